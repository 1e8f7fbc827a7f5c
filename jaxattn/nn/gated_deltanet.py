"""The Gated DeltaNet layer (Qwen3-Next's linear-attention layer) and its fixed-size decode cache.

    q, k = SiLU(causal_conv4(x W_q)), SiLU(causal_conv4(x W_k))     [B, T, K, H], unit length
    v    = SiLU(causal_conv4(x W_v))                                  [B, T, N, h]
    beta = sigmoid(x W_b),  g = -exp(A_log) * softplus(x W_a + dt_bias)           [B, T, N]
    o    = gated_delta_rule(q, k, v, g, beta)        (q scaled by 1/sqrt(H) in the rule)
    y    = (RMSNorm(o) * SiLU(x W_z)) W_o                                          [B, T, D]

The causal convolutions are depthwise with a short kernel (4 taps: the current and three previous
tokens).  Value heads ``N`` are a multiple of key heads ``K`` (value head ``n`` reads key head
``n // (N // K)``).  The decode cache is the last ``W - 1`` projected inputs of each convolution
plus the ``[B, N, H, h]`` recurrent memory: its size does not depend on how many tokens were seen.

Continuous batching: with a cache, ``num_tokens [B]`` marks row ``b``'s first ``num_tokens[b]``
tokens as real and the rest as padding (one row prefills a chunk while others decode one token or
sit idle).  Padding leaves the cache untouched and outputs zeros; ``DeltaNetCache.reset`` empties
the rows of finished sequences so their slots take new requests.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from jaxattn.checks import check_int, check_nonnegative
from jaxattn.nn.linear import Einsum, param
from jaxattn.ops.decode import check_num_tokens
from jaxattn.ops.delta_rule import (IMPLEMENTATIONS, gated_delta_rule, gated_delta_rule_step,
                                    l2_normalize, segment_resets)
from jaxattn.ops.norms import rms_norm
from jaxattn.ops.quantization import kv_quantized
from jaxattn.sharding import shard


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeltaNetCache:
  """Decode state of one Gated DeltaNet layer: convolution tails and the recurrent memory.

  ``conv_q, conv_k [B, W-1, K, H]`` and ``conv_v [B, W-1, N, h]`` hold the last ``W - 1``
  projected (pre-convolution) inputs, zeros before the first token; ``state [B, N, H, h]`` is the
  fp32 memory (key dimension first).  Nothing here grows with the sequence.

  ``snapshots=True`` (``with_snapshots``, for speculative decoding): the layer's next call over
  ``T`` tokens returns the cache before and after each of them, every array with an axis ``T + 1``
  after ``B`` (``conv_q [B, T+1, W-1, K, H]``, ``state [B, T+1, N, H, h]``), computed token by
  token as decode steps would; ``at(j)`` is the plain cache after the call's first ``j`` tokens
  (0: as it was; ``j [B]``: per row).
  """

  conv_q: Float[Array, "B W K H"]
  conv_k: Float[Array, "B W K H"]
  conv_v: Float[Array, "B W N h"]
  state: Float[Array, "B N H h"]
  snapshots: bool = dataclasses.field(default=False, metadata=dict(static=True))

  def with_snapshots(self) -> "DeltaNetCache":
    """This cache asking its layer's next call for the cache after each token."""
    return dataclasses.replace(self, snapshots=True)

  def at(self, j: Int[Array, "*B"]) -> "DeltaNetCache":
    """The plain cache after the first ``j`` tokens of a snapshot call: ``j`` an int (every row)
    or ``[B]`` (row ``b`` after its first ``j[b]``); may be traced.  The snapshot axis sits
    fourth from the end of every array, after ``B``, whatever layer axes are stacked."""
    if not self.snapshots:
      raise ValueError("DeltaNetCache.at: this cache holds one state, not per-token snapshots.")
    b = self.state.shape[-5]
    rows = jnp.broadcast_to(jnp.asarray(j, jnp.int32), (b,))

    def pick(x):
      idx = jnp.broadcast_to(rows.reshape((b, 1, 1, 1, 1)), x.shape[:-4] + (1,) + x.shape[-3:])
      return jnp.take_along_axis(x, idx, axis=x.ndim - 4)[..., 0, :, :, :]
    return dataclasses.replace(jax.tree.map(pick, self), snapshots=False)

  @classmethod
  def init(cls, batch: int, num_heads: int, num_key_heads: int, head_dim: int, v_head_dim: int,
           conv_kernel_size: int = 4, dtype=jnp.float32) -> "DeltaNetCache":
    for name, v in (("batch", batch), ("num_heads", num_heads), ("num_key_heads", num_key_heads),
                    ("head_dim", head_dim), ("v_head_dim", v_head_dim),
                    ("conv_kernel_size", conv_kernel_size)):
      if int(v) < 1:
        raise ValueError(f"DeltaNetCache.init: `{name}` must be >= 1, got {v!r}.")
    w = conv_kernel_size - 1
    return cls(conv_q=jnp.zeros((batch, w, num_key_heads, head_dim), dtype),
               conv_k=jnp.zeros((batch, w, num_key_heads, head_dim), dtype),
               conv_v=jnp.zeros((batch, w, num_heads, v_head_dim), dtype),
               state=jnp.zeros((batch, num_heads, head_dim, v_head_dim), jnp.float32))

  def reset(self, done: Bool[Array, "B"]) -> "DeltaNetCache":
    """This cache with the rows where ``done [B]`` (bool) emptied, as ``init`` makes them (state
    and convolution tails zero), the others unchanged: a finished sequence's slot is reused by a
    new request.  Works under ``jit`` (``done`` traced)."""
    b = self.state.shape[0]
    if not hasattr(done, "shape") or tuple(done.shape) != (b,):
      raise ValueError(f"`done` must be a bool array of shape [B={b}], got "
                       f"{getattr(done, 'shape', type(done).__name__)}.")
    if done.dtype != jnp.bool_:     # an int mask would be read as 0 / 1 or fail to broadcast
      raise ValueError(f"`done` must be a bool array, got dtype {done.dtype}.")

    def clear(x):
      return jnp.where(done.reshape((b,) + (1,) * (x.ndim - 1)), jnp.zeros((), x.dtype), x)
    return DeltaNetCache(conv_q=clear(self.conv_q), conv_k=clear(self.conv_k),
                         conv_v=clear(self.conv_v), state=clear(self.state))

  @property
  def nbytes(self) -> int:
    """Bytes held, the same after any number of tokens."""
    return int(sum(x.size * x.dtype.itemsize for x in (self.conv_q, self.conv_k, self.conv_v,
                                                       self.state)))


