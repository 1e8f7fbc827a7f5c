"""INT8 / FP8 block quantization: scales, round trip error bounds, amax floor, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.ops.quantization import (FP8_E4M3_MAX, dequantize, fake_quantize, quantize_fp8,
                                      quantize_int8)


def test_int8_per_token_matches_numpy():
  x = np.asarray(jax.random.normal(jax.random.key(0), (3, 5, 16))) * 3
  q, s = quantize_int8(jnp.asarray(x))
  assert q.dtype == jnp.int8 and s.shape == (3, 5, 1)
  s_ref = np.abs(x).max(-1, keepdims=True) / 127
  np.testing.assert_allclose(s, s_ref, rtol=1e-6)
  np.testing.assert_array_equal(q, np.clip(np.round(x / s_ref), -127, 127).astype(np.int8))
  err = np.abs(np.asarray(dequantize(q, s)) - x)
  assert np.all(err <= s_ref / 2 + 1e-6)  # half a quantization step
  assert int(jnp.max(jnp.abs(q.astype(jnp.int32)))) == 127


def test_int8_per_block_scales_are_per_block():
  x = jnp.concatenate([jnp.full((2, 4), 100.0), jnp.full((2, 4), 0.01)], axis=-1)
  q, s = quantize_int8(x, block_size=4)
  assert s.shape == (2, 2)
  # The small block keeps its values because it has its own scale; per-token it would round to 0.
  np.testing.assert_allclose(dequantize(q, s), x, rtol=1e-2)
  q1, s1 = quantize_int8(x)
  np.testing.assert_array_equal(dequantize(q1, s1)[:, 4:], 0.0)


def test_fp8_blocks_floor_and_round_trip():
  k = jax.random.key(1)
  x = jax.random.normal(k, (4, 256)) * jnp.where(jnp.arange(256) < 128, 1.0, 1e3)
  q, s = quantize_fp8(x)
  assert q.dtype == jnp.float8_e4m3fn and s.shape == (4, 2)
  np.testing.assert_allclose(s, jnp.max(jnp.abs(x.reshape(4, 2, 128)), -1) / FP8_E4M3_MAX,
                             rtol=1e-6)
  # e4m3 has 3 mantissa bits: relative error <= 2^-4 for normal numbers.
  xd = dequantize(q, s)
  big = jnp.abs(x) > 1e-2 * jnp.repeat(s, 128, axis=-1) * FP8_E4M3_MAX
  assert float(jnp.max(jnp.where(big, jnp.abs(xd - x) / jnp.abs(x), 0))) <= 2.0 ** -4 + 1e-6
  # All-zero block: the amax floor keeps the scale finite and the result zero, never NaN.
  qz, sz = quantize_fp8(jnp.zeros((1, 128)))
  np.testing.assert_allclose(sz, 1e-4 / FP8_E4M3_MAX)
  np.testing.assert_array_equal(dequantize(qz, sz), 0.0)


def test_fp8_ue8m0_scales_are_powers_of_two():
  x = jax.random.normal(jax.random.key(2), (3, 128)) * 7
  q, s = quantize_fp8(x, scale_format="ue8m0")
  np.testing.assert_allclose(np.log2(s), np.round(np.log2(s)), atol=1e-6)
  assert float(jnp.max(jnp.abs(q.astype(jnp.float32)))) <= FP8_E4M3_MAX
  np.testing.assert_allclose(dequantize(q, s), x, rtol=0.07, atol=1e-3)


def test_seed_dynamic_range_crushes_small_entries():
  # The seed's [1000, 0.01, 0.001, 500]: one per-token INT8 scale rounds 0.01 and 0.001 to zero.
  # (experiments/hadamard_quant.py measures how far the Hadamard rotation reduces such errors.)
  x = jnp.array([[1000.0, 0.01, 0.001, 500.0]])
  q, s = quantize_int8(x)
  assert float(dequantize(q, s)[0, 1]) == 0.0
  probe = jnp.array([[0.0, 1000.0, 0.0, 0.0]])  # reads only the small entry
  exact = float(jnp.sum(x * probe))
  plain = float(jnp.sum(fake_quantize(x, "int8") * probe))
  assert plain == 0.0 and exact == pytest.approx(10.0)


def test_errors():
  with pytest.raises(ValueError, match="block_size"):
    quantize_int8(jnp.ones((2, 6)), block_size=4)
  q, scale = quantize_int8(jnp.ones((2, 8)), block_size=np.int64(4))  # a NumPy int is an int
  assert scale.shape == (2, 2)
  with pytest.raises(ValueError, match="amax_floor"):
    quantize_fp8(jnp.ones((2, 128)), amax_floor=0.0)
  with pytest.raises(ValueError, match="scale_format"):
    quantize_fp8(jnp.ones((2, 128)), scale_format="e5m2")
  with pytest.raises(ValueError, match="scale"):
    dequantize(jnp.ones((2, 8), jnp.int8), jnp.ones((2, 3)))
  with pytest.raises(ValueError, match="fmt"):
    fake_quantize(jnp.ones((2, 8)), "int4")
