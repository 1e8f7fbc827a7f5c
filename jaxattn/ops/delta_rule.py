"""The gated delta rule (Gated DeltaNet): a fixed-size memory that overwrites; one dispatch point.

Shapes (the package docstring defines the letters): ``query, key [B, T, K, H]`` (``K`` key heads of
size ``H``), ``value [B, T, N, h]`` (``N`` value heads, a multiple of ``K``: value head ``n`` reads
key head ``n // (N // K)``, as GQA), ``g, beta [B, T, N]``, output ``[B, T, N, h]`` and the memory
``state [B, N, H, h]`` (fp32).  The state is stored key-dimension first, as
flash-linear-attention and Hugging Face's Qwen3-Next store it: the transpose of the seed's ``S``.
Per value head::

    a_t   = exp(g_t)                               decay (g_t <= 0 is a log-decay)
    S_t   = a_t S_{t-1} + beta_t k_t (v_t - a_t S_{t-1}^T k_t)^T
          = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T
    o_t   = S_t^T (scale * q_t)                    scale defaults to 1 / sqrt(H)

``a_t S_{t-1}^T k_t`` is what the decayed memory currently returns for ``k_t``; the write adds the
correction ``v_t -`` that answer, so with ``a = beta = 1`` and a unit key the memory's answer for
``k_t`` *becomes* ``v_t`` (2 -> 5 in the seed's example, not 2 + 5).

Implementations (``implementation=``):

* ``"recurrent"`` — ``lax.scan`` of the update above, one token at a time, fp32 state.  The
  reference; also what single-token decode runs (``gated_delta_rule_step``).
* ``"chunked"`` — the chunkwise-parallel WY / UT-transform form (flash-linear-attention's
  ``chunk_gated_delta_rule``, Hugging Face's ``torch_chunk_gated_delta_rule``).  Within a chunk of
  ``C`` tokens, with ``gamma_i = exp(sum_{s<=i} g_s)`` the cumulative decay since the chunk start::

      A     = strict_lower(diag(beta) K K^T * gamma_i / gamma_j)        [C, C]
      T     = (I + A)^{-1}                                               (UT transform)
      U     = T diag(beta) V          W = T diag(beta gamma) K           [C, h], [C, H]
      V'    = U - W S                 (corrections against the incoming state S)
      O     = diag(gamma) Q S + lower(Q K^T * gamma_i / gamma_j) V'
      S_out = gamma_C S + (K * gamma_C / gamma)^T V'

  Only the last two lines are sequential (a scan over ``T / C`` chunks); the rest is chunk-local
  (``_chunk_local``), evaluated for all chunks up front on accelerators and inside the scan on CPU,
  where keeping one chunk's working set in cache measured 1.5x faster.  Every exponent is a
  non-positive sum of ``g``, so nothing overflows.  ``T`` comes from exact recursive block
  inversion: XLA's triangular-solve primitive is an order of magnitude slower on CPU, and the
  Neumann-product shortcut ``(I - A)(I + A^2)(I + A^4)...`` loses all precision when keys repeat.

Packed sequences: ``segment_ids [B, T]`` resets the memory to zero where the id changes (the first
segment starts from ``initial_state``); in the recurrence that is ``a_t = 0`` at a boundary, in the
chunked form a same-segment mask on every decay factor.
"""

from __future__ import annotations

import functools
from typing import Callable, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxattn.checks import is_int
from jaxattn.ops import context_parallel
from jaxattn.ops.attention import check_scale

Implementation = Literal["recurrent", "chunked", "pallas_tpu", "pallas_gpu"]
IMPLEMENTATIONS: tuple[str, ...] = ("recurrent", "chunked", "pallas_tpu", "pallas_gpu")

# name -> callable with the normalized signature of `_chunked`; Pallas kernels register here.
_REGISTRY: dict[str, Callable] = {}
_UNAVAILABLE: dict[str, str] = {
    "pallas_tpu": "no Pallas TPU gated-delta-rule kernel is registered in this build of jaxattn",
    "pallas_gpu": "no Pallas GPU gated-delta-rule kernel is registered in this build of jaxattn",
}

L2_NORM_EPS = 1e-6  # flash-linear-attention and Hugging Face: x * rsqrt(sum(x^2) + 1e-6)


