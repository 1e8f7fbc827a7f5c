"""8-bit quantization of indexer vectors: INT8 (symmetric) and FP8 e4m3 with per-block scales.

DSA (seed 3.7, DeepSeek-V3.2) scores tokens with 8-bit indexer queries and keys.  Every row (a
token's vector, last axis ``d``) is cut into blocks of ``block_size`` entries, each with its own fp32
scale ``s = max(amax(|block|), amax_floor) / qmax`` so that ``x ~= q * s``:

* INT8: ``q = clip(round(x / s), -127, 127)`` (symmetric, ``qmax = 127``; -128 unused so ``-q`` fits).
  ``block_size=None`` is one scale per token (per row).
* FP8 e4m3 (``float8_e4m3fn``, ``qmax = 448``): ``q = cast(x / s)``, as DeepSeek-V3.2's reference
  ``act_quant`` (128-entry blocks, amax floored at ``1e-4`` so an all-zero block gets a finite scale).
  ``scale_format="ue8m0"`` rounds each scale up to a power of two as the reference's UE8M0 option.

``dequantize`` inverts either; the quantization error of one entry is at most ``s / 2`` (INT8), so
one large entry in a block crushes the small ones -- the reason for the Hadamard rotation first.
"""

from __future__ import annotations

import functools

from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int8

from jaxattn.checks import is_int

INT8_MAX = 127.0
FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn
DEFAULT_AMAX_FLOOR = 1e-4


