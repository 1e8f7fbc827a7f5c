"""The GPU (Triton) flash-attention kernel, in interpret mode on CPU, against the attention formula.

Without a GPU these tests run the kernels' Pallas programs in interpret mode and check that they
lower to Triton IR; on a GPU machine (``experiments/device_check.sh``) the same tests run the
compiled kernels (``interpret=None`` picks the hardware when present).

Tolerances: as in ``test_flash_tpu.py`` (fp32: summation order only; bf16: bf16 probabilities in
the ``p @ v`` matmul and bf16 outputs).  On GPU hardware fp32 matmuls may run in TF32, so the fp32
tolerance is widened there.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.ops import masks as M
from jaxattn.ops.attention import dot_product_attention
from pallas_kernels.flash_attention import BlockSizes, flash_attention_gpu
from pallas_kernels.flash_attention import common as C
from pallas_kernels.flash_attention import gpu as gpu_kernel

ON_GPU = jax.default_backend() in ("gpu", "cuda", "rocm")
FAST_COMPILE = {} if ON_GPU else {"xla_backend_optimization_level": 0,
                                  "xla_llvm_disable_expensive_passes": True}
SMALL = BlockSizes(block_q=16, block_k=16, block_q_dkv=16, block_k_dkv=16)
F32_TOL = 2e-3 if ON_GPU else 2e-5  # TF32 tensor-core matmuls on hardware
F32_GRAD_TOL = 5e-3 if ON_GPU else 1e-4


# These tests are the Triton kernels' (conftest.py's fixture).
pytestmark = pytest.mark.usefixtures("triton_kernels")


def run(f, *args):
  return jax.jit(f).lower(*args).compile(compiler_options=FAST_COMPILE)(*args)


def inputs(b, t, s, n, k, h, hv, dtype=jnp.float32, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(ks[0], (b, t, n, h), jnp.float32).astype(dtype)
  key = jax.random.normal(ks[1], (b, s, k, h), jnp.float32).astype(dtype)
  v = jax.random.normal(ks[2], (b, s, k, hv), jnp.float32).astype(dtype)
  return q, key, v


def assert_close(got, want, tol, name):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  scale = max(1.0, float(np.max(np.abs(want[np.isfinite(want)]), initial=0.0)))
  np.testing.assert_allclose(got, want, rtol=0, atol=tol * scale, err_msg=name)


def loss_and_grads(attn, q, k, v):
  def loss(q, k, v):
    out, lse = attn(q, k, v)
    o = out.astype(jnp.float32)
    lse_term = 0.1 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))
    return jnp.sum(o * jnp.cos(o)) + lse_term, (out, lse)

  (_, (out, lse)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
  return out, lse, grads


def segment_ids(b, length):
  cuts = np.array([[length // 3, length // 2], [5, length - 7]])[:b]
  return jnp.asarray((np.arange(length)[None, :, None] >= cuts[:, None, :]).sum(-1), jnp.int32)


# name -> (shape B T S N K H h, reference keyword arguments)
CASES = {
    # GQA, ragged T and S, value head size 24 (padded to a 32-wide tile inside).
    "causal_gqa_ragged": ((2, 40, 33, 4, 2, 16, 24), {"is_causal": True}),
    "window_segments_alibi_mqa": ((2, 48, 48, 2, 1, 16, 16),
                                  {"local_window_size": (10, 6), "segments": True, "alibi": True}),
    # Batch row 1 has no valid key: zeros and lse -inf, never NaN.
    "padding_softcap_offset": ((2, 24, 40, 2, 2, 16, 16),
                               {"kv_lengths": (29, 0), "logits_soft_cap": 3.0, "is_causal": True,
                                "q_offset": 16}),
    # One query (the rest of its block padding) against 200 keys, ALiBi without causality: slope
    # 0.5 x a distance past 176 exceeds 88, where the padded rows' p overflowed (NaN in dK / dV).
    "alibi_one_query_far_keys": ((1, 1, 200, 2, 2, 16, 16), {"alibi": True}),
}


def build(shape, kw, dtype=jnp.float32):
  b, t, s, n, k, h, hv = shape
  q, key, v = inputs(b, t, s, n, k, h, hv, dtype)
  kw = dict(kw)
  if kw.pop("alibi", False):
    kw["alibi_slopes"] = jnp.asarray(0.5 ** np.arange(1, n + 1), jnp.float32)
  if kw.pop("segments", False):
    kw["segment_ids"] = segment_ids(b, t)
  if "kv_lengths" in kw:
    kw["kv_lengths"] = jnp.asarray(kw["kv_lengths"], jnp.int32)
  return (q, key, v), kw


def kernel_fn(kw, block_sizes=SMALL):
  mask = M.make_mask(is_causal=kw.get("is_causal", False),
                     local_window_size=kw.get("local_window_size"),
                     segment_ids=kw.get("segment_ids"), kv_lengths=kw.get("kv_lengths"))

  def attn(q, k, v):
    return flash_attention_gpu(q, k, v, mask, alibi_slopes=kw.get("alibi_slopes"),
                               logits_soft_cap=kw.get("logits_soft_cap"),
                               q_offset=kw.get("q_offset", 0), return_residuals=True,
                               block_sizes=block_sizes)
  return attn


def reference_fn(kw):
  def attn(q, k, v):
    return dot_product_attention(q.astype(jnp.float32), k.astype(jnp.float32),
                                 v.astype(jnp.float32), implementation="xla", return_residuals=True,
                                 **kw)
  return attn


@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_gradients_match_formula(name):
  (q, k, v), kw = build(*CASES[name])
  out, lse, grads = run(lambda q, k, v: loss_and_grads(kernel_fn(kw), q, k, v), q, k, v)
  r_out, r_lse, r_grads = run(lambda q, k, v: loss_and_grads(reference_fn(kw), q, k, v), q, k, v)
  assert not np.isnan(np.asarray(out)).any()
  assert_close(out, r_out, F32_TOL, "out")
  np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(r_lse))
  assert_close(jnp.where(jnp.isfinite(lse), lse, 0), jnp.where(jnp.isfinite(r_lse), r_lse, 0),
               F32_TOL, "lse")
  for g, rg, label in zip(grads, r_grads, ("dq", "dk", "dv")):
    assert_close(g, rg, F32_GRAD_TOL, label)
  if name == "padding_softcap_offset":
    np.testing.assert_array_equal(np.asarray(out[1]), 0.0)
    np.testing.assert_array_equal(np.asarray(grads[0][1]), 0.0)


def test_bf16_causal_gqa():
  (q, k, v), kw = build((1, 48, 40, 4, 2, 16, 16), {"is_causal": True}, jnp.bfloat16)
  out, lse, grads = run(lambda q, k, v: loss_and_grads(kernel_fn(kw), q, k, v), q, k, v)
  assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
  r_out, r_lse, r_grads = run(lambda q, k, v: loss_and_grads(reference_fn(kw), q, k, v), q, k, v)
  assert_close(out, r_out, 2e-2, "out")
  assert_close(lse, r_lse, 1e-3, "lse")
  for g, rg, label in zip(grads, r_grads, ("dq", "dk", "dv")):
    assert_close(g, rg, 3e-2, label)


def test_dispatcher_uses_the_kernel():
  (q, k, v), kw = build((2, 32, 32, 4, 2, 16, 16), {"is_causal": True, "segments": True})
  out = run(lambda q, k, v: dot_product_attention(q, k, v, implementation="pallas_gpu", **kw),
            q, k, v)
  want = run(lambda q, k, v: dot_product_attention(q, k, v, implementation="xla", **kw), q, k, v)
  assert_close(out, want, F32_TOL, "out")


def test_lowers_to_triton(cuda_target):
  """All three kernels lower to Triton IR for CUDA at production sizes (bf16, causal, GQA,
  segments, ALiBi, soft-cap, ragged lengths); compiling that IR needs a GPU."""
  b, t, n, kh, h = 2, 1000, 8, 2, 128
  q = jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((b, t, kh, h), jnp.bfloat16)
  ids = jax.ShapeDtypeStruct((b, t), jnp.int32)
  slopes = jax.ShapeDtypeStruct((n,), jnp.float32)

  def grads(q, k, v, ids, slopes):
    mask = M.CausalMask() & M.SegmentMask(ids, ids)

    def loss(q, k, v):
      out = flash_attention_gpu(q, k, v, mask, alibi_slopes=slopes, logits_soft_cap=30.0,
                                interpret=False)
      return jnp.sum(out.astype(jnp.float32))

    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  text = jax.jit(grads).trace(q, k, k, ids, slopes).lower(lowering_platforms=("cuda",)).as_text()
  kernels = ["jaxattn_flash_fwd_gpu", "jaxattn_flash_dkv_gpu"]
  if gpu_kernel.get_options()["dq"] == "kernel":
    kernels.append("jaxattn_flash_dq_gpu")
  else:
    assert "jaxattn_flash_dq_gpu" not in text
  for name in kernels:
    assert name in text


def test_block_sizes_must_be_triton_tiles():
  q, k, v = inputs(1, 16, 16, 2, 2, 16, 16)
  with pytest.raises(ValueError, match="power of two"):
    flash_attention_gpu(q, k, v, block_sizes=BlockSizes(48, 16, 48, 16))
  with pytest.raises(ValueError, match="num_warps"):
    BlockSizes(16, 16, 16, 16, num_warps=3)


@pytest.fixture(params=[{"exp": "exp2", "affine": True, "reverse": True, "dq": "atomic"},
                        {"exp": "ex2asm", "affine": False, "reverse": False, "dq": "kernel"}],
                ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def codegen_options(request):
  saved = gpu_kernel.get_options()
  gpu_kernel.set_options(**request.param)
  yield request.param
  gpu_kernel.set_options(**saved)


@pytest.mark.parametrize("name", ["causal_gqa_ragged", "padding_softcap_offset"])
def test_codegen_switches_keep_results(codegen_options, name):
  """Base-2 softmax and affine block addressing (``gpu.set_options``) give the formula's results;
  the causal case has an affine table, the padded one does not (per-batch lengths)."""
  (q, k, v), kw = build(*CASES[name])
  out, lse, grads = run(lambda q, k, v: loss_and_grads(kernel_fn(kw), q, k, v), q, k, v)
  r_out, r_lse, r_grads = run(lambda q, k, v: loss_and_grads(reference_fn(kw), q, k, v), q, k, v)
  assert_close(out, r_out, F32_TOL, "out")
  assert_close(jnp.where(jnp.isfinite(lse), lse, 0), jnp.where(jnp.isfinite(r_lse), r_lse, 0),
               F32_TOL, "lse")
  for g, rg, label in zip(grads, r_grads, ("dq", "dk", "dv")):
    assert_close(g, rg, F32_GRAD_TOL, label)


def test_codegen_switches_lower_to_triton(codegen_options, cuda_target):
  test_lowers_to_triton(cuda_target)


def test_affine_tables_detected():
  def plan(mask, length=100):
    q = jax.ShapeDtypeStruct((1, length, 2, 16), jnp.float32)
    return C.make_plan(q, q, q, static_mask=mask, q_offset=0, logits_soft_cap=None,
                       alibi_slopes=None, segment_ids=None, kv_lengths=None, block_sizes=SMALL,
                       interpret=True)

  saved = gpu_kernel.get_options()
  try:
    gpu_kernel.set_options(affine=True)
    assert gpu_kernel._affine(plan(M.CausalMask()), False)
    assert gpu_kernel._affine(plan(M.CausalMask()), True)
    assert gpu_kernel._affine(plan(None), False)  # the ragged last key block is PARTIAL
    assert not gpu_kernel._affine(plan(None, 96), False)  # all FULL: table loads (faster)
    # A window whose band leaves FULL blocks between two PARTIAL edges: not one ascending run.
    assert not gpu_kernel._affine(plan(M.SlidingWindowMask(60, 0)), False)
    gpu_kernel.set_options(affine=False)
    assert not gpu_kernel._affine(plan(M.CausalMask()), False)
  finally:
    gpu_kernel.set_options(**saved)
  with pytest.raises(ValueError, match="unknown option"):
    gpu_kernel.set_options(fast=True)

