"""LoRA / QLoRA on scanned models: stacked adapters == per-layer adapters of the unrolled model.

``DecoderLM(scan_layers=True)`` stores each layer's kernels stacked ``[L, ...]`` and runs them with
``nnx.scan``; ``apply_lora`` gives it stacked adapters.  The reference is the same model unrolled,
with the same weights and adapters copied layer by layer into the stack (QLoRA: plain LoRA on the
dequantized stack, and each layer's code against ``quantize_nf4`` of that layer alone).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxattn import sharding
from jaxattn.configs import get_config
from jaxattn.nn.linear import Einsum
from jaxattn.nn.lora import (LoRA, LoRAParam, NF4Einsum, NF4Weight, apply_lora, count_parameters,
                             lora_layers, lora_optimizer, make_train_step, merge_lora, unload_lora,
                             unmerge_lora)
from jaxattn.nn.model import DecoderLM
from jaxattn.ops.nf4 import dequantize_nf4, quantize_nf4

RANK = 2
TARGETS = r"mixer/(q|v|o)_proj$|ffn/down$"


def _config(pattern="A", **kw):
  extra = dict(sliding_window=3) if "S" in pattern else {}
  return get_config("llama", embed_dim=32, mlp_dim=64, num_heads=4, num_kv_heads=2,
                    max_seq_len=32, num_layers=4, layer_pattern=pattern, **extra, **kw)


def _tokens(cfg, shape=(2, 8), seed=1):
  return jax.random.randint(jax.random.key(seed), shape, 0, cfg.vocab_size)


def _stack_layers(unrolled_pure, period, count):
  """The unrolled model's pure state in the scanned model's layout (layer c * period + j is slice
  c of unit position j)."""
  layers = unrolled_pure["groups"][0]["unit"]["layers"]
  out = {k: v for k, v in unrolled_pure.items() if k != "groups"}
  out["groups"] = {0: {"units": {"layers": {
      j: jax.tree.map(lambda *xs: jnp.stack(xs), *[layers[c * period + j] for c in range(count)])
      for j in range(period)}}}}
  return out


@functools.lru_cache(maxsize=None)
def _base_unrolled(pattern):
  # Building a model runs its initializers op by op (seconds on a CPU): build once, clone per test.
  # "S" and "A" layers have the same parameters, so other patterns reuse the "A" model's values.
  if pattern == "A":
    return DecoderLM(_config(pattern), rngs=nnx.Rngs(0))
  model = nnx.eval_shape(lambda: DecoderLM(_config(pattern), rngs=nnx.Rngs(0)))
  nnx.update(model, nnx.state(_base_unrolled("A")))
  return model


def _unrolled(pattern="A"):
  return nnx.clone(_base_unrolled(pattern))


def _scanned(pattern="A", *, remat="none"):
  """The scanned model holding the unrolled base model's weights (built abstractly, then filled)."""
  cfg = _config(pattern, scan_layers=True, remat=remat)
  scanned = nnx.eval_shape(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0)))
  _copy_unrolled_into_scanned(_base_unrolled(pattern), scanned)
  return scanned


def _copy_unrolled_into_scanned(unrolled, scanned):
  """Every variable (base weights, adapters) of ``unrolled`` into the stacks of ``scanned``."""
  period = len(scanned.config.layer_pattern)
  count = scanned.config.num_layers // period
  s_state = nnx.state(scanned)
  nnx.replace_by_pure_dict(s_state, _stack_layers(nnx.to_pure_dict(nnx.state(unrolled)), period,
                                                  count))
  nnx.update(scanned, s_state)


def _randomize_b(model, scale=0.2, seed=3):
  rng = np.random.default_rng(seed)
  for _, layer in lora_layers(model):
    layer.lora_b[...] = jnp.asarray(rng.standard_normal(layer.lora_b[...].shape) * scale,
                                    jnp.float32)


