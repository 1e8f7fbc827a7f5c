"""Paged GQA / MQA / MHA decode kernel (TPU / Mosaic style), split-KV with a combine step.

The page table and the sequence lengths travel by scalar prefetch
(``pltpu.PrefetchScalarGridSpec``): they sit in SMEM before the grid starts, so the key/value
``index_map`` reads them and the pipeline DMAs pool page ``page_table[b, j]`` straight from the
pool -- pages are never gathered into a contiguous copy.

    grid (B, I, S, J)              b: sequence; i: block of query rows; s: split-KV partition;
                                   j: page within the partition (J = ceil(M / S)); b, i, s
                                   parallel, j sequential ("arbitrary").  At batch 1 the
                                   order is (S, B, I, J): a megacore chip splits the leading
                                   axis between its TensorCores (``split_plan``)
    q block    [K, Tb*G, H]        a block of the sequence's queries, rows (t, g) per KV head:
                                   every query head of a KV group shares each fetched page.  A
                                   decode step is one block (I = 1); a long prefill is cut into
                                   blocks of consecutive tokens that fit VMEM
    k/v block  [page, K*H|K*h]     one page of the merged pools [P, page, K*H] (a PagedKVCache's),
                                   all KV heads (one contiguous DMA); KV head g is the lane
                                   slice [g*H, (g+1)*H).  Split pools [P, page, K, H] are read
                                   in blocks [page, K, H] (a contiguous cache's page view)
    out block  [K, Tb*G, h] fp32   the partition's normalized partial output (S = 1: the output,
                                   in the query dtype)
    lse block  [K, Tb*G, 1] fp32   its log-sum-exp (-inf when the partition saw no key)
    scratch    m, l [K, Tb*G, 1], acc [K, Tb*G, h]  fp32 online-softmax state

Pages that a row block cannot see -- at or past the sequence's length, or (causal) past its last
token's position -- do no compute (``pl.when``), and their ``index_map`` clamps to the block's
last visible page: the block index then equals the previous step's, so the pipeline does not
fetch it again.  With a sliding window the page axis starts at the page holding the block's
first visible key (``window_start``) and spans only the pages a window can cover
(``window_pages``: 65 of 64 tokens for Mistral's 4,096 keys, whatever the context): a long
sequence costs no grid steps for the pages behind the window.  ALiBi adds ``slope * (j - i)``
from a ``[K, rows, 1]`` block of the rows' slopes.  ``combine`` merges the ``S`` partials
(flash-decoding): with ``lse* = logsumexp_s lse_s``, ``out = sum_s exp(lse_s - lse*) out_s``.

One page per grid step keeps the kernel simple; pick ``page_size`` large enough (128+ tokens) to
amortize the per-step overhead on TPU.  Validated in interpret mode (race detection on) against
``jaxattn.ops.decode.paged_attention_xla``; compiled for TPU v5e / v6e by
``experiments/tpu_compile_check.py``, not yet run on one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from jaxattn.ops.decode import (cache_row_bytes, check_num_splits, page_view, scale_page_view,
                                view_page_size)
from pallas_kernels.flash_attention import sharded
from pallas_kernels.flash_attention.common import default_interpret, reset_online_softmax

_F32 = jnp.float32


# -- the shared online-softmax pieces (also used by the MLA decode kernel) -------------------------

def dot_t(a, b):
  """``a [R, X] @ b [S, X]^T`` with fp32 accumulation."""
  return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=_F32)


def code_dtype(query_dtype):
  """The dtype quantized codes (int8, float8_e4m3fn) are widened to for the dots: the query's
  when it is a 16-bit float (exact: every int8 and e4m3 value is a bf16 / fp16 number), else
  fp32.  The dots accumulate in fp32 either way (the GPU kernels' too)."""
  return query_dtype if jnp.finfo(query_dtype).bits < 32 else _F32


def operand_dtype(query_dtype, cache_dtype):
  """The dtype both operands of a kernel's dots take: the wider float of the query's and the
  cache's, quantized codes counting as ``code_dtype``.  A bf16 query over a bf16 cache keeps
  bf16 operands, which the MXU multiplies at its native rate (fp32 operands take several
  passes)."""
  if jnp.dtype(cache_dtype).itemsize < 2 or not jnp.issubdtype(cache_dtype, jnp.floating):
    cache_dtype = code_dtype(query_dtype)
  return jnp.promote_types(query_dtype, cache_dtype)


def online_softmax_update(m_ref, l_ref, acc_ref, logits, valid, value, value_scale=None):
  """Folds one block into the running ``(m, l, acc)``: ``logits [R, S]`` fp32, ``valid`` broadcast
  to ``[R, S]``, ``value [S, h]`` fp32 (or narrower: the probabilities are then rounded to its
  dtype for the matmul, accumulated in fp32); refs are ``[R, 1]``, ``[R, 1]``, ``[R, h]`` views.
  ``value_scale [1, S]`` (quantized values, ``value`` their codes): the probabilities times it
  before the matmul, ``sum_j p_j s_j v_j``; the normalizer counts them unscaled."""
  logits = jnp.where(valid, logits, -jnp.inf)
  m_prev = m_ref[...]
  m_new = jnp.maximum(m_prev, jnp.max(logits, axis=-1, keepdims=True))
  m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)   # rows with nothing yet: keep exp() finite
  alpha = jnp.exp(m_prev - m_safe)                    # 0 while m_prev = -inf
  p = jnp.exp(logits - m_safe)                        # 0 on invalid entries
  l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=-1, keepdims=True)
  if value_scale is not None:
    p = p * value_scale
  if jnp.finfo(value.dtype).bits < 32:
    p = p.astype(value.dtype)
  acc_ref[...] = alpha * acc_ref[...] + jax.lax.dot_general(
      p, value, (((1,), (0,)), ((), ())), preferred_element_type=_F32)
  m_ref[...] = m_new


