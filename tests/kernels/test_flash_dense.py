"""A dense additive bias and a dense boolean mask array in the flash-attention kernels (TPU and
Triton GPU, interpreted on CPU).

The bias ``[B|1, N|1, T|1, S|1]`` (a T5 relative bias, a user bias) is streamed in blocks beside
the keys and differentiated by the kernels' own backward pass (its gradient is the dQ kernel's
``ds``).  The mask array (True = attend, the shape of ``jax.nn.dot_product_attention``'s ``mask``)
is streamed as int8 blocks, and the block tables skip the blocks it empties for every head of a
batch row.  Every case compares the output, the log-sum-exp and the gradients of a non-linear
loss with respect to query, key, value (and the bias) with ``dot_product_attention(...,
implementation="xla")``, which materializes the logits.  Shapes are ragged (T and S not multiples
of the blocks), so padded rows / keys of the dense inputs are exercised.

Tolerances as in ``test_flash_tpu.py``: fp32 summation order (2e-5 outputs, 1e-4 gradients);
bf16 inputs against the fp32 formula on the same inputs, 2e-2 / 3e-2.
"""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jaxattn import sharding
from jaxattn.ops import masks as M
from jaxattn.ops.attention import dot_product_attention
from pallas_kernels.flash_attention import BlockSizes, flash_attention_gpu, flash_attention_tpu
from pallas_kernels.flash_attention.sharded import plan_specs

ON_GPU = jax.default_backend() in ("gpu", "cuda", "rocm")
FAST_COMPILE = {} if ON_GPU else {"xla_backend_optimization_level": 0,
                                  "xla_llvm_disable_expensive_passes": True}
TPU_BLOCKS = BlockSizes(block_q=16, block_k=16, block_q_dkv=8, block_k_dkv=8)
GPU_BLOCKS = BlockSizes(block_q=16, block_k=16, block_q_dkv=16, block_k_dkv=16)
F32_TOL, F32_GRAD_TOL = (2e-3, 5e-3) if ON_GPU else (2e-5, 1e-4)  # TF32 on GPU hardware


# The GPU entry point on its Triton kernels, which take the dense inputs (the Hopper kernels pass
# such calls to them anyway; conftest.py's fixture).
pytestmark = pytest.mark.usefixtures("triton_kernels")


def run(f, *args):
  return jax.jit(f).lower(*args).compile(compiler_options=FAST_COMPILE)(*args)


def assert_close(got, want, tol, name):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  scale = max(1.0, float(np.max(np.abs(want[np.isfinite(want)]), initial=0.0)))
  np.testing.assert_allclose(got, want, rtol=0, atol=tol * scale, err_msg=name)


def assert_results(got, want, tol=F32_TOL, grad_tol=F32_GRAD_TOL):
  """``(out, lse, grads)`` against the formula's: values, and -inf log-sum-exps in the same rows."""
  (out, lse, grads), (r_out, r_lse, r_grads) = got, want
  assert_close(out, r_out, tol, "out")
  np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(r_lse))
  assert_close(jnp.where(jnp.isfinite(lse), lse, 0), jnp.where(jnp.isfinite(r_lse), r_lse, 0),
               tol, "lse")
  for g, rg, label in zip(grads, r_grads, ("dq", "dk", "dv", "dbias")):
    assert_close(g, rg, grad_tol, label)


def make_inputs(b, t, s, n, kh, h, bias_shape, dtype=jnp.float32, seed=0):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (b, t, n, h), jnp.float32).astype(dtype)
  k = jax.random.normal(ks[1], (b, s, kh, h), jnp.float32).astype(dtype)
  v = jax.random.normal(ks[2], (b, s, kh, h), jnp.float32).astype(dtype)
  bias = 2.0 * jax.random.normal(ks[3], bias_shape, jnp.float32)
  return q, k, v, bias.astype(dtype)


