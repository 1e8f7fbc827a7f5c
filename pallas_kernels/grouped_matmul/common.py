"""What the TPU and GPU grouped-matmul kernels share: their gradient plumbing around the kernels
(``jax.custom_vjp``), and the even / odd split of the activations for MXFP4 codes."""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from jaxattn.ops.mxfp4 import GROUP


def dense_block_matmul(forward: Callable, dx: Callable, dw: Callable) -> Callable:
  """``f(xb, w, block_group, num_used, interpret=None)`` with kernels for its forward
  ``forward(xb, w, bg, nu, interpret)``, ``dx(dy, w, bg, nu, interpret)`` and ``dw(xb, dy, bg, nu,
  num_groups, dtype, interpret)`` (under jit XLA drops a kernel whose result nobody reads: a
  frozen matrix's ``dW``)."""
  @functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
  def f(xb, w, block_group, num_used, interpret=None):
    return forward(xb, w, block_group, num_used, interpret)

  def fwd(xb, w, block_group, num_used, interpret):
    return forward(xb, w, block_group, num_used, interpret), (xb, w, block_group, num_used)

  def bwd(interpret, res, dy):
    xb, w, block_group, num_used = res
    # (dy has the output's dtype: xb's)
    return (dx(dy, w, block_group, num_used, interpret),
            dw(xb, dy, block_group, num_used, w.shape[0], w.dtype, interpret), None, None)

  f.defvjp(fwd, bwd)
  return f


def frozen_block_matmul(forward: Callable, dx: Callable) -> Callable:
  """``f(xb, codes, scales, block_group, num_used, interpret=None)`` for frozen (MXFP4) weights:
  ``forward(xb, codes, scales, bg, nu, interpret)`` and ``dx(dy, codes, scales, bg, nu, k,
  interpret)``; no gradient reaches the weights."""
  @functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
  def f(xb, codes, scales, block_group, num_used, k, interpret):
    return forward(xb, codes, scales, block_group, num_used, interpret)

  def fwd(xb, codes, scales, block_group, num_used, k, interpret):
    out = forward(xb, codes, scales, block_group, num_used, interpret)
    return out, (codes, scales, block_group, num_used)

  def bwd(k, interpret, res, dy):
    return dx(dy, *res, k, interpret), None, None, None, None

  f.defvjp(fwd, bwd)

  def call(xb, codes, scales, block_group, num_used, interpret=None):
    return f(xb, codes, scales, block_group, num_used, xb.shape[2], interpret)
  return call


BYTES_PER_GROUP = GROUP // 2   # codes bytes under one MXFP4 scale


def scales_per_16_bytes(codes, scales):
  """``scales [E, N, K / 32]`` (stored or converted) zero-padded to one per 16 bytes of the codes'
  rows ``[E, N, W]``: ``[E, N, W / 16]`` (the rows' padding bytes get 0; a pass over 1/16 of the
  codes' bytes)."""
  pad = codes.shape[-1] // BYTES_PER_GROUP - scales.shape[-1]
  return jnp.pad(scales, ((0, 0), (0, 0), (0, pad)))


def halves(xb, width: int):
  """``xb``'s even and odd columns (the low and high nibbles' rows of ``W``), each zero-padded to
  the codes' ``width`` bytes."""
  pad = ((0, 0), (0, 0), (0, width - xb.shape[2] // 2))
  return jnp.pad(xb[..., 0::2], pad), jnp.pad(xb[..., 1::2], pad)


def interleave(even, odd, k: int):
  """The inverse of ``halves`` for ``dxb``: ``[..., width]`` even and odd columns -> ``[..., K]``."""
  return jnp.stack([even[..., :k // 2], odd[..., :k // 2]], axis=-1).reshape(
      even.shape[:-1] + (k,))
