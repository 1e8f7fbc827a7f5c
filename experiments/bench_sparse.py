"""Dense causal vs sliding-window vs DeepSeek Sparse Attention on CPU: prefill and decode.

    python -m experiments.bench_sparse [--lengths 4096,8192,16384,32768] [--heads 8] [--head-dim 64]
                                       [--window 256] [--topk 256] [--index-heads 4]
                                       [--index-dim 32] [--index-block 1024] [--query-block 256]
                                       [--order position] [--main-chunk 64] [--chunk 1024]
                                       [--iters 3] [--allpairs-max-len 32768]
                                       [--index-quant none] [--no-bf16]
                                       [--out runs/bench_sparse]

One attention layer's core (projections excluded), batch 1, fp32, ``--heads`` query heads over one
shared key/value head of ``--head-dim`` (MQA, like DSA's shared MLA latent):

Every variant uses the library's default implementation on this machine unless its name ends in
``_xla``: on a CPU where the native kernels build (``jaxattn.native``), dense and sliding-window
attention run the fused flash kernel (``implementation="cpu"``) and DSA the native indexer /
top-k and sparse-attention kernels (``jaxattn.ops.sparse_cpu``); the header line says which.

* ``dense``: causal ``dot_product_attention`` (skips key blocks above the diagonal) -- the
  baseline every prefill ratio is against.
* ``swa``: the same call with ``local_window_size=--window``: only the band's blocks run.
* ``dsa``: the lightning indexer + top-``--topk`` (``indexer_topk``, ``--order position``), then
  ``sparse_attention`` in chunks of ``--main-chunk`` query rows.  Indexer ``--index-heads`` x
  ``--index-dim``, fp32 scores (``--index-quant`` int8 / fp8: queries and keys rounded through
  that format, one scale per vector).  ``dsa_index`` times the selection alone, ``dsa_main`` the
  sparse attention alone given the selected indices (the main-attention cost that should grow
  linearly in T).
* ``dsa_xla``: the same on the pure-XLA paths (``implementation="xla"``): the streaming indexer
  (query chunks of ``--query-block`` rows score only the causal key blocks of ``--index-block``,
  candidates above a bisected threshold are compacted, the exact top-k among them is taken) and
  the gather reference of sparse attention.
* ``dsa_bf16`` / ``dsa_index_bf16``: the same with the reduced-precision indexer
  (``indexer_topk(dot_dtype="bfloat16")``: bf16 dot operands, fp32 accumulation and scores), and
  its recall of the fp32 selection (``--no-bf16`` skips them).
* ``dsa_allpairs``: the previous path for comparison -- per ``--chunk`` query rows, indexer scores
  against all ``S`` keys -> ``topk_indices`` -> sparse attention (``--allpairs-max-len`` caps T).

Decode: one new token against a cache of ``T`` entries (dense: all of them; swa: the last
``--window`` as a rolling cache keeps; dsa: streaming indexer over ``T`` keys + top-K + gather).
All variants of one ``T`` are compiled first and then timed round-robin (one call of each per
round, ``--iters`` rounds), so every ratio compares calls made under the same machine load.
Reports median wall times and median process CPU times (CPU seconds are less sensitive to other
jobs on a shared machine), the load average before and after, scratch (XLA's
``memory_analysis().temp_size_in_bytes`` plus what the native kernels allocate themselves:
``attention_cpu.workspace_bytes``, ``sparse_cpu.indexer_workspace_bytes`` /
``sparse_workspace_bytes`` with one task per core), ratios against ``dense`` and the log-log
slope of time vs T.  Writes ``results.json`` and ``bench_sparse.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from experiments.cli import int_list
from jaxattn import native
from jaxattn.ops.attention import dot_product_attention
from jaxattn.ops.attention_cpu import workspace_bytes
from jaxattn.ops.sparse_cpu import indexer_workspace_bytes, sparse_workspace_bytes
from jaxattn.ops.sparse import indexer_scores, indexer_topk, sparse_attention, topk_indices


def sparse_main(q, k, v, indices, *, chunk, implementation=None):
  """Sparse attention over given indices, ``chunk`` query rows at a time under ``lax.map``: the
  gathered ``[chunk, k, H]`` rows stay small enough for the cache."""
  b, t, n, _ = q.shape
  chunk = min(chunk, t)
  pad = -t % chunk
  qp = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
  ip = jnp.pad(indices, ((0, 0), (0, pad), (0, 0)), constant_values=-1)

  def one(c):
    qc = jax.lax.dynamic_slice_in_dim(qp, c * chunk, chunk, axis=1)
    return sparse_attention(qc, k, v, jax.lax.dynamic_slice_in_dim(ip, c * chunk, chunk, axis=1),
                            implementation=implementation)

  out = jax.lax.map(one, jnp.arange((t + pad) // chunk))        # [nc, B, chunk, N, h]
  return jnp.moveaxis(out, 0, 1).reshape(b, t + pad, n, v.shape[-1])[:, :t]


def dsa_prefill(q, k, v, qi, ki, w, *, topk, index_block, query_block, order, main_chunk,
                quant=None, dot_dtype=None, implementation=None):
  """Streaming DSA prefill: ``indexer_topk`` then chunked sparse attention."""
  idx = indexer_topk(qi, ki, w, topk, block_size=index_block, query_block=query_block,
                     order=order, quant=quant, dot_dtype=dot_dtype, implementation=implementation)
  return sparse_main(q, k, v, idx, chunk=main_chunk, implementation=implementation)


def dsa_prefill_allpairs(q, k, v, qi, ki, w, *, topk, chunk):
  """The all-pairs path: per chunk of query rows, indexer scores against all ``S`` keys (the
  causal mask sets the later ones to -inf) -> top-K -> sparse attention."""
  b, t, n, h = q.shape
  nc = t // chunk

  def one(c):
    start = c * chunk
    qc = jax.lax.dynamic_slice_in_dim(q, start, chunk, axis=1)
    sc = indexer_scores(jax.lax.dynamic_slice_in_dim(qi, start, chunk, axis=1), ki,
                        jax.lax.dynamic_slice_in_dim(w, start, chunk, axis=1), q_offset=start)
    return sparse_attention(qc, k, v, topk_indices(sc, topk))

  out = jax.lax.map(one, jnp.arange(nc))                 # [nc, B, chunk, N, h]
  return jnp.moveaxis(out, 0, 1).reshape(b, t, n, v.shape[-1])


def selection_recall(ref, got):
  """``(mean, min)`` over query rows of ``|got & ref| / |ref|`` (``-1`` padding ignored)."""
  per_row = []
  for r, g in zip(ref.reshape(-1, ref.shape[-1]), got.reshape(-1, got.shape[-1])):
    r = r[r >= 0]
    per_row.append(np.isin(r, g).mean() if r.size else 1.0)
  return float(np.mean(per_row)), float(np.min(per_row))


def compile_case(fn, args):
  """``(compiled fn, XLA scratch bytes)``; one warm-up call."""
  compiled = jax.jit(fn).lower(*args).compile()
  mem = compiled.memory_analysis()
  scratch = int(getattr(mem, "temp_size_in_bytes", 0)) if mem is not None else 0
  jax.block_until_ready(compiled(*args))
  return compiled, scratch


def time_round_robin(cases, iters, bar=None):
  """``{name: (median wall s, median process CPU s, scratch bytes)}`` for ``cases`` =
  ``{name: (compiled, args, scratch, repeats)}``: each round calls every case once (``repeats``
  times back to back for the very short decode calls), so all cases see the same load."""
  walls = {nm: [] for nm in cases}
  cpus = {nm: [] for nm in cases}
  for _ in range(iters):
    for nm, (compiled, args, _, reps) in cases.items():
      for _ in range(reps):
        c0, t0 = time.process_time(), time.perf_counter()
        jax.block_until_ready(compiled(*args))
        walls[nm].append(time.perf_counter() - t0)
        cpus[nm].append(time.process_time() - c0)
    if bar is not None:
      bar.update()
  return {nm: (statistics.median(walls[nm]), statistics.median(cpus[nm]), cases[nm][2])
          for nm in cases}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--lengths", type=int_list(minimum=1), default="4096,8192,16384,32768")
  ap.add_argument("--heads", type=int, default=8)
  ap.add_argument("--head-dim", type=int, default=64)
  ap.add_argument("--window", type=int, default=256)
  ap.add_argument("--topk", type=int, default=256)
  ap.add_argument("--index-heads", type=int, default=4)
  ap.add_argument("--index-dim", type=int, default=32)
  ap.add_argument("--index-block", type=int, default=1024, help="indexer key tile")
  ap.add_argument("--query-block", type=int, default=256, help="indexer query rows per chunk")
  ap.add_argument("--order", choices=("position", "score"), default="position",
                  help="order of the selected indices (position: no final sort)")
  ap.add_argument("--main-chunk", type=int, default=64, help="sparse-attention query rows per step")
  ap.add_argument("--chunk", type=int, default=1024, help="query chunk of the all-pairs path")
  ap.add_argument("--iters", type=int, default=3, help="timing rounds (medians)")
  ap.add_argument("--skip-dense-above", type=int, default=1 << 30,
                  help="skip the dense prefill for T above this (it is the slowest)")
  ap.add_argument("--allpairs-max-len", type=int, default=1 << 30,
                  help="time the all-pairs DSA path only up to this T")
  ap.add_argument("--index-quant", choices=("none", "int8", "fp8"), default="none",
                  help="8-bit indexer scoring (per-vector scales) for every DSA variant; with "
                       "the bf16 indexer its dots run on the 8-bit codes")
  ap.add_argument("--no-bf16", action="store_true",
                  help="skip the bf16-indexer variants (dsa_bf16, dsa_index_bf16)")
  ap.add_argument("--out", type=str, default="runs/bench_sparse")
  args = ap.parse_args(argv)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  lengths = args.lengths
  n, h, hi, di = args.heads, args.head_dim, args.index_heads, args.index_dim
  quant = None if args.index_quant == "none" else args.index_quant
  sel = dict(topk=args.topk, index_block=args.index_block, query_block=args.query_block,
             order=args.order, quant=quant)
  load_before = os.getloadavg()
  rows = []
  bar = tqdm(total=len(lengths) * (args.iters + 1), desc="bench_sparse")
  for t in lengths:
    ks = jax.random.split(jax.random.key(t), 6)
    q = jax.random.normal(ks[0], (1, t, n, h))
    k = jax.random.normal(ks[1], (1, t, 1, h))
    v = jax.random.normal(ks[2], (1, t, 1, h))
    qi = jax.random.normal(ks[3], (1, t, hi, di))
    ki = jax.random.normal(ks[4], (1, t, di))
    w = jax.random.uniform(ks[5], (1, t, hi))
    fns = {}
    if t <= args.skip_dense_above:
      fns["dense"] = (lambda a, b_, c: dot_product_attention(a, b_, c, is_causal=True),
                      (q, k, v), 1)
    fns["swa"] = (lambda a, b_, c: dot_product_attention(
        a, b_, c, is_causal=True, local_window_size=args.window), (q, k, v), 1)
    fns["dsa"] = (lambda a, b_, c, d, e, f: dsa_prefill(
        a, b_, c, d, e, f, main_chunk=args.main_chunk, **sel), (q, k, v, qi, ki, w), 1)
    fns["dsa_xla"] = (lambda a, b_, c, d, e, f: dsa_prefill(
        a, b_, c, d, e, f, main_chunk=args.main_chunk, implementation="xla", **sel),
        (q, k, v, qi, ki, w), 1)
    select = lambda d, e, f, dd=None: indexer_topk(
        d, e, f, args.topk, block_size=args.index_block, query_block=args.query_block,
        order=args.order, quant=quant, dot_dtype=dd)
    fns["dsa_index"] = (select, (qi, ki, w), 1)
    idx = jax.jit(select)(qi, ki, w)                     # the real selection, for dsa_main
    recall = None
    if not args.no_bf16:
      fns["dsa_bf16"] = (lambda a, b_, c, d, e, f: dsa_prefill(
          a, b_, c, d, e, f, main_chunk=args.main_chunk, dot_dtype="bfloat16", **sel),
          (q, k, v, qi, ki, w), 1)
      select_bf16 = lambda d, e, f: select(d, e, f, "bfloat16")
      fns["dsa_index_bf16"] = (select_bf16, (qi, ki, w), 1)
      recall = selection_recall(np.asarray(idx), np.asarray(jax.jit(select_bf16)(qi, ki, w)))
    fns["dsa_main"] = (lambda a, b_, c, i: sparse_main(a, b_, c, i, chunk=args.main_chunk),
                       (q, k, v, idx), 1)
    if t <= args.allpairs_max_len and t % min(args.chunk, t) == 0:
      fns["dsa_allpairs"] = (lambda a, b_, c, d, e, f: dsa_prefill_allpairs(
          a, b_, c, d, e, f, topk=args.topk, chunk=min(args.chunk, t)), (q, k, v, qi, ki, w), 1)
    # Decode: the last token against T cached entries.
    q1, qi1, w1 = q[:, -1:], qi[:, -1:], w[:, -1:]
    fns["decode_dense"] = (lambda a, b_, c: dot_product_attention(
        a, b_, c, is_causal=True, q_offset=t - 1), (q1, k, v), 5)
    kw_, vw_ = k[:, -args.window - 1:], v[:, -args.window - 1:]  # what a rolling cache holds
    fns["decode_swa"] = (lambda a, b_, c: dot_product_attention(
        a, b_, c, is_causal=True, q_offset=b_.shape[1] - 1), (q1, kw_, vw_), 5)
    fns["decode_dsa"] = (lambda a, b_, c, d, e, f: sparse_attention(
        a, b_, c, indexer_topk(d, e, f, args.topk, q_offset=t - 1, block_size=args.index_block,
                               order=args.order, quant=quant)), (q1, k, v, qi1, ki, w1), 5)
    # Memory the native kernels allocate themselves (not in XLA's memory analysis).
    extra = {}
    if native.available():
      threads = os.cpu_count() or 1
      dense_ws = workspace_bytes(q.shape, k.shape, v.shape)
      index_ws = indexer_workspace_bytes(1, t, hi, di, args.topk, threads)
      main_ws = sparse_workspace_bytes(args.topk, h, h, n, threads)
      extra = {"dense": dense_ws, "swa": dense_ws, "dsa": index_ws + main_ws,
               "dsa_index": index_ws, "dsa_bf16": index_ws + main_ws, "dsa_index_bf16": index_ws,
               "dsa_main": main_ws, "dsa_allpairs": main_ws,
               "decode_dense": workspace_bytes(q1.shape, k.shape, v.shape),
               "decode_swa": workspace_bytes(q1.shape, kw_.shape, vw_.shape),
               "decode_dsa": indexer_workspace_bytes(1, t, hi, di, args.topk, 1) + main_ws}
    cases = {}
    for nm, (fn, fargs, reps) in fns.items():
      compiled, scratch = compile_case(fn, fargs)
      cases[nm] = (compiled, fargs, scratch + extra.get(nm, 0), reps)
    bar.update()
    rows.append(dict(T=t, **time_round_robin(cases, args.iters, bar), recall_bf16=recall))
  bar.close()
  load_after = os.getloadavg()

  names = ["dense", "swa", "dsa", "dsa_xla", "dsa_index", "dsa_bf16", "dsa_index_bf16", "dsa_main",
           "dsa_allpairs", "decode_dense",
           "decode_swa", "decode_dsa"]
  print(f"\nT, heads={n}x{h} (1 KV head), window={args.window}, top-k={args.topk}, "
        f"indexer {hi}x{di} (key tile {args.index_block}, query block {args.query_block}), "
        f"main chunk {args.main_chunk}, order {args.order}, indexer quant {args.index_quant}")
  print("implementations: " + ("native CPU kernels (dense / swa: 'cpu'; dsa: indexer + sparse "
                               "attention 'cpu'); *_xla: pure XLA" if native.available() else
                               f"XLA only (native kernels unavailable: {native.reason()})"))
  print(f"load average (1/5/15 min) before {load_before[0]:.2f}/{load_before[1]:.2f}/"
        f"{load_before[2]:.2f}, after {load_after[0]:.2f}/{load_after[1]:.2f}/{load_after[2]:.2f} "
        f"on {os.cpu_count()} CPUs")
  print("wall s / CPU s (scratch MiB) [speed-up vs dense: wall / CPU]")
  for r in rows:
    parts = []
    for nm in names:
      if nm not in r:
        continue
      tm, cpu, mem = r[nm]
      base = r.get("decode_dense" if nm.startswith("decode") else "dense")
      ratio = (f" [{base[0] / tm:.1f}x / {base[1] / cpu:.1f}x]"
               if base is not None and nm not in ("dense", "decode_dense") else "")
      parts.append(f"{nm} {tm:.4f}/{cpu:.4f}s ({mem / 2**20:.0f}){ratio}")
    if r["recall_bf16"] is not None:
      parts.append(f"bf16-indexer recall of the fp32 selection: mean {r['recall_bf16'][0]:.4f}, "
                   f"min row {r['recall_bf16'][1]:.4f}")
    print(f"T={r['T']:6d}: " + "\n          ".join(parts))
  slopes = {}
  if len(rows) > 1:
    ts = np.log([r["T"] for r in rows])
    for nm in names:
      if all(nm in r for r in rows):
        slopes[nm] = float(np.polyfit(ts, np.log([r[nm][0] for r in rows]), 1)[0])
    print("log-log slope of wall time vs T (1 = linear, 2 = quadratic): " +
          ", ".join(f"{k_} {v_:.2f}" for k_, v_ in slopes.items()))
  last = rows[-1]
  if "dense" in last:
    wall, cpu = (last["dense"][i] / last["dsa"][i] for i in (0, 1))
    print(f"goal (DSA prefill incl. indexer >= 3x faster than dense at T={last['T']}): "
          f"fp32 indexer: wall {wall:.2f}x, CPU {cpu:.2f}x")
    if "dsa_bf16" in last:
      wall, cpu = (last["dense"][i] / last["dsa_bf16"][i] for i in (0, 1))
      print(f"  bf16 indexer (dot_dtype='bfloat16'): wall {wall:.2f}x, CPU {cpu:.2f}x")
    wall, cpu = (last["dense"][i] / last["dsa_xla"][i] for i in (0, 1))
    print(f"  pure-XLA DSA (dsa_xla) against the same dense baseline: wall {wall:.2f}x, "
          f"CPU {cpu:.2f}x")
  (out / "results.json").write_text(json.dumps(dict(args=vars(args), rows=rows, slopes=slopes,
                                                    load=[load_before, load_after]),
                                               indent=2))
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(1, 2, figsize=(10, 4))
  for nm in names:
    pts = [(r["T"], r[nm][0]) for r in rows if nm in r]
    if pts:
      ax[1 if nm.startswith("decode") else 0].loglog(*zip(*pts), "o-", label=nm)
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
