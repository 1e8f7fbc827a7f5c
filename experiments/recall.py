"""Multi-query associative recall (MQAR): Gated DeltaNet, sliding-window attention, full attention
and a hybrid, accuracy against sequence length.

    python -m experiments.recall [--lengths 32,64,128,256] [--steps 1000] [--models dn,swa,attn,hybrid]
        [--dim 64] [--window 32] [--batch 32] [--lr 1e-2] [--out runs/recall]

Task (after Zoology's MQAR, with each key-value pair in one position): a sequence of length ``T``
starts with ``P = T // 8`` pairs, position ``i`` carrying key ``k_i`` (distinct keys from a
vocabulary of 64) and value ``v_i`` (from another 64) as the sum of a key and a value embedding;
``T - P`` queries follow, each a key drawn from the pairs with a "no value" embedding.  At every
query position the model must output that key's value; only those positions enter the loss and
the accuracy.  A query can be up to ``T`` tokens from its pair, and ``P`` associations (32 at
``T = 256``) must be held at once.  Putting key and value in one position makes retrieval a
one-step lookup that two-layer models learn within a few hundred steps (the two-token format needs
an induction circuit and thousands of steps); it still separates exact memories from bounded ones.

Models: embeddings -> a two-layer ``HybridStack`` (width 64, 2 heads of 32) -> RMSNorm -> linear
head, with mixers ``dn`` = ``"DD"`` (Gated DeltaNet, a 32 x 32 memory per head), ``swa`` = ``"SS"``
(sliding window ``--window``, RoPE), ``attn`` = ``"AA"`` (full causal attention, RoPE),
``hybrid`` = ``"DS"`` (Gated DeltaNet then sliding-window attention, the Gated DeltaNet paper's
pairing; bounded memory too).  One model per mixer is trained for ``--steps`` AdamW steps on
fresh random batches, cycling through the lengths (one length per step), then scored on 512
held-out sequences of each length.  Small budgets: read the comparison between models, not the
absolute numbers.  Gated DeltaNet needs the most steps: its query positions also write to the
memory (with strength beta), and until it learns beta ~ 0 there they overwrite the associations
being asked about (about 400 of the 1000 steps are a loss plateau); with 600 steps and lengths up
to 512 it did not leave the plateau at all.  About 15 minutes on 2 busy CPU cores.

Writes ``results.json`` and ``recall.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from experiments.cli import choice_list, int_list
from jaxattn.nn.hybrid import HybridStack
from jaxattn.ops.norms import rms_norm

try:
  from tqdm import trange
except ImportError:  # pragma: no cover
  def trange(n, **_):
    return range(n)

NUM_KEYS = 64
NUM_VALUES = 64
MODELS = {"dn": "DD", "swa": "SS", "attn": "AA", "hybrid": "DS"}


def mqar_batch(rng: np.random.Generator, batch: int, length: int):
  """``keys [B, T]``, ``values [B, T]`` (``NUM_VALUES`` = none, at query positions), ``targets
  [B, T]`` (the value asked for at each query position) and ``mask [B, T]`` (query positions)."""
  pairs = length // 8
  keys = np.argsort(rng.random((batch, NUM_KEYS)), axis=1)[:, :pairs]         # distinct keys
  values = rng.integers(0, NUM_VALUES, (batch, pairs))
  which = rng.integers(0, pairs, (batch, length - pairs))
  queries = np.take_along_axis(keys, which, axis=1)
  answers = np.take_along_axis(values, which, axis=1)
  none = np.full_like(queries, NUM_VALUES)
  key_tokens = np.concatenate([keys, queries], axis=1)
  value_tokens = np.concatenate([values, none], axis=1)
  targets = np.concatenate([np.zeros_like(values), answers], axis=1)
  mask = np.concatenate([np.zeros_like(values), np.ones_like(queries)], axis=1).astype(bool)
  return (key_tokens.astype(np.int32), value_tokens.astype(np.int32), targets.astype(np.int32),
          mask)


class RecallModel(nnx.Module):
  def __init__(self, pattern: str, *, dim: int, window: int, rngs: nnx.Rngs):
    self.key_embed = nnx.Embed(NUM_KEYS, dim, rngs=rngs)
    self.value_embed = nnx.Embed(NUM_VALUES + 1, dim, rngs=rngs)  # + "no value" at queries
    self.stack = HybridStack(dim, pattern, num_heads=2, mlp_dim=2 * dim, sliding_window=window,
                             deltanet=dict(num_key_heads=2, chunk_size=16), rngs=rngs)
    self.head = nnx.Linear(dim, NUM_VALUES, rngs=rngs)

  def __call__(self, keys, values):
    x = self.key_embed(keys) + self.value_embed(values)
    return self.head(rms_norm(self.stack(x)))


def train(pattern, lengths, *, steps, batch, dim, window, lr, seed):
  """One model per pattern, trained on all lengths in turn (one length per step): short sequences
  are learned first and carry the mechanism over to long ones, as in Zoology's mixed training."""
  model = RecallModel(pattern, dim=dim, window=window, rngs=nnx.Rngs(seed))
  warmup = max(steps // 10, 1)
  schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1))
  opt = nnx.Optimizer(model, optax.adamw(schedule, weight_decay=0.1), wrt=nnx.Param)

  @nnx.jit
  def step(model, opt, keys, values, targets, mask):
    def loss_fn(m):
      ce = optax.softmax_cross_entropy_with_integer_labels(m(keys, values), targets)
      return jnp.sum(ce * mask) / jnp.sum(mask)
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    opt.update(model, grads)
    return loss

  rng = np.random.default_rng(seed)
  losses = []
  for i in trange(steps, desc=pattern, leave=False, disable=None):
    losses.append(float(step(model, opt, *mqar_batch(rng, batch, lengths[i % len(lengths)]))))
  return model, losses


