"""MLA's quantized paged latent cache (``PagedLatentCache(dtype=int8 | float8_e4m3fn)``): the
append / gather round trip within the quantization step; ``paged_mla_decode`` on the codes equal
to the same op on the dequantized float cache (XLA, dense and sparse); the dense TPU kernel
(interpreted, race detection on) equal to XLA on the same codes, NaN-scrambled pools, ragged
lengths incl. 0, split-KV, under a mesh; the GPU (Triton) kernels, dense and sparse (interpreted),
equal to XLA on the same codes likewise, under a mesh, and lowering to Triton IR for CUDA; the
MLA module's paged decode with an int8 cache close to the float cache, at less than 0.6x the
bytes of a bf16 cache; DSA's sparse decode on an FP8 latent cache; the errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxattn import paged_cache, sharding
from jaxattn.nn.dsa import DSA
from jaxattn.nn.mla import MLA
from jaxattn.ops.decode import paged_mla_decode
from jaxattn.paged_cache import PagedLatentCache
from jaxattn.testing import (pallas_calls, prefill_then_decode, random_module,
                             scrambled_paged_cache)
from pallas_kernels.mla_decode import paged_mla_decode_gpu, paged_mla_decode_tpu

PAGE, C, R, SCALE = 4, 16, 4, 0.25
LENGTHS = (9, 0, 2, 16)                       # ragged, one empty sequence, one full table
QUANT = (jnp.int8, jnp.float8_e4m3fn)


def rows(lengths=LENGTHS, seed=0):
  """Random latent rows (a spread of magnitudes per token, as RMS-normed latents times their
  learned scales have) and rotated keys ``[B, S, C]``, ``[B, S, R]``."""
  rng = np.random.default_rng(seed)
  b, s = len(lengths), max(lengths)
  c_kv = rng.standard_normal((b, s, C)) * rng.uniform(0.1, 4.0, (b, s, 1))
  return (jnp.asarray(c_kv, jnp.float32),
          jnp.asarray(rng.standard_normal((b, s, R)), jnp.float32))


def cache_for(dtype, lengths=LENGTHS, seed=0, page=PAGE, max_pages=4, **kw):
  """``lengths`` rows appended to a NaN-scrambled cache (stale slots hold NaN: scales, fp8 codes
  and the k^R pool) whose pages land scattered over the pool."""
  cache = scrambled_paged_cache(PagedLatentCache.init(
      len(lengths), 16, page, C, R, max_pages_per_seq=max_pages, dtype=dtype, **kw), seed)
  return cache.append(*rows(lengths, seed), num_tokens=np.asarray(lengths))


def dequantized(cache):
  """The same cache as a float one: its pool holds ``codes * scale`` (NaN in stale slots)."""
  scales = jnp.swapaxes(cache.c_kv_scale_pool, 1, 2)                  # [P, page, 1]
  return dataclasses.replace(cache, c_kv_pool=cache.c_kv_pool.astype(jnp.float32) * scales,
                             c_kv_scale_pool=None)


def queries(t, n=3, dtype=jnp.float32, seed=1):
  rng = np.random.default_rng(seed)
  b = len(LENGTHS)
  return (jnp.asarray(rng.standard_normal((b, t, n, C)), dtype),
          jnp.asarray(rng.standard_normal((b, t, n, R)), dtype))


def decode(q, cache, **kw):
  return paged_mla_decode(*q, cache.c_kv_pool, cache.k_rope_pool, cache.page_table,
                          cache.lengths, scale=SCALE, c_kv_scale=cache.c_kv_scale_pool, **kw)


@pytest.mark.parametrize("dtype", QUANT)
def test_append_gather_round_trip(dtype):
  cache = cache_for(dtype)
  assert cache.quantized and cache.c_kv_pool.dtype == dtype
  assert cache.c_kv_scale_pool.shape == (16, 1, PAGE)
  assert cache.k_rope_pool.dtype == jnp.float32                       # rope_dtype default
  c_kv, k_rope = rows()
  got_c, got_r = cache.gather()
  assert got_c.dtype == jnp.float32
  for b, n in enumerate(LENGTHS):
    x, err = np.asarray(c_kv[b, :n]), np.abs(np.asarray(got_c[b, :n] - c_kv[b, :n]))
    scale = np.abs(x).max(-1, keepdims=True) / (127.0 if dtype == jnp.int8 else 448.0)
    if dtype == jnp.int8:      # round to nearest on a grid of step `scale`
      assert (err <= scale / 2 * (1 + 1e-5)).all()
    else:                      # e4m3: 3 mantissa bits (half-ulp 2^-4 relative), subnormals 2^-9
      assert (err <= np.abs(x) * 2.0 ** -4 + scale * 2.0 ** -10 + 1e-7).all()
    np.testing.assert_array_equal(got_r[b, :n], k_rope[b, :n])       # k^R stored as it is
    np.testing.assert_array_equal(got_c[b, n:], 0.0)
  # nbytes: one byte per latent entry, a fp32 scale per token, k^R in its own float dtype
  small = PagedLatentCache.init(2, 16, PAGE, C, R, dtype=dtype, rope_dtype=jnp.bfloat16,
                                rope_align=1)
  assert small.k_rope_pool.dtype == jnp.bfloat16
  assert small.nbytes == 16 * PAGE * (C + 2 * R + 4)
  assert not PagedLatentCache.init(2, 16, PAGE, C, R).quantized


@pytest.mark.parametrize("dtype", QUANT)
def test_xla_on_codes_equals_xla_on_dequantized_cache(dtype):
  """Dense (several new tokens, a ragged chunk) and sparse (DSA indices) mode: the XLA path on
  the codes and their scales equals the XLA path on the float cache holding ``codes * scale``."""
  cache = cache_for(dtype)
  ref_cache = dequantized(cache)
  q = queries(3)
  tol = dict(rtol=1e-6, atol=1e-6)
  for kw in (dict(), dict(num_tokens=jnp.array([3, 0, 1, 2], jnp.int32))):
    got = decode(q, cache, implementation="xla", **kw)
    ref = decode(q, ref_cache, implementation="xla", **kw)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(got, ref, **tol)
  rng = np.random.default_rng(3)
  idx = np.full((len(LENGTHS), 3, 5), -1, np.int32)
  for b, n in enumerate(LENGTHS):
    for t in range(3):
      picks = rng.permutation(n)[:5]
      idx[b, t, :len(picks)] = picks
  idx[0, 0, 1] = LENGTHS[0] + 2                                        # out of range: ignored
  got = decode(q, cache, indices=jnp.asarray(idx), implementation="xla")
  ref = decode(q, ref_cache, indices=jnp.asarray(idx), implementation="xla")
  assert np.isfinite(np.asarray(got)).all()
  np.testing.assert_allclose(got, ref, **tol)
  np.testing.assert_array_equal(got[1], 0.0)


@pytest.mark.parametrize("q_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("dtype", QUANT)
def test_tpu_kernel_equals_xla_on_the_codes(dtype, q_dtype):
  """The dense kernel (scales fetched with each page, folded into the logits and the
  probabilities) == the XLA path on the same codes: NaN-scrambled pools, ragged lengths incl. 0,
  three new tokens, single pass and split-KV.  bf16 queries: both paths compute in fp32 and
  round the output to bf16, so they differ by at most about one bf16 ulp."""
  cache = cache_for(dtype)
  q = queries(3, dtype=q_dtype)
  ref = decode(q, cache, implementation="xla").astype(np.float32)
  tol = dict(rtol=1e-5, atol=1e-5) if q_dtype == jnp.float32 else dict(rtol=1e-2, atol=1e-2)
  for splits in (1, 2):
    got = decode(q, cache, implementation="pallas_tpu", num_splits=splits, interpret=True)
    assert got.dtype == q_dtype
    got = got.astype(np.float32)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(got, ref, **tol)
    np.testing.assert_array_equal(got[1], 0.0)                         # length 0
    np.testing.assert_array_equal(got[2, :1], 0.0)                     # position -1


@pytest.mark.parametrize("dtype,q_dtype", [(jnp.float8_e4m3fn, jnp.float32),
                                           (jnp.int8, jnp.bfloat16)])
def test_tpu_kernel_race_free_and_ragged_chunk(dtype, q_dtype, race_states):
  """Race detection on, one decode token per sequence (3-D queries), then a ragged chunk
  (``num_tokens``) with a padded k^R pool."""
  cache = cache_for(dtype)
  q = tuple(x[:, 0] for x in queries(1, n=4, dtype=q_dtype))
  tol = dict(rtol=1e-5, atol=1e-5) if q_dtype == jnp.float32 else dict(rtol=1e-2, atol=1e-2)
  got = decode(q, cache, implementation="pallas_tpu", num_splits=2,
               interpret=pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2))
  ref = decode(q, cache, implementation="xla")
  np.testing.assert_allclose(got.astype(np.float32), ref.astype(np.float32), **tol)
  assert race_states and not any(st.races_found for st in race_states)
  padded = cache_for(dtype, rope_align=8)
  assert padded.k_rope_pool.shape[2] == 8
  q = queries(2, dtype=q_dtype)
  n = jnp.array([2, 0, 1, 2], jnp.int32)
  got = decode(q, padded, implementation="pallas_tpu", num_tokens=n, interpret=True)
  ref = decode(q, cache, implementation="xla", num_tokens=n)
  np.testing.assert_allclose(got.astype(np.float32), ref.astype(np.float32), **tol)


def _pallas_input_shapes(f, *args):
  """The input shapes of every ``pallas_call`` in ``f``'s jaxpr (per device inside shard_map)."""
  return [shapes for _, shapes in pallas_calls(f, *args)]


