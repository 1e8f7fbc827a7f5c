"""Ragged chunks through the attention modules (``num_tokens`` with a paged cache: continuous
batching, where in one call a sequence prefills a chunk, another decodes a token and a third
waits): every sequence's outputs equal the full causal pass over that sequence alone, padding rows
give zeros and never reach the cache (they hold huge values here), for ``Attention`` (GQA, the XLA
path and the TPU kernel interpreted), ``MLA`` and ``DSA`` (sparse top-K)."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxattn.nn.attention import Attention
from jaxattn.nn.dsa import DSA
from jaxattn.nn.mla import MLA
from jaxattn.testing import random_module

D = 32
MLA_DIMS = dict(kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                q_lora_rank=16)
# Chunks per step (rows: sequences): a prefill split 3 + 1 + 0 + 2, decodes, idle steps.
SCHEDULE = np.array([[3, 1, 0], [1, 3, 0], [0, 2, 3], [2, 0, 3]])      # [steps, B]
T = 3


def gqa():
  return random_module(lambda: Attention(D, num_heads=4, num_kv_heads=2, use_bias=True,
                                         rngs=nnx.Rngs(0)), 0)


def mla():
  return random_module(lambda: MLA(D, 4, mode="absorbed", rngs=nnx.Rngs(0), **MLA_DIMS), 0)


def dsa():
  return random_module(lambda: DSA(D, 4, index_num_heads=3, index_head_dim=16, index_rope_dim=4,
                                   index_topk=3, attention_mode="sparse", rngs=nnx.Rngs(0),
                                   **MLA_DIMS), 0)


@nnx.jit(static_argnames="implementation")
def _step(m, cache, x, num_tokens, implementation=None):
  return m(x, cache=cache, num_tokens=num_tokens, implementation=implementation)


def _run(module, implementation=None):
  """Feeds SCHEDULE's chunks of each sequence's tokens; returns the sequences ``[B, S, D]``,
  each sequence's real outputs ``[B, S, D]`` in order, the padding outputs, the final cache."""
  rng = np.random.default_rng(1)
  b, s = SCHEDULE.shape[1], SCHEDULE.sum(0).max()
  seqs = rng.standard_normal((b, s, D)).astype(np.float32)
  cache = module.init_paged_cache(b, num_pages=12, page_size=2, max_pages_per_seq=4)
  done = np.zeros(b, int)
  outs = [[] for _ in range(b)]
  padding = []
  for nt in SCHEDULE:
    x = 1e3 * rng.standard_normal((b, T, D)).astype(np.float32)      # padding: huge values
    for i, n in enumerate(nt):
      x[i, :n] = seqs[i, done[i]:done[i] + n]
    y, cache = _step(module, cache, jnp.asarray(x), jnp.asarray(nt, jnp.int32),
                     implementation=implementation)
    y = np.asarray(y)
    for i, n in enumerate(nt):
      outs[i].append(y[i, :n])
      padding.append(y[i, n:])
    done += nt
  return seqs, np.stack([np.concatenate(o) for o in outs]), padding, cache


@pytest.mark.parametrize("make,implementation", [
    (gqa, None), (gqa, "pallas_tpu"), (mla, None), (dsa, None)],
    ids=["gqa-xla", "gqa-pallas_tpu", "mla", "dsa-sparse"])
def test_ragged_chunks_equal_each_sequence_alone(make, implementation):
  module = make()
  seqs, outs, padding, cache = _run(module, implementation)
  full = np.asarray(nnx.jit(lambda m, x: m(x))(module, jnp.asarray(seqs)))
  np.testing.assert_allclose(outs, full, rtol=1e-4, atol=1e-4)
  for p in padding:
    np.testing.assert_array_equal(p, 0.0)
  np.testing.assert_array_equal(cache.lengths, SCHEDULE.sum(0))


def test_full_chunks_equal_the_plain_call():
  module = gqa()
  x = jnp.asarray(np.random.default_rng(2).standard_normal((2, T, D)), jnp.float32)
  cache = module.init_paged_cache(2, num_pages=8, page_size=2, max_pages_per_seq=4)
  y0, c0 = module(x, cache=cache)
  y1, c1 = module(x, cache=cache, num_tokens=jnp.full((2,), T, jnp.int32))
  np.testing.assert_allclose(y1, y0, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(c1.key_pool, c0.key_pool)


@pytest.mark.parametrize("make", [gqa, mla, dsa], ids=["gqa", "mla", "dsa"])
def test_num_tokens_needs_a_paged_cache(make):
  module = make()
  x = jnp.zeros((2, T, D), jnp.float32)
  nt = jnp.asarray([1, 2], jnp.int32)
  with pytest.raises(ValueError, match=r"`num_tokens` \(a ragged chunk\) needs a Paged"):
    module(x, num_tokens=nt)
  with pytest.raises(ValueError, match=r"`num_tokens` \(a ragged chunk\) needs a Paged"):
    module(x, cache=module.init_cache(2, 8), num_tokens=nt)
  paged = module.init_paged_cache(2, num_pages=8, page_size=2, max_pages_per_seq=4)
  with pytest.raises(ValueError, match=r"`num_tokens` must lie in \[0, T=3\]"):
    module(x, cache=paged, num_tokens=jnp.asarray([1, 4], jnp.int32))


def test_dsa_aux_refused_for_a_ragged_chunk():
  module = dsa()
  paged = module.init_paged_cache(2, num_pages=8, page_size=2, max_pages_per_seq=4)
  with pytest.raises(ValueError, match="`return_aux`.*ragged chunk"):
    module(jnp.zeros((2, T, D)), cache=paged, num_tokens=jnp.asarray([1, 2]), return_aux=True)
