"""Decode over a contiguous KV cache read as pages of itself (``ops.decode.cache_attention``): the
TPU kernel (interpret mode, race detection) and the GPU kernel (interpreted) against the
XLA formula and a float64 NumPy reference; ragged lengths incl. zero, several new tokens,
soft-cap, bf16, NaN in the unused slots, the simulated 8-device mesh; ``Attention`` routing its
cached steps to the kernel (equal to the flash / XLA path), and what it leaves alone.  The same
for MLA's contiguous latent cache (``cache_mla_decode``): in-place fused rows, the sliced
fallback, ``LatentCache``'s TPU layout (k^R padded to 128 columns), ``MLA`` routing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxattn import sharding
from jaxattn.cache import KVCache, cache_length
from jaxattn.dsa_cache import DSACache
from jaxattn.mla_cache import LatentCache
from jaxattn.nn import attention as attention_module
from jaxattn.nn import mla as mla_module
from jaxattn.nn.attention import Attention
from jaxattn.nn.mla import MLA
from jaxattn.ops.decode import cache_attention, cache_mla_decode, view_page_size
from jaxattn.testing import prefill_then_decode, random_module
from pallas_kernels.decode_attention.tpu import contiguous_attention_tpu
from pallas_kernels.mla_decode.tpu import contiguous_mla_decode_tpu

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
  # One page of keys + values within 2 MiB (double-buffered in VMEM): 8 KV heads of 128 in bf16
  # take 512 tokens, 32 heads 128, and a row too large for any page still gets the smallest.
  assert view_page_size(8192, 8 * 128 * 2 * 2) == 512
  assert view_page_size(8192, 32 * 128 * 2 * 2) == 128
  assert view_page_size(8192, 1 << 20) == 16


@pytest.mark.parametrize("impl,merged", [("xla", False), ("pallas_tpu", False),
                                         ("pallas_tpu", True), ("pallas_gpu", True)])
def test_matches_numpy_reference(impl, merged):
  """Ragged lengths (0, a partial block, a full cache), GQA, three new tokens, a soft-cap; the
  cache split ``[B, S, K, H]`` or in a ``KVCache``'s rows ``[B, S, K * H]``."""
  lengths = (21, 0, 48, 5)
  key, value = cache(lengths, 48, kh=2)
  q = queries(4, 3, 4)
  if merged:
    key, value = key.reshape(4, 48, 16), value.reshape(4, 48, 16)
  got = cache_attention(q, key, value, jnp.asarray(lengths), scale=0.4, logits_soft_cap=2.0,
                        implementation=impl, num_splits=2)
  want = numpy_reference(q, key.reshape(4, 48, 2, 8), value.reshape(4, 48, 2, 8), lengths, 0.4,
                         cap=2.0)
  assert got.shape == (4, 3, 4, 8) and np.isfinite(np.asarray(got)).all()
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
  np.testing.assert_array_equal(got[1], 0.0)


def test_tpu_kernel_row_blocks():
  """Six new tokens x two heads per KV head = 12 query rows, in blocks of 8 (merged cache) and
  of 8 with a split cache and split-KV: equal to the NumPy reference."""
  lengths = (21, 0, 48, 3)
  key, value = cache(lengths, 48, kh=2)
  q = queries(4, 6, 4)
  want = numpy_reference(q, key, value, lengths, 0.4)
  lens = jnp.asarray(lengths)
  for k, v, splits in ((key.reshape(4, 48, 16), value.reshape(4, 48, 16), 1), (key, value, 3)):
    got = contiguous_attention_tpu(q, k, v, lens, scale=0.4, block_rows=8, num_splits=splits,
                                   interpret=True)
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
  rows = NamedSharding(mesh, P("data", None, "tensor"))               # KVCache rows, K-major
  for k, v, sp in ((key, value, spec), (key.reshape(2, 32, 32), value.reshape(2, 32, 32), rows)):
    with jax.set_mesh(mesh):
      args = [jax.device_put(q, spec), jax.device_put(k, sp), jax.device_put(v, sp)]
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
  rows = (key.reshape(1, 32, 16), value.reshape(1, 32, 16))           # KVCache rows [B, S, K*H]
  with pytest.raises(ValueError, match="`key`"):
    cache_attention(queries(1, 1, 2, h=5), *rows, lens)             # 16 % 5
  with pytest.raises(ValueError, match="`value`"):
    cache_attention(q, rows[0], value.reshape(1, 32, 2, 8)[..., :7].reshape(1, 32, 14)[..., :13],
                    lens)                                            # 13 % K=2
  with pytest.raises(ValueError, match="multiple"):
    cache_attention(queries(1, 1, 3), key, value, lens, implementation="pallas_tpu")
  with pytest.raises(ValueError, match="lengths"):
    cache_attention(q, key, value, jnp.asarray([33]), implementation="pallas_tpu")
  with pytest.raises(ValueError, match="num_splits"):
    cache_attention(q, key, value, lens, implementation="pallas_tpu", num_splits=0)


