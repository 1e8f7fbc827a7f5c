"""RoPE: the seed's formula and properties, partial RoPE, scalings, dtypes, transformations, errors."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.test_util import check_grads

from jaxattn.ops.rope import RopeScaling, apply_rope, rope_frequencies, yarn_mscale


def _rand(shape, seed=0, dtype=np.float32):
  return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _seed_rotation_matrix(m, dim, base=10000.0):
  """The seed's block-diagonal R_{theta,m} (float64), blocks [[cos, -sin], [sin, cos]]."""
  theta = base ** (-2.0 * np.arange(dim // 2) / dim)
  r = np.zeros((dim, dim))
  for i, t in enumerate(theta):
    c, s = math.cos(m * t), math.sin(m * t)
    r[2 * i:2 * i + 2, 2 * i:2 * i + 2] = [[c, -s], [s, c]]
  return r


def _deinterleave(dim):
  """Permutation taking consecutive pairs (x0,x1),(x2,x3),... to the half split (evens, odds)."""
  return np.concatenate([np.arange(0, dim, 2), np.arange(1, dim, 2)])


# -- the formula ---------------------------------------------------------------------------------

def test_interleaved_matches_seed_block_diagonal_matrix():
  t, n, h = 6, 2, 8
  x = _rand((1, t, n, h))
  positions = np.array([0, 1, 2, 7, 50, 123])
  got = np.asarray(apply_rope(x, positions, interleaved=True))
  want = np.stack([x[0, i] @ _seed_rotation_matrix(m, h).T for i, m in enumerate(positions)])
  np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5)


def test_seed_walkthrough_first_pair():
  # One pair, theta_0 = 1: RoPE((q1, q2), m) = (q1 cos m - q2 sin m, q1 sin m + q2 cos m).
  q = np.array([[[[2.0, -1.0]]]], np.float32)
  got = np.asarray(apply_rope(q, np.array([3]), interleaved=True))[0, 0, 0]
  np.testing.assert_allclose(got, [2 * math.cos(3) + math.sin(3), 2 * math.sin(3) - math.cos(3)],
                             rtol=1e-6)


def test_half_split_is_interleaved_after_permutation():
  h = 16
  x = _rand((2, 5, 3, h), seed=1)
  pos = np.arange(5) * 37
  perm = _deinterleave(h)
  inter = np.asarray(apply_rope(x, pos, interleaved=True))
  half = np.asarray(apply_rope(x[..., perm], pos, interleaved=False))
  np.testing.assert_allclose(half, inter[..., perm], rtol=1e-6, atol=1e-6)


def test_position_zero_is_identity():
  x = _rand((1, 3, 2, 8))
  for interleaved in (True, False):
    out = apply_rope(x, np.zeros(3, np.int32), interleaved=interleaved)
    np.testing.assert_array_equal(np.asarray(out), x)


@pytest.mark.parametrize("interleaved", [True, False])
def test_rotation_preserves_norm(interleaved):
  x = _rand((2, 7, 3, 16), seed=2)
  out = np.asarray(apply_rope(x, np.arange(7) * 1000, interleaved=interleaved))
  np.testing.assert_allclose(np.linalg.norm(out, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)


def _score(q, k, m, n, **kw):
  """q_m . k_n after RoPE, for one head vector each."""
  qm = apply_rope(q[None, None, None], np.array([m]), **kw)[0, 0, 0]
  kn = apply_rope(k[None, None, None], np.array([n]), **kw)[0, 0, 0]
  return float(jnp.dot(qm, kn))


@settings(max_examples=30, deadline=None)
@given(m=st.integers(0, 60), n=st.integers(0, 60), shift=st.integers(0, 60),
       interleaved=st.booleans())
def test_score_depends_only_on_offset(m, n, shift, interleaved):
  q, k = _rand((16,), seed=3), _rand((16,), seed=4)
  a = _score(q, k, m, n, interleaved=interleaved)
  b = _score(q, k, m + shift, n + shift, interleaved=interleaved)
  # fp32 angles at positions <= 120: absolute angle error <= 120 * 2^-24 rad.
  assert abs(a - b) <= 1e-5 * (np.linalg.norm(q) * np.linalg.norm(k))


def test_score_is_seed_relative_rotation():
  # q_m^T k_n = q^T R_{theta, n - m} k (the seed's closed form, float64 reference).
  h = 8
  q, k = _rand((h,), seed=5), _rand((h,), seed=6)
  for m, n in [(0, 0), (3, 11), (40, 2), (100, 250)]:
    want = q @ _seed_rotation_matrix(n - m, h) @ k
    np.testing.assert_allclose(_score(q, k, m, n, interleaved=True), want, rtol=1e-4, atol=1e-4)


def test_long_term_decay():
  # The seed: the achievable score shrinks with |m - n| as the per-pair cosines fall out of phase.
  # With q = k = ones, q_0 . k_r = 2 * sum_i cos(r theta_i); average its size over windows.
  h = 128
  ones = jnp.ones((1, 1501, 1, h))
  keys = apply_rope(ones, jnp.arange(1501))
  query = apply_rope(ones[:, :1], jnp.zeros(1, jnp.int32))
  scores = np.abs(np.asarray(jnp.einsum("h,th->t", query[0, 0, 0], keys[0, :, 0])))
  np.testing.assert_allclose(scores[0], h, rtol=1e-6)
  windows = [scores[0:3].mean(), scores[5:16].mean(), scores[50:151].mean(),
             scores[500:1501].mean()]
  assert all(a > b for a, b in zip(windows, windows[1:])), windows
  assert windows[-1] < 0.25 * windows[0], windows
  # RoFormer's upper bound, mean_j |sum_{k<=j} exp(i r theta_k)|, decays the same way.
  theta = np.asarray(rope_frequencies(h)[0], np.float64)

  def bound(r):
    return np.abs(np.cumsum(np.exp(1j * np.outer(r, theta)), axis=-1)).mean(-1).mean()

  assert bound(np.arange(0, 3)) > 2 * bound(np.arange(500, 1501))


# -- partial RoPE, shapes ------------------------------------------------------------------------

@pytest.mark.parametrize("interleaved", [True, False])
def test_partial_rope_leaves_tail_bit_identical(interleaved):
  x = _rand((2, 5, 3, 12), seed=7)
  pos = np.arange(5) + 9
  out = np.asarray(apply_rope(x, pos, rotary_dim=4, interleaved=interleaved))
  np.testing.assert_array_equal(out[..., 4:], x[..., 4:])
  head = np.asarray(apply_rope(x[..., :4], pos, interleaved=interleaved))
  np.testing.assert_array_equal(out[..., :4], head)
  assert not np.allclose(out[..., :4], x[..., :4])


def test_positions_broadcast_and_batch_dims():
  x = _rand((2, 4, 3, 8), seed=8)
  pos = np.arange(4) + 5
  a = apply_rope(x, pos)
  b = apply_rope(x, np.broadcast_to(pos, (2, 4)))
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  per_seq = np.stack([pos, pos + 3])
  c = np.asarray(apply_rope(x, per_seq))
  np.testing.assert_array_equal(c[1], np.asarray(apply_rope(x[1:], pos + 3))[0])
  # Extra leading batch dims, unbatched [T, N, H].
  xx = _rand((2, 3, 4, 1, 8), seed=9)
  np.testing.assert_array_equal(np.asarray(apply_rope(xx, pos))[1, 2],
                                np.asarray(apply_rope(xx[1, 2], pos)))


def test_inv_freq_override_matches_base():
  x = _rand((1, 3, 2, 8))
  inv_freq, _ = rope_frequencies(8, base=500.0)
  np.testing.assert_array_equal(np.asarray(apply_rope(x, np.arange(3), inv_freq=inv_freq)),
                                np.asarray(apply_rope(x, np.arange(3), base=500.0)))
  partial = apply_rope(x, np.arange(3), inv_freq=rope_frequencies(4)[0])  # rotary_dim from it
  np.testing.assert_array_equal(np.asarray(partial)[..., 4:], x[..., 4:])


# -- dtypes --------------------------------------------------------------------------------------

@pytest.mark.parametrize("interleaved", [True, False])
def test_bf16_in_bf16_out(interleaved):
  x32 = _rand((2, 6, 2, 16), seed=10)
  x16 = jnp.asarray(x32, jnp.bfloat16)
  pos = np.array([0, 1, 256, 257, 4097, 65537])  # not all representable in bf16
  out = apply_rope(x16, pos, interleaved=interleaved)
  assert out.dtype == jnp.bfloat16
  ref = np.asarray(apply_rope(np.asarray(x16, np.float32), pos, interleaved=interleaved))
  # fp32 math on the same bf16 inputs, one final rounding: error <= 2^-9 |value| (bf16 has 8
  # significant bits), so within 2^-8 of the largest entry.
  np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=2.0**-8 * np.abs(ref).max())


# -- transformations -----------------------------------------------------------------------------

def test_jit_and_vmap():
  x = _rand((3, 5, 2, 8), seed=11)
  pos = np.stack([np.arange(5) + i for i in range(3)])
  eager = apply_rope(x, pos, rotary_dim=6)
  jitted = jax.jit(lambda x, p: apply_rope(x, p, rotary_dim=6))(x, pos)
  np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), rtol=1e-6, atol=1e-6)
  mapped = jax.vmap(lambda x, p: apply_rope(x, p, rotary_dim=6))(x, pos)
  np.testing.assert_allclose(np.asarray(mapped), np.asarray(eager), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("interleaved", [True, False])
def test_grad_is_inverse_rotation(interleaved):
  # RoPE is orthogonal: the gradient of <g, rope(x, m)> with respect to x is rope(g, -m).
  x, g = _rand((1, 4, 2, 8), seed=12), _rand((1, 4, 2, 8), seed=13)
  pos = np.array([0, 3, 17, 100])
  grad = jax.grad(lambda x: jnp.sum(g * apply_rope(x, pos, interleaved=interleaved)))(x)
  np.testing.assert_allclose(np.asarray(grad), np.asarray(apply_rope(g, -pos, interleaved=interleaved)),
                             rtol=1e-5, atol=1e-5)
  check_grads(lambda x: apply_rope(x, pos, rotary_dim=6, interleaved=interleaved), (x,), order=1,
              modes=("fwd", "rev"), atol=1e-2, rtol=1e-2)


# -- frequencies and scalings --------------------------------------------------------------------

def test_default_frequencies():
  inv_freq, factor = rope_frequencies(8, base=10000.0)
  np.testing.assert_allclose(np.asarray(inv_freq), [1.0, 0.1, 0.01, 0.001], rtol=1e-6)
  assert inv_freq.dtype == jnp.float32 and factor == 1.0


def test_linear_scaling_is_position_interpolation():
  s = RopeScaling("linear", factor=4.0)
  inv_freq, factor = rope_frequencies(16, scaling=s)
  np.testing.assert_allclose(np.asarray(inv_freq), np.asarray(rope_frequencies(16)[0]) / 4, rtol=1e-7)
  assert factor == 1.0
  x = _rand((1, 3, 1, 16))
  np.testing.assert_allclose(np.asarray(apply_rope(x, np.array([4, 8, 40]), scaling=s)),
                             np.asarray(apply_rope(x, np.array([1, 2, 10]))), rtol=1e-5, atol=1e-6)


def test_dynamic_scaling_only_past_trained_length():
  s = RopeScaling("dynamic", factor=2.0, original_max_position_embeddings=64)
  plain = np.asarray(rope_frequencies(16)[0])
  for seq_len in (None, 10, 64):
    np.testing.assert_array_equal(np.asarray(rope_frequencies(16, scaling=s, seq_len=seq_len)[0]),
                                  plain)
  longer = np.asarray(rope_frequencies(16, scaling=s, seq_len=128)[0])
  new_base = 10000.0 * (2.0 * 128 / 64 - 1.0) ** (16 / 14)
  np.testing.assert_allclose(longer, new_base ** (-np.arange(0, 16, 2) / 16), rtol=1e-6)
  # A traced seq_len (fp32 arithmetic) gives the same frequencies.
  traced = jax.jit(lambda n: rope_frequencies(16, scaling=s, seq_len=n)[0])(jnp.int32(128))
  np.testing.assert_allclose(np.asarray(traced), longer, rtol=1e-6)
  # apply_rope's default seq_len is max(positions) + 1.
  x = _rand((1, 3, 1, 16))
  pos = np.array([0, 50, 127])
  np.testing.assert_allclose(np.asarray(apply_rope(x, pos, scaling=s)),
                             np.asarray(apply_rope(x, pos, scaling=s, seq_len=128)), rtol=1e-6)


def test_yarn_attention_factor_and_ramp():
  s = RopeScaling("yarn", factor=4.0, original_max_position_embeddings=256)
  inv_freq, factor = rope_frequencies(32, scaling=s)
  assert factor == pytest.approx(0.1 * math.log(4.0) + 1.0)
  plain = np.asarray(rope_frequencies(32)[0])
  ratio = plain / np.asarray(inv_freq)
  assert ratio[0] == pytest.approx(1.0)          # fast pairs extrapolate (unchanged)
  assert ratio[-1] == pytest.approx(4.0)         # slow pairs interpolate (divided by factor)
  assert np.all(np.diff(ratio) >= -1e-6)         # and the ramp between is monotone
  # Explicit attention_factor wins; DeepSeek's mscale pair gives a ratio of get_mscale values.
  assert rope_frequencies(32, scaling=RopeScaling(
      "yarn", factor=4.0, original_max_position_embeddings=256, attention_factor=0.5))[1] == 0.5
  ds = RopeScaling("yarn", factor=40.0, original_max_position_embeddings=4096, mscale=0.707,
                   mscale_all_dim=1.0)
  assert rope_frequencies(32, scaling=ds)[1] == pytest.approx(yarn_mscale(40.0, 0.707)
                                                              / yarn_mscale(40.0, 1.0))


def test_attention_factor_scales_cos_sin_on_request():
  s = RopeScaling("yarn", factor=8.0, original_max_position_embeddings=64)
  x = _rand((1, 4, 2, 16))
  pos = np.arange(4)
  with_factor = np.asarray(apply_rope(x, pos, scaling=s))
  without = np.asarray(apply_rope(x, pos, scaling=s, apply_attention_factor=False))
  np.testing.assert_allclose(with_factor, without * rope_frequencies(16, scaling=s)[1], rtol=1e-6)


def test_yarn_mscale():
  assert yarn_mscale(1.0) == 1.0 and yarn_mscale(0.5, 3.0) == 1.0
  assert yarn_mscale(math.e, 2.0) == pytest.approx(1.2)


def test_llama3_keeps_high_and_scales_low_frequencies():
  s = RopeScaling("llama3", factor=8.0, original_max_position_embeddings=8192,
                  low_freq_factor=1.0, high_freq_factor=4.0)
  inv_freq, factor = rope_frequencies(128, base=500000.0, scaling=s)
  plain = np.asarray(rope_frequencies(128, base=500000.0)[0])
  wavelen = 2 * np.pi / plain
  got = np.asarray(inv_freq)
  np.testing.assert_array_equal(got[wavelen < 8192 / 4], plain[wavelen < 8192 / 4])
  np.testing.assert_allclose(got[wavelen > 8192], plain[wavelen > 8192] / 8, rtol=1e-6)
  mid = (wavelen >= 8192 / 4) & (wavelen <= 8192)
  assert mid.any() and np.all(got[mid] <= plain[mid]) and np.all(got[mid] >= plain[mid] / 8)
  assert factor == 1.0


def test_rope_scaling_from_hf():
  assert RopeScaling.from_hf({"rope_type": "default", "rope_theta": 1e4}) is None
  s = RopeScaling.from_hf({"type": "dynamic", "factor": 2.0}, max_position_embeddings=2048)
  assert s == RopeScaling("dynamic", 2.0, 2048)
  y = RopeScaling.from_hf({"rope_type": "yarn", "factor": 4.0, "beta_fast": 0, "mscale": 1.0,
                           "original_max_position_embeddings": 1024})
  assert y == RopeScaling("yarn", 4.0, 1024, mscale=1.0)
  assert hash(y) == hash(RopeScaling("yarn", 4.0, 1024, mscale=1.0))


# -- errors --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(rotary_dim=5), "rotary_dim"),
    (dict(rotary_dim=0), "rotary_dim"),
    (dict(rotary_dim=-2), "rotary_dim"),
    (dict(rotary_dim=10), "rotary_dim.*H=8"),
    (dict(scaling={"rope_type": "linear", "factor": 2.0}), "scaling"),
    (dict(inv_freq=np.ones((2, 2), np.float32)), "inv_freq"),
    (dict(inv_freq=np.ones(2, np.float32), rotary_dim=8), "inv_freq"),
])
def test_apply_rope_errors(kwargs, match):
  with pytest.raises(ValueError, match=match):
    apply_rope(np.ones((1, 2, 1, 8), np.float32), np.arange(2), **kwargs)