def finalize(m, l, acc):
  """``(out, lse)`` of a finished partition; zero output and ``-inf`` lse where it saw no key."""
  seen = l != 0  # NaN rows stay NaN
  out = jnp.where(seen, acc / jnp.where(seen, l, 1.0), 0.0)
  lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
  return out, lse


def combine(out: Float[Array, "B S ... h"], lse: Float[Array, "B S ... 1"], sink=None):
  """Merges split-KV partials over axis 1: ``[B, S, ..., h]`` -> ``[B, ..., h]`` fp32.  A single
  partition is already the result (normalized, zeros where it saw no key): returned as it is, in
  its dtype, with no merge pass.  ``sink`` (broadcastable to ``lse[:, 0]``): attention sinks, one
  more partition of zero output whose log-sum-exp is the sink logit (rows that saw no key stay
  zeros)."""
  if out.shape[1] == 1 and sink is None:
    return out[:, 0]
  top = jnp.max(lse, axis=1, keepdims=True)
  seen = jnp.isfinite(top)
  if sink is not None:
    top = jnp.where(seen, jnp.maximum(top, jnp.asarray(sink, jnp.float32)[:, None]), top)
  top = jnp.where(seen, top, 0.0)
  w = jnp.exp(lse - top)                                # 0 for empty partitions
  total = jnp.sum(w, axis=1)
  if sink is not None:
    total = jnp.where(total != 0, total + jnp.exp(sink - top[:, 0]), total)
  merged = jnp.sum(w * out.astype(jnp.float32), axis=1)
  return jnp.where(total != 0, merged / jnp.where(total != 0, total, 1.0), 0.0)


def head_args(alibi_slopes, sinks, key_scale=None, value_scale=None) -> tuple:
  """The per-head arrays of a decode call as ``shard_map`` arguments (split with the heads):
  ``(slopes,)``, or ``()`` without ALiBi; with ``sinks`` always ``(slopes, sinks)``, an absent
  one as an empty array (``present``); with the scales of quantized pools (``[P, 1, K * page]``)
  always ``(slopes, sinks, key_scale, value_scale)``."""
  if key_scale is not None:
    return head_args(alibi_slopes, jnp.zeros((0,), _F32) if sinks is None else sinks) + (
        key_scale, value_scale)
  if sinks is None:
    return slopes_arg(alibi_slopes)
  empty = jnp.zeros((0,), _F32)
  slopes = empty if alibi_slopes is None else jnp.asarray(alibi_slopes, _F32)
  return slopes, jnp.asarray(sinks, _F32)


