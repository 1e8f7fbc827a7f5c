"""Paged decode caches: fixed-size pages in one pool, a page table per sequence, ragged lengths.

A contiguous cache (``KVCache``, ``LatentCache``) reserves ``max_len`` slots for every sequence.
A paged cache keeps one pool of ``P`` pages of ``page_size`` tokens per cache kind and hands pages
to sequences as they grow, so memory follows the tokens actually held and sequences of different
lengths share one batch:

    pool          [P, page, ...]      KV: key [P, page, K * H] and value [P, page, K * h];
                                      MLA: c_kv [P, page, C] and k_rope [P, page, R_p]
                                      (R_p: R rounded up to 128 lanes on TPU, see below);
                                      DSA indexer: keys [P, page, d_I] (int8/fp8/fp32) + scales
    page_table    [B, max_pages]      int32: logical page j of sequence b lives in pool page
                                      page_table[b, j]; -1 = not allocated
    lengths       [B]                 int32: tokens held by each sequence (ragged; 0 = empty)

Token ``s`` of sequence ``b`` lives at ``pool[page_table[b, s // page], s % page]``.

Allocation is *functional and jit-compatible*: the free pages form a stack (``free_pages [P]``,
the first ``num_free`` entries free) that is part of the pytree, so ``append`` (which pops pages
for sequences that cross a page boundary) and ``free`` (which pushes a finished sequence's pages
back) are pure array updates that run inside ``jax.jit`` and return a new cache.  Running out of
pages cannot raise inside jit: with concrete values (eager calls) ``append`` raises ``ValueError``;
under jit, check ``cache.table.pages_needed(t) <= cache.table.num_free`` on the host between
steps (tokens that found no page are dropped and the sequence's length does not count them).

TPU layout of the rotated-key pool: XLA lays out a ``[P, page, 64]`` array with its page axis
minor (a 64-wide minor axis would fill half of each 128-lane tile), so a kernel reading pages of
it pays a relayout copy of the whole pool on every decode step (``experiments/tpu_compile_check``).
``PagedLatentCache`` therefore stores ``k^R`` zero-padded to ``R_p = ceil(R / 128) * 128`` columns
on TPU (``rope_align``; exact ``R`` elsewhere): the pool is row-major, the kernels read it in place
(their queries are zero-padded to match), and the cache holds ``C + R_p`` instead of ``C + R``
values per token (640 instead of 576 for DeepSeek-V3).

One cache holds one layer.  A model with many layers appends the same token counts to each layer's
cache, so their page tables stay identical; sharing one table across layers is an optimization
left to the serving loop.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from jaxattn.checks import check_int_array, is_int
from jaxattn.ops.quantization import check_cache_dtype, kv_quantized, quantize_kv

_I32 = jnp.int32
_LANES = 128


def default_rope_align() -> int:
  """Column multiple of the stored ``k^R`` pool: 128 (the TPU lane width) on TPU, else 1."""
  return _LANES if jax.default_backend() == "tpu" else 1


def stored_rope_width(qk_rope_head_dim: int, rope_align: int) -> int:
  """Columns a latent cache stores ``k^R`` in: ``R`` rounded up to a multiple of ``rope_align``
  (the extra columns are zeros)."""
  return -(-qk_rope_head_dim // rope_align) * rope_align


def _check_positive(where, **values):
  for name, v in values.items():
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
      raise ValueError(f"{where}: `{name}` must be a positive int, got {v!r}.")


def _concrete(*xs) -> bool:
  return not any(isinstance(x, jax.core.Tracer) for x in xs)


def nan_where_dropped(y, old_lengths: Int[Array, "B"], new_lengths: Int[Array, "B"], t: int,
                      num_tokens: Int[Array, "B"] | None = None):
  """``y [B, ...]``, a layer's output from a step that appended ``t`` tokens per sequence
  (``num_tokens[b]`` of them for a ragged chunk, ``y [B, T, ...]`` then zero past them), NaN in
  the rows whose tokens did not all find a page.

  Eager ``append`` raises when pages run out; under ``jit`` it cannot, drops the tokens and leaves
  the length short, so the step's queries attend a shifted prefix: finite, silently wrong
  outputs.  NaN rows show it instead, as ``jaxattn.cache.nan_past_capacity`` does for the
  contiguous caches."""
  if num_tokens is not None:     # the padding queries of a ragged chunk: zeros (an o_proj bias)
    real = jnp.arange(y.shape[1], dtype=_I32)[None, :] < num_tokens[:, None]
    y = jnp.where(real.reshape(real.shape + (1,) * (y.ndim - 2)), y, jnp.zeros((), y.dtype))
    t = num_tokens
  if not isinstance(new_lengths, jax.core.Tracer):
    return y
  short = (new_lengths - old_lengths) < t
  return jnp.where(short.reshape((-1,) + (1,) * (y.ndim - 1)), jnp.asarray(jnp.nan, y.dtype), y)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PageTable:
  """Which pool pages each sequence owns, how long each sequence is, and the free-page stack.

  ``page_table [B, max_pages]`` int32 (-1 = unallocated), ``lengths [B]`` int32,
  ``free_pages [P]`` int32 (entries ``[0, num_free)`` are the free page ids, the rest stale),
  ``num_free`` int32 scalar.  ``page_size`` is static metadata.
  """

  page_table: Int[Array, "B M"]
  lengths: Int[Array, "B"]
  free_pages: Int[Array, "P"]
  num_free: Int[Array, ""]
  page_size: int = dataclasses.field(metadata=dict(static=True))

  @classmethod
  def init(cls, batch: int, num_pages: int, page_size: int,
           max_pages_per_seq: int | None = None) -> "PageTable":
    """All pages free, every sequence empty.  ``max_pages_per_seq`` defaults to ``num_pages``."""
    max_pages_per_seq = num_pages if max_pages_per_seq is None else max_pages_per_seq
    _check_positive("PageTable.init", batch=batch, num_pages=num_pages, page_size=page_size,
                    max_pages_per_seq=max_pages_per_seq)
    # Pop order: page 0 first (the stack top is the last free entry, so store them reversed).
    return cls(page_table=jnp.full((batch, max_pages_per_seq), -1, _I32),
               lengths=jnp.zeros((batch,), _I32),
               free_pages=jnp.arange(num_pages - 1, -1, -1, dtype=_I32),
               num_free=jnp.asarray(num_pages, _I32), page_size=int(page_size))

  @property
  def batch(self) -> int:
    return self.page_table.shape[0]

  @property
  def max_pages(self) -> int:
    return self.page_table.shape[1]

  @property
  def num_pages(self) -> int:
    return self.free_pages.shape[0]

  @property
  def max_len(self) -> int:
    """Most tokens one sequence can hold: ``max_pages * page_size``."""
    return self.max_pages * self.page_size

  def _counts(self, t: int, num_tokens) -> Int[Array, "B"]:
    if num_tokens is None:
      return jnp.full((self.batch,), t, _I32)
    num_tokens = jnp.asarray(num_tokens)
    check_int_array("num_tokens", num_tokens)     # (a float count was truncated)
    num_tokens = num_tokens.astype(_I32)
    if num_tokens.shape != (self.batch,):
      raise ValueError(f"`num_tokens` must be [B={self.batch}], got shape {num_tokens.shape}.")
    if _concrete(num_tokens):
      n = np.asarray(num_tokens)
      if ((n < 0) | (n > t)).any():
        raise ValueError(f"`num_tokens` must lie in [0, T={t}], got {n}.")
    return num_tokens

  def pages_needed(self, t: int, num_tokens: Int[Array, "B"] | None = None) -> Int[Array, ""]:
    """Pages ``reserve(t, num_tokens)`` would pop from the free stack (a sequence holds at most
    ``max_pages``: tokens past ``max_len`` take none)."""
    counts = self._counts(t, num_tokens)
    ps = self.page_size
    end = jnp.minimum(self.lengths + counts, self.max_len)
    return jnp.sum(-(-end // ps) - (-(-self.lengths // ps)))

  def reserve(self, t: int, num_tokens: Int[Array, "B"] | None = None
              ) -> tuple["PageTable", Int[Array, "B T"], Int[Array, "B T"]]:
    """Makes room for ``t`` new tokens per sequence (``num_tokens[b] <= t`` of them real).

    Returns ``(table, page [B, T], offset [B, T])``: new token ``i`` of sequence ``b`` goes to
    ``pool[page[b, i], offset[b, i]]``.  Tokens not written (``i >= num_tokens[b]``, or no page
    left under jit) get ``page = P`` (one past the pool), which ``.at[...].set(mode="drop")``
    ignores.  Lengths advance by the tokens that found a slot.
    """
    return _reserve(self, t, self.check_reserve(t, num_tokens))

  def check_reserve(self, t: int, num_tokens: Int[Array, "B"] | None = None) -> Int[Array, "B"]:
    """Validates a ``reserve(t, num_tokens)`` (with concrete values: capacity and free pages too)
    and returns the per-sequence token counts ``[B]``."""
    _check_positive("reserve", t=t)
    counts = self._counts(t, num_tokens)
    if _concrete(counts, self.lengths, self.num_free):  # eager call: check on the host
      ps = self.page_size
      lens, n = np.asarray(self.lengths), np.asarray(counts)
      if (lens + n).max() > self.max_len:
        raise ValueError(f"sequence too long: lengths {lens} + {n} new tokens exceed max_pages * "
                         f"page_size = {self.max_pages} * {ps} = {self.max_len}.")
      need = int((-(-(lens + n) // ps) - (-(-lens // ps))).sum())
      if need > int(self.num_free):
        raise ValueError(f"out of pages: {need} new pages needed, {int(self.num_free)} free "
                         f"(pool of {self.num_pages} pages of {ps} tokens).")
    return counts

  def free(self, done: Bool[Array, "B"], keep: Bool[Array, "P"] | None = None) -> "PageTable":
    """Returns the pages of the sequences where ``done [B]`` (bool) is True to the free stack and
    empties those sequences (length 0, no pages).  Pages where ``keep [P]`` (bool) is True are
    not returned: pages shared with other sequences or held by a prefix cache (see ``attach``)."""
    done = jnp.asarray(done)
    if done.shape != (self.batch,) or done.dtype != jnp.bool_:
      raise ValueError(f"`done` must be a bool array [B={self.batch}], got {done.dtype} "
                       f"{done.shape}.")
    if keep is None:
      keep = jnp.zeros((self.num_pages,), jnp.bool_)
    keep = jnp.asarray(keep)
    if keep.shape != (self.num_pages,) or keep.dtype != jnp.bool_:
      raise ValueError(f"`keep` must be a bool array [P={self.num_pages}], got {keep.dtype} "
                       f"{keep.shape}.")
    return _free(self, done, keep)

  def release_behind(self, window: int) -> "PageTable":
    """Returns to the free stack the pages wholly behind every sequence's sliding window: a
    query at position ``p >= length`` (every future token) sees keys ``p - window .. p`` only,
    so logical page ``j`` is dead once ``(j + 1) * page_size <= length - window``.  Their
    table entries become -1 (the windowed decode paths never read them).  A sequence's live
    pages are then at most ``ceil((window + T) / page_size) + 1`` during a step of ``T``
    tokens, whatever its length.  (Pages a prefix cache shares must not be released: this is
    for tables that share none.)"""
    if not is_int(window) or window < 0:
      raise ValueError(f"`window` must be an int >= 0, got {window!r}.")
    return _release_behind(self, int(window))

  def truncate(self, lengths: Int[Array, "B"]) -> "PageTable":
    """Each sequence cut back to its first ``lengths[b]`` tokens (at most its length; larger
    entries leave it as it is): the pages past them return to the free stack (a rollback:
    speculative decoding drops the drafts the model rejected).  The slots past a length within
    its last page keep stale contents, masked and overwritten as any slot past the length is.
    (A page a prefix cache shares must lie below the new length: shared pages are whole pages
    of tokens kept.)"""
    lengths = jnp.asarray(lengths)
    check_int_array("lengths", lengths)
    if lengths.shape != (self.batch,):
      raise ValueError(f"`lengths` must be [B={self.batch}], got shape {lengths.shape}.")
    if _concrete(lengths) and (np.asarray(lengths) < 0).any():
      raise ValueError(f"`lengths` must be >= 0, got {np.asarray(lengths).tolist()}.")
    return _truncate(self, lengths.astype(_I32))

  def attach(self, rows: Int[Array, "n"], page_table: Int[Array, "n M"],
             lengths: Int[Array, "n"]) -> "PageTable":
    """Sequences ``rows [n]`` start from pages they did not allocate: row ``rows[i]`` gets the
    page-table row ``page_table[i]`` (-1 = unallocated) and length ``lengths[i]``, and nothing
    is popped from the free stack.  This is prefix sharing: a new sequence whose first tokens
    are another's reads that one's full pages instead of computing them again; its own tokens
    go to pages it pops past them (give it whole pages only: a page written by two sequences is
    corrupt).  The rows should be empty (their own pages would be lost).  Entries of ``rows``
    that are negative or ``>= B`` are dropped (padding).  Free such rows with ``keep``."""
    rows, page_table, lengths = (jnp.asarray(x) for x in (rows, page_table, lengths))
    for name, x in (("rows", rows), ("page_table", page_table), ("lengths", lengths)):
      check_int_array(name, x)
    n = rows.shape[0] if rows.ndim == 1 else -1
    if n < 0 or page_table.shape != (n, self.max_pages) or lengths.shape != (n,):
      raise ValueError(f"`rows` [n], `page_table` [n, M={self.max_pages}] and `lengths` [n] "
                       f"must agree, got {rows.shape}, {page_table.shape}, {lengths.shape}.")
    if _concrete(page_table, lengths):
      pt, ln = np.asarray(page_table), np.asarray(lengths)
      if ((pt < -1) | (pt >= self.num_pages)).any():
        raise ValueError(f"`page_table` entries must be page ids in [0, {self.num_pages}) or -1, "
                         f"got {sorted(set(pt[(pt < -1) | (pt >= self.num_pages)].tolist()))}.")
      held = -(-ln // self.page_size)
      covered = (pt >= 0).cumprod(axis=1).sum(axis=1)
      if (ln < 0).any() or (held > covered).any():
        raise ValueError(f"`lengths` {ln.tolist()} must be >= 0 and within each row's leading "
                         f"allocated pages ({covered.tolist()} of {self.page_size} tokens).")
    return _attach(self, rows.astype(_I32), page_table.astype(_I32), lengths.astype(_I32))

  def push(self, pages: Int[Array, "n"]) -> "PageTable":
    """Returns ``pages [n]`` (ids; negative entries are padding) to the free stack: the pages a
    prefix cache held and lets go.  No sequence may still hold them."""
    pages = jnp.asarray(pages)
    check_int_array("pages", pages)
    if pages.ndim != 1:
      raise ValueError(f"`pages` must be a 1-D array of page ids, got shape {pages.shape}.")
    if _concrete(pages, self.num_free):
      p = np.asarray(pages)
      if (p >= self.num_pages).any() or int(self.num_free) + int((p >= 0).sum()) > self.num_pages:
        raise ValueError(f"`pages` {p.tolist()} must be ids in [0, {self.num_pages}) not already "
                         f"free ({int(self.num_free)} of {self.num_pages} are).")
    return _push(self, pages.astype(_I32))


@functools.partial(jax.jit, static_argnums=1)
def _reserve(table: PageTable, t: int, counts):
  """``PageTable.reserve`` after validation (jitted: eager decode loops compile it once)."""
  counts = jnp.clip(counts, 0, t)
  ps, m, num_pages = table.page_size, table.max_pages, table.num_pages
  # [B] pages already owned: up to the last allocated one (a sequence owns ceil(length / ps);
  # a table may hold pages past its length, to be written without popping: see
  # jaxattn.serving.mtp_functions)
  j = jnp.arange(m, dtype=_I32)[None, :]
  old_pages = jnp.maximum(jnp.max(jnp.where(table.page_table >= 0, j + 1, 0), axis=1),
                          -(-table.lengths // ps))
  new_len = jnp.minimum(table.lengths + counts, table.max_len)
  need = -(-new_len // ps) - old_pages                                # [B] pages to pop
  total = jnp.sum(need)
  # Sequence b takes the stack entries just below the top, in batch order.
  start = jnp.cumsum(need) - need                                     # [B]
  k = jnp.arange(m, dtype=_I32)[None, :] - old_pages[:, None]         # k-th new page of b
  is_new = (k >= 0) & (k < need[:, None])
  stack_pos = table.num_free - 1 - (start[:, None] + k)               # [B, M]
  got = is_new & (stack_pos >= 0)
  popped = table.free_pages[jnp.clip(stack_pos, 0, num_pages - 1)]
  page_table = jnp.where(got, popped, table.page_table)
  # Slot of every new token; one whose page is missing is not written (page = P: dropped).
  pos = table.lengths[:, None] + jnp.arange(t, dtype=_I32)[None, :]  # [B, T]
  page = jnp.take_along_axis(page_table, jnp.clip(pos // ps, 0, m - 1), axis=1)
  ok = (jnp.arange(t)[None, :] < counts[:, None]) & (pos < table.max_len) & (page >= 0)
  page = jnp.where(ok, page, num_pages)
  # Pages are popped in logical order, so a sequence short of pages (only possible under jit)
  # keeps a prefix of its new tokens: the count of written ones is its length increase.
  written = jnp.sum(ok, axis=1).astype(_I32)
  new = PageTable(page_table=page_table, lengths=table.lengths + written,
                  free_pages=table.free_pages,
                  num_free=jnp.maximum(table.num_free - total, 0).astype(_I32), page_size=ps)
  return new, page, pos % ps


@jax.jit
def _free(table: PageTable, done, keep):
  ps = table.page_size
  owned = jnp.arange(table.max_pages)[None, :] < (-(-table.lengths // ps))[:, None]
  kept = keep[jnp.clip(table.page_table, 0, table.num_pages - 1)]
  release = (owned & done[:, None] & (table.page_table >= 0) & ~kept).reshape(-1)  # [B * M]
  return dataclasses.replace(_stack_push(table, table.page_table.reshape(-1), release),
                             page_table=jnp.where(done[:, None], -1, table.page_table),
                             lengths=jnp.where(done, 0, table.lengths))


@functools.partial(jax.jit, static_argnums=1)
def _release_behind(table: PageTable, window: int):
  ps = table.page_size
  dead = jnp.arange(table.max_pages)[None, :] < ((table.lengths - window) // ps)[:, None]
  release = dead & (table.page_table >= 0)
  return dataclasses.replace(_stack_push(table, table.page_table.reshape(-1), release.reshape(-1)),
                             page_table=jnp.where(release, -1, table.page_table))


def _stack_push(table: PageTable, pages, release) -> PageTable:
  """``table`` with ``pages[release]`` pushed on top of its free stack, in order (and counted in
  ``num_free``)."""
  slot = table.num_free + jnp.cumsum(release) - 1                     # stack slot of each page
  slot = jnp.where(release, slot, table.num_pages)                    # the others: dropped
  return dataclasses.replace(table, free_pages=table.free_pages.at[slot].set(pages, mode="drop"),
                             num_free=(table.num_free + jnp.sum(release)).astype(_I32))


@jax.jit
def _truncate(table: PageTable, lengths):
  ps = table.page_size
  lengths = jnp.minimum(lengths, table.lengths)
  j = jnp.arange(table.max_pages)[None, :]
  cut = (j >= (-(-lengths // ps))[:, None]) & (j < (-(-table.lengths // ps))[:, None])
  release = cut & (table.page_table >= 0)
  return dataclasses.replace(_stack_push(table, table.page_table.reshape(-1), release.reshape(-1)),
                             page_table=jnp.where(release, -1, table.page_table),
                             lengths=lengths)


@jax.jit
def _push(table: PageTable, pages):
  return _stack_push(table, pages, pages >= 0)


@jax.jit
def _attach(table: PageTable, rows, page_table, lengths):
  rows = jnp.where(rows < 0, table.batch, rows)                       # padding: dropped
  return dataclasses.replace(
      table, page_table=table.page_table.at[rows].set(page_table, mode="drop"),
      lengths=table.lengths.at[rows].set(lengths, mode="drop"))


def _write(pool, page, offset, new):
  """``pool [P, page, ...]`` with ``new [B, T, ...]`` written at ``(page, offset) [B, T]``."""
  return pool.at[page, offset].set(new.astype(pool.dtype), mode="drop")


def gather_pages(pool: Float[Array, "P page ..."],
                 table: PageTable) -> Float[Array, "B M*page ..."]:
  """The pages of every sequence laid out contiguously: ``[B, max_pages * page_size, ...]``.

  Positions at or past a sequence's length are zero (unallocated pages never leak another
  sequence's data).  This is the reference path; kernels read the pool through the table.
  """
  if pool.ndim < 2 or pool.shape[1] != table.page_size:
    raise ValueError(f"`pool` {pool.shape} must be [P, page_size={table.page_size}, ...].")
  return _gather(pool, table.page_table, table.lengths)


@jax.jit
def _gather(pool, page_table, lengths):
  b, m = page_table.shape
  x = pool[jnp.maximum(page_table, 0)]                                # [B, M, page, ...]
  x = x.reshape((b, m * pool.shape[1]) + pool.shape[2:])
  valid = jnp.arange(m * pool.shape[1])[None, :] < lengths[:, None]   # [B, S]
  return jnp.where(valid.reshape(valid.shape + (1,) * (x.ndim - 2)), x, jnp.zeros((), x.dtype))


def split_scales(scales: Float[Array, "P 1 Kpage"], kv_heads: int) -> Float[Array, "P page K"]:
  """A quantized pool's scales ``[P, 1, K * page]`` as ``[P, page, K]`` (token-major, as the
  pool's rows), for ``gather_pages`` and the XLA paths."""
  p, k = scales.shape[0], kv_heads
  return scales.reshape(p, k, -1).transpose(0, 2, 1)


