"""A rolling (ring-buffer) KV cache for sliding-window attention: only the last ``w`` tokens.

With a causal window of radius ``w`` (query ``p`` sees keys ``p - w .. p``), a decode step needs
the ``w`` previous keys plus its own, so the cache keeps ``L = max(w, 1)`` slots whatever the
sequence length: token ``p`` lives in slot ``p % L`` and overwrites the one ``L`` positions older.
Memory is ``O(w)`` instead of ``O(max_len)`` (seed 3.7: Mistral's sliding window).

Because the slots are not in position order, each slot records the absolute position it holds
(``-1``: empty) and ``extend`` builds the attention mask from positions, not slot numbers.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from jaxattn.ops.quantization import kv_quantized


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RollingKVCache:
  """``key [B, L, K, H]``, ``value [B, L, K, h]``, ``positions [L]`` (absolute position in each slot,
  ``-1`` empty), ``index`` (int32 scalar: tokens seen so far, the next position); ``window`` ``w``
  (static)."""

  key: Float[Array, "B L K H"]
  value: Float[Array, "B L K h"]
  positions: Int[Array, "L"]
  index: Int[Array, ""]
  window: int = dataclasses.field(metadata=dict(static=True))

  @classmethod
  def init(cls, batch: int, window: int, num_kv_heads: int, head_dim: int,
           v_head_dim: int | None = None, dtype=jnp.float32) -> "RollingKVCache":
    if not isinstance(window, (int, np.integer)) or isinstance(window, bool) or window < 0:
      raise ValueError(f"RollingKVCache.init: `window` must be a non-negative int, got {window!r}.")
    window = int(window)
    for name, v in (("batch", batch), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
      if int(v) < 1:
        raise ValueError(f"RollingKVCache.init: `{name}` must be >= 1, got {v!r}.")
    slots = max(window, 1)
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    if kv_quantized(dtype):
      raise ValueError(f"RollingKVCache.init: `dtype` {jnp.dtype(dtype)} (a quantized cache) is "
                       f"not supported by the ring buffer; use a float dtype, or a KVCache / "
                       f"PagedKVCache for int8 / float8_e4m3fn.")
    return cls(key=jnp.zeros((batch, slots, num_kv_heads, head_dim), dtype),
               value=jnp.zeros((batch, slots, num_kv_heads, v_head_dim), dtype),
               positions=jnp.full((slots,), -1, jnp.int32), index=jnp.zeros((), jnp.int32),
               window=window)

  @property
  def slots(self) -> int:
    return self.key.shape[1]

  @property
  def nbytes(self) -> int:
    """Bytes held: ``B * L * K * (H + h) * bytes``, independent of the sequence length."""
    return int(self.key.size * self.key.dtype.itemsize + self.value.size * self.value.dtype.itemsize)

  def extend(self, key: Float[Array, "B T K H"], value: Float[Array, "B T K h"]
             ) -> tuple[Float[Array, "B S K H"], Float[Array, "B S K h"], Bool[Array, "1 1 T S"],
                        "RollingKVCache"]:
    """Attention inputs for ``T`` new tokens at positions ``index .. index + T - 1`` and the cache
    after them.

    Returns ``(keys, values, mask, cache)``: keys/values ``[B, L + T, ...]`` are the cached slots
    followed by the new tokens; ``mask [1, 1, T, L + T]`` is True where the key's position ``k``
    satisfies ``q - w <= k <= q`` (and the slot is filled).  Any ``T`` works (a long prefill too).
    """
    b, t = key.shape[:2]
    if key.shape[0] != self.key.shape[0] or key.shape[2:] != self.key.shape[2:]:
      raise ValueError(f"`key` {key.shape} does not fit the cache buffer {self.key.shape}.")
    if value.shape[:2] != key.shape[:2] or value.shape[2:] != self.value.shape[2:]:
      raise ValueError(f"`value` {value.shape} does not fit the cache buffer {self.value.shape}.")
    new_pos = self.index + jnp.arange(t, dtype=jnp.int32)                  # [T]
    keys = jnp.concatenate([self.key, key.astype(self.key.dtype)], axis=1)
    values = jnp.concatenate([self.value, value.astype(self.value.dtype)], axis=1)
    k_pos = jnp.concatenate([self.positions, new_pos])                     # [L + T]
    q_pos = new_pos[:, None]
    mask = (k_pos[None] >= 0) & (k_pos[None] <= q_pos) & (q_pos - k_pos[None] <= self.window)
    # Only the last L new tokens can be needed later; write them into their slots p % L.
    keep = min(t, self.slots)
    slots = new_pos[t - keep:] % self.slots
    cache = RollingKVCache(
        key=self.key.at[:, slots].set(key[:, t - keep:].astype(self.key.dtype)),
        value=self.value.at[:, slots].set(value[:, t - keep:].astype(self.value.dtype)),
        positions=self.positions.at[slots].set(new_pos[t - keep:]),
        index=self.index + t, window=self.window)
    return keys, values, mask[None, None], cache
