"""Decode attention over a paged cache (``jaxattn.paged_cache``): formulas and one dispatch point.

Serving decodes a few new tokens per sequence against a long cache held in pages.  Two ops:

* ``paged_attention``: MHA / GQA / MQA.  ``q [B, T, N, H]`` (or ``[B, N, H]``: ``T = 1``) against
  ``key_pool [P, page, K * H]`` / ``value_pool [P, page, K * h]`` (or the split ``[P, page, K, H]``
  form) through ``page_table [B, M]`` and ``lengths [B]``.
* ``paged_mla_decode``: MLA in absorbed form.  The query is already in latent space
  (``q_latent = q^C W_up^K^T [.., N, C]`` plus the rotated ``q_rope [.., N, R]``); every head
  attends to the shared cached rows ``[c_KV, k^R]`` (one MQA key of width ``C + R`` whose first
  ``C`` entries are the value) and the result stays in latent space ``[.., N, C]`` -- the module
  applies ``W_up^V`` and ``o_proj``.  With ``indices`` (DeepSeek Sparse Attention) only the selected
  positions are attended.

Semantics shared by both (the contract the kernels are tested against):

* The ``T`` queries of sequence ``b`` are its LAST ``T`` tokens, already appended: query ``t`` sits
  at position ``lengths[b] - T + t`` and sees keys ``s <= lengths[b] - T + t`` (causal); ``T = 1``
  is plain decode (all ``lengths[b]`` keys).  Rows whose position is negative see nothing.
* Ragged chunks (continuous batching: one sequence prefills a chunk while others decode one token)
  pass ``num_tokens [B]``: sequence ``b``'s queries are its first ``num_tokens[b]`` of ``T``, its
  last ``num_tokens[b]`` tokens (query ``t`` at ``lengths[b] - num_tokens[b] + t``); the others
  are padding and return zeros.  None means ``T`` for every sequence.  The kernels take the
  queries aligned to the end of ``T`` (``align_queries``: each row shifted right by
  ``T - num_tokens[b]``), where their own contract places them, and the output shifted back.
* Logits in fp32: ``scale * q.k`` (+ ``slope * (j - i)`` with ALiBi slopes, + a learned
  ``RelativeBias`` of ``j - i``) -> soft-cap
  ``c * tanh(x / c)`` (when ``logits_soft_cap``) -> mask (causal; with ``local_window_size=w``
  also ``j >= i - w``) -> softmax in fp32.  A query with no visible key (``lengths[b] = 0``)
  returns zeros.
* Output in the query dtype.

Implementations: ``"xla"`` (the reference below: gather every page to a contiguous ``[B, S, ...]``
buffer, dense fp32 softmax), ``"pallas_tpu"`` (``pallas_kernels.decode_attention`` /
``pallas_kernels.mla_decode``: reads pages in place by scalar prefetch, split-KV, runs interpreted
off TPU) and ``"pallas_gpu"`` (the Pallas Triton kernels in the same packages' ``gpu.py``: pages
read in place by scalar loads of the page table, split-KV, runs interpreted off GPU).
``implementation=None`` picks ``"pallas_tpu"`` on TPU, ``"pallas_gpu"`` on an NVIDIA GPU of
compute capability 8.0 or newer (validated on an H200 by ``experiments/device_check.sh``: compiled
kernel tests and ``bench_decode --check``; 2.5-4x faster than ``"xla"`` from batch 8 up,
docs/performance.md) where the cache's pages are multiples of 16 tokens, and ``"xla"`` elsewhere
(and for sparse decode off TPU too).  An explicit choice never falls back.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxattn.checks import check_float_array, check_int_array, is_int
from jaxattn.ops.quantization import kv_quantized
from jaxattn.ops.t5_bias import check_bucket_args, t5_position_bias
from jaxattn.paged_cache import PageTable, gather_pages, split_scales

DecodeImplementation = Literal["xla", "pallas_tpu", "pallas_gpu"]
DECODE_IMPLEMENTATIONS: tuple[str, ...] = ("xla", "pallas_tpu", "pallas_gpu")

_F32 = jnp.float32
# New tokens per step up to which ``Attention`` / ``MLA`` send a step with a contiguous cache to
# ``cache_attention`` / ``cache_mla_decode`` on TPU (more: prefill, which flash attention serves).
DECODE_MAX_T = 16


def resolve_implementation(implementation, *, sparse: bool = False,
                           page_size: int | None = None) -> str:
  """``None`` -> ``"pallas_tpu"`` on TPU; ``"pallas_gpu"`` on an NVIDIA sm_80+ GPU when
  ``page_size`` (the cache's, None: not known yet) is a multiple of 16 (the Triton kernels' key
  blocks may not straddle pages); else ``"xla"``.  An explicit name is checked, never replaced.

  ``sparse`` (DSA decode): ``None`` -> ``"xla"`` on TPU and GPU.  The TPU kernel gathers single
  rows, which Mosaic allows only from a ``[rows, 1, C]`` view of the pool, and XLA re-tiles the
  whole pool into it on every step (docs/performance.md): more bytes than the XLA gather reads;
  the GPU sparse kernel matched the gather reference on an H200 but has not been timed there."""
  if implementation is None:
    if sparse:
      return "xla"
    if jax.default_backend() == "tpu":
      return "pallas_tpu"
    if gpu_kernels_default(page_size):
      return "pallas_gpu"
    return "xla"
  if implementation not in DECODE_IMPLEMENTATIONS:
    raise ValueError(f"`implementation` must be None or one of {DECODE_IMPLEMENTATIONS}, got "
                     f"{implementation!r}.")
  return implementation


def gpu_kernels_default(page_size: int | None = None) -> bool:
  """Whether automatic dispatch takes the GPU decode kernels: the default backend is an NVIDIA
  GPU of compute capability 8.0 or newer and ``page_size`` (if known) a multiple of 16."""
  if jax.default_backend() not in ("gpu", "cuda"):
    return False
  from jaxattn.ops.attention_cudnn import nvidia_reason  # noqa: PLC0415 (import cycle)
  if nvidia_reason() is not None:
    return False
  return page_size is None or (page_size >= 16 and page_size % 16 == 0)


# The dense dispatch's names that have no paged-decode backend of their own: a module built for
# them decodes from a paged cache with the default decode backend.
_DENSE_ONLY = ("xla_chunked", "cpu", "cudnn")


def module_decode_implementation(implementation):
  """The paged-decode backend for a module's (dense-attention) ``implementation``: a decode name
  (``DECODE_IMPLEMENTATIONS``) is kept; ``"xla_chunked"`` is ``"xla"``; a dense-only name
  (``"cpu"``, ``"cudnn"``) is None, the default; a sequence of preferences takes its first decode
  name (None when it has none).  Anything else is returned as given, for
  ``resolve_implementation`` to refuse."""
  if isinstance(implementation, (list, tuple)):
    names = ["xla" if n == "xla_chunked" else n for n in implementation]
    return next((n for n in names if n in DECODE_IMPLEMENTATIONS), None)
  if implementation == "xla_chunked":
    return "xla"
  return None if implementation in _DENSE_ONLY else implementation


def tpu_kernel_requested(implementation) -> bool:
  """Whether a module call with this ``implementation`` (a dense-attention name, a sequence of
  preferences or None) should run the TPU decode kernels: ``"pallas_tpu"`` explicitly (or as
  the first decode name of a sequence: ``module_decode_implementation``), or None on a TPU
  backend."""
  if implementation is None:
    return jax.default_backend() == "tpu"
  return module_decode_implementation(implementation) == "pallas_tpu"


def _table(page_table, lengths, page_size) -> PageTable:
  """A ``PageTable`` view for ``gather_pages`` (the free stack is not needed to read)."""
  empty = jnp.zeros((0,), jnp.int32)
  return PageTable(page_table=page_table, lengths=lengths, free_pages=empty,
                   num_free=jnp.zeros((), jnp.int32), page_size=page_size)


def check_table(page_table, lengths, batch: int, num_pages: int | None = None, page_size=None,
                window: int | None = None, t=1):
  """Validates ``page_table [B, M]`` and ``lengths [B]`` (int32-convertible integer arrays).

  Concrete (not traced) values are checked too: each length fits the table, and every page a
  sequence reads (its first ``ceil(length / page_size)`` entries; with a sliding ``window`` and
  ``t`` queries (an int, or ``[B]`` per sequence), those from the page of key
  ``length - t - window`` on: the pages behind it may have been released,
  ``PageTable.release_behind``) is a page of the pool, in ``[0, num_pages)``.  (The dense paths
  would clamp a ``-1`` there to page 0, another sequence's; ``PagedKVCache`` never writes such a
  table, a hand-built one can.)"""
  for name, x in (("page_table", page_table), ("lengths", lengths)):
    if not hasattr(x, "shape"):       # (a list failed on `.shape`)
      raise ValueError(f"`{name}` must be an integer array, got {type(x).__name__}.")
  if page_table.ndim != 2 or page_table.shape[0] != batch or page_table.shape[1] < 1:
    raise ValueError(f"`page_table` must be [B={batch}, max_pages >= 1], got shape "
                     f"{page_table.shape}.")
  if lengths.shape != (batch,):
    raise ValueError(f"`lengths` must be [B={batch}], got shape {lengths.shape}.")
  check_int_array("page_table", page_table)
  check_int_array("lengths", lengths)
  if page_size is not None and not isinstance(lengths, jax.core.Tracer):
    cap = page_table.shape[1] * page_size
    lens = np.asarray(lengths)
    if ((lens < 0) | (lens > cap)).any():
      raise ValueError(f"`lengths` must lie in [0, max_pages * page_size = {cap}], got {lens}.")
    if not isinstance(page_table, jax.core.Tracer):
      tab = np.asarray(page_table)
      used = np.arange(tab.shape[1])[None, :] < -(-lens // page_size)[:, None]
      if window is not None:
        queries = (0 if isinstance(t, jax.core.Tracer) or np.shape(t) not in ((), lens.shape)
                   else np.asarray(t))             # (a bad num_tokens is refused after this)
        first = np.maximum(lens - queries - window, 0) // page_size
        used &= np.arange(tab.shape[1])[None, :] >= first[:, None]
      bad = used & ((tab < 0) | (tab >= (num_pages if num_pages is not None else np.inf)))
      if bad.any():
        b, j = (int(i) for i in np.argwhere(bad)[0])
        pool = f"[0, {num_pages})" if num_pages is not None else ">= 0"
        raise ValueError(f"`page_table`[{b}, {j}] = {tab[b, j]} is not a page of the pool "
                         f"({pool}), but sequence {b} (length {lens[b]}) reads its logical page "
                         f"{j}.")


def _check_scale(name, v):
  """``v`` (a softmax scale or soft-cap) as a Python float, None kept.  The kernels compile it in,
  so it must be concrete: a Python or NumPy number, or a concrete one-element array; a traced
  value is refused rather than failing deep inside a ``jit``."""
  if v is None:
    return None
  if isinstance(v, jax.core.Tracer):
    raise ValueError(f"`{name}` must be a concrete number (it is compiled into the kernels), got "
                     f"a traced value {v!r}; pass a Python float.")
  f = None
  arr = np.asarray(v) if isinstance(v, (int, float, np.generic, np.ndarray, jax.Array)) else None
  if (arr is not None and arr.size == 1 and not isinstance(v, bool)
      and (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating))):
    f = float(arr.reshape(()))
  if f is None or not (math.isfinite(f) and f > 0):
    raise ValueError(f"`{name}` must be a positive finite float or None, got {v!r}.")
  return f


def check_num_splits(num_splits) -> None:
  """``num_splits``: None or a positive int (shared with the decode kernels' wrappers)."""
  if num_splits is not None and (not is_int(num_splits) or num_splits < 1):
    raise ValueError(f"`num_splits` must be a positive int or None (automatic), got "
                     f"{num_splits!r}.")


def _as_4d(q, name):
  if q.ndim == 3:
    return q[:, None], True
  if q.ndim == 4:
    return q, False
  raise ValueError(f"`{name}` must be [B, N, ...] or [B, T, N, ...], got shape {q.shape}.")


def _query_positions(t, lengths, num_tokens=None):
  """``[B, T]``: the position of each query row (the last ``T`` tokens; with ``num_tokens``, the
  first ``num_tokens[b]`` rows are the last tokens)."""
  rows = jnp.arange(t, dtype=jnp.int32)[None, :]
  n = t if num_tokens is None else num_tokens[:, None]
  return lengths[:, None] - n + rows


def _visible(q_pos, kv_pos, lengths, num_tokens=None, window=None):
  """``[B, T, S]``: key ``s`` (at ``kv_pos [B|1, S]``) exists and is not after query ``t`` (at
  ``q_pos [B, T]``: ``_query_positions``; with ``num_tokens``, only the first ``num_tokens[b]``
  queries are real, the rest see nothing), nor more than ``window`` positions before it (a
  sliding window)."""
  kv, q = kv_pos[:, None, :], q_pos[:, :, None]
  ok = (kv < lengths[:, None, None]) & (kv <= q)
  if num_tokens is not None:
    ok &= jnp.arange(q_pos.shape[1], dtype=jnp.int32)[None, :, None] < num_tokens[:, None, None]
  return ok if window is None else ok & (kv >= q - window)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RelativeBias:
  """A learned relative-position bias (T5's) for ``paged_attention``: ``table [num_buckets, N]``
  indexed by the bucket of ``key position - query position`` (``jaxattn.ops.t5_bias``).  Under
  paging a sequence's keys sit wherever its pages are, so the op takes the bias as a function of
  positions, not as a ``[T, S]`` array."""

  table: Float[Array, "nb N"]
  bidirectional: bool = dataclasses.field(default=False, metadata=dict(static=True))
  num_buckets: int = dataclasses.field(default=32, metadata=dict(static=True))
  max_distance: int = dataclasses.field(default=128, metadata=dict(static=True))

  def __call__(self, q_positions: Int[Array, "B T"], kv_positions: Int[Array, "B S"]
               ) -> Float[Array, "B N T S"]:
    return t5_position_bias(self.table, q_positions, kv_positions,
                            bidirectional=self.bidirectional, num_buckets=self.num_buckets,
                            max_distance=self.max_distance)


def check_relative_bias(relative_bias, num_heads: int):
  """``relative_bias``: None or a ``RelativeBias`` whose table is ``[num_buckets, N]``."""
  if relative_bias is None:
    return None
  if not isinstance(relative_bias, RelativeBias):
    raise ValueError(f"`relative_bias` must be a RelativeBias or None, got "
                     f"{type(relative_bias).__name__}.")
  check_bucket_args(relative_bias.num_buckets, relative_bias.max_distance,
                    relative_bias.bidirectional)
  if tuple(relative_bias.table.shape) != (relative_bias.num_buckets, num_heads):
    raise ValueError(f"`relative_bias.table` must be [num_buckets={relative_bias.num_buckets}, "
                     f"N={num_heads}], got {tuple(relative_bias.table.shape)}.")
  return relative_bias


def check_window(local_window_size):
  """``local_window_size`` of a paged / cached call: None or an int ``w >= 0`` (a query at ``p``
  sees keys ``p - w .. p``; the queries are causal, so there is no right-hand side)."""
  if local_window_size is not None and (not is_int(local_window_size) or local_window_size < 0):
    raise ValueError(f"`local_window_size` must be None or an int >= 0 (a query at p sees keys "
                     f"p - w .. p), got {local_window_size!r}.")
  return None if local_window_size is None else int(local_window_size)


def check_slopes(alibi_slopes, num_heads: int):
  """``alibi_slopes``: None or ``[N]`` real numbers -> a float32 array (traced values allowed:
  the kernels read the slopes as data)."""
  if alibi_slopes is None:
    return None
  if tuple(np.shape(alibi_slopes)) != (num_heads,):
    raise ValueError(f"`alibi_slopes` must have shape [N] = ({num_heads},), got "
                     f"{np.shape(alibi_slopes)}.")
  slopes = jnp.asarray(alibi_slopes)
  if not (jnp.issubdtype(slopes.dtype, jnp.floating) or jnp.issubdtype(slopes.dtype, jnp.integer)):
    raise ValueError(f"`alibi_slopes` must be real numbers, got dtype {slopes.dtype}.")
  return slopes.astype(_F32)


def check_num_tokens(num_tokens, batch: int, t: int, lengths=None):
  """``num_tokens``: None, or ``[B]`` integers in ``[0, T]`` (checked when concrete), at most
  ``lengths`` when given (the new tokens are counted in it) -> int32."""
  if num_tokens is None:
    return None
  if not hasattr(num_tokens, "shape"):       # a list
    raise ValueError(f"`num_tokens` must be an integer array [B={batch}] or None, got "
                     f"{type(num_tokens).__name__}.")
  if num_tokens.shape != (batch,):
    raise ValueError(f"`num_tokens` must be [B={batch}], got shape {num_tokens.shape}.")
  check_int_array("num_tokens", num_tokens)
  if not isinstance(num_tokens, jax.core.Tracer):
    n = np.asarray(num_tokens)
    if ((n < 0) | (n > t)).any():
      raise ValueError(f"`num_tokens` must lie in [0, T={t}], got {n}.")
    if lengths is not None and not isinstance(lengths, jax.core.Tracer):
      short = n > np.asarray(lengths)
      if short.any():
        raise ValueError(f"`num_tokens` {n} exceeds `lengths` {np.asarray(lengths)} (rows "
                         f"{np.flatnonzero(short).tolist()}): the new tokens are counted in the "
                         f"lengths (append them to the cache first).")
  return jnp.asarray(num_tokens).astype(jnp.int32)


def check_ragged_needs_paged(num_tokens, cache_kind: str) -> None:
  """A module's ``num_tokens`` (a ragged chunk) needs a paged cache, which keeps a length per
  sequence: any other call refuses it rather than ignoring it."""
  if num_tokens is not None:
    raise ValueError(f"`num_tokens` (a ragged chunk) needs a {cache_kind}, which keeps a length "
                     f"per sequence; got num_tokens with another cache or none.")


def align_queries(x, num_tokens, fill=0):
  """``x [B, T, ...]`` with row ``b``'s first ``num_tokens[b]`` entries moved to its end (shifted
  right by ``T - num_tokens[b]``), ``fill`` before them: a ragged chunk laid out as the kernels'
  contract wants it (the queries are the last tokens)."""
  t = x.shape[1]
  src = jnp.arange(t, dtype=jnp.int32)[None, :] - (t - num_tokens)[:, None]       # [B, T]
  got = jnp.take_along_axis(x, jnp.maximum(src, 0).reshape(src.shape + (1,) * (x.ndim - 2)),
                            axis=1)
  return jnp.where((src >= 0).reshape(src.shape + (1,) * (x.ndim - 2)), got,
                   jnp.asarray(fill, x.dtype))


def unalign_queries(x, num_tokens):
  """The inverse of ``align_queries``: row ``b``'s last ``num_tokens[b]`` entries moved back to
  its start, zeros after them (the padding queries' outputs)."""
  t = x.shape[1]
  src = jnp.arange(t, dtype=jnp.int32)[None, :] + (t - num_tokens)[:, None]       # [B, T]
  got = jnp.take_along_axis(x, jnp.minimum(src, t - 1).reshape(src.shape + (1,) * (x.ndim - 2)),
                            axis=1)
  return jnp.where((src < t).reshape(src.shape + (1,) * (x.ndim - 2)), got,
                   jnp.zeros((), x.dtype))


def _softmax_rows(logits, valid, sink=None):
  """fp32 softmax over the last axis with invalid entries dropped; all-invalid rows give zeros.
  ``sink`` (broadcast to the rows' shape with a last axis of 1): one more entry's logit, of a
  zero value (attention sinks), in the normalizer only."""
  logits = jnp.where(valid, logits, -jnp.inf)
  m = jnp.max(logits, axis=-1, keepdims=True)
  if sink is not None:
    m = jnp.where(jnp.isfinite(m), jnp.maximum(m, sink), m)   # no key: zeros, as without
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(logits - m_safe)
  l = jnp.sum(p, axis=-1, keepdims=True)
  if sink is not None:
    l = jnp.where(l != 0, l + jnp.exp(sink - m_safe), l)
  return p / jnp.where(l != 0, l, 1.0)


def _cap(logits, logits_soft_cap):
  if logits_soft_cap is None:
    return logits
  return logits_soft_cap * jnp.tanh(logits / logits_soft_cap)


def _window_columns(page_table, lengths, num_tokens, t: int, page: int, window):
  """The page-table columns a sliding window can reach, and the position of their first key:
  ``(page_table [B, W], kv_start [B])``.  The ``T`` queries of a sequence see at most
  ``window + T`` keys, over ``W = (window + T + page - 2) // page + 1`` pages from the one
  holding the first query's first key (shifted back to end at the table's last column at the
  latest); so the reference gathers the window, not the whole table.  No window (or one as wide
  as the table): the whole table, ``kv_start = 0``."""
  b, m = page_table.shape
  span = m if window is None else min(m, (window + t + page - 2) // page + 1)
  if span == m:
    return page_table, jnp.zeros((b,), jnp.int32)
  n = t if num_tokens is None else num_tokens
  first = jnp.clip((lengths - n - window) // page, 0, m - span)                # [B]
  cols = first[:, None] + jnp.arange(span, dtype=jnp.int32)[None, :]
  return jnp.take_along_axis(page_table, cols, axis=1), first * page


@functools.partial(jax.jit, static_argnames=("logits_soft_cap", "local_window_size"))
def paged_attention_xla(query, key_pool, value_pool, page_table, lengths, *, scale,
                        logits_soft_cap=None, num_tokens=None, local_window_size=None,
                        alibi_slopes=None, relative_bias=None, sinks=None, key_scale=None,
                        value_scale=None):
  """The reference: gather pages to ``[B, S, K, H]``, then dense fp32 attention.  ``query`` is
  ``[B, T, N, H]``; see ``paged_attention`` (``num_tokens`` [B] or None; ``key_scale`` /
  ``value_scale [P, 1, K * page]`` with quantized pools: the gathered codes times their
  scales)."""
  b, t, n, h = query.shape
  kh, page = key_pool.shape[2], key_pool.shape[1]
  page_table, kv_start = _window_columns(page_table, lengths, num_tokens, t, page,
                                         local_window_size)
  table = _table(page_table, lengths - kv_start, page)

  def gather(pool, scales):       # [B, S, K, H|h] fp32
    x = gather_pages(pool, table).astype(_F32)
    if scales is None:
      return x
    return x * gather_pages(split_scales(scales, kh), table)[..., None]

  # (4-D pools here: ``paged_attention`` splits merged ``[P, page, K * H]`` rows by head.)
  key, value = gather(key_pool, key_scale), gather(value_pool, value_scale)
  q = query.astype(_F32).reshape(b, t, kh, n // kh, h)              # head n reads KV head n // G
  s = key.shape[1]
  logits = jnp.einsum("btkgh,bskh->bkgts", q, key) * scale
  kv_pos = kv_start[:, None] + jnp.arange(s, dtype=jnp.int32)[None, :]          # [B, S]
  q_pos = _query_positions(t, lengths, num_tokens)                                 # [B, T]
  if alibi_slopes is not None:      # slope * (j - i), from the positions
    rel = kv_pos[:, None, :] - q_pos[:, :, None]
    slopes = jnp.asarray(alibi_slopes, _F32).reshape(kh, n // kh)
    logits = logits + slopes[None, :, :, None, None] * rel[:, None, None].astype(_F32)
  if relative_bias is not None:     # table[bucket(j - i)], [B, N, T, S]
    bias = relative_bias(q_pos, kv_pos).reshape(b, kh, n // kh, t, s)
    logits = logits + bias
  logits = _cap(logits, logits_soft_cap)
  visible = _visible(q_pos, kv_pos, lengths, num_tokens, local_window_size)
  sink = None if sinks is None else jnp.asarray(sinks, _F32).reshape(1, kh, n // kh, 1, 1)
  p = _softmax_rows(logits, visible[:, None, None], sink)
  out = jnp.einsum("bkgts,bskh->btkgh", p, value)
  return out.reshape(b, t, n, value.shape[-1]).astype(query.dtype)


def merged_kv_heads(key_pool, value_pool, head_dim: int, *, names=("key_pool", "value_pool"),
                    lead: str = "P, page") -> int:
  """Checks paged KV pools -- merged ``[P, page, K * H]`` / ``[P, page, K * h]`` or split
  ``[P, page, K, H]`` / ``[P, page, K, h]`` -- against the query's head size; returns ``K``.
  ``names`` / ``lead`` word the errors for other callers (a contiguous cache: ``B, S``)."""
  kn, vn = names
  if key_pool.ndim == value_pool.ndim == 4:
    if key_pool.shape[3] != head_dim or value_pool.shape[:3] != key_pool.shape[:3]:
      raise ValueError(f"`{kn}` {key_pool.shape} must be [{lead}, K, H={head_dim}] and "
                       f"`{vn}` {value_pool.shape} share its [{lead}, K].")
    return key_pool.shape[2]
  if key_pool.ndim == value_pool.ndim == 3:
    kh = key_pool.shape[2] // head_dim
    if (kh < 1 or key_pool.shape[2] % head_dim or value_pool.shape[:2] != key_pool.shape[:2]
        or value_pool.shape[2] % kh):
      raise ValueError(f"`{kn}` {key_pool.shape} must be [{lead}, K * H] with H={head_dim} and "
                       f"`{vn}` {value_pool.shape} [{lead}, K * h] on the same slots.")
    return kh
  raise ValueError(f"`{kn}` / `{vn}` must be [{lead}, K * H] / [{lead}, K * h] (or "
                   f"[{lead}, K, H] / [{lead}, K, h]), got {key_pool.shape}, "
                   f"{value_pool.shape}.")


def check_kv_scales(key_pool, value_pool, key_scale, value_scale, kv_heads: int, *,
                    names=("key_pool", "value_pool"), lead="P", width="page"):
  """Quantized pools: ``key_scale`` / ``value_scale`` fp32 ``[P, 1, K * page]`` (a
  ``PagedKVCache``'s) given exactly when the pools hold int8 / float8_e4m3fn codes
  (``jaxattn.ops.quantization.quantize_kv``).  ``names``, ``lead`` and ``width`` word the errors
  (a contiguous cache: ``[B, K, S]``, ``lead="B"``, ``width="S"``)."""
  kn, vn = names
  quant = [kv_quantized(x.dtype) for x in (key_pool, value_pool)]
  if quant[0] != quant[1] or quant[0] != (key_scale is not None) or (
      (key_scale is None) != (value_scale is None)):
    raise ValueError(f"`key_scale` and `value_scale` must be given exactly when `{kn}` and "
                     f"`{vn}` hold quantized codes (int8 / float8_e4m3fn); got {kn} "
                     f"{key_pool.dtype}, {vn} {value_pool.dtype}, key_scale given: "
                     f"{key_scale is not None}, value_scale given: {value_scale is not None}.")
  if not quant[0]:
    for name, x in ((kn, key_pool), (vn, value_pool)):
      check_float_array(name, x)
    return
  if width == "page":   # a pool's: [P, 1, K * page]
    want, form = (key_pool.shape[0], 1, kv_heads * key_pool.shape[1]), f"[{lead}, 1, K * page]"
  else:                 # a contiguous cache's: [B, K, S]
    want, form = (key_pool.shape[0], kv_heads, key_pool.shape[1]), f"[{lead}, K, {width}]"
  for name, x in (("key_scale", key_scale), ("value_scale", value_scale)):
    _check_scale_array(name, x, want, form)


def _check_scale_array(name: str, x, want: tuple, form: str) -> None:
  """``x``, a quantized cache's scales, is float32 of shape ``want`` (``form`` in words)."""
  if x.shape != want or x.dtype != jnp.float32:
    raise ValueError(f"`{name}` must be float32 {form} = {list(want)}, got "
                     f"{x.dtype}{list(x.shape)}.")


def _check_gqa(q, key_pool, value_pool, page_table, lengths, scale, logits_soft_cap,
               num_splits, window=None, num_tokens=None, key_scale=None, value_scale=None):
  """``paged_attention``'s argument checks (``q`` 4-D; ``window`` checked already); returns the
  KV heads ``K`` and the scale and soft-cap as floats (``_check_scale``)."""
  b, _, n, h = q.shape
  check_float_array("q", q)
  kh = merged_kv_heads(key_pool, value_pool, h)
  check_kv_scales(key_pool, value_pool, key_scale, value_scale, kh)
  if n % kh:
    raise ValueError(f"query heads N={n} must be a multiple of the KV heads K={kh}.")
  check_table(page_table, lengths, b, num_pages=key_pool.shape[0], page_size=key_pool.shape[1],
              window=window, t=q.shape[1] if num_tokens is None else num_tokens)
  check_num_splits(num_splits)
  return kh, _check_scale("scale", scale), _check_scale("logits_soft_cap", logits_soft_cap)


def page_view(cache: Array, page: int) -> tuple[Array, Int[Array, "B M"]]:
  """A contiguous cache ``[B, S, ...]`` as a pool of its own pages ``[B * S / page, page, ...]``
  (a reshape that splits ``S`` only: no data moves) and the identity page table ``[B, S / page]``
  that maps sequence ``b``'s logical page ``j`` to pool page ``b * S / page + j``."""
  b, m = cache.shape[0], cache.shape[1] // page
  return (cache.reshape((b * m, page) + cache.shape[2:]),
          jnp.arange(b * m, dtype=jnp.int32).reshape(b, m))


def paged_attention(
    query: Float[Array, "B T N H"] | Float[Array, "B N H"],
    key_pool: Float[Array, "P page KH"] | Float[Array, "P page K H"],
    value_pool: Float[Array, "P page Kh"] | Float[Array, "P page K h"],
    page_table: Int[Array, "B M"],
    lengths: Int[Array, "B"],
    *,
    scale: float | None = None,
    logits_soft_cap: float | None = None,
    num_splits: int | None = None,
    implementation: DecodeImplementation | None = None,
    interpret=None,
    num_tokens: Int[Array, "B"] | None = None,
    local_window_size: int | None = None,
    alibi_slopes: Float[Array, "N"] | None = None,
    relative_bias: RelativeBias | None = None,
    sinks: Float[Array, "N"] | None = None,
    key_scale: Float[Array, "P 1 Kpage"] | None = None,
    value_scale: Float[Array, "P 1 Kpage"] | None = None,
) -> Float[Array, "B T N h"] | Float[Array, "B N h"]:
  """Attention of each sequence's newest ``T`` tokens over its paged keys and values.

  Args:
    query: ``[B, T, N, H]`` or ``[B, N, H]`` (one token), ``N % K == 0`` (GQA: head ``n`` reads
      KV head ``n // (N / K)``).
    key_pool: ``[P, page, K * H]`` and value_pool ``[P, page, K * h]`` (a ``PagedKVCache``'s
      pools: the KV heads of a token side by side in one row, which the TPU kernel reads in
      place), or ``[P, page, K, H]`` / ``[P, page, K, h]`` (read in place too; but on TPU, XLA's
      default layout for such a pool with heads of 64 or one KV head is not row-major, and XLA
      then re-tiles the pool before the kernel on every call).
    page_table: ``[B, M]`` int32, pool page of each logical page (``-1`` = none).
    lengths: ``[B]`` int32 tokens held per sequence, the new ones included; 0 gives zeros.
    scale: logits scale, default ``1 / sqrt(H)``.
    logits_soft_cap: ``c`` in ``c * tanh(logits / c)`` (Gemma 2), applied after the scale.
    num_splits: split-KV partitions (flash-decoding) for the kernel: each covers ``M / num_splits``
      pages and yields a partial (output, log-sum-exp), merged in a combine step.  None: for
      ``"pallas_tpu"`` 1 (no combine pass), but 2 at batch 1 (per device) on a megacore chip
      (TPU v4, v5p) -- one partition per TensorCore, which the kernel's leading grid axis then
      is; for ``"pallas_gpu"``
      ``clamp(ceil(2 * SMs / programs_per_split), 1, max(1, M * page // 256))`` (about two
      programs per multiprocessor, partitions of 256+ tokens; ``programs_per_split = B * K *
      ceil(T * G / 64)`` here).  Ignored by ``"xla"``.  Both kernels take the query rows in
      blocks (VMEM / a Triton tile), so a long prefill through the cache runs in them too.
    implementation: ``None`` (``"pallas_tpu"`` on TPU, else ``"xla"``), ``"xla"``,
      ``"pallas_tpu"`` or ``"pallas_gpu"``.
    interpret: for the Pallas kernels: None (interpret unless on their hardware), a bool, or (TPU)
      a ``pltpu.InterpretParams``.
    num_tokens: ``[B]`` int, ragged chunks (continuous batching): sequence ``b``'s queries are
      its first ``num_tokens[b]`` rows of ``T`` (its newest tokens, already counted in
      ``lengths``); the rows after them return zeros.  None: all ``T``.
    local_window_size: a sliding window ``w`` (Mistral, Gemma's local layers): a query at
      position ``p`` sees keys ``p - w .. p`` only.  The kernels neither compute nor fetch the
      pages before a row block's window (their grids span the window's pages, not the
      sequence's).  None: every earlier key.
    alibi_slopes: ``[N]`` ALiBi slopes: ``slope * (j - i)`` added to the scaled logits (before
      the soft-cap), from the key's and the query's positions, as ``dot_product_attention``.
    relative_bias: a ``RelativeBias`` (T5's learned buckets), added like the slopes.  The
      ``"xla"`` implementation only (None picks it; a kernel name is refused).
    sinks: ``[N]`` attention-sink logits, as ``dot_product_attention``'s (the kernels add them
      in their combine step, as one more split-KV partition).
    key_scale: with int8 / float8_e4m3fn pools (a quantized ``PagedKVCache``), their fp32
      scales ``[P, 1, K * page]`` (one per token and KV head, head ``k``'s at lanes
      ``[k * page, (k + 1) * page)``; ``value_scale`` the values'): key ``j`` is
      ``codes_j * key_scale_j``.  The kernels read the codes (half a bf16 pool's bytes)
      and fold the scales in: ``s_k (q . k)`` and ``(p * s_v) @ v``.

  Returns:
    ``[B, T, N, h]`` (``[B, N, h]`` for a 3-D query) in the query dtype.
  """
  q, squeeze = _as_4d(query, "query")
  h = q.shape[3]
  window = check_window(local_window_size)
  kh, scale, logits_soft_cap = _check_gqa(q, key_pool, value_pool, page_table, lengths, scale,
                                          logits_soft_cap, num_splits, window, num_tokens,
                                          key_scale, value_scale)
  extra_q = {} if key_scale is None else dict(key_scale=key_scale, value_scale=value_scale)
  num_tokens = check_num_tokens(num_tokens, q.shape[0], q.shape[1], lengths)
  extra = dict(local_window_size=window, alibi_slopes=check_slopes(alibi_slopes, q.shape[2]),
               **extra_q)
  relative_bias = check_relative_bias(relative_bias, q.shape[2])
  if relative_bias is not None:
    if implementation not in (None, "xla"):
      raise ValueError(f"`relative_bias` (a learned relative-position bias) runs on "
                       f"implementation='xla' only, got implementation={implementation!r}; the "
                       f"decode kernels take ALiBi as `alibi_slopes`.")
    implementation = "xla"
  if sinks is not None:
    from jaxattn.ops.attention import check_sinks  # noqa: PLC0415 (import cycle)
    sinks = check_sinks(sinks, q.shape[2])
  scale = 1.0 / math.sqrt(h) if scale is None else scale
  page_table, lengths = page_table.astype(jnp.int32), lengths.astype(jnp.int32)
  impl = (resolve_implementation(implementation, page_size=key_pool.shape[1]) if q.shape[1]
          else "xla")                                                     # T = 0: empty
  if impl != "pallas_tpu":  # the XLA reference and the GPU kernel index [P, page, K, H]
    key_pool = key_pool.reshape(key_pool.shape[:2] + (kh, h))
    value_pool = value_pool.reshape(value_pool.shape[:2] + (kh, -1))
  if impl == "xla":
    out = paged_attention_xla(q, key_pool, value_pool, page_table, lengths, scale=scale,
                              logits_soft_cap=logits_soft_cap, num_tokens=num_tokens,
                              relative_bias=relative_bias, sinks=sinks, **extra)
    return out[:, 0] if squeeze else out
  if num_tokens is not None:
    q = align_queries(q, num_tokens)
  if impl == "pallas_gpu":
    from pallas_kernels.decode_attention import paged_attention_gpu  # noqa: PLC0415 (optional)
    out = paged_attention_gpu(q, key_pool, value_pool, page_table, lengths, scale=scale,
                              logits_soft_cap=logits_soft_cap, num_splits=num_splits,
                              interpret=interpret, sinks=sinks, **extra)
  else:
    from pallas_kernels.decode_attention import paged_attention_tpu  # noqa: PLC0415 (optional)
    out = paged_attention_tpu(q, key_pool, value_pool, page_table, lengths, scale=scale,
                              logits_soft_cap=logits_soft_cap, num_splits=num_splits,
                              interpret=interpret, sinks=sinks, **extra)
  if num_tokens is not None:
    out = unalign_queries(out, num_tokens)
  return out[:, 0] if squeeze else out


def cache_attention(
    query: Float[Array, "B T N H"] | Float[Array, "B N H"],
    key: Float[Array, "B S K H"],
    value: Float[Array, "B S K h"],
    lengths: Int[Array, "B"],
    *,
    scale: float | None = None,
    logits_soft_cap: float | None = None,
    num_splits: int | None = None,
    implementation: DecodeImplementation | None = None,
    interpret=None,
    local_window_size: int | None = None,
    alibi_slopes: Float[Array, "N"] | None = None,
    sinks: Float[Array, "N"] | None = None,
    key_scale: Float[Array, "B K S"] | None = None,
    value_scale: Float[Array, "B K S"] | None = None,
) -> Float[Array, "B T N h"] | Float[Array, "B N h"]:
  """``paged_attention`` over a contiguous cache (a ``KVCache``'s ``key`` / ``value``).

  ``key [B, S, K * H]`` / ``value [B, S, K * h]`` (a ``KVCache``'s rows; or split,
  ``[B, S, K, H]`` / ``[B, S, K, h]``) hold ``lengths[b]`` tokens of sequence ``b`` (the new ones
  included); the ``T`` queries are its last ``T`` tokens, exactly as in ``paged_attention``.  The
  cache is read as pages of itself (``page_view``: a reshape that only splits ``S``, and an
  identity page table), so the decode kernels serve it:
  ``"pallas_tpu"`` (the default on TPU; ``S`` a multiple of 16) reads each valid page once, in
  place, where flash attention's head-major layout costs a transpose of the whole cache per step;
  ``"pallas_gpu"`` likewise; ``"xla"`` (the default elsewhere) is ``paged_attention_xla`` with one
  page per sequence.  Arguments as in ``paged_attention``; a quantized ``KVCache``'s codes come
  with ``key_scale`` / ``value_scale [B, K, S]`` (its scales).
  """
  q, squeeze = _as_4d(query, "query")
  b, t, n, h = q.shape
  kh = merged_kv_heads(key, value, h, names=("key", "value"), lead="B, S")
  check_kv_scales(key, value, key_scale, value_scale, kh, names=("key", "value"), lead="B",
                  width="S")
  if key.shape[0] != b:
    raise ValueError(f"`key` {key.shape} must hold the query's B={b} sequences.")
  impl = resolve_implementation(implementation) if t else "xla"           # T = 0: empty
  s = key.shape[1]
  impl, page = _view_pages(impl, implementation, s,
                           lambda: view_page_size(s, cache_row_bytes(key, value)))
  key_pages, table = page_view(key, page)
  value_pages, _ = page_view(value, page)
  scales = {} if key_scale is None else dict(key_scale=scale_page_view(key_scale, page),
                                              value_scale=scale_page_view(value_scale, page))
  extra = dict(local_window_size=local_window_size, alibi_slopes=alibi_slopes, sinks=sinks)
  if impl != "pallas_tpu":
    out = paged_attention(q, key_pages, value_pages, table, lengths, scale=scale,
                          logits_soft_cap=logits_soft_cap, num_splits=num_splits,
                          implementation=impl, interpret=interpret, **extra, **scales)
    return out[:, 0] if squeeze else out
  # The same checks as paged_attention, then the kernel on the 4-D cache (its shard_map splits
  # the cache over batch; the page view is taken on each device).
  _, scale, logits_soft_cap = _check_gqa(q, key_pages, value_pages, table, lengths, scale,
                                         logits_soft_cap, num_splits, **scales)
  extra = dict(local_window_size=check_window(local_window_size),
               alibi_slopes=check_slopes(alibi_slopes, n), key_scale=key_scale,
               value_scale=value_scale)
  if sinks is not None:
    from jaxattn.ops.attention import check_sinks  # noqa: PLC0415 (import cycle)
    extra["sinks"] = check_sinks(sinks, n)
  from pallas_kernels.decode_attention.tpu import contiguous_attention_tpu  # noqa: PLC0415
  out = contiguous_attention_tpu(q, key, value, lengths.astype(jnp.int32),
                                 scale=1.0 / math.sqrt(h) if scale is None else scale,
                                 logits_soft_cap=logits_soft_cap, num_splits=num_splits,
                                 interpret=interpret, **extra)
  return out[:, 0] if squeeze else out


def scale_page_view(scales: Float[Array, "B K S"], page: int) -> Float[Array, "BM 1 Kpage"]:
  """A contiguous quantized cache's scales ``[B, K, S]`` as the pages of ``page_view``, in a
  ``PagedKVCache``'s layout ``[B * S / page, 1, K * page]`` (a transpose of the scales only, 4
  bytes per token and head)."""
  b, kh, s = scales.shape
  m = s // page
  return scales.reshape(b, kh, m, page).transpose(0, 2, 1, 3).reshape(b * m, 1, kh * page)


def _mla_queries(q_latent, q_rope):
  """``(q_latent, q_rope)`` as 4-D ``[B, T, N, .]`` arrays, checked against each other, and
  whether they came 3-D (one token)."""
  ql, squeeze = _as_4d(q_latent, "q_latent")
  qr, _ = _as_4d(q_rope, "q_rope")
  if qr.shape[:3] != ql.shape[:3] or q_rope.ndim != q_latent.ndim:
    raise ValueError(f"`q_rope` {q_rope.shape} must share [B, (T,) N] with `q_latent` "
                     f"{q_latent.shape}.")
  return ql, qr, squeeze


def _check_mla_call(page_table, lengths, batch, page_size, scale, num_splits,
                    num_pages=None) -> float:
  """The table, scale and split checks of the MLA decode ops; returns the scale as a float."""
  check_table(page_table, lengths, batch, num_pages=num_pages, page_size=page_size)
  if scale is None:
    raise ValueError("`scale` is required for MLA (1 / sqrt(P + R), times the YaRN mscale^2).")
  check_num_splits(num_splits)
  return _check_scale("scale", scale)


def _check_latent_scale(c_kv_pool, c_kv_scale) -> bool:
  """A quantized latent pool: ``c_kv_scale [P, 1, page]`` fp32 given exactly when ``c_kv_pool``
  holds int8 / float8_e4m3fn codes (a quantized ``PagedLatentCache``); else ``c_kv_pool`` must
  be a float array.  Returns whether the pool is quantized."""
  quant = kv_quantized(c_kv_pool.dtype)
  if c_kv_scale is None:
    if quant:
      raise ValueError(f"`c_kv_pool` must be a floating-point array, or int8 / float8_e4m3fn "
                       f"codes given with their `c_kv_scale` [P, 1, page] (a quantized latent "
                       f"cache); got {c_kv_pool.dtype} codes without `c_kv_scale`.")
    check_float_array("c_kv_pool", c_kv_pool)
    return False
  if not quant:
    raise ValueError(f"`c_kv_scale` must be given only with quantized codes in `c_kv_pool` "
                     f"(int8 / float8_e4m3fn); got c_kv_pool {c_kv_pool.dtype}.")
  _check_scale_array("c_kv_scale", c_kv_scale, (c_kv_pool.shape[0], 1, c_kv_pool.shape[1]),
                     "[P, 1, page]")
  return True


def _zero_pad_columns(x, width: int):
  """``x`` with zero columns appended on its last axis up to ``width`` (the stored ``k^R``
  width, which the kernels read as it is)."""
  pad = width - x.shape[-1]
  return jnp.pad(x, ((0, 0),) * (x.ndim - 1) + ((0, pad),)) if pad > 0 else x


def cache_mla_decode(
    q_latent: Float[Array, "B T N C"] | Float[Array, "B N C"],
    q_rope: Float[Array, "B T N R"] | Float[Array, "B N R"],
    kv: Float[Array, "B S W"],
    lengths: Int[Array, "B"],
    *,
    scale: float,
    num_splits: int | None = None,
    implementation: DecodeImplementation | None = None,
    interpret=None,
    k_rope: Float[Array, "B S R_p"] | None = None,
    c_kv_scale: Float[Array, "B 1 S"] | None = None,
) -> Float[Array, "B T N C"] | Float[Array, "B N C"]:
  """``paged_mla_decode`` over a contiguous latent cache (a ``LatentCache``'s ``kv`` buffer).

  ``kv [B, S, C + R_p]`` holds rows ``[c_KV | k^R | zeros]`` (``R_p >= R``; the ``LatentCache``
  layout) of ``lengths[b]`` tokens; the ``T`` queries are each sequence's last ``T`` tokens, as in
  ``paged_mla_decode``.  ``"pallas_tpu"`` (the default on TPU; ``S`` a multiple of 16) runs the
  dense MLA decode kernel over the buffer read as pages of itself, in place when ``R_p`` is a
  multiple of 128 and ``C`` of ``R_p`` (what a ``LatentCache`` allocates on TPU); ``"pallas_gpu"``
  and ``"xla"`` (the default elsewhere) run ``paged_mla_decode`` on the two column ranges.  The
  columns past ``R`` must be zero, as the cache keeps them.  Other arguments as in
  ``paged_mla_decode``.

  A quantized ``LatentCache`` (its ``kv``, ``k_rope_buf`` and ``c_kv_scale``): ``kv [B, S, C]``
  int8 / float8_e4m3fn codes of ``c_KV``, ``k_rope [B, S, R_p]`` the float rotated keys and
  ``c_kv_scale [B, 1, S]`` fp32 one scale per token.  The three are read as pages of themselves
  (the scales as ``[B * S / page, 1, page]``, a reshape) into ``paged_mla_decode(...,
  c_kv_scale=)``; ``"pallas_tpu"`` runs the dense kernel on them in place.  ``k_rope`` alone
  (float ``kv [B, S, C]``) is an unquantized cache kept in two arrays.
  """
  ql, qr, squeeze = _mla_queries(q_latent, q_rope)
  b, t, n, c = ql.shape
  r = qr.shape[3]
  if k_rope is None:
    if c_kv_scale is not None:
      raise ValueError("`c_kv_scale` (a quantized latent cache) comes with `k_rope`, the cache's "
                       "separate float k^R buffer [B, S, R_p].")
    if kv.ndim != 3 or kv.shape[0] != b or kv.shape[2] < c + r:
      raise ValueError(f"`kv` must be [B={b}, S, C + R_p] with C={c} and R_p >= R={r}, got "
                       f"shape {kv.shape}.")
  else:
    if kv.ndim != 3 or kv.shape[0] != b or kv.shape[2] != c:
      raise ValueError(f"`kv` (with a separate `k_rope`) must be [B={b}, S, C={c}], got shape "
                       f"{kv.shape}.")
    if k_rope.ndim != 3 or k_rope.shape[:2] != kv.shape[:2] or k_rope.shape[2] < r:
      raise ValueError(f"`k_rope` must be [B, S, R_p] = {kv.shape[:2]} + (R_p,) with R_p >= "
                       f"R={r}, got shape {k_rope.shape}.")
    if c_kv_scale is not None:
      _check_scale_array("c_kv_scale", c_kv_scale, (b, 1, kv.shape[1]), "[B, 1, S]")
  impl = resolve_implementation(implementation) if t else "xla"           # T = 0: empty
  s = kv.shape[1]
  impl, page = _view_pages(impl, implementation, s,
                           lambda: latent_view_page_size(kv, k_rope, c_kv_scale))
  pages, table = page_view(kv, page)
  if k_rope is not None:
    scales = None if c_kv_scale is None else c_kv_scale.reshape(b * (s // page), 1, page)
    if impl != "pallas_tpu":
      out = paged_mla_decode(ql, qr, pages, page_view(k_rope, page)[0], table, lengths,
                             scale=scale, num_splits=num_splits, implementation=impl,
                             interpret=interpret, c_kv_scale=scales)
      return out[:, 0] if squeeze else out
    _check_latent_scale(pages, scales)
    scale = _check_mla_call(table, lengths, b, page, scale, num_splits)
    qr = _zero_pad_columns(qr, k_rope.shape[2])                      # to the stored k^R width
    from pallas_kernels.mla_decode.tpu import contiguous_mla_decode_tpu  # noqa: PLC0415
    out = contiguous_mla_decode_tpu(ql, qr, kv, lengths.astype(jnp.int32), scale=scale,
                                    num_splits=num_splits, interpret=interpret, k_rope=k_rope,
                                    c_kv_scale=c_kv_scale)
    return out[:, 0] if squeeze else out
  if impl != "pallas_tpu":
    out = paged_mla_decode(ql, qr, pages[..., :c], pages[..., c:], table, lengths, scale=scale,
                           num_splits=num_splits, implementation=impl, interpret=interpret)
    return out[:, 0] if squeeze else out
  # paged_mla_decode's checks on the page view, then the kernel on the 3-D buffer (its shard_map
  # splits the cache over batch; the page view is taken on each device).
  scale = _check_mla_call(table, lengths, b, page, scale, num_splits)
  qr = _zero_pad_columns(qr, kv.shape[2] - c)                      # to the stored k^R width
  from pallas_kernels.mla_decode.tpu import contiguous_mla_decode_tpu  # noqa: PLC0415
  out = contiguous_mla_decode_tpu(ql, qr, kv, lengths.astype(jnp.int32), scale=scale,
                                  num_splits=num_splits, interpret=interpret)
  return out[:, 0] if squeeze else out


def _view_pages(impl: str, implementation, length: int, page_size) -> tuple[str, int]:
  """``(implementation, page)`` for reading a contiguous cache of ``length`` slots: the XLA path
  reads it whole; a kernel reads it as pages of ``page_size()`` tokens, and where no page size
  fits, automatic dispatch (``implementation`` None) takes the XLA path, an explicit kernel
  raises."""
  page = length if impl == "xla" else page_size()
  if page is None and implementation is None:
    return "xla", length
  if page is None:
    raise ValueError(f"implementation={impl!r} reads the cache as pages of 16 or more tokens: "
                     f"its length S={length} must be a multiple of 16 (or use "
                     f"implementation='xla').")
  return impl, page


def view_page_size(length: int, row_bytes: int = 0) -> int | None:
  """Tokens per page when a contiguous cache of ``length`` slots is read as pages of itself: the
  largest of 512, 256, ..., 16 that divides it and keeps one page of ``row_bytes`` per token
  (keys + values) within 2 MiB -- the kernels double-buffer it, and TPU v5e's default scoped
  VMEM is 16 MiB (32 KV heads of 128 in bf16: 128 tokens).  None: no size divides ``length``."""
  pages = [p for p in (512, 256, 128, 64, 32, 16) if length % p == 0]
  fitting = [p for p in pages if p * row_bytes <= _PAGE_BUDGET]
  return (fitting or pages[-1:] or [None])[0]


_PAGE_BUDGET = 2 << 20


def cache_row_bytes(*caches) -> int:
  """Bytes of one token's row across ``caches`` ``[B, S, ...]``."""
  return sum(math.prod(c.shape[2:]) * c.dtype.itemsize for c in caches)


def latent_view_page_size(kv, k_rope=None, c_kv_scale=None) -> int | None:
  """``view_page_size`` of a contiguous latent cache: its rows ``kv`` (and, apart from them, the
  ``k_rope`` buffer and a quantized cache's 4-byte scale per token)."""
  row_bytes = cache_row_bytes(kv, *(() if k_rope is None else (k_rope,)))
  return view_page_size(kv.shape[1], row_bytes + (0 if c_kv_scale is None else 4))


def sparse_rows(indices, page_table, lengths, page_size):
  """``(valid [B, T, k], page [B, T, k], offset [B, T, k])`` of selected positions ``indices``:
  a position is valid when ``0 <= i < lengths[b]``."""
  m = page_table.shape[1]
  valid = (indices >= 0) & (indices < lengths[:, None, None])
  safe = jnp.where(valid, indices, 0)
  logical = jnp.clip(safe // page_size, 0, m - 1)
  page = jnp.take_along_axis(page_table[:, None, :], logical, axis=2)
  return valid & (page >= 0), jnp.maximum(page, 0), safe % page_size


@jax.jit
def paged_mla_decode_xla(q_latent, q_rope, c_kv_pool, k_rope_pool, page_table, lengths, *, scale,
                         indices=None, num_tokens=None, c_kv_scale=None):
  """The reference (``q_*`` are ``[B, T, N, .]``, ``indices`` ``[B, T, k]`` or None,
  ``num_tokens`` ``[B]`` or None): gather the latent rows, fp32 softmax over
  ``q~ . c + q^R . k^R``, weighted sum of ``c``.  ``c_kv_scale [P, 1, page]`` with a quantized
  latent pool: the gathered codes times their scales."""
  b, t, n, c = q_latent.shape
  ql, qr = q_latent.astype(_F32), q_rope.astype(_F32)
  k_rope_pool = k_rope_pool[..., :q_rope.shape[3]]                  # a padded pool: R columns
  if indices is None:
    table = _table(page_table, lengths, c_kv_pool.shape[1])
    ckv = gather_pages(c_kv_pool, table).astype(_F32)               # [B, S, C]
    if c_kv_scale is not None:                                      # codes: times [B, S, 1]
      ckv = ckv * gather_pages(split_scales(c_kv_scale, 1), table)
    kr = gather_pages(k_rope_pool, table).astype(_F32)              # [B, S, R]
    logits = (jnp.einsum("btnc,bsc->btns", ql, ckv)
              + jnp.einsum("btnr,bsr->btns", qr, kr)) * scale
    visible = _visible(_query_positions(t, lengths, num_tokens),
                       jnp.arange(ckv.shape[1], dtype=jnp.int32)[None], lengths, num_tokens)
    p = _softmax_rows(logits, visible[:, :, None])
    out = jnp.einsum("btns,bsc->btnc", p, ckv)
  else:
    valid, page, off = sparse_rows(indices, page_table, lengths, c_kv_pool.shape[1])
    if num_tokens is not None:                                      # padding queries: nothing
      valid &= jnp.arange(t, dtype=jnp.int32)[None, :, None] < num_tokens[:, None, None]
    keep = valid[..., None]                                         # unselected rows: zeros
    rows = c_kv_pool[page, off].astype(_F32)                        # [B, T, k, C]
    if c_kv_scale is not None:                                      # codes: times their scales
      rows = rows * c_kv_scale[page, 0, off][..., None]
    ckv = jnp.where(keep, rows, 0.0)
    kr = jnp.where(keep, k_rope_pool[page, off].astype(_F32), 0.0)  # [B, T, k, R]
    logits = (jnp.einsum("btnc,btjc->btnj", ql, ckv)
              + jnp.einsum("btnr,btjr->btnj", qr, kr)) * scale
    p = _softmax_rows(logits, valid[:, :, None, :])
    out = jnp.einsum("btnj,btjc->btnc", p, ckv)
  return out.astype(q_latent.dtype)


def paged_mla_decode(
    q_latent: Float[Array, "B T N C"] | Float[Array, "B N C"],
    q_rope: Float[Array, "B T N R"] | Float[Array, "B N R"],
    c_kv_pool: Float[Array, "P page C"],
    k_rope_pool: Float[Array, "P page R"],
    page_table: Int[Array, "B M"],
    lengths: Int[Array, "B"],
    *,
    scale: float,
    indices: Int[Array, "B k"] | Int[Array, "B T k"] | None = None,
    num_splits: int | None = None,
    implementation: DecodeImplementation | None = None,
    interpret=None,
    num_tokens: Int[Array, "B"] | None = None,
    c_kv_scale: Float[Array, "P 1 page"] | None = None,
) -> Float[Array, "B T N C"] | Float[Array, "B N C"]:
  """Absorbed MLA attention over a paged latent cache; the output stays in latent space.

  Args:
    q_latent: ``[B, T, N, C]`` or ``[B, N, C]``: ``q^C_i (W_up^K_i)^T``, the content query mapped
      into latent space.
    q_rope: ``[B, T, N, R]`` / ``[B, N, R]``: the rotated position query.
    c_kv_pool: ``[P, page, C]``; k_rope_pool: ``[P, page, R_p]`` with ``R_p >= R`` (a
      ``PagedLatentCache``'s pools; on TPU its ``k^R`` pool is zero-padded to 128 columns so that
      the kernels read it in place).  Columns past ``R`` must be zero, as the cache keeps them:
      the kernels multiply them by a zero-padded ``q_rope``; the ``"xla"`` path drops them.
    page_table, lengths: as in ``paged_attention``.
    scale: the softmax scale (MLA's is ``1 / sqrt(P + R)``, not derivable from these shapes).
    indices: sparse (DSA) mode: ``[B, k]`` (or ``[B, T, k]``) selected positions per query,
      ``-1`` = none; positions outside ``[0, lengths[b])`` are ignored too.  Causality is the
      selector's job (the lightning indexer masks future keys), as in
      ``jaxattn.ops.sparse.sparse_mla_attention``.  None: dense causal attention.
    num_splits, implementation, interpret: as in ``paged_attention`` (``num_splits`` applies to
      the dense mode, and for ``"pallas_gpu"`` to the sparse mode too, over the ``k`` selected
      slots; there ``programs_per_split = B * ceil(T * N / 16)`` dense, ``B * T * ceil(N / 16)``
      sparse).
    num_tokens: ragged chunks, as in ``paged_attention`` (sparse mode: the padding rows'
      selections are ignored).
    c_kv_scale: with an int8 / float8_e4m3fn ``c_kv_pool`` (a quantized ``PagedLatentCache``),
      its fp32 scales ``[P, 1, page]``, one per token: row ``j`` is ``codes_j * s_j``.  ``c_KV``
      is both the key's latent part and the value, so the logits are
      ``scale * (s_j (q~ . c_j) + q^R . k^R_j)`` and the output ``(p * s) @ c``.  The
      ``"pallas_tpu"`` dense kernel and the ``"pallas_gpu"`` kernels (dense and sparse) read the
      codes and fold the scales in; the ``"xla"`` path dequantizes the gathered rows.  The TPU
      sparse kernel takes no scales (an explicit request for it raises ``ValueError``).

  Returns:
    ``[B, T, N, C]`` (``[B, N, C]`` for 3-D queries): ``sum_s p_s c_s`` per head, query dtype.
  """
  ql, qr, squeeze = _mla_queries(q_latent, q_rope)
  b, t, n, c = ql.shape
  r = qr.shape[3]
  for name, x in (("q_latent", ql), ("q_rope", qr), ("k_rope_pool", k_rope_pool)):
    check_float_array(name, x)
  if c_kv_pool.ndim != 3 or c_kv_pool.shape[2] != c:
    raise ValueError(f"`c_kv_pool` must be [P, page, C={c}], got {c_kv_pool.shape}.")
  if (k_rope_pool.ndim != 3 or k_rope_pool.shape[:2] != c_kv_pool.shape[:2]
      or k_rope_pool.shape[2] < r):
    raise ValueError(f"`k_rope_pool` must be [P, page, R_p] = {c_kv_pool.shape[:2]} + (R_p,) "
                     f"with R_p >= R={r}, got {k_rope_pool.shape}.")
  quantized = _check_latent_scale(c_kv_pool, c_kv_scale)
  scale = _check_mla_call(page_table, lengths, b, c_kv_pool.shape[1], scale, num_splits,
                          num_pages=c_kv_pool.shape[0])
  num_tokens = check_num_tokens(num_tokens, b, t, lengths)
  if indices is not None:
    if squeeze and indices.ndim == 2:
      indices = indices[:, None]
    if indices.ndim != 3 or indices.shape[:2] != (b, t) or indices.shape[2] < 1:
      want = f"[B={b}, k]" if squeeze else f"[B={b}, T={t}, k]"
      raise ValueError(f"`indices` must be {want} with k >= 1, got shape {indices.shape}.")
    check_int_array("indices", indices)
    indices = indices.astype(jnp.int32)
  page_table, lengths = page_table.astype(jnp.int32), lengths.astype(jnp.int32)
  impl = (resolve_implementation(implementation, sparse=indices is not None,
                                 page_size=c_kv_pool.shape[1]) if t
          else "xla")                                                     # T = 0: empty
  if quantized and impl == "pallas_tpu" and indices is not None:
    raise ValueError(f"implementation={impl!r} has no sparse (`indices`) MLA kernel for a "
                     f"quantized latent cache (`c_kv_scale` given, c_kv_pool "
                     f"{c_kv_pool.dtype}); use implementation='xla'.")
  if impl != "xla":  # the kernels read the padded pool as it is stored
    qr = _zero_pad_columns(qr, k_rope_pool.shape[2])
  if impl == "xla":
    out = paged_mla_decode_xla(ql, qr, c_kv_pool, k_rope_pool, page_table, lengths, scale=scale,
                               indices=indices, num_tokens=num_tokens, c_kv_scale=c_kv_scale)
    return out[:, 0] if squeeze else out
  if num_tokens is not None:
    ql, qr = align_queries(ql, num_tokens), align_queries(qr, num_tokens)
    if indices is not None:
      indices = align_queries(indices, num_tokens, fill=-1)
  if impl == "pallas_gpu":
    from pallas_kernels.mla_decode import paged_mla_decode_gpu  # noqa: PLC0415 (optional)
    out = paged_mla_decode_gpu(ql, qr, c_kv_pool, k_rope_pool, page_table, lengths, scale=scale,
                               indices=indices, num_splits=num_splits, interpret=interpret,
                               c_kv_scale=c_kv_scale)
  else:
    from pallas_kernels.mla_decode import paged_mla_decode_tpu  # noqa: PLC0415 (optional)
    out = paged_mla_decode_tpu(ql, qr, c_kv_pool, k_rope_pool, page_table, lengths, scale=scale,
                               indices=indices, num_splits=num_splits, interpret=interpret,
                               c_kv_scale=c_kv_scale)
  if num_tokens is not None:
    out = unalign_queries(out, num_tokens)
  return out[:, 0] if squeeze else out


__all__ = ["DECODE_IMPLEMENTATIONS", "DECODE_MAX_T", "align_queries", "cache_attention",
           "cache_mla_decode", "cache_row_bytes", "check_num_tokens", "merged_kv_heads",
           "module_decode_implementation", "paged_attention", "paged_attention_xla",
           "paged_mla_decode", "paged_mla_decode_xla",
           "page_view", "resolve_implementation", "sparse_rows", "tpu_kernel_requested",
           "unalign_queries", "view_page_size"]
