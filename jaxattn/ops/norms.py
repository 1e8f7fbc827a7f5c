"""Normalization formulas (seed section 3.8): statistics over the last (feature) axis, in fp32.

    LayerNorm(x) = gamma * (x - mean) / sqrt(var + eps) + beta
    RMSNorm(x)   = gamma * x / sqrt(mean(x^2) + eps)

``zero_centered_scale=True`` uses ``(1 + gamma)`` (Gemma / Qwen3-Next store the scale as an offset
from one, so a zero-initialized parameter is the identity).  The result has the input's dtype.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from jaxattn.checks import check_nonnegative


def _check_eps(eps):
  check_nonnegative("eps", eps)


def _check_param(name, p, d):
  if p is not None and np.shape(p) != (d,):
    raise ValueError(f"`{name}` must have shape ({d},) to match the feature axis, got "
                     f"{np.shape(p)}.")


def layer_norm(
    x: Float[Array, "*B D"],
    scale: Float[Array, "D"] | None = None,
    bias: Float[Array, "D"] | None = None,
    *,
    eps: float = 1e-6,
    zero_centered_scale: bool = False,
) -> Float[Array, "*B D"]:
  """LayerNorm over the last axis; mean and variance in fp32."""
  _check_eps(eps)
  _check_param("scale", scale, x.shape[-1])
  _check_param("bias", bias, x.shape[-1])
  xf = x.astype(jnp.float32)
  mean = jnp.mean(xf, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
  y = (xf - mean) * jnp.reciprocal(jnp.sqrt(var + eps))
  if scale is not None:
    s = jnp.asarray(scale, jnp.float32)
    y = y * (1.0 + s if zero_centered_scale else s)
  if bias is not None:
    y = y + jnp.asarray(bias, jnp.float32)
  return y.astype(x.dtype)


def rms_norm(
    x: Float[Array, "*B D"],
    scale: Float[Array, "D"] | None = None,
    *,
    eps: float = 1e-6,
    zero_centered_scale: bool = False,
) -> Float[Array, "*B D"]:
  """RMSNorm over the last axis; mean square in fp32, no centering and no shift."""
  _check_eps(eps)
  _check_param("scale", scale, x.shape[-1])
  xf = x.astype(jnp.float32)
  ms = jnp.mean(jnp.square(xf), axis=-1, keepdims=True)
  y = xf * jnp.reciprocal(jnp.sqrt(ms + eps))
  if scale is not None:
    s = jnp.asarray(scale, jnp.float32)
    y = y * (1.0 + s if zero_centered_scale else s)
  return y.astype(x.dtype)
