"""Paged GQA / MQA / MHA decode for NVIDIA GPUs (Pallas Triton), split-KV with a combine step.

The GPU shape of ``tpu.py``'s algorithm (flash-decoding): one program per
``(sequence b, KV head k and row block r, split-KV partition s)`` holds a tile of the query rows
of KV group ``k`` and loops over its partition's key blocks *inside* the kernel::

    grid (B, K * R, S)
    q tile   [rows, H]        rows = a block of the T * G query rows (t, g) of KV head k, a power
                              of two >= 16 (a Triton dot tile): each fetched key serves all G
                              heads.  A decode step is one block (R = 1); a prefill's rows come
                              in blocks of ``block_rows`` (64)
    loop     i < ceil((min(end, visible) - start) / block_k)    -- visible: the keys up to the
                                                                   block's last row (causal),
                                                                   at most the length
             pos = start + i * block_k;  page = page_table[b, pos // page]  (a scalar load)
             k, v = pool[page, pos % page : + block_k, k, :]    [block_k, H], [block_k, h]
             logits = scale * q k^T (fp32) -> soft-cap -> causal mask -> online softmax
             acc += p @ v                                       [rows, h] fp32
    out      [B, S, K, rows, h] fp32 + lse [B, S, K, rows]: the partition's partial, merged over
             S by ``tpu.combine``: with ``lse* = logsumexp_s lse_s``,
             ``out = sum_s exp(lse_s - lse*) out_s``

With a sliding window a program's loop starts at its rows' first visible key block, and the
split-KV partitions cover the pages a window can span (``tpu.window_pages``), not the whole
table; ALiBi adds ``slope * (j - i)`` from the program's row slopes.

Pages are read in place from the pool (no gathered copy).  A key block never straddles a page:
``page_size`` must be a multiple of ``block_k`` (a power of two >= 16).  Head sizes that are not a
power of two are zero-padded, which copies the pools: fine for tests, slow for serving -- use
H in {16, 32, 64, 128, 256}.  Slots past a sequence's length inside its last block may hold stale
data (even NaN): masked loads read them as zeros, and their logits are masked.

Quantized pools (int8 / float8_e4m3fn codes with fp32 scales ``[P, 1, K * page]``, one per token
and KV head, viewed as ``[P, K, page]``: a free reshape on GPU): a key block's ``[block_k]`` scales are loaded beside its codes (masked alike: a stale
slot's scale reads as zero), the codes widened to the query's dtype (fp32 under an fp32 query)
for the dots, the logits multiplied by the keys' scales, ``s_k (q . k)``, and the probabilities
by the values' before ``p @ v`` (the softmax normalizer sums them unscaled).

``num_splits=None`` picks ``clamp(ceil(2 * SMs / (B * K)), 1, max(1, M * page // 256))``
partitions (``M`` = pages per sequence, ``SMs`` the device's multiprocessor count, 132 when
unknown): about two programs per SM, so that small batches still fill the GPU, but no partition
shorter than 256 tokens (its fp32 partial output must stay small next to what it reads).

Under a device mesh (``mesh=`` or ``jax.set_mesh``) the call runs in ``jax.shard_map`` over the
batch (and the KV heads), as ``tpu.py`` does: a ``pallas_call`` cannot be partitioned by XLA.

Validated in interpret mode on CPU (``interpret=True``) against
``jaxattn.ops.decode.paged_attention_xla``; ``experiments/bench_decode.py --check`` compares the
compiled kernel with the formula on a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int

from jaxattn.ops.decode import check_num_splits, merged_kv_heads
from pallas_kernels.decode_attention.tpu import (code_dtype, combine, row_slopes,
                                                 run_sharded_gqa, head_args, present,
                                                 visible_keys, window_pages,
                                                 window_start)

_F32 = jnp.float32
DEFAULT_SMS = 132  # H100 / H200 SXM


def pow2(x: int) -> int:
  """Smallest power of two >= max(x, 16): the smallest Triton dot tile."""
  return max(16, 1 << (max(x, 1) - 1).bit_length())


def default_interpret(interpret) -> bool:
  if interpret is None:
    return jax.default_backend() not in ("gpu", "cuda", "rocm")
  return bool(interpret)


def num_sms() -> int:
  """Multiprocessors of the default device (``DEFAULT_SMS`` when JAX does not say)."""
  try:
    count = getattr(jax.devices()[0], "core_count", None)
  except Exception:  # noqa: BLE001 (no device query must break a call)
    count = None
  return int(count) if isinstance(count, int) and count > 0 else DEFAULT_SMS


MIN_SPLIT_TOKENS = 256


def auto_splits(programs_per_split: int, max_pages: int, page_size: int,
                long_split_tokens: int | None = None) -> int:
  """``clamp(ceil(2 * SMs / programs_per_split), 1, max(1, M * page // MIN_SPLIT_TOKENS))``:
  about two programs per SM, but each partition at least ``MIN_SPLIT_TOKENS`` long -- every
  partition writes (and the combine reads) an fp32 partial of its rows, which must stay small
  next to the cache bytes it reads (an MLA partial of 16 x 512 fp32 is 32 KB = 28 cached rows).

  With ``long_split_tokens``, raised to up to four programs per SM as long as partitions stay at
  least that long (more loads in flight where the partials cost little; the MLA kernel's rule,
  from H200 timings: module docstring of ``pallas_kernels.mla_decode.gpu``)."""
  tokens = max_pages * page_size
  programs = max(programs_per_split, 1)
  splits = max(1, min(max(1, tokens // MIN_SPLIT_TOKENS), -(-2 * num_sms() // programs)))
  if long_split_tokens:
    splits = max(splits, min(tokens // long_split_tokens, -(-4 * num_sms() // programs)))
  return splits


def check_block_k(block_k, page_size: int, default: int) -> int:
  """The key block: ``block_k`` or the largest power of two <= ``default`` dividing the page."""
  if block_k is None:
    block_k = default
    while block_k > 16 and page_size % block_k:
      block_k //= 2
  if isinstance(block_k, bool) or not isinstance(block_k, int) or block_k < 16 or (
      block_k & (block_k - 1)):
    raise ValueError(f"`block_k` must be a power of two >= 16 (a Triton tile), got {block_k!r}.")
  if page_size % block_k:
    raise ValueError(f"the pool's page size ({page_size}) must be a multiple of `block_k` "
                     f"({block_k}) on GPU: a key block may not straddle two pages; use pages of "
                     f"16, 32, 64, ... tokens.")
  return block_k


def pad_last(x, size: int):
  """Zero-pads the last axis to ``size`` (a no-op when it already is)."""
  if x.shape[-1] == size:
    return x
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])])


def pad_lengths(lengths):
  """``[B]`` lengths padded to a power-of-two length (only scalars are read from it)."""
  b = lengths.shape[0]
  return jnp.pad(lengths, (0, pow2(b) - b))


def partition_blocks(length, s, pages_per_split: int, page_size: int, block_k: int, lo=0):
  """``(first position, number of key blocks)`` of partition ``s``, clipped to ``length`` (the
  keys a block of query rows can see: ``tpu.visible_keys``).  ``lo``: the first key it can see
  (a sliding window's, ``tpu.window_start``): the partitions then cover the pages from the one
  holding it, and the first starts at its key block."""
  base = lax.div(lo, page_size) * page_size
  start = base + s * (pages_per_split * page_size)
  end = jnp.minimum(start + pages_per_split * page_size, length)
  start = jnp.maximum(start, lax.div(lo, block_k) * block_k)
  return start, lax.div(jnp.maximum(end - start, 0) + (block_k - 1), block_k)


def block_location(table_ref, pos, page_size: int, block_k: int):
  """``(pool page, offset in it)`` of the key block starting at position ``pos``."""
  logical = lax.div(pos, page_size)
  off = pl.multiple_of(pos - logical * page_size, block_k)
  return jnp.maximum(table_ref[logical], 0), off


def load_rows(ref, page, off, block_k: int, live):
  """``ref[page, off : off + block_k, :]`` with the rows where ``live [block_k, 1]`` is False read
  as zeros and not fetched.  Slots past a sequence's length may hold anything (even NaN): zeroed,
  ``0 * NaN`` cannot reach the accumulator.  A masked load (rather than a ``where`` after it)
  keeps the load a plain Triton load that the software pipeliner can prefetch."""
  shape = (block_k, ref.shape[-1])
  return plgpu.load(ref.at[page, pl.ds(off, block_k), :], mask=jnp.broadcast_to(live, shape),
                    other=0.0)


def load_scales(ref, page, off, block_k: int, live):
  """``ref[page, off : off + block_k]`` (a quantized pool's fp32 scales ``[P, page]`` of one KV
  head) with the slots where ``live [block_k]`` is False read as zeros: a stale slot's scale (any
  number, even NaN) cannot reach the result."""
  return plgpu.load(ref.at[page, pl.ds(off, block_k)], mask=live, other=0.0)


def dot_nt(a, b):
  """``a @ b.T`` in fp32, ``a [rows, H]``, ``b [bk, H]``.  Triton's dot takes operands of one
  dtype: the narrower is widened (an fp32 query over a bf16 cache, or the reverse)."""
  dt = jnp.promote_types(a.dtype, b.dtype)
  return plgpu.dot(a.astype(dt), b.astype(dt), trans_b=True)


def online_step(carry, logits, value, value_scale=None):
  """One online-softmax step: ``logits [rows, bk]`` fp32 (masked entries ``-inf``), ``value
  [bk, h]``; carry ``(acc [rows, h], m [rows], l [rows])`` fp32.  ``value_scale [bk]`` (quantized
  values, ``value`` their codes): the probabilities times it before the matmul, ``sum_j p_j s_j
  v_j``; the normalizer counts them unscaled."""
  acc, m, l = carry
  m_next = jnp.maximum(m, jnp.max(logits, axis=1))
  m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # nothing seen yet: keep exp() finite
  p = jnp.exp(logits - m_safe[:, None])
  alpha = jnp.exp(m - m_safe)
  l = l * alpha + jnp.sum(p, axis=1)
  if value_scale is not None:
    p = p * value_scale[None, :]
  pv_dtype = value.dtype if jnp.finfo(value.dtype).bits < 32 else _F32
  acc = acc * alpha[:, None] + plgpu.dot(p.astype(pv_dtype), value)
  return acc, m_next, l


def finish(carry):
  """``(out [rows, h], lse [rows])``: zeros and ``-inf`` where the partition saw no key."""
  acc, m, l = carry
  ok = l != 0.0  # NaN rows stay NaN (a fully masked row has l == 0)
  out = acc * jnp.where(ok, 1.0 / jnp.where(ok, l, 1.0), 0.0)[:, None]
  return out, jnp.where(ok, m + jnp.log(jnp.where(ok, l, 1.0)), -jnp.inf)


# -- the kernel --------------------------------------------------------------------------------

def _kernel(lens_ref, table_ref, q_ref, k_ref, v_ref, *refs, scale, soft_cap, num_t, groups,
            pages_per_split, block_k, row_blocks, window, alibi, quantized):
  refs = list(refs)
  slope_ref = refs.pop(0) if alibi else None
  ks_ref, vs_ref = (refs.pop(0), refs.pop(0)) if quantized else (None, None)  # [P, page] fp32
  o_ref, lse_ref = refs
  b, kr, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  page_size = k_ref.shape[1]
  rows = q_ref.shape[0]
  length = lens_ref[b]
  ri = lax.rem(kr, row_blocks)                                       # this program's row block
  # Keys after the block's last query row are not visible to it: not loaded (causal prefill);
  # nor, under a sliding window, those before its first row's window.
  start, n_blocks = partition_blocks(visible_keys(length, ri, rows, num_t, groups), s,
                                     pages_per_split, page_size, block_k,
                                     window_start(length, ri, rows, num_t, groups, window))
  q = q_ref[...]                                                     # [rows, Hp]
  # Query row (t, g) sits at position length - T + t and sees keys up to it (the contract).
  row = ri * rows + jnp.arange(rows, dtype=jnp.int32)
  q_pos = (length - num_t + lax.div(row, groups))[:, None]
  slopes = slope_ref[...][:, None] if alibi else None                # [rows, 1]

  def body(i, carry):
    pos = start + i * block_k
    page, off = block_location(table_ref, pos, page_size, block_k)
    kv_pos = pos + jnp.arange(block_k, dtype=jnp.int32)
    live = (kv_pos < length)[:, None]
    k = load_rows(k_ref, page, off, block_k, live)                   # [bk, Hp]
    v = load_rows(v_ref, page, off, block_k, live)                   # [bk, hp]
    value_scale = None
    if quantized:                                  # one-byte codes, widened for the dots
      k, v = k.astype(code_dtype(q.dtype)), v.astype(code_dtype(q.dtype))
    logits = dot_nt(q, k) * scale                                    # [rows, bk] fp32
    if quantized:                # key j is k_j * s_j: its logits are s_j (q . k_j)
      logits = logits * load_scales(ks_ref, page, off, block_k, live[:, 0])[None, :]
      value_scale = load_scales(vs_ref, page, off, block_k, live[:, 0])  # [bk]
    if alibi:                                                        # slope * (j - i)
      logits += slopes * (kv_pos[None, :] - q_pos).astype(_F32)
    if soft_cap is not None:
      logits = soft_cap * jnp.tanh(logits / soft_cap)
    valid = (kv_pos[None, :] < length) & (kv_pos[None, :] <= q_pos)
    if window is not None:
      valid &= kv_pos[None, :] >= q_pos - window
    return online_step(carry, jnp.where(valid, logits, -jnp.inf), v, value_scale)

  init = (jnp.zeros((rows, o_ref.shape[-1]), _F32), jnp.full((rows,), -jnp.inf, _F32),
          jnp.zeros((rows,), _F32))
  out, lse = finish(lax.fori_loop(0, n_blocks, body, init))
  o_ref[...] = out
  lse_ref[...] = lse


# Query rows (t, g) per program when the caller gives none: a decode step's GQA group in one
# tile; a prefill's rows in tiles of 64 (the fp32 accumulator lives in registers).
GPU_BLOCK_ROWS = 64


def gpu_block_rows(rows: int, block_rows: int | None) -> int:
  """Rows per Triton tile: ``block_rows`` (a power of two >= 16) or ``min(pow2(rows), 64)``."""
  if block_rows is None:
    return min(pow2(rows), GPU_BLOCK_ROWS)
  if isinstance(block_rows, bool) or not isinstance(block_rows, int) or block_rows < 16 or (
      block_rows & (block_rows - 1)):
    raise ValueError(f"`block_rows` must be None or a power of two >= 16 (a Triton tile), got "
                     f"{block_rows!r}.")
  return min(block_rows, pow2(rows))


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "num_splits", "block_k",
                                             "block_rows", "num_warps", "num_stages",
                                             "interpret", "window"))
def _call(q, key_pool, value_pool, page_table, lengths, slopes=None, sinks=None, key_scale=None,
          value_scale=None, *, scale, soft_cap, num_splits, block_k, block_rows, num_warps,
          num_stages, interpret, window=None):
  slopes, sinks = present(slopes), present(sinks)
  b, t, n, h = q.shape
  num_pages, page_size, kh, hv = value_pool.shape
  g = n // kh
  m = page_table.shape[1]
  hp, vp = pow2(h), pow2(hv)
  rb = gpu_block_rows(t * g, block_rows)
  nrb = -(-(t * g) // rb)                                            # row blocks per KV head
  rows = nrb * rb
  span = window_pages(m, page_size, rb, g, window)  # pages a row block can see (its window's)
  splits = min(num_splits, span)
  pps = -(-span // splits)                                           # pages per partition
  splits = -(-span // pps)                                           # no empty trailing ones
  # [B, T, K, G, H] -> [B, K, T*G, H], rows (t, g) of one KV head contiguous, padded to tiles.
  qk = q.reshape(b, t, kh, g, h).transpose(0, 2, 1, 3, 4).reshape(b, kh, t * g, h)
  qk = jnp.pad(qk, ((0, 0), (0, 0), (0, rows - t * g), (0, hp - h)))
  key_pool, value_pool = pad_last(key_pool, hp), pad_last(value_pool, vp)  # copies unless pow2
  kernel = functools.partial(_kernel, scale=float(scale), soft_cap=soft_cap, num_t=t, groups=g,
                             pages_per_split=pps, block_k=block_k, row_blocks=nrb, window=window,
                             alibi=slopes is not None, quantized=key_scale is not None)
  lens = pad_lengths(lengths)
  # Grid axis 1 enumerates (KV head, row block): program kr serves head kr // nrb.
  pool_map = lambda bi, kr, si: (0, 0, kr // nrb, 0)  # noqa: E731
  extra_specs, extra_args = [], []
  if slopes is not None:     # ALiBi: each query row's slope, [K, rows] rows (t, g)
    extra_args.append(row_slopes(slopes, kh, g, t, rows))
    extra_specs.append(pl.BlockSpec((None, rb), lambda bi, kr, si: (kr // nrb, kr % nrb)))
  if key_scale is not None:  # quantized pools: KV head k's scales [P, page], read beside its codes
    extra_args += [key_scale, value_scale]
    extra_specs += [pl.BlockSpec((num_pages, None, page_size),
                                 lambda bi, kr, si: (0, kr // nrb, 0))] * 2
  out, lse = pl.pallas_call(
      kernel,
      grid=(b, kh * nrb, splits),
      in_specs=[
          pl.BlockSpec(lens.shape, lambda bi, kr, si: (0,)),                      # lengths
          pl.BlockSpec((None, m), lambda bi, kr, si: (bi, 0)),                    # page table row
          pl.BlockSpec((None, None, rb, hp),
                       lambda bi, kr, si: (bi, kr // nrb, kr % nrb, 0)),          # q tile
          pl.BlockSpec((num_pages, page_size, None, hp), pool_map),               # key pool
          pl.BlockSpec((num_pages, page_size, None, vp), pool_map),               # value pool
      ] + extra_specs,
      out_specs=[
          pl.BlockSpec((None, None, None, rb, vp),
                       lambda bi, kr, si: (bi, si, kr // nrb, kr % nrb, 0)),
          pl.BlockSpec((None, None, None, rb), lambda bi, kr, si: (bi, si, kr // nrb, kr % nrb)),
      ],
      out_shape=[jax.ShapeDtypeStruct((b, splits, kh, rows, vp), _F32),
                 jax.ShapeDtypeStruct((b, splits, kh, rows), _F32)],
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret, name="jaxattn_paged_decode_gpu",
  )(lens, page_table, qk, key_pool, value_pool, *extra_args)
  sink = None if sinks is None else row_slopes(sinks, kh, g, t, rows)[None, :, :, None]
  out = combine(out, lse[..., None], sink)                           # [B, K, rows, vp]
  out = out[:, :, :t * g, :hv].reshape(b, kh, t, g, hv).transpose(0, 2, 1, 3, 4)
  return out.reshape(b, t, n, hv).astype(q.dtype)


def paged_attention_gpu(
    query: Float[Array, "B T N H"],
    key_pool: Float[Array, "P page KH"] | Float[Array, "P page K H"],
    value_pool: Float[Array, "P page Kh"] | Float[Array, "P page K h"],
    page_table: Int[Array, "B M"],
    lengths: Int[Array, "B"],
    *,
    scale: float,
    logits_soft_cap: float | None = None,
    num_splits: int | None = None,
    block_k: int | None = None,
    block_rows: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool | None = None,
    mesh=None,
    local_window_size: int | None = None,
    alibi_slopes: Float[Array, "N"] | None = None,
    sinks: Float[Array, "N"] | None = None,
    key_scale: Float[Array, "P 1 Kpage"] | None = None,
    value_scale: Float[Array, "P 1 Kpage"] | None = None,
) -> Float[Array, "B T N h"]:
  """``jaxattn.ops.decode.paged_attention`` as a Pallas Triton kernel (shapes checked there).

  Args:
    query, key_pool, value_pool, page_table, lengths, scale, logits_soft_cap: as
      ``paged_attention`` (``query`` 4-D).
    num_splits: split-KV partitions (each ``ceil(M / num_splits)`` pages), None = automatic
      (module docstring).
    block_k: keys per loop step, a power of two >= 16 dividing the page size; default the largest
      of 64, 32, 16 that divides it.
    block_rows: query rows ``(t, g)`` of a KV head per program, a power of two >= 16; default
      all of them up to 64 (a decode step: one program per KV head), so a long prefill runs as
      programs of 64 rows, each loading only the keys its tokens can see.
    num_warps, num_stages: Triton launch parameters.
    interpret: None runs the kernel interpreted unless the default backend is a GPU.
    mesh: a ``jax.sharding.Mesh`` to run under; None uses the one set by ``jax.set_mesh`` (if
      any).  Under a mesh the call runs in ``jax.shard_map`` exactly as ``paged_attention_tpu``:
      queries, page table and lengths split over the ``"batch"`` mesh axes, queries and pools over
      the ``"kv_heads"`` axes when both ``N`` and ``K`` divide (whole GQA groups per device); a
      size that does not divide stays whole (replicated).  The pools are not split over batch:
      any sequence may own any page.  ``num_splits=None`` is then chosen per device, from the
      local batch and KV heads.
    local_window_size, alibi_slopes, sinks: as ``paged_attention`` (the sinks enter the combine
      step as one more partition).  With a window a program loads only
      the key blocks from its rows' window on, and the split-KV partitions cover the window's
      pages, not the sequence's.
    key_scale, value_scale: with quantized pools (int8 / float8_e4m3fn codes), their fp32 scales
      ``[P, 1, K * page]``, as ``paged_attention``: each key block's scales are loaded beside its
      codes, the logits multiplied by the keys' and the probabilities by the values'.

  Returns:
    ``[B, T, N, h]`` in the query dtype.
  """
  check_num_splits(num_splits)
  if query.ndim != 4:
    raise ValueError(f"`query` must be [B, T, N, H], got {query.shape}.")
  # Merged [P, page, K * H|h] pools are split by head (a free reshape on GPU).
  kh = merged_kv_heads(key_pool, value_pool, query.shape[3])
  key_pool = key_pool.reshape(key_pool.shape[:2] + (kh, -1))
  value_pool = value_pool.reshape(value_pool.shape[:2] + (kh, -1))
  if query.shape[2] % key_pool.shape[2]:
    raise ValueError(f"query heads N={query.shape[2]} must be a multiple of the KV heads "
                     f"K={key_pool.shape[2]}.")
  block_k = check_block_k(block_k, key_pool.shape[1], 64)
  gpu_block_rows(1, block_rows)                                      # checked here, once
  interpret = default_interpret(interpret)

  def local(q, k_pool, v_pool, table, lens, *heads):
    # Shapes here are the device's own (inside shard_map): the automatic split count must fill
    # this device's multiprocessors with its local B * K * row-block programs, not the global
    # ones.
    splits = num_splits
    if splits is None:
      rows = q.shape[1] * (q.shape[2] // k_pool.shape[2])
      rb = gpu_block_rows(rows, block_rows)
      programs = q.shape[0] * k_pool.shape[2] * -(-rows // rb)
      span = window_pages(table.shape[1], k_pool.shape[1], rb, q.shape[2] // k_pool.shape[2],
                          local_window_size)
      splits = auto_splits(programs, span, k_pool.shape[1])
    # A quantized pool's scales [P, 1, K * page] (this device's heads) as [P, K, page].
    heads = heads[:2] + tuple(s.reshape(s.shape[0], k_pool.shape[2], -1) for s in heads[2:])
    return _call(q, k_pool, v_pool, table, lens, *heads, scale=float(scale),
                 soft_cap=logits_soft_cap, num_splits=splits, block_k=block_k,
                 block_rows=block_rows, num_warps=num_warps, num_stages=num_stages,
                 interpret=interpret, window=local_window_size)

  args = (query, key_pool, value_pool, page_table.astype(jnp.int32), lengths.astype(jnp.int32))
  return run_sharded_gqa(local, args + head_args(alibi_slopes, sinks, key_scale, value_scale),
                         mesh)


__all__ = ["auto_splits", "paged_attention_gpu"]
