"""The chunked (online-softmax, block-skipping) attention against the reference formula.

Every case runs ``dot_product_attention`` twice on the same inputs, ``implementation="xla"`` (the
reference that materializes ``T x S`` logits) and ``"xla_chunked"`` with tiny blocks (8 query x 16
key rows) on lengths that are not multiples of them, so ragged last blocks, many FULL / PARTIAL /
EMPTY blocks and the padding of keys are all exercised; outputs and the gradients w.r.t. query,
key, value and bias (``jax.vjp`` with a random cotangent) must agree.

Tolerances: fp32 ``1e-5`` (the two paths sum the same fp32 terms in a different order: blockwise
online softmax vs one softmax; errors measured ~1e-6).  bf16: ``2e-2`` of the largest reference
magnitude: bf16 keeps 8 significant bits (one rounding = up to 2^-9 ~ 0.2% relative), the outputs
and gradients are rounded to bf16 at the end of both paths and the chunked path also rounds the
probabilities and ``dS`` to bf16 before its matmuls, as flash kernels do; a few such roundings
accumulate to well under 2%.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxattn.ops import attention as attention_mod
from jaxattn.ops.attention import dot_product_attention
from jaxattn.ops.attention_chunked import block_schedule, chunked_attention, split_static
from jaxattn.ops.masks import (AndMask, CausalMask, GlobalTokensMask, PaddingMask, SegmentMask,
                               sliding_window)

BLOCK_Q, BLOCK_K = 8, 16
F32_TOL = 1e-5
BF16_TOL = 2e-2


@pytest.fixture
def small_blocks(monkeypatch):
  """Points ``implementation="xla_chunked"`` at the chunked path with tiny blocks, then restores."""
  monkeypatch.setitem(attention_mod._REGISTRY, "xla_chunked",
                      functools.partial(chunked_attention, block_q=BLOCK_Q, block_k=BLOCK_K))


def _inputs(seed=0, b=2, t=37, s=45, n=4, kh=2, h=16, hv=12, dtype=jnp.float32, bias_shape=None):
  """Random inputs and output cotangents (NumPy RNG: no compilation for the test data)."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)
  q, k, v = normal(b, t, n, h), normal(b, s, kh, h), normal(b, s, kh, hv)
  bias = None if bias_shape is None else normal(*bias_shape)
  cot = (normal(b, t, n, hv), jnp.asarray(rng.standard_normal((b, n, t), np.float32)))
  return q, k, v, bias, cot


def _fwd_and_grads(impl, q, k, v, bias, cot, **kwargs):
  """(out, lse, dq, dk, dv, dbias) of one implementation, as one jitted program.

  The cotangent of the log-sum-exp output is random too, so its gradient (``p * d_lse``) is checked.
  """

  @jax.jit
  def run(q, k, v, bias, cot):
    def f(q, k, v, bias):
      return dot_product_attention(q, k, v, bias, implementation=impl, return_residuals=True,
                                   **kwargs)

    (out, lse), vjp = jax.vjp(f, q, k, v, bias)
    d_out, d_lse = cot
    return (out, lse) + tuple(vjp((d_out.astype(out.dtype), d_lse)))

  return run(q, k, v, bias, cot)


def _assert_close(got, want, tol, what):
  got = np.asarray(jnp.asarray(got, jnp.float32))
  want = np.asarray(jnp.asarray(want, jnp.float32))
  assert got.shape == want.shape, (what, got.shape, want.shape)
  assert not np.isnan(got).any(), f"{what}: NaN"
  finite = np.isfinite(want)
  np.testing.assert_array_equal(np.isfinite(got), finite, err_msg=f"{what}: -inf pattern")
  scale = max(1.0, float(np.abs(want[finite]).max(initial=0.0)))
  np.testing.assert_allclose(got[finite], want[finite], atol=tol * scale, rtol=tol,
                             err_msg=what)


