"""Flash attention for TPU (Mosaic): forward, dQ and dK/dV kernels with block-sparse masks.

Reads top-down: public entry -> custom VJP -> forward / backward -> ``pallas_call`` builders ->
kernels.  Semantics are those of ``jaxattn.ops.attention.dot_product_attention``; the tests hold the
kernels against that formula.

Layout.  Inputs ``[B, T, N, H]`` are transposed (and padded to whole blocks) to ``[B, N, T, H]``
so that every VMEM block is a ``[rows, head_dim]`` tile.  GQA/MQA: query head ``n`` reads KV head
``n // G`` through the index maps; K/V are never repeated in memory.

Forward grid ``(B, N, query blocks, W)``::

    for w in range(W):                       # "arbitrary": sequential, accumulates in VMEM
      j, kind = table[b, i, w]               # scalar-prefetched (SMEM): w-th non-empty key block
      if kind != EMPTY:                      # padded steps re-point to the last block: no DMA
        s = scores(q_i . k_j, bias_ij)       # scale -> bias -> ALiBi -> soft-cap -> mask
        m' = max(m, rowmax(s));  p = exp(s - m');  a = exp(m - m')
        l = a l + rowsum(p);  acc = a acc + p v_j;  m = m'
    out_i = acc / l;  lse_i = m + log l      (zeros and -inf for a row with no allowed key)

``W`` is the largest number of non-empty key blocks of any query block: causal attention runs about
half the grid steps of full attention, a sliding window ``O(window / block)`` per query block.

Backward (FlashAttention-2, recomputing ``p = exp(s - lse)`` from the forward's log-sum-exp):

* dQ kernel, grid ``(B, N, query blocks, W)``: ``dq_i = scale * sum_j ds_ij k_j``;
* dK/dV kernel, grid ``(B, K, key blocks, G * W_t)``: for each key block the non-empty query
  blocks of all ``G`` query heads of its KV head (transposed table), in transposed orientation
  ``s^T = k_j q_i^T`` so every matmul is a plain or NT product:
  ``dv_j = sum p^T do``, ``dk_j = scale * sum ds^T q`` with ``ds = p (do v^T - delta)``.

A dense bias ``[B|1, N|1, T|1, S]`` is streamed as ``[block_q, block_k]`` tiles (``[1,
block_k]`` for one row) beside the key blocks (the same table entry picks both; the dK/dV kernel
transposes its tile); its gradient, computed when the bias is being differentiated, is the dQ
kernel's ``ds`` tile for a bias with every dim, else comes from its own kernel
(``_dbias_call``), which sums ``ds`` over the batch rows / heads / query blocks that share each
block in VMEM (no ``[B, N, T, S]`` buffer).  A boolean mask array streams the same way as int8
tiles, and its blocks refine the tables.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Bool, Float, Int

from jaxattn.ops.masks import FULL, PARTIAL, Mask
from pallas_kernels.flash_attention import common as C
from pallas_kernels.flash_attention.sharded import run_flash

NT_DIMS = (((1,), (1,)), ((), ()))  # a @ b.T
NN_DIMS = (((1,), (0,)), ((), ()))  # a @ b
_KIND_MASK = (1 << C.KIND_BITS) - 1


def _div(x, d: int):
  """``x // d`` for non-negative grid indices: truncating division (one scalar op; ``//`` adds
  sign fix-ups), and none at all when ``d == 1``."""
  return x if d == 1 else lax.div(x, d)


def _rem(x, d: int):
  return 0 if d == 1 else lax.rem(x, d)


# ----------------------------------------------------------------------------------------------
# Public entry point
# ----------------------------------------------------------------------------------------------


def flash_attention(
    query: Float[Array, "B T N H"],
    key: Float[Array, "B S K H"],
    value: Float[Array, "B S K h"],
    mask: Mask | None = None,
    *,
    scale: float | None = None,
    alibi_slopes: Float[Array, "N"] | None = None,
    logits_soft_cap: float | None = None,
    q_offset: int | Int[Array, ""] = 0,
    return_residuals: bool = False,
    block_sizes: C.BlockSizes | None = None,
    interpret=None,
    mesh=None,
    residuals=None,
    bias: Float[Array, "#B #N #T #S"] | None = None,
    mask_array: Bool[Array, "#B #N #T #S"] | None = None,
) -> Float[Array, "B T N h"] | tuple[Float[Array, "B T N h"], Float[Array, "B N T"]]:
  """Flash attention on TPU; the function of ``dot_product_attention``.

  Args:
    query, key, value: ``[B, T, N, H]``, ``[B, S, K, H]``, ``[B, S, K, h]``; float32 or bfloat16.
    bias: a dense additive bias ``[B|1, N|1, T|1, S|1]`` (a T5 relative bias, a user bias),
      added after the scale; differentiated (its gradient is written only when it is being
      differentiated).  Size-1 batch / head dims are read, not repeated, one row for all queries
      as one-row blocks; a size-1 ``S`` is broadcast before the kernel.
    mask_array: a dense boolean mask ``[B|1, N|1, T|1, S|1]`` (True = attend), ``&`` with
      ``mask``: streamed as int8 tiles (broadcast dims as ``bias``'); key blocks that it empties
      for every head of a batch row are skipped, blocks it fills need no mask evaluation
      (per-row block tables).
    mask: a ``jaxattn.ops.masks.Mask``: any position mask (causal, window, global tokens, their
      ``&``/``|``), ``&`` at most one ``SegmentMask`` and any ``PaddingMask``.
    scale: logits scale, default ``1 / sqrt(H)``; a traced one is a constant to ``jax.grad``
      here (its gradient is 0), as are the slopes: ``dot_product_attention`` differentiates both.
    alibi_slopes: ``[N]`` ALiBi slopes (constant here; `dot_product_attention` differentiates them).
    logits_soft_cap: ``cap * tanh(logits / cap)`` when set.
    q_offset: position of query row 0 in key coordinates; a traced value disables static block
      skipping (every block is visited, still exact).
    return_residuals: also return the fp32 log-sum-exp ``[B, N, T]``.
    block_sizes: ``BlockSizes``; default ``BlockSizes.tpu()``.
    interpret: None (interpret unless running on TPU), False, True, or ``pltpu.InterpretParams``.
    mesh: a ``Mesh`` to run under ``shard_map`` (batch and heads sharded); default: the mesh set
      by ``jax.set_mesh`` if any.
    residuals: the forward's ``(out, lse)``, given: returned without running the forward kernel;
      the backward kernels run from them (``jaxattn.ops.attention.attention_gradients``).

  Returns:
    ``[B, T, N, h]`` in the query dtype; with ``return_residuals``, ``(out, lse)``.
  """
  interpret = C.default_interpret(interpret)
  out, lse = run_flash(query, key, value, mask, scale=scale, alibi_slopes=alibi_slopes,
                       logits_soft_cap=logits_soft_cap, q_offset=q_offset,
                       block_sizes=block_sizes or C.BlockSizes.tpu(), interpret=interpret,
                       mesh=mesh, build=_build, residuals=residuals, bias=bias,
                       mask_array=mask_array)
  return (out, lse) if return_residuals else out


# ----------------------------------------------------------------------------------------------
# custom VJP
# ----------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=128)
def _build(plan: C.Plan):
  """``(q, k, v, aux) -> (out [B, T, N, h], lse [B, N, T])`` with its flash backward."""
  return C.flash_custom_vjp(plan, _forward, _backward)


def _pad_to(x, axis, size, value=0):
  if x.shape[axis] == size:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, pad, constant_values=value)


def _heads_major(x, length):
  """``[B, T, N, H]`` -> ``[B, N, Tp, H]`` (zero padded)."""
  return _pad_to(jnp.swapaxes(x, 1, 2), 2, length)


class _Inputs:
  """The kernel-side views shared by forward and backward."""

  def __init__(self, plan: C.Plan, q, k, v, aux, bias=None):
    # the bias [Bb, Nb, Tp | 1, Sp] (zero padded), the mask array as int8 (0 padded)
    self.dense = tuple(
        _pad_to(x if x.shape[2] == 1 else _pad_to(x, 2, plan.q_pad), 3, plan.kv_pad)
        for x in (bias, None if aux["mask_array"] is None else aux["mask_array"].astype(jnp.int8))
        if x is not None)
    self.q = _heads_major(q, plan.q_pad)  # [B, N, Tp, H]
    self.k = _heads_major(k, plan.kv_pad)  # [B, K, Sp, H]
    self.v = _heads_major(v, plan.kv_pad)  # [B, K, Sp, h]
    ints = [aux["q_offset"].reshape(1)]
    if plan.has_lengths:
      ints.append(aux["kv_lengths"].astype(jnp.int32))
    self.iscal = jnp.concatenate(ints)  # [1 (+ B)]: q_offset, kv_lengths
    floats = [aux["scale"].reshape(1)]
    if plan.has_alibi:
      floats.append(aux["slopes"])
    self.fscal = jnp.concatenate(floats)  # [1 (+ N)]: scale, slopes
    self.q_ids = self.kv_ids = None
    if plan.has_segments:
      self.q_ids = C.pad_edge(aux["q_ids"].astype(jnp.int32), plan.q_pad)  # [B, Tp]
      self.kv_ids = C.pad_edge(aux["kv_ids"].astype(jnp.int32), plan.kv_pad)  # [B, Sp]

  def segs_for_rows_of_q(self):
    """Query ids as columns ``[B, Tp, LANES]`` and key ids as rows ``[B, SUBLANES, Sp]``."""
    b, tp = self.q_ids.shape
    sp = self.kv_ids.shape[1]
    return (jnp.broadcast_to(self.q_ids[:, :, None], (b, tp, C.NUM_LANES)),
            jnp.broadcast_to(self.kv_ids[:, None, :], (b, C.NUM_SUBLANES, sp)))

  def segs_for_rows_of_k(self):
    """Key ids as columns ``[B, Sp, LANES]`` and query ids as rows ``[B, SUBLANES, Tp]``."""
    b, tp = self.q_ids.shape
    sp = self.kv_ids.shape[1]
    return (jnp.broadcast_to(self.kv_ids[:, :, None], (b, sp, C.NUM_LANES)),
            jnp.broadcast_to(self.q_ids[:, None, :], (b, C.NUM_SUBLANES, tp)))


def _tables(plan, aux, transpose):
  entries, _ = C.block_tables(plan, q_ids=aux["q_ids"], kv_ids=aux["kv_ids"],
                              kv_lengths=aux["kv_lengths"], mask_array=aux["mask_array"],
                              transpose=transpose)
  width = entries.shape[-1]
  return entries.reshape(-1), width  # flat: 1-D SMEM arrays are not padded to tiles


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------


def _forward(plan: C.Plan, q, k, v, bias, aux):
  x = _Inputs(plan, q, k, v, aux, bias)
  entries, width = _tables(plan, aux, transpose=False)
  segs = x.segs_for_rows_of_q() if plan.has_segments else ()
  out, lse = _fwd_call(plan, width)(entries, x.iscal, x.fscal, x.q, x.k, x.v, *segs, *x.dense)
  out = jnp.swapaxes(out[:, :, :plan.q_len], 1, 2)  # [B, T, N, h]
  return out, lse[:, :, :plan.q_len, 0]  # [B, N, T]


def _launch(kernel, plan, grid, in_specs, out_specs, out_shape, scratch, vmem, name,
            sequential: int = 1):
  """The ``pallas_call`` all the kernels share: three scalar-prefetched tables (block entries, int
  and float scalars), a grid whose last ``sequential`` axes walk the non-empty blocks (and, for
  the shared bias' gradient, the rows it sums) in order."""
  semantics = ("parallel",) * (len(grid) - sequential) + ("arbitrary",) * sequential
  return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=3, grid=grid, in_specs=in_specs,
                                             out_specs=out_specs, scratch_shapes=scratch),
      out_shape=out_shape,
      compiler_params=_compiler_params(semantics, vmem),
      interpret=plan.interpret,
      name=name,
  )


