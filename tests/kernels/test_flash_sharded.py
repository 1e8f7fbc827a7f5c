"""Flash-attention kernels under the simulated 8-device mesh: batch and heads sharded with
``shard_map``, results and gradients equal to the unsharded formula (fp32, summation-order
tolerances as in ``test_flash_tpu.py``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxattn import sharding
from jaxattn.ops import masks as M
from jaxattn.ops.attention import dot_product_attention
from pallas_kernels.flash_attention import BlockSizes, flash_attention_gpu, flash_attention_tpu
from pallas_kernels.flash_attention.sharded import plan_specs

FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
SMALL = BlockSizes(16, 16, 16, 16)


def run(f, *args):
  return jax.jit(f).lower(*args).compile(compiler_options=FAST_COMPILE)(*args)


def inputs(b, t, n, k, h=16, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(ks[0], (b, t, n, h)), jax.random.normal(ks[1], (b, t, k, h)),
          jax.random.normal(ks[2], (b, t, k, h)))


def assert_close(got, want, tol):
  got, want = np.asarray(got), np.asarray(want)
  np.testing.assert_allclose(got, want, rtol=0, atol=tol * max(1.0, np.abs(want).max()))


def packed(b, t):
  return jnp.asarray((np.arange(t)[None, :] >= np.array([[t // 2], [5]])[:b]).astype(np.int32))


def test_sharded_forward_and_gradients_match_formula():
  mesh = sharding.make_mesh({"data": 2, "tensor": 4})
  b, t, n, kh = 2, 32, 8, 4  # 2 query heads per KV head: each tensor shard keeps whole groups
  q, k, v = inputs(b, t, n, kh)
  ids = packed(b, t)
  lengths = jnp.asarray([32, 27], jnp.int32)
  slopes = jnp.asarray(0.5 ** np.arange(1, n + 1), jnp.float32)
  kw = dict(is_causal=True, segment_ids=ids, kv_lengths=lengths, alibi_slopes=slopes)

  def loss(attn):
    def f(q, k, v):
      out = attn(q, k, v)
      return jnp.sum(out * jnp.cos(out)), out
    return jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)

  mask = M.make_mask(is_causal=True, segment_ids=ids, kv_lengths=lengths)
  kernel = loss(lambda q, k, v: flash_attention_tpu(q, k, v, mask, alibi_slopes=slopes,
                                                    block_sizes=SMALL))
  with jax.set_mesh(mesh):
    assert plan_specs(mesh, b, n, kh) == ("data", "tensor")
    jaxpr = str(jax.make_jaxpr(kernel)(q, k, v))
    assert "shard_map" in jaxpr and "pallas_call" in jaxpr
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data", None, "tensor", None)))  # noqa
    (_, out), grads = run(kernel, put(q), put(k), put(v))
  assert out.sharding.spec == P("data", None, "tensor", None)
  (_, want), want_grads = run(loss(lambda q, k, v: dot_product_attention(
      q, k, v, implementation="xla", **kw)), q, k, v)
  assert_close(out, want, 2e-5)
  for g, w in zip(grads, want_grads):
    assert_close(g, w, 1e-4)


def test_explicit_mesh_argument_and_explicit_axes_with_mqa():
  # jax.make_mesh gives Explicit axes; one KV head cannot split over "tensor": heads stay whole.
  mesh = jax.make_mesh((2, 4), ("data", "tensor"))
  b, t, n, kh = 2, 24, 4, 1
  q, k, v = inputs(b, t, n, kh, seed=1)
  assert plan_specs(mesh, b, n, kh) == ("data", None)
  out = flash_attention_tpu(q, k, v, M.sliding_window(6), block_sizes=SMALL, mesh=mesh)
  want = dot_product_attention(q, k, v, local_window_size=6, is_causal=True, implementation="xla")
  assert_close(out, want, 2e-5)
  with jax.set_mesh(mesh):
    out = run(lambda q, k, v: dot_product_attention(q, k, v, is_causal=True,
                                                    implementation="pallas_tpu"), q, k, v)
  want = dot_product_attention(q, k, v, is_causal=True, implementation="xla")
  assert_close(out, want, 2e-5)


@pytest.mark.parametrize("kernel", [flash_attention_tpu, flash_attention_gpu])
def test_numpy_and_list_slopes_are_split_with_the_heads(kernel):
  """A NumPy array was closed over whole: every head shard but the first read the first shard's
  ALiBi slopes (a list failed with an AttributeError)."""
  mesh = sharding.make_mesh({"data": 2, "tensor": 4})
  q, k, v = inputs(2, 16, 4, 4, seed=3)
  slopes = 0.5 ** np.arange(1, 5, dtype=np.float32)
  want = dot_product_attention(q, k, v, alibi_slopes=jnp.asarray(slopes), implementation="xla")
  with jax.set_mesh(mesh):
    for given in (slopes, slopes.tolist()):
      assert_close(kernel(q, k, v, None, alibi_slopes=given, block_sizes=SMALL), want, 2e-5)


def test_gpu_kernel_sharded():
  mesh = sharding.make_mesh({"data": 2, "tensor": 4})
  q, k, v = inputs(2, 32, 4, 4, seed=2)
  with jax.set_mesh(mesh):
    out = run(lambda q, k, v: flash_attention_gpu(q, k, v, M.CausalMask(), block_sizes=SMALL),
              q, k, v)
  want = dot_product_attention(q, k, v, is_causal=True, implementation="xla")
  assert_close(out, want, 2e-5)


def test_inside_a_users_shard_map_runs_on_local_shards():
  """Called where every mesh axis is already manual, the kernel runs on the local arrays."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  q, k, v = inputs(8, 16, 2, 2, seed=3)

  @jax.shard_map(mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False)
  def per_device(q, k, v):
    return flash_attention_tpu(q, k, v, M.CausalMask(), block_sizes=SMALL)

  with jax.set_mesh(mesh):
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data")))  # noqa: E731
    out = per_device(put(q), put(k), put(v))
  want = dot_product_attention(q, k, v, is_causal=True, implementation="xla")
  assert_close(out, want, 2e-5)


@pytest.mark.parametrize("shape,expected", [((8, 8, 8), (("data", "fsdp"), "tensor")),
                                            ((3, 8, 8), (None, "tensor")),
                                            ((8, 8, 1), (("data", "fsdp"), None))])
def test_plan_specs_split_only_what_divides(shape, expected):
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  assert plan_specs(mesh, *shape) == expected
