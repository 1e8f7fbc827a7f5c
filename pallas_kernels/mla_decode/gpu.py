"""Absorbed MLA decode over a paged latent cache for NVIDIA GPUs (Pallas Triton): dense split-KV
and sparse (DSA).

The query arrives in latent space (``q~ [N, C]`` plus the rotated ``q^R [N, R]``); every head
attends to the same cached rows ``[c_KV, k^R]`` (MQA over latents) and the output stays in latent
space.  One program per ``(sequence b, split-KV partition s, head block h)``::

    grid (B, S, ceil(T*N / block_h))
    q tiles  [block_h, C], [block_h, R]   query rows (t, n) folded together, zero-padded to whole
                                          blocks (C, R zero-padded to powers of two if needed)
    loop     i < ceil((min(end, visible) - start) / block_k)     -- visible: keys up to the block's
                                                                   last row (causal), at most
                                                                   the length
             page = page_table[b, pos // page]                  (a scalar load)
             c  = c_pool[page, pos % page : + block_k, :]        [block_k, C]
             kr = kr_pool[page, ...]                             [block_k, R]
             logits = scale * (q~ c^T + q^R kr^T)  fp32  -> causal mask -> online softmax
             acc += p @ c                                        [block_h, C] fp32
    out      [B, S, rows, C] fp32 + lse [B, S, rows]: partials merged by
             ``decode_attention.combine``

Every head block of a sequence reads the whole latent cache, so with ``N <= block_h`` (e.g. 16
heads: DeepSeek-V3's 128 under 8-way tensor parallelism) each cached byte is read once; with 128
heads on one device it is read ``128 / block_h`` times (mostly from L2) and absorbed MLA decode is
compute-bound on an H200 anyway (~2 * 128 * 576 FLOPs per 1,152 cached bytes).

``T > 1`` new tokens per sequence are supported by folding ``(t, n)`` into the rows with the
contract's causal rule (row ``(t, n)`` sees keys ``<= lengths[b] - T + t``).

Sparse mode (DeepSeek Sparse Attention, ``indices [B, T, k]``): grid ``(B, T, head blocks)``; each
step loads ``block_k`` selected positions, looks their pages up in the page-table row (a vector
gather), and gathers those rows of the pool viewed flat as ``[P * page, C]`` by a vector of row
offsets; unselected or out-of-range slots are zeroed and masked.  Split-KV over the ``k`` selected
slots: grid ``(B, T, S, head blocks)``, partition ``s`` takes whole ``block_k`` blocks of the
index row, writes an fp32 partial and its log-sum-exp, merged by the same ``combine`` (one
partition writes the output directly).

A quantized latent cache (``c_KV`` as int8 / float8_e4m3fn codes, fp32 scales ``[P, 1, page]``,
one per token) works as the GQA kernel's quantized pools do: each block's scales are loaded
beside its codes (dense: masked alike, a stale slot's scale reading as zero; sparse: gathered by
the same row offsets, unselected slots zeroed), the codes widened to the query's dtype (fp32
under an fp32 query); ``c_j = s_j codes_j`` is both key part and value, so the content logits
are multiplied by ``s_j`` and the probabilities by ``s_j`` before ``p @ codes`` (the normalizer
sums them unscaled).

``num_splits=None`` picks ``clamp(ceil(2 * SMs / programs_per_split), 1, max(1, L // 256))``
partitions (``pallas_kernels.decode_attention.gpu.auto_splits``): dense ``programs_per_split = B *
head_blocks`` and ``L = M * page`` cached positions; sparse ``programs_per_split = B * T *
head_blocks`` and ``L = k`` selected slots.  Dense, that is raised to up to
``ceil(4 * SMs / programs_per_split)`` while partitions keep ``LONG_SPLIT_TOKENS`` (1024)
positions.  Under a device mesh it is chosen per device, from the local sizes.

Dense defaults (``block_k`` 64 where the page allows, 4 warps, 2 stages, the split rule above) are
from an H200 (jax 0.11.2; 16 heads, C = 512, R = 64, bf16, pages of 64, 32k context; % of the
4.2 TB/s read + write copy rate, cache bytes read over time): the previous defaults (32-row
blocks, 8 warps, two programs per SM) read 51% at batch 8 and 39-41% at batch 32; 64-row
blocks with 4 warps 75% / 66%; with 16 partitions at batch 32 (512 programs) 92%, 32: 89%, while
batch 8 kept its 33 (75%; 16 read 62%).  8 warps, 16-row blocks or 3 stages were slower.

Under a mesh (``mesh=`` or ``jax.set_mesh``) both modes run in ``jax.shard_map`` as ``tpu.py``
does: batch over the ``"batch"`` mesh axes, query heads over the ``"heads"`` axes (every head
reads the same latent rows, so each device holds the whole latent pool but only its heads).

Validated in interpret mode on CPU against ``jaxattn.ops.decode.paged_mla_decode_xla``;
``experiments/bench_decode.py --check`` compares the compiled kernel with it on a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int

from jaxattn.ops.decode import check_num_splits
from pallas_kernels.decode_attention.gpu import (auto_splits, block_location, check_block_k,
                                                 dot_nt, default_interpret, finish,
                                                 load_rows, load_scales, online_step, pad_last,
                                                 pad_lengths, partition_blocks, pow2)
from pallas_kernels.decode_attention.tpu import code_dtype, combine, visible_keys
from pallas_kernels.mla_decode.tpu import run_sharded_mla

# Dense split-KV: partitions at least this long may be added up to four programs per SM.
LONG_SPLIT_TOKENS = 1024

_F32 = jnp.float32


def _kernel(lens_ref, table_ref, ql_ref, qr_ref, c_ref, kr_ref, *refs, scale, num_t, num_heads,
            pages_per_split, block_k, quantized):
  refs = list(refs)
  cs_ref = refs.pop(0) if quantized else None                        # [P, page] fp32 scales
  o_ref, lse_ref = refs
  b, s, hb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  page_size = c_ref.shape[1]
  block_h = ql_ref.shape[0]
  length = lens_ref[b]
  # Keys after the block's last query row are not visible to it: not loaded (causal prefill).
  start, n_blocks = partition_blocks(visible_keys(length, hb, block_h, num_t, num_heads), s,
                                     pages_per_split, page_size, block_k)
  ql, qr = ql_ref[...], qr_ref[...]                                  # [bh, Cp], [bh, Rp]
  row = hb * block_h + jnp.arange(block_h, dtype=jnp.int32)          # folded (t, n)
  q_pos = (length - num_t + lax.div(row, num_heads))[:, None]        # [bh, 1]

  def body(i, carry):
    pos = start + i * block_k
    page, off = block_location(table_ref, pos, page_size, block_k)
    kv_pos = pos + jnp.arange(block_k, dtype=jnp.int32)
    live = (kv_pos < length)[:, None]              # rows past the length: zeros, not fetched
    c = load_rows(c_ref, page, off, block_k, live)                   # [bk, Cp]
    kr = load_rows(kr_ref, page, off, block_k, live)                 # [bk, Rp]
    c_scale = None
    if quantized:  # codes: row j is s_j c_j, key part and value alike (stale slots' s_j: 0)
      c = c.astype(code_dtype(ql.dtype))                             # widened for the dots
      c_scale = load_scales(cs_ref, page, off, block_k, live[:, 0])  # [bk]
    content = dot_nt(ql, c)                                          # [bh, bk] fp32
    if quantized:
      content = content * c_scale[None, :]
    logits = (content + dot_nt(qr, kr)) * scale
    valid = (kv_pos[None, :] < length) & (kv_pos[None, :] <= q_pos)
    return online_step(carry, jnp.where(valid, logits, -jnp.inf), c, c_scale)

  init = (jnp.zeros((block_h, o_ref.shape[-1]), _F32), jnp.full((block_h,), -jnp.inf, _F32),
          jnp.zeros((block_h,), _F32))
  out, lse = finish(lax.fori_loop(0, n_blocks, body, init))
  o_ref[...] = out
  lse_ref[...] = lse


@functools.partial(jax.jit, static_argnames=("scale", "num_splits", "block_h", "block_k",
                                             "num_warps", "num_stages", "interpret"))
def _call(q_latent, q_rope, c_pool, kr_pool, page_table, lengths, c_scale=None, *, scale,
          num_splits, block_h, block_k, num_warps, num_stages, interpret):
  b, t, n, c = q_latent.shape
  r = q_rope.shape[3]
  num_pages, page_size = c_pool.shape[:2]
  m = page_table.shape[1]
  splits = min(num_splits, m)
  pps = -(-m // splits)
  splits = -(-m // pps)
  cp, rp = pow2(c), pow2(r)
  rows = t * n
  rows_p = -(-rows // block_h) * block_h
  ql = jnp.pad(q_latent.reshape(b, rows, c), ((0, 0), (0, rows_p - rows), (0, cp - c)))
  qr = jnp.pad(q_rope.reshape(b, rows, r), ((0, 0), (0, rows_p - rows), (0, rp - r)))
  c_pool, kr_pool = pad_last(c_pool, cp), pad_last(kr_pool, rp)  # copies unless powers of two
  kernel = functools.partial(_kernel, scale=float(scale), num_t=t, num_heads=n,
                             pages_per_split=pps, block_k=block_k,
                             quantized=c_scale is not None)
  lens = pad_lengths(lengths)
  q_map = lambda bi, si, hi: (bi, hi, 0)  # noqa: E731
  extra_specs, extra_args = [], []
  if c_scale is not None:  # quantized codes: their scales [P, 1, page] as [P, page] (free)
    extra_args.append(c_scale.reshape(num_pages, page_size))
    extra_specs.append(pl.BlockSpec((num_pages, page_size), lambda bi, si, hi: (0, 0)))
  out, lse = pl.pallas_call(
      kernel,
      grid=(b, splits, rows_p // block_h),
      in_specs=[
          pl.BlockSpec(lens.shape, lambda bi, si, hi: (0,)),                    # lengths
          pl.BlockSpec((None, m), lambda bi, si, hi: (bi, 0)),                  # page table row
          pl.BlockSpec((None, block_h, cp), q_map),                             # q~ tile
          pl.BlockSpec((None, block_h, rp), q_map),                             # q^R tile
          pl.BlockSpec((num_pages, page_size, cp), lambda bi, si, hi: (0, 0, 0)),  # c_KV pool
          pl.BlockSpec((num_pages, page_size, rp), lambda bi, si, hi: (0, 0, 0)),  # k^R pool
      ] + extra_specs,
      out_specs=[
          pl.BlockSpec((None, None, block_h, cp), lambda bi, si, hi: (bi, si, hi, 0)),
          pl.BlockSpec((None, None, block_h), lambda bi, si, hi: (bi, si, hi)),
      ],
      out_shape=[jax.ShapeDtypeStruct((b, splits, rows_p, cp), _F32),
                 jax.ShapeDtypeStruct((b, splits, rows_p), _F32)],
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret, name="jaxattn_paged_mla_decode_gpu",
  )(lens, page_table, ql, qr, c_pool, kr_pool, *extra_args)
  out = combine(out, lse[..., None])                                 # [B, rows_p, Cp]
  return out[:, :rows, :c].reshape(b, t, n, c).astype(q_latent.dtype)


# -- sparse (DSA): selected rows only ------------------------------------------------------------

def _sparse_kernel(lens_ref, table_ref, idx_ref, ql_ref, qr_ref, c_ref, kr_ref, *refs, scale,
                   page_size, block_k, num_blocks, blocks_per_split, quantized):
  """``blocks_per_split=None``: one pass over all ``num_blocks`` blocks, the output written in its
  dtype; else partition ``program_id(2)`` covers its blocks and writes an fp32 partial plus its
  log-sum-exp to ``lse_ref``.  ``quantized``: ``c_ref`` holds codes and the first of ``refs`` is
  their flat scales ``[P * page]``, gathered by the same row offsets."""
  refs = list(refs)
  cs_ref = refs.pop(0) if quantized else None
  o_ref, lse_ref = refs[0], refs[1:]
  b = pl.program_id(0)
  block_h = ql_ref.shape[0]
  length = lens_ref[b]
  ql, qr = ql_ref[...], qr_ref[...]                                  # [bh, Cp], [bh, Rp]

  def body(j, carry):
    idx = idx_ref[pl.ds(pl.multiple_of(j * block_k, block_k), block_k)]  # [bk] positions
    valid = (idx >= 0) & (idx < length)
    pos = jnp.where(valid, idx, 0)
    logical = lax.div(pos, page_size)
    page = table_ref[logical]                                        # [bk] gathered page ids
    valid = valid & (page >= 0) & (page < c_ref.shape[0] // page_size)   # a corrupt id: absent
    row = jnp.maximum(page, 0) * page_size + (pos - logical * page_size)  # rows of the flat pool
    # Gathered rows (a vector of row offsets); unselected slots may point at anything (NaN):
    # zero them so that 0 * NaN cannot reach the accumulator.
    # Codes are widened for the dots (a NaN fp8 code of an unselected slot is zeroed after).
    cdt = code_dtype(ql.dtype) if quantized else c_ref.dtype
    c = jnp.where(valid[:, None], c_ref[row, :].astype(cdt), 0.0).astype(cdt)  # [bk, Cp]
    kr = jnp.where(valid[:, None], kr_ref[row, :], 0.0).astype(kr_ref.dtype)  # [bk, Rp]
    content = dot_nt(ql, c)                                          # [bh, bk] fp32
    c_scale = None
    if quantized:  # row j is s_j c_j, key part and value alike (unselected slots' s_j: 0)
      c_scale = jnp.where(valid, cs_ref[row], 0.0)                   # [bk]
      content = content * c_scale[None, :]
    logits = (content + dot_nt(qr, kr)) * scale
    return online_step(carry, jnp.where(valid[None, :], logits, -jnp.inf), c, c_scale)

  init = (jnp.zeros((block_h, o_ref.shape[-1]), _F32), jnp.full((block_h,), -jnp.inf, _F32),
          jnp.zeros((block_h,), _F32))
  if blocks_per_split is None:
    out, _ = finish(lax.fori_loop(0, num_blocks, body, init))
    o_ref[...] = out.astype(o_ref.dtype)
    return
  first = pl.program_id(2) * blocks_per_split
  last = jnp.minimum(first + blocks_per_split, num_blocks)
  out, lse = finish(lax.fori_loop(first, last, body, init))
  o_ref[...] = out
  lse_ref[0][...] = lse


@functools.partial(jax.jit, static_argnames=("scale", "num_splits", "block_h", "block_k",
                                             "num_warps", "num_stages", "interpret"))
def _sparse_call(q_latent, q_rope, c_pool, kr_pool, page_table, lengths, indices, c_scale=None,
                 *, scale, num_splits, block_h, block_k, num_warps, num_stages, interpret):
  b, t, n, c = q_latent.shape
  r = q_rope.shape[3]
  num_pages, page_size = c_pool.shape[:2]
  m, k = page_table.shape[1], indices.shape[2]
  cp, rp = pow2(c), pow2(r)
  n_p = -(-n // block_h) * block_h
  k_p = -(-k // block_k) * block_k
  ql = jnp.pad(q_latent, ((0, 0), (0, 0), (0, n_p - n), (0, cp - c)))
  qr = jnp.pad(q_rope, ((0, 0), (0, 0), (0, n_p - n), (0, rp - r)))
  idx = jnp.pad(indices, ((0, 0), (0, 0), (0, k_p - k)), constant_values=-1)
  # Flat [P * page, C|R] views (free reshapes): a selected row is one offset.
  c_flat = pad_last(c_pool, cp).reshape(num_pages * page_size, cp)
  kr_flat = pad_last(kr_pool, rp).reshape(num_pages * page_size, rp)
  # Quantized codes: their scales [P, 1, page] as [P * page], one per flat row (free).
  extra = () if c_scale is None else (c_scale.reshape(num_pages * page_size),)
  num_blocks = k_p // block_k
  bps = -(-num_blocks // min(num_splits, num_blocks))              # blocks per partition
  splits = -(-num_blocks // bps)                                     # no empty trailing ones
  lens = pad_lengths(lengths)
  if splits > 1:
    return _sparse_split_call(lens, page_table, idx, ql, qr, c_flat, kr_flat, *extra,
                              scale=scale, page_size=page_size, block_h=block_h, block_k=block_k,
                              num_blocks=num_blocks, blocks_per_split=bps, splits=splits,
                              num_warps=num_warps, num_stages=num_stages,
                              interpret=interpret)[:, :, :n, :c].astype(q_latent.dtype)
  kernel = functools.partial(_sparse_kernel, scale=float(scale), page_size=page_size,
                             block_k=block_k, num_blocks=num_blocks, blocks_per_split=None,
                             quantized=bool(extra))
  q_map = lambda bi, ti, hi: (bi, ti, hi, 0)  # noqa: E731
  out = pl.pallas_call(
      kernel,
      grid=(b, t, n_p // block_h),
      in_specs=[
          pl.BlockSpec(lens.shape, lambda bi, ti, hi: (0,)),                    # lengths
          pl.BlockSpec((None, m), lambda bi, ti, hi: (bi, 0)),                  # page table row
          pl.BlockSpec((None, None, k_p), lambda bi, ti, hi: (bi, ti, 0)),      # selected positions
          pl.BlockSpec((None, None, block_h, cp), q_map),                       # q~ tile
          pl.BlockSpec((None, None, block_h, rp), q_map),                       # q^R tile
          pl.BlockSpec(c_flat.shape, lambda bi, ti, hi: (0, 0)),                # c_KV rows
          pl.BlockSpec(kr_flat.shape, lambda bi, ti, hi: (0, 0)),               # k^R rows
      ] + [pl.BlockSpec(x.shape, lambda bi, ti, hi: (0,)) for x in extra],      # c_KV scales
      out_specs=pl.BlockSpec((None, None, block_h, cp), q_map),
      out_shape=jax.ShapeDtypeStruct((b, t, n_p, cp), q_latent.dtype),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret, name="jaxattn_sparse_mla_decode_gpu",
  )(lens, page_table, idx, ql, qr, c_flat, kr_flat, *extra)
  return out[:, :, :n, :c]


def _sparse_split_call(lens, page_table, idx, ql, qr, c_flat, kr_flat, *extra, scale, page_size,
                       block_h, block_k, num_blocks, blocks_per_split, splits, num_warps,
                       num_stages, interpret):
  """Split-KV over the selected slots: grid ``(B, T, S, head blocks)``, fp32 partials
  ``[B, S, T, N_p, Cp]`` and log-sum-exps ``[B, S, T, N_p]`` merged by ``combine`` ->
  ``[B, T, N_p, Cp]`` fp32 (inputs already padded by ``_sparse_call``; ``extra``: the flat
  ``c_KV`` scales of quantized codes, or nothing)."""
  b, t, n_p, cp = ql.shape
  rp = qr.shape[3]
  m, k_p = page_table.shape[1], idx.shape[2]
  kernel = functools.partial(_sparse_kernel, scale=float(scale), page_size=page_size,
                             block_k=block_k, num_blocks=num_blocks,
                             blocks_per_split=blocks_per_split, quantized=bool(extra))
  q_map = lambda bi, ti, si, hi: (bi, ti, hi, 0)  # noqa: E731
  out, lse = pl.pallas_call(
      kernel,
      grid=(b, t, splits, n_p // block_h),
      in_specs=[
          pl.BlockSpec(lens.shape, lambda bi, ti, si, hi: (0,)),                # lengths
          pl.BlockSpec((None, m), lambda bi, ti, si, hi: (bi, 0)),              # page table row
          pl.BlockSpec((None, None, k_p), lambda bi, ti, si, hi: (bi, ti, 0)),  # selected positions
          pl.BlockSpec((None, None, block_h, cp), q_map),                       # q~ tile
          pl.BlockSpec((None, None, block_h, rp), q_map),                       # q^R tile
          pl.BlockSpec(c_flat.shape, lambda bi, ti, si, hi: (0, 0)),            # c_KV rows
          pl.BlockSpec(kr_flat.shape, lambda bi, ti, si, hi: (0, 0)),           # k^R rows
      ] + [pl.BlockSpec(x.shape, lambda bi, ti, si, hi: (0,)) for x in extra],  # c_KV scales
      out_specs=[
          pl.BlockSpec((None, None, None, block_h, cp),
                       lambda bi, ti, si, hi: (bi, si, ti, hi, 0)),
          pl.BlockSpec((None, None, None, block_h), lambda bi, ti, si, hi: (bi, si, ti, hi)),
      ],
      out_shape=[jax.ShapeDtypeStruct((b, splits, t, n_p, cp), _F32),
                 jax.ShapeDtypeStruct((b, splits, t, n_p), _F32)],
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret, name="jaxattn_sparse_mla_decode_gpu_split",
  )(lens, page_table, idx, ql, qr, c_flat, kr_flat, *extra)
  return combine(out, lse[..., None])                                # [B, T, N_p, Cp]


def paged_mla_decode_gpu(
    q_latent: Float[Array, "B T N C"],
    q_rope: Float[Array, "B T N R"],
    c_kv_pool: Float[Array, "P page C"],
    k_rope_pool: Float[Array, "P page R"],
    page_table: Int[Array, "B M"],
    lengths: Int[Array, "B"],
    *,
    scale: float,
    indices: Int[Array, "B T k"] | None = None,
    num_splits: int | None = None,
    block_h: int = 16,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    interpret: bool | None = None,
    mesh=None,
    c_kv_scale: Float[Array, "P 1 page"] | None = None,
) -> Float[Array, "B T N C"]:
  """``jaxattn.ops.decode.paged_mla_decode`` (dense split-KV and sparse) as Pallas Triton kernels.

  Args:
    q_latent, q_rope, c_kv_pool, k_rope_pool, page_table, lengths, scale: as
      ``paged_mla_decode`` (queries 4-D; shapes checked there).
    indices: sparse (DSA) mode: ``[B, T, k]`` selected positions (``-1`` = none; positions outside
      ``[0, lengths[b])`` ignored); None: dense causal attention.
    num_splits: split-KV partitions (dense: of the ``M`` pages; sparse: of the ``k`` selected
      slots, in whole ``block_k`` blocks), None = automatic (module docstring).
    block_h: query rows per program, a power of two >= 16.
    block_k: cached rows per loop step, a power of two >= 16; dense: dividing the page size,
      default the largest of 64, 32, 16 that divides it; sparse: selected rows gathered per step,
      default 16.
    num_warps, num_stages: Triton launch parameters; ``num_warps`` defaults to 4 (dense; the
      sparse mode: 8 for latents of 256+, else 4).
    interpret: None runs the kernel interpreted unless the default backend is a GPU.
    mesh: a ``jax.sharding.Mesh`` to run under; None uses the one set by ``jax.set_mesh`` (if
      any).  As ``paged_mla_decode_tpu``: queries, page table, lengths (and indices) split over
      the ``"batch"`` mesh axes, query heads over the ``"heads"`` axes; the latent pools stay
      whole on every device; a size that does not divide stays whole (replicated).
    c_kv_scale: ``[P, 1, page]`` fp32: ``c_kv_pool`` holds int8 / float8_e4m3fn codes with these
      per-token scales (a quantized ``PagedLatentCache``; checked by ``paged_mla_decode``).  Both
      modes load each key block's scales beside its codes (dense: masked like them; sparse:
      gathered by the same rows, unselected slots zeroed), widen the codes to the query's dtype
      (fp32 under an fp32 query), multiply the content logits and the probabilities by them;
      under a mesh they stay whole on every device, as the pools do.

  Returns:
    ``[B, T, N, C]`` in the query dtype.
  """
  check_num_splits(num_splits)
  if isinstance(block_h, bool) or not isinstance(block_h, int) or block_h < 16 or (
      block_h & (block_h - 1)):
    raise ValueError(f"`block_h` must be a power of two >= 16 (a Triton tile), got {block_h!r}.")
  if q_latent.ndim != 4 or q_rope.ndim != 4 or c_kv_pool.ndim != 3 or k_rope_pool.ndim != 3:
    raise ValueError(f"queries must be [B, T, N, C|R] and pools [P, page, C|R], got "
                     f"{q_latent.shape}, {q_rope.shape}, {c_kv_pool.shape}, {k_rope_pool.shape}.")
  if num_warps is None:  # dense: 4 (H200 timings, module docstring); sparse: 8 for wide latents
    num_warps = 8 if indices is not None and pow2(q_latent.shape[-1]) >= 256 else 4
  b, t, n = q_latent.shape[:3]
  interpret = default_interpret(interpret)
  args = [q_latent, q_rope, c_kv_pool, k_rope_pool, page_table.astype(jnp.int32),
          lengths.astype(jnp.int32)]
  scales = () if c_kv_scale is None else (c_kv_scale,)
  kw = dict(scale=float(scale), block_h=block_h, num_warps=num_warps, num_stages=num_stages,
            interpret=interpret)
  if indices is not None:
    if indices.shape[:2] != (b, t) or indices.ndim != 3:
      raise ValueError(f"`indices` must be [B={b}, T={t}, k], got shape {indices.shape}.")
    # Selected rows are gathered one by one: any block size works, no page alignment needed.
    block_k = check_block_k(block_k, 16 if block_k is None else block_k, 16)
    args.append(indices.astype(jnp.int32))

    def local(ql, qr, c_pool, kr_pool, table, lens, idx, *cs):
      # Local (per-device) sizes: the k selected slots count as k one-row pages, so partitions
      # hold >= MIN_SPLIT_TOKENS slots, as the dense mode's hold >= MIN_SPLIT_TOKENS positions.
      lb, lt, ln = ql.shape[:3]
      splits = num_splits
      if splits is None:
        splits = auto_splits(lb * lt * -(-ln // block_h), idx.shape[2], 1)
      return _sparse_call(ql, qr, c_pool, kr_pool, table, lens, idx, *cs, num_splits=splits,
                          block_k=block_k, **kw)
  else:
    block_k = check_block_k(block_k, c_kv_pool.shape[1], 64)

    def local(ql, qr, c_pool, kr_pool, table, lens, *cs):
      lb, lt, ln = ql.shape[:3]
      splits = num_splits
      if splits is None:
        splits = auto_splits(lb * -(-(lt * ln) // block_h), table.shape[1], c_pool.shape[1],
                             long_split_tokens=LONG_SPLIT_TOKENS)
      return _call(ql, qr, c_pool, kr_pool, table, lens, *cs, num_splits=splits,
                   block_k=block_k, **kw)

  return run_sharded_mla(local, args + list(scales), mesh, pool_scales=bool(scales))


__all__ = ["paged_mla_decode_gpu"]
