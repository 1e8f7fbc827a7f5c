"""Expert load with and without auxiliary-loss-free balancing, in a small MoE language model.

    python -m experiments.moe_balance [--steps 400] [--rate 0.01] [--out runs/moe_balance]

A 2-layer decoder (token embedding -> [RMSNorm -> Attention, RMSNorm -> MoE] x 2 -> tied
unembedding), 16 routed experts, top-2, sigmoid routing and one shared expert, trained with optax
AdamW on next-token prediction over a synthetic corpus: each sequence follows one of several
sparse Markov chains whose tokens have Zipf-distributed frequencies, so a router that follows
token identity is pushed toward the experts that frequent tokens prefer.

Runs (same seed, same data):
  none      no balancing: the router bias stays 0, no auxiliary loss
  bias      the auxiliary-loss-free update b_i += rate * sign(mean_load - load_i) after each step
  bias+seq  the bias update plus DeepSeek-V3's sequence-wise balance loss (alpha = --alpha)

Plots max/mean expert load (averaged over layers) and the language-model loss per step to
``--out``/balance.png and writes the curves and a summary to ``--out``/results.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from experiments.cli import choice_list
from jaxattn.nn.attention import Attention
from jaxattn.nn.linear import param
from jaxattn.nn.moe import MoE
from jaxattn.nn.norms import RMSNorm

try:
  from tqdm import trange
except ImportError:  # pragma: no cover
  def trange(n, **_):
    return range(n)


class TinyMoELM(nnx.Module):
  """Embedding + pre-norm blocks of attention and MoE + tied unembedding."""

  def __init__(self, vocab: int, dim: int, layers: int, *, experts: int, top_k: int,
               expert_dim: int, seq_alpha: float, rngs: nnx.Rngs):
    self.embed = param(rngs, nnx.initializers.normal(1.0), (vocab, dim), ("vocab", "embed"))
    self.attn_norms = nnx.List([RMSNorm(dim, rngs=rngs) for _ in range(layers)])
    self.attns = nnx.List([Attention(dim, num_heads=4, rngs=rngs) for _ in range(layers)])
    self.moe_norms = nnx.List([RMSNorm(dim, rngs=rngs) for _ in range(layers)])
    self.moes = nnx.List([MoE(dim, experts, top_k, expert_dim, num_shared_experts=1,
                              seq_balance_alpha=seq_alpha, rngs=rngs) for _ in range(layers)])
    self.final_norm = RMSNorm(dim, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed[...][tokens]
    stats = []
    for an, attn, mn, moe in zip(self.attn_norms, self.attns, self.moe_norms, self.moes):
      x = x + attn(an(x))
      y, s = moe(mn(x))
      x = x + y
      stats.append(s)
    # Tied unembedding scaled by 1/sqrt(D): unit-variance embeddings would give logits of size ~D.
    logits = self.final_norm(x) @ self.embed[...].T * x.shape[-1] ** -0.5
    return logits, stats


def make_corpus(seed: int, vocab: int, chains: int, branching: int):
  """``chains`` sparse transition matrices over a Zipf-weighted vocabulary."""
  rng = np.random.default_rng(seed)
  zipf = 1.0 / np.arange(1, vocab + 1) ** 1.1
  zipf /= zipf.sum()
  trans = np.zeros((chains, vocab, vocab))
  for c in range(chains):
    for v in range(vocab):
      nxt = rng.choice(vocab, size=branching, replace=False, p=zipf)
      trans[c, v, nxt] = rng.dirichlet(np.ones(branching))
  return jnp.asarray(np.log(trans + 1e-12), jnp.float32), jnp.asarray(np.log(zipf), jnp.float32)


@partial(jax.jit, static_argnums=(3, 4))
def sample_batch(key, log_trans, log_start, batch: int, length: int):
  kc, ks, kt = jax.random.split(key, 3)
  chain = jax.random.randint(kc, (batch,), 0, log_trans.shape[0])
  first = jax.random.categorical(ks, jnp.broadcast_to(log_start, (batch, log_start.shape[0])))

  def step(tok, k):
    nxt = jax.random.categorical(k, log_trans[chain, tok])
    return nxt, nxt

  _, rest = jax.lax.scan(step, first, jax.random.split(kt, length - 1))
  return jnp.concatenate([first[:, None], rest.T], axis=1)


MODES = ("none", "bias", "bias+seq")


def train(mode: str, args, corpus):
  seq_alpha = args.alpha if mode == "bias+seq" else 0.0
  model = TinyMoELM(args.vocab, args.dim, args.layers, experts=args.experts, top_k=args.top_k,
                    expert_dim=args.expert_dim, seq_alpha=seq_alpha, rngs=nnx.Rngs(args.seed))
  opt = nnx.Optimizer(model, optax.adamw(args.lr, weight_decay=0.01), wrt=nnx.Param)
  rate = args.rate if mode != "none" else 0.0

  @nnx.jit
  def step(model, opt, tokens):
    def loss_fn(m):
      logits, stats = m(tokens[:, :-1])
      ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
      return ce + sum(s.aux_loss for s in stats), (ce, stats)
    (_, (ce, stats)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    opt.update(model, grads)
    # The bias update: outside the gradient, after the optimizer step, once per layer.
    for moe, s in zip(model.moes, stats):
      moe.update_bias(s.load, rate=rate)
    imbalance = jnp.mean(jnp.stack([s.max_over_mean for s in stats]))
    return ce, imbalance

  key = jax.random.key(args.seed + 1)
  losses, loads = [], []
  for _ in trange(args.steps, desc=f"{mode:>9}", leave=False):
    key, sub = jax.random.split(key)
    ce, imb = step(model, opt, sample_batch(sub, *corpus, args.batch, args.length + 1))
    losses.append(float(ce))
    loads.append(float(imb))
  return dict(loss=losses, max_over_mean=loads,
              bias=[np.asarray(m.router_bias[...]).round(4).tolist() for m in model.moes])


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--steps", type=int, default=400)
  p.add_argument("--rate", type=float, default=0.01, help="bias update rate (gamma)")
  p.add_argument("--alpha", type=float, default=1e-3, help="sequence-wise balance loss weight")
  p.add_argument("--modes", type=choice_list(MODES), default=",".join(MODES),
                 help=f"comma list of {', '.join(MODES)}")
  p.add_argument("--vocab", type=int, default=256)
  p.add_argument("--dim", type=int, default=64)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--experts", type=int, default=16)
  p.add_argument("--top-k", type=int, default=2)
  p.add_argument("--expert-dim", type=int, default=64)
  p.add_argument("--chains", type=int, default=8)
  p.add_argument("--branching", type=int, default=4)
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--length", type=int, default=64)
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default="runs/moe_balance")
  args = p.parse_args(argv)
  modes = args.modes

  corpus = make_corpus(args.seed, args.vocab, args.chains, args.branching)
  runs, t0 = {}, time.time()
  for mode in modes:
    runs[mode] = train(mode, args, corpus)
  tail = max(1, args.steps // 10)
  summary = {m: dict(first_max_over_mean=r["max_over_mean"][0],
                     final_max_over_mean=float(np.mean(r["max_over_mean"][-tail:])),
                     peak_max_over_mean=float(np.max(r["max_over_mean"])),
                     final_loss=float(np.mean(r["loss"][-tail:]))) for m, r in runs.items()}
  print(f"{args.steps} steps, {args.experts} experts top-{args.top_k}, {args.layers} layers "
        f"({time.time() - t0:.0f} s); max/mean load over the last {tail} steps "
        f"(1 = balanced, {args.experts / args.top_k:.0f} = collapsed):")
  for m, s in summary.items():
    print(f"  {m:>9}: load max/mean first {s['first_max_over_mean']:.2f}  peak "
          f"{s['peak_max_over_mean']:.2f}  final {s['final_max_over_mean']:.2f}   "
          f"loss final {s['final_loss']:.3f}")

  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "results.json").write_text(json.dumps(dict(config=vars(args), summary=summary, runs=runs)))
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for m, r in runs.items():
      axes[0].plot(r["max_over_mean"], label=m)
      axes[1].plot(r["loss"], label=m)
    axes[0].axhline(1.0, color="gray", lw=0.5)
    axes[0].set(xlabel="step", ylabel="max / mean expert load", title="expert load (layer mean)")
    axes[1].set(xlabel="step", ylabel="cross-entropy", title="language-model loss", yscale="log")
    for a in axes:
      a.legend()
    fig.tight_layout()
    fig.savefig(out / "balance.png", dpi=120)
  except ImportError:  # pragma: no cover
    pass
  print(f"wrote {out / 'results.json'}")
  return summary


if __name__ == "__main__":
  main()
