"""The length-extrapolation experiment: evaluation rows, the loss it reports, and the learned
table's "n/a" beyond its rows."""

import math

import jax
import numpy as np
import pytest

from experiments import length_extrapolation as le
from jaxattn.train.data import BOS, EOS, load_text, split_documents, tokenize_documents

TINY = dict(embed_dim=16, num_layers=1, num_heads=2, num_kv_heads=1, mlp_dim=32)


def test_eval_rows_golden():
  tokens, doc = le.eval_stream([np.array([5, 6, 7]), np.array([8, 9])])
  np.testing.assert_array_equal(tokens, [BOS, 5, 6, 7, EOS, BOS, 8, 9, EOS])
  np.testing.assert_array_equal(doc, [0, 0, 0, 0, 0, 1, 1, 1, 1])
  rows = le.eval_rows(tokens, doc, 2, 8)
  np.testing.assert_array_equal(rows["tokens"], [[BOS, 5], [6, 7], [EOS, BOS], [8, 9]])
  np.testing.assert_array_equal(rows["targets"], [[5, 6], [7, EOS], [BOS, 8], [9, EOS]])
  # Only the EOS -> BOS step crosses documents.
  np.testing.assert_array_equal(rows["loss_mask"], [[1, 1], [1, 1], [0, 1], [1, 1]])
  # Every length that divides num_tokens scores the same (input, target) pairs.
  long = le.eval_rows(tokens, doc, 4, 8)
  for k in ("tokens", "targets", "loss_mask"):
    np.testing.assert_array_equal(long[k].reshape(-1), rows[k].reshape(-1))


def test_errors_name_the_argument():
  with pytest.raises(ValueError, match="scheme"):
    le.scheme_config("xpos", train_len=16, max_eval_len=32)
  with pytest.raises(ValueError, match="schemes"):
    le.run(schemes=("rope", "kerple"), steps=0)
  with pytest.raises(ValueError, match="steps"):
    le.run(schemes=("rope",), steps=-1)
  tokens, doc = le.eval_stream([np.arange(3, 10)])
  with pytest.raises(ValueError, match="num_tokens"):
    le.eval_rows(tokens, doc, 4, 16)
  with pytest.raises(ValueError, match="eval_lens"):
    le.run(schemes=("rope",), steps=0, train_len=16, eval_lens=(16, 4096), eval_tokens=100,
           **TINY)


def test_learned_table_is_train_length_others_cover_eval():
  assert le.scheme_config("learned", train_len=256, max_eval_len=2048).max_seq_len == 256
  for scheme in ("sinusoidal", "t5", "alibi", "rope", "nope"):
    cfg = le.scheme_config(scheme, train_len=256, max_eval_len=2048)
    assert cfg.max_seq_len == 2048 and cfg.position == {"rope": "rope", "nope": "none"}.get(
        scheme, scheme)


def test_finite_at_twice_train_length_and_na_for_learned():
  # steps=0 evaluates the initialized models (no train step to compile); the contract is about
  # evaluation, which is the same code whatever the weights.
  res = le.run(schemes=("learned", "sinusoidal", "t5", "alibi", "rope"), steps=0, train_len=16,
               eval_lens=(16, 32), eval_tokens=64, **TINY)
  assert res["config"]["eval_tokens"] == 64
  learned = res["schemes"]["learned"]["eval"]
  assert math.isfinite(learned["16"]["ppl"])
  assert learned["32"]["ppl"] is None
  assert learned["32"]["na"] == "n/a (no row for position >= 16)"
  for scheme in ("sinusoidal", "t5", "alibi", "rope"):
    e = res["schemes"][scheme]["eval"]["32"]
    assert e["na"] is None
    assert math.isfinite(e["ppl"]) and math.isfinite(e["beyond_ppl"]), scheme
    # An untrained model is near uniform over the 259 byte ids.
    assert abs(e["loss"] - math.log(259)) < 0.5, (scheme, e["loss"])
  assert "n/a (no row for position >= 16)" in le.format_table(res)


def test_reported_loss_matches_numpy_reference():
  docs = load_text(None)
  _, held = split_documents(docs, eval_every=5)
  stream = le.eval_stream(tokenize_documents(held))
  cfg = le.scheme_config("alibi", train_len=16, max_eval_len=32, **TINY)
  graphdef, state, losses = le.train_model(cfg, tokenize_documents(docs[:4]), steps=0,
                                           batch_size=2, seq_len=16)
  assert losses == []
  # 3 rows in batches of 2: the last batch is padded with masked rows.
  got = le.evaluate_lengths(graphdef, state, cfg, stream, (32,), train_len=16, num_tokens=96,
                            tokens_per_batch=64)["32"]
  # Reference: the model's logits on hand-cut rows, log-softmax in float64 NumPy.
  from flax import nnx
  model = nnx.merge(graphdef, state.params, state.rest)
  toks, doc = stream
  inp = np.stack([toks[s:s + 32] for s in (0, 32, 64)])
  tgt = np.stack([toks[s + 1:s + 33] for s in (0, 32, 64)])
  mask = np.stack([doc[s:s + 32] == doc[s + 1:s + 33] for s in (0, 32, 64)]).astype(np.float64)
  logits = np.asarray(model(jax.numpy.asarray(inp)), np.float64)
  logp = logits - logits.max(-1, keepdims=True)
  logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
  nll = -np.take_along_axis(logp, tgt[..., None], -1)[..., 0]
  np.testing.assert_allclose(got["loss"], (nll * mask).sum() / mask.sum(), rtol=1e-5)
  np.testing.assert_allclose(got["beyond_loss"],
                             (nll * mask)[:, 16:].sum() / mask[:, 16:].sum(), rtol=1e-5)
  assert got["tokens"] == int(mask.sum())
  np.testing.assert_allclose(got["ppl"], math.exp(got["loss"]), rtol=1e-6)


def test_training_updates_from_uniform_start():
  docs = tokenize_documents(load_text(None)[:6])
  cfg = le.scheme_config("rope", train_len=16, max_eval_len=32, **TINY)
  _, _, losses = le.train_model(cfg, docs, steps=3, batch_size=2, seq_len=16,
                                learning_rate=1e-2)
  assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
  assert abs(losses[0] - math.log(259)) < 0.5
