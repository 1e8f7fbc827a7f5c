"""Attention masks as values.

A mask answers "may query ``i`` attend to key ``j``?".  Every mask has

* an elementwise view, ``mask(q_idx, kv_idx, q_offset=0)``: boolean, broadcast over the index arrays
  (``[T, S]`` for position masks, ``[B, T, S]`` for data masks such as segment ids); this is what the
  chunked XLA path and the kernels evaluate one block at a time;
* a dense view, ``mask.dense(q_len, kv_len)``, the reference the tests compare against;
* a block view, ``mask.block_view(q_len, kv_len, block_q, block_k)``: per block ``EMPTY`` (skip it),
  ``PARTIAL`` (evaluate the mask) or ``FULL`` (no masking needed).

Position masks (causal, sliding window, global tokens) are frozen dataclasses with only static
fields: they hash, compare equal, and may be static ``jit`` arguments; their block view is a NumPy
array computed at trace time.  Data masks (segment ids, padding) hold arrays, are pytrees, and give a
block view as a JAX array.  Masks compose with ``&`` and ``|`` and refuse ``bool()``.

``q_offset`` is the position of query row 0 (queries sit at ``q_offset + arange(T)``; keys at
``arange(S)``).  With ``q_offset = 0`` the causal mask is aligned top-left, as in
``jax.nn.dot_product_attention``; a KV-cache decode passes the cache position.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn.checks import is_int

EMPTY, PARTIAL, FULL = 0, 1, 2


class Mask:
  """Base class; subclasses implement ``__call__``."""

  #: True when the mask depends only on positions (hashable, static block view).
  is_static: bool = True

  def __call__(self, q_idx, kv_idx, q_offset=0):  # pragma: no cover - abstract
    raise NotImplementedError

  def __bool__(self):
    raise TypeError(f"{type(self).__name__} is a mask object; it has no truth value. "
                    "Use .dense(q_len, kv_len) for a boolean array.")

  def __and__(self, other: "Mask") -> "Mask":
    return AndMask(self, other)

  def __or__(self, other: "Mask") -> "Mask":
    return OrMask(self, other)

  def dense(self, q_len: int, kv_len: int, q_offset=0):
    """Boolean ``[T, S]`` (position masks, NumPy when ``q_offset`` is static) or ``[B, T, S]``."""
    q_idx = np.arange(q_len, dtype=np.int32)[:, None]
    kv_idx = np.arange(kv_len, dtype=np.int32)[None, :]
    return self(q_idx, kv_idx, q_offset)

  def block_view(self, q_len: int, kv_len: int, block_q: int, block_k: int, q_offset: int = 0):
    """``[ceil(T/bq), ceil(S/bk)]`` of ``EMPTY``/``PARTIAL``/``FULL`` (``[B, ...]`` for data masks).

    Padding rows/columns past ``q_len``/``kv_len`` do not count: a block whose in-range part is all
    allowed is ``FULL``.
    """
    if self.is_static:
      band = _band(self)
      if band is not None:
        return _band_block_view(band, q_len, kv_len, block_q, block_k, int(q_offset))
      return _static_block_view(self, q_len, kv_len, block_q, block_k, int(q_offset))
    dense = jnp.asarray(self.dense(q_len, kv_len, q_offset))
    if dense.ndim == 2:
      dense = dense[None]
    return _reduce_blocks(dense, block_q, block_k, xp=jnp)


def _reduce_blocks(dense, block_q, block_k, xp):
  """[..., T, S] bool -> [..., nq, nk] EMPTY/PARTIAL/FULL; out-of-range padding counts as 'allowed'
  for FULL and 'disallowed' for EMPTY."""
  *lead, t, s = dense.shape
  nq, nk = -(-t // block_q), -(-s // block_k)
  pad = [(0, 0)] * len(lead) + [(0, nq * block_q - t), (0, nk * block_k - s)]
  valid = xp.pad(xp.ones((t, s), bool), pad[-2:])
  any_ = xp.pad(dense, pad, constant_values=False)
  all_ = xp.pad(dense, pad, constant_values=True)
  shape = (*lead, nq, block_q, nk, block_k)
  has_any = any_.reshape(shape).any(axis=(-3, -1))
  has_all = (all_ | ~valid).reshape(shape).all(axis=(-3, -1))
  return xp.where(has_all, FULL, xp.where(has_any, PARTIAL, EMPTY)).astype(xp.int8)


def _band(mask) -> tuple[float, float] | None:
  """``(left, right)`` when ``mask`` allows exactly keys ``p - left <= j <= p + right`` (inf for an
  unbounded side): causal, sliding-window and full masks and their conjunctions.  None otherwise."""
  inf = float("inf")
  if isinstance(mask, FullMask):
    return inf, inf
  if isinstance(mask, CausalMask):
    return inf, 0.0
  if isinstance(mask, SlidingWindowMask):
    return (inf if mask.left is None else float(mask.left),
            inf if mask.right is None else float(mask.right))
  if isinstance(mask, AndMask):
    a, b = _band(mask.a), _band(mask.b)
    if a is not None and b is not None:
      return min(a[0], b[0]), min(a[1], b[1])
  return None


@functools.lru_cache(maxsize=256)
def _band_block_view(band, q_len, kv_len, block_q, block_k, q_offset):
  """Block view of a band mask from block corners: O(blocks), not O(T * S).

  Row ``p`` allows the key interval ``[p - left, p + right]``; both ends grow with ``p``, so a block
  is EMPTY when the union of its rows' intervals misses its key range and FULL when the first row's
  interval reaches its last key and the last row's interval reaches its first key.
  """
  left, right = band
  nq, nk = -(-q_len // block_q), -(-kv_len // block_k)
  r0 = np.arange(nq)[:, None] * block_q + q_offset  # first / last (in-range) query position
  r1 = np.minimum(np.arange(nq)[:, None] * block_q + block_q, q_len) - 1 + q_offset
  c0 = np.arange(nk)[None, :] * block_k  # first / last (in-range) key index
  c1 = np.minimum(np.arange(nk)[None, :] * block_k + block_k, kv_len) - 1
  empty = (r1 + right < c0) | (r0 - left > c1)
  full = (r1 - left <= c0) & (r0 + right >= c1)
  out = np.where(full, FULL, np.where(empty, EMPTY, PARTIAL)).astype(np.int8)
  out.setflags(write=False)
  return out


@functools.lru_cache(maxsize=256)
def _static_block_view(mask, q_len, kv_len, block_q, block_k, q_offset):
  # Evaluated one row of blocks at a time so memory stays O(block_q * S), not O(T * S).
  rows = []
  kv_idx = np.arange(kv_len, dtype=np.int64)[None, :]
  for start in range(0, q_len, block_q):
    q_idx = np.arange(start, min(start + block_q, q_len), dtype=np.int64)[:, None]
    dense = np.broadcast_to(np.asarray(mask(q_idx, kv_idx, q_offset)), (q_idx.shape[0], kv_len))
    rows.append(_reduce_blocks(dense, block_q, block_k, xp=np)[0])
  out = np.stack(rows)
  out.setflags(write=False)
  return out


# ----------------------------------------------------------------------------------------------
# Position masks (static)
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FullMask(Mask):
  """Every query attends to every key."""

  def __call__(self, q_idx, kv_idx, q_offset=0):
    xp = _xp(q_idx, kv_idx, q_offset)
    return xp.ones(xp.broadcast_shapes(xp.shape(q_idx), xp.shape(kv_idx)), bool)


@dataclasses.dataclass(frozen=True)
class CausalMask(Mask):
  """Query at position ``p`` attends to keys ``j <= p``."""

  def __call__(self, q_idx, kv_idx, q_offset=0):
    return kv_idx <= q_idx + q_offset


@dataclasses.dataclass(frozen=True)
class SlidingWindowMask(Mask):
  """Banded mask: query at ``p`` attends to keys ``p - left <= j <= p + right``.

  The seed's window of radius ``w`` is ``left = right = w`` (two-sided); the causal sliding window
  of Mistral is ``left = w, right = 0``.  ``None`` means unbounded on that side.
  """

  left: int | None
  right: int | None = 0

  def __post_init__(self):
    for name in ("left", "right"):
      v = getattr(self, name)
      if v is not None and (not is_int(v) or v < 0):
        raise ValueError(f"SlidingWindowMask: `{name}` must be a non-negative int or None, got {v!r}.")

  def __call__(self, q_idx, kv_idx, q_offset=0):
    pos = q_idx + q_offset
    ok = True
    if self.left is not None:
      ok = kv_idx >= pos - self.left
    if self.right is not None:
      ok = ok & (kv_idx <= pos + self.right)
    if ok is True:
      return FullMask()(q_idx, kv_idx, q_offset)
    return ok


def sliding_window(radius: int, *, causal: bool = True) -> Mask:
  """The seed's banded window of radius ``w``: causal (``[p - w, p]``) or two-sided (``[p-w, p+w]``)."""
  if not is_int(radius) or radius < 0:
    raise ValueError(f"sliding_window: `radius` must be a non-negative int, got {radius!r}.")
  return SlidingWindowMask(int(radius), 0 if causal else int(radius))