def _compiler_params(semantics, vmem_bytes: int):
  # Raise the scoped VMEM limit only when the working set needs it (large blocks / head sizes).
  limit = None
  if vmem_bytes > 12 * 2**20:
    limit = min(int(vmem_bytes * 1.5), 96 * 2**20)
  return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=limit)


def vmem_bytes_forward(block_q: int, block_k: int, head_dim: int, v_head_dim: int,
                       itemsize: int, dense_itemsize: int = 0) -> int:
  """VMEM working set of one forward grid step: double-buffered q, k, v, out and lse blocks (and
  ``[block_q, block_k]`` blocks of a dense bias / mask array, ``dense_itemsize`` bytes per element
  in all, 0 without), the fp32 scratch (m, l, acc) and the fp32 ``[block_q, block_k]`` scores and
  probabilities."""
  io = 2 * itemsize * (block_q * head_dim + block_k * (head_dim + v_head_dim)
                       + block_q * v_head_dim)
  io += 2 * dense_itemsize * block_q * block_k
  io += 2 * 4 * block_q * C.NUM_LANES  # lse block
  scratch = 4 * (2 * block_q * C.NUM_LANES + block_q * v_head_dim)
  temps = 2 * 4 * block_q * block_k
  return io + scratch + temps


def vmem_bytes_dq(block_q: int, block_k: int, head_dim: int, v_head_dim: int,
                  itemsize: int, dense_itemsize: int = 0, bias_grad: bool = False) -> int:
  """VMEM working set of one dQ step: double-buffered q, k, v, do, fp32 dq out, lse and delta
  (lane-replicated) blocks (and bias / mask-array blocks, and fp32 bias-gradient blocks), the fp32
  accumulator and four fp32 ``[block_q, block_k]`` temporaries (s, p, dp, ds)."""
  io = 2 * itemsize * (block_q * head_dim + block_k * (head_dim + v_head_dim)
                       + block_q * v_head_dim)
  io += 2 * (dense_itemsize + (4 if bias_grad else 0)) * block_q * block_k
  io += 2 * 4 * (block_q * head_dim + 2 * block_q * C.NUM_LANES)
  return io + 4 * block_q * head_dim + 4 * 4 * block_q * block_k


