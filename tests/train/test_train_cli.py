"""The training job end to end: loss falls, kill-and-resume reproduces the uninterrupted run."""

import json

import numpy as np
import pytest

from experiments import train as train_cli

COMMON = ["--preset", "llama", "--set", "embed_dim=32", "mlp_dim=64", "num_layers=2",
          "--batch-size", "8", "--seq-len", "32", "--eval-batches", "1", "--eval-every", "0",
          "--sample-tokens", "8", "--lr", "1e-2", "--warmup", "2"]


def _strict_loads(text):
  """``json.loads`` that refuses the bare ``NaN`` / ``Infinity`` strict JSON does not have."""
  def refuse(name):
    raise ValueError(f"not strict JSON: {name}")
  return json.loads(text, parse_constant=refuse)


def _records(out):
  return [_strict_loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]


def _losses(out):
  return {r["step"]: r["loss"] for r in _records(out) if "loss" in r}


def test_kill_and_resume_reproduces_the_uninterrupted_run(tmp_path, monkeypatch):
  a, b = tmp_path / "a", tmp_path / "b"
  summary = train_cli.train(train_cli.make_parser().parse_args(
      COMMON + ["--steps", "8", "--save-every", "100", "--out", str(a)]))
  assert summary["last_loss"] < summary["first_loss"]
  assert np.isfinite(summary["eval_ppl"]) and len(summary["sample"]) > 0
  assert _strict_loads((a / "summary.json").read_text())["last_loss"] == summary["last_loss"]
  # the first (compiling) step has no timed window: its tokens/s is null, not a bare NaN
  recs = {r["step"]: r for r in _records(a) if "loss" in r}
  assert recs[1]["tokens_per_s"] is None and recs[1]["mfu_flops"] is None
  assert all(recs[s]["tokens_per_s"] > 0 for s in range(2, 9))
  from experiments import generate as generate_cli
  calls = []
  real = generate_cli.generate
  monkeypatch.setattr(generate_cli, "generate", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
  assert generate_cli.main(["--run", str(a), "--max-new-tokens", "4"]) == 0
  # stops at the EOS the training data ends every document with
  assert calls[-1]["eos_id"] == train_cli.ByteTokenizer.eos_id == 2
  assert calls[-1]["cache_dtype"] is None
  # an int8 KV cache from the command line
  assert generate_cli.main(["--run", str(a), "--max-new-tokens", "4", "--cache-dtype",
                            "int8"]) == 0
  assert calls[-1]["cache_dtype"] == "int8"
  # interrupted at step 5 (as by SIGINT): saves and stops; the rerun resumes and finishes
  first = train_cli.train(train_cli.make_parser().parse_args(
      COMMON + ["--steps", "8", "--save-every", "3", "--out", str(b), "--stop-at-step", "5",
                "--sample-tokens", "0"]))
  assert first == {"interrupted": True, "step": 5}
  resumed = train_cli.train(train_cli.make_parser().parse_args(
      COMMON + ["--steps", "8", "--save-every", "3", "--out", str(b), "--sample-tokens", "0"]))
  la, lb = _losses(a), _losses(b)
  assert sorted(lb) == list(range(1, 9))
  for s in range(1, 9):
    assert lb[s] == la[s], (s, lb[s], la[s])  # bit-identical, before and after the resume
  # The resumed run's summary covers the whole run (metrics.jsonl), not only steps 6..8.
  assert resumed["first_loss"] == summary["first_loss"] == la[1]
  assert resumed["last_loss"] == la[8]


def test_resume_refuses_another_config(tmp_path):
  out = tmp_path / "c"
  summary = train_cli.train(train_cli.make_parser().parse_args(
      COMMON + ["--steps", "2", "--out", str(out), "--sample-tokens", "0", "--log-every", "2"]))
  # with --log-every 2 the one logged window is a real measurement (it was dropped)
  assert summary["tokens_per_s"] is not None and summary["tokens_per_s"] > 0
  config = (out / "config.json").read_text()
  for change in (["--preset", "llama-alibi"],):   # same parameter shapes, another model
    with pytest.raises(ValueError, match="another model config|is shape"):
      train_cli.train(train_cli.make_parser().parse_args(
          COMMON + ["--steps", "4", "--out", str(out)] + change))
    # the refused run left the config that generate rebuilds the checkpoint with alone
    assert (out / "config.json").read_text() == config
  # another optimizer setting would silently continue a different run
  with pytest.raises(ValueError, match=r"optimizer settings: --lr 0.005 \(checkpoint: 0.01\)"):
    train_cli.train(train_cli.make_parser().parse_args(
        COMMON + ["--steps", "4", "--out", str(out), "--lr", "5e-3"]))
  # --no-resume over old checkpoints: refused before training (their step numbers would block
  # every save of the new run, leaving the old weights under its config and metrics).
  with pytest.raises(ValueError, match=r"--no-resume: `--out` .* already holds checkpoints \[2\]"):
    train_cli.train(train_cli.make_parser().parse_args(
        COMMON + ["--steps", "2", "--out", str(out), "--no-resume"]))


def test_mesh_and_process_layout_errors(tmp_path, monkeypatch):
  with pytest.raises(ValueError, match="size >= 1, got 'tensor=0'"):
    train_cli.parse_mesh("data=2,tensor=0")
  # two processes whose batch is not split over them would each feed rows of a half batch
  monkeypatch.setattr(train_cli.jax, "process_count", lambda: 2)
  with pytest.raises(ValueError, match=r"batch shards data x fsdp = 1 .* multiple of the 2 "):
    train_cli.train(train_cli.make_parser().parse_args(
        COMMON + ["--steps", "2", "--out", str(tmp_path / "mp"), "--mesh", "data=1,tensor=8"]))


def test_cli_argument_errors(tmp_path, capsys):
  with pytest.raises(ValueError, match="batch-size"):
    train_cli.train(train_cli.make_parser().parse_args(
        COMMON + ["--batch-size", "6", "--mesh", "data=4,tensor=2", "--out", str(tmp_path)]))
  with pytest.raises(ValueError, match=r"`--seq-len` \(30\) must be divisible by the context axis"):
    train_cli.train(train_cli.make_parser().parse_args(
        COMMON + ["--seq-len", "30", "--mesh", "data=2,context=4", "--out", str(tmp_path)]))
  with pytest.raises(ValueError, match="--mesh"):
    train_cli.parse_mesh("data:2")
  with pytest.raises(ValueError, match="names axis 'data' twice"):
    train_cli.parse_mesh("data=2,data=4")
  with pytest.raises(ValueError, match="--set"):
    train_cli.parse_overrides(["num_layers"])
  assert train_cli.parse_overrides(["num_layers=3", "norm=layer", "rope_scaling=None"]) == {
      "num_layers": 3, "norm": "layer", "rope_scaling": None}
  # Lowercase spellings too: "false" used to stay a (truthy) string.
  assert train_cli.parse_overrides(["scan_layers=false", "tie_embeddings=TRUE",
                                    "sliding_window=none", "logits_soft_cap=null"]) == {
      "scan_layers": False, "tie_embeddings": True, "sliding_window": None,
      "logits_soft_cap": None}
  assert train_cli.parse_overrides(["position=none", "remat=none"]) == {
      "position": "none", "remat": "none"}                   # string values named "none"
  with pytest.raises(ValueError, match="`--set`: 'nonsense' is not a ModelConfig field"):
    train_cli.parse_overrides(["nonsense=1"])
  with pytest.raises(ValueError, match="`gated_mlp` must be a bool, got 'no'"):
    train_cli.build_config(train_cli.make_parser().parse_args(["--set", "gated_mlp=no"]))
  # Bad numbers are refused by the parser, naming the flag, before any work.
  for flag, value in (("--clip", "-1"), ("--clip", "0"), ("--log-every", "0"), ("--keep", "0"),
                      ("--steps", "0"), ("--eval-batches", "0"), ("--eval-split-every", "1"),
                      ("--lr", "nan"), ("--warmup", "-1"), ("--weight-decay", "-0.1"),
                      ("--sample-temperature", "-1"), ("--sample-temperature", "nan"),
                      ("--sample-top-p", "0"), ("--sample-top-p", "1.5")):
    with pytest.raises(SystemExit):
      train_cli.make_parser().parse_args([flag, value])
    assert f"argument {flag}: must be" in capsys.readouterr().err
  # experiments.generate refuses bad sampling flags the same way, before loading the run.
  from experiments import generate as generate_cli
  for flag, value in (("--top-p", "0"), ("--top-k", "-1"), ("--temperature", "-1"),
                      ("--min-p", "1.5"), ("--min-p", "nan"), ("--eos-id", "-2")):
    with pytest.raises(SystemExit):
      generate_cli.main(["--run", str(tmp_path / "absent"), flag, value])
    assert f"argument {flag}: must be" in capsys.readouterr().err


def test_metrics_log_writes_strict_json(tmp_path):
  """Non-finite floats (a step with no timed window, a diverged loss) are written as null: a bare
  NaN is not JSON that strict readers (JavaScript, jq, pandas' default engine) accept.  A resume
  keeps the earlier lines and rewrites an older version's NaN as null as well."""
  path = tmp_path / "metrics.jsonl"
  log = train_cli.MetricsLog(path, 0)
  log.write(dict(step=1, loss=2.5, tokens_per_s=float("nan"), mfu_flops=None))
  log.write(dict(step=2, loss=float("inf"), tokens_per_s=np.float32(-np.inf), eval=[float("nan")]))
  log.write(dict(step=3, loss=1.0, tokens_per_s=123.5))
  assert [_strict_loads(l) for l in path.read_text().splitlines()] == [
      dict(step=1, loss=2.5, tokens_per_s=None, mfu_flops=None),
      dict(step=2, loss=None, tokens_per_s=None, eval=[None]),
      dict(step=3, loss=1.0, tokens_per_s=123.5)]
  with path.open("a") as f:                                 # as an older version wrote it
    f.write('{"step": 4, "loss": 0.5, "tokens_per_s": NaN}\n')
  resumed = train_cli.MetricsLog(path, 4)
  assert [r["step"] for r in resumed.earlier] == [1, 2, 3, 4]
  lines = [_strict_loads(l) for l in path.read_text().splitlines()]
  assert lines[-1] == dict(step=4, loss=0.5, tokens_per_s=None)
  train_cli.MetricsLog(path, 2)                             # a resume from step 2 drops 3 and 4
  assert [_strict_loads(l)["step"] for l in path.read_text().splitlines()] == [1, 2]
