"""The experiment report: runs the experiments at a quick size; writes JSON, plots and REPORT.md.

    python -m experiments.report [--quick | --smoke] [--out results] [--only a,b] [--skip a,b]
        [--train-metrics runs/train/metrics.jsonl]

Sections (each runs the experiment's own ``main(argv)`` in this process with small flags, under
``OUT/<name>/``):

    kv_cache              KV-cache bytes per token: MHA / GQA / MQA / MLA (experiments/demo.py)
    length_extrapolation  perplexity at 1x..8x the training length per positional scheme
    hadamard_quant        INT8 error and indexer top-K recall with and without Hadamard rotation
    moe_balance           expert load with and without auxiliary-loss-free balancing
    recall                associative recall: Gated DeltaNet, sliding window, full attention
    mhc_stability         composite residual mixing gain: plain, HC, mHC
    lora_finetune         LoRA / QLoRA / full fine-tuning: loss, trainable parameters, memory
    kv_quant_quality      a trained model read through float / int8 / FP8 KV caches
    speculative           speculative decoding (prompt lookup, a draft model, an MTP model's own
                          module) against generate
    bench_train           train-step tokens/s and MFU of the tiny presets
    training              the training run's loss curve, if ``--train-metrics`` exists

Writes ``OUT/<name>.json`` (status, seconds, key numbers, the experiment's data), its plots as
``OUT/<name>.png`` (``OUT/<name>_<plot>.png`` when there are several) and ``OUT/REPORT.md``, which
tabulates the key numbers and embeds the plots with relative links.  A section that fails is
recorded (error and traceback tail in its JSON and in the report) and the others still run; the
exit status is 1 if any section failed.  ``--quick`` (the default) sizes every experiment to a few
tens of seconds on a CPU (about 9 minutes in all on two idle cores); ``--smoke`` is the tiniest
setting that still runs every code path (for tests), not a measurement; ``--full`` uses each
experiment's own defaults (tens of minutes).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import json
import math
import pathlib
import re
import shutil
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

# Flags per size.  "full" passes none: each experiment's defaults are its full size.
FLAGS: dict[str, dict[str, list[str]]] = {
    "length_extrapolation": dict(
        quick=["--steps", "60", "--batch-size", "8", "--eval-tokens", "8192"],
        smoke=["--steps", "1", "--batch-size", "2", "--train-len", "16", "--eval-lens", "16,32",
               "--schemes", "learned,rope", "--embed-dim", "16", "--layers", "1", "--heads", "2",
               "--kv-heads", "1", "--mlp-dim", "32", "--eval-tokens", "64"]),
    "hadamard_quant": dict(
        quick=["--keys", "2048", "--queries", "32"],
        smoke=["--dim", "16", "--keys", "64", "--queries", "4", "--heads", "2", "--topk", "8",
               "--outliers", "1,100"]),
    "moe_balance": dict(
        quick=["--steps", "80", "--batch", "16"],
        smoke=["--steps", "2", "--batch", "2", "--length", "8", "--vocab", "16", "--dim", "16",
               "--experts", "4", "--expert-dim", "8", "--layers", "1", "--modes", "none,bias"]),
    "recall": dict(
        quick=["--steps", "150", "--lengths", "32,64", "--batch", "16"],
        smoke=["--steps", "2", "--lengths", "16", "--batch", "2", "--dim", "16", "--window", "4",
               "--models", "attn"]),
    "mhc_stability": dict(
        quick=["--layers", "16", "--train-layers", "4", "--train-steps", "40"],
        smoke=["--layers", "2", "--dim", "8", "--streams", "2", "--batch", "1", "--seq", "4",
               "--drift", "0,0.1", "--train-layers", "1", "--train-steps", "1"]),
    "lora_finetune": dict(
        quick=["--pretrain-steps", "100", "--finetune-steps", "40", "--dim", "64", "--layers", "2",
               "--mem-sizes", ""],
        smoke=["--pretrain-steps", "1", "--finetune-steps", "1", "--dim", "16", "--layers", "1",
               "--vocab", "16", "--seq", "8", "--batch", "2", "--rank", "2", "--mem-sizes", ""]),
    "kv_quant_quality": dict(
        quick=["--train-steps", "80", "--docs", "16"],
        smoke=["--train-steps", "1", "--docs", "2", "--seq-len", "12", "--chunk", "4",
               "--page-size", "4"]),
    # Quick: the model given as --run (section_speculative), the draft and an MTP model trained
    # here (80 steps each, seconds), 4 prompts x 64 new tokens, greedy rows only: about 90 s on
    # two busy cores, most of it compiling each row's programs (without a model to reuse, its
    # training adds ~40 s).
    "bench_speculative": dict(
        quick=["--train-steps", "80", "--prompts", "4", "--new-tokens", "64", "--k", "2,4,8",
               "--temperature", "0", "--repeats", "2"],
        smoke=["--smoke", "--prompts", "1", "--prompt-len", "16", "--new-tokens", "4", "--k", "2",
               "--temperature", "0", "--repeats", "1", "--no-engine"]),
    "bench_train": dict(
        quick=["--batch-size", "4", "--seq-len", "128", "--steps", "3", "--matmul-size", "1024"],
        smoke=["--presets", "llama", "--batch-size", "1", "--seq-len", "8", "--steps", "1",
               "--warmup", "0", "--matmul-size", "64"]),
}
# Experiments whose main(argv) writes its data to this file under --out.
DATA_FILE = {"length_extrapolation": "results.json", "hadamard_quant": "results.json",
             "moe_balance": "results.json", "recall": "results.json",
             "mhc_stability": "report.json", "lora_finetune": "report.json",
             "bench_train": "results.json", "kv_quant_quality": "results.json",
             "bench_speculative": "results.json"}
TITLES = {"kv_cache": "KV-cache size per token",
          "length_extrapolation": "Positional length extrapolation",
          "hadamard_quant": "Hadamard rotation before INT8 quantization",
          "moe_balance": "MoE expert balance", "recall": "Associative recall vs sequence length",
          "mhc_stability": "mHC residual-mixing stability",
          "lora_finetune": "LoRA / QLoRA fine-tuning",
          "kv_quant_quality": "Quantized KV cache quality",
          "speculative": "Speculative decoding",
          "bench_train": "Training throughput (CPU)",
          "training": "Training run"}
SECTIONS = ("kv_cache", "length_extrapolation", "hadamard_quant", "moe_balance", "recall",
            "mhc_stability", "lora_finetune", "kv_quant_quality", "speculative", "bench_train",
            "training")


@dataclasses.dataclass
class Section:
  """The outcome of one section: ``markdown`` is its body in REPORT.md (tables, notes)."""
  name: str
  status: str = "ok"                  # ok | failed | skipped
  seconds: float = 0.0
  summary: dict = dataclasses.field(default_factory=dict)
  data: Any = None
  plots: list[str] = dataclasses.field(default_factory=list)   # file names under OUT
  markdown: str = ""
  error: str | None = None


# ---------------------------------------------------------------------------------------------
# Helpers.
# ---------------------------------------------------------------------------------------------

def _md_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
  def cell(v):
    if v is None:
      return "n/a"
    if isinstance(v, float):
      if math.isnan(v):
        return "nan"
      return f"{v:.4g}"
    return str(v)
  lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
  lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
  return "\n".join(lines)


def _collect_plots(name: str, folder: pathlib.Path, out: pathlib.Path) -> list[str]:
  """Copies ``folder/*.png`` to ``out/<name>.png`` (one) or ``out/<name>_<stem>.png`` (several)."""
  pngs = sorted(folder.glob("*.png"))
  names = []
  for p in pngs:
    target = f"{name}.png" if len(pngs) == 1 else f"{name}_{p.stem}.png"
    shutil.copyfile(p, out / target)
    names.append(target)
  return names


def _run_experiment(name: str, size: str, folder: pathlib.Path, extra: Sequence[str] = ()):
  """``experiments.<name>.main(flags + extra + ['--out', folder])``; returns (main's result,
  data)."""
  module = importlib.import_module(f"experiments.{name}")
  flags = [] if size == "full" else FLAGS[name][size]
  result = module.main(list(flags) + list(extra) + ["--out", str(folder)])
  data = json.loads((folder / DATA_FILE[name]).read_text())
  return result, data


def _mean_tail(xs, frac=0.1):
  if not xs:
    return None
  k = max(1, int(len(xs) * frac))
  return float(np.mean(xs[-k:]))


# ---------------------------------------------------------------------------------------------
# Sections: each fills ``sec`` (summary, markdown) from the experiment's data.
# ---------------------------------------------------------------------------------------------

def section_kv_cache(sec: Section, size: str, folder: pathlib.Path, out: pathlib.Path,
                     args) -> None:
  from experiments.demo import kv_table  # noqa: PLC0415

  rows = kv_table()
  sec.data = rows
  sec.summary = {r["variant"]: dict(numbers_per_token_per_layer=r["numbers_per_token_per_layer"],
                                    ratio_to_mha=r["ratio_to_mha"],
                                    gib_at_128k_bf16=r["gib_at_context_bf16"]) for r in rows}
  sec.markdown = ("Llama-like shape: 32 layers, 32 query heads x 128, 128k-token context, bf16; "
                  "GQA with 8 KV heads, MLA at DeepSeek's d_c = 512, d_R = 64.\n\n" +
                  _md_table(["variant", "numbers / token / layer", "vs MHA", "GiB at 128k"],
                            [(r["variant"], r["numbers_per_token_per_layer"], r["ratio_to_mha"],
                              r["gib_at_context_bf16"]) for r in rows]))


def section_length_extrapolation(sec, size, folder, out, args):
  results, data = _run_experiment("length_extrapolation", size, folder)
  cfg = data["config"]
  lens = cfg["eval_lens"]
  sec.data = data
  sec.summary = {s: {L: (e["ppl"] if e["ppl"] is not None else e["na"])
                     for L, e in r["eval"].items()} for s, r in data["schemes"].items()}
  rows = []
  for s, r in data["schemes"].items():
    first, last = r["eval"][str(lens[0])]["ppl"], r["eval"][str(lens[-1])]["ppl"]
    ratio = last / first if first is not None and last is not None else None
    rows.append([s, r["final_train_loss"]] +
                [r["eval"][str(L)]["ppl"] if r["eval"][str(L)]["ppl"] is not None
                 else r["eval"][str(L)]["na"] for L in lens] + [ratio])
  longer = [L for L in lens if L > cfg["train_len"]]
  beyond = [[s] + [r["eval"][str(L)]["beyond_ppl"] for L in longer]
            for s, r in data["schemes"].items()]
  sec.markdown = (
      f"Tiny decoders (d={cfg['embed_dim']}, {cfg['num_layers']} layers) trained "
      f"{cfg['steps']} steps x {cfg['batch_size']} rows x {cfg['train_len']} bytes on the built-in "
      f"text, identical except for the positional scheme; held-out perplexity (bytes) over the "
      f"same {cfg['eval_tokens']} targets at every evaluation length.\n\n" +
      _md_table(["scheme", "final train loss"] + [f"ppl @ {L}" for L in lens]
                + [f"ppl @ {lens[-1]} / ppl @ {lens[0]}"], rows) +
      (f"\n\nPerplexity on the positions >= {cfg['train_len']} only (never seen in training):\n\n" +
       _md_table(["scheme"] + [f"@ {L}" for L in longer], beyond) if longer else ""))


def section_hadamard_quant(sec, size, folder, out, args):
  _, data = _run_experiment("hadamard_quant", size, folder)
  sec.data = data
  sweep = data["outlier_sweep"]
  sec.summary = dict(heavy_tailed_error_plain=data["heavy_tailed_error_plain"],
                     heavy_tailed_error_hadamard=data["heavy_tailed_error_hadamard"],
                     outlier_sweep=sweep)
  sec.markdown = (
      f"Relative INT8 error on Student-t(2) vectors: plain {data['heavy_tailed_error_plain']:.3e}, "
      f"after a Hadamard rotation {data['heavy_tailed_error_hadamard']:.3e}.\n\n" +
      _md_table(["outlier gain", "key error INT8", "key error Hadamard+INT8", "top-K recall INT8",
                 "top-K recall Hadamard+INT8"],
                [(r["outlier"], r["err_plain"], r["err_hadamard"], r["recall_plain"],
                  r["recall_hadamard"]) for r in sweep]))


def section_moe_balance(sec, size, folder, out, args):
  _, data = _run_experiment("moe_balance", size, folder)
  sec.data = dict(config=data["config"], summary=data["summary"])
  sec.summary = data["summary"]
  c = data["config"]
  sec.markdown = (
      f"{c['steps']} steps, {c['experts']} experts top-{c['top_k']}; max/mean expert load "
      f"(1 = balanced, {c['experts'] / c['top_k']:.0f} = collapsed).\n\n" +
      _md_table(["mode", "load max/mean first", "peak", "final", "final loss"],
                [(m, s["first_max_over_mean"], s["peak_max_over_mean"], s["final_max_over_mean"],
                  s["final_loss"]) for m, s in data["summary"].items()]))


def section_recall(sec, size, folder, out, args):
  _, data = _run_experiment("recall", size, folder)
  sec.data = data
  res = data["results"]
  lengths = data["config"]["lengths"]  # a list (a "32,64" string before experiments/cli.py)
  if isinstance(lengths, str):
    lengths = [int(x) for x in lengths.split(",")]
  sec.summary = {m: {str(t): r[str(t)]["accuracy"] for t in lengths} for m, r in res.items()}
  sec.markdown = (
      f"{data['config']['steps']} training steps per model; accuracy on held-out sequences.\n\n" +
      _md_table(["model", "final loss"] + [f"acc @ T={t}" for t in lengths],
                [[m, r["final_loss"]] + [r[str(t)]["accuracy"] for t in lengths]
                 for m, r in res.items()]))


def section_mhc_stability(sec, size, folder, out, args):
  _, data = _run_experiment("mhc_stability", size, folder)
  sec.data = data
  drift, trained = data["drift"], data.get("trained") or {}
  sec.summary = dict(
      drift={k: dict(forward_gain=r["forward_gain"][-1], backward_gain=r["backward_gain"][-1])
             for k, r in drift.items()},
      trained={k: dict(loss_first=r["loss"][0], loss_last=_mean_tail(r["loss"]),
                       max_grad_norm=max(r["grad_norm"])) for k, r in trained.items()})
  a = data["args"]
  md = (f"Composite mixing gain after {a['layers']} blocks ({2 * a['layers']} residual sites), "
        "static maps drifted by sigma:\n\n" +
        _md_table(["kind@sigma", "forward gain", "backward gain"],
                  [(k, v["forward_gain"], v["backward_gain"])
                   for k, v in sec.summary["drift"].items()]))
  if trained:
    md += (f"\n\nTrained {a['train_layers']}-block decoders, {a['train_steps']} steps:\n\n" +
           _md_table(["kind", "loss first", "loss last", "max grad norm"],
                     [(k, v["loss_first"], v["loss_last"], v["max_grad_norm"])
                      for k, v in sec.summary["trained"].items()]))
  sec.markdown = md


def section_lora_finetune(sec, size, folder, out, args):
  _, data = _run_experiment("lora_finetune", size, folder)
  res = data["results"]
  sec.data = dict(args=data["args"], results={m: {k: v for k, v in r.items() if k != "curve"}
                                              for m, r in res.items()})
  sec.summary = {m: dict(trainable=r["trainable"], shifted_loss_before=r["shifted_loss_before"],
                         shifted_loss_after=r["shifted_loss_after"],
                         copy_loss_after=r["copy_loss_after"],
                         ms_per_step=1e3 * r["seconds_per_step"],
                         peak_mib=_lora_peak_mib(r)) for m, r in res.items()}
  a = data["args"]
  sec.markdown = (
      f"Pretrained {a['pretrain_steps']} steps on a copy task, then fine-tuned "
      f"{a['finetune_steps']} steps on the shifted task (+{a['shift']}); loss on the copied "
      "half; peak MiB: the compiled fine-tuning step's memory (parameters, optimizer state, "
      "gradients, activations).\n\n" +
      _md_table(["method", "trainable params", "shifted loss before", "after", "copy loss after",
                 "ms / step", "peak MiB", "peak / full"],
                [(m, s["trainable"], s["shifted_loss_before"], s["shifted_loss_after"],
                  s["copy_loss_after"], s["ms_per_step"], s["peak_mib"],
                  _ratio(s["peak_mib"], sec.summary.get("full", {}).get("peak_mib")))
                 for m, s in sec.summary.items()]))
  # Compile-only memory of larger models (``--mem-sizes``), when the run measured any.
  mem_only = data.get("memory_only") or {}
  if mem_only:
    sec.data["memory_only"] = mem_only
  for size, rows in mem_only.items():
    full = _lora_peak_mib(rows.get("full", {}))
    sec.markdown += (
        f"\n\nCompiled train-step memory of a {size} (dim x layers x vocab) model, batch "
        f"{a.get('mem_batch')} x {a.get('mem_seq')} (compile only):\n\n" +
        _md_table(["method", "trainable params", "frozen params", "peak MiB", "peak / full"],
                  [(m, r.get("trainable"), r.get("frozen"), _lora_peak_mib(r),
                    _ratio(_lora_peak_mib(r), full)) for m, r in rows.items()]))


def _lora_peak_mib(run: dict) -> float | None:
  """Peak MiB of a lora_finetune run's compiled step (``memory.peak_bytes``), None if absent."""
  peak = (run.get("memory") or {}).get("peak_bytes")
  return None if peak is None else peak / 2**20


def _ratio(a, b):
  return None if a is None or not b else a / b


def section_kv_quant_quality(sec, size, folder, out, args):
  # The training run's model when there is one (the main job's), else a small one trained here.
  run = pathlib.Path(args.train_metrics).parent
  extra = ["--run", str(run)] if size != "smoke" and (run / "config.json").is_file() else []
  _, data = _run_experiment("kv_quant_quality", size, folder, extra)
  caches = data["caches"]
  sec.data = data
  sec.summary = {name: dict(perplexity=c["perplexity"], kl_mean=c["kl_mean"],
                            top1_agreement=c["top1_agreement"], vs_bf16_bytes=c["vs_bf16_bytes"])
                 for name, c in caches.items()}
  sec.markdown = (
      f"The model of `{data['run']}` (step {data['step']}) reading {data['docs']} held-out rows "
      f"through a paged cache, {data['chunk']} tokens per chunk; the float cache reproduces the "
      f"full forward pass to {data['full_forward_max_err']:.1e} in log-probability.\n\n" +
      _md_table(["cache", "perplexity", "mean KL from float (nats)", "max KL", "top-1 = float",
                 "cache bytes vs bf16"],
                [(n, c["perplexity"], c["kl_mean"], c["kl_max"], c["top1_agreement"],
                  c["vs_bf16_bytes"]) for n, c in caches.items()]))


def _speculative_run(size: str, out: pathlib.Path, args) -> list[str]:
  """``--run`` for bench_speculative: the training run's model when there is one, else the model
  kv_quant_quality trained in this report at the same size (the same recipe: llama-tiny, 80
  steps), else none (the bench trains its own)."""
  if size == "smoke":
    return []
  run = pathlib.Path(args.train_metrics).parent
  if (run / "config.json").is_file():
    return ["--run", str(run)]
  kv = out / "kv_quant_quality.json"
  if kv.is_file():
    rec = json.loads(kv.read_text())
    trained = (rec.get("data") or {}).get("run")
    if (rec.get("status") == "ok" and rec.get("size") == size and trained
        and (pathlib.Path(trained) / "config.json").is_file()):
      return ["--run", str(trained)]
  return []


def _source_step(source: str) -> tuple[str, int | None]:
  """```runs/train` (step 80)`` and 80 from bench_speculative's ``runs/train (step 80)``; an
  untrained (smoke) model's source as it is and None."""
  m = re.fullmatch(r"(.*) \(step (\d+)\)", source)
  return (f"`{m.group(1)}` (step {m.group(2)})", int(m.group(2))) if m else (source, None)


def _engine_paragraph(rows: list[dict], prompts: int) -> str:
  """bench_speculative's serving-engine rows in a sentence ("" without them): each drafting
  row's speed-up over the engine without drafts, acceptance and tokens per slot-step."""
  drafting = [r for r in rows if r["draft"] is not None]
  if not drafting:
    return ""
  parts = [f"`{r['name']}` {r['speedup']:.2f}x ("
           + ("" if r["acceptance_rate"] is None else f"{100 * r['acceptance_rate']:.0f}% of "
              "drafts kept, ")
           + f"{r['tokens_per_step']:.2f} tokens per slot-step)" for r in drafting]
  bad = [r["name"] for r in rows if r["mismatched_prompts"]]
  sampled = sorted({r.get("temperature") or 0.0 for r in rows} - {0.0})
  return (f"\n\nThe serving engine (`jaxattn.serving.Engine`, all {prompts} prompts in one "
          "batch, greedy" + "".join(f", and sampled at T = {t:g}" for t in sampled)
          + "), against the same model's engine without drafts: " + ", ".join(parts)
          + "; " + ("every greedy request's tokens equal its baseline's" if not bad else
                    f"**tokens differ from the baseline's in {', '.join(bad)}**")
          + ".  Each slot keeps its own drafts (no lock step across the batch), while a step "
          "verifies every slot's k + 1 tokens.")


def section_speculative(sec, size, folder, out, args):
  # A greedy mismatch (main returns 1) is in results.json too: the section fails, visibly.
  _, data = _run_experiment("bench_speculative", size, folder, _speculative_run(size, out, args))
  rows, prompts = data["rows"], data["prompts"]
  sec.data = data
  sec.summary = {r["name"]: dict(
      speedup=r["speedup"], acceptance_rate=r["acceptance_rate"],
      tokens_per_call=r["tokens_per_call"], tokens_per_s=r["tokens_per_s"],
      equals_generate=(None if r["mismatched_prompts"] is None
                       else r["mismatched_prompts"] == 0)) for r in rows}

  def same(r):
    if r["mismatched_prompts"] is None:
      return "sampled"
    return f"**NO** ({r['mismatched_prompts']} of {prompts})" if r["mismatched_prompts"] else "yes"

  model, step = _source_step(data["model"])
  draft, _ = _source_step(data["draft"])
  mtp, _ = _source_step(data["mtp_model"])
  losses = data.get("eval_loss") or {}
  params = data["parameters"]
  mismatched = data.get("greedy_mismatches") or {}
  md = ""
  if mismatched:
    sec.status = "failed"
    sec.error = ("greedy speculative output differs from its baseline's (it must not): " +
                 ", ".join(f"{n} on {m} of {prompts} prompts" for n, m in mismatched.items()))
    md = f"**ERROR: {sec.error}.**\n\n"
  md += (
      f"Model {model}, {params['model'] / 1e6:.2f}M parameters; drafts from prompt lookup or "
      f"from a draft model, {draft}, {params['draft'] / 1e6:.2f}M; and the same model trained "
      f"with multi-token prediction, {mtp} ({params['mtp_modules'] / 1e6:.2f}M of its "
      f"{params['mtp'] / 1e6:.2f}M parameters in its MTP module), drafting with that module "
      f"(`mtp` rows, against its own `generate`)" +
      ("" if losses.get("model") is None or losses.get("mtp") is None else
       f"; held-out loss {losses['model']:.3f} without, {losses['mtp']:.3f} with the MTP "
       "objective") + f"; {prompts} held-out prompts "
      f"of {data['prompt_len']} tokens continued by {data['new_tokens']} tokens each, batch 1, "
      f"best of {data['repeats']}.  Speed-up: generate's wall time over the row's; tokens / "
      "call: tokens per model call after the prefill.\n\n" +
      _md_table(["row", "tokens/s", "speed-up", "acceptance", "tokens / call", "= generate"],
                [(r["name"], f"{r['tokens_per_s']:.0f}", f"{r['speedup']:.2f}x",
                  None if r["acceptance_rate"] is None else f"{100 * r['acceptance_rate']:.1f}%",
                  f"{r['tokens_per_call']:.2f}", same(r)) for r in rows]))
  md += _engine_paragraph(data.get("engine_rows") or [], prompts)
  if data["backend"] == "cpu":
    md += (f"\n\nOn a {data['cpu_count']}-core CPU a tiny model's step is mostly per-call "
           "overhead, so the speed-up tracks tokens per call, below it: a round costs more than "
           "one plain step, more so with the draft model's k calls per round.")
  else:
    md += (f"\n\nOn {data['device']} decode is memory-bound, so verifying k + 1 tokens costs "
           "about one step: the speed-up approaches tokens per call as the draft gets cheaper.")
  if step is None:
    md += " The models are untrained (smoke): the figures mean nothing."
  else:
    md += (f" A model trained for {step} steps falls into greedy loops, which prompt lookup feeds "
           "on: its acceptance here overstates what it gets on a capable model's text.")
  sec.markdown = md


def section_bench_train(sec, size, folder, out, args):
  _, data = _run_experiment("bench_train", size, folder)
  sec.data = data
  c = data["config"]
  sec.summary = dict(matmul_gflops=data["matmul_gflops_reference"],
                     presets={r["preset"]: dict(tokens_per_second=r["tokens_per_second"],
                                                mfu=r["mfu"], compile_seconds=r["compile_seconds"],
                                                peak_mib=r["memory_bytes"]["peak"] / 2**20)
                              for r in data["rows"]})
  sec.markdown = (
      f"Batch {c['batch_size']} x {c['seq_len']}, step = median of {c['steps']}; MFU against the "
      f"fp32 {c['matmul_size']}^3 matmul rate measured in the same run, the faster of "
      f"{data['matmul_gflops']:.1f} GFLOP/s before and {data['matmul_gflops_after']:.1f} after the "
      "presets (a gap means the machine was busy and the step times are noisy too).\n\n" +
      _md_table(["preset", "params", "compile s", "step ms", "tokens/s", "MFLOP/token", "MFU",
                 "peak MiB"],
                [(r["preset"], f"{r['params']:,}", r["compile_seconds"], 1e3 * r["step_seconds"],
                  f"{r['tokens_per_second']:.0f}", r["model_flops_per_token"] / 1e6,
                  f"{100 * r['mfu']:.1f}%", r["memory_bytes"]["peak"] / 2**20)
                 for r in data["rows"]]))


def read_metrics(path: pathlib.Path) -> list[dict]:
  """The JSON lines of a metrics file (blank lines skipped; a malformed line raises ValueError)."""
  rows = []
  for i, line in enumerate(path.read_text().splitlines()):
    if not line.strip():
      continue
    try:
      rows.append(json.loads(line))
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}: line {i + 1} is not JSON ({e}).") from e
  return rows


def section_training(sec, size, folder, out, args):
  path = pathlib.Path(args.train_metrics)
  if not path.is_file():
    sec.status = "skipped"
    sec.markdown = (f"No training metrics at `{args.train_metrics}`: run `python -m "
                    "experiments.train` first (it writes `runs/train/metrics.jsonl`).")
    return
  rows = read_metrics(path)
  train = [r for r in rows if isinstance(r.get("loss"), (int, float))]
  evals = [r for r in rows if isinstance(r.get("eval_loss"), (int, float))]
  if not train and not evals:
    raise ValueError(f"{path} holds {len(rows)} rows but none with a numeric 'loss' or "
                     "'eval_loss'.")
  step = lambda r, i: r.get("step", i)
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  fig, ax = plt.subplots(figsize=(7, 4))
  if train:
    ax.plot([step(r, i) for i, r in enumerate(train)], [r["loss"] for r in train],
            label="train loss")
  if evals:
    ax.plot([step(r, i) for i, r in enumerate(evals)], [r["eval_loss"] for r in evals], "o-",
            label="eval loss")
  ax.set(xlabel="step", ylabel="cross-entropy (nats / token)", yscale="log",
         title=f"training run ({path.name})")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  folder.mkdir(parents=True, exist_ok=True)
  fig.savefig(folder / "loss.png", dpi=120)
  plt.close(fig)
  last = rows[-1]
  sec.summary = dict(rows=len(rows), first_loss=train[0]["loss"] if train else None,
                     last_loss=train[-1]["loss"] if train else None,
                     last_step=step(train[-1], len(train) - 1) if train else None,
                     last_eval_loss=evals[-1]["eval_loss"] if evals else None,
                     last_eval_ppl=evals[-1].get("eval_ppl") if evals else None)
  sec.data = dict(summary=sec.summary, last_row=last)
  keys = [k for k in last if isinstance(last[k], (int, float)) and k not in ("step",)]
  sec.markdown = (f"From `{args.train_metrics}` ({len(rows)} rows).\n\n" +
                  _md_table(["metric", "value"], [(k, v) for k, v in sec.summary.items()]) +
                  "\n\nLast row: " + ", ".join(f"{k} = {last[k]:.4g}" for k in keys))


BUILDERS: dict[str, Callable] = {
    "kv_cache": section_kv_cache, "length_extrapolation": section_length_extrapolation,
    "hadamard_quant": section_hadamard_quant, "moe_balance": section_moe_balance,
    "recall": section_recall, "mhc_stability": section_mhc_stability,
    "lora_finetune": section_lora_finetune, "kv_quant_quality": section_kv_quant_quality,
    "speculative": section_speculative,
    "bench_train": section_bench_train,
    "training": section_training}


# ---------------------------------------------------------------------------------------------
# Driver.
# ---------------------------------------------------------------------------------------------

def run_section(name: str, size: str, out: pathlib.Path, args) -> Section:
  """Runs one section; any exception becomes ``status="failed"`` with the error recorded."""
  sec = Section(name)
  folder = out / name
  folder.mkdir(parents=True, exist_ok=True)
  t0 = time.perf_counter()
  try:
    BUILDERS[name](sec, size, folder, out, args)
    sec.plots = _collect_plots(name, folder, out)
  except Exception as e:  # noqa: BLE001 - a section's failure must not stop the report
    sec.status = "failed"
    tb = traceback.format_exc().strip().splitlines()
    sec.error = f"{type(e).__name__}: {e}\n" + "\n".join(tb[-12:])
  sec.seconds = time.perf_counter() - t0
  if not any(folder.iterdir()):
    folder.rmdir()  # sections computed in process (kv_cache) or skipped leave nothing there
  record = dict(section=name, title=TITLES[name], status=sec.status, seconds=sec.seconds,
                size=size, summary=sec.summary, plots=sec.plots, error=sec.error, data=sec.data)
  (out / f"{name}.json").write_text(json.dumps(record, indent=1, default=_json_default))
  return sec


def _json_default(x):
  if isinstance(x, (np.floating, np.integer)):
    return x.item()
  if isinstance(x, np.ndarray):
    return x.tolist()
  return str(x)


def write_markdown(sections: Sequence[Section], out: pathlib.Path, size: str,
                   seconds: float) -> pathlib.Path:
  """``out/REPORT.md``: a status table, then one heading per section with its tables and plots."""
  now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
  lines = [f"# jaxattn experiment report ({size})", "",
           f"Generated {now} by `python -m experiments.report --{size}` in {seconds:.0f} s, "
           f"jax {jax.__version__} on {jax.devices()[0].platform}. Small models and budgets: read "
           "the comparisons within a section, not the absolute numbers. Timings on a shared "
           "machine are noisy.", "",
           _md_table(["section", "status", "seconds", "data"],
                     [(f"[{TITLES[s.name]}](#{s.name.replace('_', '-')})", s.status,
                       f"{s.seconds:.0f}", f"[{s.name}.json]({s.name}.json)") for s in sections]),
           ""]
  for s in sections:
    lines += [f'<a id="{s.name.replace("_", "-")}"></a>', "", f"## {TITLES[s.name]}", ""]
    if s.status == "failed":
      lines += ["**FAILED**:", "", "```", s.error or "", "```", ""]
    if s.markdown:
      lines += [s.markdown, ""]
    for p in s.plots:
      lines += [f"![{TITLES[s.name]}]({p})", ""]
  path = out / "REPORT.md"
  path.write_text("\n".join(lines))
  return path


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  size = ap.add_mutually_exclusive_group()
  size.add_argument("--quick", dest="size", action="store_const", const="quick",
                    help="a few tens of seconds per experiment (the default)")
  size.add_argument("--smoke", dest="size", action="store_const", const="smoke",
                    help="the tiniest settings: exercises every path, measures nothing")
  size.add_argument("--full", dest="size", action="store_const", const="full",
                    help="each experiment's own defaults (tens of minutes)")
  ap.set_defaults(size="quick")
  ap.add_argument("--out", default="results")
  ap.add_argument("--only", default="", help=f"comma-separated sections to run, of {SECTIONS}")
  ap.add_argument("--skip", default="", help="comma-separated sections to leave out")
  ap.add_argument("--train-metrics", default="runs/train/metrics.jsonl")
  args = ap.parse_args(argv)
  only = [s for s in args.only.split(",") if s]
  skip = [s for s in args.skip.split(",") if s]
  bad = sorted(set(only + skip) - set(SECTIONS))
  if bad:
    raise ValueError(f"--only / --skip name unknown section(s) {bad}; sections are {SECTIONS}.")
  names = [s for s in SECTIONS if (not only or s in only) and s not in skip]
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  t0 = time.perf_counter()
  sections = []
  for i, name in enumerate(names):
    print(f"\n[{i + 1}/{len(names)}] {name} ({args.size}) ...", flush=True)
    sec = run_section(name, args.size, out, args)
    sections.append(sec)
    print(f"[{i + 1}/{len(names)}] {name}: {sec.status} in {sec.seconds:.0f} s"
          + (f" -- {sec.error.splitlines()[0]}" if sec.error else ""), flush=True)
  path = write_markdown(sections, out, args.size, time.perf_counter() - t0)
  failed = [s.name for s in sections if s.status == "failed"]
  print(f"\nwrote {path} ({time.perf_counter() - t0:.0f} s); "
        + (f"FAILED: {failed}" if failed else "all sections ok or skipped"))
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
