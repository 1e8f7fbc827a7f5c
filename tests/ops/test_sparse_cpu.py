"""The native DSA kernels (``implementation="cpu"``) against the XLA formulas.

Selection: the same positions as the XLA paths (``indexer_topk(implementation="xla")`` and
``topk_indices(indexer_scores(...))``) in both orders, on rows long enough that the candidate
sets are cut many times, on integer-valued inputs whose scores tie massively (ties go to the
lower position, across cuts), with query offsets (traced too), ragged key lengths, fewer visible
keys than ``k`` (``-1`` padding), 8-bit codes with key scales, and under ``jit`` / ``vmap``.
Sparse attention: values and gradients against the gather reference (MHA / GQA / MQA, value
widths that are not multiples of 16, empty slots and empty rows, bf16), and DSA on MLA.
"""

import functools
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn import native
from jaxattn.ops.sparse import (indexer_scores, indexer_topk, sparse_attention,
                                sparse_mla_attention, topk_indices)

if shutil.which("c++") is None and shutil.which("g++") is None and shutil.which("clang++") is None:
  pytest.skip("no C++ compiler on this machine: the native kernels cannot be built",
              allow_module_level=True)


def index_inputs(b, t, s, hi, d, seed=0, integer=False):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((b, t, hi, d)).astype(np.float32)
  k = rng.standard_normal((b, s, d)).astype(np.float32)
  w = rng.uniform(0.1, 1.0, (b, t, hi)).astype(np.float32)
  if integer:  # small integer scores: thousands of exact ties per row
    q, k, w = np.round(q), np.round(k), np.ones_like(w)
  return jnp.asarray(q), jnp.asarray(k), jnp.asarray(w)


def test_kernels_are_built():
  assert native.available(), native.reason()


@pytest.mark.parametrize("order", ["position", "score"])
@pytest.mark.parametrize("case", [
    dict(b=2, t=70, s=70, k=8),  # causal self-attention, the first rows see fewer than k keys
    dict(b=1, t=40, s=1500, k=16, q_offset=1460),  # long rows: the candidate set is cut often
    dict(b=2, t=33, s=300, k=20, q_offset=267, kv_lengths=(300, 150)),  # ragged cache
    dict(b=1, t=1, s=900, k=64, q_offset=899),  # one decode step
])
def test_selection_matches_xla(case, order):
  case = dict(case)
  b, t, s, k = case.pop("b"), case.pop("t"), case.pop("s"), case.pop("k")
  if "kv_lengths" in case:
    case["kv_lengths"] = jnp.asarray(case["kv_lengths"], jnp.int32)
  q, keys, w = index_inputs(b, t, s, 4, 32, seed=s)
  want = indexer_topk(q, keys, w, k, order=order, implementation="xla", **case)
  got = indexer_topk(q, keys, w, k, order=order, implementation="cpu", **case)
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("order", ["position", "score"])
def test_massive_ties_go_to_lower_positions(order):
  q, keys, w = index_inputs(2, 50, 800, 2, 4, seed=3, integer=True)
  scores = indexer_scores(q, keys, w, q_offset=750)
  want = topk_indices(scores, 24)  # score order, ties to the lower position
  got = indexer_topk(q, keys, w, 24, q_offset=750, order=order, implementation="cpu")
  if order == "position":
    want = jnp.sort(jnp.where(want < 0, jnp.iinfo(jnp.int32).max, want), axis=-1)
    want = jnp.where(want == jnp.iinfo(jnp.int32).max, -1, want)
  np.testing.assert_array_equal(got, want)


def test_fewer_visible_keys_than_k_pads_with_minus_one():
  q, keys, w = index_inputs(1, 5, 5, 2, 8)
  got = np.asarray(indexer_topk(q, keys, w, 8, order="position", implementation="cpu"))
  for t in range(5):
    np.testing.assert_array_equal(got[0, t, :t + 1], np.arange(t + 1))
    assert np.all(got[0, t, t + 1:] == -1)


def test_traced_offset_jit_and_vmap():
  q, keys, w = index_inputs(2, 6, 200, 2, 16, seed=5)
  f = jax.jit(lambda q, keys, w, off: indexer_topk(q, keys, w, 10, q_offset=off,
                                                   implementation="cpu"))
  want = indexer_topk(q, keys, w, 10, q_offset=150, implementation="xla")
  np.testing.assert_array_equal(f(q, keys, w, jnp.int32(150)), want)
  batched = jax.vmap(lambda q, keys, w: indexer_topk(q[None], keys[None], w[None], 10,
                                                     q_offset=150, implementation="cpu")[0])
  np.testing.assert_array_equal(batched(q, keys, w), want)


@pytest.mark.parametrize("quant", ["int8", "fp8"])
def test_quantized_codes_with_key_scales(quant):
  q, keys, w = index_inputs(1, 30, 400, 4, 32, seed=7)
  kw = dict(q_offset=370, quant=quant, dot_dtype="bfloat16", order="position")
  want = indexer_topk(q, keys, w, 32, implementation="xla", **kw)
  got = indexer_topk(q, keys, w, 32, implementation="cpu", **kw)
  # Exact codes in both, scales applied after the sums: equal up to fp32 summation order, so
  # at most a near-tie at the k-th place may differ.
  same = np.mean([np.isin(g, wt).mean() for g, wt in zip(np.asarray(got)[0], np.asarray(want)[0])])
  assert same > 0.99


