"""What the TPU and GPU top-K sparse kernels share: argument checks, running under a device mesh,
and MLA's absorption."""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pallas_kernels.flash_attention import sharded

_F32 = jnp.float32


def check_indices(indices, b: int, t: int) -> None:
  if indices.ndim != 3 or indices.shape[:2] != (b, t) or indices.shape[2] < 1:
    raise ValueError(f"`indices` must be [B={b}, T={t}, k>=1], got shape {indices.shape}.")


def check_gqa(query, key, value, indices, scale) -> float:
  """Checks ``sparse_attention``'s arguments; returns the scale (default ``1 / sqrt(H)``)."""
  if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
    raise ValueError(f"`query`, `key`, `value` must be [B, T, N, H], [B, S, K, H], [B, S, K, h]; "
                     f"got {query.shape}, {key.shape}, {value.shape}.")
  b, t, n, h = query.shape
  kh = key.shape[2]
  if key.shape[0] != b or key.shape[3] != h or value.shape[:3] != key.shape[:3]:
    raise ValueError(f"`key` {key.shape} / `value` {value.shape} must be [B={b}, S, K, H={h}] / "
                     "[B, S, K, h].")
  if n % kh:
    raise ValueError(f"query heads N={n} must be a multiple of key heads K={kh}.")
  check_indices(indices, b, t)
  return 1.0 / math.sqrt(h) if scale is None else float(scale)


def check_latent(q_latent, q_rope, c_kv, k_rope, indices) -> None:
  """Checks the latent-space arguments of DSA on MLA."""
  b, t, n, c = q_latent.shape
  s, r = c_kv.shape[1], k_rope.shape[-1]
  if c_kv.shape != (b, s, c) or k_rope.shape != (b, s, r) or q_rope.shape != (b, t, n, r):
    raise ValueError(f"`q_latent` [B,T,N,C], `q_rope` [B,T,N,R], `c_kv` [B,S,C], `k_rope` [B,S,R]"
                     f": got {q_latent.shape}, {q_rope.shape}, {c_kv.shape}, {k_rope.shape}.")
  check_indices(indices, b, t)


def flat_rows(indices, num_keys: int):
  """Row addresses of ``[B * S]``-row pools for ``indices [B, T, k]`` -> ``[B * T, k]`` int32;
  ``-1`` and out-of-range positions become ``-1``."""
  b = indices.shape[0]
  valid = (indices >= 0) & (indices < num_keys)
  base = (jnp.arange(b, dtype=jnp.int32) * num_keys)[:, None, None]
  return jnp.where(valid, indices.astype(jnp.int32) + base, -1).reshape(-1, indices.shape[2])


def pad_rows(rows, block_k: int):
  """``rows [M, k]`` padded with ``-1`` to whole blocks of ``block_k`` slots, and per row the
  number of blocks a kernel visits: up to the one holding its last valid slot (0 when none)."""
  k = rows.shape[1]
  k_pad = -(-k // block_k) * block_k
  rows = jnp.pad(rows.astype(jnp.int32), ((0, 0), (0, k_pad - k)), constant_values=-1)
  last = jnp.max(jnp.where(rows >= 0, jnp.arange(k_pad, dtype=jnp.int32), -1), axis=1)
  return rows, (last + block_k) // block_k


def run_gqa_sharded(local, query, key, value, indices, mesh):
  """``local(query, key, value, indices)`` under ``mesh`` (None: the context mesh; no mesh: called
  directly) in ``jax.shard_map``: batch (queries, cache, indices) over the ``"batch"`` axes, query
  and KV heads over the ``"heads"`` axes when both divide (whole GQA groups per shard).  Each
  shard gathers its own batch rows' selected rows for its own heads: no communication."""
  b, _, n, _ = query.shape

  def specs(mesh):
    batch, heads = sharded.plan_specs(mesh, b, n, key.shape[2])
    spec = P(batch, None, heads, None)
    return (spec, spec, spec, P(batch, None, None)), spec

  return sharded.run_sharded(local, (query, key, value, indices), mesh, specs)


def run_latent_sharded(local, q_latent, q_rope, c_kv, k_rope, indices, mesh):
  """As ``run_gqa_sharded`` for DSA on MLA: every head reads the same latent rows, so the latent
  cache splits over batch only and the heads over the ``"heads"`` axes."""
  b, _, n, _ = q_latent.shape

  def specs(mesh):
    batch, heads = sharded.latent_specs(mesh, b, n)
    q, rows = P(batch, None, heads, None), P(batch, None, None)
    return (q, q, rows, rows, rows), q

  return sharded.run_sharded(local, (q_latent, q_rope, c_kv, k_rope, indices), mesh, specs)


def absorbed(latent_fn, q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, indices, scale):
  """DSA on MLA in absorbed form around a latent-space kernel: ``q~ = q^C W_up^K`` per head,
  ``latent_fn(q~, q^R, c_KV, k^R, indices, scale) -> [B, T, N, C]``, then ``W_up^V``."""
  b, t, n, p = q_nope.shape
  c, r = c_kv.shape[-1], q_rope.shape[-1]
  if w_uk.shape != (c, n, p) or w_uv.shape[:2] != (c, n):
    raise ValueError(f"`w_uk` must be [C, N, P] = {(c, n, p)} and `w_uv` [C={c}, N={n}, h]; got "
                     f"{w_uk.shape}, {w_uv.shape}.")
  scale = 1.0 / math.sqrt(p + r) if scale is None else float(scale)
  dt = q_nope.dtype
  q_lat = jnp.einsum("btnp,cnp->btnc", q_nope, w_uk.astype(dt), preferred_element_type=_F32)
  o_lat = latent_fn(q_lat.astype(dt), q_rope, c_kv, k_rope, indices, scale)
  return jnp.einsum("btnc,cnh->btnh", o_lat.astype(dt), w_uv.astype(dt),
                    preferred_element_type=_F32).astype(dt)
