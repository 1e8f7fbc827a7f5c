"""DeepSeek Sparse Attention (DSA) formulas: lightning indexer, top-K selection, sparse attention.

Seed 3.7 "DeepSeek Sparse Attention" and the second seed's "Sparse attention (DSA)":

    I[t, s] = sum_j w[t, j] * ReLU(q^I[t, j] . k^I[s])         (indexer, causal: s <= t)
    S_t     = TopKIndices(I[t, :t+1], k)                        (at most k positions)
    u_t     = sum_{s in S_t} softmax_s(q_t . k_s * scale) v_s   (main attention on S_t only)

``H_I`` indexer heads ``j`` read ONE shared key per token (MQA style).  ``w`` is the per-token head
weight (DeepSeek-V3.2 folds ``H_I^-1/2 * d_I^-1/2`` into it).  The indexer picks positions; its
scores are not the attention weights.  Indices are ``int32 [B, T, k]``, the same for every head;
``-1`` marks "no position" (fewer than ``k`` available).  Training the indexer uses
``indexer_kl_loss``: KL from the main attention's head-summed distribution (stop-gradient) to the
indexer's softmax.

Everything here is the XLA reference (gathers); ``pallas_kernels.sparse_attention`` holds the
kernel that fetches only the selected rows.
"""

from __future__ import annotations

import functools

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jaxattn.ops.quantization import QUANT_FORMATS, QuantFormat, fake_quantize

_F32 = jnp.float32
NEG_INF = -jnp.inf


def _valid_keys(t, s, *, causal, q_offset, kv_lengths, batch):
  """Boolean ``[B, T, S]``: key ``s`` exists (``< kv_lengths``) and is visible from query ``t``."""
  kv = jnp.arange(s, dtype=jnp.int32)
  ok = jnp.ones((batch, t, s), bool)
  if causal:
    q_pos = q_offset + jnp.arange(t, dtype=jnp.int32)
    ok = ok & (kv[None, None, :] <= q_pos[None, :, None])
  if kv_lengths is not None:
    ok = ok & (kv[None, None, :] < jnp.asarray(kv_lengths, jnp.int32)[:, None, None])
  return ok


@functools.partial(jax.jit, static_argnames=('causal', 'quant', 'quant_block_size',))
def indexer_scores(
    q_index: Float[Array, "B T HI d"],
    k_index: Float[Array, "B S d"],
    weights: Float[Array, "B T HI"],
    *,
    causal: bool = True,
    q_offset: int | Int[Array, ""] = 0,
    kv_lengths: Int[Array, "B"] | None = None,
    quant: QuantFormat = None,
    quant_block_size: int | None = None,
) -> Float[Array, "B T S"]:
  """Lightning-indexer scores ``I [B, T, S]`` (fp32); invisible keys get ``-inf``.

  Args:
    q_index: indexer queries ``[B, T, H_I, d]``.
    k_index: the one shared indexer key per token ``[B, S, d]``.
    weights: per-token head weights ``[B, T, H_I]`` (any scaling already folded in).
    causal: key ``s`` is visible from query ``t`` only if ``s <= t + q_offset``.
    q_offset: position of query row 0 among the keys (decode: tokens already cached).
    kv_lengths: ``[B]`` number of valid keys (unfilled cache slots are invisible).
    quant: ``None`` (fp32 scoring), ``"int8"`` or ``"fp8"``: queries and keys are rounded through
      that format (per-token / per-``quant_block_size`` scales) before the dot products, as an
      8-bit scorer would see them.  Rotate with ``hadamard_transform`` first.
  """
  if q_index.ndim != 4 or k_index.ndim != 3 or weights.ndim != 3:
    raise ValueError(f"`q_index` [B, T, H_I, d], `k_index` [B, S, d], `weights` [B, T, H_I] have "
                     f"ranks 4, 3, 3; got shapes {q_index.shape}, {k_index.shape}, {weights.shape}.")
  b, t, hi, d = q_index.shape
  if k_index.shape[0] != b or k_index.shape[2] != d:
    raise ValueError(f"`k_index` {k_index.shape} must be [B={b}, S, d={d}] to match `q_index` "
                     f"{q_index.shape}.")
  if weights.shape != (b, t, hi):
    raise ValueError(f"`weights` must be [B, T, H_I] = {(b, t, hi)}, got {weights.shape}.")
  if quant not in QUANT_FORMATS:
    raise ValueError(f"`quant` must be one of {QUANT_FORMATS}, got {quant!r}.")
  q = fake_quantize(q_index, quant, block_size=quant_block_size)
  k = fake_quantize(k_index, quant, block_size=quant_block_size)
  logits = jnp.einsum("btjd,bsd->btjs", q, k, preferred_element_type=_F32)
  scores = jnp.einsum("btjs,btj->bts", jax.nn.relu(logits), weights.astype(_F32))
  ok = _valid_keys(t, k_index.shape[1], causal=causal, q_offset=q_offset, kv_lengths=kv_lengths,
                   batch=b)
  return jnp.where(ok, scores, NEG_INF)