def latent_rope_dtype(rope_dtype, dtype, where: str):
  """The dtype of a latent cache's ``k^R`` beside latents of ``dtype``: ``rope_dtype``, or (None)
  ``dtype`` itself, float32 under quantized latents; a float dtype (``k^R`` is stored
  unquantized), else a ``ValueError`` naming ``where``."""
  if rope_dtype is None:
    rope_dtype = jnp.float32 if kv_quantized(dtype) else dtype
  dt = check_cache_dtype(rope_dtype, where, "rope_dtype")
  if kv_quantized(dt):
    raise ValueError(f"{where}: `rope_dtype` must be a float dtype (k^R is stored unquantized), "
                     f"got {dt}.")
  return dt


class _TableViews:
  """The page table's views, shared by the paged caches."""

  table: "PageTable"

  @property
  def lengths(self) -> Int[Array, "B"]:
    return self.table.lengths

  @property
  def page_table(self) -> Int[Array, "B M"]:
    return self.table.page_table


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache(_TableViews):
  """Keys and values in pages, the KV heads of a token side by side in one row:
  ``key_pool [P, page, K * H]``, ``value_pool [P, page, K * h]`` (row ``[k_0 | k_1 | ...]``, the
  element order of ``[P, page, K, H]``), and the ``PageTable`` that maps sequences to pages.
  Decode is ``y, cache = attn(x, cache=cache)``.

  Why rows of ``K * H``: on TPU, XLA's default layout for a ``[P, page, K, H]`` array whose minor
  dimensions are not whole ``(8|16, 128)`` tiles (head size 64, or ``K = 1``: MQA) puts another
  dimension minor, so a kernel reading its pages re-tiles the whole pool on every decode step
  (``experiments/tpu_compile_check``).  ``K * H`` is a multiple of 128 for nearly every model
  (not for MQA with heads of 64).

  ``window``: the sliding window of the layer that owns the cache (a query at ``p`` reads keys
  ``p - window .. p``), None for full attention: the pages wholly behind it are dead and
  ``jaxattn.nn.PagedModelCache.release_behind`` returns them to the pool.

  Quantized (``dtype`` int8 or float8_e4m3fn at ``init``): the pools hold one-byte codes and
  ``key_scale_pool`` / ``value_scale_pool [P, 1, K * page]`` fp32 one scale per token and KV head
  (``jaxattn.ops.quantization.quantize_kv``, applied by ``append``): half the bytes of a bf16
  cache, plus 4 bytes per token and head (3% at heads of 128).  A page's scales are one row, KV
  head ``k``'s ``page`` scales at ``[k * page, (k + 1) * page)``, the page's tokens along the
  lanes as the decode kernels use them (a row of a page's logits times its keys' scales, the
  probabilities times the values').  Why not ``[P, K, page]``: on TPU, XLA lays such an array out
  with another dimension minor when ``page < 128``, and relaid the whole scale pool out before the
  kernel on every step (``experiments/tpu_compile_check``); ``[P, 1, K * page]`` is row-major."""

  key_pool: Float[Array, "P page KH"]
  value_pool: Float[Array, "P page Kh"]
  table: PageTable
  num_kv_heads: int = dataclasses.field(default=1, metadata=dict(static=True))
  window: int | None = dataclasses.field(default=None, metadata=dict(static=True))
  key_scale_pool: Float[Array, "P 1 Kpage"] | None = None
  value_scale_pool: Float[Array, "P 1 Kpage"] | None = None

  @classmethod
  def init(cls, batch: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
           v_head_dim: int | None = None, *, max_pages_per_seq: int | None = None,
           dtype=jnp.float32, window: int | None = None) -> "PagedKVCache":
    """``dtype``: the pools' float dtype, or int8 / float8_e4m3fn for a quantized cache."""
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    _check_positive("PagedKVCache.init", num_kv_heads=num_kv_heads, head_dim=head_dim,
                    v_head_dim=v_head_dim)
    if window is not None and (not is_int(window) or window < 0):
      raise ValueError(f"`window` must be None or an int >= 0, got {window!r}.")
    dtype = check_cache_dtype(dtype, "PagedKVCache.init")
    table = PageTable.init(batch, num_pages, page_size, max_pages_per_seq)
    scales = ({} if not kv_quantized(dtype) else
              {f"{n}_scale_pool": jnp.ones((num_pages, 1, num_kv_heads * page_size), jnp.float32)
               for n in ("key", "value")})
    return cls(key_pool=jnp.zeros((num_pages, page_size, num_kv_heads * head_dim), dtype),
               value_pool=jnp.zeros((num_pages, page_size, num_kv_heads * v_head_dim), dtype),
               table=table, num_kv_heads=int(num_kv_heads),
               window=None if window is None else int(window), **scales)

  @property
  def quantized(self) -> bool:
    """Whether the pools hold quantized codes with per-token scales."""
    return self.key_scale_pool is not None

  @property
  def head_dim(self) -> int:
    return self.key_pool.shape[2] // self.num_kv_heads

  @property
  def v_head_dim(self) -> int:
    return self.value_pool.shape[2] // self.num_kv_heads

  @property
  def nbytes(self) -> int:
    """Bytes of the pools (all pages, used or not; the scales of a quantized cache too)."""
    pools = (self.key_pool, self.value_pool, self.key_scale_pool, self.value_scale_pool)
    return int(sum(a.size * a.dtype.itemsize for a in pools if a is not None))

  def append(self, key: Float[Array, "B T K H"], value: Float[Array, "B T K h"],
             num_tokens: Int[Array, "B"] | None = None) -> "PagedKVCache":
    """Writes ``T`` new tokens of every sequence at its length (only the first ``num_tokens[b]``
    of sequence ``b`` when given: ragged prefill), allocating pages as needed."""
    kh, h, hv = self.num_kv_heads, self.head_dim, self.v_head_dim
    if key.ndim != 4 or key.shape[0] != self.table.batch or key.shape[2:] != (kh, h):
      raise ValueError(f"`key` {key.shape} must be [B={self.table.batch}, T, K, H] with "
                       f"[K, H]={(kh, h)}.")
    if value.shape[:2] != key.shape[:2] or value.shape[2:] != (kh, hv):
      raise ValueError(f"`value` {value.shape} must be [B, T]={key.shape[:2]} + [K, h]="
                       f"{(kh, hv)}.")
    if key.shape[1] == 0:   # an empty chunk: nothing to write (was "`t` must be positive")
      self.table._counts(0, num_tokens)
      return self
    return _append_kv(self, key, value, self.table.check_reserve(key.shape[1], num_tokens))

  def free(self, done, keep=None) -> "PagedKVCache":
    """Releases the pages of the sequences where ``done [B]`` is True, those where ``keep [P]``
    is True aside (see ``PageTable.free``)."""
    return dataclasses.replace(self, table=self.table.free(done, keep))

  def gather(self) -> tuple[Float[Array, "B S K H"], Float[Array, "B S K h"]]:
    """Contiguous ``(key, value)`` ``[B, max_pages * page_size, K, H|h]`` for the reference path
    (a quantized cache's dequantized, in fp32)."""
    kh = self.num_kv_heads

    def one(pool, scales):
      x = gather_pages(pool, self.table)
      x = x.reshape(x.shape[:2] + (kh, -1))
      if scales is None:
        return x
      s = gather_pages(split_scales(scales, kh), self.table)            # [B, S, K]
      return x.astype(jnp.float32) * s[..., None]

    return one(self.key_pool, self.key_scale_pool), one(self.value_pool, self.value_scale_pool)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedLatentCache(_TableViews):
  """The MLA latent cache in pages: ``c_kv_pool [P, page, C]`` (normalized latents),
  ``k_rope_pool [P, page, R_p]`` (the rotated key shared by all heads, its ``R`` columns followed
  by ``R_p - R`` zero columns: see the module note on the TPU layout) and, for DeepSeek Sparse
  Attention, optional indexer keys ``index_keys_pool [P, page, d_I]`` (int8 / fp8 / fp32) with
  ``index_scales_pool [P, page, nb]`` (fp32), stored as the scorer reads them.  ``rope_dim``
  (static) is ``R``; None means ``R_p`` (no padding).

  Quantized (``dtype`` int8 or float8_e4m3fn at ``init``; DeepSeek serves MLA with an FP8 latent
  cache): ``c_kv_pool`` holds one-byte codes and ``c_kv_scale_pool [P, 1, page]`` fp32 one scale
  per token over its ``C`` latent entries (``jaxattn.ops.quantization.quantize_kv``, applied by
  ``append``), laid along the page's tokens as the decode kernels read them; ``k_rope_pool`` (the
  small rotated key) stays in a float dtype (``rope_dtype``)."""

  c_kv_pool: Float[Array, "P page C"]
  k_rope_pool: Float[Array, "P page R_p"]
  table: PageTable
  index_keys_pool: Array | None = None
  index_scales_pool: Float[Array, "P page nb"] | None = None
  rope_dim: int | None = dataclasses.field(default=None, metadata=dict(static=True))
  c_kv_scale_pool: Float[Array, "P 1 page"] | None = None

  @classmethod
  def init(cls, batch: int, num_pages: int, page_size: int, kv_lora_rank: int,
           qk_rope_head_dim: int, *, max_pages_per_seq: int | None = None,
           index_head_dim: int | None = None, index_dtype=jnp.float32,
           index_num_scales: int = 1, rope_align: int | None = None,
           dtype=jnp.float32, rope_dtype=None) -> "PagedLatentCache":
    """``index_head_dim`` set: also hold indexer keys of that width in ``index_dtype`` with
    ``index_num_scales`` fp32 scales per token.  ``rope_align``: store ``k^R`` with its columns
    zero-padded to a multiple of this (None: ``default_rope_align()``, 128 on TPU, else 1).
    ``dtype``: the latent pool's float dtype, or int8 / float8_e4m3fn for a quantized latent
    cache; ``rope_dtype``: the ``k^R`` pool's float dtype (None: ``dtype`` when it is a float
    dtype, else float32)."""
    rope_align = default_rope_align() if rope_align is None else rope_align
    _check_positive("PagedLatentCache.init", kv_lora_rank=kv_lora_rank,
                    qk_rope_head_dim=qk_rope_head_dim, rope_align=rope_align)
    dtype = check_cache_dtype(dtype, "PagedLatentCache.init")
    quantized = kv_quantized(dtype)
    rope_dtype = latent_rope_dtype(rope_dtype, dtype, "PagedLatentCache.init")
    rope_width = stored_rope_width(qk_rope_head_dim, rope_align)
    table = PageTable.init(batch, num_pages, page_size, max_pages_per_seq)
    keys = scales = None
    if index_head_dim is not None:
      _check_positive("PagedLatentCache.init", index_head_dim=index_head_dim,
                      index_num_scales=index_num_scales)
      keys = jnp.zeros((num_pages, page_size, index_head_dim), index_dtype)
      scales = jnp.ones((num_pages, page_size, index_num_scales), jnp.float32)
    c_scales = (jnp.ones((num_pages, 1, page_size), jnp.float32) if quantized else None)
    return cls(c_kv_pool=jnp.zeros((num_pages, page_size, kv_lora_rank), dtype),
               k_rope_pool=jnp.zeros((num_pages, page_size, rope_width), rope_dtype),
               table=table, index_keys_pool=keys, index_scales_pool=scales,
               rope_dim=int(qk_rope_head_dim), c_kv_scale_pool=c_scales)

  @property
  def quantized(self) -> bool:
    """Whether ``c_kv_pool`` holds quantized codes with per-token scales."""
    return self.c_kv_scale_pool is not None

  @property
  def kv_lora_rank(self) -> int:
    return self.c_kv_pool.shape[2]

  @property
  def qk_rope_head_dim(self) -> int:
    """``R``, the rotated key's width (the pool may hold zero columns past it)."""
    return self.k_rope_pool.shape[2] if self.rope_dim is None else self.rope_dim

  @property
  def nbytes(self) -> int:
    """Bytes of every pool as allocated (padding columns of ``k^R`` included; the latent scales
    of a quantized cache too)."""
    arrays = [self.c_kv_pool, self.k_rope_pool, self.index_keys_pool, self.index_scales_pool,
              self.c_kv_scale_pool]
    return int(sum(a.size * a.dtype.itemsize for a in arrays if a is not None))

  def append(self, c_kv: Float[Array, "B T C"], k_rope: Float[Array, "B T R"],
             index_keys: Array | None = None, index_scales: Float[Array, "B T nb"] | None = None,
             num_tokens: Int[Array, "B"] | None = None) -> "PagedLatentCache":
    """Writes ``T`` new latent rows per sequence at its length (indexer keys too when this cache
    holds them: pass them already quantized), allocating pages as needed."""
    b = self.table.batch
    if c_kv.ndim != 3 or c_kv.shape[0] != b or c_kv.shape[2] != self.kv_lora_rank:
      raise ValueError(f"`c_kv` {c_kv.shape} must be [B={b}, T, C={self.kv_lora_rank}].")
    if k_rope.shape != c_kv.shape[:2] + (self.qk_rope_head_dim,):
      raise ValueError(f"`k_rope` {k_rope.shape} must be "
                       f"{c_kv.shape[:2] + (self.qk_rope_head_dim,)} ([B, T, R]).")
    has_index = self.index_keys_pool is not None
    if has_index != (index_keys is not None) or (index_keys is None) != (index_scales is None):
      raise ValueError(f"`index_keys` and `index_scales` must be given exactly when the cache "
                       f"holds indexer keys (it does: {has_index}); got keys="
                       f"{index_keys is not None}, scales={index_scales is not None}.")
    keys, scales = self.index_keys_pool, self.index_scales_pool
    if has_index:
      if index_keys.shape != c_kv.shape[:2] + keys.shape[2:] or index_keys.dtype != keys.dtype:
        raise ValueError(f"`index_keys` {index_keys.dtype}{index_keys.shape} must be "
                         f"{keys.dtype}{c_kv.shape[:2] + keys.shape[2:]}.")
      if index_scales.shape != c_kv.shape[:2] + scales.shape[2:]:
        raise ValueError(f"`index_scales` {index_scales.shape} must be "
                         f"{c_kv.shape[:2] + scales.shape[2:]}.")
    if c_kv.shape[1] == 0:  # an empty chunk: nothing to write
      self.table._counts(0, num_tokens)
      return self
    return _append_latent(self, c_kv, k_rope, index_keys, index_scales,
                          self.table.check_reserve(c_kv.shape[1], num_tokens))

  def free(self, done, keep=None) -> "PagedLatentCache":
    """Releases the pages of the sequences where ``done [B]`` is True, those where ``keep [P]``
    is True aside (see ``PageTable.free``)."""
    return dataclasses.replace(self, table=self.table.free(done, keep))

  def gather(self) -> tuple[Float[Array, "B S C"], Float[Array, "B S R"]]:
    """Contiguous ``(c_kv, k_rope)`` ``[B, max_pages * page_size, C|R]`` (reference path; a
    quantized cache's ``c_kv`` dequantized, in fp32)."""
    c_kv = gather_pages(self.c_kv_pool, self.table)
    if self.quantized:
      s = gather_pages(split_scales(self.c_kv_scale_pool, 1), self.table)       # [B, S, 1]
      c_kv = c_kv.astype(jnp.float32) * s
    return c_kv, gather_pages(self.k_rope_pool, self.table)[..., :self.qk_rope_head_dim]

  def gather_index_keys(self) -> tuple[Array, Float[Array, "B S nb"]]:
    """Contiguous indexer ``(keys, scales)`` ``[B, S, d_I]``, ``[B, S, nb]``."""
    if self.index_keys_pool is None:
      raise ValueError("this PagedLatentCache holds no indexer keys (init with `index_head_dim`).")
    return (gather_pages(self.index_keys_pool, self.table),
            gather_pages(self.index_scales_pool, self.table))


