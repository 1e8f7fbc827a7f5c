"""The experts' grouped matmul on NVIDIA GPUs (Pallas Triton), over the blocked layout, with dense
or MXFP4 weights: ``implementation="pallas_gpu"``.

The layout is the TPU kernels' (``tpu.py``): every expert's rows padded to whole blocks of ``bm``
rows, ``block_group[b]`` the expert of block ``b``, blocks ``>= num_used`` empty.  One program per
``(block, N tile)`` reads its expert from ``block_group`` and loops over ``K`` in tiles, the
expert's weight tile addressed in the whole weight array (Triton loads by pointer; nothing is
gathered or copied)::

    grid (NB, N / bn)
    g = block_group[b];  acc = 0                      [bm, bn] fp32
    for k0 in 0, bk, ..:  acc += xb[b, :, k0:+bk] @ W[g, k0:+bk, n0:+bn]
    y[b, :, n0:+bn] = acc                             (zeros for an unused block: no iteration)

``dx`` is the same kernel with ``W`` read transposed in its tiles.  ``dW``: one program per
``(expert, K tile, N tile)`` loops over that expert's blocks (contiguous, from the layout), so
every output tile is written once, without atomics; an expert without rows writes zeros.

MXFP4 (gpt-oss): the codes ``[E, N, W]`` (``jaxattn.ops.mxfp4.MXFP4Array``) are read as ``[E, N,
W / 16, 16]`` tiles -- one scale group per row of 16 bytes -- and decoded in registers: each nibble
to its float bits (``e2m1_values``), times its group's scale (the uint8 exponent shifted into a
float's exponent field), then the even / odd halves of ``x`` times the low / high nibbles as in
the TPU kernels.  The backward gives ``dx`` only.

Tiles are powers of two (Triton's): ``bk`` and ``bn`` the largest up to 64 / 128 that divide the
axes (``K`` and ``N`` must be multiples of 16: gpt-oss's 2880 takes 64); MXFP4 tiles of 128 bytes
(256 values).  ``bm`` (the layout's block size) at least 16.

Status: validated in interpret mode (``tests/kernels/test_grouped_matmul_gpu.py``) and lowered for
CUDA; not run or timed on a GPU.  ``implementation=None`` does not pick it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, UInt8

from jaxattn.ops.mxfp4 import e2m1_values
from pallas_kernels.decode_attention.gpu import default_interpret
from pallas_kernels.grouped_matmul import common

BYTES_PER_GROUP = common.BYTES_PER_GROUP
MIN_TILE = 16          # Triton's smallest dot tile
MXFP4_TILE_BYTES = 128


def _pow2_tile(size: int, target: int, name: str) -> int:
  """The largest power of two from 16 up to ``target`` that divides ``size``."""
  t = target
  while t >= MIN_TILE:
    if size % t == 0:
      return t
    t //= 2
  raise ValueError(f"`implementation=\"pallas_gpu\"` tiles {name} in powers of two from "
                   f"{MIN_TILE}: its size {size} is not a multiple of {MIN_TILE}.")


def check_block_size(bm: int) -> None:
  if bm < MIN_TILE or bm & (bm - 1):
    raise ValueError(f"`block_size` must be a power of two >= {MIN_TILE} for "
                     f"`implementation=\"pallas_gpu\"` (a Triton dot tile), got {bm}.")


def _params(interpret, num_warps=4):
  return dict(compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
              interpret=default_interpret(interpret))


def _full(shape):
  """A whole array as one block (the kernel addresses its tiles itself)."""
  return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


# -- dense weights ----------------------------------------------------------------------------------


def _matmul_kernel(bg_ref, nu_ref, x_ref, w_ref, o_ref, *, bk, bn, num_k, transpose_w):
  b, j = pl.program_id(0), pl.program_id(1)
  g = bg_ref[b]
  n0 = pl.multiple_of(j * bn, bn)

  def body(t, acc):
    k0 = pl.multiple_of(t * bk, bk)
    x = x_ref[:, pl.ds(k0, bk)]                                           # [bm, bk]
    if transpose_w:                                                       # W[g] is [N, K]
      return acc + plgpu.dot(x, w_ref[g, pl.ds(n0, bn), pl.ds(k0, bk)], trans_b=True)
    return acc + plgpu.dot(x, w_ref[g, pl.ds(k0, bk), pl.ds(n0, bn)])

  trips = jnp.where(b < nu_ref[0], num_k, 0)
  acc = lax.fori_loop(0, trips, body, jnp.zeros(o_ref.shape, jnp.float32))
  o_ref[...] = acc.astype(o_ref.dtype)


def _matmul(xb, w, block_group, num_used, *, transpose_w: bool, interpret):
  nb, bm, k = xb.shape
  n = w.shape[1] if transpose_w else w.shape[2]
  bk, bn = _pow2_tile(k, 64, "the contraction axis"), _pow2_tile(n, 128, "the output axis")
  kernel = functools.partial(_matmul_kernel, bk=bk, bn=bn, num_k=k // bk,
                             transpose_w=transpose_w)
  return pl.pallas_call(
      kernel, grid=(nb, n // bn),
      in_specs=[_full(block_group.shape), _full((1,)),
                pl.BlockSpec((None, bm, k), lambda b, j: (b, 0, 0)), _full(w.shape)],
      out_specs=pl.BlockSpec((None, bm, bn), lambda b, j: (b, 0, j)),
      out_shape=jax.ShapeDtypeStruct((nb, bm, n), xb.dtype),
      name="jaxattn_grouped_matmul_gpu", **_params(interpret),
  )(block_group, num_used.reshape(1), xb, w.astype(xb.dtype))


def _weight_grad_kernel(start_ref, count_ref, x_ref, dy_ref, o_ref, *, bk, bn):
  e, a, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  k0, n0 = pl.multiple_of(a * bk, bk), pl.multiple_of(c * bn, bn)
  first = start_ref[e]

  def body(t, acc):
    blk = first + t
    x = x_ref[blk, :, pl.ds(k0, bk)]                                       # [bm, bk]
    dy = dy_ref[blk, :, pl.ds(n0, bn)]                                     # [bm, bn]
    return acc + plgpu.dot(x, dy, trans_a=True)

  acc = lax.fori_loop(0, count_ref[e], body, jnp.zeros(o_ref.shape, jnp.float32))
  o_ref[...] = acc.astype(o_ref.dtype)


def group_blocks(block_group, num_used, num_groups: int):
  """``(first block, used blocks)`` of every group (the blocks are sorted by group)."""
  used = (jnp.arange(block_group.shape[0]) < num_used).astype(jnp.int32)
  count = jnp.zeros((num_groups,), jnp.int32).at[block_group].add(used)
  return (jnp.cumsum(count) - count).astype(jnp.int32), count


def _weight_grad(xb, dy, block_group, num_used, num_groups, *, out_dtype, interpret):
  nb, bm, k = xb.shape
  n = dy.shape[2]
  bk, bn = _pow2_tile(k, 64, "the contraction axis"), _pow2_tile(n, 64, "the output axis")
  start, count = group_blocks(block_group, num_used, num_groups)
  return pl.pallas_call(
      functools.partial(_weight_grad_kernel, bk=bk, bn=bn), grid=(num_groups, k // bk, n // bn),
      in_specs=[_full(start.shape), _full(count.shape), _full(xb.shape), _full(dy.shape)],
      out_specs=pl.BlockSpec((None, bk, bn), lambda e, a, c: (e, a, c)),
      out_shape=jax.ShapeDtypeStruct((num_groups, k, n), out_dtype),
      name="jaxattn_grouped_matmul_dw_gpu", **_params(interpret),
  )(start, count, xb, dy)


block_matmul_gpu = common.dense_block_matmul(
    lambda xb, w, bg, nu, interpret: _matmul(xb, w, bg, nu, transpose_w=False,
                                             interpret=interpret),
    lambda dy, w, bg, nu, interpret: _matmul(dy, w, bg, nu, transpose_w=True,
                                             interpret=interpret),
    lambda xb, dy, bg, nu, groups, dtype, interpret: _weight_grad(
        xb, dy, bg, nu, groups, out_dtype=dtype, interpret=interpret))
block_matmul_gpu.__doc__ = """``block_matmul_gpu(xb [NB, bm, K], w [E, K, N], block_group, num_used,
interpret=None)``: ``jaxattn.ops.moe.block_matmul`` as Pallas Triton kernels (forward, ``dxb``,
``dW``)."""


# -- MXFP4 weights ----------------------------------------------------------------------------------


def _decoded(c_ref, s_ref, g, n0, bn, t, dtype):
  """The tile's ``(low, high)`` nibble values ``[bn, 128]`` (bytes ``t * 128 ..``), scaled."""
  groups = MXFP4_TILE_BYTES // BYTES_PER_GROUP
  codes = c_ref[g, pl.ds(n0, bn), pl.ds(t * groups, groups), :].astype(jnp.int32)  # [bn, 8, 16]
  exponent = s_ref[g, pl.ds(n0, bn), pl.ds(t * groups, groups)].astype(jnp.int32)  # [bn, 8]
  scale = lax.bitcast_convert_type(exponent << 23, jnp.float32)[:, :, None]       # 2^(s - 127)
  return tuple((e2m1_values(nib) * scale).astype(dtype).reshape(bn, MXFP4_TILE_BYTES)
               for nib in (codes & 0xF, (codes >> 4) & 0xF))


