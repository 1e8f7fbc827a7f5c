"""Text for training: a byte tokenizer, document sources, and a packed, resumable batch iterator.

Shape letters: ``B`` rows in a batch (the global batch, or one host's slice of it), ``T`` tokens per
row (``seq_len``).  Every batch is a dict of NumPy arrays:

  tokens       [B, T] int32    input ids
  targets      [B, T] int32    the next token of the stream (``tokens`` shifted left by one)
  segment_ids  [B, T] int32    1, 2, ... per document piece in the row, 0 on padding
  positions    [B, T] int32    position inside the segment, restarting at 0 where a segment starts
  loss_mask    [B, T] float32  1 where ``targets`` is a real next token of the same document; 0 on
                               padding and where the target would cross into the next document

Packing: the documents of one epoch (each wrapped as ``[BOS] doc [EOS]``) are shuffled with a NumPy
generator seeded by ``(seed, epoch)`` and concatenated; epochs follow each other into one endless
stream.  Row ``r`` of the stream is ``stream[r*T : r*T + T + 1]``: its first ``T`` tokens are the
inputs and its last ``T`` the targets, so consecutive rows overlap by one token and every token of
the stream is an input exactly once and a target exactly once (no transition is lost at a row edge).
A long document spans rows; segment ids and positions restart in each row because attention never
sees across rows.  Batch ``k`` holds the global rows ``[k*B, (k+1)*B)``.  The training stream has no
padding; only :func:`eval_batches`, which is finite, pads its last row and batch.
"""

from __future__ import annotations

import os
import re
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from jaxtyping import Int

from jaxattn.checks import is_int

# Special ids of the byte tokenizer.  PAD is 0 so that zero-filled buffers read as padding.
PAD = 0
BOS = 1
EOS = 2
NUM_SPECIAL = 3

Batch = dict[str, np.ndarray]


class ByteTokenizer:
  """UTF-8 bytes as tokens: byte ``b`` is id ``b + 3``; ids 0, 1, 2 are PAD, BOS, EOS.

  Byte level needs no training and no vocabulary file, never meets an unknown token, and the
  259-entry vocabulary keeps the embedding tiny for CPU-sized models.
  """

  pad_id = PAD
  bos_id = BOS
  eos_id = EOS
  vocab_size = 256 + NUM_SPECIAL

  def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False
             ) -> Int[np.ndarray, "n"]:
    """``text`` -> int32 ids (one per UTF-8 byte), optionally wrapped in BOS / EOS."""
    if not isinstance(text, str):
      raise ValueError(f"ByteTokenizer.encode: `text` must be a str, got {type(text).__name__}.")
    # frombuffer + one vectorized add: ~1 ms per MB, no Python loop over characters.
    ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32) + NUM_SPECIAL
    if add_bos or add_eos:
      ids = np.concatenate([np.array([BOS] if add_bos else [], np.int32), ids,
                            np.array([EOS] if add_eos else [], np.int32)])
    return ids

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    """ids -> text.  Special ids are skipped; invalid UTF-8 (e.g. a cut multi-byte character)
    becomes U+FFFD.  An id outside ``[0, vocab_size)`` raises: this tokenizer cannot make it."""
    ids = np.asarray(ids).reshape(-1)
    if ids.size and (not np.issubdtype(ids.dtype, np.integer)
                     or ids.min() < 0 or ids.max() >= self.vocab_size):
      integer = np.issubdtype(ids.dtype, np.integer)
      bad = ids[(ids < 0) | (ids >= self.vocab_size)] if integer else ids
      raise ValueError(f"ByteTokenizer.decode: ids must be integers in [0, {self.vocab_size}), got "
                       f"{bad[:5].tolist()} (dtype {ids.dtype}).")
    data = ids[ids >= NUM_SPECIAL] - NUM_SPECIAL
    return data.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------------------------
# Sources of documents.
# ---------------------------------------------------------------------------------------------

_SOURCES_HELP = ("None or 'builtin' (the Python documentation topics in pydoc_data), a path to a "
                 "UTF-8 text file, or 'hf:NAME[:CONFIG][:SPLIT]' (a Hugging Face dataset)")