def test_kv_cache_rows_and_split_heads():
  """``KVCache`` keeps a token's KV heads side by side (``[B, L, K * H]``); ``split_heads`` is
  the ``[B, L, K, H]`` view; updates land at ``index``; wrong shapes are refused."""
  kv = KVCache.init(2, 8, 2, 4, 3, length_align=1)
  assert kv.key.shape == (2, 8, 8) and kv.value.shape == (2, 8, 6)
  assert (kv.num_kv_heads, kv.head_dim, kv.v_head_dim, kv.nbytes) == (2, 4, 3, 2 * 8 * 14 * 4)
  rng = np.random.default_rng(9)
  k, v = rng.standard_normal((2, 3, 2, 4)), rng.standard_normal((2, 3, 2, 3))
  kv = jax.jit(lambda c, k, v: c.update(k, v))(kv, jnp.asarray(k), jnp.asarray(v))
  kv = kv.update(jnp.asarray(k[:, :1]), jnp.asarray(v[:, :1]))
  key, value = kv.split_heads()
  assert int(kv.index) == 4 and key.shape == (2, 8, 2, 4) and value.shape == (2, 8, 2, 3)
  np.testing.assert_allclose(key[:, :3], k, rtol=1e-6)
  np.testing.assert_allclose(value[:, 3], v[:, 0], rtol=1e-6)
  np.testing.assert_array_equal(kv.key[:, 4:], 0.0)
  np.testing.assert_allclose(kv.key[0, 1], k[0, 1].reshape(-1), rtol=1e-6)  # row [k_0 | k_1]
  with pytest.raises(ValueError, match="`key`"):
    kv.update(jnp.ones((2, 1, 1, 4)), jnp.ones((2, 1, 1, 3)))
  with pytest.raises(ValueError, match="`value`"):
    kv.update(jnp.ones((2, 1, 2, 4)), jnp.ones((2, 1, 2, 4)))
  with pytest.raises(ValueError, match="overflow"):
    kv.update(jnp.ones((2, 5, 2, 4)), jnp.ones((2, 5, 2, 3)))


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


@pytest.mark.parametrize("kw", [dict(logits_soft_cap=3.0), dict(attention_sinks=True)],
                         ids=["softcap", "sinks"])
def test_module_steps_run_the_decode_kernel_and_equal_the_xla_path(monkeypatch, kw):
  """Prefill (5 tokens) and four one-token steps with a contiguous cache of 16: with
  ``implementation="pallas_tpu"`` (the TPU default) every step goes to the decode kernel, and the
  outputs equal the XLA path's; a soft-cap, or attention sinks (random), are carried over."""
  module = _module(**kw)
  x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 9, D)), jnp.float32)
  calls = _counting(monkeypatch)
  got = _decode(module, x, "pallas_tpu")
  assert calls == ["pallas_tpu"] * 2                     # traced once per step shape: 5 and 1
  want = _decode(module, x, "xla")
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(got, nnx.jit(lambda m, x: m(x))(module, x), rtol=2e-5, atol=2e-5)


