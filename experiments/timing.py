"""Shared measurement helpers for the benchmark scripts: compile, time, memory, matmul rate, and
strict-JSON output."""

from __future__ import annotations

import json
import math
import os
import pathlib
import time

import jax
import jax.numpy as jnp

AUTO = "auto"
ROUND_S = 0.01           # an "auto" round lasts at least this long (when MAX_INNER allows) ...
MAX_INNER = 50           # ... with at most this many calls queued
QUEUED_BYTES = 16 << 30  # ... whose outputs (all alive until the round's end) fit in this


def compile_timed(fn, *args):
  """``(compiled executable, compile seconds)`` of ``jax.jit(fn)`` for these arguments."""
  t0 = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  return compiled, time.perf_counter() - t0


def _out_bytes(out) -> int:
  return sum(int(getattr(x, "nbytes", 0) or 0) for x in jax.tree.leaves(out))


def auto_inner(call_s: float, out_bytes: int = 0, *, round_s: float = ROUND_S,
               min_inner: int = 1, max_inner: int = MAX_INNER,
               queued_bytes: int = QUEUED_BYTES) -> int:
  """Calls per timing round for a call measured at ``call_s`` seconds (host dispatch and sync
  included): enough that a round lasts ``round_s``, at most ``max_inner`` and no more than fit
  their queued outputs (``out_bytes`` each, all alive until the round ends) in ``queued_bytes``;
  at least ``min_inner`` (and 1) whatever those say."""
  want = math.ceil(round_s / call_s) if call_s > 0 else max_inner
  cap = max_inner if out_bytes <= 0 else min(max_inner, queued_bytes // out_bytes)
  return max(1, min_inner, min(cap, want))


def best_time(compiled, args, repeats: int, inner: int | str = 1, *, min_inner: int = 1,
              max_inner: int = MAX_INNER, round_s: float = ROUND_S) -> float:
  """Best wall time per call over ``repeats`` rounds after one warm-up call, in seconds.

  Each round issues ``inner`` calls back to back and waits for the last: on an accelerator the
  calls queue asynchronously, so the host's dispatch cost and the one sync per round hide behind
  the device's work.  ``inner="auto"``: time one more call on its own after the warm-up and queue
  enough per round that a round lasts ``round_s`` (``auto_inner``: between ``min_inner`` and
  ``max_inner``), so a 0.3 ms kernel is not reported ~10% slow for ~30 us of dispatch + sync."""
  out = jax.block_until_ready(compiled(*args))
  if inner == AUTO:
    t0 = time.perf_counter()
    out = jax.block_until_ready(compiled(*args))
    inner = auto_inner(time.perf_counter() - t0, _out_bytes(out), round_s=round_s,
                       min_inner=min_inner, max_inner=max_inner)
  elif not (isinstance(inner, int) and inner >= 1):
    raise ValueError(f"inner must be an int >= 1 or {AUTO!r}, got {inner!r}")
  del out
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    for _ in range(inner):
      out = compiled(*args)
    jax.block_until_ready(out)
    del out
    best = min(best, (time.perf_counter() - t0) / inner)
  return best


def peak_bytes(compiled) -> float:
  """Temp + argument + output bytes from the compiled executable's memory analysis (NaN if none)."""
  m = compiled.memory_analysis()
  if m is None:
    return float("nan")
  return float(m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes)


def matmul_rate(n: int = 4096, dtype=jnp.float32, repeats: int = 3,
                inner: int | str = AUTO) -> float:
  """FLOP/s of one ``n x n x n`` matmul on random data (fp32 accumulation): the practical peak."""
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
  b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(dtype)
  f, _ = compile_timed(
      lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(dtype), a, b)
  return 2 * n**3 / best_time(f, (a, b), repeats, inner=inner)


def error_text(e: BaseException, width: int = 200) -> str:
  """``"ExcType: first line of the message"`` (cut to ``width`` characters), for a one-line
  report."""
  return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:width]}"


def strict_json(obj):
  """``obj`` with every non-finite float (NaN, +-inf) as None, so ``json.dumps`` writes strict
  JSON (``null``) rather than ``NaN``, which strict parsers refuse; tuples become lists."""
  if isinstance(obj, float):
    return obj if math.isfinite(obj) else None
  if isinstance(obj, dict):
    return {k: strict_json(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [strict_json(v) for v in obj]
  if hasattr(obj, "item") and getattr(obj, "shape", None) == ():   # NumPy / JAX scalars
    return strict_json(obj.item())
  return obj


def write_json(path, obj) -> None:
  """Write ``obj`` as strict JSON to ``path`` atomically (a temporary file, then a rename), so a
  run killed mid-write leaves the previous complete file, never a truncated one."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(path.name + ".tmp")
  tmp.write_text(json.dumps(strict_json(obj), indent=1, allow_nan=False))
  os.replace(tmp, path)
