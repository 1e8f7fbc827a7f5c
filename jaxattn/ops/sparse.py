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

Everything here is the XLA reference (gathers); ``sparse_attention`` and ``sparse_mla_attention``
dispatch to kernels that fetch only the selected rows: the native CPU kernel
(``jaxattn.ops.sparse_cpu``) and the Pallas kernels of ``pallas_kernels.sparse_attention`` (TPU:
manual row DMAs; GPU: Triton gathers).  Their backward pass is the reference's gradient taken in
chunks of query rows (``sparse_attention_vjp``: scratch bounded whatever ``T``).
"""

from __future__ import annotations

import functools

import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from jaxattn import native
from jaxattn.checks import check_int_array, is_int
from jaxattn.ops import sparse_cpu
from jaxattn.ops.attention import check_kv_lengths, check_q_offset, check_scale
from jaxattn.ops.quantization import (QUANT_FORMATS, QuantFormat, fake_quantize, quantize_fp8,
                                      quantize_int8)

_F32 = jnp.float32
NEG_INF = -jnp.inf
# Operand dtypes of the indexer's dot products: None = fp32; "bfloat16" = bf16 operands with fp32
# accumulation (DeepSeek-V3.2 scores in FP8; bf16 is the reduced precision XLA:CPU runs fast).
DOT_DTYPES = (None, "bfloat16")


IMPLEMENTATIONS = ("xla", "cpu", "pallas_tpu", "pallas_gpu")


def _resolve_implementation(implementation, gathered_rows=None, pool_rows=None):
  """The ``implementation`` argument of the DSA ops.  None: ``"cpu"`` where the native kernels are
  built; on TPU ``"pallas_tpu"`` when the call gathers at least as many rows as the cache holds
  (``gathered_rows >= pool_rows``: prefill), else ``"xla"`` (the kernel's row gathers need the
  cache re-tiled on every call, see docs/performance.md); else ``"xla"`` (the GPU kernel is opt-in
  until a GPU run has timed it).  The Pallas names run interpreted off their hardware."""
  if implementation is None:
    if jax.default_backend() == "tpu":
      big = gathered_rows is not None and gathered_rows >= pool_rows
      return "pallas_tpu" if big else "xla"
    return "cpu" if sparse_cpu.available() else "xla"
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"`implementation` must be None or one of {IMPLEMENTATIONS}, got "
                     f"{implementation!r}.")
  if implementation == "cpu" and not sparse_cpu.available():
    raise ValueError("`implementation='cpu'` needs a CPU backend and the native kernels: "
                     + (native.reason() or f"the backend is {jax.default_backend()!r}"))
  return implementation


def _check_dot_dtype(dot_dtype):
  if dot_dtype not in DOT_DTYPES:
    raise ValueError(f"`dot_dtype` must be one of {DOT_DTYPES}, got {dot_dtype!r}.")


def _check_index_operands(q_index, k_index, weights) -> tuple[int, int, int, int]:
  """Shapes of the indexer's operands (``[B, T, H_I, d]``, ``[B, S, d]``, ``[B, T, H_I]``);
  returns ``(B, T, H_I, d)``."""
  if q_index.ndim != 4 or k_index.ndim != 3 or weights.ndim != 3:
    raise ValueError(f"`q_index` [B, T, H_I, d], `k_index` [B, S, d], `weights` [B, T, H_I] have "
                     f"ranks 4, 3, 3; got shapes {q_index.shape}, {k_index.shape}, "
                     f"{weights.shape}.")
  b, t, hi, d = q_index.shape
  if k_index.shape[0] != b or k_index.shape[2] != d:
    raise ValueError(f"`k_index` {k_index.shape} must be [B={b}, S, d={d}] to match `q_index` "
                     f"{q_index.shape}.")
  if weights.shape != (b, t, hi):
    raise ValueError(f"`weights` must be [B, T, H_I] = {(b, t, hi)}, got {weights.shape}.")
  return b, t, hi, d


def _dot_operand(x, dot_dtype):
  """``x`` as the indexer's dot operand: fp32 unchanged, else rounded to ``dot_dtype``."""
  return x if dot_dtype is None else x.astype(jnp.dtype(dot_dtype))


def _index_operands(q_index, k_index, weights, quant, quant_block_size, dot_dtype):
  """``(q [B,T,HI,d], keys [B,S,d], w [B,T,HI] fp32, key scales [B,S] fp32 or None)``: the dot
  operands of the indexer; scores are ``k_scale[s] * sum_j w[t,j] ReLU(q[t,j] . keys[s])``.

  fp32 (``dot_dtype=None``): the fake-quantized values, no scales.  Reduced precision with an
  8-bit ``quant`` of one scale per vector: the codes themselves (int8 and fp8 e4m3 values are
  exact in bf16, their products and sums of up to 2^24 / 127^2 terms exact in fp32), the query
  scale folded into ``w`` and the key scale applied after the sum -- ReLU commutes with the
  positive scales, so this equals the fp32 quantized scores up to fp32 rounding instead of
  rounding the dequantized values to bf16.  (Direct int8 x int8 -> int32 dots run slower than
  fp32 on XLA:CPU; see the section comment.)
  """
  w = weights.astype(_F32)
  if quant is not None and dot_dtype is not None:
    d = q_index.shape[-1]
    if quant == "int8":
      qc, qs = quantize_int8(q_index, block_size=quant_block_size)
      kc, ks = quantize_int8(k_index, block_size=quant_block_size)
    else:
      bs = quant_block_size if quant_block_size is not None else min(128, d)
      qc, qs = quantize_fp8(q_index, block_size=bs)
      kc, ks = quantize_fp8(k_index, block_size=bs)
    if qs.shape[-1] == 1:                       # one scale per vector (else: blockwise, below)
      return (_dot_operand(qc, dot_dtype), _dot_operand(kc, dot_dtype), w * qs[..., 0],
              ks[..., 0].astype(_F32))
  q = _dot_operand(fake_quantize(q_index, quant, block_size=quant_block_size).astype(_F32),
                   dot_dtype)
  keys = _dot_operand(fake_quantize(k_index, quant, block_size=quant_block_size).astype(_F32),
                      dot_dtype)
  return q, keys, w, None