@dataclasses.dataclass(frozen=True)
class GlobalTokensMask(Mask):
  """Longformer global tokens: positions in ``indices`` attend to all and are attended by all.

  Compose with a local window: ``sliding_window(w, causal=False) | GlobalTokensMask((0,))``.
  """

  indices: tuple[int, ...]

  def __post_init__(self):
    try:
      raw = tuple(self.indices)
    except TypeError:
      raw = None
    if raw is None or not all(is_int(i) and i >= 0 for i in raw):
      raise ValueError(f"GlobalTokensMask: `indices` must be a sequence of non-negative ints, got "
                       f"{self.indices!r}.")
    idx = tuple(int(i) for i in raw)
    object.__setattr__(self, "indices", tuple(sorted(set(idx))))

  @classmethod
  def from_bool(cls, is_global) -> "GlobalTokensMask":
    """From a concrete boolean vector ``[S]`` marking global tokens."""
    return cls(tuple(int(i) for i in np.flatnonzero(np.asarray(is_global))))

  def __call__(self, q_idx, kv_idx, q_offset=0):
    xp = _xp(q_idx, kv_idx, q_offset)
    g = xp.asarray(self.indices if self.indices else (-1,), dtype=np.int32)
    q_glob = (xp.asarray(q_idx + q_offset)[..., None] == g).any(-1)
    kv_glob = (xp.asarray(kv_idx)[..., None] == g).any(-1)
    return q_glob | kv_glob