def _mxfp4_kernel(bg_ref, nu_ref, xe_ref, xo_ref, c_ref, s_ref, o_ref, *, bn, num_t):
  b, j = pl.program_id(0), pl.program_id(1)
  g = bg_ref[b]
  n0 = pl.multiple_of(j * bn, bn)

  def body(t, acc):
    low, high = _decoded(c_ref, s_ref, g, n0, bn, t, xe_ref.dtype)
    cols = pl.ds(pl.multiple_of(t * MXFP4_TILE_BYTES, MXFP4_TILE_BYTES), MXFP4_TILE_BYTES)
    return (acc + plgpu.dot(xe_ref[:, cols], low, trans_b=True)
            + plgpu.dot(xo_ref[:, cols], high, trans_b=True))

  trips = jnp.where(b < nu_ref[0], num_t, 0)
  acc = lax.fori_loop(0, trips, body, jnp.zeros(o_ref.shape, jnp.float32))
  o_ref[...] = acc.astype(o_ref.dtype)


def _mxfp4_dx_kernel(bg_ref, nu_ref, dy_ref, c_ref, s_ref, de_ref, do_ref, *, bn, num_n):
  b, t = pl.program_id(0), pl.program_id(1)
  g = bg_ref[b]

  def body(jn, accs):
    n0 = pl.multiple_of(jn * bn, bn)
    low, high = _decoded(c_ref, s_ref, g, n0, bn, t, dy_ref.dtype)
    dy = dy_ref[:, pl.ds(n0, bn)]                                          # [bm, bn]
    return accs[0] + plgpu.dot(dy, low), accs[1] + plgpu.dot(dy, high)

  trips = jnp.where(b < nu_ref[0], num_n, 0)
  zero = jnp.zeros(de_ref.shape, jnp.float32)
  even, odd = lax.fori_loop(0, trips, body, (zero, zero))
  de_ref[...] = even.astype(de_ref.dtype)
  do_ref[...] = odd.astype(do_ref.dtype)


