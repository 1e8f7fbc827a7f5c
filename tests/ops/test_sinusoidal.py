"""Sinusoidal positional encoding: the seed's formula, d = 4 walkthrough and relative property."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.ops.sinusoidal import sinusoidal_positions


def test_seed_walkthrough_d4():
  # w_0 = 1, w_1 = 10000^(-1/2) = 1/100: PE(m) = [sin m, cos m, sin(m/100), cos(m/100)].
  pe = np.asarray(sinusoidal_positions(jnp.arange(4), 4))
  want = np.array([[math.sin(m), math.cos(m), math.sin(m / 100), math.cos(m / 100)]
                   for m in range(4)])
  np.testing.assert_allclose(pe, want, rtol=1e-6, atol=1e-7)
  np.testing.assert_array_equal(pe[0], [0.0, 1.0, 0.0, 1.0])


def test_matches_numpy_formula_and_concatenated_layout():
  d, pos = 16, np.array([0, 1, 5, 99, 1000])
  w = 10000.0 ** (-2.0 * np.arange(d // 2) / d)
  want = np.zeros((len(pos), d))
  want[:, 0::2], want[:, 1::2] = np.sin(np.outer(pos, w)), np.cos(np.outer(pos, w))
  pe = np.asarray(sinusoidal_positions(pos, d))
  assert pe.dtype == np.float32 and pe.shape == (5, d)
  # fp32 angles up to 1000 rad: absolute error ~1000 * 2^-24.
  np.testing.assert_allclose(pe, want, atol=1e-4)
  concat = np.asarray(sinusoidal_positions(pos, d, interleaved=False))
  np.testing.assert_array_equal(concat, np.concatenate([pe[:, 0::2], pe[:, 1::2]], axis=-1))


def test_dot_product_depends_only_on_offset():
  # <PE_m, PE_n> = sum_i cos(w_i (m - n)), the same for every pair with the same offset.
  d = 32
  w = 10000.0 ** (-2.0 * np.arange(d // 2) / d)
  pe = np.asarray(sinusoidal_positions(jnp.arange(200), d), np.float64)
  for offset in (0, 1, 7, 50):
    dots = np.einsum("td,td->t", pe[offset:], pe[:200 - offset])
    np.testing.assert_allclose(dots, np.cos(w * offset).sum(), atol=1e-5)


def test_batched_positions_and_base():
  pos = np.array([[0, 1, 2], [10, 11, 12]])
  pe = np.asarray(sinusoidal_positions(pos, 6, base=100.0))
  assert pe.shape == (2, 3, 6)
  np.testing.assert_array_equal(pe[1], np.asarray(sinusoidal_positions(pos[1], 6, base=100.0)))
  np.testing.assert_allclose(pe[0, 1, 2], math.sin(100.0 ** (-2 / 6)), rtol=1e-6)


def test_numpy_integer_dim():
  np.testing.assert_array_equal(sinusoidal_positions(jnp.arange(3), np.int64(6)),
                                sinusoidal_positions(jnp.arange(3), 6))


@pytest.mark.parametrize("dim", [3, 0, -2, 6.0, True])
def test_bad_dim(dim):
  with pytest.raises(ValueError, match="dim"):
    sinusoidal_positions(jnp.arange(3), dim)


@pytest.mark.parametrize("base", [0.0, -1.0, float("inf"), True])
def test_bad_base(base):
  with pytest.raises(ValueError, match="`base`"):
    sinusoidal_positions(jnp.arange(3), 4, base=base)


@pytest.mark.parametrize("positions", [jnp.array([0.5, 1.7]), jnp.array([True, False])])
def test_non_integer_positions(positions):
  with pytest.raises(ValueError, match="`positions` must be an integer array"):
    sinusoidal_positions(positions, 4)
