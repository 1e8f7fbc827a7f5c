"""Learned absolute positions and the T5 relative-bias module."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxattn.nn.positional import LearnedPositionalEmbedding, T5RelativePositionBias
from jaxattn.ops.t5_bias import t5_position_bias


def test_learned_lookup_and_metadata():
  emb = LearnedPositionalEmbedding(8, 4, rngs=nnx.Rngs(0))
  table = np.asarray(emb.embedding[...])
  assert table.shape == (8, 4) and table.dtype == np.float32
  assert emb.embedding.get_metadata()["logical_axes"] == ("position", "embed")
  pos = jnp.array([[0, 7, 3], [1, 1, 2]])
  np.testing.assert_array_equal(np.asarray(emb(pos)), table[np.asarray(pos)])
  bf16 = LearnedPositionalEmbedding(8, 4, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
  assert bf16(pos).dtype == jnp.bfloat16


@pytest.mark.parametrize("positions", [[0, 8], [9], [-1, 2], np.array([[3, 100]])])
def test_learned_rejects_positions_past_table(positions):
  emb = LearnedPositionalEmbedding(8, 4, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="positions.*max_len=8"):
    emb(jnp.asarray(positions))


def test_learned_under_jit_fills_nan_past_table():
  # A traced position cannot raise; the row comes back NaN instead of silently reusing row 7.
  emb = LearnedPositionalEmbedding(8, 4, rngs=nnx.Rngs(0))
  out = nnx.jit(lambda m, p: m(p))(emb, jnp.array([7, 8]))
  assert np.all(np.isfinite(np.asarray(out[0]))) and np.all(np.isnan(np.asarray(out[1])))
  # check=False skips the eager check too.
  assert np.isnan(np.asarray(emb(jnp.array([8]), check=False))).all()


def test_learned_under_jit_fills_nan_before_table():
  # Negative positions (pads are often cumsum(mask) - 1 = -1) are outside the table too: NaN, not
  # the NumPy-style wrap onto the last rows.
  emb = LearnedPositionalEmbedding(8, 4, rngs=nnx.Rngs(0))
  out = np.asarray(nnx.jit(lambda m, p: m(p))(emb, jnp.array([-1, -8, -9, 0])))
  assert np.isnan(out[:3]).all() and np.isfinite(out[3]).all()
  assert np.isnan(np.asarray(emb(jnp.array([-1]), check=False))).all()


def test_learned_errors():
  emb = LearnedPositionalEmbedding(8, 4, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="positions.*integers"):
    emb(jnp.array([0.0, 1.0]))
  with pytest.raises(ValueError, match="max_len"):
    LearnedPositionalEmbedding(0, 4, rngs=nnx.Rngs(0))


def test_learned_gradient_reaches_rows_used():
  emb = LearnedPositionalEmbedding(8, 4, rngs=nnx.Rngs(0))
  grads = nnx.grad(lambda m: m(jnp.array([1, 1, 5])).sum())(emb)
  g = np.asarray(grads["embedding"][...])
  np.testing.assert_array_equal(g[[1, 5]], [[2.0] * 4, [1.0] * 4])
  assert np.all(g[[0, 2, 3, 4, 6, 7]] == 0)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_module_shape_and_formula(bidirectional):
  mod = T5RelativePositionBias(3, bidirectional=bidirectional, num_buckets=16, max_distance=40,
                               rngs=nnx.Rngs(1))
  assert mod.embedding[...].shape == (16, 3)
  assert mod.embedding.get_metadata()["logical_axes"] == ("relpos_buckets", "heads")
  q, kv = jnp.arange(5) + 2, jnp.arange(9)
  bias = mod(q, kv)
  assert bias.shape == (1, 3, 5, 9) and bias.dtype == jnp.float32
  want = t5_position_bias(mod.embedding[...], q, kv, bidirectional=bidirectional, num_buckets=16,
                          max_distance=40)
  np.testing.assert_array_equal(np.asarray(bias), np.asarray(want))
  jitted = nnx.jit(lambda m, q, k: m(q, k))(mod, q, kv)
  np.testing.assert_array_equal(np.asarray(jitted), np.asarray(bias))


def test_t5_module_errors():
  with pytest.raises(ValueError, match="num_heads"):
    T5RelativePositionBias(0, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="num_buckets"):
    T5RelativePositionBias(2, num_buckets=2, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="max_distance"):
    T5RelativePositionBias(2, num_buckets=32, max_distance=4, rngs=nnx.Rngs(0))


def test_param_specs_from_logical_axes():
  from jaxattn.sharding import param_specs
  mod = T5RelativePositionBias(4, rngs=nnx.Rngs(0))
  specs = param_specs(nnx.state(mod))
  assert tuple(jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))[0]) \
      == (None, "tensor")