def _compare(q, k, v, bias, cot, tol=F32_TOL, **kwargs):
  ref = _fwd_and_grads("xla", q, k, v, bias, cot, **kwargs)
  got = _fwd_and_grads("xla_chunked", q, k, v, bias, cot, **kwargs)
  for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dbias"), got, ref):
    if b is None:
      assert a is None, name
      continue
    _assert_close(a, b, tol, name)
  return got


# ----------------------------------------------------------------------------------------------
# Forward, log-sum-exp and gradients against the reference
# ----------------------------------------------------------------------------------------------

SEG = np.array([[0] * 10 + [1] * 20 + [2] * 15, [5] * 45])  # [B=2, S=45]
SLOPES = np.array([0.5, 0.25, 0.125, 0.0625])

# Each case combines several features (compiling is what costs time here).  Defaults: B=2, T=37,
# S=45, N=4 query heads sharing K=2 KV heads (GQA), H=16, value head dim h=12.
CASES = {
    "full_bias_bnts": dict(bias_shape=(1, 4, 37, 45)),
    "causal_softcap_bias_b11s": dict(is_causal=True, logits_soft_cap=3.0, bias_shape=(2, 1, 1, 45)),
    "window_causal_alibi_bias_bnt1": dict(is_causal=True, local_window_size=9,
                                          alibi_slopes=SLOPES, bias_shape=(2, 4, 37, 1)),
    "window_two_sided_mask_array": dict(local_window_size=6, mask="random"),
    "window_left_right_segments": dict(local_window_size=(11, 3), is_causal=True,
                                       segment_ids=(SEG[:, :37], SEG)),
    "window_left_only_mqa": dict(local_window_size=(5, None), kh=1),
    "kv_lengths_q_offset_mha": dict(kv_lengths=np.array([17, 45]), is_causal=True, q_offset=8,
                                    kh=4),
    "global_tokens": dict(mask=sliding_window(3, causal=False) | GlobalTokensMask((0, 20))),
    "decode_at_offset": dict(t=1, is_causal=True, q_offset=40, kv_lengths=np.array([41, 41])),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference_f32(small_blocks, case):
  kw = dict(CASES[case])
  shape_kw = {name: kw.pop(name) for name in ("bias_shape", "kh", "t") if name in kw}
  q, k, v, bias, cot = _inputs(seed=len(case), **shape_kw)
  if isinstance(kw.get("mask"), str):
    kw["mask"] = np.random.default_rng(9).random((2, 1, q.shape[1], 45)) < 0.7
  _compare(q, k, v, bias, cot, **kw)


def test_fully_masked_rows_give_zeros_not_nan(small_blocks):
  """Batch row 0 has no valid key at all; batch row 1 loses its first query rows to the mask."""
  q, k, v, bias, cot = _inputs(seed=6, t=20, s=20, bias_shape=(1, 4, 20, 20))
  mask = np.ones((2, 1, 20, 20), bool)
  mask[1, :, :5, :] = False
  got = _compare(q, k, v, bias, cot, mask=mask, kv_lengths=np.array([0, 20]), is_causal=True)
  out, lse = got[0], got[1]
  assert np.all(np.asarray(out[0]) == 0) and np.all(np.asarray(out[1, :5]) == 0)
  assert np.all(np.isneginf(np.asarray(lse[0]))) and np.all(np.isneginf(np.asarray(lse[1, :, :5])))
  for g in got[2:]:
    assert np.isfinite(np.asarray(g)).all()


def test_bf16(small_blocks):
  q, k, v, bias, cot = _inputs(seed=7, dtype=jnp.bfloat16, bias_shape=(1, 4, 37, 45))
  got = _compare(q, k, v, bias, cot, tol=BF16_TOL, is_causal=True, local_window_size=20)
  assert got[0].dtype == jnp.bfloat16 and got[2].dtype == jnp.bfloat16
  assert got[1].dtype == jnp.float32


# ----------------------------------------------------------------------------------------------
# Traced q_offset, transformations, dispatch, caching
# ----------------------------------------------------------------------------------------------


def test_traced_q_offset_matches_static(small_blocks):
  """A traced offset cannot skip blocks statically; values and gradients stay exact."""
  q, k, v, _, _ = _inputs(seed=11, t=12, s=45)

  def loss(impl, q, k, v, off):
    out = dot_product_attention(q, k, v, is_causal=True, local_window_size=7, q_offset=off,
                                implementation=impl)
    return jnp.sum(out**2), out

  traced = jax.jit(jax.value_and_grad(functools.partial(loss, "xla_chunked"), argnums=(0, 1, 2),
                                      has_aux=True))
  for off in (0, 33):  # the reference sees a static offset
    (_, out), grads = traced(q, k, v, jnp.int32(off))
    (_, out_ref), grads_ref = jax.value_and_grad(functools.partial(loss, "xla"), argnums=(0, 1, 2),
                                                 has_aux=True)(q, k, v, off)
    _assert_close(out, out_ref, F32_TOL, f"out, offset {off}")
    for a, b in zip(grads, grads_ref):
      _assert_close(a, b, F32_TOL, f"grad, offset {off}")


def test_vmap_of_grad(small_blocks):
  q, k, v, _, _ = _inputs(seed=13, b=1, t=19, s=19)
  qs, ks, vs = (jnp.stack([x, 2 * x, -x]) for x in (q, k, v))  # [3, B, ...]

  def loss(impl, q, k, v):
    return jnp.sum(jnp.tanh(dot_product_attention(q, k, v, is_causal=True, implementation=impl)))

  grad = lambda impl: jax.jit(jax.vmap(jax.grad(functools.partial(loss, impl), argnums=(0, 1, 2))))
  for a, b in zip(grad("xla_chunked")(qs, ks, vs), grad("xla")(qs, ks, vs)):
    _assert_close(a, b, F32_TOL, "vmap(grad)")


def test_default_implementation_and_blocks():
  """``implementation=None`` on CPU is the chunked path; default blocks, one ragged block here."""
  q, k, v, _, _ = _inputs(seed=14, t=70, s=70)
  want = dot_product_attention(q, k, v, is_causal=True, implementation="xla")
  impl = None if jax.default_backend() == "cpu" else "xla_chunked"
  got = dot_product_attention(q, k, v, is_causal=True, implementation=impl)
  _assert_close(got, want, F32_TOL, "default")


def test_traced_once_per_configuration():
  from jaxattn.ops import attention_chunked as chunked_mod
  q, k, v, _, _ = _inputs(seed=15, t=9, s=9)
  chunked_mod._build.cache_clear()
  for i in range(3):
    chunked_attention(q * i, k, v, mask=CausalMask(), scale=0.25, block_q=4, block_k=4)
  info = chunked_mod._build.cache_info()
  assert (info.misses, info.hits) == (1, 2)


def test_invalid_block_size():
  q, k, v, _, _ = _inputs(seed=16, t=9, s=9)
  with pytest.raises(ValueError, match="block_q"):
    chunked_attention(q, k, v, scale=0.25, block_q=0)


# ----------------------------------------------------------------------------------------------
# Block skipping really happens
# ----------------------------------------------------------------------------------------------


def test_block_schedule_counts():
  shape = (1, 64, 4, 16)
  full = block_schedule(shape, shape, block_q=16, block_k=16)
  causal = block_schedule(shape, shape, mask=CausalMask(), block_q=16, block_k=16)
  window = block_schedule(shape, shape, mask=sliding_window(16), block_q=16, block_k=16)
  assert full == {"full": 16, "partial": 0, "empty": 0, "total": 16}
  assert causal == {"full": 6, "partial": 4, "empty": 6, "total": 16}  # 10 of 16 computed
  assert window["full"] + window["partial"] == 7  # the diagonal and the one below it
  long = (1, 4096, 4, 16)
  causal = block_schedule(long, long, mask=CausalMask(), block_q=256, block_k=256)
  assert causal["full"] + causal["partial"] == 16 * 17 // 2  # about half of 256
  window = block_schedule(long, long, mask=sliding_window(256), block_q=256, block_k=256)
  assert window["full"] + window["partial"] == 16 + 15  # O(T * w), not O(T^2)
  # A data mask keeps the static skipping and only turns the FULL blocks PARTIAL.
  seg = CausalMask() & SegmentMask(jnp.zeros((1, 64), jnp.int32), jnp.zeros((1, 64), jnp.int32))
  assert block_schedule(shape, shape, mask=seg, block_q=16, block_k=16) == {
      "full": 0, "partial": 10, "empty": 6, "total": 16}
  # A ragged last key block holds padding: never FULL.
  ragged = block_schedule((1, 40, 4, 16), (1, 40, 4, 16), block_q=16, block_k=16)
  assert ragged == {"full": 6, "partial": 3, "empty": 0, "total": 9}


def test_split_static():
  seg = SegmentMask(jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 4), jnp.int32))
  pad = PaddingMask(jnp.array([3]))
  assert split_static(None) == (None, None)
  assert split_static(CausalMask()) == (CausalMask(), None)
  static, data = split_static(CausalMask() & seg & sliding_window(3) & pad)
  assert static == CausalMask() & sliding_window(3)
  assert isinstance(data, AndMask) and data.a is seg and data.b is pad
  either = CausalMask() | pad  # cannot be split
  assert split_static(either) == (None, either)


