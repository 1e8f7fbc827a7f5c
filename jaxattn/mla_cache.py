"""The latent cache of multi-head latent attention (MLA): one compressed row per token and layer.

Each cached token holds ``C + R`` numbers (``C`` = ``kv_lora_rank``, the normalized latent
``c_KV``; ``R`` = ``qk_rope_head_dim``, the one RoPE-rotated key shared by all heads), instead of
the ``K * (H + h)`` of a ``KVCache``.  For DeepSeek-V2/V3 that is 512 + 64 = 576 numbers against
MHA's 2 * 128 * 128 = 32,768 per token per layer (``jaxattn.kv_efficiency``).

The two parts live side by side in one buffer ``kv [B, L, C + R]``, latent first: the absorbed
decode path attends against that row directly as a single shared key of width ``C + R`` whose
first ``C`` entries are also the value (MQA over latents), so no per-step concatenation is needed.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LatentCache:
  """Compressed latents and shared rotated keys of the tokens seen so far, in a fixed-size buffer.

  ``kv [B, L, C + R]``: ``kv[..., :C]`` is ``c_KV`` (after its RMSNorm), ``kv[..., C:]`` the rotated
  shared key ``k_rope``; ``L`` is the capacity.  ``index`` (int32 scalar) is how many positions are
  filled, the same for every batch row; slots ``>= index`` are masked out by the attention call.
  ``kv_lora_rank`` (``C``) is static pytree metadata.
  """

  kv: Float[Array, "B L C+R"]
  index: Int[Array, ""]
  kv_lora_rank: int = dataclasses.field(metadata=dict(static=True))

  @classmethod
  def init(cls, batch: int, max_len: int, kv_lora_rank: int, qk_rope_head_dim: int,
           dtype=jnp.float32) -> "LatentCache":
    for name, v in (("batch", batch), ("max_len", max_len), ("kv_lora_rank", kv_lora_rank),
                    ("qk_rope_head_dim", qk_rope_head_dim)):
      if int(v) < 1:
        raise ValueError(f"LatentCache.init: `{name}` must be >= 1, got {v!r}.")
    return cls(kv=jnp.zeros((batch, max_len, kv_lora_rank + qk_rope_head_dim), dtype),
               index=jnp.zeros((), jnp.int32), kv_lora_rank=int(kv_lora_rank))

  @property
  def max_len(self) -> int:
    return self.kv.shape[1]

  @property
  def qk_rope_head_dim(self) -> int:
    return self.kv.shape[2] - self.kv_lora_rank

  @property
  def c_kv(self) -> Float[Array, "B L C"]:
    """The cached latents ``c_KV``."""
    return self.kv[..., :self.kv_lora_rank]

  @property
  def k_rope(self) -> Float[Array, "B L R"]:
    """The cached rotated keys shared by all heads."""
    return self.kv[..., self.kv_lora_rank:]

  @property
  def nbytes(self) -> int:
    """Bytes held by the buffer at full capacity: ``B * L * (C + R) * bytes``."""
    return int(self.kv.size * self.kv.dtype.itemsize)

  def update(self, c_kv: Float[Array, "B T C"], k_rope: Float[Array, "B T R"]) -> "LatentCache":
    """Writes ``T`` new positions at ``index`` and advances it."""
    b, _, width = self.kv.shape
    rank = self.kv_lora_rank
    if c_kv.ndim != 3 or c_kv.shape[0] != b or c_kv.shape[2] != rank:
      raise ValueError(f"`c_kv` {c_kv.shape} does not fit the cache: expected [B={b}, T, C={rank}].")
    if k_rope.shape != c_kv.shape[:2] + (width - rank,):
      raise ValueError(f"`k_rope` {k_rope.shape} does not fit the cache: expected "
                       f"{c_kv.shape[:2] + (width - rank,)} ([B, T, R]).")
    t = c_kv.shape[1]
    if t > self.max_len:
      raise ValueError(f"{t} new tokens exceed the cache capacity max_len={self.max_len}.")
    if not isinstance(self.index, jax.core.Tracer) and int(self.index) + t > self.max_len:
      raise ValueError(f"cache overflow: index {int(self.index)} + {t} new tokens > max_len "
                       f"{self.max_len}.")
    row = jnp.concatenate([c_kv.astype(self.kv.dtype), k_rope.astype(self.kv.dtype)], axis=-1)
    return LatentCache(kv=jax.lax.dynamic_update_slice(self.kv, row, (0, self.index, 0)),
                       index=self.index + t, kv_lora_rank=rank)