def loss_and_grads(attn, q, k, v, bias):
  """Value, (out, lse) and gradients (q, k, v, bias) of ``sum(out cos out) + 0.1 sum(lse)``."""

  def loss(q, k, v, bias):
    out, lse = attn(q, k, v, bias)
    o = out.astype(jnp.float32)
    return jnp.sum(o * jnp.cos(o)) + 0.1 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)), (
        out, lse)

  (_, (out, lse)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(
      q, k, v, bias)
  return out, lse, grads


def kernel(backend, mask, **kw):
  fn, blocks = {"tpu": (flash_attention_tpu, TPU_BLOCKS), "gpu": (flash_attention_gpu,
                                                                   GPU_BLOCKS)}[backend]
  return lambda q, k, v, bias: fn(q, k, v, mask, bias=bias, return_residuals=True,
                                  block_sizes=blocks, interpret=None if ON_GPU else True, **kw)


def reference(ref_kw):
  def attn(q, k, v, bias):
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    return dot_product_attention(f32(q), f32(k), f32(v), None if bias is None else f32(bias),
                                 implementation="xla", return_residuals=True, **ref_kw)
  return attn


def segment_ids(b, length):
  cuts = np.array([[length // 3, length // 2], [5, length - 7]])[:b]
  return jnp.asarray((np.arange(length)[None, :, None] >= cuts[:, None, :]).sum(-1), jnp.int32)


# name -> (B T S N K H, bias shape, reference keyword arguments)
CASES = {
    # A full per-row, per-head bias under a causal mask and a soft-cap (bias before the cap).
    "full_causal_softcap": ((2, 40, 33, 4, 2, 16), (2, 4, 40, 33),
                            {"is_causal": True, "logits_soft_cap": 3.0}),
    # A T5-style bias shared by the batch, with ALiBi, packed segments and key lengths (one row
    # with no valid key: zeros, and a zero bias gradient there).
    "shared_batch_segments_alibi": ((2, 24, 24, 2, 1, 16), (1, 2, 24, 24),
                                    {"segments": True, "alibi": True, "kv_lengths": (19, 0)}),
    # A per-key bias (padding-style, [B, 1, 1, S]) broadcast over heads and queries, with a window
    # and nothing else (the GPU kernel's base-2 logits must scale the bias too).
    "per_key_window": ((2, 36, 36, 4, 4, 16), (2, 1, 1, 36), {"local_window_size": (9, 4)}),
    # One bias for everything ([1, 1, T, S]) against a query offset (decode-like chunk).
    "shared_offset_causal": ((1, 8, 40, 2, 2, 16), (1, 1, 8, 40), {"is_causal": True,
                                                                   "q_offset": 30}),
}


def reference_kwargs(kw, b, t, n):
  """The formula's keyword arguments of a case: ``alibi`` / ``segments`` flags made arrays."""
  kw = dict(kw)
  ref_kw = {}
  if kw.pop("alibi", False):
    ref_kw["alibi_slopes"] = jnp.asarray(0.5 ** np.arange(1, n + 1), jnp.float32)
  if kw.pop("segments", False):
    ref_kw["segment_ids"] = segment_ids(b, t)
  if "kv_lengths" in kw:
    ref_kw["kv_lengths"] = jnp.asarray(kw.pop("kv_lengths"), jnp.int32)
  return {**ref_kw, **kw}


def build(name, dtype=jnp.float32):
  (b, t, s, n, kh, h), bias_shape, kw = CASES[name]
  q, k, v, bias = make_inputs(b, t, s, n, kh, h, bias_shape, dtype)
  ref_kw = reference_kwargs(kw, b, t, n)
  mask = M.make_mask(is_causal=ref_kw.get("is_causal", False),
                     local_window_size=ref_kw.get("local_window_size"),
                     segment_ids=ref_kw.get("segment_ids"), kv_lengths=ref_kw.get("kv_lengths"))
  kern_kw = {k_: ref_kw[k_] for k_ in ("alibi_slopes", "logits_soft_cap", "q_offset")
             if k_ in ref_kw}
  return (q, k, v, bias), ref_kw, mask, kern_kw


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
@pytest.mark.parametrize("name", list(CASES))
def test_bias_forward_and_gradients_match_formula(backend, name):
  args, ref_kw, mask, kern_kw = build(name)
  out, lse, grads = run(lambda *a: loss_and_grads(kernel(backend, mask, **kern_kw), *a), *args)
  r_out, r_lse, r_grads = run(lambda *a: loss_and_grads(reference(ref_kw), *a), *args)
  assert grads[3].shape == args[3].shape and grads[3].dtype == args[3].dtype
  assert_results((out, lse, grads), (r_out, r_lse, r_grads))
  # The bias gradient is not trivially small: the test would see a missing or misplaced one.
  assert float(jnp.abs(r_grads[3]).max()) > 0.05
  if name == "shared_batch_segments_alibi":  # row 1 sees no key: zeros, never NaN
    np.testing.assert_array_equal(np.asarray(out[1]), 0.0)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
@pytest.mark.parametrize("name", ["full_causal_softcap", "shared_batch_segments_alibi",
                                  "per_key_window"])
def test_bias_bf16(backend, name):
  """bf16 inputs and bias: a full bias (its gradient the dQ kernel's ds), one shared over the
  batch and one per key (their gradients summed by their own kernel, written in bf16)."""
  args, ref_kw, mask, kern_kw = build(name, jnp.bfloat16)
  out, lse, grads = run(lambda *a: loss_and_grads(kernel(backend, mask, **kern_kw), *a), *args)
  assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
  r_out, r_lse, r_grads = run(lambda *a: loss_and_grads(reference(ref_kw), *a), *args)
  assert_close(out, r_out, 2e-2, "out")
  assert_close(lse, r_lse, 1e-3, "lse")
  for g, rg, label in zip(grads, r_grads, ("dq", "dk", "dv", "dbias")):
    assert_close(g, rg, 3e-2, label)


def _pallas_calls(jaxpr) -> list[tuple[str, list[tuple], list[tuple]]]:
  """``(kernel name, operand shapes, output shapes)`` of every ``pallas_call`` in a (nested)
  jaxpr."""
  found = []

  def walk(jx):
    for eqn in jx.eqns:
      if eqn.primitive.name == "pallas_call":
        found.append((str(eqn.params.get("name")), [tuple(x.aval.shape) for x in eqn.invars],
                      [tuple(x.aval.shape) for x in eqn.outvars]))
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        walk(sub)

  walk(jaxpr.jaxpr)
  return found


def _dq_kernel_outputs(jaxpr, kernel="flash_dq") -> list[int]:
  """Numbers of outputs of the dQ ``pallas_call``s (or another ``kernel``'s) in a (nested)
  jaxpr."""
  return [len(outs) for name, _, outs in _pallas_calls(jaxpr) if kernel in name]


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_a_constant_bias_costs_no_gradient_write(backend):
  """The bias gradient (a ``[B, N, T, S]`` fp32 write) is produced only when the bias is being
  differentiated: a constant bias (a mask written as -inf / 0, a frozen T5 table) gets none."""
  args, _, mask, kern_kw = build("full_causal_softcap")
  attn = kernel(backend, mask, **kern_kw)
  loss = lambda q, k, v, bias: jnp.sum(attn(q, k, v, bias)[0] ** 2)  # noqa: E731
  const = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(*args)
  learned = jax.make_jaxpr(jax.grad(loss, argnums=(0, 3)))(*args)
  assert _dq_kernel_outputs(const) == [1]  # dQ only
  assert _dq_kernel_outputs(learned) == [2]  # dQ and the ds blocks


def test_dispatcher_sends_a_bias_to_the_kernels():
  """``dot_product_attention(..., bias, implementation="pallas_tpu" | "pallas_gpu")`` runs the
  kernel (it used to refuse a dense bias)."""
  args, ref_kw, _, _ = build("shared_offset_causal")
  q, k, v, bias = args
  want = dot_product_attention(q, k, v, bias, implementation="xla", is_causal=True, q_offset=30)
  for impl in ("pallas_tpu", "pallas_gpu"):
    got = dot_product_attention(q, k, v, bias, implementation=impl, is_causal=True, q_offset=30)
    assert_close(got, want, F32_TOL, impl)


def test_bias_errors_name_the_argument():
  q, k, v, _ = make_inputs(1, 8, 8, 2, 2, 8, (1, 1, 1, 1))
  with pytest.raises(ValueError, match=r"`bias` must have shape \[B\|1, N\|1, T\|1, S\|1\]"):
    flash_attention_tpu(q, k, v, bias=jnp.zeros((1, 3, 8, 8)), interpret=True)
  with pytest.raises(ValueError, match=r"`bias` must have shape"):
    flash_attention_gpu(q, k, v, bias=jnp.zeros((2, 8, 8)), interpret=True)
  with pytest.raises(ValueError, match="`bias` must be floating point"):
    flash_attention_tpu(q, k, v, bias=jnp.zeros((1, 2, 8, 8), jnp.int32), interpret=True)


def test_sharded_bias_matches_formula():
  """Under the simulated 8-device mesh (batch over `data`, heads over `tensor`): a per-row bias
  is split with batch and heads, a batch-shared one replicated over `data` (its gradient summed
  over the batch shards by ``shard_map``'s transpose); the mask arrays likewise."""
  mesh = sharding.make_mesh({"data": 2, "tensor": 4})
  b, t, n, kh, h = 2, 24, 8, 4, 16
  for bias_shape, mask_shape in (((b, n, t, t), (1, n, t, t)), ((1, n, t, t), (b, 1, 1, t))):
    q, k, v, bias = make_inputs(b, t, t, n, kh, h, bias_shape, seed=5)
    allowed = random_mask(mask_shape, seed=6, density=0.7)
    attn = lambda q, k, v, bias: flash_attention_tpu(  # noqa: E731
        q, k, v, M.CausalMask(), bias=bias, mask_array=allowed, return_residuals=True,
        block_sizes=GPU_BLOCKS, interpret=True)
    with jax.set_mesh(mesh):
      assert plan_specs(mesh, b, n, kh) == ("data", "tensor")
      jaxpr = str(jax.make_jaxpr(lambda *a: loss_and_grads(attn, *a))(q, k, v, bias))
      assert "shard_map" in jaxpr
      out, lse, grads = run(lambda *a: loss_and_grads(attn, *a), q, k, v, bias)
    r_out, _, r_grads = run(
        lambda *a: loss_and_grads(reference({"is_causal": True, "mask": allowed}), *a),
        q, k, v, bias)
    assert_close(out, r_out, 2e-5, f"out {bias_shape}")
    for g, rg, label in zip(grads, r_grads, ("dq", "dk", "dv", "dbias")):
      assert_close(g, rg, 1e-4, f"{label} {bias_shape}")


def test_dispatcher_with_alibi_leaves_a_constant_bias_out_of_the_backward():
  """With ALiBi slopes the dispatcher wraps the kernel in its own custom VJP (for the slopes'
  gradient); a bias that is not being differentiated still costs no gradient write there."""
  args, _, _, _ = build("shared_offset_causal")
  slopes = jnp.asarray([0.5, 0.25], jnp.float32)

  def loss(q, k, v, bias):
    out = dot_product_attention(q, k, v, bias, implementation="pallas_tpu", is_causal=True,
                                q_offset=30, alibi_slopes=slopes)
    return jnp.sum(out ** 2)

  const = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(*args)
  learned = jax.make_jaxpr(jax.grad(loss, argnums=(0, 3)))(*args)
  assert _dq_kernel_outputs(const) == [1] and _dq_kernel_outputs(const, "flash_dbias") == []
  # the bias [1, 1, T, S] is shared over the heads: its gradient has its own kernel
  assert _dq_kernel_outputs(learned) == [1]
  assert _dq_kernel_outputs(learned, "flash_dbias") == [1]
  got = jax.grad(loss, argnums=(0, 3))(*args)
  want = jax.grad(lambda q, k, v, b: jnp.sum(dot_product_attention(
      q, k, v, b, implementation="xla", is_causal=True, q_offset=30,
      alibi_slopes=slopes) ** 2), argnums=(0, 3))(*args)
  for g, w, label in zip(got, want, ("dq", "dbias")):
    assert_close(g, w, F32_GRAD_TOL, label)


def test_bias_kernels_are_race_free(race_states):
  """TPU-semantics interpreter with race detection: forward, dQ (writing the bias' gradient
  blocks) and dK/dV (reading transposed bias and mask blocks), with the bias shared over the
  batch and a mask array per row."""
  pltpu = pytest.importorskip("jax.experimental.pallas.tpu")
  q, k, v, bias = make_inputs(2, 16, 16, 2, 1, 8, (1, 2, 16, 16), seed=2)
  allowed = random_mask((2, 1, 16, 16), seed=3, density=0.8)
  params = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)

  def loss(q, k, v, bias):
    out = flash_attention_tpu(q, k, v, M.CausalMask(), bias=bias, mask_array=allowed,
                              block_sizes=BlockSizes(8, 8, 8, 8), interpret=params)
    return jnp.sum(out * jnp.sin(out))

  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, bias)
  jax.block_until_ready(grads)
  # forward, dQ, dK/dV and the shared bias' gradient (summing the batch in VMEM)
  assert len(race_states) >= 4, "expected the four kernels to be interpreted"
  assert not any(st_.races_found for st_ in race_states)
  r_grads = jax.grad(lambda *a: jnp.sum((o := dot_product_attention(
      *a, mask=allowed, is_causal=True, implementation="xla")) * jnp.sin(o)),
      argnums=(0, 1, 2, 3))(q, k, v, bias)
  for g, rg, label in zip(grads, r_grads, ("dq", "dk", "dv", "dbias")):
    assert_close(g, rg, 1e-4, label)


def _pallas_shapes(jaxpr) -> dict[str, list[list[tuple]]]:
  """Kernel name -> [operand shapes, output shapes] of the ``pallas_call``s in a jaxpr."""
  return {name: [ins, outs] for name, ins, outs in _pallas_calls(jaxpr)}


# bias shape -> how the TPU backward differentiates it
SHARED_BIASES = {
    "T5 [1, N, T, S]": (1, 4, 36, 40),  # summed over the batch (union tables: lengths differ)
    "heads [B, 1, T, S]": (2, 1, 36, 40),  # summed over the heads, per-row tables
    "both [1, 1, T, S]": (1, 1, 36, 40),  # summed over batch x heads (r = b * N + n)
    "per key [1, N, 1, S]": (1, 4, 1, 40),  # column sums over queries and batch
    "per row and key [B, 1, 1, S]": (2, 1, 1, 40),  # column sums over queries and heads
}


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
@pytest.mark.parametrize("name", list(SHARED_BIASES))
def test_shared_bias_gradient_is_summed_in_its_kernel(backend, name):
  """A bias shared over the batch, heads or queries gets its gradient from its own kernel, which
  sums the ``ds`` blocks of every (batch row, head) sharing an output block (in VMEM on TPU, in
  registers on GPU): no ``[B, N, T, S]`` buffer is written (the dQ kernel writes only dQ), and
  the gradient equals the formula's.  Ragged T / S, GQA, causal with a query offset and key
  lengths that differ per row (row 0 leaves blocks empty that row 1 fills: the batch-summing
  tables list a block any row visits, and evaluate its masks per element)."""
  b, t, s, n, kh, h = 2, 36, 40, 4, 2, 16
  q, k, v, bias = make_inputs(b, t, s, n, kh, h, SHARED_BIASES[name], seed=11)
  lens = jnp.asarray([13, 40], jnp.int32)
  attn = kernel(backend, M.make_mask(is_causal=True, kv_lengths=lens), q_offset=4)
  ref = reference({"is_causal": True, "kv_lengths": lens, "q_offset": 4})
  got = run(lambda *a: loss_and_grads(attn, *a), q, k, v, bias)
  want = run(lambda *a: loss_and_grads(ref, *a), q, k, v, bias)
  assert_results(got, want)
  assert float(jnp.abs(want[2][3]).max()) > 0.05
  shapes = _pallas_shapes(jax.make_jaxpr(
      lambda *a: loss_and_grads(attn, *a)[2])(q, k, v, bias))
  suffix = "_gpu" if backend == "gpu" else ""
  dq_ins, dq_outs = shapes["jaxattn_flash_dq" + suffix]
  _, db_outs = shapes["jaxattn_flash_dbias" + suffix]
  assert len(dq_outs) == 1  # dQ only
  tp, sp = -(-t // 16) * 16, -(-s // 16) * 16  # padded to the test's 16-row blocks
  # one output block per shared block: [Bb, Nb, Tp, Sp], or one column sum per key (TPU: as a
  # lane-wide column)
  if bias.shape[2] > 1:
    assert db_outs == [(*bias.shape[:2], tp, sp)]
  else:
    assert db_outs == [(*bias.shape[:2], sp) if backend == "gpu" else (*bias.shape[:2], sp, 128)]
  for shape in [*dq_ins, *dq_outs]:
    assert len(shape) != 4 or shape[-2:] != (tp, sp) or shape[:2] != (b, n), shape


def test_shared_bias_atomic_option_matches_formula():
  """The Triton dQ kernel's other way for a bias shared over the batch (``shared_bias=
  "atomic"``: its ds added up over the batch with atomic adds into one zeroed [1, N, T, S]
  buffer): the same gradient, and no shared-bias kernel."""
  from pallas_kernels.flash_attention import gpu as gpu_kernel  # noqa: PLC0415
  gpu_kernel.set_options(shared_bias="atomic")  # restored by the triton_kernels fixture
  args, ref_kw, mask, kern_kw = build("shared_batch_segments_alibi")
  attn = kernel("gpu", mask, **kern_kw)
  got = run(lambda *a: loss_and_grads(attn, *a), *args)
  assert_results(got, run(lambda *a: loss_and_grads(reference(ref_kw), *a), *args))
  shapes = _pallas_shapes(jax.make_jaxpr(lambda *a: loss_and_grads(attn, *a)[2])(*args))
  assert "jaxattn_flash_dbias_gpu" not in shapes
  assert shapes["jaxattn_flash_dq_gpu"][1][1] == (1, 2, 32, 32)  # [1, N, Tp, Sp]


# ----------------------------------------------------------------------------------------------
# Boolean mask arrays
# ----------------------------------------------------------------------------------------------


def random_mask(shape, seed, density=0.6):
  return jax.random.uniform(jax.random.key(seed), shape) < density


# name -> (B T S N K H, mask-array shape, reference keyword arguments, with a bias too)
MASK_CASES = {
    # Per row and head, under a causal mask and a soft-cap (the mask after the cap); row 5 of
    # batch 1 sees no key (zeros, -inf lse), and query block 0 x key block 1 of batch 0 is empty
    # for every head (skipped by the tables).
    "full_causal_softcap": ((2, 40, 33, 4, 2, 16), (2, 4, 40, 33),
                            {"is_causal": True, "logits_soft_cap": 3.0}, False),
    # Shared over the batch, with packed segments, ALiBi and a learned bias beside it.
    "shared_segments_alibi_bias": ((2, 24, 24, 2, 1, 16), (1, 2, 24, 24),
                                   {"segments": True, "alibi": True}, True),
    # A key-padding mask as Hugging Face models build it ([B, 1, 1, S]), GQA, no position mask.
    "key_padding_gqa": ((2, 36, 36, 4, 2, 16), (2, 1, 1, 36), {}, False),
}


def without_bias(*fns):
  """``(a stand-in bias, *fns)`` for a case without one: each ``fn(q, k, v, bias)`` called with
  None; the loss still differentiates the stand-in (its gradient is zero on both sides)."""
  return (jnp.zeros((1, 1, 1, 1)),
          *[lambda q, k, v, b, fn=fn: fn(q, k, v, None) for fn in fns])


def build_masked(name):
  (b, t, s, n, kh, h), mshape, kw, with_bias = MASK_CASES[name]
  q, k, v, bias = make_inputs(b, t, s, n, kh, h, (1, n, t, s), seed=7)
  allowed = random_mask(mshape, seed=8)
  if name == "full_causal_softcap":
    allowed = allowed.at[1, :, 5].set(False).at[0, :, :16, 16:32].set(False)
  ref_kw = reference_kwargs(kw, b, t, n)
  mask = M.make_mask(is_causal=ref_kw.get("is_causal", False),
                     segment_ids=ref_kw.get("segment_ids"))
  kern_kw = {k_: ref_kw[k_] for k_ in ("alibi_slopes", "logits_soft_cap") if k_ in ref_kw}
  return (q, k, v, bias if with_bias else None), allowed, ref_kw, mask, kern_kw


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
@pytest.mark.parametrize("name", list(MASK_CASES))
def test_mask_array_forward_and_gradients_match_formula(backend, name):
  (q, k, v, bias), allowed, ref_kw, mask, kern_kw = build_masked(name)
  attn = kernel(backend, mask, mask_array=allowed, **kern_kw)
  ref = reference({**ref_kw, "mask": allowed})
  if bias is None:
    bias, attn, ref = without_bias(attn, ref)
  out, lse, grads = run(lambda *a: loss_and_grads(attn, *a), q, k, v, bias)
  r_out, r_lse, r_grads = run(lambda *a: loss_and_grads(ref, *a), q, k, v, bias)
  assert_results((out, lse, grads), (r_out, r_lse, r_grads))
  if name == "full_causal_softcap":
    assert not np.isnan(np.asarray(out)).any()
    np.testing.assert_array_equal(np.asarray(out[1, 5]), 0.0)
    assert np.all(np.asarray(lse[1, :, 5]) == -np.inf)


def test_mask_array_prunes_the_block_tables():
  """A block-diagonal mask array (two 16-row blocks) lists only the diagonal blocks, FULL (no
  mask evaluation), in both tilings; a block with some allowed pairs is PARTIAL; the tables are
  per batch row and take the union over heads."""
  from pallas_kernels.flash_attention import common  # noqa: PLC0415
  t = 32
  diag = np.kron(np.eye(2, dtype=bool), np.ones((16, 16), bool))
  allowed = np.stack([diag, diag]).reshape(2, 1, t, t)
  allowed[1, 0, 3, 20] = True  # row 1: one pair in query block 0 x key block 1
  allowed = jnp.asarray(allowed)
  q = jnp.zeros((2, t, 2, 8))
  plan = common.make_plan(q, q, q, static_mask=None, q_offset=0, logits_soft_cap=None,
                          alibi_slopes=None, segment_ids=None, kv_lengths=None,
                          block_sizes=BlockSizes(16, 16, 16, 16), interpret=True,
                          mask_array=allowed)
  assert plan.per_batch_tables
  for transpose in (False, True):
    entries, counts = common.block_tables(plan, mask_array=allowed, transpose=transpose)
    counts, cols = np.asarray(counts), np.asarray(entries) >> common.KIND_BITS
    np.testing.assert_array_equal(counts[0], [[1, 0], [1, 0]])  # (FULL, PARTIAL) per row
    np.testing.assert_array_equal(cols[0, :, 0], [0, 1])
    # row 1: the extra pair makes (query block 0, key block 1) PARTIAL, listed after the FULL
    # diagonal block of query block 0's row (forward) or of key block 1's row (dK/dV)
    np.testing.assert_array_equal(counts[1], [[1, 0], [1, 1]] if transpose else [[1, 1], [1, 0]])


def test_mask_array_errors_name_the_argument():
  q, k, v, _ = make_inputs(1, 8, 8, 2, 2, 8, (1, 1, 1, 1))
  with pytest.raises(ValueError, match=r"`mask_array` must have shape \[B\|1, N\|1, T\|1, S\|1\]"):
    flash_attention_tpu(q, k, v, mask_array=jnp.ones((1, 3, 8, 8), bool), interpret=True)
  with pytest.raises(ValueError, match="`mask_array` must be boolean"):
    flash_attention_gpu(q, k, v, mask_array=jnp.ones((1, 2, 8, 8), jnp.int32), interpret=True)


@settings(max_examples=4, deadline=None, derandomize=True)
@given(t=st.integers(1, 40), s=st.integers(1, 40), groups=st.sampled_from([1, 2]),
       bias_dims=st.sampled_from([None, (1, 1), (1, 0), (0, 1), (0, 0)]),
       mask_dims=st.sampled_from([None, (1, 1, 1), (0, 1, 1), (1, 0, 0)]),
       causal=st.booleans())
def test_dense_inputs_random_shapes(t, s, groups, bias_dims, mask_dims, causal):
  """Random lengths (8-row blocks: ragged everywhere), GQA groups, which dims of the bias / mask
  array are full (1) or broadcast (0): forward and gradients (the bias' too) on the TPU kernel
  against the formula."""
  b, kh = 2, 1
  n = kh * groups
  q, k, v, _ = make_inputs(b, t, s, n, kh, 8, (1, 1, 1, 1), seed=t * 41 + s)
  bias = allowed = None
  if bias_dims is not None:
    shape = (b if bias_dims[0] else 1, n if bias_dims[1] else 1, t, s)
    bias = jax.random.normal(jax.random.key(s), shape)
  if mask_dims is not None:
    shape = (b if mask_dims[0] else 1, n if mask_dims[1] else 1, t if mask_dims[2] else 1, s)
    allowed = random_mask(shape, seed=t + s, density=0.7)
  mask = M.CausalMask() if causal else None
  q_offset = max(0, s - t) if causal else 0

  def ours(q, k, v, bias):
    return flash_attention_tpu(q, k, v, mask, bias=bias, mask_array=allowed, q_offset=q_offset,
                               return_residuals=True, block_sizes=BlockSizes(8, 8, 8, 8),
                               interpret=True)

  def ref(q, k, v, bias):
    return dot_product_attention(q, k, v, bias, allowed, is_causal=causal, q_offset=q_offset,
                                 return_residuals=True, implementation="xla")

  if bias is None:
    bias, ours, ref = without_bias(ours, ref)
  out, lse, grads = run(lambda *a: loss_and_grads(ours, *a), q, k, v, bias)
  r_out, r_lse, r_grads = run(lambda *a: loss_and_grads(ref, *a), q, k, v, bias)
  assert_close(out, r_out, 2e-5, "out")
  np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(r_lse))
  for g, rg, label in zip(grads, r_grads, ("dq", "dk", "dv", "dbias")):
    assert_close(g, rg, 1e-4, label)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_one_row_inputs_are_read_not_broadcast(backend):
  """A key-padding mask ``[B, 1, 1, S]`` and a per-key bias ``[1, N, 1, S]`` reach every kernel
  (forward, dQ, dK/dV) as they are, one row per key block (the GPU entry takes the mask as
  segment ids, ``key_mask_as_segments``): the ``[B, N|1, T, S]`` arrays they stand for are never
  built."""
  b, t, s, n = 2, 40, 36, 4
  q, k, v, bias = make_inputs(b, t, s, n, 2, 16, (1, n, 1, s))
  allowed = random_mask((b, 1, 1, s), seed=1)
  attn = kernel(backend, M.CausalMask(), mask_array=allowed)
  # (the bias constant: a learned one adds its gradient's buffer, [B|1, N, T, S] by design)
  jaxpr = jax.make_jaxpr(jax.grad(lambda q, bias: jnp.sum(attn(q, k, v, bias)[0] ** 2)))(q, bias)
  shapes = {name: ins for name, (ins, _) in _pallas_shapes(jaxpr).items()}
  assert len(shapes) == 3, shapes  # forward, dQ, dK/dV
  for name, operands in shapes.items():
    dense = [x for x in operands if len(x) == 4 and x[2] == 1 and x[0] in (1, b)
             and x[1] in (1, n)]
    if backend == "tpu":
      assert len(dense) == 2, (name, operands)  # the bias' row and the mask's row
    else:  # the bias' row; the key-padding mask became segment ids ([B, Tp] and [B, Sp])
      assert len(dense) == 1, (name, operands)
      assert sum(len(x) == 2 and x[0] == b for x in operands) == 2, (name, operands)
    # no [.., T, S] operand (the lse / delta rows, lane-replicated to 128, are [B, N, Tp, 128])
    assert not [x for x in operands if len(x) == 4 and x[2] >= t and s <= x[3] < 128], (
        name, operands)


@pytest.mark.parametrize("bias_rows, shared_bias", [
    ((1, 1024), "kernel"), ((1, 1024), "atomic"), ((2, 1024), "kernel"), ((1, 1), "kernel")],
    ids=["shared bias (its own kernel)", "shared bias (atomic ds)", "per-row bias",
         "one-row shared bias (column sums)"])
def test_dense_inputs_lower_to_triton(bias_rows, shared_bias, cuda_target):
  """The Triton kernels with a learned bias and a key-padding mask array lower to Triton IR for
  CUDA at a production size (compiling the IR needs a GPU).  A bias shared over the batch gets
  its gradient from its own kernel ([1, N, T, S] out, the dQ kernel writes dQ only) or, with
  ``shared_bias="atomic"``, from the dQ kernel's atomic adds into one [1, N, T, S] buffer; a
  per-row bias from the dQ kernel's ds ([B, N, T, S]); a one-row bias [1, N, 1, S] as column
  sums ([1, N, S])."""
  from pallas_kernels.flash_attention import gpu as gpu_kernel  # noqa: PLC0415
  gpu_kernel.set_options(shared_bias=shared_bias)  # restored by the triton_kernels fixture
  b, t, n, kh, h = 2, 1024, 8, 2, 128
  bias_batch, bias_t = bias_rows
  q = jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((b, t, kh, h), jnp.bfloat16)
  bias = jax.ShapeDtypeStruct((bias_batch, n, bias_t, t), jnp.bfloat16)
  allowed = jax.ShapeDtypeStruct((b, 1, 1, t), jnp.bool_)

  def grads(q, k, v, bias, allowed):
    def loss(q, k, v, bias):
      out = flash_attention_gpu(q, k, v, M.CausalMask(), bias=bias, mask_array=allowed,
                                interpret=False)
      return jnp.sum(out.astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, bias)

  traced = jax.jit(grads).trace(q, k, k, bias, allowed)
  text = traced.lower(lowering_platforms=("cuda",)).as_text()
  own_kernel = bias_batch == 1 and shared_bias == "kernel"
  names = ["jaxattn_flash_fwd_gpu", "jaxattn_flash_dq_gpu", "jaxattn_flash_dkv_gpu"]
  for name in names + (["jaxattn_flash_dbias_gpu"] if own_kernel else []):
    assert name in text
  assert ("jaxattn_flash_dbias_gpu" in text) == own_kernel
  outputs = _pallas_shapes(traced.jaxpr)
  dq_outs = outputs["jaxattn_flash_dq_gpu"][1]
  if own_kernel:
    assert len(dq_outs) == 1
    want = (1, n, t, t) if bias_t > 1 else (1, n, t)
    assert outputs["jaxattn_flash_dbias_gpu"][1] == [want]
  else:
    assert dq_outs[1] == (bias_batch, n, t, t)
