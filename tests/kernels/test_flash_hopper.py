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
from hypothesis import given, settings, strategies as st

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


def formula(q, k, v, mask, q_offset, cap, slopes=None):
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  return dot_product_attention(f32(q), f32(k), f32(v), mask=mask, q_offset=q_offset,
                               logits_soft_cap=cap, alibi_slopes=slopes, implementation="xla",
                               return_residuals=True)


# Interpreted, these kernels are the suite's most expensive tests.  Each case in SLOW repeats
# features a cheaper case of the same test already covers (named beside it): marked `slow`, it
# is out of the default run (`pytest -m slow` runs it) and runs compiled in device_check.sh.
SLOW = {
    "causal ragged offset fp16",      # offsets / ragged: "window softcap ragged"; fp16: data cases
    "causal gqa ragged",              # GQA + ragged backward: "window softcap offset"
    "packed causal gqa",              # segments + GQA: "scattered ids ..."; packed: "packed l.."
    "lengths window alibi softcap",   # lengths / ALiBi: "scattered ids ..."; window + cap: CASES
    "lengths",                        # backward lengths / ALiBi: "packed" (all three features)
}


def params(cases, ids=None):
  ids = ids or [c[0] for c in cases]
  return [pytest.param(c, id=i, marks=[pytest.mark.slow] if i in SLOW else [])
          for c, i in zip(cases, ids)]


def residual_loss(f):
  """``value_and_grad`` over ``(q, k, v)`` of ``sum(o cos o)`` for ``f(q, k, v) -> (out, lse)``,
  with ``(out, lse)`` as its aux."""
  def g(q, k, v):
    out, lse = f(q, k, v)
    o = out.astype(jnp.float32)
    return jnp.sum(o * jnp.cos(o)), (out, lse)
  return jax.value_and_grad(g, argnums=(0, 1, 2), has_aux=True)


def assert_close(got, want, tol, name):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  scale = max(1.0, float(np.max(np.abs(want[np.isfinite(want)]), initial=0.0)))
  np.testing.assert_allclose(got, want, rtol=0, atol=tol * scale, err_msg=name)


CASES = [
    # name, (b, t, s, n, k, h), mask, q_offset, cap, dtype, config
    ("full gqa exact blocks", (1, 128, 128, 2, 1, 64), None, 0, None, jnp.bfloat16,
     hopper.Config(block_k=64, pingpong=True)),
    ("causal ragged offset fp16", (1, 200, 300, 2, 2, 64), M.CausalMask(), 100, None,
     jnp.float16, hopper.Config(block_k=64, pingpong=True)),
    ("window softcap ragged", (1, 130, 260, 2, 1, 64), M.SlidingWindowMask(50, 10), 90, 30.0,
     jnp.bfloat16, hopper.Config(block_k=64, stages=3, pingpong=True)),
    ("two-sided window no pingpong", (1, 192, 192, 1, 1, 64), M.SlidingWindowMask(20, 20), 0,
     None, jnp.bfloat16, hopper.Config(block_k=64, pingpong=False)),
    ("causal 128-key steps", (1, 256, 256, 1, 1, 64), M.CausalMask(), 0, None, jnp.bfloat16,
     hopper.Config(block_k=128, pingpong=True)),
    # the overlapped schedule: each step finishes the previous block (first / step / last)
    ("window softcap ragged overlap", (1, 130, 260, 2, 1, 64), M.SlidingWindowMask(50, 10), 90,
     30.0, jnp.bfloat16, hopper.Config(block_k=64, stages=3, overlap=True)),
    ("causal 128-key steps overlap pingpong fp16", (1, 256, 256, 1, 1, 64), M.CausalMask(), 0,
     None, jnp.float16, hopper.Config(block_k=128, overlap=True, pingpong=True)),
    ("causal 192-key steps overlap offset", (1, 200, 330, 2, 1, 64), M.CausalMask(), 130,
     None, jnp.bfloat16, hopper.Config(block_k=192, overlap=True)),
    # persistent CTAs: two when interpreted, each walking four of the eight tiles (two query
    # tiles x two heads x two batch rows) with one K/V ring across them
    ("causal gqa persistent", (2, 200, 200, 2, 1, 64), M.CausalMask(), 0, None, jnp.bfloat16,
     hopper.Config(block_k=64, persistent=True)),
    ("window softcap offset persistent overlap pingpong", (2, 130, 260, 2, 1, 64),
     M.SlidingWindowMask(50, 10), 90, 30.0, jnp.bfloat16,
     hopper.Config(block_k=64, stages=3, overlap=True, pingpong=True, persistent=True)),
]


@pytest.mark.parametrize("case", params(CASES))
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


@pytest.mark.parametrize("h,hv,config", [
    (192, 128, None), (192, 128, hopper.Config(block_k=64, overlap=True)),
    (64, 128, hopper.Config(block_k=64))], ids=["192-128 default", "192-128 overlap", "64-128"])
def test_mla_head_sizes(h, hv, config):
  """DeepSeek's MLA prefill shape (query / key heads of 192 = 128 + 64 RoPE, values of 128):
  the output is written into the query tiles' bytes (seen as [96, 128] tiles), which leaves room
  for 128-key steps by default; wider values (64 / 128) get output tiles of their own.
  Gradients through the entry point take the Hopper backward, whose dK and dV come from kernels
  of their own at unequal sizes (a [64, 192] and a [64, 128] fp32 accumulator do not fit in one
  consumer's registers beside its logit tiles)."""
  q, key, _ = inputs(1, 130, 130, 2, 1, h, jnp.bfloat16, seed=6)
  v = jax.random.normal(jax.random.key(7), (1, 130, 1, hv), jnp.float32).astype(jnp.bfloat16)
  assert hopper.default_config(192, 128).block_k == 128
  assert hopper._aliased_out_rows(192, 128, 64) == 96
  assert hopper._aliased_out_rows(64, 128, 64) is None  # wider: tiles of its own
  assert hopper._aliased_out_rows(256, 192, 64) is None  # 85 1/3 rows
  tiles = 2 * (2 * 64 * 192 + 2 * 128 * (192 + 128))  # no output tiles: they share q's
  assert hopper.smem_bytes(192, hopper.Config(), 128, segments=False) == tiles + 8 * 9
  assert hopper.smem_bytes(64, hopper.Config(), 128, segments=False) == (
      2 * (2 * 64 * 64 + 2 * 64 * 128 + 2 * 128 * (64 + 128)) + 8 * 9)
  assert hopper.supports(dtype=jnp.bfloat16, head_dim=192, v_head_dim=128,
                         static_mask=None) is None
  assert hopper.supports_backward(head_dim=128, v_head_dim=64) is None
  assert hopper.supports_backward(head_dim=192, v_head_dim=128) is None
  assert "at most 192" in hopper.supports_backward(head_dim=256, v_head_dim=128)
  assert "shared memory in the backward" in hopper.supports_backward(
      head_dim=192, v_head_dim=192, config=hopper.Config(stages=3))
  # The interpreter takes no aliased refs (it writes the output to tiles of its own) and, on two
  # CPU cores, stalls at 128-key steps with unequal head sizes: a thread dump shows the two
  # consumers' barrier waits (host callbacks) holding both of XLA's CPU pool threads while the
  # producer's program waits for a thread to run on -- the interpreter starved of threads, not
  # a cycle of barriers in the kernel. Interpreted runs take
  # 64-key steps.
  run_config = config or (None if ON_GPU else hopper.Config(block_k=64))
  out, lse = hopper.forward(q, key, v, mask=M.CausalMask(), q_offset=0, config=run_config,
                            interpret=interpret())
  want_out, want_lse = formula(q, key, v, M.CausalMask(), 0, None)
  assert out.shape == (1, 130, 2, hv)
  assert_close(out, want_out, TOL, "out")
  assert_close(lse, want_lse, 1e-2, "lse")
  if config is not None:
    return
  calls, parts = [], []
  saved, real, real_dkv = gpu_kernel.get_options(), hopper.forward, hopper._dkv_call
  try:
    gpu_kernel.set_options(forward="hopper", backward="hopper", hopper=run_config)
    hopper.forward = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    hopper._dkv_call = lambda st, part="both": parts.append(part) or real_dkv(st, part)
    loss = lambda f: jax.grad(lambda q, k, v: jnp.sum(  # noqa: E731
        jnp.sin(f(q, k, v).astype(jnp.float32))), argnums=(0, 1, 2))
    grads = loss(lambda q, k, v: flash_attention_gpu(q, k, v, M.CausalMask()))(q, key, v)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    want = loss(lambda q, k, v: dot_product_attention(
        f32(q), f32(k), f32(v), mask=M.CausalMask(), implementation="xla"))(q, key, v)
  finally:
    hopper.forward, hopper._dkv_call = real, real_dkv
    gpu_kernel.set_options(**saved)
  assert calls and parts == ["dk", "dv"]  # the Hopper forward and backward, dK / dV apart
  for g, w, name in zip(grads, want, ("dq", "dk", "dv")):
    assert g.shape == w.shape
    assert_close(g, w, 3e-2, name)


def test_traced_query_offset():
  """A traced ``q_offset`` (chunked prefill) is an input of the kernels: one compiled program
  serves every offset, the block runs computed at run time; values for two offsets under one
  ``jit``, and gradients, against the formula."""
  q, key, v = inputs(1, 130, 200, 1, 1, 64, jnp.bfloat16, seed=8)
  mask = M.CausalMask() & M.SlidingWindowMask(60, 0)
  cfg = hopper.Config(block_k=64)
  fwd = jax.jit(lambda q, k, v, o: hopper.forward(q, k, v, mask=mask, q_offset=o, config=cfg,
                                                  interpret=interpret()))
  for offset in (70, 3):
    out, lse = fwd(q, key, v, jnp.int32(offset))
    want_out, want_lse = formula(q, key, v, mask, offset, None)
    assert_close(out, want_out, TOL, f"out at {offset}")
    empty = ~np.isfinite(np.asarray(want_lse))
    assert np.all(np.isneginf(np.asarray(lse)[empty]))
    assert_close(jnp.where(empty, 0.0, lse), jnp.where(empty, 0.0, want_lse), 1e-2, "lse")
  assert fwd._cache_size() == 1
  d_out = jax.random.normal(jax.random.key(3), q.shape, jnp.float32).astype(q.dtype)
  grads = jax.jit(lambda q, k, v, o: hopper.backward(
      q, k, v, *fwd(q, k, v, o), d_out, mask=mask, q_offset=o, config=cfg,
      interpret=interpret()))(q, key, v, jnp.int32(70))
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  _, vjp = jax.vjp(lambda q, k, v: formula(q, k, v, mask, 70, None)[0], f32(q), f32(key), f32(v))
  for g, w, name in zip(grads, vjp(f32(d_out)), ("dq", "dk", "dv")):
    assert_close(g, w, TOL, name)


