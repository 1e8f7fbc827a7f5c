"""Train a jaxattn decoder on a device mesh: the main job.

    python -m experiments.train [--preset llama] [--size tiny] [--steps 300] [--batch-size 16]
        [--seq-len 256] [--lr 3e-3] [--warmup 30] [--mesh data=2,tensor=4] [--dtype bfloat16]
        [--context-strategy ring] [--scan-layers] [--remat dots] [--data PATH | --data hf:NAME]
        [--out runs/train] [--save-every 100] [--keep 3] [--no-resume] [--eval-every 100]
        [--set key=value ...]
        [--sample-tokens 200] [--report]

* Mesh: all devices, axes ``data / fsdp / context / tensor / expert`` (``--mesh`` gives some
  sizes, ``data`` takes the rest; ``context`` splits the sequence: context parallelism, with
  ``--context-strategy all_gather | ring``, ``jaxattn.ops.context_parallel``).  Parameters are
  created directly on their shards (``nnx.eval_shape`` -> logical rules ->
  ``jax.jit(out_shardings=...)``), the optimizer moments follow them, and the train step is a
  ``jax.jit`` with explicit in/out shardings (``jaxattn.train.step``).
* Optimizer: AdamW, linear warmup + cosine decay, global-norm clipping.  ``--dtype bfloat16`` is
  mixed precision (fp32 parameters and optimizer, bf16 matmuls, fp32 softmax/norms/loss).
* Data: byte-level, packed rows with segment ids (``jaxattn.train.data``); the default text ships
  with Python (no download).  Deterministic and resumable.
* Checkpoints (orbax, ``--out/checkpoints``): every ``--save-every`` steps, on SIGINT/SIGTERM and
  at the end; the last ``--keep`` are kept; a rerun with the same ``--out`` resumes exactly
  (parameters, optimizer, step, data position, RNG) unless ``--no-resume``.  A resume refuses
  another model config or other optimizer flags (``--lr --warmup --weight-decay --clip``);
  another ``--steps`` re-stretches the cosine schedule (and says so).
* Logs: a progress bar (loss, tokens/s, ETA), ``--out/metrics.jsonl`` (one strict-JSON object per
  step and per evaluation: a value not measured -- the tokens/s of a step with no timed window, as
  the first, compiling one -- or not finite is ``null``, never ``NaN``), evaluation perplexity
  every ``--eval-every`` steps and at the end, then a sample streamed from the trained model, and
  with ``--report`` the experiment report.
* Multi-host: launched as several processes (``JAX_COORDINATOR_ADDRESS`` / ``--coordinator`` set),
  it calls ``jax.distributed.initialize`` and each host feeds its slice of the global batch.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import math
import os
import pathlib
import sys
import time

import jax
import numpy as np
from flax import nnx
from tqdm import tqdm

from experiments.cli import at_least
from experiments.timing import strict_json
from jaxattn.configs import PRESETS, get_config
from jaxattn.generation import TextStream, generate
from jaxattn.nn.model import DecoderLM, ModelConfig
from jaxattn.ops import context_parallel
from jaxattn.sharding import make_mesh, param_shardings
from jaxattn.train.checkpoint import Checkpointer, install_interrupt_handler
from jaxattn.train.data import (ByteTokenizer, PackedDataset, eval_batches, load_text,
                                split_documents, tokenize_documents)
from jaxattn.train.step import (evaluate, init_train_state, make_eval_step,
                                make_optimizer, make_train_step, model_flops_per_token,
                                shard_batch)


def parse_mesh(text: str | None) -> dict[str, int]:
  """``"data=2,tensor=4"`` -> ``{"data": 2, "tensor": 4}``."""
  if not text:
    return {}
  out = {}
  for part in text.split(","):
    name, _, size = part.partition("=")
    if not size.isdigit() or int(size) < 1:
      raise ValueError(f"`--mesh` entries must look like axis=size with size >= 1, got {part!r}.")
    if name.strip() in out:
      raise ValueError(f"`--mesh` names axis {name.strip()!r} twice, got {text!r}.")
    out[name.strip()] = int(size)
  return out


_WORDS = {"true": True, "false": False, "none": None, "null": None}


def parse_overrides(items: list[str]) -> dict:
  """``["num_layers=8", "sliding_window=none", "scan_layers=true"]`` -> a dict of Python literals
  (``true`` / ``false`` / ``none`` / ``null`` in any case too; other strings as is).  Keys must be
  ``ModelConfig`` fields."""
  types = {f.name: f.type for f in dataclasses.fields(ModelConfig)}
  fields = set(types)
  out = {}
  for item in items or []:
    key, eq, value = item.partition("=")
    if not eq:
      raise ValueError(f"`--set` takes key=value, got {item!r}.")
    if key not in fields:
      raise ValueError(f"`--set`: {key!r} is not a ModelConfig field; fields: {sorted(fields)}.")
    word = value.strip().lower()
    ftype = str(types[key])
    # true/false for bool fields, none/null for optional ones; "none" stays a string elsewhere
    # (position="none", remat="none").
    if word in _WORDS and (("bool" in ftype and word in ("true", "false"))
                           or ("None" in ftype and word in ("none", "null"))):
      out[key] = _WORDS[word]
      continue
    try:
      out[key] = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      out[key] = value
  return out


def _positive_float(text: str) -> float:
  v = float(text)
  if not (math.isfinite(v) and v > 0):
    raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
  return v


def _nonnegative_float(text: str) -> float:
  v = float(text)
  if not (math.isfinite(v) and v >= 0):
    raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
  return v


def _probability(text: str) -> float:
  v = float(text)
  if not 0 < v <= 1:   # also refuses NaN
    raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
  return v


def build_config(args) -> ModelConfig:
  over = parse_overrides(args.set)
  if args.dtype:
    over["dtype"] = args.dtype
  if args.scan_layers:
    over["scan_layers"] = True
  if args.remat:
    over["remat"] = args.remat
  cfg = get_config(args.preset, args.size, **over)
  if cfg.position == "learned" and cfg.max_seq_len < args.seq_len:
    cfg = cfg.replace(max_seq_len=args.seq_len)
  return cfg


def create_sharded_model(cfg: ModelConfig, mesh, seed: int) -> DecoderLM:
  """Builds the model with every parameter created directly on its shards."""
  abstract = nnx.eval_shape(lambda: DecoderLM(cfg, rngs=nnx.Rngs(seed)))
  graphdef, abs_state = nnx.split(abstract)
  shardings = param_shardings(abs_state, mesh)
  state = jax.jit(lambda: nnx.state(DecoderLM(cfg, rngs=nnx.Rngs(seed))),
                  out_shardings=shardings)()
  return nnx.merge(graphdef, state)


def optimizer_args(args) -> dict:
  """The flags the optimizer state depends on (kept with every checkpoint, compared on resume)."""
  return {"lr": args.lr, "warmup": args.warmup, "weight_decay": args.weight_decay,
          "clip": args.clip}


def abstract_like(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def maybe_initialize_distributed(args) -> None:
  if args.coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS"):
    kw = {}
    if args.coordinator:
      kw = dict(coordinator_address=args.coordinator, num_processes=args.num_processes,
                process_id=args.process_id)
    if os.environ.get("JAX_PLATFORMS", "") == "cpu":  # CPU processes talk through gloo
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**kw)


def _strict_json(x, **kwargs) -> str:
  """``json.dumps`` that writes a non-finite float as ``null`` (never the bare ``NaN`` /
  ``Infinity`` that strict JSON readers refuse)."""
  return json.dumps(strict_json(x), allow_nan=False, **kwargs)


def _loss_or_nan(record: dict) -> float:
  """A record's loss as a float: a diverged step's loss is stored as ``null``."""
  v = record.get("loss")
  return float("nan") if v is None else v


class MetricsLog:
  """Append-only JSONL; on resume, lines from steps after the restored one are dropped.

  ``earlier`` holds the kept records (those of the run segments before a resume), read on
  process 0 only (the one writer): the summary's loss and throughput cover the whole run.
  """

  def __init__(self, path: pathlib.Path, resume_step: int):
    self.path = path
    self.earlier: list[dict] = []
    if jax.process_index() != 0:  # one writer
      return
    lines = []
    if resume_step > 0 and path.exists():
      for line in path.read_text().splitlines():
        try:
          rec = json.loads(line)
        except json.JSONDecodeError:
          continue
        if isinstance(rec, dict) and rec.get("step", 0) <= resume_step:
          lines.append(_strict_json(rec))   # (a line an older version wrote with NaN: null)
          self.earlier.append(rec)
    path.write_text("".join(l + "\n" for l in lines))

  def write(self, record: dict) -> None:
    if jax.process_index() == 0:
      with self.path.open("a") as f:
        f.write(_strict_json(record) + "\n")


def train(args) -> dict:
  """Runs the job; returns a summary dict (also written to ``--out/summary.json``)."""
  maybe_initialize_distributed(args)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  cfg = build_config(args)
  mesh = make_mesh(parse_mesh(args.mesh))
  shards = mesh.shape["data"] * mesh.shape["fsdp"]
  if args.batch_size % shards:
    raise ValueError(f"`--batch-size` ({args.batch_size}) must be divisible by the batch shards "
                     f"data x fsdp = {shards} of mesh {dict(mesh.shape)}.")
  if args.seq_len % mesh.shape["context"]:
    raise ValueError(f"`--seq-len` ({args.seq_len}) must be divisible by the context axis "
                     f"({mesh.shape['context']}) of mesh {dict(mesh.shape)}: each device holds "
                     "an equal slice of the sequence.")
  pi, pc = jax.process_index(), jax.process_count()
  if shards % pc:
    # Each process feeds batch_size / process_count rows: they must be whole batch shards, or the
    # global batch would be assembled from fewer rows than asked (and differ per process).
    raise ValueError(f"the batch shards data x fsdp = {shards} of mesh {dict(mesh.shape)} must be "
                     f"a multiple of the {pc} processes (each feeds its own rows); put the "
                     "processes on the data or fsdp axis.")
  log = (lambda *a: print(*a, flush=True)) if pi == 0 else (lambda *a: None)
  log(f"preset {args.preset} ({args.size}); mesh {dict(mesh.shape)} over {jax.device_count()} "
      f"{jax.devices()[0].platform} device(s), {pc} process(es)")

  # -- data ------------------------------------------------------------------------------------
  tokenizer = ByteTokenizer()
  docs = load_text(args.data)
  train_docs, eval_docs = split_documents(docs, eval_every=args.eval_split_every)
  train_tok = tokenize_documents(train_docs, tokenizer)
  eval_tok = tokenize_documents(eval_docs, tokenizer)
  data = PackedDataset(train_tok, batch_size=args.batch_size, seq_len=args.seq_len,
                       seed=args.seed, process_index=pi, process_count=pc)
  evals = eval_batches(eval_tok, batch_size=args.batch_size, seq_len=args.seq_len,
                       process_index=pi, process_count=pc, max_batches=args.eval_batches)
  if cfg.vocab_size < tokenizer.vocab_size:
    raise ValueError(f"the model's vocab_size ({cfg.vocab_size}) is below the tokenizer's "
                     f"({tokenizer.vocab_size}).")

  with jax.set_mesh(mesh), context_parallel.set_options(strategy=args.context_strategy):
    # -- model, optimizer, state ---------------------------------------------------------------
    model = create_sharded_model(cfg, mesh, args.seed)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    log(f"model: {n_params / 1e6:.2f}M parameters, layers {cfg.num_layers} "
        f"(pattern {cfg.layer_pattern!r}), position {cfg.position}, dtype {cfg.dtype}, "
        f"scan {cfg.scan_layers}, remat {cfg.remat}")
    tx = make_optimizer(learning_rate=args.lr, warmup_steps=min(args.warmup, args.steps),
                        total_steps=args.steps, weight_decay=args.weight_decay,
                        clip_norm=args.clip)
    graphdef, state = init_train_state(model, tx, mesh=mesh)
    del model

    # -- resume ----------------------------------------------------------------------------------
    ckpt = Checkpointer(out / "checkpoints", max_to_keep=args.keep, save_every=args.save_every)
    if args.no_resume and ckpt.all_steps():
      # Their step numbers would block every save of the new run (or fail it partway), leaving the
      # old weights under the new run's config and metrics.
      raise ValueError(f"--no-resume: `--out` {str(out)!r} already holds checkpoints "
                       f"{ckpt.all_steps()}; use another --out or remove {ckpt.directory}.")
    start = 0
    rng = np.random.default_rng(args.seed)
    if not args.no_resume and ckpt.latest_step() is not None:
      state, meta = ckpt.restore(target=abstract_like(state), fallback=True)
      if meta.get("config") != cfg.to_dict():
        raise ValueError(f"the checkpoint in {ckpt.directory} was written for another model "
                         "config; use another --out or --no-resume.")
      # The optimizer's hyperparameters shape the restored state's schedule: another --lr,
      # --warmup, --weight-decay or --clip would silently continue a different run.
      changed = {k: (v, meta["optimizer"][k]) for k, v in optimizer_args(args).items()
                 if k in meta.get("optimizer", {}) and meta["optimizer"][k] != v}
      if changed:
        flags = ", ".join(f"--{k.replace('_', '-')} {v} (checkpoint: {w})"
                          for k, (v, w) in changed.items())
        raise ValueError(f"the checkpoint in {ckpt.directory} was trained with other optimizer "
                         f"settings: {flags}; use the same flags, another --out or --no-resume.")
      if meta.get("steps", args.steps) != args.steps:
        log(f"--steps {args.steps} (the checkpoint's run had {meta['steps']}): the learning-rate "
            "schedule now decays over the new total")
      data.restore(meta["data"])
      rng.bit_generator.state = meta["rng"]
      start = int(state.step)
      log(f"resumed from step {start} ({ckpt.directory})")
    if pi == 0:  # what experiments.generate needs to rebuild the model around a checkpoint
      (out / "config.json").write_text(cfg.to_json())   # (after the checks: a refused run
                                                          # must not relabel the old weights)

    def meta():
      return {"config": cfg.to_dict(), "data": data.state(), "rng": rng.bit_generator.state,
              "preset": args.preset, "size": args.size, "optimizer": optimizer_args(args),
              "steps": args.steps}

    step_fn = make_train_step(graphdef, tx, state, mesh=mesh)
    eval_fn = make_eval_step(graphdef, mesh=mesh)
    metrics_log = MetricsLog(out / "metrics.jsonl", start)
    flops_per_token = model_flops_per_token(cfg, args.seq_len)

    # -- loop ------------------------------------------------------------------------------------
    t_compile = None
    history = []
    t_window, tok_window = time.perf_counter(), 0
    interrupted = False
    bar = tqdm(total=args.steps, initial=start, desc="train", unit="step", disable=pi != 0,
               dynamic_ncols=True)
    with install_interrupt_handler() as interrupt:
      for step in range(start, args.steps):
        batch = shard_batch(next(data), mesh)
        t0 = time.perf_counter()
        state, m = step_fn(state, batch)
        n = int(step + 1)
        tok_window += data.tokens_per_batch
        if t_compile is None:  # the first step compiles: keep it out of the throughput
          jax.block_until_ready(m)
          t_compile = time.perf_counter() - t0
          t_window, tok_window = time.perf_counter(), 0
        if n % args.log_every == 0 or n == args.steps:
          m = {k: float(v) for k, v in m.items()}
          dt = time.perf_counter() - t_window
          tps = tok_window / dt if dt > 0 and tok_window else float("nan")
          t_window, tok_window = time.perf_counter(), 0
          rec = dict(step=n, **m, tokens_per_s=tps, epoch=data.epoch,
                     mfu_flops=flops_per_token * tps if math.isfinite(tps) else None)
          history.append(rec)
          metrics_log.write(rec)
          mtp = {"mtp": f"{m['mtp_loss']:.3f}"} if "mtp_loss" in m else {}
          bar.set_postfix(loss=f"{m['loss']:.3f}", **mtp, tok_s=f"{tps:,.0f}")
        bar.update(1)
        if args.eval_every and n % args.eval_every == 0 and n < args.steps:
          jax.block_until_ready(state)   # queued train steps are training time, not eval time
          t_eval = time.perf_counter()
          ev = evaluate(eval_fn, state, evals, mesh=mesh)
          t_window += time.perf_counter() - t_eval   # evaluation is not training throughput
          metrics_log.write(dict(step=n, **ev))
          bar.write(f"step {n}: eval loss {ev['eval_loss']:.4f}, ppl {ev['eval_ppl']:.2f}")
        if ckpt.should_save(n):
          jax.block_until_ready(state)   # queued train steps are training time, not save time
        t_save = time.perf_counter()
        ckpt.save(n, state, meta())
        t_window += time.perf_counter() - t_save   # nor is the checkpoint save (as evaluation)
        if args.stop_at_step is not None and n == args.stop_at_step:
          interrupt.requested = True  # behaves exactly like SIGINT at this step (for tests)
        if interrupt:
          ckpt.save(n, state, meta(), force=True)
          ckpt.wait()
          bar.write(f"interrupted: saved step {n} to {ckpt.directory}; rerun to resume")
          interrupted = True
          break
    bar.close()
    final_step = int(state.step)
    if not interrupted:
      ckpt.save(final_step, state, meta(), force=True)
    ckpt.wait()
    ckpt.close()
    if interrupted:
      return {"interrupted": True, "step": final_step}

    ev = evaluate(eval_fn, state, evals, mesh=mesh)
    metrics_log.write(dict(step=final_step, **ev))
    log(f"eval: loss {ev['eval_loss']:.4f}  perplexity {ev['eval_ppl']:.2f} "
        f"({int(ev['eval_tokens'])} held-out tokens)")
    if "eval_mtp_loss" in ev:
      acc = ", ".join(f"{100 * a:.1f}%" for a in ev["eval_mtp_accuracy"])
      log(f"eval: multi-token prediction loss {ev['eval_mtp_loss']:.4f}, top-1 accuracy by "
          f"depth {acc} (depth 1: the first drafts a greedy draft='mtp' would keep)")

    sample = ""
    if args.sample_tokens:  # every process runs the (SPMD) generation; process 0 prints
      model = nnx.merge(graphdef, state.params, state.rest)
      prompt = tokenizer.encode(args.prompt, add_bos=True)[None, :]
      log(f"sample ({args.sample_tokens} bytes, temperature {args.sample_temperature}, top-p "
          f"{args.sample_top_p}) after {args.prompt!r}:")
      pieces = []
      text = TextStream(tokenizer.decode)

      def stream(ids):
        s = text.feed(ids[:1])
        pieces.append(s)
        if pi == 0:
          print(s, end="", flush=True)

      generate(model, prompt, args.sample_tokens, temperature=args.sample_temperature,
               top_p=args.sample_top_p, seed=args.seed, on_token=stream)
      pieces.append(text.flush())
      log(pieces[-1])
      sample = args.prompt + "".join(pieces)

  # The whole run, resumed segments included: the earlier training records (not the evals)
  # from metrics.jsonl, then this segment's.
  history = [r for r in metrics_log.earlier if "loss" in r] + history
  first = _loss_or_nan(history[0]) if history else float("nan")
  last = _loss_or_nan(history[-1]) if history else float("nan")
  # (a segment's compile step record, if logged, has no window: NaN / null, left out here)
  tps = [h["tokens_per_s"] for h in history
         if h.get("tokens_per_s") is not None and math.isfinite(h["tokens_per_s"])]
  summary = dict(preset=args.preset, size=args.size, steps=final_step, parameters=n_params,
                 first_loss=first, last_loss=last, **ev, compile_s=t_compile,
                 tokens_per_s=float(np.median(tps)) if tps else None, sample=sample,
                 mesh=dict(mesh.shape), config=cfg.to_dict())
  if pi == 0:
    (out / "summary.json").write_text(_strict_json(summary, indent=2))
    log(f"loss {first:.3f} -> {last:.3f}; summary, metrics and checkpoints in {out}/")
  return summary


def make_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--preset", default="llama", choices=sorted(PRESETS))
  p.add_argument("--size", default="tiny", choices=("tiny", "full"))
  p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                 help="ModelConfig overrides, e.g. --set num_layers=6 sliding_window=64")
  p.add_argument("--steps", type=at_least(1), default=300)
  p.add_argument("--batch-size", type=at_least(1), default=16, help="global rows per step")
  p.add_argument("--seq-len", type=at_least(1), default=256)
  p.add_argument("--lr", type=_positive_float, default=3e-3)
  p.add_argument("--warmup", type=at_least(0), default=30)
  p.add_argument("--weight-decay", type=_nonnegative_float, default=0.1)
  p.add_argument("--clip", type=_positive_float, default=1.0,
                 help="global gradient-norm clip (a negative one would reverse the updates)")
  p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None)
  p.add_argument("--context-strategy", choices=("all_gather", "ring"), default="all_gather",
                 help="context parallelism (a `context` axis in --mesh): gather the sequence's "
                      "keys and values on every device, or pass them around a ring")
  p.add_argument("--scan-layers", action="store_true")
  p.add_argument("--remat", choices=("none", "full", "dots", "dots_no_batch"), default=None)
  p.add_argument("--mesh", default=None, help="axis sizes, e.g. data=2,tensor=4 (data: the rest)")
  p.add_argument("--data", default=None, help="text file, or hf:NAME[:CONFIG][:SPLIT]; default: "
                 "Python's documentation topics")
  p.add_argument("--eval-split-every", type=at_least(2), default=20,
                 help="every n-th document is held out")
  p.add_argument("--eval-every", type=at_least(0), default=100, help="0: no periodic eval")
  p.add_argument("--eval-batches", type=at_least(1), default=8)
  p.add_argument("--log-every", type=at_least(1), default=1)
  p.add_argument("--out", default="runs/train")
  p.add_argument("--save-every", type=at_least(1), default=100)
  p.add_argument("--keep", type=at_least(1), default=3)
  p.add_argument("--no-resume", action="store_true")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--sample-tokens", type=at_least(0), default=200)
  p.add_argument("--prompt", default="The ")
  p.add_argument("--sample-temperature", type=_nonnegative_float, default=0.7,
                 help="0: greedy")
  p.add_argument("--sample-top-p", type=_probability, default=0.9)
  p.add_argument("--report", action="store_true", help="run `experiments.report --quick` after")
  p.add_argument("--stop-at-step", type=int, default=None, help=argparse.SUPPRESS)
  p.add_argument("--coordinator", default=None, help="multi-host: coordinator address host:port")
  p.add_argument("--num-processes", type=int, default=None)
  p.add_argument("--process-id", type=int, default=None)
  return p


def main(argv=None) -> int:
  args = make_parser().parse_args(argv)
  summary = train(args)
  if summary.get("interrupted"):
    return 130
  if args.report and jax.process_index() == 0:
    from experiments import report
    return report.main(["--quick", "--train-metrics", str(pathlib.Path(args.out) / "metrics.jsonl")])
  return 0


if __name__ == "__main__":
  sys.exit(main())
