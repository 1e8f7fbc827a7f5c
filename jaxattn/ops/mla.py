"""Multi-head latent attention (MLA, DeepSeek-V2/V3): attention over a compressed, shared KV latent.

Seed 3.1 "Multi-Head Latent Attention" and 3.6 "Decoupled RoPE".  Each token keeps one latent
``c_KV = RMSNorm(x W_down^KV)`` of size ``C`` and one RoPE-rotated key ``k^R = RoPE(x W^KR)`` of size
``R`` shared by all heads.  Head ``i`` sees

    content key   k^C_i = c_KV W_up^K_i          [P]   (never rotated)
    value         v_i   = c_KV W_up^V_i          [h]
    score_i(m, n) = q^C_{m,i} . k^C_{n,i}  +  q^R_{m,i} . k^R_n      (content + position)

so the position term depends on ``m, n`` only through ``n - m`` and the content term not at all.

Shape letters (the package docstring has the common ones): ``P`` content ("no position") head size
``qk_nope_head_dim``, ``R`` rotary head size ``qk_rope_head_dim``, so a query/key head has
``H = P + R``; ``h`` value head size; ``C`` latent size ``kv_lora_rank``; ``Cq`` query latent size
``q_lora_rank``.

Two ways to evaluate the same attention (``mode``), equal up to rounding:

* ``"naive"``: reconstruct per-head keys ``[B, S, N, P + R]`` and values ``[B, S, N, h]`` from the
  latent and run multi-head attention.  Costs ``S * C * N * (P + h)`` multiply-adds per call, so it
  suits prefill/training (amortized over ``T`` queries) and is slow for decode.
* ``"absorbed"``: the seed's ``A_i = W_up^Q_i (W_up^K_i)^T`` trick, associated the cheap way round:
  each query is mapped into latent space once, ``q~_i = q^C_i (W_up^K_i)^T`` ``[C]``, and attends
  against the cached rows ``[c_KV, k^R]`` directly.  All heads then read ONE shared key of width
  ``C + R`` whose first ``C`` entries are also the value -- MQA over latents -- and the per-head
  value up-projection ``W_up^V_i`` is applied after the softmax-weighted sum (it commutes with the
  sum), before the output projection.  Per-head keys and values are never materialized.

Both paths call ``jaxattn.ops.attention.dot_product_attention`` with an explicit ``scale`` (the
absorbed query is wider than ``H``, so the default ``1/sqrt(width)`` would be wrong).
"""

from __future__ import annotations

import math
from typing import Literal, Sequence

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jaxattn.ops.attention import Implementation, check_scale, dot_product_attention
from jaxattn.ops.masks import Mask
from jaxattn.ops.rope import RopeScaling, yarn_mscale

Mode = Literal["naive", "absorbed"]
MODES: tuple[str, ...] = ("naive", "absorbed")

_F32 = jnp.float32


def mla_softmax_scale(qk_head_dim: int, scaling: RopeScaling | None = None) -> float:
  """DeepSeek's softmax scale: ``1 / sqrt(P + R)``, times ``yarn_mscale(factor, mscale_all_dim)**2``
  when a RoPE scaling with ``mscale_all_dim`` is on (YaRN context extension, DeepSeek-V2/V3).

  The scaling's own attention factor (``mscale / mscale_all_dim``) is separate: transformers and
  ``jaxattn.ops.rope.apply_rope`` multiply cos and sin by it, so it scales only the position term.
  """
  if not isinstance(qk_head_dim, int) or qk_head_dim < 1:
    raise ValueError(f"`qk_head_dim` must be a positive int (P + R), got {qk_head_dim!r}.")
  scale = qk_head_dim ** -0.5
  if scaling is not None and scaling.mscale_all_dim:
    m = yarn_mscale(scaling.factor, scaling.mscale_all_dim)
    scale = scale * m * m
  return float(scale)


