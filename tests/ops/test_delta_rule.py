"""The gated delta rule: recurrent and chunked forms against a float64 NumPy loop, the seed's
2 -> 5 example, decode, packed sequences, gradients and errors.

Tolerances: fp32 paths are compared at 2e-5 (the chunked form reassociates the same sums; observed
differences are ~5e-7 at these sizes).  bf16 inputs: both paths compute in fp32 from the same
bf16-rounded inputs, so their bf16 outputs differ by at most one rounding: 1e-2 on unit-scale
outputs (bf16 has 8 significant bits, 2^-8 ~ 4e-3 relative).  Gradients (fp32) at 1e-4: the
backward passes reassociate longer chains of products than the forward.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.ops import delta_rule as dr
from jaxattn.ops.delta_rule import gated_delta_rule, gated_delta_rule_step, l2_normalize

IMPLS = ["recurrent", "chunked"]


def _inputs(b=2, t=21, k=2, n=4, h=8, hv=6, dtype=jnp.float32, seed=0, decay=0.3):
  """NumPy-generated (no per-op compilation): unit keys, g <= 0, beta in (0, 1), a random state."""
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((b, t, k, h))
  kk = rng.standard_normal((b, t, k, h))
  kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
  v = rng.standard_normal((b, t, n, hv))
  g = -decay * np.logaddexp(0.0, rng.standard_normal((b, t, n)))        # -decay * softplus
  beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((b, t, n))))
  s0 = rng.standard_normal((b, n, h, hv))
  return tuple(jnp.asarray(x, dtype) for x in (q, kk, v, g, beta)) + (jnp.asarray(s0, jnp.float32),)


def _numpy_reference(q, k, v, g, beta, s0=None, segment_ids=None, scale=None):
  """The seed's update, token by token, in float64 (state key-dim first: S^T of the seed)."""
  q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
  b, t, kh, h = k.shape
  n, hv = v.shape[2:]
  grp = n // kh
  s = np.zeros((b, n, h, hv)) if s0 is None else np.array(s0, np.float64)
  out = np.zeros((b, t, n, hv))
  q = q * (h ** -0.5 if scale is None else scale)
  for i in range(b):
    for j in range(t):
      for m in range(n):
        kt, qt = k[i, j, m // grp], q[i, j, m // grp]
        a = np.exp(g[i, j, m])
        if segment_ids is not None and j > 0 and segment_ids[i, j] != segment_ids[i, j - 1]:
          a = 0.0
        s[i, m] = a * s[i, m]
        s[i, m] += beta[i, j, m] * np.outer(kt, v[i, j, m] - kt @ s[i, m])
        out[i, j, m] = qt @ s[i, m]
  return out, s


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("t,chunk", [(21, 8), (5, 64), (1, 4)])
def test_matches_numpy_loop_with_initial_state(impl, t, chunk):
  q, k, v, g, beta, s0 = _inputs(t=t)
  want, want_s = _numpy_reference(q, k, v, g, beta, s0)
  got, got_s = gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                chunk_size=chunk, implementation=impl)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(got_s, want_s, atol=2e-5, rtol=2e-5)
  assert got.dtype == jnp.float32 and got_s.dtype == jnp.float32


@pytest.mark.parametrize("fuse", [True, False])
def test_chunked_equals_recurrent_t_not_multiple_of_chunk(fuse):
  t = 37
  # Both evaluation orders of the chunked form (local products inside the scan, or up front).
  q, k, v, g, beta, s0 = _inputs(t=t, n=4, k=1, seed=3)
  want, want_s = gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                  implementation="recurrent")
  state = s0.reshape(2, 1, 4, 8, 6)
  pad = (-t) % 16
  args = [jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) for x in
          (q * 8 ** -0.5, k, v.reshape(2, t, 1, 4, 6), g.reshape(2, t, 1, 4),
           beta.reshape(2, t, 1, 4), jnp.zeros((2, t), bool))]
  chunked = jax.jit(functools.partial(dr._chunked, chunk_size=16, fuse=fuse))
  out, s = chunked(*args[:5], state, args[5])
  np.testing.assert_allclose(out[:, :t].reshape(want.shape), want, atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(s.reshape(want_s.shape), want_s, atol=2e-5, rtol=2e-5)


def test_strong_decay_and_repeated_keys_stay_finite_and_exact():
  # Log-decays of -40 per step underflow exp() within a chunk; identical keys with beta = 1 make
  # (I + A) the all-ones lower triangle, where a Neumann-product inverse would blow up.
  q, k, v, g, beta, s0 = _inputs(seed=5)
  g = g.at[:, 3:8].set(-40.0)
  k = k.at[:, 8:].set(k[:, 8:9])
  beta = beta.at[:, 8:].set(1.0)
  g = g.at[:, 8:].set(0.0)
  want, want_s = _numpy_reference(q, k, v, g, beta, s0)
  got, got_s = gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                chunk_size=8, implementation="chunked")
  assert np.isfinite(np.asarray(got)).all()
  np.testing.assert_allclose(got, want, atol=5e-5, rtol=5e-5)
  np.testing.assert_allclose(got_s, want_s, atol=5e-5, rtol=5e-5)


