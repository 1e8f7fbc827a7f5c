"""The absorbed MLA decode kernels over a paged latent cache (interpret mode, race detection)
against the XLA paged formula: dense split-KV == single pass == reference on ragged batches (incl.
an empty sequence), several new tokens, bf16; sparse (DSA) mode == the gather reference; stale
slots never reach the result; the shard_map wrapper on the simulated 8-device mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxattn import sharding
from jaxattn.ops.decode import paged_mla_decode
from jaxattn.paged_cache import PagedLatentCache
from jaxattn.testing import scrambled_paged_cache
from pallas_kernels.mla_decode import paged_mla_decode_tpu

RACES = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)
PAGE, C, R, SCALE = 4, 16, 4, 0.25


def cache_for(lengths, dtype=jnp.float32, num_pages=12, max_pages=4, seed=0, rope_align=1):
  """``lengths`` random latent rows in randomly placed pages; empty slots are NaN.  ``rope_align``:
  the ``k^R`` pool's column multiple (8: ``R = 4`` stored in 8 columns, as TPU stores 64 in 128)."""
  b, s = len(lengths), max(max(lengths), 1)
  rng = np.random.default_rng(seed)
  cache = scrambled_paged_cache(PagedLatentCache.init(
      b, num_pages, PAGE, C, R, max_pages_per_seq=max_pages, rope_align=rope_align, dtype=dtype),
      seed)
  c_kv = jnp.asarray(rng.standard_normal((b, s, C)), dtype)
  k_rope = jnp.asarray(rng.standard_normal((b, s, R)), dtype)
  return cache.append(c_kv, k_rope, num_tokens=np.asarray(lengths))


def queries(b, t, n, dtype=jnp.float32, seed=1):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.standard_normal((b, t, n, C)), dtype),
          jnp.asarray(rng.standard_normal((b, t, n, R)), dtype))


def _call(q, cache, **kw):
  return paged_mla_decode(*q, cache.c_kv_pool, cache.k_rope_pool, cache.page_table,
                          cache.lengths, scale=SCALE, **kw)


def test_dense_matches_reference_with_race_detection(race_states):
  cache = cache_for((6, 0), num_pages=6, max_pages=3)     # grid (2, 2, 2)
  q = tuple(x[:, 0] for x in queries(2, 1, 4))            # [B, N, C] / [B, N, R]
  ref = _call(q, cache, implementation="xla")
  got = _call(q, cache, implementation="pallas_tpu", num_splits=2, interpret=RACES)
  assert got.shape == (2, 4, C)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(got[1], 0.0)
  assert race_states and not any(st.races_found for st in race_states)


def test_an_empty_row_with_stale_page_ids_reads_inside_the_pool():
  """A length-0 row's unchecked table entries (stale ids, a sentinel past the pool) are clamped
  into the pool for the fetch (it was an out-of-bounds DMA); the row's output is 0."""
  cache = cache_for((6, 0), num_pages=6, max_pages=3)
  table = cache.page_table.at[1].set(cache.c_kv_pool.shape[0] + 7)
  q = tuple(x[:, 0] for x in queries(2, 1, 4))
  args = (*q, cache.c_kv_pool, cache.k_rope_pool, table, cache.lengths)
  ref = paged_mla_decode(*args, scale=SCALE, implementation="xla")
  got = paged_mla_decode(*args, scale=SCALE, implementation="pallas_tpu",
                         interpret=pltpu.InterpretParams())
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(got[1], 0.0)


@pytest.mark.parametrize("t,dtype,rope_align", [(1, jnp.bfloat16, 1), (3, jnp.float32, 8)])
def test_dense_split_kv_ragged(t, dtype, rope_align):
  lengths = (9, 0, 2, 16)
  cache = cache_for(lengths, dtype=dtype, num_pages=16, rope_align=rope_align)
  q = queries(len(lengths), t, 3, dtype=dtype)
  # The reference on an unpadded cache of the same rows (a padded k^R pool changes nothing).
  ref = _call(q, cache_for(lengths, dtype=dtype, num_pages=16), implementation="xla")
  assert cache.k_rope_pool.shape[2] == max(R, rope_align)
  single = _call(q, cache, implementation="pallas_tpu", num_splits=1, interpret=True)
  split = _call(q, cache, implementation="pallas_tpu", num_splits=4, interpret=True)
  assert single.dtype == split.dtype == dtype
  tol = dict(rtol=1e-5, atol=1e-6) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
  np.testing.assert_allclose(single.astype(np.float32), ref.astype(np.float32), **tol)
  np.testing.assert_allclose(split.astype(np.float32), single.astype(np.float32), **tol)
  assert np.isfinite(np.asarray(split.astype(np.float32))).all()
  np.testing.assert_array_equal(split[1], 0.0)


@pytest.mark.parametrize("t", [1, 5])
def test_dense_megacore_default_at_batch_one(monkeypatch, t):
  """A batch-1 call on a (pretend) megacore chip: two partitions on the leading grid axis, one
  per TensorCore, equal to the reference (decode, and a prefill in row blocks)."""
  from pallas_kernels.mla_decode import tpu as mla_tpu  # noqa: PLC0415
  monkeypatch.setattr(mla_tpu, "tensorcores", lambda: 2)
  calls = []
  real = mla_tpu.combine
  monkeypatch.setattr(mla_tpu, "combine", lambda o, l: calls.append(o.shape) or real(o, l))
  cache = cache_for((13,), num_pages=6)
  q = queries(1, t, 3)
  ref = _call(q, cache, implementation="xla")
  got = paged_mla_decode_tpu(*q, cache.c_kv_pool, cache.k_rope_pool, cache.page_table,
                             cache.lengths, scale=SCALE, block_rows=8, interpret=RACES)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
  assert calls and calls[0][:2] == (1, 2)                           # two partitions


