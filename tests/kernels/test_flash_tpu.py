"""The TPU (Mosaic) flash-attention kernel, in interpret mode, against the attention formula.

Every case compares outputs, log-sum-exps and the gradients of a non-linear loss (so ``dO`` is not
constant) with ``dot_product_attention(..., implementation="xla")``, which materializes the logits.
Tiny shapes with 8- or 16-row blocks make every case span several query and key blocks, so block
skipping, ragged last blocks and the FULL / PARTIAL paths all run.

Tolerances: fp32 kernels differ from the formula only in summation order (online softmax, blocked
matmuls): 2e-5 relative on outputs, 1e-4 on gradients.  bf16 kernels round probabilities to bf16
before the ``p @ v`` matmul (as every flash kernel does) and return bf16: compared with the fp32
formula on the same bf16 inputs within 2e-2 (about 3 bf16 ulps at magnitude 1).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jaxattn.ops import masks as M
from jaxattn.ops.attention import attention_gradients, dot_product_attention
from pallas_kernels.flash_attention import BlockSizes, common, flash_attention_tpu
from pallas_kernels.flash_attention import tpu as tpu_kernel

# Interpret-mode programs are large while loops; XLA's CPU backend compiles them twice as fast at
# optimization level 0, and they run in milliseconds either way.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
SMALL = BlockSizes(block_q=16, block_k=16, block_q_dkv=8, block_k_dkv=8)


def run(f, *args):
  return jax.jit(f).lower(*args).compile(compiler_options=FAST_COMPILE)(*args)


def inputs(b, t, s, n, k, h, hv, dtype=jnp.float32, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(ks[0], (b, t, n, h), jnp.float32).astype(dtype)
  key = jax.random.normal(ks[1], (b, s, k, h), jnp.float32).astype(dtype)
  v = jax.random.normal(ks[2], (b, s, k, hv), jnp.float32).astype(dtype)
  return q, key, v


def packed_ids(b, length, seed):
  """Sorted segment ids ``[B, length]`` with a few segments per row (packed sequences)."""
  rng = np.random.default_rng(seed)
  cuts = np.sort(rng.integers(1, length, size=(b, 3)), axis=1)
  ids = (np.arange(length)[None, :, None] >= cuts[:, None, :]).sum(-1)
  return jnp.asarray(ids, jnp.int32)


def loss_and_grads(attn, q, k, v):
  """Value, (out, lse) and gradients of ``sum(out * cos(out)) + sum(0.1 * finite lse)``."""

  def loss(q, k, v):
    out, lse = attn(q, k, v)
    lse_term = jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)) * 0.1
    o = out.astype(jnp.float32)
    return jnp.sum(o * jnp.cos(o)) + lse_term, (out, lse)

  (_, (out, lse)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
  return out, lse, grads


def assert_close(got, want, rtol, name):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  scale = max(1.0, float(np.max(np.abs(want[np.isfinite(want)]), initial=0.0)))
  np.testing.assert_allclose(got, want, rtol=0, atol=rtol * scale, err_msg=name)


# name -> (shape B T S N K H h, dot_product_attention keyword arguments)
CASES = {
    # MHA, no mask, T and S not multiples of the blocks, value head size != key head size.
    "full_ragged": ((2, 40, 33, 2, 2, 16, 24), {}),
    "causal_gqa": ((1, 48, 48, 4, 2, 16, 16), {"is_causal": True}),
    "window_mqa": ((1, 40, 40, 4, 1, 16, 16), {"local_window_size": (9, 5)}),
    "causal_window_alibi": ((1, 48, 48, 2, 2, 16, 16),
                            {"is_causal": True, "local_window_size": 12, "alibi": True}),
    "segments_causal": ((2, 48, 48, 2, 1, 16, 16), {"is_causal": True, "segments": True}),
    # Row 1 has no valid key at all: its outputs are zeros and its lse -inf, never NaN.
    "padding_softcap_alibi": ((2, 24, 40, 2, 2, 16, 16),
                              {"kv_lengths": (29, 0), "logits_soft_cap": 3.0, "alibi": True}),
    # A decode-like chunk: 8 queries at positions 30..37 of a 40-key cache.
    "offset_causal": ((1, 8, 40, 4, 2, 16, 16), {"is_causal": True, "q_offset": 30}),
    "global_tokens_or_window": ((1, 40, 40, 2, 2, 16, 16), {"global_window": True}),
    # One query (the rest of its block padding) against 200 keys, ALiBi without causality: slope
    # 0.5 x a distance past 176 exceeds 88, where the padded rows' p overflowed (NaN in dK / dV).
    "alibi_one_query_far_keys": ((1, 1, 200, 2, 2, 16, 16), {"alibi": True}),
}


def build_case(shape, kw, dtype=jnp.float32, seed=0):
  b, t, s, n, k, h, hv = shape
  q, key, v = inputs(b, t, s, n, k, h, hv, dtype, seed)
  kw = dict(kw)
  ref_kw = {}
  if kw.pop("alibi", False):
    ref_kw["alibi_slopes"] = jnp.asarray(0.5 ** np.arange(1, n + 1), jnp.float32)
  if kw.pop("segments", False):
    ids = packed_ids(b, t, seed)
    ref_kw["segment_ids"] = ids
  if "kv_lengths" in kw:
    ref_kw["kv_lengths"] = jnp.asarray(kw.pop("kv_lengths"), jnp.int32)
  if kw.pop("global_window", False):
    ref_kw["mask"] = M.sliding_window(4, causal=False) | M.GlobalTokensMask((0, 17))
  ref_kw.update(kw)
  return (q, key, v), ref_kw


def kernel_fn(ref_kw, block_sizes=SMALL, **extra):
  mask = M.make_mask(is_causal=ref_kw.get("is_causal", False),
                     local_window_size=ref_kw.get("local_window_size"),
                     segment_ids=ref_kw.get("segment_ids"), kv_lengths=ref_kw.get("kv_lengths"),
                     mask=ref_kw.get("mask"))

  def attn(q, k, v):
    return flash_attention_tpu(
        q, k, v, mask, alibi_slopes=ref_kw.get("alibi_slopes"),
        logits_soft_cap=ref_kw.get("logits_soft_cap"), q_offset=ref_kw.get("q_offset", 0),
        return_residuals=True, block_sizes=block_sizes, interpret=True, **extra)

  return attn


def reference_fn(ref_kw):
  def attn(q, k, v):
    return dot_product_attention(q.astype(jnp.float32), k.astype(jnp.float32),
                                 v.astype(jnp.float32), implementation="xla", return_residuals=True,
                                 **ref_kw)
  return attn


@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_gradients_match_formula(name):
  shape, kw = CASES[name]
  (q, k, v), ref_kw = build_case(shape, kw)
  out, lse, grads = run(lambda q, k, v: loss_and_grads(kernel_fn(ref_kw), q, k, v), q, k, v)
  r_out, r_lse, r_grads = run(lambda q, k, v: loss_and_grads(reference_fn(ref_kw), q, k, v),
                              q, k, v)
  assert not np.isnan(np.asarray(out)).any()
  assert_close(out, r_out, 2e-5, "out")
  np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(r_lse))
  assert_close(jnp.where(jnp.isfinite(lse), lse, 0), jnp.where(jnp.isfinite(r_lse), r_lse, 0), 2e-5,
               "lse")
  for g, rg, label in zip(grads, r_grads, ("dq", "dk", "dv")):
    assert_close(g, rg, 1e-4, label)
  if name == "padding_softcap_alibi":  # batch row 1 has no valid key
    np.testing.assert_array_equal(np.asarray(out[1]), 0.0)
    assert np.all(np.asarray(lse[1]) == -np.inf)
    np.testing.assert_array_equal(np.asarray(grads[0][1]), 0.0)
    np.testing.assert_array_equal(np.asarray(grads[1][1]), 0.0)


def test_traced_q_offset_matches_static():
  (q, k, v), ref_kw = build_case(*CASES["offset_causal"])
  ref_kw.pop("q_offset")
  mask = M.CausalMask()

  def f(q, k, v, offset):
    return flash_attention_tpu(q, k, v, mask, q_offset=offset, block_sizes=SMALL, interpret=True)

  got = run(f, q, k, v, jnp.int32(30))  # traced: no static block skipping, every block visited
  want = run(lambda q, k, v: dot_product_attention(q, k, v, is_causal=True, q_offset=30,
                                                   implementation="xla"), q, k, v)
  assert_close(got, want, 2e-5, "out")


def test_bf16_causal_gqa_alibi():
  shape, kw = (1, 48, 40, 4, 2, 16, 16), {"is_causal": True, "alibi": True}
  (q, k, v), ref_kw = build_case(shape, kw, dtype=jnp.bfloat16)
  out, lse, grads = run(lambda q, k, v: loss_and_grads(kernel_fn(ref_kw), q, k, v), q, k, v)
  assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
  r_out, r_lse, r_grads = run(lambda q, k, v: loss_and_grads(reference_fn(ref_kw), q, k, v),
                              q, k, v)
  assert_close(out, r_out, 2e-2, "out")
  assert_close(lse, r_lse, 1e-3, "lse")  # lse is fp32 from fp32 logits of the same bf16 inputs
  for g, rg, label in zip(grads, r_grads, ("dq", "dk", "dv")):
    assert_close(g, rg, 3e-2, label)


@settings(max_examples=3, deadline=None, derandomize=True)
@given(t=st.integers(1, 40), s=st.integers(1, 40), groups=st.sampled_from([1, 2]),
       kv_heads=st.sampled_from([1, 2]), mask=st.sampled_from(["none", "causal", "window"]))
def test_forward_random_shapes(t, s, groups, kv_heads, mask):
  n = kv_heads * groups
  q, k, v = inputs(1, t, s, n, kv_heads, 8, 8, seed=t * 41 + s)
  kw = {"none": {}, "causal": {"is_causal": True, "q_offset": max(0, s - t)},
        "window": {"local_window_size": (5, 3)}}[mask]
  got = run(lambda q, k, v: kernel_fn(kw, BlockSizes(8, 8, 8, 8))(q, k, v)[0], q, k, v)
  want = run(lambda q, k, v: dot_product_attention(q, k, v, implementation="xla", **kw), q, k, v)
  assert_close(got, want, 2e-5, "out")


def test_no_races_in_any_kernel(race_states):
  """TPU-semantics interpreter with race detection over the forward, dQ and dK/dV kernels."""
  pltpu = pytest.importorskip("jax.experimental.pallas.tpu")
  states = race_states
  shape, kw = (1, 16, 16, 2, 1, 8, 8), {"is_causal": True, "segments": True}
  (q, k, v), ref_kw = build_case(shape, kw)
  params = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)
  mask = M.make_mask(is_causal=True, segment_ids=ref_kw["segment_ids"])

  def loss(q, k, v):
    out = flash_attention_tpu(q, k, v, mask, block_sizes=BlockSizes(8, 8, 8, 8), interpret=params)
    return jnp.sum(out * jnp.sin(out))

  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  jax.block_until_ready(grads)
  assert len(states) >= 3, "expected the forward, dQ and dK/dV kernels to be interpreted"
  assert not any(st_.races_found for st_ in states)
  ref = reference_fn(ref_kw)
  r_grads = run(jax.grad(lambda q, k, v: jnp.sum((o := ref(q, k, v)[0]) * jnp.sin(o)),
                         argnums=(0, 1, 2)), q, k, v)
  for g, rg in zip(grads, r_grads):
    assert_close(g, rg, 1e-4, "grad")


def test_given_residuals_run_only_the_backward_kernels_race_free(race_states):
  """``residuals=(out, lse)`` of a larger call (here: the whole rows, of which the call sees one
  key block of 13): the dQ and dK/dV kernels alone run from them, race-free, and give that
  block's share of the whole call's gradients."""
  pltpu = pytest.importorskip("jax.experimental.pallas.tpu")
  q, k, v = inputs(1, 16, 29, 2, 1, 8, 8, seed=3)
  d_out = jax.random.normal(jax.random.key(4), q.shape)
  mask = M.CausalMask()
  params = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)

  def whole(q, k, v):
    return dot_product_attention(q, k, v, mask=mask, q_offset=13, return_residuals=True,
                                 implementation="xla")
  (out, lse), vjp = jax.vjp(whole, q, k, v)
  want = vjp((d_out, jnp.zeros_like(lse)))

  def block(q, kb, vb):   # keys [16, 29): query row i sits at key position i + 13 - 16
    return flash_attention_tpu(q, kb, vb, mask, q_offset=-3, return_residuals=True,
                               residuals=(out, lse), block_sizes=BlockSizes(8, 8, 8, 8),
                               interpret=params)
  got_out, block_vjp = jax.vjp(block, q, k[:, 16:], v[:, 16:])
  np.testing.assert_array_equal(got_out[0], out)   # returned as given
  dq, dk, dv = jax.jit(block_vjp)((d_out, jnp.zeros_like(lse)))
  assert len(race_states) == 2, "expected the dQ and dK/dV kernels alone"
  assert not any(st_.races_found for st_ in race_states)
  assert_close(dk, want[1][:, 16:], 1e-4, "dk")
  assert_close(dv, want[2][:, 16:], 1e-4, "dv")
  # the query's gradient is the sum over key blocks: the first block's share is what is left
  dq_first = attention_gradients(q, k[:, :16], v[:, :16], out, lse, d_out, mask=mask,
                                 q_offset=13, implementation="xla")[0]
  assert_close(dq + dq_first, want[0], 1e-4, "dq")


# ----------------------------------------------------------------------------------------------
# Block tables: what the grid visits
# ----------------------------------------------------------------------------------------------


def _plan(t, s, mask=None, bq=16, bk=16, q_offset=0, segments=None, lengths=None, b=1):
  q = jnp.zeros((b, t, 2, 8))
  k = jnp.zeros((b, s, 2, 8))
  return common.make_plan(q, k, k, static_mask=mask, q_offset=q_offset, logits_soft_cap=None,
                          alibi_slopes=None, segment_ids=segments, kv_lengths=lengths,
                          block_sizes=BlockSizes(bq, bk, bq, bk), interpret=True)


def _decode(entries, counts):
  entries, counts = np.asarray(entries), np.asarray(counts)
  return entries >> common.KIND_BITS, entries & 3, counts


def test_causal_tables_skip_upper_blocks_and_redirect_padding_steps():
  plan = _plan(64, 64, M.CausalMask())
  counts = common.block_counts((1, 64, 2, 8), (1, 64, 2, 8), M.CausalMask(),
                               block_sizes=BlockSizes(16, 16, 16, 16))
  assert counts == {"full": 6, "partial": 4, "empty": 6, "total": 16}
  cols, kinds, counts = _decode(*common.block_tables(plan))
  assert cols.shape == (1, 4, 4)  # width = widest row (the last query block sees 4 key blocks)
  for i in range(4):
    n_full, n_part = counts[0, i]
    assert (n_full, n_part) == (i, 1)
    # FULL blocks first, then the diagonal PARTIAL block, then padding steps (kind EMPTY) that
    # point at the last non-empty block so the pipeline fetches nothing new.
    assert list(cols[0, i, :i + 1]) == list(range(i)) + [i]
    assert list(kinds[0, i, :i + 1]) == [M.FULL] * i + [M.PARTIAL]
    assert np.all(kinds[0, i, i + 1:] == M.EMPTY) and np.all(cols[0, i, i + 1:] == i)


def test_window_tables_are_banded_and_ragged_keys_are_partial():
  plan = _plan(64, 60, M.sliding_window(16, causal=True))
  cols, kinds, counts = _decode(*common.block_tables(plan))
  assert cols.shape[-1] == 2  # a 16-wide causal window touches at most 2 key blocks of 16
  np.testing.assert_array_equal(counts[0].sum(-1), [1, 2, 2, 2])
  # The last key block holds 4 padding keys: never FULL.
  assert not np.any((cols == 3) & (kinds == M.FULL))


def test_data_tables_skip_other_segments_and_padding_per_row():
  ids = jnp.asarray([[0] * 16 + [1] * 16, [0] * 32], jnp.int32)
  plan = _plan(32, 32, segments=(ids, ids), lengths=jnp.asarray([32, 10]), b=2)
  cols, kinds, counts = _decode(*common.block_tables(plan, q_ids=ids, kv_ids=ids,
                                                     kv_lengths=jnp.asarray([32, 10])))
  # Row 0: two segments, each a whole block: only the diagonal, and it needs no mask.
  np.testing.assert_array_equal(counts[0], [[1, 0], [1, 0]])
  np.testing.assert_array_equal(cols[0, :, 0], [0, 1])
  # Row 1: one segment but only 10 valid keys: key block 1 is empty, block 0 partial.
  np.testing.assert_array_equal(counts[1], [[0, 1], [0, 1]])
  # The transposed (dK/dV) table lists the same pairs.
  cols_t, _, counts_t = _decode(*common.block_tables(plan, q_ids=ids, kv_ids=ids,
                                                     kv_lengths=jnp.asarray([32, 10]),
                                                     transpose=True))
  np.testing.assert_array_equal(counts_t[1], [[0, 2], [0, 0]])
  np.testing.assert_array_equal(counts_t[0], [[1, 0], [1, 0]])


# ----------------------------------------------------------------------------------------------
# Dispatcher, lowering and errors
# ----------------------------------------------------------------------------------------------


def test_dispatcher_uses_the_kernel():
  q, k, v = inputs(2, 24, 24, 4, 2, 16, 16)
  ids = packed_ids(2, 24, 3)
  kw = dict(is_causal=True, segment_ids=ids, kv_lengths=jnp.asarray([24, 20]),
            return_residuals=True)
  out, lse = run(lambda q, k, v: dot_product_attention(q, k, v, implementation="pallas_tpu", **kw),
                 q, k, v)
  r_out, r_lse = run(lambda q, k, v: dot_product_attention(q, k, v, implementation="xla", **kw),
                     q, k, v)
  assert_close(out, r_out, 2e-5, "out")
  assert_close(lse, r_lse, 2e-5, "lse")


def test_errors_name_the_argument():
  q, k, v = inputs(1, 8, 8, 2, 2, 8, 8)
  with pytest.raises(ValueError, match="at most one SegmentMask"):
    dot_product_attention(q, k, v, mask=M.SegmentMask(ids := jnp.zeros((1, 8), jnp.int32), ids)
                          & M.SegmentMask(ids, ids), implementation="pallas_tpu")
  ids = jnp.zeros((1, 8), jnp.int32)
  with pytest.raises(ValueError, match="OrMask"):
    flash_attention_tpu(q, k, v, M.CausalMask() | M.SegmentMask(ids, ids))
  with pytest.raises(ValueError, match="block_q"):
    BlockSizes(block_q=12, block_k=16, block_q_dkv=16, block_k_dkv=16)
  with pytest.raises(ValueError, match="multiple of the smaller"):
    BlockSizes(block_q=128, block_k=128, block_q_dkv=96, block_k_dkv=128)
  with pytest.raises(ValueError, match="alibi_slopes"):
    flash_attention_tpu(q, k, v, alibi_slopes=jnp.ones((3,)))
  with pytest.raises(ValueError, match="segment ids"):
    flash_attention_tpu(q, k, v, M.SegmentMask(jnp.zeros((1, 7), jnp.int32), ids))
  with pytest.raises(ValueError, match="multiple of key/value heads"):
    flash_attention_tpu(q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2))
  with pytest.raises(ValueError, match="block_sizes"):
    flash_attention_tpu(q, k, v, block_sizes=(16, 16))


def test_default_tpu_blocks_fit_16mib_of_vmem_and_are_compute_bound():
  bs = BlockSizes.tpu()
  for est in (tpu_kernel.vmem_bytes_forward(bs.block_q, bs.block_k, 128, 128, 2),
              tpu_kernel.vmem_bytes_dq(bs.block_q, bs.block_k, 128, 128, 2),
              tpu_kernel.vmem_bytes_dkv(bs.block_q_dkv, bs.block_k_dkv, 128, 128, 2)):
    assert 2**20 < est < 16 * 2**20
  # bf16 forward intensity is about block_q FLOP per HBM byte; v6e's ridge is 918e12 / 1638e9.
  assert bs.block_q > 918e12 / 1638e9
