"""Paged caches: append/gather round trips against a plain per-sequence list, the allocator's
invariants (no page owned twice, freed pages reused, counts), jit-compatible decode appends,
indexer keys, errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.paged_cache import (PagedKVCache, PagedLatentCache, PageTable, default_rope_align,
                                 gather_pages)


def _owned(table: PageTable) -> list[list[int]]:
  """Pool pages each sequence owns (its first ceil(length / page) table entries)."""
  pt, lens = np.asarray(table.page_table), np.asarray(table.lengths)
  return [list(pt[b, :-(-lens[b] // table.page_size)]) for b in range(len(lens))]


def _check_invariants(table: PageTable):
  owned = _owned(table)
  flat = [p for seq in owned for p in seq]
  assert all(p >= 0 for p in flat), "a held token has no page"
  assert len(flat) == len(set(flat)), f"a page is owned twice: {owned}"
  free = list(np.asarray(table.free_pages)[:int(table.num_free)])
  assert not set(free) & set(flat), "a free page is also owned"
  assert len(free) + len(flat) == table.num_pages, "pages leaked"
  # Table entries past the owned prefix are unallocated.
  pt = np.asarray(table.page_table)
  for b, seq in enumerate(owned):
    assert (pt[b, len(seq):] == -1).all()


def test_append_gather_round_trip_ragged_against_lists():
  b, ps, kh, h, hv = 3, 4, 2, 3, 5
  cache = PagedKVCache.init(b, 12, ps, kh, h, hv, max_pages_per_seq=5)
  rng = np.random.default_rng(0)
  ref_k = [[] for _ in range(b)]
  ref_v = [[] for _ in range(b)]
  # Ragged prefill, then single-token steps, then a multi-token chunk crossing page boundaries.
  for t, counts in ((6, [6, 0, 3]), (1, None), (1, None), (6, [5, 2, 4])):
    k = rng.standard_normal((b, t, kh, h)).astype(np.float32)
    v = rng.standard_normal((b, t, kh, hv)).astype(np.float32)
    cache = cache.append(jnp.asarray(k), jnp.asarray(v),
                         None if counts is None else jnp.asarray(counts))
    for i in range(b):
      n = t if counts is None else counts[i]
      ref_k[i] += list(k[i, :n])
      ref_v[i] += list(v[i, :n])
    _check_invariants(cache.table)
  lens = np.asarray(cache.lengths)
  np.testing.assert_array_equal(lens, [len(x) for x in ref_k])
  key, value = cache.gather()
  assert key.shape == (b, 5 * ps, kh, h) and value.shape == (b, 5 * ps, kh, hv)
  # Stored with a token's KV heads side by side: row [k_0 | k_1 | ...] of the pool.
  assert cache.key_pool.shape[2:] == (kh * h,) and cache.value_pool.shape[2:] == (kh * hv,)
  assert (cache.num_kv_heads, cache.head_dim, cache.v_head_dim) == (kh, h, hv)
  first = cache.key_pool[cache.page_table[0, 0], 0]                  # sequence 0, token 0
  np.testing.assert_array_equal(first.reshape(kh, h), ref_k[0][0])
  for i in range(b):
    np.testing.assert_array_equal(key[i, :lens[i]], np.stack(ref_k[i]))
    np.testing.assert_array_equal(value[i, :lens[i]], np.stack(ref_v[i]))
    np.testing.assert_array_equal(key[i, lens[i]:], 0.0)  # nothing leaks past the length
  assert int(cache.table.num_free) == 12 - sum(-(-n // ps) for n in lens)


def test_decode_append_under_jit_equals_eager_and_pages_needed():
  cache = PagedKVCache.init(2, 8, 2, 1, 4)
  x = jnp.arange(2 * 3 * 4, dtype=jnp.float32).reshape(2, 3, 1, 4)
  cache = cache.append(x, x, jnp.array([2, 1]))
  step = jnp.ones((2, 1, 1, 4))
  assert int(cache.table.pages_needed(1)) == 1      # lengths 2 and 1 (pages of 2): only row 0
  assert int(cache.table.pages_needed(3)) == 3      # 2 -> 5: 2 pages; 1 -> 4: 1 page
  eager = cache.append(step, 2 * step)
  jitted = jax.jit(lambda c, k, v: c.append(k, v))(cache, step, 2 * step)
  for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted)):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(eager.lengths, [3, 2])
  assert int(cache.table.num_free) - int(eager.table.num_free) == 1
  # at most max_pages per sequence: a full sequence needs no more pages (it reported one more)
  full = PagedKVCache.init(2, 8, 2, 1, 4, max_pages_per_seq=2)
  full = full.append(jnp.ones((2, 4, 1, 4)), jnp.ones((2, 4, 1, 4)), jnp.array([4, 3]))
  assert int(full.table.pages_needed(2)) == 0


def test_free_returns_pages_and_they_are_reused():
  cache = PagedKVCache.init(3, 8, 2, 1, 2)
  x = jnp.ones((3, 4, 1, 2))
  cache = cache.append(x, x, jnp.array([4, 3, 1]))   # 2 + 2 + 1 = 5 pages
  assert int(cache.table.num_free) == 3
  never_used = set(np.asarray(cache.table.free_pages)[:3])
  cache = cache.free(jnp.array([True, False, True]))
  _check_invariants(cache.table)
  np.testing.assert_array_equal(cache.lengths, [0, 3, 0])
  assert int(cache.table.num_free) == 6
  # jit-compatible; the next allocation needs all 6 free pages, so the freed ones are reused.
  cache = jax.jit(lambda c, k: c.append(k, k))(cache, 2 * x)
  _check_invariants(cache.table)
  np.testing.assert_array_equal(cache.lengths, [4, 7, 4])
  assert int(cache.table.num_free) == 0
  assert (set(_owned(cache.table)[0]) | set(_owned(cache.table)[2])) - never_used
  key, _ = cache.gather()
  np.testing.assert_array_equal(key[1, :7, 0, 0], [1, 1, 1, 2, 2, 2, 2])
  np.testing.assert_array_equal(key[0, :4, 0, 0], 2.0)


def test_a_table_holding_pages_past_its_length_writes_into_them():
  """Pages a table already holds past a sequence's length (another cache's table, shared: the
  serving engine's MTP block) are written in place; only pages past the last held one pop."""
  table, _, _ = PageTable.init(2, num_pages=8, page_size=2).reserve(4)     # pages 0-1 | 2-3
  held = np.asarray(table.page_table)
  short = dataclasses.replace(table, lengths=jnp.array([1, 4], jnp.int32))
  grown, page, off = short.reserve(3, jnp.array([3, 1], jnp.int32))
  assert int(grown.num_free) == int(table.num_free) - 1        # row 1's position 4: a new page
  np.testing.assert_array_equal(np.asarray(grown.page_table)[0], held[0])
  np.testing.assert_array_equal(np.asarray(page)[0], [held[0, 0], held[0, 1], held[0, 1]])
  np.testing.assert_array_equal(np.asarray(off)[0], [1, 0, 1])
  assert np.asarray(grown.lengths).tolist() == [4, 5]
  assert int(np.asarray(grown.page_table)[1, 2]) not in held.reshape(-1)