@pytest.mark.parametrize("scale", [0.3, -0.2])
def test_scale_folded_into_the_exponent(scale):
  """Without ALiBi / soft-cap the forward takes the row max of the raw logits and folds the
  scale into ``exp2`` (``_folds``); a negative scale reverses the max, so it is not folded."""
  q, key, v = inputs(1, 128, 128, 1, 1, 64, jnp.bfloat16, seed=4)
  out, lse = hopper.forward(q, key, v, mask=M.CausalMask(), scale=scale,
                            config=hopper.Config(block_k=64), interpret=interpret())
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  # (the formula takes positive scales: -c q.k is c (-q).k)
  want_out, want_lse = dot_product_attention(f32(q) * np.sign(scale), f32(key), f32(v),
                                             mask=M.CausalMask(), scale=abs(scale),
                                             implementation="xla", return_residuals=True)
  assert_close(out, want_out, TOL, "out")
  assert_close(lse, want_lse, 1e-2, "lse")


BWD_CASES = [
    # name, (b, t, s, n, k, h), mask, q_offset, cap, dtype, config
    ("causal gqa ragged", (1, 130, 130, 2, 1, 64), M.CausalMask(), 0, None, jnp.bfloat16,
     hopper.Config(block_k=64, pingpong=True)),
    ("window softcap offset overlap pingpong dq128", (1, 130, 200, 2, 1, 64),
     M.SlidingWindowMask(50, 10), 60, 30.0, jnp.bfloat16,
     hopper.Config(block_k=64, stages=3, pingpong=True, overlap=True, dq_block_k=128)),
    ("causal gqa ragged overlap", (1, 130, 130, 2, 1, 64), M.CausalMask(), 0, None, jnp.bfloat16,
     hopper.Config(block_k=64, backward_overlap=True)),
    ("full mha fp16 no pingpong", (1, 128, 128, 2, 2, 64), None, 0, None, jnp.float16,
     hopper.Config(block_k=64, pingpong=False)),
]


@pytest.mark.parametrize("case", params(BWD_CASES))
def test_backward_matches_formula(case):
  """dQ, dK, dV (GQA groups summed in the kernel) from the kernel's own forward, with a cotangent
  on the log-sum-exp too, against the formula's VJP; each step's matmuls in turn, or in flight
  together (``backward_overlap``: the forward's ``overlap`` by default, or set alone); the dQ
  kernel at 64 or 128 keys per step (``dq_block_k``: 200 keys, two ragged steps of 128)."""
  name, (b, t, s, n, k, h), mask, q_offset, cap, dtype, config = case
  q, key, v = inputs(b, t, s, n, k, h, dtype)
  races = name.startswith("causal gqa ragged")  # the dK/dV ring refills its slots (two heads,
                                                  # three blocks)
  check_backward(name, q, key, v, mask, q_offset, cap, config, seed=9, races=races)


def check_backward(name, q, key, v, mask, q_offset, cap, config, *, seed, races=False):
  """dQ, dK, dV of the kernels (their own forward's output and log-sum-exp, random cotangents
  on both) against the formula's VJP: shapes, dtypes, values; with ``races``, none found."""
  b, t, n, _ = q.shape
  ks = jax.random.split(jax.random.key(seed), 2)
  d_out = jax.random.normal(ks[0], (b, t, n, v.shape[-1]), jnp.float32).astype(q.dtype)
  d_lse = 0.3 * jax.random.normal(ks[1], (b, n, t), jnp.float32)
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  (_, lse_ref), vjp = jax.vjp(lambda q, k, v: formula(q, k, v, mask, q_offset, cap),
                              f32(q), f32(key), f32(v))
  want = vjp((f32(d_out), jnp.where(jnp.isfinite(lse_ref), d_lse, 0.0)))
  out, lse = hopper.forward(q, key, v, mask=mask, q_offset=q_offset, logits_soft_cap=cap,
                            config=config, interpret=interpret())
  got = hopper.backward(q, key, v, out, lse, d_out, d_lse, mask=mask, q_offset=q_offset,
                        logits_soft_cap=cap, config=config, interpret=interpret(races))
  if races and not ON_GPU:
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks  # noqa: PLC0415
    assert not gpu_callbacks.get_races().races_found
  for g, w, x, grad in zip(got, want, (q, key, v), ("dq", "dk", "dv")):
    assert g.shape == x.shape and g.dtype == x.dtype, grad
    assert_close(g, w, TOL, f"{name} {grad}")


@pytest.mark.parametrize("h,hv,config", [
    (64, 128, hopper.Config(block_k=64, pingpong=True)),
    (128, 64, hopper.Config(block_k=64, overlap=True))], ids=["64-128 pingpong", "128-64"])
def test_backward_unequal_head_sizes(h, hv, config):
  """Unequal head sizes (MLA's 192 / 128 at CPU sizes): dK and dV from kernels of their own
  (``part``), dQ with value-width output-gradient and value tiles; GQA, ragged, a window with a
  query offset and soft-cap on the second, whose dK kernel overlaps (``s^T`` and ``dp^T`` in
  flight together); a cotangent on the log-sum-exp too."""
  mask, q_offset, cap = ((M.CausalMask(), 0, None) if hv > h else
                         (M.SlidingWindowMask(50, 10), 40, 30.0))
  q, key, _ = inputs(1, 130, 170, 2, 1, h, seed=3)
  v = jax.random.normal(jax.random.key(4), (1, 170, 1, hv), jnp.float32).astype(jnp.bfloat16)
  check_backward(f"{h}/{hv}", q, key, v, mask, q_offset, cap, config, seed=5)


def packed_ids(b, length, sizes, seed):
  """``[b, length]`` ids of packed sequences (``sizes`` cycled, shifted per row)."""
  rows = []
  for r in range(b):
    cycle = np.roll(np.asarray(sizes), r + seed)
    rows.append(np.repeat(np.arange(len(cycle) * 8), np.tile(cycle, 8))[:length])
  return jnp.asarray(np.stack(rows), jnp.int32)


def data_case(b, t, s, n, k, mask, dtype, *, segments, lengths, alibi, seed=0):
  """Inputs, kernel keyword arguments and the formula's mask of one data-feature case."""
  q, key, v = inputs(b, t, s, n, k, 64, dtype, seed=seed)
  kw, full_mask = {}, mask
  if segments == "packed":  # contiguous runs, as packed training batches are
    q_ids, kv_ids = packed_ids(b, t, (37, 70, 50), seed), packed_ids(b, s, (37, 70, 50), seed)
  elif segments == "scattered":  # not contiguous: every block may meet every block
    rng = np.random.RandomState(seed)
    q_ids, kv_ids = (jnp.asarray(rng.randint(0, 3, (b, x)), jnp.int32) for x in (t, s))
  if segments:
    kw["segment_ids"] = (q_ids, kv_ids)
    full_mask = M.SegmentMask(q_ids, kv_ids) if full_mask is None else (
        full_mask & M.SegmentMask(q_ids, kv_ids))
  if lengths is not None:
    kw["kv_lengths"] = jnp.asarray(lengths, jnp.int32)
    full_mask = M.PaddingMask(kw["kv_lengths"]) if full_mask is None else (
        full_mask & M.PaddingMask(kw["kv_lengths"]))
  if alibi:
    kw["alibi_slopes"] = jnp.asarray(np.geomspace(0.25, 0.02, n), jnp.float32)
  return (q, key, v), kw, full_mask


DATA_CASES = [
    # name, (b, t, s, n, k), mask, q_offset, cap, dtype, config, segments, lengths, alibi
    ("packed causal gqa", (2, 200, 200, 2, 1), M.CausalMask(), 0, None, jnp.bfloat16,
     hopper.Config(block_k=64, pingpong=True), "packed", None, False),
    ("lengths window alibi softcap", (2, 130, 260, 2, 2), M.SlidingWindowMask(60, 10), 90, 30.0,
     jnp.bfloat16, hopper.Config(block_k=64, stages=3, pingpong=True), None, (0, 150), True),
    ("scattered ids lengths alibi no pingpong fp16", (1, 128, 192, 2, 1), None, 0, None,
     jnp.float16, hopper.Config(block_k=64, pingpong=False), "scattered", (170,), True),
    ("packed lengths alibi 128-key steps", (1, 256, 256, 1, 1), M.CausalMask(), 0, None,
     jnp.bfloat16, hopper.Config(block_k=128, pingpong=True), "packed", (230,), True),
    ("scattered ids lengths alibi overlap", (1, 128, 192, 2, 1), None, 0, None, jnp.bfloat16,
     hopper.Config(block_k=64, overlap=True), "scattered", (170,), True),
    ("scattered ids lengths alibi persistent", (2, 128, 192, 2, 1), None, 0, None,
     jnp.bfloat16, hopper.Config(block_k=64, persistent=True), "scattered", (170, 0), True),
]


BIAS_CASES = [
    # name, (b, t, s, n, k), bias dims (batch, heads), mask, q_offset, cap, config, data
    ("T5 causal offset", (2, 130, 200, 2, 1), (1, 2), M.CausalMask(), 70, None,
     hopper.Config(block_k=64, pingpong=True), False),
    ("per row window softcap overlap", (2, 130, 200, 2, 1), (2, 1), M.SlidingWindowMask(50, 10),
     70, 30.0, hopper.Config(block_k=64, overlap=True), False),
    ("packed lengths alibi 128-key steps", (1, 256, 256, 1, 1), (1, 1), M.CausalMask(), 0,
     None, hopper.Config(block_k=128, pingpong=True), True),
    ("persistent overlap pingpong", (2, 130, 200, 2, 1), (1, 2), None, 0, None,
     hopper.Config(block_k=64, overlap=True, pingpong=True, persistent=True), False),
]


