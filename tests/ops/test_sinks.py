"""Attention sinks (gpt-oss): one more softmax entry per head, of a learned logit and a zero
value.  Every backend against the formula written out (the sink logit concatenated to the
logits), forward and gradients (the sinks' too), the mass they take, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import pallas_kernels.flash_attention  # noqa: F401  (registers the Pallas backends)
from jaxattn.ops import context_parallel as cp
from jaxattn.ops import dot_product_attention
from jaxattn.ops.decode import paged_attention, page_view
from jaxattn.sharding import make_mesh

B, T, N, K, H = 2, 21, 4, 2, 8
SINKS = np.array([0.0, 1.5, -2.0, 3.0], np.float32)


def _inputs(dtype=jnp.float32, t=T, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  return tuple(jax.random.normal(kk, (B, t, n, H), dtype) for kk, n in zip(ks, (N, K, K)))


def _reference(q, k, v, sinks, window=None):
  """Softmax over ``[logits | sink]``, the sink's column dropped (gpt-oss, transformers)."""
  t = q.shape[1]
  kk, vv = (jnp.repeat(x.astype(jnp.float32), N // K, 2) for x in (k, v))
  s = jnp.einsum("btnh,bsnh->bnts", q.astype(jnp.float32), kk) / np.sqrt(H)
  i, j = np.arange(t)[:, None], np.arange(t)[None, :]
  keep = (j <= i) if window is None else (j <= i) & (j >= i - window)
  s = jnp.where(keep, s, -jnp.inf)
  sink = jnp.broadcast_to(jnp.asarray(sinks)[None, :, None, None], (B, N, t, 1))
  p = jax.nn.softmax(jnp.concatenate([s, sink], -1), -1)[..., :-1]
  return jnp.einsum("bnts,bsnh->btnh", p, vv)


def _loss(f):
  return lambda *a: jnp.sum(jnp.sin(f(*a).astype(jnp.float32)))


@pytest.mark.parametrize("implementation", ["xla", "xla_chunked", "cpu", "pallas_tpu",
                                            "pallas_gpu"])
def test_every_backend_matches_the_formula(implementation):
  """fp32, GQA, causal sliding window (rows see 6 keys; odd T): outputs and the gradients of
  the query, keys, values and sinks."""
  q, k, v = _inputs()
  f = lambda q, k, v, s: dot_product_attention(  # noqa: E731
      q, k, v, is_causal=True, local_window_size=5, sinks=s, implementation=implementation)
  ref = lambda q, k, v, s: _reference(q, k, v, s, window=5)  # noqa: E731
  np.testing.assert_allclose(f(q, k, v, SINKS), ref(q, k, v, SINKS), rtol=2e-5, atol=2e-5)
  got = jax.grad(_loss(f), argnums=(0, 1, 2, 3))(q, k, v, jnp.asarray(SINKS))
  want = jax.grad(_loss(ref), argnums=(0, 1, 2, 3))(q, k, v, jnp.asarray(SINKS))
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_bf16():
  q, k, v = _inputs(jnp.bfloat16, seed=1)
  got = dot_product_attention(q, k, v, is_causal=True, sinks=SINKS)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(got, np.float32), _reference(q, k, v, SINKS), atol=2e-2)


def test_the_mass_the_sink_takes_and_rows_without_keys():
  """The weights of a row sum to ``sigmoid(lse - sink)`` (the sink takes the rest), ``lse``
  becomes ``logaddexp(lse, sink)``; a row that sees no key gives zeros and ``lse = sink``."""
  q, k, _ = _inputs(seed=2)
  ones = jnp.ones((B, T, K, 1))       # value 1 everywhere: the output is the row's total weight
  lengths = jnp.array([T, 0])         # the second sequence holds no key
  mass, lse = dot_product_attention(q, k, ones, kv_lengths=lengths, sinks=SINKS,
                                    return_residuals=True)
  _, lse0 = dot_product_attention(q, k, ones, kv_lengths=lengths, return_residuals=True)
  expect = jax.nn.sigmoid(lse0[0] - SINKS[:, None])                      # [N, T]
  np.testing.assert_allclose(mass[0, ..., 0], expect.T, rtol=1e-5)
  assert float(mass[0].max()) < 1.0
  np.testing.assert_allclose(lse[0], np.logaddexp(lse0[0], SINKS[:, None]), rtol=1e-5)
  np.testing.assert_array_equal(mass[1], 0.0)
  np.testing.assert_allclose(lse[1], np.broadcast_to(SINKS[:, None], (N, T)))


@pytest.mark.parametrize("implementation", ["xla", "pallas_tpu", "pallas_gpu"])
def test_paged_decode(implementation):
  """``paged_attention(..., sinks=)``: the newest 3 tokens of each sequence over a paged cache
  equal the last rows of the full causal pass (the kernels, interpreted, add the sinks in their
  combine step; split-KV or not)."""
  q, k, v = _inputs(t=32, seed=3)
  kp, table = page_view(k, 16)      # (the GPU kernel reads pages of 16 or more)
  vp, _ = page_view(v, 16)
  want = _reference(q, k, v, SINKS)[:, -3:]
  for splits in (1, 2):
    got = paged_attention(q[:, -3:], kp, vp, table, jnp.array([32, 32]), sinks=SINKS,
                          implementation=implementation, num_splits=splits)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_under_a_context_axis(strategy):
  """With the sequence split over ``context`` (T = 24 on 4 devices) the sinks apply to the
  merged rows: equal to the formula, forward and gradients."""
  q, k, v = _inputs(t=24, seed=4)
  f = lambda q, k, v, s: dot_product_attention(q, k, v, is_causal=True, sinks=s)  # noqa: E731
  want = jax.grad(_loss(_reference), argnums=(0, 1, 2, 3))(q, k, v, jnp.asarray(SINKS))
  mesh = make_mesh({"data": 2, "context": 4})
  with jax.set_mesh(mesh), cp.set_options(strategy=strategy):
    args = [jax.device_put(x, NamedSharding(mesh, P("data", "context"))) for x in (q, k, v)]
    out = jax.jit(f)(*args, jnp.asarray(SINKS))
    got = jax.jit(jax.grad(_loss(f), argnums=(0, 1, 2, 3)))(*args, jnp.asarray(SINKS))
  np.testing.assert_allclose(out, _reference(q, k, v, SINKS), rtol=2e-5, atol=2e-5)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_errors():
  from jaxattn.ops import attention_gradients, explain_dispatch
  q, k, v = _inputs()
  # the dispatch explanation knows that sinks need the log-sum-exp (here the CPU kernel takes it)
  assert explain_dispatch(q, k, v, is_causal=True, sinks=SINKS)[0] == "cpu"
  out, lse = dot_product_attention(q, k, v, return_residuals=True)
  with pytest.raises(ValueError, match="`sinks` act on the whole rows"):
    attention_gradients(q, k, v, out, lse, out, sinks=SINKS)
  with pytest.raises(ValueError, match=r"`sinks` must be a \[N\] array .* N=4, got shape \(3,\)"):
    dot_product_attention(q, k, v, sinks=np.zeros(3, np.float32))
  with pytest.raises(ValueError, match="`sinks` must be floating point"):
    dot_product_attention(q, k, v, sinks=np.zeros(4, np.int32))
