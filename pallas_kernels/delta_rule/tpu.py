"""The sequential part of the chunked gated delta rule on TPU: one kernel, the memory in VMEM.

The XLA chunked form (``jaxattn.ops.delta_rule``) splits each chunk's work into chunk-local
products (``_chunk_local``: the UT transform, ``U``, ``W``, decays; parallel over chunks, left to
XLA here) and the pass that carries the memory ``S [H, h]`` from chunk to chunk
(``_state_pass``).  In XLA that pass is a ``lax.scan``: every chunk reads and writes ``S`` through
HBM and pays a loop iteration.  This kernel runs the whole pass for one ``(batch, key head, value
head)`` with ``S`` resident in a VMEM scratch buffer.

Grid ``(B, K, G, nc)``, the chunk axis last and "arbitrary" (sequential)::

    c == 0:       S = S0                                         [H, h] fp32, VMEM scratch
    every c:      V' = U_c - W_c S                               [C, h]
                  O_c = Qg_c S + Intra_c V'                      [C, h]   (written out)
                  S = gamma_c S + Kg_c^T V'                      [H, h]
    c == nc - 1:  S_final = S

Blocks: ``U_c [C, h]``, ``W_c, Qg_c, Kg_c [C, H]``, ``Intra_c [C, C]`` per grid step (full head
sizes: they must be multiples of 128 or the full dimension for Mosaic; ``C`` a multiple of 8).

Gradients: a custom VJP whose backward differentiates the XLA pass (``_state_pass`` under
``lax.scan``), so training gets the XLA backward and the kernel forward.

Under a device mesh the kernel runs in ``jax.shard_map`` with batch and key heads split (the
``"batch"`` / ``"heads"`` sharding rules), each device on its own slice.

Status: correct in interpret mode (``tests/kernels/test_delta_rule_tpu.py``), compiled for TPU
v5e / v6e by ``experiments/tpu_compile_check.py``.  Not timed on a TPU;
whether it beats the XLA scan there is unmeasured, so ``implementation=None`` never selects it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float

from jaxattn.ops import delta_rule as dr
from pallas_kernels.flash_attention.common import default_interpret

NN_DIMS = (((1,), (0,)), ((), ()))  # a @ b
TN_DIMS = (((0,), (0,)), ((), ()))  # a.T @ b


# -- public entry (the normalized backend signature of gated_delta_rule) --------------------------


def chunked_delta_rule_tpu(q, k, v, g, beta, state, resets, *, chunk_size, interpret=None):
  """Backend for ``gated_delta_rule(..., implementation="pallas_tpu")``.

  ``q, k [B, T, K, H]`` (q scaled), ``v [B, T, K, G, h]``, ``g, beta [B, T, K, G]``,
  ``state [B, K, G, H, h]``, ``resets [B, T]``; fp32, ``T`` a multiple of ``chunk_size``.
  Returns ``(out [B, T, K, G, h], final state)``.  ``interpret=None`` interprets unless on a TPU.
  """
  interpret = default_interpret(interpret)
  b, t, kh, hk = k.shape
  grp, hv = v.shape[3], v.shape[4]
  c = chunk_size
  nc = t // c
  # The chunk-local products in XLA, all chunks at once, with [B, nc] as the leading dims:
  # q, k [B, nc, K, C, H], v [B, nc, K, G, C, h], g, beta [B, nc, K, G, C], resets [B, nc, C].
  xs = (q.reshape(b, nc, c, kh, hk).transpose(0, 1, 3, 2, 4),
        k.reshape(b, nc, c, kh, hk).transpose(0, 1, 3, 2, 4),
        v.reshape(b, nc, c, kh, grp, hv).transpose(0, 1, 3, 4, 2, 5),
        g.reshape(b, nc, c, kh, grp).transpose(0, 1, 3, 4, 2),
        beta.reshape(b, nc, c, kh, grp).transpose(0, 1, 3, 4, 2),
        resets.reshape(b, nc, c))
  local = dr._chunk_local(*xs)                                           # [B, nc, K, G, ...]
  out, state = state_pass_tpu(*local, state, interpret)
  out = out.transpose(0, 3, 4, 1, 2, 5).reshape(b, t, kh, grp, hv)      # [B,K,G,nc,C,h] -> [B,T,K,G,h]
  return out, state


# -- custom VJP: kernel forward, XLA backward ------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def state_pass_tpu(u: Float[Array, "B nc K G C h"], w: Float[Array, "B nc K G C H"],
                   qg: Float[Array, "B nc K G C H"], intra: Float[Array, "B nc K G C C"],
                   kg: Float[Array, "B nc K G C H"], chunk_decay: Float[Array, "B nc K G"],
                   state: Float[Array, "B K G H h"], interpret: bool = False):
  """The memory pass over chunks: ``(out [B, K, G, nc, C, h], final state [B, K, G, H, h])``."""
  return _forward(u, w, qg, intra, kg, chunk_decay, state, interpret)


def _reference(u, w, qg, intra, kg, chunk_decay, state):
  """The same pass in XLA (``lax.scan`` of ``_state_pass``), differentiated for the backward."""
  xs = tuple(jnp.moveaxis(x, 1, 0) for x in (u, w, qg, intra, kg, chunk_decay))  # [nc, B, K, G, ..]
  state, out = lax.scan(lambda s, x: dr._state_pass(s, *x), state, xs)
  return jnp.moveaxis(out, 0, 3), state                                 # [B, K, G, nc, C, h]


def _fwd(u, w, qg, intra, kg, chunk_decay, state, interpret):
  out = _forward(u, w, qg, intra, kg, chunk_decay, state, interpret)
  return out, (u, w, qg, intra, kg, chunk_decay, state)


def _bwd(interpret, residuals, cotangents):
  del interpret
  _, vjp = jax.vjp(_reference, *residuals)
  return vjp(cotangents)


state_pass_tpu.defvjp(_fwd, _bwd)


# -- pallas_call builder and kernel ----------------------------------------------------------------


def _forward(u, w, qg, intra, kg, chunk_decay, state, interpret):
  """The kernel under the context mesh in ``shard_map`` (batch and key heads split: the pass is
  independent per ``(batch, key head, value head)``), or directly without one."""
  from pallas_kernels.flash_attention.sharded import plan_specs, run_sharded  # noqa: PLC0415

  def specs(mesh):
    bax, hax = plan_specs(mesh, u.shape[0], u.shape[2], u.shape[2])
    chunked = P(bax, None, hax)
    return [chunked] * 6 + [P(bax, hax)], (P(bax, hax), P(bax, hax))

  local = functools.partial(_forward_local, interpret=interpret)
  return run_sharded(local, [u, w, qg, intra, kg, chunk_decay, state], None, specs)


def _forward_local(u, w, qg, intra, kg, chunk_decay, state, interpret):
  b, nc, kh, grp, c, hv = u.shape
  hk = w.shape[-1]
  # Kernel layout: [B, K, G, nc, ...] so one program's chunks are contiguous along the grid axis.
  u, w, qg, intra, kg = (x.transpose(0, 2, 3, 1, 4, 5) for x in (u, w, qg, intra, kg))
  cd = chunk_decay.transpose(0, 2, 3, 1)[..., None, None]               # [B, K, G, nc, 1, 1]

  def chunk_block(rows, cols):
    return pl.BlockSpec((None, None, None, None, rows, cols), lambda i, j, l, m: (i, j, l, m, 0, 0))

  state_block = pl.BlockSpec((None, None, None, hk, hv), lambda i, j, l, m: (i, j, l, 0, 0))
  out, final = pl.pallas_call(
      functools.partial(_kernel, num_chunks=nc),
      grid=(b, kh, grp, nc),
      in_specs=[chunk_block(c, hv), chunk_block(c, hk), chunk_block(c, hk), chunk_block(c, c),
                chunk_block(c, hk), chunk_block(1, 1), state_block],
      out_specs=[chunk_block(c, hv), state_block],
      out_shape=[jax.ShapeDtypeStruct((b, kh, grp, nc, c, hv), jnp.float32),
                 jax.ShapeDtypeStruct((b, kh, grp, hk, hv), jnp.float32)],
      scratch_shapes=[pltpu.VMEM((hk, hv), jnp.float32)],              # the memory S
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
      interpret=interpret, name="jaxattn_delta_rule_state_pass_tpu",
  )(u, w, qg, intra, kg, cd, state)
  return out, final


def _kernel(u_ref, w_ref, qg_ref, intra_ref, kg_ref, cd_ref, s0_ref, out_ref, sfinal_ref, s_ref, *,
            num_chunks):
  c = pl.program_id(3)

  @pl.when(c == 0)
  def init():
    s_ref[...] = s0_ref[...]                                           # [H, h]

  s = s_ref[...]                                                       # [H, h]
  f32 = jnp.float32
  v_new = u_ref[...] - lax.dot_general(w_ref[...], s, NN_DIMS, preferred_element_type=f32)  # [C, h]
  out_ref[...] = (lax.dot_general(qg_ref[...], s, NN_DIMS, preferred_element_type=f32)
                  + lax.dot_general(intra_ref[...], v_new, NN_DIMS, preferred_element_type=f32))
  s_ref[...] = s * cd_ref[...] + lax.dot_general(kg_ref[...], v_new, TN_DIMS,
                                                 preferred_element_type=f32)  # [H, h]

  @pl.when(c == num_chunks - 1)
  def store():
    sfinal_ref[...] = s_ref[...]
