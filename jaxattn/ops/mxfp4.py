"""MXFP4 (OCP Microscaling, FP4 E2M1 elements with one E8M0 scale per 32): gpt-oss's expert weights.

A group of 32 consecutive values along the quantized axis shares one power-of-two scale
``2^(s - 127)`` (``s`` a uint8, E8M0); each value is one FP4 E2M1 code (sign, two exponent bits,
one mantissa bit: magnitudes ``0, 0.5, 1, 1.5, 2, 3, 4, 6``), two codes per byte, the first in the
low nibble.  Quantization follows the OCP MX specification: the shared exponent is
``floor(log2(amax)) - 2`` (2 = the largest E2M1 exponent), so the group's largest magnitude maps
into ``[4, 8)`` and saturates at 6; every value rounds to the nearest E2M1 magnitude (ties to the
even code).  4.25 bits per value: ``[..., K]`` fp32 / bf16 weights take ``K / 2 + K / 32`` bytes.

Layout: ``quantize_mxfp4(w, axis)`` moves ``axis`` last and returns ``blocks [..., K / 32, 16]``
(uint8) and ``scales [..., K / 32]`` (uint8) -- for an expert matrix ``[E, K, N]`` quantized along
its contraction axis ``K`` that is the published gpt-oss checkpoints' ``[E, N, K / 32, 16]``.
``dequantize_mxfp4`` inverts it (exactly, for values that are representable).
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float, Int, UInt8

GROUP = 32
# E2M1 magnitudes by code (the sign is bit 3), and the 16 signed values.
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
FP4_VALUES = np.concatenate([E2M1, -E2M1]).astype(np.float32)
_EMAX = 2   # the largest E2M1 exponent: 6 = 1.5 * 2^2


def quantize_mxfp4(w: Float[Array, "..."], axis: int = -1
                   ) -> tuple[UInt8[Array, "... G 16"], UInt8[Array, "... G"]]:
  """``w`` quantized in groups of 32 along ``axis`` (moved last): ``(blocks, scales)``."""
  w = jnp.asarray(w)
  if w.ndim == 0 or not jnp.issubdtype(w.dtype, jnp.floating):
    raise ValueError(f"`w` must be a floating-point array with at least one axis, got "
                     f"{w.dtype}{list(w.shape)}.")
  x = jnp.moveaxis(w.astype(jnp.float32), axis, -1)
  k = x.shape[-1]
  if k % GROUP:
    raise ValueError(f"the quantized axis ({axis}) has {k} entries; MXFP4 groups need a multiple "
                     f"of {GROUP}.")
  g = x.reshape(x.shape[:-1] + (k // GROUP, GROUP))
  amax = jnp.max(jnp.abs(g), axis=-1)
  _, ex = jnp.frexp(amax)                       # amax = m 2^ex, m in [0.5, 1): floor(log2) = ex - 1
  e = jnp.where(amax > 0, ex - 1 - _EMAX, -127)
  e = jnp.clip(e, -127, 127)
  y = jnp.ldexp(g, -e[..., None])
  mag = jnp.abs(y)
  # nearest magnitude; a tie between neighbours goes to the even code (round half to even)
  dist = jnp.abs(mag[..., None] - jnp.asarray(E2M1))
  best = jnp.min(dist, axis=-1, keepdims=True)
  ties = dist == best
  code = jnp.argmax(ties & (jnp.arange(8) % 2 == 0), axis=-1)
  code = jnp.where(jnp.sum(ties, axis=-1) > 1, code, jnp.argmin(dist, axis=-1))
  code = (code + 8 * (y < 0)).astype(jnp.uint8)
  blocks = code[..., 0::2] | (code[..., 1::2] << 4)
  return blocks.astype(jnp.uint8), (e + 127).astype(jnp.uint8)


def _check(blocks, scales):
  if (blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.shape[:-1] != scales.shape):
    raise ValueError(f"MXFP4 wants uint8 `blocks` [..., G, B] and `scales` [..., G], got "
                     f"{blocks.dtype}{list(blocks.shape)} and {scales.dtype}{list(scales.shape)}.")


def _dequantize_host(blocks, scales):
  """The dequantization in NumPy, by the table of the 16 values."""
  _check(blocks, scales)
  values = np.stack([FP4_VALUES[blocks & 0x0F], FP4_VALUES[blocks >> 4]], axis=-1)
  values = values.reshape(blocks.shape[:-1] + (-1,))
  values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
  return values.reshape(blocks.shape[:-2] + (-1,))


def e2m1_values(codes: Int[Array, "..."]) -> Float[Array, "..."]:
  """E2M1 codes (int32, 0..15) -> their fp32 values, built as float bits without a table: sign
  bit 3, exponent bits 2-1 (``e``), mantissa bit 0 (``m``); normal ``2^(e-1) (1 + m / 2)`` (float
  exponent ``e + 126``), subnormal ``m / 2``.  Elementwise, so XLA fuses it with what follows (a
  table lookup is a gather, which XLA materializes with its int32 indices); the kernels use it
  too."""
  e = (codes >> 1) & 3
  m = codes & 1
  bits = jnp.where(e > 0, ((e + 126) << 23) | (m << 22), m * (126 << 23))
  return lax.bitcast_convert_type(bits | ((codes >> 3) << 31), jnp.float32)


def dequantize_mxfp4(blocks: UInt8[Array, "... G 16"], scales: UInt8[Array, "... G"], *,
                     dtype=jnp.float32) -> Float[Array, "... K"]:
  """``(blocks, scales)`` -> ``[..., G * 32]`` values (computed in fp32, returned as ``dtype``):
  one elementwise fusion, no table gather."""
  blocks, scales = jnp.asarray(blocks), jnp.asarray(scales)
  _check(blocks, scales)
  codes = blocks.astype(jnp.int32)
  scale = jnp.ldexp(jnp.ones((), jnp.float32), scales.astype(jnp.int32) - 127)[..., None, None]
  values = jnp.stack([e2m1_values(codes & 0xF), e2m1_values(codes >> 4)], axis=-1) * scale
  return values.astype(dtype).reshape(blocks.shape[:-2] + (-1,))


def dequantize_mxfp4_host(blocks, scales) -> np.ndarray:
  """``dequantize_mxfp4`` in NumPy, on the host (a checkpoint converter's, tensor by tensor)."""
  return _dequantize_host(np.asarray(blocks), np.asarray(scales))


CODE_ALIGN = 128   # bytes: a flat codes row is padded to whole 128-byte lane tiles


def code_width(k: int) -> int:
  """Bytes of a flat codes row for a quantized axis of ``k`` values: ``k / 2`` rounded up to a
  multiple of ``CODE_ALIGN``.  A TPU lays an array out in (32, 128) tiles of bytes and, by default,
  orders its dimensions to pad them least: codes ``[.., 2880, 1440]`` (gpt-oss) would be stored
  with the 2880 axis minor, and copied back to row-major for a kernel on every call.  Rows of
  whole tiles are row-major, and cost nothing more in HBM than the tiles' padding already did."""
  return -(-(k // 2) // CODE_ALIGN) * CODE_ALIGN


class MXFP4Array(NamedTuple):
  """A matrix ``W [..., K, N]`` (``x @ W``) in MXFP4 along ``K``, as the expert kernels take it:
  ``codes [..., N, code_width(K)]`` uint8 (the ``blocks`` with their byte axis flat, zero bytes
  past ``K / 2``) and ``scales [..., N, K / 32]`` uint8.  A pytree: it passes through ``jax.jit``
  and ``shard_map`` as its two arrays."""
  codes: UInt8[Array, "... N W"]
  scales: UInt8[Array, "... N G"]

  @classmethod
  def from_blocks(cls, blocks: UInt8[Array, "... N G 16"], scales: UInt8[Array, "... N G"]
                  ) -> "MXFP4Array":
    """From ``quantize_mxfp4``'s (and the published checkpoints') ``blocks`` layout."""
    flat = blocks.reshape(blocks.shape[:-2] + (-1,))
    k = GROUP * scales.shape[-1]
    pad = [(0, 0)] * (flat.ndim - 1) + [(0, code_width(k) - k // 2)]
    return cls(jnp.pad(flat, pad), scales)

  @classmethod
  def quantize(cls, w: Float[Array, "... K N"]) -> "MXFP4Array":
    return cls.from_blocks(*quantize_mxfp4(jnp.swapaxes(jnp.asarray(w), -1, -2), axis=-1))

  @property
  def shape(self) -> tuple[int, ...]:
    *lead, n, g = self.scales.shape
    return (*lead, g * GROUP, n)

  @property
  def ndim(self) -> int:
    return self.codes.ndim

  def blocks(self) -> UInt8[Array, "... N G 16"]:
    g = self.scales.shape[-1]
    return self.codes[..., :g * GROUP // 2].reshape(self.codes.shape[:-1] + (g, GROUP // 2))

  def dequantize(self, dtype=jnp.float32) -> Float[Array, "... K N"]:
    return jnp.swapaxes(dequantize_mxfp4(self.blocks(), self.scales, dtype=dtype), -1, -2)


__all__ = ["MXFP4Array", "code_width", "quantize_mxfp4", "dequantize_mxfp4",
           "dequantize_mxfp4_host", "FP4_VALUES", "GROUP"]
