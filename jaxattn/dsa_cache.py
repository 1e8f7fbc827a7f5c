"""Decode cache of DeepSeek Sparse Attention on MLA: the latent rows plus the indexer keys.

Per token and layer it holds the MLA row ``[c_KV, k^R]`` (``C + R`` numbers, a ``LatentCache``) and
the lightning indexer's one shared key ``k^I`` (``d_I`` numbers), stored the way the scorer reads
it: 8-bit (``int8`` or ``float8_e4m3fn``) with fp32 per-block scales, or fp32 when unquantized.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxattn.mla_cache import LatentCache
from jaxattn.ops.quantization import QUANT_FORMATS, dequantize, quantize_fp8, quantize_int8


def quantize_index_keys(k: Float[Array, "... d"], fmt, block_size: int | None):
  """``(stored keys, scales [..., nb])`` in format ``fmt`` (None: fp32 keys and unit scales)."""
  if fmt not in QUANT_FORMATS:
    raise ValueError(f"`fmt` must be one of {QUANT_FORMATS}, got {fmt!r}.")
  if fmt is None:
    return k.astype(jnp.float32), jnp.ones(k.shape[:-1] + (1,), jnp.float32)
  if fmt == "int8":
    return quantize_int8(k, block_size=block_size)
  return quantize_fp8(k, block_size=block_size)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DSACache:
  """``latent``: the MLA ``LatentCache``; ``index_keys [B, L, d_I]`` (int8 / fp8 / fp32) and
  ``index_scales [B, L, nb]`` (fp32): the indexer keys, ``key ~= keys * scale`` per block.
  ``latent.index`` counts the filled positions for both.  A quantized ``latent`` (int8 / fp8
  ``c_KV`` codes, ``latent.quantized``) is independent of the indexer keys' format."""

  latent: LatentCache
  index_keys: Array
  index_scales: Float[Array, "B L nb"]

  @classmethod
  def init(cls, batch: int, max_len: int, *, kv_lora_rank: int, qk_rope_head_dim: int,
           index_head_dim: int, quant=None, quant_block_size: int | None = None,
           dtype=jnp.float32, rope_dtype=None) -> "DSACache":
    """``dtype`` int8 / float8_e4m3fn: a quantized latent cache (``LatentCache.init``: ``c_KV``
    codes with a scale per token, ``k^R`` in the float ``rope_dtype``, None: float32)."""
    latent = LatentCache.init(batch, max_len, kv_lora_rank, qk_rope_head_dim, dtype,
                              rope_dtype=rope_dtype)
    keys, scales = quantize_index_keys(jnp.zeros((batch, latent.max_len, index_head_dim)), quant,
                                       quant_block_size)
    return cls(latent=latent, index_keys=keys, index_scales=scales)

  @property
  def index(self) -> Int[Array, ""]:
    return self.latent.index

  @property
  def max_len(self) -> int:
    return self.latent.max_len

  @property
  def quantized(self) -> bool:
    """Whether the latent rows are quantized (``LatentCache.quantized``)."""
    return self.latent.quantized

  def index_keys_fp32(self) -> Float[Array, "B L d"]:
    """The indexer keys as the scorer sees them (dequantized)."""
    return dequantize(self.index_keys, self.index_scales)

  @property
  def nbytes(self) -> int:
    return int(self.latent.nbytes + self.index_keys.size * self.index_keys.dtype.itemsize
               + self.index_scales.size * self.index_scales.dtype.itemsize)

  def update(self, c_kv: Float[Array, "B T C"], k_rope: Float[Array, "B T R"],
             index_keys: Array, index_scales: Float[Array, "B T nb"]) -> "DSACache":
    """Writes ``T`` new positions (already-quantized indexer keys) at ``index`` and advances it."""
    if index_keys.shape[:2] != c_kv.shape[:2] or index_keys.shape[2:] != self.index_keys.shape[2:]:
      raise ValueError(f"`index_keys` {index_keys.shape} must be [B, T, d_I] with [B, T] of `c_kv` "
                       f"{c_kv.shape} and d_I={self.index_keys.shape[2]}.")
    if index_keys.dtype != self.index_keys.dtype:
      raise ValueError(f"`index_keys` dtype {index_keys.dtype} must be the cache's "
                       f"{self.index_keys.dtype}.")
    if index_scales.shape != index_keys.shape[:2] + self.index_scales.shape[2:]:
      raise ValueError(f"`index_scales` {index_scales.shape} must be "
                       f"{index_keys.shape[:2] + self.index_scales.shape[2:]}.")
    latent = self.latent.update(c_kv, k_rope)   # first: its capacity check names the overflow
    at = (0, self.latent.index, 0)
    keys = jax.lax.dynamic_update_slice(self.index_keys, index_keys, at)
    scales = jax.lax.dynamic_update_slice(self.index_scales, index_scales.astype(jnp.float32), at)
    return DSACache(latent=latent, index_keys=keys, index_scales=scales)
