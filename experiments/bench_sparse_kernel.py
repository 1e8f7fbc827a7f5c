"""Top-K sparse attention kernels vs the XLA gather reference, on whatever device JAX has.

    python -m experiments.bench_sparse_kernel [--kind mla,gqa] [--contexts 8192,32768]
        [--queries 512] [--topk 2048] [--mla-heads 128] [--dtype bfloat16] [--impl auto]
        [--check] [--backward] [--repeats 5] [--out runs/bench_sparse_kernel]

DSA prefill's main attention given the selected positions (the indexer excluded), batch 1,
``--queries`` query tokens against a cache of each ``--contexts`` length, each token selecting
``--topk`` positions (random, distinct, causal-agnostic):

* ``mla``: DeepSeek-V3.2's absorbed form (``sparse_mla_attention``): ``--mla-heads`` heads over
  the shared latent row ``[c_KV (512), k^R (64)]``, value = ``c_KV``; the up-projections are
  included (the same in both paths).
* ``gqa``: ``sparse_attention`` with 32 query heads over 8 KV heads of 128.

``--impl``: the kernel path (``auto``: ``pallas_gpu`` on a GPU, ``pallas_tpu`` on a TPU, the
native ``cpu`` kernel on a CPU) against ``implementation="xla"`` (gathers every selected row for
every token, then dense math) in the same run.  Reports the best time per call, the selected rows'
bytes read per second (``T * k * row bytes / time``: every token reads its rows once, heads
share them), TFLOP/s (``2 * T * N * k * (key width + value width)``; MLA adds the two absorbed
projections the call runs, ``2 * T * N * C * (P + h)``), the XLA path's time over the
kernel's, and peak memory from each compiled executable's memory analysis.  ``--check`` compares
the kernel's output with the reference's first (max abs error, relative to the output's scale;
fails above 1e-3 in fp32, 2e-2 in bf16, 6e-2 for bf16 gradients).
``--backward`` times forward + backward instead (the gradient of ``sum(out * g)`` with respect to
every floating input): the kernel paths' backward is ``sparse_attention_vjp`` (query chunks,
scratch bounded in ``T``), the XLA path differentiates its gathers (all ``T * k`` rows at once),
and the peak-memory columns show the difference.  Each timing round queues calls until it lasts
~10 ms (at most 50; ``timing.best_time(inner="auto")``).  Writes ``results.json`` under ``--out``
(strict JSON, NaN as ``null``) after every case; a case that raises gets a row with its error, the
others still run, and the script then exits with an error.
"""

from __future__ import annotations

import argparse
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from experiments.cli import choice_list, int_list
from experiments.timing import (AUTO, best_time, compile_timed, error_text, peak_bytes,
                                write_json)
from jaxattn.ops.sparse import sparse_attention, sparse_mla_attention


def default_impl() -> str:
  backend = jax.default_backend()
  return {"gpu": "pallas_gpu", "cuda": "pallas_gpu", "tpu": "pallas_tpu"}.get(backend, "cpu")


def random_indices(t: int, s: int, k: int, seed: int) -> jax.Array:
  """``[1, t, k]`` distinct positions in ``[0, s)`` per token (``k <= s``)."""
  keys = jax.random.split(jax.random.key(seed), t)
  return jax.vmap(lambda key: jax.random.permutation(key, s)[:k])(keys)[None].astype(jnp.int32)


KINDS = ("mla", "gqa")


def case_inputs(kind: str, t: int, s: int, k: int, heads: int, dtype):
  """``(fn(impl) -> callable, args, row bytes, flops per call)`` for one case."""
  ks = jax.random.split(jax.random.key(0), 6)
  rnd = lambda i, shape, sc=1.0: (jax.random.normal(ks[i], shape) * sc).astype(dtype)  # noqa: E731
  idx = random_indices(t, s, k, 7)
  bytes_ = jnp.dtype(dtype).itemsize
  if kind == "mla":
    c, r, p, hv = 512, 64, 128, 128
    args = (rnd(0, (1, t, heads, p)), rnd(1, (1, t, heads, r)), rnd(2, (1, s, c)),
            rnd(3, (1, s, r)), rnd(4, (c, heads, p), 0.05), rnd(5, (c, heads, hv), 0.05), idx)

    def fn(impl):
      return lambda *a: sparse_mla_attention(*a, implementation=impl)
    # the attention over k latent rows, plus q_nope -> latent (w_uk) and latent -> value (w_uv)
    flops = 2 * t * heads * k * (c + r + c) + 2 * t * heads * c * (p + hv)
    return fn, args, (c + r) * bytes_, flops
  if kind != "gqa":
    raise ValueError(f"unknown kind {kind!r}; allowed: {', '.join(KINDS)}")
  n, kh, h = 32, 8, 128
  args = (rnd(0, (1, t, n, h)), rnd(1, (1, s, kh, h)), rnd(2, (1, s, kh, h)), idx)

  def fn(impl):
    return lambda *a: sparse_attention(*a, implementation=impl)
  return fn, args, 2 * kh * h * bytes_, 2 * t * n * k * (h + h)