def test_tpu_kernel_sharded_under_mesh():
  """The shard_map wrapper splits queries over batch and heads and hands every device the whole
  latent pool and its scales."""
  mesh = sharding.make_mesh({"data": 2, "tensor": 4})
  cache = cache_for(jnp.int8)
  q = queries(1, n=8)
  ref = decode(q, cache, implementation="xla")
  with jax.set_mesh(mesh):
    qs = tuple(jax.device_put(x, NamedSharding(mesh, P("data", None, "tensor", None)))
               for x in q)
    got = jax.jit(lambda q, c: decode(q, c, implementation="pallas_tpu", num_splits=2,
                                      interpret=True))(qs, cache)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


# -- the GPU (Triton) kernels, interpreted -------------------------------------------------------

GPU_PAGE = 32                     # two 16-row key blocks per page (scales read at offsets 0, 16)
GPU_LENGTHS = (37, 0, 2, 20)      # two pages, empty, position -1 at T = 3, a partial page
GPU_TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-5), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def gpu_cache(dtype, seed=0):
  return cache_for(dtype, GPU_LENGTHS, seed, page=GPU_PAGE, max_pages=2)


def sparse_indices(t, k, seed=3):
  """``[B, t, k]`` selections: -1, positions past the length, duplicates, an empty sequence."""
  rng = np.random.default_rng(seed)
  idx = rng.integers(-1, max(GPU_LENGTHS) + 4, size=(len(GPU_LENGTHS), t, k)).astype(np.int32)
  idx[0, 0, :3] = 7                                   # duplicates count as often as listed
  return jnp.asarray(idx)