@pytest.mark.parametrize("reset", [-np.inf, -1e30])
def test_hard_reset_gate_chunked_equals_recurrent(reset):
  # g = -inf (a_t = 0) gave NaN in the chunked form's cumsum differences; a huge finite g rounded
  # the decays after it to 1.  Resets mid-chunk, at a chunk start and in one head only.
  q, k, v, g, beta, s0 = _inputs(t=12, seed=7)
  g = g.at[:, 3].set(reset).at[:, 8, 1].set(reset)
  want, want_s = gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                  implementation="recurrent")
  got, got_s = gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                chunk_size=4, implementation="chunked")
  assert np.isfinite(np.asarray(want)).all()
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(got_s, want_s, atol=2e-5, rtol=2e-5)


def test_unit_lower_inverse_is_exact_on_repeated_keys():
  c = 64
  a = jnp.tril(jnp.ones((3, c, c)), -1)
  want = np.linalg.inv(np.eye(c) + np.asarray(a, np.float64))
  inverse = jax.jit(dr._unit_lower_inverse)
  np.testing.assert_allclose(inverse(a), want, atol=1e-6)
  r = jnp.tril(jax.random.normal(jax.random.key(0), (2, 16, 16)) * 0.3, -1)
  np.testing.assert_allclose(inverse(r) @ (jnp.eye(16) + r),
                             np.broadcast_to(np.eye(16), (2, 16, 16)), atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_seed_example_delta_write_replaces_two_with_five(impl):
  # Memory diag(2, 4), key (1, 0), value (5, 0), no decay, full write strength: reading (1, 0)
  # after the write gives (5, 0); an additive memory would give (7, 0).
  s0 = jnp.array([[2.0, 0.0], [0.0, 4.0]])[None, None]                 # [B, N, H, h]
  k = jnp.array([1.0, 0.0]).reshape(1, 1, 1, 2)
  v = jnp.array([5.0, 0.0]).reshape(1, 1, 1, 2)
  ones = jnp.ones((1, 1, 1))
  out, s = gated_delta_rule(k, k, v, 0.0 * ones, ones, scale=1.0, initial_state=s0,
                            output_final_state=True, implementation=impl)
  np.testing.assert_allclose(out[0, 0, 0], [5.0, 0.0], atol=1e-6)
  np.testing.assert_allclose(s[0, 0], [[5.0, 0.0], [0.0, 4.0]], atol=1e-6)
  additive = s0[0, 0].T @ k[0, 0, 0] + v[0, 0, 0]
  np.testing.assert_allclose(additive, [7.0, 0.0])


@pytest.mark.parametrize("impl", IMPLS)
def test_full_strength_write_makes_the_memory_answer_the_value(impl):
  # For any memory and unit key, beta = 1 and no decay: afterwards S^T k == v exactly.
  _, k, v, _, _, s0 = _inputs(b=1, t=1, k=2, n=2)
  ones = jnp.ones((1, 1, 2))
  _, s = gated_delta_rule(k, k, v, 0.0 * ones, ones, initial_state=s0, output_final_state=True,
                          implementation=impl)
  np.testing.assert_allclose(jnp.einsum("nhv,nh->nv", s[0], k[0, 0]), v[0, 0], atol=1e-5)


@pytest.mark.parametrize("t0", [0, 13])
def test_decode_steps_equal_the_full_forward(t0):
  q, k, v, g, beta, s0 = _inputs(seed=2)
  full, full_s = gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                  chunk_size=8)
  outs = []
  state = s0
  if t0:
    o, state = gated_delta_rule(q[:, :t0], k[:, :t0], v[:, :t0], g[:, :t0], beta[:, :t0],
                                initial_state=s0, output_final_state=True, chunk_size=8)
    outs.append(o)
  step = jax.jit(gated_delta_rule_step)
  for t in range(t0, 21):
    o, new_state = step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
    assert new_state.shape == state.shape  # the memory does not grow
    state = new_state
    outs.append(o[:, None])
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(state, full_s, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_packed_sequences_equal_separate_runs(impl):
  lengths = (5, 11, 3)   # the second segment straddles the chunk boundary at 8
  t = sum(lengths)
  q, k, v, g, beta, s0 = _inputs(b=1, t=t, seed=4)
  seg = jnp.concatenate([jnp.full((n,), i) for i, n in enumerate(lengths)])[None]
  got, got_s = gated_delta_rule(q, k, v, g, beta, segment_ids=seg, output_final_state=True,
                                chunk_size=8, implementation=impl)
  want, start = [], 0
  for n in lengths:
    sl = slice(start, start + n)
    o, s = gated_delta_rule(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl],
                            output_final_state=True, implementation="recurrent")
    want.append(o)
    start += n
  np.testing.assert_allclose(got, jnp.concatenate(want, 1), atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(got_s, s, atol=2e-5, rtol=2e-5)
  # The first segment continues from initial_state; later ones start from zero.
  ref, _ = _numpy_reference(q, k, v, g, beta, s0, np.asarray(seg))
  got0, _ = gated_delta_rule(q, k, v, g, beta, segment_ids=seg, initial_state=s0, chunk_size=8,
                             implementation=impl)
  np.testing.assert_allclose(got0, ref, atol=2e-5, rtol=2e-5)


def test_bf16_inputs_chunked_equals_recurrent():
  q, k, v, g, beta, s0 = _inputs(dtype=jnp.bfloat16, seed=6)
  outs = {impl: gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                 chunk_size=8, implementation=impl) for impl in IMPLS}
  (a, sa), (b, sb) = outs["recurrent"], outs["chunked"]
  assert a.dtype == b.dtype == jnp.bfloat16
  assert sa.dtype == sb.dtype == jnp.float32  # the memory stays fp32
  np.testing.assert_allclose(a.astype(jnp.float32), b.astype(jnp.float32), atol=1e-2, rtol=1e-2)
  np.testing.assert_allclose(sa, sb, atol=1e-4, rtol=1e-4)
  # ...and both equal the float64 loop on the same (bf16-rounded) inputs, up to output rounding.
  want, _ = _numpy_reference(*(x.astype(jnp.float32) for x in (q, k, v, g, beta)), s0)
  np.testing.assert_allclose(b.astype(jnp.float32), want, atol=1e-2, rtol=1e-2)


