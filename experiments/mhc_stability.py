"""Composite signal gain across depth for a plain residual, unconstrained HC and mHC.

    python -m experiments.mhc_stability [--layers 64] [--dim 64] [--streams 4]
                                        [--drift 0,0.1,0.2,0.4] [--train-layers 12]
                                        [--train-steps 300] [--out runs/mhc_stability]

The composite mixing after ``l`` residual sites is ``P_l = H_res^(l) ... H_res^(1)`` (two sites per
block: attention and MLP); its gain (the mHC paper's "Amax gain") is the largest absolute row sum
(forward: how much a stream can be amplified) and column sum (backward: the same for gradients).
A plain residual has ``H_res = 1``: gain 1 at every depth.

1. Drift.  A stack of ``--layers`` TransformerBlocks (random sublayers, ``--dim``, ``--streams``) with
   HC and with mHC.  Each block's static mixing parameters are moved by ``sigma * N(0, 1)`` (HC: the
   static ``pre``, ``post``, ``res`` maps; mHC: the static logits ``bias``), as training moves them,
   for each ``sigma`` in ``--drift``.  A batch of tokens runs through the stack; the gain of ``P_l``
   is measured at the tokens' own ``H_res`` at every depth (mean over tokens, as the paper reports
   it, and the maximum), with the RMS of the streams.
2. Training.  Small decoders of ``--train-layers`` blocks with each residual kind train on a copy
   task (AdamW, ``--train-lr``); the gain of the trained models' composite mixing is measured the
   same way, with the loss.

Prints a table and writes ``report.json`` and ``gain.png`` under ``--out``.
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

from experiments.cli import float_list
from jaxattn.nn.block import TransformerBlock
from jaxattn.nn.mhc import StreamCollapse
from jaxattn.ops.hyper import composite_mixing, expand_streams, hc_read, hc_write, mixing_gain
from jaxattn.ops.norms import rms_norm
from jaxattn.train.step import global_norm

try:
  from tqdm import tqdm
except ImportError:  # pragma: no cover
  def tqdm(x, **_):
    return x

KINDS = ("plain", "hc", "mhc")


def make_stack(kind: str, layers: int, dim: int, streams: int, seed: int) -> nnx.Module:
  """``layers`` TransformerBlocks with a leading layer axis on every variable (one graph)."""
  n = 1 if kind == "plain" else streams

  @nnx.split_rngs(splits=layers)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def create(rngs):
    return TransformerBlock(dim, num_heads=max(dim // 16, 1), mlp_dim=2 * dim, residual=kind,
                            num_streams=n, rngs=rngs)

  stack = create(nnx.Rngs(seed))
  if kind == "hc":
    # The HC paper's static read stream differs per layer: e_(l mod n).
    pre = jax.nn.one_hot(jnp.arange(layers) % n, n)
    stack.attn_hc.static_pre[...] = pre
    stack.mlp_hc.static_pre[...] = pre
  return stack


def drift_stack(stack, kind: str, sigma: float, seed: int):
  """Moves the static mixing parameters by ``sigma * N(0, 1)`` (in place)."""
  if kind == "plain" or sigma == 0:
    return
  rng = np.random.default_rng(seed)
  names = ("static_pre", "static_post", "static_res") if kind == "hc" else ("bias",)
  for site in (stack.attn_hc, stack.mlp_hc):
    for name in names:
      v = getattr(site, name)
      v[...] = v[...] + jnp.asarray(sigma * rng.standard_normal(v[...].shape), v[...].dtype)


def stack_forward(stack, x):
  """Runs the stacked blocks with ``lax.scan``; returns the output and per-site ``H_res`` and RMS.

  Equal to applying the blocks one after the other (the block's own forward, unrolled here to
  keep its ``H_res``).  ``x [B, T, n, D]`` (plain: ``n = 1``).
  """
  graphdef, state = nnx.split(stack)

  def body(x, layer_state):
    blk = nnx.merge(graphdef, layer_state)
    if blk.residual == "plain":
      h = x + blk.attn(blk.attn_norm(x[:, :, 0]))[:, :, None]
      y = h + blk.mlp(blk.mlp_norm(h[:, :, 0]))[:, :, None]
      one = jnp.ones((*x.shape[:2], 1, 1))
      return y, (one, one, jnp.sqrt(jnp.mean(jnp.square(y))))
    pre, post, res_a = blk.attn_hc.coefficients(x)
    h = hc_write(x, blk.attn(blk.attn_norm(hc_read(x, pre))), post, res_a)
    pre, post, res_m = blk.mlp_hc.coefficients(h)
    y = hc_write(h, blk.mlp(blk.mlp_norm(hc_read(h, pre))), post, res_m)
    return y, (res_a, res_m, jnp.sqrt(jnp.mean(jnp.square(y))))

  y, (res_a, res_m, rms) = jax.lax.scan(body, x, state)
  # Sites in order: attn_1, mlp_1, attn_2, ... -> [2L, B, T, n, n].
  res = jnp.stack([res_a, res_m], axis=1).reshape(-1, *res_a.shape[1:])
  return y, res, rms


@jax.jit
def depth_gains(res):
  """Forward / backward gain of the composite mixing at each site: token mean (the paper's
  statistic) and token max, ``4 x [2L]``."""
  fwd, bwd = mixing_gain(composite_mixing(res))       # [2L, B, T]
  fwd, bwd = fwd.reshape(fwd.shape[0], -1), bwd.reshape(bwd.shape[0], -1)
  return fwd.mean(-1), bwd.mean(-1), fwd.max(-1), bwd.max(-1)


def _gains(res):
  f, b, fmax, bmax = (np.asarray(g).tolist() for g in depth_gains(res))
  return dict(forward_gain=f, backward_gain=b, forward_gain_max=fmax, backward_gain_max=bmax)


def drift_experiment(args):
  x0 = jnp.asarray(np.random.default_rng(0).standard_normal((args.batch, args.seq, args.dim)),
                   jnp.float32)
  out = {}
  fwd_fn = nnx.jit(stack_forward)
  for kind in KINDS:
    sigmas = [0.0] if kind == "plain" else args.drift
    for sigma in tqdm(sigmas, desc=f"drift {kind:>5}", leave=False, disable=None):
      stack = make_stack(kind, args.layers, args.dim, args.streams, args.seed)
      drift_stack(stack, kind, sigma, args.seed + 1)
      x = expand_streams(x0, 1 if kind == "plain" else args.streams)
      _, res, rms = fwd_fn(stack, x)
      out[f"{kind}@{sigma:g}"] = dict(kind=kind, sigma=sigma, stream_rms=np.asarray(rms).tolist(),
                                      **_gains(res))
  return out


class StreamLM(nnx.Module):
  """A decoder whose blocks carry ``n`` residual streams (``n = 1`` for the plain residual)."""

  def __init__(self, kind, vocab, dim, layers, streams, *, rngs):
    self.n = 1 if kind == "plain" else streams
    self.embed = nnx.Embed(vocab, dim, rngs=rngs)
    self.blocks = nnx.List([
        TransformerBlock(dim, num_heads=max(dim // 16, 1), mlp_dim=2 * dim, residual=kind,
                         num_streams=self.n, layer_index=i, rngs=rngs) for i in range(layers)])
    self.collapse = StreamCollapse(dim, self.n, kind="mhc" if kind == "mhc" else "sum", rngs=rngs)
    self.head = nnx.Linear(dim, vocab, use_bias=False, rngs=rngs)

  def __call__(self, tokens):
    x = expand_streams(self.embed(tokens), self.n)
    for blk in self.blocks:
      x = blk(x) if blk.residual != "plain" else blk(x[:, :, 0])[:, :, None]
    return self.head(rms_norm(self.collapse(x)))

  def mixing(self, tokens):
    """Per-site ``H_res`` ``[2L, B, T, n, n]`` along the forward pass."""
    x = expand_streams(self.embed(tokens), self.n)
    res = []
    for blk in self.blocks:
      if blk.residual == "plain":
        x = blk(x[:, :, 0])[:, :, None]
        res += [jnp.ones((*x.shape[:2], 1, 1))] * 2
        continue
      pre, post, r = blk.attn_hc.coefficients(x)
      x = hc_write(x, blk.attn(blk.attn_norm(hc_read(x, pre))), post, r)
      res.append(r)
      pre, post, r = blk.mlp_hc.coefficients(x)
      x = hc_write(x, blk.mlp(blk.mlp_norm(hc_read(x, pre))), post, r)
      res.append(r)
    return jnp.stack(res)


def copy_batch(rng, batch, half, vocab):
  a = rng.integers(1, vocab, size=(batch, half))
  return jnp.asarray(np.concatenate([a, a], axis=1), jnp.int32)


def train_experiment(args):
  out = {}
  for kind in KINDS:
    model = StreamLM(kind, args.vocab, args.dim, args.train_layers, args.streams,
                     rngs=nnx.Rngs(args.seed))
    opt = nnx.Optimizer(model, optax.adamw(args.train_lr, weight_decay=0.01), wrt=nnx.Param)
    half = args.seq // 2

    @nnx.jit
    def step(model, opt, tokens):
      def loss_fn(m):
        ce = optax.softmax_cross_entropy_with_integer_labels(m(tokens[:, :-1]), tokens[:, 1:])
        return ce[:, half - 1:].mean()
      loss, grads = nnx.value_and_grad(loss_fn)(model)
      gnorm = global_norm(grads)
      opt.update(model, grads)
      return loss, gnorm

    rng = np.random.default_rng(args.seed)
    losses, gnorms = [], []
    for _ in tqdm(range(args.train_steps), desc=f"train {kind:>5}", leave=False, disable=None):
      loss, g = step(model, opt, copy_batch(rng, args.batch, half, args.vocab))
      losses.append(float(loss))
      gnorms.append(float(g))
    res = nnx.jit(lambda m, t: m.mixing(t))(model, copy_batch(rng, args.batch, half, args.vocab))
    out[kind] = dict(loss=losses, grad_norm=gnorms, **_gains(res))
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--layers", type=int, default=64)
  ap.add_argument("--dim", type=int, default=64)
  ap.add_argument("--streams", type=int, default=4)
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--seq", type=int, default=32)
  ap.add_argument("--drift", type=float_list(minimum=0), default="0,0.1,0.2,0.4",
                  help="standard deviations of the static maps' drift, each >= 0")
  ap.add_argument("--train-layers", type=int, default=12)
  ap.add_argument("--train-steps", type=int, default=300)
  ap.add_argument("--train-lr", type=float, default=3e-3)
  ap.add_argument("--vocab", type=int, default=32)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--out", default="runs/mhc_stability")
  args = ap.parse_args(argv)
  if args.layers < 1:
    ap.error(f"argument --layers: must be an int >= 1, got {args.layers}")
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}; dim {args.dim}, {args.streams} "
        f"streams, batch {args.batch}x{args.seq}")

  t0 = time.time()
  drift = drift_experiment(args)
  depth = 2 * args.layers
  print(f"\n== 1. composite mixing over {args.layers} blocks ({depth} residual sites), static maps "
        f"drifted by sigma [{time.time() - t0:.0f} s]")
  print("  gain = token mean (the paper's statistic); max = the largest over tokens")
  # Sites L/4 and L/2 of the L = depth sites, rounded down but at least the first (L = 2 at
  # --layers 1): the header names the sites shown.
  quarter, half = max(depth // 4, 1), max(depth // 2, 1)
  print(f"  @n: after n of the L = {depth} residual sites (L/4, L/2, L)")
  print(f"  {'kind@sigma':12s} {f'fwd gain @{quarter}':>13s} {f'@{half}':>10s} {f'@{depth}':>10s} "
        f"{f'bwd gain @{depth}':>12s} {f'max fwd/bwd @{depth}':>16s} "
        f"{f'stream RMS @{depth}':>15s}")
  for name, r in drift.items():
    f, b = r["forward_gain"], r["backward_gain"]
    mx = f"{r['forward_gain_max'][-1]:.4g}/{r['backward_gain_max'][-1]:.4g}"
    print(f"  {name:12s} {f[quarter - 1]:13.4g} {f[half - 1]:10.4g} {f[-1]:10.4g} "
          f"{b[-1]:12.4g} {mx:>16s} {r['stream_rms'][-1]:15.4g}")

  t1 = time.time()
  trained = train_experiment(args) if args.train_steps > 0 else {}
  if trained:
    print(f"\n== 2. trained {args.train_layers}-block decoders, {args.train_steps} AdamW steps at lr "
          f"{args.train_lr} on a copy task [{time.time() - t1:.0f} s]")
    print(f"  {'kind':6s} {'loss first':>10s} {'loss last':>10s} {'max grad norm':>13s} "
          f"{'fwd gain @L':>11s} {'bwd gain @L':>11s} {'max over depth, tokens':>22s}")
    for kind, r in trained.items():
      mx = f"{max(r['forward_gain_max']):.4g}/{max(r['backward_gain_max']):.4g}"
      print(f"  {kind:6s} {r['loss'][0]:10.3f} {np.mean(r['loss'][-10:]):10.3f} "
            f"{max(r['grad_norm']):13.3g} {r['forward_gain'][-1]:11.4g} "
            f"{r['backward_gain'][-1]:11.4g} {mx:>22s}")

  (out / "report.json").write_text(json.dumps(dict(args=vars(args), drift=drift, trained=trained),
                                              indent=1))
  try:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
  except ImportError:
    print(f"\nwrote {out / 'report.json'} (install matplotlib for the plot)")
    return
  panels = 3 if trained else 2
  fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4))
  colors = {"plain": "black", "hc": "tab:red", "mhc": "tab:blue"}
  for ax, key, title in ((axes[0], "forward_gain", "forward gain (max row sum)"),
                         (axes[1], "backward_gain", "backward gain (max column sum)")):
    for name, r in drift.items():
      alpha = 0.35 + 0.65 * (r["sigma"] / max(max(args.drift), 1e-9))
      ax.plot(np.arange(1, depth + 1), r[key], color=colors[r["kind"]], alpha=alpha,
              ls="-" if r["kind"] != "mhc" else "--", label=name)
    ax.set(xlabel="residual site (2 per block)", ylabel="gain of composite mixing", yscale="log",
           title=title)
    ax.legend(fontsize=7)
  if trained:
    ax = axes[2]
    for kind, r in trained.items():
      ax.plot(np.arange(1, len(r["forward_gain"]) + 1), r["forward_gain"], color=colors[kind],
              label=f"{kind} fwd (loss {np.mean(r['loss'][-10:]):.3f})")
      ax.plot(np.arange(1, len(r["backward_gain"]) + 1), r["backward_gain"], color=colors[kind],
              ls=":", label=f"{kind} bwd")
    ax.set(xlabel="residual site", ylabel="gain", yscale="log", title="after training")
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(out / "gain.png", dpi=120)
  print(f"\nwrote {out / 'report.json'} and {out / 'gain.png'}")


if __name__ == "__main__":
  main()