def _indices(lengths, t, k, seed=3):
  """Distinct random positions per query among the sequence's tokens, -1 padded, with one
  out-of-range position (which must be ignored)."""
  rng = np.random.default_rng(seed)
  idx = np.full((len(lengths), t, k), -1, np.int32)
  for b, length in enumerate(lengths):
    for j in range(t):
      picks = rng.permutation(length)[:k]
      idx[b, j, :len(picks)] = picks
  idx[0, 0, 1] = lengths[0] + 2
  return jnp.asarray(idx)


def test_sparse_matches_gather_reference_with_race_detection(race_states):
  lengths = (10, 0)
  cache = cache_for(lengths)
  q = tuple(x[:, 0] for x in queries(2, 1, 4))
  idx = _indices(lengths, 1, 3)[:, 0]                     # [B, k]
  ref = _call(q, cache, indices=idx, implementation="xla")
  got = _call(q, cache, indices=idx, implementation="pallas_tpu", interpret=RACES)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(got[1], 0.0)
  assert race_states and not any(st.races_found for st in race_states)


def test_sparse_several_queries_bf16_padded_rope_pool():
  lengths = (10, 5)
  cache = cache_for(lengths, dtype=jnp.bfloat16, rope_align=8)
  q = queries(2, 2, 2, dtype=jnp.bfloat16)
  idx = _indices(lengths, 2, 6)                           # [B, T, k]
  ref = _call(q, cache_for(lengths, dtype=jnp.bfloat16), indices=idx, implementation="xla")
  got = _call(q, cache, indices=idx, implementation="pallas_tpu", interpret=True)
  np.testing.assert_allclose(got.astype(np.float32), ref.astype(np.float32), rtol=2e-2, atol=2e-2)


def test_sharded_under_mesh_equals_unsharded():
  mesh = sharding.make_mesh({"data": 2, "tensor": 4})
  lengths = (7, 12)
  cache = cache_for(lengths)
  q = queries(2, 1, 8)
  idx = _indices(lengths, 1, 3)
  for indices in (None, idx):
    ref = _call(q, cache, indices=indices, implementation="xla")
    with jax.set_mesh(mesh):
      qs = tuple(jax.device_put(x, NamedSharding(mesh, P("data", None, "tensor", None)))
                 for x in q)
      got = jax.jit(lambda q, c, i: _call(q, c, indices=i, implementation="pallas_tpu",
                                          num_splits=2, interpret=True))(qs, cache, indices)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


# A prefill through the latent cache in blocks of query rows: 7 new tokens x 3 heads = 21 rows in
# blocks of 8 (the last padded), ragged (the 2-token sequence's first 5 query rows sit before
# position 0; an empty sequence), single pass and split-KV, fp32 and bf16 with a padded k^R pool.
@pytest.mark.parametrize("dtype,rope_align", [(jnp.float32, 1), (jnp.bfloat16, 8)])
def test_dense_row_blocks_of_a_prefill(dtype, rope_align):
  lengths = (13, 0, 2, 16)
  cache = cache_for(lengths, dtype=dtype, num_pages=16, rope_align=rope_align)
  q = queries(len(lengths), 7, 3, dtype=dtype)
  ref = _call(q, cache, implementation="xla").astype(np.float32)
  tol = dict(rtol=1e-5, atol=1e-6) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
  qr = jnp.pad(q[1], ((0, 0),) * 3 + ((0, cache.k_rope_pool.shape[2] - R),))
  for splits, rows in ((1, 8), (3, 16)):
    got = paged_mla_decode_tpu(q[0], qr, cache.c_kv_pool, cache.k_rope_pool, cache.page_table,
                               cache.lengths, scale=SCALE, block_rows=rows, num_splits=splits,
                               interpret=True)
    assert got.dtype == dtype
    np.testing.assert_allclose(got.astype(np.float32), ref, **tol)
    np.testing.assert_array_equal(got[1], 0.0)
    np.testing.assert_array_equal(got[2, :5], 0.0)


def test_dense_row_blocks_race_free(race_states):
  cache = cache_for((11, 6), num_pages=8)
  q = queries(2, 5, 2)                                      # 10 rows in blocks of 8
  got = paged_mla_decode_tpu(*q, cache.c_kv_pool, cache.k_rope_pool, cache.page_table,
                             cache.lengths, scale=SCALE, block_rows=8, num_splits=2,
                             interpret=RACES)
  np.testing.assert_allclose(got, _call(q, cache, implementation="xla"), rtol=1e-5, atol=1e-6)
  assert race_states and not any(st.races_found for st in race_states)


def test_errors():
  cache = cache_for((3,))
  with pytest.raises(ValueError, match="block_rows"):
    paged_mla_decode_tpu(*queries(1, 1, 2), cache.c_kv_pool, cache.k_rope_pool, cache.page_table,
                         cache.lengths, scale=1.0, block_rows=20, interpret=True)
  with pytest.raises(ValueError, match="num_splits"):
    paged_mla_decode_tpu(*queries(1, 1, 2), cache.c_kv_pool, cache.k_rope_pool, cache.page_table,
                         cache.lengths, scale=1.0, num_splits=0, interpret=True)
