"""Flash attention for NVIDIA GPUs (Pallas Triton): forward, dQ and dK/dV kernels.

The same function, features and block tables as the TPU kernel (``tpu.py``), in the GPU shape of
the algorithm (FlashAttention-2): one program per ``(query block, batch row, head)`` holds its query
tile and fp32 accumulator in registers and loops over key blocks *inside* the kernel::

    for w in range(n_full):      j = table[w];  online-softmax step on k_j, v_j   (no mask)
    for w in range(n_full, n_full + n_partial):   the same step, mask evaluated

so empty blocks are never loaded and FULL blocks never evaluate the mask.  The layout stays
``[B, T, N, H]`` (no transpose): a program addresses rows ``T`` with stride ``N * H``.  Head sizes
are zero-padded to a power of two (Triton tiles), sequences to whole blocks.

Backward: a dQ kernel (programs over query blocks, loop over key blocks) and a dK/dV kernel
(programs over key blocks and *query* heads, loop over the non-empty query blocks in transposed
orientation).  With GQA each query head writes its own fp32 dK/dV partial and XLA sums the ``G``
heads of a group: no atomics, and any group size (a Triton tile cannot span a group of 3 or 7).
A dense bias' gradient is the dQ kernel's ``ds`` for a bias with every dim; one shared over the
batch, heads or queries (and any bias after the Hopper backward) has its own kernel
(``_dbias_call``), summing the sharing pairs' ``ds`` per block in registers.

Validated here in interpret mode only (``interpret=True`` runs the kernels on CPU);
``experiments/device_check.sh`` runs the tests and the benchmark on a real GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Bool, Float, Int

from jaxattn.ops.attention import UnsupportedError
from jaxattn.ops import attention_cudnn
from jaxattn.ops.masks import Mask
from pallas_kernels.flash_attention import common as C
from pallas_kernels.flash_attention import hopper
from pallas_kernels.flash_attention.sharded import run_flash


# Code-generation switches of the kernels, timed on an H200 (jax 0.11.2, bf16, B=2, N=16, H=128,
# T=8192) by ``python -m experiments.bench_flash --sweep 8192 --backward``; change them with
# ``set_options`` (results do not depend on them beyond rounding):
#   exp:     "exp" (lax.exp: libdevice ``expf``), "exp2" (logits kept in base 2 with log2(e) folded
#            into the scale, lax.exp2) or "ex2asm" (base 2 with the ``ex2.approx.f32`` instruction
#            inline; lax.exp2 when interpreted).  Forward at 128 x 64 tiles, 4 warps, 3 stages:
#            exp 343 TFLOP/s -> exp2 407 (non-causal); the softmax's exponentials, not the
#            matmuls, were the bound.  Default "exp2".
#   affine:  when every row of a pass's block table lists its FULL and its PARTIAL key blocks as
#            ascending runs (causal, or no mask), address block ``w`` of a run as ``first + w``
#            instead of loading ``table[w]`` inside the loop, so Triton's pipeliner sees loads
#            affine in the loop counter.  Causal forward 268 -> 334 TFLOP/s (with ``reverse``); on
#            tables without PARTIAL blocks (no mask) it measured slower (407 -> 383), so it applies
#            only to tables that have them.  Default True.
#   reverse: forward and dQ programs take query blocks last-first (under a causal mask the last
#            blocks carry the most key blocks; launching them first shortens the tail wave).
#            Default True.
#   dq:      "kernel" (a dQ kernel over query blocks: it recomputes the logits and ``do v^T``, seven
#            matmuls per block pair in all) or "atomic" (the dK/dV kernel also adds each block's
#            ``ds k`` into an fp32 dQ with atomic adds, as FlashAttention-2's CUDA backward does:
#            five matmuls, no dQ kernel).  Default "kernel"; "atomic" is tested for results here
#            but not yet timed on a GPU.
#   forward: "triton" (the kernel below), "hopper" (``hopper.py``: Mosaic GPU, TMA + wgmma + warp
#            specialisation, for sm_90 GPUs; band masks and (static offset) Longformer-style
#            block-sparse ones, segment ids, key lengths, ALiBi and soft-cap, a dense bias or
#            a mask array [B|1, N|1, T|1, S]; calls it does not take -- fp32, other masks, a
#            traced scale, a mask array with a bias, another GPU --
#            stay on Triton, see ``hopper_reason``) or "auto"
#            ("hopper" on a compiled run, Triton when interpreted: the CPU tests interpret the
#            Hopper kernels only where they ask for them).  Either backward takes either forward's
#            output.  On an H200 at T = 8k (bf16, 16 heads of 128) the Hopper forward ran 533-554
#            TFLOP/s non-causal and 543 causal (0.85x / 0.97x cuDNN) against Triton's 443 / 379.
#            Default "auto".
#   backward: "triton" (the dQ and dK/dV kernels below), "hopper" (``hopper.backward``: the same
#            two passes as Mosaic GPU kernels; the dK/dV pass sums a GQA group in the kernel) or
#            "auto", as ``forward``.  Same eligibility, head sizes up to 192.  Forward +
#            backward, causal, 8k: 472 TFLOP/s on the Hopper kernels (0.93x cuDNN) against 267 with
#            Triton's backward.  Default "auto".
#   hopper:  the Hopper kernels' ``hopper.Config`` (None: their defaults).
#   shared_bias: the gradient of a learned bias shared over the batch, heads or queries (T5's
#            ``[1, N, T, S]``): "kernel" (its own kernel, ``_dbias_call``: per output block a loop
#            over the (batch row, head) pairs sharing it, summed in registers and written once;
#            deterministic, two extra matmuls per pair and block) or "atomic" (a bias shared over
#            the batch only: the dQ kernel adds its ``ds`` into one zeroed ``[1, N, T, S]`` fp32
#            buffer with atomic adds; no extra matmuls, summation order varies run to run; other
#            sharing takes the kernel).  Default "kernel"; neither is timed on a GPU yet.
_OPTIONS = {"exp": "exp2", "affine": True, "reverse": True, "dq": "kernel", "forward": "auto",
            "backward": "auto", "hopper": None, "shared_bias": "kernel"}
_ALLOWED = {"exp": ("exp", "exp2", "ex2asm"), "affine": (True, False), "reverse": (True, False),
            "dq": ("kernel", "atomic"), "forward": ("triton", "hopper", "auto"),
            "backward": ("triton", "hopper", "auto"), "shared_bias": ("kernel", "atomic")}
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


def set_options(**options):
  """Sets kernel code-generation switches (see ``_OPTIONS``) and drops cached kernels."""
  for name, value in options.items():
    if name not in _OPTIONS:
      raise ValueError(f"set_options: unknown option {name!r}; allowed: {sorted(_OPTIONS)}.")
    if name in _ALLOWED and value not in _ALLOWED[name]:
      raise ValueError(f"set_options: `{name}`={value!r}; allowed: {list(_ALLOWED[name])}.")
    if name == "hopper" and value is not None and not isinstance(value, hopper.Config):
      raise ValueError(f"set_options: `hopper` must be a hopper.Config or None, got "
                       f"{type(value).__name__}.")
    _OPTIONS[name] = value
  for f in (_build, _fwd_call, _dq_call, _dkv_call, _dbias_call):
    f.cache_clear()


def get_options() -> dict:
  return dict(_OPTIONS)


def _exp2(x, interpret: bool):
  if _OPTIONS["exp"] == "ex2asm" and not interpret:
    (y,) = plgpu.elementwise_inline_asm(
        "ex2.approx.f32 $0, $1;", args=[x], constraints="=r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])
    return y
  return jnp.exp2(x)


def _affine(plan: C.Plan, transpose: bool) -> bool:
  """Whether the static block table of a pass has PARTIAL blocks and lists, per row, FULL then
  PARTIAL columns as two ascending runs of consecutive blocks (so ``table[w] = table[lo] + (w -
  lo)`` within a run)."""
  if not _OPTIONS["affine"] or plan.per_batch_tables:
    return False
  bq, bk = (plan.block_q_dkv, plan.block_k_dkv) if transpose else (plan.block_q, plan.block_k)
  kinds = np.asarray(C.static_kinds(plan, bq, bk))
  if transpose:
    kinds = kinds.T
  if not np.any(kinds == C.PARTIAL):
    return False  # measured slower than the table load when every block is FULL (see _OPTIONS)
  for row in kinds:
    for kind in (C.FULL, C.PARTIAL):
      cols = np.flatnonzero(row == kind)
      if cols.size > 1 and np.any(np.diff(cols) != 1):
        return False
  return True


def _reversed_rows(specs, rows: int):
  """The specs with grid axis 0 read backwards (``r -> rows - 1 - r``) under ``reverse``."""
  if not _OPTIONS["reverse"]:
    return specs
  return [pl.BlockSpec(sp.block_shape,
                       lambda r, b, h, f=sp.index_map: f(rows - 1 - r, b, h)) for sp in specs]


def _row_id(rows: int):
  i = pl.program_id(0)
  return rows - 1 - i if _OPTIONS["reverse"] else i


def _div(x, d: int):
  """``x // d`` for non-negative grid indices: truncating division (one scalar op; ``//`` adds
  sign fix-ups), and none at all when ``d == 1``."""
  return x if d == 1 else lax.div(x, d)


# ----------------------------------------------------------------------------------------------
# Public entry point
# ----------------------------------------------------------------------------------------------


def flash_attention(
    query: Float[Array, "B T N H"],
    key: Float[Array, "B S K H"],
    value: Float[Array, "B S K h"],
    mask: Mask | None = None,
    *,
    scale: float | None = None,
    alibi_slopes: Float[Array, "N"] | None = None,
    logits_soft_cap: float | None = None,
    q_offset: int | Int[Array, ""] = 0,
    return_residuals: bool = False,
    block_sizes: C.BlockSizes | None = None,
    interpret: bool | None = None,
    mesh=None,
    residuals=None,
    bias: Float[Array, "#B #N #T #S"] | None = None,
    mask_array: Bool[Array, "#B #N #T #S"] | None = None,
) -> Float[Array, "B T N h"] | tuple[Float[Array, "B T N h"], Float[Array, "B N T"]]:
  """Flash attention on NVIDIA GPUs; arguments as ``pallas_kernels.flash_attention.tpu``.

  ``block_sizes`` defaults to ``BlockSizes.gpu()``; its blocks must be powers of two >= 16.
  ``interpret=None`` interprets (on CPU) unless the default backend is a GPU.  A key-padding
  ``mask_array`` ``[B|1, 1, 1, S]`` (Hugging Face's) is taken as segment ids
  (``masks.key_mask_as_segments``: a masked key gets an id no query has), which every kernel,
  the Hopper ones included, streams per key block.
  """
  on_gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
  if interpret is None:
    interpret = not on_gpu
  # (Lowering for CUDA on a machine without a GPU, as the lowering tests do, checks nothing.)
  if not interpret and on_gpu and (why := attention_cudnn.nvidia_reason()):
    raise UnsupportedError(f"implementation='pallas_gpu' cannot run here: {why}. Use "
                           "implementation='xla_chunked' (automatic dispatch does).")
  block_sizes = block_sizes or C.BlockSizes.gpu()
  for name in ("block_q", "block_k", "block_q_dkv", "block_k_dkv"):
    v = getattr(block_sizes, name)
    if v < 16 or v & (v - 1):
      raise ValueError(f"GPU flash attention: `block_sizes.{name}` must be a power of two >= 16 "
                       f"(a Triton tile), got {v}.")
  out, lse = run_flash(query, key, value, mask, scale=scale, alibi_slopes=alibi_slopes,
                       logits_soft_cap=logits_soft_cap, q_offset=q_offset, block_sizes=block_sizes,
                       interpret=bool(interpret), mesh=mesh, build=_build, pow2_blocks=True,
                       residuals=residuals, bias=bias,
                       mask_array=mask_array, key_mask_ids=True)
  return (out, lse) if return_residuals else out


# ----------------------------------------------------------------------------------------------
# custom VJP
# ----------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=128)
def _build(plan: C.Plan):
  """``(q, k, v, aux) -> (out [B, T, N, h], lse [B, N, T])`` with its flash backward."""
  return C.flash_custom_vjp(plan, _forward, _backward)


def _pow2(x: int) -> int:
  return max(16, 1 << (x - 1).bit_length())


def _pad(x, seq_len, head_dim):
  """``[B, T, N, H]`` zero-padded to ``[B, seq_len, N, head_dim]``."""
  if x.shape[1] == seq_len and x.shape[3] == head_dim:
    return x
  return jnp.pad(x, ((0, 0), (0, seq_len - x.shape[1]), (0, 0), (0, head_dim - x.shape[3])))


def _pad_vec(x):
  """1-D scalar table padded to a power-of-two length (a Triton tile)."""
  n = x.shape[0]
  return jnp.pad(x, (0, _pow2(n) - n)) if n != _pow2(n) else x


class _Inputs:

  def __init__(self, plan: C.Plan, q, k, v, aux, bias=None):
    # the bias [Bb, Nb, Tp | 1, Sp] (zero padded), the mask array as int8 (0 padded)
    self.dense = tuple(
        jnp.pad(x, ((0, 0), (0, 0), (0, 0 if x.shape[2] == 1 else plan.q_pad - plan.q_len),
                    (0, plan.kv_pad - plan.kv_len)))
        for x in (bias, None if aux["mask_array"] is None else aux["mask_array"].astype(jnp.int8))
        if x is not None)
    self.hp, self.vp = _pow2(plan.head_dim), _pow2(plan.v_head_dim)
    self.q = _pad(q, plan.q_pad, self.hp)  # [B, Tp, N, Hp]
    self.k = _pad(k, plan.kv_pad, self.hp)  # [B, Sp, K, Hp]
    self.v = _pad(v, plan.kv_pad, self.vp)  # [B, Sp, K, hp]
    ints = [aux["q_offset"].reshape(1)]
    if plan.has_lengths:
      ints.append(aux["kv_lengths"].astype(jnp.int32))
    self.iscal = _pad_vec(jnp.concatenate(ints))  # q_offset, kv_lengths
    floats = [aux["scale"].reshape(1)]
    if plan.has_alibi:
      floats.append(aux["slopes"])
    self.fscal = _pad_vec(jnp.concatenate(floats))  # scale, slopes
    self.segs = ()
    if plan.has_segments:
      self.segs = (C.pad_edge(aux["q_ids"].astype(jnp.int32), plan.q_pad),  # [B, Tp]
                   C.pad_edge(aux["kv_ids"].astype(jnp.int32), plan.kv_pad))  # [B, Sp]


def _tables(plan, aux, transpose):
  return C.block_tables(plan, q_ids=aux["q_ids"], kv_ids=aux["kv_ids"],
                        kv_lengths=aux["kv_lengths"], mask_array=aux["mask_array"],
                        transpose=transpose, pad_width_to_pow2=True)


def _compiler_params(plan: C.Plan, head_dim: int):
  num_warps = plan.num_warps or (4 if head_dim <= 64 else 8)
  return plgpu.CompilerParams(num_warps=num_warps, num_stages=plan.num_stages)


def _scalars(plan, iscal_ref, fscal_ref, b, n):
  slope = fscal_ref[1 + n] if plan.has_alibi else None
  kv_length = iscal_ref[1 + b] if plan.has_lengths else None
  return iscal_ref[0], fscal_ref[0], slope, kv_length


def _bt(plan, b):
  return b if plan.per_batch_tables else 0


def _visit(counts_ref, entries_ref, carry, step, affine=False):
  """Runs ``step(block, carry, masked)`` over the FULL then the PARTIAL entries of one row
  (``affine``: each run's blocks are consecutive, see ``_affine``)."""
  n_full, n_part = counts_ref[0], counts_ref[1]
  width = entries_ref.shape[0]
  for masked, lo, hi in ((False, 0, n_full), (True, n_full, n_full + n_part)):
    if affine:
      base = (entries_ref[jnp.minimum(lo, width - 1)] >> C.KIND_BITS) - lo
      body = lambda w, c, masked=masked, base=base: step(base + w, c, masked)  # noqa: E731
    else:
      body = lambda w, c, masked=masked: step(entries_ref[w] >> C.KIND_BITS, c, masked)  # noqa
    carry = lax.fori_loop(lo, hi, body, carry)
  return carry


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------


def hopper_device_reason() -> str | None:
  """None when the default device is an sm_90 GPU (the Hopper kernels' target), else why not."""
  cc = getattr(jax.devices()[0], "compute_capability", None)
  if cc is None or not str(cc).startswith("9"):
    return f"device compute capability {cc} (the kernel is for sm_90)"
  return None


def hopper_reason(plan: C.Plan, which: str = "forward") -> str | None:
  """None when option ``which`` ("forward" / "backward") = "hopper" runs this plan's pass on the
  Hopper kernels, else why not."""
  if _OPTIONS[which] == "triton":
    return f"option {which}='triton'"
  if _OPTIONS[which] == "auto" and plan.interpret:
    return f"option {which}='auto' interprets the Triton kernels"
  dense = _hopper_dense(plan)
  if which == "backward" and (why := hopper.supports_backward(
      head_dim=plan.head_dim, v_head_dim=plan.v_head_dim, config=_OPTIONS["hopper"],
      bias=dense)):
    return why
  if not plan.interpret and (why := hopper_device_reason()):
    return why
  if plan.static_scale is None:
    return "a traced scale"
  if dense is True and plan.has_bias and plan.bias_dtype != plan.dtype:
    return (f"a dense bias {plan.bias_shape} {plan.bias_dtype} (the Hopper kernels stream "
            f"[B|1, N|1, T, S] tiles in the inputs' dtype, or one-row biases as fp32 vectors)")
  # (a key-padding mask [B|1, 1, 1, S] arrives as segment ids)
  if plan.has_mask_array and plan.has_bias:
    return ("a boolean mask array with a bias (the Hopper kernels stream one dense input, the "
            "bias' or the mask's)")
  return hopper.supports(dtype=plan.dtype, head_dim=plan.head_dim, v_head_dim=plan.v_head_dim,
                         static_mask=plan.static_mask,
                         config=_OPTIONS["hopper"], segments=plan.has_segments, bias=dense,
                         static_offset=plan.static_q_offset is not None)


def _hopper_dense(plan: C.Plan) -> bool | str:
  """The Hopper kernels' dense input (their shared-memory models' ``bias``): ``"row"`` for a
  bias or mask array with one row for all queries (fp32 key vectors), True for a bias or mask
  array tile, else False."""
  shape = plan.bias_shape or plan.mask_shape
  if shape is not None and shape[2] == 1:
    return "row"
  return plan.has_bias or plan.has_mask_array


def _hopper_kwargs(plan: C.Plan, aux) -> dict:
  """The arguments of ``hopper.forward`` / ``hopper.backward`` for this plan besides the
  tensors: its static part and its data masks / slopes."""
  q_offset = aux["q_offset"] if plan.static_q_offset is None else plan.static_q_offset
  return dict(mask=plan.static_mask, scale=plan.static_scale, q_offset=q_offset,
              logits_soft_cap=plan.logits_soft_cap, config=_OPTIONS["hopper"],
              interpret=plan.interpret or None,
              alibi_slopes=aux["slopes"] if plan.has_alibi else None,
              segment_ids=(aux["q_ids"], aux["kv_ids"]) if plan.has_segments else None,
              kv_lengths=aux["kv_lengths"] if plan.has_lengths else None,
              mask_array=aux["mask_array"] if plan.has_mask_array else None)


def _forward(plan: C.Plan, q, k, v, bias, aux):
  if hopper_reason(plan) is None:
    return hopper.forward(q, k, v, bias=bias, **_hopper_kwargs(plan, aux))
  x = _Inputs(plan, q, k, v, aux, bias)
  entries, counts = _tables(plan, aux, transpose=False)
  out, lse = _fwd_call(plan, entries.shape[-1], x.hp, x.vp)(
      x.q, x.k, x.v, entries, counts, x.iscal, x.fscal, *x.segs, *x.dense)
  return out[:, :plan.q_len, :, :plan.v_head_dim], lse[:, :, :plan.q_len]


def _common_specs(plan, width, iscal_len, fscal_len, transpose):
  """Table, count, scalar and segment-id specs for a grid ``(blocks, B, heads)``."""
  rows_block = plan.block_k_dkv if transpose else plan.block_q
  specs = [
      pl.BlockSpec((None, None, width), lambda r, b, h: (_bt(plan, b), r, 0)),  # entries
      pl.BlockSpec((None, None, 2), lambda r, b, h: (_bt(plan, b), r, 0)),  # counts
      pl.BlockSpec((iscal_len,), lambda r, b, h: (0,)),
      pl.BlockSpec((fscal_len,), lambda r, b, h: (0,)),
  ]
  if plan.has_segments:
    if transpose:  # programs own key blocks and loop over all query rows
      specs += [pl.BlockSpec((None, plan.q_pad), lambda r, b, h: (b, 0)),
                pl.BlockSpec((None, rows_block), lambda r, b, h: (b, r))]
    else:
      specs += [pl.BlockSpec((None, rows_block), lambda r, b, h: (b, r)),
                pl.BlockSpec((None, plan.kv_pad), lambda r, b, h: (b, 0))]
  # The bias' and the mask array's rows of this program's block (forward, dQ) or their columns
  # (dK/dV); an input with one row for all queries: that row.
  for index, rows in plan.dense_inputs():
    if transpose:
      specs.append(pl.BlockSpec((None, None, plan.q_pad if rows else 1, rows_block),
                                lambda r, b, h, index=index: (*index(b, h), 0, r)))
    else:
      specs.append(pl.BlockSpec((None, None, rows_block if rows else 1, plan.kv_pad),
                                lambda r, b, h, index=index, rows=rows: (*index(b, h),
                                                                         r if rows else 0, 0)))
  return specs


@functools.lru_cache(maxsize=128)
def _fwd_call(plan: C.Plan, width: int, hp: int, vp: int):
  bq, g = plan.block_q, plan.groups
  nq = plan.q_pad // bq
  in_specs = [
      pl.BlockSpec((None, bq, None, hp), lambda i, b, n: (b, i, n, 0)),  # q tile
      pl.BlockSpec((None, plan.kv_pad, None, hp), lambda i, b, n: (b, 0, _div(n, g), 0)),  # k (all)
      pl.BlockSpec((None, plan.kv_pad, None, vp), lambda i, b, n: (b, 0, _div(n, g), 0)),  # v (all)
  ] + _common_specs(plan, width, *_scalar_lens(plan), transpose=False)
  out_specs = [
      pl.BlockSpec((None, bq, None, vp), lambda i, b, n: (b, i, n, 0)),
      pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, i)),
  ]
  out_shape = [
      jax.ShapeDtypeStruct((plan.batch, plan.q_pad, plan.num_heads, vp), jnp.dtype(plan.dtype)),
      jax.ShapeDtypeStruct((plan.batch, plan.num_heads, plan.q_pad), jnp.float32),
  ]
  return pl.pallas_call(
      functools.partial(_fwd_kernel, plan=plan),
      grid=(nq, plan.batch, plan.num_heads),
      in_specs=_reversed_rows(in_specs, nq), out_specs=_reversed_rows(out_specs, nq),
      out_shape=out_shape, compiler_params=_compiler_params(plan, hp),
      interpret=plan.interpret, name="jaxattn_flash_fwd_gpu")


