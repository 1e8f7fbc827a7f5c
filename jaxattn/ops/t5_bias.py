"""T5 relative position bias: a learned scalar per head and per bucket of the offset ``n - m``.

``score(m, n) = q_m . k_n * scale + table[bucket(n - m), head]``.  Offsets below ``max_exact`` (half
the buckets) get a bucket each; larger ones share logarithmically wider buckets up to
``max_distance``, past which everything falls into the last bucket.  Bidirectional (encoder) biases
spend half the buckets on future keys; causal (decoder) ones map every future key to bucket 0.

Shape letters: ``B`` batch (any number of leading dims), ``T`` queries, ``S`` keys, ``N`` heads.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxattn.checks import check_int_array, is_int, is_number


def check_bucket_args(num_buckets: int, max_distance: int, bidirectional: bool) -> None:
  """Raises ValueError unless the bucketing is well defined (at least one exact and one log bucket)."""
  if not is_int(num_buckets):
    raise ValueError(f"`num_buckets`={num_buckets!r} must be an int >= "
                     f"{4 if bidirectional else 2} (bidirectional={bidirectional}).")
  half = num_buckets // 2 if bidirectional else num_buckets
  if half < 2:
    raise ValueError(f"`num_buckets`={num_buckets!r} is too small: need >= {4 if bidirectional else 2} "
                     f"(bidirectional={bidirectional}).")
  max_exact = half // 2
  if not is_number(max_distance) or not math.isfinite(max_distance) or not max_distance > max_exact:
    raise ValueError(f"`max_distance`={max_distance!r} must be a finite number exceeding the "
                     f"exact-bucket range {max_exact} (num_buckets={num_buckets}, "
                     f"bidirectional={bidirectional}).")


# jit: one compiled computation per shape and setting instead of a dozen eager ops.
@functools.partial(jax.jit, static_argnames=("bidirectional", "num_buckets", "max_distance"))
def t5_relative_position_bucket(
    relative_position: Int[Array, "*shape"],
    *,
    bidirectional: bool = True,
    num_buckets: int = 32,
    max_distance: int = 128,
) -> Int[Array, "*shape"]:
  """Bucket (int32 in ``[0, num_buckets)``) of each ``relative_position = key_pos - query_pos``.

  Bit for bit transformers' ``T5Attention._relative_position_bucket`` (which follows Mesh
  TensorFlow), including its fp32 logarithm and truncation toward zero.
  """
  check_bucket_args(num_buckets, max_distance, bidirectional)
  rel = jnp.asarray(relative_position)
  check_int_array("relative_position", rel)
  rel = rel.astype(jnp.int32)
  bucket = jnp.zeros_like(rel)
  if bidirectional:
    num_buckets //= 2
    bucket = bucket + (rel > 0).astype(jnp.int32) * num_buckets  # keys after the query
    rel = jnp.abs(rel)
  else:
    rel = -jnp.minimum(rel, 0)  # future keys -> 0; distance into the past otherwise
  max_exact = num_buckets // 2
  is_small = rel < max_exact
  # log(rel / max_exact) / log(max_distance / max_exact) spans [0, 1) over [max_exact, max_distance):
  # the upper half of the buckets.  fp32 and the same constant order as the reference, so bucket
  # edges (e.g. rel = 16, where the value is an integer up to rounding) land the same way.
  log_ratio = jnp.log(rel.astype(jnp.float32) / max_exact) / np.float32(
      math.log(max_distance / max_exact))
  large = max_exact + (log_ratio * (num_buckets - max_exact)).astype(jnp.int32)
  large = jnp.minimum(large, num_buckets - 1)
  return bucket + jnp.where(is_small, rel, large)


def t5_position_bias(
    table: Float[Array, "num_buckets N"],
    q_positions: Int[Array, "*B T"],
    kv_positions: Int[Array, "*B S"],
    *,
    bidirectional: bool = True,
    num_buckets: int = 32,
    max_distance: int = 128,
) -> Float[Array, "#B N T S"]:
  """The additive bias ``table[bucket(kv - q)]`` as fp32 ``[1, N, T, S]`` (``[*B, N, T, S]``).

  1-D positions give ``[1, N, T, S]`` like transformers' ``compute_bias``; batched positions (e.g.
  per-sequence offsets) give ``[*B, N, T, S]``.
  """
  table = jnp.asarray(table)
  if table.ndim != 2 or table.shape[0] != num_buckets:
    raise ValueError(f"`table` has shape {table.shape}; expected [num_buckets={num_buckets}, N].")
  q_positions = jnp.asarray(q_positions)
  kv_positions = jnp.asarray(kv_positions)
  if q_positions.ndim < 1 or kv_positions.ndim < 1:
    raise ValueError(f"`q_positions` {q_positions.shape} and `kv_positions` {kv_positions.shape} "
                     "must be [*B, T] and [*B, S].")
  check_int_array("q_positions", q_positions)
  check_int_array("kv_positions", kv_positions)
  relative = kv_positions[..., None, :] - q_positions[..., :, None]  # [*B, T, S]: memory - query
  buckets = t5_relative_position_bucket(relative, bidirectional=bidirectional,
                                        num_buckets=num_buckets, max_distance=max_distance)
  bias = jnp.take(table, buckets, axis=0).astype(jnp.float32)      # [*B, T, S, N]
  bias = jnp.moveaxis(bias, -1, -3)                                  # [*B, N, T, S]
  if bias.ndim == 3:
    bias = bias[None]                                                # [1, N, T, S]
  return bias