def test_unknown_implementation_raises():
  q, keys, w = index_inputs(1, 4, 4, 1, 8)
  with pytest.raises(ValueError, match="`implementation` must be None, 'xla' or 'cpu'"):
    indexer_topk(q, keys, w, 2, implementation="gpu")
  with pytest.raises(ValueError, match="`implementation` must be None or one of"):
    sparse_attention(jnp.ones((1, 4, 2, 8)), jnp.ones((1, 4, 1, 8)), jnp.ones((1, 4, 1, 8)),
                     jnp.zeros((1, 4, 2), jnp.int32), implementation="tpu")


def attention_inputs(b, t, s, n, kh, h, hv, k, seed=0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((b, t, n, h)), dtype)
  key = jnp.asarray(rng.standard_normal((b, s, kh, h)), dtype)
  v = jnp.asarray(rng.standard_normal((b, s, kh, hv)), dtype)
  idx = rng.integers(0, s, (b, t, k)).astype(np.int32)
  idx[rng.uniform(size=idx.shape) < 0.2] = -1  # empty slots
  idx[0, 0] = -1  # a row with no selected position: zeros
  return q, key, v, jnp.asarray(idx)


@pytest.mark.parametrize("shape", [(2, 9, 50, 8, 1, 64, 64, 40),  # MQA, as DSA
                                   (1, 7, 30, 4, 2, 24, 40, 33),  # GQA, ragged widths
                                   (1, 5, 20, 3, 3, 16, 8, 5)])  # MHA, k < 16
def test_sparse_attention_matches_reference(shape):
  q, key, v, idx = attention_inputs(*shape)
  want = sparse_attention(q, key, v, idx, implementation="xla")
  got = sparse_attention(q, key, v, idx, implementation="cpu")
  np.testing.assert_allclose(got, want, atol=2e-6)
  assert np.all(np.asarray(got)[0, 0] == 0)

  def loss(impl):
    def f(q, key, v):
      out = sparse_attention(q, key, v, idx, implementation=impl)
      return jnp.sum(out * jnp.cos(out))
    return jax.grad(f, argnums=(0, 1, 2))

  for g, wt in zip(loss("cpu")(q, key, v), loss("xla")(q, key, v)):
    np.testing.assert_allclose(g, wt, atol=1e-5)


def test_sparse_attention_bf16_and_default():
  q, key, v, idx = attention_inputs(1, 6, 40, 4, 1, 32, 32, 12, seed=2, dtype=jnp.bfloat16)
  got = sparse_attention(q, key, v, idx)  # default on CPU: the native kernel
  assert got.dtype == jnp.bfloat16
  want = sparse_attention(*(x.astype(jnp.float32) for x in (q, key, v)), idx,
                          implementation="xla")
  np.testing.assert_allclose(got.astype(jnp.float32), want, atol=1e-2, rtol=1e-2)


def test_sparse_mla_attention_native_matches_reference():
  rng = np.random.default_rng(4)
  b, t, s, n, p, r, c, h = 1, 6, 30, 4, 16, 8, 32, 16
  arr = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
  q_nope, q_rope, c_kv, k_rope = arr(b, t, n, p), arr(b, t, n, r), arr(b, s, c), arr(b, s, r)
  w_uk, w_uv = arr(c, n, p) * 0.2, arr(c, n, h) * 0.2
  idx = jnp.asarray(rng.integers(0, s, (b, t, 10)), jnp.int32)
  got = sparse_mla_attention(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, idx)  # native default
  want = sparse_mla_attention(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, idx, implementation="xla")
  np.testing.assert_allclose(got, want, atol=2e-5)


def test_sharded_under_a_mesh_matches_unsharded():
  """Under the 8-device mesh the native calls run in ``shard_map`` (batch split; sparse attention
  also over heads), each device on its slice; selection and outputs equal the unsharded XLA
  paths, and the gradient (the XLA reference's VJP) too."""
  from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: PLC0415

  from jaxattn import sharding  # noqa: PLC0415

  mesh = sharding.make_mesh({"data": 2, "tensor": 4})
  q, keys, w = index_inputs(2, 40, 96, 4, 16, seed=11)
  lengths = jnp.asarray([96, 70], jnp.int32)
  rng = np.random.default_rng(12)
  query = jnp.asarray(rng.standard_normal((2, 40, 8, 16)), jnp.float32)
  key = jnp.asarray(rng.standard_normal((2, 96, 4, 16)), jnp.float32)
  value = jnp.asarray(rng.standard_normal((2, 96, 4, 24)), jnp.float32)

  def run(impl, q, keys, w, query, key, value):
    idx = indexer_topk(q, keys, w, k=16, q_offset=56, kv_lengths=lengths, implementation=impl)

    def loss(query, key, value):
      out = sparse_attention(query, key, value, idx, implementation=impl)
      return jnp.sum(out * jnp.cos(out)), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(query, key,
                                                                                  value)
    return idx, out, grads

  f = jax.jit(functools.partial(run, "cpu"))
  with jax.set_mesh(mesh):
    args = (q, keys, w, query, key, value)
    jaxpr = str(jax.make_jaxpr(f)(*args))
    assert jaxpr.count("shard_map") >= 2 and "jaxattn_indexer_topk_f32" in jaxpr
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    idx, out, grads = f(put(q, P("data")), put(keys, P("data")), put(w, P("data")),
                        put(query, P("data", None, "tensor")), put(key, P("data", None, "tensor")),
                        put(value, P("data", None, "tensor")))
  want_idx, want_out, want_grads = run("xla", q, keys, w, query, key, value)
  np.testing.assert_array_equal(np.asarray(idx), np.asarray(want_idx))
  np.testing.assert_allclose(out, want_out, atol=2e-5)
  for g, wg in zip(grads, want_grads):
    np.testing.assert_allclose(g, wg, atol=2e-5)
