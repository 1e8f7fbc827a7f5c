"""The paged decode kernel over a quantized KV cache (int8 / float8_e4m3fn codes, a scale per
token and KV head) against the XLA formula on the same codes (interpret mode, race detection):
ragged lengths incl. zero, split-KV, several new tokens, bf16 queries, window, ALiBi and sinks,
stale slots (NaN codes and scales) never read into the result, and under the 8-device mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxattn import sharding
from jaxattn.ops.decode import paged_attention
from jaxattn.paged_cache import PagedKVCache
from jaxattn.testing import scrambled_paged_cache

RACES = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)
PAGE = 4
INT8, FP8 = jnp.int8, jnp.float8_e4m3fn


def quantized_cache(lengths, kh, dtype, h=8, num_pages=16, max_pages=5, seed=0):
  """``lengths`` random tokens in scattered pages of a quantized cache whose empty slots (and, in
  fp8, their codes) are NaN."""
  b, s = len(lengths), max(max(lengths), 1)
  rng = np.random.default_rng(seed)
  cache = scrambled_paged_cache(PagedKVCache.init(b, num_pages, PAGE, kh, h,
                                                  max_pages_per_seq=max_pages, dtype=dtype), seed)
  # Heads of different magnitudes: a scale per KV head matters.
  mag = jnp.asarray(np.geomspace(0.3, 3.0, kh), jnp.float32)[:, None]
  key = jnp.asarray(rng.standard_normal((b, s, kh, h)), jnp.float32) * mag
  value = jnp.asarray(rng.standard_normal((b, s, kh, h)), jnp.float32) * mag
  return cache.append(key, value, np.asarray(lengths))


def queries(b, t, n, h=8, dtype=jnp.float32, seed=1):
  return jnp.asarray(np.random.default_rng(seed).standard_normal((b, t, n, h)), dtype)


def _call(q, cache, **kw):
  return paged_attention(q, cache.key_pool, cache.value_pool, cache.page_table, cache.lengths,
                         key_scale=cache.key_scale_pool, value_scale=cache.value_scale_pool, **kw)


def test_matches_reference_with_race_detection(race_states):
  cache = quantized_cache((7, 0), kh=2, dtype=INT8, num_pages=6, max_pages=3)
  q = queries(2, 1, 4)
  ref = _call(q, cache, implementation="xla")
  got = _call(q, cache, implementation="pallas_tpu", num_splits=2, interpret=RACES)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(got[1], 0.0)
  assert race_states and not any(st.races_found for st in race_states)


@pytest.mark.parametrize("dtype,qdtype,n,kh,t", [
    (INT8, jnp.float32, 4, 2, 1),
    (FP8, jnp.float32, 2, 2, 3),
    (INT8, jnp.bfloat16, 4, 1, 2),
])
def test_ragged_batches_and_split_kv(dtype, qdtype, n, kh, t):
  lengths = (9, 0, 4, 2, 17)
  cache = quantized_cache(lengths, kh, dtype)
  q = queries(len(lengths), t, n, dtype=qdtype)
  ref = _call(q, cache, implementation="xla", scale=0.5)
  tol = dict(rtol=1e-5, atol=1e-6) if qdtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
  for splits in (1, 3):
    got = _call(q, cache, implementation="pallas_tpu", num_splits=splits, interpret=True,
                scale=0.5)
    assert got.dtype == qdtype and np.isfinite(np.asarray(got, np.float32)).all()
    np.testing.assert_allclose(got.astype(np.float32), ref.astype(np.float32), **tol)
    np.testing.assert_array_equal(got[1], 0.0)


def test_window_alibi_sinks_and_soft_cap():
  n, kh = 4, 2
  cache = quantized_cache((13, 3, 0), kh, FP8)
  q = queries(3, 2, n)
  kw = dict(local_window_size=5, alibi_slopes=np.linspace(0.1, 0.8, n), logits_soft_cap=2.0,
            sinks=np.linspace(-1.0, 1.5, n).astype(np.float32))
  ref = _call(q, cache, implementation="xla", **kw)
  got = _call(q, cache, implementation="pallas_tpu", num_splits=2, interpret=True, **kw)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_sharded_under_mesh_equals_unsharded():
  """Scales travel split with the KV heads (``[P, K, page]``, axis 1)."""
  mesh = sharding.make_mesh({"data": 2, "tensor": 4})
  cache = quantized_cache((6, 11), 4, INT8)
  q = queries(2, 1, 8)
  ref = _call(q, cache, implementation="xla")
  with jax.set_mesh(mesh):
    qs = jax.device_put(q, NamedSharding(mesh, P("data", None, "tensor", None)))
    got = jax.jit(lambda q, c: _call(q, c, implementation="pallas_tpu", num_splits=2,
                                     interpret=True))(qs, cache)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