@dataclasses.dataclass(frozen=True)
class AndMask(Mask):
  a: Mask
  b: Mask

  @property
  def is_static(self):  # type: ignore[override]
    return self.a.is_static and self.b.is_static

  def __call__(self, q_idx, kv_idx, q_offset=0):
    return self.a(q_idx, kv_idx, q_offset) & self.b(q_idx, kv_idx, q_offset)


@dataclasses.dataclass(frozen=True)
class OrMask(Mask):
  a: Mask
  b: Mask

  @property
  def is_static(self):  # type: ignore[override]
    return self.a.is_static and self.b.is_static

  def __call__(self, q_idx, kv_idx, q_offset=0):
    return self.a(q_idx, kv_idx, q_offset) | self.b(q_idx, kv_idx, q_offset)


# ----------------------------------------------------------------------------------------------
# Data masks (pytrees holding arrays)
# ----------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class SegmentMask(Mask):
  """Packed sequences: query ``i`` attends to key ``j`` only when their segment ids are equal.

  ``q_segment_ids: [B, T]``, ``kv_segment_ids: [B, S]`` (int).  Evaluates to ``[B, T, S]``.
  """

  q_segment_ids: Any
  kv_segment_ids: Any
  is_static = False

  def __call__(self, q_idx, kv_idx, q_offset=0):
    q = jnp.take(jnp.asarray(self.q_segment_ids), jnp.asarray(q_idx)[..., 0], axis=1)  # [B, T]
    kv = jnp.take(jnp.asarray(self.kv_segment_ids), jnp.asarray(kv_idx)[0], axis=1)  # [B, S]
    return q[:, :, None] == kv[:, None, :]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class PaddingMask(Mask):
  """Keys at index ``>= kv_lengths[b]`` are padding (or unfilled cache slots).  ``[B, T, S]``."""

  kv_lengths: Any
  is_static = False

  def __call__(self, q_idx, kv_idx, q_offset=0):
    lengths = jnp.asarray(self.kv_lengths)[:, None, None]
    return jnp.broadcast_to(jnp.asarray(kv_idx)[None] < lengths,
                            (lengths.shape[0],) + jnp.broadcast_shapes(jnp.shape(q_idx), jnp.shape(kv_idx)))


