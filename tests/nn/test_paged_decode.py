"""``Attention`` and ``MLA`` decoding from paged caches: prefill + decode equals the
contiguous-cache decode and the full pass, ragged batches (a finished sequence freed and a new one
started beside a running one), the Pallas kernel through the module, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxattn.nn.attention import Attention
from jaxattn.nn.mla import MLA
from jaxattn.paged_cache import PagedKVCache, PagedLatentCache
from jaxattn.testing import prefill_then_decode, random_module

D = 32
MLA_DIMS = dict(kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                q_lora_rank=16)


def _filled(ctor, seed=0):
  return random_module(ctor, seed)


def gqa():
  return _filled(lambda: Attention(D, num_heads=4, num_kv_heads=2, logits_soft_cap=5.0,
                                   rngs=nnx.Rngs(0)))


def mla():
  return _filled(lambda: MLA(D, 4, mode="absorbed", rngs=nnx.Rngs(0), **MLA_DIMS))


def _x(t, b=2, seed=1):
  return jnp.asarray(np.random.default_rng(seed).standard_normal((b, t, D)), jnp.float32)


@nnx.jit(static_argnames="implementation")
def _step(m, cache, xt, implementation=None):
  return m(xt, cache=cache, implementation=implementation)


_full = nnx.jit(lambda m, x: m(x))


def _decode(module, cache, x, prefill):
  return prefill_then_decode(_step, module, cache, x, prefill)


@pytest.mark.parametrize("make", [gqa, mla], ids=["gqa", "mla"])
def test_paged_decode_equals_contiguous_decode(make):
  module, x = make(), _x(7)
  paged, cache = _decode(module, module.init_paged_cache(2, num_pages=8, page_size=2), x, 4)
  assert isinstance(cache, (PagedKVCache, PagedLatentCache))
  np.testing.assert_array_equal(cache.lengths, [7, 7])
  contiguous, _ = _decode(module, module.init_cache(2, 8), x, 4)
  np.testing.assert_allclose(paged, contiguous, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("make", [gqa, mla], ids=["gqa", "mla"])
def test_ragged_batch_free_and_restart_equals_full_pass(make):
  """Sequence 1 finishes after 3 tokens and is freed; a new sequence starts in its slot while
  sequence 0 keeps decoding.  Each equals the full pass over its own tokens."""
  module = make()
  x = _x(6, seed=2)
  fresh = _x(3, seed=3)
  cache = module.init_paged_cache(2, num_pages=5, page_size=2, max_pages_per_seq=3)
  y_a, cache = _step(module, cache, x[:, :3])
  cache = cache.free(jnp.array([False, True]))
  np.testing.assert_array_equal(cache.lengths, [3, 0])
  # The batch is now ragged (3 and 0 tokens); both rows take 3 more tokens.
  step_in = jnp.concatenate([x[:1, 3:], fresh[1:]], axis=0)
  y_b, cache = _step(module, cache, step_in)
  np.testing.assert_array_equal(cache.lengths, [6, 3])
  full0 = _full(module, x[:1])
  full1 = _full(module, fresh[1:])
  np.testing.assert_allclose(jnp.concatenate([y_a[:1], y_b[:1]], 1), full0, rtol=2e-5,
                             atol=2e-5)
  np.testing.assert_allclose(y_b[1:], full1, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("make", [gqa, mla], ids=["gqa", "mla"])
def test_pallas_kernel_through_the_module(make):
  module, x = make(), _x(6, seed=4)
  cache = module.init_paged_cache(2, num_pages=8, page_size=2)
  _, cache = _step(module, cache, x[:, :5])
  y_xla, _ = _step(module, cache, x[:, 5:], implementation="xla")
  y_kernel, _ = _step(module, cache, x[:, 5:], implementation="pallas_tpu")  # interpreted on CPU
  np.testing.assert_allclose(y_kernel, y_xla, rtol=2e-5, atol=2e-5)


def test_mla_tpu_cache_layout_through_the_module(monkeypatch):
  """A cache made on TPU stores k^R zero-padded to 128 columns (R = 4 here); prefill and a decode
  step through the XLA path and the kernel equal those from an unpadded cache."""
  module, x = mla(), _x(6, seed=4)
  with monkeypatch.context() as m:
    m.setattr(jax, "default_backend", lambda: "tpu")
    padded = module.init_paged_cache(2, num_pages=8, page_size=2)
  assert padded.k_rope_pool.shape[2] == 128 and padded.qk_rope_head_dim == 4
  plain = module.init_paged_cache(2, num_pages=8, page_size=2)
  y_plain, plain = _step(module, plain, x[:, :5])
  y_padded, padded = _step(module, padded, x[:, :5])
  np.testing.assert_allclose(y_padded, y_plain, rtol=2e-5, atol=2e-5)
  ref, _ = _step(module, plain, x[:, 5:], implementation="xla")
  for impl in ("xla", "pallas_tpu"):
    got, _ = _step(module, padded, x[:, 5:], implementation=impl)
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5, err_msg=impl)


def test_errors():
  x = _x(2)
  for kw in (dict(sliding_window=2), dict(position="alibi"), dict(causal=False)):
    # Abstract modules: the check comes before any parameter is read.
    attn = nnx.eval_shape(lambda kw=kw: Attention(D, num_heads=4, rngs=nnx.Rngs(0), **kw))
    with pytest.raises(ValueError, match="PagedKVCache"):
      attn(x, cache=attn.init_paged_cache(2, 4, 2))
  attn = gqa()
  with pytest.raises(ValueError, match="PagedKVCache"):
    attn(x, cache=attn.init_paged_cache(2, 4, 2), mask=jnp.ones((1, 1, 2, 2), bool))
  with pytest.raises(ValueError, match="out of pages"):
    attn(_x(5), cache=attn.init_paged_cache(2, 4, 2))
  m = mla()
  with pytest.raises(ValueError, match="C=5"):
    m(x, cache=PagedLatentCache.init(2, 4, 2, 5, 4))
  with pytest.raises(ValueError, match="PagedLatentCache"):
    m(x, cache=m.init_paged_cache(2, 4, 2), segment_ids=jnp.zeros((2, 2), jnp.int32))
