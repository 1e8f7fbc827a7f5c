"""One decode step against a long cache: MHA/GQA with a full KV cache vs MLA naive vs MLA absorbed.

    python -m experiments.bench_mla [--contexts 1024,4096,16384,32768] [--iters 5]
                                    [--out runs/bench_mla]

Model size (defaults, DeepSeek-V2-Lite's attention): D 2048, 16 heads, MLA with C 512, P 128, R 64,
h 128 and no query compression; the baselines are ``jaxattn.nn.Attention`` with 16 heads of 128 and
``--kv-heads`` key/value heads (16 = MHA, 4 = GQA) and a ``KVCache``.  Everything in fp32.

For each context ``n``, a cache of capacity ``n`` is filled with random rows up to its last
``iters + 1`` slots (what is in it does not change the cost) and the jitted step
``(params, cache, x_t) -> (y, cache)`` runs with the cache donated (its update may be in place).
Reported per variant and context: median step time, the step's XLA scratch
(``memory_analysis().temp_size_in_bytes``), cache bytes, and the time and cache ratios against the
named baseline (the first ``--kv-heads`` entry), all measured in the same run.  The naive and
absorbed outputs are compared on the same cache (max abs difference).  Writes ``results.json`` and
``decode.png`` under ``--out``.

Numbers from a shared or loaded machine are noisy; compare ratios within one run.
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
from flax import nnx

from experiments.cli import int_list
from jaxattn.cache import KVCache
from jaxattn.kv_efficiency import format_kv_cache_table, kv_cache_table
from jaxattn.mla_cache import LatentCache
from jaxattn.nn.attention import Attention
from jaxattn.nn.mla import MLA

try:
  from tqdm import tqdm
except ImportError:  # pragma: no cover
  def tqdm(it, **_):
    return it


def _filled(cache, context: int, seed: int):
  """``cache`` with random contents and ``index = context``."""
  leaves, treedef = jax.tree.flatten(cache)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  new = [jnp.full((), context, jnp.int32) if leaf.ndim == 0 else
         jax.random.normal(k, leaf.shape, leaf.dtype) for leaf, k in zip(leaves, keys)]
  return jax.tree.unflatten(treedef, new)


def _step_fn(module, **call_kwargs):
  """A jitted ``(params, cache, x) -> (y, cache)`` with the cache donated."""
  graphdef, params = nnx.split(module)

  def step(params, cache, x):
    m = nnx.merge(graphdef, params)
    return m(x, cache=cache, **call_kwargs)

  return params, jax.jit(step, donate_argnums=(1,))


def measure(name, module, cache, x, iters, call_kwargs):
  """Median seconds per step, scratch bytes, cache bytes, and the output of the first step."""
  params, step = _step_fn(module, **call_kwargs)
  compiled = step.lower(params, cache, x).compile()
  mem = compiled.memory_analysis()
  scratch = int(getattr(mem, "temp_size_in_bytes", 0) or 0) if mem is not None else -1
  cache_bytes = sum(int(a.size * a.dtype.itemsize) for a in jax.tree.leaves(cache) if a.ndim)
  first, cache = step(params, cache, x)  # warm-up (compiled above; this also checks it runs)
  first = np.asarray(first)
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    y, cache = step(params, cache, x)
    y.block_until_ready()
    times.append(time.perf_counter() - t0)
  del cache
  return dict(variant=name, seconds=statistics.median(times), scratch_bytes=scratch,
              cache_bytes=cache_bytes), first


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--contexts", type=int_list(minimum=1), default="1024,4096,16384,32768")
  ap.add_argument("--iters", type=int, default=5, help="timed steps per variant (median reported)")
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--embed-dim", type=int, default=2048)
  ap.add_argument("--heads", type=int, default=16)
  ap.add_argument("--head-dim", type=int, default=128, help="baseline head size")
  ap.add_argument("--kv-heads", type=int_list(minimum=1), default="16,4",
                  help="baseline KV heads; the first is the baseline")
  ap.add_argument("--kv-lora-rank", type=int, default=512)
  ap.add_argument("--qk-nope-head-dim", type=int, default=128)
  ap.add_argument("--qk-rope-head-dim", type=int, default=64)
  ap.add_argument("--v-head-dim", type=int, default=128)
  ap.add_argument("--q-lora-rank", type=int, default=0, help="0: no query compression")
  ap.add_argument("--implementation", default=None, help="attention backend (default: auto)")
  ap.add_argument("--out", default="runs/bench_mla")
  args = ap.parse_args(argv)
  contexts, kv_heads = args.contexts, args.kv_heads
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  b, d, n = args.batch, args.embed_dim, args.heads
  print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({jax.device_count()} device(s)); "
        f"fp32, batch {b}, D {d}, {n} heads\n")

  mla = MLA(d, n, kv_lora_rank=args.kv_lora_rank, qk_nope_head_dim=args.qk_nope_head_dim,
            qk_rope_head_dim=args.qk_rope_head_dim, v_head_dim=args.v_head_dim,
            q_lora_rank=args.q_lora_rank or None, implementation=args.implementation,
            rngs=nnx.Rngs(0))
  baselines = {}
  for k in kv_heads:
    label = "MHA" if k == n else ("MQA" if k == 1 else f"GQA(K={k})")
    baselines[label] = Attention(d, n, k, args.head_dim, implementation=args.implementation,
                                 rngs=nnx.Rngs(1))
  base_name = next(iter(baselines))

  rows = kv_cache_table(num_heads=n, head_dim=args.head_dim, gqa_kv_heads=[k for k in kv_heads
                                                                             if 1 < k < n],
                        kv_lora_rank=args.kv_lora_rank, qk_rope_head_dim=args.qk_rope_head_dim,
                        dtype=jnp.float32)
  print("KV cache per token and layer (fp32):")
  print(format_kv_cache_table(rows, seq_len=max(contexts)))
  print()

  x = jax.random.normal(jax.random.key(7), (b, 1, d), jnp.float32)
  results = []
  variants = [(name, mod, {}) for name, mod in baselines.items()]
  variants += [("MLA naive", mla, dict(mode="naive")), ("MLA absorbed", mla, dict(mode="absorbed"))]
  bar = tqdm([(c, v) for c in contexts for v in variants], desc="decode steps", disable=None)
  firsts = {}
  for context, (name, module, kw) in bar:
    if hasattr(bar, "set_postfix_str"):
      bar.set_postfix_str(f"{name} @ {context}")
    # Capacity = context (a round size, as a serving cache would have, which also spares the chunked
    # backend a padded copy); the steps fill its last `iters + 1` slots.
    if isinstance(module, MLA):
      cache = LatentCache.init(b, context, args.kv_lora_rank, args.qk_rope_head_dim)
    else:
      cache = KVCache.init(b, context, module.num_kv_heads, module.head_dim)
    # The same random latent rows for naive and absorbed.
    cache = _filled(cache, context - args.iters - 1, seed=context)
    r, first = measure(name, module, cache, x, args.iters, kw)
    r["context"] = context
    results.append(r)
    firsts[(context, name)] = first

  print(f"\n{'context':>8} {'variant':<13} {'ms/step':>9} {'x ' + base_name:>9} {'cache MiB':>10} "
        f"{'cache x':>8} {'scratch MiB':>12}")
  for context in contexts:
    rs = [r for r in results if r["context"] == context]
    base = next(r for r in rs if r["variant"] == base_name)
    for r in rs:
      r["time_ratio_to_baseline"] = r["seconds"] / base["seconds"]
      r["cache_ratio_to_baseline"] = r["cache_bytes"] / base["cache_bytes"]
      print(f"{context:>8} {r['variant']:<13} {1e3 * r['seconds']:>9.2f} "
            f"{r['time_ratio_to_baseline']:>9.3f} {r['cache_bytes'] / 2**20:>10.1f} "
            f"{r['cache_ratio_to_baseline']:>8.4f} {r['scratch_bytes'] / 2**20:>12.1f}")
    naive = next(r for r in rs if r["variant"] == "MLA naive")
    absorbed = next(r for r in rs if r["variant"] == "MLA absorbed")
    diff = float(np.abs(firsts[(context, "MLA naive")] - firsts[(context, "MLA absorbed")]).max())
    fastest = min(rs, key=lambda r: r["seconds"])["variant"]
    ratio = naive["seconds"] / absorbed["seconds"]
    speed = f"{ratio:.1f}x faster" if ratio >= 1 else f"{1 / ratio:.1f}x slower"
    print(f"{'':>8} absorbed is {speed} than naive; "
          f"fastest: {fastest}; max |naive - absorbed| = {diff:.2e}")
    for r in rs:
      r["naive_vs_absorbed_max_abs"] = diff

  (out / "results.json").write_text(json.dumps(dict(args=vars(args), results=results), indent=1))
  try:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
  except ImportError:
    print(f"\nwrote {out / 'results.json'} (install matplotlib for the plot)")
    return
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for name in [v[0] for v in variants]:
    rs = [r for r in results if r["variant"] == name]
    axes[0].plot([r["context"] for r in rs], [1e3 * r["seconds"] for r in rs], "o-", label=name)
    if name != "MLA naive":  # both MLA paths read the same latent cache
      label = "MLA (either path)" if name == "MLA absorbed" else name
      axes[1].plot([r["context"] for r in rs], [r["cache_bytes"] / 2**20 for r in rs], "o-",
                   label=label)
  axes[0].set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="ms per decode step",
              title="one decode step (fp32, CPU)")
  axes[1].set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="cache MiB (one layer)",
              title="cache size")
  for ax in axes:
    ax.legend()
  fig.tight_layout()
  fig.savefig(out / "decode.png", dpi=120)
  print(f"\nwrote {out / 'results.json'} and {out / 'decode.png'}")


if __name__ == "__main__":
  main()
