"""Absorbed MLA decode over a paged latent cache (TPU / Mosaic style): dense split-KV and sparse.

The query arrives in latent space (``q~ = q^C W_up^K^T [N, C]`` plus the rotated ``q^R [N, R]``);
every head attends to the same cached rows ``[c_KV, k^R]``, so one fetched page serves all ``N``
heads (MQA over latents) and the output stays in latent space for the module to up-project.

Dense mode, split-KV (flash-decoding), page table and lengths by scalar prefetch:

    grid (B, S, J)                 b: sequence; s: split-KV partition; j: page in the partition
    q blocks  [T*N, C], [T*N, R]   all heads (rows (t, n)) of sequence b
    kv blocks [page, C], [page, R] one pool page of c_KV and of k^R
    out block [T*N, C] fp32 + lse [T*N, 1]: the partition's partial, merged by ``combine``

    logits = scale * (q~ c^T + q^R k^R^T)      [T*N, page]   (fp32)
    acc   += softmax-weights @ c               [T*N, C]

Pages past a sequence's length do no compute and their DMA index is clamped to its last valid page
(no refetch), exactly as in ``pallas_kernels.decode_attention``.

Sparse mode (DeepSeek Sparse Attention): ``indices [B, T, k]`` selected positions, by scalar
prefetch with the page table; grid ``(B, T, k)`` fetches ONE row of ``c_KV`` and ``k^R`` per step
(row-granular DMA: correct and simple, but each step moves only ``(C + R) * bytes``; a production
kernel would batch several rows per step with manual async copies).  Invalid slots (``-1`` or past
the length) re-point at the previous valid row and skip compute.

Validated in interpret mode (race detection on) against ``jaxattn.ops.decode.paged_mla_decode_xla``;
not yet compiled on a TPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from pallas_kernels.decode_attention.tpu import (combine, default_interpret, finalize,
                                                 online_softmax_update, page_index)
from pallas_kernels.flash_attention import sharded
from pallas_kernels.flash_attention.common import reset_online_softmax

_F32 = jnp.float32


def _dot_t(a, b):
  """``a [R, X] @ b [S, X]^T`` in fp32."""
  return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=_F32)


# -- dense, split-KV ---------------------------------------------------------------------------

def _dense_kernel(lens_ref, table_ref, ql_ref, qr_ref, c_ref, kr_ref, o_ref, lse_ref, m_ref,
                  l_ref, acc_ref, *, scale, num_t, num_heads, pages_per_split):
  b, s, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  page_size = c_ref.shape[0]
  length = lens_ref[b]
  start = (s * pages_per_split + j) * page_size

  reset_online_softmax(j == 0, m_ref, l_ref, acc_ref)

  @pl.when(start < length)
  def compute():
    rows = ql_ref.shape[0]                                                  # T * N
    c = c_ref[...].astype(_F32)                                             # [page, C]
    # Rows past the length hold stale data: zero them so 0 * NaN cannot reach the accumulator.
    live = (start + jax.lax.broadcasted_iota(jnp.int32, (page_size, 1), 0)) < length
    c = jnp.where(live, c, 0.0)
    logits = (_dot_t(ql_ref[...].astype(_F32), c)
              + _dot_t(qr_ref[...].astype(_F32), kr_ref[...].astype(_F32))) * scale
    kv_pos = start + jax.lax.broadcasted_iota(jnp.int32, (rows, page_size), 1)
    q_pos = length - num_t + jax.lax.broadcasted_iota(jnp.int32, (rows, page_size), 0) // num_heads
    online_softmax_update(m_ref, l_ref, acc_ref, logits, (kv_pos < length) & (kv_pos <= q_pos), c)

  @pl.when(j == pages_per_split - 1)
  def store():
    out, lse = finalize(m_ref[...], l_ref[...], acc_ref[...])
    o_ref[...] = out
    lse_ref[...] = lse


@functools.partial(jax.jit, static_argnames=("scale", "num_splits", "interpret"))
def _dense_local(q_latent, q_rope, c_pool, kr_pool, page_table, lengths, *, scale, num_splits,
                 interpret):
  b, t, n, c = q_latent.shape
  r = q_rope.shape[3]
  page_size, m = c_pool.shape[1], page_table.shape[1]
  splits = min(num_splits, m)
  pps = -(-m // splits)
  rows = t * n
  ql = q_latent.reshape(b, rows, c)                                          # rows (t, n)
  qr = q_rope.reshape(b, rows, r)

  def kv_map(bi, si, ji, lens_ref, table_ref):
    return (page_index(lens_ref, table_ref, bi, si * pps + ji, max_pages=m, page_size=page_size),
            0, 0)

  q_map = lambda bi, si, ji, *_: (bi, 0, 0)  # noqa: E731
  o_map = lambda bi, si, ji, *_: (bi, si, 0, 0)  # noqa: E731
  kernel = functools.partial(_dense_kernel, scale=float(scale), num_t=t, num_heads=n,
                             pages_per_split=pps)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      grid=(b, splits, pps),
      in_specs=[pl.BlockSpec((None, rows, c), q_map),                # q~ [T*N, C]
                pl.BlockSpec((None, rows, r), q_map),                # q^R [T*N, R]
                pl.BlockSpec((None, page_size, c), kv_map),          # c_KV page
                pl.BlockSpec((None, page_size, r), kv_map)],         # k^R page
      out_specs=[pl.BlockSpec((None, None, rows, c), o_map),
                 pl.BlockSpec((None, None, rows, 1), o_map)],
      scratch_shapes=[pltpu.VMEM((rows, 1), _F32), pltpu.VMEM((rows, 1), _F32),
                      pltpu.VMEM((rows, c), _F32)])
  out, lse = pl.pallas_call(
      kernel, grid_spec=grid_spec,
      out_shape=[jax.ShapeDtypeStruct((b, splits, rows, c), _F32),
                 jax.ShapeDtypeStruct((b, splits, rows, 1), _F32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=default_interpret(interpret),
  )(lengths, page_table.reshape(-1), ql, qr, c_pool, kr_pool)
  return combine(out, lse).reshape(b, t, n, c).astype(q_latent.dtype)


# -- sparse (DSA): selected rows only ----------------------------------------------------------

def _sparse_kernel(lens_ref, table_ref, idx_ref, ql_ref, qr_ref, c_ref, kr_ref, o_ref, m_ref,
                   l_ref, acc_ref, *, scale, num_t, num_k):
  b, t, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)

  reset_online_softmax(j == 0, m_ref, l_ref, acc_ref)

  pos = idx_ref[(b * num_t + t) * num_k + j]

  @pl.when((pos >= 0) & (pos < lens_ref[b]))
  def compute():
    c = c_ref[...].astype(_F32)                                             # [1, C]
    logits = (_dot_t(ql_ref[...].astype(_F32), c)
              + _dot_t(qr_ref[...].astype(_F32), kr_ref[...].astype(_F32))) * scale  # [N, 1]
    online_softmax_update(m_ref, l_ref, acc_ref, logits, jnp.ones(logits.shape, bool), c)

  @pl.when(j == num_k - 1)
  def store():
    out, _ = finalize(m_ref[...], l_ref[...], acc_ref[...])
    o_ref[...] = out.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def _sparse_local(q_latent, q_rope, c_pool, kr_pool, page_table, lengths, indices, *, scale,
                  interpret):
  b, t, n, c = q_latent.shape
  r = q_rope.shape[3]
  page_size, m = c_pool.shape[1], page_table.shape[1]
  num_k = indices.shape[2]
  # The pools are viewed as [P, page, 1, C|R] (a free reshape) so that a one-row block keeps its
  # last two dims equal to the array's, as Mosaic requires of blocks not tiled by (8, 128).
  # Invalid slots point at the last valid slot before them (or position 0), so the pipeline keeps
  # the row it already holds instead of fetching a new one.
  valid = (indices >= 0) & (indices < lengths[:, None, None])
  slot = jnp.where(valid, jnp.arange(num_k)[None, None, :], -1)
  last_valid = jax.lax.cummax(slot, axis=2)
  fetch = jnp.where(last_valid >= 0,
                    jnp.take_along_axis(indices, jnp.maximum(last_valid, 0), axis=2), 0)
  safe_idx = jnp.where(valid, indices, -1)

  def row_map(bi, ti, ji, lens_ref, table_ref, idx_ref, fetch_ref):
    p = fetch_ref[(bi * t + ti) * num_k + ji]
    return (jnp.maximum(table_ref[bi * m + p // page_size], 0), p % page_size, 0, 0)

  q_map = lambda bi, ti, ji, *_: (bi, ti, 0, 0)  # noqa: E731
  kernel = functools.partial(_sparse_kernel, scale=float(scale), num_t=t, num_k=num_k)

  def body(lens_ref, table_ref, idx_ref, fetch_ref, *refs):
    del fetch_ref  # only the index maps read it
    kernel(lens_ref, table_ref, idx_ref, *refs)

  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=4,
      grid=(b, t, num_k),
      in_specs=[pl.BlockSpec((None, None, n, c), q_map),             # q~ [N, C]
                pl.BlockSpec((None, None, n, r), q_map),             # q^R [N, R]
                pl.BlockSpec((None, None, 1, c), row_map),           # one c_KV row [1, C]
                pl.BlockSpec((None, None, 1, r), row_map)],          # one k^R row [1, R]
      out_specs=pl.BlockSpec((None, None, n, c), q_map),
      scratch_shapes=[pltpu.VMEM((n, 1), _F32), pltpu.VMEM((n, 1), _F32),
                      pltpu.VMEM((n, c), _F32)])
  return pl.pallas_call(
      body, grid_spec=grid_spec,
      out_shape=jax.ShapeDtypeStruct((b, t, n, c), q_latent.dtype),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=default_interpret(interpret),
  )(lengths, page_table.reshape(-1), safe_idx.reshape(-1), fetch.reshape(-1).astype(jnp.int32),
    q_latent, q_rope, c_pool[:, :, None, :], kr_pool[:, :, None, :])


def run_sharded_mla(local, args, mesh):
  """``local(q_latent, q_rope, c_pool, kr_pool, page_table, lengths[, indices])`` under ``mesh``
  (None: the context mesh; no mesh or no free axis: called directly): batch over the ``"batch"``
  axes, query heads over ``"heads"``; every device keeps the whole latent pool.  Shared by the TPU
  and GPU MLA decode kernels."""
  b, _, n, _ = args[0].shape

  def specs(mesh):
    free = sharded._free_axes(mesh)
    bax = sharded._spec_axes("batch", b, mesh, free)
    hax = sharded._spec_axes("heads", n, mesh, free)
    q_spec = P(bax, None, hax, None)
    return (q_spec, q_spec, P(), P(), P(bax, None), P(bax), P(bax, None, None))[:len(args)], q_spec

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
    num_splits: int = 1,
    interpret=None,
    mesh=None,
) -> Float[Array, "B T N C"]:
  """``jaxattn.ops.decode.paged_mla_decode`` as Pallas kernels (arguments checked there).

  Under a mesh the call runs in ``jax.shard_map``: queries, page table, lengths (and indices) split
  over the ``"batch"`` mesh axes, query heads over the ``"heads"`` axes (all heads share the
  latent, so any split of the heads is valid); the latent pools stay whole on every device.
  """
  if num_splits < 1:
    raise ValueError(f"`num_splits` must be >= 1, got {num_splits!r}.")
  if indices is None:
    local = functools.partial(_dense_local, scale=scale, num_splits=num_splits,
                              interpret=interpret)
  else:
    local = functools.partial(_sparse_local, scale=scale, interpret=interpret)
  args = [q_latent, q_rope, c_kv_pool, k_rope_pool, page_table, lengths]
  if indices is not None:
    args.append(indices)
  return run_sharded_mla(local, args, mesh)