def _validate(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, mode, scale):
  if mode not in MODES:
    raise ValueError(f"`mode` must be one of {MODES}, got {mode!r}.")
  for name, x, rank in (("q_nope", q_nope, 4), ("q_rope", q_rope, 4), ("c_kv", c_kv, 3),
                        ("k_rope", k_rope, 3), ("w_uk", w_uk, 3), ("w_uv", w_uv, 3)):
    if x.ndim != rank:
      raise ValueError(f"`{name}` must have rank {rank}, got shape {x.shape}.")
  b, t, n, p = q_nope.shape
  if q_rope.shape[:3] != (b, t, n):
    raise ValueError(f"`q_rope` {q_rope.shape} must share [B, T, N] with `q_nope` {q_nope.shape}.")
  r = q_rope.shape[3]
  if c_kv.shape[0] != b or k_rope.shape[:2] != c_kv.shape[:2]:
    raise ValueError(f"`c_kv` {c_kv.shape} and `k_rope` {k_rope.shape} must be [B={b}, S, C] and "
                     "[B, S, R] with the same S.")
  if k_rope.shape[2] != r:
    raise ValueError(f"`k_rope` has R={k_rope.shape[2]} rotary dims, `q_rope` has {r}; they must "
                     "match.")
  c = c_kv.shape[2]
  if w_uk.shape != (c, n, p):
    raise ValueError(f"`w_uk` must be [C, N, P] = {(c, n, p)}, got {w_uk.shape}.")
  if w_uv.shape[:2] != (c, n):
    raise ValueError(f"`w_uv` must be [C={c}, N={n}, h], got {w_uv.shape}.")
  dtypes = {q_nope.dtype, q_rope.dtype, c_kv.dtype, k_rope.dtype}
  if len(dtypes) != 1:
    raise ValueError(f"`q_nope`, `q_rope`, `c_kv`, `k_rope` dtypes must match, got {q_nope.dtype}, "
                     f"{q_rope.dtype}, {c_kv.dtype}, {k_rope.dtype}.")
  check_scale(scale)


def _mm(spec, x, w):
  """``einsum`` in the activation dtype with fp32 accumulation, cast back to that dtype."""
  return jnp.einsum(spec, x, w.astype(x.dtype), preferred_element_type=_F32).astype(x.dtype)


def mla_attention(
    q_nope: Float[Array, "B T N P"],
    q_rope: Float[Array, "B T N R"],
    c_kv: Float[Array, "B S C"],
    k_rope: Float[Array, "B S R"],
    w_uk: Float[Array, "C N P"],
    w_uv: Float[Array, "C N h"],
    mask: Bool[Array, "#B #N #T #S"] | Mask | None = None,
    *,
    mode: Mode = "naive",
    scale: float | None = None,
    is_causal: bool = False,
    segment_ids: Int[Array, "B T"] | tuple[Int[Array, "B T"], Int[Array, "B S"]] | None = None,
    kv_lengths: Int[Array, "B"] | None = None,
    q_offset: int | Int[Array, ""] = 0,
    implementation: Implementation | Sequence[Implementation] | None = None,
) -> Float[Array, "B T N h"]:
  """MLA attention of queries against latent keys/values; per-head outputs before ``o_proj``.

  Args:
    q_nope: content queries ``[B, T, N, P]`` (``q^C``, not rotated).
    q_rope: rotated position queries ``[B, T, N, R]`` (``q^R``, RoPE already applied).
    c_kv: latents ``[B, S, C]`` (after their RMSNorm), e.g. a ``LatentCache``'s ``c_kv``.
    k_rope: rotated position keys ``[B, S, R]``, one per token shared by all heads.
    w_uk: key up-projection ``[C, N, P]``: ``k^C_i = c_KV @ w_uk[:, i]``.
    w_uv: value up-projection ``[C, N, h]``: ``v_i = c_KV @ w_uv[:, i]``.
    mask: extra boolean ``[B|1, N|1, T, S]`` array (True = attend) or a ``Mask``.
    mode: ``"naive"`` (reconstruct per-head K and V) or ``"absorbed"`` (attend over latents).
    scale: logits scale, default ``1 / sqrt(P + R)`` (see ``mla_softmax_scale`` for YaRN).
    is_causal, segment_ids, kv_lengths, q_offset, implementation: as in ``dot_product_attention``
      (a decode step over a cache passes ``kv_lengths`` and ``q_offset = cache index``).

  Returns:
    ``[B, T, N, h]`` in the dtype of the activations.  Matmuls accumulate in fp32, softmax is fp32.
  """
  _validate(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, mode, scale)
  b, t, n, p = q_nope.shape
  s, c, r = c_kv.shape[1], c_kv.shape[2], q_rope.shape[3]
  if scale is None:
    scale = 1.0 / math.sqrt(p + r)
  attn = dict(scale=scale, is_causal=is_causal, segment_ids=segment_ids, kv_lengths=kv_lengths,
              q_offset=q_offset, implementation=implementation)
  if mode == "naive":
    k_nope = _mm("bsc,cnp->bsnp", c_kv, w_uk)                      # [B, S, N, P]
    value = _mm("bsc,cnh->bsnh", c_kv, w_uv)                       # [B, S, N, h]
    k_pos = jnp.broadcast_to(k_rope[:, :, None, :], (b, s, n, r))  # the shared key, every head
    query = jnp.concatenate([q_nope, q_rope], axis=-1)             # [B, T, N, P + R]
    key = jnp.concatenate([k_nope, k_pos], axis=-1)                # [B, S, N, P + R]
    return dot_product_attention(query, key, value, None, mask, **attn)
  # Absorbed: q^C_i . (c W_up^K_i) = (q^C_i W_up^K_i^T) . c, so fold W_up^K into the query.
  q_latent = _mm("btnp,cnp->btnc", q_nope, w_uk)                   # [B, T, N, C]
  query = jnp.concatenate([q_latent, q_rope], axis=-1)             # [B, T, N, C + R]
  # One shared KV head: the cached row [c_KV, k^R] is the key, and (its first C entries) the value.
  # Passing the whole row as the value and dropping the last R outputs costs R/C more work in the
  # weighted sum but avoids copying a strided [B, S, C] slice of the cache on every step.
  kv = jnp.concatenate([c_kv, k_rope], axis=-1)[:, :, None, :]     # [B, S, 1, C + R]
  o_latent = dot_product_attention(query, kv, kv, None, mask, **attn)[..., :c]  # [B, T, N, C]
  # sum_n p_n (c_n W_up^V_i) = (sum_n p_n c_n) W_up^V_i: up-project once per query, not per key.
  return _mm("btnc,cnh->btnh", o_latent, w_uv)