def test_apply_rope_input_errors():
  x = np.ones((1, 2, 1, 8), np.float32)
  with pytest.raises(ValueError, match="positions"):
    apply_rope(x, np.arange(3))
  with pytest.raises(ValueError, match="positions"):
    apply_rope(x, np.arange(2.0))
  with pytest.raises(ValueError, match="positions"):
    apply_rope(x, np.zeros((3, 1, 2), np.int32))
  with pytest.raises(ValueError, match="`x`"):
    apply_rope(np.ones((2, 8)), np.arange(2))


def test_rope_frequencies_errors():
  with pytest.raises(ValueError, match="rotary_dim"):
    rope_frequencies(7)
  with pytest.raises(ValueError, match="rotary_dim.*>= 4"):
    rope_frequencies(2, scaling=RopeScaling("dynamic", 2.0, 16), seq_len=64)
  with pytest.raises(ValueError, match="scaling"):
    rope_frequencies(8, scaling="yarn")


@pytest.mark.parametrize("kwargs, match", [
    (dict(type="ntk", factor=2.0), "type.*'ntk'.*allowed"),
    (dict(type="longrope", factor=2.0, original_max_position_embeddings=16), "type"),
    (dict(type="linear", factor=0.0), "factor"),
    (dict(type="linear", factor="2"), "`factor`='2' must be a finite number > 0"),
    (dict(type="yarn", factor=2.0), "original_max_position_embeddings"),
    (dict(type="dynamic", factor=2.0, original_max_position_embeddings=0),
     "original_max_position_embeddings"),
    # (inf: yarn's attention factor inf, NaN frequencies; NaN / negative attention factors gave
    # NaN / sign-flipped outputs; betas of 0 and a low factor of 0 divided by zero)
    (dict(type="yarn", factor=float("inf"), original_max_position_embeddings=16),
     "`factor`=inf must be a finite number > 0"),
    (dict(type="yarn", factor=2.0, original_max_position_embeddings=16, attention_factor=-1.0),
     "`attention_factor`=-1.0 must be a finite number > 0"),
    (dict(type="yarn", factor=2.0, original_max_position_embeddings=16, mscale=float("nan")),
     "`mscale`=nan must be a finite number >= 0"),
    (dict(type="yarn", factor=2.0, original_max_position_embeddings=16, beta_fast=0.0),
     "`beta_fast`=0.0 must be a finite number > 0"),
    (dict(type="llama3", factor=8.0, original_max_position_embeddings=16, low_freq_factor=0.0),
     "`low_freq_factor`=0.0 must be a finite number > 0"),
    (dict(type="dynamic", factor=2.0, original_max_position_embeddings="16"),
     "`original_max_position_embeddings`='16' must be an int >= 1"),
    (dict(type="llama3", factor=8.0, original_max_position_embeddings=16, low_freq_factor=4.0,
          high_freq_factor=1.0), "high_freq_factor"),
])
def test_rope_scaling_errors(kwargs, match):
  with pytest.raises(ValueError, match=match):
    RopeScaling(**kwargs)


@pytest.mark.parametrize("base", [0.0, -10000.0, float("inf"), float("nan"), True, None])
def test_bad_base(base):
  with pytest.raises(ValueError, match="`base`.*finite number > 0"):
    rope_frequencies(8, base=base)
  with pytest.raises(ValueError, match="`base`"):
    apply_rope(np.ones((1, 2, 1, 8), np.float32), np.arange(2), base=base)


def test_yarn_base_one():
  yarn = RopeScaling("yarn", 4.0, original_max_position_embeddings=16)
  with pytest.raises(ValueError, match="`base`=1.0 must not be 1 with yarn"):
    rope_frequencies(8, base=1.0, scaling=yarn)


def test_odd_head_size_without_rotary_dim_names_h():
  with pytest.raises(ValueError, match="head size H=5"):
    apply_rope(np.ones((1, 2, 1, 5), np.float32), np.arange(2))