def test_out_of_pages_under_jit_keeps_a_prefix():
  # Eager calls raise (below); under jit the tokens that found no page are dropped.
  cache = PagedKVCache.init(2, 3, 2, 1, 1)
  x = jnp.arange(2 * 4, dtype=jnp.float32).reshape(2, 4, 1, 1)
  cache = jax.jit(lambda c, k: c.append(k, k))(cache, x)    # needs 4 pages, has 3
  np.testing.assert_array_equal(cache.lengths, [4, 2])
  assert int(cache.table.num_free) == 0
  _check_invariants(cache.table)
  key, _ = cache.gather()
  np.testing.assert_array_equal(key[1, :2, 0, 0], [4, 5])


def test_latent_cache_with_indexer_keys():
  cache = PagedLatentCache.init(2, 4, 3, 5, 2, index_head_dim=4, index_dtype=jnp.int8,
                                index_num_scales=2)
  c_kv = jnp.arange(2 * 4 * 5, dtype=jnp.float32).reshape(2, 4, 5)
  k_rope = -jnp.arange(2 * 4 * 2, dtype=jnp.float32).reshape(2, 4, 2)
  keys = (jnp.arange(2 * 4 * 4) % 100).astype(jnp.int8).reshape(2, 4, 4)
  scales = jnp.full((2, 4, 2), 0.5)
  cache = cache.append(c_kv, k_rope, keys, scales, num_tokens=jnp.array([4, 2]))
  got_c, got_r = cache.gather()
  got_keys, got_scales = cache.gather_index_keys()
  np.testing.assert_array_equal(got_c[0, :4], c_kv[0])
  np.testing.assert_array_equal(got_r[1, :2], k_rope[1, :2])
  np.testing.assert_array_equal(got_c[1, 2:], 0.0)
  assert got_keys.dtype == jnp.int8
  np.testing.assert_array_equal(got_keys[0, :4], keys[0])
  np.testing.assert_array_equal(got_scales[1, :2], 0.5)
  assert cache.nbytes == 4 * 3 * (5 * 4 + 2 * 4 + 4 * 1 + 2 * 4)
  plain = PagedLatentCache.init(1, 2, 2, 5, 2)
  with pytest.raises(ValueError, match="indexer"):
    plain.gather_index_keys()
  with pytest.raises(ValueError, match="index_keys"):
    plain.append(c_kv[:1], k_rope[:1], keys[:1], scales[:1])
  with pytest.raises(ValueError, match="index_keys"):
    cache.append(c_kv, k_rope)
  with pytest.raises(ValueError, match="index_keys"):
    cache.append(c_kv, k_rope, keys.astype(jnp.float32), scales)


