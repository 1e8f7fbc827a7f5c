"""INT8 quantization error and indexer top-K recall, with and without the Hadamard rotation.

    python -m experiments.hadamard_quant [--dim 128] [--keys 4096] [--queries 64] [--heads 4]
                                         [--topk 256] [--seed 0] [--out runs/hadamard_quant]

Seed 3.7: 8-bit indexer vectors lose small entries when a few entries are large, and a Hadamard
rotation first spreads the energy so the per-token scale fits every entry.  Three inputs:

1. the seed's vector ``[1000, 0.01, 0.001, 500]`` (INT8 per token, round trip per entry);
2. random heavy-tailed vectors (Student-t, 2 degrees of freedom), ``--dim`` wide;
3. indexer keys with outlier channels (a few coordinates ``x outlier`` larger, as LLM activations
   have), for a sweep of outlier sizes: relative quantization error and the top-K recall of the
   INT8 indexer scores ``sum_j w_j ReLU(q_j . k)`` against the fp32 scores.

Per-token symmetric INT8 (``jaxattn.ops.quantization``) with and without ``hadamard_transform``;
the rotated error is measured after rotating back (the rotation is orthonormal).  Prints tables and
writes ``results.json`` and ``hadamard_quant.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from experiments.cli import float_list
from jaxattn.ops.hadamard import hadamard_transform
from jaxattn.ops.quantization import dequantize, quantize_int8
from jaxattn.ops.sparse import indexer_scores, topk_indices


def int8_round_trip(x, rotate):
  """``x`` after per-token INT8 quantization, in the original basis (fp32)."""
  y = hadamard_transform(x) if rotate else x
  y = dequantize(*quantize_int8(y))
  return hadamard_transform(y) if rotate else y


def rel_error(x, xq):
  return float(jnp.linalg.norm(xq - x) / jnp.linalg.norm(x))


def recall(q, k, w, topk, rotate):
  """Mean fraction of the fp32 top-K that the INT8 scores also select (queries at the end)."""
  exact = indexer_scores(q, k, w, causal=False)
  quant = indexer_scores(int8_round_trip(q, rotate), int8_round_trip(k, rotate), w, causal=False)
  a, b = np.asarray(topk_indices(exact, topk)), np.asarray(topk_indices(quant, topk))
  hits = [len(set(a[0, t]) & set(b[0, t])) / topk for t in range(a.shape[1])]
  return float(np.mean(hits))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--dim", type=int, default=128)
  ap.add_argument("--keys", type=int, default=4096)
  ap.add_argument("--queries", type=int, default=64)
  ap.add_argument("--heads", type=int, default=4)
  ap.add_argument("--topk", type=int, default=256)
  ap.add_argument("--outliers", type=float_list(minimum=0, min_exclusive=True),
                  default="1,10,30,100,300,1000",
                  help="gains of the outlier channels in queries and keys (1: none), each > 0")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--out", type=str, default="runs/hadamard_quant")
  args = ap.parse_args(argv)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  results = {}

  seed_vec = jnp.array([[1000.0, 0.01, 0.001, 500.0]])
  print("1) the seed's vector [1000, 0.01, 0.001, 500], per-token INT8 round trip")
  for rotate in (False, True):
    got = np.asarray(int8_round_trip(seed_vec, rotate))[0]
    print(f"   {'hadamard' if rotate else 'plain   '}: {np.array2string(got, precision=4)}  "
          f"rel. error {rel_error(seed_vec, got):.2e}")
    results[f"seed_{'hadamard' if rotate else 'plain'}"] = got.tolist()

  key = jax.random.key(args.seed)
  k1, k2, k3, k4, k5 = jax.random.split(key, 5)
  heavy = jax.random.t(k1, 2.0, (args.keys, args.dim))
  print(f"\n2) Student-t(2) vectors [{args.keys}, {args.dim}]: relative INT8 error")
  for rotate in (False, True):
    e = rel_error(heavy, int8_round_trip(heavy, rotate))
    results[f"heavy_tailed_error_{'hadamard' if rotate else 'plain'}"] = e
    print(f"   {'hadamard' if rotate else 'plain   '}: {e:.3e}")

  print(f"\n3) indexer with outlier channels: {args.queries} queries x {args.keys} keys, "
        f"{args.heads} heads, d={args.dim}, top-{args.topk}")
  print(f"   {'outlier x':>9} | {'err plain':>9} {'err hadam':>9} | {'recall plain':>12} "
        f"{'recall hadam':>12}")
  sweep = []
  chan = jax.random.choice(k2, args.dim, (4,), replace=False)
  q = jax.random.normal(k3, (1, args.queries, args.heads, args.dim))
  k = jax.random.normal(k4, (1, args.keys, args.dim))
  w = jax.random.uniform(k5, (1, args.queries, args.heads))
  for factor in args.outliers:
    gain = jnp.ones((args.dim,)).at[chan].set(factor)
    qs, ks = q * gain, k * gain  # the same channels are large in queries and keys
    row = dict(outlier=factor,
               err_plain=rel_error(ks, int8_round_trip(ks, False)),
               err_hadamard=rel_error(ks, int8_round_trip(ks, True)),
               recall_plain=recall(qs, ks, w, args.topk, False),
               recall_hadamard=recall(qs, ks, w, args.topk, True))
    sweep.append(row)
    print(f"   {factor:9.0f} | {row['err_plain']:9.2e} {row['err_hadamard']:9.2e} | "
          f"{row['recall_plain']:12.3f} {row['recall_hadamard']:12.3f}")
  results["outlier_sweep"] = sweep
  (out / "results.json").write_text(json.dumps(results, indent=2))

  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  xs = [r["outlier"] for r in sweep]
  fig, ax = plt.subplots(1, 2, figsize=(10, 4))
  ax[0].loglog(xs, [r["err_plain"] for r in sweep], "o-", label="INT8")
  ax[0].loglog(xs, [r["err_hadamard"] for r in sweep], "s-", label="Hadamard + INT8")
  ax[0].set(xlabel="outlier channel gain", ylabel="relative error of keys",
            title="per-token INT8 quantization error")
  ax[1].semilogx(xs, [r["recall_plain"] for r in sweep], "o-", label="INT8")
  ax[1].semilogx(xs, [r["recall_hadamard"] for r in sweep], "s-", label="Hadamard + INT8")
  ax[1].set(xlabel="outlier channel gain", ylabel=f"top-{args.topk} recall vs fp32",
            title="indexer top-K recall", ylim=(0, 1.02))
  for a in ax:
    a.legend()
    a.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(out / "hadamard_quant.png", dpi=120)
  print(f"\nwrote {out / 'results.json'} and {out / 'hadamard_quant.png'}")


if __name__ == "__main__":
  main()