def _scalar_lens(plan):
  return _pow2(1 + (plan.batch if plan.has_lengths else 0)), _pow2(
      1 + (plan.num_heads if plan.has_alibi else 0))


def _fwd_kernel(q_ref, k_ref, v_ref, entries_ref, counts_ref, iscal_ref, fscal_ref, *refs, plan):
  if plan.has_segments:
    qseg_ref, kvseg_ref, *refs = refs
  bias_ref, mask_ref, refs = C.dense_refs(plan, refs)
  o_ref, lse_ref = refs
  i, b, n = _row_id(plan.q_pad // plan.block_q), pl.program_id(1), pl.program_id(2)
  bq, bk = plan.block_q, plan.block_k
  q_offset, scale, slope, kv_length = _scalars(plan, iscal_ref, fscal_ref, b, n)
  q = q_ref[...]  # [bq, Hp], resident for the whole loop
  q_idx = i * bq + jnp.arange(bq, dtype=jnp.int32)[:, None]  # [bq, 1]
  q_seg = qseg_ref[...][:, None] if plan.has_segments else None

  base2 = _OPTIONS["exp"] != "exp"
  # Base 2: logits times log2(e), so that exp(x - m) = exp2(x' - m').  Without ALiBi or soft-cap
  # the factor folds into the scale (one multiply per logit, as before).
  fold = base2 and slope is None and plan.logits_soft_cap is None and bias_ref is None
  step_scale = scale * _LOG2E if fold else scale
  expf = (lambda x: _exp2(x, plan.interpret)) if base2 else jnp.exp  # noqa: E731

  def step(j, carry, masked):
    acc, m, l = carry  # [bq, hp], [bq], [bq]
    start = pl.multiple_of(j * bk, bk)
    k = k_ref[pl.ds(start, bk), :]  # [bk, Hp]
    v = v_ref[pl.ds(start, bk), :]  # [bk, hp]
    s = plgpu.dot(q, k, trans_b=True)  # [bq, bk] fp32
    kv_idx = start + jnp.arange(bk, dtype=jnp.int32)[None, :]
    segs = {}
    if masked and plan.has_segments:
      segs = dict(q_seg=q_seg, kv_seg=kvseg_ref[pl.ds(start, bk)][None, :])
    if bias_ref is not None:
      segs["bias"] = bias_ref[:, pl.ds(start, bk)]
    if mask_ref is not None and masked:
      segs["allowed_tile"] = mask_ref[:, pl.ds(start, bk)]
    s = C.block_scores(s, plan=plan, q_idx=q_idx, kv_idx=kv_idx, q_offset=q_offset,
                       scale=step_scale, slope=slope, masked=masked, kv_length=kv_length, **segs)
    if base2 and not fold:
      s = s * _LOG2E
    m_next = jnp.maximum(m, jnp.max(s, axis=1))
    m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # no allowed key yet: exp(-inf) = 0
    p = expf(s - m_safe[:, None])
    alpha = expf(m - m_safe)
    acc = acc * alpha[:, None] + plgpu.dot(p.astype(C.matmul_dtype(v)), v)
    return acc, m_next, l * alpha + jnp.sum(p, axis=1)

  init = (jnp.zeros((bq, o_ref.shape[-1]), jnp.float32), jnp.full((bq,), -jnp.inf, jnp.float32),
          jnp.zeros((bq,), jnp.float32))
  acc, m, l = _visit(counts_ref, entries_ref, init, step, affine=_affine(plan, False))
  ok = l != 0.0  # NaN rows stay NaN (a fully masked row has l == 0)
  inv = jnp.where(ok, 1.0 / jnp.where(ok, l, 1.0), 0.0)  # a row with no allowed key gives 0
  o_ref[...] = (acc * inv[:, None]).astype(o_ref.dtype)
  if base2:
    lse = (m + jnp.log2(jnp.where(ok, l, 1.0))) * _LN2
  else:
    lse = m + jnp.log(jnp.where(ok, l, 1.0))
  lse_ref[...] = jnp.where(ok, lse, -jnp.inf)


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------


def _backward_inputs(plan: C.Plan, q, k, v, bias, aux, out, lse, d_out, d_lse):
  """The Triton backward kernels' operands: the padded inputs, dO, and the padded lse / delta
  rows ``[B, N, Tp]``."""
  x = _Inputs(plan, q, k, v, aux, bias)
  do = _pad(d_out, plan.q_pad, x.vp)  # [B, Tp, N, hp]
  delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B, T, N]
  delta = jnp.swapaxes(delta, 1, 2) - d_lse.astype(jnp.float32)  # [B, N, T]
  lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0)  # empty rows: p = exp(-inf - 0) = 0
  pad_t = ((0, 0), (0, 0), (0, plan.q_pad - plan.q_len))
  # Padded query rows are not masked: an lse of +inf makes their p = 0 (0 let a large ALiBi
  # term overflow p to inf, and inf * 0 put NaN into dK / dV).
  delta, lse_safe = jnp.pad(delta, pad_t), jnp.pad(lse_safe, pad_t, constant_values=jnp.inf)
  return x, do, lse_safe, delta


