"""The attention score of one block of queries against one block of keys.

One helper serves the reference formula, the chunked XLA path (forward and backward) and the tests,
so the order of operations is written once:

    logits = scale * (q . k)            fp32 accumulation
           + bias                       (additive: T5 bias, user bias)
           + alibi_slope * (j - i)      (ALiBi from slopes and positions, never a stored T x S table)
    logits = cap * tanh(logits / cap)   (soft-cap, Gemma-2 style, when logits_soft_cap is set)
    logits = where(mask, logits, -inf)

Layouts used inside the ops (GQA-grouped): queries ``[B, K, G, T, H]`` (``N = K * G`` query heads
share KV head ``k``), keys ``[B, K, S, H]``, logits ``[B, K, G, T, S]``.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxattn.ops.masks import Mask

NEG_INF = -jnp.inf


def group_heads(x, num_kv_heads):
  """``[..., N, X, Y]`` -> ``[..., K, G, X, Y]`` for arrays broadcastable over heads (size 1 kept)."""
  if x is None:
    return None
  n = x.shape[-3]
  if n == 1:
    return x[..., None, :, :]
  return x.reshape(*x.shape[:-3], num_kv_heads, n // num_kv_heads, *x.shape[-2:])


def block_logits(
    q,  # [B, K, G, Tb, H]
    k,  # [B, K, Sb, H]
    *,
    scale: float,
    q_idx,  # [Tb] int32: row index of each query in the full sequence
    kv_idx,  # [Sb] int32: column index of each key
    q_offset=0,
    bias=None,  # broadcastable to [B, K, G, Tb, Sb]
    alibi_slopes=None,  # [K, G] fp32 (grouped)
    logits_soft_cap: float | None = None,
    mask: Mask | None = None,
    mask_array=None,  # bool, broadcastable to [B, K, G, Tb, Sb]
):
  """Masked fp32 logits ``[B, K, G, Tb, Sb]`` and the boolean ``allowed`` (or None when unmasked)."""
  logits = jnp.einsum("bkgth,bksh->bkgts", q, k, preferred_element_type=jnp.float32)
  logits = logits * jnp.float32(scale)
  if bias is not None:
    logits = logits + bias.astype(jnp.float32)
  if alibi_slopes is not None:
    rel = (kv_idx[None, :] - (q_idx[:, None] + q_offset)).astype(jnp.float32)  # [Tb, Sb]
    logits = logits + alibi_slopes[:, :, None, None].astype(jnp.float32) * rel
  if logits_soft_cap is not None:
    cap = jnp.float32(logits_soft_cap)
    logits = cap * jnp.tanh(logits / cap)
  allowed = None
  if mask is not None:
    m = mask(q_idx[:, None], kv_idx[None, :], q_offset)  # [Tb, Sb] or [B, Tb, Sb]
    m = jnp.asarray(m)
    allowed = m[:, None, None] if m.ndim == 3 else m
  if mask_array is not None:
    allowed = mask_array if allowed is None else allowed & mask_array
  if allowed is not None:
    logits = jnp.where(allowed, logits, NEG_INF)
  return logits, allowed


def safe_softmax_stats(logits, axis=-1):
  """Row max (0 for fully masked rows, so ``exp(-inf - m) = 0`` and no NaN), exponentials, row sum."""
  m = jnp.max(logits, axis=axis, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(logits - m)
  l = jnp.sum(p, axis=axis, keepdims=True)
  return m, p, l


def lse_from_stats(m, l):
  """log-sum-exp of a row from its max and sum; ``-inf`` for a fully masked row."""
  return jnp.where(l != 0, m + jnp.log(jnp.where(l != 0, l, 1.0)), NEG_INF)


def finalize(acc, l, out_dtype):
  """acc / l with fully masked rows (l == 0) giving zeros; a NaN row stays NaN."""
  return jnp.where(l != 0, acc / jnp.where(l != 0, l, 1.0), 0.0).astype(out_dtype)


def ungroup(x):
  """``[B, K, G, T, X]`` -> ``[B, T, K*G, X]``."""
  b, kh, g, t, d = x.shape
  return jnp.transpose(x, (0, 3, 1, 2, 4)).reshape(b, t, kh * g, d)


def ungroup_lse(lse):
  """``[B, K, G, T]`` -> ``[B, N, T]``."""
  b, kh, g, t = lse.shape
  return lse.reshape(b, kh * g, t)


__all__ = ["block_logits", "safe_softmax_stats", "lse_from_stats", "finalize", "group_heads",
           "ungroup", "ungroup_lse", "NEG_INF"]
