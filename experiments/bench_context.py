"""Context parallelism: causal self-attention, forward + backward, with the sequence split over
the devices of a mesh axis -- jaxattn's strategies against XLA's own partitioning.

Rows, per sequence length T (batch 1, ``--heads`` query heads on ``--kv-heads`` KV heads, head
size 64, causal), all on one mesh axis of ``--devices`` devices, inputs split along T:

* ``xla``, the named baseline: ``jax.nn.dot_product_attention`` on the split inputs, partitioned
  by XLA (GSPMD) on a mesh axis jaxattn does not route (``seq``);
* ``all_gather``: ``jaxattn.ops.context_parallel``, keys and values gathered, query halves swapped
  so every device gets the same causal work (``load_balance``);
* ``all_gather_unbalanced``: the same without the swap (the last device sees C times the keys of
  the first);
* ``ring``: keys and values passed around the ring, one chunk per step, backward a second ring,
  in the zigzag layout (every device the same work at every step);
* ``ring_unbalanced``: the same over contiguous chunks (the steps wait for the busiest device).

Columns: the time of one jitted forward + backward call (best of ``--repeats`` rounds), its ratio
to the baseline's (``> 1``: faster than XLA), and the peak memory *per device* from the compiled
executable's memory analysis (temp + arguments + outputs), with its ratio to the baseline's.  The
causal work of the busiest device (``busiest``: query-key pairs it computes, as a fraction of
``t x T``, ``t = T / C``) shows the balancing on paper: ``(2 C + 1) / (4 C)`` balanced, 1 not.

On a CPU the devices are simulated (``jax_num_cpu_devices``) and share the machine's cores: the
times there measure total work and the collectives' copies, not parallel speed-up; the memory
columns hold as they would on chips.  On a GPU / TPU host the real devices are used (bf16).

    python -m experiments.bench_context --seq-lens 2048 4096 8192 --devices 8
    python -m experiments.bench_context --plot runs/context.png --json runs/context.json
    python -m experiments.bench_context --mixer deltanet --heads 8 --kv-heads 4 --head-dim 128

``--window W``: a causal sliding window of ``W`` earlier keys for every row (Mistral's and
gpt-oss's sliding layers); the ring then runs only the steps that bring visible keys.

``--mixer deltanet``: Gated DeltaNet's rule (forward + backward, chunked form) instead, rows
``xla`` (the rule on the split inputs, partitioned by XLA) and ``context``
(``context_parallel.delta_rule``: each device runs its chunk; only the chunks' state
transitions, ``[B, N, H, H + h]`` each, are exchanged).
"""

from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from experiments.cli import at_least
from experiments.timing import best_time, compile_timed, error_text, peak_bytes, write_json

STRATEGIES = ("xla", "all_gather", "all_gather_unbalanced", "ring", "ring_unbalanced")
# Gated DeltaNet's rule (``--mixer deltanet``): XLA's partitioning of the chunked rule vs
# ``context_parallel.delta_rule`` (state transitions exchanged, not the sequence).
DELTA_STRATEGIES = ("xla", "context")


def _simulate_devices(n: int) -> None:
  """Asks for ``n`` CPU devices when the default backend is the CPU (before it starts)."""
  try:
    jax.config.update("jax_num_cpu_devices", n)
  except Exception:  # noqa: BLE001 - the backend already started (e.g. under pytest): keep it
    pass


def _mesh(devices: int, axis: str):
  devs = np.asarray(jax.devices()[:devices])
  if devs.size < devices:
    raise ValueError(f"`--devices` ({devices}) exceeds the {devs.size} devices available.")
  return jax.sharding.Mesh(devs, (axis,))


def busiest_work(strategy: str, seq_len: int, devices: int) -> float:
  """Query-key pairs the busiest device computes under the causal mask (the key range each of
  its query rows reads, which block skipping follows), as a fraction of ``t x T``, ``t = T / C``.
  Unbalanced (and XLA without skipping at best): the last device, 1.  Balanced (all-gather, and
  the zigzag ring summed over its steps): every device ``h (C t + h)`` with ``h = t / 2``, i.e.
  ``(2 C + 1) / (4 C)``, about half."""
  t = seq_len // devices
  if strategy in ("all_gather", "ring"):
    h = t // 2
    return h * (devices * t + h) / (t * seq_len)
  return 1.0