def mxfp4_kernel_operands(codes: UInt8[Array, "E N W"], scales: UInt8[Array, "E N G"]):
  """The codes viewed as ``[E, N, W / 16, 16]`` (free) and the uint8 scales zero-padded to one per
  16 bytes ``[E, N, W / 16]`` (a pass over 1/16 of the codes' bytes)."""
  e, n, width = codes.shape
  return (codes.reshape(e, n, width // BYTES_PER_GROUP, BYTES_PER_GROUP),
          common.scales_per_16_bytes(codes, scales))


def _mxfp4_matmul(xb, codes4, scales, block_group, num_used, interpret):
  nb, bm, _ = xb.shape
  n, width = codes4.shape[1], codes4.shape[2] * BYTES_PER_GROUP
  bn = _pow2_tile(n, 64, "the output axis")
  half = pl.BlockSpec((None, bm, width), lambda b, j: (b, 0, 0))
  return pl.pallas_call(
      functools.partial(_mxfp4_kernel, bn=bn, num_t=width // MXFP4_TILE_BYTES),
      grid=(nb, n // bn),
      in_specs=[_full(block_group.shape), _full((1,)), half, half, _full(codes4.shape),
                _full(scales.shape)],
      out_specs=pl.BlockSpec((None, bm, bn), lambda b, j: (b, 0, j)),
      out_shape=jax.ShapeDtypeStruct((nb, bm, n), xb.dtype),
      name="jaxattn_grouped_matmul_mxfp4_gpu", **_params(interpret),
  )(block_group, num_used.reshape(1), *common.halves(xb, width), codes4, scales)


def _mxfp4_dx(dy, codes4, scales, block_group, num_used, k: int, interpret):
  nb, bm, n = dy.shape
  width = codes4.shape[2] * BYTES_PER_GROUP
  bn = _pow2_tile(n, 64, "the output axis")
  half = pl.BlockSpec((None, bm, MXFP4_TILE_BYTES), lambda b, t: (b, 0, t))
  even, odd = pl.pallas_call(
      functools.partial(_mxfp4_dx_kernel, bn=bn, num_n=n // bn),
      grid=(nb, width // MXFP4_TILE_BYTES),
      in_specs=[_full(block_group.shape), _full((1,)),
                pl.BlockSpec((None, bm, n), lambda b, t: (b, 0, 0)), _full(codes4.shape),
                _full(scales.shape)],
      out_specs=[half, half],
      out_shape=[jax.ShapeDtypeStruct((nb, bm, width), dy.dtype)] * 2,
      name="jaxattn_grouped_matmul_mxfp4_dx_gpu", **_params(interpret),
  )(block_group, num_used.reshape(1), dy, codes4, scales)
  return common.interleave(even, odd, k)


block_matmul_mxfp4_gpu = common.frozen_block_matmul(_mxfp4_matmul, _mxfp4_dx)
block_matmul_mxfp4_gpu.__doc__ = """``block_matmul_mxfp4_gpu(xb [NB, bm, K], codes4, scales,
block_group, num_used, interpret=None)``: ``block_matmul`` with MXFP4 experts (``codes4``,
``scales`` from ``mxfp4_kernel_operands``), frozen."""


__all__ = ["block_matmul_gpu", "block_matmul_mxfp4_gpu", "mxfp4_kernel_operands",
           "check_block_size", "group_blocks"]