@pytest.mark.parametrize("case", params(BIAS_CASES))
def test_forward_bias_matches_formula(case):
  """A dense bias ``[B|1, N|1, T, S]`` (a T5 relative bias, per batch row, shared) streamed as
  ``[128, block_k]`` tiles beside each key block, added before ALiBi and the soft-cap: every
  schedule (plain with ping-pong, overlapped, persistent), ragged lengths (the bias padded to
  whole tiles), with segment ids, key lengths and ALiBi; race detection on one case."""
  name, (b, t, s, n, k), dims, mask, q_offset, cap, config, data = case
  (q, key, v), kw, full_mask = data_case(
      b, t, s, n, k, mask, jnp.bfloat16, segments="packed" if data else None,
      lengths=(230,) if data else None, alibi=data, seed=3)
  bias_shape = (b if dims[0] > 1 else 1, n if dims[1] > 1 else 1, t, s)
  bias = (2.0 * jax.random.normal(jax.random.key(9), bias_shape)).astype(jnp.bfloat16)
  races = name.startswith("T5")
  out, lse = hopper.forward(q, key, v, mask=mask, q_offset=q_offset, logits_soft_cap=cap,
                            config=config, interpret=interpret(detect_races=races), bias=bias,
                            **kw)
  if races and not ON_GPU:
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks  # noqa: PLC0415
    assert not gpu_callbacks.get_races().races_found
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  want_out, want_lse = dot_product_attention(
      f32(q), f32(key), f32(v), f32(bias), mask=full_mask, q_offset=q_offset,
      logits_soft_cap=cap, alibi_slopes=kw.get("alibi_slopes"), implementation="xla",
      return_residuals=True)
  # the bias moves the result: without it the kernel would be far off
  plain = formula(q, key, v, full_mask, q_offset, cap, kw.get("alibi_slopes"))[0]
  assert float(jnp.abs(plain - want_out).max()) > 0.3
  empty = ~np.isfinite(np.asarray(want_lse))
  assert np.array_equal(~np.isfinite(np.asarray(lse)), empty)
  assert_close(out, want_out, TOL, name + " out")
  assert_close(jnp.where(empty, 0.0, lse), jnp.where(empty, 0.0, want_lse), 1e-2, name + " lse")


BWD_BIAS_CASES = [
    # name, (b, t, s, n, k), bias dims, mask, q_offset, cap, config
    ("T5 causal gqa overlap", (1, 130, 130, 2, 1), (1, 2), M.CausalMask(), 0, None,
     hopper.Config(block_k=64, overlap=True)),
    ("per row window softcap pingpong", (2, 130, 200, 1, 1), (2, 1), M.SlidingWindowMask(50, 10),
     70, 30.0, hopper.Config(block_k=64, pingpong=True)),
]
SLOW.add("per row window softcap pingpong")  # the window / soft-cap: the forward's bias cases


@pytest.mark.parametrize("case", params(BWD_BIAS_CASES))
def test_backward_bias_matches_formula(case):
  """The Hopper backward with a dense bias: the dQ kernel streams its ``[128, dq_block_k]``
  tiles beside K, the dK/dV kernel the transposed bias' ``[128 keys, 64 rows]`` tiles beside q
  (each of the GQA group's heads its own); dQ, dK, dV against the formula's (the bias constant
  here: its gradient is ``gpu.py``'s, tested through the entry point)."""
  name, (b, t, s, n, k), dims, mask, q_offset, cap, config = case
  q, key, v = inputs(b, t, s, n, k, 64, seed=8)
  bias = (2.0 * jax.random.normal(jax.random.key(10), (b if dims[0] > 1 else 1,
                                                       n if dims[1] > 1 else 1, t, s)))
  bias = bias.astype(jnp.bfloat16)
  d_out = jax.random.normal(jax.random.key(11), (b, t, n, 64)).astype(jnp.bfloat16)
  out, lse = hopper.forward(q, key, v, mask=mask, q_offset=q_offset, logits_soft_cap=cap,
                            config=config, interpret=interpret(), bias=bias)
  got = hopper.backward(q, key, v, out, lse, d_out, mask=mask, q_offset=q_offset,
                        logits_soft_cap=cap, config=config, interpret=interpret(), bias=bias)
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  _, vjp = jax.vjp(lambda q, k, v: dot_product_attention(
      q, k, v, f32(bias), mask=mask, q_offset=q_offset, logits_soft_cap=cap,
      implementation="xla"), f32(q), f32(key), f32(v))
  for g, w, label in zip(got, vjp(f32(d_out)), ("dq", "dk", "dv")):
    assert_close(g, w, 3e-2, f"{name} {label}")


SLOW.add("per head softcap persistent overlap")  # the vectors: the first case; the schedule:
# the tile bias' persistent case
ROW_BIAS_CASES = [
    # name, (b, t, s, n, k), bias dims (batch, heads), bias dtype, mask, q_offset, cap, config
    ("per row causal offset fp32", (2, 130, 200, 2, 1), (2, 1), jnp.float32, M.CausalMask(), 70,
     None, hopper.Config(block_k=64, pingpong=True)),
    ("per head softcap persistent overlap", (1, 130, 200, 2, 1), (1, 2), jnp.bfloat16, None, 0,
     30.0, hopper.Config(block_k=64, overlap=True, persistent=True)),
]


@pytest.mark.parametrize("case", params(ROW_BIAS_CASES))
def test_forward_one_row_bias_matches_formula(case):
  """A bias with one row for all queries ``[B|1, N|1, 1, S]`` (a per-key bias: an additive
  padding mask, a learned per-key prior), any float dtype: streamed as fp32 ``[block_k]``
  vectors beside each key block and broadcast over the rows, added before the soft-cap."""
  name, (b, t, s, n, k), dims, dtype, mask, q_offset, cap, config = case
  q, key, v = inputs(b, t, s, n, k, 64, seed=12)
  bias = 2.0 * jax.random.normal(jax.random.key(13), (b if dims[0] > 1 else 1,
                                                      n if dims[1] > 1 else 1, 1, s))
  bias = bias.at[..., 150:170].set(-1e9).astype(dtype)    # keys masked the additive way
  out, lse = hopper.forward(q, key, v, mask=mask, q_offset=q_offset, logits_soft_cap=cap,
                            config=config, interpret=interpret(), bias=bias)
  want_out, want_lse = dot_product_attention(
      *(x.astype(jnp.float32) for x in (q, key, v, bias)), mask=mask, q_offset=q_offset,
      logits_soft_cap=cap, implementation="xla", return_residuals=True)
  plain = formula(q, key, v, mask, q_offset, cap)[0]
  assert float(jnp.abs(plain - want_out).max()) > 0.3
  assert_close(out, want_out, TOL, name + " out")
  assert_close(lse, want_lse, 1e-2, name + " lse")


def test_backward_one_row_bias_matches_formula():
  """dQ, dK, dV with a one-row bias per head ``[1, N, 1, S]`` and GQA: the dK/dV kernel streams
  the vector of its keys for each query head of the group in turn (the wrong head's would move
  dK); the bias' gradient is ``gpu.py``'s."""
  b, t, s, n, k = 1, 130, 200, 2, 1
  q, key, v = inputs(b, t, s, n, k, 64, seed=14)
  bias = (3.0 * jax.random.normal(jax.random.key(15), (1, n, 1, s))).astype(jnp.bfloat16)
  mask, config = M.CausalMask(), hopper.Config(block_k=64, overlap=True)
  d_out = jax.random.normal(jax.random.key(16), (b, t, n, 64)).astype(jnp.bfloat16)
  out, lse = hopper.forward(q, key, v, mask=mask, q_offset=70, config=config,
                            interpret=interpret(), bias=bias)
  got = hopper.backward(q, key, v, out, lse, d_out, mask=mask, q_offset=70, config=config,
                        interpret=interpret(), bias=bias)
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  _, vjp = jax.vjp(lambda q, k, v: dot_product_attention(
      q, k, v, f32(bias), mask=mask, q_offset=70, implementation="xla"),
      f32(q), f32(key), f32(v))
  for g, w, label in zip(got, vjp(f32(d_out)), ("dq", "dk", "dv")):
    assert_close(g, w, 3e-2, f"one-row bias {label}")


def mask_array(shape, seed):
  """A boolean mask ``[Bm, Nm, T, S]`` whose 64-key blocks are, for every head and row: all
  allowed (keys 64..127: FULL where a tile has no padded row), none allowed (128..191: EMPTY,
  skipped) and random elsewhere (heads and rows differ), except that the first head allows
  none of keys 0..63 (the run table must take the union of the heads); query row 5 allows no
  key at all."""
  m = np.random.default_rng(seed).random(shape) < 0.6
  m[..., 64:128] = True
  m[..., 128:192] = False
  if shape[1] > 1:
    m[:, 0, :, :64] = False
  if shape[2] > 5:
    m[..., 5, :] = False
  return jnp.asarray(m)


def with_array(full_mask, allowed, t, s, q_offset):
  """The formula's mask: a static / data mask and'ed with a mask array, as one boolean array."""
  if full_mask is None:
    return allowed
  dense = jnp.asarray(full_mask.dense(t, s, q_offset))
  return allowed & (dense[None, None] if dense.ndim == 2 else dense[:, None])


MASK_CASES = [
    # name, (b, t, s, n, k), mask array dims (batch, heads), mask, q_offset, config, data
    ("per row and head causal gqa offset", (2, 130, 200, 2, 1), (2, 2), M.CausalMask(), 70,
     hopper.Config(block_k=64, pingpong=True), False),
    ("shared packed lengths alibi overlap", (1, 130, 200, 2, 1), (1, 1), None, 0,
     hopper.Config(block_k=64, overlap=True), True),
    # one row per head (streamed as key vectors; its run table the same for every query tile)
    ("one row per head window", (1, 130, 200, 2, 1), (1, 2, "row"), M.SlidingWindowMask(90, 0),
     70, hopper.Config(block_k=64, pingpong=True), False),
]


