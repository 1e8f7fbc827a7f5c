"""Top-K sparse attention (TPU / Mosaic style): gather only the selected rows, ``block_k`` per step.

One kernel serves DeepSeek Sparse Attention prefill (``sparse_attention_tpu``, GQA over a
contiguous cache), DSA on MLA (``sparse_mla_attention_tpu``, latent rows) and sparse MLA decode over
a paged latent pool (``pallas_kernels.mla_decode``): each of them turns its selected positions into
**row addresses** of a flat pool ``[rows, K * D]`` (``-1`` = no row) and calls ``gather_attention``.

    grid (2, M / 2)                one program per query token (all its heads): two halves of
                                   the tokens, "parallel" (one per TensorCore of a megacore
                                   chip), each walked in order ("arbitrary")
    q blocks   [N, D_p]            per key part p (e.g. latent and rotary parts), auto-pipelined
    addresses  [1, 1 + k_pad] SMEM the number of blocks to visit, then the row addresses; the
                                   next token's too (a second block of the same array)
    pools      [rows, 1, K * D_p]  left in HBM (``memory_space=pl.ANY``)
    buffers    [2, block_k, 1, K*D_p]  VMEM, double-buffered

    for each block j of block_k selected slots (only up to the last valid one):
      start the manual row DMAs of block j + 1 into the other buffer  (one async copy per row);
        at the last block, those of the next token's block 0 (its first block was started by
        the step before, so only a core's first token waits for its first rows)
      wait for block j's rows
      per KV head g:  s = scale * sum_p q_p[g] k_p[g]^T      [G, block_k] fp32 on the MXU
                      online softmax (m, l, acc in VMEM scratch); acc += p @ v[g]

Slots without a row (``-1``) start no DMA: their buffer rows are zero-filled instead (a stale or
never-written row may hold anything, and ``0 * NaN`` must not reach the accumulator) and their
logits are masked.  The value is either its own pool or one of the key parts (MLA: the first ``C``
entries of the latent row ``[c_KV, k^R]`` are the value, so the row is fetched once).

Mosaic allows a DMA slice of a tiled dimension only at whole tiles, so single rows move between
``[rows, 1, K * D]`` views of the pools and ``[2, block_k, 1, K * D]`` buffers (the row index on
an untiled dimension).  Compiled for TPU v5e / v6e by ``experiments/tpu_compile_check.py``; XLA
re-tiles each pool into that view on every call (a copy of the cache), which prefill amortizes
and decode does not -- ``jaxattn.ops.sparse`` and ``jaxattn.ops.decode`` take the XLA gather by
default for decode-sized calls on TPU.

What is left for a hardware run: there is no split-KV over the selected slots (decode with batch 1
and one new token runs on one core).  Validated in interpret mode (race detection on, two
simulated cores) against the gather references of ``jaxattn.ops.sparse`` and
``jaxattn.ops.decode``; not yet run on a TPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int

from pallas_kernels.decode_attention.tpu import dot_t, finalize, online_softmax_update
from pallas_kernels.flash_attention.common import default_interpret, reset_online_softmax
from pallas_kernels.sparse_attention import common

_F32 = jnp.float32
# The token axis is split in this many contiguous halves, a "parallel" grid axis (the two
# TensorCores of a megacore chip; one core runs both halves in turn).
_CORES = 2


def default_block_k(k: int) -> int:
  """Selected rows gathered per step: all of them up to 128, in multiples of 8 (sublanes)."""
  return min(128, -(-k // 8) * 8)


def _kernel(meta_ref, next_meta_ref, rows_ref, *refs, dims, value_part, value_width, kv_heads,
            groups, block_k, scale):
  n_parts = len(dims)
  q_refs, refs = refs[:n_parts], refs[n_parts:]
  pool_refs, refs = refs[:n_parts], refs[n_parts:]
  vpool_ref, refs = (refs[0], refs[1:]) if value_part is None else (None, refs)
  o_ref, refs = refs[0], refs[1:]
  bufs, refs = refs[:n_parts], refs[n_parts:]
  vbuf, refs = (refs[0], refs[1:]) if value_part is None else (None, refs)
  sem, first_slot, m_ref, l_ref, acc_ref = refs
  copies = list(zip(pool_refs, bufs))             # (HBM pool, VMEM buffer) pairs a row fills
  if value_part is None:
    copies.append((vpool_ref, vbuf))
  i, steps = pl.program_id(1), pl.num_programs(1)

  def each_row(meta, blk, slot, fetched, missing=None):
    """``fetched(copy)`` for every row DMA of block ``blk`` of the token whose addresses are
    ``meta`` (into ``slot``) that has an address; ``missing(r)`` for the slots without one."""
    def one(r, carry):
      addr = meta[0, 1 + blk * block_k + r]

      @pl.when(addr >= 0)
      def _():
        for src, buf in copies:
          fetched(pltpu.make_async_copy(src.at[addr], buf.at[slot, r], sem.at[slot]))

      if missing is not None:
        pl.when(addr < 0)(lambda: missing(r))
      return carry

    lax.fori_loop(0, block_k, one, 0)

  def zero_row(slot):
    def fill(r):
      for _, buf in copies:
        buf[slot, r] = jnp.zeros((1, buf.shape[-1]), buf.dtype)
    return fill

  def start(meta, blk, slot):
    each_row(meta, blk, slot, lambda copy: copy.start(), zero_row(slot))

  def wait(blk, slot):
    each_row(meta_ref, blk, slot, lambda copy: copy.wait())

  def compute(blk, slot):
    first = pl.multiple_of(blk * block_k, block_k)
    valid = rows_ref[:, pl.ds(first, block_k)] >= 0                     # [1, bk]
    for g in range(kv_heads):
      rs = pl.ds(g * groups, groups)
      logits = None
      for p, d in enumerate(dims):
        part = dot_t(q_refs[p][rs, :], bufs[p][slot, :, 0, pl.ds(g * d, d)])   # [G, bk]
        logits = part if logits is None else logits + part
      src = vbuf if value_part is None else bufs[value_part]
      v = src[slot, :, 0, pl.ds(g * value_width, value_width)]              # [bk, h]
      online_softmax_update(m_ref.at[rs], l_ref.at[rs], acc_ref.at[rs], logits * scale, valid, v)

  reset_online_softmax(True, m_ref, l_ref, acc_ref)
  num_blocks = meta_ref[0, 0]
  # The next token's first block is fetched while this token's last block is multiplied (it is
  # the next grid step on this core: axis 1 runs in order).  Its slot is the one this token's
  # last block does not use; a token's first block was fetched by the step before, except on a
  # core's first step.
  has_next = (i + 1 < steps) & (next_meta_ref[0, 0] > 0)

  @pl.when(i == 0)
  def _():
    first_slot[0] = 0

    @pl.when(num_blocks > 0)
    def _():
      start(meta_ref, 0, 0)

  base = first_slot[0]

  def body(blk, carry):
    slot = lax.rem(base + blk.astype(jnp.int32), jnp.int32(2))   # int32 under jax_enable_x64 too

    @pl.when(blk + 1 < num_blocks)
    def _():
      start(meta_ref, blk + 1, 1 - slot)

    @pl.when((blk + 1 == num_blocks) & has_next)
    def _():
      start(next_meta_ref, 0, 1 - slot)
      first_slot[0] = 1 - slot

    wait(blk, slot)
    compute(blk, slot)
    return carry

  lax.fori_loop(0, num_blocks, body, 0)

  @pl.when((num_blocks == 0) & has_next)
  def _():
    start(next_meta_ref, 0, 0)
    first_slot[0] = 0

  out, _ = finalize(m_ref[...], l_ref[...], acc_ref[...])
  o_ref[...] = out.astype(o_ref.dtype)


def gather_attention(
    q_parts: tuple[Float[Array, "M N D"], ...],
    pools: tuple[Float[Array, "rows W"], ...],
    rows: Int[Array, "M k"],
    *,
    kv_heads: int,
    scale: float,
    value_pool: Float[Array, "rows V"] | None = None,
    value_part: int | None = None,
    block_k: int | None = None,
    interpret=None,
) -> Float[Array, "M N h"]:
  """Attention of each query token over the pool rows named by its addresses.

  ``q_parts[p] [M, N, D_p]`` and ``pools[p] [rows, K * D_p]``: the logit of head ``n`` (KV head
  ``g = n // (N / K)``) against row ``a`` is ``scale * sum_p q_p[n] . pools[p][a, g*D_p:(g+1)*D_p]``.
  The value is ``value_pool [rows, K * h]``, or, with ``value_part=p``, the key part ``p`` itself.
  ``rows [M, k]``: row addresses in ``[0, rows)`` or ``-1`` (none; a token with none gets zeros).
  Returns ``[M, N, h]`` in the queries' dtype.  ``interpret``: None (compile on TPU, else
  interpret), True/False, or a ``pltpu.InterpretParams``.
  """
  if (value_pool is None) == (value_part is None):
    raise ValueError("pass exactly one of `value_pool` and `value_part`.")
  m, n = q_parts[0].shape[:2]
  if n % kv_heads:
    raise ValueError(f"query heads N={n} must be a multiple of key heads K={kv_heads}.")
  dims = tuple(q.shape[2] for q in q_parts)
  for q, pool, d in zip(q_parts, pools, dims):
    if q.shape[:2] != (m, n) or pool.shape[1] != kv_heads * d or pool.shape[0] != pools[0].shape[0]:
      raise ValueError(f"query part {q.shape} and pool {pool.shape} must be [M={m}, N={n}, D] "
                       f"and [rows, K * D] with K={kv_heads}.")
  if value_part is not None:
    value_width = dims[value_part]
  else:
    if value_pool.shape[0] != pools[0].shape[0] or value_pool.shape[1] % kv_heads:
      raise ValueError(f"`value_pool` {value_pool.shape} must be [rows, K * h] with K={kv_heads}.")
    value_width = value_pool.shape[1] // kv_heads
  k = rows.shape[1]
  block_k = default_block_k(k) if block_k is None else block_k
  if block_k < 1 or block_k % 8:
    raise ValueError(f"`block_k` must be a positive multiple of 8, got {block_k!r}.")
  rows, num_blocks = common.pad_rows(rows, block_k)
  k_pad = rows.shape[1]
  # Two halves of the tokens, one per TensorCore on megacore chips ("parallel"); each runs its
  # tokens in order ("arbitrary") so that a step can prefetch the next token's first block.
  half = -(-m // _CORES)
  pad = _CORES * half - m
  if pad:
    rows = jnp.pad(rows, ((0, pad), (0, 0)), constant_values=-1)
    num_blocks = jnp.pad(num_blocks, (0, pad))
    q_parts = tuple(jnp.pad(q, ((0, pad), (0, 0), (0, 0))) for q in q_parts)
  meta = jnp.concatenate([num_blocks[:, None], rows], axis=1)              # [M', 1 + k_pad]

  kernel = functools.partial(_kernel, dims=dims, value_part=value_part, value_width=value_width,
                             kv_heads=kv_heads, groups=n // kv_heads, block_k=block_k,
                             scale=float(scale))
  all_pools = list(pools) + ([] if value_pool is None else [value_pool])
  token = lambda c, i: (c * half + i, 0, 0)                                 # noqa: E731
  next_token = lambda c, i: (c * half + jnp.minimum(i + 1, half - 1), 0, 0)  # noqa: E731
  in_specs = (
      [pl.BlockSpec((None, 1, 1 + k_pad), token, memory_space=pltpu.SMEM),
       pl.BlockSpec((None, 1, 1 + k_pad), next_token, memory_space=pltpu.SMEM),
       pl.BlockSpec((None, 1, k_pad), token)]
      + [pl.BlockSpec((None, n, d), token) for d in dims]
      + [pl.BlockSpec(memory_space=pl.ANY) for _ in all_pools])
  scratch = ([pltpu.VMEM((2, block_k, 1, p.shape[1]), p.dtype) for p in all_pools]
             + [pltpu.SemaphoreType.DMA((2,)), pltpu.SMEM((1,), jnp.int32),
                pltpu.VMEM((n, 1), _F32), pltpu.VMEM((n, 1), _F32),
                pltpu.VMEM((n, value_width), _F32)])
  out = pl.pallas_call(
      kernel,
      grid=(_CORES, half),
      in_specs=in_specs,
      out_specs=pl.BlockSpec((None, n, value_width), token),
      out_shape=jax.ShapeDtypeStruct((m + pad, n, value_width), q_parts[0].dtype),
      scratch_shapes=scratch,
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
      interpret=default_interpret(interpret), name="jaxattn_sparse_attention_tpu",
  )(meta[:, None, :], meta[:, None, :], rows[:, None, :], *q_parts,
    *(p[:, None, :] for p in all_pools))
  return out[:m] if pad else out


def sparse_attention_tpu(
    query: Float[Array, "B T N H"],
    key: Float[Array, "B S K H"],
    value: Float[Array, "B S K h"],
    indices: Int[Array, "B T k"],
    *,
    scale: float | None = None,
    block_k: int | None = None,
    interpret=None,
    mesh=None,
) -> Float[Array, "B T N h"]:
  """``jaxattn.ops.sparse.sparse_attention`` as a Pallas kernel reading only the selected rows.

  Positions outside ``[0, S)`` count as ``-1`` (unused).  ``block_k``: selected rows gathered per
  step (a multiple of 8; default ``default_block_k(k)``).  ``interpret`` as ``gather_attention``.
  ``mesh`` (None: the one set by ``jax.set_mesh``, if any): run in ``jax.shard_map`` with batch
  and heads split (``common.run_gqa_sharded``).
  """
  scale = common.check_gqa(query, key, value, indices, scale)

  def local(query, key, value, indices):
    b, t, n, h = query.shape
    s, kh, hv = key.shape[1], key.shape[2], value.shape[3]
    out = gather_attention((query.reshape(b * t, n, h),), (key.reshape(b * s, kh * h),),
                           common.flat_rows(indices, s), kv_heads=kh, scale=scale,
                           value_pool=value.reshape(b * s, kh * hv), block_k=block_k,
                           interpret=interpret)
    return out.reshape(b, t, n, hv)

  return common.run_gqa_sharded(local, query, key, value, indices, mesh)


def sparse_mla_latent_tpu(
    q_latent: Float[Array, "B T N C"],
    q_rope: Float[Array, "B T N R"],
    c_kv: Float[Array, "B S C"],
    k_rope: Float[Array, "B S R"],
    indices: Int[Array, "B T k"],
    *,
    scale: float,
    block_k: int | None = None,
    interpret=None,
    mesh=None,
) -> Float[Array, "B T N C"]:
  """The latent-space core of DSA on MLA: every head of a token attends to the selected rows of
  the shared key ``[c_KV, k^R]`` (gathered from the two arrays, no concatenated copy), and the
  gathered ``c_KV`` rows are the value.  Output ``[B, T, N, C]`` in the queries' dtype.  ``mesh``
  as ``sparse_attention_tpu`` (``common.run_latent_sharded``)."""
  common.check_latent(q_latent, q_rope, c_kv, k_rope, indices)

  def local(q_latent, q_rope, c_kv, k_rope, indices):
    b, t, n, c = q_latent.shape
    s, r = c_kv.shape[1], k_rope.shape[2]
    out = gather_attention(
        (q_latent.reshape(b * t, n, c), q_rope.astype(q_latent.dtype).reshape(b * t, n, r)),
        (c_kv.reshape(b * s, c), k_rope.astype(c_kv.dtype).reshape(b * s, r)),
        common.flat_rows(indices, s), kv_heads=1, scale=float(scale), value_part=0, block_k=block_k,
        interpret=interpret)
    return out.reshape(b, t, n, c)

  return common.run_latent_sharded(local, q_latent, q_rope, c_kv, k_rope, indices, mesh)


def sparse_mla_attention_tpu(
    q_nope: Float[Array, "B T N P"],
    q_rope: Float[Array, "B T N R"],
    c_kv: Float[Array, "B S C"],
    k_rope: Float[Array, "B S R"],
    w_uk: Float[Array, "C N P"],
    w_uv: Float[Array, "C N h"],
    indices: Int[Array, "B T k"],
    *,
    scale: float | None = None,
    block_k: int | None = None,
    interpret=None,
    mesh=None,
) -> Float[Array, "B T N h"]:
  """DSA over the MLA latent cache, absorbed form, as ``jaxattn.ops.sparse.sparse_mla_attention``:
  queries mapped into latent space, ``sparse_mla_latent_tpu``, then ``W_up^V``."""
  return common.absorbed(
      lambda ql, qr, c, kr, i, sc: sparse_mla_latent_tpu(ql, qr, c, kr, i, scale=sc,
                                                         block_k=block_k, interpret=interpret,
                                                         mesh=mesh),
      q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, indices, scale)
