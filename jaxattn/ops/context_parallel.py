"""Context parallelism: sequence mixers over a sequence split across the devices of a mesh axis.

Long sequences are split over the mesh axis ``context`` (the ``"length"`` rule of
``jaxattn.sharding.DEFAULT_RULES``): device ``c`` of ``C`` holds rows ``[c t, (c + 1) t)`` of the
queries, keys and values, ``t = T / C``.  Most of a transformer is per token; the layers that mix
the sequence communicate: self-attention (here) and Gated DeltaNet's rule (``delta_rule``: each
device runs its chunk, and only the chunks' state transitions are exchanged).  Two strategies for
attention:

* ``"all_gather"`` (the default; Llama 3's and MaxText's): each device gathers the whole sequence's
  keys and values (``all_gather`` over ``context``; its transpose, a reduce-scatter, brings the
  key/value gradients back) and attends with its own queries.  Under a causal mask the last
  device would see ``C`` times the keys of the first, so by default (``load_balance``) device
  ``c`` swaps the second half of its queries with device ``C - 1 - c`` (one ``ppermute`` each way,
  and back for the outputs): every device then holds one early and one late half-chunk and
  attends to the same number of keys, ``(2 C + 1) t / 2``.  Each device reads only the key range
  its queries' band can see.  Memory per device: the whole sequence's keys and values.
* ``"ring"``: keys and values travel around the ring of devices, one chunk per step (``C`` steps,
  each ``ppermute`` issued before the step's attention so they overlap); each device keeps its
  queries' running output and log-sum-exp and merges every chunk's in fp32.  Key/value memory per
  device stays ``t`` rows (plus fp32 accumulators for the output and, backward, the gradients).
  The backward pass is a second ring: each chunk's gradient accumulators follow it one step
  behind its keys and values, and every block's attention is differentiated with the final
  output and log-sum-exp (``attention_gradients``: the backend's backward pass alone, run from
  the rows' whole output and log-sum-exp; no block forward is recomputed).  Blocks a
  band mask empties are skipped (``lax.switch`` on the chunk distance, one static program per
  distance).  Under a causal mask (``load_balance``) the ring runs in the zigzag layout: devices
  ``c`` and ``C-1-c`` swap the second halves of their queries, keys and values, so every ring
  chunk holds an early and a late half-chunk and every device computes the same ``2 h^2``
  query-key pairs at every step (``_ring_plan``), where the contiguous ring's steps each wait for
  a device computing a whole block.  Under a causal sliding window shorter than the sequence
  the ring stops after the ``1 + ceil(window / t)`` steps that bring visible keys (the gradient
  accumulators then take one ``ppermute`` home).

Both call ``dot_product_attention`` on each device's blocks with a static ``q_offset`` (one
``lax.switch`` branch per device position or chunk distance), so any backend with block skipping
(the native CPU kernel, the Pallas kernels) takes them.  ``dot_product_attention`` routes here by
itself when the mesh set by ``jax.set_mesh`` has a ``context`` axis of size > 1 and the call is
self-attention that context parallelism computes (``unsupported`` says why not): causal / window /
global-token masks, segment ids, lengths, ALiBi, soft-cap, a dense bias and a dense boolean mask
array (split with the query rows; each block reads the columns of its keys, and the bias'
gradient stays on the device of its rows), residuals.
``set_options`` picks the strategy for those calls.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from jaxattn.ops import masks as M

AXIS = "context"
Strategy = Literal["all_gather", "ring"]
STRATEGIES = ("all_gather", "ring")
_OPTIONS: dict[str, Any] = {"strategy": "all_gather", "load_balance": None}


def set_options(*, strategy: Strategy | None = None, load_balance: bool | None = None):
  """Sets the strategy (and causal load balancing; None: where it applies, as in
  ``context_parallel_attention``) that ``dot_product_attention`` uses under a ``context`` mesh
  axis.  Returns the previous
  options; usable as a context manager: ``with set_options(strategy="ring"): ...``."""
  if strategy is not None and strategy not in STRATEGIES:
    raise ValueError(f"`strategy` must be one of {STRATEGIES}, got {strategy!r}.")
  if load_balance is not None and not isinstance(load_balance, bool):
    raise ValueError(f"`load_balance` must be a bool or None, got {load_balance!r}.")
  previous = dict(_OPTIONS)
  if strategy is not None:
    _OPTIONS["strategy"] = strategy
  _OPTIONS["load_balance"] = load_balance
  return _Restore(previous)


class _Restore(contextlib.AbstractContextManager):
  def __init__(self, previous):
    self.previous = previous

  def __exit__(self, *exc):
    _OPTIONS.update(self.previous)
    return False

  def __getitem__(self, name):
    return self.previous[name]


def get_options() -> dict:
  return dict(_OPTIONS)


def mesh_axis_size(mesh=None) -> int:
  """Size of the ``context`` axis of ``mesh`` (default: the one ``jax.set_mesh`` set) when it is
  > 1 and not already manual (inside a ``shard_map``); else 1."""
  if mesh is None:
    try:
      mesh = jax.sharding.get_abstract_mesh()
    except AttributeError:  # pragma: no cover - older jax
      return 1
  if mesh is None or getattr(mesh, "empty", False):
    return 1
  if AXIS in set(getattr(mesh, "manual_axes", ()) or ()):
    return 1
  return int(dict(mesh.shape).get(AXIS, 1))


def unsupported(query, key, *, bias, mask_array, q_offset, scale, size: int, strategy: str,
                mask: M.Mask | None = None) -> str | None:
  """Why a call is not one context parallelism computes over ``size`` devices (None: it is)."""
  from pallas_kernels.flash_attention import common as C
  from jaxattn.ops.attention import UnsupportedError
  t, s = query.shape[1], key.shape[1]
  if t != s:
    return f"it is not self-attention (T={t}, S={s})"
  if t % size:
    return f"T={t} is not a multiple of the context axis size {size}"
  if isinstance(q_offset, jax.core.Tracer) or int(np.asarray(q_offset)) != 0:
    return "q_offset is not 0"
  try:
    static = C.split_mask(mask)[0]
  except UnsupportedError as e:
    return f"the mask: {e}"
  if strategy == "ring":
    if isinstance(scale, jax.core.Tracer):
      return "the ring strategy needs a static `scale`"
    if static is not None and M._band(static) is None:
      return (f"the ring strategy takes band masks (causal, sliding window), not "
              f"{type(static).__name__} (use strategy='all_gather')")
  return None


def context_parallel_attention(
    query: Float[Array, "B T N H"],
    key: Float[Array, "B T K H"],
    value: Float[Array, "B T K h"],
    bias: Float[Array, "#B #N #T T"] | None = None,
    mask: M.Mask | Bool[Array, "#B #N #T T"] | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    local_window_size=None,
    segment_ids: Int[Array, "B T"] | None = None,
    kv_lengths: Int[Array, "B"] | None = None,
    alibi_slopes: Float[Array, "N"] | None = None,
    logits_soft_cap: float | None = None,
    return_residuals: bool = False,
    strategy: Strategy = "all_gather",
    load_balance: bool | None = None,
    mesh=None,
    implementation=None,
):
  """Self-attention with the sequence split over the mesh axis ``context``.

  Arguments as ``dot_product_attention`` (self-attention: ``T == S``, ``q_offset`` 0; ``mask`` a
  ``Mask`` object or a boolean array, split with the query rows like ``bias``).  ``strategy``:
  ``"all_gather"`` or ``"ring"`` (module docstring).  ``load_balance``: swap half-chunks between
  devices ``c`` and ``C-1-c`` so a causal mask gives every device the same work (queries for
  ``"all_gather"``; queries, keys and values for the ring, whose ALiBi is then refused); None:
  when the mask is causal (and, for the ring, there is no ALiBi) and ``T / C`` is even.
  ``mesh``: a ``Mesh`` with a ``context`` axis (default: the one set by ``jax.set_mesh``).
  ``implementation``: the backend each device's blocks use.  Returns what
  ``dot_product_attention`` returns, with the output split like the query.
  """
  from jaxattn.ops.attention import _backend_kwargs
  if strategy not in STRATEGIES:
    raise ValueError(f"`strategy` must be one of {STRATEGIES}, got {strategy!r}.")
  kw = _backend_kwargs(query, key, value, bias, mask, scale=scale, is_causal=is_causal,
                       local_window_size=local_window_size, segment_ids=segment_ids,
                       kv_lengths=kv_lengths, alibi_slopes=alibi_slopes,
                       logits_soft_cap=logits_soft_cap, return_residuals=return_residuals)
  size = mesh_axis_size(mesh)
  if size <= 1:
    raise ValueError(f"`mesh` must have a `{AXIS}` axis of size > 1 (got "
                     f"{None if mesh is None else dict(mesh.shape)}; none set by jax.set_mesh).")
  why = unsupported(query, key, bias=kw["bias"], mask_array=kw["mask_array"],
                    q_offset=kw["q_offset"], scale=kw["scale"], size=size, strategy=strategy,
                    mask=kw["mask"])
  if why is not None:
    raise ValueError(f"context_parallel_attention cannot compute this call: {why}.")
  return attention(query, key, value, kw, size=size, strategy=strategy,
                   load_balance=load_balance, mesh=mesh, implementation=implementation,
                   strict=True)


def attention(query, key, value, kw: dict, *, size: int, strategy: str, load_balance, mesh,
              implementation, strict: bool = False):
  """The context-parallel call on ``dot_product_attention``'s normalized arguments ``kw`` (a call
  ``unsupported`` accepts).  ``strict``: a ``load_balance=True`` that cannot apply raises (else,
  from the dispatcher's options, it applies where it can)."""
  from pallas_kernels.flash_attention import common as C
  from pallas_kernels.flash_attention.sharded import (dense_spec, plan_specs, run_sharded,
                                                      with_all_keys)
  static, segments, lengths = C.split_mask(kw["mask"])
  band = None if static is None else M._band(static)
  t = query.shape[1] // size
  causal = band is not None and band == (math.inf, 0.0)
  # the ring's zigzag layout assumes a plain causal mask (no ALiBi: offsets are not tracked)
  balanceable = causal and t % 2 == 0 and (strategy == "all_gather"
                                           or kw["alibi_slopes"] is None)
  if load_balance is None or (load_balance and not strict):
    load_balance = balanceable
  if load_balance and not balanceable:
    raise ValueError(f"`load_balance` needs a causal mask (without ALiBi, for the ring) and an "
                     f"even number of rows per device, got strategy={strategy!r}, mask "
                     f"{static!r}, T / C = {t}.")
  # dense inputs with every key column: the blocks slice their keys' columns
  bias, allowed = (with_all_keys(kw[n], key.shape[1]) for n in ("bias", "mask_array"))
  q_ids, kv_ids = (None, None) if segments is None else segments
  scale = kw["scale"]
  named = {"query": query, "key": key, "value": value, "q_ids": q_ids, "kv_ids": kv_ids,
           "lengths": lengths, "slopes": kw["alibi_slopes"], "bias": bias, "allowed": allowed,
           "scale": scale if isinstance(scale, jax.core.Tracer) else None}
  named = {k: (jnp.asarray(v) if isinstance(v, np.ndarray) else v) for k, v in named.items()}
  names = [k for k, v in named.items() if v is not None]
  cfg = _Config(size=size, t=t, static=static, band=band, load_balance=bool(load_balance),
                static_scale=None if isinstance(scale, jax.core.Tracer) else float(scale),
                cap=kw["logits_soft_cap"], implementation=_hashable(implementation),
                # without a position mask or ALiBi a block's result does not depend on where
                # its rows sit: one program serves every device position / chunk distance
                position_free=static is None and kw["alibi_slopes"] is None,
                steps=_ring_steps(size, t, band, bool(load_balance)))

  def body(*xs):
    got = dict(zip(names, xs))
    args = [got.get(k) for k in named]
    if strategy == "all_gather":
      return _all_gather_local(cfg, *args)
    return _ring_local(cfg, *args)

  def specs(mesh):
    bax, hax = plan_specs(mesh, query.shape[0], query.shape[2], key.shape[2])
    table = {"query": P(bax, AXIS, hax, None), "key": P(bax, AXIS, hax, None),
             "value": P(bax, AXIS, hax, None), "q_ids": P(bax, AXIS), "kv_ids": P(bax, AXIS),
             "lengths": P(bax), "slopes": P(hax), "scale": P()}
    for name, x in (("bias", bias), ("allowed", allowed)):  # split with the query rows
      if x is not None:
        table[name] = dense_spec(x, bax, hax, AXIS)
    return [table[k] for k in names], (P(bax, AXIS, hax, None), P(bax, hax, AXIS))

  out, lse = run_sharded(body, [named[k] for k in names], mesh, specs)
  return (out, lse) if kw["return_residuals"] else out


def _hashable(implementation):
  return tuple(implementation) if isinstance(implementation, list) else implementation


class _Config:
  """The static settings of one call (hashable: the ring's custom VJP is built once per value)."""

  def __init__(self, **kw):
    self.__dict__.update(kw)
    self._key = tuple(sorted(kw.items(), key=lambda kv: kv[0]))

  def __hash__(self):
    return hash(self._key)

  def __eq__(self, other):
    return isinstance(other, _Config) and self._key == other._key


# ----------------------------------------------------------------------------------------------
# One block: this device's queries against a range of keys, at a static relative offset
# ----------------------------------------------------------------------------------------------


def _block(cfg, q, k, v, q_ids, kv_ids, lengths, slopes, bias, scale, *, q_offset: int,
           allowed=None):
  """``(out, lse)`` of queries at positions ``q_offset + arange(rows)`` (in the coordinates of
  this block's keys, ``arange(S_block)``); ``bias`` / ``allowed`` (a boolean mask array): this
  block's rows and columns of them."""
  from jaxattn.ops.attention import dot_product_attention
  mask = _block_mask(cfg, q_ids, kv_ids, lengths, allowed, q.shape[1], k.shape[1], q_offset,
                     q.shape[0])
  return dot_product_attention(
      q, k, v, bias, mask, scale=cfg.static_scale if scale is None else scale,
      q_offset=q_offset, alibi_slopes=slopes, logits_soft_cap=cfg.cap, return_residuals=True,
      implementation=cfg.implementation)


def _block_mask(cfg, q_ids, kv_ids, lengths, allowed=None, rows=0, cols=0, q_offset=0,
                batch=1):
  """The block's ``Mask``; with a mask array ``allowed``, that array and'ed with the Mask's dense
  view (a call takes one or the other: the kernels then skip blocks by the array's contents),
  except a key-padding mask ``[B|1, 1, 1, S_block]``, which joins the segment ids instead
  (``masks.key_mask_as_segments``: no dense view)."""
  if allowed is not None and allowed.shape[1:3] == (1, 1):
    q_ids, kv_ids = M.key_mask_as_segments(allowed, None if q_ids is None else (q_ids, kv_ids),
                                           batch, rows)
    allowed = None
  parts = [] if cfg.static is None else [cfg.static]
  if q_ids is not None:
    parts.append(M.SegmentMask(q_ids, kv_ids))
  if lengths is not None:
    parts.append(M.PaddingMask(lengths))
  mask = functools.reduce(lambda a, b: a & b, parts) if parts else None
  if allowed is None or mask is None:
    return mask if allowed is None else allowed
  dense = jnp.asarray(mask.dense(rows, cols, q_offset))  # [T, S] or [B, T, S]
  return allowed & (dense[:, None] if dense.ndim == 3 else dense[None, None])


def _block_grads(cfg, q, k, v, q_ids, kv_ids, lengths, slopes, scale, out, lse, d_out, d_lse, *,
                 q_offset: int, bias=None, allowed=None):
  """``(dq, dk, dv, d_slopes, d_bias)`` of ``_block``'s queries against these keys, given the
  rows' whole ``(out, lse)`` and their cotangents (``attention_gradients``: the backend's
  backward pass alone, no forward)."""
  from jaxattn.ops.attention import attention_gradients
  mask = _block_mask(cfg, q_ids, kv_ids, lengths, allowed, q.shape[1], k.shape[1], q_offset,
                     q.shape[0])
  dq, dk, dv, d_bias, d_slopes = attention_gradients(
      q, k, v, out, lse, d_out, d_lse, bias, mask,
      scale=cfg.static_scale if scale is None else scale, q_offset=q_offset, alibi_slopes=slopes,
      logits_soft_cap=cfg.cap, implementation=cfg.implementation)
  return dq, dk, dv, d_slopes, d_bias


def _key_range(cfg, q_start: int, rows: int, total: int) -> tuple[int, int]:
  """The keys ``[lo, hi)`` that rows ``[q_start, q_start + rows)`` can see under the band."""
  if cfg.band is None:
    return 0, total
  left, right = cfg.band
  lo = 0 if math.isinf(left) else max(0, q_start - int(left))
  hi = total if math.isinf(right) else min(total, q_start + rows + int(right))
  return lo, max(lo, hi)


def _empty(q, v):
  from jaxattn.ops.attention import no_visible_keys
  return no_visible_keys(q, v)


def _rows(q_start: int, rows: int, cfg, q, k, v, q_ids, kv_ids, lengths, slopes, bias, allowed,
          scale):
  """Queries at global rows ``[q_start, q_start + rows)`` against the gathered keys (static)."""
  lo, hi = _key_range(cfg, q_start, rows, k.shape[1])
  if hi == lo:
    return _empty(q, v)
  sl = lambda x, ax: None if x is None else lax.slice_in_dim(x, lo, hi, axis=ax)  # noqa: E731
  return _block(cfg, q, sl(k, 1), sl(v, 1), q_ids, sl(kv_ids, 1),
                None if lengths is None else lengths - lo, slopes, sl(bias, 3), scale,
                q_offset=q_start - lo, allowed=sl(allowed, 3))


def _swap_halves(cfg, x, axis: int = 1):
  """Devices ``c`` and ``C-1-c`` exchange the second halves of their chunks of ``x`` along
  ``axis``: device ``c`` then holds half-chunks ``2c`` and ``2C-1-2c`` (the load-balanced
  layouts).  The pairing is its own inverse, so the same call puts results back."""
  if x is None:
    return None
  h, t = cfg.t // 2, cfg.t
  pairs = [(i, cfg.size - 1 - i) for i in range(cfg.size)]
  own, other = lax.slice_in_dim(x, 0, h, axis=axis), lax.slice_in_dim(x, h, t, axis=axis)
  return jnp.concatenate([own, lax.ppermute(other, AXIS, pairs)], axis=axis)


# ----------------------------------------------------------------------------------------------
# all_gather
# ----------------------------------------------------------------------------------------------


def _all_gather_local(cfg, q, k, v, q_ids, kv_ids, lengths, slopes, bias, allowed, scale):
  size, t = cfg.size, cfg.t
  c = lax.axis_index(AXIS)
  gather = lambda x: lax.all_gather(x, AXIS, axis=1, tiled=True)  # noqa: E731
  k, v = gather(k), gather(v)
  kv_ids = None if kv_ids is None else gather(kv_ids)

  if not cfg.load_balance:
    def branch(i):
      return lambda *a: _rows(i * t, t, cfg, *a)
    args = (q, k, v, q_ids, kv_ids, lengths, slopes, bias, allowed, scale)
    if cfg.position_free:
      return branch(0)(*args)
    return _switch(c, [branch(i) for i in range(size)], args)

  # Device c keeps rows [c t, c t + h) and takes device (C-1-c)'s rows [(C-c) t - h, (C-c) t).
  h = t // 2
  halves = lambda x, ax: (lax.slice_in_dim(x, 0, h, axis=ax),  # noqa: E731
                          lax.slice_in_dim(x, h, t, axis=ax))
  qa, qb = halves(_swap_halves(cfg, q), 1)
  ida, idb = (None, None) if q_ids is None else halves(_swap_halves(cfg, q_ids), 1)

  def row_halves(x):  # a dense input's rows follow the queries (unless it has one row)
    if x is None or x.shape[2] == 1:
      return x, x
    return halves(_swap_halves(cfg, x, 2), 2)

  (ba, bb), (aa, ab) = row_halves(bias), row_halves(allowed)

  def branch(i):
    def run(qa, qb, k, v, ida, idb, kv_ids, lengths, slopes, ba, bb, aa, ab, scale):
      oa, la = _rows(i * t, h, cfg, qa, k, v, ida, kv_ids, lengths, slopes, ba, aa, scale)
      ob, lb = _rows((size - i) * t - h, h, cfg, qb, k, v, idb, kv_ids, lengths, slopes, bb,
                     ab, scale)
      return oa, la, ob, lb
    return run

  args = (qa, qb, k, v, ida, idb, kv_ids, lengths, slopes, ba, bb, aa, ab, scale)
  oa, la, ob, lb = _switch(c, [branch(i) for i in range(size)], args)
  return (_swap_halves(cfg, jnp.concatenate([oa, ob], axis=1)),
          _swap_halves(cfg, jnp.concatenate([la, lb], axis=2), axis=2))


def _switch(index, branches, args):
  """``branches[index](*args)``; None arguments stay out of the traced operands."""
  present = [i for i, a in enumerate(args) if a is not None]

  def wrap(fn):
    def run(*xs):
      full = [None] * len(args)
      for i, x in zip(present, xs):
        full[i] = x
      return fn(*full)
    return run

  operands = [args[i] for i in present]
  if len(branches) == 1:
    return wrap(branches[0])(*operands)
  return lax.switch(index, [wrap(b) for b in branches], *operands)


# ----------------------------------------------------------------------------------------------
# ring
# ----------------------------------------------------------------------------------------------


def _distances(cfg) -> list[int]:
  """Chunk distances ``d = c - j`` (query chunk minus key chunk), ``-(C-1) .. C-1``."""
  return list(range(-(cfg.size - 1), cfg.size))


def _block_at(cfg, q_offset: int, q, k, v, q_ids, kv_ids, lengths, slopes, scale, bias=None,
              allowed=None):
  return _block(cfg, q, k, v, q_ids, kv_ids, lengths, slopes, bias, scale, q_offset=q_offset,
                allowed=allowed)


def _block_grads_at(cfg, q_offset: int, q, k, v, q_ids, kv_ids, lengths, slopes, scale, bias,
                    allowed, *res):
  return _block_grads(cfg, q, k, v, q_ids, kv_ids, lengths, slopes, scale, *res,
                      q_offset=q_offset, bias=bias, allowed=allowed)


def _chunk_cols(cfg, x, j):
  """The key columns of ring chunk ``j`` (traced) of a dense ``[.., .., rows, S]`` input: ``[j t,
  (j + 1) t)``, or in the zigzag layout half-chunks ``2 j`` and ``2 C - 1 - 2 j``."""
  if x is None:
    return None
  t = cfg.t
  if not cfg.load_balance:
    return lax.dynamic_slice_in_dim(x, j * t, t, axis=3)
  h = t // 2
  return jnp.concatenate([lax.dynamic_slice_in_dim(x, 2 * j * h, h, axis=3),
                          lax.dynamic_slice_in_dim(x, (2 * cfg.size - 1 - 2 * j) * h, h, axis=3)],
                         axis=3)


def _add_chunk_cols(cfg, acc, g, j):
  """``acc`` with ``g`` added at ring chunk ``j``'s key columns (``_chunk_cols``' transpose)."""
  def add(acc, g, start):
    n = g.shape[3]
    return lax.dynamic_update_slice_in_dim(
        acc, lax.dynamic_slice_in_dim(acc, start, n, axis=3) + g, start, axis=3)

  t = cfg.t
  if not cfg.load_balance:
    return add(acc, g, j * t)
  h = t // 2
  acc = add(acc, lax.slice_in_dim(g, 0, h, axis=3), 2 * j * h)
  return add(acc, lax.slice_in_dim(g, h, t, axis=3), (2 * cfg.size - 1 - 2 * j) * h)


def _half_block(x, a: int, b: int, h: int):
  """The index of query half ``a``'s rows (all rows when ``x`` has one) and key half ``b``'s
  columns in a dense ``[.., .., rows, 2 h]`` input (static slices)."""
  rows = slice(None) if x.shape[2] == 1 else slice(a * h, (a + 1) * h)
  return slice(None), slice(None), rows, slice(b * h, (b + 1) * h)


# The kinds of a (query half, key half) pair under a causal mask, zigzag layout.
_NONE, _DIAGONAL, _FULL = 0, 1, 2


def _zigzag_block(cfg, kinds, q, k, v, q_ids, kv_ids, lengths, slopes, scale, bias=None,
                  allowed=None):
  """This device's two query half-chunks against a ring chunk's two key half-chunks, each pair
  of kind ``kinds[2 a + b]`` (no key visible, the diagonal, all keys: causal with offset 0 or
  ``h``); ``lengths`` ``[2, B]`` relative to each key half; ``bias`` / ``allowed``: the chunk's
  columns of the dense inputs (rows in this device's layout)."""
  h = cfg.t // 2
  f32 = jnp.float32
  split = lambda x: (None, None) if x is None else (x[:, :h], x[:, h:])  # noqa: E731
  qs, ks, vs, qi, ki = split(q), split(k), split(v), split(q_ids), split(kv_ids)
  outs, lses = [], []
  for a in range(2):
    acc = None
    for b in range(2):
      kind = kinds[2 * a + b]
      if kind == _NONE:
        continue
      dense = [None if x is None else x[_half_block(x, a, b, h)] for x in (bias, allowed)]
      o, l = _block(cfg, qs[a], ks[b], vs[b], qi[a], ki[b],
                    None if lengths is None else lengths[b], slopes, dense[0], scale,
                    q_offset=0 if kind == _DIAGONAL else h, allowed=dense[1])
      acc = (o.astype(f32), l) if acc is None else _merge(*acc, o, l)
    if acc is None:
      o, l = _empty(qs[a], v)
      acc = (o.astype(f32), l)
    outs.append(acc[0])
    lses.append(acc[1])
  return jnp.concatenate(outs, axis=1).astype(q.dtype), jnp.concatenate(lses, axis=2)


def _zigzag_grads(cfg, kinds, q, k, v, q_ids, kv_ids, lengths, slopes, scale, bias, allowed, out,
                  lse, d_out, d_lse):
  """``_zigzag_block``'s gradients ``(dq, dk, dv, d_slopes, d_bias)`` given the rows' whole
  ``(out, lse)`` and their cotangents: each non-empty (query half, key half) pair's, summed."""
  h = cfg.t // 2
  f32 = jnp.float32
  split = lambda x, ax=1: (None, None) if x is None else (  # noqa: E731
      lax.slice_in_dim(x, 0, h, axis=ax), lax.slice_in_dim(x, h, 2 * h, axis=ax))
  qs, ks, vs, qi, ki = split(q), split(k), split(v), split(q_ids), split(kv_ids)
  rows = list(zip(split(out), split(lse, 2), split(d_out), split(d_lse, 2)))
  dq = [jnp.zeros(x.shape, f32) for x in qs]
  dk = [jnp.zeros(x.shape, f32) for x in ks]
  dv = [jnp.zeros(x.shape, f32) for x in vs]
  d_slopes = None
  d_bias = None if bias is None else jnp.zeros(bias.shape, f32)
  for a in range(2):
    for b in range(2):
      kind = kinds[2 * a + b]
      if kind == _NONE:
        continue
      at = {name: None if x is None else x[_half_block(x, a, b, h)]
            for name, x in (("bias", bias), ("allowed", allowed))}
      gq, gk, gv, g_sl, g_b = _block_grads(cfg, qs[a], ks[b], vs[b], qi[a], ki[b],
                                           None if lengths is None else lengths[b], slopes,
                                           scale, *rows[a], q_offset=0 if kind == _DIAGONAL
                                           else h, **at)
      dq[a], dk[b], dv[b] = dq[a] + gq, dk[b] + gk, dv[b] + gv
      if g_sl is not None:
        d_slopes = g_sl.astype(f32) if d_slopes is None else d_slopes + g_sl
      if g_b is not None:
        d_bias = d_bias.at[_half_block(bias, a, b, h)].add(g_b)
  cat = lambda xs: jnp.concatenate(xs, axis=1)  # noqa: E731
  return cat(dq), cat(dk), cat(dv), d_slopes, d_bias


def _pair_kind(qi: int, ki: int) -> int:
  return _NONE if qi < ki else _DIAGONAL if qi == ki else _FULL


def _ring_plan(cfg, grads: bool = False):
  """``(blocks, locate)``: ``blocks[i](q, kb, vb, q_ids, kv_ids_b, lens, slopes, scale, bias_b,
  allowed_b) -> (out, lse)`` (None: the block is empty; ``bias_b`` / ``allowed_b``: the chunk's
  columns of the dense inputs, or None), and ``locate(c, s, lengths) -> (branch index, lens, j)``
  for the chunk ``j = (c - s) mod C`` device ``c`` holds at ring step ``s``.  With ``grads``, each
  block takes ``out, lse, d_out, d_lse`` (the rows' whole results and cotangents) after those
  arguments and returns ``(dq, dk, dv, d_slopes, d_bias)`` instead.

  Contiguous chunks: one branch per chunk distance ``d = c - j`` (static offset ``d t``).
  Zigzag (``load_balance``, causal only): device ``c`` holds half-chunks ``2c`` and
  ``2C-1-2c`` of the queries and, as ring chunk ``c``, of the keys; a (query half, key half) pair
  is empty, diagonal or full by their order, one branch per distinct pattern of the four pairs.
  Every step then costs every device ``2 h^2`` query-key pairs (two full pairs, or two diagonals
  and a full one), where the contiguous ring's busiest device computes a whole block, ``t^2``.
  """
  size, t = cfg.size, cfg.t
  if not cfg.load_balance:
    at = _block_grads_at if grads else _block_at
    if cfg.position_free:
      blocks = [functools.partial(at, cfg, 0)]
    else:
      blocks = []
      for d in _distances(cfg):
        lo, hi = _key_range(cfg, d * t, t, t)
        blocks.append(None if hi == lo else functools.partial(at, cfg, d * t))

    def locate(c, s, lengths):
      j = (c - s) % size
      which = 0 if len(blocks) == 1 else c - j + size - 1
      return which, None if lengths is None else lengths - j * t, j
    return blocks, locate

  h = t // 2
  patterns: dict[tuple, int] = {}
  table = np.zeros((size, size), np.int32)
  for c in range(size):
    for j in range(size):
      kinds = tuple(_pair_kind(qi, ki) for qi in (2 * c, 2 * size - 1 - 2 * c)
                    for ki in (2 * j, 2 * size - 1 - 2 * j))
      table[c, j] = patterns.setdefault(kinds, len(patterns))
  blocks = [functools.partial(_zigzag_grads if grads else _zigzag_block, cfg, kinds)
            for kinds in patterns]

  def locate(c, s, lengths):
    j = (c - s) % size
    lens = None if lengths is None else jnp.stack([lengths - 2 * j * h,
                                                   lengths - (2 * size - 1 - 2 * j) * h])
    return jnp.asarray(table)[c, j], lens, j
  return blocks, locate


def _ring_perm(size, shift: int = 1):
  return [(i, (i + shift) % size) for i in range(size)]


def _ring_steps(size: int, t: int, band, load_balance: bool) -> int:
  """Ring steps that can meet a visible key: all ``C`` in general; under a causal window of
  ``left`` keys (contiguous chunks) device ``c`` sees chunks ``c - d`` for ``d <= ceil(left /
  t)`` only, which the first ``1 + ceil(left / t)`` steps bring (Mistral's, gpt-oss's sliding
  layers: 2 steps when the window is shorter than a chunk)."""
  if load_balance or band is None or band[1] != 0 or math.isinf(band[0]):
    return size
  return min(size, 1 + -(-int(band[0]) // t))


def _merge(o_acc, l_acc, o, l):
  """Running (fp32 out, lse) with one more block's ``(out, lse)``."""
  new = jnp.logaddexp(l_acc, l)
  finite = jnp.isfinite(new)
  wa = jnp.where(finite, jnp.exp(l_acc - jnp.where(finite, new, 0.0)), 0.0)
  wb = jnp.where(finite, jnp.exp(l - jnp.where(finite, new, 0.0)), 0.0)
  to_rows = lambda w: jnp.swapaxes(w, 1, 2)[..., None]  # noqa: E731  [B,N,T] -> [B,T,N,1]
  return o_acc * to_rows(wa) + o.astype(jnp.float32) * to_rows(wb), new


def _ring_forward(cfg, q, k, v, q_ids, kv_ids, lengths, slopes, scale, bias=None, allowed=None):
  size, t = cfg.size, cfg.t
  c = lax.axis_index(AXIS)
  perm = _ring_perm(size)
  blocks, locate = _ring_plan(cfg)
  branches = [(lambda q, kb, vb, *rest: _empty(q, vb)) if fn is None else fn for fn in blocks]
  b, _, n, _ = q.shape
  o0 = jnp.zeros((b, t, n, v.shape[-1]), jnp.float32)
  l0 = jnp.full((b, n, t), -jnp.inf, jnp.float32)
  kv_ids0 = jnp.zeros((b, t), jnp.int32) if kv_ids is None else kv_ids

  def step(carry, s):
    kb, vb, idb, o_acc, l_acc = carry
    nxt = lax.ppermute((kb, vb, idb), AXIS, perm)      # issued first: overlaps the block
    which, lens, j = locate(c, s, lengths)
    o, l = _switch(which, branches,
                   (q, kb, vb, q_ids, None if kv_ids is None else idb, lens, slopes, scale,
                    _chunk_cols(cfg, bias, j), _chunk_cols(cfg, allowed, j)))
    o_acc, l_acc = _merge(o_acc, l_acc, o, l)
    return (*nxt, o_acc, l_acc), None

  (_, _, _, o, l), _ = lax.scan(step, (k, v, kv_ids0, o0, l0), jnp.arange(cfg.steps))
  return o.astype(q.dtype), l


@functools.lru_cache(maxsize=64)
def _ring_vjp(cfg):
  """The ring's ``(q, k, v, slopes, bias, aux) -> (out, lse)`` with its ring backward pass; ALiBi
  ``slopes`` and a dense ``bias`` (this device's rows, every key column; or None) are
  differentiated too (the bias' gradient stays on this device: each step adds its chunk's
  columns), ``aux = (q_ids, kv_ids, lengths, allowed, scale)`` not."""

  def forward(q, k, v, slopes, bias, aux):
    q_ids, kv_ids, lengths, allowed, scale = aux
    return _ring_forward(cfg, q, k, v, q_ids, kv_ids, lengths, slopes, scale, bias, allowed)

  @jax.custom_vjp
  def ring(q, k, v, slopes, bias, aux):
    return forward(q, k, v, slopes, bias, aux)

  def fwd(q, k, v, slopes, bias, aux):
    out, lse = forward(q, k, v, slopes, bias, aux)
    return (out, lse), (q, k, v, slopes, bias, aux, out, lse)

  def bwd(res, cts):
    q, k, v, slopes, bias, aux, out, lse = res
    q_ids, kv_ids, lengths, allowed, scale = aux
    d_out, d_lse = cts
    size = cfg.size
    c = lax.axis_index(AXIS)
    perm = _ring_perm(size)
    f32 = jnp.float32
    d_lse = jnp.zeros_like(lse) if d_lse is None else d_lse.astype(f32)

    # the slopes' gradient (a dummy scalar without slopes) sums over the steps; shard_map adds
    # the devices' sums (slopes are replicated over `context`)
    d_slopes0 = jnp.zeros((), f32) if slopes is None else jnp.zeros(slopes.shape, f32)

    def grads(block):
      def run(q, kb, vb, q_ids, idb, lens, slopes, scale, bias_b, allowed_b, out, lse, d_out,
              d_lse):
        d_b0 = jnp.zeros((), f32) if bias_b is None else jnp.zeros(bias_b.shape, f32)
        if block is None:
          return (jnp.zeros(q.shape, f32), jnp.zeros(kb.shape, f32), jnp.zeros(vb.shape, f32),
                  d_slopes0, d_b0)
        dq, dk, dv, d_sl, d_b = block(q, kb, vb, q_ids, idb, lens, slopes, scale, bias_b,
                                      allowed_b, out, lse, d_out, d_lse)
        d_sl = d_slopes0 if slopes is None else d_sl.astype(f32)
        d_b = d_b0 if bias_b is None else d_b.astype(f32)
        return dq.astype(f32), dk.astype(f32), dv.astype(f32), d_sl, d_b
      return run

    blocks, locate = _ring_plan(cfg, grads=True)
    branches = [grads(block) for block in blocks]
    kv_ids0 = jnp.zeros(q.shape[:2], jnp.int32) if kv_ids is None else kv_ids

    def step(carry, s):
      kb, vb, idb, dkb, dvb, dq, d_sl, d_bias = carry
      nxt = lax.ppermute((kb, vb, idb), AXIS, perm)      # issued first: overlaps the block
      which, lens, j = locate(c, s, lengths)
      gq, gk, gv, g_sl, g_b = _switch(
          which, branches, (q, kb, vb, q_ids, None if kv_ids is None else idb, lens, slopes,
                            scale, _chunk_cols(cfg, bias, j), _chunk_cols(cfg, allowed, j), out,
                            lse, d_out, d_lse))
      # the chunk's gradient accumulators follow it; after C steps each is home again
      dkb, dvb = lax.ppermute((dkb + gk, dvb + gv), AXIS, perm)
      # the bias' rows are this device's: its chunk columns are added in place
      d_bias = d_bias if bias is None else _add_chunk_cols(cfg, d_bias, g_b, j)
      return (*nxt, dkb, dvb, dq + gq, d_sl + g_sl, d_bias), None

    zeros = lambda x: jnp.zeros(x.shape, f32)  # noqa: E731
    d_bias0 = jnp.zeros((), f32) if bias is None else zeros(bias)
    init = (k, v, kv_ids0, zeros(k), zeros(v), zeros(q), d_slopes0, d_bias0)
    (_, _, _, dk, dv, dq, d_sl, d_bias), _ = lax.scan(step, init, jnp.arange(cfg.steps))
    if cfg.steps % size:   # a shortened ring: the accumulators are `steps` devices downstream
      dk, dv = lax.ppermute((dk, dv), AXIS, _ring_perm(size, -cfg.steps))
    d_slopes = None if slopes is None else d_sl.astype(slopes.dtype)
    d_bias = None if bias is None else d_bias.astype(bias.dtype)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), d_slopes, d_bias,
            None)

  ring.defvjp(fwd, bwd)
  return ring


def _ring_local(cfg, q, k, v, q_ids, kv_ids, lengths, slopes, bias, allowed, scale):
  if not cfg.load_balance:
    return _ring_vjp(cfg)(q, k, v, slopes, bias, (q_ids, kv_ids, lengths, allowed, scale))
  # zigzag: device c keeps its first half-chunk and takes device (C-1-c)'s second
  swap = functools.partial(_swap_halves, cfg)
  rows = lambda x: x if x is None or x.shape[2] == 1 else swap(x, axis=2)  # noqa: E731
  out, lse = _ring_vjp(cfg)(swap(q), swap(k), swap(v), slopes, rows(bias),
                            (swap(q_ids), swap(kv_ids), lengths, rows(allowed), scale))
  return swap(out), swap(lse, axis=2)


# ----------------------------------------------------------------------------------------------
# The gated delta rule: a recurrence, parallel over devices through its state transitions
# ----------------------------------------------------------------------------------------------


def delta_rule(query, key, value, g, beta, *, scale, initial_state, output_final_state: bool,
               chunk_size: int, segment_ids, use_qk_l2norm: bool, implementation, size: int,
               mesh=None):
  """``gated_delta_rule`` with the sequence split over the mesh axis ``context`` (``size``
  devices; ``T`` a multiple of it).  Returns ``(out, final_state or None)``.

  The memory after a device's chunk is affine in the memory before it: ``S_out = M S_in + Q``
  (``M`` the product of the chunk's ``a_t (I - beta_t k_t k_t^T)``, ``Q`` the chunk run from
  zero).  One local run with the values widened by ``H`` zero columns, started from ``[0 | I]``,
  gives both (``[Q | M]``: the rule acts on each value column alone).  The devices gather every
  ``(M, Q)`` (``[B, N, H, H + h]`` each, independent of the length) and each composes its
  predecessors' to find its incoming memory (cleared where a packed sequence starts at its first
  token); a second local run from it gives the outputs.  Per device: two runs over ``T / C``
  tokens, one of them ``H + h`` wide, and no sequence-length communication.  Gradients by
  autodiff (the gather transposes to a reduce-scatter).
  """
  from jaxattn.ops.delta_rule import gated_delta_rule
  from pallas_kernels.flash_attention.sharded import plan_specs, run_sharded
  b, _, kh, hk = key.shape
  n, hv = value.shape[2], value.shape[3]
  f32 = jnp.float32
  run = functools.partial(gated_delta_rule, scale=scale, chunk_size=chunk_size,
                          use_qk_l2norm=use_qk_l2norm, implementation=implementation)

  def local(q, k, v, gg, bb, ids, s0):
    c = lax.axis_index(AXIS)
    bl = q.shape[0]
    nl = v.shape[2]
    # [Q | M]: the chunk's memory from zero, and its transition, in one run
    wide = jnp.concatenate([v, jnp.zeros(v.shape[:3] + (hk,), v.dtype)], axis=-1)
    eye = jnp.broadcast_to(jnp.eye(hk, dtype=f32), (bl, nl, hk, hk))
    start = jnp.concatenate([jnp.zeros((bl, nl, hk, hv), f32), eye], axis=-1)
    _, both = run(q, k, wide, gg, bb, initial_state=start, output_final_state=True,
                  segment_ids=ids)
    both = lax.all_gather(both, AXIS, axis=0)                   # [C, B, N, H, h + H]
    q_all, m_all = both[..., :hv], both[..., hv:]
    if ids is None:
      keep = jnp.ones((size, bl), bool)
    else:  # device j's first token continues device j-1's last token's sequence
      first = lax.all_gather(ids[:, 0], AXIS, axis=0)           # [C, B]
      last = lax.all_gather(ids[:, -1], AXIS, axis=0)
      keep = jnp.concatenate([jnp.ones((1, bl), bool), first[1:] == last[:-1]], axis=0)
    keep = keep.astype(f32)[:, :, None, None, None]

    def fold(state, j):   # the memory entering device j -> entering device j + 1
      state = state * keep[j]
      # S [H, h] key-dimension first: S_out = M S_in + Q, M acting on the key dimension
      new = jnp.einsum("bnij,bnjh->bnih", m_all[j], state) + q_all[j]
      return new, new

    s0 = jnp.zeros((bl, nl, hk, hv), f32) if s0 is None else s0.astype(f32)
    # a scan of fixed length (reverse-mode differentiable, unlike a loop to the traced c)
    final, after = lax.scan(fold, s0, jnp.arange(size))
    entering = jnp.concatenate([s0[None], after[:-1]], axis=0)  # [C, B, N, H, h]
    incoming = entering[c] * keep[c]
    out, _ = run(q, k, v, gg, bb, initial_state=incoming, output_final_state=False,
                 segment_ids=ids)
    return out, (final if output_final_state else jnp.zeros((), f32))

  named = {"query": query, "key": key, "value": value, "g": g, "beta": beta,
           "ids": segment_ids, "s0": initial_state}
  names = [k for k, v in named.items() if v is not None]

  def body(*xs):
    got = dict(zip(names, xs))
    return local(*(got.get(k) for k in named))

  def specs(mesh):
    bax, hax = plan_specs(mesh, b, n, kh)
    table = {"query": P(bax, AXIS, hax, None), "key": P(bax, AXIS, hax, None),
             "value": P(bax, AXIS, hax, None), "g": P(bax, AXIS, hax), "beta": P(bax, AXIS, hax),
             "ids": P(bax, AXIS), "s0": P(bax, hax, None, None)}
    final = P(bax, hax, None, None) if output_final_state else P()
    return [table[k] for k in names], (P(bax, AXIS, hax, None), final)

  out, final = run_sharded(body, [named[k] for k in names], mesh, specs)
  return out, (final if output_final_state else None)


__all__ = ["AXIS", "STRATEGIES", "context_parallel_attention", "delta_rule", "get_options",
           "mesh_axis_size", "set_options", "unsupported"]
