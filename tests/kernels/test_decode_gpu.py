"""The GPU (Pallas Triton) paged decode kernels against the XLA paged formulas.

Without a GPU the kernels run in interpret mode on CPU; on a GPU machine the same tests run the
compiled kernels (``interpret=None`` picks the hardware when present).  Covered: paged kernel ==
``paged_attention_xla`` / ``paged_mla_decode_xla``, split-KV == single pass, ragged lengths
(including 0, lengths that are not multiples of the key block, a full cache), several new tokens
(the causal rule), fp32 and bf16, GQA groups 1 / 4 / 8 and MQA, MLA with a head count that is not a
multiple of the head block, sliding windows (the pages before a window not read) and ALiBi,
sparse (DSA) MLA == the gather reference, quantized (int8 / fp8 e4m3) pools with per-token scales
== the XLA path on the same codes, stale (NaN) slots never reaching the result, lowering to
Triton IR, and the errors.

Tolerances: fp32 on CPU only the summation order differs (1e-5 of the output scale); on GPU
hardware fp32 dots run in TF32 (5e-3; a wrong page or partition errs by O(1)).  bf16: bf16
probabilities in ``p @ v`` and a bf16 output.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.ops.decode import paged_attention, paged_mla_decode, resolve_implementation
from jaxattn.paged_cache import PagedKVCache, PagedLatentCache
from jaxattn.testing import scrambled_paged_cache
from pallas_kernels.decode_attention import gpu as gqa_gpu
from pallas_kernels.decode_attention import paged_attention_gpu
from pallas_kernels.mla_decode import paged_mla_decode_gpu

ON_GPU = jax.default_backend() in ("gpu", "cuda")
F32_TOL = 5e-3 if ON_GPU else 1e-5  # TF32 tensor-core dots on hardware
BF16_TOL = 2e-2
LENGTHS = (37, 0, 16, 5, 64)         # ragged, empty, one block, < one block, the whole table


def tol(dtype):
  return F32_TOL if dtype == jnp.float32 else BF16_TOL


def assert_close(got, want, tolerance, name=""):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  assert np.isfinite(got).all(), f"{name}: non-finite output"
  scale = max(1.0, float(np.max(np.abs(want), initial=0.0)))
  np.testing.assert_allclose(got, want, rtol=0, atol=tolerance * scale, err_msg=name)


def _scatter(cache_pools, rng, num_pages):
  """Pools filled with NaN (a slot holding no token would poison the result) and a random page
  order, so that logical pages land anywhere in the pool."""
  order = jnp.asarray(rng.permutation(num_pages).astype(np.int32))
  return {k: jnp.full_like(v, jnp.nan) for k, v in cache_pools.items()}, order


def kv_cache(lengths, kh, h=16, hv=32, page=16, dtype=jnp.float32, max_pages=4, seed=0):
  b, s = len(lengths), max(max(lengths), 1)
  num_pages = b * max_pages + 3
  rng = np.random.default_rng(seed)
  cache = PagedKVCache.init(b, num_pages, page, kh, h, hv, max_pages_per_seq=max_pages,
                            dtype=dtype)
  pools, order = _scatter(dict(key_pool=cache.key_pool, value_pool=cache.value_pool), rng,
                          num_pages)
  cache = dataclasses.replace(cache, **pools,
                              table=dataclasses.replace(cache.table, free_pages=order))
  key = jnp.asarray(rng.standard_normal((b, s, kh, h)), dtype)
  value = jnp.asarray(rng.standard_normal((b, s, kh, hv)), dtype)
  return cache.append(key, value, np.asarray(lengths))


def latent_cache(lengths, c, r, page=16, dtype=jnp.float32, max_pages=4, seed=0, rope_align=1):
  b, s = len(lengths), max(max(lengths), 1)
  num_pages = b * max_pages + 3
  rng = np.random.default_rng(seed)
  cache = PagedLatentCache.init(b, num_pages, page, c, r, max_pages_per_seq=max_pages,
                                rope_align=rope_align, dtype=dtype)
  pools, order = _scatter(dict(c_kv_pool=cache.c_kv_pool, k_rope_pool=cache.k_rope_pool), rng,
                          num_pages)
  cache = dataclasses.replace(cache, **pools,
                              table=dataclasses.replace(cache.table, free_pages=order))
  c_kv = jnp.asarray(rng.standard_normal((b, s, c)), dtype)
  k_rope = jnp.asarray(rng.standard_normal((b, s, r)), dtype)
  return cache.append(c_kv, k_rope, num_tokens=np.asarray(lengths))


def normal(shape, dtype, seed):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


# -- GQA / MQA / MHA -----------------------------------------------------------------------------

def _gqa(q, cache, **kw):
  return paged_attention(q, cache.key_pool, cache.value_pool, cache.page_table, cache.lengths,
                         **kw)


# (N, K, T, dtype, soft cap, page, block_k): groups 1, 4, 8 and MQA; one to three new tokens; a
# page of two key blocks.
@pytest.mark.parametrize("n,kh,t,dtype,cap,page,block_k", [
    (4, 4, 1, jnp.float32, None, 16, 16),     # MHA (G = 1)
    (8, 2, 3, jnp.float32, 2.0, 32, 16),      # G = 4, three new tokens, soft-cap, 2 blocks / page
    (16, 2, 1, jnp.bfloat16, None, 16, None),  # G = 8
    (4, 1, 2, jnp.bfloat16, 1.5, 16, None),   # MQA
])
def test_gqa_matches_formula_single_and_split(n, kh, t, dtype, cap, page, block_k):
  cache = kv_cache(LENGTHS, kh, page=page, dtype=dtype, max_pages=64 // page)
  q = normal((len(LENGTHS), t, n, 16), dtype, seed=1)
  kw = dict(scale=0.4, logits_soft_cap=cap)
  ref = _gqa(q, cache, implementation="xla", **kw)
  args = (q, cache.key_pool, cache.value_pool, cache.page_table, cache.lengths)
  single = paged_attention_gpu(*args, num_splits=1, block_k=block_k, **kw)
  split = paged_attention_gpu(*args, num_splits=3, block_k=block_k, **kw)
  assert single.shape == (len(LENGTHS), t, n, 32) and single.dtype == split.dtype == dtype
  assert_close(single, ref, tol(dtype), "single pass vs formula")
  assert_close(split, single, tol(dtype), "split-KV vs single pass")
  np.testing.assert_array_equal(np.asarray(single[1], np.float32), 0.0)  # empty sequence


# Sliding windows and ALiBi: decode with a window of 20 over pages of 16 (the 64-token sequence's
# first two pages lie before it), three new tokens seeing themselves only (window 0), a bf16
# prefill of 9 tokens in programs of 16 rows; single pass and split-KV (partitions over the
# window's pages).  The pages before every window are NaN: not read.
@pytest.mark.parametrize("n,kh,t,dtype,window,alibi,block_rows,sinks", [
    (8, 2, 1, jnp.float32, 20, True, None, True),
    (4, 4, 3, jnp.float32, 0, False, None, False),
    (4, 1, 9, jnp.bfloat16, 7, True, 16, True),
])
def test_gqa_window_and_alibi(n, kh, t, dtype, window, alibi, block_rows, sinks):
  """(With attention sinks on two cases: the combine step adds them.)"""
  cache = kv_cache(LENGTHS, kh, dtype=dtype)
  q = normal((len(LENGTHS), t, n, 16), dtype, seed=2)
  slopes = jnp.asarray(np.linspace(0.05, 0.8, n), jnp.float32) if alibi else None
  kw = dict(scale=0.4, local_window_size=window, alibi_slopes=slopes)
  if sinks:
    kw["sinks"] = jnp.asarray(np.linspace(-1.0, 2.0, n), jnp.float32)
  ref = _gqa(q, cache, implementation="xla", **kw)
  table, page = np.asarray(cache.page_table), cache.key_pool.shape[1]
  dead = np.array([table[b, j] for b, length in enumerate(LENGTHS)
                   for j in range(max(length - t - window, 0) // page)])
  assert dead.size
  pools = (cache.key_pool.at[dead].set(np.nan), cache.value_pool.at[dead].set(np.nan))
  for splits in (1, 3):
    got = paged_attention_gpu(q, *pools, cache.page_table, cache.lengths, num_splits=splits,
                              block_rows=block_rows, **kw)
    assert got.dtype == dtype
    assert_close(got, ref, tol(dtype), f"splits={splits}")
    np.testing.assert_array_equal(np.asarray(got[1], np.float32), 0.0)


# A prefill through the cache: 9 new tokens x 4 query heads per KV head = 36 rows in programs of
# 16 (three row blocks, the last padded), each loading only the keys its tokens can see; the
# 5-token sequence's first 4 query rows sit before position 0.
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gqa_row_blocks_of_a_prefill(dtype):
  cache = kv_cache(LENGTHS, 2, dtype=dtype)
  q = normal((len(LENGTHS), 9, 8, 16), dtype, seed=3)
  ref = _gqa(q, cache, scale=0.4, implementation="xla")
  args = (q, cache.key_pool, cache.value_pool, cache.page_table, cache.lengths)
  for splits in (1, 3):
    got = paged_attention_gpu(*args, scale=0.4, num_splits=splits, block_rows=16)
    assert got.dtype == dtype
    assert_close(got, ref, tol(dtype), f"row blocks, {splits} partition(s)")
    np.testing.assert_array_equal(np.asarray(got[3, :4], np.float32), 0.0)
  assert gqa_gpu.gpu_block_rows(4, None) == 16 and gqa_gpu.gpu_block_rows(2048, None) == 64
  assert gqa_gpu.gpu_block_rows(36, 128) == 64


def quant_cache(lengths, kh, dtype, h=16, hv=32, page=16, max_pages=4, seed=0):
  """A quantized ``PagedKVCache`` (``dtype`` int8 or float8_e4m3fn codes, fp32 scales) whose
  float pools -- the scales, and fp8 codes -- are NaN in every slot that holds no token."""
  b, s = len(lengths), max(max(lengths), 1)
  cache = scrambled_paged_cache(PagedKVCache.init(b, b * max_pages + 3, page, kh, h, hv,
                                                  max_pages_per_seq=max_pages, dtype=dtype),
                                seed=seed)
  rng = np.random.default_rng(seed)
  key = jnp.asarray(rng.standard_normal((b, s, kh, h)), jnp.float32)
  value = jnp.asarray(rng.standard_normal((b, s, kh, hv)), jnp.float32)
  return cache.append(key, value, np.asarray(lengths))


# Quantized pools: (code dtype, N, K, T, query dtype, soft cap, window, ALiBi + sinks).  int8 and
# fp8 codes under fp32 and bf16 queries, GQA and MQA, several new tokens, a sliding window with
# ALiBi and sinks; single pass and split-KV.  The kernel reads the same codes and scales as the
# XLA path, so the tolerances are the unquantized ones.
@pytest.mark.parametrize("codes,n,kh,t,dtype,cap,window,alibi", [
    (jnp.int8, 8, 2, 1, jnp.float32, 2.0, None, False),
    (jnp.float8_e4m3fn, 8, 2, 2, jnp.float32, None, 20, True),
    (jnp.int8, 4, 1, 3, jnp.bfloat16, None, 7, True),
    (jnp.float8_e4m3fn, 16, 2, 1, jnp.bfloat16, 1.5, None, False),
])
def test_gqa_quantized_pools(codes, n, kh, t, dtype, cap, window, alibi):
  cache = quant_cache(LENGTHS, kh, codes)
  # Stale slots hold NaN scales (and NaN fp8 codes): read, they would poison the result.
  assert np.isnan(np.asarray(cache.value_scale_pool)).any()
  if codes == jnp.float8_e4m3fn:
    assert np.isnan(np.asarray(cache.key_pool, np.float32)).any()
  q = normal((len(LENGTHS), t, n, 16), dtype, seed=4)
  kw = dict(scale=0.4, logits_soft_cap=cap, local_window_size=window)
  if alibi:
    kw.update(alibi_slopes=jnp.asarray(np.linspace(0.05, 0.8, n), jnp.float32),
              sinks=jnp.asarray(np.linspace(-1.0, 2.0, n), jnp.float32))
  pools = dict(key_pool=cache.key_pool, value_pool=cache.value_pool,
               key_scale=cache.key_scale_pool, value_scale=cache.value_scale_pool)
  ref = paged_attention(q, **pools, page_table=cache.page_table, lengths=cache.lengths,
                        implementation="xla", **kw)
  if window is not None:   # the pages before every window: NaN codes and scales, not read
    table, page = np.asarray(cache.page_table), cache.key_pool.shape[1]
    dead = np.array([table[b, j] for b, length in enumerate(LENGTHS)
                     for j in range(max(length - t - window, 0) // page)])
    assert dead.size
    pools = {k: v.at[dead].set(np.nan if k.endswith("scale") or codes != jnp.int8 else 0)
             for k, v in pools.items()}
  for splits in (1, 3):
    got = paged_attention(q, **pools, page_table=cache.page_table, lengths=cache.lengths,
                          implementation="pallas_gpu", num_splits=splits, **kw)
    assert got.shape == (len(LENGTHS), t, n, 32) and got.dtype == dtype
    assert_close(got, ref, tol(dtype), f"{jnp.dtype(codes).name}, splits={splits}")
    np.testing.assert_array_equal(np.asarray(got[1], np.float32), 0.0)  # empty sequence


def test_gqa_dispatch_with_automatic_splits():
  """``implementation="pallas_gpu"`` through the op, a 3-D query, ``num_splits=None``."""
  cache = kv_cache(LENGTHS, 2)
  q = normal((len(LENGTHS), 8, 16), jnp.float32, seed=2)
  got = _gqa(q, cache, implementation="pallas_gpu")
  assert got.shape == (len(LENGTHS), 8, 32)
  assert_close(got, _gqa(q, cache, implementation="xla"), F32_TOL)


def test_auto_splits_rule(monkeypatch):
  monkeypatch.setattr(gqa_gpu, "num_sms", lambda: 132)
  assert gqa_gpu.auto_splits(8, 512, 64) == 33      # ceil(264 / 8)
  assert gqa_gpu.auto_splits(1, 512, 64) == 128     # partitions of >= 256 tokens
  assert gqa_gpu.auto_splits(1, 4, 16) == 1         # a 64-token sequence: one partition
  assert gqa_gpu.auto_splits(1000, 512, 64) == 1
  # MLA's dense rule: up to four programs per SM while partitions keep 1024 positions (32k
  # context, 16 heads in one head block): batch 32 -> 17 (was 9), batch 8 keeps 33, batch 1 128.
  assert gqa_gpu.auto_splits(32, 512, 64, long_split_tokens=1024) == 17
  assert gqa_gpu.auto_splits(32, 512, 64) == 9
  assert gqa_gpu.auto_splits(8, 512, 64, long_split_tokens=1024) == 33
  assert gqa_gpu.auto_splits(1, 512, 64, long_split_tokens=1024) == 128
  assert gqa_gpu.auto_splits(32, 8, 64, long_split_tokens=1024) == 2   # 512 tokens: 2 x 256


# -- MLA ------------------------------------------------------------------------------------------

def _mla(q, cache, **kw):
  return paged_mla_decode(*q, cache.c_kv_pool, cache.k_rope_pool, cache.page_table,
                          cache.lengths, scale=0.3, **kw)


# (N, T, C, R, dtype): 40 folded rows = 3 head blocks of 16 (the last one padded); latent sizes
# that are not powers of two (padded inside); bf16.
@pytest.mark.parametrize("n,t,c,r,dtype", [
    (20, 2, 32, 16, jnp.float32),
    (6, 1, 24, 8, jnp.float32),
    (16, 1, 32, 16, jnp.bfloat16),
    (4, 9, 32, 16, jnp.float32),               # a prefill: 36 rows, blocks of 16 skip late keys
])
def test_mla_matches_formula_single_and_split(n, t, c, r, dtype):
  cache = latent_cache(LENGTHS, c, r, dtype=dtype)
  q = (normal((len(LENGTHS), t, n, c), dtype, 1), normal((len(LENGTHS), t, n, r), dtype, 2))
  ref = _mla(q, cache, implementation="xla")
  args = (*q, cache.c_kv_pool, cache.k_rope_pool, cache.page_table, cache.lengths)
  single = paged_mla_decode_gpu(*args, scale=0.3, num_splits=1)
  split = paged_mla_decode_gpu(*args, scale=0.3, num_splits=3, block_k=16)
  assert single.shape == (len(LENGTHS), t, n, c) and single.dtype == split.dtype == dtype
  assert_close(single, ref, tol(dtype), "single pass vs formula")
  assert_close(split, single, tol(dtype), "split-KV vs single pass")
  np.testing.assert_array_equal(np.asarray(single[1], np.float32), 0.0)


def test_mla_dispatch_three_dim_queries_padded_rope_pool():
  """Through the dispatch point, with the k^R pool stored in 32 columns for R = 16 (as a TPU
  cache stores 64 in 128): the kernel reads the padded pool, the reference an unpadded one."""
  cache = latent_cache(LENGTHS, 32, 16, rope_align=32)
  assert cache.k_rope_pool.shape[2] == 32
  q = (normal((len(LENGTHS), 4, 32), jnp.float32, 3), normal((len(LENGTHS), 4, 16), jnp.float32, 4))
  got = _mla(q, cache, implementation="pallas_gpu", num_splits=2)
  assert got.shape == (len(LENGTHS), 4, 32)
  assert_close(got, _mla(q, latent_cache(LENGTHS, 32, 16), implementation="xla"), F32_TOL)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_mla_sparse_matches_gather_reference(dtype):
  """DSA mode: selected positions incl. -1, past the length, duplicates, an empty sequence;
  k = 21 (not a multiple of the gathered block); 20 heads (two head blocks); T = 2."""
  cache = latent_cache(LENGTHS, 32, 16, dtype=dtype)
  b, t, n = len(LENGTHS), 2, 20
  rng = np.random.default_rng(5)
  indices = rng.integers(-1, 70, size=(b, t, 21)).astype(np.int32)
  indices[0, 0, :3] = 7                                   # duplicates count as often as listed
  q = (normal((b, t, n, 32), dtype, 6), normal((b, t, n, 16), dtype, 7))
  indices = jnp.asarray(indices)
  ref = _mla(q, cache, implementation="xla", indices=indices)
  got = _mla(q, cache, implementation="pallas_gpu", indices=indices)
  assert got.shape == (b, t, n, 32) and got.dtype == dtype
  assert_close(got, ref, tol(dtype), "sparse vs gather reference")
  np.testing.assert_array_equal(np.asarray(got[1], np.float32), 0.0)


# -- errors ---------------------------------------------------------------------------------------

def test_errors():
  assert resolve_implementation("pallas_gpu") == "pallas_gpu"
  cache = kv_cache((3,), 1)
  q = normal((1, 1, 2, 16), jnp.float32, 0)
  args = (q, cache.key_pool, cache.value_pool, cache.page_table, cache.lengths)
  with pytest.raises(ValueError, match="num_splits"):
    paged_attention_gpu(*args, scale=1.0, num_splits=0)
  with pytest.raises(ValueError, match="num_splits"):
    _gqa(q, cache, implementation="pallas_gpu", num_splits=1.5)
  with pytest.raises(ValueError, match="block_k"):
    paged_attention_gpu(*args, scale=1.0, block_k=24)
  with pytest.raises(ValueError, match="block_k"):
    paged_attention_gpu(*args, scale=1.0, block_k=32)        # a 16-token page
  with pytest.raises(ValueError, match="block_rows"):
    paged_attention_gpu(*args, scale=1.0, block_rows=24)
  small = kv_cache((3,), 1, page=8, max_pages=2)
  with pytest.raises(ValueError, match="page size"):
    _gqa(q, small, implementation="pallas_gpu")
  lat = latent_cache((3,), 32, 16)
  ql, qr = normal((1, 1, 4, 32), jnp.float32, 0), normal((1, 1, 4, 16), jnp.float32, 1)
  largs = (ql, qr, lat.c_kv_pool, lat.k_rope_pool, lat.page_table, lat.lengths)
  with pytest.raises(ValueError, match="indices"):
    paged_mla_decode_gpu(*largs, scale=1.0, indices=jnp.zeros((1, 2), jnp.int32))
  with pytest.raises(ValueError, match="block_k"):
    paged_mla_decode_gpu(*largs, scale=1.0, indices=jnp.zeros((1, 1, 2), jnp.int32), block_k=8)
  with pytest.raises(ValueError, match="block_h"):
    paged_mla_decode_gpu(*largs, scale=1.0, block_h=8)


def test_kernels_lower_to_triton(cuda_target):
  """The kernels lower to Triton IR for CUDA at production sizes (bf16 Llama-3-8B GQA with a
  soft-cap and two new tokens, and a 256-token prefill in row blocks; DeepSeek-V3 MLA with 128 heads, 512 + 64 latents, dense and sparse
  with top-2048); compiling that IR needs a GPU."""
  b, m, page = 2, 64, 64
  pages = b * m
  table = jax.ShapeDtypeStruct((b, m), jnp.int32)
  lens = jax.ShapeDtypeStruct((b,), jnp.int32)
  bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)  # noqa: E731

  def gqa(q, k, v, t, n):
    return paged_attention(q, k, v, t, n, implementation="pallas_gpu", logits_soft_cap=30.0,
                           interpret=False)

  def mla(ql, qr, c, kr, t, n):
    return paged_mla_decode(ql, qr, c, kr, t, n, scale=0.07, implementation="pallas_gpu",
                            interpret=False)

  def sparse(ql, qr, c, kr, t, n, idx):
    return paged_mla_decode(ql, qr, c, kr, t, n, scale=0.07, indices=idx,
                            implementation="pallas_gpu", interpret=False)

  cases = [
      ("jaxattn_paged_decode_gpu", gqa,
       (bf16(b, 2, 32, 128), bf16(pages, page, 8, 128), bf16(pages, page, 8, 128), table, lens)),
      ("jaxattn_paged_decode_gpu", gqa,
       (bf16(b, 256, 32, 128), bf16(pages, page, 8, 128), bf16(pages, page, 8, 128), table,
        lens)),
      ("jaxattn_paged_mla_decode_gpu", mla,
       (bf16(b, 128, 512), bf16(b, 128, 64), bf16(pages, page, 512), bf16(pages, page, 64), table,
        lens)),
      ("jaxattn_sparse_mla_decode_gpu", sparse,
       (bf16(b, 128, 512), bf16(b, 128, 64), bf16(pages, page, 512), bf16(pages, page, 64), table,
        lens, jax.ShapeDtypeStruct((b, 2048), jnp.int32))),
  ]
  # Query and cache in different dtypes (fp32 compute over a bf16 cache, and the reverse): Triton's
  # dot refused operands of two dtypes.
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
  cases += [
      ("jaxattn_paged_decode_gpu", gqa,
       (f32(b, 1, 32, 128), bf16(pages, page, 8, 128), bf16(pages, page, 8, 128), table, lens)),
      ("jaxattn_paged_decode_gpu", gqa,
       (bf16(b, 1, 32, 128), f32(pages, page, 8, 128), f32(pages, page, 8, 128), table, lens)),
      ("jaxattn_paged_mla_decode_gpu", mla,
       (f32(b, 16, 512), f32(b, 16, 64), bf16(pages, page, 512), bf16(pages, page, 64), table,
        lens)),
      ("jaxattn_sparse_mla_decode_gpu", sparse,
       (bf16(b, 16, 512), bf16(b, 16, 64), f32(pages, page, 512), f32(pages, page, 64), table,
        lens, jax.ShapeDtypeStruct((b, 256), jnp.int32))),
  ]
  # Quantized pools (merged [P, page, K * H] codes, as a PagedKVCache stores them, with fp32
  # scales [P, 1, K * page]): int8 under a bf16 query, fp8 e4m3 under an fp32 one with a window.
  def quant(q, k, v, t, n, ks, vs):
    return paged_attention(q, k, v, t, n, implementation="pallas_gpu", key_scale=ks,
                           value_scale=vs, local_window_size=100, interpret=False)

  scales = (f32(pages, 1, 8 * page), f32(pages, 1, 8 * page))
  for q, codes in ((bf16(b, 1, 32, 128), jnp.int8), (f32(b, 2, 32, 128), jnp.float8_e4m3fn)):
    pool = jax.ShapeDtypeStruct((pages, page, 8 * 128), codes)
    cases.append(("jaxattn_paged_decode_gpu", quant, (q, pool, pool, table, lens, *scales)))
  for name, f, args in cases:
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert name in text