def load_text(source: str | os.PathLike | None = None, *, delimiter: str | None = None,
              text_field: str = "text") -> list[str]:
  """Loads a list of documents, always in the same order.

  Args:
    source: ``None`` or ``"builtin"``: the documentation topics that ship with Python
      (``pydoc_data.topics.topics``), one document per topic in sorted topic order -- real English
      prose with code, no download.  A filesystem path: that UTF-8 text file, split into documents
      at ``delimiter`` if given, else at blank lines (paragraphs); pieces are stripped and empty
      ones dropped.  ``"hf:NAME[:CONFIG][:SPLIT]"``: the ``text_field`` column of a Hugging Face
      dataset (split ``train`` by default; empty rows dropped), which needs the ``datasets``
      package and, unless cached, network access.  (Python 3.11 ships ~470 KB of topics in 79
      documents; newer Pythons ship more.)
    delimiter: document separator for a text file (e.g. ``"<|endoftext|>"``).
    text_field: the column holding the text in a Hugging Face dataset.
  """
  if source is None or source == "builtin":
    from pydoc_data import topics  # the Python documentation: ships with every CPython

    return [topics.topics[name] for name in sorted(topics.topics)]
  if isinstance(source, str) and source.startswith("hf:"):
    return _load_hf(source, text_field)
  if not isinstance(source, (str, os.PathLike)):
    raise ValueError(f"load_text: `source` must be {_SOURCES_HELP}; got {source!r}.")
  path = os.fspath(source)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"load_text: no file at `source`={path!r}; `source` must be "
                            f"{_SOURCES_HELP}.")
  with open(path, encoding="utf-8", errors="replace") as f:
    text = f.read()
  if delimiter is not None and not delimiter:
    raise ValueError("load_text: `delimiter` must be a non-empty string or None (blank lines).")
  pieces = text.split(delimiter) if delimiter else re.split(r"\n[ \t\r\f\v]*\n", text)
  docs = [p.strip() for p in pieces if p.strip()]
  if not docs:
    raise ValueError(f"load_text: {path!r} holds no text.")
  return docs


def _load_hf(source: str, text_field: str) -> list[str]:
  parts = source[len("hf:"):].split(":")
  if not parts[0] or len(parts) > 3:
    raise ValueError(f"load_text: `source`={source!r} must read 'hf:NAME[:CONFIG][:SPLIT]', e.g. "
                     "'hf:wikitext:wikitext-2-raw-v1:train'.")
  name, config, split = parts[0], (parts[1] if len(parts) > 1 and parts[1] else None), \
      (parts[2] if len(parts) > 2 and parts[2] else "train")
  try:
    import datasets
  except ImportError as e:
    raise ImportError(f"load_text({source!r}) needs the Hugging Face `datasets` package: "
                      "`pip install datasets` (and network access, unless the dataset is cached). "
                      "Without it, use source=None for the built-in text or a path to a text "
                      "file.") from e
  try:
    ds = datasets.load_dataset(name, config, split=split)
  except (ConnectionError, OSError) as e:
    raise ConnectionError(f"load_text({source!r}): could not load dataset {name!r} (config "
                          f"{config!r}, split {split!r}); downloading it needs network access. "
                          f"Cause: {e}") from e
  if text_field not in ds.column_names:
    raise ValueError(f"load_text({source!r}): no column `text_field`={text_field!r}; the dataset "
                     f"has {ds.column_names}.")
  docs = [t for t in ds[text_field] if isinstance(t, str) and t.strip()]
  if not docs:
    raise ValueError(f"load_text({source!r}): column {text_field!r} holds no text.")
  return docs


def split_documents(docs: Sequence[Any], *, eval_every: int = 20) -> tuple[list[Any], list[Any]]:
  """Deterministic train / eval split by document: documents ``eval_every-1, 2*eval_every-1, ...``
  (every ``eval_every``-th, counting from 1) go to eval, the rest to train, both in input order."""
  if int(eval_every) < 2:
    raise ValueError(f"split_documents: `eval_every` must be >= 2, got {eval_every!r}.")
  eval_every = int(eval_every)
  train = [d for i, d in enumerate(docs) if (i + 1) % eval_every]
  held = [d for i, d in enumerate(docs) if not (i + 1) % eval_every]
  if not train or not held:
    raise ValueError(f"split_documents: {len(docs)} documents with `eval_every`={eval_every} leave "
                     f"{len(train)} for training and {len(held)} for eval; both must be non-empty "
                     f"(use a smaller eval_every or more documents).")
  return train, held