def causal_depthwise_conv(
    x: Float[Array, "B T *C"],
    weight: Float[Array, "W *C"],
    *,
    prefix: Float[Array, "B W1 *C"] | None = None,
    segment_ids: Int[Array, "B T"] | None = None,
    num_tokens: Int[Array, "B"] | None = None,
) -> tuple[Float[Array, "B T *C"], Float[Array, "B W1 *C"]]:
  """``out[t] = sum_w weight[w] * x[t - (W - 1) + w]`` per channel (PyTorch's ``Conv1d`` with
  ``groups=channels`` and left padding ``W - 1``), in fp32; returns ``(out, new prefix)``.

  ``prefix [B, W-1, *C]`` supplies the inputs before ``x`` (zeros when None); the new prefix is
  the last ``W - 1`` inputs, for the next call; with ``num_tokens [B]`` (ragged chunks) only row
  ``b``'s first ``num_tokens[b]`` inputs count, so its new prefix is the last ``W - 1`` of
  ``prefix ++ x[b, :num_tokens[b]]`` (``prefix`` itself for 0).  Outputs are computed at every
  position; those past ``num_tokens[b]`` are the caller's to drop.  ``segment_ids [B, T]`` zeroes
  taps that reach into an earlier packed sequence.  A sequence is a contiguous run of one id (as in
  ``gated_delta_rule``, whose memory is cleared where the id changes), so a reused id starts a new
  sequence; ``prefix`` belongs to the first run.
  """
  taps = weight.shape[0]
  b, t = x.shape[:2]
  if weight.shape[1:] != x.shape[2:]:
    raise ValueError(f"`weight` {weight.shape} must be [W, *C] with C = x's channels {x.shape[2:]}.")
  if prefix is None:
    prefix = jnp.zeros((b, taps - 1) + x.shape[2:], x.dtype)
  elif prefix.shape != (b, taps - 1) + x.shape[2:]:
    raise ValueError(f"`prefix` must have shape {(b, taps - 1) + x.shape[2:]}, got {prefix.shape}.")
  if segment_ids is not None:
    if tuple(segment_ids.shape) != (b, t):
      raise ValueError(f"`segment_ids` must have shape [B, T] = {(b, t)}, got "
                       f"{tuple(segment_ids.shape)}.")
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
      raise ValueError(f"`segment_ids` must be integers, got {segment_ids.dtype}.")
    # Run index per token: 0 for the first run (and the prefix), +1 wherever the id changes.
    run = jnp.cumsum(segment_resets(segment_ids, b, t), axis=1)
  num_tokens = check_num_tokens(num_tokens, b, t)
  full = jnp.concatenate([prefix.astype(x.dtype), x], axis=1)          # [B, W-1+T, *C]
  xf = full.astype(jnp.float32)
  wf = weight.astype(jnp.float32)
  extra = (1,) * (x.ndim - 2)
  out = jnp.zeros((b, t) + x.shape[2:], jnp.float32)
  for w in range(taps):  # W is 4: a short sum of shifted copies beats a general convolution
    tap = xf[:, w:w + t] * wf[w]
    lag = taps - 1 - w
    if segment_ids is not None and lag:
      src = jnp.pad(run, ((0, 0), (lag, 0)))[:, :t]          # the tapped input's run
      tap = tap * (src == run).reshape((b, t) + extra)
    out = out + tap
  if num_tokens is None:
    return out.astype(x.dtype), full[:, t:]
  # x[b, j] sits at row W-1+j of `full`, so the last W-1 of prefix ++ x[b, :n] are rows n..n+W-2.
  rows = num_tokens[:, None] + jnp.arange(taps - 1, dtype=jnp.int32)[None, :]        # [B, W-1]
  tail = jnp.take_along_axis(full, rows.reshape(rows.shape + (1,) * (x.ndim - 2)), axis=1)
  return out.astype(x.dtype), tail


