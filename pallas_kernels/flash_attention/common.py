"""What the TPU and GPU flash-attention kernels share: block sizes, the plan, block tables, scores.

The kernels never define semantics: ``jaxattn.ops.attention`` does.  This file turns one call of
``dot_product_attention`` (normalized: a ``Mask`` object, scale, ALiBi slopes, soft-cap, query
offset) into what a kernel can use:

* a static ``Plan`` (shapes, padded lengths, block sizes, the position-only part of the mask,
  flags); hashable, so one traced program exists per plan;
* the data-dependent arrays (segment ids, key lengths, slopes, scale, query offset, a dense
  additive bias streamed block by block);
* block tables: for every query block (forward, dQ) or key block (dK/dV) the list of key (query)
  blocks that are not empty, FULL ones first, then PARTIAL ones, padded to a static width with the
  last non-empty block so that a padded grid step neither computes nor fetches new data;
* the score of one block, ``block_scores``, written once for both kernels and both passes, in the
  order of ``jaxattn.ops.scores``: scale -> bias -> ALiBi -> soft-cap -> mask.

Block kinds come from ``jaxattn.ops.masks``: ``EMPTY`` (skip), ``PARTIAL`` (evaluate the mask),
``FULL`` (no mask).  The position-only ("static") part of the mask gives them at trace time; segment
ids and key lengths refine them at run time, per batch row (a block whose query segment ids and key
segment ids cannot meet, or whose keys all lie past ``kv_lengths[b]``, is EMPTY).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jaxattn.ops.attention import UnsupportedError
from jaxattn.ops.masks import (
    EMPTY,
    FULL,
    PARTIAL,
    AndMask,
    CausalMask,
    FullMask,
    GlobalTokensMask,
    Mask,
    OrMask,
    PaddingMask,
    SegmentMask,
    SlidingWindowMask,
)

# TPU vector registers are 8 sublanes x 128 lanes (fp32): per-row statistics are kept replicated
# over lanes ([rows, NUM_LANES]) and per-column ones over sublanes ([NUM_SUBLANES, cols]) so that
# every VMEM block is a whole number of native tiles.
NUM_LANES = 128
NUM_SUBLANES = 8
# Smallest block length we accept: one sublane tile.
MIN_BLOCK = 8
# Block tables pack (block index, kind) into one int32: index * 4 + kind.
KIND_BITS = 2


def default_interpret(interpret):
  """A TPU kernel's ``interpret`` argument: None -> compiled on a TPU backend, interpreted
  elsewhere; an explicit bool or ``pltpu.InterpretParams`` is kept."""
  return jax.default_backend() != "tpu" if interpret is None else interpret


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes of the flash-attention kernels (they change speed, not results).

  Attributes:
    block_q, block_k: query / key block of the forward and dQ kernels.
    block_q_dkv, block_k_dkv: query / key block of the dK/dV kernel.
    num_warps, num_stages: GPU (Triton) launch parameters; ignored on TPU.  ``num_warps=None``
      picks 4 for head sizes <= 64, else 8.

  Sequences shorter than a block use one block of the (8-aligned) sequence length.  Of each pair
  ``(block_q, block_q_dkv)`` and ``(block_k, block_k_dkv)`` the larger must be a multiple of the
  smaller, so that one padded length serves both passes.  On TPU hardware use multiples of 128
  (lanes) unless a block covers the whole sequence; on GPU, powers of two >= 16.
  """

  block_q: int
  block_k: int
  block_q_dkv: int
  block_k_dkv: int
  num_warps: int | None = None
  num_stages: int = 2

  def __post_init__(self):
    for name in ("block_q", "block_k", "block_q_dkv", "block_k_dkv"):
      v = getattr(self, name)
      if not isinstance(v, (int, np.integer)) or v < MIN_BLOCK or v % MIN_BLOCK:
        raise ValueError(f"BlockSizes: `{name}` must be a positive multiple of {MIN_BLOCK}, "
                         f"got {v!r}.")
    for a, b in (("block_q", "block_q_dkv"), ("block_k", "block_k_dkv")):
      x, y = getattr(self, a), getattr(self, b)
      if max(x, y) % min(x, y):
        raise ValueError(f"BlockSizes: the larger of `{a}`={x} and `{b}`={y} must be a multiple "
                         "of the smaller.")
    if self.num_warps is not None and self.num_warps not in (1, 2, 4, 8, 16):
      raise ValueError(f"BlockSizes: `num_warps` must be None or a power of two <= 16, got "
                       f"{self.num_warps!r}.")
    if not isinstance(self.num_stages, (int, np.integer)) or self.num_stages < 1:
      raise ValueError(f"BlockSizes: `num_stages` must be a positive int, got {self.num_stages!r}.")

  @classmethod
  def tpu(cls) -> "BlockSizes":
    """TPU default.  A forward step moves a ``[block_k, H + h]`` key/value block per
    ``2 * block_q * block_k * (H + h)`` MXU flops: ``block_q`` flops per byte in bf16, so 1024 query
    rows clear the HBM ridge of v6e (560 FLOP/B) and v5e (240).  The dK/dV kernel's intensity
    grows with its key block instead (about ``1.5 * block_k_dkv``): 512 clears both.  Working sets
    (docs/performance.md, ``experiments/bench_flash.py --roofline``): forward 8.0 MiB, dQ 13.0
    MiB, dK/dV 6.6 MiB of VMEM at H = h = 128 in bf16."""
    return cls(block_q=1024, block_k=512, block_q_dkv=512, block_k_dkv=512)

  @classmethod
  def gpu(cls) -> "BlockSizes":
    """GPU default (FlashAttention-2 tiling in Triton): 128 query rows per program hold a
    ``[128, H]`` query tile and ``[128, h]`` fp32 accumulator in registers over 64-key steps, with
    4 warps and a 3-stage K/V pipeline; the backward kernels hold two accumulators, hence 64 x 64
    tiles.  Chosen by ``python -m experiments.bench_flash --sweep 8192 --backward`` on an H200
    (bf16, H = 128): forward 407 TFLOP/s non-causal / 334 causal, against 343 / 271 for the best
    8-warp tiles."""
    return cls(block_q=128, block_k=64, block_q_dkv=64, block_k_dkv=64, num_warps=4,
               num_stages=3)


