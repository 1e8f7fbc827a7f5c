"""NF4 block quantization: the bitsandbytes codebook, packing, double quantization, round-trip error."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.ops.nf4 import (DYNAMIC_MAP, NF4_CODEBOOK, dequantize_blockwise_8bit, dequantize_nf4,
                             nf4_block_scales, nf4_bytes, nf4_einsum, pack_4bit,
                             quantize_blockwise_8bit, quantize_nf4, unpack_4bit)

# The 16 NF4 levels exactly as bitsandbytes lists them (bitsandbytes/functional.py,
# get_4bit_type("nf4"); the same constants are hard-coded in its CUDA dequantization decision tree).
# bitsandbytes is not installed here (no GPU build), so they are written out.
BNB_NF4 = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
]

# A known block, worked out by hand with the rules of bitsandbytes' reference implementation
# (backends/default/ops.py, quantize_4bit): absmax per 64-block, x * (1 / absmax) clamped to
# [-1, 1], index of the nearest level (argmin |x - level|), and `packed = q[::2] << 4 | q[1::2]`.
# absmax = 2.0; normalized: -1 -> 0, 1 -> 15, 0 -> 7, 0.25 -> 10 (0.2461), -0.15 -> 5 (-0.1848),
# 0.6 -> 13 (0.5626), -0.5 -> 2 (-0.5251), 0.05 -> 8 (0.0796); the 56 zeros -> 7.
EXAMPLE_BLOCK = [-2.0, 2.0, 0.0, 0.5, -0.3, 1.2, -1.0, 0.1] + [0.0] * 56
EXAMPLE_INDICES = [0, 15, 7, 10, 5, 13, 2, 8] + [7] * 56
EXAMPLE_PACKED = [0x0F, 0x7A, 0x5D, 0x28] + [0x77] * 28
EXAMPLE_ABSMAX = [2.0]

# bitsandbytes' tests/test_functional.py::test_4bit_quant, nf4 with block size 64 on randn(1024, 1024):
# mean abs error (0.072798 +- 0.000074) and mean relative error (0.203339 +- 0.000340), asserted
# below mean + 7 std.
BNB_MEAN_ABS_ERR_BOUND = 0.072798 + 7 * 0.000074      # 0.0733
BNB_MEAN_REL_ERR_BOUND = 0.203339 + 7 * 0.000340


def _randn(seed, shape):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_codebook_is_bitsandbytes_nf4():
  np.testing.assert_array_equal(NF4_CODEBOOK, np.asarray(BNB_NF4, np.float32))
  assert NF4_CODEBOOK[7] == 0.0 and (np.diff(NF4_CODEBOOK) > 0).all()
  # Asymmetric: 7 negative levels, 8 positive ones, both ends at +-1.
  assert (NF4_CODEBOOK < 0).sum() == 7 and (NF4_CODEBOOK > 0).sum() == 8


def test_known_block_quantizes_and_packs_like_bitsandbytes():
  q = quantize_nf4(jnp.asarray(EXAMPLE_BLOCK), double_quant=False)
  np.testing.assert_array_equal(q.packed, np.asarray(EXAMPLE_PACKED, np.uint8))
  np.testing.assert_array_equal(q.absmax, EXAMPLE_ABSMAX)
  np.testing.assert_array_equal(unpack_4bit(q.packed), EXAMPLE_INDICES)
  want = NF4_CODEBOOK[EXAMPLE_INDICES] * 2.0
  np.testing.assert_array_equal(dequantize_nf4(q, (64,)), want)
  # Odd length: bitsandbytes pads the values with 0.0, i.e. index 7 in the last low nibble.
  q5 = quantize_nf4(jnp.asarray(EXAMPLE_BLOCK[:5]), double_quant=False)
  np.testing.assert_array_equal(q5.packed, [0x0F, 0x7A, 0x57])
  np.testing.assert_allclose(dequantize_nf4(q5, (5,)), want[:5])


def test_quantization_equals_an_argmin_reference():
  # Independent reference: the nearest level by brute force (as bitsandbytes' default backend).
  w = _randn(0, (40, 96)) * 0.02                 # 3840 values = 60 blocks of 64, weight-like scale
  blocks = w.reshape(-1, 64)
  absmax = np.abs(blocks).max(-1)
  scaled = np.clip(blocks * (1 / absmax)[:, None], -1, 1)
  idx = np.argmin(np.abs(scaled[..., None] - NF4_CODEBOOK), axis=-1).reshape(-1)
  q = quantize_nf4(jnp.asarray(w), double_quant=False)
  np.testing.assert_array_equal(unpack_4bit(q.packed), idx)
  np.testing.assert_array_equal(q.packed, (idx[0::2] << 4) | idx[1::2])
  np.testing.assert_array_equal(q.absmax, absmax)
  np.testing.assert_allclose(dequantize_nf4(q, w.shape), (NF4_CODEBOOK[idx].reshape(-1, 64)
                                                          * absmax[:, None]).reshape(w.shape))


@pytest.mark.parametrize("double_quant", [False, True])
def test_round_trip_error_within_bitsandbytes_bounds(double_quant):
  w = _randn(1, (1024, 1024))
  q = quantize_nf4(jnp.asarray(w), double_quant=double_quant)
  err = np.abs(np.asarray(dequantize_nf4(q, w.shape)) - w)
  assert err.mean() < BNB_MEAN_ABS_ERR_BOUND
  assert (err / (np.abs(w) + 1e-8)).mean() < BNB_MEAN_REL_ERR_BOUND
  # Per value, the error is at most half the widest gap between levels, times the block's absmax
  # (plus the scale's own 8-bit error with double quantization).
  scales = np.asarray(nf4_block_scales(q)).repeat(64).reshape(w.shape)
  half_gap = np.diff(NF4_CODEBOOK).max() / 2
  assert (err <= half_gap * scales + 0.01 * double_quant * np.abs(w) + 1e-6).all()


def test_dynamic_map_and_double_quantized_scales():
  m = DYNAMIC_MAP
  # bitsandbytes' create_dynamic_map(signed=True): 256 sorted distinct values, 0 and 1 included, the
  # coarsest magnitudes are the midpoints of 64 steps on [0.1, 1], the finest 0.55e-6.
  assert m.shape == (256,) and len(np.unique(m)) == 256 and (np.diff(m) > 0).all()
  assert 0.0 in m and m[-1] == 1.0 and m[0] == np.float32(-0.99296875)
  np.testing.assert_allclose(m[m > 0].min(), 0.55e-6, rtol=1e-6)
  assert (m > 0).sum() == 128 and (m < 0).sum() == 127
  x = _randn(2, (1000,))
  codes, absmax = quantize_blockwise_8bit(jnp.asarray(x), block_size=256)
  assert codes.dtype == np.uint8 and absmax.shape == (4,)
  back = np.asarray(dequantize_blockwise_8bit(codes, absmax, block_size=256))
  step = np.diff(m).max() / 2                       # widest half-gap of the code, near |x| = 1
  assert (np.abs(back - x) <= step * np.asarray(absmax).repeat(256)[:1000] + 1e-7).all()
  # Double quantization of NF4 block scales: offset = mean, 8-bit codes, one fp32 per 256 blocks.
  w = _randn(3, (512, 512))
  q2, q1 = quantize_nf4(jnp.asarray(w)), quantize_nf4(jnp.asarray(w), double_quant=False)
  assert q2.absmax.dtype == np.uint8 and q2.absmax.shape == (4096,) and q2.absmax_scale.shape == (16,)
  np.testing.assert_allclose(q2.absmax_offset, np.mean(q1.absmax), rtol=1e-6)
  scale_err = np.abs(np.asarray(nf4_block_scales(q2)) - np.asarray(q1.absmax))
  assert (scale_err <= step * np.asarray(q2.absmax_scale).repeat(256) + 1e-6).all()


def test_storage_is_4_127_bits_per_weight():
  w = jnp.zeros((1024, 1024)).at[0, 0].set(1.0)
  q = quantize_nf4(w)
  n = w.size
  assert nf4_bytes(q) == n // 2 + n // 64 + 4 * (n // 64 // 256) + 4
  np.testing.assert_allclose(8 * nf4_bytes(q) / n, 4 + 8 / 64 + 32 / (64 * 256), atol=1e-4)
  assert nf4_bytes(quantize_nf4(w, double_quant=False)) == n // 2 + 4 * n // 64


def test_zero_blocks_pack_and_dtypes():
  w = jnp.concatenate([jnp.zeros(64), jnp.asarray(_randn(4, (64,)))])
  q = quantize_nf4(w)
  np.testing.assert_array_equal(q.packed[:32], 0x77)
  out = dequantize_nf4(q, (2, 64), dtype=jnp.bfloat16)
  assert out.dtype == jnp.bfloat16 and out.shape == (2, 64)
  np.testing.assert_array_equal(np.asarray(out[0], np.float32), 0.0)
  np.testing.assert_array_equal(unpack_4bit(pack_4bit(jnp.arange(16, dtype=jnp.uint8))), np.arange(16))


def test_nf4_einsum_equals_the_dequantized_matmul_forward_and_backward():
  w = _randn(5, (32, 3, 8))
  q = quantize_nf4(jnp.asarray(w))
  kernel = dequantize_nf4(q, w.shape)
  x = jnp.asarray(_randn(6, (2, 5, 32)))
  spec = "BTD,DNH->BTNH"
  np.testing.assert_allclose(nf4_einsum(spec, x, q, w.shape), jnp.einsum(spec, x, kernel), atol=1e-5)
  loss = lambda f: (lambda x: jnp.sum(jnp.sin(f(x))))
  got = jax.jit(jax.grad(loss(lambda x: nf4_einsum(spec, x, q, w.shape))))(x)
  want = jax.grad(loss(lambda x: jnp.einsum(spec, x, kernel)))(x)
  np.testing.assert_allclose(got, want, atol=1e-5)
  y = nf4_einsum(spec, x, q, w.shape, dtype=jnp.bfloat16)
  assert y.dtype == jnp.bfloat16


def test_errors():
  with pytest.raises(ValueError, match="block_size"):
    quantize_nf4(jnp.ones(64), block_size=63)
  with pytest.raises(ValueError, match="floating"):
    quantize_nf4(jnp.ones(64, jnp.int32))
  with pytest.raises(ValueError, match="empty"):
    quantize_nf4(jnp.ones((0, 4)))
  q = quantize_nf4(jnp.ones(128))
  with pytest.raises(ValueError, match="shape"):
    dequantize_nf4(q, (64,))


def test_dequantize_checks_block_sizes_against_the_tensor():
  # The block sizes are not stored in the tensor: sizes its shapes contradict are refused (they
  # would scale values by another block's absmax), naming the size the shapes imply.
  w = jnp.asarray(_randn(5, (10, 64)))
  q = quantize_nf4(w, scale_block_size=4)  # 10 blocks of 64, 3 scales of 4 blocks
  assert q.absmax.shape == (10,) and q.absmax_scale.shape == (3,)
  good = dequantize_nf4(q, w.shape, scale_block_size=4)
  assert float(jnp.abs(good - w).max()) < 0.5 * float(jnp.abs(w).max())
  # 640 values in 10 blocks: any block size in [64, 71] gives that many.
  with pytest.raises(ValueError, match=r"`block_size`=128 .* imply block_size in \[64, 71\]"):
    dequantize_nf4(q, w.shape, block_size=128, scale_block_size=4)
  with pytest.raises(ValueError, match=r"`block_size`=32 .* imply block_size in \[64, 71\]"):
    dequantize_nf4(q, w.shape, block_size=32, scale_block_size=4)
  with pytest.raises(ValueError, match=r"`scale_block_size`=256 .* imply scale_block_size=4\."):
    dequantize_nf4(q, w.shape)  # the default 256 wants 1 scale
  with pytest.raises(ValueError, match="scale_block_size"):
    dequantize_nf4(q, w.shape, scale_block_size=0)
  with pytest.raises(ValueError, match="absmax_offset"):
    dequantize_nf4(q._replace(absmax_offset=None), w.shape, scale_block_size=4)
  with pytest.raises(ValueError, match="scale_block_size"):
    nf4_block_scales(q)
  # nf4_einsum dequantizes the same way and checks the same.
  with pytest.raises(ValueError, match="block_size"):
    nf4_einsum("bi,io->bo", jnp.ones((1, 10)), q, w.shape, block_size=128, scale_block_size=4)
  # Without double quantization only `absmax` is checked against block_size.
  q1 = quantize_nf4(w, double_quant=False)
  np.testing.assert_array_equal(dequantize_nf4(q1, w.shape, scale_block_size=2),
                                dequantize_nf4(q1, w.shape))
  with pytest.raises(ValueError, match=r"imply block_size in \[64, 71\]"):
    dequantize_nf4(q1, w.shape, block_size=128)