def test_caches_round_their_length_up_on_tpu(monkeypatch):
  """On TPU a contiguous cache's length is rounded up (to 16; to 128 past 512 slots), so that the
  decode kernels can read it as pages of itself: a module's ``init_cache(2, 10)`` then decodes in
  the kernel, where 10 slots would have sent every step to flash attention.  Elsewhere the
  length is exact; an explicit ``length_align`` wins; a bad one is refused."""
  assert cache_length(1000, 1) == 1000 and cache_length(17, 16) == 32
  module = _module()
  with monkeypatch.context() as m:
    m.setattr(jax, "default_backend", lambda: "cpu")
    assert KVCache.init(1, 1000, 2, 8).max_len == 1000 and LatentCache.init(1, 9, 8, 4).max_len == 9
  with monkeypatch.context() as m:
    m.setattr(jax, "default_backend", lambda: "tpu")
    assert KVCache.init(1, 1000, 2, 8).max_len == 1024
    assert KVCache.init(1, 100, 2, 8).max_len == 112
    assert KVCache.init(1, 100, 2, 8, length_align=1).max_len == 100
    assert LatentCache.init(1, 513, 8, 4).max_len == 640
    assert LatentCache.init(1, 512, 8, 4).max_len == 512
    dsa = DSACache.init(2, 20, kv_lora_rank=8, qk_rope_head_dim=4, index_head_dim=16)
    assert dsa.max_len == 32 and dsa.index_keys.shape[1] == 32
    cache = module.init_cache(2, 10)
  assert cache.max_len == 16
  calls = _counting(monkeypatch)
  x = jnp.asarray(np.random.default_rng(6).standard_normal((2, 3, D)), jnp.float32)
  y, cache = _step(module, cache, x, implementation="pallas_tpu")
  assert calls == ["pallas_tpu"] and int(cache.index) == 3
  np.testing.assert_allclose(y, nnx.jit(lambda m, x: m(x))(module, x), rtol=2e-5, atol=2e-5)
  for bad in (0, True, 2.0):
    with pytest.raises(ValueError, match="length_align"):
      KVCache.init(1, 8, 1, 8, length_align=bad)
    with pytest.raises(ValueError, match="length_align"):
      LatentCache.init(1, 8, 8, 4, length_align=bad)


@pytest.mark.parametrize("kw", [dict(sliding_window=4), dict(position="alibi")])
def test_window_and_alibi_layers_decode_in_the_kernel(monkeypatch, kw):
  """A sliding window (4 keys before each query: the 9-token prefix's early pages fall out of it)
  and ALiBi are the decode kernel's own: every step goes to it and equals the XLA path and the
  full forward."""
  module = _module(**kw)
  x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 9, D)), jnp.float32)
  calls = _counting(monkeypatch)
  got = _decode(module, x, "pallas_tpu")
  assert calls == ["pallas_tpu"] * 2
  np.testing.assert_allclose(got, _decode(module, x, "xla"), rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(got, nnx.jit(lambda m, x: m(x))(module, x), rtol=2e-5, atol=2e-5)


def test_module_leaves_other_layers_to_flash_attention(monkeypatch):
  """A learned relative bias (T5) is not the decode kernel's: the step goes to the dense
  dispatch, here a preference list whose first name is the TPU kernels' (the dense flash
  kernel takes no dense bias and falls through to ``xla_chunked``)."""
  module = _module(position="t5")
  x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 6, D)), jnp.float32)
  calls = _counting(monkeypatch)
  prefer = ("pallas_tpu", "xla_chunked")
  y, _ = _step(module, module.init_cache(2, 16), x, implementation=prefer)
  assert calls == []
  np.testing.assert_allclose(y, nnx.jit(lambda m, x: m(x))(module, x), rtol=2e-5, atol=2e-5)
  _step(_module(), _module().init_cache(2, 16), x, implementation=prefer)   # the kernel's
  assert calls == ["pallas_tpu"]
  calls.clear()
  long = jnp.asarray(np.random.default_rng(4).standard_normal((2, 17, D)), jnp.float32)
  _step(_module(), _module().init_cache(2, 32), long, implementation="pallas_tpu")  # T > 16
  assert calls == []


# -- MLA: the contiguous latent cache --------------------------------------------------------------

def latent_buffer(lengths, s, c, r, width=None, dtype=jnp.float32, seed=5):
  """``[B, S, width]`` rows ``[c_KV | k^R | zeros]`` holding ``lengths`` tokens; NaN past them."""
  rng = np.random.default_rng(seed)
  width = c + r if width is None else width
  kv = np.zeros((len(lengths), s, width))
  kv[..., :c + r] = rng.standard_normal((len(lengths), s, c + r))
  kv[np.arange(s)[None, :] >= np.asarray(lengths)[:, None]] = np.nan
  return jnp.asarray(kv, dtype)


def mla_numpy(ql, qr, kv, lengths, scale):
  """float64 absorbed MLA: logits ``scale * (q~ . c + q^R . k^R)`` over each sequence's prefix."""
  ql, qr, kv = (np.asarray(x, np.float64) for x in (ql, qr, kv))
  b, t, n, c = ql.shape
  r = qr.shape[3]
  out = np.zeros((b, t, n, c))
  for i, length in enumerate(lengths):
    for j in range(t):
      pos = length - t + j
      if pos < 0:
        continue
      rows = kv[i, :pos + 1]
      for head in range(n):
        logits = (rows[:, :c] @ ql[i, j, head] + rows[:, c:c + r] @ qr[i, j, head]) * scale
        p = np.exp(logits - logits.max())
        out[i, j, head] = (p / p.sum()) @ rows[:, :c]
  return out