def _delta_loss(strategy: str):
  del strategy  # the mesh axis's name decides: `context` is routed, `seq` left to XLA
  from jaxattn.ops.delta_rule import gated_delta_rule

  def loss(q, k, v, d_out):
    n = v.shape[2]
    g = jnp.full(v.shape[:2] + (n,), -0.05, jnp.float32).astype(v.dtype)
    beta = jnp.full(v.shape[:2] + (n,), 0.5, jnp.float32).astype(v.dtype)
    out, _ = gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True)
    return jnp.sum(out.astype(jnp.float32) * d_out)

  return jax.value_and_grad(loss, argnums=(0, 1, 2))


def _loss(strategy: str, mixer: str = "attention", window: int | None = None):
  from jaxattn.ops import context_parallel as cp
  from jaxattn.ops.attention import dot_product_attention
  if mixer == "deltanet":
    return _delta_loss(strategy)

  def loss(q, k, v, d_out):
    if strategy == "xla":
      out = jax.nn.dot_product_attention(
          q, k, v, is_causal=True, local_window_size=None if window is None else (window, 0))
    else:
      opts = dict(strategy=strategy.split("_unbalanced")[0],
                  load_balance=not strategy.endswith("_unbalanced"))
      with cp.set_options(**opts):
        out = dot_product_attention(q, k, v, is_causal=True, local_window_size=window)
    return jnp.sum(out.astype(jnp.float32) * d_out)

  return jax.value_and_grad(loss, argnums=(0, 1, 2))


def measure(strategy: str, seq_len: int, *, devices: int, heads: int, kv_heads: int,
            head_dim: int, dtype, repeats: int, mixer: str = "attention",
            window: int | None = None) -> dict:
  """One row: seconds per forward + backward call and peak bytes per device.  For the delta
  rule, ``heads`` value heads read ``kv_heads`` query / key heads."""
  axis = "seq" if strategy == "xla" else "context"
  mesh = _mesh(devices, axis)
  ks = jax.random.split(jax.random.key(seq_len), 4)
  shape_q, shape_k = (1, seq_len, heads, head_dim), (1, seq_len, kv_heads, head_dim)
  spec = NamedSharding(mesh, P(None, axis))
  shape_v = shape_k
  if mixer == "deltanet":
    shape_q, shape_v = shape_k, shape_q
  q = jax.device_put(jax.random.normal(ks[0], shape_q, dtype), spec)
  k = jax.device_put(jax.random.normal(ks[1], shape_k, dtype), spec)
  v = jax.device_put(jax.random.normal(ks[2], shape_v, dtype), spec)
  shape_out = shape_v if mixer == "deltanet" else shape_q
  d_out = jax.device_put(jax.random.normal(ks[3], shape_out, jnp.float32), spec)
  with jax.set_mesh(mesh):
    compiled, compile_s = compile_timed(_loss(strategy, mixer, window), q, k, v, d_out)
    seconds = best_time(compiled, (q, k, v, d_out), repeats)
  return {"strategy": strategy, "mixer": mixer, "seq_len": seq_len, "devices": devices,
          "seconds": seconds, "compile_s": compile_s, "peak_bytes": peak_bytes(compiled),
          "window": window,
          # (a window shorter than a chunk gives every device the same work)
          "busiest_work": (busiest_work(strategy, seq_len, devices)
                           if mixer == "attention" and window is None else 1.0)}