def register_implementation(name: str, fn: Callable) -> None:
  """Registers a backend under ``name`` (``"pallas_tpu"`` / ``"pallas_gpu"``); used by kernels."""
  if name not in ("pallas_tpu", "pallas_gpu"):
    raise ValueError(f"`name` must be 'pallas_tpu' or 'pallas_gpu', got {name!r}.")
  _REGISTRY[name] = fn
  _UNAVAILABLE.pop(name, None)


def l2_normalize(x: Float[Array, "*B H"], *, eps: float = L2_NORM_EPS) -> Float[Array, "*B H"]:
  """``x / sqrt(sum(x^2) + eps)`` over the last axis, in fp32 (the keys must be unit length)."""
  xf = x.astype(jnp.float32)
  return (xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


# -- validation --------------------------------------------------------------------------------


def _validate(q, k, v, g, beta, initial_state, segment_ids, chunk_size, scale):
  for name, x in (("query", q), ("key", k), ("value", v)):
    if x.ndim != 4:
      raise ValueError(f"`{name}` must have rank 4 ([B, T, heads, head_dim]), got shape {x.shape}.")
  if q.shape != k.shape:
    raise ValueError(f"`query` {q.shape} and `key` {k.shape} must have the same shape [B, T, K, H].")
  b, t, kh, h = k.shape
  if v.shape[:2] != (b, t):
    raise ValueError(f"`value` {v.shape} must share [B, T] = {(b, t)} with `key`.")
  n, hv = v.shape[2], v.shape[3]
  if n % kh:
    raise ValueError(f"value heads N={n} must be a multiple of key heads K={kh} "
                     "(each key head serves N // K value heads).")
  for name, x in (("g", g), ("beta", beta)):
    if x.shape != (b, t, n):
      raise ValueError(f"`{name}` must have shape [B, T, N] = {(b, t, n)}, got {x.shape}.")
  for name, x in (("query", q), ("key", k), ("value", v), ("g", g), ("beta", beta)):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"`{name}` must be floating point, got {x.dtype}.")
  if initial_state is not None and initial_state.shape != (b, n, h, hv):
    raise ValueError(f"`initial_state` must have shape [B, N, H, h] = {(b, n, h, hv)}, "
                     f"got {initial_state.shape}.")
  if segment_ids is not None:
    if tuple(segment_ids.shape) != (b, t):
      raise ValueError(f"`segment_ids` must have shape [B, T] = {(b, t)}, got {segment_ids.shape}.")
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
      raise ValueError(f"`segment_ids` must be integers, got {segment_ids.dtype}.")
  if not is_int(chunk_size) or chunk_size < 1 or chunk_size & (chunk_size - 1):  # bools refused
    raise ValueError(f"`chunk_size` must be a power of two >= 1, got {chunk_size!r}.")
  check_scale(scale)


def segment_resets(segment_ids, b, t):
  """``[B, T]`` bool: the memory is cleared before token t (its segment differs from t-1's)."""
  if segment_ids is None:
    return jnp.zeros((b, t), bool)
  prev = jnp.concatenate([segment_ids[:, :1], segment_ids[:, :-1]], axis=1)
  return segment_ids != prev


# -- recurrent form: the reference and single-token decode -------------------------------------


def _step(state, q, k, v, g, beta, reset):
  """One token, heads grouped by key head.  ``state [B, K, G, H, h]``, ``q, k [B, K, H]``,
  ``v [B, K, G, h]``, ``g, beta [B, K, G]``, ``reset [B]``; all fp32 (reset bool)."""
  a = jnp.where(reset[:, None, None], 0.0, jnp.exp(g))
  state = state * a[..., None, None]
  answer = jnp.einsum("bkh,bkghv->bkgv", k, state)     # what the decayed memory returns for k
  delta = (v - answer) * beta[..., None]               # the correction, at write strength beta
  state = state + jnp.einsum("bkh,bkgv->bkghv", k, delta)
  out = jnp.einsum("bkh,bkghv->bkgv", q, state)
  return state, out