def mla_score_terms(
    q_nope: Float[Array, "B T N P"],
    q_rope: Float[Array, "B T N R"],
    c_kv: Float[Array, "B S C"],
    k_rope: Float[Array, "B S R"],
    w_uk: Float[Array, "C N P"],
) -> tuple[Float[Array, "B N T S"], Float[Array, "B N T S"]]:
  """The two unscaled, unmasked fp32 score terms ``(content, position)``, each ``[B, N, T, S]``:
  ``q^C_i . k^C_i`` and ``q^R_i . k^R``.  ``scale * (content + position)`` are the logits."""
  k_nope = jnp.einsum("bsc,cnp->bsnp", c_kv.astype(_F32), w_uk.astype(_F32))
  content = jnp.einsum("btnp,bsnp->bnts", q_nope.astype(_F32), k_nope)
  position = jnp.einsum("btnr,bsr->bnts", q_rope.astype(_F32), k_rope.astype(_F32))
  return content, position


def absorb_query_weights(w_uq_nope: Float[Array, "Cq N P"],
                         w_uk: Float[Array, "C N P"]) -> Float[Array, "Cq N C"]:
  """The seed's pre-merged ``A_i = W_up^Q_i (W_up^K_i)^T`` (fp32): ``c_Q A_i . c_KV = q^C_i . k^C_i``.

  ``w_uq_nope`` is the content part of the query up-projection (``c_Q -> q^C``).  ``A`` holds
  ``Cq * N * C`` numbers against ``N * P * (Cq + C)`` for the two factors, so it pays only when
  ``Cq * C < P * (Cq + C)``; for DeepSeek-V3 (Cq 1536, C 512, P 128) it is 3x larger, which is
  why ``mla_attention`` (and DeepSeek's reference code) applies the factors in turn instead.
  """
  if w_uq_nope.ndim != 3 or w_uk.ndim != 3 or w_uq_nope.shape[1:] != w_uk.shape[1:]:
    raise ValueError(f"`w_uq_nope` [Cq, N, P] {w_uq_nope.shape} and `w_uk` [C, N, P] {w_uk.shape} "
                     "must share N and P.")
  return jnp.einsum("qnp,cnp->qnc", w_uq_nope.astype(_F32), w_uk.astype(_F32))


def absorb_output_weights(w_uv: Float[Array, "C N h"],
                          w_o: Float[Array, "N h D"]) -> Float[Array, "N C D"]:
  """``W_up^V_i W_O_i`` merged (fp32): the output projection applied straight to latent outputs.

  ``o_latent [B, T, N, C] @ result`` equals ``(o_latent @ w_uv) @ w_o``; the seed's "the same trick
  merges the Value up-projection with the output matrix".  Like ``absorb_query_weights`` it is
  larger than its factors whenever ``C * D > h * (C + D)``.
  """
  if w_uv.ndim != 3 or w_o.ndim != 3 or w_uv.shape[1:] != w_o.shape[:2]:
    raise ValueError(f"`w_uv` [C, N, h] {w_uv.shape} and `w_o` [N, h, D] {w_o.shape} must share "
                     "N and h.")
  return jnp.einsum("cnh,nhd->ncd", w_uv.astype(_F32), w_o.astype(_F32))
