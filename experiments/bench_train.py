"""Training throughput of the tiny presets: tokens/s and model FLOPs utilization (MFU).

    python -m experiments.bench_train [--presets llama,mistral,deepseek-v3,deepseek-v3.2,qwen3-next]
        [--batch-size 8] [--seq-len 256] [--steps 5] [--warmup 1] [--matmul-size 2048]
        [--out runs/bench_train]

For each preset (``jaxattn.configs``, tiny size): the jitted train step of ``jaxattn.train.step``
(forward, backward, AdamW, router-bias update) on one packed batch of the built-in byte-level text.

    compile     seconds to lower and compile the step (reported apart from the step time)
    step        median wall time of ``--steps`` calls after ``--warmup`` calls
    tokens/s    batch x seq_len / step
    MFU         model_flops_per_token(cfg, seq_len) x tokens/s / R, with R the fp32 rate of one
                jitted square matmul (``--matmul-size`` cubed, median of the same number of calls)
                measured in the same run, before and after the presets (R = the faster): the
                rate this machine reaches on the op that dominates training, so MFU is "how much
                of the reachable matmul rate the step converts into model FLOPs" (its complement
                is attention softmax, norms, routing, gathers, optimizer, dispatch overhead and
                small matmuls that do not reach the peak)
    peak        argument + output - aliased (donated) + temporary bytes of the compiled step
                (``jax.jit(...).lower(...).compile().memory_analysis()``)

``model_flops_per_token`` counts 6 x active matmul parameters plus each attention layer's score
and value products over the keys a causal query attends on average (all earlier ones; at most the
window + 1 for sliding-window layers; at most top-k for DSA, plus the indexer's scores over every
earlier key); only the routed top-k experts of a MoE count.  Gated DeltaNet's chunked recurrence
is not in it (qwen3-next's MFU is an underestimate on that account).  Timings on a shared CPU are
noisy:
read ratios, not the digits.  Prints a table and writes ``results.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.cli import at_least, choice_list
from jaxattn.checks import check_int
from jaxattn.configs import PRESETS as ALL_PRESETS
from jaxattn.configs import get_config
from jaxattn.nn.model import DecoderLM
from jaxattn.train.data import PackedDataset, load_text, tokenize_documents
from jaxattn.train.step import (init_train_state, make_optimizer, make_train_step,
                                model_flops_per_token)

try:
  from tqdm import tqdm
except ImportError:  # pragma: no cover - tqdm is optional
  def tqdm(it, **_):
    return it

PRESETS = ("llama", "mistral", "deepseek-v3", "deepseek-v3.2", "qwen3-next")


def _median_seconds(fn, args, *, steps: int, warmup: int) -> float:
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def matmul_gflops(n: int = 2048, *, steps: int = 5, warmup: int = 1) -> float:
  """fp32 GFLOP/s of a jitted ``[n, n] @ [n, n]`` (median of ``steps`` calls)."""
  if n < 1:
    raise ValueError(f"`n` (the matmul size) must be >= 1, got {n}.")
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
  b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
  f = jax.jit(jnp.matmul).lower(a, b).compile()
  return 2 * n**3 / _median_seconds(f, (a, b), steps=steps, warmup=warmup) / 1e9


def memory_bytes(compiled) -> dict:
  """Bytes of a compiled executable (NaN where the backend reports none)."""
  m = compiled.memory_analysis()
  if m is None:
    return dict(argument=float("nan"), output=float("nan"), alias=float("nan"),
                temp=float("nan"), peak=float("nan"))
  arg, out = float(m.argument_size_in_bytes), float(m.output_size_in_bytes)
  alias, temp = float(m.alias_size_in_bytes), float(m.temp_size_in_bytes)
  return dict(argument=arg, output=out, alias=alias, temp=temp, peak=arg + out - alias + temp)


def bench_preset(name: str, batch: dict, *, steps: int, warmup: int, seed: int = 0,
                 **overrides) -> dict:
  """Compile and time the train step of preset ``name`` (tiny) on ``batch`` (numpy arrays)."""
  if steps < 1 or warmup < 0:
    raise ValueError(f"`steps` must be >= 1 and `warmup` >= 0, got steps={steps}, warmup={warmup}.")
  b, t = batch["tokens"].shape
  cfg = get_config(name, **overrides)
  model = DecoderLM(cfg, rngs=nnx.Rngs(seed))
  tx = make_optimizer(learning_rate=1e-3, warmup_steps=1, total_steps=1000)
  graphdef, state = init_train_state(model, tx)
  params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
  step = make_train_step(graphdef, tx, state)
  dev_batch = {k: jnp.asarray(v) for k, v in batch.items()}
  t0 = time.perf_counter()
  compiled = step.lower(state, dev_batch).compile()
  compile_s = time.perf_counter() - t0
  mem = memory_bytes(compiled)

  # The step donates its state: thread it through so every call gets a live buffer.
  holder = [state]

  def call(batch):
    holder[0], metrics = compiled(holder[0], batch)
    return metrics

  step_s = _median_seconds(call, (dev_batch,), steps=steps, warmup=warmup)
  loss = float(call(dev_batch)["loss"])
  flops_per_token = model_flops_per_token(cfg, t)
  tokens_per_s = b * t / step_s
  return dict(preset=name, layer_pattern=cfg.layer_pattern, num_experts=cfg.num_experts,
              params=params, batch_size=b, seq_len=t, compile_seconds=compile_s,
              step_seconds=step_s, tokens_per_second=tokens_per_s,
              model_flops_per_token=flops_per_token,
              model_gflops_per_second=flops_per_token * tokens_per_s / 1e9, memory_bytes=mem,
              loss_after=loss, finite=bool(np.isfinite(loss)))


def run(*, presets: Sequence[str] = PRESETS, batch_size: int = 8, seq_len: int = 256,
        steps: int = 5, warmup: int = 1, matmul_size: int = 2048, seed: int = 0) -> dict:
  """Benchmarks every preset and the matmul rate in one run; returns the results dict."""
  from jaxattn.configs import PRESETS as ALL  # noqa: PLC0415

  bad = [p for p in presets if p not in ALL]
  if bad or not presets:
    raise ValueError(f"`presets` must be a non-empty subset of {sorted(ALL)}, got {list(presets)}.")
  # Checked before any work: a bad count used to surface only after the first matmul timing (or
  # as statistics' "no median for empty data" with steps=0, naming no argument).
  for arg, value, low in (("batch_size", batch_size, 1), ("seq_len", seq_len, 2),
                          ("steps", steps, 1), ("warmup", warmup, 0),
                          ("matmul_size", matmul_size, 1)):
    check_int(arg, value, minimum=low)
  docs = tokenize_documents(load_text(None))
  batch = next(PackedDataset(docs, batch_size=batch_size, seq_len=seq_len, seed=seed))
  gflops = matmul_gflops(matmul_size, steps=steps, warmup=warmup)
  rows = []
  bar = tqdm(list(presets), desc="presets", leave=False, disable=None)
  for name in bar:
    if hasattr(bar, "set_postfix_str"):
      bar.set_postfix_str(name)
    rows.append(bench_preset(name, batch, steps=steps, warmup=warmup, seed=seed))
  # Re-measure the matmul after the presets: a drift between the two says the machine was busy.
  # MFU divides by the faster of the two, the rate this machine demonstrably reaches, so that a
  # matmul timed during someone else's burst cannot inflate it.
  gflops_after = matmul_gflops(matmul_size, steps=steps, warmup=warmup)
  reference = max(gflops, gflops_after)
  for row in rows:
    row["mfu"] = row["model_gflops_per_second"] / reference
  return dict(config=dict(presets=list(presets), batch_size=batch_size, seq_len=seq_len,
                          steps=steps, warmup=warmup, matmul_size=matmul_size, seed=seed),
              machine=dict(platform=jax.devices()[0].platform, device=str(jax.devices()[0]),
                           jax=jax.__version__,
                           processor=platform.processor() or platform.machine()),
              matmul_gflops=gflops, matmul_gflops_after=gflops_after,
              matmul_gflops_reference=reference, rows=rows)


def format_table(results: dict) -> str:
  c = results["config"]
  lines = [f"batch {c['batch_size']} x seq {c['seq_len']}; step = median of {c['steps']} after "
           f"{c['warmup']} warm-up; fp32 matmul {c['matmul_size']}^3: "
           f"{results['matmul_gflops']:.1f} GFLOP/s before the presets, "
           f"{results['matmul_gflops_after']:.1f} after; MFU uses the faster"]
  head = (f"{'preset':>14} {'params':>9} {'compile s':>9} {'step ms':>9} {'tokens/s':>10} "
          f"{'MFLOP/tok':>10} {'GFLOP/s':>8} {'MFU':>7} {'peak MiB':>9}")
  lines += [head, "-" * len(head)]
  for r in results["rows"]:
    lines.append(f"{r['preset']:>14} {r['params']:9,d} {r['compile_seconds']:9.1f} "
                 f"{1e3 * r['step_seconds']:9.1f} {r['tokens_per_second']:10.0f} "
                 f"{r['model_flops_per_token'] / 1e6:10.2f} {r['model_gflops_per_second']:8.2f} "
                 f"{100 * r['mfu']:6.1f}% {r['memory_bytes']['peak'] / 2**20:9.1f}")
  return "\n".join(lines)


def plot(results: dict, path: pathlib.Path) -> pathlib.Path:
  """Bars of tokens/s and MFU per preset."""
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  rows = results["rows"]
  names = [r["preset"] for r in rows]
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
  axes[0].bar(names, [r["tokens_per_second"] for r in rows], color="tab:blue")
  axes[0].set(ylabel="tokens / s", title="train-step throughput (CPU)")
  axes[1].bar(names, [100 * r["mfu"] for r in rows], color="tab:orange")
  axes[1].set(ylabel="MFU (% of measured fp32 matmul rate)", title="model FLOPs utilization")
  for ax in axes:
    ax.tick_params(axis="x", rotation=20)
    ax.grid(axis="y", alpha=0.3)
  c = results["config"]
  fig.suptitle(f"batch {c['batch_size']} x {c['seq_len']}; fp32 matmul rate "
               f"{results['matmul_gflops_reference']:.0f} GFLOP/s", fontsize=9)
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--presets", type=choice_list(ALL_PRESETS), default=",".join(PRESETS),
                  help=f"comma list of {', '.join(ALL_PRESETS)}")
  ap.add_argument("--batch-size", type=at_least(1), default=8)
  ap.add_argument("--seq-len", type=at_least(2), default=256)
  ap.add_argument("--steps", type=at_least(1), default=5,
                  help="timed steps per preset (median)")
  ap.add_argument("--warmup", type=at_least(0), default=1,
                  help="untimed steps after compilation")
  ap.add_argument("--matmul-size", type=at_least(1), default=2048)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--out", default="runs/bench_train")
  args = ap.parse_args(argv)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {jax.device_count()} device(s); "
        "timings on a shared machine are noisy")
  results = run(presets=args.presets, batch_size=args.batch_size,
                seq_len=args.seq_len, steps=args.steps, warmup=args.warmup,
                matmul_size=args.matmul_size, seed=args.seed)
  print(format_table(results))
  (out / "results.json").write_text(json.dumps(results, indent=1))
  png = plot(results, out / "bench_train.png")
  print(f"\nwrote {out / 'results.json'} and {png}")
  return results


if __name__ == "__main__":
  main()