def score(model, length, *, seed, n=512):
  """Query accuracy on ``n`` held-out sequences of ``length``."""
  @nnx.jit
  def correct(model, keys, values, targets, mask):
    hit = jnp.argmax(model(keys, values), axis=-1) == targets
    return jnp.sum(hit & mask), jnp.sum(mask)

  rng = np.random.default_rng(10_000 + seed)
  hits = total = 0
  for _ in range(n // 64):
    h, m = correct(model, *mqar_batch(rng, 64, length))
    hits, total = hits + int(h), total + int(m)
  return hits / total


def _plot(out, results, lengths):
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:  # pragma: no cover
    return
  fig, a = plt.subplots(figsize=(6, 4))
  for name, rows in results.items():
    a.plot(lengths, [rows[str(t)]["accuracy"] for t in lengths], "o-",
           label=f"{name} ({MODELS[name]})")
  a.set_xscale("log", base=2)
  a.set_xticks(lengths, [str(t) for t in lengths])
  a.set_ylim(0, 1.02)
  a.set_xlabel("sequence length T (P = T/8 key-value pairs)")
  a.set_ylabel("query accuracy")
  a.set_title("MQAR")
  a.legend()
  fig.tight_layout()
  fig.savefig(out / "recall.png", dpi=120)
  plt.close(fig)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  # T // 8 pairs of distinct keys: at least 1, at most NUM_KEYS.
  p.add_argument("--lengths", type=int_list(minimum=8, maximum=8 * NUM_KEYS + 7),
                 default="32,64,128,256")
  p.add_argument("--models", type=choice_list(MODELS), default=",".join(MODELS),
                 help=f"comma list of {', '.join(MODELS)}")
  p.add_argument("--steps", type=int, default=1000)
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--dim", type=int, default=64)
  p.add_argument("--window", type=int, default=32)
  p.add_argument("--lr", type=float, default=1e-2)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default="runs/recall")
  args = p.parse_args(argv)
  lengths, names = args.lengths, args.models
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  results = {}
  for name in names:
    t0 = time.perf_counter()
    model, losses = train(MODELS[name], lengths, steps=args.steps, batch=args.batch, dim=args.dim,
                          window=args.window, lr=args.lr, seed=args.seed)
    results[name] = {"train_seconds": time.perf_counter() - t0,
                     "final_loss": float(np.mean(losses[-4 * len(lengths):]))}
    for t in lengths:
      results[name][str(t)] = {"accuracy": score(model, t, seed=args.seed)}
    accs = "  ".join(f"T={t}: {results[name][str(t)]['accuracy']:.3f}" for t in lengths)
    print(f"{name:>7} ({MODELS[name]})  {accs}   final loss {results[name]['final_loss']:.3f} "
          f"({results[name]['train_seconds']:.0f} s)", flush=True)
  (out / "results.json").write_text(json.dumps({"config": vars(args), "results": results}, indent=2))
  _plot(out, results, lengths)
  print(f"wrote {out}/results.json and recall.png")


if __name__ == "__main__":
  main()
