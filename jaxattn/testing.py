"""Helpers for testing modules built on jaxattn."""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def random_module(ctor: Callable[[], nnx.Module], seed: int = 0) -> nnx.Module:
  """``ctor()`` built abstractly and filled with random weights drawn by NumPy.

  Kernels get a fan-in scaled normal (the ``o_proj`` fan-in spans its first two axes), norm scales
  ``1 + 0.2 N(0, 1)`` and everything else ``0.1 N(0, 1)``, so norms and biases matter in tests.
  The module's own initializers would run eagerly and compile once per parameter shape, which
  dominates small tests' runtime.  Parameter metadata (logical axes) is the constructor's.
  """
  module = nnx.eval_shape(ctor)
  rng = np.random.default_rng(seed)
  for path, var in nnx.to_flat_state(nnx.state(module, nnx.Param)):
    shape = var.get_value().shape
    if path[-1] == "kernel":
      fan_in = shape[0] * (shape[1] if path[0] == "o_proj" else 1)
      value = rng.standard_normal(shape) / math.sqrt(fan_in)
    elif path[-1] == "scale":
      value = 1 + 0.2 * rng.standard_normal(shape)
    else:
      value = 0.1 * rng.standard_normal(shape)
    var.set_value(jnp.asarray(value, var.get_value().dtype))
  return module


def prefill_then_decode(step: Callable, module, cache, x, prefill: int):
  """Runs ``step(module, cache, tokens) -> (y, cache)`` on the first ``prefill`` positions of ``x
  [B, T, D]``, then on one position at a time; returns the outputs ``[B, T, D]`` concatenated and
  the final cache (decode must reproduce the full pass)."""
  y, cache = step(module, cache, x[:, :prefill])
  outs = [y]
  for t in range(prefill, x.shape[1]):
    y, cache = step(module, cache, x[:, t:t + 1])
    outs.append(y)
  return jnp.concatenate(outs, axis=1), cache


def scrambled_paged_cache(cache, seed: int = 0):
  """``cache``, an empty ``PagedKVCache`` / ``PagedLatentCache``, with every floating-point pool
  NaN (a slot read that should not be shows in the result) and its free pages in a random order
  (each sequence's pages land scattered over the pool, not in table order)."""
  pools = {f.name: jnp.full_like(getattr(cache, f.name), jnp.nan)
           for f in dataclasses.fields(cache)
           if f.name.endswith("_pool") and getattr(cache, f.name) is not None
           and jnp.issubdtype(getattr(cache, f.name).dtype, jnp.floating)}
  order = np.random.default_rng(seed).permutation(cache.table.num_pages).astype(np.int32)
  table = dataclasses.replace(cache.table, free_pages=jnp.asarray(order))
  return dataclasses.replace(cache, **pools, table=table)


def pallas_calls(f: Callable, *args) -> list[tuple[tuple, list[tuple]]]:
  """``[(grid, input shapes)]`` of every ``pallas_call`` in ``f(*args)``'s jaxpr, nested ones
  included (inside ``shard_map`` these are the per-device shapes)."""
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "pallas_call":
        found.append((tuple(eqn.params["grid_mapping"].grid),
                      [tuple(v.aval.shape) for v in eqn.invars]))
      for param in eqn.params.values():
        for sub in param if isinstance(param, (list, tuple)) else (param,):
          inner = getattr(sub, "jaxpr", sub)
          if hasattr(inner, "eqns"):
            walk(inner)

  walk(jax.make_jaxpr(f)(*args).jaxpr)
  return found
