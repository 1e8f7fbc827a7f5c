"""The experiment report: runs sections end to end, links plots that exist, survives a failing
section and says so in its exit status."""

import json
import pathlib
import re
import types

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


def test_lora_section_reports_memory(tmp_path, monkeypatch):
  def run(name, peak, with_memory=True):
    r = dict(trainable=10, frozen=0, shifted_loss_before=3.0, shifted_loss_after=2.0,
             copy_loss_after=1.0, seconds_per_step=0.01)
    if with_memory:
      r["memory"] = dict(peak_bytes=peak * 2**20)
    return r

  data = dict(args=dict(pretrain_steps=1, finetune_steps=1, shift=5, mem_batch=2, mem_seq=16),
              results={"full": run("full", 4.0), "lora": run("lora", 2.0),
                       "qlora": run("qlora", 0, with_memory=False)},
              memory_only={"64x1x128": {"full": dict(trainable=5, frozen=0,
                                                     memory=dict(peak_bytes=8 * 2**20)),
                                        "lora": dict(trainable=1, frozen=5,
                                                     memory=dict(peak_bytes=2 * 2**20))}})
  monkeypatch.setattr(report, "_run_experiment", lambda *a: (None, data))
  sec = report.Section("lora_finetune")
  report.section_lora_finetune(sec, "smoke", tmp_path, tmp_path, None)
  assert sec.summary["lora"]["peak_mib"] == 2.0 and sec.summary["qlora"]["peak_mib"] is None
  assert "peak MiB | peak / full |" in sec.markdown
  assert "| lora | 10 | 3 | 2 | 1 | 10 | 2 | 0.5 |" in sec.markdown
  assert "| qlora | 10 | 3 | 2 | 1 | 10 | n/a | n/a |" in sec.markdown
  assert "64x1x128" in sec.markdown and "| lora | 1 | 5 | 2 | 0.25 |" in sec.markdown


def _smoke_section(tmp_path, name):
  """Runs the report's section ``name`` alone at the smoke size (no training run); returns its
  JSON record (checked ok) and the report's folder."""
  out = tmp_path / "r"
  rc = report.main(["--smoke", "--out", str(out), "--only", name,
                    "--train-metrics", str(tmp_path / "missing.jsonl")])
  assert rc == 0
  rec = json.loads((out / f"{name}.json").read_text())
  assert rec["status"] == "ok", rec["error"]
  return rec, out


def test_kv_quant_quality_section(tmp_path):
  """The quantized-cache section (smoke: a model trained one step): perplexity, KL and top-1
  agreement per cache, the float cache equal to the full forward pass, int8 / fp8 bytes."""
  rec, out = _smoke_section(tmp_path, "kv_quant_quality")
  s = rec["summary"]
  assert set(s) == {"float", "int8", "fp8"}
  assert s["float"]["kl_mean"] == 0 and s["float"]["top1_agreement"] == 1
  assert 0 <= s["int8"]["kl_mean"] < 0.05 and s["int8"]["vs_bf16_bytes"] < 1
  assert rec["data"]["full_forward_max_err"] < 1e-3
  assert "kv_quant_quality.png" in _links((out / "REPORT.md").read_text())


def test_speculative_section(tmp_path):
  """The speculative-decoding section (smoke: untrained tiny models): per row the speed-up,
  acceptance and tokens per call, greedy outputs equal to generate's, the bench's plot linked."""
  rec, out = _smoke_section(tmp_path, "speculative")
  s = rec["summary"]
  assert list(s) == ["generate (no draft)", "ngram k=2", "draft k=2", "generate (MTP model)",
                     "mtp k=2"]
  assert s["generate (no draft)"]["speedup"] == 1.0
  assert s["generate (no draft)"]["acceptance_rate"] is None
  for name, r in s.items():
    assert r["equals_generate"] is True and r["speedup"] > 0, name
    assert 1 <= r["tokens_per_call"] <= 3, name
  assert 0 <= s["ngram k=2"]["acceptance_rate"] <= 1
  assert rec["data"]["greedy_mismatches"] == {} and rec["data"]["prompts"] == 1
  md = (out / "REPORT.md").read_text()
  assert "speculative.png" in _links(md)
  assert "| ngram k=2 |" in md and "untrained (smoke)" in md and "FAILED" not in md


