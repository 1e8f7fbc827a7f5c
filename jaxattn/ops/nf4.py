"""NF4 (4-bit NormalFloat) block quantization with double-quantized block scales, as QLoRA stores weights.

Layout and rules follow bitsandbytes' ``quantize_4bit(quant_type="nf4", compress_statistics=True)``:

* the tensor is flattened (row-major) and cut into blocks of ``block_size`` (64) values;
* each block keeps ``absmax = max |w|``; each value ``w / absmax`` (clamped to [-1, 1]) is replaced by
  the index of the nearest of the 16 NF4 levels (ties go to the lower index);
* two 4-bit indices per byte, the first value of each pair in the high nibble;
* double quantization: ``offset = mean(absmax)``, then ``absmax - offset`` is quantized blockwise
  (256 scales per block) to 8-bit codes of bitsandbytes' signed dynamic map, keeping one fp32 scale
  per 256 blocks.  Storage is ``4 + 8/64 + 32/(64*256) ~ 4.127`` bits per weight.

Dequantization inverts the steps: ``w ~ NF4[index] * (dynamic[code] * absmax2 + offset)``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, UInt8

from jaxattn.checks import is_int

# The 16 NF4 levels: quantiles of N(0, 1) normalized to [-1, 1], with an exact zero (QLoRA, Dettmers
# et al. 2023), as listed in bitsandbytes (``get_4bit_type("nf4")``).
NF4_CODEBOOK = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
], dtype=np.float32)
NF4_ZERO = 7  # index of 0.0


def _torch_linspace(start: float, end: float, n: int) -> np.ndarray:
  """fp32 ``torch.linspace`` as bitsandbytes builds the table with it: a fp32 step, the first half
  counted up from ``start`` and the rest down from ``end``, each value ``start + step * i`` rounded
  once (a fused multiply-add).  ``np.linspace`` rounds 22 of the table's entries differently."""
  s, e = np.float32(start), np.float32(end)
  step = np.float64(np.float32((e - s) / np.float32(n - 1)))
  i = np.arange(n)
  up = np.float64(s) + step * i
  down = np.float64(e) - step * (n - 1 - i)
  return np.where(i < n // 2, up, down).astype(np.float32)


def dynamic_map(max_exponent_bits: int = 7, total_bits: int = 8) -> np.ndarray:
  """bitsandbytes' signed 8-bit "dynamic" code (``create_dynamic_map(signed=True)``), 256 sorted values.

  For exponent ``e = 0 .. 6`` it holds ``+-10^(e - 6) * m`` for the ``2^e`` midpoints ``m`` of an even
  grid on [0.1, 1], plus 0 and 1: fine steps near zero, coarse near one.
  """
  data = []
  non_sign_bits = total_bits - 1
  for i in range(max_exponent_bits):
    n_edges = 2 ** (i + non_sign_bits - max_exponent_bits) + 1
    edges = _torch_linspace(0.1, 1.0, n_edges)
    means = (edges[:-1] + edges[1:]) / 2.0
    mag = np.float32(10.0 ** (-(max_exponent_bits - 1) + i)) * means   # fp32 products, as the original
    data += mag.tolist() + (-mag).tolist()
  data += [0.0, 1.0]
  data += [0.0] * (2 ** total_bits - len(data))
  return np.sort(np.asarray(data, dtype=np.float32))


DYNAMIC_MAP = dynamic_map()


class NF4Tensor(NamedTuple):
  """A quantized tensor (a pytree of arrays; the shape and block sizes travel separately).

  ``packed [ceil(N/2)] uint8``: two 4-bit NF4 indices per byte.
  ``absmax``: ``[num_blocks] float32`` scales, or ``uint8`` codes when double quantized.
  ``absmax_scale [ceil(num_blocks/256)] float32`` and ``absmax_offset []``: the second level (None
  without double quantization).
  """
  packed: jax.Array
  absmax: jax.Array
  absmax_scale: jax.Array | None = None
  absmax_offset: jax.Array | None = None


def _check_block_size(name, block_size):
  if not is_int(block_size) or block_size < 2 or block_size % 2:
    raise ValueError(f"`{name}` must be an even int >= 2, got {block_size!r}.")


def _nearest(x, code):
  """Index of the nearest value of the sorted ``code`` (ties to the lower index), as bitsandbytes'
  ``argmin |x - code|`` but without its ``[N, len(code)]`` intermediate."""
  mids = (code[1:] + code[:-1]) / 2
  return jnp.searchsorted(mids, x, side="left").astype(jnp.uint8)


def _blockwise_absmax(flat, block_size):
  pad = (-flat.shape[0]) % block_size
  blocks = jnp.pad(flat, (0, pad)).reshape(-1, block_size)
  absmax = jnp.max(jnp.abs(blocks), axis=-1)
  # bitsandbytes multiplies by 1/absmax; an all-zero block maps to index 7 (0.0) instead of NaN.
  inv = jnp.where(absmax > 0, 1.0 / jnp.where(absmax > 0, absmax, 1.0), 0.0)
  scaled = jnp.clip(blocks * inv[:, None], -1.0, 1.0).reshape(-1)
  return scaled, absmax


def pack_4bit(indices: UInt8[Array, "N"], *, pad_index: int = 0) -> UInt8[Array, "ceil(N/2)"]:
  """Two 4-bit indices per byte, the first in the high nibble (an odd tail gets ``pad_index``)."""
  idx = indices.astype(jnp.uint8).reshape(-1)
  if idx.shape[0] % 2:
    idx = jnp.pad(idx, (0, 1), constant_values=pad_index)
  return (idx[0::2] << 4) | idx[1::2]


def unpack_4bit(packed: UInt8[Array, "M"], n: int | None = None) -> UInt8[Array, "N"]:
  """Inverse of ``pack_4bit``: the first ``n`` (default ``2 M``) indices."""
  p = packed.astype(jnp.uint8).reshape(-1)
  idx = jnp.stack([p >> 4, p & 0xF], axis=-1).reshape(-1)
  return idx if n is None else idx[:n]


def quantize_blockwise_8bit(x: Float[Array, "N"], *, block_size: int = 256):
  """bitsandbytes' ``quantize_blockwise`` with the dynamic map: ``(codes uint8 [N], absmax [nb])``."""
  _check_block_size("block_size", block_size)
  flat = x.astype(jnp.float32).reshape(-1)
  scaled, absmax = _blockwise_absmax(flat, block_size)
  return _nearest(scaled[:flat.shape[0]], jnp.asarray(DYNAMIC_MAP)), absmax


def dequantize_blockwise_8bit(codes: UInt8[Array, "N"], absmax: Float[Array, "nb"], *,
                              block_size: int = 256) -> Float[Array, "N"]:
  """Inverse of ``quantize_blockwise_8bit`` (fp32)."""
  n = codes.shape[0]
  vals = jnp.asarray(DYNAMIC_MAP)[codes.astype(jnp.int32)]
  scale = jnp.repeat(absmax.astype(jnp.float32), block_size)[:n]
  return vals * scale


def quantize_nf4(
    w: Float[Array, "..."],
    *,
    block_size: int = 64,
    double_quant: bool = True,
    scale_block_size: int = 256,
) -> NF4Tensor:
  """NF4-quantizes ``w`` (any shape, flattened row-major).  See the module docstring."""
  _check_block_size("block_size", block_size)
  _check_block_size("scale_block_size", scale_block_size)
  if not jnp.issubdtype(w.dtype, jnp.floating):
    raise ValueError(f"`w` must be a floating array, got dtype {w.dtype}.")
  if w.size == 0:
    raise ValueError(f"`w` must not be empty, got shape {w.shape}.")
  return _quantize_nf4(w, block_size, double_quant, scale_block_size)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _quantize_nf4(w, block_size, double_quant, scale_block_size):
  flat = w.astype(jnp.float32).reshape(-1)
  scaled, absmax = _blockwise_absmax(flat, block_size)
  # An odd tail is padded with the index of 0.0, as bitsandbytes pads the values with 0.
  packed = pack_4bit(_nearest(scaled[:flat.shape[0]], jnp.asarray(NF4_CODEBOOK)), pad_index=NF4_ZERO)
  if not double_quant:
    return NF4Tensor(packed, absmax)
  offset = jnp.mean(absmax)
  codes, absmax2 = quantize_blockwise_8bit(absmax - offset, block_size=scale_block_size)
  return NF4Tensor(packed, codes, absmax2, offset)


def _implied(name, n, count):
  """The ``name`` values that cut ``n`` values into ``count`` blocks, for error messages."""
  if count < 1:
    return f"no {name} gives them"
  lo = -(-n // count)
  if -(-n // lo) != count:
    return f"no {name} gives them"
  if count == 1:
    return f"the tensor's shapes imply {name} >= {lo}"
  hi = -(-n // (count - 1)) - 1
  return (f"the tensor's shapes imply {name}={lo}" if lo == hi else
          f"the tensor's shapes imply {name} in [{lo}, {hi}]")


def _check_scale_layout(q, scale_block_size):
  _check_block_size("scale_block_size", scale_block_size)
  if (q.absmax_scale is None) != (q.absmax_offset is None):
    raise ValueError("`q.absmax_scale` and `q.absmax_offset` must both be set (double "
                     "quantized) or both be None.")
  if q.absmax_scale is None:
    return
  nb = q.absmax.shape[0] if q.absmax.ndim == 1 else 0
  want = (-(-nb // scale_block_size),)
  if q.absmax.ndim != 1 or q.absmax_scale.shape != want:
    raise ValueError(f"`scale_block_size`={scale_block_size} needs `q.absmax_scale` of shape "
                     f"{want} for the {q.absmax.shape} block codes, got {q.absmax_scale.shape}: "
                     f"{_implied('scale_block_size', nb, q.absmax_scale.size)}.")


def _check_layout(q, shape, block_size, scale_block_size):
  """Raises ``ValueError`` unless ``q`` holds ``shape`` quantized with these block sizes (they are
  not stored in ``q``, and a mismatch would scale values by another block's absmax)."""
  _check_block_size("block_size", block_size)
  n = int(np.prod(shape))
  if q.packed.shape != ((n + 1) // 2,):
    raise ValueError(f"`shape` {shape} needs {(n + 1) // 2} packed bytes, got {q.packed.shape}.")
  nb = -(-n // block_size)
  if q.absmax.shape != (nb,):
    count = q.absmax.shape[0] if q.absmax.ndim == 1 else 0
    raise ValueError(f"`block_size`={block_size} cuts the {n} values into {nb} blocks, but "
                     f"`q.absmax` has shape {q.absmax.shape}: "
                     f"{_implied('block_size', n, count)}.")
  _check_scale_layout(q, scale_block_size)


def nf4_block_scales(q: NF4Tensor, *, scale_block_size: int = 256) -> Float[Array, "nb"]:
  """The per-block scales ``absmax`` (fp32), undoing the double quantization when present."""
  _check_scale_layout(q, scale_block_size)
  if q.absmax_scale is None:
    return q.absmax.astype(jnp.float32)
  return dequantize_blockwise_8bit(q.absmax, q.absmax_scale,
                                   block_size=scale_block_size) + q.absmax_offset


def dequantize_nf4(
    q: NF4Tensor,
    shape: Sequence[int],
    *,
    block_size: int = 64,
    scale_block_size: int = 256,
    dtype=jnp.float32,
) -> Float[Array, "..."]:
  """Rebuilds the ``shape`` tensor from ``q`` in ``dtype`` (fp32 math).

  ``block_size`` and ``scale_block_size`` must be those ``q`` was quantized with; ``ValueError``
  when ``q``'s shapes contradict them.
  """
  shape = tuple(int(s) for s in shape)
  _check_layout(q, shape, block_size, scale_block_size)
  return _dequantize_nf4(q, shape, block_size, scale_block_size, jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _dequantize_nf4(q, shape, block_size, scale_block_size, dtype):
  n = int(np.prod(shape))
  idx = unpack_4bit(q.packed, n)
  vals = jnp.asarray(NF4_CODEBOOK)[idx.astype(jnp.int32)]
  scales = nf4_block_scales(q, scale_block_size=scale_block_size)
  vals = jnp.pad(vals, (0, scales.shape[0] * block_size - n)).reshape(-1, block_size)
  return (vals * scales[:, None]).reshape(-1)[:n].reshape(shape).astype(dtype)


def nf4_einsum(
    spec: str,
    x: Float[Array, "..."],
    q: NF4Tensor,
    shape: Sequence[int],
    *,
    block_size: int = 64,
    scale_block_size: int = 256,
    dtype=None,
) -> Float[Array, "..."]:
  """``einsum(spec, x, dequantize_nf4(q, shape))`` that never keeps the dequantized kernel.

  The forward pass dequantizes right before the matmul; the backward pass (the gradient reaches
  ``x`` only: the quantized kernel is frozen) dequantizes again once the incoming gradient exists.
  Optimization barriers pin both dequantizations to their matmuls, so XLA cannot hoist them to the
  start of the program and hold every layer's full-precision kernel at once.  ``dtype``: the compute
  dtype (default ``x.dtype``).
  """
  shape = tuple(int(s) for s in shape)
  _check_layout(q, shape, block_size, scale_block_size)
  dtype = jnp.dtype(dtype or x.dtype)
  return _nf4_einsum(spec, shape, block_size, scale_block_size, dtype,
                     jax.ShapeDtypeStruct(x.shape, x.dtype), x, q)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4, 5))
def _nf4_einsum(spec, shape, block_size, scale_block_size, dtype, x_struct, x, q):
  x, q = jax.lax.optimization_barrier((x, q))
  w = _dequantize_nf4(q, shape, block_size, scale_block_size, dtype)
  return jnp.einsum(spec, x.astype(dtype), w)


def _nf4_einsum_fwd(spec, shape, block_size, scale_block_size, dtype, x_struct, x, q):
  return _nf4_einsum(spec, shape, block_size, scale_block_size, dtype, x_struct, x, q), q


def _nf4_einsum_bwd(spec, shape, block_size, scale_block_size, dtype, x_struct, q, dy):
  dy, q = jax.lax.optimization_barrier((dy, q))
  w = _dequantize_nf4(q, shape, block_size, scale_block_size, dtype)
  (dx,) = jax.linear_transpose(lambda x: jnp.einsum(spec, x.astype(dtype), w), x_struct)(dy)
  zero = lambda a: (np.zeros(a.shape, jax.dtypes.float0) if not jnp.issubdtype(a.dtype, jnp.inexact)
                    else jnp.zeros_like(a))
  return dx, jax.tree.map(zero, q)


_nf4_einsum.defvjp(_nf4_einsum_fwd, _nf4_einsum_bwd)


def nf4_bytes(q: NF4Tensor) -> int:
  """Storage of ``q`` in bytes."""
  return int(sum(np.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in q if a is not None))
