"""Explicit cache pytrees.  Decode is ``(module, cache, x) -> (y, cache)`` and equals the full pass."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """Keys and values of the tokens seen so far, in a fixed-size buffer.

  ``key [B, L, K, H]``, ``value [B, L, K, h]`` where ``L`` is the capacity; ``index`` (int32 scalar)
  is how many positions are filled, the same for every batch row.  Slots ``>= index`` are masked out
  by the attention call (``kv_lengths``), so their contents never matter.
  """

  key: Float[Array, "B L K H"]
  value: Float[Array, "B L K h"]
  index: Int[Array, ""]

  @classmethod
  def init(cls, batch: int, max_len: int, num_kv_heads: int, head_dim: int,
           v_head_dim: int | None = None, dtype=jnp.float32) -> "KVCache":
    for name, v in (("batch", batch), ("max_len", max_len), ("num_kv_heads", num_kv_heads),
                    ("head_dim", head_dim)):
      if int(v) < 1:
        raise ValueError(f"KVCache.init: `{name}` must be >= 1, got {v!r}.")
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    return cls(key=jnp.zeros((batch, max_len, num_kv_heads, head_dim), dtype),
               value=jnp.zeros((batch, max_len, num_kv_heads, v_head_dim), dtype),
               index=jnp.zeros((), jnp.int32))

  @property
  def max_len(self) -> int:
    return self.key.shape[1]

  @property
  def nbytes(self) -> int:
    """Bytes held by the buffers at full capacity (the seed's ``2 x n x h x d x bytes`` per layer)."""
    return int(self.key.size * self.key.dtype.itemsize + self.value.size * self.value.dtype.itemsize)

  def update(self, key: Float[Array, "B T K H"], value: Float[Array, "B T K h"]) -> "KVCache":
    """Writes ``T`` new positions at ``index`` and advances it."""
    t = key.shape[1]
    if key.shape[0] != self.key.shape[0] or key.shape[2:] != self.key.shape[2:]:
      raise ValueError(f"`key` {key.shape} does not fit the cache buffer {self.key.shape}.")
    if value.shape[:2] != key.shape[:2] or value.shape[2:] != self.value.shape[2:]:
      raise ValueError(f"`value` {value.shape} does not fit the cache buffer {self.value.shape}.")
    if t > self.max_len:
      raise ValueError(f"{t} new tokens exceed the cache capacity max_len={self.max_len}.")
    if not isinstance(self.index, jax.core.Tracer) and int(self.index) + t > self.max_len:
      raise ValueError(f"cache overflow: index {int(self.index)} + {t} new tokens > max_len "
                       f"{self.max_len}.")
    start = (0, self.index, 0, 0)
    return KVCache(
        key=jax.lax.dynamic_update_slice(self.key, key.astype(self.key.dtype), start),
        value=jax.lax.dynamic_update_slice(self.value, value.astype(self.value.dtype), start),
        index=self.index + t)


def kv_cache_bytes_per_token(num_kv_heads: int, head_dim: int, dtype=jnp.bfloat16,
                             v_head_dim: int | None = None) -> int:
  """Per-token, per-layer KV cache bytes: ``K * (H + h) * bytes`` (= ``2 K H bytes`` when h = H)."""
  v_head_dim = head_dim if v_head_dim is None else v_head_dim
  return int(num_kv_heads * (head_dim + v_head_dim) * np.dtype(dtype).itemsize)