def test_speculative_section_shows_a_greedy_mismatch(tmp_path, monkeypatch):
  """A greedy row whose tokens differ from generate's fails the section, in its table and text;
  a training run, else this report's kv_quant_quality model, is passed as ``--run``."""
  row = lambda name, draft, k, mismatched: dict(
      name=name, draft=draft, k=k, temperature=0.0, tokens_per_s=100.0, speedup=1.5,
      acceptance_rate=None if draft is None else 0.5, tokens_per_call=2.0 if draft else 1.0,
      mismatched_prompts=mismatched)
  data = dict(model="runs/train (step 80)", draft="r/draft (step 80)", mtp_model="r/mtp (step 80)",
              eval_loss=dict(model=1.25, mtp=1.5),
              parameters=dict(model=800_000, draft=60_000, mtp=900_000, mtp_modules=100_000),
              prompts=4, prompt_len=64,
              new_tokens=64, repeats=1, backend="cpu", device="cpu", cpu_count=2,
              greedy_mismatches={"ngram k=2": 3},
              rows=[row("generate (no draft)", None, None, 0), row("ngram k=2", "ngram", 2, 3),
                    row("draft k=2", "model", 2, 0)],
              engine_rows=[dict(name="engine (MTP model)", draft=None, speedup=1.0,
                                acceptance_rate=None, tokens_per_step=1.0, mismatched_prompts=0),
                           dict(name="engine mtp k=4", draft="mtp", speedup=1.9,
                                acceptance_rate=0.961, tokens_per_step=4.63,
                                mismatched_prompts=2),
                           dict(name="engine mtp k=4 T=0.8", draft="mtp", temperature=0.8,
                                speedup=1.2, acceptance_rate=0.572, tokens_per_step=2.5,
                                mismatched_prompts=None)])
  calls = []
  monkeypatch.setattr(report, "_run_experiment", lambda *a: calls.append(a) or (1, data))
  args = types.SimpleNamespace(train_metrics=str(tmp_path / "train" / "metrics.jsonl"))
  sec = report.Section("speculative")
  report.section_speculative(sec, "quick", tmp_path, tmp_path, args)
  assert sec.status == "failed" and "ngram k=2 on 3 of 4 prompts" in sec.error
  assert sec.summary["ngram k=2"]["equals_generate"] is False
  assert sec.summary["draft k=2"]["equals_generate"] is True
  assert "**ERROR: greedy speculative output differs" in sec.markdown
  assert "| ngram k=2 | 100 | 1.50x | 50.0% | 2.00 | **NO** (3 of 4) |" in sec.markdown
  # the serving engine's rows, in a sentence
  assert ("all 4 prompts in one batch, greedy, and sampled at T = 0.8), against the same "
          "model's engine without drafts: `engine mtp k=4` 1.90x (96% of drafts kept, 4.63 "
          "tokens per slot-step), `engine mtp k=4 T=0.8` 1.20x (57% of drafts kept, 2.50 tokens "
          "per slot-step); **tokens differ from the baseline's in engine mtp k=4**"
          ) in sec.markdown
  assert "`runs/train` (step 80)" in sec.markdown and "80 steps" in sec.markdown
  assert "`r/mtp` (step 80) (0.10M of its 0.90M parameters" in sec.markdown
  assert "held-out loss 1.250 without, 1.500 with the MTP objective" in sec.markdown
  assert calls[-1][3] == []                             # no training run: the bench trains one
  (tmp_path / "kv").mkdir()
  (tmp_path / "kv" / "config.json").write_text("{}")
  (tmp_path / "kv_quant_quality.json").write_text(json.dumps(
      dict(status="ok", size="quick", data=dict(run=str(tmp_path / "kv")))))
  assert report._speculative_run("quick", tmp_path, args) == ["--run", str(tmp_path / "kv")]
  assert report._speculative_run("full", tmp_path, args) == []
  (tmp_path / "train").mkdir()
  (tmp_path / "train" / "config.json").write_text("{}")
  assert report._speculative_run("quick", tmp_path, args) == ["--run", str(tmp_path / "train")]
  assert report._speculative_run("smoke", tmp_path, args) == []
