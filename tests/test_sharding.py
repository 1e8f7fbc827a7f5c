"""Sharding on a simulated 8-device CPU mesh: rules place parameters, results equal one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxattn import sharding
from jaxattn.nn.block import TransformerBlock


def _block():
  return TransformerBlock(64, num_heads=8, mlp_dim=128, num_kv_heads=4, rngs=nnx.Rngs(0))


def test_eight_devices_are_simulated():
  assert jax.device_count() == 8


def test_logical_to_spec_rules():
  mesh = sharding.make_mesh({"fsdp": 2, "tensor": 4})
  assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "context": 1, "tensor": 4, "expert": 1}
  assert sharding.logical_to_spec(("embed", "heads", "head_dim"), mesh=mesh) == P("fsdp", "tensor", None)
  # Batch over (data, fsdp): data has size 1 here, so only fsdp remains.
  assert sharding.logical_to_spec(("batch", "length", "act_embed"), mesh=mesh) == P("fsdp", None, None)
  # Two KV heads cannot split four ways: replicated rather than an error at device_put.
  assert sharding.logical_to_spec(("embed", "kv_heads"), mesh=mesh, shape=(64, 2)) == P("fsdp", None)
  # A batch that (data, fsdp) does not divide keeps the axes that do (it was replicated whole).
  wide = sharding.make_mesh({"data": 2, "fsdp": 4})
  spec = lambda b: sharding.logical_to_spec(("batch", "length"), mesh=wide, shape=(b, 16))  # noqa
  assert (spec(8), spec(4), spec(2), spec(3)) == (P(("data", "fsdp"), None), P("data", None),
                                                  P("data", None), P(None, None))
  with pytest.raises(ValueError, match="unknown logical axis"):
    sharding.logical_to_spec(("embedding",))
  with pytest.raises(ValueError, match="needs 16 devices"):
    sharding.make_mesh({"data": 2, "tensor": 8})
  with pytest.raises(ValueError, match="unknown axes"):
    sharding.make_mesh({"model": 2})
  # The sequence splits over `context` (context parallelism), absent or of size 1 elsewhere.
  cp = sharding.make_mesh({"data": 2, "context": 4})
  assert (sharding.logical_to_spec(("batch", "length", "act_embed"), mesh=cp)
          == P("data", "context", None))


def test_shard_is_a_noop_without_mesh():
  x = jnp.ones((2, 3, 4))
  assert sharding.shard(x, ("batch", "length", "act_embed")) is x


def test_explicit_meshes_reshard_in_shard_and_are_refused_by_the_model():
  """``jax.make_mesh`` gives Explicit axes, where a sharding constraint only asserts: ``shard``
  reshards there (it failed whenever the sharding differed); the model, whose einsums need
  Auto axes, refuses such a mesh by name (a ShardingTypeError deep in a layer before)."""
  from jaxattn.configs import get_config
  from jaxattn.nn.model import DecoderLM
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"))
  assert sharding.is_explicit(mesh) and not sharding.is_explicit(sharding.make_mesh())
  x = jnp.arange(8 * 3 * 8, dtype=jnp.float32).reshape(8, 3, 8)
  with jax.set_mesh(mesh):
    y = jax.jit(lambda x: sharding.shard(x * 2, ("batch", "length", "act_embed")))(x)
  assert y.sharding.spec == P(("data", "fsdp"), None, None)
  np.testing.assert_array_equal(np.asarray(y), 2 * np.asarray(x))
  model = DecoderLM(get_config("llama", embed_dim=32, mlp_dim=64, num_layers=1, vocab_size=64),
                    rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="shard_module: the mesh has Explicit axes"):
    sharding.shard_module(model, mesh)
  with jax.set_mesh(mesh), pytest.raises(ValueError, match="DecoderLM: the mesh has Explicit"):
    model(jnp.zeros((2, 4), jnp.int32))


def test_chunked_attention_runs_on_an_explicit_mesh():
  """The XLA chunked path (the CPU fallback for a bias or mask array) under Explicit axes: its
  block loops start from unsharded buffers, a TypeError with sharded inputs; it runs under Auto
  axes now, forward and gradients equal to one device, the output sharded as the query."""
  from jaxattn.ops.attention import dot_product_attention
  ks = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(ks[0], (4, 40, 4, 8))
  k, v = (jax.random.normal(x, (4, 40, 2, 8)) for x in ks[1:3])
  bias = jax.random.normal(ks[3], (1, 4, 40, 40))

  def loss(q, k, v):
    out = dot_product_attention(q, k, v, bias, is_causal=True, implementation="xla_chunked")
    return jnp.sum(out * jnp.cos(out)), out

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
  (_, want), want_grads = step(q, k, v)
  mesh = jax.make_mesh((4, 2), ("data", "tensor"))
  put = lambda x: jax.device_put(x, jax.NamedSharding(mesh, P("data", None, "tensor")))  # noqa
  with jax.set_mesh(mesh):
    (_, out), grads = step(put(q), put(k), put(v))
  assert out.sharding.spec[:3] == ("data", None, "tensor")
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-6)
  for g, w in zip(grads, want_grads):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5)


def test_shard_places_a_concrete_array_when_called_eagerly():
  """Outside jit a sharding constraint needs its input on the mesh already; a layer called eagerly
  under `jax.set_mesh` with a single-device input (a MoE layer, say) used to raise a TypeError."""
  from jaxattn.nn.moe import MoE
  mesh = sharding.make_mesh({"data": 2, "expert": 4})
  x = jnp.arange(4 * 3 * 8, dtype=jnp.float32).reshape(4, 3, 8)
  with jax.set_mesh(mesh):
    y = sharding.shard(x, ("batch", "length", "act_embed"))
  assert y.sharding.spec == P("data", None, None) and y.sharding.mesh.shape == mesh.shape
  np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
  layer = MoE(8, 8, 2, 12, rngs=nnx.Rngs(0))
  xm = jax.random.normal(jax.random.key(0), (2, 4, 8))
  want, _ = nnx.jit(lambda m, x: m(x))(layer, xm)    # the reference need not be eager
  with jax.set_mesh(mesh):
    got, _ = layer(xm)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


def test_sharded_forward_equals_single_device_and_params_are_sharded():
  x = jax.random.normal(jax.random.key(1), (4, 16, 64))
  ref_block = _block()
  want = ref_block(x)

  mesh = sharding.make_mesh({"fsdp": 2, "tensor": 4})
  block = _block()
  with jax.set_mesh(mesh):
    sharding.shard_module(block, mesh)
    # Parameters are placed as the rules say.
    q = block.attn.q_proj.kernel[...]
    assert q.sharding.spec == P("fsdp", "tensor", None)
    assert q.addressable_shards[0].data.shape == (32, 2, 8)
    assert block.mlp.down.kernel[...].sharding.spec == P("tensor", "fsdp")
    assert block.attn.k_proj.kernel[...].sharding.spec == P("fsdp", "tensor", None)
    assert block.attn_norm.scale[...].sharding.spec == P(None)

    @nnx.jit
    def fwd(m, x):
      return m(x)

    xs = jax.device_put(x, jax.NamedSharding(mesh, P(("data", "fsdp"), None, None)))
    got = fwd(block, xs)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
  assert got.sharding.spec[0] in ("fsdp", ("data", "fsdp"))


def test_param_specs_tree_matches_state():
  block = _block()
  specs = sharding.param_specs(nnx.state(block))
  flat = dict(nnx.to_flat_state(specs)) if hasattr(nnx, "to_flat_state") else None
  assert flat is not None
  assert flat[("attn", "o_proj", "kernel")] == P("tensor", None, "fsdp")


def test_split_axis_keeps_merged_heads_whole():
  """``split_axis`` splits one dimension by its units: a ``[..., K * H]`` row by its K heads."""
  x = jnp.arange(3 * 4 * 6, dtype=jnp.float32).reshape(3, 4, 6)      # K = 2 heads of H = 3
  assert sharding.split_axis(x, -1, "kv_heads", 2) is x               # no mesh: unchanged
  with jax.set_mesh(sharding.make_mesh({"data": 4, "tensor": 2})):
    heads = sharding.split_axis(x, -1, "kv_heads", 2)
    odd = sharding.split_axis(x, -1, "kv_heads", 3)       # 3 units on tensor = 2: replicated
    whole = sharding.split_axis(x, None)
    with pytest.raises(ValueError, match="`count` 4 must divide dimension 2"):
      sharding.split_axis(x, -1, "kv_heads", 4)
  assert heads.sharding.spec == P(None, None, "tensor")
  assert heads.addressable_shards[0].data.shape == (3, 4, 3)          # one whole head each
  first = heads.addressable_shards[0].data
  np.testing.assert_array_equal(np.asarray(first), np.asarray(x)[..., :3])
  for y in (odd, whole):
    assert all(s is None for s in y.sharding.spec) and len(y.sharding.device_set) == 8
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