def _a_log_init(low: float, high: float):
  def init(key, shape, dtype=jnp.float32):
    return jnp.log(jax.random.uniform(key, shape, jnp.float32, low, high)).astype(dtype)
  return init


def _dt_bias_init(dt_min: float, dt_max: float, floor: float):
  """``softplus^{-1}(dt)`` with ``dt`` log-uniform in ``[dt_min, dt_max]`` (Mamba-2 / Gated
  DeltaNet), so the initial step sizes ``softplus(dt_bias)`` span two decades."""
  def init(key, shape, dtype=jnp.float32):
    u = jax.random.uniform(key, shape, jnp.float32)
    dt = jnp.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    dt = jnp.maximum(dt, floor)
    return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)
  return init


def _conv_init(taps: int):
  """PyTorch's ``Conv1d`` default for a depthwise kernel: ``U(-1/sqrt(W), 1/sqrt(W))``."""
  bound = 1.0 / math.sqrt(taps)

  def init(key, shape, dtype=jnp.float32):
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound).astype(dtype)
  return init


class GatedDeltaNet(nnx.Module):
  """Gated DeltaNet token mixer: ``[B, T, D] -> [B, T, D]`` (see the module docstring).

  Args:
    embed_dim: ``D``.
    num_heads: value heads ``N`` (the memory has one ``[H, h]`` matrix per value head).
    num_key_heads: query/key heads ``K`` (default ``N``); ``N % K == 0``.
    head_dim: query/key head size ``H`` (default ``D // N``).
    v_head_dim: value head size ``h`` (default ``H``).
    conv_kernel_size: taps of the causal depthwise convolutions (4 in Qwen3-Next and the paper).
    norm_eps: epsilon of the gated RMSNorm.
    chunk_size, implementation: passed to ``gated_delta_rule``.
    a_init_range: ``A = exp(A_log)`` is drawn uniformly from this range (Qwen3-Next: (0.01, 16);
      flash-linear-attention: (0, 16), whose 0 would make ``A_log = -inf``).
    dt_min, dt_max, dt_init_floor: ``softplus(dt_bias)`` starts log-uniform in ``[dt_min,
      dt_max]`` (the Gated DeltaNet / Mamba-2 reference).  Qwen3-Next instead sets ``dt_bias = 1``.
  """

  def __init__(
      self,
      embed_dim: int,
      num_heads: int,
      num_key_heads: int | None = None,
      head_dim: int | None = None,
      *,
      v_head_dim: int | None = None,
      conv_kernel_size: int = 4,
      norm_eps: float = 1e-6,
      chunk_size: int = 64,
      implementation=None,
      a_init_range: tuple[float, float] = (0.01, 16.0),
      dt_min: float = 1e-3,
      dt_max: float = 0.1,
      dt_init_floor: float = 1e-4,
      rngs: nnx.Rngs,
      dtype=None,
      param_dtype=jnp.float32,
  ):
    num_key_heads = num_heads if num_key_heads is None else num_key_heads
    for name, v in (("embed_dim", embed_dim), ("num_heads", num_heads),
                    ("num_key_heads", num_key_heads), ("conv_kernel_size", conv_kernel_size)):
      check_int(name, v)        # (True passed as 1; a float kernel size was a TypeError)
    if num_heads % num_key_heads:
      raise ValueError(f"`num_heads` ({num_heads}) must be a multiple of `num_key_heads` "
                       f"({num_key_heads}): each key head serves num_heads / num_key_heads value "
                       "heads.")
    if head_dim is None:
      if embed_dim % num_heads:
        raise ValueError(f"`embed_dim` ({embed_dim}) is not divisible by `num_heads` ({num_heads}); "
                         "pass `head_dim` explicitly.")
      head_dim = embed_dim // num_heads
    check_int("head_dim", head_dim)
    check_int("v_head_dim", v_head_dim, allow_none=True)
    # Checked here as well as per call, so that a bad setting fails where it is written.
    if (not isinstance(chunk_size, (int, np.integer)) or isinstance(chunk_size, bool)
        or chunk_size < 1 or chunk_size & (chunk_size - 1)):
      raise ValueError(f"`chunk_size` must be a power of two >= 1, got {chunk_size!r}.")
    if implementation is not None and implementation not in IMPLEMENTATIONS:
      raise ValueError(f"`implementation` must be None or one of {IMPLEMENTATIONS}, got "
                       f"{implementation!r}.")
    check_nonnegative("norm_eps", norm_eps)
    lo, hi = a_init_range
    if not 0 < lo < hi:
      raise ValueError(f"`a_init_range` must satisfy 0 < low < high, got {a_init_range!r}.")
    if not 0 < dt_min <= dt_max:
      raise ValueError(f"`dt_min` ({dt_min}) and `dt_max` ({dt_max}) must satisfy 0 < min <= max.")
    self.embed_dim, self.num_heads, self.num_key_heads = embed_dim, num_heads, num_key_heads
    self.head_dim = head_dim
    self.v_head_dim = head_dim if v_head_dim is None else v_head_dim
    self.conv_kernel_size, self.norm_eps = conv_kernel_size, norm_eps
    self.chunk_size, self.implementation, self.dtype = chunk_size, implementation, dtype

    d, n, k, h, hv = embed_dim, num_heads, num_key_heads, head_dim, self.v_head_dim
    w = conv_kernel_size
    kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    self.q_proj = Einsum("BTD,DKH->BTKH", (d, k, h), ("embed", "kv_heads", "head_dim"), **kw)
    self.k_proj = Einsum("BTD,DKH->BTKH", (d, k, h), ("embed", "kv_heads", "head_dim"), **kw)
    self.v_proj = Einsum("BTD,DNh->BTNh", (d, n, hv), ("embed", "heads", "head_dim"), **kw)
    self.z_proj = Einsum("BTD,DNh->BTNh", (d, n, hv), ("embed", "heads", "head_dim"), **kw)  # gate
    self.b_proj = Einsum("BTD,DN->BTN", (d, n), ("embed", "heads"), **kw)   # write strength
    self.a_proj = Einsum("BTD,DN->BTN", (d, n), ("embed", "heads"), **kw)   # step size
    self.o_proj = Einsum("BTNh,NhD->BTD", (n, hv, d), ("heads", "head_dim", "embed"),
                         fan_in_axes=(0, 1), **kw)
    conv = _conv_init(w)
    self.conv_q = param(rngs, conv, (w, k, h), (None, "kv_heads", "head_dim"), param_dtype)
    self.conv_k = param(rngs, conv, (w, k, h), (None, "kv_heads", "head_dim"), param_dtype)
    self.conv_v = param(rngs, conv, (w, n, hv), (None, "heads", "head_dim"), param_dtype)
    self.A_log = param(rngs, _a_log_init(lo, hi), (n,), ("heads",), param_dtype)
    self.dt_bias = param(rngs, _dt_bias_init(dt_min, dt_max, dt_init_floor), (n,), ("heads",),
                         param_dtype)
    self.norm_scale = param(rngs, nnx.initializers.ones_init(), (hv,), ("norm",), param_dtype)

  # -- cache -----------------------------------------------------------------------------------

  def init_cache(self, batch: int, max_len: int | None = None, dtype=None) -> DeltaNetCache:
    """An empty decode cache.  ``max_len`` is accepted for interface parity with attention caches
    and ignored: the state does not grow."""
    del max_len
    if dtype is not None and kv_quantized(dtype):   # a quantized KV cache for attention layers:
      dtype = None                                  # no bearing on a recurrent state
    dtype = dtype or self.dtype or jnp.float32
    return DeltaNetCache.init(batch, self.num_heads, self.num_key_heads, self.head_dim,
                              self.v_head_dim, self.conv_kernel_size, dtype)

  def cache_bytes(self, seq_len: int, batch: int = 1, dtype=jnp.bfloat16) -> int:
    """Decode-cache bytes after ``seq_len`` tokens: constant (fp32 memory + ``dtype`` conv tails;
    a quantized KV cache's ``dtype`` leaves them in the compute dtype, as ``init_cache``)."""
    del seq_len
    if kv_quantized(dtype):
      dtype = self.dtype or jnp.float32
    conv = (self.conv_kernel_size - 1) * (2 * self.num_key_heads * self.head_dim
                                          + self.num_heads * self.v_head_dim)
    state = self.num_heads * self.head_dim * self.v_head_dim
    return int(batch * (conv * np.dtype(dtype).itemsize + state * 4))

  # -- forward ---------------------------------------------------------------------------------

  def gates(self, x: Float[Array, "B T D"]) -> tuple[Float[Array, "B T N"], Float[Array, "B T N"]]:
    """``(g, beta)`` in fp32: ``g = -exp(A_log) * softplus(x W_a + dt_bias)``,
    ``beta = sigmoid(x W_b)``."""
    a = self.a_proj(x).astype(jnp.float32)
    g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
        a + self.dt_bias[...].astype(jnp.float32))
    beta = jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32))
    return g, beta

  def __call__(self, x: Float[Array, "B T D"], *, segment_ids: Int[Array, "B T"] | None = None,
               cache: DeltaNetCache | None = None, positions=None, implementation=None,
               num_tokens: Int[Array, "B"] | None = None):
    """``x [B, T, D]`` -> ``[B, T, D]``, and the updated cache when one is given.

    ``segment_ids [B, T]`` (packed sequences) stops both the convolutions and the memory at
    segment boundaries: wherever the id changes (a reused id starts a new sequence).
    ``positions`` is accepted for interface parity with attention and unused: the layer has no
    positional encoding (order enters through the convolution and the recurrence).

    ``num_tokens [B]`` (ints in ``[0, T]``, only with a ``cache``; may be traced) makes the call
    ragged, for continuous batching: row ``b``'s real tokens are its first ``num_tokens[b]``, the
    rest is padding of any value.  Row ``b``'s outputs at ``t < num_tokens[b]`` are those of a call
    on that row alone with only its real tokens, its outputs after them are zeros, and its new
    cache is the one after its real tokens only (a row with 0 keeps its cache exactly).  None
    means ``T`` everywhere.
    """
    del positions
    if x.ndim != 3 or x.shape[-1] != self.embed_dim:
      raise ValueError(f"`x` must be [B, T, D={self.embed_dim}], got shape {x.shape}.")
    if segment_ids is not None and cache is not None:
      raise ValueError("`segment_ids` (packed sequences) cannot be combined with a decode `cache`.")
    valid = None
    if num_tokens is not None:
      if cache is None:
        raise ValueError("`num_tokens` (ragged chunks) needs a decode `cache`: it says which of "
                         "each row's T tokens extend that row's cached sequence.")
      b, t = x.shape[:2]
      num_tokens = check_num_tokens(num_tokens, b, t)
      valid = jnp.arange(t, dtype=jnp.int32)[None, :] < num_tokens[:, None]        # [B, T]
      # Padding may hold anything, NaN included.  Its q, k, v still enter the rule's arithmetic
      # (times beta = 0 below, and 0 * NaN = NaN), so it is zeroed before the projections.
      x = jnp.where(valid[..., None], x, jnp.zeros((), x.dtype))
    x = shard(x, ("batch", "length", "act_embed"))
    pre = {"q": self.q_proj(x), "k": self.k_proj(x), "v": self.v_proj(x)}  # before the conv
    conved, tails = {}, {}
    for name, weight in (("q", self.conv_q), ("k", self.conv_k), ("v", self.conv_v)):
      prefix = None if cache is None else getattr(cache, "conv_" + name)
      y, tails[name] = causal_depthwise_conv(pre[name], weight[...], prefix=prefix,
                                             segment_ids=segment_ids, num_tokens=num_tokens)
      conved[name] = jax.nn.silu(y)
    q = l2_normalize(conved["q"])
    k = l2_normalize(conved["k"])
    q = shard(q, ("batch", "length", "act_heads", "head_dim"))
    v = shard(conved["v"], ("batch", "length", "act_heads", "head_dim"))
    g, beta = self.gates(x)
    if valid is not None:
      # Padding becomes a no-op of the rule: a_t = exp(g_t) = 1 keeps the memory undecayed and
      # beta_t = 0 writes nothing, so S passes through unchanged (the recurrent and chunked forms,
      # and any kernel, see only these inputs).  Padding follows the real tokens of its row, so
      # the real tokens' outputs never see it either.
      g = jnp.where(valid[..., None], g, 0.0)
      beta = jnp.where(valid[..., None], beta, 0.0)
    snapshots = cache is not None and cache.snapshots
    if snapshots:
      # Token by token, as decode steps: the state after each token is kept (a ragged chunk's
      # padding is a no-op of the rule, so its snapshots repeat the last real token's).
      def body(state, xs):
        out, state = gated_delta_rule_step(*xs, state)
        return state, (out, state)
      xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta))
      _, (o, state) = jax.lax.scan(body, cache.state, xs)
      o = jnp.moveaxis(o, 0, 1)
      state = jnp.concatenate([cache.state[:, None], jnp.moveaxis(state, 0, 1)], axis=1)
    else:
      o, state = gated_delta_rule(
          q, k, v, g, beta, initial_state=None if cache is None else cache.state,
          output_final_state=cache is not None, chunk_size=self.chunk_size,
          segment_ids=segment_ids, implementation=implementation or self.implementation)
    # Gated RMSNorm per value head, in fp32: normalize first, then gate with SiLU(z).
    z = self.z_proj(x)
    o = rms_norm(o.astype(jnp.float32), self.norm_scale[...], eps=self.norm_eps)
    o = (o * jax.nn.silu(z.astype(jnp.float32))).astype(z.dtype)
    y = shard(self.o_proj(o), ("batch", "length", "act_embed"))
    if cache is None:
      return y
    if snapshots:   # the tails after j tokens: inputs j .. j + W - 2 of prefix ++ x
      def tails_each(name):
        prefix = getattr(cache, "conv_" + name)
        full = jnp.concatenate([prefix.astype(pre[name].dtype), pre[name]], axis=1)
        w = prefix.shape[1]
        after = jnp.stack([full[:, j:j + w] for j in range(1, x.shape[1] + 1)], axis=1)
        return jnp.concatenate([prefix[:, None], after.astype(prefix.dtype)], axis=1)
      y = y if valid is None else jnp.where(valid[..., None], y, jnp.zeros((), y.dtype))
      return y, DeltaNetCache(conv_q=tails_each("q"), conv_k=tails_each("k"),
                              conv_v=tails_each("v"), state=state, snapshots=True)
    new = DeltaNetCache(conv_q=tails["q"].astype(cache.conv_q.dtype),
                        conv_k=tails["k"].astype(cache.conv_k.dtype),
                        conv_v=tails["v"].astype(cache.conv_v.dtype), state=state)
    if valid is None:
      return y, new
    # Zero already (a zeroed x gives SiLU(z) = 0: the projections have no bias); explicit so the
    # contract does not rest on that.
    y = jnp.where(valid[..., None], y, jnp.zeros((), y.dtype))
    # Idle rows get their cache back as it was, bit for bit: the no-op above is exact in both XLA
    # forms, but a tail cast through x's dtype (a bf16 x with an fp32 cache) or a kernel that
    # rounds the memory would otherwise perturb a sequence that received no token.
    idle = num_tokens == 0
    return y, jax.tree.map(
        lambda fresh, old: jnp.where(idle.reshape((-1,) + (1,) * (old.ndim - 1)), old, fresh),
        new, cache)