def test_qk_l2norm_and_scale_options():
  q, k, v, g, beta, s0 = _inputs(seed=7)
  raw_k = 3.0 * k
  got, _ = gated_delta_rule(q, raw_k, v, g, beta, use_qk_l2norm=True, scale=0.5, chunk_size=8)
  want, _ = _numpy_reference(l2_normalize(q), k, v, g, beta, scale=0.5)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def _loss(impl, q, k, v, g, beta, s0, ct, cs):
  out, s = gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                            chunk_size=8, implementation=impl)
  return jnp.sum(out * ct) + jnp.sum(s * cs)


def test_gradients_chunked_equal_recurrent():
  q, k, v, g, beta, s0 = _inputs(seed=8)
  ct = jax.random.normal(jax.random.key(10), v.shape)
  cs = jax.random.normal(jax.random.key(11), s0.shape)
  grads = {impl: jax.grad(functools.partial(_loss, impl), argnums=tuple(range(6)))(
      q, k, v, g, beta, s0, ct, cs) for impl in IMPLS}
  for name, a, b in zip("q k v g beta s0".split(), grads["recurrent"], grads["chunked"]):
    np.testing.assert_allclose(b, a, atol=1e-4, rtol=1e-4, err_msg=name)
    assert np.abs(np.asarray(a)).max() > 1e-3, name  # every input actually matters