def with_backward(fn, inputs):
  """``fn(impl)`` -> the gradient of ``sum(out * g)`` w.r.t. every floating input (a fixed random
  cotangent ``g`` keeps the gradients from cancelling)."""
  diff = tuple(i for i, x in enumerate(inputs) if jnp.issubdtype(x.dtype, jnp.floating))

  def make(impl):
    f = fn(impl)

    def grads(*a):
      out_shape = jax.eval_shape(f, *a)
      g = jax.random.normal(jax.random.key(1), out_shape.shape).astype(out_shape.dtype)
      return jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) * g), diff)(*a)
    return grads
  return make


def _measure(args, kind, s, k, impl, dtype) -> dict:
  """Compile both paths for one case, compare them (``--check``), time them: the row's figures."""
  fn, inputs, row_bytes, flops = case_inputs(kind, args.queries, s, k, args.mla_heads, dtype)
  if args.backward:
    fn = with_backward(fn, inputs)
  kern, _ = compile_timed(fn(impl), *inputs)
  ref, _ = compile_timed(fn("xla"), *inputs)
  err = float("nan")
  if args.check:
    err = 0.0
    for got, want in zip(jax.tree.leaves(kern(*inputs)), jax.tree.leaves(ref(*inputs))):
      got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
      err = max(err, float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)))
  t_k = best_time(kern, inputs, args.repeats, inner=AUTO)
  t_x = best_time(ref, inputs, args.repeats, inner=AUTO)
  if args.backward:
    flops *= 3.5                                   # forward + backward (recomputed logits)
  return dict(kernel_s=t_k, xla_s=t_x, speedup=t_x / t_k,
              gbps=args.queries * k * row_bytes / t_k / 1e9, tflops=flops / t_k / 1e12,
              kernel_bytes=peak_bytes(kern), xla_bytes=peak_bytes(ref), max_rel_err=err)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--kind", type=choice_list(KINDS), default="mla,gqa",
                  help=f"comma list of {', '.join(KINDS)}")
  ap.add_argument("--contexts", type=int_list(minimum=1), default="8192,32768")
  ap.add_argument("--queries", type=int, default=512)
  ap.add_argument("--topk", type=int, default=2048)
  ap.add_argument("--mla-heads", type=int, default=128)
  ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
  ap.add_argument("--impl", default="auto", help="kernel implementation (auto: per backend)")
  ap.add_argument("--check", action="store_true", help="compare outputs before timing")
  ap.add_argument("--backward", action="store_true", help="time forward + backward")
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--out", default="runs/bench_sparse_kernel")
  args = ap.parse_args(argv)
  impl = default_impl() if args.impl == "auto" else args.impl
  dtype = jnp.dtype(args.dtype)
  cases = [(kind, s) for kind in args.kind for s in args.contexts]
  print(f"device {jax.devices()[0].device_kind}  backend {jax.default_backend()}  kernel {impl}  "
        f"vs xla  T={args.queries}  top-{args.topk}  {args.dtype}"
        + ("  forward + backward" if args.backward else ""))
  print(f"{'case':>14} {'kernel ms':>10} {'xla ms':>9} {'speedup':>8} {'GB/s':>8} {'TFLOP/s':>8} "
        f"{'kernel MiB':>11} {'xla MiB':>9} {'max err':>9}")
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  results = []
  try:
    for kind, s in tqdm(cases, desc="sparse kernels", leave=False):
      k = min(args.topk, s)
      row = dict(kind=kind, context=s, queries=args.queries, topk=k, impl=impl, dtype=args.dtype,
                 backward=args.backward)
      try:
        row.update(_measure(args, kind, s, k, impl, dtype))
      except Exception as e:  # one case's failure keeps the others' figures
        row["error"] = error_text(e)
        tqdm.write(f"{kind + ' ' + str(s):>14} error: {row['error']}")
      else:
        tqdm.write(f"{kind + ' ' + str(s):>14} {row['kernel_s'] * 1e3:10.3f} "
                   f"{row['xla_s'] * 1e3:9.3f} {row['speedup']:7.2f}x {row['gbps']:8.1f} "
                   f"{row['tflops']:8.2f} {row['kernel_bytes'] / 2**20:11.1f} "
                   f"{row['xla_bytes'] / 2**20:9.1f} {row['max_rel_err']:9.2e}")
      results.append(row)
      write_json(out / "results.json", results)  # after every case: a killed run keeps them
  finally:
    write_json(out / "results.json", results)
  # bf16: the XLA path's gradients are scatter-added in bf16 (the kernels' backward in fp32).
  tol = 1e-3 if args.dtype == "float32" else (6e-2 if args.backward else 2e-2)
  failed = [r for r in results if r.get("error")]
  if failed:
    raise SystemExit(f"{len(failed)} of {len(results)} cases failed: "
                     + "; ".join(f"{r['kind']} {r['context']}: {r['error']}" for r in failed))
  if args.check and any(not (r["max_rel_err"] < tol) for r in results):
    raise SystemExit(f"kernel output differs from the reference (max_rel_err >= {tol})")
  return results


if __name__ == "__main__":
  main()
