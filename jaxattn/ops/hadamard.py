"""Fast Walsh-Hadamard transform with orthonormal scaling (DSA's rotation before quantization).

Seed 3.7 "Quantization + Hadamard Rotation": ``H_n`` (Sylvester order, ``H_2 = [[1, 1], [1, -1]]``,
``H_2n = [[H_n, H_n], [H_n, -H_n]]``) scaled by ``1/sqrt(n)`` is orthonormal and symmetric, so
``H^T H = I`` and ``(H q) . (H k) = q . k``: rotating both indexer queries and keys leaves their
scores unchanged while spreading a spiky vector's energy over all coordinates (``[8, 0, 0, 0]`` ->
``[4, 4, 4, 4]``), which keeps small entries alive after 8-bit quantization.
"""

from __future__ import annotations

import functools

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jaxattn.checks import is_int


def _check_size(n: int, axis: int) -> None:
  if n < 1 or n & (n - 1):
    raise ValueError(f"hadamard_transform: the size of `axis`={axis} must be a power of two "
                     f"(1, 2, 4, ...), got {n}.")


@functools.partial(jax.jit, static_argnames=('axis',))
def hadamard_transform(x: Float[Array, "..."], *, axis: int = -1) -> Float[Array, "..."]:
  """``H_n x / sqrt(n)`` along ``axis`` (size ``n``, a power of two), in O(n log n) per vector.

  Butterfly form: at each of ``log2(n)`` stages, split the axis into pairs of halves ``(a, b)``
  and replace them with ``(a + b, a - b)``; scaling by ``1/sqrt(n)`` once at the end makes the
  transform orthonormal (and its own inverse).  Computed in fp32, returned in ``x``'s dtype.
  """
  if x.ndim == 0:
    raise ValueError(f"hadamard_transform: `x` must have at least one axis, got shape {x.shape}.")
  if not jnp.issubdtype(x.dtype, jnp.floating):  # the result would be cut back to integers
    raise ValueError(f"hadamard_transform: `x` must be a floating-point array, got dtype "
                     f"{x.dtype}.")
  if not -x.ndim <= axis < x.ndim:
    raise ValueError(f"hadamard_transform: `axis`={axis} out of range for shape {x.shape}.")
  axis = axis % x.ndim
  n = x.shape[axis]
  _check_size(n, axis)
  y = jnp.moveaxis(x.astype(jnp.float32), axis, -1)
  lead = y.shape[:-1]
  h = 1
  while h < n:
    # [..., n/(2h), 2, h]: index 0 / 1 of the size-2 axis are the two halves of each block.
    y = y.reshape(lead + (n // (2 * h), 2, h))
    a, b = y[..., 0, :], y[..., 1, :]
    y = jnp.stack([a + b, a - b], axis=-2).reshape(lead + (n,))
    h *= 2
  y = y * (1.0 / math.sqrt(n))
  return jnp.moveaxis(y, -1, axis).astype(x.dtype)


def hadamard_matrix(n: int) -> Float[Array, "n n"]:
  """The orthonormal Sylvester Hadamard matrix ``H_n / sqrt(n)`` (fp32), for tests and reference."""
  if not is_int(n):
    raise ValueError(f"hadamard_matrix: `n` must be an int (a power of two), got {n!r}.")
  _check_size(n, 0)
  h = jnp.ones((1, 1), jnp.float32)
  while h.shape[0] < n:
    h = jnp.block([[h, h], [h, -h]])
  return h / math.sqrt(n)
