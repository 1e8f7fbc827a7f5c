"""Multi-head attention (MHA / GQA / MQA) with any positional scheme and an explicit KV cache."""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from jaxattn.cache import KVCache, kv_cache_bytes_per_token, nan_past_capacity
from jaxattn.checks import check_positive, is_int
from jaxattn.paged_cache import PagedKVCache, nan_where_dropped
from jaxattn.rolling_cache import RollingKVCache
from jaxattn.nn.linear import Einsum
from jaxattn.nn.norms import RMSNorm
from jaxattn.nn.positional import T5RelativePositionBias
from jaxattn.ops.alibi import alibi_slopes
from jaxattn.ops.attention import dot_product_attention
from jaxattn.ops.decode import (DECODE_MAX_T, RelativeBias, cache_attention,
                                check_num_tokens, check_ragged_needs_paged,
                                module_decode_implementation, paged_attention,
                                tpu_kernel_requested)
from jaxattn.ops.rope import RopeScaling, apply_rope, check_rope_base, check_rope_scaling
from jaxattn.sharding import shard

PositionKind = Literal["rope", "alibi", "t5", "none"]
POSITION_KINDS = ("rope", "alibi", "t5", "none")


class Attention(nnx.Module):
  """Self-attention: ``o_proj(attention(rope(q_proj x), rope(k_proj x), v_proj x))``.

  ``num_kv_heads == num_heads`` is MHA, ``1`` is MQA, a divisor in between is GQA.  ``position``
  picks where position enters: ``"rope"`` rotates q and k (``rotary_dim`` < ``head_dim`` is partial
  RoPE; ``rope_interleaved`` picks consecutive pairs instead of Llama's half split), ``"alibi"`` adds
  ``slope * (j - i)`` (causal layers only: the paper's causal form), ``"t5"`` adds a learned
  bucketed bias per head, ``"none"`` leaves positions to the embeddings (sinusoidal or learned
  absolute).  ``sliding_window=w`` lets a query at ``p`` see keys ``p - w .. p`` (causal) or
  ``p - w .. p + w``.  ``qk_norm`` RMS-normalizes each q and k head (``norm_eps``) before RoPE, and
  ``output_gate`` multiplies each output head by ``sigmoid(x W_gate)`` before ``o_proj`` (both as
  Qwen3-Next's full-attention layers).  ``attention_sinks`` gives each head a learned sink logit
  (gpt-oss): one more softmax entry of value zero, so a head may attend to nothing
  (``dot_product_attention(..., sinks=)``; the decode kernels add them in their combine step).

  Call ``attn(x)`` for a full pass; with ``cache=attn.init_cache(...)`` it returns ``(y, cache)``
  and, for a causal layer, a prefill followed by token-by-token decode equals the full pass on the
  same tokens (a non-causal full pass lets earlier tokens see later ones; decode cannot).  (Not
  with ``rope_scaling`` of type ``"dynamic"``: its base depends on the sequence length, so a full
  pass rotates every token with the base of its final length while decode rotates each new token
  with the base of the length so far and keeps the cached keys as they were, as transformers does.)
  """

  def __init__(
      self,
      embed_dim: int,
      num_heads: int,
      num_kv_heads: int | None = None,
      head_dim: int | None = None,
      *,
      v_head_dim: int | None = None,
      causal: bool = True,
      position: PositionKind = "rope",
      rope_base: float = 10000.0,
      rotary_dim: int | None = None,
      rope_interleaved: bool = False,
      rope_scaling: RopeScaling | None = None,
      t5_num_buckets: int = 32,
      t5_max_distance: int = 128,
      sliding_window: int | None = None,
      logits_soft_cap: float | None = None,
      attention_scale: float | None = None,
      use_bias: bool = False,
      qk_norm: bool = False,
      output_gate: bool = False,
      attention_sinks: bool = False,
      norm_eps: float = 1e-6,
      implementation=None,
      rngs: nnx.Rngs,
      dtype=None,
      param_dtype=jnp.float32,
  ):
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if num_heads < 1 or num_kv_heads < 1:
      raise ValueError(f"`num_heads` ({num_heads}) and `num_kv_heads` ({num_kv_heads}) must be >= 1.")
    if num_heads % num_kv_heads != 0:
      raise ValueError(f"`num_heads` ({num_heads}) must be divisible by `num_kv_heads` "
                       f"({num_kv_heads}): each KV head serves num_heads / num_kv_heads query heads.")
    if head_dim is None:
      if embed_dim % num_heads:
        raise ValueError(f"`embed_dim` ({embed_dim}) is not divisible by `num_heads` ({num_heads}); "
                         "pass `head_dim` explicitly.")
      head_dim = embed_dim // num_heads
    if position not in POSITION_KINDS:
      raise ValueError(f"`position` must be one of {POSITION_KINDS}, got {position!r}.")
    if sliding_window is not None and (not is_int(sliding_window) or sliding_window < 0):
      raise ValueError(f"`sliding_window` must be a non-negative int or None, got {sliding_window!r}.")
    if logits_soft_cap is not None:
      check_positive("logits_soft_cap", logits_soft_cap)
    if position == "alibi" and not causal:
      raise ValueError(f"`position`={position!r} needs `causal`=True, got causal={causal!r}: the "
                       "ALiBi bias here is the paper's causal form slope * (j - i), which gives "
                       "keys after the query a positive bias instead of a distance penalty.")
    check_rope_scaling(rope_scaling, name="rope_scaling")
    if position == "rope":
      rd = head_dim if rotary_dim is None else rotary_dim
      if rd % 2 or not 0 < rd <= head_dim:
        raise ValueError(f"`rotary_dim` must be even and in (0, head_dim={head_dim}], got {rd}.")
      check_rope_base(rope_base, rope_scaling, name="rope_base")
    self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
    self.head_dim = head_dim
    self.v_head_dim = head_dim if v_head_dim is None else v_head_dim
    self.causal, self.position = causal, position
    self.rope_base, self.rotary_dim = rope_base, rotary_dim
    self.rope_interleaved, self.rope_scaling = rope_interleaved, rope_scaling
    self.sliding_window, self.logits_soft_cap = sliding_window, logits_soft_cap
    self.attention_scale, self.implementation, self.dtype = attention_scale, implementation, dtype

    kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype, use_bias=use_bias)
    d, n, k, h, hv = embed_dim, num_heads, num_kv_heads, head_dim, self.v_head_dim
    self.q_proj = Einsum("BTD,DNH->BTNH", (d, n, h), ("embed", "heads", "head_dim"), **kw)
    self.k_proj = Einsum("BSD,DKH->BSKH", (d, k, h), ("embed", "kv_heads", "head_dim"), **kw)
    self.v_proj = Einsum("BSD,DKH->BSKH", (d, k, hv), ("embed", "kv_heads", "head_dim"), **kw)
    self.o_proj = Einsum("BTNH,NHD->BTD", (n, hv, d), ("heads", "head_dim", "embed"),
                         fan_in_axes=(0, 1), **kw)
    self.rel_bias = (T5RelativePositionBias(n, bidirectional=not causal, num_buckets=t5_num_buckets,
                                            max_distance=t5_max_distance, rngs=rngs)
                     if position == "t5" else None)
    # Qwen3-Next: RMSNorm over each q / k head before RoPE, and a sigmoid gate per output head.
    self.q_norm = (RMSNorm(h, eps=norm_eps, rngs=rngs, param_dtype=param_dtype) if qk_norm
                   else None)
    self.k_norm = (RMSNorm(h, eps=norm_eps, rngs=rngs, param_dtype=param_dtype) if qk_norm
                   else None)
    self.gate_proj = (Einsum("BTD,DNH->BTNH", (d, n, hv), ("embed", "heads", "head_dim"), **kw)
                      if output_gate else None)
    # gpt-oss: a learned sink logit per head, one more softmax entry of value zero (initialized
    # to 0: a sink as likely as a key of logit 0).
    self.sinks = (nnx.Param(jnp.zeros((n,), param_dtype), logical_axes=("heads",))
                  if attention_sinks else None)

  # -- cache -----------------------------------------------------------------------------------

  def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
    """An empty cache for ``batch`` sequences of up to ``max_len`` tokens."""
    dtype = dtype or self.dtype or jnp.float32
    return KVCache.init(batch, max_len, self.num_kv_heads, self.head_dim, self.v_head_dim, dtype)

  def init_rolling_cache(self, batch: int, dtype=None) -> RollingKVCache:
    """A ring-buffer cache of the last ``sliding_window`` tokens (``jaxattn.rolling_cache``): decode
    memory independent of the sequence length.  Needs ``causal`` and ``sliding_window``."""
    if self.sliding_window is None or not self.causal:
      raise ValueError(f"a rolling cache needs a causal layer with `sliding_window` set; got "
                       f"causal={self.causal}, sliding_window={self.sliding_window}.")
    dtype = dtype or self.dtype or jnp.float32
    return RollingKVCache.init(batch, int(self.sliding_window), self.num_kv_heads, self.head_dim,
                               self.v_head_dim, dtype)

  def _check_cache_fits(self, cache, batch):
    """A cache built for another batch or another layer is refused as ``cache`` (it failed later
    as a bad ``key``, the tensor the layer computed)."""
    if isinstance(cache, RollingKVCache):    # [B, L, K, H]
      got = (*cache.key.shape[:1], *cache.key.shape[2:], cache.value.shape[3])
    else:
      got = (cache.key.shape[0], cache.num_kv_heads, cache.head_dim, cache.v_head_dim)
    want = (batch, self.num_kv_heads, self.head_dim, self.v_head_dim)
    if got != want:
      raise ValueError(f"`cache` holds [B, K, H, h] = {list(got)}; this layer and `x` need "
                       f"{list(want)} (build it with init_cache / init_rolling_cache).")

  def _check_rolling(self, cache, mask):
    if self.sliding_window is None or not self.causal or cache.window != self.sliding_window:
      raise ValueError(f"a RollingKVCache(window={cache.window}) needs a causal layer with "
                       f"sliding_window={cache.window}; this layer has causal={self.causal}, "
                       f"sliding_window={self.sliding_window}.")
    if self.position in ("alibi", "t5") or mask is not None:
      raise ValueError(f"a RollingKVCache keeps keys out of position order; it supports "
                       f"position='rope' or 'none' and no extra `mask` (position={self.position!r}, "
                       f"mask given: {mask is not None}).")

  def init_paged_cache(self, batch: int, num_pages: int, page_size: int, *,
                       max_pages_per_seq: int | None = None, dtype=None) -> PagedKVCache:
    """An empty paged cache (``jaxattn.paged_cache``): a pool of ``num_pages`` pages of
    ``page_size`` tokens shared by ``batch`` sequences of ragged lengths (a sliding-window layer
    marks it with its window: the pages behind it can be released).  ``dtype`` int8 or
    float8_e4m3fn: quantized keys and values, a scale per token and KV head."""
    dtype = dtype or self.dtype or jnp.float32
    return PagedKVCache.init(batch, num_pages, page_size, self.num_kv_heads, self.head_dim,
                             self.v_head_dim, max_pages_per_seq=max_pages_per_seq, dtype=dtype,
                             window=self.sliding_window if self.causal else None)

  def _paged_call(self, x, positions, segment_ids, mask, cache: PagedKVCache, implementation,
                  num_tokens=None):
    """Prefill / decode against a paged cache: each sequence's ``T`` new tokens (its first
    ``num_tokens[b]``, a ragged chunk) go at its own length (ragged batch) and attend causally to
    everything it holds (the last ``sliding_window + 1`` tokens with a window; ALiBi from the
    positions)."""
    if not self.causal or segment_ids is not None or mask is not None:
      raise ValueError(f"a PagedKVCache supports causal layers (any position scheme, a sliding "
                       f"window too), no `mask` or `segment_ids`; this layer has causal="
                       f"{self.causal}, mask given: {mask is not None}, segment_ids given: "
                       f"{segment_ids is not None}.")
    t = x.shape[1]
    num_tokens = check_num_tokens(num_tokens, x.shape[0], t)
    x = shard(x, ("batch", "length", "act_embed"))
    if positions is None:  # per-sequence positions: the batch is ragged
      positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    q, k, v = self._qkv(x)
    if self.position == "rope":
      rope = dict(base=self.rope_base, rotary_dim=self.rotary_dim,
                  interleaved=self.rope_interleaved, scaling=self.rope_scaling)
      q, k = apply_rope(q, positions, **rope), apply_rope(k, positions, **rope)
    old_lengths, cache = cache.lengths, cache.append(k, v, num_tokens)
    q = shard(q, ("batch", "length", "act_heads", "head_dim"))
    impl = module_decode_implementation(implementation or self.implementation)
    rel = None
    if self.rel_bias is not None:   # T5: the XLA path (the kernels take no learned bias)
      rel = RelativeBias(self.rel_bias.embedding[...], bidirectional=self.rel_bias.bidirectional,
                         num_buckets=self.rel_bias.num_buckets,
                         max_distance=self.rel_bias.max_distance)
      impl = "xla"
    out = paged_attention(q, cache.key_pool, cache.value_pool, cache.page_table, cache.lengths,
                          scale=self.attention_scale, logits_soft_cap=self.logits_soft_cap,
                          implementation=impl, num_tokens=num_tokens,
                          local_window_size=self.sliding_window, alibi_slopes=self._slopes(),
                          relative_bias=rel, sinks=self._sinks(), key_scale=cache.key_scale_pool,
                          value_scale=cache.value_scale_pool)
    y = shard(self.o_proj(self._gate(x, out.astype(q.dtype))), ("batch", "length", "act_embed"))
    return nan_where_dropped(y, old_lengths, cache.lengths, t, num_tokens), cache

  def _decode_kernel(self, t, cache: KVCache, mask, implementation) -> bool:
    """Whether a step with a contiguous cache runs the paged decode kernel over it
    (``jaxattn.ops.decode.cache_attention``): on TPU (or with ``implementation="pallas_tpu"``),
    for up to ``DECODE_MAX_T`` new tokens of a causal layer without relative bias or extra mask
    (a sliding window and ALiBi are the kernel's own), over a cache whose length is a multiple
    of 16 (``init_cache`` on TPU rounds the length up to one: ``jaxattn.cache.cache_length``).
    The flash kernel would get the cache in its head-major layout, which XLA makes by
    transposing the whole cache on every step; the decode kernel reads each valid block once, in
    place (with a window: only the pages of the window)."""
    return (tpu_kernel_requested(implementation or self.implementation) and t <= DECODE_MAX_T
            and self.causal and mask is None and self.rel_bias is None
            and cache.max_len % 16 == 0)

  def _sinks(self):
    """The layer's sink logits ``[N]`` (None without ``attention_sinks``)."""
    return None if self.sinks is None else self.sinks[...]

  def _slopes(self):
    """The layer's ALiBi slopes ``[N]`` (None unless ``position="alibi"``)."""
    return alibi_slopes(self.num_heads) if self.position == "alibi" else None

  def cache_bytes(self, seq_len: int, batch: int = 1, dtype=jnp.bfloat16) -> int:
    """KV cache bytes of this layer for ``seq_len`` tokens: the seed's ``2 x n x h_kv x d x bytes``."""
    return batch * seq_len * kv_cache_bytes_per_token(self.num_kv_heads, self.head_dim, dtype,
                                                      self.v_head_dim)

  # -- forward ---------------------------------------------------------------------------------

  def _qkv(self, x):
    """``q [B,T,N,H], k [B,T,K,H], v [B,T,K,h]``, q and k per-head normed if ``qk_norm``."""
    q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
    if self.q_norm is not None:
      q, k = self.q_norm(q).astype(q.dtype), self.k_norm(k).astype(k.dtype)
    return q, k, v

  def _gate(self, x, out):
    """``out [B,T,N,h] * sigmoid(x W_gate)`` when the layer has an output gate."""
    if self.gate_proj is None:
      return out
    g = jax.nn.sigmoid(self.gate_proj(x).astype(jnp.float32))
    return (out.astype(jnp.float32) * g).astype(out.dtype)

  def __call__(self, x, *, positions=None, segment_ids=None, mask=None,
               cache: KVCache | None = None, implementation=None, num_tokens=None):
    """``x [B, T, D]`` -> ``[B, T, D]`` (and the updated cache when one is given).

    ``positions [B, T]`` (default ``cache.index + arange(T)``) feed RoPE; restart them per segment
    for packed sequences.  ``segment_ids [B, T]`` confines attention to a segment; ``mask`` is an
    extra boolean ``[B|1, N|1, T, S]`` array or ``Mask``.  A ``PagedKVCache`` (``init_paged_cache``)
    gives each sequence its own length; default positions then continue each sequence.  With it,
    ``num_tokens [B]`` makes the step a ragged chunk (continuous batching): sequence ``b``'s new
    tokens are its first ``num_tokens[b]`` rows of ``x`` (only they are cached), the other rows
    are padding and give zeros.
    """
    if x.ndim != 3 or x.shape[-1] != self.embed_dim:
      raise ValueError(f"`x` must be [B, T, D={self.embed_dim}], got shape {x.shape}.")
    if isinstance(cache, PagedKVCache):
      return self._paged_call(x, positions, segment_ids, mask, cache, implementation, num_tokens)
    check_ragged_needs_paged(num_tokens, "PagedKVCache (init_paged_cache)")
    if cache is not None and not isinstance(cache, (KVCache, RollingKVCache)):
      raise ValueError(f"`cache` must be a KVCache / RollingKVCache (init_cache) or a PagedKVCache "
                       f"(init_paged_cache), got {type(cache).__name__}.")
    b, t, _ = x.shape
    x = shard(x, ("batch", "length", "act_embed"))
    offset = 0 if cache is None else cache.index
    if positions is None:
      positions = (offset + jnp.arange(t, dtype=jnp.int32))[None, :]
    q, k, v = self._qkv(x)  # [B, T, N, H], [B, T, K, H], [B, T, K, h]
    if self.position == "rope":
      rope = dict(base=self.rope_base, rotary_dim=self.rotary_dim,
                  interleaved=self.rope_interleaved, scaling=self.rope_scaling)
      q = apply_rope(q, positions, **rope)
      k = apply_rope(k, positions, **rope)
    kv_lengths = None
    rolling = isinstance(cache, RollingKVCache)
    if cache is not None:
      if segment_ids is not None:
        raise ValueError("`segment_ids` (packed sequences) cannot be combined with a KV `cache`.")
      self._check_cache_fits(cache, b)
      if rolling:  # ring buffer: the window and causality come from the slots' positions
        self._check_rolling(cache, mask)
        k, v, mask, cache = cache.extend(k, v)
        k, v = k.astype(q.dtype), v.astype(q.dtype)
      else:
        cache = cache.update(k, v)
        kv_lengths = jnp.full((b,), cache.index, jnp.int32)
        if self._decode_kernel(t, cache, mask, implementation):
          q = shard(q, ("batch", "length", "act_heads", "head_dim"))
          out = cache_attention(q, cache.key, cache.value, kv_lengths,
                                scale=self.attention_scale, logits_soft_cap=self.logits_soft_cap,
                                implementation="pallas_tpu", alibi_slopes=self._slopes(),
                                local_window_size=self.sliding_window, sinks=self._sinks(),
                                key_scale=cache.key_scale, value_scale=cache.value_scale)
          y = shard(self.o_proj(self._gate(x, out)), ("batch", "length", "act_embed"))
          return nan_past_capacity(y, cache), cache
        k, v = (x.astype(q.dtype) for x in cache.split_heads())
    q = shard(q, ("batch", "length", "act_heads", "head_dim"))
    bias = None
    if self.rel_bias is not None:
      q_pos = offset + jnp.arange(t, dtype=jnp.int32)
      bias = self.rel_bias(q_pos, jnp.arange(k.shape[1], dtype=jnp.int32))
    slopes = self._slopes()
    out = dot_product_attention(
        q, k, v, bias, mask, scale=self.attention_scale, is_causal=self.causal and not rolling,
        local_window_size=None if rolling else self.sliding_window, segment_ids=segment_ids,
        kv_lengths=kv_lengths, q_offset=0 if rolling else offset, alibi_slopes=slopes,
        logits_soft_cap=self.logits_soft_cap, sinks=self._sinks(),
        implementation=implementation or self.implementation)
    y = self.o_proj(self._gate(x, out))
    y = shard(y, ("batch", "length", "act_embed"))
    if cache is None:
      return y
    return (y if rolling else nan_past_capacity(y, cache)), cache
