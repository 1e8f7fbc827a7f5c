"""DeepSeek Sparse Attention (DSA, DeepSeek-V3.2) on MLA: a lightning indexer picks top-K latents.

Seed 3.7 "DeepSeek Sparse Attention" and the second seed's "Sparse attention (DSA)".  Per token:

    q^I  = RoPE_part(c_Q W^IQ)                 [B, T, H_I, d_I]  H_I light heads from the query latent
    k^I  = RoPE_part(LayerNorm(x W^IK))        [B, T, d_I]       ONE key shared by the heads (MQA)
    w    = x W^IW * H_I^-1/2 * d_I^-1/2        [B, T, H_I]       per-token head weights
    I[t, s] = sum_j w[t, j] ReLU(q^I[t, j] . k^I[s])   (causal)  -> S_t = TopK(I[t], k)
    y    = o_proj(MLA attention restricted to S_t)                (absorbed form over the latents)

``RoPE_part`` rotates the first ``index_rope_dim`` coordinates (half-split pairs, as DeepSeek-V3.2's
indexer).  With ``index_rotate`` the indexer queries and keys go through ``hadamard_transform``
(scores unchanged) and with ``index_quant`` ("int8"/"fp8") they are rounded to 8 bits before
scoring; the decode cache stores the indexer keys in that 8-bit form with their scales.

Training (``return_aux=True``): ``aux["indexer_loss"]`` is the KL from the main attention's
head-summed distribution (stop-gradient) to the indexer's softmax -- over all causal keys in
``attention_mode="dense"`` (warm-up: main attention dense), over ``S_t`` in ``"sparse"``.  The
indexer reads ``stop_gradient`` of its inputs, so the indexer loss trains only the indexer and the
language-model loss (through the top-K gather, which has no gradient to the indexer) only the rest.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from jaxattn.cache import nan_past_capacity
from jaxattn.checks import check_int
from jaxattn.dsa_cache import DSACache, quantize_index_keys
from jaxattn.nn.linear import Einsum, effective_kernel
from jaxattn.nn.mla import MLA
from jaxattn.nn.norms import LayerNorm
from jaxattn.ops.decode import check_num_tokens, check_ragged_needs_paged
from jaxattn.ops.hadamard import hadamard_transform
from jaxattn.ops.mla import mla_attention, mla_score_terms
from jaxattn.ops.quantization import QUANT_FORMATS, dequantize, fake_quantize
from jaxattn.ops.rope import RopeScaling, apply_rope, check_rope_base, check_rope_scaling
from jaxattn.ops.sparse import IMPLEMENTATIONS as SPARSE_IMPLEMENTATIONS
from jaxattn.ops.sparse import (DOT_DTYPES, indexer_kl_loss, indexer_scores, indexer_topk,
                                indices_to_mask, sparse_mla_attention, topk_indices)
from jaxattn.paged_cache import PagedLatentCache, nan_where_dropped
from jaxattn.sharding import shard

AttentionMode = Literal["dense", "sparse"]
ATTENTION_MODES = ("dense", "sparse")


class LightningIndexer(nnx.Module):
  """DSA's lightning indexer: scores ``I [B, T, S]`` from ``H_I`` light heads and one shared key.

  Args:
    embed_dim: ``D`` (keys and head weights read ``x``).
    query_dim: width of the query input (the query latent ``Cq``, or ``D`` without one).
    num_heads: ``H_I`` (DeepSeek-V3.2: 64).
    head_dim: ``d_I``, a power of two when ``rotate`` (128).
    rope_dim: rotated leading coordinates of ``q^I`` and ``k^I`` (64), even, ``<= head_dim``.
    rope_base: RoPE base.
    rope_scaling: the attention's ``RopeScaling`` (YaRN for DeepSeek-V3.2), applied to the
      indexer's RoPE as well: transformers rotates the indexer with the same (scaled) cos and sin.
    rotate: Hadamard-rotate queries and keys before (optional) quantization.
    quant: None, "int8" or "fp8" scoring; ``quant_block_size`` None = one scale per vector (fp8
      default: 128-entry blocks, or the whole vector when shorter).
    dot_dtype: None (fp32 dot products) or "bfloat16": the scoring dots take bf16 operands and
      accumulate in fp32 (``indexer_scores`` / ``indexer_topk``'s ``dot_dtype``).  With ``quant``
      the module scores the dequantized values, so these are rounded to bf16 once more.
  """

  def __init__(self, embed_dim: int, query_dim: int, *, num_heads: int, head_dim: int,
               rope_dim: int, rope_base: float = 10000.0,
               rope_scaling: RopeScaling | None = None, rotate: bool = True, quant=None,
               quant_block_size: int | None = None, norm_eps: float = 1e-6, rngs: nnx.Rngs,
               dtype=None, param_dtype=jnp.float32, dot_dtype: str | None = None):
    for name, v in (("embed_dim", embed_dim), ("query_dim", query_dim), ("num_heads", num_heads),
                    ("head_dim", head_dim)):
      check_int(name, v)
    if not isinstance(rope_dim, int) or rope_dim < 0 or rope_dim % 2 or rope_dim > head_dim:
      raise ValueError(f"`rope_dim` must be an even int in [0, head_dim={head_dim}], got "
                       f"{rope_dim!r}.")
    if rotate and head_dim & (head_dim - 1):
      raise ValueError(f"`head_dim`={head_dim} must be a power of two for the Hadamard rotation "
                       "(or pass rotate=False).")
    if quant not in QUANT_FORMATS:
      raise ValueError(f"`quant` must be one of {QUANT_FORMATS}, got {quant!r}.")
    if quant == "fp8" and quant_block_size is None:
      quant_block_size = min(128, head_dim)
    if quant_block_size is not None and (quant_block_size < 1 or head_dim % quant_block_size):
      raise ValueError(f"`quant_block_size`={quant_block_size!r} must divide head_dim={head_dim}.")
    if dot_dtype not in DOT_DTYPES:
      raise ValueError(f"`dot_dtype` must be one of {DOT_DTYPES}, got {dot_dtype!r}.")
    self.dot_dtype = dot_dtype
    self.num_heads, self.head_dim, self.rope_dim = num_heads, head_dim, rope_dim
    check_rope_scaling(rope_scaling, name="rope_scaling")
    check_rope_base(rope_base, rope_scaling, name="rope_base")
    self.rope_base, self.rope_scaling = rope_base, rope_scaling
    self.rotate, self.quant = rotate, quant
    self.quant_block_size = quant_block_size
    kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    self.wq = Einsum("BTC,CJE->BTJE", (query_dim, num_heads, head_dim),
                     ("latent", "heads", "head_dim"), **kw)
    self.wk = Einsum("BSD,DE->BSE", (embed_dim, head_dim), ("embed", "head_dim"), **kw)
    self.k_norm = LayerNorm(head_dim, eps=norm_eps, rngs=rngs, param_dtype=param_dtype)
    self.weights_proj = Einsum("BTD,DJ->BTJ", (embed_dim, num_heads), ("embed", "heads"), **kw)

  def _rope(self, x, positions):
    if self.rope_dim == 0:
      return x
    return apply_rope(x, positions, base=self.rope_base, rotary_dim=self.rope_dim,
                      interleaved=False, scaling=self.rope_scaling)

  def _prepare(self, x):
    """Rotation then 8-bit rounding, fp32."""
    x = x.astype(jnp.float32)
    return hadamard_transform(x) if self.rotate else x

  def project(self, x: Float[Array, "B T D"], q_in: Float[Array, "B T Cq"],
              positions: Int[Array, "#B T"]):
    """``(q^I [B,T,H_I,d_I] fp32, as scored; keys (stored form) [B,T,d_I]; scales [B,T,nb];
    w [B,T,H_I] fp32)``."""
    q = self._rope(self.wq(q_in), positions)
    k = self._rope(self.k_norm(self.wk(x))[:, :, None, :], positions)[:, :, 0, :]
    w = self.weights_proj(x).astype(jnp.float32) * (self.num_heads * self.head_dim) ** -0.5
    q = fake_quantize(self._prepare(q), self.quant, block_size=self.quant_block_size)
    keys, scales = quantize_index_keys(self._prepare(k), self.quant, self.quant_block_size)
    return q, keys, scales, w

  def __call__(self, x: Float[Array, "B T D"], q_in: Float[Array, "B T Cq"], *,
               positions: Int[Array, "#B T"] | None = None) -> Float[Array, "B T T"]:
    """Causal self-scores ``I [B, T, T]`` (``-inf`` above the diagonal)."""
    if positions is None:
      positions = jnp.arange(x.shape[1], dtype=jnp.int32)[None]
    q, keys, scales, w = self.project(x, q_in, positions)
    return indexer_scores(q, dequantize(keys, scales), w, dot_dtype=self.dot_dtype)


class DSA(MLA):
  """MLA with DeepSeek Sparse Attention: a ``LightningIndexer`` selects ``index_topk`` latents.

  Takes every ``MLA`` argument (``causal`` must stay True) plus:
    index_num_heads, index_head_dim, index_rope_dim: the indexer's ``H_I``, ``d_I`` and rotated
      width (DeepSeek-V3.2: 64, 128, 64).
    index_topk: ``k`` (2048 in V3.2); every position is used when fewer are available.
    attention_mode: "sparse" (top-K) or "dense" (the warm-up stage: MLA attention over all keys,
      indexer scored and trained alongside); overridable per call.
    index_rotate, index_quant, index_quant_block_size, index_dot_dtype: as ``LightningIndexer``'s
      rotate / quant / dot_dtype (``index_dot_dtype="bfloat16"``: reduced-precision scoring).

  The indexer reads the query latent ``c_Q`` when ``q_lora_rank`` is set, else ``x``.  Sparse
  attention runs in MLA's absorbed form over the selected latent rows.
  ``y = dsa(x)``; ``y, cache = dsa(x, cache=cache)``; with ``return_aux=True`` also a dict with
  ``indices [B, T, k]`` (sparse mode), ``index_scores [B, T, S]`` and ``indexer_loss``.
  A paged cache (``init_paged_cache``) decodes ragged batches through ``paged_mla_decode``.
  """

  def __init__(self, embed_dim: int, num_heads: int, *, index_num_heads: int,
               index_head_dim: int, index_rope_dim: int, index_topk: int,
               attention_mode: AttentionMode = "sparse", index_rotate: bool = True,
               index_quant=None, index_quant_block_size: int | None = None,
               index_dot_dtype: str | None = None, rngs: nnx.Rngs, **mla_kwargs):
    super().__init__(embed_dim, num_heads, rngs=rngs, **mla_kwargs)
    if not self.causal:
      raise ValueError("DSA needs `causal=True`: the indexer selects among earlier tokens.")
    check_int("index_topk", index_topk)
    if attention_mode not in ATTENTION_MODES:
      raise ValueError(f"`attention_mode` must be one of {ATTENTION_MODES}, got "
                       f"{attention_mode!r}.")
    self.index_topk, self.attention_mode = int(index_topk), attention_mode
    q_dim = embed_dim if self.q_lora_rank is None else self.q_lora_rank
    self.indexer = LightningIndexer(
        embed_dim, q_dim, num_heads=index_num_heads, head_dim=index_head_dim,
        rope_dim=index_rope_dim, rope_base=self.rope_base, rope_scaling=self.rope_scaling,
        rotate=index_rotate, quant=index_quant,
        quant_block_size=index_quant_block_size, norm_eps=mla_kwargs.get("norm_eps", 1e-6),
        rngs=rngs, dtype=mla_kwargs.get("dtype"), param_dtype=mla_kwargs.get("param_dtype",
                                                                           jnp.float32),
        dot_dtype=index_dot_dtype)

  def init_cache(self, batch: int, max_len: int, dtype=None) -> DSACache:
    """An empty cache: latent rows plus the indexer keys in their scoring format.  ``dtype``
    int8 / float8_e4m3fn: quantized latent rows, as ``MLA.init_cache`` (the contiguous dense and
    sparse paths read them dequantized)."""
    dtype = dtype or self.dtype or jnp.float32
    ix = self.indexer
    return DSACache.init(batch, max_len, kv_lora_rank=self.kv_lora_rank,
                         qk_rope_head_dim=self.qk_rope_head_dim, index_head_dim=ix.head_dim,
                         quant=ix.quant, quant_block_size=ix.quant_block_size, dtype=dtype,
                         rope_dtype=self._rope_dtype(dtype))

  def cache_bytes(self, seq_len: int, batch: int = 1, dtype=jnp.bfloat16) -> int:
    """Cache bytes of this layer for ``seq_len`` tokens: the latent rows ``(C + R) x bytes`` (as
    MLA) plus each token's indexer key in its scoring format and its fp32 scales."""
    key_dtype, num_scales = self._index_key_format()
    index = self.indexer.head_dim * jnp.dtype(key_dtype).itemsize + num_scales * 4
    return super().cache_bytes(seq_len, batch, dtype) + batch * seq_len * index

  def _index_key_format(self):
    """``(dtype, number of scales)`` of one stored indexer key: whatever ``quantize_index_keys``
    produces for this indexer (the contiguous cache's format, so the two never drift apart)."""
    ix = self.indexer
    keys, scales = jax.eval_shape(lambda: quantize_index_keys(
        jnp.zeros((1, 1, ix.head_dim), jnp.float32), ix.quant, ix.quant_block_size))
    return keys.dtype, scales.shape[-1]

  def init_paged_cache(self, batch: int, num_pages: int, page_size: int, *,
                       max_pages_per_seq: int | None = None, dtype=None) -> PagedLatentCache:
    """An empty paged cache (``jaxattn.paged_cache``): ``num_pages`` pages of ``page_size`` rows
    ``[c_KV, k^R]`` plus the indexer key of each row in its scoring format (int8 / fp8 / fp32 with
    fp32 scales), shared by ``batch`` sequences of ragged lengths.  ``dtype`` int8 /
    float8_e4m3fn: quantized latents, as ``MLA.init_paged_cache`` (sparse decode then runs on
    the ``"xla"`` path, the default for sparse mode)."""
    dtype = dtype or self.dtype or jnp.float32
    index_dtype, num_scales = self._index_key_format()
    return PagedLatentCache.init(batch, num_pages, page_size, self.kv_lora_rank,
                                 self.qk_rope_head_dim, max_pages_per_seq=max_pages_per_seq,
                                 index_head_dim=self.indexer.head_dim, index_dtype=index_dtype,
                                 index_num_scales=num_scales, dtype=dtype,
                                 rope_dtype=self._rope_dtype(dtype))

  def _check_paged_cache(self, cache: PagedLatentCache):
    if cache.kv_lora_rank != self.kv_lora_rank or cache.qk_rope_head_dim != self.qk_rope_head_dim:
      raise ValueError(f"`cache` holds C={cache.kv_lora_rank}, R={cache.qk_rope_head_dim}; this "
                       f"layer needs C={self.kv_lora_rank}, R={self.qk_rope_head_dim}.")
    if cache.index_keys_pool is None:
      raise ValueError("`cache` is a PagedLatentCache without indexer keys (index_keys_pool is "
                       "None, as MLA.init_paged_cache makes it); DSA needs DSA.init_paged_cache.")
    index_dtype, num_scales = self._index_key_format()
    keys, scales = cache.index_keys_pool, cache.index_scales_pool
    if (keys.dtype != index_dtype or keys.shape[2] != self.indexer.head_dim
        or scales.shape[2] != num_scales):
      raise ValueError(f"`cache` indexer keys are {keys.dtype} [.., {keys.shape[2]}] with "
                       f"{scales.shape[2]} scale(s); this layer stores {index_dtype} "
                       f"[.., d_I={self.indexer.head_dim}] with {num_scales} scale(s) "
                       f"(index_quant={self.indexer.quant!r}).")

  def _paged_call(self, x, positions, cache: PagedLatentCache, mode, return_aux, implementation,
                  segment_ids, num_tokens=None):
    """Prefill / decode against a paged cache, always in absorbed form; batches may be ragged.

    Each sequence appends its ``T`` new rows (latents, rotated key, quantized indexer key) at its
    own length, RoPE positions default to ``lengths[b] + arange(T)``; the indexer scores that
    sequence's cached keys (gathered through the page table: the reference path) causally and
    within its length; ``paged_mla_decode`` attends to the top-K positions (sparse) or all of
    them (dense) in latent space; ``W_up^V`` and ``o_proj`` follow, as in the contiguous path.
    ``num_tokens``: a ragged chunk, as in ``Attention``.
    """
    if segment_ids is not None:
      raise ValueError("`segment_ids` (packed sequences) cannot be combined with a "
                       "PagedLatentCache: each batch row is one sequence.")
    self._check_paged_cache(cache)
    t = x.shape[1]
    num_tokens = check_num_tokens(num_tokens, x.shape[0], t)
    if num_tokens is not None and return_aux:
      raise ValueError("`return_aux` (the indexer's training loss) is not available for a ragged "
                       "chunk (`num_tokens`): its padding rows have no attention distribution.")
    x = shard(x, ("batch", "length", "act_embed"))
    if positions is None:  # per-sequence positions: the batch is ragged
      positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    q_in, q_nope, q_rope, c_kv, k_rope = self._project_all(x, positions)
    # The indexer learns only from its own loss: detach its inputs from the main model.
    q_idx, keys, scales, w = self.indexer.project(jax.lax.stop_gradient(x),
                                                  jax.lax.stop_gradient(q_in), positions)
    old_lengths, cache = cache.lengths, cache.append(c_kv, k_rope, keys, scales,
                                                     num_tokens=num_tokens)
    lengths = cache.lengths
    indices = scores = None
    if mode == "sparse" or return_aux:
      k_idx = dequantize(*cache.gather_index_keys())                # [B, S, d_I]
      scores = indexer_scores(q_idx, k_idx, w, causal=False, kv_lengths=lengths,
                              dot_dtype=self.indexer.dot_dtype)
      # The T queries are each sequence's last T tokens (paged_mla_decode's contract; its first
      # num_tokens[b] for a ragged chunk): query t of sequence b sits at lengths[b] - T + t, a
      # per-sequence offset that indexer_scores' scalar q_offset cannot express, so causality is
      # applied here.  (A padding query's selection is ignored by paged_mla_decode.)
      n = t if num_tokens is None else num_tokens[:, None]
      q_pos = lengths[:, None] - n + jnp.arange(t, dtype=jnp.int32)[None, :]       # [B, T]
      visible = jnp.arange(k_idx.shape[1], dtype=jnp.int32)[None, None, :] <= q_pos[:, :, None]
      scores = jnp.where(visible, scores, -jnp.inf)
      if mode == "sparse":
        indices = topk_indices(scores, self.index_topk)            # [B, T, k], -1 = none
    y = nan_where_dropped(self._absorbed_paged(q_nope, q_rope, cache, lengths, indices,
                                               implementation, num_tokens),
                          old_lengths, lengths, t, num_tokens)
    if not return_aux:
      return y, cache
    dt = q_nope.dtype
    c_all, k_rope_all = cache.gather()                               # [B, S, C], [B, S, R]
    return y, cache, self._aux(q_nope, q_rope, c_all.astype(dt), k_rope_all.astype(dt), scores,
                               indices)

  def _project_all(self, x, positions):
    """MLA's projections, also returning the query latent the indexer reads."""
    if self.q_proj is not None:
      q_in = x
      q = self.q_proj(x)
    else:
      q_in = self.q_norm(self.q_down(x))
      q = self.q_up(q_in)
    q = shard(q, ("batch", "length", "act_heads", "head_dim"))
    p = self.qk_nope_head_dim
    rope = dict(base=self.rope_base, interleaved=self.rope_interleaved, scaling=self.rope_scaling)
    q_nope, q_rope = q[..., :p], apply_rope(q[..., p:], positions, **rope)
    c_kv = shard(self.kv_norm(self.kv_down(x)), ("batch", "length", None))
    k_rope = apply_rope(self.k_rope_proj(x)[:, :, None, :], positions, **rope)[:, :, 0, :]
    return q_in, q_nope, q_rope, c_kv, k_rope

  def __call__(
      self,
      x: Float[Array, "B T D"],
      *,
      positions: Int[Array, "#B T"] | None = None,
      cache: DSACache | None = None,
      attention_mode: AttentionMode | None = None,
      return_aux: bool = False,
      implementation=None,
      segment_ids: Int[Array, "B T"] | None = None,
      num_tokens: Int[Array, "B"] | None = None,
  ):
    """``segment_ids [B, T]`` (packed rows; equal ids = one document, 0 included, as in
    ``dot_product_attention`` and the dense mode): the indexer selects, and attention
    reads, only earlier tokens of the query's own segment (full scores are formed for the mask).
    ``num_tokens [B]`` (a ``PagedLatentCache`` only): a ragged chunk, as in ``Attention``."""
    mode = self.attention_mode if attention_mode is None else attention_mode
    if mode not in ATTENTION_MODES:
      raise ValueError(f"`attention_mode` must be one of {ATTENTION_MODES}, got {mode!r}.")
    if x.ndim != 3 or x.shape[-1] != self.embed_dim:
      raise ValueError(f"`x` must be [B, T, D={self.embed_dim}], got shape {x.shape}.")
    if isinstance(cache, PagedLatentCache):
      return self._paged_call(x, positions, cache, mode, return_aux, implementation, segment_ids,
                              num_tokens)
    check_ragged_needs_paged(num_tokens, "PagedLatentCache (DSA.init_paged_cache)")
    if cache is not None and not isinstance(cache, DSACache):
      raise ValueError(f"`cache` must be a DSACache (DSA.init_cache) or a PagedLatentCache "
                       f"(DSA.init_paged_cache), got {type(cache)}.")
    b, t, _ = x.shape
    if segment_ids is not None and (cache is not None or segment_ids.shape != (b, t)):
      raise ValueError(f"`segment_ids` must be [B, T] = {(b, t)} and cannot be combined with a "
                       f"cache; got shape {segment_ids.shape}, cache given: {cache is not None}.")
    x = shard(x, ("batch", "length", "act_embed"))
    offset = 0 if cache is None else cache.index
    positions = self._positions(t, offset, positions)
    q_in, q_nope, q_rope, c_kv, k_rope = self._project_all(x, positions)
    # The indexer learns only from its own loss: detach its inputs from the main model.
    q_idx, keys, scales, w = self.indexer.project(jax.lax.stop_gradient(x),
                                                  jax.lax.stop_gradient(q_in), positions)
    kv_lengths = None
    if cache is not None:
      cache = cache.update(c_kv, k_rope, keys, scales)
      c_kv = cache.latent.c_kv.astype(q_nope.dtype)       # (quantized latents: dequantized)
      k_rope = cache.latent.k_rope.astype(q_nope.dtype)
      k_idx = cache.index_keys_fp32()
      kv_lengths = jnp.full((b,), cache.index, jnp.int32)
    else:
      k_idx = dequantize(keys, scales)
    w_uk, w_uv = effective_kernel(self.k_up), effective_kernel(self.v_up)
    indices = scores = None
    if return_aux or mode == "dense" or segment_ids is not None:
      scores = indexer_scores(q_idx, k_idx, w, q_offset=offset, kv_lengths=kv_lengths,
                              dot_dtype=self.indexer.dot_dtype)
      if segment_ids is not None:
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        scores = jnp.where(same, scores, -jnp.inf)
    if mode == "sparse":
      if scores is None:
        # Only the selection is needed: stream it (causal key blocks, no [T, S] scores).  The
        # attention needs the set, not its order: position order skips the final sort.
        indices = indexer_topk(q_idx, k_idx, w, self.index_topk, q_offset=offset,
                               kv_lengths=kv_lengths, order="position",
                               dot_dtype=self.indexer.dot_dtype)
      else:
        indices = topk_indices(scores, self.index_topk)
      # The dense backend's name picks the sparse kernel where one exists under that name
      # ("xla", "cpu", "pallas_tpu", "pallas_gpu"); "xla_chunked" and None take its default.
      impl = implementation or self.implementation
      out = sparse_mla_attention(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, indices,
                                 scale=self.scale,
                                 implementation=impl if impl in SPARSE_IMPLEMENTATIONS else None)
    else:
      out = mla_attention(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, mode=self.mode,
                          scale=self.scale, is_causal=True, kv_lengths=kv_lengths, q_offset=offset,
                          segment_ids=segment_ids,
                          implementation=implementation or self.implementation)
    y = shard(self.o_proj(out), ("batch", "length", "act_embed"))
    result = (y,) if cache is None else (nan_past_capacity(y, cache), cache)
    if return_aux:
      result = result + (self._aux(q_nope, q_rope, c_kv, k_rope, scores, indices),)
    return result[0] if len(result) == 1 else result

  def _aux(self, q_nope, q_rope, c_kv, k_rope, scores, indices):
    """Indexer loss against the main attention's (dense or selected-set) distribution."""
    content, position = mla_score_terms(q_nope, q_rope, c_kv, k_rope, effective_kernel(self.k_up))
    allowed = jnp.isfinite(scores)                                 # causal and filled slots
    if indices is not None:
      allowed = allowed & indices_to_mask(indices, scores.shape[-1])[:, 0]
    logits = jnp.where(allowed[:, None], self.scale * (content + position), -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    probs = jnp.where(allowed[:, None], probs, 0.0)
    loss = indexer_kl_loss(probs, scores, allowed)
    return {"indices": indices, "index_scores": scores, "indexer_loss": loss}