def vmem_bytes_dkv(block_q: int, block_k: int, head_dim: int, v_head_dim: int,
                   itemsize: int, dense_itemsize: int = 0) -> int:
  """VMEM working set of one dK/dV step: double-buffered q, do, k, v, fp32 dk/dv out and the
  sublane-replicated lse/delta rows (and bias / mask-array blocks), the two fp32 accumulators and
  four fp32 temporaries."""
  io = 2 * itemsize * (block_q + block_k) * (head_dim + v_head_dim)
  io += 2 * dense_itemsize * block_q * block_k
  io += 2 * 4 * (block_k * (head_dim + v_head_dim) + 2 * C.NUM_SUBLANES * block_q)
  return io + 4 * block_k * (head_dim + v_head_dim) + 4 * 4 * block_q * block_k


def _dense_specs(plan: C.Plan, bq: int, bk: int, index) -> list:
  """Block specs of the bias and the mask array (those present): ``index(*grid, *prefetched) ->
  (b, n, query block, key block)``; an input with one row for all queries is read as ``[1, bk]``
  blocks of its row."""
  specs = []
  for which, rows in plan.dense_inputs():
    def index_map(*args, which=which, rows=rows):
      b, n, i, j = index(*args)
      return (*which(b, n), i if rows else 0, j)
    specs.append(pl.BlockSpec((None, None, bq if rows else 1, bk), index_map))
  return specs


def _transposed_specs(plan: C.Plan, bq: int, bk: int, *, q_rows, k_rows, q_cols, kv_ids, q_ids):
  """The inputs of the kernels in the transposed orientation (dK/dV, a shared bias' gradient):
  q, k, v, do blocks, the lse / delta rows (``q_cols``: sublane-replicated ``[8, bq]``) and,
  with segment ids, the keys' as columns and the queries' as rows; each its index map."""
  hd, hv = plan.head_dim, plan.v_head_dim
  specs = [
      pl.BlockSpec((None, None, bq, hd), q_rows),  # q
      pl.BlockSpec((None, None, bk, hd), k_rows),  # k
      pl.BlockSpec((None, None, bk, hv), k_rows),  # v
      pl.BlockSpec((None, None, bq, hv), q_rows),  # do
      pl.BlockSpec((None, None, C.NUM_SUBLANES, bq), q_cols),  # lse as a row
      pl.BlockSpec((None, None, C.NUM_SUBLANES, bq), q_cols),  # delta as a row
  ]
  if plan.has_segments:
    specs += [pl.BlockSpec((None, bk, C.NUM_LANES), kv_ids),
              pl.BlockSpec((None, C.NUM_SUBLANES, bq), q_ids)]
  return specs


def _dense_itemsize(plan: C.Plan) -> int:
  """Bytes per ``[T, S]`` element the kernels stream: the bias in its own dtype, the mask array as
  int8; 0 without either."""
  return ((jnp.dtype(plan.bias_dtype).itemsize if plan.has_bias else 0)
          + (1 if plan.has_mask_array else 0))


def _entry_index(plan: C.Plan, rows: int, width: int):
  """Index of table entry ``(b, row, w)`` in the flat table."""
  per_batch = plan.per_batch_tables

  def index(b, r, w):
    return ((b if per_batch else 0) * rows + r) * width + w

  return index