@pytest.mark.parametrize("case", params(MASK_CASES))
def test_forward_mask_array_matches_formula(case):
  """A boolean mask array ``[B|1, N|1, T, S]`` (Flax's ``make_attention_mask`` shape): streamed
  as the bias is, and'ed with the band and the data masks; its blocks refine the run table over
  all heads (EMPTY ones skipped, FULL ones not evaluated: a block some head masks must be, so
  the heads' random blocks are), a row with no allowed key gives 0 and ``lse = -inf``."""
  name, (b, t, s, n, k), dims, mask, q_offset, config, data = case
  (q, key, v), kw, full_mask = data_case(
      b, t, s, n, k, mask, jnp.bfloat16, segments="packed" if data else None,
      lengths=(190,) if data else None, alibi=data, seed=4)
  allowed = mask_array((b if dims[0] > 1 else 1, n if dims[1] > 1 else 1,
                        1 if "row" in dims else t, s), seed=2)
  out, lse = hopper.forward(q, key, v, mask=mask, q_offset=q_offset, config=config,
                            interpret=interpret(), mask_array=allowed, **kw)
  want_out, want_lse = formula(q, key, v, with_array(full_mask, allowed, t, s, q_offset),
                               q_offset, None, kw.get("alibi_slopes"))
  empty = ~np.isfinite(np.asarray(want_lse))
  assert "row" in dims or empty[:, :, 5].all()
  assert np.array_equal(~np.isfinite(np.asarray(lse)), empty)
  assert np.all(np.asarray(out, np.float32).transpose(0, 2, 1, 3)[empty] == 0.0)
  assert_close(out, want_out, TOL, name + " out")
  assert_close(jnp.where(empty, 0.0, lse), jnp.where(empty, 0.0, want_lse), 1e-2, name + " lse")


@pytest.mark.slow  # the Hopper backward with a mask array: test_flax_mask_array_runs_on_hopper
def test_backward_mask_array_matches_formula():
  """dQ, dK, dV with a per-row-and-head mask array (the dK/dV kernel reads it transposed, its
  run table too), GQA and a causal band, against the formula's VJP; masked pairs get no
  gradient and the row with no key none at all."""
  b, t, s, n, k = 1, 130, 200, 2, 1
  q, key, v = inputs(b, t, s, n, k, 64, seed=6)
  allowed = mask_array((b, n, t, s), seed=3)
  mask, q_offset, config = M.CausalMask(), 70, hopper.Config(block_k=64, overlap=True)
  d_out = jax.random.normal(jax.random.key(12), (b, t, n, 64)).astype(jnp.bfloat16)
  out, lse = hopper.forward(q, key, v, mask=mask, q_offset=q_offset, config=config,
                            interpret=interpret(), mask_array=allowed)
  got = hopper.backward(q, key, v, out, lse, d_out, mask=mask, q_offset=q_offset,
                        config=config, interpret=interpret(), mask_array=allowed)
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  _, vjp = jax.vjp(lambda q, k, v: formula(q, k, v, with_array(mask, allowed, t, s, q_offset),
                                           q_offset, None)[0], f32(q), f32(key), f32(v))
  want = vjp(f32(d_out))
  assert not np.asarray(got[0])[:, 5].any()
  for g, w, label in zip(got, want, ("dq", "dk", "dv")):
    assert_close(g, w, 3e-2, f"mask array {label}")


def test_mask_array_holes_are_not_loaded():
  """A mask array with a static query offset walks block lists (``list_table``): key blocks that
  no row of a CTA may see are neither loaded nor evaluated, even between blocks it sees (keys
  128..191 here, masked for every row and head, hold NaN: a loaded block, evaluated masked,
  would carry NaN through ``p v``); the result is the formula's on clean inputs.  The persistent
  overlapped schedule: a CTA's ring runs on across tiles with lists of different lengths."""
  b, t, s, n, k = 2, 130, 260, 2, 1
  q, key, v = inputs(b, t, s, n, k, 64, seed=8)
  allowed = mask_array((b, n, t, s), seed=5)
  hole = (jnp.arange(s) >= 128) & (jnp.arange(s) < 192)
  poison = lambda x: jnp.where(hole[None, :, None, None], jnp.nan, x)  # noqa: E731
  mask, q_offset = M.CausalMask(), 130
  for config in (hopper.Config(block_k=64, pingpong=True),
                 hopper.Config(block_k=64, overlap=True, persistent=True)):
    out, lse = hopper.forward(q, poison(key), poison(v), mask=mask, q_offset=q_offset,
                              config=config, interpret=interpret(), mask_array=allowed)
    want_out, want_lse = formula(q, key, v, with_array(mask, allowed, t, s, q_offset), q_offset,
                                 None)
    empty = ~np.isfinite(np.asarray(want_lse))
    assert not np.isnan(np.asarray(out, np.float32)).any(), config
    assert_close(out, want_out, TOL, f"holes {config} out")
    assert_close(jnp.where(empty, 0.0, lse), jnp.where(empty, 0.0, want_lse), 1e-2, "lse")


def sinks_and_window(window):
  """StreamingLLM's attention: a causal window and the first keys (the sinks) for every row."""
  return M.CausalMask() & (M.sliding_window(window) | M.GlobalTokensMask((0, 1, 2, 3)))


LONGFORMER = M.sliding_window(40, causal=False) | M.GlobalTokensMask((0, 3, 150))

LIST_CASES = [
    # name, (b, t, s, n, k), mask, q_offset, cap, config
    ("longformer gqa ragged", (1, 330, 330, 2, 1), LONGFORMER, 0, None,
     hopper.Config(block_k=64, pingpong=True)),
    ("sinks and window offset softcap overlap", (1, 200, 390, 2, 1), sinks_and_window(60), 190,
     30.0, hopper.Config(block_k=64, overlap=True)),
    ("longformer persistent overlap pingpong", (2, 200, 200, 2, 2), LONGFORMER, 0, None,
     hopper.Config(block_k=64, overlap=True, pingpong=True, persistent=True)),
]


@pytest.mark.parametrize("case", params(LIST_CASES))
def test_forward_non_band_masks_match_formula(case):
  """Masks that are not a band (Longformer's window and global tokens, a causal window with
  attention sinks) run on the Hopper kernels through block lists: each CTA loads the blocks its
  rows may see, in order (the sinks' block, then the window's, skipping those between), and
  evaluates the mask (a few compares per logit) in blocks it does not wholly allow."""
  name, (b, t, s, n, k), mask, q_offset, cap, config = case
  q, key, v = inputs(b, t, s, n, k, 64, seed=10)
  out, lse = hopper.forward(q, key, v, mask=mask, q_offset=q_offset, logits_soft_cap=cap,
                            config=config, interpret=interpret())
  want_out, want_lse = formula(q, key, v, mask, q_offset, cap)
  assert_close(out, want_out, TOL, name + " out")
  assert_close(lse, want_lse, 1e-2, name + " lse")


def test_backward_non_band_mask_matches_formula():
  """dQ (lists of key blocks per query tile) and dK / dV (lists of query blocks per key tile,
  the GQA group's heads in turn) with Longformer's mask against the formula's VJP."""
  q, key, v = inputs(1, 330, 330, 2, 1, 64, seed=11)
  check_backward("longformer", q, key, v, LONGFORMER, 0, None,
                 hopper.Config(block_k=64, backward_overlap=True), seed=13)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(data=st.data(), ctas=st.integers(1, 3), cols=st.integers(1, 9), batch=st.integers(1, 2))
def test_list_table_lists_what_each_tile_needs(data, ctas, cols, batch):
  """For random block kinds: each CTA lists exactly the blocks either tile needs, in order; each
  tile's run ``[lo, hi)`` holds every position it needs (and starts and ends on one), and its
  FULL run only positions FULL for it -- all of them when they are contiguous."""
  kinds = np.asarray(data.draw(st.lists(st.sampled_from([C.EMPTY, C.PARTIAL, C.FULL]),
                                        min_size=batch * 2 * ctas * cols,
                                        max_size=batch * 2 * ctas * cols)),
                     np.int8).reshape(batch, 2 * ctas, cols)
  width = cols if data.draw(st.booleans()) else None
  table = np.asarray(hopper.list_table(jnp.asarray(kinds), width))
  assert table.shape == (batch, ctas, 9 + cols)
  for b in range(batch):
    for c in range(ctas):
      row = table[b, c]
      pair = kinds[b, 2 * c:2 * c + 2]
      need = np.flatnonzero((pair != C.EMPTY).any(0))
      count = row[0]
      assert count == need.size
      np.testing.assert_array_equal(row[9:9 + count], need)
      for x in range(2):
        lo, hi, f_lo, f_hi = row[1 + 4 * x:5 + 4 * x]
        listed = pair[x][need]
        mine = np.flatnonzero(listed != C.EMPTY)
        if mine.size:
          assert (lo, hi) == (mine[0], mine[-1] + 1)
        else:
          assert hi <= lo
        assert lo <= f_lo <= f_hi <= max(hi, lo)
        assert (listed[f_lo:f_hi] == C.FULL).all()
        full = np.flatnonzero(listed == C.FULL)
        if full.size and full[-1] - full[0] + 1 == full.size:
          assert (f_lo, f_hi) == (full[0], full[-1] + 1)


def test_sinks_and_window_through_the_entry_point():
  """``implementation="pallas_gpu"`` with a causal window and attention sinks runs the Hopper
  forward (counted; the block lists), and matches the formula."""
  q, key, v = inputs(1, 200, 200, 2, 1, 64, seed=12)
  mask, calls, real = sinks_and_window(50), [], hopper.forward

  def counting(*a, **kw):
    calls.append(kw["mask"])
    return real(*a, **kw)

  saved = gpu_kernel.get_options()
  try:
    gpu_kernel.set_options(forward="hopper", hopper=hopper.Config(block_k=64))
    hopper.forward = counting
    out = dot_product_attention(q, key, v, mask=mask, implementation="pallas_gpu")
  finally:
    hopper.forward = real
    gpu_kernel.set_options(**saved)
  assert calls == [mask]
  assert_close(out, formula(q, key, v, mask, 0, None)[0], TOL, "sinks")


