"""Gated delta rule: the chunked form against the recurrent scan, and decode memory against a KV cache.

    python -m experiments.bench_deltanet [--lengths 1024,2048,4096,8192,16384] [--batch 1]
        [--heads 8] [--key-heads 4] [--head-dim 128] [--chunk-size 64] [--iters 1] [--kernel]
        [--out runs/bench_deltanet]

1. Forward time of ``gated_delta_rule`` with ``implementation="chunked"`` against the baseline
   ``implementation="recurrent"`` (a ``lax.scan`` over tokens), both jitted, fp32, at each length:
   the best of ``--iters`` runs after a warm-up, the time ratio, the XLA scratch of each compiled
   program (``memory_analysis().temp_size_in_bytes``) and the max abs difference of their outputs.
   Defaults: 8 value heads and 4 key heads of 128 (Qwen3-Next's head size, fewer heads).
   ``--kernel`` adds ``implementation="pallas_tpu"`` (the Pallas state-pass kernel; interpreted,
   so only a correctness check, unless run on a TPU) and its speed relative to the XLA chunked form.
2. Decode memory per layer as the context grows: the Gated DeltaNet cache (``DeltaNetCache``:
   conv tails + fp32 memory) against a full-attention ``KVCache`` holding every token, both at
   Qwen3-Next-80B-A3B's layer sizes (DeltaNet 16 key / 32 value heads of 128; attention 2 KV heads
   of 256), in bf16 (memory fp32).  Sizes come from ``jax.eval_shape`` of the real cache
   constructors, so nothing is allocated.  Also the compiled decode step's scratch bytes.

Writes ``results.json``, ``speed.png`` and ``memory.png`` under ``--out``.  Times on a shared or
loaded machine are noisy; the ratio is measured within one run.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.cli import int_list
from jaxattn.cache import KVCache
from jaxattn.nn.gated_deltanet import DeltaNetCache
from jaxattn.ops.delta_rule import gated_delta_rule, gated_delta_rule_step, l2_normalize

try:
  from tqdm import tqdm
  _write = tqdm.write
except ImportError:  # pragma: no cover
  def tqdm(it, **_):
    return it
  _write = print


def _inputs(b, t, kh, n, h, seed=0):
  ks = jax.random.split(jax.random.key(seed), 5)
  q = jax.random.normal(ks[0], (b, t, kh, h))
  k = l2_normalize(jax.random.normal(ks[1], (b, t, kh, h)))
  v = jax.random.normal(ks[2], (b, t, n, h))
  g = -jax.nn.softplus(jax.random.normal(ks[3], (b, t, n)) - 2.0)   # decays near exp(-0.13)
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, n)))
  return q, k, v, g, beta


def _time(fn, args, iters):
  jax.block_until_ready(fn(*args))  # warm-up
  best = float("inf")
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - t0)
  return best


def _scratch(fn, args):
  mem = fn.lower(*args).compile().memory_analysis()
  return int(getattr(mem, "temp_size_in_bytes", 0) or 0) if mem is not None else -1


def speed(lengths, batch, heads, key_heads, head_dim, chunk_size, iters, kernel):
  rows = []
  impls = ("recurrent", "chunked") + (("pallas_tpu",) if kernel else ())
  for t in tqdm(lengths, desc="chunked vs recurrent"):
    args = _inputs(batch, t, key_heads, heads, head_dim)
    fns = {impl: jax.jit(lambda *a, impl=impl: gated_delta_rule(
        *a, chunk_size=chunk_size, implementation=impl)[0]) for impl in impls}
    row = {"T": t}
    outs = {}
    for impl, fn in fns.items():
      row[f"{impl}_s"] = _time(fn, args, iters)
      row[f"{impl}_scratch_bytes"] = _scratch(fn, args)
      outs[impl] = fn(*args)
    row["speedup"] = row["recurrent_s"] / row["chunked_s"]
    row["max_abs_diff"] = float(jnp.abs(outs["chunked"] - outs["recurrent"]).max())
    rows.append(row)
    _write(f"T={t:6d}  recurrent {row['recurrent_s'] * 1e3:9.1f} ms  chunked "
          f"{row['chunked_s'] * 1e3:8.1f} ms  speedup {row['speedup']:5.1f}x  scratch "
          f"{row['recurrent_scratch_bytes'] / 2**20:7.1f} / {row['chunked_scratch_bytes'] / 2**20:7.1f}"
          f" MiB  max|diff| {row['max_abs_diff']:.1e}")
    if kernel:
      row["kernel_vs_chunked"] = row["chunked_s"] / row["pallas_tpu_s"]
      row["kernel_interpreted"] = jax.default_backend() != "tpu"
      _write(f"T={t:6d}  pallas_tpu state pass ({'interpreted' if row['kernel_interpreted'] else 'TPU'}) "
             f"{row['pallas_tpu_s'] * 1e3:9.1f} ms = {row['kernel_vs_chunked']:.3f}x the XLA "
             f"chunked speed, max|diff| {float(jnp.abs(outs['pallas_tpu'] - outs['chunked']).max()):.1e}")
  return rows


def _nbytes(tree):
  return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def memory(contexts, batch):
  # Qwen3-Next-80B-A3B layer sizes.
  dn = dict(num_heads=32, num_key_heads=16, head_dim=128, v_head_dim=128, conv_kernel_size=4)
  attn = dict(num_kv_heads=2, head_dim=256)
  dn_cache = jax.eval_shape(lambda: DeltaNetCache.init(batch, **dn, dtype=jnp.bfloat16))
  state = dn_cache.state
  step = jax.jit(gated_delta_rule_step)
  q = jax.ShapeDtypeStruct((batch, 16, 128), jnp.bfloat16)
  v = jax.ShapeDtypeStruct((batch, 32, 128), jnp.bfloat16)
  gb = jax.ShapeDtypeStruct((batch, 32), jnp.float32)
  step_scratch = _scratch(step, (q, q, v, gb, gb, state))
  rows = []
  for t in contexts:
    kv = jax.eval_shape(lambda t=t: KVCache.init(batch, t, attn["num_kv_heads"], attn["head_dim"],
                                                 dtype=jnp.bfloat16))
    rows.append({"T": t, "deltanet_cache_bytes": _nbytes(dn_cache),
                 "kv_cache_bytes": _nbytes(kv) - 4})  # minus the int32 index
  for r in rows:
    print(f"T={r['T']:8d}  DeltaNet cache {r['deltanet_cache_bytes'] / 2**20:8.2f} MiB   full-attention "
          f"KV cache {r['kv_cache_bytes'] / 2**20:9.2f} MiB   ratio KV/DeltaNet "
          f"{r['kv_cache_bytes'] / r['deltanet_cache_bytes']:7.2f}")
  # Per sequence: the DeltaNet cache holds `batch` sequences; kv_per_token is one sequence's.
  kv_per_token = 2 * attn["num_kv_heads"] * attn["head_dim"] * 2        # K and V, bf16
  crossover = _nbytes(dn_cache) / batch / kv_per_token
  print(f"decode step scratch (compiled, batch {batch}): {step_scratch} bytes at every context; "
        f"the KV cache outgrows the DeltaNet cache after ~{crossover:.0f} tokens")
  return rows, step_scratch, crossover


def _plot(out, speed_rows, mem_rows, batch=1):
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:  # pragma: no cover
    return
  if speed_rows:
    ts = [r["T"] for r in speed_rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.loglog(ts, [r["recurrent_s"] for r in speed_rows], "o-", label="recurrent (lax.scan)")
    a.loglog(ts, [r["chunked_s"] for r in speed_rows], "s-", label="chunked (WY/UT)")
    a.set_xlabel("sequence length T")
    a.set_ylabel("forward time (s)")
    a.legend()
    a.set_title("gated delta rule forward, CPU")
    b.semilogx(ts, [r["speedup"] for r in speed_rows], "o-")
    b.axhline(5.0, ls="--", c="gray", label="goal 5x")
    b.set_xlabel("sequence length T")
    b.set_ylabel("recurrent / chunked")
    b.legend()
    fig.tight_layout()
    fig.savefig(out / "speed.png", dpi=120)
    plt.close(fig)
  ts = [r["T"] for r in mem_rows]
  fig, a = plt.subplots(figsize=(6, 4))
  a.loglog(ts, [r["kv_cache_bytes"] / 2**20 for r in mem_rows], "o-", label="full attention KV cache")
  a.loglog(ts, [r["deltanet_cache_bytes"] / 2**20 for r in mem_rows], "s-", label="Gated DeltaNet cache")
  a.set_xlabel("tokens in context")
  a.set_ylabel(f"decode cache per layer (MiB, batch {batch})")
  a.set_title("Qwen3-Next-80B layer sizes, bf16 (DeltaNet memory fp32)")
  a.legend()
  fig.tight_layout()
  fig.savefig(out / "memory.png", dpi=120)
  plt.close(fig)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--lengths", type=int_list(minimum=1), default="1024,2048,4096,8192,16384")
  p.add_argument("--contexts", type=int_list(minimum=1), default="1024,4096,16384,65536,262144")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--key-heads", type=int, default=4)
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--chunk-size", type=int, default=64)
  p.add_argument("--iters", type=int, default=1, help="timed runs per point (best is kept)")
  p.add_argument("--skip-speed", action="store_true")
  p.add_argument("--kernel", action="store_true",
                 help="also time implementation='pallas_tpu' (interpreted when not on a TPU)")
  p.add_argument("--out", default="runs/bench_deltanet")
  args = p.parse_args(argv)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  print(f"backend {jax.default_backend()}, {jax.device_count()} device(s); B={args.batch} "
        f"N={args.heads} K={args.key_heads} H=h={args.head_dim} C={args.chunk_size}, fp32")
  speed_rows = [] if args.skip_speed else speed(
      args.lengths, args.batch, args.heads, args.key_heads, args.head_dim, args.chunk_size,
      args.iters, args.kernel)
  mem_rows, step_scratch, crossover = memory(args.contexts, args.batch)
  results = {"config": vars(args), "speed": speed_rows, "memory": mem_rows,
             "decode_step_scratch_bytes": step_scratch, "kv_outgrows_deltanet_after_tokens": crossover}
  (out / "results.json").write_text(json.dumps(results, indent=2))
  _plot(out, speed_rows, mem_rows, args.batch)
  print(f"wrote {out}/results.json and plots")


if __name__ == "__main__":
  main()
