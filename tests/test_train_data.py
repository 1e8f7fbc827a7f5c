"""Byte tokenizer, text sources, and the packed, resumable batch iterator (jaxattn.train.data)."""

import json
import sys

import numpy as np
import pytest

from jaxattn.train.data import (BOS, EOS, PAD, ByteTokenizer, PackedDataset, eval_batches,
                                load_text, split_documents, tokenize_documents)

KEYS = ("tokens", "targets", "segment_ids", "positions", "loss_mask")


def _random_docs(seed=0, n=7, lo=1, hi=40):
  rng = np.random.default_rng(seed)
  # Ids >= 3 like byte tokens, so BOS / EOS / PAD never occur inside a document.
  return [rng.integers(3, 259, size=int(rng.integers(lo, hi))).astype(np.int32) for _ in range(n)]


def _reference_epoch(docs, seed, epoch):
  """The documented packing order, built independently: shuffle by (seed, epoch), wrap, concat."""
  order = np.random.default_rng([seed, epoch]).permutation(len(docs))
  return np.concatenate([np.concatenate([[BOS], docs[i], [EOS]]) for i in order]).astype(np.int32)


# -- tokenizer ------------------------------------------------------------------------------------

def test_tokenizer_round_trip_and_layout():
  tok = ByteTokenizer()
  text = "Hello, world!\nUnicode: h\u00e9llo \u2014 \u65e5\u672c\u8a9e \U0001F600"
  ids = tok.encode(text)
  assert ids.dtype == np.int32 and tok.vocab_size == 259
  np.testing.assert_array_equal(ids, np.frombuffer(text.encode("utf-8"), np.uint8) + 3)
  assert tok.decode(ids) == text
  wrapped = tok.encode(text, add_bos=True, add_eos=True)
  assert wrapped[0] == BOS and wrapped[-1] == EOS and tok.decode(wrapped) == text
  # Specials are skipped wherever they are.
  assert tok.decode([PAD, BOS, *tok.encode("ab"), EOS, PAD, *tok.encode("c")]) == "abc"
  # A multi-byte character cut in half decodes to U+FFFD instead of raising.
  assert tok.decode(tok.encode("\u00e9")[:1]) == "\ufffd"


def test_tokenizer_errors():
  tok = ByteTokenizer()
  with pytest.raises(ValueError, match=r"\[0, 259\).*\[259\]"):
    tok.decode([5, 259])
  with pytest.raises(ValueError, match="-1"):
    tok.decode(np.array([-1, 4]))
  with pytest.raises(ValueError, match="must be a str"):
    tok.encode(b"bytes")


# -- sources --------------------------------------------------------------------------------------

def test_builtin_text_is_real_and_deterministic():
  docs = load_text(None)
  assert docs == load_text("builtin")
  assert len(docs) > 50 and sum(map(len, docs)) > 300_000
  text = " ".join(docs)
  for word in (" the ", " and ", " function ", " statement "):
    assert text.count(word) > 20, word
  # Mostly letters and spaces, as English prose is (not binary or a code dump).
  letters = sum(c.isalpha() or c.isspace() for c in text)
  assert letters / len(text) > 0.8
  token_docs = tokenize_documents(docs)
  assert sum(map(len, token_docs)) == sum(len(d.encode()) for d in docs)


def test_text_file_paragraphs_and_delimiter(tmp_path):
  path = tmp_path / "corpus.txt"
  path.write_text("First paragraph\nstill first.\n\n  \nSecond one.\n\n\nThird<|sep|>Fourth\n",
                  encoding="utf-8")
  assert load_text(str(path)) == ["First paragraph\nstill first.", "Second one.",
                                  "Third<|sep|>Fourth"]
  assert load_text(path, delimiter="<|sep|>") == [
      "First paragraph\nstill first.\n\n  \nSecond one.\n\n\nThird", "Fourth"]
  with pytest.raises(ValueError, match="delimiter"):
    load_text(path, delimiter="")
  (tmp_path / "empty.txt").write_text("\n\n  \n")
  with pytest.raises(ValueError, match="no text"):
    load_text(tmp_path / "empty.txt")
  with pytest.raises(FileNotFoundError, match="nope.txt.*builtin.*hf:"):
    load_text(str(tmp_path / "nope.txt"))
  with pytest.raises(ValueError, match="source"):
    load_text(42)


