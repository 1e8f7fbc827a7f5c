"""LoRA on a MoE's routed experts (``ExpertLoRA``): per-expert adapters on ``w_gate`` / ``w_up`` /
``w_down``, targeted by path through ``apply_lora``.

Contracts: at init the model is unchanged (B = 0); with B set, the MoE equals a MoE whose expert
weights are ``W_e + scaling * A_e B_e`` (the formula, built independently); only the adapters train;
merge / unmerge are exact and unload leaves the merged function; parameter counts; a scanned
DeepSeek-style model (stacked ``[L, E, ...]`` experts) takes them through ``nnx.scan``; errors.
"""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxattn.configs import get_config
from jaxattn.nn.lora import (ExpertLoRA, LoRAParam, apply_lora, count_parameters,
                             expert_lora_layers, lora_optimizer, make_train_step, merge_lora,
                             unload_lora, unmerge_lora)
from jaxattn.nn.model import DecoderLM
from jaxattn.nn.moe import MoE

D, E, F = 16, 4, 24


class Holder(nnx.Module):
  def __init__(self, rngs):
    self.ffn = MoE(D, E, 2, F, num_shared_experts=1, rngs=rngs)

  def __call__(self, x):
    return self.ffn(x)[0]


def _x(seed=0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal((2, 7, D)), jnp.float32)


def _randomize_b(model, scale=0.2, seed=1):
  rng = np.random.default_rng(seed)
  for _, a in expert_lora_layers(model):
    a.lora_b[...] = jnp.asarray(rng.standard_normal(a.lora_b[...].shape) * scale, jnp.float32)


def test_init_identity_and_formula():
  model = Holder(nnx.Rngs(0))
  x = _x()
  base = model(x)
  paths = apply_lora(model, r"ffn/w_(gate|up|down)$", rank=3, alpha=6.0, rngs=nnx.Rngs(1))
  assert paths == ["ffn/w_gate", "ffn/w_up", "ffn/w_down"]
  adapters = dict(expert_lora_layers(model))
  assert adapters["ffn/w_gate"].lora_a[...].shape == (E, D, 3)
  assert adapters["ffn/w_down"].lora_b[...].shape == (E, 3, D)
  np.testing.assert_array_equal(model(x), base)  # B = 0
  _randomize_b(model)
  got = model(x)
  assert float(jnp.max(jnp.abs(got - base))) > 1e-3

  # The formula on an independent copy: expert e's kernel W_e + (alpha / r) A_e B_e.
  ref = Holder(nnx.Rngs(0))
  for name in ("w_gate", "w_up", "w_down"):
    a, b = adapters[f"ffn/{name}"].lora_a[...], adapters[f"ffn/{name}"].lora_b[...]
    w = getattr(ref.ffn, name)
    w[...] = w[...] + 2.0 * np.einsum("eir,ero->eio", np.asarray(a), np.asarray(b))
  np.testing.assert_allclose(got, ref(x), atol=1e-5)


def test_only_expert_adapters_train_and_counts():
  model = Holder(nnx.Rngs(0))
  apply_lora(model, r"w_(gate|up)$", rank=2, rngs=nnx.Rngs(1))
  counts = count_parameters(model)
  assert counts.trainable == 2 * (E * D * 2 + E * 2 * F)
  frozen_before = {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
                   if not isinstance(v, LoRAParam)}
  opt = lora_optimizer(model, optax.adam(1e-2))
  x, y = _x(1), _x(2)
  step = make_train_step(lambda m, x, y: jnp.mean((m(x) - y) ** 2))
  losses = [float(step(model, opt, x, y)) for _ in range(5)]
  assert losses[-1] < losses[0]
  for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    if k in frozen_before:
      np.testing.assert_array_equal(np.asarray(v), frozen_before[k])
  assert any(float(jnp.max(jnp.abs(a.lora_b[...]))) > 0 for _, a in expert_lora_layers(model))


def test_merge_unmerge_unload():
  model = Holder(nnx.Rngs(0))
  x = _x()
  w0 = np.asarray(model.ffn.w_down[...])
  apply_lora(model, r"ffn/w_down$", rank=2, rngs=nnx.Rngs(1))
  _randomize_b(model)
  adapted = model(x)
  merge_lora(model)
  assert model.ffn.w_down_lora.merged
  np.testing.assert_allclose(model(x), adapted, atol=1e-5)
  unmerge_lora(model)
  np.testing.assert_allclose(np.asarray(model.ffn.w_down[...]), w0, atol=1e-6)
  np.testing.assert_allclose(model(x), adapted, atol=1e-5)
  unload_lora(model)
  assert model.ffn.w_down_lora is None and not expert_lora_layers(model)
  np.testing.assert_allclose(model(x), adapted, atol=1e-5)
  assert count_parameters(model).trainable == 0


def test_scanned_deepseek_experts():
  """Stacked experts ``[L, E, D, F]`` get stacked adapters ``[L, E, D, r]`` that ``nnx.scan``
  slices per layer; with B set, the model equals the same model with merged kernels."""
  cfg = get_config("deepseek-v3", "tiny", scan_layers=True, num_layers=3)
  model = DecoderLM(cfg, rngs=nnx.Rngs(0))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12)), jnp.int32)
  base = model(tokens)
  paths = apply_lora(model, r"ffn/w_(gate|down)$", rank=2, rngs=nnx.Rngs(1))
  assert paths and all(p.endswith(("w_gate", "w_down")) for p in paths)
  layers = expert_lora_layers(model)
  assert layers and all(a.lora_a[...].ndim == 4 for _, a in layers)  # [L, E, in, r]
  np.testing.assert_allclose(model(tokens), base, atol=1e-5)
  _randomize_b(model, scale=0.05)
  adapted = model(tokens)
  assert float(jnp.max(jnp.abs(adapted - base))) > 1e-4
  merge_lora(model)
  np.testing.assert_allclose(model(tokens), adapted, atol=2e-4)


def test_errors():
  model = Holder(nnx.Rngs(0))
  with pytest.raises(ValueError, match="no NF4 base"):
    apply_lora(model, r"w_up$", quantize_base=True, rngs=nnx.Rngs(1))
  with pytest.raises(ValueError, match="dropout"):
    apply_lora(model, r"w_up$", dropout=0.1, rngs=nnx.Rngs(1))
  with pytest.raises(ValueError, match="match no"):
    apply_lora(model, r"w_nothing$", rngs=nnx.Rngs(1))
  with pytest.raises(ValueError, match=r"\[\.\.\., E, in, out\]"):
    ExpertLoRA(nnx.Param(jnp.zeros((3, 4))), rngs=nnx.Rngs(0))
