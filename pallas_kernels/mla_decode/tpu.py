"""Absorbed MLA decode over a paged latent cache (TPU / Mosaic style): dense split-KV and sparse.

The query arrives in latent space (``q~ = q^C W_up^K^T [N, C]`` plus the rotated ``q^R [N, R]``);
every head attends to the same cached rows ``[c_KV, k^R]``, so one fetched page serves all ``N``
heads (MQA over latents) and the output stays in latent space for the module to up-project.

Dense mode, split-KV (flash-decoding), page table and lengths by scalar prefetch:

    grid (B, I, S, J)              b: sequence; i: block of query rows; s: split-KV partition;
                                   j: page in the partition ((S, B, I, J) at batch 1, so that
                                   a megacore chip gives each TensorCore a partition)
    q blocks  [Tb*N, C], [Tb*N, R] a block of the rows (t, n) of sequence b: all heads of a
                                   decode step (I = 1), or ``MLA_BLOCK_ROWS`` consecutive rows of
                                   a prefill at a time (VMEM)
    kv blocks [page, C], [page, R] one pool page of c_KV and of k^R (R: the pool's width; a
                                   ``PagedLatentCache`` on TPU stores k^R zero-padded to 128
                                   columns, and ``paged_mla_decode`` pads q^R to match, so the
                                   pool is read in place, without a relayout)
    out block [Tb*N, C] fp32 + lse [Tb*N, 1]: the partition's partial, merged by ``combine``
                                   (one partition: the output, in the query dtype)

    logits = scale * (q~ c^T + q^R k^R^T)      [Tb*N, page]   (fp32)
    acc   += softmax-weights @ c               [Tb*N, C]

A quantized latent cache (``c_KV`` as int8 / float8_e4m3fn codes) also fetches the page's scales
``[1, page]`` (from the ``[P, 1, page]`` scale pool, by the ``c_KV`` page's index) and folds them
in, ``c_j = s_j codes_j`` being both key part and value: the content logits times ``s`` along
the page, the probabilities times ``s`` before ``@ codes`` (the normalizer unscaled); stale
slots' scales are zeroed, so a NaN there never reaches the result.

Pages a row block cannot see (past the sequence's length, or past its last token's position) do
no compute and their DMA index is clamped to its last visible page (no refetch), exactly as in
``pallas_kernels.decode_attention``.

Sparse mode (DeepSeek Sparse Attention): ``indices [B, T, k]`` selected positions become row
addresses of the pools viewed flat (through the page table; ``-1`` past the length, unused or on
an unmapped page) and ``pallas_kernels.sparse_attention.tpu.gather_attention`` gathers ``block_k``
rows per step with double-buffered manual DMAs, all ``N`` heads of a token sharing each row, the
gathered ``c_KV`` rows doubling as the value.

Validated in interpret mode (race detection on) against ``jaxattn.ops.decode.paged_mla_decode_xla``;
compiled for TPU v5e / v6e by ``experiments/tpu_compile_check.py``, not yet run on one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from jaxattn.ops.decode import check_num_splits, latent_view_page_size, page_view
from pallas_kernels.decode_attention.tpu import (check_block_rows, combine, dot_t, finalize,
                                                 grid_ids, grid_order, online_softmax_update,
                                                 operand_dtype, pad_rows, page_index,
                                                 split_plan, tensorcores, visible_keys)
from pallas_kernels.flash_attention import sharded
from pallas_kernels.flash_attention.common import default_interpret, reset_online_softmax
from pallas_kernels.sparse_attention.tpu import gather_attention

_F32 = jnp.float32


def _dense_kernel(lens_ref, table_ref, ql_ref, qr_ref, c_ref, kr_ref, *refs, scale, num_t,
                  num_heads, pages_per_split, split_first, quantized):
  refs = list(refs)
  cs_ref = refs.pop(0) if quantized else None                     # [1, page] fp32: the scales
  o_ref, lse_ref, m_ref, l_ref, acc_ref = refs
  b, i, s, j = grid_ids(split_first)
  page_size, rows = c_ref.shape[0], ql_ref.shape[0]                # rows: a block of T*N
  length = lens_ref[b]
  start = (s * pages_per_split + j) * page_size

  reset_online_softmax(j == 0, m_ref, l_ref, acc_ref)

  @pl.when(start < visible_keys(length, i, rows, num_t, num_heads))
  def compute():
    # Operands in their own dtype (bf16 stays bf16: the MXU's native rate), fp32 accumulation.
    cdt, rdt = operand_dtype(ql_ref.dtype, c_ref.dtype), operand_dtype(qr_ref.dtype, kr_ref.dtype)
    c = c_ref[...].astype(cdt)                                              # [page, C]
    # Rows past the length hold stale data: zero them so 0 * NaN cannot reach the accumulator.
    live = (start + jax.lax.broadcasted_iota(jnp.int32, (page_size, 1), 0)) < length
    c = jnp.where(live, c, 0)
    content = dot_t(ql_ref[...].astype(cdt), c)                             # [rows, page] fp32
    c_scale = None
    if quantized:   # codes: row j is s_j c_j, key part and value alike (stale slots: 0, no NaN)
      live_row = (start + jax.lax.broadcasted_iota(jnp.int32, (1, page_size), 1)) < length
      c_scale = jnp.where(live_row, cs_ref[...], 0.0)                      # [1, page]
      content = content * c_scale
    logits = (content + dot_t(qr_ref[...].astype(rdt), kr_ref[...].astype(rdt))) * scale
    kv_pos = start + jax.lax.broadcasted_iota(jnp.int32, (rows, page_size), 1)
    row = i * rows + jax.lax.broadcasted_iota(jnp.int32, (rows, page_size), 0)
    q_pos = length - num_t + row // num_heads
    online_softmax_update(m_ref, l_ref, acc_ref, logits, (kv_pos < length) & (kv_pos <= q_pos), c,
                          c_scale)

  @pl.when(j == pages_per_split - 1)
  def store():
    out, lse = finalize(m_ref[...], l_ref[...], acc_ref[...])
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = lse


# Query rows (tokens x heads) per block of the dense kernel when the caller gives none: queries,
# fp32 accumulator and output of 512 rows of C = 512 take ~4.5 MiB of VMEM (double-buffered).
MLA_BLOCK_ROWS = 512


@functools.partial(jax.jit, static_argnames=("scale", "num_splits", "block_rows", "interpret",
                                             "cores"))
def _dense_local(q_latent, q_rope, c_pool, kr_pool, page_table, lengths, c_scale=None, *, scale,
                 num_splits, block_rows=None, interpret=None, cores=1):
  """``kr_pool=None``: ``c_pool`` is a fused pool ``[P, page, C + R]`` (``C`` a multiple of ``R``),
  whose ``k^R`` columns the kernel reads as block ``C / R`` of the last axis: two DMAs from one
  array, no copy.  ``c_scale [P, 1, page]``: ``c_pool`` holds quantized codes with these scales
  (a separate ``kr_pool`` then), each page's fetched beside its codes."""
  b, t, n, c = q_latent.shape
  r = q_rope.shape[3]
  rope_block = 0
  if kr_pool is None:
    kr_pool, rope_block = c_pool, c // r
  page_size, m = c_pool.shape[1], page_table.shape[1]
  splits, split_first = split_plan(num_splits, b, m, cores)
  pps = -(-m // splits)
  rows = t * n
  rb = min(block_rows or MLA_BLOCK_ROWS, rows)
  ql = pad_rows(q_latent.reshape(b, rows, c), 1, rb)                          # rows (t, n)
  qr = pad_rows(q_rope.reshape(b, rows, r), 1, rb)
  padded = ql.shape[1]

  def kv_map(bi, ii, si, ji, lens_ref, table_ref):
    visible = visible_keys(lens_ref[bi], ii, rb, t, n)
    return (page_index(visible, table_ref, bi, si * pps + ji, max_pages=m, page_size=page_size,
                       num_pages=c_pool.shape[0]), 0, 0)

  def kr_map(*idx):
    return kv_map(*idx)[:2] + (rope_block,)

  order = functools.partial(grid_order, split_first, (b, padded // rb, splits, pps))
  grid, q_map = order(lambda bi, ii, si, ji, *_: (bi, ii, 0))
  c_map, r_map = order(kv_map)[1], order(kr_map)[1]
  o_map = order(lambda bi, ii, si, ji, *_: (bi, si, ii, 0))[1]
  # One partition: the kernel's output is final (query dtype); else fp32 partials to combine.
  out_dtype = q_latent.dtype if splits == 1 else _F32
  kernel = functools.partial(_dense_kernel, scale=float(scale), num_t=t, num_heads=n,
                             pages_per_split=pps, split_first=split_first,
                             quantized=c_scale is not None)
  extra_args, extra_specs = [], []
  if c_scale is not None:    # the c_KV page's scales [1, page], by the same page index
    extra_args.append(c_scale)
    extra_specs.append(pl.BlockSpec((None, 1, page_size), c_map))
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      grid=grid,
      in_specs=[pl.BlockSpec((None, rb, c), q_map),                  # q~ [rows, C]
                pl.BlockSpec((None, rb, r), q_map),                  # q^R [rows, R]
                pl.BlockSpec((None, page_size, c), c_map),           # c_KV page
                pl.BlockSpec((None, page_size, r), r_map),           # k^R page
                *extra_specs],
      out_specs=[pl.BlockSpec((None, None, rb, c), o_map),
                 pl.BlockSpec((None, None, rb, 1), o_map)],
      scratch_shapes=[pltpu.VMEM((rb, 1), _F32), pltpu.VMEM((rb, 1), _F32),
                      pltpu.VMEM((rb, c), _F32)])
  out, lse = pl.pallas_call(
      kernel, grid_spec=grid_spec,
      out_shape=[jax.ShapeDtypeStruct((b, splits, padded, c), out_dtype),
                 jax.ShapeDtypeStruct((b, splits, padded, 1), _F32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
      interpret=default_interpret(interpret),
  )(lengths, page_table.reshape(-1), ql, qr, c_pool, kr_pool, *extra_args)
  return combine(out, lse)[:, :rows].reshape(b, t, n, c).astype(q_latent.dtype)


# -- sparse (DSA): selected rows only ----------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def _sparse_local(q_latent, q_rope, c_pool, kr_pool, page_table, lengths, indices, *, scale,
                  interpret):
  """The selected positions become rows of the pools viewed flat as ``[P * page, C|R]`` (free
  reshapes): ``table[b, pos // page] * page + pos % page``, ``-1`` where the slot is unused, past
  the length or on an unmapped page; ``gather_attention`` fetches ``block_k`` of them per step."""
  b, t, n, c = q_latent.shape
  r = q_rope.shape[3]
  num_pages, page_size = c_pool.shape[:2]
  m = page_table.shape[1]
  valid = (indices >= 0) & (indices < lengths[:, None, None])
  pos = jnp.where(valid, indices, 0)
  logical = jnp.minimum(pos // page_size, m - 1)
  page = jnp.take_along_axis(page_table, logical.reshape(b, -1), axis=1).reshape(pos.shape)
  valid = valid & (page >= 0) & (page < num_pages)
  rows = jnp.where(valid, page * page_size + pos % page_size, -1).reshape(b * t, -1)
  out = gather_attention(
      (q_latent.reshape(b * t, n, c), q_rope.astype(q_latent.dtype).reshape(b * t, n, r)),
      (c_pool.reshape(num_pages * page_size, c),
       kr_pool.astype(c_pool.dtype).reshape(num_pages * page_size, r)),
      rows, kv_heads=1, scale=scale, value_part=0, interpret=default_interpret(interpret))
  return out.reshape(b, t, n, c)


def run_sharded_mla(local, args, mesh, pool_scales: bool = False):
  """``local(q_latent, q_rope, c_pool, kr_pool, page_table, lengths[, indices])`` under ``mesh``
  (None: the context mesh; no mesh or no free axis: called directly): batch over the ``"batch"``
  axes, query heads over ``"heads"``; every device keeps the whole latent pool.  Shared by the TPU
  and GPU MLA decode kernels.  ``pool_scales``: the last argument is the quantized latent pool's
  scales ``[P, 1, page]``, whole on every device as the pool is."""
  b, _, n, _ = args[0].shape

  def specs(mesh):
    bax, hax = sharded.latent_specs(mesh, b, n)
    q_spec = P(bax, None, hax, None)
    ins = (q_spec, q_spec, P(), P(), P(bax, None), P(bax), P(bax, None, None))
    return ins[:len(args) - pool_scales] + (P(),) * pool_scales, q_spec

  return sharded.run_sharded(local, args, mesh, specs)

def paged_mla_decode_tpu(
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
    block_rows: int | None = None,
    interpret=None,
    mesh=None,
    c_kv_scale: Float[Array, "P 1 page"] | None = None,
) -> Float[Array, "B T N C"]:
  """``jaxattn.ops.decode.paged_mla_decode`` as Pallas kernels (arguments checked there).

  Under a mesh the call runs in ``jax.shard_map``: queries, page table, lengths (and indices) split
  over the ``"batch"`` mesh axes, query heads over the ``"heads"`` axes (all heads share the
  latent, so any split of the heads is valid); the latent pools stay whole on every device.
  Dense mode takes the query rows ``(t, n)`` ``block_rows`` at a time (None: all of them up to
  ``MLA_BLOCK_ROWS``, else blocks of that many), so a long prefill runs here too.
  ``c_kv_scale [P, 1, page]``: ``c_kv_pool`` holds int8 / float8_e4m3fn codes with these
  per-token scales (a quantized ``PagedLatentCache``), folded into the dense kernel; the sparse
  mode takes none.
  """
  check_num_splits(num_splits)
  check_block_rows(block_rows)
  if c_kv_scale is not None and indices is not None:
    raise ValueError("the sparse (`indices`) MLA decode kernel takes no `c_kv_scale`: a quantized "
                     "latent cache decodes sparsely on the 'xla' path.")
  if indices is None:
    local = functools.partial(_dense_local, scale=scale, num_splits=num_splits,
                              block_rows=block_rows, interpret=interpret, cores=tensorcores())
  else:
    local = functools.partial(_sparse_local, scale=scale, interpret=interpret)
  args = [q_latent, q_rope, c_kv_pool, k_rope_pool, page_table, lengths]
  if indices is not None:
    args.append(indices)
  if c_kv_scale is not None:
    args.append(c_kv_scale)
  return run_sharded_mla(local, args, mesh, pool_scales=c_kv_scale is not None)


def contiguous_mla_decode_tpu(
    q_latent: Float[Array, "B T N C"],
    q_rope: Float[Array, "B T N R"],
    kv: Float[Array, "B S W"],
    lengths: Int[Array, "B"],
    *,
    scale: float,
    num_splits: int | None = None,
    block_rows: int | None = None,
    interpret=None,
    mesh=None,
    k_rope: Float[Array, "B S R"] | None = None,
    c_kv_scale: Float[Array, "B 1 S"] | None = None,
) -> Float[Array, "B T N C"]:
  """``jaxattn.ops.decode.cache_mla_decode`` as the dense kernel over a contiguous ``LatentCache``
  buffer ``kv [B, S, C + R]`` (``R`` = ``q_rope``'s width; on TPU a ``LatentCache`` pads ``k^R``
  to 128 columns, so its rows are ``512 + 128``).

  The buffer is read as pages of itself (``[B * S / page, page, C + R]``, a reshape that splits
  only ``S``; identity page table), each page's ``c_KV`` and ``k^R`` columns as two blocks of the
  same array -- in place, where the concatenation and the flash kernel's layout cost copies of
  the cache on every step.  That needs ``R`` a multiple of 128 and ``C`` a multiple of ``R`` (the
  blocks' lane tiling); other widths are sliced into two arrays first (copies).  Under a mesh:
  batch over ``"batch"``, query heads over ``"heads"``.  ``block_rows`` as in
  ``paged_mla_decode_tpu``.

  ``k_rope [B, S, R]`` given: ``kv [B, S, C]`` holds ``c_KV`` alone (a quantized ``LatentCache``:
  int8 / float8_e4m3fn codes with ``c_kv_scale [B, 1, S]`` fp32, one scale per token, read as
  ``[B * S / page, 1, page]``); each array is read as pages of itself, in place.
  """
  check_num_splits(num_splits)
  check_block_rows(block_rows)
  c, r = q_latent.shape[3], q_rope.shape[3]
  split = k_rope is not None
  page = latent_view_page_size(kv, k_rope, c_kv_scale)
  if page is None or kv.shape[2] != (c if split else c + r) or (split and k_rope.shape[2] != r):
    raise ValueError(f"`kv` {kv.shape} must be [B, S, C + R] = [B, S, {c} + {r}] (or [B, S, C] "
                     f"with `k_rope` [B, S, R]) with S a multiple of 16.")
  if c_kv_scale is not None and not split:
    raise ValueError("`c_kv_scale` (quantized codes in `kv`) needs the separate `k_rope`.")
  fused = c % r == 0 and r % 128 == 0
  cores = tensorcores()

  def local(ql, qr, kv, lens, *rest):
    pages, table = page_view(kv, page)
    if split:
      c_pool, kr_pool = pages, page_view(rest[0], page)[0]
    else:
      c_pool, kr_pool = (pages, None) if fused else (pages[..., :c], pages[..., c:])
    c_scale = (rest[1].reshape(table.size, 1, page) if len(rest) > 1 else None)
    return _dense_local(ql, qr, c_pool, kr_pool, table, lens, c_scale, scale=scale,
                        num_splits=num_splits, block_rows=block_rows, interpret=interpret,
                        cores=cores)

  args = [q_latent, q_rope, kv, lengths.astype(jnp.int32)]
  args += ([k_rope] if split else []) + ([c_kv_scale] if c_kv_scale is not None else [])

  def specs(mesh):
    bax, hax = sharded.latent_specs(mesh, q_latent.shape[0], q_latent.shape[2])
    q_spec = P(bax, None, hax, None)
    buf = P(bax, None, None)
    return (q_spec, q_spec, buf, P(bax)) + (buf,) * (len(args) - 4), q_spec

  return sharded.run_sharded(local, args, mesh, specs)