def present(x):
  """None for an absent per-head array (None or empty), else the array."""
  return None if x is None or x.shape[0] == 0 else x


def visible_keys(length, block, block_rows: int, num_t: int, groups: int):
  """Keys that query-row block ``block`` may see: those up to its last row's position (causal;
  rows ``(t, g)`` flattened, ``groups`` per token, ``block_rows`` per block, the ``num_t`` queries
  being the sequence's last tokens), at most ``length``.  Pages from this count on do no compute
  and are not fetched: a prefill's early row blocks skip the pages of its later tokens."""
  last_t = ((block + 1) * block_rows - 1) // groups          # past T in a padded last block
  return jnp.minimum(jnp.maximum(length - num_t + last_t + 1, 0), length)


def window_start(length, block, block_rows: int, num_t: int, groups: int, window):
  """The first key that query-row block ``block``'s first row may see under a sliding window of
  ``window`` (its position minus ``window``, at least 0); 0 without a window.  The block's pages
  before the one holding it do no compute and are not fetched: the kernels' page axis starts at
  that page."""
  if window is None:
    return jnp.int32(0)
  first_t = (block * block_rows) // groups
  return jnp.maximum(length - num_t + first_t - window, 0)


def window_pages(max_pages: int, page_size: int, block_rows: int, groups: int, window) -> int:
  """Pages a row block's keys can span: all ``max_pages`` without a window, else at most those
  of its window: ``window`` keys before its first token and its own tokens (``(rows - 1) // G +
  1``, one more when ``G`` does not divide the rows: a block may then start mid-token), over
  one page more than they fill when they start mid-page."""
  if window is None:
    return max_pages
  keys = window + (block_rows - 1) // groups + (1 if block_rows % groups == 0 else 2)
  return min(max_pages, (keys + page_size - 2) // page_size + 1)


def page_index(visible, table_ref, b, logical, *, max_pages, page_size, num_pages):
  """Pool page holding logical page ``logical`` of sequence ``b``, clamped to the last page that
  holds one of its ``visible`` keys (so later steps re-use the block already in VMEM: no DMA) and
  to a real page id in ``[0, num_pages)``: a row with no visible key still fetches its first
  entry, which nothing checked (an empty slot's stale or sentinel ids; any id under ``jit``)."""
  last = jnp.maximum((visible + page_size - 1) // page_size - 1, 0)
  logical = jnp.minimum(logical, last)
  return jnp.clip(table_ref[b * max_pages + logical], 0, num_pages - 1)


def check_block_rows(block_rows) -> None:
  if block_rows is not None and (isinstance(block_rows, bool) or not isinstance(block_rows, int)
                                 or block_rows < 8 or block_rows % 8):
    raise ValueError(f"`block_rows` must be None or a positive multiple of 8, got "
                     f"{block_rows!r}.")


def block_rows_for(rows: int, row_bytes: int, block_rows: int | None) -> int:
  """Query rows per kernel block: ``block_rows`` when given, else all ``rows`` when their VMEM
  (``row_bytes`` each: query block double-buffered, fp32 accumulator, output double-buffered)
  fits ``ROW_BUDGET``, else the largest multiple of 16 that does.  Never more than ``rows``."""
  if block_rows is None:
    block_rows = rows if rows * row_bytes <= ROW_BUDGET else max(16, ROW_BUDGET // row_bytes
                                                                 // 16 * 16)
  return min(block_rows, rows)


# VMEM for one block of query rows and their state: with a page of keys and values (2 MiB,
# double-buffered) it stays well within TPU v5e's 16 MiB default scoped VMEM.
ROW_BUDGET = 4 << 20


def pad_rows(x, axis: int, block: int):
  """``x`` zero-padded along ``axis`` to a multiple of ``block``."""
  pad = -x.shape[axis] % block
  if not pad:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths)


def kv_heads_of(pool, head_dim: int) -> int:
  """KV heads of a pool or cache: split ``[..., K, H]``, or merged rows ``[..., K * H]``."""
  return pool.shape[2] if pool.ndim == 4 else pool.shape[2] // head_dim


def tensorcores() -> int:
  """TensorCores behind one JAX device: 2 on a megacore chip (TPU v4, v5p), else 1 (other TPUs,
  and anything that is not a TPU)."""
  try:
    return max(1, int(pltpu.get_tpu_info().num_cores))
  except Exception:  # noqa: BLE001 - not a TPU (or an unknown one): one core
    return 1


def split_plan(num_splits: int | None, batch: int, max_pages: int,
               cores: int = 1) -> tuple[int, bool]:
  """``(partitions, split_first)`` of a decode kernel's split-KV axis on one device.

  Mosaic gives the two TensorCores of a megacore chip halves of the *leading* "parallel" grid
  axis.  That is the batch axis, which cannot feed both cores at batch 1: then the split axis
  leads the grid (``split_first``; with one sequence the order of the steps is the same), and
  ``num_splits=None`` gives one partition per TensorCore (``cores``: ``tensorcores()``, read by
  the kernels' wrappers outside ``jit``).  Otherwise None gives one partition (no combine pass).
  Never more partitions than pages."""
  split_first = batch == 1
  if num_splits is None:
    num_splits = cores if split_first else 1
  return max(1, min(num_splits, max_pages)), split_first


def grid_order(split_first: bool, grid, index_map):
  """``grid`` ``(B, I, S, J)`` and an index map written for it, reordered to ``(S, B, I, J)``
  when ``split_first``."""
  if not split_first:
    return grid, index_map
  b, i, s, j = grid
  return (s, b, i, j), lambda si, bi, ii, ji, *rest: index_map(bi, ii, si, ji, *rest)


def grid_ids(split_first: bool):
  """The kernel's ``(b, i, s, j)`` program ids under ``grid_order``."""
  ids = [pl.program_id(a) for a in range(4)]
  return (ids[1], ids[2], ids[0], ids[3]) if split_first else tuple(ids)


# -- the kernel --------------------------------------------------------------------------------

def _kernel(lens_ref, table_ref, q_ref, k_ref, v_ref, *refs, scale, soft_cap, num_t, groups,
            pages_per_split, split_first, window, alibi, quantized):
  refs = list(refs)
  slope_ref = refs.pop(0) if alibi else None
  ks_ref, vs_ref = (refs.pop(0), refs.pop(0)) if quantized else (None, None)  # [1, K*page]
  o_ref, lse_ref, m_ref, l_ref, acc_ref = refs
  b, i, s, j = grid_ids(split_first)
  page_size, num_kv = k_ref.shape[0], q_ref.shape[0]
  rows, h, hv = q_ref.shape[1], q_ref.shape[2], acc_ref.shape[2]          # rows: a block of T*G
  merged = len(k_ref.shape) == 2                      # [page, K*H] rows, else [page, K, H]
  length = lens_ref[b]
  # The page axis starts at the block's first page in its window (0 without a window).
  base = window_start(length, i, rows, num_t, groups, window) // page_size
  start = (base + s * pages_per_split + j) * page_size   # first position of this page

  reset_online_softmax(j == 0, m_ref, l_ref, acc_ref)

  @pl.when(start < visible_keys(length, i, rows, num_t, groups))
  def compute():
    kv_pos = start + jax.lax.broadcasted_iota(jnp.int32, (rows, page_size), 1)
    row = i * rows + jax.lax.broadcasted_iota(jnp.int32, (rows, page_size), 0)
    q_pos = length - num_t + row // groups
    valid = (kv_pos < length) & (kv_pos <= q_pos)                          # [rows, page]
    if window is not None:
      valid &= kv_pos >= q_pos - window
    # Slots past the length hold stale data (a freed sequence's, or anything): zero their values
    # so that 0 * NaN cannot reach the accumulator.
    live = (start + jax.lax.broadcasted_iota(jnp.int32, (page_size, 1), 0)) < length  # [page, 1]
    if quantized:   # the same as a row of the page's tokens, as the scales lie
      live_row = (start + jax.lax.broadcasted_iota(jnp.int32, (1, page_size), 1)) < length
    # Operands in their own dtype (bf16 stays bf16), accumulation in fp32.
    kdt, vdt = operand_dtype(q_ref.dtype, k_ref.dtype), operand_dtype(q_ref.dtype, v_ref.dtype)
    for kv in range(num_kv):                                               # static: K is small
      q = q_ref[kv].astype(kdt)                                            # [rows, H]
      if merged:
        k, v = k_ref[:, kv * h:(kv + 1) * h], v_ref[:, kv * hv:(kv + 1) * hv]  # [page, H|h]
      else:
        k, v = k_ref[:, kv, :], v_ref[:, kv, :]
      logits = dot_t(q, k.astype(kdt)) * scale                             # [rows, page] fp32
      value_scale = None
      if quantized:   # codes: key j is k_j * s_j, so its logits are s_j (q . k_j)
        heads = slice(kv * page_size, (kv + 1) * page_size)               # head kv's lanes
        logits = logits * ks_ref[:, heads]
        value_scale = jnp.where(live_row, vs_ref[:, heads], 0.0)         # stale slots: no NaN
      if alibi:                                       # slope * (j - i), per query row's head
        logits += slope_ref[kv] * (kv_pos - q_pos).astype(_F32)
      if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
      online_softmax_update(m_ref.at[kv], l_ref.at[kv], acc_ref.at[kv], logits, valid,
                            jnp.where(live, v.astype(vdt), 0), value_scale)

  @pl.when(j == pages_per_split - 1)
  def store():
    out, lse = finalize(m_ref[...], l_ref[...], acc_ref[...])
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = lse


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "num_splits", "block_rows",
                                             "interpret", "cores", "window"))