def tokenize_documents(docs: Sequence[str], tokenizer: ByteTokenizer | None = None
                       ) -> list[np.ndarray]:
  """Encodes each document (no BOS/EOS: the packer adds them)."""
  tokenizer = tokenizer or ByteTokenizer()
  return [tokenizer.encode(d) for d in docs]


# ---------------------------------------------------------------------------------------------
# Packing.
# ---------------------------------------------------------------------------------------------


def _check_docs(token_docs: Sequence[np.ndarray], who: str) -> list[np.ndarray]:
  if len(token_docs) == 0:
    raise ValueError(f"{who}: `token_docs` is empty; give at least one tokenized document.")
  out = []
  for i, d in enumerate(token_docs):
    a = np.asarray(d)
    if a.ndim != 1 or (a.size and not np.issubdtype(a.dtype, np.integer)):
      raise ValueError(f"{who}: `token_docs[{i}]` must be a 1-D integer array, got shape "
                       f"{a.shape} dtype {a.dtype}.")
    if a.size and a.min() < 0:
      raise ValueError(f"{who}: `token_docs[{i}]` holds a negative id {int(a.min())}.")
    if a.size and a.max() > np.iinfo(np.int32).max:  # the int32 cast below would wrap it
      raise ValueError(f"{who}: `token_docs[{i}]` holds id {int(a.max())}, above the int32 "
                       "range of token ids.")
    out.append(a.astype(np.int32, copy=False))
  return out


def _check_layout(who: str, batch_size: int, seq_len: int, process_index: int,
                  process_count: int) -> None:
  for name, v in (("seq_len", seq_len), ("batch_size", batch_size),
                  ("process_index", process_index), ("process_count", process_count)):
    if not is_int(v):  # a float would be truncated (batch_size=2.7 ran as 2)
      raise ValueError(f"{who}: `{name}` must be an int, got {v!r}.")
  if int(seq_len) < 1:
    raise ValueError(f"{who}: `seq_len` must be >= 1, got {seq_len!r}.")
  if int(batch_size) < 1:
    raise ValueError(f"{who}: `batch_size` must be >= 1, got {batch_size!r}.")
  if int(process_count) < 1:
    raise ValueError(f"{who}: `process_count` must be >= 1, got {process_count!r}.")
  if not 0 <= int(process_index) < int(process_count):
    raise ValueError(f"{who}: `process_index` must be in [0, {process_count}), got "
                     f"{process_index!r}.")
  if int(batch_size) % int(process_count):
    raise ValueError(f"{who}: the global `batch_size`={batch_size} must be divisible by "
                     f"`process_count`={process_count} (each host takes an equal slice).")


def _concat(docs: Sequence[np.ndarray], bos_id: int | None, eos_id: int | None,
            first_doc_id: int) -> tuple[np.ndarray, np.ndarray]:
  """Documents -> (token stream, document id per token), each document wrapped in BOS/EOS."""
  pieces, ids = [], []
  for i, d in enumerate(docs):
    if bos_id is not None:
      d = np.concatenate([np.array([bos_id], np.int32), d])
    if eos_id is not None:
      d = np.concatenate([d, np.array([eos_id], np.int32)])
    pieces.append(d)
    ids.append(np.full(d.shape, first_doc_id + i, np.int64))
  return np.concatenate(pieces), np.concatenate(ids)


def _rows_to_batch(window: np.ndarray, doc: np.ndarray) -> Batch:
  """``window [B, T+1]`` token ids and ``doc [B, T+1]`` document ids (-1 = padding) -> a batch."""
  t = window.shape[1] - 1
  real = doc[:, :t] >= 0
  # A segment starts at column 0 and wherever the document changes.
  starts = np.ones_like(real)
  starts[:, 1:] = doc[:, 1:t] != doc[:, :t - 1]
  starts &= real
  segment_ids = np.where(real, np.cumsum(starts, axis=1), 0)
  col = np.arange(t)
  last_start = np.maximum.accumulate(np.where(starts, col, 0), axis=1)
  positions = np.where(real, col - last_start, 0)
  # A target counts only if it is real and continues the same document as its input.
  loss_mask = real & (doc[:, 1:] == doc[:, :t])
  return dict(tokens=window[:, :t].astype(np.int32), targets=window[:, 1:].astype(np.int32),
              segment_ids=segment_ids.astype(np.int32), positions=positions.astype(np.int32),
              loss_mask=loss_mask.astype(np.float32))