# (C, R, stored width, implementation): the fused in-place path (R a multiple of 128, the TPU
# cache's padded k^R), the sliced fallback (R = 8, and a padded 8 -> 16), the GPU kernel, XLA.
@pytest.mark.parametrize("c,r,width,impl", [
    (256, 128, 384, "pallas_tpu"),
    (12, 8, 20, "pallas_tpu"),
    (12, 8, 28, "pallas_tpu"),
    (16, 8, 32, "pallas_gpu"),
    (12, 8, 28, "xla"),
])
def test_mla_matches_numpy_reference(c, r, width, impl):
  lengths = (19, 0, 32)
  kv = latent_buffer(lengths, 32, c, r, width)
  rng = np.random.default_rng(6)
  ql = jnp.asarray(rng.standard_normal((3, 2, 4, c)), jnp.float32)
  qr = jnp.asarray(rng.standard_normal((3, 2, 4, r)), jnp.float32)
  got = cache_mla_decode(ql, qr, kv, jnp.asarray(lengths), scale=0.2, num_splits=2,
                         implementation=impl)
  assert got.shape == (3, 2, 4, c) and np.isfinite(np.asarray(got)).all()
  np.testing.assert_allclose(got, mla_numpy(ql, qr, kv, lengths, 0.2), rtol=2e-5, atol=2e-5)
  np.testing.assert_array_equal(got[1], 0.0)


def test_mla_tpu_kernel_race_free_bf16_and_sharded(race_states):
  lengths = (7, 32)
  kv = latent_buffer(lengths, 32, 256, 128, dtype=jnp.bfloat16)
  rng = np.random.default_rng(7)
  ql = jnp.asarray(rng.standard_normal((2, 8, 256)), jnp.bfloat16)      # [B, N, C]: one token
  qr = jnp.asarray(rng.standard_normal((2, 8, 128)), jnp.bfloat16)
  lens = jnp.asarray(lengths)
  want = cache_mla_decode(ql, qr, kv, lens, scale=0.1, implementation="xla")
  got = cache_mla_decode(ql, qr, kv, lens, scale=0.1, implementation="pallas_tpu", num_splits=2,
                         interpret=RACES)
  assert got.shape == (2, 8, 256) and got.dtype == jnp.bfloat16
  np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=2e-2,
                             atol=2e-2)
  assert race_states and not any(st.races_found for st in race_states)
  mesh = sharding.make_mesh({"data": 2, "tensor": 4})
  with jax.set_mesh(mesh):
    heads = NamedSharding(mesh, P("data", "tensor", None))
    sharded = jax.jit(lambda ql, qr, kv, n: cache_mla_decode(
        ql, qr, kv, n, scale=0.1, implementation="pallas_tpu"))(
        jax.device_put(ql, heads), jax.device_put(qr, heads),
        jax.device_put(kv, NamedSharding(mesh, P("data", None, None))), lens)
  np.testing.assert_allclose(sharded.astype(np.float32), want.astype(np.float32), rtol=2e-2,
                             atol=2e-2)