@functools.lru_cache(maxsize=128)
def _fwd_call(plan: C.Plan, width: int):
  bq, bk, g = plan.block_q, plan.block_k, plan.groups
  hd, hv = plan.head_dim, plan.v_head_dim
  nq = plan.q_pad // bq
  at = _entry_index(plan, nq, width)

  def kv_block(b, i, w, entries):
    return entries[at(b, i, w)] >> C.KIND_BITS

  q_spec = pl.BlockSpec((None, None, bq, hd), lambda b, n, i, w, *_: (b, n, i, 0))
  k_spec = pl.BlockSpec((None, None, bk, hd),
                        lambda b, n, i, w, e, *_: (b, _div(n, g), kv_block(b, i, w, e), 0))
  v_spec = pl.BlockSpec((None, None, bk, hv),
                        lambda b, n, i, w, e, *_: (b, _div(n, g), kv_block(b, i, w, e), 0))
  in_specs = [q_spec, k_spec, v_spec]
  if plan.has_segments:
    in_specs += [
        pl.BlockSpec((None, bq, C.NUM_LANES), lambda b, n, i, w, *_: (b, i, 0)),
        pl.BlockSpec((None, C.NUM_SUBLANES, bk),
                     lambda b, n, i, w, e, *_: (b, 0, kv_block(b, i, w, e))),
    ]
  in_specs += _dense_specs(plan, bq, bk,
                           lambda b, n, i, w, e, *_: (b, n, i, kv_block(b, i, w, e)))
  out_specs = [
      pl.BlockSpec((None, None, bq, hv), lambda b, n, i, w, *_: (b, n, i, 0)),
      pl.BlockSpec((None, None, bq, C.NUM_LANES), lambda b, n, i, w, *_: (b, n, i, 0)),
  ]
  out_shape = [
      jax.ShapeDtypeStruct((plan.batch, plan.num_heads, plan.q_pad, hv), jnp.dtype(plan.dtype)),
      jax.ShapeDtypeStruct((plan.batch, plan.num_heads, plan.q_pad, C.NUM_LANES), jnp.float32),
  ]
  scratch = [pltpu.VMEM((bq, C.NUM_LANES), jnp.float32),  # running max m
             pltpu.VMEM((bq, C.NUM_LANES), jnp.float32),  # running sum l
             pltpu.VMEM((bq, hv), jnp.float32)]  # accumulator
  grid = (plan.batch, plan.num_heads, nq, width)
  kernel = functools.partial(_fwd_kernel, plan=plan, width=width, at=at)
  vmem = vmem_bytes_forward(bq, bk, hd, hv, jnp.dtype(plan.dtype).itemsize,
                            dense_itemsize=_dense_itemsize(plan))
  return _launch(kernel, plan, grid, in_specs, out_specs, out_shape, scratch, vmem,
                 "jaxattn_flash_fwd")


def _scalars(plan, iscal_ref, fscal_ref, b, n):
  """(q_offset, scale, ALiBi slope of head n or None, key length of row b or None) from SMEM."""
  slope = fscal_ref[1 + n] if plan.has_alibi else None
  kv_length = iscal_ref[1 + b] if plan.has_lengths else None
  return iscal_ref[0], fscal_ref[0], slope, kv_length


def _fwd_kernel(entries_ref, iscal_ref, fscal_ref, q_ref, k_ref, v_ref, *refs, plan, width, at):
  if plan.has_segments:
    qseg_ref, kvseg_ref, *refs = refs
  bias_ref, mask_ref, refs = C.dense_refs(plan, refs)
  o_ref, lse_ref, m_ref, l_ref, acc_ref = refs
  b, n, i, w = (pl.program_id(a) for a in range(4))
  entry = entries_ref[at(b, i, w)]
  j, kind = entry >> C.KIND_BITS, entry & _KIND_MASK
  q_offset, scale, slope, kv_length = _scalars(plan, iscal_ref, fscal_ref, b, n)

  C.reset_online_softmax(w == 0, m_ref, l_ref, acc_ref)

  def compute(masked: bool):
    q, k, v = q_ref[...], k_ref[...], v_ref[...]  # [bq, H], [bk, H], [bk, h]
    s = lax.dot_general(q, k, NT_DIMS, preferred_element_type=jnp.float32)  # [bq, bk]
    q_idx = i * plan.block_q + lax.broadcasted_iota(jnp.int32, s.shape, 0)
    kv_idx = j * plan.block_k + lax.broadcasted_iota(jnp.int32, s.shape, 1)
    segs = {}
    if masked and plan.has_segments:
      segs = dict(q_seg=qseg_ref[:, :1], kv_seg=kvseg_ref[:1, :])  # [bq, 1], [1, bk]
    s = C.block_scores(s, plan=plan, q_idx=q_idx, kv_idx=kv_idx, q_offset=q_offset, scale=scale,
                       slope=slope, masked=masked, kv_length=kv_length, **segs,
                       bias=None if bias_ref is None else bias_ref[...],
                       allowed_tile=None if mask_ref is None or not masked else mask_ref[...])
    m_prev, l_prev = m_ref[:, :1], l_ref[:, :1]  # [bq, 1]
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # no allowed key yet: exp(-inf - 0) = 0
    p = jnp.exp(s - m_safe)  # [bq, bk]
    alpha = jnp.exp(m_prev - m_safe)
    l_ref[...] = jnp.broadcast_to(alpha * l_prev + jnp.sum(p, axis=1, keepdims=True), l_ref.shape)
    m_ref[...] = jnp.broadcast_to(m_next, m_ref.shape)
    pv = lax.dot_general(p.astype(C.matmul_dtype(v)), v, NN_DIMS,
                         preferred_element_type=jnp.float32)  # [bq, h]
    acc_ref[...] = alpha * acc_ref[...] + pv

  pl.when(kind == FULL)(lambda: compute(False))
  pl.when(kind == PARTIAL)(lambda: compute(True))

  @pl.when(w == width - 1)
  def store():
    l, m = l_ref[:, :1], m_ref[:, :1]
    ok = l != 0.0  # NaN rows stay NaN (a fully masked row has l == 0)
    inv = jnp.where(ok, 1.0 / jnp.where(ok, l, 1.0), 0.0)  # a row with no allowed key gives 0
    o_ref[...] = (acc_ref[...] * inv).astype(o_ref.dtype)
    lse = jnp.where(ok, m + jnp.log(jnp.where(ok, l, 1.0)), -jnp.inf)
    lse_ref[...] = jnp.broadcast_to(lse, lse_ref.shape)


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------