class PackedDataset:
  """An endless, deterministic, resumable iterator of packed training batches (module docstring).

  Args:
    token_docs: tokenized documents (1-D integer arrays, without BOS/EOS).
    batch_size: GLOBAL rows per step; each host yields ``batch_size // process_count`` of them.
    seq_len: ``T``, tokens per row.
    seed: shuffling seed; epoch ``e`` uses ``np.random.default_rng([seed, e])``.
    bos_id, eos_id: ids put before / after every document; ``None`` to add none.
    process_index, process_count: this host's slice of the global batch (``jax.process_index()``,
      ``jax.process_count()`` in a multi-host job).  Host ``p`` yields global rows
      ``[p*b, (p+1)*b)`` of every batch, ``b = batch_size // process_count``.

  ``state()`` is the same on every host and ``restore(state)`` continues with exactly the batches
  the uninterrupted iterator would have yielded next (also with another batch size or host count:
  the state is a position in the token stream).
  """

  def __init__(self, token_docs: Sequence[np.ndarray], *, batch_size: int, seq_len: int,
               seed: int = 0, bos_id: int | None = BOS, eos_id: int | None = EOS,
               process_index: int = 0, process_count: int = 1):
    who = "PackedDataset"
    self._docs = _check_docs(token_docs, who)
    _check_layout(who, batch_size, seq_len, process_index, process_count)
    self.batch_size, self.seq_len, self.seed = int(batch_size), int(seq_len), int(seed)
    self.bos_id, self.eos_id = bos_id, eos_id
    self.process_index, self.process_count = int(process_index), int(process_count)
    extra = (bos_id is not None) + (eos_id is not None)
    # Every epoch is a permutation of the same documents, so it has the same length: a position in
    # the endless stream is simply epoch * tokens_per_epoch + offset.
    self.tokens_per_epoch = sum(len(d) + extra for d in self._docs)
    if self.tokens_per_epoch < 2:
      raise ValueError(f"{who}: the documents hold {self.tokens_per_epoch} token(s) per epoch; at "
                       "least 2 are needed to form one (input, target) pair.")
    # Identifies the stream, so that a state from other data or another seed is refused.
    crc = zlib.crc32(repr((bos_id, eos_id)).encode())  # the special tokens are part of it
    for d in self._docs:
      crc = zlib.crc32(d.tobytes(), zlib.crc32(np.int64(len(d)).tobytes(), crc))
    self._fingerprint = f"{crc:08x}"
    self._offset = 0  # global token offset of the next batch's first row
    self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}

  @property
  def local_batch_size(self) -> int:
    return self.batch_size // self.process_count

  @property
  def tokens_per_batch(self) -> int:
    """Input tokens per GLOBAL batch (``B * T``)."""
    return self.batch_size * self.seq_len

  @property
  def epoch(self) -> float:
    """Epochs consumed so far (fractional), for logging."""
    return self._offset / self.tokens_per_epoch

  def _epoch_stream(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    if epoch not in self._cache:
      order = np.random.default_rng([self.seed, epoch]).permutation(len(self._docs))
      # Document ids are unique across epochs, so a one-document corpus still gets a boundary.
      self._cache[epoch] = _concat([self._docs[i] for i in order], self.bos_id, self.eos_id,
                                   first_doc_id=epoch * len(self._docs))
      for old in [e for e in self._cache if e < epoch - 1]:
        del self._cache[old]
    return self._cache[epoch]

  def _take(self, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` tokens (and document ids) of the endless stream from global offset ``start``."""
    toks, docs = [], []
    while n > 0:
      epoch, pos = divmod(start, self.tokens_per_epoch)
      stream, ids = self._epoch_stream(epoch)
      k = min(n, self.tokens_per_epoch - pos)
      toks.append(stream[pos:pos + k])
      docs.append(ids[pos:pos + k])
      start, n = start + k, n - k
    return np.concatenate(toks), np.concatenate(docs)

  def __iter__(self) -> Iterator[Batch]:
    return self

  def __next__(self) -> Batch:
    b, t = self.local_batch_size, self.seq_len
    first = self._offset + self.process_index * b * t  # this host's first row
    toks, docs = self._take(first, b * t + 1)
    # Row r = stream[r*T : r*T + T + 1]: a strided view of the contiguous slice, no copy.
    idx = np.arange(b)[:, None] * t + np.arange(t + 1)[None, :]
    self._offset += self.batch_size * t
    return _rows_to_batch(toks[idx], docs[idx])

  def state(self) -> dict[str, Any]:
    """JSON-able position of the next batch: ``{"epoch", "position", "seed", "tokens_per_epoch",
    "fingerprint"}``, ``position`` counted in tokens inside ``epoch``."""
    epoch, position = divmod(self._offset, self.tokens_per_epoch)
    return dict(epoch=int(epoch), position=int(position), seed=self.seed,
                tokens_per_epoch=int(self.tokens_per_epoch), fingerprint=self._fingerprint)

  def restore(self, state: dict[str, Any]) -> None:
    """Continues from ``state`` (from :meth:`state`, possibly through JSON)."""
    missing = {"epoch", "position"} - set(state)
    if missing:
      raise ValueError(f"PackedDataset.restore: `state` lacks {sorted(missing)}; got keys "
                       f"{sorted(state)}.")
    for key, mine in (("seed", self.seed), ("tokens_per_epoch", self.tokens_per_epoch),
                      ("fingerprint", self._fingerprint)):
      if key in state and state[key] != mine:
        raise ValueError(f"PackedDataset.restore: the state was saved with {key}={state[key]!r} "
                         f"but this dataset has {key}={mine!r}: other data or another seed, so "
                         "the position would not resume the same stream.")
    epoch, position = int(state["epoch"]), int(state["position"])
    if epoch < 0 or not 0 <= position < self.tokens_per_epoch:
      raise ValueError(f"PackedDataset.restore: `state` epoch={epoch}, position={position} is out "
                       f"of range (position must be in [0, {self.tokens_per_epoch})).")
    self._offset = epoch * self.tokens_per_epoch + position


def eval_batches(token_docs: Sequence[np.ndarray], *, batch_size: int, seq_len: int,
                 bos_id: int | None = BOS, eos_id: int | None = EOS, pad_id: int = PAD,
                 process_index: int = 0, process_count: int = 1,
                 max_batches: int | None = None) -> list[Batch]:
  """A fixed, finite list of batches covering ``token_docs`` once, in order (no shuffling).

  Same layout as :class:`PackedDataset`; the last row is padded with ``pad_id`` and the last batch
  with empty rows (``segment_ids`` 0, ``loss_mask`` 0), so ``sum(loss * loss_mask) /
  sum(loss_mask)`` over all batches is the exact per-token loss of the documents and
  ``exp`` of it the perplexity.  Every host gets the same number of batches (its slice of each).
  ``max_batches`` keeps only the first batches (a quicker, still fixed, estimate).
  """
  who = "eval_batches"
  docs = _check_docs(token_docs, who)
  _check_layout(who, batch_size, seq_len, process_index, process_count)
  if max_batches is not None and int(max_batches) < 1:
    raise ValueError(f"{who}: `max_batches` must be >= 1 or None, got {max_batches!r}.")
  stream, ids = _concat(docs, bos_id, eos_id, first_doc_id=0)
  t = int(seq_len)
  rows = max(1, -(-(len(stream) - 1) // t))  # rows needed so every token is a target once
  num_batches = -(-rows // batch_size)
  if max_batches is not None:
    num_batches = min(num_batches, int(max_batches))
  total = num_batches * batch_size * t + 1
  stream = np.concatenate([stream, np.full(max(0, total - len(stream)), pad_id, np.int32)])[:total]
  ids = np.concatenate([ids, np.full(max(0, total - len(ids)), -1, np.int64)])[:total]
  b = batch_size // process_count
  idx = np.arange(b)[:, None] * t + np.arange(t + 1)[None, :]
  out = []
  for k in range(num_batches):
    first = (k * batch_size + process_index * b) * t
    out.append(_rows_to_batch(stream[first:][idx], ids[first:][idx]))
  return out
