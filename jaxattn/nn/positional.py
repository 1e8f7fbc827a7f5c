"""Positional modules that own parameters: a learned absolute table and T5's relative bias.

The parameter-free schemes are plain functions in ``jaxattn.ops`` (``sinusoidal_positions``,
``apply_rope``, ``alibi_slopes``/``alibi_bias``).

Shape letters: ``B`` batch (any number of leading dims), ``T`` queries, ``S`` keys, ``N`` heads,
``D`` embedding size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from jaxattn.nn.linear import Initializer, param
from jaxattn.ops.t5_bias import check_bucket_args, t5_position_bias


def _concrete(x) -> np.ndarray | None:
  """``x`` as a NumPy array when its values are known now, None when it is traced."""
  try:
    return np.asarray(x)
  except jax.errors.TracerArrayConversionError:
    return None


class LearnedPositionalEmbedding(nnx.Module):
  """A trainable table ``P [max_len, D]``; position ``m`` gets row ``P[m]`` (GPT-2, BERT).

  It cannot extrapolate: a position ``>= max_len`` has no row.  Concrete positions are checked and
  raise ``ValueError``; traced positions (inside ``jit``) cannot raise, so out-of-range rows come
  back as NaN (``jnp.take(..., mode="fill")``) rather than silently repeating the last row.
  """

  def __init__(self, max_len: int, dim: int, *, rngs: nnx.Rngs, dtype=None,
               param_dtype=jnp.float32,
               embedding_init: Initializer = nnx.initializers.normal(stddev=0.02)):
    if max_len < 1 or dim < 1:
      raise ValueError(f"`max_len`={max_len} and `dim`={dim} must both be >= 1.")
    self.max_len, self.dim, self.dtype = max_len, dim, dtype
    self.embedding = param(rngs, embedding_init, (max_len, dim), ("position", "embed"), param_dtype)

  def __call__(self, positions: Int[Array, "*B T"], *, check: bool = True) -> Float[Array, "*B T D"]:
    """Rows ``P[positions]`` ``[*B, T, D]``, in ``dtype`` (default: ``param_dtype``).

    With ``check`` (default), concrete positions outside ``[0, max_len)`` raise ``ValueError``.
    """
    positions = jnp.asarray(positions)
    if not jnp.issubdtype(positions.dtype, jnp.integer):
      raise ValueError(f"`positions` must be integers, got dtype {positions.dtype}.")
    values = _concrete(positions) if check else None
    if values is not None and values.size and (values.min() < 0 or values.max() >= self.max_len):
      raise ValueError(f"`positions` range over [{values.min()}, {values.max()}], but the learned "
                       f"table has rows for [0, {self.max_len - 1}] only (max_len={self.max_len}); "
                       "a learned table cannot extrapolate.")
    # `take` wraps negative indices NumPy-style (-1 is the last row), so they are sent past the
    # table first: every position outside [0, max_len) then comes back as NaN.
    positions = jnp.where(positions < 0, self.max_len, positions)
    out = jnp.take(self.embedding[...], positions, axis=0, mode="fill", fill_value=jnp.nan)
    return out if self.dtype is None else out.astype(self.dtype)


class T5RelativePositionBias(nnx.Module):
  """T5's learned bias ``table [num_buckets, N]`` indexed by the bucket of ``kv - q`` per head.

  Encoders use ``bidirectional=True``; decoders (causal self-attention) ``False``.
  """

  def __init__(self, num_heads: int, *, bidirectional: bool = True, num_buckets: int = 32,
               max_distance: int = 128, rngs: nnx.Rngs, param_dtype=jnp.float32,
               embedding_init: Initializer = nnx.initializers.variance_scaling(
                   1.0, "fan_avg", "uniform")):
    if num_heads < 1:
      raise ValueError(f"`num_heads`={num_heads} must be >= 1.")
    check_bucket_args(num_buckets, max_distance, bidirectional)
    self.num_heads = num_heads
    self.bidirectional, self.num_buckets, self.max_distance = bidirectional, num_buckets, max_distance
    self.embedding = param(rngs, embedding_init, (num_buckets, num_heads),
                           ("relpos_buckets", "heads"), param_dtype)

  def __call__(self, q_positions: Int[Array, "*B T"],
               kv_positions: Int[Array, "*B S"]) -> Float[Array, "#B N T S"]:
    """The fp32 bias ``[1, N, T, S]`` for 1-D positions (``[*B, N, T, S]`` for batched ones)."""
    return t5_position_bias(self.embedding[...], q_positions, kv_positions,
                            bidirectional=self.bidirectional, num_buckets=self.num_buckets,
                            max_distance=self.max_distance)