def test_latent_cache_pads_the_rotated_key_on_tpu(monkeypatch):
  """On TPU the k^R pool is stored in whole 128-lane rows (zero columns past R); elsewhere
  unpadded.  The padding is invisible through the cache's interface."""
  assert PagedLatentCache.init(1, 2, 2, 8, 64).k_rope_pool.shape == (2, 2, 64)   # CPU: exact
  with monkeypatch.context() as m:
    m.setattr(jax, "default_backend", lambda: "tpu")
    assert default_rope_align() == 128
    assert PagedLatentCache.init(1, 2, 2, 8, 64).k_rope_pool.shape == (2, 2, 128)
    assert PagedLatentCache.init(1, 2, 2, 8, 130).k_rope_pool.shape == (2, 2, 256)
  padded = PagedLatentCache.init(2, 4, 3, 5, 2, rope_align=8)
  plain = PagedLatentCache.init(2, 4, 3, 5, 2)
  assert padded.qk_rope_head_dim == 2 and padded.k_rope_pool.shape == (4, 3, 8)
  c_kv = jnp.arange(2 * 4 * 5, dtype=jnp.float32).reshape(2, 4, 5)
  k_rope = 1.0 + jnp.arange(2 * 4 * 2, dtype=jnp.float32).reshape(2, 4, 2)
  padded = jax.jit(lambda c, a, b: c.append(a, b, num_tokens=jnp.array([4, 2])))(
      padded, c_kv, k_rope)
  plain = plain.append(c_kv, k_rope, num_tokens=jnp.array([4, 2]))
  assert padded.rope_dim == 2                                   # static: survives jit
  for got, want in zip(padded.gather(), plain.gather()):
    np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(padded.k_rope_pool[..., 2:], 0.0)
  np.testing.assert_array_equal(padded.k_rope_pool[..., :2], plain.k_rope_pool)
  assert padded.nbytes == 4 * 3 * (5 + 8) * 4                   # as allocated
  with pytest.raises(ValueError, match="k_rope"):
    padded.append(c_kv, jnp.ones((2, 4, 8)))                   # R, not the stored width
  with pytest.raises(ValueError, match="rope_align"):
    PagedLatentCache.init(1, 2, 2, 8, 64, rope_align=0)


def test_an_empty_chunk_leaves_the_caches_as_they_were():
  """(It was refused, naming an internal `t`.)"""
  cache = PagedKVCache.init(2, 4, 2, 1, 2).append(jnp.ones((2, 3, 1, 2)), jnp.ones((2, 3, 1, 2)))
  same = cache.append(jnp.ones((2, 0, 1, 2)), jnp.ones((2, 0, 1, 2)))
  np.testing.assert_array_equal(same.lengths, [3, 3])
  np.testing.assert_array_equal(same.page_table, cache.page_table)
  latent = PagedLatentCache.init(2, 3, 2, 4, 2)
  assert latent.append(jnp.ones((2, 0, 4)), jnp.ones((2, 0, 2))) is latent
  with pytest.raises(ValueError, match="num_tokens"):
    cache.append(jnp.ones((2, 0, 1, 2)), jnp.ones((2, 0, 1, 2)), jnp.array([1, 0]))


