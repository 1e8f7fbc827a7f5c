"""The experts' grouped matmul on TPU, over the blocked layout, with dense or MXFP4 weights.

``jaxattn.ops.moe`` sorts the token-expert assignments by expert and pads every expert's rows to
whole blocks of ``bm`` rows (``block_layout``): block ``b`` holds rows of expert
``block_group[b]`` only, and blocks ``>= num_used`` hold none.  One kernel program then owns one
block, and the expert's matrix is one more operand whose block index comes from ``block_group``
by scalar prefetch::

    y[b] = xb[b] @ W[block_group[b]]             b < num_used      [bm, N]
    y[b] = 0                                     b >= num_used

Grid ``(NB, N / bn, K / bk)``, the contraction axis last ("arbitrary") into a fp32 VMEM
accumulator.  Consecutive blocks of one expert ask for the same weight tile, which the pipeline
does not fetch again; the unused blocks at the end repeat the last used block's indices, so they
fetch nothing and only write their zeros.

Backward (``jax.custom_vjp``): ``dxb = dy @ W^T`` is the same kernel reading ``W`` transposed in
its tiles (no transposed copy in HBM); ``dW[e] = sum_{b: group e} xb[b]^T dy[b]`` is a second
kernel with the blocks innermost, accumulating while the group stays the same and writing the
expert's tile when it changes (the blocks are sorted by group, so each tile is written once).
Experts without rows are never visited and are zero-filled after the call.  Under jit XLA
drops a gradient kernel whose result nobody reads (a frozen matrix's ``dW``).

MXFP4 weights (gpt-oss's experts; ``jaxattn.ops.mxfp4``) stay packed in HBM -- 4.25 bits per
weight instead of 16 -- and are dequantized tile by tile in VMEM: the codes ``[E, N, W]`` (two
E2M1 values a byte, the even ``k`` in the low nibble; rows of ``W = code_width(K)`` bytes, zero
past ``K / 2``) and one power-of-two scale per 32 ``k``.  The kernel never interleaves nibbles: ``x @ W = x[:, 0::2] @ W_low + x[:, 1::2] @ W_high``
with the activations split into even and odd columns outside (one pass over the activations, not
the weights).  An E2M1 code becomes its float bits directly (sign, exponent ``e + 126``, mantissa),
and the per-byte scale comes from the per-group scales by a 0/1 matmul (exact: one power of two
per output).  The scales travel as bf16 powers of two ``[E, W / 16, N]`` (0.5 bit per weight).
Frozen weights: the backward gives ``dxb`` only (the same dequantization, contracting ``N``).

Tiles: an axis up to the target (512) is one tile; a longer one takes the largest multiple of 128
(dense) that divides it, or of 256 bytes for the MXFP4 codes (512 values: 16 scale rows, whole
bf16 tiles); where none does (gpt-oss's 2880), tiles of the target with a ragged last one, whose
entries past the axis are masked wherever they would reach a sum.

Status: correct in interpret mode (``tests/kernels/test_grouped_matmul_tpu.py``, race detection
on), compiled for TPU v5e / v6e by ``experiments/tpu_compile_check.py``; not timed on a TPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, UInt8

from jaxattn.ops.mxfp4 import e2m1_values
from pallas_kernels.flash_attention import common as C
from pallas_kernels.grouped_matmul import common

NN = (((1,), (0,)), ((), ()))   # a @ b
NT = (((1,), (1,)), ((), ()))   # a @ b.T
TN = (((0,), (0,)), ((), ()))   # a.T @ b
BYTES_PER_GROUP = common.BYTES_PER_GROUP
TARGET_N = 512
TARGET_K = 512


def _tile(size: int, target: int, align: int) -> int:
  """The tile of an axis of ``size``: the whole axis up to ``target``; else the largest multiple
  of ``align`` up to ``target`` that divides it; else ``target`` itself, with a ragged last tile
  (``pl.cdiv`` tiles; the kernels mask what lies past the axis where it would be summed)."""
  if size <= target:
    return size
  for t in range(target // align * align, 0, -align):
    if size % t == 0:
      return t
  return target // align * align


def _inside(shape, dim: int, tile_index, tile: int, size: int):
  """Where a tile's entries along ``dim`` lie inside an axis of ``size`` (a ragged last tile reads
  past the array: whatever is there must not reach a sum)."""
  return tile_index * tile + lax.broadcasted_iota(jnp.int32, shape, dim) < size


def _masked(x, dim: int, tile_index, tile: int, size: int):
  if size % tile == 0:
    return x
  return jnp.where(_inside(x.shape, dim, tile_index, tile, size), x, jnp.zeros((), x.dtype))


def _used(i, num_used_ref):
  """Block ``i``, or the last used block for the unused tail (its tiles are already in VMEM)."""
  return jnp.maximum(jnp.minimum(i, num_used_ref[0] - 1), 0)


def _params(interpret, semantics):
  return dict(compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
              interpret=C.default_interpret(interpret))


# -- dense weights: y = xb @ W (or W^T) per block -------------------------------------------------


def _accumulate(nu_ref, acc_ref, o_ref, num_k: int, product):
  """The forward kernels' reduction over the last grid axis: the accumulator zeroed at the first
  tile, ``product(kk)`` added for a used block, the output written at the last tile (zeros for
  an unused block)."""
  i, kk = pl.program_id(0), pl.program_id(2)

  @pl.when(kk == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  @pl.when(i < nu_ref[0])
  def _():
    acc_ref[...] += product(kk)

  @pl.when(kk == num_k - 1)
  def _():
    o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def _matmul_kernel(bg_ref, nu_ref, x_ref, w_ref, o_ref, acc_ref, *, dims, num_k, bk, k):
  def product(kk):
    x = _masked(x_ref[...], 1, kk, bk, k)
    w = _masked(w_ref[...], dims[0][1][0], kk, bk, k)
    return lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)

  _accumulate(nu_ref, acc_ref, o_ref, num_k, product)


def _matmul(xb, w, block_group, num_used, *, transpose_w: bool, out_dtype, interpret):
  """``y[b] = xb[b] @ w[g]`` (``w [E, K, N]``) or ``xb[b] @ w[g]^T`` (``w [E, N, K]``)."""
  nb, bm, k = xb.shape
  n = w.shape[1] if transpose_w else w.shape[2]
  bk, bn = _tile(k, TARGET_K, 128), _tile(n, TARGET_N, 128)
  nk = pl.cdiv(k, bk)
  if transpose_w:
    w_spec = pl.BlockSpec((None, bn, bk), lambda i, j, kk, bg, nu: (bg[_used(i, nu)], j, kk))
  else:
    w_spec = pl.BlockSpec((None, bk, bn), lambda i, j, kk, bg, nu: (bg[_used(i, nu)], kk, j))
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2, grid=(nb, pl.cdiv(n, bn), nk),
      in_specs=[pl.BlockSpec((None, bm, bk), lambda i, j, kk, bg, nu: (_used(i, nu), 0, kk)),
                w_spec],
      out_specs=pl.BlockSpec((None, bm, bn), lambda i, j, kk, bg, nu: (i, 0, j)),
      scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)])
  return pl.pallas_call(
      functools.partial(_matmul_kernel, dims=NT if transpose_w else NN, num_k=nk, bk=bk, k=k),
      grid_spec=grid_spec, out_shape=jax.ShapeDtypeStruct((nb, bm, n), out_dtype),
      name="jaxattn_grouped_matmul_tpu",
      **_params(interpret, ("parallel", "parallel", "arbitrary")),
  )(block_group, num_used.reshape(1), xb, w)


def _group_change(bg_ref, nu_ref, a, b):
  return bg_ref[_used(a, nu_ref)] != bg_ref[_used(b, nu_ref)]


def _weight_grad_kernel(bg_ref, nu_ref, x_ref, dy_ref, o_ref, acc_ref, *, num_blocks):
  i = pl.program_id(2)

  @pl.when((i == 0) | _group_change(bg_ref, nu_ref, i, i - 1))
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  @pl.when(i < nu_ref[0])
  def _():
    acc_ref[...] += lax.dot_general(x_ref[...], dy_ref[...], TN,
                                    preferred_element_type=jnp.float32)

  @pl.when((i == num_blocks - 1) | _group_change(bg_ref, nu_ref, i + 1, i))
  def _():
    o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def _weight_grad(xb, dy, block_group, num_used, num_groups, *, out_dtype, interpret):
  """``dW[e] = sum_{b < num_used, block_group[b] = e} xb[b]^T dy[b]`` -> ``[E, K, N]``."""
  nb, bm, k = xb.shape
  n = dy.shape[2]
  bk, bn = _tile(k, TARGET_K, 128), _tile(n, TARGET_N, 128)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2, grid=(pl.cdiv(k, bk), pl.cdiv(n, bn), nb),
      in_specs=[pl.BlockSpec((None, bm, bk), lambda kk, j, i, bg, nu: (_used(i, nu), 0, kk)),
                pl.BlockSpec((None, bm, bn), lambda kk, j, i, bg, nu: (_used(i, nu), 0, j))],
      out_specs=pl.BlockSpec((None, bk, bn), lambda kk, j, i, bg, nu: (bg[_used(i, nu)], kk, j)),
      scratch_shapes=[pltpu.VMEM((bk, bn), jnp.float32)])
  dw = pl.pallas_call(
      functools.partial(_weight_grad_kernel, num_blocks=nb),
      grid_spec=grid_spec, out_shape=jax.ShapeDtypeStruct((num_groups, k, n), out_dtype),
      name="jaxattn_grouped_matmul_dw_tpu",
      **_params(interpret, ("parallel", "parallel", "arbitrary")),
  )(block_group, num_used.reshape(1), xb, dy)
  # Experts without rows were never written: zero them (a select, so stale memory cannot leak).
  visited = jnp.zeros((num_groups,), bool).at[block_group].max(jnp.arange(nb) < num_used)
  return jnp.where(visited[:, None, None], dw, jnp.zeros((), dw.dtype))


block_matmul_tpu = common.dense_block_matmul(
    lambda xb, w, bg, nu, interpret: _matmul(xb, w, bg, nu, transpose_w=False,
                                             out_dtype=xb.dtype, interpret=interpret),
    lambda dy, w, bg, nu, interpret: _matmul(dy, w, bg, nu, transpose_w=True,
                                             out_dtype=dy.dtype, interpret=interpret),
    lambda xb, dy, bg, nu, groups, dtype, interpret: _weight_grad(
        xb, dy, bg, nu, groups, out_dtype=dtype, interpret=interpret))
block_matmul_tpu.__doc__ = """``block_matmul_tpu(xb [NB, bm, K], w [E, K, N], block_group, num_used,
interpret=None)``: ``jaxattn.ops.moe.block_matmul`` as Pallas TPU kernels (forward, ``dxb``,
``dW``)."""


# -- MXFP4 weights: dequantized tile by tile in VMEM ----------------------------------------------


def _byte_scales(scales, width):
  """``[G, bn]`` per-group scales -> ``[bn, width]`` per byte (16 bytes a group), as a 0/1 matmul:
  each output is one power of two times 1, exact in any precision."""
  g = scales.shape[0]
  spread = (lax.broadcasted_iota(jnp.int32, (g, width), 1) // BYTES_PER_GROUP
            == lax.broadcasted_iota(jnp.int32, (g, width), 0)).astype(scales.dtype)
  return lax.dot_general(scales, spread, TN, preferred_element_type=jnp.float32)


def _dequantized(codes, scales, kk, width: int, dtype):
  """A tile's ``(low, high)`` nibble values ``[bn, bh]`` (bytes ``kk * bh ..``), scaled, in
  ``dtype``; bytes and scale groups past the codes' ``width`` (a ragged last tile) are zeros."""
  bh = codes.shape[1]
  codes = _masked(codes.astype(jnp.int32) & 0xFF, 1, kk, bh, width)
  scale = _byte_scales(_masked(scales, 0, kk, bh // BYTES_PER_GROUP, width // BYTES_PER_GROUP),
                       bh)
  return tuple((e2m1_values(nib) * scale).astype(dtype) for nib in (codes & 0xF, codes >> 4))


def _mxfp4_kernel(bg_ref, nu_ref, xe_ref, xo_ref, c_ref, s_ref, o_ref, acc_ref, *, num_k, width):
  def product(kk):
    low, high = _dequantized(c_ref[...], s_ref[...], kk, width, xe_ref.dtype)
    xe, xo = (_masked(r[...], 1, kk, low.shape[1], width) for r in (xe_ref, xo_ref))
    return (lax.dot_general(xe, low, NT, preferred_element_type=jnp.float32)
            + lax.dot_general(xo, high, NT, preferred_element_type=jnp.float32))

  _accumulate(nu_ref, acc_ref, o_ref, num_k, product)


def _mxfp4_tiles(width: int, n: int):
  """``(bytes, rows)`` of a codes tile: 256 bytes (512 values, 16 scale groups: whole bf16 tiles
  of the scales) or the whole row, and up to 512 of the ``N`` rows."""
  return _tile(width, TARGET_K // 2, 256), _tile(n, TARGET_N, 128)


def _mxfp4_matmul(xb, codes, scales_t, block_group, num_used, interpret):
  nb, bm, _ = xb.shape
  n, width = codes.shape[1], codes.shape[2]
  bh, bn = _mxfp4_tiles(width, n)
  nk = pl.cdiv(width, bh)
  half = lambda: pl.BlockSpec((None, bm, bh), lambda i, j, kk, bg, nu: (_used(i, nu), 0, kk))
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2, grid=(nb, pl.cdiv(n, bn), nk),
      in_specs=[half(), half(),
                pl.BlockSpec((None, bn, bh), lambda i, j, kk, bg, nu: (bg[_used(i, nu)], j, kk)),
                pl.BlockSpec((None, bh // BYTES_PER_GROUP, bn),
                             lambda i, j, kk, bg, nu: (bg[_used(i, nu)], kk, j))],
      out_specs=pl.BlockSpec((None, bm, bn), lambda i, j, kk, bg, nu: (i, 0, j)),
      scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)])
  return pl.pallas_call(
      functools.partial(_mxfp4_kernel, num_k=nk, width=width),
      grid_spec=grid_spec, out_shape=jax.ShapeDtypeStruct((nb, bm, n), xb.dtype),
      name="jaxattn_grouped_matmul_mxfp4_tpu",
      **_params(interpret, ("parallel", "parallel", "arbitrary")),
  )(block_group, num_used.reshape(1), *common.halves(xb, width), codes, scales_t)