def test_list_table():
  """Per CTA (two tiles' rows of kinds): the blocks either tile needs, in order, and each
  tile's runs over those positions (a FULL run only where its FULL positions are contiguous)."""
  E, P, F = C.EMPTY, C.PARTIAL, C.FULL
  kinds = jnp.asarray([[[F, E, E, P, E, E], [F, E, E, E, P, F],
                        [E, E, E, E, E, E], [E, P, E, E, E, E]]], jnp.int8)
  table = np.asarray(hopper.list_table(kinds, 4))
  assert table.shape == (1, 2, 13)
  np.testing.assert_array_equal(table[0], [[4, 0, 2, 0, 1, 0, 4, 0, 0, 0, 3, 4, 5],
                                           [1, 0, 0, 0, 0, 0, 1, 0, 0, 1, 0, 0, 0]])
  # the sinks and a window: a tile far from the start loads the sinks' block and its window's,
  # not the blocks between (a range would load all 12 blocks of the last CTA)
  st = hopper._static("forward", *inputs(1, 768, 768, 1, 1, 64), mask=sinks_and_window(60),
                      scale=None, q_offset=0, logits_soft_cap=None,
                      config=hopper.Config(block_k=64), interpret=None)
  tab = np.asarray(hopper._data_table(st, {}, 768, 768, 64, 64, transpose=False))
  assert tab.shape[-1] == 9 + 4
  np.testing.assert_array_equal(tab[0, -1, :5], [4, 0, 3, 0, 0])
  np.testing.assert_array_equal(tab[0, -1, 9:], [0, 9, 10, 11])


@pytest.mark.parametrize("case", params(DATA_CASES))
def test_forward_data_features_match_formula(case):
  """Segment ids (packed, and scattered so that every block is evaluated masked), key lengths (a
  zero-length row: output 0, lse -inf) and ALiBi, against the formula with the same mask."""
  name, (b, t, s, n, k), mask, q_offset, cap, dtype, config, segments, lengths, alibi = case
  (q, key, v), kw, full_mask = data_case(b, t, s, n, k, mask, dtype, segments=segments,
                                         lengths=lengths, alibi=alibi)
  races = segments == "scattered"  # three key blocks through two slots, ids streamed: no race
  out, lse = hopper.forward(q, key, v, mask=mask, q_offset=q_offset, logits_soft_cap=cap,
                            config=config, interpret=interpret(detect_races=races), **kw)
  if races and not ON_GPU:
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks  # noqa: PLC0415
    assert not gpu_callbacks.get_races().races_found
  want_out, want_lse = formula(q, key, v, full_mask, q_offset, cap, kw.get("alibi_slopes"))
  empty = ~np.isfinite(np.asarray(want_lse))
  assert np.all(np.isneginf(np.asarray(lse)[empty]))
  assert np.all(np.asarray(out, np.float32).transpose(0, 2, 1, 3)[empty] == 0.0)
  assert_close(out, want_out, TOL, name + " out")
  assert_close(jnp.where(empty, 0.0, lse), jnp.where(empty, 0.0, want_lse), 1e-2, name + " lse")


BWD_DATA_CASES = [
    # DATA_CASES' first two, smaller: still three query tiles and three key blocks of 64 each;
    # GQA on the packed case, two batch rows (one of length 0) on the other.
    ("packed causal gqa dq128", (1, 130, 130, 2, 1), M.CausalMask(), 0, None, jnp.bfloat16,
     hopper.Config(block_k=64, pingpong=True, dq_block_k=128), "packed", None, False),
    ("lengths window alibi softcap", (2, 130, 200, 1, 1), M.SlidingWindowMask(60, 10), 60, 30.0,
     jnp.bfloat16, hopper.Config(block_k=64, stages=3, pingpong=True), None, (0, 150), True),
]


@pytest.mark.parametrize("case", params(BWD_DATA_CASES, ["packed", "lengths"]))
def test_backward_data_features_match_formula(case):
  """dQ, dK, dV with segment ids / key lengths / ALiBi against the formula's VJP: keys past a
  row's length and keys of other segments get no gradient."""
  name, (b, t, s, n, k), mask, q_offset, cap, dtype, config, segments, lengths, alibi = case
  if segments:  # all three features at once on the packed case
    lengths, alibi = (110,), True
  (q, key, v), kw, full_mask = data_case(b, t, s, n, k, mask, dtype, segments=segments,
                                         lengths=lengths, alibi=alibi)
  ks = jax.random.split(jax.random.key(5), 2)
  d_out = jax.random.normal(ks[0], q.shape, jnp.float32).astype(dtype)
  d_lse = 0.3 * jax.random.normal(ks[1], (b, n, t), jnp.float32)
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  (_, lse_ref), vjp = jax.vjp(
      lambda q, k, v: formula(q, k, v, full_mask, q_offset, cap, kw.get("alibi_slopes")),
      f32(q), f32(key), f32(v))
  want = vjp((f32(d_out), jnp.where(jnp.isfinite(lse_ref), d_lse, 0.0)))
  out, lse = hopper.forward(q, key, v, mask=mask, q_offset=q_offset, logits_soft_cap=cap,
                            config=config, interpret=interpret(), **kw)
  got = hopper.backward(q, key, v, out, lse, d_out, d_lse, mask=mask, q_offset=q_offset,
                        logits_soft_cap=cap, config=config, interpret=interpret(), **kw)
  for g, w, grad in zip(got, want, ("dq", "dk", "dv")):
    assert_close(g, w, TOL, f"{name} {grad}")
  if lengths is not None:
    for row, length in enumerate(lengths):
      assert np.all(np.asarray(got[1][row, length:], np.float32) == 0.0)
      assert np.all(np.asarray(got[2][row, length:], np.float32) == 0.0)


def test_run_table():
  """Per row of block kinds: first to last non-empty block, and the FULL run only when the FULL
  blocks are contiguous (else every block of the range is evaluated masked)."""
  E, P, F = C.EMPTY, C.PARTIAL, C.FULL
  kinds = jnp.asarray([[[E, P, F, F, P, E], [E, E, E, E, E, E], [F, E, F, E, E, E],
                        [P, P, E, E, E, P]]], jnp.int8)
  table = np.asarray(hopper.run_table(kinds))[0]
  np.testing.assert_array_equal(table, [[1, 5, 2, 4], [0, 0, 0, 0], [0, 3, 0, 0], [0, 6, 0, 0]])


@pytest.mark.skipif(ON_GPU, reason="delays the interpreter's barrier waits")
@pytest.mark.parametrize("slow,overlap", [(0, True), (1, True), (0, False)],
                         ids=["consumer 0 slow", "consumer 1 slow", "rendezvous turns"])
def test_persistent_turns_with_a_slow_consumer(slow, overlap, monkeypatch):
  """The overlapped ping-pong's turns (``go``) run on from tile to tile of a persistent CTA.
  With one consumer delayed before each of its barrier waits, the other runs as far ahead as
  the barriers let it: across a tile boundary it must not complete a barrier phase twice before
  the slow one observes it (on hardware the slow consumer's parity wait would miss the phase;
  the interpreter raises in the fast consumer's thread and the slow one waits forever, so a
  regression stalls this test: ``faulthandler_timeout`` dumps the threads).  Consumer 1 used to
  grant consumer 0 the first turn of every tile, a second arrival on ``go[0]`` while consumer 0
  had yet to wait for the previous tile's last pass (it stalled here, and now and then in the
  undelayed persistent case of ``CASES``).  The plain ping-pong's turns are rendezvous (both
  arrive, then both wait): consumer 0's last turn of a tile meets consumer 1's first of the
  next."""
  import time  # noqa: PLC0415

  from jax._src.pallas.mosaic_gpu.interpret import shared_memory  # noqa: PLC0415

  real_wait = shared_memory.Barrier.wait

  def wait(self, device_id, local_thread_id, *args, **kwargs):
    if local_thread_id == slow:
      time.sleep(0.05)
    return real_wait(self, device_id, local_thread_id, *args, **kwargs)

  q, key, v = inputs(2, 256, 256, 1, 1, 64, jnp.bfloat16, seed=4)  # 2 CTAs x 2 tiles
  # the reference first, and the kernel awaited before anything else is dispatched: the
  # interpreter's callbacks run JAX operations of their own on the CPU device
  want_out, want_lse = jax.block_until_ready(formula(q, key, v, M.CausalMask(), 0, None))
  monkeypatch.setattr(shared_memory.Barrier, "wait", wait)
  cfg = hopper.Config(block_k=64, overlap=overlap, pingpong=True, persistent=True)
  out, lse = jax.block_until_ready(
      hopper.forward(q, key, v, mask=M.CausalMask(), config=cfg, interpret=interpret()))
  assert_close(out, want_out, TOL, "out")
  assert_close(lse, want_lse, 1e-2, "lse")


@pytest.mark.parametrize("overlap,pingpong", [(False, False), (True, False), (True, True)])
def test_rows_without_keys_and_races(overlap, pingpong):
  """A negative offset under a causal mask leaves the first rows with no key: output 0 and
  ``lse = -inf``; whole key blocks before the band are skipped by one consumer, not the other
  (with ``overlap``: a consumer with no computed block runs neither end of its pipeline, and
  with ``pingpong`` too it still takes its turns).  Race detection over the producer / consumer
  hand-offs finds nothing."""
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks  # noqa: PLC0415

  q, key, v = inputs(1, 128, 128, 1, 1, 64, jnp.bfloat16, seed=3)
  mask = M.CausalMask() & M.SlidingWindowMask(40, 0)
  out, lse = hopper.forward(q, key, v, mask=mask, q_offset=-70,
                            config=hopper.Config(block_k=64, overlap=overlap, pingpong=pingpong),
                            interpret=interpret(detect_races=True))
  if not ON_GPU:
    assert not gpu_callbacks.get_races().races_found
  want_out, want_lse = formula(q, key, v, mask, -70, None)
  assert np.all(np.asarray(out[:, :70], np.float32) == 0.0)
  assert np.all(np.isneginf(np.asarray(lse[:, :, :70])))
  assert_close(out, want_out, TOL, "out")
  assert_close(lse[:, :, 70:], want_lse[:, :, 70:], 1e-2, "lse")


@pytest.mark.parametrize("forward,backward,with_bias", [
    ("hopper", "triton", False),
    # a learned T5-style bias: the Hopper forward and backward (its tiles in the logits), the
    # bias' gradient from the Triton kernel of its own
    ("hopper", "hopper", True),
    # the Hopper backward through the entry point (its own tests cover it directly):
    pytest.param("hopper", "hopper", False, marks=pytest.mark.slow)])