def test_hf_source_errors(monkeypatch):
  with pytest.raises(ValueError, match="hf:NAME"):
    load_text("hf:")
  with pytest.raises(ValueError, match="hf:NAME"):
    load_text("hf:a:b:c:d")
  monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
  with pytest.raises(ImportError, match="pip install datasets.*network"):
    load_text("hf:wikitext:wikitext-2-raw-v1")


def test_split_documents():
  docs = list(range(45))
  train, held = split_documents(docs, eval_every=20)
  assert held == [19, 39] and train == [d for d in docs if d not in (19, 39)]
  train, held = split_documents(docs, eval_every=2)
  assert held == docs[1::2] and train == docs[::2]
  with pytest.raises(ValueError, match="eval_every"):
    split_documents(docs, eval_every=1)
  with pytest.raises(ValueError, match="both must be non-empty"):
    split_documents(list(range(5)), eval_every=20)


# -- packing --------------------------------------------------------------------------------------

def _check_row_invariants(batch, seq_len):
  b = batch["tokens"].shape[0]
  for key in KEYS:
    assert batch[key].shape == (b, seq_len), key
  assert batch["loss_mask"].dtype == np.float32
  assert all(batch[k].dtype == np.int32 for k in KEYS[:4])
  seg, pos = batch["segment_ids"], batch["positions"]
  # Targets are the inputs shifted by one inside a row.
  np.testing.assert_array_equal(batch["targets"][:, :-1], batch["tokens"][:, 1:])
  for r in range(b):
    real = seg[r] > 0
    if not real.all():  # padding (eval only) is a suffix of the row, with position 0
      assert not real[np.argmin(real):].any() and np.all(pos[r][~real] == 0)
    if not real.any():
      continue
    s, p = seg[r][real], pos[r][real]
    assert s[0] == 1 and p[0] == 0
    new = np.diff(s) != 0
    assert np.all(np.diff(s)[new] == 1)                    # ids count up 1, 2, 3, ...
    np.testing.assert_array_equal(p[1:][new], 0)            # positions restart in each segment
    np.testing.assert_array_equal(p[1:][~new], p[:-1][~new] + 1)