def test_mla_tpu_kernel_row_blocks():
  """Five new tokens x four heads = 20 query rows in blocks of 8, fused in-place blocks (R = 128)
  and the sliced fallback: equal to the NumPy reference."""
  lengths = (19, 0, 32)
  rng = np.random.default_rng(9)
  for c, r, width in ((256, 128, 384), (12, 8, 20)):
    kv = latent_buffer(lengths, 32, c, r, width)
    ql = jnp.asarray(rng.standard_normal((3, 5, 4, c)), jnp.float32)
    qr = jnp.asarray(rng.standard_normal((3, 5, 4, width - c)), jnp.float32)
    got = contiguous_mla_decode_tpu(ql, qr, kv, jnp.asarray(lengths), scale=0.2, block_rows=8,
                                    num_splits=2, interpret=True)
    np.testing.assert_allclose(got, mla_numpy(ql, qr, kv, lengths, 0.2), rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(got[1], 0.0)


def test_mla_errors():
  kv = latent_buffer((3,), 40, 12, 8)
  ql, qr = jnp.ones((1, 1, 2, 12)), jnp.ones((1, 1, 2, 8))
  with pytest.raises(ValueError, match="multiple of 16"):
    cache_mla_decode(ql, qr, kv, jnp.asarray([3]), scale=0.1, implementation="pallas_tpu")
  with pytest.raises(ValueError, match="`kv`"):
    cache_mla_decode(ql, jnp.ones((1, 1, 2, 9)), kv, jnp.asarray([3]), scale=0.1)
  kv = latent_buffer((3,), 32, 12, 8)
  with pytest.raises(ValueError, match="scale"):
    cache_mla_decode(ql, qr, kv, jnp.asarray([3]), scale=None, implementation="pallas_tpu")
  with pytest.raises(ValueError, match="lengths"):
    cache_mla_decode(ql, qr, kv, jnp.asarray([40]), scale=0.1, implementation="pallas_tpu")
  with pytest.raises(ValueError, match="q_rope"):
    cache_mla_decode(ql, qr[:, :, :1], kv, jnp.asarray([3]), scale=0.1,
                     implementation="pallas_tpu")


def test_latent_cache_pads_the_rotated_key_on_tpu(monkeypatch):
  assert LatentCache.init(1, 4, 8, 64).kv.shape == (1, 4, 72)                   # CPU: exact
  with monkeypatch.context() as m:
    m.setattr(jax, "default_backend", lambda: "tpu")
    assert LatentCache.init(1, 4, 512, 64).kv.shape == (1, 16, 640)         # length: 16 slots
  cache = LatentCache.init(2, 4, 5, 2, rope_align=8)
  assert cache.kv.shape == (2, 4, 13) and cache.qk_rope_head_dim == 2
  c_kv, k_rope = jnp.ones((2, 3, 5)), 2 * jnp.ones((2, 3, 2))
  cache = jax.jit(lambda cc, a, b: cc.update(a, b))(cache, c_kv, k_rope)
  np.testing.assert_array_equal(cache.c_kv[:, :3], 1.0)
  np.testing.assert_array_equal(cache.k_rope[:, :3], 2.0)
  assert cache.k_rope.shape == (2, 4, 2)
  np.testing.assert_array_equal(cache.kv[..., 7:], 0.0)                       # the padding
  assert cache.nbytes == 2 * 4 * 13 * 4
  with pytest.raises(ValueError, match="k_rope"):
    cache.update(c_kv[:, :1], jnp.ones((2, 1, 8)))
  with pytest.raises(ValueError, match="rope_align"):
    LatentCache.init(1, 4, 8, 64, rope_align=0)


MLA_DIMS = dict(kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)


def _mla(**kw):
  return random_module(lambda: MLA(D, 4, mode="absorbed", rngs=nnx.Rngs(0), **MLA_DIMS, **kw), 0)


@nnx.jit(static_argnames=("implementation", "mode"))
def _mla_step(m, c, xt, implementation=None, mode=None):
  return m(xt, cache=c, implementation=implementation, mode=mode)


def test_mla_module_steps_run_the_decode_kernel(monkeypatch):
  """Absorbed MLA with a contiguous latent cache: prefill (5) and four steps go to the kernel
  with ``implementation="pallas_tpu"``, over a cache made on TPU (k^R padded to 128) too; the
  outputs equal the XLA path's and the full pass.  Naive mode keeps its own path."""
  module = _mla()
  x = jnp.asarray(np.random.default_rng(8).standard_normal((2, 9, D)), jnp.float32)
  calls = []

  def counted(*args, **kw):
    calls.append(kw["implementation"])
    return cache_mla_decode(*args, **kw)
  monkeypatch.setattr(mla_module, "cache_mla_decode", counted)
  want = nnx.jit(lambda m, x: m(x))(module, x)
  with monkeypatch.context() as m:
    m.setattr(jax, "default_backend", lambda: "tpu")
    tpu_cache = module.init_cache(2, 16)
  assert tpu_cache.kv.shape[2] == 12 + 128
  for cache in (module.init_cache(2, 16), tpu_cache):
    step = lambda m, c, xt: _mla_step(m, c, xt, implementation="pallas_tpu")  # noqa: E731
    got, _ = prefill_then_decode(step, module, cache, x, 5)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
  assert calls == ["pallas_tpu"] * 4                     # two caches x two step shapes
  # The kernel takes T x N query rows in blocks that fit VMEM (576 rows: two blocks); more than
  # DECODE_MAX_T new tokens are a prefill, which flash attention serves.
  wide = nnx.eval_shape(lambda: MLA(D, 64, mode="absorbed", rngs=nnx.Rngs(0), **MLA_DIMS))
  cache = wide.init_cache(1, 32)
  assert wide._decode_kernel(9, "absorbed", None, "pallas_tpu", cache)
  assert not wide._decode_kernel(17, "absorbed", None, "pallas_tpu", cache)
  _mla_step(module, module.init_cache(2, 16), x[:, :3], implementation="pallas_tpu",
            mode="naive")
  assert len(calls) == 4