def assert_matches(got, ref, q_dtype, name=""):
  assert got.dtype == q_dtype, name
  got = np.asarray(got, np.float32)
  assert np.isfinite(got).all(), name
  np.testing.assert_allclose(got, np.asarray(ref, np.float32), err_msg=name, **GPU_TOL[q_dtype])
  np.testing.assert_array_equal(got[1], 0.0)                         # length 0


@pytest.mark.parametrize("q_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("dtype", QUANT)
def test_gpu_kernel_equals_xla_on_the_codes(dtype, q_dtype):
  """The dense Triton kernel (each key block's scales loaded beside its codes, folded into the
  content logits and the probabilities) == the XLA path on the same codes: NaN scales (and fp8
  codes, and k^R) in every stale slot, ragged lengths incl. 0, three new tokens; a single pass
  through the dispatch (one 32-row block per page) and split-KV called directly with 16-row
  blocks.  bf16 queries: the kernel rounds the probabilities to bf16 for ``p @ codes``."""
  cache = gpu_cache(dtype)
  assert np.isnan(np.asarray(cache.c_kv_scale_pool)).any()
  q = queries(3, dtype=q_dtype)
  ref = decode(q, cache, implementation="xla")
  single = decode(q, cache, implementation="pallas_gpu", num_splits=1, interpret=True)
  split = paged_mla_decode_gpu(*q, cache.c_kv_pool, cache.k_rope_pool, cache.page_table,
                               cache.lengths, scale=SCALE, c_kv_scale=cache.c_kv_scale_pool,
                               num_splits=2, block_k=16, interpret=True)
  for name, got in (("single pass", single), ("split-KV", split)):
    assert_matches(got, ref, q_dtype, name)
    np.testing.assert_array_equal(np.asarray(got[2, :1], np.float32), 0.0)  # position -1


@pytest.mark.parametrize("dtype,q_dtype", [(jnp.int8, jnp.bfloat16),
                                           (jnp.float8_e4m3fn, jnp.float32)])
def test_gpu_sparse_kernel_equals_xla_on_the_codes(dtype, q_dtype):
  """DSA mode: the selected rows' scales gathered by the same flat row offsets as their codes
  (unselected, out-of-range or stale slots zeroed); k = 21 selections = two gathered blocks of
  16, a single pass and split-KV over them."""
  cache = gpu_cache(dtype, seed=2)
  q = queries(2, dtype=q_dtype, seed=4)
  idx = sparse_indices(2, 21)
  ref = decode(q, cache, indices=idx, implementation="xla")
  for splits in (1, 2):
    got = decode(q, cache, indices=idx, implementation="pallas_gpu", num_splits=splits,
                 interpret=True)
    assert_matches(got, ref, q_dtype, f"splits={splits}")


def test_gpu_kernel_sharded_under_mesh():
  """Under a ``data=2, tensor=4`` mesh: batch over data, query heads over tensor, and every
  device's kernel reads the whole latent pool and its whole scale pool (read off the jaxpr)."""
  mesh = sharding.make_mesh({"data": 2, "tensor": 4})
  cache = gpu_cache(jnp.int8)
  q = queries(1, n=8)
  ref = decode(q, cache, implementation="xla")
  f = jax.jit(lambda q, c: decode(q, c, implementation="pallas_gpu", num_splits=2,
                                  interpret=True))
  with jax.set_mesh(mesh):
    qs = tuple(jax.device_put(x, NamedSharding(mesh, P("data", None, "tensor", None)))
               for x in q)
    got = f(qs, cache)
    (shapes,) = _pallas_input_shapes(f, qs, cache)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(got[1], 0.0)
  assert (2, 16, C) in shapes                               # local: 2 sequences, 2 heads padded
  assert shapes[-1] == (16, GPU_PAGE)                       # the whole scale pool, as [P, page]


def test_gpu_kernels_lower_to_triton(cuda_target):
  """Both quantized modes lower to Triton IR for CUDA at DeepSeek-V3's sizes (128 heads, 512
  code bytes + 64 bf16 k^R per token, a top-2048 selection): int8 codes under bf16 queries, fp8
  e4m3 under fp32 ones (codes widened to fp32); compiling that IR needs a GPU."""
  b, m, page = 2, 64, 64
  pages = b * m
  spec = jax.ShapeDtypeStruct
  table, lens = spec((b, m), jnp.int32), spec((b,), jnp.int32)

  def dense(ql, qr, c, kr, t, n, cs):
    return paged_mla_decode(ql, qr, c, kr, t, n, scale=0.07, implementation="pallas_gpu",
                            interpret=False, c_kv_scale=cs)

  def sparse(ql, qr, c, kr, t, n, cs, idx):
    return paged_mla_decode(ql, qr, c, kr, t, n, scale=0.07, indices=idx,
                            implementation="pallas_gpu", interpret=False, c_kv_scale=cs)

  for q_dtype, codes in ((jnp.bfloat16, jnp.int8), (jnp.float32, jnp.float8_e4m3fn)):
    args = (spec((b, 128, 512), q_dtype), spec((b, 128, 64), q_dtype),
            spec((pages, page, 512), codes), spec((pages, page, 64), jnp.bfloat16), table, lens,
            spec((pages, 1, page), jnp.float32))
    for name, f, extra in (("jaxattn_paged_mla_decode_gpu", dense, ()),
                           ("jaxattn_sparse_mla_decode_gpu", sparse,
                            (spec((b, 2048), jnp.int32),))):
      text = jax.jit(f).trace(*args, *extra).lower(lowering_platforms=("cuda",)).as_text()
      assert name in text


def test_errors():
  cache = cache_for(jnp.int8)
  flt = dequantized(cache)
  q = queries(1)
  base = (*q, cache.c_kv_pool, cache.k_rope_pool, cache.page_table, cache.lengths)
  with pytest.raises(ValueError, match="codes given with their `c_kv_scale`"):
    paged_mla_decode(*base, scale=SCALE)                              # codes without scales
  with pytest.raises(ValueError, match="`c_kv_scale` must be given only with quantized codes"):
    paged_mla_decode(*q, flt.c_kv_pool, flt.k_rope_pool, flt.page_table, flt.lengths,
                     scale=SCALE, c_kv_scale=cache.c_kv_scale_pool)    # a float pool with scales
  for bad in (cache.c_kv_scale_pool[:, :, :2], cache.c_kv_scale_pool.astype(jnp.bfloat16),
              jnp.swapaxes(cache.c_kv_scale_pool, 1, 2)):
    with pytest.raises(ValueError, match=r"`c_kv_scale` must be float32 \[P, 1, page\]"):
      paged_mla_decode(*base, scale=SCALE, c_kv_scale=bad)
  idx = jnp.zeros((len(LENGTHS), 1, 2), jnp.int32)
  # The GPU kernels take the codes now: the dense one refuses a 4-token page as it refuses a
  # float cache's (a 16-row key block may not straddle pages); the TPU sparse one takes no scales.
  with pytest.raises(ValueError, match="page size .* must be a multiple of `block_k`"):
    decode(q, cache, implementation="pallas_gpu", interpret=True)
  with pytest.raises(ValueError, match="'pallas_tpu' has no sparse"):
    decode(q, cache, implementation="pallas_tpu", indices=idx, interpret=True)
  with pytest.raises(ValueError, match="sparse .* takes no `c_kv_scale`"):
    paged_mla_decode_tpu(*base, scale=SCALE, indices=idx, c_kv_scale=cache.c_kv_scale_pool,
                         interpret=True)
  with pytest.raises(ValueError, match="`dtype` must be a float dtype, or int8"):
    PagedLatentCache.init(1, 2, PAGE, C, R, dtype=jnp.int32)
  with pytest.raises(ValueError, match="`rope_dtype` must be a float dtype"):
    PagedLatentCache.init(1, 2, PAGE, C, R, dtype=jnp.int8, rope_dtype=jnp.int8)
  mla = nnx.eval_shape(lambda: MLA(32, 2, kv_lora_rank=16, qk_nope_head_dim=8,
                                   qk_rope_head_dim=4, v_head_dim=8, rngs=nnx.Rngs(0)))
  for dt in QUANT:  # a contiguous LatentCache quantizes too (tests/kernels/test_latent_cache_quant)
    assert mla.init_cache(2, 8, dtype=dt).quantized
  with pytest.raises(ValueError, match=r"LatentCache.init: `dtype` must be a float dtype, or int8 / float8_e4m3fn"):
    mla.init_cache(2, 8, dtype=jnp.int32)


# -- the modules ---------------------------------------------------------------------------------

D = 32
MLA_DIMS = dict(kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)


@nnx.jit(static_argnames="implementation")
def _step(m, cache, xt, implementation=None):
  return m(xt, cache=cache, implementation=implementation)


def _x(t, b=2, seed=1):
  return jnp.asarray(np.random.default_rng(seed).standard_normal((b, t, D)), jnp.float32)


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def _paged_decode(module, x, dtype, prefill: int):
  """``module`` over ``x``: ``prefill`` tokens, then one at a time, through a paged cache of
  ``dtype`` (2 sequences, pages of 2)."""
  cache = module.init_paged_cache(2, num_pages=8, page_size=2, max_pages_per_seq=4, dtype=dtype)
  return prefill_then_decode(_step, module, cache, x, prefill)


def test_mla_module_int8_paged_cache_close_to_float_cache():
  """Prefill 4 tokens, decode 3, with an int8 latent cache and with a fp32 one.  Per-token
  absmax INT8 rounds each latent entry by at most ``amax / 254``; the RMS-normed latents' amax is
  ~2-3x their RMS at C = 32, so the rounding error's RMS is about ``amax / 254 / sqrt(3)``
  ~ 0.5% of the latents' (uniform rounding), and it enters the logits and the output linearly:
  a relative error ~1%, bounded here by 3e-2 (measured: 7e-3).  The kernel path on the
  same int8 cache equals the XLA path."""
  module = random_module(lambda: MLA(D, 4, mode="absorbed", rngs=nnx.Rngs(0), **MLA_DIMS))
  x = _x(7)
  ref, _ = _paged_decode(module, x, jnp.float32, 4)
  got, cache = _paged_decode(module, x, jnp.int8, 4)
  assert cache.quantized and cache.c_kv_pool.dtype == jnp.int8
  assert cache.k_rope_pool.dtype == jnp.float32                       # the compute dtype
  assert np.isfinite(np.asarray(got)).all()
  assert 0 < _rel(got, ref) < 3e-2
  y_xla, _ = _step(module, cache, x[:, :1], implementation="xla")
  y_tpu, _ = _step(module, cache, x[:, :1], implementation="pallas_tpu")  # interpreted here
  np.testing.assert_allclose(y_tpu, y_xla, rtol=2e-5, atol=2e-5)


def test_mla_int8_cache_bytes(monkeypatch):
  """DeepSeek-V3's latent (C = 512, R = 64) with a bf16 module: an int8 paged cache holds 512
  code bytes + 64 bf16 k^R (128 bytes) + a 4-byte scale per token, 644 / 1152 = 0.56 of the bf16
  cache.  (k^R unpadded: on TPU both caches pad it to 128 columns, 0.60.)"""
  monkeypatch.setattr(paged_cache, "default_rope_align", lambda: 1)
  mla = nnx.eval_shape(lambda: MLA(64, 2, kv_lora_rank=512, qk_nope_head_dim=128,
                                   qk_rope_head_dim=64, v_head_dim=128, dtype=jnp.bfloat16,
                                   rngs=nnx.Rngs(0)))
  quant = mla.init_paged_cache(2, 8, 16, dtype=jnp.int8)
  bf16 = mla.init_paged_cache(2, 8, 16)
  assert quant.k_rope_pool.dtype == bf16.c_kv_pool.dtype == jnp.bfloat16
  assert quant.nbytes == 8 * 16 * (512 + 128 + 4)
  assert quant.nbytes < 0.6 * bf16.nbytes


def test_dsa_sparse_decode_on_an_fp8_latent_cache():
  """A DSA layer decodes sparsely (the XLA path, sparse mode's default) from a paged cache with
  FP8 latents: the indexer's selection does not read the latents, so the result is the float
  cache's up to the latents' rounding (e4m3: at most 2^-4 relative per entry, ~2% RMS; measured
  at the output: 2e-2, bounded by 1e-1); the contiguous cache takes a quantized dtype too."""
  kw = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
            q_lora_rank=24)
  module = random_module(lambda: DSA(D, 4, index_num_heads=3, index_head_dim=16,
                                     index_rope_dim=4, index_topk=3, index_quant="int8",
                                     attention_mode="sparse", rngs=nnx.Rngs(0), **kw))
  x = _x(5, seed=2)
  ref, _ = _paged_decode(module, x, jnp.float32, 3)
  got, cache = _paged_decode(module, x, jnp.float8_e4m3fn, 3)
  assert cache.quantized and cache.k_rope_pool.dtype == jnp.float32
  assert np.isfinite(np.asarray(got)).all()
  assert 0 < _rel(got, ref) < 1e-1
  assert module.init_cache(2, 8, dtype=jnp.float8_e4m3fn).quantized   # contiguous too
