"""Parameter creation with logical axis names, and the einsum projection every module uses."""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

Initializer = Callable[..., jax.Array]


def param(rngs: nnx.Rngs, init: Initializer, shape: Sequence[int], logical_axes: Sequence[str | None],
          param_dtype=jnp.float32) -> nnx.Param:
  """An ``nnx.Param`` whose metadata names each axis (see ``jaxattn.sharding``)."""
  if len(logical_axes) != len(shape):
    raise ValueError(f"`logical_axes` {tuple(logical_axes)} must name each of the {len(shape)} dims "
                     f"of shape {tuple(shape)}.")
  return nnx.Param(init(rngs.params(), tuple(shape), param_dtype), logical_axes=tuple(logical_axes))


class Einsum(nnx.Module):
  """``y = einsum(spec, x, W) (+ b)``: a linear map whose kernel has named, possibly split axes.

  E.g. the query projection ``Einsum("BTD,DNH->BTNH", (D, N, H), ("embed", "heads", "head_dim"))``.
  The kernel is stored in ``param_dtype`` and cast to ``dtype`` (default: the input's dtype) for the
  matmul.  ``fan_in_axes`` tells the default LeCun-normal initializer which kernel axes are inputs.
  """

  def __init__(self, spec: str, shape: Sequence[int], logical_axes: Sequence[str | None], *,
               rngs: nnx.Rngs, fan_in_axes: Sequence[int] = (0,), use_bias: bool = False,
               kernel_init: Initializer | None = None, dtype=None, param_dtype=jnp.float32):
    self.spec = spec
    self.dtype = dtype
    shape = tuple(int(s) for s in shape)
    out_axes = tuple(i for i in range(len(shape)) if i not in fan_in_axes)
    init = kernel_init or nnx.initializers.variance_scaling(
        1.0, "fan_in", "truncated_normal", in_axis=tuple(fan_in_axes), out_axis=out_axes)
    self.kernel = param(rngs, init, shape, logical_axes, param_dtype)
    if use_bias:
      out_shape = tuple(shape[i] for i in out_axes)
      out_names = tuple(logical_axes[i] for i in out_axes)
      self.bias = param(rngs, nnx.initializers.zeros_init(), out_shape, out_names, param_dtype)
    else:
      self.bias = None

  def __call__(self, x: jax.Array) -> jax.Array:
    dtype = self.dtype or x.dtype
    y = jnp.einsum(self.spec, x.astype(dtype), self.kernel[...].astype(dtype))
    if self.bias is not None:
      y = y + self.bias[...].astype(dtype)
    return y


def effective_kernel(layer) -> jax.Array:
  """The kernel a projection layer applies, for code that uses it as a matrix rather than calling
  the layer (MLA's matrix absorption): ``layer.kernel`` for ``Einsum`` / ``nnx.Linear``, or
  ``layer.effective_kernel()`` for wrappers that define it (a LoRA adapter: base + ``scaling * A
  B``; an NF4 base: the dequantized kernel)."""
  fn = getattr(layer, "effective_kernel", None)
  return fn() if callable(fn) else layer.kernel[...]
