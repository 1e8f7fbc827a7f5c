"""T5 relative position buckets and bias (the bit-for-bit transformers check is in tests/hf)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.ops.t5_bias import t5_position_bias, t5_relative_position_bucket


def test_bucket_structure_bidirectional():
  rel = jnp.arange(-300, 301)
  b = np.asarray(t5_relative_position_bucket(rel))
  assert b.dtype == np.int32 and b.min() >= 0 and b.max() <= 31
  r = np.arange(-300, 301)
  # Exact buckets for |offset| < 8, future keys in the upper half.
  assert b[r == 0] == 0
  np.testing.assert_array_equal(b[(r > 0) & (r < 8)], np.arange(1, 8) + 16)
  np.testing.assert_array_equal(b[(r < 0) & (r > -8)], np.arange(7, 0, -1))
  # Logarithmic buckets grow monotonically with distance and saturate from max_distance on.
  assert np.all(np.diff(b[r <= 0][::-1]) >= 0)
  assert np.all(b[r <= -128] == 15) and np.all(b[r >= 128] == 31)


def test_bucket_structure_causal():
  r = np.arange(-300, 301)
  b = np.asarray(t5_relative_position_bucket(r, bidirectional=False))
  assert np.all(b[r >= 0] == 0)  # every future key shares bucket 0
  np.testing.assert_array_equal(b[(r < 0) & (r > -16)], np.arange(15, 0, -1))
  assert np.all(b[r <= -128] == 31) and np.all(np.diff(b[r <= 0][::-1]) >= 0)


def test_bias_gathers_table_per_head():
  table = jnp.arange(32 * 3, dtype=jnp.float32).reshape(32, 3)
  q, kv = jnp.arange(4) + 10, jnp.arange(20)
  bias = np.asarray(t5_position_bias(table, q, kv, bidirectional=True))
  assert bias.shape == (1, 3, 4, 20) and bias.dtype == np.float32
  buckets = np.asarray(t5_relative_position_bucket(kv[None, :] - q[:, None]))
  np.testing.assert_array_equal(bias[0], np.moveaxis(np.asarray(table)[buckets], -1, 0))
  # Depends only on kv - q: shifting both leaves it unchanged.
  np.testing.assert_array_equal(bias, np.asarray(t5_position_bias(table, q + 7, kv + 7)))
  batched = t5_position_bias(table, jnp.stack([q, q + 1]), jnp.stack([kv, kv]))
  assert batched.shape == (2, 3, 4, 20)
  jitted = jax.jit(lambda t, q, k: t5_position_bias(t, q, k, bidirectional=False))(table, q, kv)
  np.testing.assert_array_equal(np.asarray(jitted),
                                np.asarray(t5_position_bias(table, q, kv, bidirectional=False)))


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_buckets=3), "num_buckets"),
    (dict(num_buckets=1, bidirectional=False), "num_buckets"),
    (dict(num_buckets=32, max_distance=8), "max_distance"),
    (dict(num_buckets=8.0), "num_buckets"),
    (dict(num_buckets=32.0), "`num_buckets`=32.0 must be an int"),
    (dict(num_buckets=True), "`num_buckets`=True must be an int"),
    (dict(max_distance=None), "`max_distance`=None"),
    (dict(max_distance=float("inf")), "max_distance"),
])
def test_bucket_errors(kwargs, match):
  with pytest.raises(ValueError, match=match):
    t5_relative_position_bucket(jnp.arange(3), **kwargs)


def test_bias_errors():
  with pytest.raises(ValueError, match="table"):
    t5_position_bias(jnp.zeros((16, 2)), jnp.arange(2), jnp.arange(2), num_buckets=32)
  with pytest.raises(ValueError, match="q_positions"):
    t5_position_bias(jnp.zeros((32, 2)), jnp.int32(1), jnp.arange(2))


def test_float_positions_refused():
  with pytest.raises(ValueError, match="`relative_position` must be an integer array"):
    t5_relative_position_bucket(jnp.array([-0.5, 2.9]))
  with pytest.raises(ValueError, match="`kv_positions` must be an integer array"):
    t5_position_bias(jnp.zeros((32, 2)), jnp.arange(2), jnp.arange(2.0))
