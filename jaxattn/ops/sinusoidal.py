"""Sinusoidal absolute positional encoding ("Attention Is All You Need", section 3.5).

``PE(m, 2i) = sin(m * w_i)``, ``PE(m, 2i + 1) = cos(m * w_i)``, ``w_i = base ** (-2i / D)``: one
sine/cosine "clock" per pair of dimensions, fast for small ``i`` and slow for large ``i``.  The dot
product of two encodings, ``sum_i cos(w_i (m - n))``, depends only on the offset ``m - n``.

Shape letters: ``B`` batch (any number of leading dims), ``T`` sequence, ``D`` encoding size.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxattn.checks import check_int_array, check_positive, is_int


@functools.partial(jax.jit, static_argnames=("dim", "base", "interleaved"))
def sinusoidal_positions(
    positions: Int[Array, "*B T"],
    dim: int,
    *,
    base: float = 10000.0,
    interleaved: bool = True,
) -> Float[Array, "*B T D"]:
  """The fp32 sinusoidal encoding ``[*B, T, D]`` of integer ``positions`` ``[*B, T]``.

  ``interleaved=True`` gives the paper's layout (sin at even dims, cos at odd dims);
  ``interleaved=False`` the concatenated ``[sin_0..sin_{D/2-1}, cos_0..cos_{D/2-1}]`` layout that
  several codebases use (the same numbers, permuted).
  """
  if not is_int(dim) or dim <= 0 or dim % 2:
    raise ValueError(f"`dim`={dim!r} must be a positive even integer (dimensions come in sin/cos "
                     "pairs).")
  check_positive("base", base)  # the frequencies are base ** (-2i / D)
  positions = jnp.asarray(positions)
  check_int_array("positions", positions)
  freqs = 1.0 / (base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))  # w_i, [D/2]
  # fp32 angles: a low-precision position would be off by whole radians at large m.
  angles = positions.astype(jnp.float32)[..., None] * freqs                 # [*B, T, D/2]
  sin, cos = jnp.sin(angles), jnp.cos(angles)
  if interleaved:
    return jnp.stack([sin, cos], axis=-1).reshape(*angles.shape[:-1], dim)
  return jnp.concatenate([sin, cos], axis=-1)
