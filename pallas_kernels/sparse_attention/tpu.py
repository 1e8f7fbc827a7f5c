"""Top-K sparse attention kernel (TPU / Mosaic style): fetch only the selected key/value rows.

The selected positions ``indices [B, T, k]`` (``-1`` = unused) are passed by scalar prefetch
(``pltpu.PrefetchScalarGridSpec``), so they sit in SMEM before the grid starts and the key/value
``index_map`` can read them: grid step ``(b, t, j)`` DMAs exactly row ``indices[b, t, j]`` of the
keys and values into VMEM -- the ``S - k`` unselected rows are never read.  An online softmax
(running max ``m``, sum ``l``, accumulator ``acc`` in VMEM scratch) folds the ``k`` rows in, as a
flash kernel folds key blocks, and the last step normalizes.  Unused slots are skipped with
``pl.when``; a query with no valid slot returns zeros.

    grid (B, T, k)            b, t: parallel; j: the selected rows, sequential ("arbitrary")
    q block   [N, H]          query row (b, t), all heads
    k/v block [K, H] / [K, h] cache row indices[b, t, j], all KV heads (GQA: head n reads n // G)

One row per grid step keeps the kernel short and obviously correct; a production TPU kernel would
gather several rows per step with manual DMAs (as JAX's paged attention does with pages) to
amortize the per-step overhead.  Validated in interpret mode (with race detection) against
``jaxattn.ops.sparse.sparse_attention``; forward only (DSA's top-K gather carries no gradient to
the indexer, and training uses the XLA reference).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int

from pallas_kernels.flash_attention.common import reset_online_softmax

_F32 = jnp.float32


def _kernel(idx_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, *, scale, num_t, num_k,
            groups):
  b, t, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)

  reset_online_softmax(j == 0, m_ref, l_ref, acc_ref)

  row = idx_ref[(b * num_t + t) * num_k + j]

  @pl.when(row >= 0)
  def compute():
    q = q_ref[...].astype(_F32)                                  # [N, H]
    k = k_ref[...].astype(_F32)                                  # [K, H]
    v = v_ref[...].astype(_F32)                                  # [K, h]
    if groups > 1:                                               # GQA: head n uses KV head n // G
      k = jnp.repeat(k, groups, axis=0)                          # [N, H]
      v = jnp.repeat(v, groups, axis=0)                          # [N, h]
    s = jnp.sum(q * k, axis=-1, keepdims=True) * scale           # [N, 1]
    m_prev = m_ref[...]                                          # [N, 1]
    m_new = jnp.maximum(m_prev, s)
    alpha = jnp.exp(m_prev - m_new)                              # 0 on the first valid row
    p = jnp.exp(s - m_new)                                       # [N, 1]
    l_ref[...] = alpha * l_ref[...] + p
    acc_ref[...] = alpha * acc_ref[...] + p * v                  # [N, h]
    m_ref[...] = m_new

  @pl.when(j == num_k - 1)
  def store():
    l = l_ref[...]
    o_ref[...] = jnp.where(l > 0, acc_ref[...] / jnp.where(l > 0, l, 1.0), 0.0).astype(o_ref.dtype)


def sparse_attention_tpu(
    query: Float[Array, "B T N H"],
    key: Float[Array, "B S K H"],
    value: Float[Array, "B S K h"],
    indices: Int[Array, "B T k"],
    *,
    scale: float | None = None,
    interpret=False,
) -> Float[Array, "B T N h"]:
  """``jaxattn.ops.sparse.sparse_attention`` as a Pallas kernel reading only the selected rows.

  ``interpret``: False (compile for TPU), True, or a ``pltpu.InterpretParams`` (e.g. with
  ``detect_races=True``) to run on CPU.
  """
  if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
    raise ValueError(f"`query`, `key`, `value` must be [B, T, N, H], [B, S, K, H], [B, S, K, h]; "
                     f"got {query.shape}, {key.shape}, {value.shape}.")
  b, t, n, h = query.shape
  s, kh, hv = key.shape[1], key.shape[2], value.shape[3]
  if key.shape[0] != b or key.shape[3] != h or value.shape[:3] != key.shape[:3]:
    raise ValueError(f"`key` {key.shape} / `value` {value.shape} must be [B={b}, S, K, H={h}] / "
                     "[B, S, K, h].")
  if n % kh:
    raise ValueError(f"query heads N={n} must be a multiple of key heads K={kh}.")
  if indices.ndim != 3 or indices.shape[:2] != (b, t) or indices.shape[2] < 1:
    raise ValueError(f"`indices` must be [B={b}, T={t}, k>=1], got shape {indices.shape}.")
  num_k = indices.shape[2]
  scale = 1.0 / math.sqrt(h) if scale is None else float(scale)
  # Out-of-range rows are treated as unused, like -1 (the reference would wrap or clamp them).
  idx = jnp.where((indices >= 0) & (indices < s), indices, -1).astype(jnp.int32).reshape(-1)

  def kv_map(bi, ti, ji, idx_ref):
    return (bi, jnp.maximum(idx_ref[(bi * t + ti) * num_k + ji], 0), 0, 0)

  kernel = functools.partial(_kernel, scale=scale, num_t=t, num_k=num_k, groups=n // kh)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      grid=(b, t, num_k),
      in_specs=[
          pl.BlockSpec((None, None, n, h), lambda bi, ti, ji, _: (bi, ti, 0, 0)),   # q [N, H]
          pl.BlockSpec((None, None, kh, h), kv_map),                                # k row [K, H]
          pl.BlockSpec((None, None, kh, hv), kv_map),                               # v row [K, h]
      ],
      out_specs=pl.BlockSpec((None, None, n, hv), lambda bi, ti, ji, _: (bi, ti, 0, 0)),
      scratch_shapes=[pltpu.VMEM((n, 1), _F32),     # running max m
                      pltpu.VMEM((n, 1), _F32),     # running sum l
                      pltpu.VMEM((n, hv), _F32)])   # accumulator
  # b and t write disjoint output rows, so they may run on different cores; j accumulates.
  params = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))
  return pl.pallas_call(
      kernel, grid_spec=grid_spec, out_shape=jax.ShapeDtypeStruct((b, t, n, hv), query.dtype),
      compiler_params=params, interpret=interpret)(idx, query, key, value)


def sparse_mla_attention_tpu(
    q_nope: Float[Array, "B T N P"],
    q_rope: Float[Array, "B T N R"],
    c_kv: Float[Array, "B S C"],
    k_rope: Float[Array, "B S R"],
    w_uk: Float[Array, "C N P"],
    w_uv: Float[Array, "C N h"],
    indices: Int[Array, "B T k"],
    *,
    scale: float | None = None,
    interpret=False,
) -> Float[Array, "B T N h"]:
  """DSA over the MLA latent cache: the kernel fetches only the selected ``[c_KV, k^R]`` rows.

  Absorbed form, as ``jaxattn.ops.sparse.sparse_mla_attention``: the latent row is the single
  shared key, its first ``C`` entries the value (the kernel reads the row once per selected slot
  for each role).
  """
  b, t, n, p = q_nope.shape
  c, r = c_kv.shape[2], q_rope.shape[3]
  if w_uk.shape != (c, n, p) or w_uv.shape[:2] != (c, n):
    raise ValueError(f"`w_uk` must be [C, N, P] = {(c, n, p)} and `w_uv` [C={c}, N={n}, h]; got "
                     f"{w_uk.shape}, {w_uv.shape}.")
  scale = 1.0 / math.sqrt(p + r) if scale is None else scale
  dt = q_nope.dtype
  q_lat = jnp.einsum("btnp,cnp->btnc", q_nope, w_uk.astype(dt), preferred_element_type=_F32)
  query = jnp.concatenate([q_lat.astype(dt), q_rope], axis=-1)   # [B, T, N, C + R]
  kv = jnp.concatenate([c_kv, k_rope], axis=-1)[:, :, None, :]  # [B, S, 1, C + R]
  o_lat = sparse_attention_tpu(query, kv, c_kv[:, :, None, :], indices, scale=scale,
                               interpret=interpret)              # [B, T, N, C]
  return jnp.einsum("btnc,cnh->btnh", o_lat, w_uv.astype(dt),
                    preferred_element_type=_F32).astype(dt)
