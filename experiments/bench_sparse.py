"""Dense causal vs sliding-window vs DeepSeek Sparse Attention on CPU: prefill and decode.

    python -m experiments.bench_sparse [--lengths 4096,8192,16384,32768] [--heads 8] [--head-dim 64]
                                       [--window 256] [--topk 256] [--index-heads 4]
                                       [--index-dim 32] [--chunk 1024] [--iters 2]
                                       [--out runs/bench_sparse]

One attention layer's core (projections excluded), batch 1, fp32, ``--heads`` query heads over one
shared key/value head of ``--head-dim`` (MQA, like DSA's shared MLA latent):

* ``dense``: causal ``dot_product_attention(implementation="xla_chunked")`` (skips key blocks
  above the diagonal) -- the baseline every ratio is against.
* ``swa``: the same call with ``local_window_size=--window``: only the band's blocks run.
* ``dsa``: lightning indexer (``--index-heads`` x ``--index-dim``, fp32 scores) -> top-``--topk``
  -> ``sparse_attention`` (gather reference), query chunks of ``--chunk`` rows under ``lax.map``
  so scratch stays bounded.  ``dsa_main`` times only the sparse attention given the indices
  (the main-attention cost that should grow linearly in T); ``dsa`` includes the indexer.

Decode: one new token against a cache of ``T`` entries (dense: all of them; swa: the last
``--window`` as a rolling cache keeps; dsa: indexer over ``T`` keys + top-K + gather).
Reports median times, XLA scratch (``memory_analysis().temp_size_in_bytes``), ratios against
``dense`` from the same run and the log-log slope of time vs T.  Writes ``results.json`` and
``bench_sparse.png`` under ``--out``.  A shared, loaded CPU makes absolute numbers noisy.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from jaxattn.ops.attention import dot_product_attention
from jaxattn.ops.sparse import indexer_scores, sparse_attention, topk_indices


def dsa_prefill(q, k, v, qi, ki, w, *, topk, chunk, with_indexer=True, indices=None):
  """Chunked DSA prefill: per chunk of query rows, indexer scores -> top-K -> sparse attention.

  ``lax.map`` over chunks keeps one chunk's ``[chunk, S]`` scores and gathered rows live at a time.
  Every chunk scores all ``S`` keys (the causal mask zeroes the later ones): static shapes, at the
  price of twice the causal indexer work.  (Unrolled chunks over causal key prefixes were tried:
  XLA kept every chunk's intermediates alive, 9 GB of scratch at T = 32k, and ran slower.)
  """
  b, t, n, h = q.shape
  nc = t // chunk

  def one(c):
    start = c * chunk
    qc = jax.lax.dynamic_slice_in_dim(q, start, chunk, axis=1)
    if with_indexer:
      sc = indexer_scores(jax.lax.dynamic_slice_in_dim(qi, start, chunk, axis=1), ki,
                          jax.lax.dynamic_slice_in_dim(w, start, chunk, axis=1), q_offset=start)
      idx = topk_indices(sc, topk)
    else:
      idx = jax.lax.dynamic_slice_in_dim(indices, start, chunk, axis=1)
    return sparse_attention(qc, k, v, idx)

  out = jax.lax.map(one, jnp.arange(nc))                 # [nc, B, chunk, N, h]
  return jnp.moveaxis(out, 0, 1).reshape(b, t, n, v.shape[-1])


def timed(fn, args, iters):
  compiled = jax.jit(fn).lower(*args).compile()
  mem = compiled.memory_analysis()
  scratch = int(getattr(mem, "temp_size_in_bytes", 0)) if mem is not None else 0
  jax.block_until_ready(compiled(*args))                 # warm-up
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times), scratch


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--lengths", type=str, default="4096,8192,16384,32768")
  ap.add_argument("--heads", type=int, default=8)
  ap.add_argument("--head-dim", type=int, default=64)
  ap.add_argument("--window", type=int, default=256)
  ap.add_argument("--topk", type=int, default=256)
  ap.add_argument("--index-heads", type=int, default=4)
  ap.add_argument("--index-dim", type=int, default=32)
  ap.add_argument("--chunk", type=int, default=1024)
  ap.add_argument("--iters", type=int, default=2)
  ap.add_argument("--skip-dense-above", type=int, default=1 << 30,
                  help="skip the dense prefill for T above this (it is the slowest)")
  ap.add_argument("--out", type=str, default="runs/bench_sparse")
  args = ap.parse_args(argv)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  lengths = [int(x) for x in args.lengths.split(",")]
  n, h, hi, di = args.heads, args.head_dim, args.index_heads, args.index_dim
  rows = []
  bar = tqdm(total=len(lengths) * 7, desc="bench_sparse")
  for t in lengths:
    chunk = min(args.chunk, t)
    ks = jax.random.split(jax.random.key(t), 6)
    q = jax.random.normal(ks[0], (1, t, n, h))
    k = jax.random.normal(ks[1], (1, t, 1, h))
    v = jax.random.normal(ks[2], (1, t, 1, h))
    qi = jax.random.normal(ks[3], (1, t, hi, di))
    ki = jax.random.normal(ks[4], (1, t, di))
    w = jax.random.uniform(ks[5], (1, t, hi))
    idx = jax.jit(lambda a, b_, c: topk_indices(indexer_scores(a, b_, c), args.topk))(
        qi[:, :chunk], ki[:, :chunk], w[:, :chunk])
    idx = jnp.concatenate([idx, jnp.tile(idx[:, -1:], (1, t - chunk, 1))], axis=1)  # cheap indices
    res = dict(T=t)
    if t <= args.skip_dense_above:
      res["dense"] = timed(lambda a, b_, c: dot_product_attention(
          a, b_, c, is_causal=True, implementation="xla_chunked"), (q, k, v), args.iters)
    bar.update()
    res["swa"] = timed(lambda a, b_, c: dot_product_attention(
        a, b_, c, is_causal=True, local_window_size=args.window, implementation="xla_chunked"),
        (q, k, v), args.iters)
    bar.update()
    res["dsa"] = timed(lambda a, b_, c, d, e, f: dsa_prefill(a, b_, c, d, e, f, topk=args.topk,
                                                             chunk=chunk),
                       (q, k, v, qi, ki, w), args.iters)
    bar.update()
    res["dsa_main"] = timed(lambda a, b_, c, i: dsa_prefill(a, b_, c, None, None, None,
                                                            topk=args.topk, chunk=chunk,
                                                            with_indexer=False, indices=i),
                            (q, k, v, idx), args.iters)
    bar.update()
    # Decode: the last token against T cached entries.
    q1, qi1, w1 = q[:, -1:], qi[:, -1:], w[:, -1:]
    res["decode_dense"] = timed(lambda a, b_, c: dot_product_attention(
        a, b_, c, is_causal=True, q_offset=t - 1, implementation="xla_chunked"),
        (q1, k, v), max(args.iters, 5))
    bar.update()
    kw_, vw_ = k[:, -args.window - 1:], v[:, -args.window - 1:]  # what a rolling cache holds
    res["decode_swa"] = timed(lambda a, b_, c: dot_product_attention(
        a, b_, c, is_causal=True, q_offset=b_.shape[1] - 1, implementation="xla_chunked"),
        (q1, kw_, vw_), max(args.iters, 5))
    bar.update()
    res["decode_dsa"] = timed(lambda a, b_, c, d, e, f: sparse_attention(
        a, b_, c, topk_indices(indexer_scores(d, e, f, q_offset=t - 1), args.topk)),
        (q1, k, v, qi1, ki, w1), max(args.iters, 5))
    bar.update()
    rows.append(res)
  bar.close()

  names = ["dense", "swa", "dsa", "dsa_main", "decode_dense", "decode_swa", "decode_dsa"]
  print(f"\nT, heads={n}x{h} (1 KV head), window={args.window}, top-k={args.topk}, "
        f"indexer {hi}x{di}; time s (scratch MiB) [ratio vs dense]")
  for r in rows:
    parts = []
    for nm in names:
      if nm not in r:
        continue
      tm, mem = r[nm]
      base = r.get("decode_dense" if nm.startswith("decode") else "dense")
      ratio = f" [{base[0] / tm:5.1f}x]" if base is not None and nm not in ("dense",
                                                                              "decode_dense") else ""
      parts.append(f"{nm} {tm:.4f}s ({mem / 2**20:.0f}){ratio}")
    print(f"T={r['T']:6d}: " + "; ".join(parts))
  slopes = {}
  if len(rows) > 1:
    ts = np.log([r["T"] for r in rows])
    for nm in names:
      if all(nm in r for r in rows):
        slopes[nm] = float(np.polyfit(ts, np.log([r[nm][0] for r in rows]), 1)[0])
    print("log-log slope of time vs T (1 = linear, 2 = quadratic): " +
          ", ".join(f"{k_} {v_:.2f}" for k_, v_ in slopes.items()))
  (out / "results.json").write_text(json.dumps(dict(args=vars(args), rows=rows, slopes=slopes),
                                               indent=2))
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(1, 2, figsize=(10, 4))
  for nm, a in (("dense", 0), ("swa", 0), ("dsa", 0), ("dsa_main", 0), ("decode_dense", 1),
                ("decode_swa", 1), ("decode_dsa", 1)):
    pts = [(r["T"], r[nm][0]) for r in rows if nm in r]
    if pts:
      ax[a].loglog(*zip(*pts), "o-", label=nm)
  ax[0].set(xlabel="T", ylabel="prefill time (s)", title="prefill (CPU)")
  ax[1].set(xlabel="T (cache length)", ylabel="decode step time (s)", title="decode (CPU)")
  for a in ax:
    a.legend()
    a.grid(alpha=0.3, which="both")
  fig.tight_layout()
  fig.savefig(out / "bench_sparse.png", dpi=120)
  print(f"wrote {out / 'results.json'} and {out / 'bench_sparse.png'}")


if __name__ == "__main__":
  main()