# ----------------------------------------------------------------------------------------------
# Splitting a mask into what kernels evaluate
# ----------------------------------------------------------------------------------------------


def _conjuncts(mask: Mask) -> list[Mask]:
  if isinstance(mask, AndMask):
    return _conjuncts(mask.a) + _conjuncts(mask.b)
  return [mask]


def split_mask(mask: Mask | None):
  """``(static, segment_ids, kv_lengths)`` of a mask that is a conjunction of supported parts.

  ``static`` is the conjunction of the position-only parts (a hashable ``Mask``, or None);
  ``segment_ids`` a ``(q_ids [B, T], kv_ids [B, S])`` pair or None; ``kv_lengths`` ``[B]`` or None
  (several padding masks combine by minimum).  Raises ``ValueError`` for data masks the kernels do
  not evaluate (an ``OrMask`` with a data-dependent side, two segment masks, unknown classes).
  """
  if mask is None:
    return None, None, None
  if not isinstance(mask, Mask):
    raise ValueError(f"`mask` must be a jaxattn.ops.masks.Mask or None, got {type(mask).__name__}.")
  static, segments, lengths = None, None, None
  for part in _conjuncts(mask):
    if part.is_static:
      if not isinstance(part, FullMask):
        static = part if static is None else static & part
    elif isinstance(part, SegmentMask):
      if segments is not None:
        raise UnsupportedError("the Pallas flash-attention kernels take at most one SegmentMask; got "
                         "two in `mask` (combine the ids into one pair of arrays).")
      segments = (jnp.asarray(part.q_segment_ids), jnp.asarray(part.kv_segment_ids))
    elif isinstance(part, PaddingMask):
      lens = jnp.asarray(part.kv_lengths, jnp.int32)
      lengths = lens if lengths is None else jnp.minimum(lengths, lens)
    else:
      raise UnsupportedError(
          f"the Pallas flash-attention kernels cannot evaluate the mask part {type(part).__name__} "
          "(supported: position masks, SegmentMask and PaddingMask combined with `&`; an OrMask "
          "with a data-dependent side is not). Use implementation='xla_chunked'.")
  return static, segments, lengths


def eval_mask(mask: Mask | None, q_idx, kv_idx, q_offset):
  """Boolean mask of a position-only ``Mask`` on index arrays, with 2-D ops only (Mosaic/Triton
  friendly); None means "everything allowed".  ``q_idx``/``kv_idx`` broadcast against each other."""
  if mask is None or isinstance(mask, FullMask):
    return None
  if isinstance(mask, CausalMask):
    return kv_idx <= q_idx + q_offset
  if isinstance(mask, SlidingWindowMask):
    pos = q_idx + q_offset
    out = None
    if mask.left is not None:
      out = kv_idx >= pos - mask.left
    if mask.right is not None:
      right = kv_idx <= pos + mask.right
      out = right if out is None else out & right
    return out
  if isinstance(mask, GlobalTokensMask):
    pos = q_idx + q_offset
    out = (pos < 0) | (kv_idx < 0)  # all False, in the broadcast shape
    for g in mask.indices:  # a handful of global tokens: one compare per token
      out = out | (pos == g) | (kv_idx == g)
    return out
  if isinstance(mask, AndMask):
    a = eval_mask(mask.a, q_idx, kv_idx, q_offset)
    b = eval_mask(mask.b, q_idx, kv_idx, q_offset)
    return b if a is None else a if b is None else a & b
  if isinstance(mask, OrMask):
    a = eval_mask(mask.a, q_idx, kv_idx, q_offset)
    b = eval_mask(mask.b, q_idx, kv_idx, q_offset)
    return None if (a is None or b is None) else a | b
  return mask(q_idx, kv_idx, q_offset)  # other position masks: their own elementwise view


