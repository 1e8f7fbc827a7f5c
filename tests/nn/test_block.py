"""Transformer block: pre- and post-LN placement (seed 3.8), the gated MLP, decode through a block."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxattn.nn.block import TransformerBlock
from jaxattn.nn.mlp import MLP
from jaxattn.ops.norms import layer_norm, rms_norm


def _x(t=6):
  return jax.random.normal(jax.random.key(2), (2, t, 16)) * 2 + 0.5


def test_pre_ln_is_x_plus_sublayer_of_norm():
  blk = TransformerBlock(16, num_heads=4, mlp_dim=32, norm="rms", norm_position="pre",
                         rngs=nnx.Rngs(0))
  x = _x()
  h = x + blk.attn(rms_norm(x, blk.attn_norm.scale[...]))
  want = h + blk.mlp(rms_norm(h, blk.mlp_norm.scale[...]))
  np.testing.assert_allclose(blk(x), want, atol=1e-6)


def test_post_ln_normalizes_the_residual_stream():
  blk = TransformerBlock(16, num_heads=4, mlp_dim=32, norm="layer", norm_position="post",
                         rngs=nnx.Rngs(0))
  x = _x()
  y = np.asarray(blk(x))
  h = layer_norm(x + blk.attn(x), blk.attn_norm.scale[...], blk.attn_norm.bias[...])
  np.testing.assert_allclose(y, layer_norm(h + blk.mlp(h), blk.mlp_norm.scale[...],
                                           blk.mlp_norm.bias[...]), atol=1e-5)
  # With the initial gamma = 1, beta = 0, every output token has mean 0 and variance 1.
  np.testing.assert_allclose(y.mean(-1), 0, atol=1e-5)
  np.testing.assert_allclose(y.var(-1), 1, atol=1e-3)


def test_swiglu_formula():
  mlp = MLP(16, 24, rngs=nnx.Rngs(0))
  x = _x()
  want = (jax.nn.silu(x @ mlp.gate.kernel[...]) * (x @ mlp.up.kernel[...])) @ mlp.down.kernel[...]
  np.testing.assert_allclose(mlp(x), want, atol=1e-5)
  plain = MLP(16, 24, gated=False, activation="gelu", rngs=nnx.Rngs(0))
  assert plain.gate is None
  np.testing.assert_allclose(plain(x), jax.nn.gelu(x @ plain.up.kernel[...]) @ plain.down.kernel[...],
                             atol=1e-5)


def test_block_decode_equals_full():
  blk = TransformerBlock(16, num_heads=4, mlp_dim=32, num_kv_heads=2, sliding_window=2,
                         rngs=nnx.Rngs(0))
  x = _x(t=7)
  full = blk(x)
  cache = blk.init_cache(2, 8)
  ys = []
  for t in range(7):
    y, cache = blk(x[:, t:t + 1], cache=cache)
    ys.append(y)
  np.testing.assert_allclose(jnp.concatenate(ys, 1), full, atol=2e-5)


def test_bad_options_raise():
  with pytest.raises(ValueError, match="norm_position"):
    TransformerBlock(16, num_heads=4, mlp_dim=32, norm_position="sandwich", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="norm"):
    TransformerBlock(16, num_heads=4, mlp_dim=32, norm="batch", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="activation"):
    MLP(16, 32, activation="swish2", rngs=nnx.Rngs(0))
