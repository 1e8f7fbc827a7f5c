"""The GPU (Pallas Triton) decode kernels under a device mesh, and split-KV in sparse (DSA) MLA.

Interpret mode on the 8 simulated CPU devices (``tests/conftest.py``).  Covered: under a
``data=2, tensor=4`` mesh (set by ``jax.set_mesh`` or passed as ``mesh=``) the sharded kernels equal
the unsharded XLA formulas for GQA, MQA and MLA (dense and sparse); each device's ``pallas_call``
sees its local shard (batch over ``data``, GQA KV heads / MLA query heads over ``tensor``), with the
automatic split count chosen from the local sizes; a batch (or KV head count) that does not divide
stays whole, as in the TPU wrappers; quantized (int8) pools with their scales split over the
KV heads with the pools; sparse MLA split-KV == single pass == the gather reference,
with empty partitions, the automatic rule, and lowering to Triton IR (also under a mesh).

An interpreted kernel can be partitioned by XLA like any JAX code, so equal values alone would not
show that the ``shard_map`` wrapper ran: the tests also read the local shapes off the jaxpr.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxattn import sharding
from jaxattn.ops.decode import paged_attention, paged_mla_decode
from jaxattn.paged_cache import PagedKVCache, PagedLatentCache
from jaxattn.testing import pallas_calls, scrambled_paged_cache
from pallas_kernels.decode_attention import gpu as gqa_gpu
from pallas_kernels.decode_attention import paged_attention_gpu
from pallas_kernels.mla_decode import paged_mla_decode_gpu

ON_GPU = jax.default_backend() in ("gpu", "cuda")
F32_TOL = 5e-3 if ON_GPU else 1e-5  # TF32 tensor-core dots on hardware
BF16_TOL = 2e-2
PAGE = 16


@pytest.fixture(scope="module")
def mesh():
  return sharding.make_mesh({"data": 2, "tensor": 4})


def assert_close(got, want, tolerance, name=""):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  assert np.isfinite(got).all(), f"{name}: non-finite output"
  scale = max(1.0, float(np.max(np.abs(want), initial=0.0)))
  np.testing.assert_allclose(got, want, rtol=0, atol=tolerance * scale, err_msg=name)


def _nan_pools(cache, names, num_pages, seed):
  """Every slot that holds no token is NaN (reading one would poison the result) and pages are
  handed out in a random order, so logical pages land anywhere in the pool."""
  order = jnp.asarray(np.random.default_rng(seed).permutation(num_pages).astype(np.int32))
  pools = {k: jnp.full_like(getattr(cache, k), jnp.nan) for k in names}
  return dataclasses.replace(cache, **pools,
                             table=dataclasses.replace(cache.table, free_pages=order))


def kv_cache(lengths, kh, h=16, hv=16, dtype=jnp.float32, max_pages=4, seed=0):
  b, s = len(lengths), max(max(lengths), 1)
  num_pages = b * max_pages + 2
  cache = PagedKVCache.init(b, num_pages, PAGE, kh, h, hv, max_pages_per_seq=max_pages,
                            dtype=dtype)
  cache = _nan_pools(cache, ("key_pool", "value_pool"), num_pages, seed)
  rng = np.random.default_rng(seed + 1)
  key = jnp.asarray(rng.standard_normal((b, s, kh, h)), dtype)
  value = jnp.asarray(rng.standard_normal((b, s, kh, hv)), dtype)
  return cache.append(key, value, np.asarray(lengths))


def latent_cache(lengths, c=32, r=16, dtype=jnp.float32, max_pages=4, seed=0):
  b, s = len(lengths), max(max(lengths), 1)
  num_pages = b * max_pages + 2
  cache = PagedLatentCache.init(b, num_pages, PAGE, c, r, max_pages_per_seq=max_pages,
                                dtype=dtype)
  cache = _nan_pools(cache, ("c_kv_pool", "k_rope_pool"), num_pages, seed)
  rng = np.random.default_rng(seed + 1)
  c_kv = jnp.asarray(rng.standard_normal((b, s, c)), dtype)
  k_rope = jnp.asarray(rng.standard_normal((b, s, r)), dtype)
  return cache.append(c_kv, k_rope, num_tokens=np.asarray(lengths))


def normal(shape, dtype, seed):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def selections(lengths, t, k, seed):
  """``[B, T, k]`` positions: random in ``[-1, length + 3)`` (so -1, out-of-range and duplicate
  picks all occur), the first query of sequence 0 picking only in its first 16 slots (the other
  partitions of that row see no valid key: lse = -inf must merge to nothing)."""
  rng = np.random.default_rng(seed)
  idx = np.stack([rng.integers(-1, max(n, 1) + 3, size=(t, k)) for n in lengths]).astype(np.int32)
  idx[0, 0, 16:] = -1
  return jnp.asarray(idx)


def _gqa(q, cache, **kw):
  return paged_attention(q, cache.key_pool, cache.value_pool, cache.page_table, cache.lengths,
                         **kw)


def _mla(q, cache, **kw):
  return paged_mla_decode(*q, cache.c_kv_pool, cache.k_rope_pool, cache.page_table,
                          cache.lengths, scale=0.3, **kw)


# -- GQA under a mesh ----------------------------------------------------------------------------

def test_gqa_sharded_by_context_mesh_equals_formula(mesh):
  """Through ``paged_attention(implementation="pallas_gpu")`` under ``jax.set_mesh``: batch 4 over
  data=2, KV heads 4 over tensor=4 (one whole GQA group of 2 per device), two new tokens, a
  soft-cap, split-KV 2 (the automatic count under a mesh:
  ``test_automatic_splits_use_local_sizes``)."""
  lengths = (37, 0, 16, 64)
  cache = kv_cache(lengths, kh=4)
  q = normal((4, 2, 8, 16), jnp.float32, 1)
  kw = dict(scale=0.4, logits_soft_cap=2.0)
  ref = _gqa(q, cache, implementation="xla", **kw)
  with jax.set_mesh(mesh):
    qs = jax.device_put(q, NamedSharding(mesh, P("data", None, "tensor", None)))
    f = jax.jit(lambda q, c: _gqa(q, c, implementation="pallas_gpu", num_splits=2, **kw))
    got = f(qs, cache)
    assert got.sharding.spec == P("data", None, "tensor", None)
    (grid, shapes), = pallas_calls(f, qs, cache)
  assert_close(got, ref, F32_TOL)
  assert grid == (2, 1, 2)                                  # local batch 2, one KV head, 2 splits
  assert shapes[2][:2] == (2, 1) and shapes[3][2] == 1      # q tile [B, K, rows, H]; pool's K
  np.testing.assert_array_equal(np.asarray(got[1]), 0.0)
  # ALiBi slopes split with the heads (each device reads its own) and a window of 20 over pages
  # of 16: the page axis spans 3 pages of the 4, split in 2 partitions.
  kw.update(alibi_slopes=np.linspace(0.05, 0.8, 8), local_window_size=20)
  with jax.set_mesh(mesh):
    f = jax.jit(lambda q, c: _gqa(q, c, implementation="pallas_gpu", num_splits=2, **kw))
    got = f(qs, cache)
    (grid, _), = pallas_calls(f, qs, cache)
  assert_close(got, _gqa(q, cache, implementation="xla", **kw), F32_TOL, "ALiBi, window")
  assert grid == (2, 1, 2)


def test_gqa_explicit_mesh_mqa_and_ragged_batch(mesh):
  """``mesh=`` passed directly; MQA (one KV head cannot split over tensor=4: heads stay whole)
  and a batch of 3 that data=2 does not divide (stays whole, as ``paged_attention_tpu`` does):
  nothing is split, each device runs the whole call, the result is still the formula."""
  lengths = (5, 48, 21)
  cache = kv_cache(lengths, kh=1, dtype=jnp.bfloat16)
  q = normal((3, 1, 4, 16), jnp.bfloat16, 2)
  ref = _gqa(q, cache, implementation="xla")
  args = (q, cache.key_pool, cache.value_pool, cache.page_table, cache.lengths)
  f = lambda *a: paged_attention_gpu(*a, scale=0.25, num_splits=2, mesh=mesh)  # noqa: E731
  assert_close(f(*args), ref, BF16_TOL, "MQA, batch 3")
  (grid, _), = pallas_calls(f, *args)
  assert grid == (3, 1, 2)
  # Batch 4 divides: split over data while the single KV head stays whole.
  cache4 = kv_cache(lengths + (9,), kh=1, dtype=jnp.bfloat16)
  q4 = normal((4, 1, 4, 16), jnp.bfloat16, 3)
  args4 = (q4, cache4.key_pool, cache4.value_pool, cache4.page_table, cache4.lengths)
  assert_close(f(*args4), _gqa(q4, cache4, implementation="xla"), BF16_TOL, "MQA, batch 4")
  (grid, _), = pallas_calls(f, *args4)
  assert grid == (2, 1, 2)


def test_gqa_sharded_quantized_pools(mesh):
  """int8 codes with fp32 scales ``[P, 1, K * page]`` (NaN in every slot that holds no token) under
  ``mesh=``: batch 4 over data=2, KV heads 4 over tensor=4, the scales split over the KV heads
  with the pools (each device reads its own head's); without ALiBi and sinks (their empty
  stand-ins travel through ``shard_map``) and with both."""
  lengths, kh = (37, 0, 16, 64), 4
  cache = scrambled_paged_cache(PagedKVCache.init(4, 18, PAGE, kh, 16, 16, max_pages_per_seq=4,
                                                  dtype=jnp.int8), seed=3)
  rng = np.random.default_rng(4)
  cache = cache.append(jnp.asarray(rng.standard_normal((4, 64, kh, 16)), jnp.float32),
                       jnp.asarray(rng.standard_normal((4, 64, kh, 16)), jnp.float32),
                       np.asarray(lengths))
  q = normal((4, 1, 8, 16), jnp.float32, 5)
  args = (q, cache.key_pool, cache.value_pool, cache.page_table, cache.lengths)
  scales = dict(key_scale=cache.key_scale_pool, value_scale=cache.value_scale_pool)
  heads = dict(alibi_slopes=jnp.asarray(np.linspace(0.05, 0.8, 8), jnp.float32),
               sinks=jnp.asarray(np.linspace(-1.0, 2.0, 8), jnp.float32))
  for kw in ({}, heads):
    ref = paged_attention(*args, scale=0.25, implementation="xla", **scales, **kw)
    f = lambda *a, kw=kw: paged_attention_gpu(*a, scale=0.25, num_splits=2, mesh=mesh,  # noqa: E731
                                              **scales, **kw)
    got = f(*args)
    assert_close(got, ref, F32_TOL, f"int8, ALiBi and sinks: {bool(kw)}")
    np.testing.assert_array_equal(np.asarray(got[1]), 0.0)
    (grid, shapes), = pallas_calls(f, *args)
    assert grid == (2, 1, 2)                                # local batch 2, one KV head
    assert shapes[-2] == shapes[-1] == (18, 1, PAGE)        # local scales, as [P, K, page]


def test_automatic_splits_use_local_sizes(mesh, monkeypatch):
  """``num_splits=None`` under a mesh fills one device with its own programs (read off the jaxpr,
  nothing runs): 8 sequences x 4 KV heads over a 4,096-position table (cap 4096 / 256 = 16).
  Unsharded: 32 programs -> ceil(2 * 132 / 32) = 9 partitions; on the mesh each device holds 4
  sequences x 1 KV head = 4 programs -> ceil(264 / 4) = 66, capped at 16."""
  monkeypatch.setattr(gqa_gpu, "num_sms", lambda: 132)
  q = jax.ShapeDtypeStruct((8, 1, 8, 16), jnp.float32)
  pool = jax.ShapeDtypeStruct((520, PAGE, 4, 16), jnp.float32)
  table = jax.ShapeDtypeStruct((8, 4096 // PAGE), jnp.int32)
  lens = jax.ShapeDtypeStruct((8,), jnp.int32)
  f = lambda *a, m=None: paged_attention_gpu(*a, scale=0.25, mesh=m)  # noqa: E731
  (grid, _), = pallas_calls(f, q, pool, pool, table, lens)
  assert grid == (8, 4, 9)
  (grid, _), = pallas_calls(lambda *a: f(*a, m=mesh), q, pool, pool, table, lens)
  assert grid == (4, 1, 16)


# -- MLA under a mesh ----------------------------------------------------------------------------

@pytest.mark.parametrize("sparse", [False, True])
def test_mla_sharded_equals_formula(mesh, sparse):
  """Batch 2 over data=2, 8 query heads over tensor=4 (2 per device, each holding the whole latent
  pool), two new tokens; dense with 2 partitions, sparse with 3 (k = 40: 3 blocks of 16)."""
  lengths = (37, 60)
  cache = latent_cache(lengths)
  q = (normal((2, 2, 8, 32), jnp.float32, 4), normal((2, 2, 8, 16), jnp.float32, 5))
  indices = selections(lengths, 2, 40, seed=6) if sparse else None
  ref = _mla(q, cache, implementation="xla", indices=indices)
  splits = 3 if sparse else 2
  with jax.set_mesh(mesh):
    qs = tuple(jax.device_put(x, NamedSharding(mesh, P("data", None, "tensor", None))) for x in q)
    f = jax.jit(lambda q, c, i: _mla(q, c, implementation="pallas_gpu", indices=i,
                                     num_splits=splits))
    got = f(qs, cache, indices)
    (grid, shapes), = pallas_calls(f, qs, cache, indices)
  assert got.shape == (2, 2, 8, 32)
  assert_close(got, ref, F32_TOL, "sparse" if sparse else "dense")
  # Local: 1 sequence, 2 heads of 2 tokens (one 16-row head block); the whole latent pool.
  assert grid == ((1, 2, 3, 1) if sparse else (1, 2, 1))
  pool_shape = cache.c_kv_pool.shape
  assert (pool_shape[0] * pool_shape[1], 32) in shapes if sparse else pool_shape in shapes


def test_mla_sparse_explicit_mesh_ragged_batch_bf16(mesh):
  """Batch 3 (data=2 does not divide: batch stays whole), 40 heads over tensor=4 (10 per device:
  one 16-row head block, where all 40 would need 3), bf16, automatic splits (k = 24: one
  partition), through ``paged_mla_decode_gpu(mesh=...)``."""
  lengths = (0, 33, 64)
  cache = latent_cache(lengths, dtype=jnp.bfloat16)
  q = (normal((3, 1, 40, 32), jnp.bfloat16, 7), normal((3, 1, 40, 16), jnp.bfloat16, 8))
  indices = selections(lengths, 1, 24, seed=9)
  ref = _mla(q, cache, implementation="xla", indices=indices)
  args = (*q, cache.c_kv_pool, cache.k_rope_pool, cache.page_table, cache.lengths)
  f = lambda *a: paged_mla_decode_gpu(*a[:-1], scale=0.3, indices=a[-1], mesh=mesh)  # noqa: E731
  got = f(*args, indices)
  assert got.dtype == jnp.bfloat16
  assert_close(got, ref, BF16_TOL)
  np.testing.assert_array_equal(np.asarray(got[0], np.float32), 0.0)
  (grid, _), = pallas_calls(f, *args, indices)
  assert grid == (3, 1, 1)                                   # all 3 sequences, 10 local heads


# -- sparse MLA split-KV (unsharded) -------------------------------------------------------------

@pytest.mark.parametrize("dtype,split_counts", [(jnp.float32, (2, 5)), (jnp.bfloat16, (3,))])
def test_mla_sparse_split_equals_single_and_gather_reference(dtype, split_counts):
  """k = 70 selected slots (5 blocks of 16, the last padded), 20 heads (two head blocks), T = 2,
  ragged lengths incl. 0; partitions of 3, 2 and 1 block (2, 3 and 5 partitions), the first
  query of sequence 0 seeing keys in its first partition only."""
  lengths = (37, 0, 64)
  cache = latent_cache(lengths, dtype=dtype)
  q = (normal((3, 2, 20, 32), dtype, 10), normal((3, 2, 20, 16), dtype, 11))
  indices = selections(lengths, 2, 70, seed=12)
  ref = _mla(q, cache, implementation="xla", indices=indices)
  args = (*q, cache.c_kv_pool, cache.k_rope_pool, cache.page_table, cache.lengths)
  single = paged_mla_decode_gpu(*args, scale=0.3, indices=indices, num_splits=1)
  assert single.dtype == dtype and single.shape == (3, 2, 20, 32)
  assert_close(single, ref, F32_TOL if dtype == jnp.float32 else BF16_TOL, "single vs reference")
  for splits in split_counts:
    got = paged_mla_decode_gpu(*args, scale=0.3, indices=indices, num_splits=splits)
    assert got.dtype == dtype
    assert_close(got, single, F32_TOL if dtype == jnp.float32 else BF16_TOL, f"{splits} splits")
  np.testing.assert_array_equal(np.asarray(got[1], np.float32), 0.0)


def test_mla_sparse_split_grids_and_automatic_rule(monkeypatch):
  """Split counts (read off the jaxpr, nothing runs): partitions are whole blocks, so 5 blocks in
  3 partitions of 2 blocks; 10 partitions ask for more than the 5 blocks -> 5; the automatic rule
  is the dense one with the k slots as the length: k = 2048, 128 heads (8 head blocks), batch 2
  -> ceil(264 / 16) = 17, capped at 2048 / 256 = 8; batch 64 -> 1 (the single-pass kernel)."""
  monkeypatch.setattr(gqa_gpu, "num_sms", lambda: 132)
  sds = jax.ShapeDtypeStruct

  def grid_of(b, n, k, num_splits, c=32, r=16):
    args = (sds((b, 1, n, c), jnp.float32), sds((b, 1, n, r), jnp.float32),
            sds((b * 4, PAGE, c), jnp.float32), sds((b * 4, PAGE, r), jnp.float32),
            sds((b, 4), jnp.int32), sds((b,), jnp.int32), sds((b, 1, k), jnp.int32))
    f = lambda *a: paged_mla_decode_gpu(*a[:-1], scale=0.3, indices=a[-1],  # noqa: E731
                                        num_splits=num_splits)
    (grid, _), = pallas_calls(f, *args)
    return grid

  assert grid_of(1, 4, 70, 3) == (1, 1, 3, 1)
  assert grid_of(1, 4, 70, 10) == (1, 1, 5, 1)
  assert grid_of(1, 4, 70, 1) == (1, 1, 1)
  assert grid_of(2, 128, 2048, None) == (2, 1, 8, 8)
  assert grid_of(64, 128, 2048, None) == (64, 1, 8)


def test_errors():
  lengths = (3,)
  cache = latent_cache(lengths)
  ql, qr = normal((1, 1, 4, 32), jnp.float32, 0), normal((1, 1, 4, 16), jnp.float32, 1)
  args = (ql, qr, cache.c_kv_pool, cache.k_rope_pool, cache.page_table, cache.lengths)
  idx = jnp.zeros((1, 1, 2), jnp.int32)
  for bad in (0, 1.5, True):
    with pytest.raises(ValueError, match="num_splits"):
      paged_mla_decode_gpu(*args, scale=1.0, indices=idx, num_splits=bad)
  with pytest.raises(ValueError, match="num_splits"):
    _mla((ql, qr), cache, implementation="pallas_gpu", indices=idx, num_splits=0)


# -- lowering to Triton IR -----------------------------------------------------------------------

def test_new_variants_lower_to_triton(mesh, cuda_target):
  """The sparse split-KV kernel lowers to Triton IR at DeepSeek-V3.2 sizes (128 heads, 512 + 64
  latents, top-2048, bf16), and the single-pass one when ``num_splits=1``; under the mesh, GQA and
  sparse MLA lower with per-device shapes inside the shard_map (compiling needs a GPU)."""
  b, m, page = 4, 64, 64
  pages = b * m
  bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)  # noqa: E731
  table = jax.ShapeDtypeStruct((b, m), jnp.int32)
  lens = jax.ShapeDtypeStruct((b,), jnp.int32)
  idx = jax.ShapeDtypeStruct((b, 2048), jnp.int32)
  mla_args = (bf16(b, 128, 512), bf16(b, 128, 64), bf16(pages, page, 512), bf16(pages, page, 64),
              table, lens, idx)

  def sparse(splits):
    return lambda ql, qr, c, kr, t, n, i: paged_mla_decode(
        ql, qr, c, kr, t, n, scale=0.07, indices=i, num_splits=splits,
        implementation="pallas_gpu", interpret=False)

  def lower(f, *args):
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

  names = lambda text: set(re.findall(r"jaxattn_sparse_mla_decode_gpu\w*", text))  # noqa: E731
  assert names(lower(sparse(4), *mla_args)) == {"jaxattn_sparse_mla_decode_gpu_split"}
  assert names(lower(sparse(1), *mla_args)) == {"jaxattn_sparse_mla_decode_gpu"}

  gqa_args = (bf16(b, 1, 32, 128), bf16(pages, page, 8, 128), bf16(pages, page, 8, 128), table,
              lens)
  def gqa(q, k, v, t, n):
    return paged_attention(q, k, v, t, n, implementation="pallas_gpu", interpret=False)

  with jax.set_mesh(mesh):
    text = lower(gqa, *gqa_args)
    assert "jaxattn_paged_decode_gpu" in text
    assert "tensor<2x1x8x128xbf16>" in text          # local queries: 2 sequences, 8 heads
    text = lower(sparse(None), *mla_args)
    assert "jaxattn_sparse_mla_decode_gpu" in text
    assert "tensor<2x1x32x512xbf16>" in text         # local latent queries: 2 sequences, 32 heads