def run(args) -> list[dict]:
  on_cpu = jax.default_backend() == "cpu"
  dtype = jnp.float32 if on_cpu else jnp.bfloat16
  rows = []
  if args.strategies is None:
    args.strategies = list(DELTA_STRATEGIES if args.mixer == "deltanet" else STRATEGIES)
  allowed = DELTA_STRATEGIES if args.mixer == "deltanet" else STRATEGIES
  if [x for x in args.strategies if x not in allowed]:
    raise ValueError(f"`--strategies` for --mixer {args.mixer} must be among {allowed}, got "
                     f"{args.strategies}.")
  try:
    from tqdm import tqdm
    bar = tqdm(total=len(args.seq_lens) * len(args.strategies), desc="bench_context",
               leave=False)
  except ImportError:  # tqdm is optional
    bar = None
  what = ("causal attention" if args.mixer == "attention" else
          "the gated delta rule (chunked, value heads N, key heads K)")
  if args.window is not None:
    if args.mixer != "attention":
      raise ValueError("`--window` is a sliding window of attention (--mixer attention).")
    what += f", sliding window of {args.window} keys"
  print(f"{jax.device_count()} {jax.devices()[0].platform} device(s), mesh of {args.devices}; "
        f"{what}, B=1, N={args.heads}, K={args.kv_heads}, H={args.head_dim}, "
        f"{jnp.dtype(dtype).name}, forward + backward")
  if on_cpu:
    print("(simulated CPU devices share the cores: times are total work, memory is per device)")
  head = (f"{'T':>6} {'strategy':<22} {'ms':>9} {'x xla':>6} {'MiB/dev':>9} {'mem x xla':>9} "
          f"{'busiest':>8}")
  print(head)
  for seq_len in args.seq_lens:
    base = None
    for strategy in args.strategies:
      try:
        row = measure(strategy, seq_len, devices=args.devices, heads=args.heads,
                      kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=dtype,
                      repeats=args.repeats, mixer=args.mixer, window=args.window)
      except Exception as e:  # noqa: BLE001 - one failing row must not lose the others
        row = {"strategy": strategy, "seq_len": seq_len, "error": error_text(e)}
        print(f"{seq_len:>6} {strategy:<22} error: {row['error']}")
      else:
        if strategy == "xla":
          base = row
        if base is not None:
          row["speedup"] = base["seconds"] / row["seconds"]
          row["memory_ratio"] = row["peak_bytes"] / base["peak_bytes"]
        print(f"{seq_len:>6} {strategy:<22} {1e3 * row['seconds']:>9.1f} "
              f"{row.get('speedup', math.nan):>6.2f} {row['peak_bytes'] / 2**20:>9.1f} "
              f"{row.get('memory_ratio', math.nan):>9.2f} {row['busiest_work']:>8.2f}", flush=True)
      rows.append(row)
      if bar is not None:
        bar.update(1)
  if bar is not None:
    bar.close()
  if args.json:
    write_json(args.json, {"rows": rows, "devices": args.devices, "dtype": jnp.dtype(dtype).name})
  if args.plot:
    plot(rows, args.plot)
  return rows


def plot(rows: list[dict], path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  for strategy in dict.fromkeys(r["strategy"] for r in rows):
    rs = [r for r in rows if r["strategy"] == strategy and "error" not in r]
    if not rs:
      continue
    t = [r["seq_len"] for r in rs]
    axes[0].plot(t, [1e3 * r["seconds"] for r in rs], "o-", label=strategy)
    axes[1].plot(t, [r["peak_bytes"] / 2**20 for r in rs], "o-", label=strategy)
  for ax, label in zip(axes, ("ms per forward + backward", "peak MiB per device")):
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length T")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
  axes[0].legend()
  delta = bool(rows) and rows[0].get("mixer") == "deltanet"
  fig.suptitle(("Gated delta rule" if delta else "Causal attention")
               + " with the sequence split over devices")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def make_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--seq-lens", type=at_least(2), nargs="+", default=[2048, 4096, 8192])
  p.add_argument("--devices", type=at_least(2), default=8)
  p.add_argument("--heads", type=at_least(1), default=8)
  p.add_argument("--kv-heads", type=at_least(1), default=2)
  p.add_argument("--head-dim", type=at_least(1), default=64)
  p.add_argument("--repeats", type=at_least(1), default=3)
  p.add_argument("--mixer", choices=("attention", "deltanet"), default="attention")
  p.add_argument("--window", type=at_least(0), default=None,
                 help="a causal sliding window of this many earlier keys (Mistral, gpt-oss)")
  p.add_argument("--strategies", nargs="+", choices=sorted(set(STRATEGIES + DELTA_STRATEGIES)),
                 default=None, help="default: every strategy of the mixer")
  p.add_argument("--json", default=None)
  p.add_argument("--plot", default=None)
  return p


def main(argv=None) -> int:
  args = make_parser().parse_args(argv)
  bad = [t for t in args.seq_lens if t % (2 * args.devices)]
  if bad:
    raise ValueError(f"`--seq-lens` {bad} must be multiples of 2 x --devices "
                     f"({2 * args.devices}): each device holds two equal half-chunks.")
  if args.heads % args.kv_heads:
    raise ValueError(f"`--heads` ({args.heads}) must be a multiple of `--kv-heads` "
                     f"({args.kv_heads}).")
  _simulate_devices(args.devices)
  run(args)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
