"""Hadamard transform: the seed's examples, orthonormality, invariance of dot products, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.ops.hadamard import hadamard_matrix, hadamard_transform


def _sylvester_np(n):
  h = np.ones((1, 1))
  while h.shape[0] < n:
    h = np.block([[h, h], [h, -h]])
  return h / np.sqrt(n)


def test_seed_h4_and_spike():
  # The seed's H_4 = 1/2 [[1,1,1,1],[1,-1,1,-1],[1,1,-1,-1],[1,-1,-1,1]].
  h4 = 0.5 * np.array([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]], np.float32)
  np.testing.assert_allclose(hadamard_matrix(4), h4, atol=1e-7)
  y = hadamard_transform(jnp.array([8.0, 0.0, 0.0, 0.0]))
  np.testing.assert_allclose(y, [4.0, 4.0, 4.0, 4.0], atol=1e-6)


@pytest.mark.parametrize("n", [1, 2, 8, 64, 128])
def test_matches_matrix_and_is_orthonormal(n):
  x = jax.random.normal(jax.random.key(0), (3, n))
  h = _sylvester_np(n)
  np.testing.assert_allclose(hadamard_transform(x), np.asarray(x) @ h.T, atol=1e-5)
  # H^T H = I, read off the transform applied to the identity's rows.
  m = np.asarray(hadamard_transform(jnp.eye(n)))
  np.testing.assert_allclose(m.T @ m, np.eye(n), atol=1e-5)
  # Self-inverse (symmetric + orthogonal).
  np.testing.assert_allclose(hadamard_transform(hadamard_transform(x)), x, atol=1e-5)


def test_dot_products_unchanged_and_axis():
  kq, kk = jax.random.split(jax.random.key(1))
  q = jax.random.normal(kq, (2, 5, 32))
  k = jax.random.normal(kk, (2, 7, 32))
  before = jnp.einsum("btd,bsd->bts", q, k)
  after = jnp.einsum("btd,bsd->bts", hadamard_transform(q), hadamard_transform(k))
  np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-4)
  # A non-last axis gives the same numbers as moving it last.
  x = jax.random.normal(kq, (4, 16, 3))
  np.testing.assert_allclose(hadamard_transform(x, axis=1),
                             jnp.moveaxis(hadamard_transform(jnp.moveaxis(x, 1, -1)), -1, 1),
                             atol=1e-6)


def test_flattens_spiky_vectors():
  x = jnp.zeros((64,)).at[3].set(100.0).at[40].set(-30.0)
  y = hadamard_transform(x)
  # Same energy, far smaller peak-to-RMS ratio.
  np.testing.assert_allclose(jnp.sum(y * y), jnp.sum(x * x), rtol=1e-5)
  crest = lambda v: float(jnp.max(jnp.abs(v)) / jnp.sqrt(jnp.mean(v * v)))
  assert crest(y) < 0.25 * crest(x)


def test_bf16_dtype_kept():
  x = jnp.ones((2, 8), jnp.bfloat16)
  assert hadamard_transform(x).dtype == jnp.bfloat16


@pytest.mark.parametrize("n", [3, 6, 12, 0])
def test_non_power_of_two_raises(n):
  with pytest.raises(ValueError, match="power of two"):
    hadamard_transform(jnp.ones((2, n)))


def test_bad_axis_raises():
  with pytest.raises(ValueError, match="axis"):
    hadamard_transform(jnp.ones((2, 4)), axis=2)


def test_integer_inputs_and_sizes_are_refused():
  with pytest.raises(ValueError, match="floating-point"):  # fp32 math cut back to ints was 0
    hadamard_transform(jnp.array([1, 0, 0, 0]))
  for bad in (True, 4.0):
    with pytest.raises(ValueError, match="`n` must be an int"):
      hadamard_matrix(bad)
