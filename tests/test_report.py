"""The experiment report: runs sections end to end, links plots that exist, survives a failing
section and says so in its exit status."""

import json
import pathlib
import re

import pytest

from experiments import report


def _links(markdown: str) -> list[str]:
  return re.findall(r"!\[[^\]]*\]\(([^)]+)\)", markdown)


def test_report_smoke_end_to_end(tmp_path):
  metrics = tmp_path / "metrics.jsonl"
  metrics.write_text("\n".join(json.dumps(r) for r in [
      {"step": 1, "loss": 5.5}, {"step": 2, "loss": 4.0},
      {"step": 2, "eval_loss": 3.9, "eval_ppl": 49.4},
      {"step": 3, "loss": 3.0, "tokens_per_s": 1e3}]))
  out = tmp_path / "results"
  rc = report.main(["--smoke", "--out", str(out), "--train-metrics", str(metrics), "--only",
                    "kv_cache,length_extrapolation,hadamard_quant,bench_train,training"])
  assert rc == 0
  md = (out / "REPORT.md").read_text()
  links = _links(md)
  # A plot each from length extrapolation, Hadamard quantization, bench_train, the training run.
  for name in ("length_extrapolation.png", "hadamard_quant.png", "bench_train.png", "training.png"):
    assert name in links, (name, links)
  for link in links:
    assert not pathlib.Path(link).is_absolute()
    assert (out / link).is_file() and (out / link).stat().st_size > 1000, link
  for name in ("kv_cache", "length_extrapolation", "hadamard_quant", "bench_train", "training"):
    rec = json.loads((out / f"{name}.json").read_text())
    assert rec["status"] == "ok", (name, rec["error"])
    assert f"({name}.json)" in md
  le = json.loads((out / "length_extrapolation.json").read_text())["summary"]
  assert le["learned"]["32"] == "n/a (no row for position >= 16)"
  assert le["rope"]["32"] > 1.0
  kv = json.loads((out / "kv_cache.json").read_text())["summary"]
  assert kv["MLA"]["numbers_per_token_per_layer"] == 576
  train = json.loads((out / "training.json").read_text())["summary"]
  assert (train["first_loss"], train["last_loss"], train["last_eval_loss"]) == (5.5, 3.0, 3.9)
  bench = json.loads((out / "bench_train.json").read_text())["summary"]
  assert bench["presets"]["llama"]["tokens_per_second"] > 0 and 0 < bench["presets"]["llama"]["mfu"]


def test_failing_section_is_recorded_and_the_rest_runs(tmp_path, monkeypatch):
  def broken(sec, size, folder, out, args):
    raise RuntimeError("simulated experiment crash")

  monkeypatch.setitem(report.BUILDERS, "hadamard_quant", broken)
  out = tmp_path / "r"
  rc = report.main(["--smoke", "--out", str(out), "--only", "hadamard_quant,kv_cache,training",
                    "--train-metrics", str(tmp_path / "missing.jsonl")])
  assert rc == 1
  md = (out / "REPORT.md").read_text()
  assert "FAILED" in md and "simulated experiment crash" in md
  assert json.loads((out / "hadamard_quant.json").read_text())["status"] == "failed"
  assert json.loads((out / "kv_cache.json").read_text())["status"] == "ok"
  assert json.loads((out / "training.json").read_text())["status"] == "skipped"
  assert "| MLA | 576 |" in md  # the section after the failure still reported its table


def test_unknown_section_and_bad_metrics(tmp_path):
  with pytest.raises(ValueError, match="unknown section"):
    report.main(["--only", "kv_cache,nonesuch", "--out", str(tmp_path)])
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"step": 1, "loss": 2.0}\nnot json\n')
  with pytest.raises(ValueError, match="line 2"):
    report.read_metrics(bad)
