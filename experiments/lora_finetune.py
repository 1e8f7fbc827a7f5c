"""Fine-tuning a small pretrained decoder with LoRA, QLoRA and full fine-tuning on a shifted task.

    python -m experiments.lora_finetune [--dim 128] [--layers 4] [--pretrain-steps 400]
                                        [--finetune-steps 200] [--rank 8] [--alpha 16]
                                        [--mem-sizes 1024x8x8192,2048x16x32000] [--out runs/lora_finetune]

1. Pretrains a decoder built from ``jaxattn.nn`` blocks (RoPE attention, SwiGLU MLP) on a copy task:
   ``[a | a]``, loss on the copied half.
2. Fine-tunes three copies on a shifted task, ``[a | (a + shift) mod V]`` (the same attention pattern,
   a new output mapping):
   * full fine-tuning: every parameter, AdamW state for all of them;
   * LoRA: adapters (rank ``--rank``) on q/k/v/o, the MLP and the output head, the base frozen;
   * QLoRA: the same adapters on NF4 base kernels (double-quantized scales).
   It reports the shifted-task loss before and after, the original-task loss after (forgetting),
   trainable and frozen parameters, seconds per step, and the memory of the compiled train step
   (``jax.jit(step).lower(...).compile().memory_analysis()``: arguments = parameters + optimizer
   state + batch; temp = activations, gradients and scratch), with ratios to full fine-tuning.
3. For ``--mem-sizes`` (``DIMxLAYERSxVOCAB``) it compiles the three train steps on abstract
   (``nnx.eval_shape``) models, so the memory of larger models is measured without allocating them.

Writes ``report.json`` and ``loss.png`` under ``--out``.  CPU timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from experiments.cli import CommaList
from jaxattn.nn.block import TransformerBlock
from jaxattn.nn.lora import LoRAParam, apply_lora, count_parameters, lora_optimizer
from jaxattn.ops.norms import rms_norm

try:
  from tqdm import trange
except ImportError:  # pragma: no cover
  def trange(n, **_):
    return range(n)

TARGETS = r"(attn/(q|k|v|o)_proj|mlp/(up|gate|down)|head)$"
METHODS = ("full", "lora", "qlora")


class DecoderLM(nnx.Module):
  def __init__(self, vocab: int, dim: int, layers: int, *, rngs: nnx.Rngs):
    heads = max(dim // 32, 1)
    self.embed = nnx.Embed(vocab, dim, rngs=rngs)
    self.blocks = nnx.List([TransformerBlock(dim, num_heads=heads, mlp_dim=2 * dim, rngs=rngs)
                            for _ in range(layers)])
    self.head = nnx.Linear(dim, vocab, use_bias=False, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    for blk in self.blocks:
      x = blk(x)
    return self.head(rms_norm(x))


def make_batch(rng: np.random.Generator, batch: int, half: int, vocab: int, shift: int):
  """``[a | (a + shift) mod (vocab - 1)]`` with tokens in 1..vocab-1 (shift 0: the copy task)."""
  a = rng.integers(1, vocab, size=(batch, half))
  b = (a - 1 + shift) % (vocab - 1) + 1
  return jnp.asarray(np.concatenate([a, b], axis=1), jnp.int32)


def copied_half_loss(model, tokens):
  half = tokens.shape[1] // 2
  logits = model(tokens[:, :-1])
  ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens[:, 1:])
  return ce[:, half - 1:].mean()


def compiled_step(model, optimizer, wrt, tokens_like):
  """A jitted functional train step over ``(model, optimizer)`` state, and its compiled form."""
  graphdef, state = nnx.split((model, optimizer))

  def step(state, tokens):
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(copied_half_loss, argnums=nnx.DiffState(0, wrt))(model, tokens)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), loss

  jitted = jax.jit(step, donate_argnums=0)
  compiled = jitted.lower(state, tokens_like).compile()
  # The step donates its state; give it its own buffers (a cloned model shares the originals).
  state = jax.tree.map(lambda a: a.copy() if isinstance(a, jax.Array) else a, state)
  return graphdef, state, compiled


def memory(compiled) -> dict:
  m = compiled.memory_analysis()
  if m is None:  # some backends do not report
    return {}
  arg, out, tmp, alias = (int(m.argument_size_in_bytes), int(m.output_size_in_bytes),
                          int(m.temp_size_in_bytes), int(m.alias_size_in_bytes))
  return dict(argument_bytes=arg, output_bytes=out, temp_bytes=tmp, alias_bytes=alias,
              peak_bytes=arg + out - alias + tmp)


def setup(method: str, model: nnx.Module, args, lr: float):
  """Adapts ``model`` in place for ``method``; returns ``(optimizer, wrt)``."""
  tx = optax.adamw(lr, weight_decay=0.0)
  if method == "full":
    return nnx.Optimizer(model, tx, wrt=nnx.Param), nnx.Param
  apply_lora(model, TARGETS, rank=args.rank, alpha=args.alpha, quantize_base=method == "qlora",
             rngs=nnx.Rngs(args.seed + 7))
  return lora_optimizer(model, tx), LoRAParam


def prepare(method, pretrained, args, eval_sets):
  """A fine-tuning run of ``method`` from a copy of ``pretrained``: compiled step, counts, memory."""
  model = nnx.clone(pretrained)
  optimizer, wrt = setup(method, model, args, args.lr_lora if method != "full" else args.lr_full)
  counts = count_parameters(model, trainable=wrt)
  rng = np.random.default_rng(args.seed + 100)     # the same batches for every method
  batch = lambda: make_batch(rng, args.batch, args.seq // 2, args.vocab, args.shift)
  graphdef, state, step = compiled_step(model, optimizer, wrt, batch())
  evaluate = jax.jit(lambda state, tokens: copied_half_loss(nnx.merge(graphdef, state)[0], tokens))
  run = dict(state=state, step=step, batch=batch, evaluate=evaluate, curve=[], times=[])
  result = dict(trainable=counts.trainable, frozen=counts.frozen,
                trainable_bytes=counts.trainable_bytes, frozen_bytes=counts.frozen_bytes,
                shifted_loss_before=float(evaluate(state, eval_sets["shifted"])),
                memory=memory(step))
  return run, result


def finetune_all(pretrained, args, eval_sets):
  """Fine-tunes every method, one step of each in turn, so machine load hits all of them alike."""
  runs, results = {}, {}
  for method in METHODS:
    runs[method], results[method] = prepare(method, pretrained, args, eval_sets)
  for _ in trange(args.finetune_steps, desc="fine-tune", leave=False, disable=None):
    for method, run in runs.items():
      tokens = run["batch"]()
      t0 = time.perf_counter()
      run["state"], loss = run["step"](run["state"], tokens)
      run["curve"].append(float(loss))        # float() waits for the step
      run["times"].append(time.perf_counter() - t0)
  for method, run in runs.items():
    times = run["times"][len(run["times"]) // 4:]   # past the warm-up
    results[method].update(
        shifted_loss_after=float(run["evaluate"](run["state"], eval_sets["shifted"])),
        copy_loss_after=float(run["evaluate"](run["state"], eval_sets["copy"])),
        seconds_per_step=float(np.median(times)) if times else float("nan"), curve=run["curve"])
  return results


def pretrain(args):
  model = DecoderLM(args.vocab, args.dim, args.layers, rngs=nnx.Rngs(args.seed))
  warmup = min(30, args.pretrain_steps // 4)
  sched = optax.warmup_cosine_decay_schedule(0.0, args.lr_pretrain, warmup, max(args.pretrain_steps, warmup + 1))
  optimizer = nnx.Optimizer(model, optax.adamw(sched, weight_decay=0.01), wrt=nnx.Param)
  rng = np.random.default_rng(args.seed)
  graphdef, state, step = compiled_step(
      model, optimizer, nnx.Param, make_batch(rng, args.batch, args.seq // 2, args.vocab, 0))
  losses = []
  for _ in trange(args.pretrain_steps, desc="pretrain", leave=False, disable=None):
    state, loss = step(state, make_batch(rng, args.batch, args.seq // 2, args.vocab, 0))
    losses.append(float(loss))
  model, _ = nnx.merge(graphdef, state)
  return model, losses


def abstract_memory(dim, layers, vocab, args) -> dict:
  """Compiled train-step memory of each method for an abstract model of the given size.

  With ``--mem-time-steps N`` the models are also built for real and ``N`` steps of each are timed
  (median after one warm-up step; one step of each method in turn, so machine load hits all alike).
  """
  tokens = jax.ShapeDtypeStruct((args.mem_batch, args.mem_seq), jnp.int32)
  timed = args.mem_time_steps > 0
  out, runs = {}, {}
  for method in METHODS:
    def build():
      model = DecoderLM(vocab, dim, layers, rngs=nnx.Rngs(0))
      optimizer, _ = setup(method, model, args, 1e-3)
      return model, optimizer
    model, optimizer = build() if timed else nnx.eval_shape(build)
    wrt = nnx.Param if method == "full" else LoRAParam
    counts = count_parameters(model, trainable=wrt)
    _, state, compiled = compiled_step(model, optimizer, wrt, tokens)
    del model, optimizer
    out[method] = dict(trainable=counts.trainable, frozen=counts.frozen, memory=memory(compiled))
    runs[method] = dict(state=state, step=compiled, times=[])
  if timed:
    rng = np.random.default_rng(0)
    for _ in trange(args.mem_time_steps + 1, desc=f"time {dim}", leave=False, disable=None):
      batch = jnp.asarray(rng.integers(1, vocab, tokens.shape), jnp.int32)
      for method, run in runs.items():
        t0 = time.perf_counter()
        run["state"], loss = run["step"](run["state"], batch)
        float(loss)
        run["times"].append(time.perf_counter() - t0)
    for method, run in runs.items():
      out[method]["seconds_per_step"] = float(np.median(run["times"][1:]))
  return out


def _mib(b):
  return b / 2**20


def print_table(results: dict, title: str):
  full = results["full"].get("memory", {})
  print(f"\n{title}")
  print(f"  {'method':6s} {'trainable':>12s} {'frozen':>12s} {'args MiB':>9s} {'temp MiB':>9s} "
        f"{'peak MiB':>9s} {'peak / full':>11s}")
  timed = all("seconds_per_step" in r for r in results.values())
  for method, r in results.items():
    m = r.get("memory", {})
    ratio = m.get("peak_bytes", np.nan) / full.get("peak_bytes", np.nan)
    line = (f"  {method:6s} {r['trainable']:12,d} {r['frozen']:12,d} "
            f"{_mib(m.get('argument_bytes', np.nan)):9.2f} {_mib(m.get('temp_bytes', np.nan)):9.2f} "
            f"{_mib(m.get('peak_bytes', np.nan)):9.2f} {ratio:11.3f}")
    if timed:
      line += (f"   {1e3 * r['seconds_per_step']:.0f} ms/step "
               f"({r['seconds_per_step'] / results['full']['seconds_per_step']:.2f} x full)")
    print(line)


def _model_size(text: str) -> str:
  """``text`` if it is ``DIMxLAYERSxVOCAB`` of positive ints (``ValueError`` otherwise)."""
  parts = text.split("x")
  if len(parts) != 3 or min(int(v) for v in parts) < 1:
    raise ValueError(text)
  return text


MODEL_SIZES = CommaList(_model_size, "DIMxLAYERSxVOCAB sizes of positive integers (1024x8x8192)",
                        name="model_size_list", allow_empty=True)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--vocab", type=int, default=64)
  ap.add_argument("--dim", type=int, default=128)
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--seq", type=int, default=32, help="tokens per sequence (two halves)")
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("--shift", type=int, default=5, help="the fine-tuning task adds this to each token")
  ap.add_argument("--pretrain-steps", type=int, default=400)
  ap.add_argument("--finetune-steps", type=int, default=200)
  ap.add_argument("--rank", type=int, default=8)
  ap.add_argument("--alpha", type=float, default=16.0)
  ap.add_argument("--lr-pretrain", type=float, default=3e-3)
  ap.add_argument("--lr-full", type=float, default=1e-3)
  ap.add_argument("--lr-lora", type=float, default=3e-3)
  ap.add_argument("--mem-sizes", type=MODEL_SIZES, default="1024x8x8192",
                  help="comma-separated DIMxLAYERSxVOCAB for compile-only memory ('' to skip)")
  ap.add_argument("--mem-batch", type=int, default=8)
  ap.add_argument("--mem-seq", type=int, default=256)
  ap.add_argument("--mem-time-steps", type=int, default=0,
                  help="also build the --mem-sizes models and time this many steps")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--out", default="runs/lora_finetune")
  args = ap.parse_args(argv)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}; model dim {args.dim}, "
        f"{args.layers} layers, vocab {args.vocab}, seq {args.seq}, batch {args.batch}")

  t0 = time.time()
  pretrained, pre_curve = pretrain(args)
  rng = np.random.default_rng(args.seed + 999)
  eval_sets = {"copy": make_batch(rng, 256, args.seq // 2, args.vocab, 0),
               "shifted": make_batch(rng, 256, args.seq // 2, args.vocab, args.shift)}
  chance = float(np.log(args.vocab - 1))
  print(f"pretrained {args.pretrain_steps} steps on the copy task: final loss "
        f"{np.mean(pre_curve[-10:]):.3f} (chance {chance:.2f}) [{time.time() - t0:.0f} s]")

  results = finetune_all(pretrained, args, eval_sets)
  full_t = results["full"]["seconds_per_step"]
  print(f"\nfine-tuning {args.finetune_steps} steps on the shifted task (+{args.shift}); loss on the "
        f"copied half:")
  print(f"  {'method':6s} {'before':>7s} {'after':>7s} {'copy task after':>15s} {'ms/step':>8s} "
        f"{'vs full':>7s}")
  for method, r in results.items():
    print(f"  {method:6s} {r['shifted_loss_before']:7.3f} {r['shifted_loss_after']:7.3f} "
          f"{r['copy_loss_after']:15.3f} {1e3 * r['seconds_per_step']:8.2f} "
          f"{r['seconds_per_step'] / full_t:7.2f}")
  print_table(results, f"parameters and compiled train-step memory (dim {args.dim}, {args.layers} "
                       f"layers, batch {args.batch}x{args.seq}):")

  mem_results = {}
  for size in args.mem_sizes:
    dim, layers, vocab = (int(v) for v in size.split("x"))
    t1 = time.time()
    mem_results[size] = abstract_memory(dim, layers, vocab, args)
    how = "measured" if args.mem_time_steps else "compile-only (abstract model)"
    print_table(mem_results[size], f"{how}: dim {dim}, {layers} layers, vocab {vocab}, batch "
                                   f"{args.mem_batch}x{args.mem_seq} [{time.time() - t1:.0f} s]:")

  report = dict(args=vars(args), pretrain_curve=pre_curve, results=results, memory_only=mem_results)
  (out / "report.json").write_text(json.dumps(report, indent=1))
  try:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    fig, ax = plt.subplots(figsize=(7, 4))
    for method, r in results.items():
      ax.plot(r["curve"], label=f"{method} ({r['trainable']:,} trainable)")
    ax.axhline(chance, color="gray", ls=":", label="chance")
    ax.set(xlabel="fine-tuning step", ylabel="loss on the shifted copied half", yscale="log",
           title="LoRA vs QLoRA vs full fine-tuning")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=120)
    print(f"\nwrote {out / 'report.json'} and {out / 'loss.png'}")
  except ImportError:
    print(f"\nwrote {out / 'report.json'} (install matplotlib for the plot)")


if __name__ == "__main__":
  main()
