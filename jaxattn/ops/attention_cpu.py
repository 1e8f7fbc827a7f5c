"""The ``"cpu"`` implementation of ``dot_product_attention``: a fused native kernel for the CPU.

The forward pass is one XLA FFI custom call into ``jaxattn/native/flash_attention.cc``: a flash
attention loop in C++ with register-blocked ``q k^T`` and ``p v`` tiles, a vectorized base-2
softmax and the query blocks spread over XLA's intra-op threads.  The chunked XLA path
(``"xla_chunked"``) computes the same function with one XLA op per step of the loop; the native
kernel keeps each block of logits in cache between its two matmuls and runs independent query
blocks on independent cores, about twice as fast on a 2-core AVX-512 machine (see
``experiments/bench_attention.py``).

The backward pass is a second native kernel (flash-attention-2: probabilities recomputed from the
log-sum-exp the forward returns; one task per key block computes its dK/dV and adds its dQ share
into a per-thread accumulator, so dQ's summation order depends on scheduling in the last bits).

It computes the masks that are a band of positions (causal, sliding window, full attention, any
conjunction of them; ``jaxattn.ops.masks._band``), optionally with segment ids (packed sequences;
key blocks that share no id with a query block are skipped) and key lengths, ALiBi (from slopes
and positions) and a soft-cap, with a static ``q_offset`` and scale and no dense bias, in fp32
(bf16 / fp16 inputs are computed in fp32 and rounded once).
Anything else raises ``UnsupportedError``, so ``implementation=None`` moves on to
``"xla_chunked"``.  Without a C++ compiler the kernel is unavailable (``jaxattn.native.reason()``).
Under a device mesh the call runs inside ``shard_map`` with batch and heads split, as the Pallas
kernels do.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from jaxattn import native
from jaxattn.ops import attention_chunked
from jaxattn.ops.attention import UnsupportedError
from jaxattn.ops.masks import AndMask, Mask, PaddingMask, SegmentMask, _band

# Measured on a 2-core AVX-512 CPU, causal, 8 heads of 64, fp32, T = 8192 (forward, seconds):
#   32x256 0.329, 64x256 0.306, 64x128 0.297, 128x256 0.302, 64x512 0.302.
DEFAULT_BLOCK_Q = 64
DEFAULT_BLOCK_K = 128
# Backward blocks (both passes).
BWD_BLOCK_Q = 64
BWD_BLOCK_K = 128
_TARGET = "jaxattn_flash_attention_fwd_f32"
_TARGET_BWD = "jaxattn_flash_attention_bwd_f32"


@dataclasses.dataclass(frozen=True)
class _Static:
  scale: float
  left: int  # -1: unbounded
  right: int  # -1: unbounded
  q_offset: int
  block_q: int
  block_k: int
  soft_cap: float  # 0: none


def cpu_attention(
    query: Float[Array, "B T N H"],
    key: Float[Array, "B S K H"],
    value: Float[Array, "B S K h"],
    *,
    bias=None,
    mask: Mask | None = None,
    mask_array=None,
    scale: float,
    alibi_slopes=None,
    logits_soft_cap: float | None = None,
    q_offset: int = 0,
    return_residuals: bool = False,
    block_q: int | None = None,
    block_k: int | None = None,
    mesh=None,
    residuals=None,
):
  """Attention by the native CPU kernel; the normalized signature of the dispatch backends.

  Args as ``chunked_attention``; ``block_q`` (a multiple of 8) and ``block_k`` (a multiple of 32)
  default to ``DEFAULT_BLOCK_Q / DEFAULT_BLOCK_K``; ``mesh`` as the Pallas kernels (None: the
  context mesh, if any); ``residuals`` as ``chunked_attention``'s (given ``(out, lse)``: only the
  backward kernel runs).

  Raises:
    UnsupportedError: for what the kernel does not compute (see the module docstring).
    ValueError: for bad block sizes.
  """
  for name, present in (("bias", bias is not None), ("a boolean mask array", mask_array is not None)):
    if present:
      raise UnsupportedError(f"the native CPU kernel does not support {name}")
  static, data = attention_chunked.split_static(mask)
  band = (math.inf, math.inf) if static is None else _band(static)
  segments, lengths = _data_parts(data)
  if band is None or segments is False:
    raise UnsupportedError(f"the native CPU kernel computes band masks (causal / sliding window) "
                           f"with segment ids and key lengths, got {type(mask).__name__}")
  static_offset = attention_chunked._concrete(q_offset, int)
  static_scale = attention_chunked._concrete(scale, float)
  if static_offset is None or static_scale is None:
    raise UnsupportedError("the native CPU kernel needs a static q_offset and scale")
  if jax.default_backend() != "cpu":
    raise UnsupportedError(f"the native kernel runs on CPU, the default backend is "
                           f"{jax.default_backend()!r}")
  bq = DEFAULT_BLOCK_Q if block_q is None else block_q
  bk = DEFAULT_BLOCK_K if block_k is None else block_k
  if not isinstance(bq, (int, np.integer)) or bq <= 0 or bq % 8:
    raise ValueError(f"`block_q` must be a positive multiple of 8, got {block_q!r}.")
  if not isinstance(bk, (int, np.integer)) or bk <= 0 or bk % 32:
    raise ValueError(f"`block_k` must be a positive multiple of 32, got {block_k!r}.")
  if not native.available():
    raise UnsupportedError(f"the native CPU kernels are unavailable: {native.reason()}")

  def side(x):
    return -1 if math.isinf(x) else int(x)

  st = _Static(scale=static_scale, left=side(band[0]), right=side(band[1]), q_offset=static_offset,
               block_q=int(bq), block_k=int(bk),
               soft_cap=0.0 if logits_soft_cap is None else float(logits_soft_cap))
  q_ids, kv_ids = (None, None) if segments is None else segments
  # Mask objects may hold batch-1 arrays that broadcast over B (the XLA paths broadcast them);
  # the kernel reads one row per batch entry.
  b, t, s = query.shape[0], query.shape[1], key.shape[1]
  try:
    if q_ids is not None:
      q_ids, kv_ids = jnp.broadcast_to(q_ids, (b, t)), jnp.broadcast_to(kv_ids, (b, s))
    if lengths is not None:
      lengths = jnp.broadcast_to(lengths, (b,))
  except ValueError as e:
    raise ValueError(f"the mask's segment ids / lengths do not broadcast to [B, T] / [B, S] / [B] "
                     f"= {(b, t)} / {(b, s)} / {(b,)}: {e}") from None
  slopes = None if alibi_slopes is None else jnp.asarray(alibi_slopes, jnp.float32)

  def local(q, k, v, q_ids, kv_ids, lengths, slopes, _offset, _scale, _bias, _mask, given):
    return _build(st)(q, k, v, q_ids, kv_ids, lengths, slopes, given)

  from pallas_kernels.flash_attention.sharded import shard_attention  # noqa: PLC0415

  out, lse = shard_attention(local, query, key, value, q_ids=q_ids, kv_ids=kv_ids,
                             kv_lengths=lengths, alibi_slopes=slopes, q_offset=static_offset,
                             scale=static_scale, mesh=mesh, residuals=residuals)
  return (out, lse) if return_residuals else out


def _data_parts(data):
  """``(segments, lengths)`` of the data part of a mask: ``(q_ids, kv_ids)`` or None, and a
  ``[B]`` length array or None; ``(False, None)`` when it holds anything else."""
  segments = lengths = None
  stack = [] if data is None else [data]
  while stack:
    m = stack.pop()
    if isinstance(m, AndMask):
      stack += [m.a, m.b]
    elif isinstance(m, SegmentMask) and segments is None:
      segments = (jnp.asarray(m.q_segment_ids, jnp.int32), jnp.asarray(m.kv_segment_ids, jnp.int32))
    elif isinstance(m, PaddingMask) and lengths is None:
      lengths = jnp.asarray(m.kv_lengths, jnp.int32)
    else:
      return False, None
  return segments, lengths


def workspace_bytes(query_shape, key_shape, value_shape, *, backward: bool = False,
                    threads: int = 1) -> int:
  """Bytes the kernels allocate outside XLA's buffers, linear in the sequence length.

  Forward: ``k^T`` and ``v`` packed per KV head (``B K S_pad (H + h_pad)`` fp32).  With
  ``backward``, the larger of that and the backward's packs (``k^T``, ``v^T``, key rows:
  ``B K S_pad (2 H_pad + h)``) plus its per-thread dQ accumulators
  (``threads B N T_pad H_pad``), ``threads`` being the cores that run it.
  """
  b, s, kh, h = key_shape
  t, n = query_shape[1], query_shape[2]
  hv = value_shape[-1]
  s_pad = -(-s // 32) * 32
  hv_pad = -(-hv // 16) * 16
  h_pad = -(-h // 16) * 16
  fwd = 4 * b * kh * s_pad * (h + hv_pad)
  if not backward:
    return fwd
  t_pad = -(-t // BWD_BLOCK_Q) * BWD_BLOCK_Q
  bwd = 4 * b * kh * s_pad * (h + hv + h_pad) + 4 * threads * b * n * t_pad * h_pad
  return max(fwd, bwd)


def _mask_operands(q_ids, kv_ids, lengths, slopes):
  """The optional mask inputs of both kernels, each a size-0 array when absent."""
  def opt(x, dtype):
    return jnp.zeros((0,), dtype) if x is None else x.astype(dtype)
  i32 = jnp.int32
  return opt(q_ids, i32), opt(kv_ids, i32), opt(lengths, i32), opt(slopes, jnp.float32)


def _attrs(st: _Static, block_q: int, block_k: int) -> dict:
  """The attributes both kernels take."""
  return dict(scale=np.float32(st.scale), soft_cap=np.float32(st.soft_cap), left=np.int64(st.left),
              right=np.int64(st.right), q_offset=np.int64(st.q_offset),
              block_q=np.int64(block_q), block_k=np.int64(block_k))


def _forward(st: _Static, q, k, v, q_ids, kv_ids, lengths, slopes):
  b, t, n, _ = q.shape
  hv = v.shape[-1]
  f32 = jnp.float32
  call = jax.ffi.ffi_call(
      _TARGET, (jax.ShapeDtypeStruct((b, t, n, hv), f32), jax.ShapeDtypeStruct((b, n, t), f32)),
      vmap_method="broadcast_all")
  out, lse = call(q.astype(f32), k.astype(f32), v.astype(f32),
                  *_mask_operands(q_ids, kv_ids, lengths, slopes),
                  **_attrs(st, st.block_q, st.block_k))
  return out.astype(q.dtype), lse


def _backward(st: _Static, q, k, v, q_ids, kv_ids, lengths, slopes, out, lse, d_out, d_lse):
  f32 = jnp.float32
  # delta_i = sum_h do * o, minus the cotangent of the log-sum-exp (which enters as p * d_lse).
  delta = jnp.sum(d_out.astype(f32) * out.astype(f32), axis=-1)  # [B, T, N]
  delta = jnp.swapaxes(delta, -1, -2) - d_lse.astype(f32)  # [B, N, T]
  call = jax.ffi.ffi_call(
      _TARGET_BWD, tuple(jax.ShapeDtypeStruct(x.shape, f32) for x in (q, k, v)),
      vmap_method="broadcast_all")
  dq, dk, dv = call(q.astype(f32), k.astype(f32), v.astype(f32), d_out.astype(f32),
                    lse.astype(f32), delta, *_mask_operands(q_ids, kv_ids, lengths, slopes),
                    **_attrs(st, BWD_BLOCK_Q, BWD_BLOCK_K))
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.lru_cache(maxsize=128)
def _build(st: _Static):
  """``(q, k, v, q_ids, kv_ids, lengths, slopes, given) -> (out, lse)`` with the native backward,
  for one static configuration (``given``: the forward's ``(out, lse)``, or None to compute
  them)."""

  @jax.custom_vjp
  def attention(q, k, v, q_ids, kv_ids, lengths, slopes, given):
    if given is not None:
      return given
    return _forward(st, q, k, v, q_ids, kv_ids, lengths, slopes)

  def fwd(q, k, v, q_ids, kv_ids, lengths, slopes, given):
    out, lse = _forward(st, q, k, v, q_ids, kv_ids, lengths, slopes) if given is None else given
    return (out, lse), (q, k, v, q_ids, kv_ids, lengths, slopes, out, lse)

  def bwd(res, cotangents):
    q, k, v, q_ids, kv_ids, lengths, slopes, out, lse = res
    d_out, d_lse = cotangents
    dq, dk, dv = _backward(st, q, k, v, q_ids, kv_ids, lengths, slopes, out, lse, d_out, d_lse)
    return dq, dk, dv, None, None, None, None, None  # slopes: see dot_product_attention

  attention.defvjp(fwd, bwd)
  return attention


__all__ = ["cpu_attention", "workspace_bytes", "DEFAULT_BLOCK_Q", "DEFAULT_BLOCK_K"]