def _check_q_offset(q_offset):
  check_q_offset(q_offset, "mask the scores yourself, as the paged DSA path does")


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


@functools.partial(jax.jit, static_argnames=('causal', 'quant', 'quant_block_size', 'dot_dtype'))
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
    dot_dtype: str | None = None,
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
    dot_dtype: ``None`` (fp32 dot operands) or ``"bfloat16"``: queries and keys (after ``quant``)
      are rounded to bf16 for the dot products, which still accumulate in fp32; ReLU, weighting
      and the scores stay fp32.  Changes scores by ~2^-9 relative, so selections may differ at
      near-ties of the ``k``-th place.  With ``quant`` (one scale per vector) the dots take the
      8-bit codes, exact in bf16, and apply the scales afterwards: the same scores as fp32
      quantized scoring up to fp32 rounding, at the bf16 speed.
  """
  b, t, _, _ = _check_index_operands(q_index, k_index, weights)
  check_kv_lengths(kv_lengths, b)
  if quant not in QUANT_FORMATS:
    raise ValueError(f"`quant` must be one of {QUANT_FORMATS}, got {quant!r}.")
  _check_dot_dtype(dot_dtype)
  _check_q_offset(q_offset)
  q, k, w, k_scale = _index_operands(q_index, k_index, weights, quant, quant_block_size,
                                     dot_dtype)
  logits = jnp.einsum("btjd,bsd->btjs", q, k, preferred_element_type=_F32)
  scores = jnp.einsum("btjs,btj->bts", jax.nn.relu(logits), w)
  if k_scale is not None:
    scores = scores * k_scale[:, None, :]
  ok = _valid_keys(t, k_index.shape[1], causal=causal, q_offset=q_offset, kv_lengths=kv_lengths,
                   batch=b)
  return jnp.where(ok, scores, NEG_INF)


def _check_k(k):
  if not is_int(k) or k < 1:
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
  if indices.ndim != 3 or indices.shape[:2] != (b, t) or indices.shape[2] < 1:
    raise ValueError(f"`{name}` must be [B={b}, T={t}, k>=1], got shape {indices.shape}.")
  check_int_array(name, indices)


def _jit_static_scale(fn):
  """``jax.jit(fn)`` with ``scale`` and ``implementation`` static (the kernels take the scale as
  a constant): a concrete array scale is read as its float, a traced one refused by name (jit's
  own error, about hashing a tracer, named no argument)."""
  jitted = jax.jit(fn, static_argnames=("scale", "implementation"))

  @functools.wraps(fn)
  def call(*args, scale=None, implementation=None, **kwargs):
    if isinstance(scale, jax.core.Tracer):
      raise ValueError(f"`{fn.__name__}`: `scale` must be a Python number (a compile-time "
                       f"constant here), got a traced value {scale}.")
    if isinstance(scale, jax.Array):
      scale = float(scale)
    return jitted(*args, scale=scale, implementation=implementation, **kwargs)
  return call


@_jit_static_scale
def sparse_attention(
    query: Float[Array, "B T N H"],
    key: Float[Array, "B S K H"],
    value: Float[Array, "B S K h"],
    indices: Int[Array, "B T k"],
    *,
    scale: float | None = None,
    implementation: str | None = None,
) -> Float[Array, "B T N h"]:
  """Attention of each query over only its selected key positions.

  ``indices [B, T, k]`` (from ``topk_indices``; ``-1`` = unused slot) are shared by all heads;
  GQA/MQA as in ``dot_product_attention`` (``N % K == 0``).  Logits and softmax in fp32; a row with
  no valid index yields zeros.  Cost ``O(B T k N H)``, independent of ``S`` apart from the gather.

  Positions outside ``[0, S)`` count as ``-1``.

  ``implementation``: ``"xla"`` (the gather reference), ``"cpu"`` (the native kernel of
  ``jaxattn.ops.sparse_cpu``: gathers only the selected rows into cache-resident tiles),
  ``"pallas_tpu"`` / ``"pallas_gpu"`` (``pallas_kernels.sparse_attention``: only the selected rows
  leave HBM), or None (``_resolve_implementation``).  The kernels' backward pass is
  ``sparse_attention_vjp`` (the reference's gradient, in chunks of query rows).
  """
  if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
    raise ValueError(f"`query`, `key`, `value` must be [B, T, N, H], [B, S, K, H], [B, S, K, h]; "
                     f"got {query.shape}, {key.shape}, {value.shape}.")
  b, t, n, h = query.shape
  kh = key.shape[2]
  if key.shape[0] != b or key.shape[3] != h:
    raise ValueError(f"`key` {key.shape} must be [B={b}, S, K, H={h}].")
  if value.shape[:3] != key.shape[:3]:
    raise ValueError(f"`value` {value.shape} must share [B, S, K] with `key` {key.shape}.")
  if n % kh:
    raise ValueError(f"query heads N={n} must be a multiple of key heads K={kh}.")
  _check_indices(indices, b, t)
  check_scale(scale)
  if scale is None:
    scale = 1.0 / math.sqrt(h)
  impl = _resolve_implementation(implementation, t * indices.shape[2], key.shape[1])
  indices = _in_range(indices, key.shape[1])
  if impl == "cpu":
    return sparse_cpu.sparse_attention_cpu(query, key, value, indices, float(scale),
                                           sparse_attention_vjp)
  if impl in ("pallas_tpu", "pallas_gpu"):
    from pallas_kernels import sparse_attention as kernels  # noqa: PLC0415 (optional)

    kernel = (kernels.sparse_attention_tpu if impl == "pallas_tpu"
              else kernels.sparse_attention_gpu)
    return _with_vjp(lambda q, k, v, i: kernel(q, k, v, i, scale=float(scale)),
                     lambda q, k, v, i, d: sparse_attention_vjp(q, k, v, i, float(scale), d),
                     query, key, value, indices)
  return _sparse_attention_xla(query, key, value, indices, scale)


def _in_range(indices, num_keys):
  """``indices`` with positions outside ``[0, num_keys)`` replaced by ``-1`` (every path then
  agrees: the kernels skip them, the gather reference would clamp them)."""
  indices = indices.astype(jnp.int32)
  return jnp.where((indices >= 0) & (indices < num_keys), indices, -1)


def _with_vjp(kernel, vjp, *args):
  """``kernel(*args)`` (the last argument: integer indices) whose backward pass is
  ``vjp(*args, d_out)`` (the kernels are forward-only)."""

  @jax.custom_vjp
  def f(*args):
    return kernel(*args)

  def fwd(*args):
    return kernel(*args), args

  def bwd(args, d_out):
    return (*vjp(*args, d_out), np.zeros(args[-1].shape, jax.dtypes.float0))

  f.defvjp(fwd, bwd)
  return f(*args)


def _sparse_attention_xla(query, key, value, indices, scale):
  """The gather reference of ``sparse_attention`` (arguments already checked)."""
  valid = indices >= 0                                            # [B, T, k]
  safe = jnp.where(valid, indices, 0).astype(jnp.int32)
  k_sel, v_sel = _gather_rows(key, value, safe, valid)            # [B, T, k, K, H|h]
  return _attend(query.astype(_F32), k_sel, v_sel, valid, scale).astype(query.dtype)


_gather = jax.vmap(lambda x, i: x[i])                             # per batch row: [S, ...][T, k]


def _gather_rows(key, value, safe, valid):
  """The selected key / value rows in fp32, zero in the slots that select nothing: they gather
  row 0, whose inf or NaN would otherwise reach the output as ``0 * inf`` (and the gradients)."""
  keep = valid[..., None, None]
  return (jnp.where(keep, _gather(key, safe).astype(_F32), 0.0),
          jnp.where(keep, _gather(value, safe).astype(_F32), 0.0))
_scatter_add = jax.vmap(lambda acc, i, x: acc.at[i].add(x))       # its transpose


def _attend(q, k_sel, v_sel, valid, scale):
  """Softmax attention of ``q [B, T, N, H]`` over its gathered rows ``k_sel [B, T, k, K, H]`` /
  ``v_sel [B, T, k, K, h]`` where ``valid [B, T, k]``; fp32 in, ``[B, T, N, h]`` fp32 out."""
  b, t, n, h = q.shape
  kh = k_sel.shape[3]
  q = q.reshape(b, t, kh, n // kh, h)
  logits = jnp.einsum("btkgh,btjkh->btkgj", q, k_sel) * scale    # [B, T, K, G, k]
  logits = jnp.where(valid[:, :, None, None, :], logits, NEG_INF)
  m = jnp.max(logits, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(logits - m)
  l = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(l != 0, l, 1.0)
  out = jnp.einsum("btkgj,btjkh->btkgh", p, v_sel)
  return out.reshape(b, t, n, v_sel.shape[-1])


# Gathered fp32 elements (selected key + value rows) per chunk of the kernels' backward pass.
BACKWARD_CHUNK_ELEMENTS = 1 << 25


def sparse_attention_vjp(query, key, value, indices, scale, d_out):
  """``(dq, dk, dv)`` of ``sparse_attention`` for the cotangent ``d_out``, in chunks of query rows:
  each chunk gathers its selected rows, differentiates the softmax over them and scatter-adds
  the row gradients into fp32 ``dk`` / ``dv`` accumulators, so the scratch is about
  ``BACKWARD_CHUNK_ELEMENTS`` gathered values whatever ``T`` (differentiating the gather
  reference holds all ``T * k`` gathered rows at once: 19 GB for DeepSeek-V3.2's 4k-token prefill
  in fp32).  ``indices`` already in range (``-1`` = none).  The kernels' backward pass."""
  b, t, n, h = query.shape
  kh, hv = key.shape[2], value.shape[3]
  k = indices.shape[2]
  chunk = max(1, min(t, BACKWARD_CHUNK_ELEMENTS // (b * k * kh * (h + hv))))
  num = -(-t // chunk)

  def chunks(x, fill=0):
    x = jnp.pad(x, [(0, 0), (0, num * chunk - t)] + [(0, 0)] * (x.ndim - 2),
                constant_values=fill)
    return x.reshape(b, num, chunk, *x.shape[2:]).swapaxes(0, 1)   # [num, B, chunk, ...]

  def step(carry, xs):
    dk, dv = carry
    q, idx, d = xs
    valid = idx >= 0
    safe = jnp.where(valid, idx, 0)
    k_sel, v_sel = _gather_rows(key, value, safe, valid)
    _, vjp = jax.vjp(lambda q_, k_, v_: _attend(q_, k_, v_, valid, scale), q.astype(_F32),
                     k_sel, v_sel)
    dq, dk_sel, dv_sel = vjp(d.astype(_F32))                       # masked slots: exact zeros
    return (_scatter_add(dk, safe, dk_sel), _scatter_add(dv, safe, dv_sel)), dq

  init = (jnp.zeros(key.shape, _F32), jnp.zeros(value.shape, _F32))
  (dk, dv), dq = jax.lax.scan(step, init, (chunks(query), chunks(indices, -1), chunks(d_out)))
  dq = dq.swapaxes(0, 1).reshape(b, num * chunk, n, h)[:, :t]
  return dq.astype(query.dtype), dk.astype(key.dtype), dv.astype(value.dtype)


@_jit_static_scale
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
    implementation: str | None = None,
) -> Float[Array, "B T N h"]:
  """DSA on MLA (DeepSeek-V3.2): sparse attention over the selected latent rows, absorbed form.

  As ``jaxattn.ops.mla.mla_attention(mode="absorbed")``: queries are mapped into latent space
  (``q^C_i W_up^K_i^T``), attend against the selected ``[c_KV, k^R]`` rows as one shared key whose
  first ``C`` entries are the value, and ``W_up^V`` is applied after the sum.
  ``implementation`` as ``sparse_attention``; the Pallas kernels gather the two parts of the
  shared key from ``c_kv`` and ``k_rope`` themselves (no concatenated copy of the cache).
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
  _check_indices(indices, b, t)
  check_scale(scale)
  if scale is None:
    scale = 1.0 / math.sqrt(p + r)
  dt = q_nope.dtype
  q_lat = jnp.einsum("btnp,cnp->btnc", q_nope, w_uk.astype(dt), preferred_element_type=_F32)
  impl = _resolve_implementation(implementation, t * indices.shape[2], c_kv.shape[1])
  if impl in ("pallas_tpu", "pallas_gpu"):
    from pallas_kernels import sparse_attention as kernels  # noqa: PLC0415 (optional)

    kernel = (kernels.sparse_mla_latent_tpu if impl == "pallas_tpu"
              else kernels.sparse_mla_latent_gpu)
    o_lat = _with_vjp(
        lambda ql, qr, ck, kr, i: kernel(ql, qr, ck, kr, i, scale=float(scale)),
        functools.partial(_latent_vjp, scale=float(scale)),
        q_lat.astype(dt), q_rope.astype(dt), c_kv, k_rope.astype(c_kv.dtype),
        _in_range(indices, c_kv.shape[1]))
  else:
    o_lat = _latent_reference(q_lat.astype(dt), q_rope, c_kv, k_rope, indices, scale=scale,
                              implementation=impl)
  return jnp.einsum("btnc,cnh->btnh", o_lat, w_uv.astype(dt),
                    preferred_element_type=_F32).astype(dt)


def _shared_key(q_lat, q_rope, c_kv, k_rope):
  """Absorbed MLA as MQA: queries ``[q~, q^R]`` ``[B, T, N, C + R]`` and the one shared key
  ``[c_KV, k^R]`` ``[B, S, 1, C + R]`` (whose first ``C`` entries are the value)."""
  query = jnp.concatenate([q_lat, q_rope.astype(q_lat.dtype)], axis=-1)
  kv = jnp.concatenate([c_kv, k_rope.astype(c_kv.dtype)], axis=-1)[:, :, None, :]
  return query, kv


def _latent_reference(q_lat, q_rope, c_kv, k_rope, indices, *, scale, implementation="xla"):
  """Absorbed MLA's latent core as ``sparse_attention`` over the shared key -> ``[B, T, N, C]``."""
  query, kv = _shared_key(q_lat, q_rope, c_kv, k_rope)
  return sparse_attention(query, kv, kv, indices, scale=scale,
                          implementation=implementation)[..., :c_kv.shape[2]]


def _latent_vjp(q_lat, q_rope, c_kv, k_rope, indices, d_out, *, scale):
  """The backward pass of ``_latent_reference`` by ``sparse_attention_vjp`` over the shared key
  (a concatenated copy of the cache, made in the backward pass only)."""
  c = c_kv.shape[2]
  query, kv = _shared_key(q_lat, q_rope, c_kv, k_rope)
  d_full = jnp.pad(d_out, [(0, 0)] * 3 + [(0, kv.shape[-1] - c)])  # the output is [..., :C]
  dq, dk, dv = sparse_attention_vjp(query, kv, kv, indices, scale, d_full)
  dkv = (dk.astype(_F32) + dv.astype(_F32))[:, :, 0]
  return (dq[..., :c], dq[..., c:].astype(q_rope.dtype), dkv[..., :c].astype(c_kv.dtype),
          dkv[..., c:].astype(k_rope.dtype))


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
  target = target / jnp.where(total != 0, total, 1.0)
  logits = jnp.where(allowed, index_scores.astype(_F32), NEG_INF)
  m = jnp.max(logits, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  log_q = logits - m - jnp.log(jnp.sum(jnp.where(allowed, jnp.exp(logits - m), 0.0), axis=-1,
                                       keepdims=True).clip(min=1e-30))
  pos = target > 0
  kl = jnp.where(pos, target * (jnp.log(jnp.where(pos, target, 1.0)) - jnp.where(pos, log_q, 0.0)),
                 0.0)
  return jnp.sum(kl) / (b * t)


# ----------------------------------------------------------------------------------------------
# Streaming causal indexer + top-K selector.
#
# ``topk_indices(indexer_scores(...))`` materializes every ``[T, S]`` score (the upper triangle
# included) and hands whole rows to ``lax.top_k``, whose CPU implementation is a scalar
# ``partial_sort``: a few ns per element scanned plus a fixed cost that grows with ``k``.  The
# streaming path below
#   1. walks query chunks; per chunk a dynamic-trip ``fori_loop`` scores only the key blocks that
#      some row of the chunk can see (causal / ``kv_lengths`` block skipping), in tiles small enough
#      to stay in cache, and keeps a running strided maximum ``gmax[g] = max_{s = g mod G} I[s]``;
#   2. finds, by a vectorized bisection over the value range of the ``G`` strided maxima, a
#      threshold ``L`` with at least ``k`` strided maxima ``>= L`` -- hence at least ``k`` scores
#      ``>= L``, so ``L`` is a lower bound on the ``k``-th largest score and every top-``k``
#      position is a candidate;
#   3. packs ``I >= L`` into 32-bit words and compacts the (typically ~1.15 k) candidates into
#      ``M`` slots in position order (a sum-tree descent over the words' popcounts, then a popcount
#      bisection inside the word);
#   4. ``order="score"``: ``lax.top_k`` on those ``M`` only; ``order="position"``: no sort at all --
#      the exact ``k``-th candidate value by a 32-step bisection on the int32 order keys, the
#      slots ``>=`` it (ties at the ``k``-th place: the lowest slots), compacted again.  The slots
#      keep position order, so ties resolve to the lower position exactly as ``topk_indices``
#      does.  A chunk in which some row has more than ``M`` candidates (heavy ties, adversarial
#      scores) falls back to full rows, still exact.
#
# Measured on a shared 2-core x86 CPU (AVX-512), T = S = 32768, k = 256, H_I = 4, d = 32, one
# sequence (``python -m experiments.bench_sparse``; single runs, +-20 % under the other jobs):
# * before (bisection over int32 keys, a sum tree over the booleans of the whole row, top_k on
#   384 slots, 128-row chunks) 4.8 s: scoring tiles + score buffer ~1.9 s, candidate compaction
#   ~1.8 s, ``lax.top_k`` of 384 -> 256 ~0.8 s (~25 us per row, as slow as ``lax.sort``);
# * now ~2.8 s wall / 4.0-4.6 CPU-s (256-row chunks, ``order="position"``; same-run A/B under
#   load: 7.2 -> 4.6 CPU-s): scoring + strided maxima ~2.9 CPU-s (the four width-32 dots per tile
#   run at ~70 GFLOP/s; that is the floor here), threshold ~0.35, pack + compaction + exact
#   k-th ~1.2 (packing only the chunk's scored tiles saved ~5 %).
# Tried and not kept: scanning only each chunk's causal prefix in step 3 (a ``lax.switch`` over
# widths 1024 * 2^j: 2.69 vs 2.75 s, within noise); one head-stacked ``[cq, H_I, bk]`` einsum
# instead of one dot per head (no gain); key tiles of 256 / 512 and 128- / 512-row chunks
# (0.98 / 0.99 / 1.08 s vs 0.93 s at 16k); bf16 or int8 tile dots (0.75 / 1.01 ms vs 0.95 ms per
# 256 x 1024 x 4-head tile; bf16 would also change fp32 results); a (value, position)
# ``lax.sort`` to order the selection (slower than ``lax.top_k``).  For the sparse attention that
# follows, position-ordered indices gather ~25 % faster (0.30 vs 0.40 s at 8k); gather modes
# ``clip`` / ``promise_in_bounds``, 32- / 128-row chunks and one ``[K | V]`` gather did not help.
# Reduced precision (``dot_dtype="bfloat16"``, an explicit option; fp32 stays the default and
# unchanged): bf16 operands, fp32 accumulation, fp32 scores.  Same run at 32k (load ~1.5-3):
# selection 4.45 -> 3.66 CPU-s (2.93 -> 2.43 s wall), DSA prefill vs dense 2.17x -> 2.57x CPU
# (1.77x -> 2.11x wall); recall of the fp32 top-256 sets 0.997 mean, 0.984 worst row.  On 8-bit
# (``quant``) scoring with one scale per vector, the bf16 dots take the int8 / e4m3 codes
# themselves (exact in bf16) and apply the scales after the sum: per 256 x 1024 x 4-head tile
# 0.61 CPU-ms vs 0.98 for the fp32 dots of the dequantized values, and the same scores up to
# 3e-7 relative; int8 x int8 -> int32 dots (``preferred_element_type``) take 1.35 ms, slower
# than fp32 on XLA:CPU, so they are not used.  Same run at 32k with int8 scoring: selection
# 4.24 -> 3.51 CPU-s, DSA prefill vs dense 2.24x -> 2.62x CPU, recall of the fp32-int8 sets 1.000
# mean, 0.996 worst row.  Also tried: leaving the mask out of the tiles
# every row of a chunk sees whole (two ``fori_loop``s): 0.96 vs 0.96 s at 16k, no gain.
# ``sparse_mla_attention`` passes the latent as both key and value, but XLA merges the two gathers
# (one gather in the optimized HLO), so gathering it once by hand gains nothing.
# ----------------------------------------------------------------------------------------------

_INT32_MAX = 0x7FFFFFFF


def _order_key(x):
  """A monotone int32 key of fp32 values: ``x < y  <=>  key(x) < key(y)`` (NaN aside)."""
  bits = jax.lax.bitcast_convert_type(x.astype(_F32), jnp.int32)
  return jnp.where(bits < 0, bits ^ _INT32_MAX, bits)


def _threshold_lower_bound(gmax, k, steps):
  """Per row, a threshold ``L`` (fp32) with ``#{gmax >= L} >= k``, as large as ``steps`` bisection
  steps over the value range ``[min finite gmax, max gmax]`` find; ``-FLT_MAX`` (= every finite
  score is a candidate) when fewer than ``k`` of ``gmax [R, G]`` are finite.  The invariant holds
  after every step, so fewer steps only loosen the bound (more candidates), never break it."""
  finite = jnp.isfinite(gmax)
  enough = jnp.sum(finite, axis=-1, dtype=jnp.int32) >= k
  lo = jnp.min(jnp.where(finite, gmax, jnp.inf), axis=-1)   # count(gmax >= lo) = #finite >= k
  hi = jnp.max(gmax, axis=-1)

  def step(_, lh):
    lo, hi = lh
    mid = 0.5 * lo + 0.5 * hi                  # no overflow near FLT_MAX
    # An fp32 count (exact below 2^24) vectorizes better on XLA:CPU than an int32 one.
    ok = jnp.sum(jnp.where(gmax >= mid[:, None], 1.0, 0.0), axis=-1) >= k
    return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

  lo, _ = jax.lax.fori_loop(0, steps, step, (lo, hi))
  return jnp.where(enough, lo, jnp.finfo(_F32).min)


def _pack_bits(hit):
  """``bool [R, S]`` -> ``uint32 [R, ceil(S / 32)]``; bit ``j`` of word ``w`` is column
  ``32 w + j``."""
  r, s = hit.shape
  w = -(-s // 32)
  hit = jnp.pad(hit, ((0, 0), (0, 32 * w - s)))
  bits = hit.reshape(r, w, 32).astype(jnp.uint32) << jnp.arange(32, dtype=jnp.uint32)
  return jnp.sum(bits, axis=-1, dtype=jnp.uint32)       # disjoint bits: the sum is the OR


def _nth_set_bits(words, size):
  """Positions of the first ``size`` set bits of the packed rows ``words [R, W]`` (as
  ``_pack_bits`` lays them out) in increasing order, ``-1`` where a row has fewer; and the
  per-row count of set bits.

  A vectorized descent of a sum tree over the words' popcounts (one gather per level and slot),
  then a 5-step popcount bisection inside the word -- no scatter, no sort, and no cumulative sum
  (which XLA:CPU lowers to a slow reduce-window).  Packing first makes the tree 32x smaller and
  5 levels shallower than a tree over the booleans.
  """
  r, w = words.shape
  depth = max(w - 1, 0).bit_length()
  words = jnp.pad(words, ((0, 0), (0, (1 << depth) - w)))
  levels = [jax.lax.population_count(words).astype(jnp.int32)]
  for _ in range(depth):
    levels.append(levels[-1].reshape(r, -1, 2).sum(-1))
  total = levels[-1][:, 0]
  rank = jnp.broadcast_to(jnp.arange(size, dtype=jnp.int32), (r, size))
  node = jnp.zeros((r, size), jnp.int32)
  for lvl in reversed(levels[:-1]):
    left = 2 * node
    left_count = jnp.take_along_axis(lvl, left, axis=-1)
    right = rank >= left_count
    rank = jnp.where(right, rank - left_count, rank)
    node = left + right.astype(jnp.int32)
  word = jnp.take_along_axis(words, node, axis=-1)
  # The largest bit index p with popcount(word & (2^p - 1)) <= rank is the rank-th set bit.
  bit = jnp.zeros((r, size), jnp.uint32)
  rank = rank.astype(jnp.uint32)
  for step in (16, 8, 4, 2, 1):
    cand = bit + step
    below = jax.lax.population_count(word & ((jnp.uint32(1) << cand) - 1))
    bit = jnp.where(below <= rank, cand, bit)
  out = 32 * node + bit.astype(jnp.int32)
  return jnp.where(jnp.arange(size)[None] < total[:, None], out, -1), total


def _kth_order_key(key, k):
  """Exact ``k``-th largest of the order keys ``key [R, M]`` of finite values (32 bisection steps
  over int32), or ``key(-inf) + 1`` -- "every finite value" -- when a row has fewer than ``k``."""
  lo = jnp.full(key.shape[:-1], _order_key(jnp.float32(-jnp.inf)) + 1, jnp.int32)
  hi = jnp.max(key, axis=-1) + 1          # count(key >= hi) = 0 < k
  lo = jnp.minimum(lo, hi)

  def step(_, lh):
    lo, hi = lh
    # Floor midpoint without int32 overflow (the key range spans all of int32).
    mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)
    ok = jnp.sum(key >= mid[..., None], axis=-1, dtype=jnp.int32) >= k
    return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

  lo, _ = jax.lax.fori_loop(0, 32, step, (lo, hi))
  return lo


def _position_topk(vals, k):
  """The slots of the ``k`` largest finite ``vals [R, M]`` in increasing slot order, ``int32
  [R, k]`` with ``-1`` padding: the same set as ``lax.top_k`` (ties at the ``k``-th place go to the
  lower slot) without its sort -- an exact ``k``-th value by bisection, then compaction."""
  key = _order_key(vals)
  kth = _kth_order_key(key, k)[:, None]
  sel = key >= kth

  def break_ties(sel):
    # More than k at or above the k-th value: keep the lowest-slot ties only (rare: exact ties).
    gt, eq = key > kth, key == kth
    need = k - jnp.sum(gt, axis=-1, keepdims=True, dtype=jnp.int32)
    before = jnp.cumsum(eq.astype(jnp.int32), axis=-1) - eq
    return gt | (eq & (before < need))

  sel = jax.lax.cond(jnp.any(jnp.sum(sel, axis=-1, dtype=jnp.int32) > k), break_ties,
                     lambda s: s, sel)
  slots, _ = _nth_set_bits(_pack_bits(sel), k)
  return slots


def _row_topk(scores, k, order="score"):
  """Top-``k`` of rows ``[R, S]`` -> ``int32 [R, k]`` with ``-1`` for -inf / missing; ``order``
  ``"score"`` (``lax.top_k``: decreasing score) or ``"position"`` (increasing position)."""
  if order == "position":
    idx = _position_topk(scores, min(k, scores.shape[-1]))
  else:
    kk = min(k, scores.shape[-1])
    vals, idx = jax.lax.top_k(scores, kk)
    idx = jnp.where(jnp.isfinite(vals), idx.astype(jnp.int32), -1)
  if idx.shape[-1] < k:
    idx = jnp.pad(idx, ((0, 0), (0, k - idx.shape[-1])), constant_values=-1)
  return idx


def _select_topk(scores, gmax, k, *, candidates, steps, order, blocks=None):
  """Exact top-``k`` of rows ``scores [R, S]`` given their strided maxima ``gmax [R, G]``
  (``G >= k``; ``gmax[g] = max_{s = g mod G} scores[s]``); see the section comment.

  ``blocks = (n, size)``: only the first ``n`` (traced) column blocks of ``size`` (a multiple of
  32) can hold finite scores, so only those are compared and packed, block by block in cache.
  """
  thr = _threshold_lower_bound(gmax, k, steps)
  if blocks is None:
    words = _pack_bits(scores >= thr[:, None])
  else:
    n, size = blocks

    def pack(i, words):
      sc = jax.lax.dynamic_slice_in_dim(scores, i * size, size, axis=1)
      return jax.lax.dynamic_update_slice_in_dim(words, _pack_bits(sc >= thr[:, None]),
                                                 i * (size // 32), axis=1)

    words = jax.lax.fori_loop(0, n, pack, jnp.zeros((scores.shape[0], scores.shape[1] // 32),
                                                    jnp.uint32))
  pos, total = _nth_set_bits(words, candidates)                    # in position order
  vals = jnp.take_along_axis(scores, jnp.maximum(pos, 0), axis=-1)
  vals = jnp.where(pos >= 0, vals, NEG_INF)

  def filtered():
    # Slots keep position order, so ties to the lower slot are ties to the lower position.
    top = _row_topk(vals, k, order)
    return jnp.where(top >= 0, jnp.take_along_axis(pos, jnp.maximum(top, 0), axis=-1), -1)

  return jax.lax.cond(jnp.all(total <= candidates), filtered, lambda: _row_topk(scores, k, order))


def _round_up(x, m):
  return -(-x // m) * m


@functools.partial(jax.jit, static_argnames=('k', 'block_size', 'query_block', 'candidates',
                                             'quant', 'quant_block_size', 'bisect_steps',
                                             'order', 'dot_dtype', 'implementation'))
def indexer_topk(
    q_index: Float[Array, "B T HI d"],
    k_index: Float[Array, "B S d"],
    weights: Float[Array, "B T HI"],
    k: int,
    *,
    q_offset: int | Int[Array, ""] = 0,
    kv_lengths: Int[Array, "B"] | None = None,
    block_size: int = 1024,
    query_block: int = 128,
    candidates: int | None = None,
    quant: QuantFormat = None,
    quant_block_size: int | None = None,
    bisect_steps: int = 12,
    order: str = "score",
    dot_dtype: str | None = None,
    implementation: str | None = None,
) -> Int[Array, "B T k"]:
  """``topk_indices(indexer_scores(q_index, k_index, weights, ...), k)`` without the ``[T, S]``
  scores: streaming causal lightning-indexer scoring and top-``k`` selection.

  Same arguments and result as that composition (causal), including the order within a row
  (decreasing score, ties to the lower position) and ``-1`` padding; scores are computed in fp32
  tiles, so they may differ from ``indexer_scores`` in the last bit and a selection can differ
  only between scores that near-tie at the ``k``-th place.  Work and scratch:

  * query rows go in chunks of ``query_block``; a chunk scores only the key blocks of
    ``block_size`` that one of its rows can see (``s <= q_offset + t``, ``s < kv_lengths``), so the
    upper triangle is skipped and scratch is ``O(B * query_block * S)``;
  * selection scans each row's scored tiles with vectorized passes and keeps only
    ``candidates`` (default ``1.5 k``; random scores give about ``1.15 k``) positions per row,
    among which it takes the exact top ``k`` (``lax.top_k``, or a sort-free bisection for
    ``order="position"``); a chunk with a row of more candidates (e.g. thousands of exactly tied
    scores) selects over its full rows instead, still exact.

  Args:
    q_index, k_index, weights, q_offset, kv_lengths, quant, quant_block_size, dot_dtype: as
      ``indexer_scores`` (``quant`` rounds queries and keys through the 8-bit format first).
    k: at most ``k`` positions per query row.
    block_size: keys per scoring tile (a multiple of 8).
    query_block: query rows per chunk.
    candidates: candidate slots per row (``>= k``); default ``1.5 k`` rounded up to a multiple
      of 8.
    bisect_steps: bisection steps for the candidate threshold over the range of the strided
      maxima (1..32; fewer = a lower threshold, more candidates, never a wrong result).
    order: ``"score"`` (default): each row by decreasing score, as ``topk_indices``;
      ``"position"``: the same set in increasing position order (``-1`` padding last), which
      skips the final sort -- the faster choice when only the set matters (sparse attention),
      and its gathers then walk the keys in memory order.
    implementation: ``"xla"`` (the streaming XLA path described above), ``"cpu"`` (the native
      kernel of ``jaxattn.ops.sparse_cpu``: the same selection semantics on its own fp32 tiles;
      ``block_size``, ``query_block``, ``candidates`` and ``bisect_steps`` are XLA-path knobs it
      does not use), or None: ``"cpu"`` on a CPU backend where the kernel is built, else
      ``"xla"``.
  """
  b, t, hi, d = _check_index_operands(q_index, k_index, weights)
  _check_k(k)
  check_kv_lengths(kv_lengths, b)
  if quant not in QUANT_FORMATS:
    raise ValueError(f"`quant` must be one of {QUANT_FORMATS}, got {quant!r}.")
  if not is_int(block_size) or block_size < 8 or block_size % 8:
    raise ValueError(f"`block_size` must be a positive multiple of 8, got {block_size!r}.")
  if not is_int(query_block) or query_block < 1:
    raise ValueError(f"`query_block` must be a positive int, got {query_block!r}.")
  if candidates is None:
    candidates = _round_up(3 * k // 2, 8)
  if not is_int(candidates) or candidates < k:
    raise ValueError(f"`candidates` must be an int >= k={k}, got {candidates!r}.")
  if not is_int(bisect_steps) or not 1 <= bisect_steps <= 32:
    raise ValueError(f"`bisect_steps` must be an int in [1, 32], got {bisect_steps!r}.")
  k, block_size, query_block, candidates, bisect_steps = (
      int(v) for v in (k, block_size, query_block, candidates, bisect_steps))  # NumPy ints
  if order not in ("score", "position"):
    raise ValueError(f"`order` must be 'score' or 'position', got {order!r}.")
  _check_dot_dtype(dot_dtype)
  _check_q_offset(q_offset)
  if implementation not in (None, "xla", "cpu"):
    raise ValueError(f"`implementation` must be None, 'xla' or 'cpu' for the indexer, got "
                     f"{implementation!r}.")
  impl = _resolve_implementation(implementation)
  s = k_index.shape[1]
  # Rounded to the dot dtype once here, not per tile.
  q, keys, w, k_scale = _index_operands(q_index, k_index, weights, quant, quant_block_size,
                                        dot_dtype)
  if impl == "cpu":
    lengths = (jnp.full((b,), s, jnp.int32) if kv_lengths is None
               else jnp.minimum(jnp.asarray(kv_lengths, jnp.int32), s))
    return sparse_cpu.indexer_topk_cpu(q, keys, w, k_scale, q_offset, lengths, k, order)

  bk = min(block_size, _round_up(s, 8))
  s_pad = _round_up(s, bk)
  n_blocks = s_pad // bk
  keys = jnp.pad(keys, ((0, 0), (0, s_pad - s), (0, 0)))
  if k_scale is not None:
    k_scale = jnp.pad(k_scale, ((0, 0), (0, s_pad - s)))
  cq = min(query_block, t)
  t_pad = _round_up(t, cq)
  n_chunks = t_pad // cq
  q = jnp.pad(q, ((0, 0), (0, t_pad - t), (0, 0), (0, 0)))
  w = jnp.pad(w, ((0, 0), (0, t_pad - t), (0, 0)))
  q_offset = jnp.asarray(q_offset, jnp.int32)
  lengths = (jnp.full((b,), s, jnp.int32) if kv_lengths is None
             else jnp.minimum(jnp.asarray(kv_lengths, jnp.int32), s))
  # Strided groups: G >= k (so >= k of them are finite whenever >= k keys are visible -- visible
  # keys are a prefix of each row) and a multiple of the tile, so a tile maps onto a slice of G.
  # G = 4 k keeps the candidates near 1.15 k on random scores (2 k: about 1.4 k, often more than
  # the default 1.5 k slots), whatever the tile size.
  n_groups = _round_up(max(4 * k, bk), bk)
  filtered = s_pad > candidates                 # else top_k over the (short) rows directly

  def chunk(buf, c):
    qc = jax.lax.dynamic_slice_in_dim(q, c * cq, cq, axis=1)     # [B, cq, HI, d]
    wc = jax.lax.dynamic_slice_in_dim(w, c * cq, cq, axis=1)     # [B, cq, HI]
    rows = q_offset + c * cq + jnp.arange(cq, dtype=jnp.int32)   # query positions
    # Keys any row of this chunk can see: s < min(q_offset + (c+1) cq, max kv_length).
    limit = jnp.minimum(q_offset + (c + 1) * cq, jnp.max(lengths))
    trips = jnp.clip((limit + bk - 1) // bk, 0, n_blocks)

    def tile(i, carry):
      buf, gmax = carry
      kb = jax.lax.dynamic_slice_in_dim(keys, i * bk, bk, axis=1)  # [B, bk, d]
      # One [cq, bk] matmul per indexer head: the logits tile stays in cache for ReLU and the
      # weighted sum, where an all-heads einsum would write [cq, HI, bk] out first.
      sc = jnp.zeros((b, cq, bk), _F32)
      for j in range(hi):
        lg = jnp.einsum("btd,bsd->bts", qc[:, :, j], kb, preferred_element_type=_F32)
        sc = sc + wc[:, :, j, None] * jax.nn.relu(lg)
      if k_scale is not None:
        sc = sc * jax.lax.dynamic_slice_in_dim(k_scale, i * bk, bk, axis=1)[:, None, :]
      pos = i * bk + jnp.arange(bk, dtype=jnp.int32)
      ok = (pos[None, None, :] <= rows[None, :, None]) & (pos[None, None, :] < lengths[:, None,
                                                                                        None])
      sc = jnp.where(ok, sc, NEG_INF)
      buf = jax.lax.dynamic_update_slice_in_dim(buf, sc, i * bk, axis=2)
      if filtered:
        at = (i * bk) % n_groups
        cur = jax.lax.dynamic_slice_in_dim(gmax, at, bk, axis=2)
        gmax = jax.lax.dynamic_update_slice_in_dim(gmax, jnp.maximum(cur, sc), at, axis=2)
      return buf, gmax

    gmax = jnp.full((b, cq, n_groups if filtered else 1), NEG_INF, _F32)
    # Trip counts never decrease from chunk to chunk, so the tiles beyond this chunk's are still
    # the -inf the carried buffer started with: no per-chunk reset of the [B, cq, S] scratch.
    # (The running strided maximum mixes tiles, so it starts afresh.)
    buf, gmax = jax.lax.fori_loop(0, trips, tile, (buf, gmax))
    if filtered:
      # Pack candidates over this chunk's scored tiles only (the rest of the row is -inf).
      idx = _select_topk(buf.reshape(b * cq, s_pad), gmax.reshape(b * cq, n_groups), k,
                         candidates=candidates, steps=bisect_steps, order=order,
                         blocks=(trips, bk) if bk % 32 == 0 else None)
    else:
      idx = _row_topk(buf.reshape(b * cq, s_pad), k, order)
    return buf, idx.reshape(b, cq, k)

  buf0 = jnp.full((b, cq, s_pad), NEG_INF, _F32)
  _, idx = jax.lax.scan(chunk, buf0, jnp.arange(n_chunks))        # [n_chunks, B, cq, k]
  idx = jnp.moveaxis(idx, 0, 1).reshape(b, t_pad, k)[:, :t]
  # Padded key columns are never visible, but keep the contract explicit.
  return jnp.where(idx < s, idx, -1)
