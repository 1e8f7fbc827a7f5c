"""The Hopper (Mosaic GPU) flash-attention kernels (forward; dQ and dK/dV) against the formula.

Without a GPU the kernel runs in Mosaic GPU's interpreter: the three warpgroups as threads, TMA
copies, mbarriers (every phase must be observed) and shared memory simulated, with race detection
on in one test.  The interpreter's ``wgmma`` takes neither a transposed nor a register operand, so
interpreted, the kernel's two matmuls are plain dots on the same shared-memory tiles (everything
else -- the producer's ring of slots, the barrier hand-offs, ping-pong turns, the skip / masked /
full runs, the online softmax, the TMA stores -- is the hardware program).  The hardware program is
lowered for CUDA here (``jax.export``, Mosaic GPU's lowering) and run by ``device_check.sh`` on a
Hopper GPU, where these tests run it compiled.

Tolerances (bf16 / fp16 inputs): bf16 probabilities in ``p @ v`` and a 16-bit output.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.ops import masks as M
from jaxattn.ops.attention import dot_product_attention
from pallas_kernels.flash_attention import common as C
from pallas_kernels.flash_attention import flash_attention_gpu, hopper
from pallas_kernels.flash_attention import gpu as gpu_kernel

ON_GPU = jax.default_backend() in ("gpu", "cuda")
TOL = 2e-2


def interpret(detect_races=False):
  if ON_GPU:
    return None
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # noqa: PLC0415
  return InterpretGPUParams(detect_races=detect_races)


def inputs(b, t, s, n, k, h, dtype=jnp.bfloat16, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(ks[0], (b, t, n, h), jnp.float32).astype(dtype)
  key = jax.random.normal(ks[1], (b, s, k, h), jnp.float32).astype(dtype)
  v = jax.random.normal(ks[2], (b, s, k, h), jnp.float32).astype(dtype)
  return q, key, v


def formula(q, k, v, mask, q_offset, cap):
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  return dot_product_attention(f32(q), f32(k), f32(v), mask=mask, q_offset=q_offset,
                               logits_soft_cap=cap, implementation="xla", return_residuals=True)


def assert_close(got, want, tol, name):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  scale = max(1.0, float(np.max(np.abs(want[np.isfinite(want)]), initial=0.0)))
  np.testing.assert_allclose(got, want, rtol=0, atol=tol * scale, err_msg=name)


CASES = [
    # name, (b, t, s, n, k, h), mask, q_offset, cap, dtype, config
    ("full gqa exact blocks", (1, 128, 128, 2, 1, 64), None, 0, None, jnp.bfloat16,
     hopper.Config(block_k=64)),
    ("causal ragged offset fp16", (1, 200, 300, 2, 2, 64), M.CausalMask(), 100, None,
     jnp.float16, hopper.Config(block_k=64)),
    ("window softcap ragged", (1, 130, 260, 2, 1, 64), M.SlidingWindowMask(50, 10), 90, 30.0,
     jnp.bfloat16, hopper.Config(block_k=64, stages=3)),
    ("two-sided window no pingpong", (1, 192, 192, 1, 1, 64), M.SlidingWindowMask(20, 20), 0,
     None, jnp.bfloat16, hopper.Config(block_k=64, pingpong=False)),
    ("causal 128-key steps", (1, 256, 256, 1, 1, 64), M.CausalMask(), 0, None, jnp.bfloat16,
     hopper.Config(block_k=128)),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_forward_matches_formula(case):
  name, (b, t, s, n, k, h), mask, q_offset, cap, dtype, config = case
  q, key, v = inputs(b, t, s, n, k, h, dtype)
  out, lse = hopper.forward(q, key, v, mask=mask, q_offset=q_offset, logits_soft_cap=cap,
                            config=config, interpret=interpret())
  want_out, want_lse = formula(q, key, v, mask, q_offset, cap)
  assert out.shape == (b, t, n, h) and out.dtype == dtype
  assert lse.shape == (b, n, t) and lse.dtype == jnp.float32
  assert_close(out, want_out, TOL, name + " out")
  assert_close(lse, want_lse, 1e-2, name + " lse")


BWD_CASES = [
    # name, (b, t, s, n, k, h), mask, q_offset, cap, dtype, config
    ("causal gqa ragged", (1, 150, 150, 2, 1, 64), M.CausalMask(), 0, None, jnp.bfloat16,
     hopper.Config(block_k=64)),
    ("window softcap offset", (1, 130, 200, 2, 1, 64), M.SlidingWindowMask(50, 10), 60, 30.0,
     jnp.bfloat16, hopper.Config(block_k=64, stages=3)),
    ("full mha fp16 no pingpong", (1, 128, 128, 2, 2, 64), None, 0, None, jnp.float16,
     hopper.Config(block_k=64, pingpong=False)),
]


@pytest.mark.parametrize("case", BWD_CASES, ids=[c[0] for c in BWD_CASES])
def test_backward_matches_formula(case):
  """dQ, dK, dV (GQA groups summed in the kernel) from the kernel's own forward, with a cotangent
  on the log-sum-exp too, against the formula's VJP."""
  name, (b, t, s, n, k, h), mask, q_offset, cap, dtype, config = case
  q, key, v = inputs(b, t, s, n, k, h, dtype)
  ks = jax.random.split(jax.random.key(9), 2)
  d_out = jax.random.normal(ks[0], (b, t, n, h), jnp.float32).astype(dtype)
  d_lse = 0.3 * jax.random.normal(ks[1], (b, n, t), jnp.float32)
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  (_, lse_ref), vjp = jax.vjp(lambda q, k, v: formula(q, k, v, mask, q_offset, cap),
                              f32(q), f32(key), f32(v))
  want = vjp((f32(d_out), jnp.where(jnp.isfinite(lse_ref), d_lse, 0.0)))
  out, lse = hopper.forward(q, key, v, mask=mask, q_offset=q_offset, logits_soft_cap=cap,
                            config=config, interpret=interpret())
  got = hopper.backward(q, key, v, out, lse, d_out, d_lse, mask=mask, q_offset=q_offset,
                        logits_soft_cap=cap, config=config, interpret=interpret())
  for g, w, x, grad in zip(got, want, (q, key, v), ("dq", "dk", "dv")):
    assert g.shape == x.shape and g.dtype == x.dtype, grad
    assert_close(g, w, TOL, f"{name} {grad}")


