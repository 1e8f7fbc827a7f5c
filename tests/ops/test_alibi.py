"""ALiBi: slopes for any head count, the bias sign and its softmax-equivalent Bloom form."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.ops.alibi import alibi_bias, alibi_slopes


@pytest.mark.parametrize("num_heads", [1, 2, 4, 8, 16, 32])
def test_power_of_two_slopes_are_geometric(num_heads):
  slopes = np.asarray(alibi_slopes(num_heads), np.float64)
  ratio = 2.0 ** (-8.0 / num_heads)
  np.testing.assert_allclose(slopes, ratio ** np.arange(1, num_heads + 1), rtol=1e-7)
  if num_heads == 8:
    np.testing.assert_array_equal(slopes, [1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 1 / 128,
                                           1 / 256])


def test_non_power_of_two_interpolates():
  # 12 heads: the 8-head slopes, then every other slope of the 16-head sequence.
  np.testing.assert_array_equal(np.asarray(alibi_slopes(12)),
                                np.concatenate([alibi_slopes(8), alibi_slopes(16)[0::2][:4]]))
  slopes = np.asarray(alibi_slopes(7))
  assert slopes.shape == (7,) and slopes.dtype == np.float32 and np.all((slopes > 0) & (slopes < 1))
  assert len(set(slopes.tolist())) == 7


def test_bias_formula_and_sign():
  slopes = alibi_slopes(4)
  q, kv = jnp.arange(3, 8), jnp.arange(8)
  bias = np.asarray(alibi_bias(slopes, q, kv))
  assert bias.shape == (4, 5, 8)
  rel = np.arange(8)[None, :] - np.arange(3, 8)[:, None]
  np.testing.assert_array_equal(bias, np.asarray(slopes)[:, None, None] * rel)
  past = rel <= 0
  assert np.all(bias[:, past] <= 0) and np.all(bias[:, rel == 0] == 0)
  # Farther back, harsher penalty: strictly decreasing along each past row.
  assert np.all(np.diff(bias[:, -1, :], axis=-1) > 0)


def _masked_softmax(x, mask):
  x = np.where(mask, x, -np.inf)
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def test_softmax_equivalent_to_bloom_form():
  # slope * (kv - q) and Bloom's slope * kv differ by slope * q: a per-row constant.
  slopes = np.asarray(alibi_slopes(3))
  t = 6
  logits = np.random.default_rng(0).standard_normal((3, t, t)).astype(np.float32)
  ours = np.asarray(alibi_bias(slopes, jnp.arange(t), jnp.arange(t)))
  bloom = slopes[:, None, None] * np.arange(t, dtype=np.float32)[None, None, :]
  causal = np.tril(np.ones((t, t), bool))
  np.testing.assert_allclose(_masked_softmax(logits + ours, causal),
                             _masked_softmax(logits + bloom, causal), rtol=1e-5, atol=1e-7)


def test_batched_positions():
  slopes = alibi_slopes(2)
  q = jnp.array([[0, 1], [5, 6]])
  bias = alibi_bias(slopes, q, jnp.array([[0, 1], [5, 6]]))
  assert bias.shape == (2, 2, 2, 2)
  np.testing.assert_array_equal(np.asarray(bias[0]), np.asarray(bias[1]))


@pytest.mark.parametrize("num_heads", [0, -1, 2.0, True])
def test_bad_num_heads(num_heads):
  with pytest.raises(ValueError, match="num_heads"):
    alibi_slopes(num_heads)


def test_bad_bias_inputs():
  with pytest.raises(ValueError, match="slopes"):
    alibi_bias(jnp.ones((2, 2)), jnp.arange(2), jnp.arange(2))
  with pytest.raises(ValueError, match="q_positions"):
    alibi_bias(jnp.ones(2), jnp.int32(0), jnp.arange(2))


def test_float_positions_refused():
  with pytest.raises(ValueError, match="`q_positions` must be an integer array"):
    alibi_bias(alibi_slopes(2), jnp.array([0.5]), jnp.arange(2))
  with pytest.raises(ValueError, match="`kv_positions` must be an integer array"):
    alibi_bias(alibi_slopes(2), jnp.arange(1), jnp.array([0.0, 1.0]))