def _backward(plan: C.Plan, q, k, v, bias, aux, out, lse, d_out, d_lse, bias_grad=False):
  if hopper_reason(plan, "backward") is None:
    dq, dk, dv = hopper.backward(q, k, v, out, lse, d_out, d_lse, bias=bias,
                                 **_hopper_kwargs(plan, aux))
    d_bias = None
    if bias_grad:  # ds summed over what shares each block, by the Triton kernel of its own
      x, do, lse_safe, delta = _backward_inputs(plan, q, k, v, bias, aux, out, lse, d_out, d_lse)
      d_bias = _shared_bias_gradient(plan, aux, x, do, lse_safe, delta, bias.dtype)
    return dq, dk, dv, d_bias
  x, do, lse_safe, delta = _backward_inputs(plan, q, k, v, bias, aux, out, lse, d_out, d_lse)

  # The gradient of a bias with every dim is the dQ kernel's ds (dQ then comes from that kernel,
  # not atomics); under the "atomic" option, that of a bias shared over the batch only too (ds
  # added up over the batch with atomic adds into one zeroed buffer).  Other shared biases: their
  # own kernel, after the dK/dV one.
  full = plan.bias_shape == (plan.batch, plan.num_heads, plan.q_len)
  atomic_ds = (bias_grad and _OPTIONS["shared_bias"] == "atomic" and plan.bias_shape == (
      1, plan.num_heads, plan.q_len) and plan.batch > 1)
  ds_out = bias_grad and (full or atomic_ds)
  atomic = _OPTIONS["dq"] == "atomic" and not ds_out
  d_bias = None
  if not atomic:
    entries, counts = _tables(plan, aux, transpose=False)
    zero_ds = ((jnp.zeros((1, plan.num_heads, plan.q_pad, plan.kv_pad), jnp.float32),)
               if atomic_ds else ())
    dq = _dq_call(plan, entries.shape[-1], x.hp, x.vp, ds_out, atomic_ds)(
        x.q, x.k, x.v, do, lse_safe, delta, entries, counts, x.iscal, x.fscal, *x.segs, *x.dense,
        *zero_ds)
    if ds_out:
      dq, ds = dq
      d_bias = C.bias_gradient(plan, aux, ds, bias.dtype, zeroed=atomic_ds)
  if bias_grad and not ds_out:
    d_bias = _shared_bias_gradient(plan, aux, x, do, lse_safe, delta, bias.dtype)
  entries_t, counts_t = _tables(plan, aux, transpose=True)
  extra = ()
  if atomic:  # the dK/dV kernel accumulates dQ into this zeroed fp32 buffer (aliased in place)
    extra = (jnp.zeros((plan.batch, plan.q_pad, plan.num_heads, x.hp), jnp.float32),)
  outs = _dkv_call(plan, entries_t.shape[-1], x.hp, x.vp, atomic)(
      x.q, x.k, x.v, do, lse_safe, delta, entries_t, counts_t, x.iscal, x.fscal, *x.segs,
      *x.dense, *extra)
  dk, dv = outs[:2]
  if atomic:
    dq = outs[2] * aux["scale"]
  b, s, kh, g = plan.batch, plan.kv_len, plan.num_kv_heads, plan.groups
  # Per-query-head partials [B, Sp, N, .] -> sum over the G heads of each KV head.
  dk = dk[:, :s, :, :plan.head_dim].reshape(b, s, kh, g, plan.head_dim).sum(3)
  dv = dv[:, :s, :, :plan.v_head_dim].reshape(b, s, kh, g, plan.v_head_dim).sum(3)
  dq = dq[:, :plan.q_len, :, :plan.head_dim]
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), d_bias


