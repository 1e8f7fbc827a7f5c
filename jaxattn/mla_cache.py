"""The latent cache of multi-head latent attention (MLA): one compressed row per token and layer.

Each cached token holds ``C + R`` numbers (``C`` = ``kv_lora_rank``, the normalized latent
``c_KV``; ``R`` = ``qk_rope_head_dim``, the one RoPE-rotated key shared by all heads), instead of
the ``K * (H + h)`` of a ``KVCache``.  For DeepSeek-V2/V3 that is 512 + 64 = 576 numbers against
MHA's 2 * 128 * 128 = 32,768 per token per layer (``jaxattn.kv_efficiency``).

The two parts live side by side in one buffer ``kv [B, L, C + R_p]``, latent first: the absorbed
decode path attends against that row directly as a single shared key whose first ``C`` entries
are also the value (MQA over latents), so no per-step concatenation is needed.  On TPU ``k^R`` is
stored zero-padded to ``R_p = 128`` columns (``rope_align``, as ``PagedLatentCache`` does): a
``[B, L, 576]`` buffer is not made of whole 128-lane tiles, XLA lays it out with another dimension
minor, and every decode step would re-tile it; ``[B, L, 640]`` is read in place by the decode
kernel (``jaxattn.ops.decode.cache_mla_decode``).

A quantized cache (``dtype`` int8 or float8_e4m3fn; DeepSeek serves MLA from an FP8 latent cache)
keeps the parts apart, as a quantized ``PagedLatentCache`` does: ``kv [B, L, C]`` one-byte codes
of ``c_KV``, ``c_kv_scale [B, 1, L]`` fp32 one scale per token (a reshape away from the paged
scale layout ``[B * L / page, 1, page]``), and ``k_rope_buf [B, L, R_p]`` the rotated key in a
float ``rope_dtype`` (zero-padded as above).  Each array is read in place as pages of itself.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxattn.cache import cache_length
from jaxattn.ops.quantization import check_cache_dtype, kv_quantized, quantize_kv
from jaxattn.paged_cache import default_rope_align, latent_rope_dtype, stored_rope_width


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LatentCache:
  """Compressed latents and shared rotated keys of the tokens seen so far, in a fixed-size buffer.

  ``kv [B, L, C + R_p]``: ``kv[..., :C]`` is ``c_KV`` (after its RMSNorm), ``kv[..., C:C + R]``
  the rotated shared key ``k_rope``, then ``R_p - R`` zero columns (TPU; none elsewhere); ``L`` is
  the capacity.  ``index`` (int32 scalar) is how many positions are filled, the same for every
  batch row; slots ``>= index`` are masked out by the attention call.  ``kv_lora_rank`` (``C``)
  and ``rope_dim`` (``R``; None: all the columns after ``C``) are static pytree metadata.  Writing
  past ``L`` raises with a concrete ``index``; under ``jit`` the layer's output is NaN instead
  (``jaxattn.cache.nan_past_capacity``).

  Quantized (``dtype`` int8 / float8_e4m3fn at ``init``): ``kv [B, L, C]`` holds the codes of
  ``c_KV`` only, ``c_kv_scale [B, 1, L]`` fp32 a scale per token
  (``jaxattn.ops.quantization.quantize_kv``, applied by ``update``) and ``k_rope_buf
  [B, L, R_p]`` the rotated keys in a float dtype; ``c_kv`` dequantizes.  Both are None otherwise.
  """

  kv: Float[Array, "B L C+R_p"]
  index: Int[Array, ""]
  kv_lora_rank: int = dataclasses.field(metadata=dict(static=True))
  rope_dim: int | None = dataclasses.field(default=None, metadata=dict(static=True))
  k_rope_buf: Float[Array, "B L R_p"] | None = None
  c_kv_scale: Float[Array, "B 1 L"] | None = None

  @classmethod
  def init(cls, batch: int, max_len: int, kv_lora_rank: int, qk_rope_head_dim: int,
           dtype=jnp.float32, *, rope_align: int | None = None,
           length_align: int | None = None, rope_dtype=None) -> "LatentCache":
    """``rope_align``: store ``k^R`` zero-padded to a multiple of this many columns (None:
    ``jaxattn.paged_cache.default_rope_align()``, 128 on TPU, else 1).  ``max_len`` slots,
    rounded up to a multiple of ``length_align`` (``jaxattn.cache.cache_length``; None: 16 on
    TPU, 128 past 512 slots; else exact).  ``dtype`` int8 / float8_e4m3fn: a quantized cache,
    ``k^R`` in the float ``rope_dtype`` (None: float32); a float ``dtype`` stores both parts in
    one buffer, so ``rope_dtype`` must then be None or ``dtype``."""
    rope_align = default_rope_align() if rope_align is None else rope_align
    for name, v in (("batch", batch), ("max_len", max_len), ("kv_lora_rank", kv_lora_rank),
                    ("qk_rope_head_dim", qk_rope_head_dim), ("rope_align", rope_align)):
      if isinstance(v, bool) or int(v) < 1:
        raise ValueError(f"LatentCache.init: `{name}` must be >= 1, got {v!r}.")
    rope_width = stored_rope_width(qk_rope_head_dim, rope_align)
    length = cache_length(int(max_len), length_align)
    meta = dict(index=jnp.zeros((), jnp.int32), kv_lora_rank=int(kv_lora_rank),
                rope_dim=int(qk_rope_head_dim))
    dtype = check_cache_dtype(dtype, "LatentCache.init")
    if kv_quantized(dtype):
      rope_dtype = latent_rope_dtype(rope_dtype, dtype, "LatentCache.init")
      return cls(kv=jnp.zeros((batch, length, kv_lora_rank), dtype),
                 k_rope_buf=jnp.zeros((batch, length, rope_width), rope_dtype),
                 c_kv_scale=jnp.ones((batch, 1, length), jnp.float32), **meta)
    if rope_dtype is not None and jnp.dtype(rope_dtype) != jnp.dtype(dtype):
      raise ValueError(f"LatentCache.init: `rope_dtype` {rope_dtype!r} differs from `dtype` "
                       f"{dtype!r}: an unquantized latent cache stores [c_KV, k^R] in one buffer "
                       f"(a separate k^R dtype needs a quantized `dtype`, int8 / float8_e4m3fn).")
    return cls(kv=jnp.zeros((batch, length, kv_lora_rank + rope_width), dtype), **meta)

  @property
  def quantized(self) -> bool:
    """Whether ``kv`` holds quantized ``c_KV`` codes (with ``c_kv_scale`` and ``k_rope_buf``)."""
    return self.c_kv_scale is not None

  @property
  def max_len(self) -> int:
    return self.kv.shape[1]

  @property
  def qk_rope_head_dim(self) -> int:
    if self.rope_dim is not None:
      return self.rope_dim
    return (self.k_rope_buf.shape[2] if self.quantized
            else self.kv.shape[2] - self.kv_lora_rank)

  @property
  def c_kv(self) -> Float[Array, "B L C"]:
    """The cached latents ``c_KV`` (a quantized cache's dequantized, in fp32)."""
    if self.quantized:
      return self.kv.astype(jnp.float32) * jnp.swapaxes(self.c_kv_scale, 1, 2)
    return self.kv[..., :self.kv_lora_rank]

  @property
  def k_rope(self) -> Float[Array, "B L R"]:
    """The cached rotated keys shared by all heads."""
    if self.quantized:
      return self.k_rope_buf[..., :self.qk_rope_head_dim]
    return self.kv[..., self.kv_lora_rank:self.kv_lora_rank + self.qk_rope_head_dim]

  @property
  def nbytes(self) -> int:
    """Bytes held by the buffers at full capacity: ``B * L * (C + R_p) * bytes``; quantized,
    ``B * L * (C * 1 + 4 + R_p * rope bytes)``."""
    arrays = (self.kv, self.k_rope_buf, self.c_kv_scale)
    return int(sum(a.size * a.dtype.itemsize for a in arrays if a is not None))

  def update(self, c_kv: Float[Array, "B T C"], k_rope: Float[Array, "B T R"]) -> "LatentCache":
    """Writes ``T`` new positions at ``index`` and advances it."""
    b = self.kv.shape[0]
    rank, r = self.kv_lora_rank, self.qk_rope_head_dim
    if c_kv.ndim != 3 or c_kv.shape[0] != b or c_kv.shape[2] != rank:
      raise ValueError(f"`c_kv` {c_kv.shape} does not fit the cache: expected [B={b}, T, C={rank}].")
    if k_rope.shape != c_kv.shape[:2] + (r,):
      raise ValueError(f"`k_rope` {k_rope.shape} does not fit the cache: expected "
                       f"{c_kv.shape[:2] + (r,)} ([B, T, R]).")
    t = c_kv.shape[1]
    if t > self.max_len:
      raise ValueError(f"{t} new tokens exceed the cache capacity max_len={self.max_len}.")
    if not isinstance(self.index, jax.core.Tracer) and int(self.index) + t > self.max_len:
      raise ValueError(f"cache overflow: index {int(self.index)} + {t} new tokens > max_len "
                       f"{self.max_len}.")
    at = (0, self.index, 0)
    meta = dict(index=self.index + t, kv_lora_rank=rank, rope_dim=self.rope_dim)
    if self.quantized:    # codes, their scales [B, T] -> [B, 1, T] at the index, k^R as a float
      codes, cs = quantize_kv(c_kv.astype(jnp.float32), self.kv.dtype)
      kr = jnp.pad(k_rope.astype(self.k_rope_buf.dtype),
                   ((0, 0), (0, 0), (0, self.k_rope_buf.shape[2] - r)))       # R_p - R zeros
      return LatentCache(kv=jax.lax.dynamic_update_slice(self.kv, codes, at),
                         k_rope_buf=jax.lax.dynamic_update_slice(self.k_rope_buf, kr, at),
                         c_kv_scale=jax.lax.dynamic_update_slice(self.c_kv_scale, cs[:, None],
                                                                 (0, 0, self.index)), **meta)
    width = self.kv.shape[2]
    pad = jnp.zeros(k_rope.shape[:2] + (width - rank - r,), self.kv.dtype)   # R_p - R columns
    row = jnp.concatenate([c_kv.astype(self.kv.dtype), k_rope.astype(self.kv.dtype), pad], axis=-1)
    return LatentCache(kv=jax.lax.dynamic_update_slice(self.kv, row, at), **meta)
