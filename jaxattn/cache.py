"""Explicit cache pytrees.  Decode is ``(module, cache, x) -> (y, cache)`` and equals the full pass."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxattn.checks import is_int
from jaxattn.ops.quantization import check_cache_dtype, kv_quantized, quantize_kv


def nan_past_capacity(y, cache):
  """``y``, a layer's output from a step that wrote ``cache`` (``KVCache``, ``LatentCache`` or
  ``DSACache``), NaN when that step went past the cache's capacity.

  With a concrete index the caches raise on overflow; under ``jit`` (or ``nnx.scan``) the index
  is traced and cannot raise, and ``dynamic_update_slice`` clamps the write onto the last slots:
  silently wrong outputs.  A NaN output shows it instead (one select over ``y``)."""
  if not isinstance(cache.index, jax.core.Tracer):
    return y
  return jnp.where(cache.index > cache.max_len, jnp.asarray(jnp.nan, y.dtype), y)


def cache_length(max_len: int, length_align: int | None = None) -> int:
  """Slots a contiguous cache allocates for ``max_len`` tokens: ``max_len`` rounded up to a
  multiple of ``length_align``.  None: on TPU 16 (128 past 512 slots), else 1 (exact).  The TPU
  decode kernels read a contiguous cache in place as pages of 16 to 512 slots that divide its
  length (``jaxattn.ops.decode.view_page_size``); a cache of another length goes to flash
  attention, which re-lays out the whole cache on every decode step."""
  if length_align is None:
    length_align = (128 if max_len > 512 else 16) if jax.default_backend() == "tpu" else 1
  if isinstance(length_align, bool) or not isinstance(length_align, int) or length_align < 1:
    raise ValueError(f"`length_align` must be None or a positive int, got {length_align!r}.")
  return -(-max_len // length_align) * length_align


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """Keys and values of the tokens seen so far, in a fixed-size buffer.

  ``key [B, L, K * H]``, ``value [B, L, K * h]``: a token's ``K`` KV heads side by side in one row
  (the element order of ``[B, L, K, H]``; ``split_heads()`` gives that view), ``L`` the capacity;
  ``index`` (int32 scalar) is how many positions are filled, the same for every batch row.  Slots
  ``>= index`` are masked out by the attention call (``kv_lengths``), so their contents never
  matter.  ``num_kv_heads`` (``K``) is static pytree metadata.  Writing past ``L`` raises with a
  concrete ``index``; under ``jit`` the attention layers' outputs of such a step are NaN
  instead (``nan_past_capacity``).

  Why rows of ``K * H``: on TPU, XLA's default layout for a ``[B, L, K, H]`` array whose minor
  dimensions are not whole ``(8|16, 128)`` tiles (heads of 64, or one KV head) puts another
  dimension minor, so the decode kernel reading the cache in place
  (``jaxattn.ops.decode.cache_attention``) would find it re-tiled by XLA on every step;
  ``[B, L, K * H]`` is row-major whenever ``K * H`` is a multiple of 128.

  Quantized (``dtype`` int8 or float8_e4m3fn at ``init``): ``key`` / ``value`` hold one-byte
  codes and ``key_scale`` / ``value_scale [B, K, L]`` fp32 a scale per token and KV head
  (``jaxattn.ops.quantization.quantize_kv``); ``split_heads`` dequantizes.
  """

  key: Float[Array, "B L KH"]
  value: Float[Array, "B L Kh"]
  index: Int[Array, ""]
  num_kv_heads: int = dataclasses.field(default=1, metadata=dict(static=True))
  key_scale: Float[Array, "B K L"] | None = None
  value_scale: Float[Array, "B K L"] | None = None

  @classmethod
  def init(cls, batch: int, max_len: int, num_kv_heads: int, head_dim: int,
           v_head_dim: int | None = None, dtype=jnp.float32, *,
           length_align: int | None = None) -> "KVCache":
    """``max_len`` slots, rounded up to a multiple of ``length_align`` (``cache_length``; None:
    16 on TPU, 128 past 512 slots, so the decode kernel reads the cache in place; else exact).
    ``dtype`` int8 / float8_e4m3fn: a quantized cache."""
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    for name, v in (("batch", batch), ("max_len", max_len), ("num_kv_heads", num_kv_heads),
                    ("head_dim", head_dim), ("v_head_dim", v_head_dim)):
      if not is_int(v) or v < 1:    # (a float max_len was truncated)
        raise ValueError(f"KVCache.init: `{name}` must be an int >= 1, got {v!r}.")
    dtype = check_cache_dtype(dtype, "KVCache.init")
    length = cache_length(int(max_len), length_align)
    scales = ({} if not kv_quantized(dtype) else
              {f"{n}_scale": jnp.ones((batch, num_kv_heads, length), jnp.float32)
               for n in ("key", "value")})
    return cls(key=jnp.zeros((batch, length, num_kv_heads * head_dim), dtype),
               value=jnp.zeros((batch, length, num_kv_heads * v_head_dim), dtype),
               index=jnp.zeros((), jnp.int32), num_kv_heads=int(num_kv_heads), **scales)

  @property
  def quantized(self) -> bool:
    """Whether the buffers hold quantized codes with per-token scales."""
    return self.key_scale is not None

  @property
  def max_len(self) -> int:
    return self.key.shape[1]

  @property
  def head_dim(self) -> int:
    return self.key.shape[2] // self.num_kv_heads

  @property
  def v_head_dim(self) -> int:
    return self.value.shape[2] // self.num_kv_heads

  @property
  def nbytes(self) -> int:
    """Bytes held by the buffers at full capacity (the seed's ``2 x n x h x d x bytes`` per layer;
    a quantized cache's scales too)."""
    arrays = (self.key, self.value, self.key_scale, self.value_scale)
    return int(sum(a.size * a.dtype.itemsize for a in arrays if a is not None))

  def split_heads(self) -> tuple[Float[Array, "B L K H"], Float[Array, "B L K h"]]:
    """``(key [B, L, K, H], value [B, L, K, h])``: the buffers with the heads split out (a
    quantized cache's dequantized, in fp32)."""
    b, length, kh = self.key.shape[0], self.key.shape[1], self.num_kv_heads

    def one(x, scale):
      x = x.reshape(b, length, kh, -1)
      if scale is None:
        return x
      return x.astype(jnp.float32) * jnp.swapaxes(scale, 1, 2)[..., None]

    return one(self.key, self.key_scale), one(self.value, self.value_scale)

  def update(self, key: Float[Array, "B T K H"], value: Float[Array, "B T K h"]) -> "KVCache":
    """Writes ``T`` new positions at ``index`` and advances it."""
    t, b, kh = key.shape[1], self.key.shape[0], self.num_kv_heads
    if key.ndim != 4 or key.shape[0] != b or key.shape[2:] != (kh, self.head_dim):
      raise ValueError(f"`key` {key.shape} does not fit the cache: expected [B={b}, T, K={kh}, "
                       f"H={self.head_dim}].")
    if value.shape != key.shape[:3] + (self.v_head_dim,):
      raise ValueError(f"`value` {value.shape} does not fit the cache: expected "
                       f"{key.shape[:3] + (self.v_head_dim,)} ([B, T, K, h]).")
    if t > self.max_len:
      raise ValueError(f"{t} new tokens exceed the cache capacity max_len={self.max_len}.")
    if not isinstance(self.index, jax.core.Tracer) and int(self.index) + t > self.max_len:
      raise ValueError(f"cache overflow: index {int(self.index)} + {t} new tokens > max_len "
                       f"{self.max_len}.")
    start = (0, self.index, 0)
    rows = lambda x, like: x.reshape(b, t, like.shape[-1]).astype(like.dtype)  # noqa: E731
    scales = {}
    if self.quantized:      # codes, and their scales [B, T, K] -> [B, K, T] at the index
      (key, ks), (value, vs) = (quantize_kv(x, self.key.dtype) for x in (key, value))
      put = lambda buf, s: jax.lax.dynamic_update_slice(buf, jnp.swapaxes(s, 1, 2),  # noqa: E731
                                                        (0, 0, self.index))
      scales = dict(key_scale=put(self.key_scale, ks), value_scale=put(self.value_scale, vs))
    return KVCache(
        key=jax.lax.dynamic_update_slice(self.key, rows(key, self.key), start),
        value=jax.lax.dynamic_update_slice(self.value, rows(value, self.value), start),
        index=self.index + t, num_kv_heads=kh, **scales)


def kv_cache_bytes_per_token(num_kv_heads: int, head_dim: int, dtype=jnp.bfloat16,
                             v_head_dim: int | None = None) -> int:
  """Per-token, per-layer KV cache bytes: ``K * (H + h) * bytes`` (= ``2 K H bytes`` when h = H);
  a quantized cache (int8 / float8_e4m3fn) adds its two fp32 scales per KV head, ``8 K``."""
  v_head_dim = head_dim if v_head_dim is None else v_head_dim
  scales = 8 * num_kv_heads if kv_quantized(dtype) else 0
  return int(num_kv_heads * (head_dim + v_head_dim) * np.dtype(dtype).itemsize + scales)