def _blocks(x, block_size, fn_name):
  """``x [..., d]`` -> ``[..., d / bs, bs]`` (fp32) and the block size used."""
  if x.ndim == 0:
    raise ValueError(f"{fn_name}: `x` must have at least one axis, got shape {x.shape}.")
  d = x.shape[-1]
  bs = d if block_size is None else block_size
  if not is_int(bs) or bs < 1 or d % bs:
    raise ValueError(f"{fn_name}: `block_size`={block_size!r} must be None or a positive int "
                     f"dividing the last axis ({d}).")
  return x.astype(jnp.float32).reshape(x.shape[:-1] + (d // bs, bs)), bs


def _check_floor(amax_floor, fn_name):
  if not amax_floor > 0:
    raise ValueError(f"{fn_name}: `amax_floor` must be > 0, got {amax_floor!r}.")


@functools.partial(jax.jit, static_argnames=('block_size', 'amax_floor',))
def quantize_int8(x: Float[Array, "... d"], *, block_size: int | None = None,
                  amax_floor: float = DEFAULT_AMAX_FLOOR
                  ) -> tuple[Int8[Array, "... d"], Float[Array, "... nb"]]:
  """Symmetric INT8: ``(q int8 [..., d], scale fp32 [..., d / block_size])``.

  ``block_size=None`` gives per-token scales (``scale [..., 1]``).
  """
  _check_floor(amax_floor, "quantize_int8")
  xb, _ = _blocks(x, block_size, "quantize_int8")
  amax = jnp.maximum(jnp.max(jnp.abs(xb), axis=-1, keepdims=True), amax_floor)
  scale = amax / INT8_MAX
  q = jnp.clip(jnp.round(xb / scale), -INT8_MAX, INT8_MAX).astype(jnp.int8)
  return q.reshape(x.shape), scale[..., 0]


@functools.partial(jax.jit, static_argnames=('block_size', 'amax_floor', 'scale_format',))
def quantize_fp8(x: Float[Array, "... d"], *, block_size: int | None = 128,
                 amax_floor: float = DEFAULT_AMAX_FLOOR,
                 scale_format: Literal[None, "ue8m0"] = None
                 ) -> tuple[Float[Array, "... d"], Float[Array, "... nb"]]:
  """FP8 e4m3 with per-block fp32 scales: ``(q float8_e4m3fn [..., d], scale [..., d / bs])``."""
  _check_floor(amax_floor, "quantize_fp8")
  if scale_format not in (None, "ue8m0"):
    raise ValueError(f"quantize_fp8: `scale_format` must be None or 'ue8m0', got {scale_format!r}.")
  xb, _ = _blocks(x, block_size, "quantize_fp8")
  amax = jnp.maximum(jnp.max(jnp.abs(xb), axis=-1, keepdims=True), amax_floor)
  scale = amax / FP8_E4M3_MAX
  if scale_format == "ue8m0":
    # Power-of-two scale (rounded up, so |x / s| <= 448 still holds): exact to apply in hardware.
    scale = jnp.exp2(jnp.ceil(jnp.log2(scale)))
  q = jnp.clip(xb / scale, -FP8_E4M3_MAX, FP8_E4M3_MAX).astype(jnp.float8_e4m3fn)
  return q.reshape(x.shape), scale[..., 0]


@functools.partial(jax.jit, static_argnames=('dtype',))
def dequantize(q: Array, scale: Float[Array, "... nb"], *, dtype=jnp.float32) -> Float[Array, "... d"]:
  """``q * scale`` with each scale broadcast over its block (block size ``d / nb``)."""
  d, nb = q.shape[-1], scale.shape[-1]
  if scale.shape[:-1] != q.shape[:-1] or nb < 1 or d % nb:
    raise ValueError(f"dequantize: `scale` {scale.shape} must be [..., nb] with the leading dims of "
                     f"`q` {q.shape} and nb dividing {d}.")
  qb = q.astype(jnp.float32).reshape(q.shape[:-1] + (nb, d // nb))
  return (qb * scale[..., None].astype(jnp.float32)).reshape(q.shape).astype(dtype)


QuantFormat = Literal[None, "int8", "fp8"]
QUANT_FORMATS: tuple = (None, "int8", "fp8")


def fake_quantize(x: Float[Array, "... d"], fmt: QuantFormat, *, block_size: int | None = None
                  ) -> Float[Array, "... d"]:
  """``dequantize(quantize(x))`` in fp32 (``fmt=None``: ``x`` unchanged, in fp32): the values an
  8-bit scorer actually multiplies, for reference scoring and error studies."""
  if fmt not in QUANT_FORMATS:
    raise ValueError(f"`fmt` must be one of {QUANT_FORMATS}, got {fmt!r}.")
  if fmt is None:
    return x.astype(jnp.float32)
  if fmt == "int8":
    return dequantize(*quantize_int8(x, block_size=block_size))
  return dequantize(*quantize_fp8(x, block_size=block_size if block_size is not None else
                                  min(128, x.shape[-1])))


# -- quantized KV caches ---------------------------------------------------------------------------

# Storage dtypes of a quantized KV cache: codes in one byte, one fp32 scale per token and KV head.
KV_QUANT_DTYPES: tuple = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))


def kv_quantized(dtype) -> bool:
  """Whether ``dtype`` (a cache's storage dtype) asks for quantized keys and values: ``int8`` or
  ``float8_e4m3fn``, each stored with a scale per token and KV head (``quantize_kv``)."""
  try:
    return jnp.dtype(dtype) in KV_QUANT_DTYPES
  except TypeError:
    return False


def check_cache_dtype(dtype, where: str, name: str = "dtype"):
  """``dtype`` as a ``jnp.dtype`` when it is a float dtype or one of ``KV_QUANT_DTYPES``;
  otherwise a ``ValueError`` naming ``where`` and the argument ``name``."""
  try:
    dt = jnp.dtype(dtype)
  except TypeError:
    dt = None
  if dt is None or not (jnp.issubdtype(dt, jnp.floating) or dt in KV_QUANT_DTYPES):
    raise ValueError(f"{where}: `{name}` must be a float dtype, or int8 / float8_e4m3fn for a "
                     f"quantized cache, got {dtype!r}.")
  return dt


@functools.partial(jax.jit, static_argnames=("dtype",))
def quantize_kv(x: Float[Array, "... H"], dtype) -> tuple[Array, Float[Array, "..."]]:
  """``x [..., H]`` (a token's key or value in one KV head) as ``(codes [..., H] dtype, scale
  [...] fp32)``, ``x ~= codes * scale``: symmetric INT8 (``dtype=int8``) or FP8 e4m3
  (``float8_e4m3fn``) with one scale per row, ``amax / 127`` or ``amax / 448``.  The cache stores
  the codes (one byte per entry) and the scales (4 bytes per token and head), and the decode
  paths fold the scales into the logits and the probabilities instead of dequantizing:
  ``q . (s_k k) = s_k (q . k)`` and ``sum_j p_j s_vj v_j = (p * s_v) @ v``."""
  dt = jnp.dtype(dtype)
  if dt == jnp.int8:
    codes, scale = quantize_int8(x)
  elif dt == jnp.float8_e4m3fn:
    codes, scale = quantize_fp8(x, block_size=None)
  else:
    raise ValueError(f"quantize_kv: `dtype` must be one of {[str(d) for d in KV_QUANT_DTYPES]}, "
                     f"got {dtype!r}.")
  return codes, scale[..., 0]
