"""``DSA`` decoding from a paged latent cache: prefill + token-by-token decode equals the contiguous
``DSACache`` decode and the full pass (sparse and dense modes, fp32 and int8 indexer keys), ragged
batches with a freed sequence's pages reused by a new one, auxiliary outputs, the Pallas kernel
through the module, errors."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxattn.nn.dsa import DSA
from jaxattn.paged_cache import PagedLatentCache
from jaxattn.testing import prefill_then_decode, random_module

D = 32
MLA_KW = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
              q_lora_rank=24)
TOPK = 3  # below the sequence lengths used here, so the selection matters


def _dsa(quant=None, mode="sparse", topk=TOPK, seed=0):
  """The module built abstractly and filled with random weights from NumPy (its initializers
  compile once per parameter shape, which would dominate this file's runtime)."""
  return random_module(lambda: DSA(D, 4, index_num_heads=3, index_head_dim=16,
                                      index_rope_dim=4, index_topk=topk, index_quant=quant,
                                      attention_mode=mode, rngs=nnx.Rngs(0), **MLA_KW), seed)


def _x(t, b=2, seed=1):
  return jnp.asarray(np.random.default_rng(seed).standard_normal((b, t, D)), jnp.float32)


@nnx.jit(static_argnames=("implementation", "return_aux"))
def _step(m, cache, xt, implementation=None, return_aux=False):
  return m(xt, cache=cache, implementation=implementation, return_aux=return_aux)


@nnx.jit(static_argnames="attention_mode")
def _full(m, x, attention_mode=None):
  return m(x, attention_mode=attention_mode)


def _decode(module, cache, x, prefill):
  return prefill_then_decode(_step, module, cache, x, prefill)


# Tolerances: every path computes in fp32; they differ only in summation order (absorbed vs naive
# MLA, gathered vs contiguous rows), ~1e-6, far below a changed selection (~1e-1 here).
TOL = dict(rtol=1e-4, atol=1e-5)


# Every test uses one cache geometry and prefill length so the jitted steps compile once.
def _paged(module):
  return module.init_paged_cache(2, num_pages=8, page_size=2, max_pages_per_seq=4)


@pytest.mark.parametrize("mode,quant", [("sparse", None), ("sparse", "int8"), ("dense", "int8")])
def test_paged_decode_equals_contiguous_decode_and_full_pass(mode, quant):
  module, x = _dsa(quant, mode), _x(7)
  paged, cache = _decode(module, _paged(module), x, 3)
  assert isinstance(cache, PagedLatentCache)
  np.testing.assert_array_equal(cache.lengths, [7, 7])
  assert cache.index_keys_pool.dtype == (jnp.int8 if quant == "int8" else jnp.float32)
  contiguous, _ = _decode(module, module.init_cache(2, 8), x, 3)
  full = _full(module, x)
  np.testing.assert_allclose(paged, contiguous, **TOL)
  np.testing.assert_allclose(paged, full, **TOL)
  if mode == "sparse":  # the top-K selection really drops keys at this size
    dense = _full(module, x, attention_mode="dense")
    assert np.abs(np.asarray(full - dense))[:, TOPK:].max() > 1e-2


def test_ragged_batch_with_reused_pages_equals_full_passes():
  """Row 1 holds a long sequence (5-token prompt, prefilled in two chunks); row 0 first holds a
  short-lived sequence that is freed, then a new one (3-token prompt) that must take the freed
  page.  Both then decode two tokens at different lengths; each equals its own full pass."""
  module = _dsa("int8", "sparse")
  long_x, fresh, dummy = _x(7, b=1, seed=2), _x(5, b=1, seed=3), _x(2, b=1, seed=4)
  cache = _paged(module)
  y_a, cache = _step(module, cache, jnp.concatenate([dummy, long_x[:, :2]]))
  freed_page = int(cache.page_table[0, 0])
  cache = cache.free(jnp.array([True, False]))
  np.testing.assert_array_equal(cache.lengths, [0, 2])
  y_b, cache = _step(module, cache, jnp.concatenate([fresh[:, :3], long_x[:, 2:5]]))
  np.testing.assert_array_equal(cache.lengths, [3, 5])
  assert int(cache.page_table[0, 0]) == freed_page  # the new sequence recycled the page
  outs = [y_b]
  for i in range(2):
    y, cache = _step(module, cache, jnp.concatenate([fresh[:, 3 + i:4 + i],
                                                     long_x[:, 5 + i:6 + i]]))
    outs.append(y)
  np.testing.assert_array_equal(cache.lengths, [5, 7])
  ys = jnp.concatenate(outs, axis=1)                                  # [2, 5, D]
  np.testing.assert_allclose(ys[:1], _full(module, fresh), **TOL)
  np.testing.assert_allclose(jnp.concatenate([y_a[1:], ys[1:]], axis=1), _full(module, long_x),
                             **TOL)


def test_aux_equals_contiguous_cache_aux():
  """``return_aux`` with a paged cache: same selection, indexer scores and indexer loss as the
  contiguous cache (both hold S = 8 slots, so the score rows line up)."""
  module, x = _dsa("int8", "sparse"), _x(4, seed=5)
  paged, contiguous = _paged(module), module.init_cache(2, 8)
  _, paged = _step(module, paged, x[:, :3])
  _, contiguous = _step(module, contiguous, x[:, :3])
  y_p, _, aux_p = _step(module, paged, x[:, 3:], return_aux=True)
  y_c, _, aux_c = _step(module, contiguous, x[:, 3:], return_aux=True)
  np.testing.assert_allclose(y_p, y_c, **TOL)
  np.testing.assert_array_equal(aux_p["indices"], aux_c["indices"])
  assert (np.asarray(aux_p["indices"]) >= 0).sum() == 2 * TOPK
  np.testing.assert_allclose(aux_p["index_scores"], aux_c["index_scores"], **TOL)
  np.testing.assert_allclose(aux_p["indexer_loss"], aux_c["indexer_loss"], **TOL)


def test_pallas_kernel_through_the_module():
  module, x = _dsa("int8", "sparse"), _x(4, seed=6)
  _, cache = _step(module, _paged(module), x[:, :3])
  y_xla, _ = _step(module, cache, x[:, 3:], implementation="xla")
  y_kernel, _ = _step(module, cache, x[:, 3:], implementation="pallas_tpu")  # interpreted on CPU
  np.testing.assert_allclose(y_kernel, y_xla, rtol=2e-5, atol=2e-5)


def test_init_paged_cache_stores_the_indexer_format():
  for quant, dtype, num_scales in ((None, jnp.float32, 1), ("int8", jnp.int8, 1),
                                   ("fp8", jnp.float8_e4m3fn, 1)):
    cache = _dsa(quant).init_paged_cache(3, num_pages=5, page_size=4, max_pages_per_seq=2)
    assert cache.index_keys_pool.dtype == dtype
    assert cache.index_keys_pool.shape == (5, 4, 16)
    assert cache.index_scales_pool.shape == (5, 4, num_scales)
    assert cache.c_kv_pool.shape == (5, 4, 16) and cache.page_table.shape == (3, 2)


def test_errors():
  m, x = _dsa("int8"), _x(2)
  with pytest.raises(ValueError, match="without indexer keys"):
    m(x, cache=PagedLatentCache.init(2, 4, 2, 16, 4))            # what MLA.init_paged_cache makes
  with pytest.raises(ValueError, match="indexer keys are float32"):
    m(x, cache=_dsa(None).init_paged_cache(2, 4, 2))              # fp32 keys for an int8 indexer
  with pytest.raises(ValueError, match="C=5"):
    m(x, cache=PagedLatentCache.init(2, 4, 2, 5, 4, index_head_dim=16, index_dtype=jnp.int8))
  with pytest.raises(ValueError, match="segment_ids"):
    m(x, cache=m.init_paged_cache(2, 4, 2), segment_ids=jnp.ones((2, 2), jnp.int32))
  with pytest.raises(ValueError, match="out of pages"):
    m(_x(5), cache=m.init_paged_cache(2, 4, 2))
  with pytest.raises(ValueError, match="attention_mode"):
    m(x, cache=m.init_paged_cache(2, 4, 2), attention_mode="topk")
