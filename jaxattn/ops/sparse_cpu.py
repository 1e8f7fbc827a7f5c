"""Native CPU kernels of DeepSeek Sparse Attention (``jaxattn/native/sparse.cc``) behind
``jaxattn.ops.sparse.indexer_topk`` and ``sparse_attention`` (``implementation="cpu"``, the CPU
default where the kernels are built).

* ``indexer_topk_cpu``: the lightning-indexer scores of the visible keys in register-blocked
  tiles, each row's scores streamed through a candidate set cut back to its best ``k`` whenever
  it fills (no ``[T, S]`` scores, no sort of whole rows).  The selection is exactly
  ``lax.top_k`` of the kernel's fp32 scores (higher score first, ties to the lower position);
  those scores differ from XLA's only in summation order.
* ``sparse_attention_cpu``: per query row and KV head, the selected key rows gathered into the
  flash kernel's tiles, a base-2 softmax and ``p v`` reading the selected value rows in place.
  Differentiable: the backward pass is the VJP of the XLA gather reference.

Both run on fp32 operands (other dtypes are converted; the outputs take the query dtype), under
``jax.jit`` and ``jax.vmap`` (sequentially over the mapped axis), and under a device mesh inside
``jax.shard_map`` (batch split, and for sparse attention heads too, by the ``"batch"`` /
``"heads"`` sharding rules), so each device runs the kernel on its own slice.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxattn import native

_F32 = jnp.float32
# Measured on a 2-core AVX-512 CPU (T = 32k, 4 indexer heads of 32, k = 256).
INDEX_BLOCK_Q = 64
INDEX_BLOCK_K = 512


def available() -> bool:
  """True on a CPU backend with the native kernels built."""
  return jax.default_backend() == "cpu" and native.available()


def indexer_topk_cpu(q, keys, w, k_scale, q_offset, lengths, k: int, order: str):
  """``int32 [B, T, k]`` top-``k`` positions of ``k_scale[s] sum_j w[t,j] ReLU(q[t,j] . keys[s])``
  over the visible keys ``s <= q_offset + t``, ``s < lengths[b]`` (``-1`` padding).

  ``q [B, T, HI, d]``, ``keys [B, S, d]``, ``w [B, T, HI]``, ``k_scale [B, S]`` or None,
  ``q_offset`` an int scalar (may be traced), ``lengths [B]`` int.
  """
  # No k_scale: ones (x * 1 is exact) rather than an empty operand, which XLA's compiler in
  # jaxlib 0.11 crashes on inside shard_map.
  scale = jnp.ones(keys.shape[:2], _F32) if k_scale is None else k_scale.astype(_F32)
  # Integer positions carry no gradient: cut the operands' tangents so that differentiating
  # through a model that selects with this kernel never reaches the FFI call.
  q, keys, w, scale = (jax.lax.stop_gradient(x.astype(_F32)) for x in (q, keys, w, scale))
  offset = jnp.reshape(jnp.asarray(q_offset, jnp.int32), (1,))

  def local(q, keys, w, scale, offset, lengths):
    b, t = q.shape[:2]
    call = jax.ffi.ffi_call("jaxattn_indexer_topk_f32",
                            jax.ShapeDtypeStruct((b, t, k), jnp.int32), vmap_method="sequential")
    return call(q, keys, w, scale.reshape(-1), offset, lengths, k=np.int64(k),
                by_position=np.int64(order == "position"), block_q=np.int64(INDEX_BLOCK_Q),
                block_k=np.int64(INDEX_BLOCK_K))

  def specs(mesh):
    bax, _ = _axes(mesh, q.shape[0], 1, 1)
    return [P(bax), P(bax), P(bax), P(bax), P(), P(bax)], P(bax)

  return _sharded(local, [q, keys, w, scale, offset, jnp.asarray(lengths, jnp.int32)], specs)


def _axes(mesh, batch: int, heads: int, kv_heads: int):
  from pallas_kernels.flash_attention.sharded import plan_specs  # noqa: PLC0415
  return plan_specs(mesh, batch, heads, kv_heads)


def _sharded(local, args, specs):
  """``local(*args)`` in ``shard_map`` under the context mesh (batch, and heads where given,
  split as the attention kernels split them: each device runs the native kernel on its slice),
  or directly without one.  An FFI call cannot be partitioned by XLA, which would otherwise
  gather its operands and run it whole on every device."""
  from pallas_kernels.flash_attention.sharded import run_sharded  # noqa: PLC0415
  return run_sharded(local, args, None, specs)


def indexer_workspace_bytes(b: int, s: int, hi: int, d: int, k: int, threads: int) -> int:
  """Bytes ``indexer_topk_cpu`` allocates outside XLA's buffers: the keys packed as ``k^T``
  strips (``B S_pad d`` fp32, linear in ``S``) and, per running task, its query rows, score tile
  and candidate sets."""
  s_pad = -(-s // 32) * 32
  task = 4 * (INDEX_BLOCK_Q * (hi * d + hi + INDEX_BLOCK_K)
              + (INDEX_BLOCK_Q + 1) * (4 * k + 16) * 2)
  return 4 * b * s_pad * d + threads * task


def sparse_workspace_bytes(kk: int, h: int, hv: int, g: int, threads: int) -> int:
  """Bytes ``sparse_attention_cpu`` allocates per running task (gathered ``k^T`` strips, logits,
  outputs), times ``threads``; independent of the sequence length."""
  kk_pad = max(-(-kk // 32) * 32, 32)
  rows = -(-g // 8) * 8
  hv_pad = -(-hv // 16) * 16
  return threads * 4 * (kk_pad * h + rows * (h + kk_pad + hv_pad) + kk_pad * 2 + hv_pad + 16)


def _sparse_forward(query, key, value, indices, scale):
  def local(query, key, value, indices):
    b, t, n, _ = query.shape
    call = jax.ffi.ffi_call(
        "jaxattn_sparse_attention_f32", jax.ShapeDtypeStruct((b, t, n, value.shape[-1]), _F32),
        vmap_method="sequential")
    return call(query, key, value, indices, scale=np.float32(scale))

  def specs(mesh):
    bax, hax = _axes(mesh, query.shape[0], query.shape[2], key.shape[2])
    heads = P(bax, None, hax, None)
    return [heads, heads, heads, P(bax)], heads

  out = _sharded(local, [query.astype(_F32), key.astype(_F32), value.astype(_F32),
                         indices.astype(jnp.int32)], specs)
  return out.astype(query.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def sparse_attention_cpu(query, key, value, indices, scale: float, backward):
  """Sparse attention by the native kernel; ``backward(query, key, value, indices, scale, d_out)
  -> (dq, dk, dv)`` is the backward pass (``jaxattn.ops.sparse.sparse_attention_vjp``)."""
  return _sparse_forward(query, key, value, indices, scale)


def _fwd(query, key, value, indices, scale, backward):
  return _sparse_forward(query, key, value, indices, scale), (query, key, value, indices)


def _bwd(scale, backward, res, d_out):
  query, key, value, indices = res
  dq, dk, dv = backward(query, key, value, indices, scale, d_out)
  return dq, dk, dv, np.zeros(indices.shape, jax.dtypes.float0)


sparse_attention_cpu.defvjp(_fwd, _bwd)

__all__ = ["available", "indexer_topk_cpu", "sparse_attention_cpu", "indexer_workspace_bytes",
           "sparse_workspace_bytes", "INDEX_BLOCK_Q", "INDEX_BLOCK_K"]