def _pair(pattern="A", *, remat="none", targets=TARGETS):
  """An unrolled model with random (trained-like) adapters and a scanned copy of it."""
  cfg = _config(pattern)
  unrolled, scanned = _unrolled(pattern), _scanned(pattern, remat=remat)   # same base weights
  apply_lora(unrolled, targets, rank=RANK, alpha=4.0, rngs=nnx.Rngs(1))
  apply_lora(scanned, targets, rank=RANK, alpha=4.0, rngs=nnx.Rngs(2))
  _randomize_b(unrolled)
  return cfg, unrolled, scanned


def _loss(model, tokens):
  return _loss_from(model(tokens), tokens)


def _loss_and_logits(model, tokens):
  logits = model(tokens)
  return _loss_from(logits, tokens), logits


def _loss_from(logits, tokens):
  return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), tokens[:, 1:, None], -1))


# One compiled function per model structure, shared by the tests: ((loss, logits), adapter grads).
_grad = nnx.jit(nnx.value_and_grad(_loss_and_logits, argnums=nnx.DiffState(0, LoRAParam),
                                   has_aux=True))


@nnx.jit
def _logits(model, tokens):
  return model(tokens)


def _assert_stacked_grads_equal(g_scanned, g_unrolled, period, count, n_adapters):
  """Slice ``c`` of each stacked gradient == the gradient of unrolled layer ``c * period + j``."""
  want = nnx.traversals.flatten_mapping(_stack_layers(nnx.to_pure_dict(g_unrolled), period, count))
  got = nnx.traversals.flatten_mapping(nnx.to_pure_dict(g_scanned))
  assert sorted(got) == sorted(want) and len(got) == 2 * n_adapters * period
  for key in want:
    assert got[key].shape[0] == count
    np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-6, err_msg=str(key))
  assert all(np.abs(v).max() > 0 for v in got.values())


def test_stacked_adapters_have_the_stack_axis_and_independent_kaiming_init():
  cfg = _config(scan_layers=True)
  model = _scanned()
  tokens = _tokens(cfg)
  want = _logits(model, tokens)
  paths = apply_lora(model, TARGETS, rank=RANK, rngs=nnx.Rngs(1))
  prefix = "groups/0/units/layers/0/"
  assert paths == [prefix + p for p in ("ffn/down", "mixer/o_proj", "mixer/q_proj", "mixer/v_proj")]
  q = model.groups[0].units.layers[0].mixer.q_proj
  o = model.groups[0].units.layers[0].mixer.o_proj
  assert isinstance(q, LoRA) and q.stack_shape == (4,)
  assert q.lora_a[...].shape == (4, 32, RANK) and q.lora_b[...].shape == (4, RANK, 4, 8)
  assert o.lora_a[...].shape == (4, 4, 8, RANK) and o.lora_b[...].shape == (4, RANK, 32)
  assert q.lora_a.get_metadata()["logical_axes"] == ("layers", "embed", None)
  assert q.lora_b.get_metadata()["logical_axes"] == ("layers", None, "heads", "head_dim")
  mesh = sharding.make_mesh({"fsdp": 2, "tensor": 4})
  specs = dict(nnx.to_flat_state(sharding.param_specs(nnx.state(q), mesh=mesh)))
  assert specs[("lora_b",)] == jax.sharding.PartitionSpec(None, None, "tensor", None)
  for _, layer in lora_layers(model):
    a = np.asarray(layer.lora_a[...])
    np.testing.assert_array_equal(layer.lora_b[...], 0.0)
    bound = 1 / np.sqrt(np.prod(a.shape[1:-1]))                 # fan_in of ONE layer
    for l in range(4):
      assert np.abs(a[l]).max() <= bound and np.abs(a[l]).max() > 0.5 * bound
    # one draw per layer: no two slices alike
    assert all(not np.allclose(a[i], a[j]) for i in range(4) for j in range(i + 1, 4))
  # B = 0: the adapted scanned model computes the base model
  np.testing.assert_array_equal(_logits(model, tokens), want)


