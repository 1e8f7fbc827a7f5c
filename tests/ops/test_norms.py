import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.ops.norms import layer_norm, rms_norm


def _x(dtype=jnp.float32):
  return (jax.random.normal(jax.random.key(0), (3, 5, 16)) * 3 + 1).astype(dtype)


def test_layer_norm_matches_numpy():
  x = np.asarray(_x())
  g, b = np.linspace(0.5, 2, 16, dtype=np.float32), np.linspace(-1, 1, 16, dtype=np.float32)
  want = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-6) * g + b
  np.testing.assert_allclose(layer_norm(jnp.asarray(x), jnp.asarray(g), jnp.asarray(b)), want,
                             atol=1e-5, rtol=1e-5)
  y = np.asarray(layer_norm(jnp.asarray(x)))
  np.testing.assert_allclose(y.mean(-1), 0, atol=1e-5)
  np.testing.assert_allclose(y.var(-1), 1, atol=1e-4)


def test_rms_norm_matches_numpy_and_zero_centered():
  x = np.asarray(_x())
  g = np.linspace(0.5, 2, 16, dtype=np.float32)
  want = x / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-5) * g
  np.testing.assert_allclose(rms_norm(jnp.asarray(x), jnp.asarray(g), eps=1e-5), want, rtol=1e-5)
  np.testing.assert_allclose(rms_norm(jnp.asarray(x), jnp.asarray(g - 1), eps=1e-5,
                                      zero_centered_scale=True), want, rtol=1e-5)
  # RMSNorm does not center: a constant vector keeps its sign, LayerNorm maps it to zero.
  c = jnp.full((1, 8), 2.0)
  np.testing.assert_allclose(rms_norm(c), 1.0, rtol=1e-5)
  np.testing.assert_allclose(layer_norm(c), 0.0, atol=1e-5)


def test_bf16_uses_fp32_statistics():
  x = _x(jnp.bfloat16) + 300.0  # large mean: bf16 statistics would lose the variance entirely
  y = layer_norm(x)
  assert y.dtype == jnp.bfloat16
  ref = layer_norm(x.astype(jnp.float32))
  np.testing.assert_allclose(y.astype(jnp.float32), ref, atol=3e-2)
  assert rms_norm(x).dtype == jnp.bfloat16


def test_grad_jit_vmap():
  x = _x()
  g = jax.grad(lambda x: rms_norm(x, jnp.ones(16)).sum())(x)
  assert np.isfinite(np.asarray(g)).all()
  np.testing.assert_allclose(jax.jit(layer_norm)(x), jax.vmap(layer_norm)(x), atol=1e-6)


def test_errors():
  with pytest.raises(ValueError, match="scale"):
    rms_norm(_x(), jnp.ones(15))
  with pytest.raises(ValueError, match="bias"):
    layer_norm(_x(), jnp.ones(16), jnp.ones(3))
  with pytest.raises(ValueError, match="eps"):
    rms_norm(_x(), eps=-1.0)
  with pytest.raises(ValueError, match=r"`scale` must have shape \(16,\).*got \(2,\)"):
    rms_norm(_x(), [1.0, 1.0])


def test_list_params():
  x, g, b = _x(), np.linspace(0.5, 1.5, 16), np.linspace(-1, 1, 16)
  np.testing.assert_array_equal(layer_norm(x, list(g), list(b)),
                                layer_norm(x, jnp.asarray(g), jnp.asarray(b)))
  np.testing.assert_array_equal(rms_norm(x, list(g)), rms_norm(x, jnp.asarray(g)))


def test_eps_errors():
  for bad in (None, "1e-6", float("nan")):
    with pytest.raises(ValueError, match="`eps` must be a number >= 0"):
      rms_norm(_x(), eps=bad)