# AndMask / OrMask of data masks must be pytrees too: register them with both children as nodes.
for _cls in (AndMask, OrMask):
  jax.tree_util.register_pytree_node(
      _cls, lambda m: ((m.a, m.b), None), lambda _, ch, cls=_cls: cls(*ch))


def _xp(*xs):
  return jnp if any(isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer) for x in xs) else np


def key_mask_as_segments(mask_array, segments, batch: int, q_len: int):
  """Segment ids that allow what ``segments`` (None or ``(q_ids [B, T], kv_ids [B, S])``) and a
  key-padding mask ``[B|1, 1, 1, S]`` allow together: a masked key gets an id no query of its
  row has (one less than the row's smallest).  The block tables then skip fully masked key
  blocks and evaluate partly masked ones, as they do for the mask array."""
  keep = jnp.broadcast_to(mask_array[:, 0, 0, :], (batch, mask_array.shape[-1]))
  if segments is None:
    return jnp.zeros((batch, q_len), jnp.int32), jnp.where(keep, 0, -1).astype(jnp.int32)
  q_ids, kv_ids = (jnp.asarray(x).astype(jnp.int32) for x in segments)
  never = q_ids.min(axis=1, keepdims=True) - 1
  return q_ids, jnp.where(keep, kv_ids, never)


def make_mask(*, is_causal: bool = False, local_window_size=None, segment_ids=None, kv_lengths=None,
              mask: Mask | None = None, q_len: int | None = None) -> Mask | None:
  """Folds the convenience arguments of ``dot_product_attention`` into one ``Mask`` (or None).

  ``local_window_size`` is an int radius ``w`` (``[p-w, p]`` when causal, ``[p-w, p+w]`` otherwise)
  or a ``(left, right)`` tuple, as in ``jax.nn.dot_product_attention``.
  ``segment_ids`` is one ``[B, T]`` array (self-attention) or a ``(q_ids, kv_ids)`` pair.
  """
  parts: list[Mask] = []
  if mask is not None:
    parts.append(mask)
  if is_causal:
    parts.append(CausalMask())
  if local_window_size is not None:
    if isinstance(local_window_size, (tuple, list)):
      if len(local_window_size) != 2:
        raise ValueError("`local_window_size` must be an int or a (left, right) pair, "
                         f"got {local_window_size!r}.")
      left, right = local_window_size
    else:
      left, right = local_window_size, (0 if is_causal else local_window_size)
    for name, v in (("local_window_size", left), ("local_window_size", right)):
      if v is not None and (not is_int(v) or v < 0):
        raise ValueError(f"`{name}` must be a non-negative int (or None for unbounded), got "
                         f"{local_window_size!r}.")
    parts.append(SlidingWindowMask(left, right))
  if segment_ids is not None:
    if isinstance(segment_ids, (tuple, list)):
      if len(segment_ids) != 2:
        raise ValueError(f"`segment_ids` must be one [B, T] array or a (q_ids, kv_ids) pair, got "
                         f"a {type(segment_ids).__name__} of {len(segment_ids)}.")
      q_ids, kv_ids = segment_ids
    else:
      q_ids = kv_ids = segment_ids
    parts.append(SegmentMask(jnp.asarray(q_ids), jnp.asarray(kv_ids)))
  if kv_lengths is not None:
    parts.append(PaddingMask(jnp.asarray(kv_lengths)))
  if not parts:
    return None
  out = parts[0]
  for p in parts[1:]:
    out = out & p
  return out


# Position masks carry no arrays: as pytrees they are all static metadata, so a composed mask such
# as ``CausalMask() & SegmentMask(...)`` can cross a ``jit`` boundary as an ordinary argument.
for _cls in (FullMask, CausalMask, SlidingWindowMask, GlobalTokensMask):
  jax.tree_util.register_pytree_node(_cls, lambda m: ((), m), lambda m, _: m)
