"""Shared measurement helpers for the benchmark scripts: compile, time, memory, matmul rate."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp


def compile_timed(fn, *args):
  """``(compiled executable, compile seconds)`` of ``jax.jit(fn)`` for these arguments."""
  t0 = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  return compiled, time.perf_counter() - t0


def best_time(compiled, args, repeats: int, inner: int = 1) -> float:
  """Best wall time per call over ``repeats`` rounds after one warm-up call, in seconds.

  Each round issues ``inner`` calls back to back and waits for the last: on an accelerator the
  calls queue asynchronously, so the host's dispatch cost hides behind the device's work (use
  ``inner > 1`` for sub-millisecond kernels)."""
  jax.block_until_ready(compiled(*args))
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    for _ in range(inner):
      out = compiled(*args)
    jax.block_until_ready(out)
    best = min(best, (time.perf_counter() - t0) / inner)
  return best


def peak_bytes(compiled) -> float:
  """Temp + argument + output bytes from the compiled executable's memory analysis (NaN if none)."""
  m = compiled.memory_analysis()
  if m is None:
    return float("nan")
  return float(m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes)


def matmul_rate(n: int = 4096, dtype=jnp.float32, repeats: int = 3) -> float:
  """FLOP/s of one ``n x n x n`` matmul on random data (fp32 accumulation): the practical peak."""
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
  b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(dtype)
  f, _ = compile_timed(
      lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(dtype), a, b)
  return 2 * n**3 / best_time(f, (a, b), repeats)
