"""Linen users reach the NNX attention module through flax.nnx.bridge.to_linen."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import nnx
from flax.nnx import bridge

from jaxattn.nn.attention import Attention


class LinenModel(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(32, name="embed")(x)
    return bridge.to_linen(Attention, 32, 4, num_kv_heads=2, name="attn")(x)


def test_attention_inside_a_linen_model_matches_nnx():
  x = jax.random.normal(jax.random.key(0), (2, 6, 16))
  model = LinenModel()
  variables = model.init(jax.random.key(1), x)
  y = jax.jit(model.apply)(variables, x)
  assert y.shape == (2, 6, 32)

  params = nn.meta.unbox(variables["params"])
  attn = Attention(32, 4, num_kv_heads=2, rngs=nnx.Rngs(7))
  for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
    getattr(attn, name).kernel[...] = params["attn"][name]["kernel"]
  h = x @ params["embed"]["kernel"] + params["embed"]["bias"]
  np.testing.assert_allclose(y, attn(h), atol=1e-5)
  # Logical axis names survive into the Linen variables as metadata.
  meta = variables["params"]["attn"]["q_proj"]["kernel"]
  assert meta.metadata["logical_axes"] == ("embed", "heads", "head_dim")
  # And it trains: gradients flow to the bridged parameters.
  g = jax.grad(lambda p: jnp.sum(model.apply({"params": p}, x) ** 2))(variables["params"])
  gk = nn.meta.unbox(g)["attn"]["k_proj"]["kernel"]
  assert float(jnp.abs(gk).sum()) > 0