def test_release_behind_a_window_frees_dead_pages_and_decode_reads_the_rest():
  """Pages wholly behind every sequence's window (``(j + 1) * page <= length - window``: no
  later token's query reaches them) go back to the free stack and their entries become -1; the
  next token's eager windowed decode checks and reads only the live ones (equal to the result
  without the release), while an unwindowed read of the released table is refused (it would
  read page -1)."""
  from jaxattn.ops.decode import paged_attention  # noqa: PLC0415

  rng = np.random.default_rng(5)
  cache = PagedKVCache.init(3, 12, 2, 1, 4, max_pages_per_seq=6)
  k, v = (jnp.asarray(rng.standard_normal((3, 12, 1, 4)), jnp.float32) for _ in range(2))
  cache = cache.append(k[:, :11], v[:, :11], jnp.array([11, 4, 0]))
  before = np.asarray(cache.page_table)
  table = cache.table.release_behind(3)
  # Sequence 0 (11 tokens): pages 0-3 dead ((j + 1) * 2 <= 8); sequence 1 (4): none.
  pt = np.asarray(table.page_table)
  assert (pt[0, :4] == -1).all() and (pt[0, 4:6] == before[0, 4:6]).all()
  assert (pt[1] == before[1]).all() and int(table.num_free) == 12 - 8 + 4
  assert sorted(np.asarray(table.free_pages)[:int(table.num_free)].tolist()) == sorted(
      set(range(12)) - set(pt[pt >= 0].tolist()))
  assert (np.asarray(table.release_behind(3).page_table) == pt).all()   # idempotent
  released = PagedKVCache(cache.key_pool, cache.value_pool, table, cache.num_kv_heads)
  q = jnp.asarray(rng.standard_normal((3, 1, 2, 4)), jnp.float32)
  kw = dict(local_window_size=3, implementation="xla")
  outs = []
  for c in (cache, released):           # the next token of each sequence, then its query
    c = c.append(k[:, 11:], v[:, 11:])
    outs.append(paged_attention(q, c.key_pool, c.value_pool, c.page_table, c.lengths, **kw))
  np.testing.assert_array_equal(outs[1], outs[0])
  with pytest.raises(ValueError, match=r"`page_table`\[0, 0\] = -1 is not a page of the pool"):
    paged_attention(q, c.key_pool, c.value_pool, c.page_table, c.lengths, implementation="xla")
  for bad in (-1, 2.5, True):
    with pytest.raises(ValueError, match="`window` must be an int >= 0"):
      table.release_behind(bad)


def test_errors():
  with pytest.raises(ValueError, match="page_size"):
    PagedKVCache.init(1, 4, 0, 1, 2)
  with pytest.raises(ValueError, match="num_pages"):
    PageTable.init(1, -1, 4)
  with pytest.raises(ValueError, match="head_dim"):
    PagedKVCache.init(1, 4, 2, 1, 0)
  cache = PagedKVCache.init(2, 3, 2, 1, 2, max_pages_per_seq=2)
  x = jnp.ones((2, 2, 1, 2))
  with pytest.raises(ValueError, match="out of pages"):
    cache.append(jnp.ones((2, 3, 1, 2)), jnp.ones((2, 3, 1, 2)))
  with pytest.raises(ValueError, match="too long"):
    cache.append(jnp.ones((2, 5, 1, 2)), jnp.ones((2, 5, 1, 2)), jnp.array([5, 0]))
  with pytest.raises(ValueError, match="`key`"):
    cache.append(jnp.ones((2, 2, 2, 2)), x)
  with pytest.raises(ValueError, match="`value`"):
    cache.append(x, jnp.ones((2, 2, 1, 3)))
  with pytest.raises(ValueError, match="num_tokens"):
    cache.append(x, x, jnp.array([3, 0]))
  with pytest.raises(ValueError, match="num_tokens"):
    cache.append(x, x, jnp.array([1]))
  with pytest.raises(ValueError, match="`num_tokens` must be an integer array"):
    cache.append(x, x, np.array([1.9, 0.5]))          # (was truncated to [1, 0])
  with pytest.raises(ValueError, match="done"):
    cache.free(jnp.array([1, 0]))
  with pytest.raises(ValueError, match="page_size"):
    gather_pages(jnp.ones((3, 4, 2)), cache.table)
  latent = PagedLatentCache.init(2, 3, 2, 4, 2)
  with pytest.raises(ValueError, match="c_kv"):
    latent.append(jnp.ones((2, 1, 3)), jnp.ones((2, 1, 2)))
  with pytest.raises(ValueError, match="k_rope"):
    latent.append(jnp.ones((2, 1, 4)), jnp.ones((2, 1, 3)))