def _backward(plan: C.Plan, q, k, v, bias, aux, out, lse, d_out, d_lse, bias_grad=False):
  x = _Inputs(plan, q, k, v, aux, bias)
  b, n = plan.batch, plan.num_heads
  do = _heads_major(d_out, plan.q_pad)  # [B, N, Tp, h]
  # delta_i = sum_h dO * O; the lse cotangent enters as p * d_lse, i.e. delta - d_lse.
  delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B, T, N]
  delta = jnp.swapaxes(delta, 1, 2) - d_lse.astype(jnp.float32)  # [B, N, T]
  lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0)  # empty rows: p = exp(-inf - 0) = 0
  delta = _pad_to(delta, 2, plan.q_pad)
  # Padded query rows (zeros) are not masked: +inf makes their p = exp(s - inf) = 0 (with 0, an
  # ALiBi term past ~88 overflowed p to inf, and inf * 0 put NaN into dK / dV).
  lse_safe = _pad_to(lse_safe, 2, plan.q_pad, jnp.inf)

  def cols(a):  # [B, N, Tp] -> [B, N, Tp, LANES]
    return jnp.broadcast_to(a[..., None], (b, n, plan.q_pad, C.NUM_LANES))

  def rows(a):  # [B, N, Tp] -> [B, N, SUBLANES, Tp]
    return jnp.broadcast_to(a[:, :, None, :], (b, n, C.NUM_SUBLANES, plan.q_pad))

  entries, width = _tables(plan, aux, transpose=False)
  segs = x.segs_for_rows_of_q() if plan.has_segments else ()
  # A bias with every dim is differentiated by the dQ kernel (its ds blocks, no extra work); one
  # shared over the batch, heads or queries by its own kernel, which sums the shared dims.
  ds_out = bias_grad and plan.bias_shape == (plan.batch, plan.num_heads, plan.q_len)
  dq = _dq_call(plan, width, ds_out)(entries, x.iscal, x.fscal, x.q, x.k, x.v, do,
                                     cols(lse_safe), cols(delta), *segs, *x.dense)
  d_bias = None
  if ds_out:
    dq, ds = dq
    d_bias = C.bias_gradient(plan, aux, ds, bias.dtype)
  entries_t, width_t = _tables(plan, aux, transpose=True)
  segs = x.segs_for_rows_of_k() if plan.has_segments else ()
  key_inputs = (x.q, x.k, x.v, do, rows(lse_safe), rows(delta), *segs, *x.dense)
  dk, dv = _dkv_call(plan, width_t)(entries_t, x.iscal, x.fscal, *key_inputs)
  if bias_grad and not ds_out:
    d_bias = _shared_bias_gradient(plan, aux, x, key_inputs, bias.dtype)
  dq = jnp.swapaxes(dq[:, :, :plan.q_len], 1, 2)
  dk = jnp.swapaxes(dk[:, :, :plan.kv_len], 1, 2)
  dv = jnp.swapaxes(dv[:, :, :plan.kv_len], 1, 2)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), d_bias


@functools.lru_cache(maxsize=128)
def _dq_call(plan: C.Plan, width: int, bias_grad: bool = False):
  bq, bk, g = plan.block_q, plan.block_k, plan.groups
  hd, hv = plan.head_dim, plan.v_head_dim
  nq = plan.q_pad // bq
  at = _entry_index(plan, nq, width)

  def kv_block(b, i, w, entries):
    return entries[at(b, i, w)] >> C.KIND_BITS

  row = lambda b, n, i, w, *_: (b, n, i, 0)  # noqa: E731
  kv = lambda b, n, i, w, e, *_: (b, _div(n, g), kv_block(b, i, w, e), 0)  # noqa: E731
  in_specs = [
      pl.BlockSpec((None, None, bq, hd), row),  # q
      pl.BlockSpec((None, None, bk, hd), kv),  # k
      pl.BlockSpec((None, None, bk, hv), kv),  # v
      pl.BlockSpec((None, None, bq, hv), row),  # do
      pl.BlockSpec((None, None, bq, C.NUM_LANES), row),  # lse
      pl.BlockSpec((None, None, bq, C.NUM_LANES), row),  # delta
  ]
  if plan.has_segments:
    in_specs += [
        pl.BlockSpec((None, bq, C.NUM_LANES), lambda b, n, i, w, *_: (b, i, 0)),
        pl.BlockSpec((None, C.NUM_SUBLANES, bk),
                     lambda b, n, i, w, e, *_: (b, 0, kv_block(b, i, w, e))),
    ]
  in_specs += _dense_specs(plan, bq, bk,
                           lambda b, n, i, w, e, *_: (b, n, i, kv_block(b, i, w, e)))
  out_specs = pl.BlockSpec((None, None, bq, hd), row)
  out_shape = jax.ShapeDtypeStruct((plan.batch, plan.num_heads, plan.q_pad, hd), jnp.float32)
  if bias_grad:  # ds tiles [B, N, Tp, Sp], fp32; blocks no step visits are left unwritten
    out_specs = [out_specs, pl.BlockSpec(
        (None, None, bq, bk), lambda b, n, i, w, e, *_: (b, n, i, kv_block(b, i, w, e)))]
    out_shape = [out_shape, jax.ShapeDtypeStruct(
        (plan.batch, plan.num_heads, plan.q_pad, plan.kv_pad), jnp.float32)]
  scratch = [pltpu.VMEM((bq, hd), jnp.float32)]
  grid = (plan.batch, plan.num_heads, nq, width)
  kernel = functools.partial(_dq_kernel, plan=plan, width=width, at=at, bias_grad=bias_grad)
  vmem = vmem_bytes_dq(bq, bk, hd, hv, jnp.dtype(plan.dtype).itemsize,
                       dense_itemsize=_dense_itemsize(plan), bias_grad=bias_grad)
  return _launch(kernel, plan, grid, in_specs, out_specs, out_shape, scratch, vmem,
                 "jaxattn_flash_dq")


