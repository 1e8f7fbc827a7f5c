"""LoRA (and QLoRA) on MLA's up-projections, which the absorbed path uses as matrices.

``MLA`` folds ``W_up^K`` / ``W_up^V`` into the query and output (matrix absorption) instead of
calling the layers, so an adapter on ``k_up`` / ``v_up`` must reach those matrices: the absorbed
path, the naive path, the decode path and the merged model must all compute the same function.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxattn.nn.linear import effective_kernel
from jaxattn.nn.lora import LoRA, LoRAParam, apply_lora, merge_lora
from jaxattn.nn.mla import MLA


def _mla(seed=0):
  return MLA(32, 4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
             rngs=nnx.Rngs(seed))


def _adapted(quantize=False):
  model = _mla()
  paths = apply_lora(model, r"(k_up|v_up)$", rank=2, alpha=4.0, quantize_base=quantize,
                     rngs=nnx.Rngs(1))
  assert sorted(paths) == ["k_up", "v_up"]
  for i, (_, layer) in enumerate(sorted(nnx.iter_graph(model), key=lambda kv: str(kv[0]))):
    if isinstance(layer, LoRA):  # non-zero B so that the adapters change the function
      b = layer.lora_b
      b[...] = 0.3 * jax.random.normal(jax.random.key(10 + i), b[...].shape)
  return model


@nnx.jit(static_argnames="mode")
def _run(model, x, mode):
  return model(x, mode=mode)


@nnx.jit
def _step(model, x, cache):
  return model(x, cache=cache, mode="absorbed")


def _x():
  return jax.random.normal(jax.random.key(3), (2, 5, 32), jnp.float32)


@pytest.mark.parametrize("quantize", [False, True])
def test_absorbed_naive_and_decode_agree_with_adapters_on_up_projections(quantize):
  model, base, x = _adapted(quantize), _mla(), _x()
  naive, absorbed = _run(model, x, "naive"), _run(model, x, "absorbed")
  np.testing.assert_allclose(np.asarray(absorbed), np.asarray(naive), atol=2e-5)
  # The adapters are really in the function (the absorbed path does not read the bare kernel).
  assert float(jnp.max(jnp.abs(absorbed - _run(base, x, "absorbed")))) > 1e-3
  # Token-by-token decode (absorbed, over the latent cache) == the full pass.
  cache = model.init_cache(2, 5)
  steps = []
  for t in range(5):
    y, cache = _step(model, x[:, t:t + 1], cache)
    steps.append(y)
  np.testing.assert_allclose(np.asarray(jnp.concatenate(steps, 1)), np.asarray(naive), atol=2e-5)


def test_effective_kernel_is_base_plus_delta_and_merge_keeps_the_function():
  model, x = _adapted(), _x()
  want = _run(model, x, "absorbed")
  k = model.k_up
  np.testing.assert_allclose(np.asarray(effective_kernel(k)),
                             np.asarray(k.base.kernel[...] + k.delta()), atol=1e-6)
  merge_lora(model)
  np.testing.assert_allclose(np.asarray(effective_kernel(k)), np.asarray(k.base.kernel[...]))
  np.testing.assert_allclose(np.asarray(_run(model, x, "absorbed")), np.asarray(want), atol=2e-5)
  np.testing.assert_allclose(np.asarray(_run(model, x, "naive")), np.asarray(want), atol=2e-5)


def test_absorbed_path_gradients_reach_the_adapters_and_match_naive():
  model, x = _adapted(), _x()
  graph, params, rest = nnx.split(model, LoRAParam, ...)

  def loss(p, mode):
    m = nnx.merge(graph, p, rest)
    return jnp.sum(jnp.sin(m(x, mode=mode)))

  g_abs = jax.grad(loss)(params, "absorbed")
  g_naive = jax.grad(loss)(params, "naive")
  leaves_abs, leaves_naive = jax.tree.leaves(g_abs), jax.tree.leaves(g_naive)
  assert len(leaves_abs) == 4  # A and B of k_up and v_up
  for a, n in zip(leaves_abs, leaves_naive):
    assert float(jnp.max(jnp.abs(a))) > 0
    np.testing.assert_allclose(np.asarray(a), np.asarray(n), atol=1e-4, rtol=1e-4)


def test_dsa_absorbed_path_uses_the_adapters():
  """DSA (MLA + lightning indexer) absorbs the up-projections too: with adapters on them its
  forward equals the same model with the merged kernels."""
  from jaxattn.nn.dsa import DSA  # noqa: PLC0415

  def build():
    return DSA(32, 4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
               index_num_heads=2, index_head_dim=8, index_rope_dim=4, index_topk=3,
               rngs=nnx.Rngs(0))

  model, x = build(), _x()
  apply_lora(model, r"(k_up|v_up)$", rank=2, rngs=nnx.Rngs(1))
  for layer in (model.k_up, model.v_up):
    layer.lora_b[...] = 0.3 * jax.random.normal(jax.random.key(5), layer.lora_b[...].shape)
  got = nnx.jit(lambda m, x: m(x))(model, x)
  plain = build()
  for name in ("k_up", "v_up"):
    getattr(plain, name).kernel[...] = effective_kernel(getattr(model, name))
  want = nnx.jit(lambda m, x: m(x))(plain, x)
  assert float(jnp.max(jnp.abs(want - nnx.jit(lambda m, x: m(x))(build(), x)))) > 1e-3
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)