def test_through_gpu_entry_point_with_gradients(forward, backward, with_bias):
  """``gpu.set_options(forward=..., backward=...)``: ``flash_attention_gpu`` runs the Hopper
  forward (counted) with the Triton backward on its log-sum-exp (so the two forwards' residuals
  agree), and with the Hopper backward; values and gradients match the formula.  The training
  path: three packed sequences (causal & segment ids) with ALiBi slopes, which the dispatch
  hands to the Hopper kernels; ``with_bias``: and a learned bias ``[1, N, T, S]``, which the
  Hopper kernels stream (its gradient, ``ds`` summed over the batch, from the Triton kernel of
  its own)."""
  q, key, v = inputs(1, 130, 130, 2, 1, 64, jnp.bfloat16, seed=1)
  ids = jnp.asarray(np.repeat([0, 1, 2], [40, 50, 40])[None], jnp.int32)
  mask = M.CausalMask() & M.SegmentMask(ids, ids)
  slopes = jnp.array([0.1, 0.03], jnp.float32)
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
      def g(q, k, v, b):
        out = f(q, k, v, b)
        o = out.astype(jnp.float32)
        return jnp.sum(o * jnp.cos(o)), out
      return jax.value_and_grad(g, argnums=(0, 1, 2, 3), has_aux=True)

    bias = jnp.zeros((1, 2, 130, 130), jnp.bfloat16)
    if with_bias:
      bias = (2.0 * jax.random.normal(jax.random.key(4), bias.shape)).astype(jnp.bfloat16)
    given = (lambda b: b) if with_bias else (lambda b: None)
    (_, out), grads = loss(lambda q, k, v, b: flash_attention_gpu(
        q, k, v, mask, alibi_slopes=slopes, bias=given(b)))(q, key, v, bias)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    (_, want), want_grads = loss(lambda q, k, v, b: dot_product_attention(
        f32(q), f32(k), f32(v), f32(b), mask=mask, alibi_slopes=slopes,
        implementation="xla"))(q, key, v, bias)
  finally:
    for name in calls:
      setattr(hopper, name, real[name])
    gpu_kernel.set_options(**saved)
  for name, option in (("forward", forward), ("backward", backward)):
    assert (calls[name] > 0) == (option == "hopper"), (name, calls)
  assert_close(out, want, TOL, "out")
  names = ("dq", "dk", "dv", "dbias") if with_bias else ("dq", "dk", "dv")  # (b: unused)
  for g, w, name in zip(grads, want_grads, names):
    assert_close(g, w, 3e-2, name)


@pytest.mark.parametrize("packed", [
    # (padding alone: test_flash_dense.py's key-padding cases take the same path on Triton)
    pytest.param(False, id="padding", marks=pytest.mark.slow),
    pytest.param(True, id="padding and segments")])
def test_key_padding_mask_runs_on_hopper(packed):
  """A Hugging Face key-padding mask ``[B, 1, 1, S]`` (left padding on one row, holes on the
  other) through ``flash_attention_gpu`` becomes segment ids (a masked key gets an id no query
  has, combined with packed sequences' own ids), so the Hopper forward takes it (counted); the
  output, log-sum-exp and gradients (Triton's backward) match the formula with the mask array."""
  b, t, n = 2, 130, 2
  q, key, v = inputs(b, t, t, n, 1, 64, jnp.bfloat16, seed=5)
  keep = np.ones((b, 1, 1, t), bool)
  keep[0, ..., :50] = False  # left padding
  keep[1, ..., 70:90] = False
  keep = jnp.asarray(keep)
  mask = M.CausalMask()
  if packed:
    ids = jnp.asarray(np.repeat([0, 1, 2], [40, 50, 40])[None].repeat(b, 0), jnp.int32)
    mask = mask & M.SegmentMask(ids, ids)
  calls = []
  real = hopper.forward
  saved = gpu_kernel.get_options()
  try:
    gpu_kernel.set_options(forward="hopper", backward="triton",
                           hopper=hopper.Config(block_k=64))
    hopper.forward = lambda *a, **kw: (calls.append(kw), real(*a, **kw))[1]

    (_, (out, lse)), grads = residual_loss(lambda q, k, v: flash_attention_gpu(
        q, k, v, mask, mask_array=keep, return_residuals=True))(q, key, v)
  finally:
    hopper.forward = real
    gpu_kernel.set_options(**saved)
  assert calls and calls[0]["segment_ids"] is not None
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  (_, (want, want_lse)), want_grads = residual_loss(lambda q, k, v: dot_product_attention(
      f32(q), f32(k), f32(v), mask=keep, is_causal=True,
      segment_ids=ids if packed else None, implementation="xla",
      return_residuals=True))(q, key, v)
  empty = ~np.isfinite(np.asarray(want_lse))
  assert empty.any() and np.array_equal(~np.isfinite(np.asarray(lse)), empty)  # rows < 50
  assert_close(out, want, TOL, "out")
  for g, w, name in zip(grads, want_grads, ("dq", "dk", "dv")):
    assert_close(g, w, 3e-2, name)


def test_flax_mask_array_runs_on_hopper():
  """A Flax-style mask ``[B, 1, T, S]`` (``make_attention_mask`` of query and key padding, and'ed
  with a causal band) through ``flash_attention_gpu``: the Hopper forward and backward take it
  (both counted, the array passed as such), output, log-sum-exp and gradients match the
  formula with the same array (rows with no allowed key: 0, -inf, no gradient)."""
  b, t, n = 2, 128, 1
  q, key, v = inputs(b, t, t, n, 1, 64, jnp.bfloat16, seed=7)
  valid = np.ones((b, t), bool)
  valid[0, 100:] = False            # padding at the end of row 0
  valid[1, :30] = False             # and at the start of row 1
  allowed = jnp.asarray(valid[:, None, :, None] & valid[:, None, None, :])
  calls = {"forward": [], "backward": []}
  real = {name: getattr(hopper, name) for name in calls}
  saved = gpu_kernel.get_options()
  try:
    gpu_kernel.set_options(forward="hopper", backward="hopper",
                           hopper=hopper.Config(block_k=64))
    for name in calls:
      setattr(hopper, name, lambda *a, _n=name, **kw: (calls[_n].append(kw), real[_n](*a, **kw))[1])

    (_, (out, lse)), grads = residual_loss(lambda q, k, v: flash_attention_gpu(
        q, k, v, M.CausalMask(), mask_array=allowed, return_residuals=True))(q, key, v)
  finally:
    for name in calls:
      setattr(hopper, name, real[name])
    gpu_kernel.set_options(**saved)
  assert all(c and c[0]["mask_array"] is not None for c in calls.values())
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  (_, (want, want_lse)), want_grads = residual_loss(lambda q, k, v: dot_product_attention(
      f32(q), f32(k), f32(v), mask=allowed, is_causal=True, implementation="xla",
      return_residuals=True))(q, key, v)
  empty = ~np.isfinite(np.asarray(want_lse))
  assert empty[0, :, 100:].all() and np.array_equal(~np.isfinite(np.asarray(lse)), empty)
  assert_close(out, want, TOL, "out")
  for g, w, name in zip(grads, want_grads, ("dq", "dk", "dv")):
    assert_close(g, w, 3e-2, name)


def test_one_row_bias_through_the_entry_point_with_its_gradient():
  """A learned per-key bias ``[B, 1, 1, S]`` in fp32 through ``flash_attention_gpu``: the Hopper
  forward and backward take it (counted, as its fp32 key vectors), and its gradient (``ds``
  summed over the query rows, by the Triton kernel of its own) matches the formula's,
  as do dQ, dK and dV."""
  b, t, n = 2, 128, 1
  q, key, v = inputs(b, t, t, n, 1, 64, jnp.bfloat16, seed=9)
  bias = 2.0 * jax.random.normal(jax.random.key(17), (b, 1, 1, t), jnp.float32)
  calls = {"forward": [], "backward": []}
  real = {name: getattr(hopper, name) for name in calls}
  saved = gpu_kernel.get_options()

  def loss(f):
    def g(q, k, v, bias):
      o = f(q, k, v, bias).astype(jnp.float32)
      return jnp.sum(o * jnp.cos(o))
    return jax.value_and_grad(g, argnums=(0, 1, 2, 3))

  try:
    gpu_kernel.set_options(forward="hopper", backward="hopper",
                           hopper=hopper.Config(block_k=64))
    for name in calls:
      setattr(hopper, name, lambda *a, _n=name, **kw: (calls[_n].append(kw), real[_n](*a, **kw))[1])
    _, grads = loss(lambda q, k, v, bias: flash_attention_gpu(
        q, k, v, M.CausalMask(), bias=bias))(q, key, v, bias)
  finally:
    for name in calls:
      setattr(hopper, name, real[name])
    gpu_kernel.set_options(**saved)
  assert all(c and c[0]["bias"].shape == (b, 1, 1, t) for c in calls.values())
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  _, want = loss(lambda q, k, v, bias: dot_product_attention(
      f32(q), f32(k), f32(v), bias, is_causal=True, implementation="xla"))(q, key, v, bias)
  assert grads[3].shape == bias.shape and grads[3].dtype == jnp.float32
  for g, w, name in zip(grads, want, ("dq", "dk", "dv", "dbias")):
    assert_close(g, w, 3e-2, name)


def _plan(**kw):
  q, key, v = inputs(1, 64, 64, 2, 1, 64, kw.pop("dtype", jnp.bfloat16))
  args = dict(static_mask=M.CausalMask(), q_offset=0, logits_soft_cap=None, alibi_slopes=None,
              segment_ids=None, kv_lengths=None, block_sizes=C.BlockSizes.gpu(),
              interpret=not ON_GPU, pow2_blocks=True, scale=0.125)
  args.update(kw)
  return C.make_plan(q, key, v, **args)


class Stripes(M.Mask):
  """A position mask the kernels do not know (even keys only)."""

  def __call__(self, q_idx, kv_idx, q_offset=0):
    return (kv_idx % 2 == 0) | (q_idx < -1)

  def __hash__(self):
    return 0

  def __eq__(self, other):
    return isinstance(other, Stripes)