def _recurrent(q, k, v, g, beta, state, resets):
  """``q, k [B, T, K, H]``, ``v [B, T, K, G, h]``, ``g, beta [B, T, K, G]``, ``state [B, K, G, H, h]``,
  all fp32 and q already scaled -> ``(out [B, T, K, G, h], state)``."""

  def body(s, xs):
    return _step(s, *xs)

  xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta, resets))
  state, out = jax.lax.scan(body, state, xs)
  return jnp.moveaxis(out, 0, 1), state


# -- chunked form -------------------------------------------------------------------------------


_BASE_BLOCK = 8  # diagonal blocks inverted by forward substitution before the doubling steps

# The chunked form floors every log-decay at this before its cumulative sums.  A gate of -inf (a
# hard reset, ``a_t = exp(g_t) = 0``) would otherwise give (-inf) - (-inf) = NaN in the differences
# ``log gamma_i - log gamma_j``, where the recurrence is finite; and a huge finite g (-1e30) would
# swamp the other terms of the sums (fp32 keeps ~7 digits), rounding the decays after it to 1.
# Nothing else changes: exp underflows to 0 in fp32 below -103.3 (the smallest subnormal), so any
# product of decays with a factor at or below the floor is 0 whether g was the floor or -inf, as in
# the recurrence.  The floor is small enough that the sums after it keep ~1e-5 absolute precision.
_G_FLOOR = -110.0


