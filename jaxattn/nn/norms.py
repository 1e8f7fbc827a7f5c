"""LayerNorm and RMSNorm modules over ``jaxattn.ops.norms`` (fp32 statistics)."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxattn.nn.linear import param
from jaxattn.ops import norms


class LayerNorm(nnx.Module):
  """``gamma * (x - mean) / sqrt(var + eps) + beta`` over the last axis."""

  def __init__(self, dim: int, *, eps: float = 1e-6, use_bias: bool = True,
               zero_centered_scale: bool = False, rngs: nnx.Rngs, param_dtype=jnp.float32):
    self.eps, self.zero_centered_scale = eps, zero_centered_scale
    scale_init = nnx.initializers.zeros_init() if zero_centered_scale else nnx.initializers.ones_init()
    self.scale = param(rngs, scale_init, (dim,), ("norm",), param_dtype)
    self.bias = param(rngs, nnx.initializers.zeros_init(), (dim,), ("norm",), param_dtype) if use_bias else None

  def __call__(self, x):
    return norms.layer_norm(x, self.scale[...], None if self.bias is None else self.bias[...],
                            eps=self.eps, zero_centered_scale=self.zero_centered_scale)


class RMSNorm(nnx.Module):
  """``gamma * x / sqrt(mean(x^2) + eps)`` over the last axis (``(1 + gamma)`` if zero-centered)."""

  def __init__(self, dim: int, *, eps: float = 1e-6, zero_centered_scale: bool = False,
               rngs: nnx.Rngs, param_dtype=jnp.float32):
    self.eps, self.zero_centered_scale = eps, zero_centered_scale
    scale_init = nnx.initializers.zeros_init() if zero_centered_scale else nnx.initializers.ones_init()
    self.scale = param(rngs, scale_init, (dim,), ("norm",), param_dtype)

  def __call__(self, x):
    return norms.rms_norm(x, self.scale[...], eps=self.eps,
                          zero_centered_scale=self.zero_centered_scale)


def make_norm(kind: str, dim: int, *, eps: float, rngs: nnx.Rngs, param_dtype=jnp.float32):
  """``kind`` in {"rms", "layer"}."""
  if kind == "rms":
    return RMSNorm(dim, eps=eps, rngs=rngs, param_dtype=param_dtype)
  if kind == "layer":
    return LayerNorm(dim, eps=eps, rngs=rngs, param_dtype=param_dtype)
  raise ValueError(f"`norm` must be 'rms' or 'layer', got {kind!r}.")
