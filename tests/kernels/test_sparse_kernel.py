"""The top-K sparse attention Pallas kernel (interpret mode, race detection) vs the gather reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jaxattn.ops.sparse import (indexer_scores, sparse_attention, sparse_mla_attention,
                                topk_indices)
from pallas_kernels.sparse_attention import sparse_attention_tpu, sparse_mla_attention_tpu

RACES = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)


def _indices(b, t, s, k, seed, q_offset=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  qi = jax.random.normal(ks[0], (b, t, 2, 8))
  ki = jax.random.normal(ks[1], (b, s, 8))
  w = jax.random.uniform(ks[2], (b, t, 2)) - 0.2
  lengths = jnp.full((b,), q_offset + t, jnp.int32)
  return topk_indices(indexer_scores(qi, ki, w, q_offset=q_offset, kv_lengths=lengths), k)


# Race detection (slow: it tracks every DMA) on one GQA case; plain interpret mode on the other.
@pytest.mark.parametrize("n,kh,k,b,interpret", [(4, 2, 3, 1, RACES), (2, 1, 9, 2, True)])
def test_prefill_matches_gather_reference_with_race_detection(n, kh, k, b, interpret, race_states):
  t, h = 6, 8
  ks = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(ks[0], (b, t, n, h))
  key = jax.random.normal(ks[1], (b, t, kh, h))
  v = jax.random.normal(ks[2], (b, t, kh, 4))
  idx = _indices(b, t, t, k, 1)          # k=9 > T: rows padded with -1, row 0 has one position
  assert int((idx < 0).sum()) > 0
  got = sparse_attention_tpu(q, key, v, idx, interpret=interpret)
  np.testing.assert_allclose(got, sparse_attention(q, key, v, idx), rtol=1e-5, atol=1e-6)
  if interpret is RACES:
    assert race_states and not any(st.races_found for st in race_states)


def test_decode_over_mla_latent_cache(race_states):
  b, n, p, r, c, hv, cap = 2, 4, 8, 4, 16, 8, 16
  ks = jax.random.split(jax.random.key(2), 6)
  q_nope = jax.random.normal(ks[0], (b, 1, n, p))
  q_rope = jax.random.normal(ks[1], (b, 1, n, r))
  c_kv = jax.random.normal(ks[2], (b, cap, c))
  k_rope = jax.random.normal(ks[3], (b, cap, r))
  w_uk = jax.random.normal(ks[4], (c, n, p)) * 0.3
  w_uv = jax.random.normal(ks[5], (c, n, hv)) * 0.3
  idx = _indices(b, 1, cap, 4, 3, q_offset=10)   # 11 filled slots out of 16
  assert int(idx.max()) <= 10
  got = sparse_mla_attention_tpu(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, idx, interpret=RACES)
  ref = sparse_mla_attention(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, idx)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
  assert race_states and not any(st.races_found for st in race_states)


def test_empty_rows_and_errors():
  q = jnp.ones((1, 2, 2, 8))
  kv = jnp.ones((1, 4, 1, 8))
  idx = jnp.array([[[-1, -1], [2, -1]]], jnp.int32)
  out = sparse_attention_tpu(q, kv, kv, idx, interpret=True)
  np.testing.assert_array_equal(out[0, 0], 0.0)
  np.testing.assert_allclose(out[0, 1], 1.0)
  with pytest.raises(ValueError, match="indices"):
    sparse_attention_tpu(q, kv, kv, idx[:, :1], interpret=True)
  with pytest.raises(ValueError, match="multiple"):
    sparse_attention_tpu(jnp.ones((1, 2, 3, 8)), jnp.ones((1, 4, 2, 8)), jnp.ones((1, 4, 2, 8)),
                         idx, interpret=True)
