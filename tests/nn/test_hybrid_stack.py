"""Hybrid stacks of Gated DeltaNet and attention layers: structure, decode equals the full pass,
cache sizes, errors.  Tolerance 5e-5 (fp32, several layers of reassociated sums)."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxattn.cache import KVCache
from jaxattn.nn.attention import Attention
from jaxattn.nn.gated_deltanet import DeltaNetCache, GatedDeltaNet
from jaxattn.nn.hybrid import DeltaNetBlock, HybridStack

D = 32


@functools.lru_cache(maxsize=None)
def _stack(pattern="DSA"):
  """Built once per pattern (eager initialization compiles every initializer); tests only read."""
  return HybridStack(D, pattern, num_heads=4, mlp_dim=64, sliding_window=3,
                     attention=dict(num_kv_heads=2),
                     deltanet=dict(num_key_heads=2, head_dim=8, chunk_size=4), rngs=nnx.Rngs(0))


def _x(t=10, b=2):
  return jnp.asarray(np.random.default_rng(0).standard_normal((b, t, D)), jnp.float32)


def test_pattern_builds_the_layers_in_order():
  stack = _stack("DSA")
  kinds = [type(layer) for layer in stack.layers]
  assert kinds[0] is DeltaNetBlock and isinstance(stack.layers[0].mixer, GatedDeltaNet)
  assert isinstance(stack.layers[1].attn, Attention) and stack.layers[1].attn.sliding_window == 3
  assert isinstance(stack.layers[2].attn, Attention) and stack.layers[2].attn.sliding_window is None
  assert stack.layers[2].attn.num_kv_heads == 2
  assert stack.layers[0].mixer.num_key_heads == 2


def test_prefill_then_decode_equals_full_pass():
  stack = _stack("DSA")
  x = _x()
  full = nnx.jit(lambda m, x: m(x))(stack, x)
  cache = stack.init_cache(batch=2, max_len=16)
  assert [type(c) for c in cache] == [DeltaNetCache, KVCache, KVCache]
  step = nnx.jit(lambda m, c, x: m(x, cache=c))
  y0, cache = step(stack, cache, x[:, :4])
  outs = [y0]
  for t in range(4, 10):
    yt, cache = step(stack, cache, x[:, t:t + 1])
    outs.append(yt)
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, atol=5e-5, rtol=5e-5)
  assert int(cache[2].index) == 10


def test_cache_bytes_deltanet_constant_attention_linear():
  stack = _stack()
  dn = stack.layers[0].mixer.cache_bytes(0)
  per_token = stack.layers[1].attn.cache_bytes(1) + stack.layers[2].attn.cache_bytes(1)
  for t in (1, 100, 10000):
    assert stack.cache_bytes(t) == dn + t * per_token


def test_errors():
  with pytest.raises(ValueError, match="`pattern` must be a non-empty string"):
    _stack("DXA")
  with pytest.raises(ValueError, match="`pattern` must be a non-empty string"):
    _stack("")
  with pytest.raises(ValueError, match="`sliding_window` must be a non-negative int"):
    HybridStack(D, "DS", num_heads=4, mlp_dim=64, rngs=nnx.Rngs(0))
  stack = _stack()
  with pytest.raises(ValueError, match="`cache` has 1 entries for 3 layers"):
    stack(_x(), cache=(stack.layers[0].init_cache(2),))
  with pytest.raises(ValueError, match="`mask` is not supported"):
    stack.layers[0](_x(), mask=jnp.ones((1, 1, 10, 10), bool))


def test_norm_eps_reaches_every_norm():
  # One epsilon for the whole stack: the block norms, the QK norm and the gated norm.
  stack = HybridStack(D, "DA", num_heads=4, mlp_dim=64, norm_eps=1e-5,
                      attention=dict(num_kv_heads=2, qk_norm=True),
                      deltanet=dict(num_key_heads=2, head_dim=8), rngs=nnx.Rngs(0))
  dn, attn = stack.layers
  assert dn.mixer_norm.eps == dn.mlp_norm.eps == dn.mixer.norm_eps == 1e-5
  assert attn.attn_norm.eps == attn.attn.q_norm.eps == attn.attn.k_norm.eps == 1e-5
  for name in ("attention", "deltanet"):
    with pytest.raises(ValueError, match=f"`{name}` sets norm_eps=0.001: set `norm_eps` on the"):
      HybridStack(D, "DA", num_heads=4, mlp_dim=64, rngs=nnx.Rngs(0), **{name: dict(norm_eps=1e-3)})


def test_extra_kwargs_that_the_stack_sets_itself_are_a_value_error():
  # Before: TypeError "got multiple values for keyword argument".
  for name, key, value in (("attention", "sliding_window", 4), ("attention", "num_heads", 2),
                           ("deltanet", "dtype", jnp.bfloat16), ("attention", "param_dtype", None),
                           ("deltanet", "norm", "layer"), ("deltanet", "rngs", None)):
    with pytest.raises(ValueError, match=f"`{name}` sets {key}=.*: set `{key}` on the HybridStack"):
      HybridStack(D, "DA", num_heads=4, mlp_dim=64, rngs=nnx.Rngs(0), **{name: {key: value}})
  # The Gated DeltaNet's head count is the one override the stack allows.
  stack = HybridStack(D, "DA", num_heads=4, mlp_dim=64, deltanet=dict(num_heads=2),
                      rngs=nnx.Rngs(0))
  assert stack.layers[0].mixer.num_heads == 2
