"""LoRA / QLoRA adapters on NNX models: init, formulas, merge, adapter-only training, counts."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxattn import sharding
from jaxattn.nn.block import TransformerBlock
from jaxattn.nn.linear import Einsum
from jaxattn.nn.lora import (LoRA, LoRAParam, NF4Einsum, NF4Weight, apply_lora, count_parameters,
                             lora_layers, lora_optimizer, make_train_step, merge_lora, unload_lora,
                             unmerge_lora)
from jaxattn.ops.lora import lora_einsum_specs, lora_linear, lora_scaling
from jaxattn.ops.nf4 import dequantize_nf4, quantize_nf4

D = 16


class Tiny(nnx.Module):
  def __init__(self, rngs):
    self.blocks = nnx.List([TransformerBlock(D, num_heads=4, mlp_dim=32, rngs=rngs)])
    self.head = nnx.Linear(D, 8, rngs=rngs)

  def __call__(self, x):
    for b in self.blocks:
      x = b(x)
    return self.head(x)


def _x(shape=(2, 5, D), seed=0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


@nnx.jit
def _fwd(m, x):
  # One jitted function for all tests: it recompiles only when a model's structure changes.
  return m(x)


def _randomize_b(model, scale=0.1, seed=1):
  rng = np.random.default_rng(seed)
  for _, layer in lora_layers(model):
    layer.lora_b[...] = jnp.asarray(rng.standard_normal(layer.lora_b[...].shape) * scale, jnp.float32)


def test_specs_for_einsum_and_linear():
  s = lora_einsum_specs("BTD,DNH->BTNH")
  assert (s.down, s.up, s.delta) == ("BTD,Dr->BTr", "BTr,rNH->BTNH", "Dr,rNH->DNH")
  s = lora_einsum_specs("BTNH,NHD->BTD")
  assert (s.down, s.up, s.delta) == ("BTNH,NHr->BTr", "BTr,rD->BTD", "NHr,rD->NHD")
  s = lora_einsum_specs("...i,io->...o")
  assert (s.down, s.up, s.delta) == ("...i,ir->...r", "...r,ro->...o", "ir,ro->io")
  # A kernel axis shared by input and output (one adapter per expert).
  s = lora_einsum_specs("ETD,EDF->ETF")
  assert (s.down, s.up, s.delta) == ("ETD,EDr->ETr", "ETr,ErF->ETF", "EDr,ErF->EDF")
  assert s.a_shape((3, 8, 5), 2) == (3, 8, 2) and s.b_shape((3, 8, 5), 2) == (3, 2, 5)
  for bad in ("BTD,DF", "BTD->BTD", "BTD,DFX->BTF", "BTD,D->BT"):
    with pytest.raises(ValueError, match="spec"):
      lora_einsum_specs(bad)


def test_lora_at_init_leaves_the_model_unchanged():
  model = Tiny(nnx.Rngs(0))
  x = _x()
  want = _fwd(model, x)
  paths = apply_lora(model, r"(q_proj|v_proj|o_proj|mlp/up|head)$", rank=4, alpha=8,
                     rngs=nnx.Rngs(1))
  assert paths == ["blocks/0/attn/o_proj", "blocks/0/attn/q_proj", "blocks/0/attn/v_proj",
                   "blocks/0/mlp/up", "head"]
  assert isinstance(model.blocks[0].attn.q_proj, LoRA) and isinstance(model.head, LoRA)
  np.testing.assert_array_equal(_fwd(model, x), want)
  # B = 0, A Kaiming-uniform with peft's bound 1 / sqrt(fan_in) (fan_in = N * H = 16 for o_proj).
  for _, layer in lora_layers(model):
    np.testing.assert_array_equal(layer.lora_b[...], 0.0)
    a = np.asarray(layer.lora_a[...])
    bound = 1 / np.sqrt(np.prod(a.shape[:-1]))
    assert np.abs(a).max() <= bound and np.abs(a).max() > 0.5 * bound
  assert model.blocks[0].attn.o_proj.lora_a[...].shape == (4, 4, 4)


def test_lora_layers_match_the_formula():
  x = _x()
  lin = nnx.Linear(D, 8, rngs=nnx.Rngs(0))
  w, b = lin.kernel[...], lin.bias[...]
  layer = LoRA(lin, rank=4, alpha=6.0, rngs=nnx.Rngs(1))
  layer.lora_b[...] = jnp.asarray(np.random.default_rng(2).standard_normal((4, 8)), jnp.float32)
  want = lora_linear(x, w, layer.lora_a[...], layer.lora_b[...], scaling=1.5, bias=b)
  np.testing.assert_allclose(layer(x), want, atol=1e-5)
  ref = np.asarray(x) @ np.asarray(w) + np.asarray(b) + 1.5 * (
      np.asarray(x) @ np.asarray(layer.lora_a[...])) @ np.asarray(layer.lora_b[...])
  np.testing.assert_allclose(layer(x), ref, atol=1e-5)
  # A split-output Einsum is the same map on the flattened kernel.
  q = Einsum("BTD,DNH->BTNH", (D, 4, 3), ("embed", "heads", "head_dim"), rngs=nnx.Rngs(0))
  kq = np.asarray(q.kernel[...]).reshape(D, 12)
  lq = LoRA(q, rank=2, alpha=2.0, use_rslora=True, rngs=nnx.Rngs(1))
  lq.lora_b[...] = jnp.asarray(np.random.default_rng(3).standard_normal((2, 4, 3)), jnp.float32)
  a, bb = np.asarray(lq.lora_a[...]), np.asarray(lq.lora_b[...]).reshape(2, 12)
  assert lq.scaling == pytest.approx(2 / np.sqrt(2)) == lora_scaling(2, 2.0, use_rslora=True)
  ref = np.asarray(x) @ kq + lq.scaling * (np.asarray(x) @ a) @ bb
  np.testing.assert_allclose(lq(x), ref.reshape(2, 5, 4, 3), atol=1e-5)
  # Adapters carry the kernel's logical axes, so the sharding rules apply to them.
  assert lq.lora_a.get_metadata()["logical_axes"] == ("embed", None)
  assert lq.lora_b.get_metadata()["logical_axes"] == (None, "heads", "head_dim")
  mesh = sharding.make_mesh({"fsdp": 2, "tensor": 4})
  specs = dict(nnx.to_flat_state(sharding.param_specs(nnx.state(lq), mesh=mesh)))
  assert specs[("lora_b",)] == jax.sharding.PartitionSpec(None, "tensor", None)


def test_merge_and_unmerge_are_exact():
  model = Tiny(nnx.Rngs(0))
  apply_lora(model, ".*", rank=4, alpha=8, rngs=nnx.Rngs(1))
  _randomize_b(model)
  x = _x()
  kernels = {p: np.asarray(l.base.kernel[...]) for p, l in lora_layers(model)}
  adapted = _fwd(model, x)
  assert np.abs(adapted - _fwd(Tiny(nnx.Rngs(0)), x)).max() > 1e-2    # the adapters do something
  merge_lora(model)
  merge_lora(model)                                                       # idempotent
  assert all(l.merged for _, l in lora_layers(model))
  # The merged layers compute the same function with one matmul each.
  np.testing.assert_allclose(_fwd(model, x), adapted, atol=1e-5)
  unmerge_lora(model)
  for p, l in lora_layers(model):
    # W0 + d - d in fp32: one rounding of |W0 + d| ~ 1, i.e. within 2^-23 ~ 1.2e-7 relative.
    np.testing.assert_allclose(l.base.kernel[...], kernels[p], rtol=0, atol=5e-7)
    assert not l.merged
  np.testing.assert_allclose(_fwd(model, x), adapted, atol=1e-5)
  # unload: plain layers holding W0 + s A B.
  unload_lora(model)
  assert not lora_layers(model) and isinstance(model.head, nnx.Linear)
  np.testing.assert_allclose(_fwd(model, x), adapted, atol=1e-5)


def test_only_adapter_parameters_change_after_optimizer_steps():
  model = Tiny(nnx.Rngs(0))
  apply_lora(model, r"attn/(q|v)_proj$|head$", rank=4, alpha=8, rngs=nnx.Rngs(1))
  opt = lora_optimizer(model, optax.adam(1e-2))
  # Optimizer state exists for the adapters only (Adam: one mu leaf per adapter matrix).
  n_trainable = count_parameters(model).trainable
  mu = opt.opt_state[0].mu
  assert sum(np.size(v) for v in jax.tree.leaves(mu)) == n_trainable
  frozen_before = jax.tree.map(np.asarray, nnx.state(model, nnx.Not(LoRAParam)))
  lora_before = jax.tree.map(np.asarray, nnx.state(model, LoRAParam))
  x, target = _x(), _x((2, 5, 8), seed=3)
  step = make_train_step(lambda m, x, t: jnp.mean((m(x) - t) ** 2))
  losses = [float(step(model, opt, x, target)) for _ in range(3)]
  assert losses[-1] < losses[0]
  frozen_after = nnx.state(model, nnx.Not(LoRAParam))
  for a, b in zip(jax.tree.leaves(frozen_before), jax.tree.leaves(frozen_after)):
    np.testing.assert_array_equal(a, b)
  changed = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(lora_before),
                                                      jax.tree.leaves(nnx.state(model, LoRAParam)))]
  assert all(changed)          # both A and B move (A from the second step, once B != 0)


def test_qlora_base_is_nf4_and_stays_frozen():
  model = Tiny(nnx.Rngs(0))
  dense = {name: np.asarray(getattr(model.blocks[0].mlp, name).kernel[...])
           for name in ("up", "down")}
  x = _x()
  apply_lora(model, r"mlp/(up|down)$", quantize_base=True, rank=4, rngs=nnx.Rngs(1))
  up = model.blocks[0].mlp.up
  assert isinstance(up.base, NF4Einsum) and isinstance(up.base.packed, NF4Weight)
  assert up.base.packed[...].dtype == jnp.uint8 and up.base.packed[...].shape == (D * 32 // 2,)
  # The base computes with the dequantized NF4 kernel; the adapter starts at zero on top of it.
  deq = dequantize_nf4(quantize_nf4(jnp.asarray(dense["up"])), dense["up"].shape)
  np.testing.assert_array_equal(up.base.dequantized_kernel(), deq)
  h = np.asarray(model.blocks[0].mlp_norm(x))
  np.testing.assert_allclose(up(jnp.asarray(h)), h @ np.asarray(deq), atol=1e-5)
  opt = lora_optimizer(model, optax.adam(1e-2))
  before = jax.tree.map(np.asarray, nnx.state(model, NF4Weight))
  step = make_train_step(lambda m, x: jnp.mean(m(x) ** 2))
  step(model, opt, x)
  step(model, opt, x)
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(nnx.state(model, NF4Weight))):
    np.testing.assert_array_equal(a, b)
  assert np.abs(np.asarray(up.lora_b[...])).max() > 0
  with pytest.raises(ValueError, match="NF4"):
    up.merge()
  # Unloading gives dense layers that compute dequantize(W0) + s A B.
  adapted = _fwd(model, x)
  unload_lora(model)
  assert isinstance(model.blocks[0].mlp.up, Einsum)
  np.testing.assert_allclose(_fwd(model, x), adapted, atol=1e-5)


def test_counts_match_the_seed_example():
  def adapted(quantize):
    layer = Einsum("BTD,DF->BTF", (4096, 4096), ("embed", "mlp"), rngs=nnx.Rngs(0))
    holder = nnx.List([layer])
    apply_lora(holder, "0", rank=8, quantize_base=quantize, rngs=nnx.Rngs(1))
    return holder
  # Abstract evaluation: no 64 MiB allocation needed to count.
  counts = count_parameters(nnx.eval_shape(lambda: adapted(False)))
  assert counts.trainable == 4096 * 8 + 8 * 4096 == 65_536
  assert counts.frozen == 4096 * 4096 == 16_777_216
  assert counts.frozen == 256 * counts.trainable
  assert counts.frozen_bytes == 4 * 16_777_216 and counts.trainable_bytes == 4 * 65_536
  assert "65,536" in str(counts) and "16,777,216" in str(counts)
  q = count_parameters(nnx.eval_shape(lambda: adapted(True)))
  assert q.trainable == 65_536 and q.frozen == 16_777_216
  np.testing.assert_allclose(8 * q.frozen_bytes / q.frozen, 4.127, atol=1e-3)
  full = count_parameters(Tiny(nnx.Rngs(0)), trainable=nnx.Param)
  assert full.frozen == 0 and full.trainable == sum(
      np.size(v) for v in jax.tree.leaves(nnx.state(Tiny(nnx.Rngs(0)), nnx.Param)))


def test_bf16_compute_with_fp32_adapters():
  q = Einsum("BTD,DF->BTF", (D, 8), ("embed", "mlp"), dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  layer = LoRA(q, rank=4, rngs=nnx.Rngs(1))
  layer.lora_b[...] = jnp.asarray(np.random.default_rng(0).standard_normal((4, 8)), jnp.float32)
  x = _x()
  y = layer(x)
  assert y.dtype == jnp.bfloat16 and layer.lora_a[...].dtype == jnp.float32
  want = lora_linear(x, q.kernel[...], layer.lora_a[...], layer.lora_b[...], scaling=layer.scaling)
  # bf16 inputs, weights and products: ~2^-8 relative per value, sums of 16 terms.
  np.testing.assert_allclose(np.asarray(y, np.float32), want, atol=0.1, rtol=0.03)


def test_dropout_on_the_adapter_input():
  lin = nnx.Linear(D, 8, rngs=nnx.Rngs(0))
  layer = LoRA(lin, rank=4, dropout=0.5, rngs=nnx.Rngs(1))
  layer.lora_b[...] = jnp.ones((4, 8))
  x = _x()
  y1, y2 = layer(x), layer(x)
  assert np.abs(y1 - y2).max() > 0                  # a new mask per call while training
  layer.eval()
  want = lora_linear(x, lin.kernel[...], layer.lora_a[...], layer.lora_b[...], scaling=layer.scaling,
                     bias=lin.bias[...])
  np.testing.assert_allclose(layer(x), want, atol=1e-5)


def test_merge_refuses_an_nf4_base_before_merging_anything():
  """A model with dense and QLoRA adapters: merge_lora merged the dense ones, then raised."""
  model = Tiny(nnx.Rngs(0))
  apply_lora(model, "head", rngs=nnx.Rngs(1))
  apply_lora(model, "q_proj", quantize_base=True, rngs=nnx.Rngs(2))
  with pytest.raises(ValueError, match="cannot merge into an NF4 kernel exactly"):
    merge_lora(model)
  assert not any(m.merged for _, m in lora_layers(model))


def test_errors():
  model = Tiny(nnx.Rngs(0))
  with pytest.raises(ValueError, match="match no"):
    apply_lora(model, "wq", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="regular expression"):
    apply_lora(model, "(", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="rank"):
    apply_lora(model, "head", rank=0, rngs=nnx.Rngs(0))
  for targets in (None, [], ["head", None], 3):
    with pytest.raises(ValueError, match="targets"):
      apply_lora(model, targets, rngs=nnx.Rngs(0))
  for alpha in ("x", None, True, float("inf"), float("nan")):
    with pytest.raises(ValueError, match="alpha"):
      apply_lora(model, "head", alpha=alpha, rngs=nnx.Rngs(0))
  # truthy strings were taken as True; a string dropout or no Rngs failed as a Type/AttributeError
  for kw, match in ((dict(use_rslora="no"), "`use_rslora` must be a bool, got 'no'"),
                    (dict(quantize_base="no"), "`quantize_base` must be a bool"),
                    (dict(double_quant="no", quantize_base=True), "`double_quant` must be a bool"),
                    (dict(dropout="0.1"), r"`dropout` must be a number in \[0, 1\)"),
                    (dict(dropout=-0.1), r"`dropout` must be a number in \[0, 1\)"),
                    (dict(quantize_base=True, block_size=0), "`block_size` must be an int >= 1"),
                    (dict(rngs=None), "`rngs` must be an nnx.Rngs")):
    with pytest.raises(ValueError, match=match):
      apply_lora(model, ".*", **{"rngs": nnx.Rngs(0), **kw})
  assert not lora_layers(model)  # the refused calls changed nothing
  with pytest.raises(ValueError, match="dropout"):
    LoRA(model.head, dropout=1.0, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="supports"):
    LoRA(model.blocks[0].attn_norm, rngs=nnx.Rngs(0))
