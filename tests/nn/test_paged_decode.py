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


def gqa_sinks():
  """gpt-oss's attention: learned sinks (random here), a sliding window."""
  return _filled(lambda: Attention(D, num_heads=4, num_kv_heads=2, attention_sinks=True,
                                   sliding_window=3, rngs=nnx.Rngs(0)))


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


@pytest.mark.parametrize("make", [gqa, mla, gqa_sinks], ids=["gqa", "mla", "gqa_sinks"])
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


@pytest.mark.parametrize("make", [gqa, mla, gqa_sinks], ids=["gqa", "mla", "gqa_sinks"])
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
  for kw in (dict(causal=False),):
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
  # the other family's cache: a clear error, not an AttributeError deep inside
  with pytest.raises(ValueError, match="`cache` must be a KVCache .* got PagedLatentCache"):
    attn(x, cache=m.init_paged_cache(2, 4, 2))
  with pytest.raises(ValueError, match="`cache` must be a LatentCache .* got PagedKVCache"):
    m(x, cache=attn.init_paged_cache(2, 4, 2))


@pytest.mark.parametrize("make", [gqa, mla], ids=["gqa", "mla"])
def test_dense_backend_names_decode_from_a_paged_cache(make):
  """A layer built for a dense-only backend ("cpu", "cudnn", "xla_chunked", or a preference
  sequence) decodes from a paged cache with the default decode backend; these were refused."""
  module, x = make(), _x(5, seed=2)
  cache = module.init_paged_cache(2, num_pages=8, page_size=2)
  ref, _ = _step(module, cache, x)
  for impl in ("cpu", "cudnn", "xla_chunked", ("cpu", "xla"), ("cudnn", "pallas_tpu")):
    got, _ = _step(module, cache, x, implementation=impl)
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5, err_msg=str(impl))
  with pytest.raises(ValueError, match="`implementation` must be None or one of"):
    _step(module, cache, x, implementation="flash")


def test_a_table_entry_outside_the_pool_is_refused():
  """A hand-built table with -1 (or a page past the pool) where a sequence's length reaches: the
  dense paths clamped it to page 0 and read another sequence's keys."""
  from jaxattn.ops.decode import paged_attention, paged_mla_decode
  rng = np.random.default_rng(0)
  pool = jnp.asarray(rng.standard_normal((4, 4, 8)), jnp.float32)
  q = jnp.ones((2, 2, 8))
  lengths = jnp.array([4, 8], jnp.int32)
  paged_attention(q, pool, pool, jnp.array([[0, -1], [2, 3]], jnp.int32), lengths)  # unused -1
  for table, bad in (([[0, -1], [2, -1]], r"\[1, 1\] = -1"), ([[0, 1], [2, 4]], r"\[1, 1\] = 4")):
    with pytest.raises(ValueError, match=r"`page_table`" + bad + r" is not a page of the pool"):
      paged_attention(q, pool, pool, jnp.array(table, jnp.int32), lengths)
    with pytest.raises(ValueError, match=r"`page_table`" + bad):
      paged_mla_decode(q, q[..., :4], pool, pool[..., :4], jnp.array(table, jnp.int32), lengths,
                       scale=0.3)


@pytest.mark.parametrize("make", [gqa, mla], ids=["gqa", "mla"])
def test_running_out_of_pages_under_jit_gives_nan_rows(make):
  """Under jit append cannot raise: the tokens that found no page are dropped.  The rows that lost
  tokens are NaN (they were finite and wrong); the others are unaffected."""
  module, x = make(), _x(4, seed=3)
  # 3 pages of 2 tokens for 2 sequences: after 2 tokens each (2 pages), one page is left.
  cache = module.init_paged_cache(2, num_pages=3, page_size=2)
  _, cache = _step(module, cache, x[:, :2])
  ref, _ = _step(module, module.init_paged_cache(2, num_pages=8, page_size=2), x[:, :3])
  y, cache = _step(module, cache, x[:, 2:3])   # both need a new page; only one is free
  np.testing.assert_array_equal(np.sort(np.asarray(cache.lengths)), [2, 3])
  short = int(np.argmin(np.asarray(cache.lengths)))
  assert np.isnan(np.asarray(y[short])).all()
  np.testing.assert_allclose(y[1 - short], ref[1 - short, 2:3], rtol=2e-5, atol=2e-5)
