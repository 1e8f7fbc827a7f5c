"""Hyper-connection formulas: Sinkhorn-Knopp, the read/write maps, mHC and HC coefficients, gains."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxattn.ops.hyper import (collapse_streams, composite_mixing, expand_streams, hc_coefficients,
                               hc_read, hc_write, mhc_coefficients, mixing_gain, sinkhorn)


def _np_sinkhorn(logits, num_iters=20):
  """Float64 reference: exp, then (columns, rows) normalization ``num_iters`` times."""
  m = np.exp(np.asarray(logits, np.float64))
  for _ in range(num_iters):
    m = m / m.sum(-2, keepdims=True)
    m = m / m.sum(-1, keepdims=True)
  return m


def _randn(seed, shape, scale=1.0):
  # NumPy draws: test data without compiling a JAX random kernel per shape.
  return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def _sig(x):
  return 1 / (1 + np.exp(-x))


# ---------------------------------------------------------------------------------------------
# Sinkhorn-Knopp
# ---------------------------------------------------------------------------------------------


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.sampled_from([1, 2, 4]), std=st.floats(0.0, 0.5),
       log_domain=st.booleans())
def test_sinkhorn_is_doubly_stochastic(seed, n, std, log_domain):
  # The logit spread mHC produces near initialization (the gates see inputs of unit RMS and
  # proj ~ N(0, 0.02)) is far below 0.5; there 20 iterations converge well inside 1e-3.
  logits = _randn(seed, (3, n, n)) * std
  m = np.asarray(sinkhorn(logits, log_domain=log_domain))
  assert (m >= 0).all()
  np.testing.assert_allclose(m.sum(-1), 1, atol=1e-3)
  np.testing.assert_allclose(m.sum(-2), 1, atol=1e-3)
  np.testing.assert_allclose(m, _np_sinkhorn(logits), atol=1e-5)


def test_sinkhorn_matches_reference_for_wide_logits_and_rows_stay_exact():
  # With wider logits 20 iterations no longer make the columns exact (a finite number of steps only
  # approximates the projection); both forms still agree with the float64 reference, and the rows,
  # normalized last, sum to 1.
  logits = _randn(1, (64, 4, 4)) * 3
  for log_domain in (True, False):
    m = np.asarray(sinkhorn(logits, log_domain=log_domain))
    np.testing.assert_allclose(m, _np_sinkhorn(logits), atol=2e-5)
    np.testing.assert_allclose(m.sum(-1), 1, atol=1e-5)
  # More iterations close the column gap.
  m200 = np.asarray(sinkhorn(logits, num_iters=200))
  assert np.abs(m200.sum(-2) - 1).max() < np.abs(np.asarray(sinkhorn(logits)).sum(-2) - 1).max()


def test_sinkhorn_recovers_a_doubly_stochastic_matrix():
  # exp(log P) is already doubly stochastic: the iteration leaves it unchanged.
  p = 0.5 * np.eye(4) + 0.3 * np.roll(np.eye(4), 1, 0) + 0.2 * np.roll(np.eye(4), 2, 0)
  np.testing.assert_allclose(sinkhorn(jnp.log(p)), p, atol=1e-6)
  # Adding a constant to a row or a column does not change the projection.
  logits = _randn(0, (4, 4))
  shifted = logits + jnp.array([1.0, -2.0, 0.5, 3.0])[:, None] + jnp.array([0.0, 4.0, -1.0, 2.0])
  np.testing.assert_allclose(sinkhorn(shifted), sinkhorn(logits), atol=1e-6)


def test_log_domain_is_stable_where_plain_underflows():
  # exp(logits) is rank one (logits[i, j] = u_i + v_j), so its projection is the uniform 1/n matrix;
  # but a range of 400 underflows exp() to exact zeros in fp32 and the plain form divides 0 by 0.
  logits = jnp.array([[0.0, -200.0], [-200.0, -400.0]])
  np.testing.assert_allclose(sinkhorn(logits), 0.5, atol=1e-6)
  assert not np.isfinite(np.asarray(sinkhorn(logits, log_domain=False))).all()
  # The reference's eps keeps the plain form finite, at the price of a biased result.
  assert np.isfinite(np.asarray(sinkhorn(logits, log_domain=False, eps=1e-6))).all()


def test_sinkhorn_n1_and_gradients_agree_between_forms():
  np.testing.assert_allclose(sinkhorn(jnp.full((5, 1, 1), 3.0)), 1.0, atol=1e-7)
  logits = _randn(2, (4, 4))
  w = _randn(3, (4, 4))
  loss = lambda lg, ld: jnp.sum(w * sinkhorn(lg, log_domain=ld))
  g_log, g_plain = jax.grad(loss)(logits, True), jax.grad(loss)(logits, False)
  np.testing.assert_allclose(g_log, g_plain, atol=1e-5)
  # Central finite differences (fp32, step 1e-2; the function is smooth at this scale).
  e = np.zeros((4, 4), np.float32)
  e[1, 2] = 1e-2
  fd = (loss(logits + e, True) - loss(logits - e, True)) / 2e-2
  np.testing.assert_allclose(g_log[1, 2], fd, rtol=2e-2, atol=1e-3)


def test_sinkhorn_errors():
  with pytest.raises(ValueError, match="logits"):
    sinkhorn(jnp.zeros((3, 4)))
  with pytest.raises(ValueError, match="num_iters"):
    sinkhorn(jnp.zeros((4, 4)), num_iters=0)
  with pytest.raises(ValueError, match="eps"):
    sinkhorn(jnp.zeros((4, 4)), log_domain=False, eps=-1.0)
  with pytest.raises(ValueError, match="eps"):
    sinkhorn(jnp.zeros((4, 4)), eps=1e-6)


# ---------------------------------------------------------------------------------------------
# Read, write, expand, collapse
# ---------------------------------------------------------------------------------------------


def test_read_write_against_loops():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((2, 3, 4, 8)).astype(np.float32)
  pre, post = rng.uniform(size=(2, 2, 3, 4)).astype(np.float32)
  res = rng.uniform(size=(2, 3, 4, 4)).astype(np.float32)
  f = rng.standard_normal((2, 3, 8)).astype(np.float32)
  want_read = sum(pre[..., i, None] * x[..., i, :] for i in range(4))
  np.testing.assert_allclose(hc_read(x, pre), want_read, atol=1e-5)
  want = np.zeros_like(x)
  for o in range(4):
    want[..., o, :] = sum(res[..., o, i, None] * x[..., i, :] for i in range(4)) + post[..., o, None] * f
  np.testing.assert_allclose(hc_write(x, f, post, res), want, atol=1e-5)
  np.testing.assert_allclose(collapse_streams(x), x.sum(-2), atol=1e-5)
  np.testing.assert_allclose(collapse_streams(x, pre), want_read, atol=1e-5)


def test_one_stream_with_identity_maps_is_a_plain_residual():
  x = _randn(0, (2, 5, 16))
  f = lambda h: jnp.tanh(h) * 3
  s = expand_streams(x, 1)
  one = jnp.ones((1,))
  y = hc_write(s, f(hc_read(s, one)), one, jnp.eye(1))
  np.testing.assert_array_equal(y[:, :, 0], x + f(x))


def test_expand_and_errors():
  x = jnp.arange(6.0).reshape(2, 3)
  s = expand_streams(x, 4)
  assert s.shape == (2, 4, 3)
  np.testing.assert_array_equal(s[:, 2], x)
  with pytest.raises(ValueError, match="num_streams"):
    expand_streams(x, 0)
  with pytest.raises(ValueError, match="num_streams"):
    expand_streams(x, True)
  assert expand_streams(x, np.int64(2)).shape == (2, 2, 3)
  with pytest.raises(ValueError, match="h_pre"):
    hc_read(s, jnp.ones(3))
  with pytest.raises(ValueError, match="h_res"):
    hc_write(s, x, jnp.ones(4), jnp.ones((4, 3)))
  with pytest.raises(ValueError, match="output"):
    hc_write(s, jnp.ones((2, 5)), jnp.ones(4), jnp.eye(4))


# ---------------------------------------------------------------------------------------------
# Coefficients
# ---------------------------------------------------------------------------------------------


def test_mhc_coefficients_against_the_paper_formulas():
  n, d = 4, 8
  x = _randn(0, (2, 3, n, d), 3.0)
  proj = _randn(1, (n, d, n * (n + 2)), 0.1)
  bias = _randn(2, (n * (n + 2),), 0.3)
  scale = np.array([0.7, 1.3, 0.9], np.float32)
  pre, post, res = mhc_coefficients(x, proj, bias, scale, eps=0.0)
  # Paper order: RMSNorm of the flattened streams first, then the projection.
  flat = x.reshape(2, 3, n * d).astype(np.float64)
  xn = flat / np.sqrt((flat ** 2).mean(-1, keepdims=True) + 1e-6)
  z = xn @ proj.reshape(n * d, -1).astype(np.float64)
  np.testing.assert_allclose(pre, _sig(scale[0] * z[..., :n] + bias[:n]), atol=1e-5)
  np.testing.assert_allclose(post, 2 * _sig(scale[1] * z[..., n:2 * n] + bias[n:2 * n]), atol=1e-5)
  comb = (scale[2] * z[..., 2 * n:] + bias[2 * n:]).reshape(2, 3, n, n)   # [i_in, o_out]
  np.testing.assert_allclose(res, _np_sinkhorn(np.swapaxes(comb, -1, -2)), atol=1e-5)
  np.testing.assert_allclose(np.asarray(res).sum(-1), 1, atol=1e-5)
  with pytest.raises(ValueError, match="proj"):
    mhc_coefficients(x, proj[:, :, :-1], bias, scale)
  with pytest.raises(ValueError, match="scale"):
    mhc_coefficients(x, proj, bias, scale[:2])
  with pytest.raises(ValueError, match="`eps`"):
    mhc_coefficients(x, proj, bias, scale, eps=-1.0)
  with pytest.raises(ValueError, match="`norm_eps`"):
    mhc_coefficients(x, proj, bias, scale, norm_eps=-1.0)


def test_hc_coefficients_against_the_formulas():
  n, d = 3, 8
  x, proj = _randn(0, (2, n, d)), _randn(1, (d, n + 2))
  sp, spo, sr = _randn(2, (n,)), _randn(3, (n,)), _randn(4, (n, n))
  scale = np.array([0.1, 0.2], np.float32)
  pre, post, res = hc_coefficients(x, proj, sp, spo, sr, scale)
  xn = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6)
  t = np.tanh(xn @ proj)                      # [2, n(stream i), 2 + n]
  np.testing.assert_allclose(pre, sp + 0.1 * t[..., 0], atol=1e-5)
  np.testing.assert_allclose(post, spo + 0.2 * t[..., 1], atol=1e-5)
  for o in range(n):
    for i in range(n):   # H_res[o, i] comes from stream i's row t[i, 2 + o]
      np.testing.assert_allclose(res[:, o, i], sr[o, i] + 0.1 * t[:, i, 2 + o], atol=1e-5)
  with pytest.raises(ValueError, match="static_res"):
    hc_coefficients(x, proj, sp, spo, sr[:2], scale)
  with pytest.raises(ValueError, match="`norm_eps`"):
    hc_coefficients(x, proj, sp, spo, sr, scale, norm_eps=-1.0)


# ---------------------------------------------------------------------------------------------
# Composite mixing and gains
# ---------------------------------------------------------------------------------------------


def test_gain_of_a_hand_example_and_of_products():
  h = jnp.array([[2.0, 0.0], [0.5, 1.0]])
  fwd, bwd = mixing_gain(h)
  assert float(fwd) == 2.0 and float(bwd) == 2.5
  prods = composite_mixing(jnp.stack([h] * 3))
  np.testing.assert_allclose(prods[-1], np.linalg.matrix_power(np.asarray(h), 3), atol=1e-6)
  np.testing.assert_allclose(mixing_gain(prods[-1])[0], 8.0)
  # Later layers multiply from the left: P_2 = H_2 H_1.
  a, b = jnp.array([[0.0, 1.0], [1.0, 0.0]]), jnp.array([[1.0, 2.0], [0.0, 1.0]])
  np.testing.assert_allclose(composite_mixing(jnp.stack([a, b]))[-1], b @ a)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), std=st.floats(0.05, 4.0))
def test_composite_of_sinkhorn_maps_stays_bounded_over_64_layers(seed, std):
  logits = _randn(seed, (64, 4, 4)) * std
  prods = composite_mixing(sinkhorn(logits))
  assert (np.asarray(prods) >= 0).all()
  fwd, bwd = mixing_gain(prods)
  # Rows are normalized last and entries are >= 0, so every product is row-stochastic: forward
  # gain 1 at every depth, whatever the logits.
  np.testing.assert_allclose(fwd, 1.0, atol=1e-4)
  # Columns are only approximately normalized; the backward gain stays near 1 for spreads up to the
  # paper's regime, far from the exponential growth of unconstrained mixing (next test).
  assert float(bwd.max()) < 1.6


def test_unconstrained_mixing_grows_where_sinkhorn_does_not():
  logits = _randn(0, (64, 4, 4)) * 0.3
  hc = jnp.eye(4) + logits                    # HC: identity init plus an unconstrained drift
  g_hc = mixing_gain(composite_mixing(hc)[-1])
  g_mhc = mixing_gain(composite_mixing(sinkhorn(logits))[-1])
  assert float(g_hc[0]) > 10 and float(g_hc[1]) > 10
  assert float(g_mhc[0]) < 1.001 and float(g_mhc[1]) < 1.001
