"""Streaming causal indexer top-K (``indexer_topk``) vs ``topk_indices(indexer_scores(...))``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.ops.hadamard import hadamard_transform
from jaxattn.ops.sparse import indexer_scores, indexer_topk, topk_indices


def _inputs(seed, b, t, s, hi=3, d=16, integer=False):
  ks = jax.random.split(jax.random.key(seed), 3)
  if integer:
    # Small integers: every score is exact in fp32 in both implementations, so ties are real
    # ties and the two must agree bit for bit, order included.
    q = jax.random.randint(ks[0], (b, t, hi, d), -2, 3).astype(jnp.float32)
    k = jax.random.randint(ks[1], (b, s, d), -2, 3).astype(jnp.float32)
    w = jax.random.randint(ks[2], (b, t, hi), -1, 3).astype(jnp.float32)
    return q, k, w
  return (jax.random.normal(ks[0], (b, t, hi, d)), jax.random.normal(ks[1], (b, s, d)),
          jax.random.uniform(ks[2], (b, t, hi)) - 0.3)


def _assert_same_selection(got, ref, scores, atol):
  """Equal index arrays, except where two scores within ``atol`` of each other swap places at the
  k-th boundary (the streamed scores may differ from the reference's in the last bits)."""
  got, ref, scores = map(np.asarray, (got, ref, scores))
  assert got.shape == ref.shape
  for b, t in zip(*np.nonzero(np.any(got != ref, axis=-1))):
    g, r = set(got[b, t]) - {-1}, set(ref[b, t]) - {-1}
    assert len(g) == len(r), (b, t)
    kth = min(scores[b, t, i] for i in r)
    for i in g ^ r:
      assert abs(scores[b, t, i] - kth) <= atol, (b, t, i, scores[b, t, i], kth)


@pytest.mark.parametrize("k, block_size, query_block", [(1, 8, 4), (5, 16, 7), (13, 8, 37),
                                                        (40, 64, 64)])
def test_matches_reference_exactly_with_ties(k, block_size, query_block):
  # Odd lengths (T = S = 37: padded query chunks and key tiles), many exactly tied scores.
  q, kk, w = _inputs(0, 2, 37, 37, integer=True)
  ref = topk_indices(indexer_scores(q, kk, w), k)
  got = indexer_topk(q, kk, w, k, block_size=block_size, query_block=query_block)
  np.testing.assert_array_equal(got, ref)


def test_matches_reference_random_scores():
  q, kk, w = _inputs(1, 2, 45, 45)
  scores = indexer_scores(q, kk, w)
  got = indexer_topk(q, kk, w, 16, block_size=16, query_block=8)
  _assert_same_selection(got, topk_indices(scores, 16), scores, atol=1e-5)


def test_filtered_path_and_fallback_agree_with_reference():
  # S = 300 > candidates: the threshold + compaction path runs.  Integer scores with few distinct
  # values put far more than `candidates` positions at the threshold, forcing the full-row
  # fallback for those chunks; a one-step bisection gives a very loose threshold.  All exact.
  q, kk, w = _inputs(2, 1, 300, 300, hi=2, d=4, integer=True)
  ref = topk_indices(indexer_scores(q, kk, w), 16)
  for kw in (dict(), dict(candidates=16), dict(bisect_steps=1)):
    got = indexer_topk(q, kk, w, 16, block_size=32, query_block=16, **kw)
    np.testing.assert_array_equal(got, ref, err_msg=str(kw))
  # Continuous scores, default settings: the filtered path without fallback.
  q, kk, w = _inputs(3, 1, 300, 300, hi=4, d=32)
  scores = indexer_scores(q, kk, w)
  got = indexer_topk(q, kk, w, 16, block_size=32, query_block=16)
  _assert_same_selection(got, topk_indices(scores, 16), scores, atol=1e-5)


def test_decode_offsets_and_kv_lengths():
  q, kk, w = _inputs(4, 2, 41, 41, integer=True)
  lengths = jnp.array([41, 23])                                    # row 1: a shorter cache
  ref = topk_indices(indexer_scores(q, kk, w, kv_lengths=lengths), 6)
  got = indexer_topk(q, kk, w, 6, kv_lengths=lengths, block_size=8, query_block=5)
  np.testing.assert_array_equal(got, ref)
  # Decode: one and three new rows against a cache of 64 slots, 40 (resp. 38) of them filled.
  cache = jnp.concatenate([kk, jnp.full((2, 23, kk.shape[-1]), 7.0)], axis=1)  # junk after 41
  for t0, n in ((39, 1), (37, 3)):
    fill = jnp.array([t0 + n, t0 + n])
    step = indexer_topk(q[:, t0:t0 + n], cache, w[:, t0:t0 + n], 6, q_offset=t0,
                        kv_lengths=fill, block_size=16)
    np.testing.assert_array_equal(step, topk_indices(indexer_scores(q, kk, w), 6)[:, t0:t0 + n])
  # An empty cache row selects nothing.
  none = indexer_topk(q[:, :2], kk, w[:, :2], 4, kv_lengths=jnp.array([0, 5]))
  np.testing.assert_array_equal(none[0], -1)
  assert int((none[1] >= 0).sum()) == 1 + 2                        # rows 0 and 1 see 1 and 2 keys


def test_k_larger_than_available_pads_like_reference():
  q, kk, w = _inputs(5, 1, 9, 9, integer=True)
  got = indexer_topk(q, kk, w, 12, block_size=8)
  ref = topk_indices(indexer_scores(q, kk, w), 12)
  np.testing.assert_array_equal(got, ref)
  assert got.shape == (1, 9, 12) and int(got[0, 0, 1]) == -1


@pytest.mark.parametrize("quant", ["int8", "fp8"])
def test_quantized_scoring_matches_reference(quant):
  q, kk, w = _inputs(6, 2, 40, 40, d=32)
  q, kk = hadamard_transform(q), hadamard_transform(kk)
  scores = indexer_scores(q, kk, w, quant=quant)
  got = indexer_topk(q, kk, w, 8, quant=quant, block_size=16, query_block=8)
  _assert_same_selection(got, topk_indices(scores, 8), scores, atol=1e-4)
  # Quantization changes the selection somewhere (the option is not ignored).
  assert not np.array_equal(got, indexer_topk(q, kk, w, 8, block_size=16, query_block=8)) or \
      np.allclose(scores, indexer_scores(q, kk, w), atol=0)


def test_jit_with_traced_offset():
  q, kk, w = _inputs(7, 1, 20, 20, integer=True)
  f = jax.jit(lambda off, n: indexer_topk(q[:, 12:14], kk, w[:, 12:14], 5, q_offset=off,
                                          kv_lengths=n, block_size=8))
  got = f(jnp.int32(12), jnp.array([14]))
  np.testing.assert_array_equal(got, topk_indices(indexer_scores(q, kk, w), 5)[:, 12:14])


def test_errors():
  q, kk, w = _inputs(8, 1, 8, 8)
  for bad in (0, -1, 2.5):
    with pytest.raises(ValueError, match="`k`"):
      indexer_topk(q, kk, w, bad)
  with pytest.raises(ValueError, match="block_size"):
    indexer_topk(q, kk, w, 2, block_size=12)
  with pytest.raises(ValueError, match="query_block"):
    indexer_topk(q, kk, w, 2, query_block=0)
  with pytest.raises(ValueError, match="candidates"):
    indexer_topk(q, kk, w, 4, candidates=3)
  with pytest.raises(ValueError, match="bisect_steps"):
    indexer_topk(q, kk, w, 2, bisect_steps=33)
  with pytest.raises(ValueError, match="k_index"):
    indexer_topk(q, kk[..., :8], w, 2)
  with pytest.raises(ValueError, match="weights"):
    indexer_topk(q, kk, w[..., :2], 2)
  with pytest.raises(ValueError, match="quant"):
    indexer_topk(q, kk, w, 2, quant="int4")
  with pytest.raises(ValueError, match="for the indexer"):
    indexer_topk(q, kk, w, 2, implementation="pallas_tpu")