def _mxfp4_dx_kernel(bg_ref, nu_ref, dy_ref, c_ref, s_ref, de_ref, do_ref, acc_e, acc_o, *,
                     num_n, width, bn, n):
  i, kk, jn = pl.program_id(0), pl.program_id(1), pl.program_id(2)

  @pl.when(jn == 0)
  def _():
    acc_e[...] = jnp.zeros_like(acc_e)
    acc_o[...] = jnp.zeros_like(acc_o)

  @pl.when(i < nu_ref[0])
  def _():
    # the contraction runs over N here: a ragged last N tile is masked on both sides
    low, high = (_masked(w, 0, jn, bn, n) for w in _dequantized(
        c_ref[...], s_ref[...], kk, width, dy_ref.dtype))
    dy = _masked(dy_ref[...], 1, jn, bn, n)
    acc_e[...] += lax.dot_general(dy, low, NN, preferred_element_type=jnp.float32)
    acc_o[...] += lax.dot_general(dy, high, NN, preferred_element_type=jnp.float32)

  @pl.when(jn == num_n - 1)
  def _():
    de_ref[...] = acc_e[...].astype(de_ref.dtype)
    do_ref[...] = acc_o[...].astype(do_ref.dtype)


def _mxfp4_dx(dy, codes, scales_t, block_group, num_used, k: int, interpret):
  """``dxb[b] = dy[b] @ W[g]^T`` with ``W [K, N]`` dequantized from MXFP4: the even and odd
  columns come out apart (over the codes' width) and are interleaved here."""
  nb, bm, n = dy.shape
  width = codes.shape[2]
  bh, bn = _mxfp4_tiles(width, n)
  nn = pl.cdiv(n, bn)
  half = lambda: pl.BlockSpec((None, bm, bh), lambda i, kk, jn, bg, nu: (i, 0, kk))
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2, grid=(nb, pl.cdiv(width, bh), nn),
      in_specs=[pl.BlockSpec((None, bm, bn), lambda i, kk, jn, bg, nu: (_used(i, nu), 0, jn)),
                pl.BlockSpec((None, bn, bh), lambda i, kk, jn, bg, nu: (bg[_used(i, nu)], jn, kk)),
                pl.BlockSpec((None, bh // BYTES_PER_GROUP, bn),
                             lambda i, kk, jn, bg, nu: (bg[_used(i, nu)], kk, jn))],
      out_specs=[half(), half()],
      scratch_shapes=[pltpu.VMEM((bm, bh), jnp.float32)] * 2)
  even, odd = pl.pallas_call(
      functools.partial(_mxfp4_dx_kernel, num_n=nn, width=width, bn=bn, n=n),
      grid_spec=grid_spec, out_shape=[jax.ShapeDtypeStruct((nb, bm, width), dy.dtype)] * 2,
      name="jaxattn_grouped_matmul_mxfp4_dx_tpu",
      **_params(interpret, ("parallel", "parallel", "arbitrary")),
  )(block_group, num_used.reshape(1), dy, codes, scales_t)
  return common.interleave(even, odd, k)