def _dq_kernel(entries_ref, iscal_ref, fscal_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
               *refs, plan, width, at, bias_grad=False):
  if plan.has_segments:
    qseg_ref, kvseg_ref, *refs = refs
  ds_ref = None
  bias_ref, mask_ref, refs = C.dense_refs(plan, refs)
  if bias_grad:
    dq_ref, ds_ref, acc_ref = refs
  else:
    dq_ref, acc_ref = refs
  b, n, i, w = (pl.program_id(a) for a in range(4))
  entry = entries_ref[at(b, i, w)]
  j, kind = entry >> C.KIND_BITS, entry & _KIND_MASK
  q_offset, scale, slope, kv_length = _scalars(plan, iscal_ref, fscal_ref, b, n)

  @pl.when(w == 0)
  def init():
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  def compute(masked: bool):
    q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
    s = lax.dot_general(q, k, NT_DIMS, preferred_element_type=jnp.float32)  # [bq, bk]
    q_idx = i * plan.block_q + lax.broadcasted_iota(jnp.int32, s.shape, 0)
    kv_idx = j * plan.block_k + lax.broadcasted_iota(jnp.int32, s.shape, 1)
    segs = {}
    if masked and plan.has_segments:
      segs = dict(q_seg=qseg_ref[:, :1], kv_seg=kvseg_ref[:1, :])
    s = C.block_scores(s, plan=plan, q_idx=q_idx, kv_idx=kv_idx, q_offset=q_offset, scale=scale,
                       slope=slope, masked=masked, kv_length=kv_length, **segs,
                       bias=None if bias_ref is None else bias_ref[...],
                       allowed_tile=None if mask_ref is None or not masked else mask_ref[...])
    p = jnp.exp(s - lse_ref[:, :1])  # [bq, bk]
    dp = lax.dot_general(do, v, NT_DIMS, preferred_element_type=jnp.float32)  # [bq, bk]
    ds = C.soft_cap_grad(p * (dp - delta_ref[:, :1]), s, plan)
    if ds_ref is not None:  # d loss / d bias of this block: ds, the pre-cap logits' gradient
      ds_ref[...] = ds
    acc_ref[...] += lax.dot_general(ds.astype(C.matmul_dtype(k)), k, NN_DIMS,
                                    preferred_element_type=jnp.float32)  # [bq, H]

  pl.when(kind == FULL)(lambda: compute(False))
  pl.when(kind == PARTIAL)(lambda: compute(True))

  @pl.when(w == width - 1)
  def store():
    dq_ref[...] = (acc_ref[...] * scale).astype(dq_ref.dtype)


# ----------------------------------------------------------------------------------------------
# The gradient of a shared bias
# ----------------------------------------------------------------------------------------------


def _shared_bias_gradient(plan: C.Plan, aux, x: _Inputs, key_inputs, dtype):
  """The gradient of a bias shared over the batch, heads and / or queries, summed over them in
  the kernel (``[Bb, Nb, T | 1, S]``, never a ``[B, N, T, S]`` buffer).  ``key_inputs``: the
  dK/dV kernel's arrays (lse / delta as rows, segment ids for the transposed orientation)."""
  rows = plan.bias_shape[2] > 1
  entries, _, union = C.bias_gradient_tables(plan, aux)
  d = _dbias_call(plan, entries.shape[-1], union)(entries.reshape(-1), x.iscal, x.fscal,
                                                    *key_inputs)
  if rows:  # blocks no batch row visits were never written
    return C.bias_gradient(plan, aux, d, dtype)
  # [Bb, Nb, Sp, LANES] column sums (lanes equal; every key block written, zeros if unvisited)
  return d[:, :, None, :plan.kv_len, 0].astype(dtype)


def vmem_bytes_dbias(block_q: int, block_k: int, head_dim: int, v_head_dim: int, itemsize: int,
                     dense_itemsize: int, out_itemsize: int, rows: bool) -> int:
  """VMEM working set of one step of the shared bias' gradient kernel: double-buffered q, do, k, v,
  the lse / delta rows and the bias / mask-array blocks; with a row per query the output block
  (bias dtype, double-buffered) and its fp32 accumulator, else a lane-wide column-sum block; five
  fp32 ``[block_k, block_q]`` temporaries (s, p, dp, ds and the transposed bias tile)."""
  io = 2 * itemsize * (block_q + block_k) * (head_dim + v_head_dim)
  io += 2 * dense_itemsize * block_q * block_k + 2 * 4 * 2 * C.NUM_SUBLANES * block_q
  out = (2 * out_itemsize + 4) * block_q * block_k if rows else 2 * 4 * block_k * C.NUM_LANES
  return io + out + 5 * 4 * block_q * block_k


