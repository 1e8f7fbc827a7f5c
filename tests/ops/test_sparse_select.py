"""Exact top-K selection without a sort: bit packing + sum-tree compaction, the bisected
thresholds, and ``indexer_topk(order="position")`` against ``topk_indices(indexer_scores(...))``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.ops.sparse import (_nth_set_bits, _pack_bits, _position_topk, _threshold_lower_bound,
                                indexer_scores, indexer_topk, sparse_attention, topk_indices)


def _as_sets(idx):
  """Rows sorted ascending with the ``-1`` padding last: equal iff the same sets."""
  idx = np.asarray(idx)
  return np.sort(np.where(idx < 0, np.iinfo(np.int32).max, idx), axis=-1)


def _assert_position_order(idx):
  """Increasing positions, then only ``-1`` padding."""
  idx = np.asarray(idx)
  valid = idx >= 0
  assert np.all(valid[..., :-1] | ~valid[..., 1:]), "padding before a position"
  both = valid[..., :-1] & valid[..., 1:]
  assert np.all(np.diff(idx, axis=-1)[both] > 0), "positions not increasing"


@pytest.mark.parametrize("s, size, p", [(300, 40, 0.1), (64, 70, 1.0), (31, 8, 0.5), (1, 3, 1.0),
                                        (200, 5, 0.0)])
def test_nth_set_bits_matches_nonzero(s, size, p):
  hit = np.random.default_rng(s).random((6, s)) < p
  pos, total = jax.jit(_nth_set_bits, static_argnums=1)(_pack_bits(jnp.asarray(hit)), size)
  for r in range(hit.shape[0]):
    ref = np.nonzero(hit[r])[0][:size]
    np.testing.assert_array_equal(pos[r, :len(ref)], ref)
    np.testing.assert_array_equal(pos[r, len(ref):], -1)
    assert int(total[r]) == hit[r].sum()


def test_pack_bits_layout():
  hit = np.zeros((1, 70), bool)
  hit[0, [0, 31, 32, 69]] = True
  words = np.asarray(_pack_bits(jnp.asarray(hit)))
  assert words.dtype == np.uint32 and words.shape == (1, 3)
  np.testing.assert_array_equal(words[0], [1 | (1 << 31), 1, 1 << 5])


@pytest.mark.parametrize("steps", [1, 12, 32])
def test_threshold_is_a_lower_bound_of_the_kth(steps):
  g = np.random.default_rng(steps).standard_normal((5, 64)).astype(np.float32)
  g[1, 10:] = -np.inf                       # 10 finite >= k = 8
  g[2, 5:] = -np.inf                        # fewer than k finite: every finite one qualifies
  g[3] = 2.0                                # all tied
  bound = jax.jit(_threshold_lower_bound, static_argnums=(1, 2))
  thr = np.asarray(bound(jnp.asarray(g), 8, steps))
  for r in range(5):
    fin = g[r][np.isfinite(g[r])]
    if fin.size < 8:
      assert thr[r] == np.finfo(np.float32).min
      continue
    kth = np.sort(fin)[-8]
    assert thr[r] <= kth and np.sum(g[r] >= thr[r]) >= 8
  if steps == 32:                           # tight: no other value strictly between
    for r in (0, 1, 4):
      kth = np.sort(g[r][np.isfinite(g[r])])[-8]
      assert not np.any((g[r] >= thr[r]) & (g[r] < kth))


def test_position_topk_matches_lax_top_k():
  rng = np.random.default_rng(0)
  cont = rng.standard_normal((8, 50)).astype(np.float32)
  ties = rng.integers(-2, 3, (8, 50)).astype(np.float32)   # many exact ties at the k-th place
  short = np.where(rng.random((8, 50)) < 0.9, -np.inf, cont).astype(np.float32)  # < k finite
  for vals in (cont, ties, short):
    got = np.asarray(jax.jit(_position_topk, static_argnums=1)(jnp.asarray(vals), 12))
    tv, ti = jax.lax.top_k(jnp.asarray(vals), 12)
    ref = np.where(np.isfinite(np.asarray(tv)), np.asarray(ti), -1)
    np.testing.assert_array_equal(_as_sets(got), _as_sets(ref))
    _assert_position_order(got)


def _inputs(seed, b, t, hi=3, d=8, integer=False):
  ks = jax.random.split(jax.random.key(seed), 3)
  if integer:                               # exact scores: real ties, bit-exact comparison
    return (jax.random.randint(ks[0], (b, t, hi, d), -2, 3).astype(jnp.float32),
            jax.random.randint(ks[1], (b, t, d), -2, 3).astype(jnp.float32),
            jax.random.randint(ks[2], (b, t, hi), -1, 3).astype(jnp.float32))
  return (jax.random.normal(ks[0], (b, t, hi, d)), jax.random.normal(ks[1], (b, t, d)),
          jax.random.uniform(ks[2], (b, t, hi)) - 0.3)


@pytest.mark.parametrize("kw", [dict(), dict(candidates=16), dict(bisect_steps=1),
                                dict(block_size=64, query_block=48)])
def test_position_order_same_set_as_reference_with_ties(kw):
  # S = 300 > candidates: threshold + compaction; integer scores put many positions at the
  # threshold (candidates=16 forces the full-row fallback).  Ties must go to lower positions.
  q, kk, w = _inputs(2, 2, 300, integer=True)
  ref = topk_indices(indexer_scores(q, kk, w), 16)
  got = indexer_topk(q, kk, w, 16, order="position", **(dict(block_size=32, query_block=16) | kw))
  np.testing.assert_array_equal(_as_sets(got), _as_sets(ref))
  _assert_position_order(got)


def test_position_order_continuous_scores_and_score_order_unchanged():
  q, kk, w = _inputs(3, 2, 300)           # the shapes and settings of the test above: no recompile
  scores = np.asarray(indexer_scores(q, kk, w))
  ref = np.asarray(topk_indices(jnp.asarray(scores), 16))
  got = np.asarray(indexer_topk(q, kk, w, 16, block_size=32, query_block=16, order="position"))
  _assert_position_order(got)
  for b, t in zip(*np.nonzero(np.any(_as_sets(got) != _as_sets(ref), axis=-1))):
    # Only near-ties at the k-th place may swap (tiles vs one einsum: last-bit differences).
    g, r = set(got[b, t]) - {-1}, set(ref[b, t]) - {-1}
    kth = min(scores[b, t, i] for i in r)
    assert len(g) == len(r) and all(abs(scores[b, t, i] - kth) <= 1e-5 for i in g ^ r)
  by_score = np.asarray(indexer_topk(q, kk, w, 16, block_size=32, query_block=16))
  np.testing.assert_array_equal(_as_sets(by_score), _as_sets(got))
  vals = np.take_along_axis(scores, np.maximum(by_score, 0), axis=-1)
  assert np.all((np.diff(vals, axis=-1) <= 0) | (by_score[..., 1:] < 0))  # decreasing score


def test_position_order_decode_offset_and_kv_lengths():
  # Three new rows at offset 37 against a cache of 41 slots, one sequence filled to 40, the
  # other to 23 (its rows see fewer keys than k); query chunks of 2 (one padded).
  q, kk, w = _inputs(4, 2, 41, integer=True)
  lengths = jnp.array([40, 23])
  ref = topk_indices(indexer_scores(q[:, 37:40], kk, w[:, 37:40], q_offset=37,
                                    kv_lengths=lengths), 6)
  got = indexer_topk(q[:, 37:40], kk, w[:, 37:40], 6, q_offset=37, kv_lengths=lengths,
                     block_size=8, query_block=2, order="position")
  np.testing.assert_array_equal(_as_sets(got), _as_sets(ref))
  _assert_position_order(got)


def test_sparse_attention_does_not_depend_on_index_order():
  # The order a selection comes in changes only the summation order: values and gradients agree.
  q, kk, w = _inputs(5, 1, 48, hi=2, d=8)
  by_score = np.asarray(topk_indices(indexer_scores(q, kk, w), 12))
  by_pos = np.where(_as_sets(by_score) == np.iinfo(np.int32).max, -1, _as_sets(by_score))
  ks = jax.random.split(jax.random.key(6), 3)
  args = (jax.random.normal(ks[0], (1, 48, 4, 16)), jax.random.normal(ks[1], (1, 48, 2, 16)),
          jax.random.normal(ks[2], (1, 48, 2, 16)))
  f = jax.jit(jax.value_and_grad(lambda a, b, c, i: jnp.sum(jnp.sin(sparse_attention(a, b, c, i))),
                                 argnums=(0, 1, 2)))
  (l1, g1), (l2, g2) = f(*args, jnp.asarray(by_score)), f(*args, jnp.asarray(by_pos))
  np.testing.assert_allclose(l1, l2, rtol=1e-5)
  for a, b in zip(g1, g2):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_order_error():
  q, kk, w = _inputs(7, 1, 8)
  with pytest.raises(ValueError, match="`order`"):
    indexer_topk(q, kk, w, 2, order="value")
