"""LoRA layers against peft's LoRA ``Linear`` (PyTorch, CPU) on copied weights.

Forward (alpha / r and rsLoRA scaling, with a bias), gradients of A and B, the merged weight of
``merge_and_unload``, and the initialization (B = 0, A uniform within 1 / sqrt(fan_in)).
Tolerances: fp32 matmuls of width <= 64 accumulate ~1e-6 relative error on either side.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxattn.nn.linear import Einsum
from jaxattn.nn.lora import LoRA, apply_lora, lora_layers, merge_lora

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.hf

IN, OUT, R = 48, 40, 8


class _TorchNet(torch.nn.Module):
  def __init__(self):
    super().__init__()
    self.proj = torch.nn.Linear(IN, OUT, bias=True)

  def forward(self, x):
    return self.proj(x)


def _peft_model(use_rslora, alpha=16, dropout=0.0, seed=0):
  torch.manual_seed(seed)
  cfg = peft.LoraConfig(r=R, lora_alpha=alpha, target_modules=["proj"], lora_dropout=dropout,
                        use_rslora=use_rslora)
  model = peft.get_peft_model(_TorchNet(), cfg)
  layer = model.base_model.model.proj
  with torch.no_grad():
    layer.lora_B["default"].weight.normal_(0.0, 0.1)   # B = 0 at init; a trained adapter is not
  return model.eval(), layer


def _ours_from(layer, use_rslora, alpha=16, kind="linear"):
  """Our LoRA layer holding the peft layer's weights (torch keeps [out, in]; we keep [in, out])."""
  w = layer.base_layer.weight.detach().numpy().T
  b = layer.base_layer.bias.detach().numpy()
  if kind == "linear":
    base = nnx.Linear(IN, OUT, rngs=nnx.Rngs(0))
    base.bias[...] = jnp.asarray(b)
  else:
    base = Einsum("BTD,DF->BTF", (IN, OUT), ("embed", "mlp"), use_bias=True, rngs=nnx.Rngs(0))
    base.bias[...] = jnp.asarray(b)
  base.kernel[...] = jnp.asarray(w)
  ours = LoRA(base, rank=R, alpha=alpha, use_rslora=use_rslora, rngs=nnx.Rngs(0))
  ours.lora_a[...] = jnp.asarray(layer.lora_A["default"].weight.detach().numpy().T)
  ours.lora_b[...] = jnp.asarray(layer.lora_B["default"].weight.detach().numpy().T)
  return ours


@pytest.mark.parametrize("use_rslora", [False, True])
@pytest.mark.parametrize("kind", ["linear", "einsum"])
def test_forward_matches_peft(use_rslora, kind):
  model, layer = _peft_model(use_rslora)
  ours = _ours_from(layer, use_rslora, kind=kind)
  assert ours.scaling == pytest.approx(layer.scaling["default"])
  x = np.random.default_rng(0).standard_normal((2, 5, IN)).astype(np.float32)
  with torch.no_grad():
    want = model(torch.from_numpy(x)).numpy()
  np.testing.assert_allclose(np.asarray(ours(jnp.asarray(x))), want, atol=2e-5, rtol=1e-5)


def test_gradients_of_adapters_match_peft():
  model, layer = _peft_model(use_rslora=False)
  ours = _ours_from(layer, use_rslora=False)
  x = np.random.default_rng(1).standard_normal((3, IN)).astype(np.float32)
  t = np.random.default_rng(2).standard_normal((3, OUT)).astype(np.float32)
  loss_t = ((model(torch.from_numpy(x)) - torch.from_numpy(t)) ** 2).mean()
  loss_t.backward()
  grads = nnx.grad(lambda m: jnp.mean((m(jnp.asarray(x)) - t) ** 2),
                   argnums=nnx.DiffState(0, nnx.Param))(ours)
  np.testing.assert_allclose(grads.lora_a[...], layer.lora_A["default"].weight.grad.numpy().T,
                             atol=1e-5, rtol=1e-4)
  np.testing.assert_allclose(grads.lora_b[...], layer.lora_B["default"].weight.grad.numpy().T,
                             atol=1e-5, rtol=1e-4)
  # peft freezes the base layer; so does a LoRA optimizer (see tests/nn/test_lora.py).
  assert layer.base_layer.weight.grad is None


def test_merged_weight_matches_merge_and_unload():
  model, layer = _peft_model(use_rslora=True, alpha=8)
  holder = nnx.List([nnx.Linear(IN, OUT, rngs=nnx.Rngs(0))])
  holder[0].kernel[...] = jnp.asarray(layer.base_layer.weight.detach().numpy().T)
  holder[0].bias[...] = jnp.asarray(layer.base_layer.bias.detach().numpy())
  apply_lora(holder, "0", rank=R, alpha=8, use_rslora=True, rngs=nnx.Rngs(0))
  (_, ours), = lora_layers(holder)
  ours.lora_a[...] = jnp.asarray(layer.lora_A["default"].weight.detach().numpy().T)
  ours.lora_b[...] = jnp.asarray(layer.lora_B["default"].weight.detach().numpy().T)
  merge_lora(holder)
  merged = model.merge_and_unload().proj.weight.detach().numpy()
  np.testing.assert_allclose(np.asarray(ours.base.kernel[...]), merged.T, atol=1e-6)


def test_initialization_matches_peft():
  torch.manual_seed(0)
  fan_in, r = 256, 64
  net = torch.nn.Sequential(torch.nn.Linear(fan_in, 32))
  model = peft.get_peft_model(net, peft.LoraConfig(r=r, lora_alpha=r, target_modules=["0"]))
  a_t = model.base_model.model[0].lora_A["default"].weight.detach().numpy()
  b_t = model.base_model.model[0].lora_B["default"].weight.detach().numpy()
  ours = LoRA(nnx.Linear(fan_in, 32, rngs=nnx.Rngs(0)), rank=r, alpha=r, rngs=nnx.Rngs(3))
  a = np.asarray(ours.lora_a[...])
  np.testing.assert_array_equal(b_t, 0.0)
  np.testing.assert_array_equal(np.asarray(ours.lora_b[...]), 0.0)
  bound = 1 / np.sqrt(fan_in)
  # Both are U(-bound, bound): same support, and with 16,384 draws the same spread (std = bound/sqrt 3).
  assert np.abs(a_t).max() <= bound + 1e-7 and np.abs(a).max() <= bound
  for sample in (a_t, a):
    np.testing.assert_allclose(sample.std(), bound / np.sqrt(3), rtol=0.03)
    assert np.abs(sample).max() > 0.99 * bound
  assert a.shape == a_t.T.shape


def test_dynamic_map_is_bitsandbytes_table_bit_for_bit():
  """bitsandbytes' create_dynamic_map(signed=True), written out with torch as it does: equal to
  our table in every bit (np.linspace left 22 entries one fp32 ulp off)."""
  from jaxattn.ops.nf4 import DYNAMIC_MAP
  data = []
  for i in range(7):
    edges = torch.linspace(0.1, 1, 2 ** i + 1, dtype=torch.float32)
    means = (edges[:-1] + edges[1:]) / 2.0
    data += ((10 ** (-6 + i)) * means).tolist() + (-(10 ** (-6 + i)) * means).tolist()
  data += [0.0, 1.0] + [0.0] * (256 - len(data) - 2)
  want = torch.sort(torch.tensor(data, dtype=torch.float32)).values.numpy()
  np.testing.assert_array_equal(DYNAMIC_MAP, want)