def test_empty_blocks_are_never_computed(small_blocks):
  """A NaN in a value row poisons every block that reads it, even where p == 0 (0 * NaN = NaN).

  Causal, 64 tokens, blocks of 8 queries x 16 keys: a NaN in value row 63 reaches only query rows
  48..63 (the query blocks that compute key block 3), so rows 0..47 stay finite exactly when the
  empty blocks above the diagonal are skipped.  Same for a window: rows far before the poisoned
  key (and, two-sided, far after it) never see it.
  """
  q, k, v, _, _ = _inputs(seed=17, b=1, t=64, s=64)
  v = v.at[:, 63].set(jnp.nan)
  out = dot_product_attention(q, k, v, is_causal=True, implementation="xla_chunked")
  assert np.isfinite(np.asarray(out[:, :48])).all()
  assert np.isnan(np.asarray(out[:, 48:])).any()  # the visited blocks do see it

  v = jnp.zeros_like(v).at[:, 30].set(jnp.nan)
  out = dot_product_attention(q, k, v, local_window_size=4, implementation="xla_chunked")
  # key block 1 (keys 16..31) is read by query blocks 1..4 (rows 8..39), nobody else.
  assert np.isfinite(np.asarray(out[:, :8])).all() and np.isfinite(np.asarray(out[:, 40:])).all()