def mxfp4_kernel_operands(codes: UInt8[Array, "E N W"], scales: UInt8[Array, "E N G"]):
  """An MXFP4 expert matrix (``jaxattn.ops.mxfp4.MXFP4Array``: codes ``[E, N, W]``, ``W >= K / 2``
  bytes a row, zero past ``K / 2``) as the kernels read it: the codes as they are, the scales as
  bf16 powers of two ``[E, W / 16, N]`` (zeros past ``K / 32``; a pass over 1/16 of the codes'
  bytes)."""
  scale = jnp.ldexp(jnp.ones((), jnp.float32), scales.astype(jnp.int32) - 127)
  scale = common.scales_per_16_bytes(codes, scale)
  return codes, jnp.swapaxes(scale, -1, -2).astype(jnp.bfloat16)


block_matmul_mxfp4_tpu = common.frozen_block_matmul(_mxfp4_matmul, _mxfp4_dx)
block_matmul_mxfp4_tpu.__doc__ = """``block_matmul_mxfp4_tpu(xb [NB, bm, K], codes, scales_t,
block_group, num_used, interpret=None)``: ``block_matmul`` with the experts' matrices ``W [E, K,
N]`` in MXFP4 (``codes`` and ``scales_t`` from ``mxfp4_kernel_operands``), frozen."""


__all__ = ["block_matmul_tpu", "block_matmul_mxfp4_tpu", "mxfp4_kernel_operands"]
