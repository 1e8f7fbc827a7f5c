"""Decode over a contiguous KV cache read as pages of itself (``ops.decode.cache_attention``): the
TPU kernel (interpret mode, race detection) and the GPU kernel (interpreted) against the
XLA formula and a float64 NumPy reference; ragged lengths incl. zero, several new tokens,
soft-cap, bf16, NaN in the unused slots, the simulated 8-device mesh; ``Attention`` routing its
cached steps to the kernel (equal to the flash / XLA path), and what it leaves alone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxattn import sharding
from jaxattn.nn import attention as attention_module
from jaxattn.nn.attention import Attention
from jaxattn.ops.decode import cache_attention, view_page_size
from jaxattn.testing import prefill_then_decode, random_module

RACES = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)


def cache(lengths, s, kh, h=8, hv=8, dtype=jnp.float32, seed=0):
  """``[B, S, K, H|h]`` random keys / values holding ``lengths`` tokens; NaN past each length."""
  rng = np.random.default_rng(seed)
  b = len(lengths)
  key = rng.standard_normal((b, s, kh, h))
  value = rng.standard_normal((b, s, kh, hv))
  unused = np.arange(s)[None, :] >= np.asarray(lengths)[:, None]
  key[unused], value[unused] = np.nan, np.nan
  return jnp.asarray(key, dtype), jnp.asarray(value, dtype)


def numpy_reference(q, key, value, lengths, scale, cap=None):
  """float64, per sequence / query / head: the last T tokens attend causally to the prefix."""
  q, key, value = (np.asarray(x, np.float64) for x in (q, key, value))
  b, t, n, _ = q.shape
  g = n // key.shape[2]
  out = np.zeros((b, t, n, value.shape[-1]))
  for i, length in enumerate(lengths):
    for j in range(t):
      pos = length - t + j
      for head in range(n):
        if pos < 0:
          continue
        logits = key[i, :pos + 1, head // g] @ q[i, j, head] * scale
        if cap is not None:
          logits = cap * np.tanh(logits / cap)
        p = np.exp(logits - logits.max())
        out[i, j, head] = (p / p.sum()) @ value[i, :pos + 1, head // g]
  return out


def queries(b, t, n, h=8, dtype=jnp.float32, seed=1):
  return jnp.asarray(np.random.default_rng(seed).standard_normal((b, t, n, h)), dtype)


def test_view_page_size():
  assert [view_page_size(s) for s in (8192, 48, 96, 16, 40)] == [512, 16, 32, 16, None]


@pytest.mark.parametrize("impl", ["xla", "pallas_tpu", "pallas_gpu"])
def test_matches_numpy_reference(impl):
  """Ragged lengths (0, a partial block, a full cache), GQA, three new tokens, a soft-cap."""
  lengths = (21, 0, 48, 5)
  key, value = cache(lengths, 48, kh=2)
  q = queries(4, 3, 4)
  got = cache_attention(q, key, value, jnp.asarray(lengths), scale=0.4, logits_soft_cap=2.0,
                        implementation=impl, num_splits=2)
  want = numpy_reference(q, key, value, lengths, 0.4, cap=2.0)
  assert got.shape == (4, 3, 4, 8) and np.isfinite(np.asarray(got)).all()
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
  np.testing.assert_array_equal(got[1], 0.0)


def test_tpu_kernel_race_free_bf16_mqa(race_states):
  lengths = (17, 32)
  key, value = cache(lengths, 32, kh=1, hv=16, dtype=jnp.bfloat16)
  q = queries(2, 1, 4, dtype=jnp.bfloat16)[:, 0]                  # [B, N, H]: one token
  lens = jnp.asarray(lengths)
  got = cache_attention(q, key, value, lens, implementation="pallas_tpu", num_splits=2,
                        interpret=RACES)
  want = cache_attention(q, key, value, lens, implementation="xla")
  assert got.shape == (2, 4, 16) and got.dtype == jnp.bfloat16
  np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=2e-2,
                             atol=2e-2)
  assert race_states and not any(st.races_found for st in race_states)


def test_sharded_under_mesh_equals_unsharded():
  """Cache, queries and lengths split over ``data`` (batch) and ``tensor`` (KV heads): each
  device reads its own rows of the cache."""
  mesh = sharding.make_mesh({"data": 2, "tensor": 4})
  lengths = (9, 32)
  key, value = cache(lengths, 32, kh=4)
  q = queries(2, 2, 8)
  lens = jnp.asarray(lengths)
  want = cache_attention(q, key, value, lens, implementation="xla")
  spec = NamedSharding(mesh, P("data", None, "tensor", None))
  with jax.set_mesh(mesh):
    args = [jax.device_put(x, spec) for x in (q, key, value)]
    got = jax.jit(lambda q, k, v, n: cache_attention(q, k, v, n, implementation="pallas_tpu"))(
        *args, jax.device_put(lens, NamedSharding(mesh, P("data"))))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_errors():
  key, value = cache((3,), 40, kh=1)
  q = queries(1, 1, 2)
  lens = jnp.asarray([3])
  cache_attention(q, key, value, lens, implementation="xla")      # any length for the formula
  with pytest.raises(ValueError, match="multiple of 16"):
    cache_attention(q, key, value, lens, implementation="pallas_tpu")
  key, value = cache((3,), 32, kh=2)
  with pytest.raises(ValueError, match="`key`"):
    cache_attention(queries(1, 1, 2, h=4), key, value, lens)
  with pytest.raises(ValueError, match="`value`"):
    cache_attention(q, key, value[:, :16], lens)
  with pytest.raises(ValueError, match="multiple"):
    cache_attention(queries(1, 1, 3), key, value, lens, implementation="pallas_tpu")
  with pytest.raises(ValueError, match="lengths"):
    cache_attention(q, key, value, jnp.asarray([33]), implementation="pallas_tpu")
  with pytest.raises(ValueError, match="num_splits"):
    cache_attention(q, key, value, lens, implementation="pallas_tpu", num_splits=0)


# -- through the Attention module ------------------------------------------------------------------

D = 32


def _module(**kw):
  return random_module(lambda: Attention(D, num_heads=4, num_kv_heads=2, rngs=nnx.Rngs(0), **kw),
                       0)


@nnx.jit(static_argnames="implementation")
def _step(m, c, xt, implementation=None):
  return m(xt, cache=c, implementation=implementation)


def _decode(module, x, implementation):
  step = lambda m, c, xt: _step(m, c, xt, implementation=implementation)  # noqa: E731
  return prefill_then_decode(step, module, module.init_cache(2, 16), x, 5)[0]


def _counting(monkeypatch):
  calls = []

  def counted(*args, **kw):
    calls.append(kw["implementation"])
    return cache_attention(*args, **kw)
  monkeypatch.setattr(attention_module, "cache_attention", counted)
  return calls


def test_module_steps_run_the_decode_kernel_and_equal_the_xla_path(monkeypatch):
  """Prefill (5 tokens) and four one-token steps with a contiguous cache of 16: with
  ``implementation="pallas_tpu"`` (the TPU default) every step goes to the decode kernel, and the
  outputs equal the XLA path's; a soft-cap is carried over."""
  module = _module(logits_soft_cap=3.0)
  x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 9, D)), jnp.float32)
  calls = _counting(monkeypatch)
  got = _decode(module, x, "pallas_tpu")
  assert calls == ["pallas_tpu"] * 2                     # traced once per step shape: 5 and 1
  want = _decode(module, x, "xla")
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(got, nnx.jit(lambda m, x: m(x))(module, x), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("kw", [dict(sliding_window=4), dict(position="alibi")])
def test_module_leaves_other_layers_to_flash_attention(monkeypatch, kw):
  module = _module(**kw)
  x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 6, D)), jnp.float32)
  calls = _counting(monkeypatch)
  y, _ = _step(module, module.init_cache(2, 16), x, implementation="pallas_tpu")
  assert calls == [] and y.shape == (2, 6, D)
  long = jnp.asarray(np.random.default_rng(4).standard_normal((2, 17, D)), jnp.float32)
  _step(_module(), _module().init_cache(2, 32), long, implementation="pallas_tpu")  # T > 16
  assert calls == []
