"""MXFP4 (OCP microscaling: FP4 E2M1 codes, one E8M0 scale per 32 values): exact round trips,
the specification's scale and rounding, the error bound, the host (NumPy) twin, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.ops.mxfp4 import (E2M1, FP4_VALUES, dequantize_mxfp4, dequantize_mxfp4_host,
                               quantize_mxfp4)


def test_representable_values_round_trip_exactly():
  """Groups of E2M1 values times a power of two (each group containing a 4 or a 6, so that the
  shared exponent is that power) come back bit for bit, along any axis."""
  rng = np.random.default_rng(0)
  codes = rng.integers(0, 16, (3, 4, 64))
  codes[..., ::32] = 6                                       # 4.0: the group's exponent is e
  exps = rng.integers(-10, 10, (3, 4, 2))
  x = FP4_VALUES[codes] * np.exp2(np.repeat(exps, 32, axis=-1))
  blocks, scales = quantize_mxfp4(x)
  assert blocks.shape == (3, 4, 2, 16) and blocks.dtype == jnp.uint8
  np.testing.assert_array_equal(scales, exps + 127)
  np.testing.assert_array_equal(dequantize_mxfp4(blocks, scales), x)
  bt, st = quantize_mxfp4(np.swapaxes(x, 1, 2), axis=1)     # the same values along axis 1
  np.testing.assert_array_equal(bt, blocks)
  np.testing.assert_array_equal(st, scales)


def test_scale_rule_rounding_and_saturation():
  """Shared exponent ``floor(log2(amax)) - 2``: amax 7.0 -> exponent 0, so 7.0 saturates to 6.0;
  ties round to the even code (0.25 -> 0, 0.75 -> 1, 2.5 -> 2, 5 -> 4); the sign is kept; an
  all-zero group decodes to zeros."""
  g = np.zeros(32, np.float32)
  g[:7] = [7.0, 0.25, 0.75, 2.5, 5.0, -1.5, -0.3]
  blocks, scales = quantize_mxfp4(np.stack([g, np.zeros(32, np.float32)]))
  assert scales.tolist() == [[127], [0]]
  got = np.asarray(dequantize_mxfp4(blocks, scales))
  np.testing.assert_array_equal(got[0, :7], [6.0, 0.0, 1.0, 2.0, 4.0, -1.5, -0.5])
  np.testing.assert_array_equal(got[1], 0.0)
  assert int(blocks[0, 0, 0]) == 0x07          # code 7 (6.0) in the low nibble, 0.0 in the high


def test_error_bound_and_host_twin():
  """Random values: every error is at most a quarter of its group's largest magnitude (the
  saturation at 6 of values up to 8, the worst case), and the NumPy twin decodes identically."""
  x = jax.random.normal(jax.random.key(1), (8, 96)) * jnp.exp(jax.random.normal(
      jax.random.key(2), (8, 1)))
  blocks, scales = quantize_mxfp4(x)
  back = dequantize_mxfp4(blocks, scales)
  amax = jnp.repeat(jnp.max(jnp.abs(x.reshape(8, 3, 32)), -1), 32, axis=-1)
  assert bool(jnp.all(jnp.abs(back - x) <= 0.25 * amax))
  np.testing.assert_array_equal(dequantize_mxfp4_host(np.asarray(blocks), np.asarray(scales)),
                                back)
  assert dequantize_mxfp4(blocks, scales, dtype=jnp.bfloat16).dtype == jnp.bfloat16
  assert E2M1.tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_every_byte_at_every_scale_decodes_as_the_table():
  """The JAX dequantization builds values from their bits (one fusion, no table gather): every
  byte (both nibbles) at every scale 2^-126 .. 2^127 equals the NumPy table's decoding, signs of
  zero included -- except that a device may flush subnormal results (below 2^-126) to zero, and
  scale byte 0 (2^-127 is itself subnormal: groups of zeros, as quantize_mxfp4 writes them)."""
  blocks = np.broadcast_to(np.arange(256, dtype=np.uint8).reshape(16, 16), (254, 16, 16)).copy()
  scales = np.broadcast_to(np.arange(1, 255, dtype=np.uint8)[:, None], (254, 16)).copy()
  with np.errstate(over="ignore"):
    want = dequantize_mxfp4_host(blocks, scales)
  got = np.asarray(dequantize_mxfp4(blocks, scales))
  normal = np.abs(want) >= 2.0 ** -126
  np.testing.assert_array_equal(got[normal], want[normal])
  assert np.all((got[~normal] == want[~normal]) | (got[~normal] == 0))
  np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
  assert normal[1:].sum() == 253 * (512 - 64)   # from scale 2^-125 on, all but the 64 zeros


def test_errors():
  with pytest.raises(ValueError, match="multiple of 32"):
    quantize_mxfp4(np.ones((2, 48), np.float32))
  with pytest.raises(ValueError, match="floating-point"):
    quantize_mxfp4(np.ones((2, 32), np.int32))
  with pytest.raises(ValueError, match="MXFP4 wants uint8"):
    dequantize_mxfp4(np.ones((2, 16), np.int32), np.ones((2,), np.uint8))