def test_rows_without_keys_and_races():
  """A negative offset under a causal mask leaves the first rows with no key: output 0 and
  ``lse = -inf``; whole key blocks before the band are skipped by one consumer, not the other.
  Race detection over the producer / consumer hand-offs finds nothing."""
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks  # noqa: PLC0415

  q, key, v = inputs(1, 128, 128, 1, 1, 64, jnp.bfloat16, seed=3)
  mask = M.CausalMask() & M.SlidingWindowMask(40, 0)
  out, lse = hopper.forward(q, key, v, mask=mask, q_offset=-70, config=hopper.Config(block_k=64),
                            interpret=interpret(detect_races=True))
  if not ON_GPU:
    assert not gpu_callbacks.get_races().races_found
  want_out, want_lse = formula(q, key, v, mask, -70, None)
  assert np.all(np.asarray(out[:, :70], np.float32) == 0.0)
  assert np.all(np.isneginf(np.asarray(lse[:, :, :70])))
  assert_close(out, want_out, TOL, "out")
  assert_close(lse[:, :, 70:], want_lse[:, :, 70:], 1e-2, "lse")


@pytest.mark.parametrize("forward,backward", [("hopper", "triton"), ("triton", "hopper"),
                                              ("hopper", "hopper")])
def test_through_gpu_entry_point_with_gradients(forward, backward):
  """``gpu.set_options(forward=..., backward=...)``: ``flash_attention_gpu`` runs the Hopper
  forward (counted) with the Triton backward on its log-sum-exp, and the Hopper backward on either
  forward's; values and gradients match the formula."""
  q, key, v = inputs(1, 150, 150, 2, 1, 64, jnp.bfloat16, seed=1)
  mask = M.CausalMask()
  calls = {"forward": 0, "backward": 0}
  real = {name: getattr(hopper, name) for name in calls}

  def counting(name):
    def f(*a, **kw):
      calls[name] += 1
      return real[name](*a, **kw)
    return f

  saved = gpu_kernel.get_options()
  try:
    gpu_kernel.set_options(forward=forward, backward=backward, hopper=hopper.Config(block_k=64))
    for name in calls:
      setattr(hopper, name, counting(name))

    def loss(f):
      def g(q, k, v):
        out = f(q, k, v)
        o = out.astype(jnp.float32)
        return jnp.sum(o * jnp.cos(o)), out
      return jax.value_and_grad(g, argnums=(0, 1, 2), has_aux=True)

    (_, out), grads = loss(lambda q, k, v: flash_attention_gpu(q, k, v, mask))(q, key, v)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    (_, want), want_grads = loss(lambda q, k, v: dot_product_attention(
        f32(q), f32(k), f32(v), mask=mask, implementation="xla"))(q, key, v)
  finally:
    for name in calls:
      setattr(hopper, name, real[name])
    gpu_kernel.set_options(**saved)
  for name, option in (("forward", forward), ("backward", backward)):
    assert (calls[name] > 0) == (option == "hopper"), (name, calls)
  assert_close(out, want, TOL, "out")
  for g, w, name in zip(grads, want_grads, ("dq", "dk", "dv")):
    assert_close(g, w, 3e-2, name)


def _plan(**kw):
  q, key, v = inputs(1, 64, 64, 2, 1, 64, kw.pop("dtype", jnp.bfloat16))
  args = dict(static_mask=M.CausalMask(), q_offset=0, logits_soft_cap=None, alibi_slopes=None,
              segment_ids=None, kv_lengths=None, block_sizes=C.BlockSizes.gpu(),
              interpret=not ON_GPU, pow2_blocks=True, scale=0.125)
  args.update(kw)
  return C.make_plan(q, key, v, **args)


