"""Top-K sparse attention for NVIDIA GPUs (Pallas Triton): gather only the selected rows.

``sparse_attention_gpu`` (GQA / MQA / MHA over a contiguous cache) runs one program per
``(query token, KV head)``; the token's ``G = N / K`` query heads share every gathered row::

    grid (B * T, K)
    q tile    [G_p, H_p]                 the group's heads, zero-padded to a Triton dot tile
    loop      j < blocks holding a valid slot (read per token)
              rows = addresses[j * block_k : + block_k]               [bk] (-1 = none)
              k = keys[rows * K + g]   v = values[rows * K + g]      vector gathers [bk, H_p]
              logits = scale * q k^T (fp32) -> online softmax -> acc += p @ v

Keys and values are viewed flat as ``[B * S * K, H]`` (free reshapes), so a selected row of KV
head ``g`` is one offset.  Unused slots gather row 0 and are zeroed before use (a cache row may
hold anything, and ``0 * NaN`` must not reach the accumulator), then masked.

``sparse_mla_attention_gpu`` (DSA on MLA) reuses the sparse MLA decode kernel of
``pallas_kernels.mla_decode.gpu``: a contiguous latent cache ``[B, S, C]`` is a pool of ``B``
pages of ``S`` rows with page table ``[[0], [1], ...]``, every head of a token shares each
gathered latent row, and the selected slots split across programs when the batch is small.

Validated in interpret mode on CPU against ``jaxattn.ops.sparse``; lowered for CUDA in the tests.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int

from pallas_kernels.decode_attention.gpu import (default_interpret, dot_nt, finish, online_step,
                                                 pad_last, pad_lengths, pow2)
from pallas_kernels.sparse_attention import common

_F32 = jnp.float32


def _kernel(count_ref, rows_ref, q_ref, k_ref, v_ref, o_ref, *, scale, kv_heads, block_k):
  i, g = pl.program_id(0), pl.program_id(1)
  q = q_ref[...]                                                      # [Gp, Hp]

  def body(j, carry):
    addr = rows_ref[pl.ds(pl.multiple_of(j * block_k, block_k), block_k)]   # [bk]
    valid = addr >= 0
    row = jnp.maximum(addr, 0) * kv_heads + g
    k = jnp.where(valid[:, None], k_ref[row, :], 0.0).astype(k_ref.dtype)    # [bk, Hp]
    v = jnp.where(valid[:, None], v_ref[row, :], 0.0).astype(v_ref.dtype)    # [bk, hp]
    logits = dot_nt(q, k) * scale
    return online_step(carry, jnp.where(valid[None, :], logits, -jnp.inf), v)

  init = (jnp.zeros(o_ref.shape, _F32), jnp.full((q.shape[0],), -jnp.inf, _F32),
          jnp.zeros((q.shape[0],), _F32))
  out, _ = finish(lax.fori_loop(0, count_ref[i], body, init))
  o_ref[...] = out.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "block_k", "num_warps", "num_stages",
                                             "interpret"))
def _call(query, key, value, indices, *, scale, block_k, num_warps, num_stages, interpret):
  b, t, n, h = query.shape
  s, kh, hv = key.shape[1], key.shape[2], value.shape[3]
  g = n // kh
  gp, hp, vp = pow2(g), pow2(h), pow2(hv)
  rows, blocks = common.pad_rows(common.flat_rows(indices, s), block_k)
  k_pad = rows.shape[1]
  counts = pad_lengths(blocks)                                       # blocks to visit per token
  q = query.reshape(b * t, kh, g, h)
  q = jnp.pad(q, ((0, 0), (0, 0), (0, gp - g), (0, hp - h)))
  k_flat = pad_last(key, hp).reshape(b * s * kh, hp)
  v_flat = pad_last(value, vp).reshape(b * s * kh, vp)
  kernel = functools.partial(_kernel, scale=float(scale), kv_heads=kh, block_k=block_k)
  out = pl.pallas_call(
      kernel,
      grid=(b * t, kh),
      in_specs=[
          pl.BlockSpec(counts.shape, lambda i, j: (0,)),                    # blocks per token
          pl.BlockSpec((None, k_pad), lambda i, j: (i, 0)),                 # row addresses
          pl.BlockSpec((None, None, gp, hp), lambda i, j: (i, j, 0, 0)),    # the group's queries
          pl.BlockSpec(k_flat.shape, lambda i, j: (0, 0)),                  # keys, gathered
          pl.BlockSpec(v_flat.shape, lambda i, j: (0, 0)),                  # values, gathered
      ],
      out_specs=pl.BlockSpec((None, None, gp, vp), lambda i, j: (i, j, 0, 0)),
      out_shape=jax.ShapeDtypeStruct((b * t, kh, gp, vp), query.dtype),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret, name="jaxattn_sparse_attention_gpu",
  )(counts, rows, q, k_flat, v_flat)
  return out[:, :, :g, :hv].reshape(b, t, n, hv)


def sparse_attention_gpu(
    query: Float[Array, "B T N H"],
    key: Float[Array, "B S K H"],
    value: Float[Array, "B S K h"],
    indices: Int[Array, "B T k"],
    *,
    scale: float | None = None,
    block_k: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret=None,
    mesh=None,
) -> Float[Array, "B T N h"]:
  """``jaxattn.ops.sparse.sparse_attention`` as a Pallas Triton kernel reading only the selected
  rows.  Positions outside ``[0, S)`` count as ``-1`` (unused).  ``block_k``: selected rows
  gathered per step (a power of two >= 16).  ``interpret``: None (compile on a GPU, else
  interpret) or a bool.  ``mesh`` as ``tpu.sparse_attention_tpu``."""
  scale = common.check_gqa(query, key, value, indices, scale)
  if block_k < 16 or block_k & (block_k - 1):
    raise ValueError(f"`block_k` must be a power of two >= 16, got {block_k!r}.")
  local = functools.partial(_call, scale=scale, block_k=block_k, num_warps=num_warps,
                            num_stages=num_stages, interpret=default_interpret(interpret))
  return common.run_gqa_sharded(local, query, key, value, indices, mesh)


def sparse_mla_latent_gpu(
    q_latent: Float[Array, "B T N C"],
    q_rope: Float[Array, "B T N R"],
    c_kv: Float[Array, "B S C"],
    k_rope: Float[Array, "B S R"],
    indices: Int[Array, "B T k"],
    *,
    scale: float,
    num_splits: int | None = None,
    interpret=None,
    mesh=None,
) -> Float[Array, "B T N C"]:
  """The latent-space core of DSA on MLA (as ``tpu.sparse_mla_latent_tpu``): the contiguous cache
  goes to the sparse MLA decode kernel as ``B`` pages of ``S`` rows.  ``num_splits``: partitions
  of the selected slots (None: chosen from the device's SM count).  ``mesh`` as
  ``tpu.sparse_mla_latent_tpu``."""
  from pallas_kernels.mla_decode.gpu import paged_mla_decode_gpu  # noqa: PLC0415 (import cycle)

  common.check_latent(q_latent, q_rope, c_kv, k_rope, indices)

  def local(q_latent, q_rope, c_kv, k_rope, indices):
    b, s = c_kv.shape[:2]
    table = jnp.arange(b, dtype=jnp.int32)[:, None]                  # batch row b = page b
    return paged_mla_decode_gpu(q_latent, q_rope.astype(q_latent.dtype), c_kv,
                                k_rope.astype(c_kv.dtype), table, jnp.full((b,), s, jnp.int32),
                                scale=float(scale), indices=indices.astype(jnp.int32),
                                num_splits=num_splits, interpret=interpret)

  return common.run_latent_sharded(local, q_latent, q_rope, c_kv, k_rope, indices, mesh)


def sparse_mla_attention_gpu(
    q_nope: Float[Array, "B T N P"],
    q_rope: Float[Array, "B T N R"],
    c_kv: Float[Array, "B S C"],
    k_rope: Float[Array, "B S R"],
    w_uk: Float[Array, "C N P"],
    w_uv: Float[Array, "C N h"],
    indices: Int[Array, "B T k"],
    *,
    scale: float | None = None,
    num_splits: int | None = None,
    interpret=None,
    mesh=None,
) -> Float[Array, "B T N h"]:
  """DSA over the MLA latent cache, absorbed form, as ``jaxattn.ops.sparse.sparse_mla_attention``:
  queries mapped into latent space, ``sparse_mla_latent_gpu``, then ``W_up^V``."""
  return common.absorbed(
      lambda ql, qr, c, kr, i, sc: sparse_mla_latent_gpu(ql, qr, c, kr, i, scale=sc,
                                                         num_splits=num_splits,
                                                         interpret=interpret, mesh=mesh),
      q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, indices, scale)
