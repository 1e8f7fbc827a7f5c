"""The attention formula and its dispatcher: agreement with jax.nn, the seed's properties, errors.

Tolerances: fp32 results are compared at 2e-5 (accumulation order differs between paths); bf16
inputs at 2e-2, about two bf16 ulps at the unit scale of attention outputs (the softmax and the
accumulation are fp32, the inputs and the output carry bf16 rounding).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jaxattn.ops.attention import attention_weights, dot_product_attention as dpa
from jaxattn.ops.masks import CausalMask, SegmentMask, sliding_window

IMPLS = ["xla", "xla_chunked"]


def _qkv(b=2, t=7, s=None, n=4, k=2, h=8, hv=None, dtype=jnp.float32, seed=0):
  s = t if s is None else s
  ks = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(ks[0], (b, t, n, h), dtype)
  kk = jax.random.normal(ks[1], (b, s, k, h), dtype)
  v = jax.random.normal(ks[2], (b, s, k, hv or h), dtype)
  return q, kk, v


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n,k", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("t,s", [(7, 7), (5, 9)])
def test_matches_jax_nn(impl, n, k, causal, t, s):
  q, kk, v = _qkv(t=t, s=s, n=n, k=k)
  got = dpa(q, kk, v, is_causal=causal, implementation=impl)
  want = jax.nn.dot_product_attention(q, kk, v, is_causal=causal)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_matches_jax_nn_bias_mask_window_scale(impl):
  q, kk, v = _qkv(t=9, n=4, k=2)
  bias = jax.random.normal(jax.random.key(3), (2, 4, 9, 9))
  mask = jax.random.bernoulli(jax.random.key(4), 0.7, (2, 1, 9, 9))
  for kwargs in (dict(bias=bias), dict(mask=mask), dict(local_window_size=(2, 1)),
                 dict(is_causal=True, local_window_size=(3, 0)), dict(scale=0.3, bias=bias)):
    got = dpa(q, kk, v, implementation=impl, **kwargs)
    want = jax.nn.dot_product_attention(q, kk, v, **kwargs)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5, err_msg=str(kwargs.keys()))


@pytest.mark.parametrize("impl", IMPLS)
def test_gradients_match_jax_nn(impl):
  q, kk, v = _qkv(t=6, n=4, k=2)
  bias = jax.random.normal(jax.random.key(3), (1, 4, 6, 6))
  ct = jax.random.normal(jax.random.key(5), (2, 6, 4, 8))

  def loss(fn):
    return lambda q, k, v, b: jnp.sum(fn(q, k, v, b) * ct)

  ours = jax.grad(loss(lambda *a: dpa(*a, is_causal=True, implementation=impl)), argnums=(0, 1, 2, 3))
  ref = jax.grad(loss(lambda *a: jax.nn.dot_product_attention(*a, is_causal=True)),
                 argnums=(0, 1, 2, 3))
  for g, w in zip(ours(q, kk, v, bias), ref(q, kk, v, bias)):
    np.testing.assert_allclose(g, w, atol=5e-5, rtol=5e-5)


def test_check_grads_reference():
  q, kk, v = _qkv(b=1, t=4, n=2, k=1, h=4)
  check_grads(lambda q, k, v: dpa(q, k, v, is_causal=True, implementation="xla"),
                            (q, kk, v), order=1, modes=("rev",), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("impl", IMPLS)
def test_gqa_equals_mha_with_repeated_kv(impl):
  q, kk, v = _qkv(n=6, k=2)
  rep = lambda x: jnp.repeat(x, 3, axis=2)  # head n reads KV head n // 3
  np.testing.assert_allclose(dpa(q, kk, v, is_causal=True, implementation=impl),
                             dpa(q, rep(kk), rep(v), is_causal=True, implementation=impl),
                             atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_fully_masked_rows_give_zeros_not_nan(impl):
  q, kk, v = _qkv(t=5)
  mask = jnp.ones((2, 1, 5, 5), bool).at[:, :, 2, :].set(False)
  out, lse = dpa(q, kk, v, mask=mask, return_residuals=True, implementation=impl)
  assert not np.isnan(np.asarray(out)).any()
  np.testing.assert_array_equal(out[:, 2], 0.0)
  assert np.isneginf(np.asarray(lse)[:, :, 2]).all()
  g = jax.grad(lambda q: dpa(q, kk, v, mask=mask, implementation=impl).sum())(q)
  assert np.isfinite(np.asarray(g)).all()
  np.testing.assert_array_equal(g[:, 2], 0.0)


@pytest.mark.parametrize("impl", IMPLS)
def test_residuals_are_logsumexp(impl):
  q, kk, v = _qkv(t=5, s=8, n=4, k=2)
  _, lse = dpa(q, kk, v, is_causal=True, return_residuals=True, implementation=impl)
  logits = np.einsum("btnh,bsnh->bnts", q, np.repeat(kk, 2, axis=2)) / np.sqrt(8)
  logits = np.where(np.tril(np.ones((5, 8), bool)), logits, -np.inf)
  want = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  assert lse.shape == (2, 4, 5) and lse.dtype == jnp.float32
  np.testing.assert_allclose(lse, want, atol=1e-5, rtol=1e-5)


def test_self_attention_is_permutation_equivariant():
  """Seed 3.1: without positions, shuffling the tokens only relabels the outputs."""
  q, kk, v = _qkv(t=8)
  perm = np.array([3, 1, 7, 0, 5, 2, 6, 4])
  out = dpa(q, kk, v)
  out_perm = dpa(q[:, perm], kk[:, perm], v[:, perm])
  np.testing.assert_allclose(out_perm, out[:, perm], atol=2e-6)
  # A causal mask breaks the symmetry (it is a position signal).
  assert not np.allclose(dpa(q[:, perm], kk[:, perm], v[:, perm], is_causal=True),
                         dpa(q, kk, v, is_causal=True)[:, perm], atol=1e-3)


def test_weights_are_row_stochastic():
  q, kk, _ = _qkv(t=6)
  w = attention_weights(q, kk, is_causal=True)
  np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(w)[..., np.triu_indices(6, 1)[0], np.triu_indices(6, 1)[1]], 0)


@pytest.mark.parametrize("impl", IMPLS)
def test_soft_cap_and_alibi(impl):
  q, kk, v = _qkv(t=6, n=4, k=2)
  cap = 2.0
  logits = jnp.einsum("btnh,bsnh->bnts", q, jnp.repeat(kk, 2, axis=2)) / np.sqrt(8)
  capped = cap * jnp.tanh(logits / cap)
  want = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(capped, -1), jnp.repeat(v, 2, axis=2))
  np.testing.assert_allclose(dpa(q, kk, v, logits_soft_cap=cap, implementation=impl), want,
                             atol=2e-5)
  slopes = jnp.array([-0.5, -0.25, -0.125, -1 / 16])
  rel = jnp.arange(6)[None, :] - jnp.arange(6)[:, None]
  bias = (slopes[:, None, None] * rel)[None]
  np.testing.assert_allclose(dpa(q, kk, v, alibi_slopes=-slopes, is_causal=True, implementation=impl),
                             dpa(q, kk, v, bias=-bias, is_causal=True, implementation="xla"), atol=2e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_segments_equal_separate_sequences(impl):
  q, kk, v = _qkv(b=1, t=9, n=2, k=2)
  seg = jnp.array([[0, 0, 0, 0, 1, 1, 1, 1, 1]])
  packed = dpa(q, kk, v, is_causal=True, segment_ids=seg, implementation=impl)
  a = dpa(q[:, :4], kk[:, :4], v[:, :4], is_causal=True, implementation=impl)
  b = dpa(q[:, 4:], kk[:, 4:], v[:, 4:], is_causal=True, implementation=impl)
  np.testing.assert_allclose(packed, jnp.concatenate([a, b], 1), atol=2e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_kv_lengths_and_q_offset(impl):
  q, kk, v = _qkv(b=2, t=8, n=4, k=2)
  full = dpa(q, kk, v, is_causal=True, implementation=impl)
  # Decode row 5 against a cache buffer of 8 slots with 6 filled equals row 5 of the full pass.
  row = dpa(q[:, 5:6], kk, v, is_causal=True, q_offset=5, kv_lengths=jnp.array([6, 6]),
            implementation=impl)
  np.testing.assert_allclose(row, full[:, 5:6], atol=2e-5)
  traced = jax.jit(lambda off: dpa(q[:, 5:6], kk, v, is_causal=True, q_offset=off,
                                   kv_lengths=jnp.array([6, 6]), implementation=impl))(jnp.int32(5))
  np.testing.assert_allclose(traced, full[:, 5:6], atol=2e-5)
  short = dpa(q, kk[:, :3], v[:, :3], implementation=impl)
  np.testing.assert_allclose(dpa(q, kk, v, kv_lengths=jnp.array([3, 3]), implementation=impl),
                             short, atol=2e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_within_tolerance(impl):
  q, kk, v = _qkv(t=9, n=4, k=2)
  ref = dpa(q, kk, v, is_causal=True, implementation="xla")
  got = dpa(q.astype(jnp.bfloat16), kk.astype(jnp.bfloat16), v.astype(jnp.bfloat16), is_causal=True,
            implementation=impl)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(got.astype(jnp.float32), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("impl", IMPLS)
def test_value_head_dim_and_mask_object(impl):
  q, kk, v = _qkv(t=7, hv=5)
  out = dpa(q, kk, v, mask=sliding_window(2), implementation=impl)
  assert out.shape == (2, 7, 4, 5)
  np.testing.assert_allclose(out, dpa(q, kk, v, is_causal=True, local_window_size=2,
                                      implementation="xla"), atol=2e-5)
  np.testing.assert_allclose(dpa(q, kk, v, mask=CausalMask(), implementation=impl),
                             dpa(q, kk, v, is_causal=True, implementation="xla"), atol=2e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_jit_vmap_and_single_trace(impl):
  q, kk, v = _qkv(t=6)
  traces = []

  @jax.jit
  def f(q, k, v):
    traces.append(1)
    return dpa(q, k, v, is_causal=True, implementation=impl)

  f(q, kk, v)
  f(q + 1, kk, v)
  assert len(traces) == 1
  batched = jax.vmap(lambda q, k, v: dpa(q, k, v, is_causal=True, implementation=impl))(
      q[None].repeat(3, 0), kk[None].repeat(3, 0), v[None].repeat(3, 0))
  np.testing.assert_allclose(batched[1], f(q, kk, v), atol=2e-5)


def test_auto_implementation_on_cpu_is_native_kernel_else_chunked():
  from jaxattn import native

  q, kk, v = _qkv(t=6)
  want = "cpu" if native.available() else "xla_chunked"
  np.testing.assert_allclose(dpa(q, kk, v, is_causal=True),
                             dpa(q, kk, v, is_causal=True, implementation=want), atol=0)
  # Calls the native kernel cannot compute (here a dense bias) go to the chunked path.
  bias = jnp.ones((1, 1, 6, 6), jnp.float32)
  np.testing.assert_allclose(dpa(q, kk, v, bias=bias, is_causal=True),
                             dpa(q, kk, v, bias=bias, is_causal=True,
                                 implementation="xla_chunked"), atol=0)


def test_auto_dispatch_skips_backends_that_decline(monkeypatch):
  """Auto mode tries its order and moves past a backend that raises UnsupportedError."""
  import jaxattn.ops.attention as A
  q, kk, v = _qkv(t=5)
  calls = []

  def declining(*args, **kwargs):
    calls.append(1)
    raise A.UnsupportedError("no dense bias here")

  monkeypatch.setattr(A, "_auto_order", lambda: ["pallas_gpu", "xla"])
  monkeypatch.setitem(A._REGISTRY, "pallas_gpu", declining)
  bias = jax.random.normal(jax.random.key(1), (1, 4, 5, 5))
  np.testing.assert_allclose(dpa(q, kk, v, bias=bias), dpa(q, kk, v, bias=bias, implementation="xla"))
  assert calls == [1]
  monkeypatch.setattr(A, "_auto_order", lambda: ["pallas_gpu"])
  with pytest.raises(ValueError, match="no dense bias here"):
    dpa(q, kk, v, bias=bias)


def test_errors():
  q, kk, v = _qkv(n=4, k=2)
  with pytest.raises(ValueError, match="multiple of key/value heads"):
    dpa(*_qkv(n=4, k=3))
  with pytest.raises(ValueError, match="dtypes must match"):
    dpa(q, kk.astype(jnp.bfloat16), v)
  ints = [x.astype(jnp.int32) for x in (q, kk, v)]
  for impl in (None, "xla", "xla_chunked"):     # an integer, truncated output before
    with pytest.raises(ValueError, match="`query` must be a floating-point array, got dtype int32"):
      dpa(*ints, implementation=impl)
  with pytest.raises(ValueError, match="head_dim"):
    dpa(q, kk[..., :4], v)
  with pytest.raises(ValueError, match="must share"):
    dpa(q, kk, v[:, :3])
  with pytest.raises(ValueError, match="rank 4"):
    dpa(q[0], kk, v)
  with pytest.raises(ValueError, match="implementation"):
    dpa(q, kk, v, implementation="cudnn_magic")
  # An explicit backend that cannot take this call raises; it never falls back.
  ids = jnp.zeros((2, 7), jnp.int32)
  with pytest.raises(ValueError, match="at most one SegmentMask"):
    dpa(q, kk, v, mask=SegmentMask(ids, ids) & SegmentMask(ids, ids),
        implementation="pallas_tpu")
  with pytest.raises(ValueError, match="local_window_size"):
    dpa(q, kk, v, local_window_size=-1)
  with pytest.raises(ValueError, match="bias"):
    dpa(q, kk, v, bias=jnp.zeros((2, 3, 7, 7)))
  with pytest.raises(ValueError, match="logits_soft_cap"):
    dpa(q, kk, v, logits_soft_cap=0.0)
  with pytest.raises(ValueError, match="alibi_slopes"):
    dpa(q, kk, v, alibi_slopes=jnp.ones(3))
  with pytest.raises(ValueError, match="scale"):
    dpa(q, kk, v, scale=-1.0)
  # Segment ids and lengths of the wrong shape: a short id array used to pass as a segment of its
  # own on the XLA paths (the mask's gather fills out-of-range rows), or fail in the CPU kernel.
  ids = jnp.zeros((2, 7), jnp.int32)
  for impl in (None, "xla", "xla_chunked"):
    with pytest.raises(ValueError, match=r"`segment_ids` must be \[B, T\] = \(2, 7\)"):
      dpa(q, kk, v, segment_ids=ids[:, :5], implementation=impl)
    with pytest.raises(ValueError, match=r"`segment_ids` must be kv_ids \(2, 7\) of the"):
      dpa(q, kk, v, segment_ids=(ids, ids[:, :5]), implementation=impl)
    with pytest.raises(ValueError, match="`segment_ids` must be"):
      dpa(q, kk, v, segment_ids=ids.astype(jnp.float32), implementation=impl)
    for lengths in (jnp.int32(3), jnp.ones((3,), jnp.int32), jnp.ones((2,), jnp.float32)):
      with pytest.raises(ValueError, match=r"`kv_lengths` must be \[B\] = \(2,\) integers"):
        dpa(q, kk, v, kv_lengths=lengths, implementation=impl)


@pytest.mark.parametrize("impl", [None, "xla", "xla_chunked", "cpu"])
@pytest.mark.parametrize("t, s", [(0, 5), (4, 0), (0, 0)])
def test_empty_axes_give_the_no_visible_key_result(impl, t, s):
  """No queries, or no keys: zeros and a -inf log-sum-exp from every backend (xla_chunked could
  not tile T = 0, xla reduced an empty max), and zero gradients."""
  q, kk, v = _qkv(t=t, s=s, hv=6)
  out, lse = dpa(q, kk, v, is_causal=False, return_residuals=True, implementation=impl)
  assert out.shape == (2, t, 4, 6) and lse.shape == (2, 4, t)
  assert not np.asarray(out).any() and np.all(np.asarray(lse) == -np.inf)
  grads = jax.grad(lambda q, k, v: dpa(q, k, v, implementation=impl).sum(), (0, 1, 2))(q, kk, v)
  assert [g.shape for g in grads] == [q.shape, kk.shape, v.shape]
  assert not any(np.asarray(g).any() for g in grads)


def _rand_qkv(b=2, t=8, s=8, n=2, k=2, h=8, seed=0):
  r = np.random.default_rng(seed)
  return tuple(jnp.asarray(r.standard_normal(shape), jnp.float32)
               for shape in ((b, t, n, h), (b, s, k, h), (b, s, k, h)))


def test_infinite_soft_cap_and_per_sequence_offsets_are_refused():
  """cap = inf made every logit inf * tanh(0) = NaN: all rows 'fully masked', zeros out.  A [B]
  q_offset broadcast against the query rows (a wrong mask when B == T, a TypeError elsewhere)."""
  q, k, v = _rand_qkv()
  for impl in ("xla", "xla_chunked", "cpu"):
    with pytest.raises(ValueError, match="`logits_soft_cap` must be a finite number > 0"):
      dpa(q, k, v, logits_soft_cap=float("inf"), implementation=impl)
    with pytest.raises(ValueError, match="`q_offset` must be one integer"):
      dpa(q, k, v, is_causal=True, q_offset=jnp.array([0, 3]), implementation=impl)
  with pytest.raises(ValueError, match="`q_offset` must be one integer"):
    dpa(q, k, v, is_causal=True, q_offset=1.5)
  # a traced scalar offset is fine
  f = jax.jit(lambda off: dpa(q[:, :2], k, v, is_causal=True, q_offset=off))
  np.testing.assert_allclose(f(jnp.int32(6)), dpa(q[:, :2], k, v, is_causal=True, q_offset=6),
                             atol=1e-6)


def test_a_sequence_of_implementations_falls_back_in_order():
  """("cpu", "xla_chunked") with a dense bias: the CPU kernel declines, the chunked path computes
  it (the first registered backend was used and its UnsupportedError raised)."""
  q, k, v = _rand_qkv()
  bias = jnp.asarray(np.random.default_rng(1).standard_normal((1, 2, 8, 8)), jnp.float32)
  want = dpa(q, k, v, bias=bias, implementation="xla")
  np.testing.assert_allclose(dpa(q, k, v, bias=bias, implementation=("cpu", "xla_chunked")),
                             want, atol=1e-5)
  with pytest.raises(ValueError, match="the native CPU kernel does not support bias"):
    dpa(q, k, v, bias=bias, implementation="cpu")
  with pytest.raises(ValueError, match="or a sequence of them"):
    dpa(q, k, v, implementation=("cpu", "flash"))


def test_batch_one_mask_objects_broadcast_on_the_cpu_kernel():
  """SegmentMask / PaddingMask holding [1, T] / [1] arrays: the XLA paths broadcast them over B,
  and auto dispatch picked the CPU kernel, which failed at run time."""
  from jaxattn.ops.masks import PaddingMask, SegmentMask
  q, k, v = _rand_qkv()
  ids = jnp.array([[0, 0, 0, 1, 1, 1, 1, 1]], jnp.int32)
  for m in (SegmentMask(ids, ids) & CausalMask(), PaddingMask(jnp.array([5], jnp.int32))):
    want = dpa(q, k, v, mask=m, implementation="xla")
    for impl in ("cpu", None):
      np.testing.assert_allclose(dpa(q, k, v, mask=m, implementation=impl), want, atol=1e-5)


def test_a_float_mask_is_refused():
  """An additive 0 / -inf mask passed as `mask` was cast to bool: inverted (-inf -> attend)."""
  q, k, v = _rand_qkv()
  additive = jnp.where(jnp.tril(jnp.ones((8, 8), bool)), 0.0, -jnp.inf)[None, None]
  with pytest.raises(ValueError, match="`mask` must be boolean .* pass an additive mask as `bias`"):
    dpa(q, k, v, mask=additive)
  np.testing.assert_allclose(dpa(q, k, v, bias=additive), dpa(q, k, v, is_causal=True), atol=1e-6)


@pytest.mark.parametrize("impl", ["xla_chunked", "cpu", "pallas_tpu"])
def test_alibi_slopes_and_traced_scale_get_gradients_on_every_path(impl):
  """Learned ALiBi slopes and a learned temperature: their gradients on the chunked formula and
  the kernels (through the dispatcher's chunked backward) equal the reference's, with a window,
  a soft-cap, a causal offset and lengths that are not block multiples; q / k / v too."""
  if impl == "pallas_tpu":
    pytest.importorskip("pallas_kernels.flash_attention")
  q, kk, v = _qkv(b=1, t=13, s=19, n=4, k=2, h=8)
  w = jax.random.normal(jax.random.key(5), q.shape)
  slopes = jnp.array([0.5, 0.25, 0.125, 0.0625])
  kw = dict(is_causal=True, q_offset=6, local_window_size=9, logits_soft_cap=3.0)
  traced_scale = impl != "cpu"  # the native kernel takes a static scale only

  def loss(q, k, v, slopes, scale, impl):
    return jnp.sum(w * dpa(q, k, v, alibi_slopes=slopes, scale=scale if traced_scale else 0.3,
                           implementation=impl, **kw))

  args = (q, kk, v, slopes, 0.3)
  want = jax.grad(loss, (0, 1, 2, 3, 4))(*args, "xla")
  got = jax.jit(jax.grad(loss, (0, 1, 2, 3, 4)), static_argnums=5)(*args, impl)
  for name, a, b in zip(("dq", "dk", "dv", "dslopes", "dscale"), got, want):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5, err_msg=name)
  assert float(jnp.abs(want[3]).min()) > 1e-3 and (not traced_scale or abs(float(want[4])) > 1e-3)
  if impl == "cpu":  # constant slopes: the kernel's backward alone, no chunked pass added
    hlo = jax.jit(jax.grad(loss), static_argnums=5).lower(*args, impl).as_text()
    assert "while" not in hlo


@pytest.mark.parametrize("impl", ["xla", "xla_chunked", "cpu", "pallas_tpu", "pallas_gpu"])
def test_a_nan_query_row_stays_nan(impl):
  """A NaN in a query row makes that row's output and log-sum-exp NaN, as in jax.nn (divergence
  must show), while the other rows and a fully masked row (zeros, -inf) are unaffected."""
  if impl.startswith("pallas"):
    pytest.importorskip("pallas_kernels.flash_attention")
  q, kk, v = _qkv(b=1, t=11, n=2, k=2, h=8)
  q = q.at[0, 3, 0, 0].set(jnp.nan)
  out, lse = dpa(q, kk, v, is_causal=True, q_offset=-1, return_residuals=True, implementation=impl)
  nan_rows = np.isnan(np.asarray(out)).any(axis=-1)[0]  # [T, N]
  want = np.zeros((11, 2), bool)
  want[3, 0] = True
  np.testing.assert_array_equal(nan_rows, want)
  assert np.isnan(np.asarray(lse)[0, 0, 3]) and np.isneginf(np.asarray(lse)[0, :, 0]).all()
  np.testing.assert_array_equal(np.asarray(out)[0, 0], 0.0)  # row 0 sees no key (offset -1)