def test_dispatch_reasons():
  """What stays on the Triton forward, and why (the reasons name the feature)."""
  saved = gpu_kernel.get_options()
  try:
    # the default, "auto": the Hopper kernels on a compiled run, Triton's when interpreted
    auto = gpu_kernel.hopper_reason(_plan())
    assert auto is None if ON_GPU else auto == "option forward='auto' interprets the Triton kernels"
    gpu_kernel.set_options(forward="triton")
    assert gpu_kernel.hopper_reason(_plan()) == "option forward='triton'"
    gpu_kernel.set_options(forward="hopper")
    assert gpu_kernel.hopper_reason(_plan()) is None
    assert "dtype float32" in gpu_kernel.hopper_reason(_plan(dtype=jnp.float32))
    assert "traced scale" in gpu_kernel.hopper_reason(_plan(scale=None))
    ids = jnp.zeros((1, 64), jnp.int32)
    assert gpu_kernel.hopper_reason(_plan(alibi_slopes=jnp.ones((2,)), segment_ids=(ids, ids),
                                          kv_lengths=jnp.full((1,), 50))) is None
    # a non-band mask: block lists, built from a static query offset
    assert gpu_kernel.hopper_reason(_plan(static_mask=M.GlobalTokensMask((0,)))) is None
    traced = []
    jax.jit(lambda offset: traced.append(gpu_kernel.hopper_reason(
        _plan(static_mask=M.GlobalTokensMask((0,)), q_offset=offset))) or offset)(3)
    assert "traced q_offset" in traced[0]
    assert "Stripes" in gpu_kernel.hopper_reason(_plan(static_mask=Stripes()))
    # a dense bias [B|1, N|1, T, S] in the inputs' dtype, a one-row bias of any float dtype, a
    # mask array [B|1, N|1, T|1, S]: the Hopper kernels; a full bias of another dtype or a mask
    # array with a bias: Triton's
    bias = jnp.zeros((1, 2, 64, 64), jnp.bfloat16)
    allowed = jnp.ones((1, 2, 64, 64), bool)
    assert gpu_kernel.hopper_reason(_plan(bias=bias)) is None
    assert gpu_kernel.hopper_reason(_plan(mask_array=allowed)) is None
    assert gpu_kernel.hopper_reason(_plan(bias=bias[:, :, :1])) is None
    assert gpu_kernel.hopper_reason(_plan(bias=bias[:, :, :1].astype(jnp.float32))) is None
    assert "float32" in gpu_kernel.hopper_reason(_plan(bias=bias.astype(jnp.float32)))
    assert "mask array with a bias" in gpu_kernel.hopper_reason(
        _plan(bias=bias, mask_array=allowed))
    assert gpu_kernel.hopper_reason(_plan(mask_array=allowed[:, :, :1])) is None
    gpu_kernel.set_options(backward="triton")
    assert gpu_kernel.hopper_reason(_plan(), "backward") == "option backward='triton'"
    gpu_kernel.set_options(backward="hopper")
    assert gpu_kernel.hopper_reason(_plan(), "backward") is None
    assert gpu_kernel.hopper_reason(_plan(bias=bias), "backward") is None
    assert gpu_kernel.hopper_reason(_plan(mask_array=allowed), "backward") is None
    assert gpu_kernel.hopper_reason(_plan(bias=bias[:, :, :1]), "backward") is None
    q, key, v = inputs(1, 64, 64, 2, 1, 256)
    wide = C.make_plan(q, key, v, static_mask=None, q_offset=0, logits_soft_cap=None,
                       alibi_slopes=None, segment_ids=None, kv_lengths=None,
                       block_sizes=C.BlockSizes.gpu(), interpret=not ON_GPU, pow2_blocks=True,
                       scale=0.1)
    assert gpu_kernel.hopper_reason(wide) is None
    assert "head sizes 256 / 256" in gpu_kernel.hopper_reason(wide, "backward")
  finally:
    gpu_kernel.set_options(**saved)


def test_shared_memory_limit_and_defaults():
  assert hopper.default_config(128).block_k == 128
  assert hopper.default_config(256).block_k == 64
  for h in (64, 128, 256):
    assert hopper.smem_bytes(h, hopper.default_config(h)) <= 227 * 1024
  reason = hopper.supports(dtype=jnp.bfloat16, head_dim=256, v_head_dim=256, static_mask=None,
                           config=hopper.Config(block_k=128, stages=3))
  assert "shared memory" in reason
  # Measured on an H200: 232,544 bytes at head size 128, 128-key blocks, 3 stages (over 227
  # KiB), with the log-sum-exp rows then in shared memory (512 bytes, a 1 KiB buffer) and Mosaic
  # GPU's default 2 KiB of cross-warp reduction space: the model's terms exactly.
  three = hopper.Config(block_k=128, stages=3)
  assert hopper.smem_bytes(128, three, segments=False) + 1024 + 2048 == 232_544
  # Without those two, three stages of 128 keys and two of 192 fit; with segment ids (the
  # rows' and each key slot's id vectors, 3 KiB) they do not, and the call is left to Triton.
  for cfg in (three, hopper.Config(block_k=192), hopper.Config(block_k=192, overlap=True,
                                                                pingpong=True)):
    assert hopper.smem_bytes(128, cfg, segments=False) <= 227 * 1024, cfg
    assert hopper.supports(dtype=jnp.bfloat16, head_dim=128, v_head_dim=128, static_mask=None,
                           config=cfg, segments=False) is None
    assert "shared memory" in hopper.supports(dtype=jnp.bfloat16, head_dim=128, v_head_dim=128,
                                              static_mask=None, config=cfg)
  assert hopper.smem_bytes(128, three) - hopper.smem_bytes(128, three, segments=False) == (
      3 * 1024 + 8 * 5)  # the rows' and three key slots' ids, five more barriers
  # segment ids with the default config fit
  assert hopper.smem_bytes(128, hopper.default_config(128)) <= 227 * 1024
  # a dense bias adds a [128, block_k] 16-bit tile per slot and its barriers: 128-key steps
  # still fit at head size 128 (with segment ids too), 64-key steps at 256
  for h in (64, 128, 256):
    cfg = hopper.default_config(h, bias=True)
    assert hopper.smem_bytes(h, cfg, bias=True) <= 227 * 1024
    assert hopper.smem_bytes(h, cfg, bias=True) - hopper.smem_bytes(h, cfg) == (
        2 * 2 * 128 * cfg.block_k + 8 * 2)
  assert hopper.default_config(128, bias=True).block_k == 128
  # a one-row bias: a [block_k] fp32 vector per slot (1 KiB at 128 keys and 2 stages) and its
  # barriers; the default 128-key steps with segment ids still fit at head size 128
  assert hopper.smem_bytes(128, hopper.Config(block_k=128), bias="row") - hopper.smem_bytes(
      128, hopper.Config(block_k=128)) == 1024 + 8 * 2
  assert hopper.default_config(128, bias="row").block_k == 128
  assert hopper.smem_bytes(128, hopper.default_config(128, bias="row"), bias="row") <= 227 * 1024
  assert hopper.supports_backward(head_dim=128, bias="row") is None
  # the backward: a [128, 64] bias tile per slot in both kernels (dQ at 64 keys per step)
  assert hopper.backward_smem_bytes(128, hopper.Config(), bias=True) - hopper.backward_smem_bytes(
      128, hopper.Config()) == 2 * 2 * 128 * 64 + 8 * 2
  assert hopper.supports_backward(head_dim=128, bias=True) is None
  assert "shared memory in the backward" in hopper.supports_backward(
      head_dim=128, config=hopper.Config(dq_block_k=128), bias=True)
  assert "shared memory" in hopper.supports(dtype=jnp.bfloat16, head_dim=128, v_head_dim=128,
                                            static_mask=None, config=three, segments=False,
                                            bias=True)
  assert "shared memory" in hopper.supports(dtype=jnp.bfloat16, head_dim=128, v_head_dim=128,
                                            static_mask=None,
                                            config=hopper.Config(block_k=256))
  # The backward: the dQ kernel streams dq_block_k keys per slot, the dK/dV kernel 64 rows
  # (head size 128, 2 stages: dQ at 128 keys is the larger CTA, 196 KiB with segment ids).
  kib = 1024
  wide = hopper.Config(dq_block_k=128)
  assert hopper.backward_smem_bytes(128, wide) == (  # q, do; k, v slots; vectors; barriers
      2 * 32 * kib + 2 * 64 * kib + 3 * kib + kib + 8 * (10 + 2 * 4 + 1))
  assert hopper.backward_smem_bytes(128, hopper.Config()) == (  # the dK/dV kernel's
      2 * 32 * kib + 2 * 32 * kib + kib + 3 * kib + 8 * (6 + 2 * 6 + 1))
  assert hopper.supports_backward(head_dim=128, config=wide) is None
  assert "shared memory in the backward" in hopper.supports_backward(  # 244 KiB
      head_dim=192, v_head_dim=128, config=wide)


