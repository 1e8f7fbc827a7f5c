"""Speculative decoding against plain decoding: a trained byte-level model continuing held-out
text, greedy, with prompt-lookup (n-gram) drafts, with a smaller trained draft model, and a model
trained with multi-token prediction drafting with its own MTP module.

    python -m experiments.bench_speculative [--run runs/train] [--draft-run runs/draft]
        [--mtp-run runs/mtp] [--train-steps 80] [--draft-layers 1] [--draft-width 64] [--prompts 8]
        [--prompt-len 64] [--new-tokens 128] [--k 2,4,8] [--temperature 0.8] [--repeats 2]
        [--engine-repeats 5] [--no-engine] [--out runs/bench_speculative] [--smoke]

Models: ``--run`` is an ``experiments.train`` output (the newest checkpoint is loaded); without
it llama-tiny (byte vocabulary, 4 layers of width 128) is trained first for ``--train-steps``
(``experiments.train`` under ``--out/train``, resumed if it is there).  ``--draft-run`` likewise
gives the draft; without it a smaller llama (``--draft-layers`` layers of width
``--draft-width``, the same vocabulary, data and steps) is trained under ``--out/draft``.
``--mtp-run`` gives a model with multi-token prediction (``mtp_depth >= 1``); without it the same
llama-tiny with ``mtp_depth=1`` (and the default ``mtp_loss_weight`` 0.3) is trained alike under
``--out/mtp``: the table's header prints both models' held-out loss, so what the extra objective
costs (or gives) the next-token prediction is read beside what its drafts give.
``--smoke`` uses three untrained tiny models instead (no training: a quick end-to-end check of the
script, whose figures then mean nothing).

Prompts: ``--prompts`` rows of ``--prompt-len`` tokens of the held-out documents (the training
run's split, ``kv_quant_quality.held_out``: ``[BOS] + bytes`` cut into consecutive rows; only
full-length rows, spread evenly over them), run one at a time: batch 1.  Speculation cuts the
latency of one sequence; the rows of a batch advance together (a round keeps the fewest drafts
any row agreed on), so a batch of unlike texts gains less.

Rows, every one on the same prompts in the same process, ``--new-tokens`` tokens per prompt (no
end-of-sequence stop, so every row generates the same count):

* ``generate (no draft)``: ``jaxattn.generation.generate``, the baseline;
* ``ngram k=K`` for each ``--k``: ``speculative_generate(draft="ngram", num_draft_tokens=K)``,
  prompt lookup (no draft model);
* ``draft k=K`` for each ``--k``: ``speculative_generate`` with the draft model;
* ``generate (MTP model)`` and ``mtp k=K`` for each ``--k``: the MTP-trained model alone, and
  drafting with its own depth-1 module (``draft="mtp"``: self-speculation, no second model; its
  greedy output is checked against its own ``generate``);
* at ``--temperature`` (0: none): ``generate (no draft) T=...`` and ``draft k=4 T=...``
  (speculative sampling; its tokens legitimately differ from ``generate``'s, its distribution
  does not), and the same two for the MTP model (``mtp k=4 T=...``), seed = the prompt's index.
  Sampled text does not fall into the greedy loops that flatter every draft here, so these rows'
  acceptance is the fairer comparison of the drafts.

Every row's programs are compiled by a warm-up call before any timing; then each round runs every
row on every prompt, interleaved (drift in the machine's speed hits every row alike), and each
(row, prompt) keeps its best wall time over ``--repeats`` rounds.  Per row: tokens/s (new tokens
over the summed wall time), speed-up (the baseline's summed wall time over the row's: the greedy
baseline for greedy rows, the sampled one for sampled rows), acceptance rate (kept drafts /
proposed drafts), tokens per call (tokens generated per model call after the prefill: 1 for
``generate``, at most ``K + 1``), and whether the greedy output equals the baseline's token for
token -- it must (``speculative_generate`` is exact when greedy); a mismatching prompt is counted,
printed as an error and makes the exit status 1.  ``results.json`` holds every figure (per prompt
too), ``bench_speculative.png`` plots tokens per call and speed-up against K.

What the speed-up means.  On a 2-core CPU a tiny model's decode step is dominated by per-call
overhead (dispatch, the host loop, many small kernels), not by its arithmetic: verifying ``K + 1``
tokens in one call costs about one token's step, so the speed-up mostly reflects tokens per call,
less what the drafting costs (nothing much for prompt lookup; ``K`` calls of the draft model per
round, each a sizeable fraction of the model's step when both are tiny).  On an accelerator decode
is memory-bound -- every step reads all the weights and the cache -- so a ``(K + 1)``-token verify
also costs about one token's step, and a draft model a fraction of the model's size costs that
fraction per drafted token: the speed-up approaches tokens per call as the draft gets cheaper.
Neither case is large-model measurement; the tokens per call and acceptance are what carry over
(for the same pair of models and text).  A model trained for a few dozen steps falls into loops
when greedy ("the the the"), which prompt lookup feeds on: its acceptance here overstates what it
gets on a capable model's text, which repeats its context mostly in copying tasks.

The serving engine (a second table; ``--no-engine``: none).  ``jaxattn.serving.Engine`` drafts
too: every prompt is submitted at once (``max_batch`` = the number of prompts, ``page_size`` 16,
``chunk`` 64, greedy, ``--new-tokens`` each) and one ``run()`` serves them all.  Rows, each with
``k = 4`` drafts per step (``SAMPLE_K``):

* ``engine (no draft)``: the plain model, no speculation, the baseline of the next two;
* ``engine ngram k=4``: prompt lookup (``Engine(num_draft_tokens=4)``);
* ``engine draft k=4``: the draft model (``draft=draft_model``, its cache on the model's pages);
* ``engine (MTP model)``: the MTP-trained model, no speculation, the baseline of the next;
* ``engine mtp k=4``: its own MTP module drafting (``draft="mtp"``);
* with ``--temperature T > 0``, the same rows but prompt lookup, sampled at ``T`` (``engine
  (no draft) T=0.8`` and so on): each request samples with its own seed (``seed + rid``: every
  run draws anew), the draft model's and the MTP module's drafts are sampled from their
  distributions and judged with them (``accept_rows``' speculative sampling).  Their tokens are
  not compared (sampled, they differ from the baseline's by design); acceptance and steps are
  the means over the timed runs.

Each engine is built once and warmed up by two untimed runs of the same prompts (the first
compiles every step program); then each round runs every engine once (interleaved, as above),
keeping each row's best wall time over ``--engine-repeats`` rounds (default 5: a run of the
engine lasts a fraction of a second, so single runs are noisy on a shared machine; an engine's
cache is empty again after ``run()`` returns, and the next run reuses it).  Per row: tokens/s
(prompts x new tokens over that time), speed-up over its baseline, engine steps (each feeds every
busy slot once), acceptance (kept drafts / drafts fed), tokens per slot-step (tokens generated
over busy slot-steps: 1 for the baselines when a prompt fits one chunk, at most ``k + 1``) and
whether every request's tokens equal its baseline row's (greedy rows: they must; a mismatch
counts as above).  The ratio differs from batch 1's, and from a batched ``speculative_generate``: there a round keeps the fewest drafts
any row agreed on (the batch advances in lock step), while each engine slot keeps its own drafts
and advances by its own count, so a batch of unlike texts loses nothing to its slowest row;
instead the step's cost is the batch's (``b x (k + 1)`` rows verified), and the steps end when
the slowest request does.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import pathlib
import sys
import time

import jax
import numpy as np
from flax import nnx
from tqdm import tqdm

from experiments.cli import at_least, int_list
from experiments.kv_quant_quality import held_out
from experiments.timing import error_text, write_json
from jaxattn.generation import generate
from jaxattn.speculative import speculative_generate

BASELINE = "generate (no draft)"
MTP_BASELINE = "generate (MTP model)"
SAMPLE_K = 4            # the sampled draft row's drafts per round (and the engine rows')
ENGINE_BASELINE = "engine (no draft)"
ENGINE_MTP_BASELINE = "engine (MTP model)"
ENGINE_PAGE_SIZE = 16
ENGINE_CHUNK = 64
TRAIN_SEQ_LEN = 128     # rows of the models trained here


def train_run(out: pathlib.Path, steps: int, overrides: tuple[str, ...] = ()) -> pathlib.Path:
  """A byte-level llama-tiny trained by ``experiments.train`` (``overrides``: its ``--set``
  items), resumed if ``out`` holds one."""
  from experiments import train  # noqa: PLC0415
  argv = ["--steps", str(steps), "--batch-size", "8", "--seq-len", str(TRAIN_SEQ_LEN),
          "--warmup", str(max(1, steps // 8)), "--eval-every", "0", "--sample-tokens", "0",
          "--save-every", str(steps), "--out", str(out)]
  if overrides:
    argv += ["--set", *overrides]
  rc = train.main(argv)
  if rc:
    raise RuntimeError(f"experiments.train exited with {rc}")
  return out


def draft_overrides(layers: int, width: int) -> tuple[str, ...]:
  """``--set`` items of the draft: ``layers`` layers of ``width`` (heads of 32, half as many KV
  heads, an MLP of 3 x width)."""
  heads = max(1, width // 32)
  return (f"num_layers={layers}", f"embed_dim={width}", f"num_heads={heads}",
          f"num_kv_heads={max(1, heads // 2)}", f"mlp_dim={3 * width}")


def smoke_models():
  """Three untrained tiny llamas with the byte vocabulary: 2 layers, 1 layer (the draft) and
  2 layers with one MTP module, width 32."""
  from jaxattn.configs import get_config  # noqa: PLC0415
  from jaxattn.nn.model import DecoderLM  # noqa: PLC0415
  small = dict(embed_dim=32, mlp_dim=64, num_heads=2, num_kv_heads=1)
  model = DecoderLM(get_config("llama", num_layers=2, **small), rngs=nnx.Rngs(0))
  draft = DecoderLM(get_config("llama", num_layers=1, **small), rngs=nnx.Rngs(1))
  mtp = DecoderLM(get_config("llama", num_layers=2, mtp_depth=1, **small), rngs=nnx.Rngs(2))
  return model, draft, mtp


def last_eval(run: pathlib.Path) -> dict:
  """The last held-out evaluation ``experiments.train`` logged for ``run`` ({} if none):
  ``eval_loss``, and ``eval_mtp_accuracy`` for a model with multi-token prediction."""
  import json  # noqa: PLC0415
  path = run / "metrics.jsonl"
  if not path.exists():
    return {}
  records = [r for r in map(json.loads, path.read_text().splitlines()) if "eval_loss" in r]
  return records[-1] if records else {}


def num_params(model) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def prompts_from_held_out(count: int, length: int) -> list[np.ndarray]:
  """``count`` rows of exactly ``length`` held-out tokens, spread evenly over all such rows."""
  rows = [r for r in held_out(1 << 30, length - 1) if r.size == length]
  if not rows:
    raise SystemExit(f"no held-out row has --prompt-len {length} tokens; choose a shorter one.")
  pick = np.unique(np.linspace(0, len(rows) - 1, min(count, len(rows))).round().astype(int))
  return [rows[i][None, :].astype(np.int32) for i in pick]


def make_rows(ks: list[int], temperature: float) -> list[dict]:
  """The rows measured: name, draft ("ngram", "model", "mtp" or None), k, temperature, baseline,
  model ("model" or "mtp": which trained model decodes)."""
  rows = [dict(name=BASELINE, draft=None, k=None, temperature=0.0, baseline=BASELINE)]
  rows += [dict(name=f"ngram k={k}", draft="ngram", k=k, temperature=0.0, baseline=BASELINE)
           for k in ks]
  rows += [dict(name=f"draft k={k}", draft="model", k=k, temperature=0.0, baseline=BASELINE)
           for k in ks]
  rows += [dict(name=MTP_BASELINE, draft=None, k=None, temperature=0.0, baseline=MTP_BASELINE,
                model="mtp")]
  rows += [dict(name=f"mtp k={k}", draft="mtp", k=k, temperature=0.0, baseline=MTP_BASELINE,
                model="mtp") for k in ks]
  if temperature > 0:
    sampled = f"{BASELINE} T={temperature:g}"
    mtp_sampled = f"{MTP_BASELINE} T={temperature:g}"
    rows += [dict(name=sampled, draft=None, k=None, temperature=temperature, baseline=sampled),
             dict(name=f"draft k={SAMPLE_K} T={temperature:g}", draft="model", k=SAMPLE_K,
                  temperature=temperature, baseline=sampled),
             dict(name=mtp_sampled, draft=None, k=None, temperature=temperature,
                  baseline=mtp_sampled, model="mtp"),
             dict(name=f"mtp k={SAMPLE_K} T={temperature:g}", draft="mtp", k=SAMPLE_K,
                  temperature=temperature, baseline=mtp_sampled, model="mtp")]
  return rows


def run_row(row: dict, models: dict, prompt: np.ndarray, new_tokens: int, seed: int):
  """``(tokens [1, T + n], SpeculativeStats or None, wall seconds)`` of one row on one prompt;
  ``models``: ``{"model", "draft", "mtp"}``."""
  model = models[row.get("model", "model")]
  t0 = time.perf_counter()
  if row["draft"] is None:
    out, stats = generate(model, prompt, new_tokens, temperature=row["temperature"],
                          seed=seed), None
  else:
    draft = models["draft"] if row["draft"] == "model" else row["draft"]
    out, stats = speculative_generate(
        model, prompt, new_tokens, draft=draft, num_draft_tokens=row["k"],
        temperature=row["temperature"], seed=seed)
  return np.asarray(out), stats, time.perf_counter() - t0


def timed_rounds(keys: list, run_one, repeats: int, desc: str):
  """``repeats`` interleaved rounds, each running every key once (``run_one(key) -> (output,
  statistics, wall seconds)``): per key its best wall time, and its outputs and statistics in
  round order."""
  best = {key: float("inf") for key in keys}
  outs, stats = {key: [] for key in keys}, {key: [] for key in keys}
  bar = tqdm(total=repeats * len(keys), desc=desc)
  for _ in range(repeats):
    for key in keys:
      out, st, sec = run_one(key)
      best[key] = min(best[key], sec)
      outs[key].append(out)
      stats[key].append(st)
      bar.update(1)
  bar.close()
  return best, outs, stats


def measure(rows: list[dict], models: dict, prompts: list[np.ndarray], new_tokens: int,
            repeats: int) -> list[dict]:
  """Every row on every prompt (warm-up first, then ``repeats`` interleaved rounds): the
  per-row results (module docstring)."""
  for row in tqdm(rows, desc="compile"):
    run_row(row, models, prompts[0], new_tokens, 0)
  by_name = {r["name"]: r for r in rows}

  def run_one(key):
    name, i = key
    row = by_name[name]
    return run_row(row, models, prompts[i], new_tokens, i if row["temperature"] > 0 else 0)

  best, outs, stats = timed_rounds([(r["name"], i) for i in range(len(prompts)) for r in rows],
                                   run_one, repeats, "timing")
  results = []
  for row in rows:
    per_prompt = []
    for i in range(len(prompts)):
      key = (row["name"], i)
      st = stats[key][-1]
      equal = None
      if row["temperature"] == 0:
        equal = bool(np.array_equal(outs[key][-1], outs[(row["baseline"], i)][-1]))
      per_prompt.append(dict(
          seconds=best[key], tokens_equal_baseline=equal,
          rounds=None if st is None else st.rounds, drafted=None if st is None else st.drafted,
          accepted=None if st is None else st.accepted,
          emitted=None if st is None else st.emitted,
          acceptance_rate=None if st is None else st.acceptance_rate,
          tokens_per_call=1.0 if st is None else st.tokens_per_call))
    seconds = sum(p["seconds"] for p in per_prompt)
    total = {f: sum(p[f] for p in per_prompt) if row["draft"] else None
             for f in ("rounds", "drafted", "accepted", "emitted")}
    greedy = row["temperature"] == 0
    results.append(dict(
        name=row["name"], draft=row["draft"], k=row["k"], temperature=row["temperature"],
        baseline=row["baseline"], seconds=seconds,
        tokens_per_s=len(prompts) * new_tokens / seconds, **total,
        acceptance_rate=(total["accepted"] / total["drafted"]
                         if row["draft"] and total["drafted"] else None),
        tokens_per_call=(total["emitted"] / total["rounds"]
                         if row["draft"] and total["rounds"] else 1.0),
        mismatched_prompts=(sum(not p["tokens_equal_baseline"] for p in per_prompt)
                            if greedy else None),
        per_prompt=per_prompt))
  by_name = {r["name"]: r for r in results}
  for r in results:
    r["speedup"] = by_name[r["baseline"]]["seconds"] / r["seconds"]
  return results


def make_engine_rows(k: int = SAMPLE_K, temperature: float = 0.0) -> list[dict]:
  """The serving engine's rows: name, draft ("ngram", "model", "mtp" or None), k, temperature,
  baseline, model ("model" or "mtp"); with ``temperature > 0`` the sampled rows after the greedy
  ones (no prompt lookup)."""
  def four(t, tag=""):
    base, mtp_base = ENGINE_BASELINE + tag, ENGINE_MTP_BASELINE + tag
    return [dict(name=base, draft=None, k=None, baseline=base, model="model"),
            *([] if tag else [dict(name=f"engine ngram k={k}", draft="ngram", k=k,
                                   baseline=base, model="model")]),
            dict(name=f"engine draft k={k}{tag}", draft="model", k=k, baseline=base,
                 model="model"),
            dict(name=mtp_base, draft=None, k=None, baseline=mtp_base, model="mtp"),
            dict(name=f"engine mtp k={k}{tag}", draft="mtp", k=k, baseline=mtp_base,
                 model="mtp")]
  rows = [dict(r, temperature=0.0) for r in four(0.0)]
  if temperature > 0:
    rows += [dict(r, temperature=temperature) for r in four(temperature, f" T={temperature:g}")]
  return rows


def make_engine(row: dict, models: dict, batch: int):
  """The ``jaxattn.serving.Engine`` of an engine row, ``batch`` slots (greedy, or sampled at
  the row's temperature: request ``rid`` with seed ``rid``)."""
  from jaxattn.serving import Engine  # noqa: PLC0415
  spec = {}
  if row["draft"] is not None:
    draft = dict(ngram=None, model=models["draft"], mtp="mtp")[row["draft"]]
    spec = dict(num_draft_tokens=row["k"], draft=draft)
  return Engine(models[row["model"]], max_batch=batch, page_size=ENGINE_PAGE_SIZE,
                chunk=ENGINE_CHUNK, temperature=row.get("temperature", 0.0), seed=0, **spec)


def run_engine(engine, prompts: list[np.ndarray], new_tokens: int):
  """Every prompt submitted at once, one ``run()``: ``(tokens per prompt [T + n], the engine's
  statistics of this run (``EngineStats`` fields), wall seconds)``."""
  before = dataclasses.asdict(engine.stats)
  t0 = time.perf_counter()
  ids = [engine.submit(p[0], new_tokens) for p in prompts]
  results = engine.run()
  seconds = time.perf_counter() - t0
  after = dataclasses.asdict(engine.stats)
  return [np.asarray(results[i]) for i in ids], {f: after[f] - before[f] for f in after}, seconds


def measure_engine(rows: list[dict], models: dict, prompts: list[np.ndarray], new_tokens: int,
                   repeats: int) -> list[dict]:
  """The engine rows (module docstring): each engine warmed up by two runs, then ``repeats``
  interleaved rounds of one run each; per row its best wall time and the mean statistics of the
  timed runs (every run of a greedy engine takes the same steps; a sampled one draws anew)."""
  engines, outs = {}, {r["name"]: [] for r in rows}
  for row in tqdm(rows, desc="engine compile"):
    engines[row["name"]] = make_engine(row, models, len(prompts))
    for _ in range(2):         # (the first compiles; the second starts as every timed run does)
      outs[row["name"]].append(run_engine(engines[row["name"]], prompts, new_tokens)[0])
  best, timed, runs = timed_rounds(
      [r["name"] for r in rows],
      lambda name: run_engine(engines[name], prompts, new_tokens), repeats, "engine timing")
  results = []
  for name in outs:
    outs[name] += timed[name]
  for row in rows:
    st, seconds = collections.Counter(), best[row["name"]]
    for run in runs[row["name"]]:                          # summed over the timed runs
      st.update(run)
    greedy = not row.get("temperature")
    reference = outs[row["baseline"]][-1]
    # A prompt mismatches when any run of the row (its warm-up too) differs from the baseline's.
    mismatched = (sum(any(not np.array_equal(run[i], reference[i]) for run in outs[row["name"]])
                      for i in range(len(prompts))) if greedy else None)
    results.append(dict(
        name=row["name"], draft=row["draft"], k=row["k"], baseline=row["baseline"],
        temperature=row.get("temperature", 0.0),
        seconds=seconds, tokens_per_s=len(prompts) * new_tokens / seconds,
        steps=st["steps"] / repeats, calls=st["calls"] / repeats,
        generated=st["generated"] / repeats,
        busy_slot_steps=st["busy_slot_steps"] / repeats, drafted=st["drafted"] / repeats,
        accepted=st["accepted_drafts"] / repeats,
        acceptance_rate=(st["accepted_drafts"] / st["drafted"]
                         if row["draft"] and st["drafted"] else None),
        tokens_per_step=st["generated"] / st["busy_slot_steps"],
        mismatched_prompts=mismatched))
  by_name = {r["name"]: r for r in results}
  for r in results:
    r["speedup"] = by_name[r["baseline"]]["seconds"] / r["seconds"]
  return results


def _fmt(x, spec: str, width: int) -> str:
  return f"{'-':>{width}}" if x is None else f"{x:{width}{spec}}"


def print_table(results: list[dict], prompts: int) -> None:
  print(f"{'row':26} {'tok/s':>8} {'speed-up':>9} {'accept':>7} {'tok/call':>9} "
        f"{'= generate':>11}")
  for r in results:
    if r["mismatched_prompts"] is None:
      same = "(sampled)"
    elif r["mismatched_prompts"]:
      same = f"NO {r['mismatched_prompts']}/{prompts}"
    else:
      same = "yes"
    print(f"{r['name']:26} {r['tokens_per_s']:8.1f} {r['speedup']:8.2f}x "
          f"{_fmt(r['acceptance_rate'], '.1%', 7)} {r['tokens_per_call']:9.2f} {same:>11}")
  print("speed-up: the baseline's wall time over the row's (greedy rows against generate of the\n"
        "same model, sampled rows against sampled generate); tok/call: tokens per model call\n"
        "after the prefill.")


def print_engine_table(results: list[dict], prompts: int) -> None:
  sampled = sorted({r["temperature"] for r in results if r["temperature"]})
  print(f"\nserving engine: all {prompts} prompts in one batch, greedy"
        + "".join(f", sampled at T={t:g}" for t in sampled))
  print(f"{'row':26} {'tok/s':>8} {'speed-up':>9} {'accept':>7} {'tok/step':>9} {'steps':>6} "
        f"{'= baseline':>11}")
  for r in results:
    same = ("sampled" if r["mismatched_prompts"] is None else
            f"NO {r['mismatched_prompts']}/{prompts}" if r["mismatched_prompts"] else "yes")
    print(f"{r['name']:26} {r['tokens_per_s']:8.1f} {r['speedup']:8.2f}x "
          f"{_fmt(r['acceptance_rate'], '.1%', 7)} {r['tokens_per_step']:9.2f} {r['steps']:6.1f} "
          f"{same:>11}")
  print("speed-up: the same model's engine without drafts (at the row's temperature) over the\n"
        "row's wall time; tok/step: tokens generated per busy slot per engine step (prefill steps\n"
        "included); steps: engine steps of a run (each feeds every busy slot once; the mean).")


def _plot(results: list[dict], path: pathlib.Path) -> None:
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
  for draft, label in (("ngram", "prompt lookup (n-gram)"), ("model", "draft model"),
                       ("mtp", "own MTP module")):
    pts = sorted((r["k"], r["tokens_per_call"], r["speedup"]) for r in results
                 if r["draft"] == draft and r["temperature"] == 0)
    if not pts:
      continue
    ks, tpc, speed = zip(*pts)
    left.plot(ks, tpc, "o-", label=label)
    right.plot(ks, speed, "o-", label=label)
  ks = sorted({r["k"] for r in results if r["k"] is not None and r["temperature"] == 0})
  if ks:
    left.plot(ks, [k + 1 for k in ks], ":", color="gray", label="every draft kept (k + 1)")
  right.axhline(1.0, color="gray", ls=":", label=BASELINE)
  left.set(xlabel="drafts per round k", ylabel="tokens per model call", title="tokens per call")
  right.set(xlabel="drafts per round k", ylabel="speed-up over generate (wall time)",
            title=f"speed-up ({jax.default_backend()}, batch 1, greedy)")
  for ax in (left, right):
    ax.set_xticks(ks)
    ax.grid(alpha=0.3)
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--run", default=None, help="the model: an experiments.train output directory")
  ap.add_argument("--draft-run", default=None,
                  help="the draft model: an experiments.train output directory")
  ap.add_argument("--mtp-run", default=None,
                  help="a model with multi-token prediction: an experiments.train output "
                       "directory (trained with --set mtp_depth=1)")
  ap.add_argument("--train-steps", type=at_least(1), default=80,
                  help="without --run / --draft-run / --mtp-run: steps of the models trained "
                       "first")
  ap.add_argument("--draft-layers", type=at_least(1), default=1)
  ap.add_argument("--draft-width", type=at_least(32), default=64)
  ap.add_argument("--smoke", action="store_true",
                  help="untrained tiny models, no training: checks that the script runs")
  ap.add_argument("--prompts", type=at_least(1), default=8)
  ap.add_argument("--prompt-len", type=at_least(2), default=64)
  ap.add_argument("--new-tokens", type=at_least(1), default=128)
  ap.add_argument("--k", type=int_list(minimum=1, maximum=64), default="2,4,8",
                  help="drafts per round, comma-separated")
  ap.add_argument("--temperature", type=float, default=0.8,
                  help=f"the sampled rows' temperature (draft k={SAMPLE_K}); 0: none")
  ap.add_argument("--repeats", type=at_least(1), default=2)
  ap.add_argument("--engine-repeats", type=at_least(1), default=5,
                  help="timed rounds of the serving engine's table (best of)")
  ap.add_argument("--no-engine", action="store_true",
                  help="skip the serving engine's table (jaxattn.serving.Engine, one batch)")
  ap.add_argument("--out", default="runs/bench_speculative")
  args = ap.parse_args(argv)
  if not args.temperature >= 0 or not np.isfinite(args.temperature):
    ap.error(f"argument --temperature: must be a number >= 0 (0: no sampled rows), got "
             f"{args.temperature}")
  if args.smoke and (args.run or args.draft_run or args.mtp_run):
    ap.error("argument --smoke: builds its own untrained models; drop --run / --draft-run / "
             "--mtp-run")
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)

  from experiments.generate import load_run  # noqa: PLC0415
  if args.smoke:
    model, draft, mtp = smoke_models()
    sources = dict(model="untrained (smoke)", draft="untrained (smoke)",
                   mtp="untrained (smoke)")
    losses = dict(model=None, mtp=None, mtp_accuracy=None)
  else:
    run = (pathlib.Path(args.run) if args.run else
           train_run(out / "train", args.train_steps))
    draft_run = (pathlib.Path(args.draft_run) if args.draft_run else
                 train_run(out / "draft", args.train_steps,
                           draft_overrides(args.draft_layers, args.draft_width)))
    mtp_run = (pathlib.Path(args.mtp_run) if args.mtp_run else
               train_run(out / "mtp", args.train_steps, ("mtp_depth=1",)))
    model, step = load_run(run)
    draft, draft_step = load_run(draft_run)
    mtp, mtp_step = load_run(mtp_run)
    sources = dict(model=f"{run} (step {step})", draft=f"{draft_run} (step {draft_step})",
                   mtp=f"{mtp_run} (step {mtp_step})")
    evals = dict(model=last_eval(run), mtp=last_eval(mtp_run))
    losses = dict(model=evals["model"].get("eval_loss"), mtp=evals["mtp"].get("eval_loss"),
                  mtp_accuracy=evals["mtp"].get("eval_mtp_accuracy"))
    if not mtp.config.mtp_depth:
      ap.error(f"argument --mtp-run: {mtp_run} has no multi-token prediction (mtp_depth=0); "
               f"train it with --set mtp_depth=1")
  if draft.config.vocab_size != model.config.vocab_size:
    ap.error(f"argument --draft-run: the draft's vocab_size ({draft.config.vocab_size}) must "
             f"equal the model's ({model.config.vocab_size})")
  if mtp.config.vocab_size != model.config.vocab_size:
    ap.error(f"argument --mtp-run: its vocab_size ({mtp.config.vocab_size}) must equal the "
             f"model's ({model.config.vocab_size}): the rows share the prompts")
  params = dict(model=num_params(model), draft=num_params(draft), mtp=num_params(mtp),
                mtp_modules=num_params(mtp.mtp))
  prompts = prompts_from_held_out(args.prompts, args.prompt_len)
  device = jax.devices()[0]
  print(f"model {sources['model']}: {model.config.num_layers} layers of width "
        f"{model.config.embed_dim}, {params['model'] / 1e6:.2f}M parameters; draft "
        f"{sources['draft']}: {draft.config.num_layers} layer(s) of width "
        f"{draft.config.embed_dim}, {params['draft'] / 1e6:.2f}M", flush=True)
  print(f"MTP model {sources['mtp']}: {mtp.config.num_layers} layers + {mtp.config.mtp_depth} "
        f"MTP module(s) ({params['mtp_modules'] / 1e6:.2f}M of its "
        f"{params['mtp'] / 1e6:.2f}M parameters)", flush=True)
  if losses["model"] is not None and losses["mtp"] is not None:
    print(f"held-out next-token loss: {losses['model']:.4f} (model), {losses['mtp']:.4f} "
          f"(MTP model, mtp_loss_weight {mtp.config.mtp_loss_weight:g})", flush=True)
  if losses["mtp_accuracy"]:
    print(f"the MTP module's held-out top-1 accuracy (teacher-forced, depth 1): "
          f"{100 * losses['mtp_accuracy'][0]:.1f}%", flush=True)
  print(f"{len(prompts)} held-out prompts of {args.prompt_len} tokens, batch 1, "
        f"{args.new_tokens} new tokens each, best of {args.repeats}; {device.device_kind} "
        f"({jax.default_backend()}, {os.cpu_count()} CPU cores)", flush=True)

  rows = make_rows(args.k, args.temperature)
  models = dict(model=model, draft=draft, mtp=mtp)
  results = measure(rows, models, prompts, args.new_tokens, args.repeats)
  print_table(results, len(prompts))
  engine_results = []
  if not args.no_engine:
    engine_results = measure_engine(make_engine_rows(SAMPLE_K, args.temperature), models,
                                    prompts, args.new_tokens, args.engine_repeats)
    print_engine_table(engine_results, len(prompts))
  mismatched = {r["name"]: r["mismatched_prompts"] for r in results + engine_results
                if r["mismatched_prompts"]}
  record = dict(model=sources["model"], draft=sources["draft"], mtp_model=sources["mtp"],
                eval_loss=losses, parameters=params,
                prompts=len(prompts), prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                repeats=args.repeats, engine_repeats=args.engine_repeats, ks=args.k, temperature=args.temperature,
                backend=jax.default_backend(), device=device.device_kind,
                cpu_count=os.cpu_count(), greedy_mismatches=mismatched, rows=results,
                engine_rows=engine_results)
  write_json(out / "results.json", record)
  try:
    _plot(results, out / "bench_speculative.png")
    print(f"wrote {out / 'results.json'} and {out / 'bench_speculative.png'}", flush=True)
  except Exception as e:  # noqa: BLE001  (the figures are saved; a plotting failure loses none)
    print(f"wrote {out / 'results.json'}; no plot ({error_text(e)})", flush=True)
  if mismatched:
    print("ERROR: greedy speculative output differs from its baseline's (it must not): "
          + ", ".join(f"{n}: {m} of {len(prompts)} prompts" for n, m in mismatched.items()),
          flush=True)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