def test_dispatch_reasons():
  """What stays on the Triton forward, and why (the reasons name the feature)."""
  saved = gpu_kernel.get_options()
  try:
    assert gpu_kernel.hopper_reason(_plan()) == "option forward='triton'"
    gpu_kernel.set_options(forward="hopper")
    assert gpu_kernel.hopper_reason(_plan()) is None
    assert "dtype float32" in gpu_kernel.hopper_reason(_plan(dtype=jnp.float32))
    assert "traced scale" in gpu_kernel.hopper_reason(_plan(scale=None))
    assert "ALiBi" in gpu_kernel.hopper_reason(_plan(alibi_slopes=jnp.ones((2,))))
    assert "GlobalTokensMask" in gpu_kernel.hopper_reason(
        _plan(static_mask=M.GlobalTokensMask((0,))))
    assert gpu_kernel.hopper_reason(_plan(), "backward") == "option backward='triton'"
    gpu_kernel.set_options(backward="hopper")
    assert gpu_kernel.hopper_reason(_plan(), "backward") is None
    q, key, v = inputs(1, 64, 64, 2, 1, 256)
    wide = C.make_plan(q, key, v, static_mask=None, q_offset=0, logits_soft_cap=None,
                       alibi_slopes=None, segment_ids=None, kv_lengths=None,
                       block_sizes=C.BlockSizes.gpu(), interpret=not ON_GPU, pow2_blocks=True,
                       scale=0.1)
    assert gpu_kernel.hopper_reason(wide) is None
    assert "head size 256" in gpu_kernel.hopper_reason(wide, "backward")
  finally:
    gpu_kernel.set_options(**saved)


def test_shared_memory_limit_and_defaults():
  assert hopper.default_config(128).block_k == 128
  assert hopper.default_config(256).block_k == 64
  for h in (64, 128, 256):
    assert hopper.smem_bytes(h, hopper.default_config(h)) <= 227 * 1024
  reason = hopper.supports(dtype=jnp.bfloat16, head_dim=256, v_head_dim=256, static_mask=None,
                           static_q_offset=0, has_alibi=False, has_segments=False,
                           has_lengths=False, config=hopper.Config(block_k=128, stages=3))
  assert "shared memory" in reason


def test_errors():
  with pytest.raises(ValueError, match="block_q"):
    hopper.Config(block_q=128)
  with pytest.raises(ValueError, match="block_k"):
    hopper.Config(block_k=96)
  with pytest.raises(ValueError, match="stages"):
    hopper.Config(stages=1)
  q, key, v = inputs(1, 64, 64, 2, 1, 64, jnp.float32)
  with pytest.raises(ValueError, match="dtype float32"):
    hopper.forward(q, key, v)
  q, key, v = inputs(1, 64, 64, 2, 1, 96)
  with pytest.raises(ValueError, match="head sizes 96"):
    hopper.forward(q, key, v)
  q, key, v = inputs(1, 64, 64, 3, 2, 64)
  with pytest.raises(ValueError, match="multiple of key heads"):
    hopper.forward(q, key, v)
  with pytest.raises(ValueError, match="allowed"):
    gpu_kernel.set_options(forward="cuda")
  with pytest.raises(ValueError, match="hopper.Config"):
    gpu_kernel.set_options(hopper={"block_k": 64})


@pytest.mark.parametrize("h,mask,cap,pingpong", [
    (64, None, None, True), (128, M.CausalMask(), None, True),
    (128, M.SlidingWindowMask(256, 0), 30.0, False), (256, M.CausalMask(), None, True)])
def test_lowers_for_cuda(h, mask, cap, pingpong):
  """The hardware program (wgmma from shared memory and registers, layouts, TMA, barriers) goes
  through Mosaic GPU's lowering to one custom call, for every head size and both schedules."""
  q = jax.ShapeDtypeStruct((2, 1000, 4, h), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((2, 1000, 2, h), jnp.bfloat16)
  cfg = hopper.Config(block_k=hopper.default_config(h).block_k, pingpong=pingpong)
  f = lambda q, k, v: hopper.forward(q, k, v, mask=mask, logits_soft_cap=cap,  # noqa: E731
                                     config=cfg)
  text = jax.export.export(jax.jit(f), platforms=("cuda",))(q, k, k).mlir_module()
  assert re.findall(r"custom_call @(mosaic_gpu\w*)", text)
  if h > 128:
    return
  lse = jax.ShapeDtypeStruct((2, 4, 1000), jnp.float32)
  g = lambda q, k, v, o, lse, do: hopper.backward(  # noqa: E731
      q, k, v, o, lse, do, mask=mask, logits_soft_cap=cap, config=cfg)
  text = jax.export.export(jax.jit(g), platforms=("cuda",))(q, k, k, q, lse, q).mlir_module()
  assert len(re.findall(r"custom_call @(mosaic_gpu\w*)", text)) == 2  # dQ, dK/dV