def test_errors():
  with pytest.raises(ValueError, match="block_q"):
    hopper.Config(block_q=128)
  with pytest.raises(ValueError, match="block_k"):
    hopper.Config(block_k=96)
  with pytest.raises(ValueError, match="stages"):
    hopper.Config(stages=1)
  for regs in (244, 248, 56):
    with pytest.raises(ValueError, match=r"`registers` must be a multiple of 8 in \[64, 240\]"):
      hopper.Config(registers=regs)
  # two consumer warpgroups and the producer within 65,536 registers
  for regs, producer in ((232, 40), (240, 32), (128, 40)):
    assert hopper._registers(hopper.Config(registers=regs)) == (regs, producer)
    assert 256 * regs + 128 * producer <= 65536
  with pytest.raises(ValueError, match="`dq_block_k` must be 64 or 128, got 192"):
    hopper.Config(dq_block_k=192)
  with pytest.raises(ValueError, match="`backward_overlap` must be None"):
    hopper.Config(backward_overlap="yes")
  assert hopper.Config(overlap=True).overlaps_backward
  assert not hopper.Config(overlap=True, backward_overlap=False).overlaps_backward
  assert hopper.Config(backward_overlap=True).overlaps_backward
  q, key, v = inputs(1, 64, 64, 2, 1, 64, jnp.float32)
  with pytest.raises(ValueError, match="dtype float32"):
    hopper.forward(q, key, v)
  q, key, v = inputs(1, 64, 64, 2, 1, 96)
  with pytest.raises(ValueError, match="head sizes 96"):
    hopper.forward(q, key, v)
  q, key, v = inputs(1, 64, 64, 3, 2, 64)
  with pytest.raises(ValueError, match="multiple of key heads"):
    hopper.forward(q, key, v)
  q, key, v = inputs(1, 64, 64, 2, 1, 64)
  for bad in (jnp.zeros((1, 2, 2, 64), jnp.bfloat16), jnp.zeros((1, 3, 64, 64), jnp.bfloat16),
              jnp.zeros((1, 2, 64, 64), jnp.float32), jnp.zeros((1, 2, 1, 64), jnp.int32)):
    with pytest.raises(ValueError, match=r"`bias` must be \[B\|1, N\|1, T\|1, S\]"):
      hopper.forward(q, key, v, bias=bad)
  with pytest.raises(ValueError, match=r"`mask_array` must be \[B\|1, N\|1, T\|1, S\] with "
                                       r"\[B, N, T, S\] = \(1, 2, 64, 64\), got \(1, 2, 2, 64\)"):
    hopper.forward(q, key, v, mask_array=jnp.ones((1, 2, 2, 64), bool))
  with pytest.raises(ValueError, match="`mask_array` must be bool, got int32"):
    hopper.forward(q, key, v, mask_array=jnp.ones((1, 2, 64, 64), jnp.int32))
  with pytest.raises(ValueError, match="`bias` and `mask_array` stream through the same tiles"):
    hopper.backward(q, key, v, q, jnp.zeros((1, 2, 64)), q, bias=jnp.zeros((1, 2, 64, 64),
                    jnp.bfloat16), mask_array=jnp.ones((1, 2, 64, 64), bool))
  q, key, v = inputs(2, 64, 80, 2, 1, 64)
  ids = jnp.zeros((2, 64), jnp.int32)
  with pytest.raises(ValueError, match=r"`alibi_slopes` must have shape \[N\] = \(2,\)"):
    hopper.forward(q, key, v, alibi_slopes=jnp.ones((3,)))
  with pytest.raises(ValueError, match=r"`segment_ids` must be"):
    hopper.forward(q, key, v, segment_ids=(ids, ids))  # kv ids must be [B, S] = (2, 80)
  with pytest.raises(ValueError, match="`q_offset` must be a scalar"):
    hopper.forward(q, key, v, q_offset=jnp.zeros((2,), jnp.int32))
  # masks: a band, or built of full / causal / window / global-token masks (with a static offset)
  with pytest.raises(ValueError, match=r"unsupported call: mask Stripes \(band masks, and full / "
                                       r"causal / window / global-token masks joined by & and \|"):
    hopper.forward(q, key, v, mask=M.CausalMask() & Stripes())
  with pytest.raises(ValueError, match="mask OrMask with a traced q_offset"):
    jax.jit(lambda offset: hopper.forward(q, key, v, mask=LONGFORMER, q_offset=offset))(3)
  with pytest.raises(ValueError, match=r"`kv_lengths` must have shape \[B\] = \(2,\)"):
    hopper.backward(q, key, v, q, jnp.zeros((2, 2, 64)), q, kv_lengths=jnp.ones((1,), jnp.int32))
  with pytest.raises(ValueError, match="allowed"):
    gpu_kernel.set_options(forward="cuda")
  with pytest.raises(ValueError, match="hopper.Config"):
    gpu_kernel.set_options(hopper={"block_k": 64})


@pytest.mark.parametrize("h,mask,cap,schedule,data", [
    (64, None, None, "pingpong", False), (128, M.CausalMask(), None, "pingpong", False),
    (128, M.SlidingWindowMask(256, 0), 30.0, "plain", False),
    (256, M.CausalMask(), None, "pingpong", False),
    (128, M.CausalMask(), 30.0, "pingpong", True),
    (64, M.CausalMask(), None, "overlap", False), (256, None, 30.0, "overlap", False),
    (128, M.CausalMask(), 30.0, "overlap dq128", True),
    (128, M.CausalMask(), None, "both 240", False),
    ((192, 128), M.CausalMask(), None, "plain", False), ((192, 128), None, None, "overlap", True),
    ((64, 128), None, None, "plain", False), (128, None, None, "overlap 192 keys", False),
    (128, M.CausalMask(), None, "plain 3 stages", False),
    (128, M.CausalMask(), 30.0, "overlap persistent", True), (64, None, None, "persistent", False),
    (128, M.CausalMask(), None, "pingpong bias", True), (128, None, 30.0, "overlap bias", False),
    (64, M.CausalMask(), None, "overlap persistent bias", True),
    (128, M.CausalMask(), None, "pingpong mask", True),
    (128, M.CausalMask(), 30.0, "overlap row bias", True),
    # block lists: a mask array with a static offset, non-band masks
    (128, M.CausalMask(), None, "overlap mask", False),
    (128, LONGFORMER, 30.0, "overlap persistent", False),
    (64, sinks_and_window(256), None, "pingpong", False)])
def test_lowers_for_cuda(h, mask, cap, schedule, data):
  """The hardware program (wgmma from shared memory and registers, layouts, TMA, barriers) goes
  through Mosaic GPU's lowering to one custom call, for every head size and each schedule (the
  overlapped one: two wgmma groups in flight, the first awaited alone), and with segment ids, key
  lengths, ALiBi and a traced query offset (``data``); ``h`` a pair: query / key and value head
  sizes (192 / 128 writes its output through the query tiles' bytes, a ``RefUnion`` at 128-key
  steps; 64 / 128 into tiles of its own); with a dense bias ``[1, N, T, S]`` (``bias`` in the
  schedule: its tiles loaded from shared memory into the wgmma layout), or a mask array ``[B, 1,
  T, S]`` (``mask``: the same tiles, compared); with block lists (a mask array and a static
  offset, or a non-band mask: the producer's loads and the consumers' blocks read from the
  list); the backward wherever
  ``supports_backward`` takes the call (two kernels, or three with dK and dV apart at unequal
  sizes)."""
  h, hv = h if isinstance(h, tuple) else (h, h)
  q = jax.ShapeDtypeStruct((2, 1000, 4, h), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((2, 1000, 2, h), jnp.bfloat16)
  v = jax.ShapeDtypeStruct((2, 1000, 2, hv), jnp.bfloat16)
  ids = jax.ShapeDtypeStruct((2, 1000), jnp.int32)
  extra = (ids, ids, jax.ShapeDtypeStruct((2,), jnp.int32),
           jax.ShapeDtypeStruct((4,), jnp.float32),
           jax.ShapeDtypeStruct((), jnp.int32)) if data else ()

  def kw(*extra):
    if not extra:
      return {}
    q_ids, kv_ids, lengths, slopes, offset = extra
    return dict(segment_ids=(q_ids, kv_ids), kv_lengths=lengths, alibi_slopes=slopes,
                q_offset=offset)

  with_bias = "bias" in schedule or "mask" in schedule
  dense = "mask_array" if "mask" in schedule else "bias"
  bias = (jax.ShapeDtypeStruct((2, 1, 1000, 1000), bool) if dense == "mask_array" else
          jax.ShapeDtypeStruct((1, 4, 1, 1000), jnp.float32) if "row" in schedule else
          jax.ShapeDtypeStruct((1, 4, 1000, 1000), jnp.bfloat16))
  kind = "row" if "row" in schedule else with_bias
  cfg = hopper.Config(block_k=192 if "192" in schedule else hopper.default_config(
                          h, hv, bias=kind).block_k,
                      stages=3 if "3 stages" in schedule else 2,
                      persistent="persistent" in schedule,
                      pingpong=schedule in ("pingpong", "both 240", "pingpong bias"),
                      overlap=schedule.startswith(("overlap", "both")),
                      registers=240 if schedule == "both 240" else 232,
                      dq_block_k=128 if "dq128" in schedule else 64)
  assert hopper.smem_bytes(h, cfg, hv, segments=data, bias=kind) <= 227 * 1024
  if with_bias:
    f = lambda q, k, v, b, *extra: hopper.forward(  # noqa: E731
        q, k, v, mask=mask, logits_soft_cap=cap, config=cfg, **{dense: b}, **kw(*extra))
    text = jax.export.export(jax.jit(f), platforms=("cuda",))(q, k, v, bias,
                                                              *extra).mlir_module()
    assert re.findall(r"custom_call @(mosaic_gpu\w*)", text)
    if hopper.supports_backward(head_dim=h, v_head_dim=hv, config=cfg, bias=kind):
      return
    lse = jax.ShapeDtypeStruct((2, 4, 1000), jnp.float32)
    o = jax.ShapeDtypeStruct((2, 1000, 4, hv), jnp.bfloat16)
    g = lambda q, k, v, o, lse, do, b, *extra: hopper.backward(  # noqa: E731
        q, k, v, o, lse, do, mask=mask, logits_soft_cap=cap, config=cfg, **{dense: b},
        **kw(*extra))
    text = jax.export.export(jax.jit(g), platforms=("cuda",))(q, k, v, o, lse, o, bias,
                                                              *extra).mlir_module()
    assert len(re.findall(r"custom_call @(mosaic_gpu\w*)", text)) == 2
    return
  f = lambda q, k, v, *extra: hopper.forward(  # noqa: E731
      q, k, v, mask=mask, logits_soft_cap=cap, config=cfg, **kw(*extra))
  text = jax.export.export(jax.jit(f), platforms=("cuda",))(q, k, v, *extra).mlir_module()
  assert re.findall(r"custom_call @(mosaic_gpu\w*)", text)
  if hopper.supports_backward(head_dim=h, v_head_dim=hv, config=cfg):
    return
  lse = jax.ShapeDtypeStruct((2, 4, 1000), jnp.float32)
  o = jax.ShapeDtypeStruct((2, 1000, 4, hv), jnp.bfloat16)
  g = lambda q, k, v, o, lse, do, *extra: hopper.backward(  # noqa: E731
      q, k, v, o, lse, do, mask=mask, logits_soft_cap=cap, config=cfg, **kw(*extra))
  text = jax.export.export(jax.jit(g), platforms=("cuda",))(q, k, v, o, lse, o,
                                                            *extra).mlir_module()
  # dQ and dK/dV, or (unequal sizes) dQ, dK and dV
  assert len(re.findall(r"custom_call @(mosaic_gpu\w*)", text)) == (2 if h == hv else 3)