def _check_k(k):
  if not isinstance(k, int) or isinstance(k, bool) or k < 1:
    raise ValueError(f"`k` (top-k) must be a positive int, got {k!r}.")


@functools.partial(jax.jit, static_argnames=('k',))
def topk_indices(scores: Float[Array, "B T S"], k: int) -> Int[Array, "B T k"]:
  """The positions of the ``k`` largest finite scores per query row, ``int32 [B, T, k]``.

  A row with fewer than ``k`` finite (visible) scores returns all of them and pads with ``-1``; so
  does ``k > S``.  Ties go to the lower position.  Order within a row is by decreasing score.
  """
  _check_k(k)
  if scores.ndim != 3:
    raise ValueError(f"`scores` must be [B, T, S], got shape {scores.shape}.")
  s = scores.shape[-1]
  kk = min(k, s)
  vals, idx = jax.lax.top_k(scores.astype(_F32), kk)
  idx = jnp.where(jnp.isfinite(vals), idx.astype(jnp.int32), -1)
  if kk < k:
    idx = jnp.pad(idx, ((0, 0), (0, 0), (0, k - kk)), constant_values=-1)
  return idx


def indices_to_mask(indices: Int[Array, "B T k"], num_keys: int) -> Bool[Array, "B 1 T S"]:
  """The dense boolean mask ``[B, 1, T, S]`` (True = attend) that a selection stands for."""
  onehot = indices[..., None] == jnp.arange(num_keys, dtype=jnp.int32)  # [B, T, k, S]; -1 matches none
  return jnp.any(onehot, axis=2)[:, None]


def _check_indices(indices, b, t, name="indices"):
  if indices.ndim != 3 or indices.shape[:2] != (b, t):
    raise ValueError(f"`{name}` must be [B={b}, T={t}, k], got shape {indices.shape}.")
  if not jnp.issubdtype(indices.dtype, jnp.integer):
    raise ValueError(f"`{name}` must be an integer array, got dtype {indices.dtype}.")