def test_recurrent_gradients_match_finite_differences():
  from jax.test_util import check_grads  # noqa: PLC0415
  q, k, v, g, beta, s0 = _inputs(b=1, t=4, k=1, n=2, h=4, hv=3, seed=9)

  def f(q, k, v, g, beta, s0):
    out, s = gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                              implementation="recurrent")
    return jnp.sum(out ** 2) + jnp.sum(jnp.sin(s))

  check_grads(f, (q, k, v, g, beta, s0), order=1, modes=("rev",), eps=1e-2, atol=2e-2, rtol=2e-2)


def test_jit_and_auto_dispatch():
  q, k, v, g, beta, s0 = _inputs()
  auto = jax.jit(lambda *a: gated_delta_rule(*a, chunk_size=8)[0])(q, k, v, g, beta)
  want, _ = gated_delta_rule(q, k, v, g, beta, implementation="recurrent")
  np.testing.assert_allclose(auto, want, atol=2e-5, rtol=2e-5)
  assert dr._resolve(None, 1) == "recurrent" and dr._resolve(None, 7) == "chunked"


def test_state_bytes_constant_in_length():
  assert dr.state_bytes(2, 4, 8, 6) == 2 * 4 * 8 * 6 * 4
  assert dr.state_bytes(1, 1, 128, dtype=jnp.bfloat16) == 128 * 128 * 2


def test_errors_name_the_argument():
  q, k, v, g, beta, s0 = _inputs(t=6)
  with pytest.raises(ValueError, match="`query` must have rank 4"):
    gated_delta_rule(q[0], k, v, g, beta)
  with pytest.raises(ValueError, match="`query`.*`key`.*same shape"):
    gated_delta_rule(q[:, :, :1], k, v, g, beta)
  with pytest.raises(ValueError, match="multiple of key heads"):
    gated_delta_rule(q, k, v[:, :, :3], g[..., :3], beta[..., :3])
  with pytest.raises(ValueError, match="`value`.*must share"):
    gated_delta_rule(q, k, v[:, :5], g, beta)
  with pytest.raises(ValueError, match="`g` must have shape"):
    gated_delta_rule(q, k, v, g[..., :2], beta)
  with pytest.raises(ValueError, match="`beta` must have shape"):
    gated_delta_rule(q, k, v, g, beta[:, :4])
  with pytest.raises(ValueError, match="`initial_state` must have shape"):
    gated_delta_rule(q, k, v, g, beta, initial_state=s0[..., :2])
  with pytest.raises(ValueError, match="`segment_ids` must have shape"):
    gated_delta_rule(q, k, v, g, beta, segment_ids=jnp.zeros((2, 5), jnp.int32))
  with pytest.raises(ValueError, match="`segment_ids` must be integers"):
    gated_delta_rule(q, k, v, g, beta, segment_ids=jnp.zeros((2, 6)))
  for bad in (48, True):
    with pytest.raises(ValueError, match="`chunk_size` must be a power of two"):
      gated_delta_rule(q, k, v, g, beta, chunk_size=bad)
  with pytest.raises(ValueError, match="`scale` must be a positive"):
    gated_delta_rule(q, k, v, g, beta, scale=-1.0)
  with pytest.raises(ValueError, match="`implementation` must be None or one of"):
    gated_delta_rule(q, k, v, g, beta, implementation="fast")
  with pytest.raises(ValueError, match="`query` must be floating"):
    gated_delta_rule(q.astype(jnp.int32), k, v, g, beta)
  with pytest.raises(ValueError, match="one token"):
    gated_delta_rule_step(q, k, v, g, beta, s0)
  step = (q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], s0)
  for i, name in ((3, "g"), (4, "beta")):   # the step's [B, N], not the sequence's [B, T, N]
    bad = list(step)
    bad[i] = bad[i][:, :2]
    with pytest.raises(ValueError, match=rf"`{name}` must have shape \[B, N\] = \(2, 4\), got"):
      gated_delta_rule_step(*bad)
  with pytest.raises(ValueError, match="`name` must be"):
    dr.register_implementation("xla", lambda *a: a)
