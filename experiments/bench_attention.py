"""Causal attention on CPU: jaxattn's CPU paths against `jax.nn` and PyTorch, time and memory.

For each sequence length T it prints one row:

* ``jaxattn`` / ``chunked`` / ``jax.nn``: median wall time over ``--repeats`` calls (after one
  warm-up call) of the jitted, compiled call: ``jaxattn`` is the CPU default,
  ``implementation="cpu"`` (the native fused kernel; ``"xla_chunked"`` where it cannot be built),
  ``chunked`` the pure-XLA ``implementation="xla_chunked"``, ``jax.nn`` is
  ``jax.nn.dot_product_attention(..., is_causal=True)``; ``speedup`` is jax.nn's time over
  jaxattn's.  ``spread`` is ``(max - min) / median`` of the jaxattn samples and ``cpu/wall`` the
  process CPU time per wall second of those calls (about the core count when the machine is idle;
  much lower means other processes took the cores and the row is noisy);
* peak memory of each from ``compiled.memory_analysis()``: temp + argument + output bytes, i.e.
  everything XLA allocates for one call (aliased outputs would be counted twice; there are none
  here), plus, for the native kernels, the packed keys and values (and, backward, the per-thread
  dQ accumulators) they allocate themselves (``attention_cpu.workspace_bytes``);
* useful GFLOP/s of jaxattn and of the chunked path (causal: ``4 * B * N * H * T * T / 2``
  forward, 3.5x that for forward + backward) and their share of a large fp32 matmul's rate
  (``mm GF/s``: 4096^3, jitted, median of the same number of calls, re-measured just before each
  row so that both timings see the same load);
* PyTorch's CPU ``scaled_dot_product_attention(is_causal=True)`` on the same shapes and
  ``jaxattn / torch`` (``> 1`` means PyTorch is faster), skipped with a message without torch.

A final line checks the goals for the CPU default: >= 4x faster than ``jax.nn`` at the longest
T, memory linear in T, >= 60% of the matmul rate (and, stretch, PyTorch's speed); it declines to
judge when the load average at the end shows that other processes competed for the cores (the
benchmark alone keeps about every core busy), since the timings of such a run can be off by
several times.

    python -m experiments.bench_attention --seq-lens 1024 2048 4096 8192 --repeats 3
    python -m experiments.bench_attention --backward --plot runs/attention.png
    python -m experiments.bench_attention --backward --no-reference   # skip the slow jax.nn path
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.timing import compile_timed, peak_bytes
from jaxattn import native
from jaxattn.ops.attention import dot_product_attention
from jaxattn.ops.attention_cpu import workspace_bytes

try:
  from tqdm import tqdm
except ImportError:  # tqdm is optional
  tqdm = None


def _samples(fn, args, repeats):
  """``(wall seconds, CPU seconds)`` of each of ``repeats`` calls, after one warm-up call."""
  jax.block_until_ready(fn(*args))
  out = []
  for _ in range(repeats):
    c0, t0 = time.process_time(), time.perf_counter()
    jax.block_until_ready(fn(*args))
    out.append((time.perf_counter() - t0, time.process_time() - c0))
  return out


def _median(samples):
  return float(np.median([w for w, _ in samples]))


def _spread(samples):
  wall = [w for w, _ in samples]
  return (max(wall) - min(wall)) / float(np.median(wall))


def _cpu_per_wall(samples):
  return sum(c for _, c in samples) / sum(w for w, _ in samples)


def _matmul_timer(n, repeats):
  """A function returning the median FLOP/s of a jitted ``n x n x n`` fp32 matmul (the CPU's
  practical limit), compiled once so that it can be re-measured next to every row."""
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
  b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
  f, _ = compile_timed(jnp.dot, a, b)
  return lambda: 2 * n**3 / _median(_samples(f, (a, b), repeats))


def _attention_fns(backward, default_impl):
  def default(q, k, v):
    return dot_product_attention(q, k, v, is_causal=True, implementation=default_impl)

  def chunked(q, k, v):
    return dot_product_attention(q, k, v, is_causal=True, implementation="xla_chunked")

  def reference(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)

  if not backward:
    return default, chunked, reference

  def with_grad(f):
    return jax.value_and_grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32)),
                              argnums=(0, 1, 2))

  return with_grad(default), with_grad(chunked), with_grad(reference)


def _torch_time(shape, dtype, repeats, backward):
  try:
    import torch
  except ImportError:
    return None
  b, t, n, h = shape
  tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
  gen = torch.Generator().manual_seed(0)
  q, k, v = (torch.randn(b, n, t, h, generator=gen, dtype=tdtype) for _ in range(3))
  sdpa = torch.nn.functional.scaled_dot_product_attention

  def run():
    if backward:
      qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
      sdpa(qq, kk, vv, is_causal=True).float().sum().backward()
    else:
      with torch.no_grad():
        sdpa(q, k, v, is_causal=True)

  run()
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    run()
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
  parser.add_argument("--repeats", type=int, default=3,
                      help="timed calls per measurement (the median is reported)")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--heads", type=int, default=8)
  parser.add_argument("--head-dim", type=int, default=64)
  parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
  parser.add_argument("--backward", action="store_true", help="time value_and_grad w.r.t. q, k, v")
  parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch baseline")
  parser.add_argument("--no-reference", action="store_true",
                      help="skip jax.nn.dot_product_attention (minutes per call at 8k backward)")
  parser.add_argument("--plot", default=None, help="optional path of a time/memory plot (png)")
  args = parser.parse_args(argv)

  b, n, h = args.batch, args.heads, args.head_dim
  dtype = jnp.dtype(args.dtype)
  mode = "forward + backward (value_and_grad)" if args.backward else "forward"
  print(f"causal attention, {mode}; B={b} N={n} H={h} {args.dtype}; backend "
        f"{jax.default_backend()} ({jax.device_count()} device, {jax.devices()[0].device_kind}, "
        f"{os.cpu_count()} cores); load average at start {os.getloadavg()[0]:.1f}")
  # The matmul rate is re-measured before every row, so that '% mm' compares two timings taken
  # under the same load.
  matmul_rate = _matmul_timer(4096, args.repeats)
  print("memory = temp + argument + output bytes of the compiled executable (memory_analysis)")

  default_impl = "cpu" if native.available() else "xla_chunked"
  if default_impl != "cpu":
    print(f"native CPU kernel unavailable ({native.reason()}): jaxattn = xla_chunked")
  print(f"jaxattn = implementation={default_impl!r} (the CPU default); chunked = 'xla_chunked'")
  default_fn, chunked_fn, reference_fn = _attention_fns(args.backward, default_impl)
  flop_factor = 3.5 if args.backward else 1.0  # backward: 5 block matmuls against forward's 2
  have_torch = not args.no_torch
  if have_torch:
    try:
      import torch  # noqa: F401
    except ImportError:
      have_torch = False
      print("torch is not installed: PyTorch baseline skipped")

  header = (f"{'T':>6} {'jaxattn s':>10} {'spread':>7} {'cpu/wall':>8} {'chunked s':>10} "
            f"{'jax.nn s':>9} {'speedup':>8} {'jaxattn MB':>11} {'chunked MB':>11} "
            f"{'jax.nn MB':>10} {'GFLOP/s':>8} {'chunk GF':>8} {'mm GF/s':>8} {'% mm':>5} "
            f"{'chunk %':>7} {'torch s':>8} {'ja/torch':>9} {'compile s':>9}")
  rows = []
  seq_lens = tqdm(args.seq_lens, desc="T", leave=False, disable=None) if tqdm else args.seq_lens
  for t in seq_lens:
    rng = np.random.default_rng(t)
    q, k, v = (jnp.asarray(rng.standard_normal((b, t, n, h)), dtype) for _ in range(3))
    rate = matmul_rate() / 1e9
    d_exe, d_compile = compile_timed(default_fn, q, k, v)
    d_samples = _samples(d_exe, (q, k, v), args.repeats)
    d_mem = peak_bytes(d_exe) + (workspace_bytes(q.shape, k.shape, v.shape,
                                                 backward=args.backward, threads=os.cpu_count())
                                 if default_impl == "cpu" else 0)
    del d_exe
    if default_impl == "xla_chunked":
      c_samples, c_mem = d_samples, d_mem
    else:
      c_exe, _ = compile_timed(chunked_fn, q, k, v)
      c_samples = _samples(c_exe, (q, k, v), args.repeats)
      c_mem = peak_bytes(c_exe)
      del c_exe
    r_time = r_mem = None
    if not args.no_reference:
      r_exe, _ = compile_timed(reference_fn, q, k, v)
      r_time = _median(_samples(r_exe, (q, k, v), args.repeats))
      r_mem = peak_bytes(r_exe)
      del r_exe
    d_time, c_time = _median(d_samples), _median(c_samples)
    flops = flop_factor * 4 * b * n * h * t * t / 2
    tt = _torch_time((b, t, n, h), args.dtype, args.repeats, args.backward) if have_torch else None
    rows.append(dict(t=t, d_time=d_time, c_time=c_time, r_time=r_time, d_mem=d_mem, c_mem=c_mem,
                     r_mem=r_mem, gflops=flops / d_time / 1e9, c_gflops=flops / c_time / 1e9,
                     torch=tt, compile=d_compile, spread=_spread(d_samples), rate=rate,
                     cpu=_cpu_per_wall(d_samples)))
  print(header)
  for r in rows:
    torch_s = f"{r['torch']:8.3f} {r['d_time'] / r['torch']:9.2f}" if r["torch"] else \
        f"{'-':>8} {'-':>9}"
    ref_s = (f"{r['r_time']:9.3f} {r['r_time'] / r['d_time']:7.1f}x" if r["r_time"] else
             f"{'-':>9} {'-':>8}")
    ref_mem = f"{r['r_mem'] / 2**20:10.1f}" if r["r_mem"] else f"{'-':>10}"
    print(f"{r['t']:>6} {r['d_time']:10.3f} {100 * r['spread']:6.0f}% {r['cpu']:8.2f} "
          f"{r['c_time']:10.3f} {ref_s} {r['d_mem'] / 2**20:11.1f} {r['c_mem'] / 2**20:11.1f} "
          f"{ref_mem} {r['gflops']:8.0f} {r['c_gflops']:8.0f} {r['rate']:8.0f} "
          f"{100 * r['gflops'] / r['rate']:4.0f}% {100 * r['c_gflops'] / r['rate']:6.0f}% "
          f"{torch_s} {r['compile']:9.1f}")
  # This benchmark keeps about all cores busy itself; a load well above the core count means other
  # processes competed for them.
  busy = os.getloadavg()[0] > 1.25 * os.cpu_count()
  print(f"load average at end {os.getloadavg()[0]:.1f} ({os.cpu_count()} cores): "
        + ("other processes shared the cores, timings are noisy" if busy else
           "no sign of other processes competing for the cores"))

  last = rows[-1]
  # Memory linear in T: from the shortest to the longest T, bytes grow at most ~proportionally
  # (x 1.5 slack for fixed per-block buffers), while a T x S path grows quadratically.
  growth = last["d_mem"] / rows[0]["d_mem"]
  t_ratio = last["t"] / rows[0]["t"]
  linear = growth <= 1.5 * t_ratio if len(rows) > 1 else True
  share = last["gflops"] / last["rate"]
  speedup = last["r_time"] / last["d_time"] if last["r_time"] else None
  ok = (speedup is None or speedup >= 4) and linear and share >= 0.6
  speed_s = (f"{speedup:.1f}x jax.nn (goal >= 4x: {'met' if speedup >= 4 else 'missed'})"
             if speedup is not None else "jax.nn not measured")
  print(f"verdict at T={last['t']} ({default_impl}): {speed_s}; memory x{growth:.1f} for T x{t_ratio:.0f} "
        f"({'linear' if linear else 'super-linear'}); {100 * share:.0f}% of the fp32 matmul rate "
        f"(goal >= 60%: {'met' if share >= 0.6 else 'missed'})"
        + (f"; {last['d_time'] / last['torch']:.2f}x PyTorch's time (stretch <= 1: "
           f"{'met' if last['d_time'] <= last['torch'] else 'missed'})" if last["torch"] else "")
        + f"; xla_chunked alone {100 * last['c_gflops'] / last['rate']:.0f}% of the matmul rate"
        + " -> " + ("not judged: other processes shared the cores" if busy else
                    "all measured goals met" if ok else "goals not all met"))

  if args.plot:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ts = [r["t"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(ts, [r["d_time"] for r in rows], "o-", label=f"jaxattn {default_impl}")
    if default_impl != "xla_chunked":
      ax1.plot(ts, [r["c_time"] for r in rows], "o--", label="jaxattn xla_chunked")
    if all(r["r_time"] for r in rows):
      ax1.plot(ts, [r["r_time"] for r in rows], "s-", label="jax.nn.dot_product_attention")
    if all(r["torch"] for r in rows):
      ax1.plot(ts, [r["torch"] for r in rows], "^-", label="torch SDPA (CPU)")
    ax1.set(xscale="log", yscale="log", xlabel="T", ylabel="seconds", title=f"causal, {mode}")
    ax2.plot(ts, [r["d_mem"] / 2**20 for r in rows], "o-", label=f"jaxattn {default_impl}")
    if default_impl != "xla_chunked":
      ax2.plot(ts, [r["c_mem"] / 2**20 for r in rows], "o--", label="jaxattn xla_chunked")
    if all(r["r_mem"] for r in rows):
      ax2.plot(ts, [r["r_mem"] / 2**20 for r in rows], "s-", label="jax.nn.dot_product_attention")
    ax2.set(xscale="log", yscale="log", xlabel="T", ylabel="MiB (temp + args + outputs)",
            title="compiled memory")
    for ax in (ax1, ax2):
      ax.legend()
      ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    if os.path.dirname(args.plot):
      os.makedirs(os.path.dirname(args.plot), exist_ok=True)
    fig.savefig(args.plot, dpi=120)
    print(f"plot written to {args.plot}")


if __name__ == "__main__":
  main()