# ----------------------------------------------------------------------------------------------
# Property-based: random shapes, head sharing, masks, blocks
# ----------------------------------------------------------------------------------------------


@settings(max_examples=8, deadline=None)
@given(
    b=st.integers(1, 2), t=st.integers(1, 24), s=st.integers(1, 24), kh=st.sampled_from([1, 2]),
    g=st.sampled_from([1, 2]), h=st.sampled_from([4, 8]), hv=st.sampled_from([4, 8]),
    causal=st.booleans(), window=st.sampled_from([None, 3, (2, 5)]),
    block_q=st.sampled_from([3, 8, 16]), block_k=st.sampled_from([4, 8, 32]),
    offset=st.integers(0, 8))
def test_random_shapes(b, t, s, kh, g, h, hv, causal, window, block_q, block_k, offset):
  q, k, v, _, cot = _inputs(seed=t * 31 + s, b=b, t=t, s=s, n=kh * g, kh=kh, h=h, hv=hv)
  kw = dict(is_causal=causal, local_window_size=window, q_offset=offset)
  ref = _fwd_and_grads("xla", q, k, v, None, cot, **kw)
  with pytest.MonkeyPatch.context() as mp:
    mp.setitem(attention_mod._REGISTRY, "xla_chunked",
               functools.partial(chunked_attention, block_q=block_q, block_k=block_k))
    got = _fwd_and_grads("xla_chunked", q, k, v, None, cot, **kw)
  for name, a, r in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
    _assert_close(a, r, F32_TOL, name)
