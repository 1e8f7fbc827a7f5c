"""The paged GQA/MQA/MHA decode kernel (interpret mode, race detection) against the XLA paged
formula: ragged lengths incl. zero, several new tokens, split-KV == single pass, bf16, soft-cap,
stale pages never read into the result, the DMA clamp, and the shard_map wrapper on the simulated
8-device mesh."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxattn import sharding
from jaxattn.ops.decode import paged_attention
from jaxattn.paged_cache import PagedKVCache
from jaxattn.testing import scrambled_paged_cache
from pallas_kernels.decode_attention import paged_attention_tpu
from pallas_kernels.decode_attention import tpu as decode_tpu
from pallas_kernels.decode_attention.tpu import (ROW_BUDGET, block_rows_for, page_index,
                                                 split_plan, visible_keys, window_pages,
                                                 window_start)

RACES = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)
PAGE = 4


def cache_for(lengths, kh, h=8, hv=8, dtype=jnp.float32, num_pages=12, max_pages=4, seed=0):
  """A paged cache holding ``lengths`` random tokens in randomly placed pages; every slot that
  holds no token is NaN, so reading one into the result would show."""
  b, s = len(lengths), max(max(lengths), 1)
  rng = np.random.default_rng(seed)
  cache = scrambled_paged_cache(PagedKVCache.init(b, num_pages, PAGE, kh, h, hv,
                                                  max_pages_per_seq=max_pages, dtype=dtype), seed)
  key = jnp.asarray(rng.standard_normal((b, s, kh, h)), dtype)
  value = jnp.asarray(rng.standard_normal((b, s, kh, hv)), dtype)
  return cache.append(key, value, np.asarray(lengths))


def queries(b, t, n, h=8, dtype=jnp.float32, seed=1):
  return jnp.asarray(np.random.default_rng(seed).standard_normal((b, t, n, h)), dtype)


def _call(q, cache, **kw):
  return paged_attention(q, cache.key_pool, cache.value_pool, cache.page_table, cache.lengths, **kw)


def test_matches_reference_with_race_detection(race_states):
  cache = cache_for((7, 0), kh=2, num_pages=6, max_pages=3)   # grid (2, 2, 2)
  q = queries(2, 1, 4)
  ref = _call(q, cache, implementation="xla")
  got = _call(q, cache, implementation="pallas_tpu", num_splits=2, interpret=RACES)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
  assert np.isfinite(np.asarray(got)).all()
  np.testing.assert_array_equal(got[1], 0.0)
  assert race_states and not any(st.races_found for st in race_states)


# MHA with several new tokens and a soft-cap; MQA in bf16; each single pass and split.
@pytest.mark.parametrize("n,kh,t,dtype,cap", [
    (2, 2, 3, jnp.float32, 1.5),
    (4, 1, 1, jnp.bfloat16, None),
])
def test_ragged_batches_and_split_kv(n, kh, t, dtype, cap):
  lengths = (9, 0, 4, 2, 16)
  cache = cache_for(lengths, kh, dtype=dtype, num_pages=16)
  q = queries(len(lengths), t, n, dtype=dtype)
  kw = dict(scale=0.5, logits_soft_cap=cap)
  ref = _call(q, cache, implementation="xla", **kw)
  single = _call(q, cache, implementation="pallas_tpu", num_splits=1, interpret=True, **kw)
  split = _call(q, cache, implementation="pallas_tpu", num_splits=3, interpret=True, **kw)
  assert single.dtype == split.dtype == dtype
  # fp32: same math in a different order (1e-5).  bf16: both round an fp32 result once (2^-8).
  tol = dict(rtol=1e-5, atol=1e-6) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
  np.testing.assert_allclose(single.astype(np.float32), ref.astype(np.float32), **tol)
  np.testing.assert_allclose(split.astype(np.float32), single.astype(np.float32), **tol)
  np.testing.assert_array_equal(single[1], 0.0)
  if t == 3:  # sequence 3 holds 2 tokens: its first of 3 query rows sits at position -1
    np.testing.assert_array_equal(single[3, 0], 0.0)


def test_page_index_clamps_to_the_last_valid_page():
  """Steps past a sequence's visible keys re-point at its last visible page, so no new DMA is
  issued; an empty sequence points at a real page id (0 here) rather than -1."""
  table = jnp.array([7, 3, -1, -1, -1, -1, -1, -1], jnp.int32)  # [B=2, M=4] flattened
  kw = dict(max_pages=4, page_size=4, num_pages=8)
  got = [int(page_index(5, table, 0, j, **kw)) for j in range(4)]
  assert got == [7, 3, 3, 3]
  assert [int(page_index(4, table, 0, j, **kw)) for j in range(3)] == [7] * 3
  assert int(page_index(0, table, 1, 2, **kw)) == 0
  # an empty row's unchecked entries may hold any id: the fetch stays inside the pool
  stale = jnp.array([7, 3, -1, -1, 999, 999, 999, 999], jnp.int32)
  assert int(page_index(0, stale, 1, 0, **kw)) == 7


def test_an_empty_row_with_stale_page_ids_reads_inside_the_pool():
  """A length-0 row's table entries are not checked (a freed slot keeps stale ids, a server may
  pad with a sentinel): its fetch is clamped into the pool (it was an out-of-bounds DMA) and the
  row's output is 0, as the formula's."""
  cache = cache_for((7, 0), kh=2, num_pages=6, max_pages=3)
  table = cache.page_table.at[1].set(cache.key_pool.shape[0] + 7)
  q = queries(2, 1, 4)
  args = (q, cache.key_pool, cache.value_pool, table, cache.lengths)
  ref = paged_attention(*args, implementation="xla")
  got = paged_attention(*args, implementation="pallas_tpu", interpret=pltpu.InterpretParams())
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(got[1], 0.0)


def test_visible_keys_of_a_row_block():
  """Row block i of a prefill sees keys up to its last token's position (causal), never more
  than the length, never fewer than 0.  Here 10 tokens held, the last T = 6 are queries with
  G = 2 rows each (12 rows), blocks of 4 rows = 2 tokens: positions 4-5, 6-7, 8-9."""
  assert [int(visible_keys(10, i, 4, 6, 2)) for i in range(3)] == [6, 8, 10]
  assert int(visible_keys(10, 3, 4, 6, 2)) == 10            # a padded block: capped at the length
  assert int(visible_keys(3, 0, 4, 6, 2)) == 0              # rows before position 0 see nothing
  assert int(visible_keys(10, 0, 12, 6, 2)) == 10           # one block: all keys (decode)


def test_block_rows_default():
  """A decode step is one block; rows that do not fit ``ROW_BUDGET`` are cut into blocks of a
  multiple of 16 rows that do (a 512-token prefill of 32 heads of 128 in bf16: 64 tokens)."""
  per_row = 2 * 128 * 2 + 3 * 128 * 4
  assert block_rows_for(32, per_row * 8, None) == 32
  rows = block_rows_for(512 * 4, per_row * 8, None)
  assert rows % 16 == 0 and rows * per_row * 8 <= ROW_BUDGET and rows == 256
  assert block_rows_for(10, per_row, 64) == 10 and block_rows_for(100, per_row, 64) == 64


# A prefill through the cache in blocks of query rows: 7 new tokens x 2 query heads per KV head
# = 14 rows in blocks of 8 (the last one padded), ragged (the 6-token sequence's first query
# row sits at position -1; an empty sequence), single pass and split-KV, fp32 and bf16.
@pytest.mark.parametrize("dtype,cap", [(jnp.float32, None), (jnp.bfloat16, 2.0)])
def test_row_blocks_of_a_prefill(dtype, cap):
  lengths = (13, 0, 6, 16)
  cache = cache_for(lengths, kh=2, dtype=dtype, num_pages=16)
  q = queries(len(lengths), 7, 4, dtype=dtype)
  kw = dict(scale=0.4, logits_soft_cap=cap)
  ref = _call(q, cache, implementation="xla", **kw).astype(np.float32)
  tol = dict(rtol=1e-5, atol=1e-6) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
  for splits, rows in ((1, 8), (3, 8), (2, 16)):
    got = paged_attention_tpu(q, cache.key_pool, cache.value_pool, cache.page_table,
                              cache.lengths, block_rows=rows, num_splits=splits, interpret=True,
                              **kw)
    assert got.dtype == dtype
    np.testing.assert_allclose(got.astype(np.float32), ref, **tol)
    np.testing.assert_array_equal(got[1], 0.0)
    np.testing.assert_array_equal(got[2, 0], 0.0)


def test_row_blocks_race_free(race_states):
  cache = cache_for((11, 5), kh=1, num_pages=8)            # MQA: 5 tokens x 4 heads = 20 rows
  q = queries(2, 5, 4)
  got = paged_attention_tpu(q, cache.key_pool, cache.value_pool, cache.page_table, cache.lengths,
                            scale=0.5, block_rows=8, num_splits=2, interpret=RACES)
  np.testing.assert_allclose(got, _call(q, cache, scale=0.5, implementation="xla"), rtol=1e-5,
                             atol=1e-6)
  assert race_states and not any(st.races_found for st in race_states)


def poisoned_before_window(cache, lengths, t, window):
  """``cache`` with every pool page that lies wholly before all its sequence's windows (the first
  query, at ``length - T``, sees keys from ``length - T - window`` on) set to NaN: a kernel that
  read one into its result would show it."""
  table = np.asarray(cache.page_table)
  dead = [int(table[b, j]) for b, n in enumerate(lengths)
          for j in range(max(n - t - window, 0) // PAGE)]
  assert dead, "the case must put a page out of every window"
  return dataclasses.replace(cache, key_pool=cache.key_pool.at[np.array(dead)].set(np.nan),
                             value_pool=cache.value_pool.at[np.array(dead)].set(np.nan))


# Sliding windows, ALiBi and attention sinks through the kernel: decode (GQA, window 5, ALiBi,
# sinks), three new tokens with a window of 0 (each query sees itself only), a bf16 MQA prefill
# of 6 tokens in blocks of 8 rows (with sinks); single pass and split-KV (the sinks enter the
# combine step either way).  The pages before the windows hold NaN: not read.
@pytest.mark.parametrize("n,kh,t,dtype,window,alibi,block_rows,sinks", [
    (4, 2, 1, jnp.float32, 5, True, None, True),
    (2, 2, 3, jnp.float32, 0, False, None, False),
    (4, 1, 6, jnp.bfloat16, 3, True, 8, True),
])
def test_window_and_alibi(n, kh, t, dtype, window, alibi, block_rows, sinks):
  lengths = (9, 0, 4, 2, 16, 15)
  cache = cache_for(lengths, kh, dtype=dtype, num_pages=20)
  q = queries(len(lengths), t, n, dtype=dtype)
  slopes = jnp.asarray(np.linspace(0.1, 1.0, n), jnp.float32) if alibi else None
  kw = dict(scale=0.5, local_window_size=window, alibi_slopes=slopes)
  if sinks:
    kw["sinks"] = jnp.asarray(np.linspace(-1.0, 2.0, n), jnp.float32)
  ref = _call(q, cache, implementation="xla", **kw).astype(np.float32)
  poisoned = poisoned_before_window(cache, lengths, t, window)
  tol = dict(rtol=1e-5, atol=1e-6) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
  for splits in (1, 2):
    got = paged_attention_tpu(q, poisoned.key_pool, poisoned.value_pool, poisoned.page_table,
                              poisoned.lengths, num_splits=splits, block_rows=block_rows,
                              interpret=True, **kw)
    assert got.dtype == dtype
    np.testing.assert_allclose(got.astype(np.float32), ref, **tol, err_msg=f"splits={splits}")
    np.testing.assert_array_equal(got[1], 0.0)
  unwindowed = _call(q, cache, implementation="xla", scale=0.5, alibi_slopes=slopes,
                     sinks=kw.get("sinks"))
  assert float(jnp.max(jnp.abs(unwindowed.astype(np.float32) - ref))) > 0.1
  if sinks:   # and the sinks matter
    without = _call(q, cache, implementation="xla", **{**kw, "sinks": None})
    assert float(jnp.max(jnp.abs(without.astype(np.float32) - ref))) > 0.1


def test_window_with_race_detection(race_states):
  cache = cache_for((13, 6), kh=2, num_pages=8)
  q = queries(2, 2, 4)
  kw = dict(scale=0.5, local_window_size=4, alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625]))
  got = paged_attention_tpu(q, cache.key_pool, cache.value_pool, cache.page_table, cache.lengths,
                            num_splits=2, interpret=RACES, **kw)
  np.testing.assert_allclose(got, _call(q, cache, implementation="xla", **kw), rtol=1e-5,
                             atol=1e-6)
  assert race_states and not any(st.races_found for st in race_states)


@pytest.mark.parametrize("page,rows,groups,t,window", [
    (4, 2, 2, 1, 5), (4, 8, 2, 6, 3), (4, 8, 3, 7, 0), (16, 16, 4, 9, 40), (8, 64, 8, 8, 1)])
def test_window_pages_cover_every_row_block(page, rows, groups, t, window):
  """The page axis of a windowed call spans ``window_pages`` pages from ``window_start``'s page:
  for every length and row block, the pages holding keys some row of the block sees all lie in
  that span (a brute-force count over the rows' positions)."""
  span = window_pages(10 ** 6, page, rows, groups, window)
  assert window_pages(3, page, rows, groups, window) == min(3, span)
  assert window_pages(7, page, rows, groups, None) == 7
  most = 0
  for length in range(t, t + 3 * page + 1):
    for block in range(-(-t * groups // rows)):
      base = int(window_start(length, block, rows, t, groups, window)) // page
      pos = [length - t + r // groups for r in range(block * rows, (block + 1) * rows)
             if r < t * groups]
      seen = {k // page for p in pos for k in range(max(p - window, 0), p + 1)}
      assert seen and min(seen) >= base and max(seen) < base + span, (length, block)
      most = max(most, max(seen) - min(seen) + 1)
  assert span - most <= 1              # (one page of slack at most: lengths are not exhaustive)


def test_sharded_under_mesh_equals_unsharded():
  mesh = sharding.make_mesh({"data": 2, "tensor": 4})
  b, n, kh = 2, 8, 4
  cache = cache_for((6, 11), kh)
  q = queries(b, 1, n)
  ref = _call(q, cache, implementation="xla")
  with jax.set_mesh(mesh):
    qs = jax.device_put(q, NamedSharding(mesh, P("data", None, "tensor", None)))
    got = jax.jit(lambda q, c: _call(q, c, implementation="pallas_tpu", num_splits=2,
                                     interpret=True))(qs, cache)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
  # An explicit mesh argument, MQA (one KV head cannot split over "tensor": heads stay whole).
  cache1 = cache_for((6, 11), 1)
  got1 = paged_attention_tpu(q, cache1.key_pool, cache1.value_pool, cache1.page_table,
                             cache1.lengths, scale=8 ** -0.5, interpret=True, mesh=mesh)
  np.testing.assert_allclose(got1, _call(q, cache1, implementation="xla"), rtol=1e-5, atol=1e-6)
  # ALiBi slopes and sinks (NumPy: they must travel split with the heads, not closed over
  # whole) and a window, under the context mesh.
  kw = dict(alibi_slopes=np.linspace(0.1, 0.8, n), local_window_size=3,
            sinks=np.linspace(-1.0, 1.5, n).astype(np.float32))
  with jax.set_mesh(mesh):
    got2 = jax.jit(lambda q, c: _call(q, c, implementation="pallas_tpu", interpret=True,
                                      **kw))(qs, cache)
  np.testing.assert_allclose(got2, _call(q, cache, implementation="xla", **kw), rtol=1e-5,
                             atol=1e-6)


def test_split_pools_and_a_wider_value():
  """The kernel reads a ``PagedKVCache``'s merged rows ``[P, page, K * H]``, KV head g as the lane
  slice ``[g*H, (g+1)*H)``, and 4-D pools ``[P, page, K, H]`` in ``[page, K, H]`` blocks.  Both,
  with a value head (16) wider than the key head (8), equal the reference."""
  lengths = (5, 10)
  cache = cache_for(lengths, kh=2, hv=16)
  assert cache.key_pool.shape[2:] == (16,) and cache.value_pool.shape[2:] == (32,)
  q = queries(2, 2, 4)
  ref = _call(q, cache, implementation="xla")
  merged = _call(q, cache, implementation="pallas_tpu", interpret=True)
  split = paged_attention(q, cache.key_pool.reshape(cache.key_pool.shape[:2] + (2, 8)),
                          cache.value_pool.reshape(cache.value_pool.shape[:2] + (2, 16)),
                          cache.page_table, cache.lengths, implementation="pallas_tpu",
                          interpret=True)
  assert merged.shape == (2, 2, 4, 16)
  np.testing.assert_allclose(merged, ref, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(split, ref, rtol=1e-5, atol=1e-6)


def test_split_plan_feeds_both_cores_of_a_megacore_chip():
  """Megacore (TPU v4, v5p) splits the leading parallel grid axis between its two TensorCores.
  At batch 1 the split axis leads and ``num_splits=None`` makes one partition per core; with
  more sequences (or one core) the default stays one partition, batch leading."""
  assert decode_tpu.tensorcores() == 1                              # not a TPU here
  assert split_plan(None, 1, 8, cores=2) == (2, True)
  assert split_plan(None, 3, 8, cores=2) == (1, False)
  assert split_plan(None, 1, 1, cores=2) == (1, True)               # never more than the pages
  assert split_plan(5, 2, 3, cores=2) == (3, False) and split_plan(4, 1, 8) == (4, True)
  assert split_plan(None, 1, 8, cores=1) == (1, True)


@pytest.mark.parametrize("t", [1, 6])
def test_megacore_default_at_batch_one(monkeypatch, t):
  """On a (pretend) megacore chip a batch-1 call splits the cache in two partitions on the
  leading grid axis: the same result as the reference, for a decode step and a prefill in row
  blocks; the kernel reads its program ids in that order (a swap would read sequence 1)."""
  monkeypatch.setattr(decode_tpu, "tensorcores", lambda: 2)
  cache = cache_for((14,), kh=2, num_pages=6)
  q = queries(1, t, 4)
  ref = _call(q, cache, scale=0.5, implementation="xla")
  got = paged_attention_tpu(q, cache.key_pool, cache.value_pool, cache.page_table, cache.lengths,
                            scale=0.5, block_rows=8, interpret=RACES)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
  calls = []
  real = decode_tpu.combine
  monkeypatch.setattr(decode_tpu, "combine",
                      lambda o, l, sink: calls.append(o.shape) or real(o, l, sink))
  paged_attention_tpu(q, cache.key_pool, cache.value_pool, cache.page_table, cache.lengths,
                      scale=0.25, interpret=True)
  assert calls and calls[0][:2] == (1, 2)                           # two partitions


def test_errors():
  cache = cache_for((3,), 1)
  with pytest.raises(ValueError, match="num_splits"):
    paged_attention_tpu(queries(1, 1, 2), cache.key_pool, cache.value_pool, cache.page_table,
                        cache.lengths, scale=1.0, num_splits=0, interpret=True)
  with pytest.raises(ValueError, match="num_splits"):
    _call(queries(1, 1, 2), cache, implementation="pallas_tpu", num_splits=1.5)
  for bad in (0, 12, 8.0, True):
    with pytest.raises(ValueError, match="block_rows"):
      paged_attention_tpu(queries(1, 1, 2), cache.key_pool, cache.value_pool, cache.page_table,
                          cache.lengths, scale=1.0, block_rows=bad, interpret=True)
