"""Routed-expert dispatch: dropless grouped dispatch vs running every expert densely.

    python -m experiments.bench_moe [--tokens 4096] [--experts 64] [--top-k 6] [--embed 512]
                                    [--expert-dim 256] [--reps 3] [--backward] [--mxfp4]
                                    [--out runs/bench_moe]

Times each path of ``jaxattn.ops.moe`` on the same routing (a random router over random tokens)
and reads its scratch memory from ``jax.jit(f).lower(...).compile().memory_analysis()``:

  dense       ``dense_experts``: every expert on every token, then masked (the baseline, E/k x work)
  blocked     dropless: sort by expert, groups padded to blocks, a loop over the used blocks
  ragged_dot  dropless: sort by expert, ``jax.lax.ragged_dot`` (on CPU XLA expands it into a
              masked matmul over all groups, so it is slow there; it is the TPU path)
  capacity    GShard buffer ``[E, C, D]`` with ``--capacity-factor`` (drops overflow)
  pallas_tpu  dropless through the grouped-matmul Pallas TPU kernels (interpreted off a TPU, so
              only on a TPU by default)
  pallas_gpu  the same with the Pallas Triton kernels (by default only on a GPU)

``--lora-rank R`` gives every expert matrix a per-expert LoRA update of rank R (``LoRAWeight``:
the dispatch computes ``x W + s (x A) B``), and the path ``blocked_merged`` is the blocked loop over
the matrices with the update merged in first (``W + s A B`` materialized for every expert, what
applying an adapter to its kernel costs); ``--backward`` then trains the factors only.

``--mxfp4`` quantizes the expert matrices to MXFP4 (gpt-oss's format; ``MXFP4Array``): the kernels
read them packed, every other path dequantizes them whole inside the timed call; the weights are
frozen, so ``--backward`` differentiates the tokens and routing weights only.

Prints a table with time and memory ratios against ``dense`` measured in this run, and writes
``results.json`` and ``bench.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.cli import choice_list
from jaxattn.ops import moe
from jaxattn.ops.mxfp4 import MXFP4Array

try:
  from tqdm import tqdm
except ImportError:  # pragma: no cover
  def tqdm(it, **_):
    return it

PATHS = ("dense", "blocked", "ragged_dot", "capacity", "pallas_tpu", "pallas_gpu",
         "blocked_merged")


def _inputs(args):
  ks = jax.random.split(jax.random.key(args.seed), 6)
  dt = jnp.dtype(args.dtype)
  m, d, f, e = args.tokens, args.embed, args.expert_dim, args.experts
  x = jax.random.normal(ks[0], (m, d), dt)
  router = jax.random.normal(ks[1], (d, e)) * d ** -0.5
  r = moe.route(x.astype(jnp.float32) @ router, top_k=args.top_k)
  wg = (jax.random.normal(ks[2], (e, d, f)) * d ** -0.5).astype(dt)
  wu = (jax.random.normal(ks[3], (e, d, f)) * d ** -0.5).astype(dt)
  wd = (jax.random.normal(ks[4], (e, f, d)) * f ** -0.5).astype(dt)
  if args.mxfp4:
    wg, wu, wd = (MXFP4Array.quantize(w) for w in (wg, wu, wd))
  # LoRA factors (A small, B nonzero so the update counts), the last argument
  r_ = args.lora_rank
  factors = tuple((jax.random.normal(jax.random.fold_in(ks[5], i), (e, k, r_)) * k ** -0.5,
                   jax.random.normal(jax.random.fold_in(ks[5], 10 + i), (e, r_, n)) * 0.01)
                  for i, (k, n) in enumerate(((d, f), (d, f), (f, d))))
  return (x, r.indices, r.weights, wg, wu, wd, factors), r


def _path(name, args):
  """``fn(x, idx, w, wg, wu, wd, factors)``: with ``--lora-rank`` the weights carry their LoRA
  factors (``LoRAWeight``, computed factored), or merged into them first (``blocked_merged``:
  the update materialized, what an adapter applied to its kernel costs)."""
  if name == "dense":
    run = moe.dense_experts
  elif name == "capacity":
    run = lambda *a: moe.routed_experts(*a, capacity_factor=args.capacity_factor)[0]  # noqa: E731
  else:
    impl = "blocked" if name == "blocked_merged" else name
    run = lambda *a: moe.routed_experts(*a, implementation=impl,  # noqa: E731
                                        block_size=args.block_size)[0]

  def fn(x, idx, w, wg, wu, wd, factors):
    ws = (wg, wu, wd)
    if args.lora_rank:
      ws = [moe.LoRAWeight(base, a, b, 2.0) for base, (a, b) in zip(ws, factors)]
      if name == "blocked_merged":
        ws = [lw.dense(x.dtype) for lw in ws]
    return run(x, idx, w, *ws)
  return fn


def _with_backward(fn, args):
  """The gradients of the tokens, the routing weights and what trains: the expert matrices, or
  only the LoRA factors (``--lora-rank``), or nothing of the experts (``--mxfp4``: frozen)."""
  def loss(*a):
    return jnp.sum(fn(*a).astype(jnp.float32) ** 2)
  trained = (6,) if args.lora_rank else () if args.mxfp4 else (3, 4, 5)
  return jax.grad(loss, argnums=(0, 2) + trained)


def measure(name, args, inputs):
  fn = _path(name, args)
  if args.backward:
    fn = _with_backward(fn, args)
  jf = jax.jit(fn)
  compiled = jf.lower(*inputs).compile()
  mem = compiled.memory_analysis()
  scratch = int(getattr(mem, "temp_size_in_bytes", 0)) if mem is not None else 0
  out = jax.block_until_ready(compiled(*inputs))  # warm-up
  times = []
  for _ in tqdm(range(args.reps), desc=name, leave=False):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*inputs))
    times.append(time.perf_counter() - t0)
  return dict(name=name, seconds=float(np.median(times)), scratch_bytes=scratch), out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--tokens", type=int, default=4096)
  p.add_argument("--experts", type=int, default=64)
  p.add_argument("--top-k", type=int, default=6)
  p.add_argument("--embed", type=int, default=512)
  p.add_argument("--expert-dim", type=int, default=256)
  p.add_argument("--dtype", default="float32")
  p.add_argument("--capacity-factor", type=float, default=1.25)
  p.add_argument("--block-size", type=int, default=None)
  p.add_argument("--paths", type=choice_list(PATHS, allow_empty=True), default=None,
                 help=f"comma list of {','.join(PATHS)} (default, or empty: all but ragged_dot "
                      "on CPU, where it is ~6x slower than dense and takes minutes at 4k tokens, "
                      "and the Pallas paths off their device, where they are interpreted)")
  p.add_argument("--backward", action="store_true", help="time forward + gradients")
  p.add_argument("--mxfp4", action="store_true", help="expert matrices in MXFP4 (frozen)")
  p.add_argument("--lora-rank", type=int, default=0,
                 help="per-expert LoRA of this rank on every expert matrix (0: none); "
                      "--backward then trains the factors only")
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default="runs/bench_moe")
  args = p.parse_args(argv)

  inputs, r = _inputs(args)
  load = moe.expert_load(r.indices, args.experts)
  print(f"backend={jax.default_backend()} tokens={args.tokens} experts={args.experts} "
        f"top_k={args.top_k} D={args.embed} F={args.expert_dim} dtype={args.dtype} "
        f"{'fwd+bwd' if args.backward else 'fwd'}{' MXFP4 experts' if args.mxfp4 else ''}"
        f"{f' LoRA rank {args.lora_rank}' if args.lora_rank else ''}; "
        f"load max/mean={float(moe.load_imbalance(load)):.2f}")
  backend = jax.default_backend()
  own = {"pallas_tpu": backend == "tpu", "pallas_gpu": backend in ("gpu", "cuda"),
         "blocked_merged": args.lora_rank > 0}
  default = [s for s in PATHS if (s != "ragged_dot" or backend != "cpu") and own.get(s, True)]
  paths = list(args.paths or default)
  if "dense" not in paths:
    paths.insert(0, "dense")
  rows, outs = [], {}
  for name in paths:
    row, outs[name] = measure(name, args, inputs)
    rows.append(row)
  base = next(row for row in rows if row["name"] == "dense")
  for row in rows:
    row["speedup_vs_dense"] = base["seconds"] / row["seconds"]
    row["memory_ratio_vs_dense"] = row["scratch_bytes"] / max(base["scratch_bytes"], 1)
    a = jax.tree.leaves(outs[row["name"]])[0]
    b = jax.tree.leaves(outs["dense"])[0]
    row["max_abs_diff_vs_dense"] = float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max())

  print(f"\n{'path':<12}{'time (ms)':>12}{'speedup':>10}{'scratch (MB)':>15}{'mem ratio':>11}"
        f"{'max|diff|':>12}")
  for row in rows:
    print(f"{row['name']:<12}{row['seconds'] * 1e3:>12.1f}{row['speedup_vs_dense']:>9.2f}x"
          f"{row['scratch_bytes'] / 2**20:>15.1f}{row['memory_ratio_vs_dense']:>10.2f}x"
          f"{row['max_abs_diff_vs_dense']:>12.2e}")
  if "capacity" in paths:
    _, dropped = moe.routed_experts(*inputs[:6], capacity_factor=args.capacity_factor)
    print(f"capacity mode (factor {args.capacity_factor}) dropped {int(dropped)} of "
          f"{args.tokens * args.top_k} assignments (its diff vs dense reflects those drops).")

  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "results.json").write_text(json.dumps(dict(config=vars(args), rows=rows), indent=2))
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    names = [r["name"] for r in rows]
    axes[0].bar(names, [r["seconds"] * 1e3 for r in rows])
    axes[0].set_ylabel("time (ms)")
    axes[1].bar(names, [r["scratch_bytes"] / 2**20 for r in rows])
    axes[1].set_ylabel("scratch memory (MB)")
    fig.suptitle(f"{args.experts} experts, top-{args.top_k}, {args.tokens} tokens "
                 f"({'fwd+bwd' if args.backward else 'fwd'}, {jax.default_backend()})")
    fig.tight_layout()
    fig.savefig(out / "bench.png", dpi=120)
  except ImportError:  # pragma: no cover
    pass
  print(f"wrote {out / 'results.json'}")
  return rows


if __name__ == "__main__":
  main()