def _unit_lower_inverse(a: Float[Array, "*B C C"]) -> Float[Array, "*B C C"]:
  """``(I + a)^{-1}`` for strictly lower-triangular ``a``, ``C`` a power of two.

  Diagonal blocks of size 8 are inverted by forward substitution (unrolled, elementwise: batched
  8x8 matmuls are mostly overhead), then recursive block inversion doubles the block size:
  ``[[I + A11, 0], [A21, I + A22]]^{-1} = [[X1, 0], [-X2 A21 X1, X2]]``.  Each block computed is a
  block of the exact inverse, so nothing grows that the answer does not contain (unlike the
  product ``(I - A)(I + A^2)(I + A^4)...``, whose partial products reach C(63, 31) ~ 1e18 when
  keys repeat and then cancel catastrophically in fp32).
  """
  c = a.shape[-1]
  batch = a.shape[:-2]

  def diagonal_blocks(m):  # [..., C, C] -> [..., C/m, m, m]
    return jnp.einsum("...iaib->...iab", a.reshape(batch + (c // m, m, c // m, m)))

  base = min(_BASE_BLOCK, c)
  blocks = diagonal_blocks(base)
  eye = jnp.eye(base, dtype=a.dtype)
  rows = [jnp.broadcast_to(eye[0], blocks.shape[:-1])]
  for r in range(1, base):  # row r of the inverse: e_r - sum_{j<r} a[r, j] * row_j
    rows.append(eye[r] - sum(blocks[..., r, j, None] * rows[j] for j in range(r)))
  inv = jnp.stack(rows, axis=-2)                                       # [..., C/base, base, base]
  m = base
  while m < c:
    a21 = diagonal_blocks(2 * m)[..., m:, :m]                          # [..., C/2m, m, m]
    pairs = inv.reshape(batch + (c // (2 * m), 2, m, m))
    x1, x2 = pairs[..., 0, :, :], pairs[..., 1, :, :]
    x21 = -(x2 @ a21 @ x1)
    top = jnp.concatenate([x1, jnp.zeros_like(x1)], axis=-1)
    bottom = jnp.concatenate([x21, x2], axis=-1)
    inv = jnp.concatenate([top, bottom], axis=-2)
    m *= 2
  return inv.reshape(batch + (c, c))


def _chunk_local(q, k, v, g, beta, resets):
  """Everything about one chunk that does not depend on the incoming memory.

  Works on any leading batch dims ``*Z`` (all chunks at once, or one chunk inside the scan):
  ``q, k [*Z, K, C, H]``, ``v [*Z, K, G, C, h]``, ``g, beta [*Z, K, G, C]``, ``resets [*Z, C]``.
  Returns ``u, w, qg, intra, kg, chunk_decay`` (see the module docstring: ``U``, ``W``,
  ``diag(gamma) Q``, ``lower(Q K^T gamma_i / gamma_j)``, ``K gamma_C / gamma``, ``gamma_C``).
  """
  c = q.shape[-2]
  # Segment structure: tokens i, j share a segment iff no reset in (j, i]; the incoming memory
  # reaches token i iff no reset in [chunk start, i].
  seg = jnp.cumsum(resets.astype(jnp.int32), axis=-1)
  same = (seg[..., :, None] == seg[..., None, :])[..., None, None, :, :]  # [*Z, 1, 1, C, C]
  carry = (seg == 0)[..., None, None, :]                                # [*Z, 1, 1, C]
  keep = jnp.tril(jnp.ones((c, c), bool)) & same                        # causal, same segment
  keep_strict = keep & ~jnp.eye(c, dtype=bool)

  cum = jnp.cumsum(jnp.maximum(g, _G_FLOOR), axis=-1)                   # log gamma_i (_G_FLOOR)
  diff = cum[..., :, None] - cum[..., None, :]                          # log gamma_i / gamma_j
  # where() before exp: the masked (upper) entries are positive and could overflow.
  decay = jnp.where(keep, jnp.exp(jnp.where(keep, diff, 0.0)), 0.0)     # [*Z, K, G, C, C]
  gamma = jnp.exp(cum) * carry                                          # reads of the incoming S
  last = cum[..., -1:]
  to_end = jnp.exp(last - cum) * same[..., -1, :]                       # token i -> chunk end
  chunk_decay = jnp.exp(last[..., 0]) * carry[..., -1]                  # [*Z, K, G]

  # K K^T and Q K^T depend only on the key head: computed once for its G value heads.
  kk = jnp.einsum("...ih,...jh->...ij", k, k)[..., None, :, :]          # [*Z, K, 1, C, C]
  qk = jnp.einsum("...ih,...jh->...ij", q, k)[..., None, :, :]
  a = jnp.where(keep_strict, kk * decay, 0.0) * beta[..., :, None]      # diag(beta) K K^T decay
  tinv = _unit_lower_inverse(a)                                         # (I + A)^{-1}
  kv = k[..., None, :, :]                                               # [*Z, K, 1, C, H]
  u = tinv @ (v * beta[..., None])                                      # [*Z, K, G, C, h]
  w = tinv @ (kv * (beta * gamma)[..., None])                           # [*Z, K, G, C, H]
  qg = q[..., None, :, :] * gamma[..., None]
  kg = kv * to_end[..., None]
  return u, w, qg, qk * decay, kg, chunk_decay


def _state_pass(s, u, w, qg, intra, kg, chunk_decay):
  """The sequential part for one chunk: ``s [B, K, G, H, h]`` in -> (s out, chunk output)."""
  v_new = u - w @ s                                                     # corrections V'
  out = qg @ s + intra @ v_new                                          # [B, K, G, C, h]
  s = s * chunk_decay[..., None, None] + jnp.swapaxes(kg, -1, -2) @ v_new
  return s, out


def _chunked(q, k, v, g, beta, state, resets, *, chunk_size, fuse=None):
  """Same contract as ``_recurrent``; ``T`` must be a multiple of ``chunk_size``.

  ``fuse`` (default: on CPU) computes each chunk's local products inside the scan instead of for
  all chunks up front.  The math is the same (``_chunk_local`` then ``_state_pass``); fused keeps
  the working set of one chunk in cache, which on a 2-core CPU ran 1.5x faster (T = 4096, 8 heads
  of 128) than materializing the ``T x C`` tensors.  Elsewhere the up-front form gives every op
  the parallelism of all chunks at once (not measured on an accelerator yet).
  """
  b, t, kh, hk = k.shape
  grp, hv = v.shape[3], v.shape[4]
  c = chunk_size
  nc = t // c
  if fuse is None:
    fuse = jax.default_backend() == "cpu"
  # Chunk-major layouts, so the scan slices its leading axis:
  # [nc, B, K, C, H] for queries/keys, [nc, B, K, G, C, ...] for per-value-head quantities.
  xs = (q.reshape(b, nc, c, kh, hk).transpose(1, 0, 3, 2, 4),
        k.reshape(b, nc, c, kh, hk).transpose(1, 0, 3, 2, 4),
        v.reshape(b, nc, c, kh, grp, hv).transpose(1, 0, 3, 4, 2, 5),
        g.reshape(b, nc, c, kh, grp).transpose(1, 0, 3, 4, 2),
        beta.reshape(b, nc, c, kh, grp).transpose(1, 0, 3, 4, 2),
        resets.reshape(b, nc, c).transpose(1, 0, 2))
  if fuse:
    state, out = jax.lax.scan(lambda s, x: _state_pass(s, *_chunk_local(*x)), state, xs)
  else:
    state, out = jax.lax.scan(lambda s, x: _state_pass(s, *x), state, _chunk_local(*xs))
  out = out.transpose(1, 0, 4, 2, 3, 5).reshape(b, t, kh, grp, hv)   # [nc,B,K,G,C,h] -> [B,T,K,G,h]
  return out, state


# -- dispatch -----------------------------------------------------------------------------------


def _resolve(implementation, t):
  if implementation is None:
    return "recurrent" if t == 1 else "chunked"
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"`implementation` must be None or one of {IMPLEMENTATIONS}, got "
                     f"{implementation!r}.")
  if implementation in ("pallas_tpu", "pallas_gpu") and implementation not in _REGISTRY:
    try:  # Kernels register themselves on import.
      import pallas_kernels.delta_rule  # noqa: F401, PLC0415
    except ImportError:
      pass
    if implementation not in _REGISTRY:
      raise ValueError(f"`implementation`={implementation!r} is not available (explicit choices "
                       f"never fall back): {_UNAVAILABLE.get(implementation, 'not registered')}.")
  return implementation


def gated_delta_rule(
    query: Float[Array, "B T K H"],
    key: Float[Array, "B T K H"],
    value: Float[Array, "B T N h"],
    g: Float[Array, "B T N"],
    beta: Float[Array, "B T N"],
    *,
    scale: float | None = None,
    initial_state: Float[Array, "B N H h"] | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    segment_ids: Int[Array, "B T"] | None = None,
    use_qk_l2norm: bool = False,
    implementation: Implementation | None = None,
) -> tuple[Float[Array, "B T N h"], Float[Array, "B N H h"] | None]:
  """The gated delta rule over a sequence (see the module docstring for the math).

  Args:
    query, key: ``[B, T, K, H]``.  Keys should be unit length (``use_qk_l2norm=True`` normalizes
      both in fp32, as ``use_qk_l2norm_in_kernel`` in flash-linear-attention / transformers).
    value: ``[B, T, N, h]``, ``N`` a multiple of ``K``.
    g: ``[B, T, N]`` log-decay, ``a_t = exp(g_t)``; should be ``<= 0``.
    beta: ``[B, T, N]`` write strength, usually in ``(0, 1)``.
    scale: query scale, default ``1 / sqrt(H)``.
    initial_state: ``[B, N, H, h]`` memory before the first token (zeros when None).
    output_final_state: also return the memory after the last token (fp32).
    chunk_size: ``C`` of the chunked form, a power of two; ``T`` is zero-padded to a multiple
      (a sequence shorter than ``C`` uses the smallest power of two at or above ``T`` instead).
    segment_ids: ``[B, T]`` ints for packed sequences: the memory is cleared where the id changes.
    implementation: ``None`` (auto: ``"recurrent"`` for one token, else ``"chunked"``),
      ``"recurrent"``, ``"chunked"``, or a registered Pallas kernel ``"pallas_tpu"``/``"pallas_gpu"``.
      An explicit choice that is unavailable raises.

  Returns:
    ``(out [B, T, N, h] in value's dtype, final_state [B, N, H, h] fp32 or None)``.
  """
  _validate(query, key, value, g, beta, initial_state, segment_ids, chunk_size, scale)
  impl = _resolve(implementation, query.shape[1])
  scale = key.shape[-1] ** -0.5 if scale is None else scale
  cp_size = context_parallel.mesh_axis_size()
  if cp_size > 1 and query.shape[1] % cp_size == 0 and query.shape[1] > 1:
    # The sequence is split over the mesh axis `context`: each device runs its chunk, and the
    # devices exchange only the chunks' state transitions (`context_parallel.delta_rule`).
    return context_parallel.delta_rule(
        query, key, value, g, beta, scale=scale, initial_state=initial_state,
        output_final_state=bool(output_final_state), chunk_size=int(chunk_size),
        segment_ids=segment_ids, use_qk_l2norm=bool(use_qk_l2norm), implementation=impl,
        size=cp_size)
  # One compiled program per configuration (op-by-op dispatch of the dozens of small ops here
  # costs more than the math at test and decode sizes).
  return _gated_delta_rule_jit(query, key, value, g, beta, scale, initial_state, segment_ids,
                               impl=impl, chunk_size=int(chunk_size),
                               output_final_state=bool(output_final_state),
                               use_qk_l2norm=bool(use_qk_l2norm))


@functools.partial(jax.jit, static_argnames=("impl", "chunk_size", "output_final_state",
                                             "use_qk_l2norm"))
def _gated_delta_rule_jit(query, key, value, g, beta, scale, initial_state, segment_ids, *, impl,
                          chunk_size, output_final_state, use_qk_l2norm):
  b, t, kh, hk = key.shape
  n, hv = value.shape[2], value.shape[3]
  grp = n // kh
  f32 = jnp.float32
  q, k = query.astype(f32), key.astype(f32)
  if use_qk_l2norm:
    q, k = l2_normalize(q), l2_normalize(k)
  q = q * scale
  v = value.astype(f32).reshape(b, t, kh, grp, hv)
  gg = g.astype(f32).reshape(b, t, kh, grp)
  bb = beta.astype(f32).reshape(b, t, kh, grp)
  state = (jnp.zeros((b, kh, grp, hk, hv), f32) if initial_state is None
           else initial_state.astype(f32).reshape(b, kh, grp, hk, hv))
  resets = segment_resets(segment_ids, b, t)

  if impl == "recurrent":
    out, state = _recurrent(q, k, v, gg, bb, state, resets)
  else:
    c = min(chunk_size, 1 << max(t - 1, 0).bit_length())  # short inputs: a smaller chunk
    pad = (-t) % c
    if pad:  # zero k, v, beta and g leave the memory unchanged; padded outputs are dropped
      def p(x):
        return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
      q, k, v, gg, bb, resets = map(p, (q, k, v, gg, bb, resets))
    fn = _chunked if impl == "chunked" else _REGISTRY[impl]
    out, state = fn(q, k, v, gg, bb, state, resets, chunk_size=c)
    out = out[:, :t]
  out = out.reshape(b, t, n, hv).astype(value.dtype)
  final = state.reshape(b, n, hk, hv) if output_final_state else None
  return out, final


def gated_delta_rule_step(
    query: Float[Array, "B K H"],
    key: Float[Array, "B K H"],
    value: Float[Array, "B N h"],
    g: Float[Array, "B N"],
    beta: Float[Array, "B N"],
    state: Float[Array, "B N H h"],
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
) -> tuple[Float[Array, "B N h"], Float[Array, "B N H h"]]:
  """One decode step on the fixed-size memory: ``(out [B, N, h], new state [B, N, H, h] fp32)``.

  Equal to ``gated_delta_rule`` on a length-1 sequence with ``initial_state=state``; the memory
  does not grow with the number of tokens seen.
  """
  if query.ndim != 3 or key.ndim != 3 or value.ndim != 3:
    raise ValueError(f"decode step takes one token: `query`/`key` [B, K, H], `value` [B, N, h]; got "
                     f"{query.shape}, {key.shape}, {value.shape}.")
  for name, x in (("g", g), ("beta", beta)):   # checked here to quote the step's shapes
    if x.shape != value.shape[:2]:
      raise ValueError(f"`{name}` must have shape [B, N] = {value.shape[:2]}, got {x.shape}.")
  out, new_state = gated_delta_rule(
      query[:, None], key[:, None], value[:, None], g[:, None], beta[:, None], scale=scale,
      initial_state=state, output_final_state=True, use_qk_l2norm=use_qk_l2norm,
      implementation="recurrent")
  return out[:, 0], new_state


def state_bytes(batch: int, num_heads: int, head_dim: int, v_head_dim: int | None = None,
                dtype=jnp.float32) -> int:
  """Bytes of the recurrent memory ``[B, N, H, h]``: constant in the number of tokens."""
  v_head_dim = head_dim if v_head_dim is None else v_head_dim
  return int(batch * num_heads * head_dim * v_head_dim * np.dtype(dtype).itemsize)


__all__ = ["IMPLEMENTATIONS", "gated_delta_rule", "gated_delta_rule_step", "l2_normalize",
           "register_implementation", "state_bytes"]
