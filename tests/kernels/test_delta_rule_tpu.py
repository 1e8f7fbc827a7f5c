"""The Pallas TPU state-pass kernel of the chunked gated delta rule, in interpret mode, against the
XLA forms.  Tolerance 2e-5 (fp32; the kernel runs the same products as the XLA scan), gradients
1e-4."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.ops.delta_rule import gated_delta_rule

pltpu = pytest.importorskip("jax.experimental.pallas.tpu")
kernels = pytest.importorskip("pallas_kernels.delta_rule")


def _inputs(b=2, t=21, k=2, n=4, h=8, hv=6, seed=0):
  rng = np.random.default_rng(seed)
  kk = rng.standard_normal((b, t, k, h))
  kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
  return tuple(jnp.asarray(x, jnp.float32) for x in (
      rng.standard_normal((b, t, k, h)), kk, rng.standard_normal((b, t, n, hv)),
      -0.3 * np.logaddexp(0, rng.standard_normal((b, t, n))),
      1 / (1 + np.exp(-rng.standard_normal((b, t, n)))), rng.standard_normal((b, n, h, hv))))


def test_registered_kernel_equals_recurrent_with_state_and_segments():
  q, k, v, g, beta, s0 = _inputs()
  seg = jnp.asarray(np.repeat([[0] * 7 + [1] * 14], 2, 0))
  kw = dict(initial_state=s0, output_final_state=True, chunk_size=8, segment_ids=seg)
  want, want_s = gated_delta_rule(q, k, v, g, beta, implementation="recurrent", **kw)
  got, got_s = gated_delta_rule(q, k, v, g, beta, implementation="pallas_tpu", **kw)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(got_s, want_s, atol=2e-5, rtol=2e-5)


def test_gradients_through_the_kernel_equal_the_xla_pass():
  # The custom VJP (kernel forward, XLA backward) against autodiff of the XLA pass itself.
  rng = np.random.default_rng(1)
  b, nc, kh, grp, c, h, hv = 1, 3, 2, 2, 8, 8, 6

  def arr(*shape, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)

  args = (arr(b, nc, kh, grp, c, hv), arr(b, nc, kh, grp, c, h, scale=0.3),
          arr(b, nc, kh, grp, c, h, scale=0.3), jnp.tril(arr(b, nc, kh, grp, c, c, scale=0.3)),
          arr(b, nc, kh, grp, c, h, scale=0.3),
          jnp.asarray(rng.uniform(0.5, 1.0, (b, nc, kh, grp)), jnp.float32),
          arr(b, kh, grp, h, hv))
  tpu = importlib.import_module("pallas_kernels.delta_rule.tpu")

  def loss(fn):
    def f(*a):
      out, s = fn(*a)
      return jnp.sum(out * jnp.sin(out)) + jnp.sum(s ** 2)
    return jax.grad(f, argnums=tuple(range(7)))(*args)

  got = loss(lambda *a: tpu.state_pass_tpu(*a, True))
  want = loss(tpu._reference)
  for a, b_ in zip(want, got):
    np.testing.assert_allclose(b_, a, atol=1e-4, rtol=1e-4)
  np.testing.assert_allclose(tpu.state_pass_tpu(*args, True)[0], tpu._reference(*args)[0],
                             atol=2e-5, rtol=2e-5)


def test_no_races_under_the_tpu_interpreter(race_states):
  states = race_states
  q, k, v, g, beta, s0 = _inputs(b=1, t=16, k=1, n=2, seed=2)
  b, t, kh, h = k.shape
  args = (q * h ** -0.5, k, v.reshape(b, t, kh, 2, 6), g.reshape(b, t, kh, 2),
          beta.reshape(b, t, kh, 2), s0.reshape(b, kh, 2, h, 6), jnp.zeros((b, t), bool))
  params = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)
  out, s = jax.jit(lambda *a: kernels.chunked_delta_rule_tpu(*a, chunk_size=8, interpret=params))(*args)
  jax.block_until_ready(out)
  assert states and not any(st.races_found for st in states)
  want, want_s = gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                  implementation="recurrent")
  np.testing.assert_allclose(out.reshape(want.shape), want, atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(s.reshape(want_s.shape), want_s, atol=2e-5, rtol=2e-5)


def test_auto_dispatch_does_not_pick_the_untimed_kernel():
  from jaxattn.ops import delta_rule as dr  # noqa: PLC0415
  assert dr._resolve(None, 64) == "chunked"


def test_sharded_under_a_mesh_matches_unsharded():
  """Under the 8-device mesh the kernel runs in ``shard_map`` (batch over "data", key heads over
  "tensor") and equals the unsharded recurrent form, state included."""
  from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: PLC0415

  from jaxattn import sharding  # noqa: PLC0415

  mesh = sharding.make_mesh({"data": 2, "tensor": 4})
  q, k, v, g, beta, s0 = _inputs(b=2, t=16, k=4, n=8, seed=3)
  kw = dict(initial_state=s0, output_final_state=True, chunk_size=8)
  f = jax.jit(lambda *a: gated_delta_rule(*a, implementation="pallas_tpu", **kw))
  with jax.set_mesh(mesh):
    assert "shard_map" in str(jax.make_jaxpr(f)(q, k, v, g, beta))
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data")))  # noqa: E731
    got, got_s = f(*(put(x) for x in (q, k, v, g, beta)))
  want, want_s = gated_delta_rule(q, k, v, g, beta, implementation="recurrent", **kw)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(got_s, want_s, atol=2e-5, rtol=2e-5)
