"""ALiBi: attention with linear biases (Press et al., 2021).

``score(m, n) = q_m . k_n * scale + slope_h * (n - m)``: a fixed, per-head penalty proportional to
the distance back to the key (negative for past keys, ``n < m``).  No parameters, and the penalty
extends to any length.  This is the paper's causal ALiBi: with a non-causal mask, keys after the
query (``n > m``) get a positive bias, not a distance penalty.  The slopes form a geometric
sequence ``2 ** (-8k / N)``, ``k = 1..N``, for a power-of-two head count ``N``; other counts take
the ``P`` slopes of the largest power of two ``P < N`` and then every other slope of the ``2P``
sequence (the paper's interpolation, also transformers' Bloom).

Shape letters: ``B`` batch (any number of leading dims), ``T`` queries, ``S`` keys, ``N`` heads.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxattn.checks import check_int_array, is_int


def alibi_slopes(num_heads: int) -> Float[Array, "N"]:
  """The fp32 ALiBi slopes ``[N]`` (positive; the bias is ``slope * (n - m)``)."""
  if not is_int(num_heads) or num_heads < 1:
    raise ValueError(f"`num_heads`={num_heads!r} must be an integer >= 1.")
  p = 2 ** int(math.floor(math.log2(num_heads)))
  exponents = [8.0 * k / p for k in range(1, p + 1)]
  # Remaining heads: odd powers 1, 3, 5, ... of the 2P sequence's ratio 2 ** (-8 / 2P).
  exponents += [8.0 * k / (2 * p) for k in range(1, 2 * (num_heads - p), 2)]
  # Exact powers of two in fp64, rounded once to fp32 (Bloom raises an fp32-rounded ratio to the
  # k-th power, so its slopes differ from these by up to about k fp32 ulps).
  return jnp.asarray(np.exp2(-np.asarray(exponents, np.float64)).astype(np.float32))


@jax.jit
def alibi_bias(
    slopes: Float[Array, "N"],
    q_positions: Int[Array, "*B T"],
    kv_positions: Int[Array, "*B S"],
) -> Float[Array, "*B N T S"]:
  """The additive fp32 bias ``slope * (kv - q)``: ``[N, T, S]`` for 1-D positions, else ``[*B, N, T, S]``.

  Not positive for keys at or before the query.  Bloom adds ``slope * kv`` instead; the two differ
  by ``slope * q``, constant along each softmax row, so the attention weights are the same.
  """
  slopes = jnp.asarray(slopes, jnp.float32)
  if slopes.ndim != 1:
    raise ValueError(f"`slopes` must be [N], got shape {slopes.shape}.")
  q_positions = jnp.asarray(q_positions)
  kv_positions = jnp.asarray(kv_positions)
  if q_positions.ndim < 1 or kv_positions.ndim < 1:
    raise ValueError(f"`q_positions` {q_positions.shape} and `kv_positions` {kv_positions.shape} "
                     "must be [*B, T] and [*B, S].")
  check_int_array("q_positions", q_positions)
  check_int_array("kv_positions", kv_positions)
  # Integer difference first: exact, then one rounding to fp32.
  relative = (kv_positions[..., None, :] - q_positions[..., :, None]).astype(jnp.float32)  # [*B,T,S]
  return slopes[:, None, None] * relative[..., None, :, :]                                # [*B,N,T,S]