# ----------------------------------------------------------------------------------------------
# The static plan of one call
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
  """Everything static about one kernel call (hashable; one traced program per plan)."""

  batch: int
  q_len: int
  num_heads: int
  head_dim: int
  kv_len: int
  num_kv_heads: int
  v_head_dim: int
  dtype: str
  block_q: int
  block_k: int
  block_q_dkv: int
  block_k_dkv: int
  q_pad: int  # padded query length, a multiple of block_q and block_q_dkv
  kv_pad: int  # padded key length, a multiple of block_k and block_k_dkv
  static_mask: Mask | None
  static_q_offset: int | None  # None: the query offset is traced (no static block skipping)
  logits_soft_cap: float | None
  has_alibi: bool
  has_segments: bool
  has_lengths: bool
  num_warps: int | None
  num_stages: int
  interpret: Any
  static_scale: float | None = None  # None: the scale is traced (only ``aux["scale"]`` has it)
  # A dense additive bias ``[Bb, Nb, Tb, S]`` (``Bb`` in {1, B}, ``Nb`` in {1, N}, ``Tb`` in
  # {1, T}): its leading sizes, or None without one.  Size-1 dims are read through the index
  # maps (a one-row input as one-row blocks), not repeated.
  bias_shape: tuple[int, int, int] | None = None
  bias_dtype: str | None = None  # streamed in its own dtype, added in fp32
  # A dense boolean mask ``[Bm, Nm, Tm, S]`` (True = attend), streamed as int8 tiles: its leading
  # sizes, or None.  With one the block tables come from it too (per batch row).
  mask_shape: tuple[int, int, int] | None = None

  @property
  def has_bias(self) -> bool:
    return self.bias_shape is not None

  @property
  def has_mask_array(self) -> bool:
    return self.mask_shape is not None

  def dense_inputs(self):
    """``(index, rows)`` of the bias then the mask array, those present: ``index(b, n)`` is the
    ``(batch, head)`` of the input's block that batch row ``b`` and query head ``n`` read (0
    along a size-1 dim); ``rows``: whether it has a row per query (else one row for all)."""
    def index(shape):
      return lambda b, n: ((b if shape[0] > 1 else 0), (n if shape[1] > 1 else 0))
    return [(index(shape), shape[2] > 1) for shape in (self.bias_shape, self.mask_shape)
            if shape is not None]

  @property
  def groups(self) -> int:
    return self.num_heads // self.num_kv_heads

  @property
  def per_batch_tables(self) -> bool:
    """Block tables differ per batch row when data masks can empty blocks."""
    return self.has_segments or self.has_lengths or self.has_mask_array