@functools.lru_cache(maxsize=128)
def _dbias_call(plan: C.Plan, width: int, union: bool):
  """The kernel of a shared bias' gradient (``[Bb, Nb, Tb, S]``, ``Bb`` in {1, B}, ``Nb`` in
  {1, N}, ``Tb`` in {1, T}): each output block sums ``ds`` over the ``R = (B / Bb) (N / Nb)``
  (batch row, head) pairs that share it in VMEM, and is written once.  Blocks are computed in the
  dK/dV kernel's transposed orientation (``ds^T [bk, bq]``: lse / delta as rows, no
  lane-replicated columns to stream at every step).

  With a row per query: grid ``(Bb, Nb, query blocks, W, R)`` over the forward tiling's tables
  (per batch row when ``Bb = B``, else their ``batch_union``), an fp32 ``[bk, bq]`` accumulator
  transposed into output block ``(i, j)`` (bias dtype) after its ``R``-th step.  One row for all
  queries: grid ``(Bb, Nb, key blocks, R, W_t)`` over the transposed tables (dK/dV tiling); the
  lane-replicated ``[bk, 128]`` fp32 output block of key block ``j`` adds up the row sums of
  every query block's ``ds^T``.  Costs two of the dK/dV kernel's four matmuls per block and
  (batch row, head) again, against a ``[B, N, T, S]`` fp32 write (and its sum) without it.
  """
  rows = plan.bias_shape[2] > 1
  bq, bk = (plan.block_q, plan.block_k) if rows else (plan.block_q_dkv, plan.block_k_dkv)
  hd, hv, g = plan.head_dim, plan.v_head_dim, plan.groups
  n_b, n_n = plan.bias_shape[0], plan.bias_shape[1]
  rn = plan.num_heads // n_n
  nr = (plan.batch // n_b) * rn
  nq, nk = plan.q_pad // bq, plan.kv_pad // bk
  per_batch = plan.per_batch_tables and not union
  table_rows = nq if rows else nk

  def coords(p0, p1, p2, p3, p4, entries):
    """(batch row, head, query block, key block, kind) of a grid step."""
    if rows:
      bb, nb, i, w, r = p0, p1, p2, p3, p4
    else:
      bb, nb, j, r, w = p0, p1, p2, p3, p4
    entry = entries[((bb if per_batch else 0) * table_rows + (i if rows else j)) * width + w]
    if rows:
      j = entry >> C.KIND_BITS
    else:
      i = entry >> C.KIND_BITS
    # r enumerates (batch row, head) pairs, r = b * N + n when both dims are shared; else the
    # factor of the dim the bias has is 1.
    return bb + _div(r, rn), nb + _rem(r, rn), i, j, entry & _KIND_MASK

  def at(f):
    return lambda *a: f(*coords(*a[:6])[:4])

  in_specs = _transposed_specs(
      plan, bq, bk, q_rows=at(lambda b, n, i, j: (b, n, i, 0)),
      k_rows=at(lambda b, n, i, j: (b, _div(n, g), j, 0)),
      q_cols=at(lambda b, n, i, j: (b, n, 0, i)), kv_ids=at(lambda b, n, i, j: (b, j, 0)),
      q_ids=at(lambda b, n, i, j: (b, 0, i)))
  in_specs += _dense_specs(plan, bq, bk, lambda *a: coords(*a[:6])[:4])
  if rows:
    out_specs = pl.BlockSpec((None, None, bq, bk), lambda bb, nb, i, w, r, e, *_: (
        bb, nb, i, coords(bb, nb, i, w, r, e)[3]))
    out_shape = jax.ShapeDtypeStruct((n_b, n_n, plan.q_pad, plan.kv_pad),
                                     jnp.dtype(plan.bias_dtype))
    scratch = [pltpu.VMEM((bk, bq), jnp.float32)]
    grid = (n_b, n_n, nq, width, nr)
  else:
    out_specs = pl.BlockSpec((None, None, bk, C.NUM_LANES),
                             lambda bb, nb, j, r, w, *_: (bb, nb, j, 0))
    out_shape = jax.ShapeDtypeStruct((n_b, n_n, plan.kv_pad, C.NUM_LANES), jnp.float32)
    scratch = []
    grid = (n_b, n_n, nk, nr, width)
  kernel = functools.partial(_dbias_kernel, plan=plan, coords=coords, rows=rows, nr=nr, bq=bq,
                             bk=bk)
  vmem = vmem_bytes_dbias(bq, bk, hd, hv, jnp.dtype(plan.dtype).itemsize, _dense_itemsize(plan),
                          jnp.dtype(plan.bias_dtype).itemsize, rows)
  return _launch(kernel, plan, grid, in_specs, out_specs, out_shape, scratch, vmem,
                 "jaxattn_flash_dbias", sequential=2)


def _dbias_kernel(entries_ref, iscal_ref, fscal_ref, q_ref, k_ref, v_ref, do_ref, lse_ref,
                  delta_ref, *refs, plan, coords, rows, nr, bq, bk):
  kvseg_ref = qseg_ref = None
  if plan.has_segments:
    kvseg_ref, qseg_ref, *refs = refs
  bias_ref, mask_ref, refs = C.dense_refs(plan, refs)
  out_ref, *acc = refs
  ids = [pl.program_id(a) for a in range(5)]
  b, n, i, j, kind = coords(*ids, entries_ref)
  r, w = (ids[4], ids[3]) if rows else (ids[3], ids[4])
  q_offset, scale, slope, kv_length = _scalars(plan, iscal_ref, fscal_ref, b, n)

  if not rows:  # key block j's row sums start at the first step of its (r, w) loops
    @pl.when((r == 0) & (w == 0))
    def init():
      out_ref[...] = jnp.zeros(out_ref.shape, jnp.float32)

  def compute(masked: bool):
    _, ds = _block_p_ds_t(plan, i * bq, j * bk, masked, q_offset, scale, slope, kv_length,
                          q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, kvseg_ref, qseg_ref,
                          bias_ref, mask_ref)  # [bk, bq]
    if not rows:
      out_ref[...] += jnp.broadcast_to(jnp.sum(ds, axis=1, keepdims=True), out_ref.shape)
      return
    acc_ref, = acc
    acc_ref[...] = jnp.where(r == 0, ds, acc_ref[...] + ds)

    @pl.when(r == nr - 1)
    def store():
      out_ref[...] = acc_ref[...].T.astype(out_ref.dtype)

  pl.when(kind == FULL)(lambda: compute(False))
  pl.when(kind == PARTIAL)(lambda: compute(True))


def _block_p_ds_t(plan, q_start, kv_start, masked, q_offset, scale, slope, kv_length, q_ref,
                  k_ref, v_ref, do_ref, lse_ref, delta_ref, kvseg_ref, qseg_ref, bias_ref,
                  mask_ref):
  """``(p^T, ds^T)`` of one block in the transposed orientation ``[bk, bq]`` (fp32; ``ds`` the
  gradient of the logits before the soft-cap, i.e. the bias'), from the lse / delta rows: the
  block math of the dK/dV kernel and the shared bias' gradient."""
  q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
  s = lax.dot_general(k, q, NT_DIMS, preferred_element_type=jnp.float32)  # [bk, bq] = s^T
  kv_idx = kv_start + lax.broadcasted_iota(jnp.int32, s.shape, 0)
  q_idx = q_start + lax.broadcasted_iota(jnp.int32, s.shape, 1)
  segs = {}
  if masked and kvseg_ref is not None:
    segs = dict(kv_seg=kvseg_ref[:, :1], q_seg=qseg_ref[:1, :])  # [bk, 1], [1, bq]
  bias = None if bias_ref is None else bias_ref[...].astype(jnp.float32).T  # [bk, bq]
  allowed = None  # the mask array's tile, transposed to s^T (as int32: 32-bit transposes)
  if mask_ref is not None and masked:
    allowed = mask_ref[...].astype(jnp.int32).T
  s = C.block_scores(s, plan=plan, q_idx=q_idx, kv_idx=kv_idx, q_offset=q_offset, scale=scale,
                     slope=slope, masked=masked, kv_length=kv_length, bias=bias,
                     allowed_tile=allowed, **segs)
  p = jnp.exp(s - lse_ref[:1, :])  # [bk, bq] = p^T
  dp = lax.dot_general(v, do, NT_DIMS, preferred_element_type=jnp.float32)  # [bk, bq] = dp^T
  return p, C.soft_cap_grad(p * (dp - delta_ref[:1, :]), s, plan)


@functools.lru_cache(maxsize=128)
def _dkv_call(plan: C.Plan, width: int):
  bq, bk, g = plan.block_q_dkv, plan.block_k_dkv, plan.groups
  hd, hv = plan.head_dim, plan.v_head_dim
  nk = plan.kv_pad // bk
  at = _entry_index(plan, nk, width)

  def q_block(b, j, r, entries):
    return entries[at(b, j, _rem(r, width))] >> C.KIND_BITS

  def head(kh, r):
    return kh * g + _div(r, width)

  q_rows = lambda b, kh, j, r, e, *_: (b, head(kh, r), q_block(b, j, r, e), 0)  # noqa: E731
  k_rows = lambda b, kh, j, r, *_: (b, kh, j, 0)  # noqa: E731
  in_specs = _transposed_specs(
      plan, bq, bk, q_rows=q_rows, k_rows=k_rows,
      q_cols=lambda b, kh, j, r, e, *_: (b, head(kh, r), 0, q_block(b, j, r, e)),
      kv_ids=lambda b, kh, j, r, *_: (b, j, 0),
      q_ids=lambda b, kh, j, r, e, *_: (b, 0, q_block(b, j, r, e)))
  # bias / mask tiles in the forward orientation, [bq, bk], transposed in the kernel
  in_specs += _dense_specs(plan, bq, bk,
                           lambda b, kh, j, r, e, *_: (b, head(kh, r), q_block(b, j, r, e), j))
  out_specs = [pl.BlockSpec((None, None, bk, hd), k_rows),
               pl.BlockSpec((None, None, bk, hv), k_rows)]
  out_shape = [
      jax.ShapeDtypeStruct((plan.batch, plan.num_kv_heads, plan.kv_pad, hd), jnp.float32),
      jax.ShapeDtypeStruct((plan.batch, plan.num_kv_heads, plan.kv_pad, hv), jnp.float32),
  ]
  scratch = [pltpu.VMEM((bk, hd), jnp.float32), pltpu.VMEM((bk, hv), jnp.float32)]
  grid = (plan.batch, plan.num_kv_heads, nk, g * width)
  kernel = functools.partial(_dkv_kernel, plan=plan, width=width, at=at)
  vmem = vmem_bytes_dkv(bq, bk, hd, hv, jnp.dtype(plan.dtype).itemsize,
                        dense_itemsize=_dense_itemsize(plan))
  return _launch(kernel, plan, grid, in_specs, out_specs, out_shape, scratch, vmem,
                 "jaxattn_flash_dkv")


def _dkv_kernel(entries_ref, iscal_ref, fscal_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
                *refs, plan, width, at):
  if plan.has_segments:
    kvseg_ref, qseg_ref, *refs = refs
  bias_ref, mask_ref, refs = C.dense_refs(plan, refs)
  dk_ref, dv_ref, dk_acc, dv_acc = refs
  b, kh, j, r = (pl.program_id(a) for a in range(4))
  n = kh * plan.groups + _div(r, width)  # the query head of this step
  entry = entries_ref[at(b, j, _rem(r, width))]
  i, kind = entry >> C.KIND_BITS, entry & _KIND_MASK
  q_offset, scale, slope, kv_length = _scalars(plan, iscal_ref, fscal_ref, b, n)

  @pl.when(r == 0)
  def init():
    dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
    dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

  def compute(masked: bool):
    p, ds = _block_p_ds_t(plan, i * plan.block_q_dkv, j * plan.block_k_dkv, masked, q_offset,
                          scale, slope, kv_length, q_ref, k_ref, v_ref, do_ref, lse_ref,
                          delta_ref, kvseg_ref if plan.has_segments else None,
                          qseg_ref if plan.has_segments else None, bias_ref, mask_ref)
    q, do = q_ref[...], do_ref[...]
    dv_acc[...] += lax.dot_general(p.astype(C.matmul_dtype(do)), do, NN_DIMS,
                                   preferred_element_type=jnp.float32)  # [bk, h]
    dk_acc[...] += lax.dot_general(ds.astype(C.matmul_dtype(q)), q, NN_DIMS,
                                   preferred_element_type=jnp.float32)  # [bk, H]

  pl.when(kind == FULL)(lambda: compute(False))
  pl.when(kind == PARTIAL)(lambda: compute(True))

  @pl.when(r == plan.groups * width - 1)
  def store():
    dk_ref[...] = (dk_acc[...] * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


__all__ = ["flash_attention", "vmem_bytes_forward", "vmem_bytes_dq", "vmem_bytes_dkv",
           "vmem_bytes_dbias"]