def _probs(plan, scale, slope):
  """``(s, lse, **where) -> (logits, p)`` of one backward block: ``p = exp(logits - lse)``, in base
  2 under the ``exp`` switch (``logits`` are returned in natural units for the soft-cap's chain
  rule whenever a soft-cap is set)."""
  base2 = _OPTIONS["exp"] != "exp"
  fold = base2 and slope is None and plan.logits_soft_cap is None and not plan.has_bias

  def prob(s, lse, **where):
    if fold:
      s2 = C.block_scores(s, plan=plan, scale=scale * _LOG2E, slope=slope, **where)
      return s2, _exp2(s2 - lse * _LOG2E, plan.interpret)
    s = C.block_scores(s, plan=plan, scale=scale, slope=slope, **where)
    if base2:
      return s, _exp2((s - lse) * _LOG2E, plan.interpret)
    return s, jnp.exp(s - lse)

  return prob


@functools.lru_cache(maxsize=128)
def _dq_call(plan: C.Plan, width: int, hp: int, vp: int, bias_grad: bool = False,
             shared_ds: bool = False):
  """The dQ kernel; with ``bias_grad`` also its ``ds`` rows, per batch row ``[B, N, Tp, Sp]`` or,
  ``shared_ds`` (a bias shared over the batch), added up over the batch with atomic adds into one
  zeroed ``[1, N, Tp, Sp]`` buffer (aliased: the last input)."""
  bq, g = plan.block_q, plan.groups
  nq = plan.q_pad // bq
  row = lambda i, b, n: (b, i, n, 0)  # noqa: E731
  kv_all = lambda i, b, n: (b, 0, _div(n, g), 0)  # noqa: E731
  in_specs = [
      pl.BlockSpec((None, bq, None, hp), row),  # q
      pl.BlockSpec((None, plan.kv_pad, None, hp), kv_all),  # k
      pl.BlockSpec((None, plan.kv_pad, None, vp), kv_all),  # v
      pl.BlockSpec((None, bq, None, vp), row),  # do
      pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, i)),  # lse
      pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, i)),  # delta
  ] + _common_specs(plan, width, *_scalar_lens(plan), transpose=False)
  out_specs = [pl.BlockSpec((None, bq, None, hp), row)]
  out_shape = [jax.ShapeDtypeStruct((plan.batch, plan.q_pad, plan.num_heads, hp), jnp.float32)]
  aliases = {}
  if bias_grad:  # ds rows fp32; blocks no step visits are left unwritten (zero when shared)
    ds_batch = 1 if shared_ds else plan.batch
    ds_spec = pl.BlockSpec((None, None, bq, plan.kv_pad),
                           lambda i, b, n: (0 if shared_ds else b, n, i, 0))
    out_specs.append(ds_spec)
    out_shape.append(jax.ShapeDtypeStruct((ds_batch, plan.num_heads, plan.q_pad, plan.kv_pad),
                                          jnp.float32))
    if shared_ds:
      in_specs.append(ds_spec)
      aliases = {len(in_specs) - 1: 1}
  out_specs = _reversed_rows(out_specs, nq)
  return pl.pallas_call(
      functools.partial(_dq_kernel, plan=plan, shared_ds=shared_ds),
      grid=(nq, plan.batch, plan.num_heads),
      in_specs=_reversed_rows(in_specs, nq),
      out_specs=out_specs if bias_grad else out_specs[0],
      out_shape=out_shape if bias_grad else out_shape[0], input_output_aliases=aliases,
      compiler_params=_compiler_params(plan, hp),
      interpret=plan.interpret, name="jaxattn_flash_dq_gpu")


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, entries_ref, counts_ref, iscal_ref,
               fscal_ref, *refs, plan, shared_ds=False):
  if plan.has_segments:
    qseg_ref, kvseg_ref, *refs = refs
  bias_ref, mask_ref, refs = C.dense_refs(plan, refs)
  if shared_ds:
    refs = refs[1:]  # the aliased zero buffer's input ref: its output ref is added into
  dq_ref, *ds_ref = refs  # ds_ref: [ds rows] when the bias is differentiated
  i, b, n = _row_id(plan.q_pad // plan.block_q), pl.program_id(1), pl.program_id(2)
  bq, bk = plan.block_q, plan.block_k
  q_offset, scale, slope, kv_length = _scalars(plan, iscal_ref, fscal_ref, b, n)
  q, do = q_ref[...], do_ref[...]  # [bq, Hp], [bq, hp]
  lse, delta = lse_ref[...][:, None], delta_ref[...][:, None]  # [bq, 1]
  q_idx = i * bq + jnp.arange(bq, dtype=jnp.int32)[:, None]
  q_seg = qseg_ref[...][:, None] if plan.has_segments else None
  prob = _probs(plan, scale, slope)

  def step(j, dq, masked):
    start = pl.multiple_of(j * bk, bk)
    k = k_ref[pl.ds(start, bk), :]
    v = v_ref[pl.ds(start, bk), :]
    s = plgpu.dot(q, k, trans_b=True)  # [bq, bk]
    kv_idx = start + jnp.arange(bk, dtype=jnp.int32)[None, :]
    segs = {}
    if masked and plan.has_segments:
      segs = dict(q_seg=q_seg, kv_seg=kvseg_ref[pl.ds(start, bk)][None, :])
    if bias_ref is not None:
      segs["bias"] = bias_ref[:, pl.ds(start, bk)]
    if mask_ref is not None and masked:
      segs["allowed_tile"] = mask_ref[:, pl.ds(start, bk)]
    s, p = prob(s, lse, q_idx=q_idx, kv_idx=kv_idx, q_offset=q_offset, masked=masked,
                kv_length=kv_length, **segs)
    dp = plgpu.dot(do, v, trans_b=True)  # [bq, bk]
    ds = C.soft_cap_grad(p * (dp - delta), s, plan)
    if ds_ref and shared_ds:  # d loss / d bias of this block, summed over the batch
      plgpu.atomic_add(ds_ref[0], (slice(None), pl.ds(start, bk)), ds)
    elif ds_ref:  # d loss / d bias of this block
      ds_ref[0][:, pl.ds(start, bk)] = ds
    return dq + plgpu.dot(ds.astype(C.matmul_dtype(k)), k)  # [bq, Hp]

  dq = _visit(counts_ref, entries_ref, jnp.zeros(dq_ref.shape, jnp.float32), step,
              affine=_affine(plan, False))
  dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _shared_bias_gradient(plan: C.Plan, aux, x: _Inputs, do, lse, delta, dtype):
  """The gradient of a bias shared over the batch, heads and / or queries, summed over them in
  its own kernel (``[Bb, Nb, T | 1, S]``, never a ``[B, N, T, S]`` buffer); also that of a bias
  with every dim after the Hopper backward (one pair per block)."""
  rows = plan.bias_shape[2] > 1
  entries, counts, union = C.bias_gradient_tables(plan, aux, pad_width_to_pow2=True)
  d = _dbias_call(plan, entries.shape[-1], x.hp, x.vp, union)(
      x.q, x.k, x.v, do, lse, delta, entries, counts, x.iscal, x.fscal, *x.segs, *x.dense)
  if rows:  # blocks no batch row visits were never written
    return C.bias_gradient(plan, aux, d, dtype)
  return d[:, :, None, :plan.kv_len].astype(dtype)  # [Bb, Nb, 1, S] column sums, all written


@functools.lru_cache(maxsize=128)
def _dbias_call(plan: C.Plan, width: int, hp: int, vp: int, union: bool):
  """The kernel of a shared bias' gradient (``[Bb, Nb, Tb, S]``, ``Bb`` in {1, B}, ``Nb`` in
  {1, N}, ``Tb`` in {1, T}).  With a row per query, one program per ``(query block, Bb, Nb)``
  walks its row of the forward table (per batch row when ``Bb = B``, else their
  ``batch_union``) and, per key block, sums ``ds`` over the ``R = (B / Bb) (N / Nb)`` (batch
  row, head) pairs sharing it in fp32 registers before writing that ``[bq, bk]`` block (bias
  dtype) once.  One row for all queries: one program per ``(key block, Bb, Nb)`` over the
  transposed table (dK/dV tiling), summing the column sums of every query block's and pair's
  ``ds`` into one fp32 row of ``bk``.  q / k / v / dO, the lse / delta rows and the dense inputs
  are read whole and indexed per pair in the kernel.  Deterministic; two of the dQ kernel's three
  matmuls per block and pair again.
  """
  rows = plan.bias_shape[2] > 1
  bq, bk = (plan.block_q, plan.block_k) if rows else (plan.block_q_dkv, plan.block_k_dkv)
  n_b, n_n = plan.bias_shape[0], plan.bias_shape[1]
  nr = (plan.batch // n_b) * (plan.num_heads // n_n)
  tb = (lambda bb: 0) if union or not plan.per_batch_tables else (lambda bb: bb)  # noqa: E731
  whole = lambda x: pl.BlockSpec(x, lambda *_: (0,) * len(x))  # noqa: E731
  b, tp, sp, n, kh = plan.batch, plan.q_pad, plan.kv_pad, plan.num_heads, plan.num_kv_heads
  iscal_len, fscal_len = _scalar_lens(plan)
  in_specs = [whole((b, tp, n, hp)), whole((b, sp, kh, hp)), whole((b, sp, kh, vp)),
              whole((b, tp, n, vp)), whole((b, n, tp)), whole((b, n, tp)),
              pl.BlockSpec((None, None, width), lambda r, bb, nb: (tb(bb), r, 0)),  # entries
              pl.BlockSpec((None, None, 2), lambda r, bb, nb: (tb(bb), r, 0)),  # counts
              whole((iscal_len,)), whole((fscal_len,))]
  if plan.has_segments:
    in_specs += [whole((b, tp)), whole((b, sp))]
  in_specs += [whole((*shape[:2], tp if shape[2] > 1 else 1, sp))
               for shape in (plan.bias_shape, plan.mask_shape) if shape is not None]
  if rows:
    grid = (tp // bq, n_b, n_n)
    out_shape = jax.ShapeDtypeStruct((n_b, n_n, tp, sp), jnp.dtype(plan.bias_dtype))
    out_specs = pl.BlockSpec((None, None, bq, sp), lambda i, bb, nb: (bb, nb, i, 0))
  else:
    grid = (sp // bk, n_b, n_n)
    out_shape = jax.ShapeDtypeStruct((n_b, n_n, sp), jnp.float32)
    out_specs = pl.BlockSpec((None, None, bk), lambda j, bb, nb: (bb, nb, j))
  return pl.pallas_call(
      functools.partial(_dbias_kernel, plan=plan, rows=rows, nr=nr, bq=bq, bk=bk),
      grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=_compiler_params(plan, hp),
      interpret=plan.interpret, name="jaxattn_flash_dbias_gpu")


def _dbias_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, entries_ref, counts_ref,
                  iscal_ref, fscal_ref, *refs, plan, rows, nr, bq, bk):
  qseg_ref = kvseg_ref = None
  if plan.has_segments:
    qseg_ref, kvseg_ref, *refs = refs
  bias_ref, mask_ref, (out_ref,) = C.dense_refs(plan, refs)
  blk, bb, nb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  n_b, n_n = plan.bias_shape[0], plan.bias_shape[1]
  rn = plan.num_heads // n_n

  def pair_ds(r, i, j, masked):
    """``ds [bq, bk]`` (fp32, before the soft-cap) of block (i, j) for the r-th (batch row,
    head) pair of this program's bias block."""
    b = bb + _div(r, rn) if n_b == 1 else bb
    n = nb + lax.rem(r, rn) if n_n == 1 else nb
    q_offset, scale, slope, kv_length = _scalars(plan, iscal_ref, fscal_ref, b, n)
    qs, ks = pl.multiple_of(i * bq, bq), pl.multiple_of(j * bk, bk)
    kvh = _div(n, plan.groups)
    q, do = q_ref[b, pl.ds(qs, bq), n, :], do_ref[b, pl.ds(qs, bq), n, :]
    k, v = k_ref[b, pl.ds(ks, bk), kvh, :], v_ref[b, pl.ds(ks, bk), kvh, :]
    s = plgpu.dot(q, k, trans_b=True)  # [bq, bk]
    q_idx = qs + jnp.arange(bq, dtype=jnp.int32)[:, None]
    kv_idx = ks + jnp.arange(bk, dtype=jnp.int32)[None, :]
    where = {}
    if masked and plan.has_segments:
      where = dict(q_seg=qseg_ref[b, pl.ds(qs, bq)][:, None],
                   kv_seg=kvseg_ref[b, pl.ds(ks, bk)][None, :])

    def tile(ref, shape):  # this pair's [bq, bk] block of a dense input (or of its one row)
      db, dn = (b if shape[0] > 1 else 0), (n if shape[1] > 1 else 0)
      return ref[db, dn, pl.ds(qs, bq) if shape[2] > 1 else pl.ds(0, 1), pl.ds(ks, bk)]

    if bias_ref is not None:
      where["bias"] = tile(bias_ref, plan.bias_shape)
    if mask_ref is not None and masked:
      where["allowed_tile"] = tile(mask_ref, plan.mask_shape)
    lse = lse_ref[b, n, pl.ds(qs, bq)][:, None]
    delta = delta_ref[b, n, pl.ds(qs, bq)][:, None]
    s, p = _probs(plan, scale, slope)(s, lse, q_idx=q_idx, kv_idx=kv_idx, q_offset=q_offset,
                                      masked=masked, kv_length=kv_length, **where)
    dp = plgpu.dot(do, v, trans_b=True)  # [bq, bk]
    return C.soft_cap_grad(p * (dp - delta), s, plan)

  def summed(i, j, masked):
    return lax.fori_loop(0, nr, lambda r, acc: acc + pair_ds(r, i, j, masked),
                         jnp.zeros((bq, bk), jnp.float32))

  if rows:  # blocks of this query block's row: each summed over the pairs, then written
    def step(j, carry, masked):
      out_ref[:, pl.ds(pl.multiple_of(j * bk, bk), bk)] = summed(blk, j, masked).astype(
          out_ref.dtype)
      return carry

    _visit(counts_ref, entries_ref, 0, step)
  else:  # this key block's column sums over every query block listed for it
    def step(i, acc, masked):
      return acc + jnp.sum(summed(i, blk, masked), axis=0)

    out_ref[...] = _visit(counts_ref, entries_ref, jnp.zeros((bk,), jnp.float32), step)


@functools.lru_cache(maxsize=128)
def _dkv_call(plan: C.Plan, width: int, hp: int, vp: int, atomic_dq: bool = False):
  bk, g = plan.block_k_dkv, plan.groups
  nk = plan.kv_pad // bk
  q_all = lambda j, b, n: (b, 0, n, 0)  # noqa: E731
  kv_blk = lambda j, b, n: (b, j, _div(n, g), 0)  # noqa: E731
  in_specs = [
      pl.BlockSpec((None, plan.q_pad, None, hp), q_all),  # q (all rows of head n)
      pl.BlockSpec((None, bk, None, hp), kv_blk),  # k tile
      pl.BlockSpec((None, bk, None, vp), kv_blk),  # v tile
      pl.BlockSpec((None, plan.q_pad, None, vp), q_all),  # do
      pl.BlockSpec((None, None, plan.q_pad), lambda j, b, n: (b, n, 0)),  # lse
      pl.BlockSpec((None, None, plan.q_pad), lambda j, b, n: (b, n, 0)),  # delta
  ] + _common_specs(plan, width, *_scalar_lens(plan), transpose=True)
  out = lambda j, b, n: (b, j, n, 0)  # noqa: E731
  out_shape = [
      jax.ShapeDtypeStruct((plan.batch, plan.kv_pad, plan.num_heads, hp), jnp.float32),
      jax.ShapeDtypeStruct((plan.batch, plan.kv_pad, plan.num_heads, vp), jnp.float32),
  ]
  out_specs = [pl.BlockSpec((None, bk, None, hp), out), pl.BlockSpec((None, bk, None, vp), out)]
  aliases = {}
  if atomic_dq:  # every program of head n adds into all of dQ[b, :, n]: the whole column block
    dq_spec = pl.BlockSpec((None, plan.q_pad, None, hp), q_all)
    in_specs.append(dq_spec)
    out_specs.append(dq_spec)
    out_shape.append(jax.ShapeDtypeStruct((plan.batch, plan.q_pad, plan.num_heads, hp),
                                          jnp.float32))
    aliases = {len(in_specs) - 1: 2}
  return pl.pallas_call(
      functools.partial(_dkv_kernel, plan=plan, atomic_dq=atomic_dq),
      grid=(nk, plan.batch, plan.num_heads),
      in_specs=in_specs, out_specs=out_specs, out_shape=out_shape, input_output_aliases=aliases,
      compiler_params=_compiler_params(plan, hp),
      interpret=plan.interpret, name="jaxattn_flash_dkv_gpu")


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, entries_ref, counts_ref,
                iscal_ref, fscal_ref, *refs, plan, atomic_dq=False):
  if plan.has_segments:
    qseg_ref, kvseg_ref, *refs = refs
  bias_ref, mask_ref, refs = C.dense_refs(plan, refs)
  if atomic_dq:
    _, dk_ref, dv_ref, dq_ref = refs  # the aliased input is the output dq_ref
  else:
    dk_ref, dv_ref = refs
  j, b, n = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  bq, bk = plan.block_q_dkv, plan.block_k_dkv
  q_offset, scale, slope, kv_length = _scalars(plan, iscal_ref, fscal_ref, b, n)
  k, v = k_ref[...], v_ref[...]  # [bk, Hp], [bk, hp], resident for the whole loop
  kv_idx = j * bk + jnp.arange(bk, dtype=jnp.int32)[:, None]  # [bk, 1]
  kv_seg = kvseg_ref[...][:, None] if plan.has_segments else None
  prob = _probs(plan, scale, slope)

  def step(i, carry, masked):
    dk, dv = carry
    start = pl.multiple_of(i * bq, bq)
    q = q_ref[pl.ds(start, bq), :]  # [bq, Hp]
    do = do_ref[pl.ds(start, bq), :]  # [bq, hp]
    s = plgpu.dot(k, q, trans_b=True)  # [bk, bq] = s^T
    q_idx = start + jnp.arange(bq, dtype=jnp.int32)[None, :]
    segs = {}
    if masked and plan.has_segments:
      segs = dict(kv_seg=kv_seg, q_seg=qseg_ref[pl.ds(start, bq)][None, :])
    # [bq, bk] rows of the bias / mask (or their one row), transposed to s^T's orientation
    rows = lambda ref: (ref[...] if ref.shape[0] == 1  # noqa: E731
                        else ref[pl.ds(start, bq), :])
    if bias_ref is not None:
      segs["bias"] = rows(bias_ref).astype(jnp.float32).T
    if mask_ref is not None and masked:
      segs["allowed_tile"] = rows(mask_ref).astype(jnp.int32).T
    s, p = prob(s, lse_ref[pl.ds(start, bq)][None, :], q_idx=q_idx, kv_idx=kv_idx,
                q_offset=q_offset, masked=masked, kv_length=kv_length, **segs)  # p^T
    dv = dv + plgpu.dot(p.astype(C.matmul_dtype(do)), do)  # [bk, hp]
    dp = plgpu.dot(v, do, trans_b=True)  # [bk, bq] = dp^T
    ds = C.soft_cap_grad(p * (dp - delta_ref[pl.ds(start, bq)][None, :]), s, plan)
    ds_mm = ds.astype(C.matmul_dtype(q))
    if atomic_dq:  # dQ rows of this query block += ds k  (ds is ds^T here: [bk, bq])
      plgpu.atomic_add(dq_ref, (pl.ds(start, bq), slice(None)),
                       plgpu.dot(ds_mm, k, trans_a=True))
    return dk + plgpu.dot(ds_mm, q), dv  # [bk, Hp]

  init = (jnp.zeros(dk_ref.shape, jnp.float32), jnp.zeros(dv_ref.shape, jnp.float32))
  dk, dv = _visit(counts_ref, entries_ref, init, step, affine=_affine(plan, True))
  dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


__all__ = ["flash_attention"]