def _pad_lengths(length: int, big: int, small: int, pow2: bool) -> tuple[int, int, int]:
  """Clamps a (big, small) block pair to the sequence and returns ``(big, small, padded_length)``.

  A sequence shorter than a block gets one block of its length rounded up to a multiple of 8
  (``pow2``: to a power of two >= 16, as Triton tiles must be)."""
  if pow2:
    aligned = max(16, 1 << (max(length, 1) - 1).bit_length())
  else:
    aligned = -(-length // MIN_BLOCK) * MIN_BLOCK
  big_c = min(big, aligned)
  small_c = min(small, big_c)
  if big_c % small_c:
    small_c = big_c
  return big_c, small_c, -(-length // big_c) * big_c


def make_plan(query, key, value, *, static_mask, q_offset, logits_soft_cap, alibi_slopes,
              segment_ids, kv_lengths, block_sizes: BlockSizes, interpret,
              pow2_blocks: bool = False, scale=None, bias=None, mask_array=None) -> Plan:
  b, t, n, hd = query.shape
  s, kh, hv = key.shape[1], key.shape[2], value.shape[3]
  bq, bqd = block_sizes.block_q, block_sizes.block_q_dkv
  bk, bkd = block_sizes.block_k, block_sizes.block_k_dkv
  if bq >= bqd:
    bq, bqd, tp = _pad_lengths(t, bq, bqd, pow2_blocks)
  else:
    bqd, bq, tp = _pad_lengths(t, bqd, bq, pow2_blocks)
  if bk >= bkd:
    bk, bkd, sp = _pad_lengths(s, bk, bkd, pow2_blocks)
  else:
    bkd, bk, sp = _pad_lengths(s, bkd, bk, pow2_blocks)
  static_offset = None if is_traced(q_offset) else int(q_offset)
  return Plan(
      batch=b, q_len=t, num_heads=n, head_dim=hd, kv_len=s, num_kv_heads=kh, v_head_dim=hv,
      dtype=jnp.dtype(query.dtype).name, block_q=bq, block_k=bk, block_q_dkv=bqd, block_k_dkv=bkd,
      q_pad=tp, kv_pad=sp, static_mask=static_mask, static_q_offset=static_offset,
      logits_soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
      has_alibi=alibi_slopes is not None, has_segments=segment_ids is not None,
      has_lengths=kv_lengths is not None, num_warps=block_sizes.num_warps,
      num_stages=block_sizes.num_stages, interpret=interpret,
      static_scale=None if scale is None or is_traced(scale) else float(scale),
      bias_shape=None if bias is None else tuple(int(d) for d in bias.shape[:3]),
      bias_dtype=None if bias is None else jnp.dtype(bias.dtype).name,
      mask_shape=None if mask_array is None else tuple(int(d) for d in mask_array.shape[:3]))


def is_traced(x) -> bool:
  if isinstance(x, jax.core.Tracer):
    return True
  if isinstance(x, jax.Array):
    try:
      int(x)
      return False
    except (jax.errors.ConcretizationTypeError, TypeError):
      return True
  return False


def validate(query, key, value, *, q_offset, scale, alibi_slopes, logits_soft_cap, segment_ids,
             kv_lengths, bias=None, mask_array=None):
  """Shape/dtype checks of the kernels' public entry points (``ValueError`` naming the argument)."""
  for name, x in (("query", query), ("key", key), ("value", value)):
    if x.ndim != 4:
      raise ValueError(f"`{name}` must have rank 4 ([B, T|S, heads, head_dim]), got shape "
                       f"{x.shape}.")
  b, t, n, hd = query.shape
  s, kh = key.shape[1], key.shape[2]
  if key.shape[0] != b or value.shape[0] != b or key.shape[1:3] != value.shape[1:3]:
    raise ValueError(f"`key` {key.shape} and `value` {value.shape} must share [B, S, K] with "
                     f"`query` {query.shape}.")
  if key.shape[3] != hd:
    raise ValueError(f"`key` head_dim {key.shape[3]} must equal `query` head_dim {hd}.")
  if n % kh:
    raise ValueError(f"query heads N={n} must be a multiple of key/value heads K={kh}.")
  if not query.dtype == key.dtype == value.dtype:
    raise ValueError(f"`query`, `key`, `value` dtypes must match, got {query.dtype}, {key.dtype}, "
                     f"{value.dtype}.")
  if jnp.dtype(query.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16),
                                    jnp.dtype(jnp.float16)):
    raise ValueError(f"`query` dtype must be float32, bfloat16 or float16, got {query.dtype}.")
  if np.ndim(q_offset) != 0:
    raise ValueError(f"`q_offset` must be a scalar, got shape {np.shape(q_offset)}.")
  if not is_traced(scale) and not (math.isfinite(float(scale)) and float(scale) > 0):
    raise ValueError(f"`scale` must be a positive finite float, got {scale!r}.")
  if alibi_slopes is not None and tuple(np.shape(alibi_slopes)) != (n,):
    raise ValueError(f"`alibi_slopes` must have shape [N] = ({n},), got {np.shape(alibi_slopes)}.")
  if logits_soft_cap is not None and not (logits_soft_cap > 0 and math.isfinite(logits_soft_cap)):
    raise ValueError(f"`logits_soft_cap` must be a positive finite float or None, got "
                     f"{logits_soft_cap!r}.")
  if segment_ids is not None:
    q_ids, kv_ids = segment_ids
    if tuple(q_ids.shape) != (b, t) or tuple(kv_ids.shape) != (b, s):
      raise ValueError(f"segment ids must have shapes [B, T] = {(b, t)} and [B, S] = {(b, s)}, got "
                       f"{tuple(q_ids.shape)} and {tuple(kv_ids.shape)}.")
  if kv_lengths is not None and tuple(kv_lengths.shape) != (b,):
    raise ValueError(f"`kv_lengths` must have shape [B] = ({b},), got {tuple(kv_lengths.shape)}.")
  if bias is not None:
    shape = tuple(np.shape(bias))
    if len(shape) != 4 or any(d not in (1, full) for d, full in zip(shape, (b, n, t, s))):
      raise ValueError(f"`bias` must have shape [B|1, N|1, T|1, S|1] with [B, N, T, S] = "
                       f"{(b, n, t, s)}, got {shape}.")
    if not jnp.issubdtype(jnp.result_type(bias), jnp.floating):
      raise ValueError(f"`bias` must be floating point (an additive bias; pass a boolean mask as "
                       f"`mask_array`), got {jnp.result_type(bias)}.")
  if mask_array is not None:
    shape = tuple(np.shape(mask_array))
    if len(shape) != 4 or any(d not in (1, full) for d, full in zip(shape, (b, n, t, s))):
      raise ValueError(f"`mask_array` must have shape [B|1, N|1, T|1, S|1] with [B, N, T, S] = "
                       f"{(b, n, t, s)}, got {shape}.")
    if jnp.result_type(mask_array) != jnp.bool_:
      raise ValueError(f"`mask_array` must be boolean (True = attend), got "
                       f"{jnp.result_type(mask_array)}.")


# ----------------------------------------------------------------------------------------------
# Block tables
# ----------------------------------------------------------------------------------------------


def static_kinds(plan: Plan, bq: int, bk: int) -> np.ndarray:
  """``[Tp/bq, Sp/bk]`` block kinds from the position-only mask and the padding of the arrays."""
  return mask_kinds(plan.static_mask, plan.q_len, plan.kv_len, plan.q_pad, plan.kv_pad,
                    plan.static_q_offset, bq, bk)


def mask_kinds(mask, q_len: int, kv_len: int, q_pad: int, kv_pad: int, q_offset: int | None,
               bq: int, bk: int) -> np.ndarray:
  """``[q_pad/bq, kv_pad/bk]`` block kinds of a position-only ``mask`` (None: all allowed) over
  arrays padded to ``q_pad`` rows and ``kv_pad`` keys: blocks of padding only are EMPTY, a block
  holding padding keys is not FULL; ``q_offset`` None (traced): every real block PARTIAL."""
  t, s = q_len, kv_len
  nq, nk = q_pad // bq, kv_pad // bk
  rq, rk = -(-t // bq), -(-s // bk)  # blocks that hold real rows / keys
  if mask is None:
    real = np.full((rq, rk), FULL, np.int8)
  elif q_offset is None:  # traced offset: every block may hold allowed pairs.
    real = np.full((rq, rk), PARTIAL, np.int8)
  else:
    real = np.array(mask.block_view(t, s, bq, bk, q_offset), np.int8)
  kinds = np.full((nq, nk), EMPTY, np.int8)  # blocks made only of padding are never visited
  kinds[:rq, :rk] = real
  if s % bk:  # the last real key block holds padding keys, which must be masked out
    col = kinds[:, rk - 1]
    col[col == FULL] = PARTIAL
  return kinds


def data_kinds(plan: Plan, bq: int, bk: int, q_ids, kv_ids, kv_lengths, mask_array=None):
  """``[B, Tp/bq, Sp/bk]`` kinds that segment ids, key lengths and a dense boolean mask allow
  (FULL: unconstrained)."""
  kinds = pair_kinds(plan.batch, plan.q_pad, plan.kv_pad, bq, bk, q_ids, kv_ids, kv_lengths)
  if mask_array is not None:
    kinds = jnp.minimum(kinds, mask_array_kinds(mask_array, plan.batch, plan.q_pad, plan.kv_pad,
                                                bq, bk))
  return kinds


def mask_array_kinds(mask_array, batch: int, q_pad: int, kv_pad: int, bq: int, bk: int):
  """``[B, Tp/bq, Sp/bk]`` kinds of a dense boolean mask ``[Bm, Nm, T|1, S]``, over all its heads
  (the tables are per batch row, not per head): EMPTY where no head allows any pair of the block,
  FULL where every head allows every pair, else PARTIAL.  Padded rows / keys count as masked (a
  one-row mask has no padded rows: its blocks are the same for every query block)."""
  bm, nm, t, s = mask_array.shape
  tp = q_pad if t > 1 else 1
  m = jnp.pad(mask_array, ((0, 0), (0, 0), (0, tp - t), (0, kv_pad - s)))
  m = m.reshape(bm, nm, tp // min(bq, tp), min(bq, tp), kv_pad // bk, bk)
  any_, all_ = m.any(axis=(1, 3, 5)), m.all(axis=(1, 3, 5))
  kinds = jnp.where(any_, jnp.where(all_, FULL, PARTIAL), EMPTY).astype(jnp.int8)
  return jnp.broadcast_to(kinds, (batch, q_pad // bq, kinds.shape[2]))


def pair_kinds(batch: int, q_pad: int, kv_pad: int, bq: int, bk: int, q_ids, kv_ids, kv_lengths):
  """``[B, q_pad/bq, kv_pad/bk]`` kinds of (query block, key block) pairs that segment ids
  (``[B, T]`` / ``[B, S]`` or None) and key lengths (``[B]`` or None) allow: EMPTY when the
  blocks' id ranges are disjoint or every key lies past the length, FULL when both blocks hold
  one and the same id and no key past the length, else PARTIAL."""
  nq, nk = q_pad // bq, kv_pad // bk
  kinds = jnp.full((batch, nq, nk), FULL, jnp.int8)
  if q_ids is not None:
    # ids of padded rows/keys repeat the last real id, so they do not widen a block's id range.
    qb = pad_edge(q_ids, q_pad).reshape(batch, nq, bq)
    kb = pad_edge(kv_ids, kv_pad).reshape(batch, nk, bk)
    qmin, qmax = qb.min(-1)[:, :, None], qb.max(-1)[:, :, None]
    kmin, kmax = kb.min(-1)[:, None, :], kb.max(-1)[:, None, :]
    disjoint = (qmax < kmin) | (kmax < qmin)
    same = (qmin == qmax) & (kmin == kmax) & (qmin == kmin)
    kinds = jnp.where(disjoint, EMPTY, jnp.where(same, FULL, PARTIAL)).astype(jnp.int8)
  if kv_lengths is not None:
    start = jnp.arange(nk, dtype=jnp.int32) * bk
    lens = kv_lengths.astype(jnp.int32)[:, None]
    by_len = jnp.where(start >= lens, EMPTY, jnp.where(start + bk <= lens, FULL, PARTIAL))
    kinds = jnp.minimum(kinds, by_len[:, None, :].astype(jnp.int8))
  return kinds


def pad_edge(ids, length):
  if ids.shape[1] == length:
    return ids
  return jnp.pad(ids, ((0, 0), (0, length - ids.shape[1])), mode="edge")


def compact(kinds, width: int):
  """Per row of ``kinds [Bt, R, C]``: the non-empty columns, FULL first then PARTIAL.

  Returns ``entries [Bt, R, width]`` (``column * 4 + kind``; past the row's count, the row's last
  non-empty column with kind EMPTY, so a padded step re-uses the block already in memory) and
  ``counts [Bt, R, 2]`` (number of FULL, number of PARTIAL).
  """
  xp = jnp if isinstance(kinds, jax.Array) or isinstance(kinds, jax.core.Tracer) else np
  kinds = kinds.astype(xp.int32)
  rank = xp.where(kinds == FULL, 0, xp.where(kinds == PARTIAL, 1, 2))
  if xp is np:
    order = np.argsort(rank, axis=-1, kind="stable")
  else:
    order = jnp.argsort(rank, axis=-1, stable=True)
  order = order[..., :width].astype(xp.int32)
  n_full = (kinds == FULL).sum(-1).astype(xp.int32)
  n_part = (kinds == PARTIAL).sum(-1).astype(xp.int32)
  count = (n_full + n_part)[..., None]
  w = xp.arange(width, dtype=xp.int32)
  valid = w < count
  last = xp.take_along_axis(order, xp.clip(count - 1, 0, width - 1), axis=-1)
  col = xp.where(valid, order, xp.where(count > 0, last, 0))
  kind = xp.where(valid, xp.take_along_axis(kinds, order, axis=-1), EMPTY)
  entries = (col << KIND_BITS) | kind
  return entries.astype(xp.int32), xp.stack([n_full, n_part], axis=-1)


def batch_union(kinds):
  """``[B, R, C]`` kinds -> ``[1, R, C]``: the kinds of a pass that visits every batch row's
  blocks at once: EMPTY where every row's is, FULL where every row's is, else PARTIAL (the
  block's masks evaluated per element, exact for every row)."""
  full, empty = (kinds == FULL).all(0, keepdims=True), (kinds == EMPTY).all(0, keepdims=True)
  return jnp.where(full, FULL, jnp.where(empty, EMPTY, PARTIAL)).astype(jnp.int8)


def block_tables(plan: Plan, *, q_ids=None, kv_ids=None, kv_lengths=None, mask_array=None,
                 transpose=False, pad_width_to_pow2=False, union=False):
  """Block tables of one pass.

  ``transpose=False``: forward/dQ tiling ``(block_q, block_k)``, one row per query block listing
  key blocks.  ``transpose=True``: dK/dV tiling ``(block_q_dkv, block_k_dkv)``, one row per key
  block listing query blocks.  Returns ``(entries [Bt, R, W], counts [Bt, R, 2])`` with ``Bt = B``
  when data masks refine the tables, else 1; ``W`` is static (the widest row of the static part).
  ``union``: one table for all batch rows (``Bt = 1``, ``batch_union`` of the per-row kinds), for
  a pass whose grid step sums over the batch.
  """
  bq, bk = (plan.block_q_dkv, plan.block_k_dkv) if transpose else (plan.block_q, plan.block_k)
  kinds = static_kinds(plan, bq, bk)
  if transpose:
    kinds = kinds.T
  width = max(1, int((kinds != EMPTY).sum(-1).max(initial=0)))
  if pad_width_to_pow2:  # Triton block shapes are powers of two
    width = 1 << (width - 1).bit_length()
  if plan.per_batch_tables:
    dk = data_kinds(plan, bq, bk, q_ids, kv_ids, kv_lengths, mask_array)
    if transpose:
      dk = jnp.swapaxes(dk, 1, 2)
    if union:
      dk = batch_union(dk)
    full = jnp.minimum(jnp.asarray(kinds)[None], dk)
    if full.shape[-1] < width:  # pow2 padding beyond the number of columns
      full = jnp.pad(full, ((0, 0), (0, 0), (0, width - full.shape[-1])))
    return compact(full, width)
  k = kinds[None]
  if k.shape[-1] < width:
    k = np.pad(k, ((0, 0), (0, 0), (0, width - k.shape[-1])))
  entries, counts = compact(k, width)
  return jnp.asarray(entries), jnp.asarray(counts)


def bias_gradient_tables(plan: Plan, aux, pad_width_to_pow2=False):
  """``(entries, counts, union)``: the block tables of a kernel that sums a shared bias'
  gradient: the forward tiling for a bias with a row per query, the transposed (dK/dV) one for
  a bias with one row; ``union`` (one table for all batch rows, ``batch_union``) when the kernel
  sums the batch and the tables differ per row."""
  union = plan.bias_shape[0] == 1 and plan.batch > 1 and plan.per_batch_tables
  entries, counts = block_tables(plan, q_ids=aux["q_ids"], kv_ids=aux["kv_ids"],
                                 kv_lengths=aux["kv_lengths"], mask_array=aux["mask_array"],
                                 transpose=plan.bias_shape[2] == 1,
                                 pad_width_to_pow2=pad_width_to_pow2, union=union)
  return entries, counts, union


def block_counts(query_shape, key_shape, mask: Mask | None = None, *, q_offset: int = 0,
                 block_sizes: BlockSizes | None = None) -> dict[str, int]:
  """How many (query block, key block) pairs the forward pass visits, from the position-only part
  of ``mask`` (data masks can only remove more): ``{"full", "partial", "empty", "total"}``."""
  static, _, _ = split_mask(mask)
  q = jax.ShapeDtypeStruct(tuple(query_shape), jnp.float32)
  k = jax.ShapeDtypeStruct(tuple(key_shape), jnp.float32)
  plan = make_plan(q, k, k, static_mask=static, q_offset=q_offset, logits_soft_cap=None,
                   alibi_slopes=None, segment_ids=None, kv_lengths=None,
                   block_sizes=block_sizes or BlockSizes.tpu(), interpret=True)
  kinds = static_kinds(plan, plan.block_q, plan.block_k)
  return {"full": int((kinds == FULL).sum()), "partial": int((kinds == PARTIAL).sum()),
          "empty": int((kinds == EMPTY).sum()), "total": int(kinds.size)}


# ----------------------------------------------------------------------------------------------
# The score of one block (inside kernels)
# ----------------------------------------------------------------------------------------------


def block_scores(s, *, plan: Plan, q_idx, kv_idx, q_offset, scale, slope=None, masked: bool,
                 q_seg=None, kv_seg=None, kv_length=None, bias=None, allowed_tile=None):
  """fp32 logits of one block, in the order scale -> bias -> ALiBi -> soft-cap -> mask.

  ``s`` is the raw ``q . k`` (fp32) of the block in either orientation; ``q_idx``/``kv_idx`` are the
  (int32, unpadded-coordinate) row indices of its queries and keys, broadcastable against ``s``;
  ``q_seg``/``kv_seg`` likewise; ``bias`` the block of the dense bias in ``s``'s orientation,
  ``allowed_tile`` the block of a dense boolean mask (any integer or boolean type, nonzero =
  attend).  With ``masked=False`` (a FULL block) no mask is evaluated.
  """
  s = s * scale
  if bias is not None:
    s = s + bias.astype(jnp.float32)
  if slope is not None:
    s = s + slope * (kv_idx - (q_idx + q_offset)).astype(jnp.float32)
  if plan.logits_soft_cap is not None:
    cap = jnp.float32(plan.logits_soft_cap)
    s = cap * jnp.tanh(s / cap)
  if not masked:
    return s
  allowed = eval_mask(plan.static_mask, q_idx, kv_idx, q_offset)
  extra = []
  if plan.kv_pad != plan.kv_len:
    extra.append(kv_idx < plan.kv_len)  # padding keys of the ragged last block
  if kv_length is not None:
    extra.append(kv_idx < kv_length)
  if q_seg is not None:
    extra.append(q_seg == kv_seg)
  if allowed_tile is not None:
    extra.append(allowed_tile != 0)
  for e in extra:
    allowed = e if allowed is None else allowed & e
  if allowed is None:
    return s
  return jnp.where(allowed, s, -jnp.inf)


def soft_cap_grad(ds, s, plan: Plan):
  """Chain rule through ``cap * tanh(x / cap)``: ``ds * (1 - tanh^2)``, from the capped logits ``s``
  (masked entries hold -inf and have ``ds = 0``; the clip keeps them finite)."""
  if plan.logits_soft_cap is None:
    return ds
  t = jnp.clip(s / jnp.float32(plan.logits_soft_cap), -1.0, 1.0)
  return ds * (1.0 - t * t)


def dense_refs(plan: Plan, refs):
  """``(bias_ref, mask_ref, rest)``: a kernel's bias and mask-array refs (None when absent), which
  follow its other inputs in that order, and the refs after them."""
  bias_ref = mask_ref = None
  if plan.has_bias:
    bias_ref, *refs = refs
  if plan.has_mask_array:
    mask_ref, *refs = refs
  return bias_ref, mask_ref, refs


def reset_online_softmax(first, m_ref, l_ref, acc_ref):
  """At the first step of a row (``first``, traced bool) of a TPU kernel: running max ``-inf``,
  running sum and accumulator zero (fp32 scratch)."""

  @pl.when(first)
  def _():
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)


def matmul_dtype(x):
  """Probabilities meet values in the values' dtype when that is narrower than fp32 (the MXU /
  tensor cores run bf16 at full rate; the output cannot hold more precision anyway)."""
  return x.dtype if jnp.finfo(x.dtype).bits < 32 else jnp.float32


__all__ = ["BlockSizes", "Plan", "make_plan", "split_mask", "eval_mask", "block_tables",
           "block_counts", "block_scores", "validate", "bias_gradient", "NUM_LANES",
           "NUM_SUBLANES"]


def flash_custom_vjp(plan, forward, backward):
  """The jitted ``(q, k, v, bias, aux, given) -> (out, lse)`` of one backend, differentiated by
  its own kernels.

  ``forward(plan, q, k, v, bias, aux) -> (out, lse)``; ``backward(plan, q, k, v, bias, aux, out,
  lse, d_out, d_lse, bias_grad) -> (dq, dk, dv, d_bias)``.  ``bias``: None or the dense bias
  (``plan.bias_shape``); its gradient is computed only when it is being differentiated
  (``symbolic_zeros``' ``perturbed``: a constant bias, such as a mask written as ``-inf`` / 0,
  costs no ``[B, N, T, S]`` write), else ``d_bias`` is None.  ``aux`` (offsets, lengths, slopes,
  segment ids) gets no cotangent.  ``given``: None, or the forward's ``(out, lse)``, returned
  without running the forward kernel (the backward then runs from them:
  ``jaxattn.ops.attention.attention_gradients``).
  """

  @jax.custom_vjp
  def attention(q, k, v, bias, aux, given):
    return forward(plan, q, k, v, bias, aux) if given is None else given

  def fwd(q, k, v, bias, aux, given):  # array leaves are CustomVJPPrimal(value, perturbed)
    bias_grad = bias is not None and bias.perturbed
    q, k, v, bias, aux, given = jax.tree.map(lambda x: x.value, (q, k, v, bias, aux, given))
    out, lse = forward(plan, q, k, v, bias, aux) if given is None else given
    # The residuals' structure carries the static flag: the bias under "grad" or "const".
    return (out, lse), (q, k, v, {"grad" if bias_grad else "const": bias}, aux, out, lse)

  def bwd(res, cotangents):
    q, k, v, bias_slot, aux, out, lse = res
    (kind, bias), = bias_slot.items()
    d_out, d_lse = (jnp.zeros(c.shape, c.dtype)
                    if isinstance(c, jax.custom_derivatives.SymbolicZero) else c
                    for c in cotangents)
    dq, dk, dv, d_bias = backward(plan, q, k, v, bias, aux, out, lse, d_out, d_lse,
                                  bias_grad=kind == "grad")
    return dq, dk, dv, d_bias, None, None

  attention.defvjp(fwd, bwd, symbolic_zeros=True)
  return jax.jit(attention)


def visited_blocks(plan: Plan, aux, bq: int, bk: int):
  """``[Bt, Tp/bq, Sp/bk]`` bool: the (query block, key block) pairs a pass with these blocks
  computes (not EMPTY by the position mask, the padding or the data masks)."""
  kinds = jnp.asarray(static_kinds(plan, bq, bk))[None]
  if plan.per_batch_tables:
    kinds = jnp.minimum(kinds, data_kinds(plan, bq, bk, aux["q_ids"], aux["kv_ids"],
                                          aux["kv_lengths"], aux.get("mask_array")))
  return kinds != EMPTY


def bias_gradient(plan: Plan, aux, ds, dtype, zeroed: bool = False):
  """The bias cotangent from a kernel's ``ds`` blocks ``[B | 1, N | 1, Tp, Sp]`` (written for
  the visited blocks of the forward tiling only; the others hold whatever the buffer held, or
  zeros when ``zeroed``; a size-1 batch dim sums all rows, so a block any row visits counts):
  zeros outside visited blocks, padding sliced off, summed over the bias' broadcast batch / head
  / row dims."""
  d = ds
  if not zeroed:
    bq, bk = plan.block_q, plan.block_k
    vis = visited_blocks(plan, aux, bq, bk)
    if ds.shape[0] == 1:
      vis = vis.any(0, keepdims=True)
    vis = vis[:, None, :, None, :, None]  # broadcast over heads and the blocks' elements
    b, n, tp, sp = ds.shape
    d = jnp.where(vis, ds.reshape(b, n, tp // bq, bq, sp // bk, bk), 0.0).reshape(b, n, tp, sp)
  d = d[:, :, :plan.q_len, :plan.kv_len]
  for axis, size in enumerate(plan.bias_shape):  # the broadcast batch / head / row dims
    if size == 1:
      d = d.sum(axis, keepdims=True)
  return d.astype(dtype)
