"""Multi-head latent attention (MLA) as a Flax NNX module, with its latent cache.

The formulas are in ``jaxattn.ops.mla``; this module owns the weights (DeepSeek-V2/V3 layout):

    c_Q  = RMSNorm(x W_down^Q)                      [B, T, Cq]     (only with q_lora_rank)
    q    = c_Q W_up^Q  (or x W^Q)                   [B, T, N, P + R] -> q^C [.., :P], q^R [.., P:]
    c_KV = RMSNorm(x W_down^KV)                     [B, S, C]      cached
    k^R  = RoPE(x W^KR)                             [B, S, R]      cached, shared by all heads
    k^C_i = c_KV W_up^K_i,  v_i = c_KV W_up^V_i     [B, S, N, P], [B, S, N, h]  (naive mode only)
    y    = o_proj(attention)                        [B, T, D]

``mode="naive"`` reconstructs per-head keys and values; ``mode="absorbed"`` folds ``W_up^K`` into
the query and applies ``W_up^V`` after the attention sum, attending straight against the cached
latents.  Same weights, same result (fp32: ~1e-6); naive is the cheaper order for long prefill and
training, absorbed for decode.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from jaxattn.cache import nan_past_capacity
from jaxattn.checks import check_int
from jaxattn.kv_efficiency import kv_cache_per_token
from jaxattn.mla_cache import LatentCache
from jaxattn.paged_cache import PagedLatentCache, nan_where_dropped
from jaxattn.nn.linear import Einsum, effective_kernel
from jaxattn.nn.norms import RMSNorm
from jaxattn.ops.decode import (DECODE_MAX_T, cache_mla_decode, check_num_tokens,
                                check_ragged_needs_paged, module_decode_implementation,
                                paged_mla_decode, tpu_kernel_requested)
from jaxattn.ops.mla import MODES, Mode, mla_attention, mla_score_terms, mla_softmax_scale
from jaxattn.ops.quantization import kv_quantized
from jaxattn.ops.rope import RopeScaling, apply_rope, check_rope_base, check_rope_scaling
from jaxattn.sharding import shard


class MLA(nnx.Module):
  """DeepSeek's multi-head latent attention with decoupled RoPE and a latent KV cache.

  Args:
    embed_dim: ``D``.
    num_heads: ``N`` query heads (every head gets its own keys and values from the shared latent).
    kv_lora_rank: ``C``, the latent size ``d_c`` (DeepSeek-V2/V3: 512).
    qk_nope_head_dim: ``P``, content part of each query/key head (128).
    qk_rope_head_dim: ``R``, decoupled RoPE part, even (64); ONE rotated key of this size is shared
      by all heads.
    v_head_dim: ``h``, value head size (default ``P``).
    q_lora_rank: ``Cq``; set to compress the query through ``x W_down^Q`` and an RMSNorm (V3: 1536),
      None for a plain ``x W^Q`` (V2-Lite).
    causal: causal self-attention.
    mode: default inference path, ``"naive"`` or ``"absorbed"`` (overridable per call).
    rope_base: ``rope_theta``.
    rope_interleaved: rotate consecutive pairs (DeepSeek's reference weights; transformers'
      ``rope_interleave=True``) rather than the half split.
    rope_scaling: a ``RopeScaling`` (YaRN for DeepSeek); its ``mscale_all_dim`` also multiplies the
      softmax scale by ``yarn_mscale(factor, mscale_all_dim) ** 2``.
    attention_scale: overrides the softmax scale (default ``mla_softmax_scale(P + R, rope_scaling)``).
    norm_eps: epsilon of the two RMSNorms.
    use_bias: biases on the down-projections, the RoPE key projection and ``o_proj`` (transformers'
      ``attention_bias``; up-projections never have one).
    implementation: attention backend, as in ``dot_product_attention``.
    rngs, dtype, param_dtype: as every jaxattn module (compute dtype default: the input's).

  Call ``mla(x)`` for a full pass; with ``cache=mla.init_cache(...)`` it returns ``(y, cache)``,
  and, for a causal layer, prefill followed by token-by-token decode equals the full pass on the
  same tokens in either mode (a non-causal full pass lets earlier tokens see later ones; decode
  cannot).  (Not with ``rope_scaling`` of type ``"dynamic"``: its base depends on the sequence
  length, so a full pass rotates every token with the base of its final length while decode rotates
  each new token with the base of the length so far and keeps the cached rotated keys as they were,
  as transformers does.)  A paged cache (``init_paged_cache``) decodes ragged batches, always in
  absorbed form.
  """

  def __init__(
      self,
      embed_dim: int,
      num_heads: int,
      *,
      kv_lora_rank: int,
      qk_nope_head_dim: int,
      qk_rope_head_dim: int,
      v_head_dim: int | None = None,
      q_lora_rank: int | None = None,
      causal: bool = True,
      mode: Mode = "naive",
      rope_base: float = 10000.0,
      rope_interleaved: bool = True,
      rope_scaling: RopeScaling | None = None,
      attention_scale: float | None = None,
      norm_eps: float = 1e-6,
      use_bias: bool = False,
      implementation=None,
      rngs: nnx.Rngs,
      dtype=None,
      param_dtype=jnp.float32,
  ):
    v_head_dim = qk_nope_head_dim if v_head_dim is None else v_head_dim
    for name, v in (("embed_dim", embed_dim), ("num_heads", num_heads),
                    ("kv_lora_rank", kv_lora_rank), ("qk_nope_head_dim", qk_nope_head_dim),
                    ("qk_rope_head_dim", qk_rope_head_dim), ("v_head_dim", v_head_dim)):
      check_int(name, v)
    check_int("q_lora_rank", q_lora_rank, allow_none=True)
    if qk_rope_head_dim % 2:
      raise ValueError(f"`qk_rope_head_dim`={qk_rope_head_dim} must be even (RoPE rotates pairs of "
                       "coordinates).")
    if mode not in MODES:
      raise ValueError(f"`mode` must be one of {MODES}, got {mode!r}.")
    check_rope_scaling(rope_scaling, name="rope_scaling")
    check_rope_base(rope_base, rope_scaling, name="rope_base")
    if attention_scale is not None and not attention_scale > 0:
      raise ValueError(f"`attention_scale` must be positive or None, got {attention_scale!r}.")
    self.embed_dim, self.num_heads = embed_dim, num_heads
    self.kv_lora_rank, self.q_lora_rank = kv_lora_rank, q_lora_rank
    self.qk_nope_head_dim, self.qk_rope_head_dim = qk_nope_head_dim, qk_rope_head_dim
    self.v_head_dim = v_head_dim
    self.causal, self.mode = causal, mode
    self.rope_base, self.rope_interleaved = rope_base, rope_interleaved
    self.rope_scaling = rope_scaling
    self.scale = (mla_softmax_scale(qk_nope_head_dim + qk_rope_head_dim, rope_scaling)
                  if attention_scale is None else float(attention_scale))
    self.implementation, self.dtype = implementation, dtype

    kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    d, n, c, hv = embed_dim, num_heads, kv_lora_rank, v_head_dim
    p, r = qk_nope_head_dim, qk_rope_head_dim
    if q_lora_rank is None:
      self.q_proj = Einsum("BTD,DNH->BTNH", (d, n, p + r), ("embed", "heads", "head_dim"), **kw)
      self.q_down = self.q_norm = self.q_up = None
    else:
      self.q_proj = None
      self.q_down = Einsum("BTD,DC->BTC", (d, q_lora_rank), ("embed", "latent"), use_bias=use_bias,
                           **kw)
      self.q_norm = RMSNorm(q_lora_rank, eps=norm_eps, rngs=rngs, param_dtype=param_dtype)
      self.q_up = Einsum("BTC,CNH->BTNH", (q_lora_rank, n, p + r), ("latent", "heads", "head_dim"),
                         **kw)
    self.kv_down = Einsum("BSD,DC->BSC", (d, c), ("embed", "latent"), use_bias=use_bias, **kw)
    self.kv_norm = RMSNorm(c, eps=norm_eps, rngs=rngs, param_dtype=param_dtype)
    self.k_rope_proj = Einsum("BSD,DR->BSR", (d, r), ("embed", "head_dim"), use_bias=use_bias, **kw)
    self.k_up = Einsum("BSC,CNH->BSNH", (c, n, p), ("latent", "heads", "head_dim"), **kw)
    self.v_up = Einsum("BSC,CNH->BSNH", (c, n, hv), ("latent", "heads", "head_dim"), **kw)
    self.o_proj = Einsum("BTNH,NHD->BTD", (n, hv, d), ("heads", "head_dim", "embed"),
                         fan_in_axes=(0, 1), use_bias=use_bias, **kw)

  # -- cache -----------------------------------------------------------------------------------

  def init_cache(self, batch: int, max_len: int, dtype=None) -> LatentCache:
    """An empty latent cache for ``batch`` sequences of up to ``max_len`` tokens.  ``dtype`` int8
    / float8_e4m3fn: a quantized latent cache (``c_KV`` codes with a fp32 scale per token, ``k^R``
    in the compute dtype, ``self.dtype`` or float32), as ``init_paged_cache``."""
    dtype = dtype or self.dtype or jnp.float32
    return LatentCache.init(batch, max_len, self.kv_lora_rank, self.qk_rope_head_dim, dtype,
                            rope_dtype=self._rope_dtype(dtype))

  def init_paged_cache(self, batch: int, num_pages: int, page_size: int, *,
                       max_pages_per_seq: int | None = None, dtype=None) -> PagedLatentCache:
    """An empty paged latent cache (``jaxattn.paged_cache``): ``num_pages`` pages of
    ``page_size`` rows ``[c_KV, k^R]`` shared by ``batch`` sequences of ragged lengths.
    ``dtype`` int8 / float8_e4m3fn: a quantized latent cache (one-byte ``c_KV`` codes with a fp32
    scale per token; ``k^R`` in the compute dtype, ``self.dtype`` or float32)."""
    dtype = dtype or self.dtype or jnp.float32
    return PagedLatentCache.init(batch, num_pages, page_size, self.kv_lora_rank,
                                 self.qk_rope_head_dim, max_pages_per_seq=max_pages_per_seq,
                                 dtype=dtype, rope_dtype=self._rope_dtype(dtype))

  def _rope_dtype(self, dtype):
    """The ``k^R`` pool's dtype for a paged cache of ``dtype``: the compute dtype (``self.dtype``
    or float32) under quantized latents, else None (``dtype`` itself)."""
    return (self.dtype or jnp.float32) if kv_quantized(dtype) else None

  def _paged_call(self, x, positions, segment_ids, mask, cache: PagedLatentCache,
                  implementation, num_tokens=None):
    """Prefill / decode against a paged latent cache, always in absorbed form (the decode path:
    ``paged_mla_decode`` returns latent outputs, ``W_up^V`` and ``o_proj`` follow); a ragged
    chunk with ``num_tokens``, as in ``Attention``."""
    if not self.causal or segment_ids is not None or mask is not None:
      raise ValueError(f"a PagedLatentCache supports causal layers without `mask` or "
                       f"`segment_ids`; this layer has causal={self.causal}, mask given: "
                       f"{mask is not None}, segment_ids given: {segment_ids is not None}.")
    t = x.shape[1]
    num_tokens = check_num_tokens(num_tokens, x.shape[0], t)
    x = shard(x, ("batch", "length", "act_embed"))
    if positions is None:  # per-sequence positions: the batch is ragged
      positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    q_nope, q_rope, c_kv, k_rope = self._project(x, positions)
    old_lengths, cache = cache.lengths, cache.append(c_kv, k_rope, num_tokens=num_tokens)
    y = self._absorbed_paged(q_nope, q_rope, cache, cache.lengths, None, implementation,
                             num_tokens)
    return nan_where_dropped(y, old_lengths, cache.lengths, t, num_tokens), cache

  def _absorbed_paged(self, q_nope, q_rope, cache: PagedLatentCache, lengths, indices,
                      implementation, num_tokens=None):
    """``o_proj`` of absorbed attention over a paged latent cache (``indices``: DSA's selected
    positions, or None for dense): the query goes to latent space, ``paged_mla_decode`` attends,
    ``W_up^V`` maps back."""
    impl = module_decode_implementation(implementation or self.implementation)
    return self._absorbed(q_nope, lambda q_latent: paged_mla_decode(
        q_latent, q_rope, cache.c_kv_pool, cache.k_rope_pool, cache.page_table, lengths,
        scale=self.scale, indices=indices, implementation=impl, num_tokens=num_tokens,
        c_kv_scale=cache.c_kv_scale_pool))

  def _absorbed(self, q_nope, attend):
    """``o_proj`` of absorbed attention: the query goes to latent space, ``attend(q_latent)``
    returns the latent output ``[B, T, N, C]``, ``W_up^V`` maps it back."""
    dt = q_nope.dtype
    w_uk, w_uv = effective_kernel(self.k_up).astype(dt), effective_kernel(self.v_up).astype(dt)
    # q^C_i . (c W_up^K_i) = (q^C_i W_up^K_i^T) . c: the query goes to latent space once.
    q_latent = jnp.einsum("btnp,cnp->btnc", q_nope, w_uk, preferred_element_type=jnp.float32)
    o_latent = attend(q_latent.astype(dt))                                # [B, T, N, C]
    out = jnp.einsum("btnc,cnh->btnh", o_latent.astype(dt), w_uv,
                     preferred_element_type=jnp.float32).astype(dt)
    return shard(self.o_proj(out), ("batch", "length", "act_embed"))

  def _decode_kernel(self, t, mode, mask, implementation, cache: LatentCache) -> bool:
    """Whether a step with a contiguous ``LatentCache`` runs the dense MLA decode kernel over its
    buffer (``jaxattn.ops.decode.cache_mla_decode``): on TPU (or with
    ``implementation="pallas_tpu"``), absorbed mode, up to ``DECODE_MAX_T`` new tokens of a
    causal layer without an extra mask, a cache length that is a multiple of 16 (``init_cache``
    on TPU rounds it up to one).  The other path
    concatenates ``[c_KV, k^R]`` and hands it to flash attention in its head-major layout:
    copies of the whole cache on every step."""
    return (tpu_kernel_requested(implementation or self.implementation) and mode == "absorbed"
            and t <= DECODE_MAX_T and self.causal
            and mask is None and cache.max_len % 16 == 0)

  def cache_bytes(self, seq_len: int, batch: int = 1, dtype=jnp.bfloat16) -> int:
    """Latent cache bytes of this layer for ``seq_len`` tokens: ``(C + R) x bytes`` per token; a
    quantized ``dtype`` (int8 / float8_e4m3fn; paged or contiguous, the same per token) ``C``
    code bytes, a fp32 scale and ``k^R`` in the compute dtype.  Unpadded: on TPU both caches
    store ``k^R`` zero-padded to 128 columns (and a contiguous one rounds its length up to a
    multiple of 16, or 128 past 512), so their ``nbytes`` exceed this there."""
    per_token = kv_cache_per_token("mla", num_heads=self.num_heads, head_dim=self.qk_nope_head_dim,
                                   kv_lora_rank=self.kv_lora_rank,
                                   qk_rope_head_dim=self.qk_rope_head_dim, dtype=dtype,
                                   rope_dtype=self._rope_dtype(dtype) or dtype)
    return batch * seq_len * per_token.bytes_per_token

  # -- forward ---------------------------------------------------------------------------------

  def _project(self, x, positions):
    """``(q^C [B,T,N,P], q^R [B,T,N,R], c_KV [B,T,C], k^R [B,T,R])``, RoPE applied to q^R and k^R."""
    if self.q_proj is not None:
      q = self.q_proj(x)
    else:
      q = self.q_up(self.q_norm(self.q_down(x)))
    q = shard(q, ("batch", "length", "act_heads", "head_dim"))
    q_nope, q_rope = q[..., :self.qk_nope_head_dim], q[..., self.qk_nope_head_dim:]
    c_kv = self.kv_norm(self.kv_down(x))
    c_kv = shard(c_kv, ("batch", "length", None))
    k_rope = self.k_rope_proj(x)[:, :, None, :]  # [B, T, 1, R]: one head for apply_rope
    rope = dict(base=self.rope_base, interleaved=self.rope_interleaved, scaling=self.rope_scaling)
    q_rope = apply_rope(q_rope, positions, **rope)
    k_rope = apply_rope(k_rope, positions, **rope)[:, :, 0, :]
    return q_nope, q_rope, c_kv, k_rope

  def _positions(self, t, offset, positions):
    if positions is None:
      return (offset + jnp.arange(t, dtype=jnp.int32))[None, :]
    return positions

  def __call__(
      self,
      x: Float[Array, "B T D"],
      *,
      positions: Int[Array, "#B T"] | None = None,
      cache: LatentCache | None = None,
      mode: Mode | None = None,
      segment_ids: Int[Array, "B T"] | None = None,
      mask=None,
      implementation=None,
      num_tokens: Int[Array, "B"] | None = None,
  ) -> Float[Array, "B T D"] | tuple[Float[Array, "B T D"], LatentCache]:
    """``x [B, T, D]`` -> ``[B, T, D]`` (and the updated cache when one is given).

    ``positions [B, T]`` (default ``cache.index + arange(T)``) feed RoPE.  ``mode`` overrides the
    module's default path.  ``segment_ids [B, T]`` confines attention to a segment (not with a
    cache); ``mask`` is an extra boolean ``[B|1, N|1, T, S]`` array or ``Mask``.  With a
    ``PagedLatentCache``, ``num_tokens [B]`` makes the step a ragged chunk (continuous batching):
    sequence ``b``'s new tokens are its first ``num_tokens[b]`` rows, the others padding (zeros).
    """
    mode = self.mode if mode is None else mode
    if mode not in MODES:
      raise ValueError(f"`mode` must be one of {MODES}, got {mode!r}.")
    if x.ndim != 3 or x.shape[-1] != self.embed_dim:
      raise ValueError(f"`x` must be [B, T, D={self.embed_dim}], got shape {x.shape}.")
    if isinstance(cache, PagedLatentCache):
      if cache.kv_lora_rank != self.kv_lora_rank or cache.qk_rope_head_dim != self.qk_rope_head_dim:
        raise ValueError(f"`cache` holds C={cache.kv_lora_rank}, R={cache.qk_rope_head_dim}; this "
                         f"layer needs C={self.kv_lora_rank}, R={self.qk_rope_head_dim}.")
      return self._paged_call(x, positions, segment_ids, mask, cache, implementation, num_tokens)
    check_ragged_needs_paged(num_tokens, "PagedLatentCache (init_paged_cache)")
    if cache is not None and not isinstance(cache, LatentCache):
      raise ValueError(f"`cache` must be a LatentCache (init_cache) or a PagedLatentCache "
                       f"(init_paged_cache), got {type(cache).__name__}.")
    if cache is not None:
      if segment_ids is not None:
        raise ValueError("`segment_ids` (packed sequences) cannot be combined with a latent `cache`.")
      if cache.kv_lora_rank != self.kv_lora_rank or cache.qk_rope_head_dim != self.qk_rope_head_dim:
        raise ValueError(f"`cache` holds C={cache.kv_lora_rank}, R={cache.qk_rope_head_dim}; this "
                         f"layer needs C={self.kv_lora_rank}, R={self.qk_rope_head_dim}.")
    b, t, _ = x.shape
    x = shard(x, ("batch", "length", "act_embed"))
    offset = 0 if cache is None else cache.index
    positions = self._positions(t, offset, positions)
    q_nope, q_rope, c_kv, k_rope = self._project(x, positions)
    kv_lengths = None
    if cache is not None:
      cache = cache.update(c_kv, k_rope)
      kv_lengths = jnp.full((b,), cache.index, jnp.int32)
      if self._decode_kernel(t, mode, mask, implementation, cache):
        return nan_past_capacity(self._absorbed(q_nope, lambda q_latent: cache_mla_decode(
            q_latent, q_rope, cache.kv, kv_lengths, scale=self.scale,
            implementation="pallas_tpu", k_rope=cache.k_rope_buf,
            c_kv_scale=cache.c_kv_scale)), cache), cache
      # (a quantized cache's c_kv is dequantized here: the non-kernel path takes floats)
      c_kv, k_rope = cache.c_kv.astype(q_nope.dtype), cache.k_rope.astype(q_nope.dtype)
    w_uk, w_uv = effective_kernel(self.k_up), effective_kernel(self.v_up)
    out = mla_attention(
        q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, mask,
        mode=mode, scale=self.scale, is_causal=self.causal, segment_ids=segment_ids,
        kv_lengths=kv_lengths, q_offset=offset,
        implementation=implementation or self.implementation)
    y = self.o_proj(out)
    y = shard(y, ("batch", "length", "act_embed"))
    return y if cache is None else (nan_past_capacity(y, cache), cache)

  def score_terms(self, x: Float[Array, "B T D"], *, positions: Int[Array, "#B T"] | None = None
                  ) -> tuple[Float[Array, "B N T T"], Float[Array, "B N T T"]]:
    """The unscaled fp32 ``(content, position)`` score terms ``[B, N, T, S]`` of self-attention over
    ``x``, before masking (``self.scale * (content + position)`` are the logits); for tests and
    plots of the decoupled RoPE stream."""
    positions = self._positions(x.shape[1], 0, positions)
    q_nope, q_rope, c_kv, k_rope = self._project(x, positions)
    return mla_score_terms(q_nope, q_rope, c_kv, k_rope, effective_kernel(self.k_up))