@functools.partial(jax.jit, static_argnames=('scale',))
def sparse_attention(
    query: Float[Array, "B T N H"],
    key: Float[Array, "B S K H"],
    value: Float[Array, "B S K h"],
    indices: Int[Array, "B T k"],
    *,
    scale: float | None = None,
) -> Float[Array, "B T N h"]:
  """Attention of each query over only its selected key positions (gather reference).

  ``indices [B, T, k]`` (from ``topk_indices``; ``-1`` = unused slot) are shared by all heads;
  GQA/MQA as in ``dot_product_attention`` (``N % K == 0``).  Logits and softmax in fp32; a row with
  no valid index yields zeros.  Cost ``O(B T k N H)``, independent of ``S`` apart from the gather.
  """
  if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
    raise ValueError(f"`query`, `key`, `value` must be [B, T, N, H], [B, S, K, H], [B, S, K, h]; "
                     f"got {query.shape}, {key.shape}, {value.shape}.")
  b, t, n, h = query.shape
  s, kh = key.shape[1], key.shape[2]
  if key.shape[0] != b or key.shape[3] != h:
    raise ValueError(f"`key` {key.shape} must be [B={b}, S, K, H={h}].")
  if value.shape[:3] != key.shape[:3]:
    raise ValueError(f"`value` {value.shape} must share [B, S, K] with `key` {key.shape}.")
  if n % kh:
    raise ValueError(f"query heads N={n} must be a multiple of key heads K={kh}.")
  _check_indices(indices, b, t)
  if scale is None:
    scale = 1.0 / math.sqrt(h)
  valid = indices >= 0                                            # [B, T, k]
  safe = jnp.where(valid, indices, 0).astype(jnp.int32)
  gather = jax.vmap(lambda x, i: x[i])                            # per batch row: [S, ...][T, k]
  k_sel = gather(key, safe).astype(_F32)                          # [B, T, k, K, H]
  v_sel = gather(value, safe).astype(_F32)                        # [B, T, k, K, h]
  g = n // kh
  q = query.astype(_F32).reshape(b, t, kh, g, h)
  logits = jnp.einsum("btkgh,btjkh->btkgj", q, k_sel) * scale    # [B, T, K, G, k]
  logits = jnp.where(valid[:, :, None, None, :], logits, NEG_INF)
  m = jnp.max(logits, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(logits - m)
  l = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(l > 0, l, 1.0)
  out = jnp.einsum("btkgj,btjkh->btkgh", p, v_sel)
  return out.reshape(b, t, n, value.shape[-1]).astype(query.dtype)


@functools.partial(jax.jit, static_argnames=('scale',))
def sparse_mla_attention(
    q_nope: Float[Array, "B T N P"],
    q_rope: Float[Array, "B T N R"],
    c_kv: Float[Array, "B S C"],
    k_rope: Float[Array, "B S R"],
    w_uk: Float[Array, "C N P"],
    w_uv: Float[Array, "C N h"],
    indices: Int[Array, "B T k"],
    *,
    scale: float | None = None,
) -> Float[Array, "B T N h"]:
  """DSA on MLA (DeepSeek-V3.2): sparse attention over the selected latent rows, absorbed form.

  As ``jaxattn.ops.mla.mla_attention(mode="absorbed")``: queries are mapped into latent space
  (``q^C_i W_up^K_i^T``), attend against the selected ``[c_KV, k^R]`` rows as one shared key whose
  first ``C`` entries are the value, and ``W_up^V`` is applied after the sum.
  """
  if q_nope.ndim != 4 or q_rope.ndim != 4 or c_kv.ndim != 3 or k_rope.ndim != 3:
    raise ValueError(f"`q_nope` [B,T,N,P], `q_rope` [B,T,N,R], `c_kv` [B,S,C], `k_rope` [B,S,R]: got "
                     f"{q_nope.shape}, {q_rope.shape}, {c_kv.shape}, {k_rope.shape}.")
  b, t, n, p = q_nope.shape
  c, r = c_kv.shape[2], q_rope.shape[3]
  if w_uk.shape != (c, n, p) or w_uv.shape[:2] != (c, n):
    raise ValueError(f"`w_uk` must be [C, N, P] = {(c, n, p)} and `w_uv` [C={c}, N={n}, h]; got "
                     f"{w_uk.shape}, {w_uv.shape}.")
  if k_rope.shape != c_kv.shape[:2] + (r,) or q_rope.shape[:3] != (b, t, n):
    raise ValueError(f"`k_rope` {k_rope.shape} / `q_rope` {q_rope.shape} do not match `c_kv` "
                     f"{c_kv.shape} / `q_nope` {q_nope.shape}.")
  if scale is None:
    scale = 1.0 / math.sqrt(p + r)
  dt = q_nope.dtype
  q_lat = jnp.einsum("btnp,cnp->btnc", q_nope, w_uk.astype(dt), preferred_element_type=_F32)
  query = jnp.concatenate([q_lat.astype(dt), q_rope], axis=-1)    # [B, T, N, C + R]
  kv = jnp.concatenate([c_kv, k_rope], axis=-1)[:, :, None, :]   # [B, S, 1, C + R]
  o_lat = sparse_attention(query, kv, kv, indices, scale=scale)[..., :c]  # [B, T, N, C]
  return jnp.einsum("btnc,cnh->btnh", o_lat, w_uv.astype(dt),
                    preferred_element_type=_F32).astype(dt)


@jax.jit
def indexer_kl_loss(
    attn_weights: Float[Array, "B N T S"],
    index_scores: Float[Array, "B T S"],
    mask: Bool[Array, "B T S"] | None = None,
) -> Float[Array, ""]:
  """DSA's indexer training loss: ``mean_t KL(p_t || softmax(I_t))`` over the allowed keys.

  ``p_t`` is the main attention's distribution summed over heads and L1-renormalized over the
  allowed keys, with ``stop_gradient`` (only the indexer learns from it).  ``mask [B, T, S]``
  restricts both distributions: the causal keys in dense warm-up, the selected set ``S_t`` in the
  sparse stage (``indices_to_mask``); ``-inf`` scores are excluded as well.  Rows with nothing
  allowed contribute zero.  Returns an fp32 scalar.
  """
  if attn_weights.ndim != 4 or index_scores.ndim != 3:
    raise ValueError(f"`attn_weights` must be [B, N, T, S] and `index_scores` [B, T, S]; got "
                     f"{attn_weights.shape}, {index_scores.shape}.")
  b, _, t, s = attn_weights.shape
  if index_scores.shape != (b, t, s):
    raise ValueError(f"`index_scores` must be [B, T, S] = {(b, t, s)}, got {index_scores.shape}.")
  allowed = jnp.isfinite(index_scores)
  if mask is not None:
    if mask.shape != (b, t, s):
      raise ValueError(f"`mask` must be [B, T, S] = {(b, t, s)}, got {mask.shape}.")
    allowed = allowed & mask
  target = jnp.where(allowed, jnp.sum(jax.lax.stop_gradient(attn_weights).astype(_F32), axis=1), 0.)
  total = jnp.sum(target, axis=-1, keepdims=True)
  target = target / jnp.where(total > 0, total, 1.0)
  logits = jnp.where(allowed, index_scores.astype(_F32), NEG_INF)
  m = jnp.max(logits, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  log_q = logits - m - jnp.log(jnp.sum(jnp.where(allowed, jnp.exp(logits - m), 0.0), axis=-1,
                                       keepdims=True).clip(min=1e-30))
  pos = target > 0
  kl = jnp.where(pos, target * (jnp.log(jnp.where(pos, target, 1.0)) - jnp.where(pos, log_q, 0.0)),
                 0.0)
  return jnp.sum(kl) / (b * t)