@pytest.mark.parametrize("pattern,remat", [("A", "none"), ("SA", "full")])
def test_scanned_lora_equals_unrolled_lora_in_values_and_adapter_gradients(pattern, remat):
  cfg, unrolled, scanned = _pair(pattern, remat=remat)
  _copy_unrolled_into_scanned(unrolled, scanned)          # the adapters too, layer by layer
  tokens = _tokens(cfg)
  ((l0, y0), g0), ((l1, y1), g1) = _grad(unrolled, tokens), _grad(scanned, tokens)
  np.testing.assert_allclose(y1, y0, atol=2e-5, rtol=1e-5)
  np.testing.assert_allclose(l1, l0, rtol=1e-5)
  # Stacked gradients, slice by slice, equal the per-layer gradients.
  p = len(pattern)
  _assert_stacked_grads_equal(g1, g0, p, cfg.num_layers // p, n_adapters=4)
  # Each scan step uses its own slice: changing layer 1's adapter alone changes the output.
  q = scanned.groups[0].units.layers[p - 1].mixer.q_proj
  q.lora_b[...] = q.lora_b[...].at[1].add(0.5)
  assert np.abs(_grad(scanned, tokens)[0][1] - y1).max() > 1e-3


def test_merge_unmerge_and_unload_on_stacked_layers():
  cfg, unrolled, scanned = _pair("A")
  _copy_unrolled_into_scanned(unrolled, scanned)
  tokens = _tokens(cfg)
  adapted = np.asarray(_logits(scanned, tokens))
  kernels = {p: np.asarray(l.base.kernel[...]) for p, l in lora_layers(scanned)}
  merge_lora(unrolled)
  merge_lora(scanned)
  assert all(l.merged for _, l in lora_layers(scanned))
  np.testing.assert_allclose(_logits(scanned, tokens), adapted, atol=2e-5, rtol=1e-5)
  # the vmapped update: slice l of the merged stack == the merged kernel of unrolled layer l
  s_layer = scanned.groups[0].units.layers[0]
  for l in range(4):
    u_layer = unrolled.groups[0].unit.layers[l]
    for name in ("q_proj", "o_proj"):
      np.testing.assert_allclose(getattr(s_layer.mixer, name).base.kernel[...][l],
                                 getattr(u_layer.mixer, name).base.kernel[...], atol=1e-6)
  unmerge_lora(scanned)
  for p, l in lora_layers(scanned):
    np.testing.assert_allclose(l.base.kernel[...], kernels[p], rtol=0, atol=5e-7)
  np.testing.assert_allclose(_logits(scanned, tokens), adapted, atol=2e-5, rtol=1e-5)
  unload_lora(scanned, merge=True)
  assert not lora_layers(scanned)
  q = scanned.groups[0].units.layers[0].mixer.q_proj
  assert isinstance(q, Einsum) and q.kernel[...].shape == (4, 32, 4, 8)
  np.testing.assert_allclose(_logits(scanned, tokens), adapted, atol=2e-5, rtol=1e-5)


def test_training_a_scanned_rematerialized_model_moves_only_the_stacked_adapters():
  cfg = _config(scan_layers=True, remat="full")
  model = _scanned(remat="full")
  n_base = sum(np.size(v) for v in jax.tree.leaves(nnx.state(model, nnx.Param)))
  apply_lora(model, TARGETS, rank=RANK, alpha=4.0, rngs=nnx.Rngs(1))
  counts = count_parameters(model)
  # per layer: q [32, r] + [r, 4, 8]; v [32, r] + [r, 2, 8]; o [4, 8, r] + [r, 32];
  # down [64, r] + [r, 32]
  per_layer = RANK * ((32 + 32) + (32 + 16) + (32 + 32) + (64 + 32))
  assert counts.trainable == 4 * per_layer and counts.frozen == n_base
  opt = lora_optimizer(model, optax.adam(1e-2))
  assert sum(np.size(v) for v in jax.tree.leaves(opt.opt_state[0].mu)) == counts.trainable
  frozen_before = jax.tree.map(np.asarray, nnx.state(model, nnx.Not(LoRAParam)))
  lora_before = jax.tree.map(np.asarray, nnx.state(model, LoRAParam))
  step = make_train_step(_loss)
  tokens = _tokens(cfg, (4, 12))
  losses = [float(step(model, opt, tokens)) for _ in range(6)]
  assert losses[-1] < losses[0] - 1e-3, losses
  for a, b in zip(jax.tree.leaves(frozen_before),
                  jax.tree.leaves(nnx.state(model, nnx.Not(LoRAParam)))):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(jax.tree.leaves(lora_before), jax.tree.leaves(nnx.state(model, LoRAParam))):
    assert all(not np.array_equal(a[l], b[l]) for l in range(4))   # every layer's slice moved


def test_scanned_qlora_quantizes_each_layer_and_equals_lora_on_the_dequantized_stack():
  cfg = _config()
  targets = r"mixer/q_proj$|ffn/(up|down)$"
  model, ref = _scanned(), _scanned()
  dense_up = np.asarray(model.groups[0].units.layers[0].ffn.up.kernel[...])
  apply_lora(model, targets, rank=RANK, alpha=4.0, quantize_base=True, rngs=nnx.Rngs(1))
  _randomize_b(model)
  up = model.groups[0].units.layers[0].ffn.up
  assert isinstance(up.base, NF4Einsum) and up.base.stack_shape == (4,)
  assert up.base.kernel_shape == (32, 64) and up.base.packed[...].shape == (4, 32 * 64 // 2)
  # Each layer is quantized on its own (its own block scales and double quantization).
  stacked_w = np.asarray(up.base.dequantized_kernel())
  assert stacked_w.shape == (4, 32, 64)
  for l in range(4):
    q = quantize_nf4(jnp.asarray(dense_up[l]))
    np.testing.assert_array_equal(up.base.packed[...][l], q.packed)
    np.testing.assert_array_equal(up.base.absmax_offset[...][l], q.absmax_offset)
    np.testing.assert_array_equal(stacked_w[l], dequantize_nf4(q, (32, 64)))
  counts = count_parameters(model)
  assert counts.trainable == 4 * RANK * ((32 + 32) + (32 + 64) + (64 + 32))
  assert counts.frozen == sum(np.size(v) for v in jax.tree.leaves(nnx.state(_base_unrolled("A"),
                                                                            nnx.Param)))
  with pytest.raises(ValueError, match="NF4"):
    up.merge()
  # Reference: plain LoRA on the dequantized stacks, with the same adapters.
  apply_lora(ref, targets, rank=RANK, alpha=4.0, rngs=nnx.Rngs(2))
  for (_, q_layer), (_, r_layer) in zip(lora_layers(model), lora_layers(ref)):
    r_layer.base.kernel[...] = q_layer.base.dequantized_kernel()
    r_layer.lora_a[...], r_layer.lora_b[...] = q_layer.lora_a[...], q_layer.lora_b[...]
  tokens = _tokens(cfg)
  nf4_before = jax.tree.map(np.asarray, nnx.state(model, NF4Weight))
  ((l0, y0), g0), ((l1, y1), g1) = _grad(ref, tokens), _grad(model, tokens)
  np.testing.assert_allclose(y1, y0, atol=2e-5, rtol=1e-5)
  np.testing.assert_allclose(l1, l0, rtol=1e-5)
  want, got = (nnx.traversals.flatten_mapping(nnx.to_pure_dict(g)) for g in (g0, g1))
  assert sorted(got) == sorted(want) and len(got) == 2 * 3
  for key in want:
    assert got[key].shape[0] == 4 and np.abs(got[key]).max() > 0
    np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-6, err_msg=str(key))
  for a, b in zip(jax.tree.leaves(nf4_before), jax.tree.leaves(nnx.state(model, NF4Weight))):
    np.testing.assert_array_equal(a, b)
  # Unloading: dense stacked kernels dequantize(W0) + s A B, the same function.
  unload_lora(model, merge=True)
  dense = model.groups[0].units.layers[0].ffn.up
  assert isinstance(dense, Einsum) and dense.kernel[...].shape == (4, 32, 64)
  assert dense.kernel.get_metadata()["logical_axes"] == ("layers", "embed", "mlp")
  np.testing.assert_allclose(_logits(model, tokens), y1, atol=2e-5, rtol=1e-5)


def test_dropout_on_stacked_adapters_draws_per_layer():
  cfg = _config(scan_layers=True)
  model = _scanned()
  apply_lora(model, r"mixer/q_proj$", rank=RANK, dropout=0.5, rngs=nnx.Rngs(1))
  _randomize_b(model, scale=1.0)
  q = model.groups[0].units.layers[0].mixer.q_proj
  keys = jax.random.key_data(q.dropout.rngs.key[...])
  assert keys.shape[0] == 4 and len({tuple(np.ravel(k)) for k in np.asarray(keys)}) == 4
  tokens = _tokens(cfg)
  y1, y2 = _logits(model, tokens), _logits(model, tokens)
  assert np.abs(y1 - y2).max() > 1e-4                   # a new mask per call while training
  model.eval()
  e1, e2 = _logits(model, tokens), _logits(model, tokens)
  np.testing.assert_array_equal(e1, e2)


def test_errors_on_stacked_layers():
  model = _scanned()
  apply_lora(model, r"mixer/q_proj$|ffn/up$", rank=RANK, rngs=nnx.Rngs(1))
  apply_lora(model, r"ffn/down$", rank=RANK, quantize_base=True, rngs=nnx.Rngs(1))
  x = jnp.ones((1, 3, 32))
  with pytest.raises(ValueError, match=r"stacked over leading axes of shape \(4,\).*nnx.scan"):
    model.groups[0].units.layers[0].mixer.q_proj(x)
  with pytest.raises(ValueError, match=r"NF4Einsum holds layers stacked"):
    model.groups[0].units.layers[0].ffn.down.base(jnp.ones((1, 3, 64)))
  with pytest.raises(ValueError, match="NF4"):
    merge_lora(model)
  # a kernel with fewer axes than its spec's kernel term
  with pytest.raises(ValueError, match="fewer axes"):
    NF4Einsum("BTD,DNH->BTNH", jnp.ones((8, 4)))
  bad = Einsum("BTD,DF->BTF", (8, 4), ("embed", "mlp"), rngs=nnx.Rngs(0))
  bad.kernel = nnx.Param(jnp.ones((8,)), logical_axes=("embed",))
  with pytest.raises(ValueError, match="fewer axes"):
    LoRA(bad, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="spec"):
    NF4Einsum("BTD->BTF", jnp.ones((8, 4)))


def test_full_size_scanned_qlora_builds_abstractly_with_the_expected_counts():
  # Llama-3-8B (scanned, remat) with QLoRA r = 16 on the attention projections, never allocated.
  cfg = get_config("llama", size="full")
  assert cfg.scan_layers

  def build():
    model = DecoderLM(cfg, rngs=nnx.Rngs(0))
    apply_lora(model, r"mixer/(q|k|v|o)_proj$", rank=16, alpha=32, quantize_base=True,
               rngs=nnx.Rngs(1))
    return model

  model = nnx.eval_shape(build)
  d, kv = 4096, 8 * 128
  assert count_parameters(model).trainable == 32 * 16 * ((d + d) + 2 * (d + kv) + (d + d))
  q = model.groups[0].units.layers[0].mixer.q_proj
  assert q.lora_a.shape == (32, d, 16) and q.lora_b.shape == (32, 16, 32, 128)
  assert q.base.packed.shape == (32, d * d // 2) and q.base.kernel_shape == (d, 32, 128)