@pytest.mark.parametrize("seq_len,batch_size", [(8, 3), (16, 2), (5, 1)])
def test_packing_matches_reference_stream(seq_len, batch_size):
  docs = _random_docs(seed=seq_len)
  ds = PackedDataset(docs, batch_size=batch_size, seq_len=seq_len, seed=3)
  n_epoch = sum(len(d) + 2 for d in docs)
  assert ds.tokens_per_epoch == n_epoch
  reference = np.concatenate([_reference_epoch(docs, 3, e) for e in range(3)])
  rows_needed = -(-2 * n_epoch // seq_len)  # two full epochs of inputs
  tokens, targets, masks = [], [], []
  for _ in range(-(-rows_needed // batch_size)):
    batch = next(ds)
    _check_row_invariants(batch, seq_len)
    assert np.all(batch["segment_ids"] > 0)              # the training stream has no padding
    tokens.append(batch["tokens"].reshape(-1))
    targets.append(batch["targets"].reshape(-1))
    masks.append(batch["loss_mask"].reshape(-1))
  tokens, targets, masks = map(np.concatenate, (tokens, targets, masks))
  # Every token of every epoch is an input exactly once and a target exactly once, in the
  # documented order; consecutive epochs use different shuffles.
  np.testing.assert_array_equal(tokens, reference[:len(tokens)])
  np.testing.assert_array_equal(targets, reference[1:len(tokens) + 1])
  assert not np.array_equal(_reference_epoch(docs, 3, 0), _reference_epoch(docs, 3, 1))
  # The loss is off exactly where the target crosses into the next document (EOS -> BOS).
  np.testing.assert_array_equal(masks == 0, tokens == EOS)
  assert abs(ds.epoch - len(tokens) / n_epoch) < 1e-9


def test_long_document_spans_rows_and_boundaries_without_bos_eos():
  docs = [np.arange(3, 30, dtype=np.int32), np.arange(100, 104, dtype=np.int32)]
  ds = PackedDataset(docs, batch_size=4, seq_len=8, seed=0, bos_id=None, eos_id=None)
  assert ds.tokens_per_epoch == 31
  batch = next(ds)  # 32 inputs + 1 lookahead: all of epoch 0 and the start of epoch 1
  _check_row_invariants(batch, 8)
  stream, doc_of = [], []
  for epoch in (0, 1):
    for i in np.random.default_rng([0, epoch]).permutation(2):
      stream.append(docs[i])
      doc_of.append(np.full(len(docs[i]), 2 * epoch + i))
  stream, doc_of = np.concatenate(stream), np.concatenate(doc_of)
  np.testing.assert_array_equal(batch["tokens"].reshape(-1), stream[:32])
  # Without BOS/EOS the crossing target is the next document's first token: masked there only.
  np.testing.assert_array_equal(batch["loss_mask"].reshape(-1) == 0, doc_of[1:33] != doc_of[:32])
  # The 27-token document fills more than three rows; each row restarts its segment at 0.
  assert np.all(batch["positions"][:, 0] == 0) and np.all(batch["segment_ids"][:, 0] == 1)


def test_single_document_corpus_has_a_boundary_between_epochs():
  doc = np.arange(3, 13, dtype=np.int32)
  ds = PackedDataset([doc], batch_size=1, seq_len=11, seed=0, bos_id=None, eos_id=None)
  batch = next(ds)  # 10 tokens of epoch 0, then the first token of epoch 1
  np.testing.assert_array_equal(batch["segment_ids"][0], [1] * 10 + [2])
  np.testing.assert_array_equal(batch["positions"][0], list(range(10)) + [0])
  np.testing.assert_array_equal(batch["loss_mask"][0], [1] * 9 + [0, 1])


def test_resume_yields_exactly_the_uninterrupted_batches():
  docs = _random_docs(seed=5, n=9)
  kw = dict(batch_size=3, seq_len=7, seed=11)
  full = PackedDataset(docs, **kw)
  expected = [next(full) for _ in range(25)]  # crosses several epoch boundaries
  for n in (0, 4, 13):
    first = PackedDataset(docs, **kw)
    for _ in range(n):
      next(first)
    state = json.loads(json.dumps(first.state()))  # what the checkpoint stores
    assert set(state) >= {"epoch", "position"}
    fresh = PackedDataset(docs, **kw)
    fresh.restore(state)
    for k in range(n, 25):
      got = next(fresh)
      for key in KEYS:
        np.testing.assert_array_equal(got[key], expected[k][key], err_msg=f"batch {k} {key}")


def test_restore_refuses_other_data_and_bad_state():
  docs = _random_docs()
  ds = PackedDataset(docs, batch_size=2, seq_len=4, seed=0)
  next(ds)
  state = ds.state()
  with pytest.raises(ValueError, match="seed"):
    PackedDataset(docs, batch_size=2, seq_len=4, seed=1).restore(state)
  other = [d.copy() for d in docs]
  other[0][0] += 1  # same lengths, one token differs
  with pytest.raises(ValueError, match="fingerprint"):
    PackedDataset(other, batch_size=2, seq_len=4, seed=0).restore(state)
  with pytest.raises(ValueError, match="fingerprint"):  # other special tokens, other stream
    PackedDataset(docs, batch_size=2, seq_len=4, seed=0, bos_id=7, eos_id=8).restore(state)
  with pytest.raises(ValueError, match="lacks"):
    ds.restore({"epoch": 0})
  with pytest.raises(ValueError, match="out of range"):
    ds.restore({"epoch": 0, "position": ds.tokens_per_epoch})


@pytest.mark.parametrize("process_count", [2, 4])
def test_hosts_partition_the_global_batch(process_count):
  docs = _random_docs(seed=2, n=6)
  kw = dict(batch_size=4, seq_len=6, seed=7)
  whole = PackedDataset(docs, **kw)
  hosts = [PackedDataset(docs, **kw, process_index=p, process_count=process_count)
           for p in range(process_count)]
  for _ in range(6):
    global_batch = next(whole)
    slices = [next(h) for h in hosts]
    for key in KEYS:
      np.testing.assert_array_equal(np.concatenate([s[key] for s in slices]), global_batch[key])
  assert all(h.state() == whole.state() for h in hosts)


def test_layout_errors():
  docs = _random_docs()
  with pytest.raises(ValueError, match="batch_size"):
    PackedDataset(docs, batch_size=0, seq_len=4)
  with pytest.raises(ValueError, match="seq_len"):
    PackedDataset(docs, batch_size=2, seq_len=0)
  with pytest.raises(ValueError, match="divisible"):
    PackedDataset(docs, batch_size=3, seq_len=4, process_count=2)
  with pytest.raises(ValueError, match="process_index"):
    PackedDataset(docs, batch_size=4, seq_len=4, process_index=2, process_count=2)
  with pytest.raises(ValueError, match="empty"):
    PackedDataset([], batch_size=2, seq_len=4)
  with pytest.raises(ValueError, match=r"token_docs\[1\].*1-D"):
    PackedDataset([docs[0], np.ones((2, 2), np.int32)], batch_size=2, seq_len=4)
  with pytest.raises(ValueError, match="at least 2"):
    PackedDataset([np.array([5], np.int32)], batch_size=1, seq_len=4, bos_id=None, eos_id=None)
  with pytest.raises(ValueError, match="max_batches"):
    eval_batches(docs, batch_size=2, seq_len=4, max_batches=0)
  with pytest.raises(ValueError, match="`batch_size` must be an int"):  # was truncated to 2
    PackedDataset(docs, batch_size=2.7, seq_len=4)
  with pytest.raises(ValueError, match="above the int32 range"):   # the cast wrapped it
    PackedDataset([np.array([5, 2**31 + 5], np.int64)], batch_size=1, seq_len=4)


def test_eval_batches_cover_the_documents_once():
  docs = _random_docs(seed=9, n=5)
  batches = eval_batches(docs, batch_size=3, seq_len=8)
  assert batches and all(b["tokens"].shape == (3, 8) for b in batches)
  for b in batches:
    _check_row_invariants(b, 8)
  stream = np.concatenate([np.concatenate([[BOS], d, [EOS]]) for d in docs])
  tokens = np.concatenate([b["tokens"].reshape(-1) for b in batches])
  segs = np.concatenate([b["segment_ids"].reshape(-1) for b in batches])
  masks = np.concatenate([b["loss_mask"].reshape(-1) for b in batches])
  # In order, no shuffle; the final EOS is an input only when it does not end a row exactly.
  n_real = int(np.sum(segs > 0))
  assert len(stream) - 1 <= n_real <= len(stream)
  np.testing.assert_array_equal(tokens[segs > 0], stream[:n_real])
  assert np.all(tokens[segs == 0] == PAD) and np.all(masks[segs == 0] == 0)
  # One counted target per transition inside a document: BOS->first ... last->EOS.
  assert masks.sum() == sum(len(d) + 1 for d in docs)
  # The last batch is padded; fewer rows would miss targets.
  assert (len(batches) - 1) * 3 * 8 < len(stream) - 1 <= len(batches) * 3 * 8
  again = eval_batches(docs, batch_size=3, seq_len=8)
  assert all(np.array_equal(a[k], b[k]) for a, b in zip(batches, again) for k in KEYS)
  assert len(eval_batches(docs, batch_size=3, seq_len=8, max_batches=1)) == 1
  # Hosts get slices of the same global batches.
  halves = [eval_batches(docs, batch_size=4, seq_len=8, process_index=p, process_count=2)
            for p in range(2)]
  whole = eval_batches(docs, batch_size=4, seq_len=8)
  assert len(halves[0]) == len(halves[1]) == len(whole)
  for a, b, w in zip(*halves, whole):
    np.testing.assert_array_equal(np.concatenate([a["targets"], b["targets"]]), w["targets"])
    np.testing.assert_array_equal(np.concatenate([a["loss_mask"], b["loss_mask"]]), w["loss_mask"])
