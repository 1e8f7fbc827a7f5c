"""Running a flash-attention kernel under a device mesh.

A Pallas call cannot be auto-partitioned by XLA (Mosaic and Triton kernels are opaque custom
calls), so every call runs inside ``jax.shard_map``: batch is split over the mesh axes that the
``"batch"`` rule of ``jaxattn.sharding.DEFAULT_RULES`` names, heads over the ``"heads"`` axes.  Each
device then runs the kernel on its local ``[B/d, T, N/t, H]`` slice; no communication is needed
because attention is independent per batch row and per head.

Heads are split only when both the query heads ``N`` and the KV heads ``K`` divide by the head
axes (so each shard keeps whole GQA groups: local query head ``n`` still reads local KV head
``n // G``); otherwise heads stay whole and only batch is split.  Without a mesh (none passed and
none set by ``jax.set_mesh``) the kernel runs directly.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxattn import sharding as jsharding
from jaxattn.ops import masks as M
from pallas_kernels.flash_attention import common


def _context_mesh():
  try:
    mesh = jax.sharding.get_abstract_mesh()
  except AttributeError:  # pragma: no cover - older jax
    return None
  if mesh is None or mesh.empty:
    return None
  return mesh


def _free_axes(mesh) -> dict[str, int]:
  """Mesh axes we may split over: size > 1 and not already manual (inside another shard_map)."""
  manual = set(getattr(mesh, "manual_axes", ()) or ())
  return {a: s for a, s in dict(mesh.shape).items() if s > 1 and a not in manual}


def _spec_axes(logical: str, size: int, mesh, free: dict[str, int]):
  """Mesh axes for one logical dimension of ``size``, restricted to free axes; None if none."""
  entry = jsharding.logical_to_spec((logical,), mesh=mesh, shape=(size,))[0]
  axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
  axes = tuple(a for a in axes if a in free)
  if not axes or size % int(np.prod([free[a] for a in axes])):
    return None
  return axes[0] if len(axes) == 1 else axes


def plan_specs(mesh, batch: int, num_heads: int, num_kv_heads: int):
  """``(batch_axes, head_axes)`` used for a call with these sizes on ``mesh`` (None: not split)."""
  free = _free_axes(mesh)
  batch_axes = _spec_axes("batch", batch, mesh, free)
  heads = _spec_axes("heads", num_heads, mesh, free)
  kv_heads = _spec_axes("kv_heads", num_kv_heads, mesh, free)
  head_axes = heads if heads == kv_heads else None
  return batch_axes, head_axes


def latent_specs(mesh, batch: int, num_heads: int):
  """``(batch_axes, head_axes)`` for MLA-style calls, where every query head reads the same latent
  rows: the heads split over the ``"heads"`` axes alone (there are no KV heads to keep whole)."""
  free = _free_axes(mesh)
  return _spec_axes("batch", batch, mesh, free), _spec_axes("heads", num_heads, mesh, free)


def run_sharded(local: Callable, args, mesh, specs: Callable):
  """``local(*args)`` under ``shard_map`` over ``mesh`` (None: the context mesh set by
  ``jax.set_mesh``), or directly when there is no mesh or no free axis to split over.
  ``specs(mesh) -> (in_specs, out_specs)`` names the split of ``args`` and of the result."""
  use_context = mesh is None
  mesh = _context_mesh() if mesh is None else mesh
  if mesh is None or not _free_axes(mesh):
    return local(*args)
  in_specs, out_specs = specs(mesh)
  placed = [_place(x, sp, mesh) for x, sp in zip(args, in_specs)]
  # check_vma=False: pallas_call outputs carry no varying-mesh-axis annotations.
  f = jax.shard_map(local, mesh=None if use_context else mesh, in_specs=tuple(in_specs),
                    out_specs=out_specs, check_vma=False)
  return f(*placed)


def with_all_keys(x, kv_len: int):
  """A dense ``[B|1, N|1, T|1, S|1]`` input (bias, boolean mask array) with a column per key:
  one column for all keys is broadcast; size-1 batch, head and query dims stay size 1."""
  if x is None:
    return None
  x = jnp.asarray(x)
  return jnp.broadcast_to(x, (*x.shape[:3], kv_len))


def dense_spec(x, batch_axes, head_axes, row_axes=None):
  """The ``PartitionSpec`` of a dense ``[B|1, N|1, T|1, S]`` input: split like the queries'
  batch, heads and (``row_axes``) rows along the dims it has, size-1 dims replicated."""
  if x is None:
    return None
  return P(batch_axes if x.shape[0] > 1 else None, head_axes if x.shape[1] > 1 else None,
           row_axes if x.shape[2] > 1 else None, None)


def shard_attention(local: Callable, query, key, value, *, q_ids, kv_ids, kv_lengths,
                    alibi_slopes, q_offset, scale, mesh=None, residuals=None, bias=None,
                    mask_array=None):
  """Runs ``local(q, k, v, q_ids, kv_ids, kv_lengths, slopes, q_offset, scale, bias, mask_array,
  given) -> (out, lse)`` under ``shard_map`` over ``mesh`` (or the context mesh), or directly when
  there is none.

  Python scalars (``q_offset``, ``scale``) are closed over; arrays travel as ``shard_map``
  arguments, batch-indexed ones split with the batch, ``alibi_slopes`` with the heads, a dense
  ``bias [B|1, N|1, T, S]`` and a boolean ``mask_array`` of that shape with both where they have
  them (a size-1 dim is replicated; the bias' cotangent is then summed over the shards by
  ``shard_map``'s transpose).
  ``residuals``: a given ``(out, lse)`` (split as the results are), passed on as ``given``.
  """
  out, lse = (None, None) if residuals is None else residuals
  named = {"query": query, "key": key, "value": value, "q_ids": q_ids, "kv_ids": kv_ids,
           "kv_lengths": kv_lengths, "alibi_slopes": alibi_slopes, "q_offset": q_offset,
           "scale": scale, "bias": bias, "mask_array": mask_array, "out": out, "lse": lse}
  # NumPy arrays travel as arrays too: closed over, each shard saw the whole array (every head
  # shard but the first read other heads' ALiBi slopes).
  named = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in named.items()}
  names = [k for k, v in named.items() if isinstance(v, (jax.Array, jax.core.Tracer))]

  def body(*xs):
    got = {**named, **dict(zip(names, xs))}
    given = None if got["out"] is None else (got["out"], got["lse"])
    return local(*(got[k] for k in named if k not in ("out", "lse")), given)

  def specs(mesh):
    bax, hax = plan_specs(mesh, query.shape[0], query.shape[2], key.shape[2])
    table = {"query": P(bax, None, hax, None), "key": P(bax, None, hax, None),
             "value": P(bax, None, hax, None), "q_ids": P(bax, None), "kv_ids": P(bax, None),
             "kv_lengths": P(bax), "alibi_slopes": P(hax), "q_offset": P(), "scale": P(),
             "bias": dense_spec(bias, bax, hax), "mask_array": dense_spec(mask_array, bax, hax),
             "out": P(bax, None, hax, None), "lse": P(bax, hax, None)}
    return [table[k] for k in names], (P(bax, None, hax, None), P(bax, hax, None))

  return run_sharded(body, [named[k] for k in names], mesh, specs)


def run_flash(query, key, value, mask, *, scale, alibi_slopes, logits_soft_cap, q_offset,
              block_sizes, interpret, mesh, build, pow2_blocks=False, residuals=None, bias=None,
              mask_array=None, key_mask_ids=False):
  """The TPU and GPU entry points: validate, split the mask, shard, and run
  ``build(plan)(q, k, v, bias, aux, given)`` on each shard (``build`` maps a ``Plan`` to the
  backend's custom-VJP function; ``given``: ``residuals``, the forward's ``(out, lse)`` if given).
  A ``bias`` or boolean ``mask_array`` of key length 1 is broadcast here (the kernels stream
  blocks of key columns); size-1 batch, head and query dims stay size 1 (a ``[B, 1, 1, S]`` key
  padding mask is read as one row per key block, never as ``[B, 1, T, S]``; with
  ``key_mask_ids`` it becomes segment ids instead, ``masks.key_mask_as_segments``)."""
  static, segments, lengths = common.split_mask(mask)
  if isinstance(alibi_slopes, (list, tuple)):   # (passed the checks, then failed on .astype;
    alibi_slopes = jnp.asarray(alibi_slopes)     # shard_attention takes NumPy arrays as arrays)
  if scale is None:
    scale = 1.0 / float(query.shape[-1]) ** 0.5
  common.validate(query, key, value, q_offset=q_offset, scale=scale, alibi_slopes=alibi_slopes,
                  logits_soft_cap=logits_soft_cap, segment_ids=segments, kv_lengths=lengths,
                  bias=bias, mask_array=mask_array)
  if not isinstance(block_sizes, common.BlockSizes):
    raise ValueError(f"`block_sizes` must be a BlockSizes, got {type(block_sizes).__name__}.")
  static_offset = None if common.is_traced(q_offset) else int(q_offset)

  bias, mask_array = with_all_keys(bias, key.shape[1]), with_all_keys(mask_array, key.shape[1])
  if key_mask_ids and mask_array is not None and mask_array.shape[1:3] == (1, 1):
    segments = M.key_mask_as_segments(mask_array, segments, *query.shape[:2])
    mask_array = None

  def local(q, k, v, q_ids, kv_ids, lens, slopes, offset, scl, bias, mask_array, given):
    seg = None if q_ids is None else (q_ids, kv_ids)
    plan = common.make_plan(
        q, k, v, static_mask=static, q_offset=offset if static_offset is None else static_offset,
        logits_soft_cap=logits_soft_cap, alibi_slopes=slopes, segment_ids=seg, kv_lengths=lens,
        block_sizes=block_sizes, interpret=interpret, pow2_blocks=pow2_blocks, scale=scl,
        bias=bias, mask_array=mask_array)
    aux = {"q_ids": q_ids, "kv_ids": kv_ids, "kv_lengths": lens,
           "slopes": None if slopes is None else slopes.astype(jnp.float32),
           "q_offset": jnp.asarray(offset, jnp.int32), "scale": jnp.asarray(scl, jnp.float32),
           "mask_array": mask_array}
    return build(plan)(q, k, v, bias, aux, given)

  q_ids, kv_ids = (None, None) if segments is None else segments
  if residuals is not None:
    residuals = (residuals[0].astype(query.dtype), jnp.asarray(residuals[1], jnp.float32))
  return shard_attention(local, query, key, value, q_ids=q_ids, kv_ids=kv_ids, kv_lengths=lengths,
                         alibi_slopes=alibi_slopes, q_offset=q_offset, scale=scale, mesh=mesh,
                         residuals=residuals, bias=bias, mask_array=mask_array)


def _place(x, spec, mesh):
  """With Explicit mesh axes, ``shard_map`` refuses inputs whose sharding differs from its
  ``in_specs`` rather than resharding them, so reshard explicitly; Auto axes need nothing."""
  if jsharding.is_explicit(mesh):
    if isinstance(mesh, jax.sharding.Mesh):
      return jax.sharding.reshard(x, NamedSharding(mesh, spec))
    return jax.sharding.reshard(x, spec)
  return x


__all__ = ["dense_spec", "latent_specs", "shard_attention", "plan_specs", "run_flash",
           "run_sharded", "with_all_keys"]