# One jitted program per append (reserve + every pool write), so an eager decode loop compiles once.
@jax.jit
def _append_kv(cache: PagedKVCache, key, value, counts) -> PagedKVCache:
  table, page, off = _reserve(cache.table, key.shape[1], counts)
  merge = lambda x: x.reshape(x.shape[:2] + (-1,))                    # noqa: E731 [B, T, K*H]
  scales = {}
  if cache.quantized:
    (key, ks), (value, vs) = (quantize_kv(x, cache.key_pool.dtype) for x in (key, value))
    # [P, 1, K * page] pools: token (page, off) of KV head k at lane k * page_size + off.
    lane = off[..., None] + cache.table.page_size * jnp.arange(cache.num_kv_heads)  # [B, T, K]
    put = lambda pool, s: pool.at[page[..., None], 0, lane].set(s, mode="drop")  # noqa: E731
    scales = dict(key_scale_pool=put(cache.key_scale_pool, ks),
                  value_scale_pool=put(cache.value_scale_pool, vs))
  return dataclasses.replace(cache, key_pool=_write(cache.key_pool, page, off, merge(key)),
                             value_pool=_write(cache.value_pool, page, off, merge(value)),
                             table=table, **scales)


@jax.jit
def _append_latent(cache: PagedLatentCache, c_kv, k_rope, index_keys, index_scales,
                   counts) -> PagedLatentCache:
  table, page, off = _reserve(cache.table, c_kv.shape[1], counts)
  keys, scales = cache.index_keys_pool, cache.index_scales_pool
  if keys is not None:
    keys, scales = _write(keys, page, off, index_keys), _write(scales, page, off, index_scales)
  pad = cache.k_rope_pool.shape[2] - k_rope.shape[2]                 # zero columns to R_p
  k_rope = jnp.pad(k_rope, ((0, 0), (0, 0), (0, pad))) if pad else k_rope
  c_scales = cache.c_kv_scale_pool
  if c_scales is not None:   # codes, and one scale per token in the [P, 1, page] pool
    c_kv, cs = quantize_kv(c_kv.astype(jnp.float32), cache.c_kv_pool.dtype)
    c_scales = c_scales.at[page, 0, off].set(cs, mode="drop")
  return PagedLatentCache(_write(cache.c_kv_pool, page, off, c_kv),
                          _write(cache.k_rope_pool, page, off, k_rope), table, keys, scales,
                          cache.rope_dim, c_scales)
