"""The paged decode kernel over a quantized KV cache (int8 / float8_e4m3fn codes, a scale per
token and KV head) against the XLA formula on the same codes (interpret mode, race detection):
ragged lengths incl. zero, split-KV, several new tokens, bf16 queries, window, ALiBi and sinks,
stale slots (NaN codes and scales) never read into the result, and under the 8-device mesh; the
same kernel over a contiguous quantized ``KVCache``, and ``Attention`` routing its steps there."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxattn import sharding
from jaxattn.cache import KVCache
from jaxattn.nn import attention as attention_module
from jaxattn.nn.attention import Attention
from jaxattn.ops.decode import cache_attention, paged_attention
from jaxattn.paged_cache import PagedKVCache
from jaxattn.testing import prefill_then_decode, random_module, scrambled_paged_cache

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
  """Scales travel split with the KV heads (``[P, 1, K * page]``, K-major lanes)."""
  mesh = sharding.make_mesh({"data": 2, "tensor": 4})
  cache = quantized_cache((6, 11), 4, INT8)
  q = queries(2, 1, 8)
  ref = _call(q, cache, implementation="xla")
  with jax.set_mesh(mesh):
    qs = jax.device_put(q, NamedSharding(mesh, P("data", None, "tensor", None)))
    got = jax.jit(lambda q, c: _call(q, c, implementation="pallas_tpu", num_splits=2,
                                     interpret=True))(qs, cache)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


# -- a contiguous cache (KVCache) ------------------------------------------------------------------

def test_contiguous_cache_kernel_equals_xla():
  """``cache_attention`` over a quantized ``KVCache`` (scales ``[B, K, S]``, viewed as pages of
  16 with the codes): the kernel == the XLA path; ragged lengths, split-KV, several tokens."""
  cache = KVCache.init(3, 32, 2, 8, dtype=FP8)
  rng = np.random.default_rng(0)
  key, value = (jnp.asarray(rng.standard_normal((3, 21, 2, 8)), jnp.float32) for _ in range(2))
  cache = cache.update(key, value)
  lengths = jnp.asarray([21, 0, 9], jnp.int32)
  q = queries(3, 2, 4)
  kw = dict(key_scale=cache.key_scale, value_scale=cache.value_scale)
  ref = cache_attention(q, cache.key, cache.value, lengths, implementation="xla", **kw)
  got = cache_attention(q, cache.key, cache.value, lengths, implementation="pallas_tpu",
                        interpret=True, num_splits=2, **kw)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
  dk, dv = cache.split_heads()          # the formula over the dequantized cache
  np.testing.assert_allclose(ref, cache_attention(q, dk, dv, lengths, implementation="xla"),
                             rtol=1e-6, atol=1e-6)


D = 32


@nnx.jit(static_argnames="implementation")
def _step(m, c, xt, implementation=None):
  return m(xt, cache=c, implementation=implementation)


def test_module_decodes_a_quantized_contiguous_cache_in_the_kernel(monkeypatch):
  """``Attention`` with an int8 ``KVCache``: prefill 5 tokens, then four single steps; the
  decode-kernel route (``pallas_tpu``) == the dense route over the dequantized cache (``xla``),
  both within 3% of the unquantized cache's outputs."""
  module = random_module(lambda: Attention(D, num_heads=4, num_kv_heads=2, rngs=nnx.Rngs(0)), 0)
  x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 9, D)), jnp.float32)
  calls = []

  def counted(*args, **kw):
    calls.append(kw["implementation"])
    return cache_attention(*args, **kw)
  monkeypatch.setattr(attention_module, "cache_attention", counted)

  def run(impl, dtype):
    step = lambda m, c, xt: _step(m, c, xt, implementation=impl)  # noqa: E731
    return prefill_then_decode(step, module, module.init_cache(2, 16, dtype), x, 5)[0]

  got = run("pallas_tpu", INT8)
  assert calls == ["pallas_tpu"] * 2
  want = run("xla", INT8)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
  exact = run("xla", None)
  assert 0 < np.abs(np.asarray(want - exact)).max() <= 0.03 * np.abs(np.asarray(exact)).max()


def test_split_pools_with_scales():
  """Codes in the split form ``[P, page, K, H]`` (and a contiguous ``[B, S, K, H]``) with their
  scales: the kernel's scale blocks take the pages' index map cut to their three dimensions."""
  cache = quantized_cache((9, 4), 2, INT8)
  q = queries(2, 1, 4)
  split = dict(key_pool=cache.key_pool.reshape(cache.key_pool.shape[:2] + (2, 8)),
               value_pool=cache.value_pool.reshape(cache.value_pool.shape[:2] + (2, 8)))
  got = paged_attention(q, page_table=cache.page_table, lengths=cache.lengths,
                        key_scale=cache.key_scale_pool, value_scale=cache.value_scale_pool,
                        implementation="pallas_tpu", interpret=True, **split)
  np.testing.assert_allclose(got, _call(q, cache, implementation="xla"), rtol=1e-5, atol=1e-6)
  contiguous = KVCache.init(2, 16, 2, 8, dtype=INT8).update(*(queries(2, 11, 2, seed=s)
                                                              for s in (3, 4)))
  lengths = jnp.asarray([11, 5], jnp.int32)
  kw = dict(key_scale=contiguous.key_scale, value_scale=contiguous.value_scale)
  got = cache_attention(q, contiguous.key.reshape(2, 16, 2, 8),
                        contiguous.value.reshape(2, 16, 2, 8), lengths,
                        implementation="pallas_tpu", interpret=True, **kw)
  want = cache_attention(q, contiguous.key, contiguous.value, lengths, implementation="xla", **kw)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
