"""Serving on a device mesh (the simulated 8 CPU devices): ``Engine(mesh=...)`` places the weights
by their logical axes and splits every layer's page pools over the mesh axes of its KV heads;
greedy results equal the single-device engine's (itself equal to ``generate`` alone, see
test_serving.py), with and without the prefix cache, and every step hands the cache back in that
layout.  ``PagedModelCache.shard``'s layouts, Gated DeltaNet states included; the errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxattn.configs import get_config
from jaxattn.nn.model import DecoderLM
from jaxattn.paged_cache import PagedKVCache, PagedLatentCache
from jaxattn.serving import Engine
from jaxattn.sharding import make_mesh
from tests.test_serving import MODELS, REQUESTS, SMALL

LLAMA, DEEPSEEK = MODELS["llama"][1], MODELS["deepseek-v3"][1]
CASES = {
    # name: (preset, overrides, mesh shape, prefix cache)
    "llama-prefix": ("llama", LLAMA, {"data": 4, "tensor": 2}, True),
    # The TPU decode kernel (interpreted here) in its shard_map, reading the split pools.
    "llama-pallas_tpu": ("llama", dict(LLAMA, attention_implementation="pallas_tpu"),
                         {"data": 4, "tensor": 2}, False),
    "deepseek-v3": ("deepseek-v3", DEEPSEEK, {"data": 2, "tensor": 2, "expert": 2}, False),
    # An int8 cache: codes and scales split over the KV heads, the kernel reading both.
    "llama-int8-pallas_tpu": ("llama", dict(LLAMA, attention_implementation="pallas_tpu"),
                              {"data": 4, "tensor": 2}, True, jnp.int8),
    # Speculative decoding with a draft model: its weights and paged cache split the same way,
    # the verify step's rewinds keeping the layout.
    "llama-draft": ("llama", LLAMA, {"data": 4, "tensor": 2}, False, None,
                    dict(num_draft_tokens=3, draft=dict(num_layers=1))),
    # The model's own MTP module drafting: its block's pool split alike.
    "llama-mtp": ("llama", dict(LLAMA, mtp_depth=1), {"data": 4, "tensor": 2}, False, None,
                  dict(num_draft_tokens=3, draft="mtp")),
}


def prompts():
  rng = np.random.default_rng(0)
  system = rng.integers(1, 61, size=8)          # two pages of 4 shared by every prompt
  return [np.concatenate([system, rng.integers(1, 61, size=n)]).astype(np.int32)
          for n, _ in REQUESTS]


def serve(model, **kw):
  engine = Engine(model, max_batch=2, page_size=4, chunk=4, **kw)
  ids = [engine.submit(p, n) for p, (_, n) in zip(prompts(), REQUESTS)]
  results = engine.run()
  return [results[i] for i in ids], engine


def spec(x):
  """``x``'s partition spec, one entry per dimension (a jitted output drops trailing Nones)."""
  s = tuple(x.sharding.spec)
  return s + (None,) * (x.ndim - len(s))


def layers(cache):
  return [c for group in cache.groups for c in group]


@pytest.mark.parametrize("name", list(CASES))
def test_engine_on_a_mesh_equals_one_device_and_keeps_the_cache_split(name):
  preset, kw, shape, prefix, *rest = CASES[name]
  dtype = rest[0] if rest else None
  extra = rest[1] if len(rest) > 1 else {}
  model = DecoderLM(get_config(preset, **SMALL).replace(**kw), rngs=nnx.Rngs(0))
  if isinstance(extra.get("draft"), dict):
    extra = dict(extra, draft=DecoderLM(get_config(preset, **SMALL).replace(
        **dict(kw, **extra["draft"])), rngs=nnx.Rngs(1)))
  want, single = serve(model, prefix_cache=prefix, dtype=dtype, **extra)
  mesh = make_mesh(shape)
  got, engine = serve(model, prefix_cache=prefix, mesh=mesh, dtype=dtype, **extra)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)
  assert engine.mesh is mesh
  assert engine.stats.prefix_hit_tokens == single.stats.prefix_hit_tokens
  if prefix:
    assert engine.stats.prefix_hit_tokens > 0
  # The weights are split by their logical axes.
  specs = {str(x.sharding.spec) for x in jax.tree.leaves(engine._state)}
  assert any("tensor" in s for s in specs), specs
  if preset == "deepseek-v3":
    assert any("expert" in s for s in specs), specs
  # After the run (steps, frees, prefix updates), the cache is still laid out as shard() lays it.
  for c in layers(engine.cache):
    if isinstance(c, PagedKVCache):
      pools = (c.key_pool, c.value_pool)
      if dtype is not None:     # codes, and scales [P, 1, K * page] split the same way
        assert c.key_pool.dtype == dtype and c.quantized
        pools += (c.key_scale_pool, c.value_scale_pool)
      for pool in pools:
        assert spec(pool) == (None, None, "tensor")
        assert pool.addressable_shards[0].data.shape[-1] == pool.shape[-1] // 2
    else:
      assert isinstance(c, PagedLatentCache)         # latents: every head reads them
      for pool in (c.c_kv_pool, c.k_rope_pool):
        assert pool.addressable_shards[0].data.shape == pool.shape
    assert c.table.page_table.addressable_shards[0].data.shape == c.table.page_table.shape
  # The pages went back: every pool whole but the prefix cache's.
  assert int(layers(engine.cache)[0].table.num_free) == engine.num_pages - engine.cached_pages
  if engine.draft_cache is not None:        # the draft's cache: split alike (its tables: views)
    assert engine.stats.drafted > 0
    for c in layers(engine.draft_cache):
      assert spec(c.key_pool) == (None, None, "tensor")
      assert c.key_pool.addressable_shards[0].data.shape[-1] == c.key_pool.shape[-1] // 2
  if engine.mtp_cache is not None:          # the MTP module's pool: split alike
    assert engine.stats.drafted > 0
    (c,) = layers(engine.mtp_cache)
    assert spec(c.key_pool) == (None, None, "tensor")
    assert c.key_pool.addressable_shards[0].data.shape[-1] == c.key_pool.shape[-1] // 2