def _local(q, key_pool, value_pool, page_table, lengths, slopes=None, sinks=None, key_scale=None,
           value_scale=None, *, scale, soft_cap, num_splits, block_rows=None, interpret=None,
           cores=1, window=None):
  """One device's call: ``q [B, T, N, H]`` over merged pools ``[P, page, K * H|h]`` or split
  ones ``[P, page, K, H|h]``, each read in place in its own layout -> ``[B, T, N, h]``.
  ``slopes [N]`` (ALiBi), ``sinks [N]`` (attention sinks, applied in the combine step) or None
  (or empty); ``key_scale`` / ``value_scale [P, 1, K * page]`` with quantized pools (their
  codes' scales, read page by page beside them); ``window`` a sliding window or None."""
  slopes, sinks = present(slopes), present(sinks)
  b, t, n, h = q.shape
  page_size = key_pool.shape[1]
  kh = kv_heads_of(key_pool, h)
  hv = value_pool.shape[-1] if value_pool.ndim == 4 else value_pool.shape[2] // kh
  g = n // kh
  m = page_table.shape[1]
  # [B, T, K, G, H] -> [B, K, T*G, H]: rows (t, g) of one KV head are contiguous, and blocks of
  # them (a prefill's) are consecutive tokens.
  qk = q.reshape(b, t, kh, g, h).transpose(0, 2, 1, 3, 4).reshape(b, kh, t * g, h)
  rb = block_rows_for(t * g, kh * (2 * h * q.dtype.itemsize + 3 * hv * 4), block_rows)
  qk = pad_rows(qk, 2, rb)
  padded = qk.shape[2]
  # The page axis of a row block: from its window's first page (every page without a window).
  span = window_pages(m, page_size, rb, g, window)
  splits, split_first = split_plan(num_splits, b, span, cores)
  pps = -(-span // splits)                                                 # pages per split

  def kv_map(bi, ii, si, ji, lens_ref, table_ref):
    length = lens_ref[bi]
    visible = visible_keys(length, ii, rb, t, g)
    base = window_start(length, ii, rb, t, g, window) // page_size
    page = page_index(visible, table_ref, bi, base + si * pps + ji, max_pages=m,
                      page_size=page_size, num_pages=key_pool.shape[0])
    return (page,) + (0,) * (key_pool.ndim - 1)

  kernel = functools.partial(_kernel, scale=float(scale), soft_cap=soft_cap, num_t=t, groups=g,
                             pages_per_split=pps, split_first=split_first, window=window,
                             alibi=slopes is not None, quantized=key_scale is not None)
  order = functools.partial(grid_order, split_first, (b, padded // rb, splits, pps))
  grid, q_map = order(lambda bi, ii, si, ji, *_: (bi, 0, ii, 0))
  page_map = order(kv_map)[1]
  o_map = order(lambda bi, ii, si, ji, *_: (bi, si, 0, ii, 0))[1]
  # One partition: the kernel's output is final (query dtype); else fp32 partials to combine
  # (with sinks too: the combine step adds them).
  out_dtype = q.dtype if splits == 1 and sinks is None else _F32
  extra_specs, extra_args = [], []
  if slopes is not None:     # ALiBi: each query row's slope, [K, T*G, 1] rows (t, g)
    extra_args.append(row_slopes(slopes, kh, g, t, padded)[:, :, None])
    extra_specs.append(pl.BlockSpec((kh, rb, 1), order(lambda bi, ii, si, ji, *_: (0, ii, 0))[1]))
  if key_scale is not None:  # the page's scales [1, K * page], fetched with its codes
    extra_args += [key_scale, value_scale]
    scale_map = lambda *ids: page_map(*ids)[:3]       # noqa: E731 (a split pool's map is 4-D)
    extra_specs += [pl.BlockSpec((None, 1, kh * page_size), scale_map)] * 2
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      grid=grid,
      in_specs=[
          pl.BlockSpec((None, kh, rb, h), q_map),                                     # q
          pl.BlockSpec((None,) + key_pool.shape[1:], page_map),                       # key page
          pl.BlockSpec((None,) + value_pool.shape[1:], page_map),                     # value page
      ] + extra_specs,
      out_specs=[pl.BlockSpec((None, None, kh, rb, hv), o_map),
                 pl.BlockSpec((None, None, kh, rb, 1), o_map)],
      scratch_shapes=[pltpu.VMEM((kh, rb, 1), _F32),      # running max m
                      pltpu.VMEM((kh, rb, 1), _F32),      # running sum l
                      pltpu.VMEM((kh, rb, hv), _F32)])    # accumulator
  out, lse = pl.pallas_call(
      kernel, grid_spec=grid_spec,
      out_shape=[jax.ShapeDtypeStruct((b, splits, kh, padded, hv), out_dtype),
                 jax.ShapeDtypeStruct((b, splits, kh, padded, 1), _F32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
      interpret=default_interpret(interpret),
  )(lengths, page_table.reshape(-1), qk, key_pool, value_pool, *extra_args)
  sink = None if sinks is None else row_slopes(sinks, kh, g, t, padded)[None, :, :, None]
  out = combine(out, lse, sink)[:, :, :t * g]                              # [B, K, T*G, h]
  out = out.reshape(b, kh, t, g, hv).transpose(0, 2, 1, 3, 4).reshape(b, t, n, hv)
  return out.astype(q.dtype)


def run_sharded_gqa(local, args, mesh):
  """``local(query, key_pool, value_pool, page_table, lengths[, slopes[, sinks]])`` under
  ``mesh`` (None: the context mesh; no mesh or no free axis: called directly): queries, page
  table and lengths split over the ``"batch"`` axes, queries, pools, ALiBi slopes and sinks over
  ``"kv_heads"`` when both ``N`` and ``K`` divide.  The pools are ``[P, page, K, H]`` or merged
  ``[P, page, K * H]`` (K-major rows, so a split of the last axis is a split of the KV heads).
  Shared by the TPU and GPU decode kernels."""
  query, key_pool = args[0], args[1]
  kv_heads = kv_heads_of(key_pool, query.shape[3])

  def specs(mesh):
    bax, hax = sharded.plan_specs(mesh, query.shape[0], query.shape[2], kv_heads)
    pool = P(None, None, hax, None) if key_pool.ndim == 4 else P(None, None, hax)
    scales = P(None, None, hax)     # [P, 1, K * page]: K-major, split by K like merged rows
    ins = (P(bax, None, hax, None), pool, pool, P(bax, None), P(bax), P(hax), P(hax), scales,
           scales)
    return ins[:len(args)], P(bax, None, hax, None)

  return sharded.run_sharded(local, args, mesh, specs)

def paged_attention_tpu(
    query: Float[Array, "B T N H"],
    key_pool: Float[Array, "P page KH"] | Float[Array, "P page K H"],
    value_pool: Float[Array, "P page Kh"] | Float[Array, "P page K h"],
    page_table: Int[Array, "B M"],
    lengths: Int[Array, "B"],
    *,
    scale: float,
    logits_soft_cap: float | None = None,
    num_splits: int | None = None,
    block_rows: int | None = None,
    interpret=None,
    mesh=None,
    local_window_size: int | None = None,
    alibi_slopes: Float[Array, "N"] | None = None,
    sinks: Float[Array, "N"] | None = None,
    key_scale: Float[Array, "P 1 Kpage"] | None = None,
    value_scale: Float[Array, "P 1 Kpage"] | None = None,
) -> Float[Array, "B T N h"]:
  """``jaxattn.ops.decode.paged_attention`` as a Pallas kernel (arguments checked there).

  The kernel reads merged pools ``[P, page, K * H]`` (a ``PagedKVCache``'s) in blocks
  ``[page, K * H]``, KV head ``g`` as a lane slice, and split pools ``[P, page, K, H]`` in blocks
  ``[page, K, H]``; both in place.  (XLA's default TPU layout of a split pool with heads of 64 or
  one KV head is not row-major, and then XLA re-tiles the pool before the kernel on every call:
  keep those merged.)

  Under a mesh (``mesh`` or the one set by ``jax.set_mesh``) the call runs in ``jax.shard_map``:
  queries, page table and lengths split over the ``"batch"`` mesh axes, queries and pools over
  the ``"kv_heads"`` axes when both ``N`` and ``K`` divide (whole GQA groups per device).  The
  pools are not split over batch: any sequence may own any page, so every batch shard needs the
  whole pool (a serving system that pins sequences to devices would give each its own pool).

  Query rows ``(t, g)`` of a KV head are processed ``block_rows`` at a time (a grid axis; None:
  all of them when they fit ``ROW_BUDGET`` of VMEM -- every decode step -- else the largest
  multiple of 16 that fits), so a long prefill through the cache runs here too; a block reads
  only the pages its own tokens can see (causal, and with ``local_window_size`` from the first
  page of its window: the page grid axis then spans the window, not the sequence).
  ``alibi_slopes [N]`` add ``slope * (j - i)`` in the kernel; ``sinks [N]`` (attention sinks)
  enter the combine step as one more partition.  Quantized pools (int8 / float8_e4m3fn codes)
  come with ``key_scale`` / ``value_scale [P, 1, K * page]``: each page's scales are fetched beside
  its codes, the logits multiplied by the keys' and the probabilities by the values'.
  """
  check_num_splits(num_splits)
  check_block_rows(block_rows)
  local = functools.partial(_local, scale=scale, soft_cap=logits_soft_cap, num_splits=num_splits,
                            block_rows=block_rows, interpret=interpret, cores=tensorcores(),
                            window=local_window_size)
  args = (query, key_pool, value_pool, page_table, lengths)
  return run_sharded_gqa(local, args + head_args(alibi_slopes, sinks, key_scale, value_scale),
                         mesh)


def row_slopes(slopes, kv_heads: int, groups: int, num_t: int, rows: int):
  """A per-head ``[N]`` array (ALiBi slopes, sink logits) by the kernels' query rows: ``[K, rows]``
  fp32, row ``(t, g)`` of KV head ``k`` (``t * G + g``) holding head ``k * G + g``'s value,
  zero-padded from ``T * G`` to ``rows`` (padded rows are cut from the output)."""
  per_row = jnp.tile(slopes.astype(_F32).reshape(kv_heads, groups), (1, num_t))
  return pad_rows(per_row, 1, rows)                   # rows >= T * G: padded to exactly rows


def slopes_arg(alibi_slopes) -> tuple:
  """``(slopes,)`` as a float32 array (it travels through ``shard_map`` split with the heads), or
  ``()``."""
  return () if alibi_slopes is None else (jnp.asarray(alibi_slopes, _F32),)


def contiguous_attention_tpu(
    query: Float[Array, "B T N H"],
    key: Float[Array, "B S KH"] | Float[Array, "B S K H"],
    value: Float[Array, "B S Kh"] | Float[Array, "B S K h"],
    lengths: Int[Array, "B"],
    *,
    scale: float,
    logits_soft_cap: float | None = None,
    num_splits: int | None = None,
    block_rows: int | None = None,
    interpret=None,
    mesh=None,
    local_window_size: int | None = None,
    alibi_slopes: Float[Array, "N"] | None = None,
    sinks: Float[Array, "N"] | None = None,
    key_scale: Float[Array, "B K S"] | None = None,
    value_scale: Float[Array, "B K S"] | None = None,
) -> Float[Array, "B T N h"]:
  """``jaxattn.ops.decode.cache_attention`` as the paged kernel over a contiguous cache.

  The cache -- a ``KVCache``'s rows ``[B, S, K * H]``, or ``[B, S, K, H]`` -- is read as
  ``S / page`` pages per sequence (``view_page_size(S)`` keys each): a reshape that only splits
  ``S``, so XLA moves no byte, and an identity page table.  The kernel reads each valid page
  once, in place -- unlike flash attention, whose head-major layout makes XLA transpose the whole
  cache on every decode step.  Under a mesh: ``jax.shard_map`` with queries, cache and lengths
  split over the ``"batch"`` axes and the heads over ``"kv_heads"`` when ``N`` and ``K`` divide.
  ``block_rows``, ``local_window_size``, ``alibi_slopes`` and ``sinks`` as in
  ``paged_attention_tpu``; a quantized cache's ``key_scale`` / ``value_scale [B, K, S]`` are
  viewed as pages with it (``scale_page_view``).
  """
  check_num_splits(num_splits)
  check_block_rows(block_rows)
  page = view_page_size(key.shape[1], cache_row_bytes(key, value))
  if page is None:
    raise ValueError(f"the cache length S={key.shape[1]} must be a multiple of 16 to be read "
                     "as pages in place.")
  cores = tensorcores()

  def local(q, k, v, lens, *heads):
    (key_pages, table), (value_pages, _) = page_view(k, page), page_view(v, page)
    heads = heads[:2] + tuple(scale_page_view(s, page) for s in heads[2:])
    return _local(q, key_pages, value_pages, table, lens, *heads, scale=scale,
                  soft_cap=logits_soft_cap, num_splits=num_splits, block_rows=block_rows,
                  interpret=interpret, cores=cores, window=local_window_size)

  kv_heads = kv_heads_of(key, query.shape[3])

  def specs(mesh):
    bax, hax = sharded.plan_specs(mesh, query.shape[0], query.shape[2], kv_heads)
    heads = P(bax, None, hax, None)
    cache = heads if key.ndim == 4 else P(bax, None, hax)    # merged rows: K-major, split by K
    scales = P(bax, hax, None)
    return (heads, cache, cache, P(bax), P(hax), P(hax), scales, scales)[:len(args)], heads

  args = [query, key, value, lengths.astype(jnp.int32),
          *head_args(alibi_slopes, sinks, key_scale, value_scale)]
  return sharded.run_sharded(local, args, mesh, specs)