def test_shard_splits_pools_and_recurrent_states_over_heads():
  cfg = get_config("qwen3-next", **SMALL).replace(num_layers=4, deltanet_head_dim=8,
                                                  deltanet_v_head_dim=8, rotary_dim=4)
  model = DecoderLM(cfg, rngs=nnx.Rngs(0))
  cache = model.init_paged_cache(2, 8, 4)
  assert cache.shard() is cache                                   # no mesh: as it is

  with jax.set_mesh(make_mesh({"data": 4, "tensor": 2})):
    placed = cache.shard()
    traced = jax.jit(lambda c: c.shard())(cache)
  for c in (placed, traced):
    delta = [x for x in layers(c) if not isinstance(x, PagedKVCache)]
    attn = [x for x in layers(c) if isinstance(x, PagedKVCache)]
    assert len(delta) == 3 and len(attn) == 1
    for d in delta:
      assert spec(d.state) == (None, "tensor", None, None)                # [B, N, H, h]
      assert spec(d.conv_q) == (None, None, "tensor", None)               # [B, W, K, H]
      assert spec(d.conv_v) == (None, None, "tensor", None)
      assert d.state.addressable_shards[0].data.shape[1] == cfg.deltanet_num_heads // 2
    assert spec(attn[0].key_pool) == (None, None, "tensor")
    assert spec(c.lengths) == (None,)
    for a, b in zip(jax.tree.leaves(c), jax.tree.leaves(cache)):     # values unchanged
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  # A snapshot store for prefix caching (hybrid models): split as the slots' states, made and
  # filled on the mesh.
  with jax.set_mesh(make_mesh({"data": 4, "tensor": 2})):
    store = placed.save_states(placed.state_store(3), jnp.asarray([1]), jnp.asarray([2]))
  kept = [x for group in store for x in group if x is not None]
  assert len(kept) == 3
  for k, d in zip(kept, [x for x in layers(placed) if not isinstance(x, PagedKVCache)]):
    assert spec(k.state) == (None, "tensor", None, None) and spec(k.conv_q)[2] == "tensor"
    np.testing.assert_array_equal(np.asarray(k.state[2]), np.asarray(d.state[1]))

  # Heads that the mesh axis does not divide stay whole (2 KV heads on tensor = 4).
  with jax.set_mesh(make_mesh({"data": 2, "tensor": 4})):
    attn = [x for x in layers(cache.shard()) if isinstance(x, PagedKVCache)][0]
  assert attn.num_kv_heads == 2
  assert spec(attn.key_pool) == (None, None, None)
  assert attn.key_pool.addressable_shards[0].data.shape == attn.key_pool.shape


def test_mesh_from_the_context_and_errors():
  model = DecoderLM(get_config("llama", **SMALL).replace(num_layers=1), rngs=nnx.Rngs(0))
  mesh = make_mesh({"data": 4, "tensor": 2})
  with jax.set_mesh(mesh):
    engine = Engine(model, max_batch=2, page_size=4)
  assert engine.mesh is not None and dict(engine.mesh.shape) == dict(mesh.shape)
  assert Engine(model, max_batch=2, page_size=4).mesh is None
  with pytest.raises(ValueError, match="`mesh` must be a jax.sharding.Mesh"):
    Engine(model, mesh="tensor")
  explicit = jax.make_mesh((2, 4), ("data", "tensor"),
                           axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  with pytest.raises(ValueError, match="Explicit"):
    Engine(model, mesh=explicit)
