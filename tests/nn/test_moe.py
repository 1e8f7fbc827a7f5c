"""The MoE layer: formula, non-trainable router bias, statistics, capacity, expert parallelism."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxattn import sharding
from jaxattn.nn.moe import MoE, MoEStats, RouterBias
from jaxattn.ops import moe as ops

D = 16


def _moe(**kw):
  cfg = dict(num_experts=8, top_k=2, expert_dim=12, num_shared_experts=1, n_group=4, topk_group=2,
             routed_scaling_factor=1.5, rngs=nnx.Rngs(0))
  cfg.update(kw)
  return MoE(D, **cfg)


@nnx.jit
def _call(layer, x, token_mask=None):
  return layer(x, token_mask=token_mask)


def _x(b=2, t=8, seed=1):
  return jax.random.normal(jax.random.key(seed), (b, t, D))


def test_forward_is_shared_plus_weighted_experts_per_token():
  layer = _moe()
  layer.router_bias[...] = jnp.linspace(-0.1, 0.1, 8)  # a bias that matters for selection
  x = _x()
  y, stats = _call(layer, x)
  assert y.shape == x.shape and isinstance(stats, MoEStats)
  # Independent per-token evaluation in float64 from the layer's parameters.
  xn = np.asarray(x, np.float64).reshape(-1, D)
  router = np.asarray(layer.router[...], np.float64)
  bias = np.asarray(layer.router_bias[...], np.float64)
  wg, wu, wd = (np.asarray(w[...], np.float64) for w in (layer.w_gate, layer.w_up, layer.w_down))
  sg, su, sd = (np.asarray(p.kernel[...], np.float64)
                for p in (layer.shared.gate, layer.shared.up, layer.shared.down))
  silu = lambda a: a / (1 + np.exp(-a))
  want = np.zeros_like(xn)
  for t, h in enumerate(xn):
    s = 1 / (1 + np.exp(-(h @ router)))
    c = s + bias
    group = np.sort(c.reshape(4, 2), -1)[:, -2:].sum(-1)
    keep = np.argsort(-group)[:2]
    c = np.where(np.isin(np.arange(8) // 2, keep), c, -np.inf)
    sel = np.argsort(-c)[:2]
    g = s[sel] / s[sel].sum() * 1.5
    for gi, e in zip(g, sel):
      want[t] += gi * (silu(h @ wg[e]) * (h @ wu[e])) @ wd[e]
    want[t] += (silu(h @ sg) * (h @ su)) @ sd
  np.testing.assert_allclose(np.asarray(y).reshape(-1, D), want, atol=1e-5, rtol=1e-5)


def test_router_bias_is_not_trainable():
  layer = _moe(num_shared_experts=0)
  assert isinstance(layer.router_bias, RouterBias)
  assert not isinstance(layer.router_bias, nnx.Param)
  params = nnx.state(layer, nnx.Param)
  assert "router_bias" not in params and "router" in params

  opt = nnx.Optimizer(layer, optax.adam(0.1), wrt=nnx.Param)
  layer.router_bias[...] = jnp.full((8,), 0.25)
  x = _x()

  @nnx.jit
  def train_step(layer, opt, x):
    def loss_fn(layer):
      y, stats = layer(x)
      return jnp.mean(y ** 2), stats
    (loss, stats), grads = nnx.value_and_grad(loss_fn, has_aux=True)(layer)
    opt.update(layer, grads)
    layer.update_bias(stats.load, rate=0.01)
    return loss, stats, grads

  router0 = np.asarray(layer.router[...])
  _, stats, grads = train_step(layer, opt, x)
  # The router learns through the weights (unbiased scores); the bias has no gradient at all.
  assert float(jnp.abs(grads["router"][...]).max()) > 0
  assert "router_bias" not in grads
  assert np.abs(np.asarray(layer.router[...]) - router0).max() > 0
  # The bias moved only by the explicit update: 0.25 + 0.01 * sign(mean - load).
  want = 0.25 + 0.01 * np.sign(np.mean(stats.load) - np.asarray(stats.load))
  np.testing.assert_allclose(layer.router_bias[...], want, rtol=1e-6)


def test_stats_and_losses():
  layer = _moe(seq_balance_alpha=0.01, switch_loss_alpha=0.1, z_loss_coef=1e-3)
  x = _x(b=2, t=8)
  mask = jnp.arange(8)[None, :] < jnp.array([[8], [5]])
  y, stats = _call(layer, x, mask)
  r = nnx.jit(lambda m, x: m.route(x))(layer, x)
  assert float(stats.load.sum()) == 13 * 2  # 13 real tokens, top-2
  np.testing.assert_allclose(stats.load, ops.expert_load(r.indices, 8, mask))
  np.testing.assert_allclose(stats.max_over_mean, stats.load.max() / stats.load.mean(), rtol=1e-6)
  assert int(stats.dropped) == 0
  np.testing.assert_allclose(stats.sequence_balance_loss,
                             ops.sequence_balance_loss(r.scores, r.indices, mask), rtol=1e-6)
  np.testing.assert_allclose(stats.z_loss, ops.router_z_loss(r.logits, mask), rtol=1e-6)
  probs = r.scores / r.scores.sum(-1, keepdims=True)
  np.testing.assert_allclose(stats.switch_aux_loss, ops.switch_aux_loss(probs, r.indices, mask),
                             rtol=1e-6)
  np.testing.assert_allclose(stats.aux_loss, 0.01 * stats.sequence_balance_loss +
                             0.1 * stats.switch_aux_loss + 1e-3 * stats.z_loss, rtol=1e-6)
  # The aux loss trains the router: it has a gradient with respect to the router weights.
  g = nnx.jit(nnx.grad(lambda m: m(x)[1].aux_loss))(layer)
  assert float(jnp.abs(g["router"][...]).max()) > 0
  # Disabled losses are exactly zero.
  _, plain = _call(_moe(), x)
  assert float(plain.aux_loss) == 0.0


def test_capacity_mode_reports_dropped_tokens():
  x = _x(b=2, t=16)
  dropless = _moe()
  _, s_ref = _call(dropless, x)
  _, tight = _call(_moe(capacity_factor=0.5), x)
  cap = ops.expert_capacity(32, 8, 2, 0.5)
  assert int(tight.dropped) == int(np.maximum(np.asarray(s_ref.load) - cap, 0).sum()) > 0


def test_padding_takes_no_expert_slot():
  """Masked (padding) tokens are not dispatched: in capacity mode they took slots before real
  tokens (every real token dropped) and were counted as drops."""
  layer = _moe(num_experts=4, top_k=1, n_group=1, topk_group=1, num_shared_experts=0,
               capacity_factor=1.0)
  x = _x(b=1, t=8)
  real = x[:, 4:]
  mask = jnp.arange(8)[None] >= 4                              # left padding: tokens 0..3
  y, st = _call(layer, x, mask)
  y_ref, st_ref = nnx.jit(lambda m, x: m(x))(_moe(num_experts=4, top_k=1, n_group=1,
                                                 topk_group=1, num_shared_experts=0,
                                                 capacity_factor=2.0), real)
  # (capacity: 1.0 * 8 tokens / 4 experts = 2 slots here, 2.0 * 4 / 4 = 2 slots unpadded)
  np.testing.assert_allclose(y[:, 4:], y_ref, atol=1e-6)
  np.testing.assert_array_equal(y[:, :4], 0)                    # no shared expert: nothing
  assert int(st.dropped) == int(st_ref.dropped)
  np.testing.assert_array_equal(st.load, st_ref.load)
  # segment ids imply the mask
  y_seg, st_seg = nnx.jit(lambda m, x, s: m(x, segment_ids=s))(layer, x, mask.astype(jnp.int32))
  np.testing.assert_array_equal(y_seg, y)
  assert int(st_seg.dropped) == int(st.dropped)


def test_bf16_compute_with_fp32_routing():
  x = _x()
  want, _ = _call(_moe(), x)
  y16, stats = _call(_moe(dtype=jnp.bfloat16), x)
  assert y16.dtype == jnp.bfloat16 and stats.load.dtype == jnp.float32
  # bf16 activations and weights, fp32 routing and accumulation: ~1% of the output scale.
  np.testing.assert_allclose(np.asarray(y16, np.float32), want,
                             atol=0.03 * float(jnp.abs(want).max()))


def test_expert_parallel_equals_single_device():
  # Gradients through the all-to-all are checked against the dense reference in the ops tests;
  # here: the layer switches to the expert-parallel path under the mesh and gives the same result.
  x = _x(b=4, t=8)
  cfg = dict(num_experts=16, n_group=4, topk_group=2, top_k=3)
  want, want_stats = _call(_moe(**cfg), x)
  mesh = sharding.make_mesh({"expert": 8})
  layer = _moe(**cfg)
  with jax.set_mesh(mesh):
    sharding.shard_module(layer, mesh)
    assert layer.w_gate[...].sharding.spec == P("expert", None, None)
    assert layer.w_gate[...].addressable_shards[0].data.shape == (2, D, 12)
    assert layer._use_expert_parallel()
    got, stats = _call(layer, x)
  np.testing.assert_allclose(got, want, atol=2e-5)
  np.testing.assert_allclose(stats.load, want_stats.load)


@pytest.mark.parametrize("shape", [(2, 1), (1, 3)])
def test_expert_parallel_with_tokens_that_do_not_divide_over_the_shards(shape):
  # {"expert": 4, "data": 2} splits tokens 8 ways; a decode step [2, 1, D] and an odd prompt
  # [1, 3, D] have fewer: the expert-parallel path pads them, and the padding is no token, so
  # values, gradients (parameters and input) and the load equal the no-mesh call.
  def loss(layer, x):
    y, stats = layer(x)
    return jnp.sum(jnp.sin(y)), (y, stats.load)

  step = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True))
  x = _x(*shape)
  (_, (want, want_load)), (want_gp, want_gx) = step(_moe(), x)
  mesh = sharding.make_mesh({"expert": 4, "data": 2})
  layer = _moe()
  with jax.set_mesh(mesh):
    sharding.shard_module(layer, mesh)
    assert layer._use_expert_parallel()
    (_, (got, load)), (gp, gx) = step(layer, x)
  np.testing.assert_allclose(got, want, atol=2e-5)
  np.testing.assert_allclose(gx, want_gx, atol=5e-5, rtol=1e-4)
  for (path, g), (_, r) in zip(nnx.to_flat_state(gp), nnx.to_flat_state(want_gp)):
    np.testing.assert_allclose(g[...], r[...], atol=5e-5, rtol=1e-4, err_msg=str(path))
  assert float(load.sum()) == shape[0] * shape[1] * 2  # top-2 of the real tokens only
  np.testing.assert_array_equal(load, want_load)


def _gpt_oss(seed=0):
  """gpt-oss's options, every parameter random (biases and router logit bias included)."""
  from jaxattn.testing import random_module
  layer = random_module(lambda: MoE(D, 8, 2, 12, score_func="softmax", norm_topk_prob=True,
                                    activation=ops.ClampedSwiGLU(), expert_bias=True,
                                    router_logit_bias=True, rngs=nnx.Rngs(0)), seed)
  layer.router_bias.set_value(jnp.zeros((8,)))   # (not a parameter: random_module leaves it)
  return layer


def test_gpt_oss_options_expert_parallel_values_and_gradients():
  """The gate / up biases (added per row by its expert) and the output bias (added per chosen
  expert) through the expert-parallel path: values and every gradient (the biases' too) equal
  the no-mesh call, which equals the dense reference."""
  def loss(layer, x):
    y, _ = layer(x)
    return jnp.sum(jnp.sin(y)), y

  step = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True))
  x = _x(2, 3) * 3.0
  layer0 = _gpt_oss()
  (_, want), (want_gp, want_gx) = step(layer0, x)
  r = layer0.route(x)
  dense = ops.dense_experts(x.reshape(6, D), r.indices.reshape(6, 2), r.weights.reshape(6, 2),
                            layer0.w_gate[...], layer0.w_up[...], layer0.w_down[...],
                            activation=ops.ClampedSwiGLU(),
                            gate_up_bias=(layer0.b_gate[...], layer0.b_up[...]))
  dense = dense + jnp.einsum("mk,mkd->md", r.weights.reshape(6, 2),
                             layer0.b_down[...][r.indices.reshape(6, 2)])
  np.testing.assert_allclose(want.reshape(6, D), dense, atol=2e-5, rtol=1e-5)
  mesh = sharding.make_mesh({"expert": 4, "data": 2})
  layer = _gpt_oss()
  with jax.set_mesh(mesh):
    sharding.shard_module(layer, mesh)
    assert layer._use_expert_parallel()
    (_, got), (gp, gx) = step(layer, x)
  np.testing.assert_allclose(got, want, atol=2e-5)
  np.testing.assert_allclose(gx, want_gx, atol=5e-5, rtol=1e-4)
  flat = nnx.to_flat_state(gp)
  assert {"b_gate", "b_up", "b_down", "router_logit_bias"} <= {p[0] for p, _ in flat}
  for (path, g), (_, r) in zip(flat, nnx.to_flat_state(want_gp)):
    np.testing.assert_allclose(g[...], r[...], atol=5e-5, rtol=1e-4, err_msg=str(path))


def test_mxfp4_experts_equal_their_dequantized_weights_and_freeze():
  """``quantize_experts``: the layer computes exactly what the same layer with the dequantized
  matrices as parameters computes (values and input gradients); the quantized storage takes no
  gradient while the router and biases still train; the bytes stored; errors."""
  from jaxattn.nn.moe import MXFP4Weight, QuantizedData
  from jaxattn.ops.mxfp4 import code_width, dequantize_mxfp4, quantize_mxfp4
  def make():
    return MoE(32, 4, 2, 64, score_func="softmax", activation=ops.ClampedSwiGLU(),
               expert_bias=True, router_logit_bias=True, rngs=nnx.Rngs(0))

  dense, quant = make(), make()
  quant.quantize_experts()
  assert isinstance(quant.w_gate, MXFP4Weight) and quant.w_down.shape == (4, 64, 32)
  for name in ("w_gate", "w_up", "w_down"):   # the reference: the dequantized values, as params
    w = getattr(dense, name)[...]
    back = jnp.swapaxes(dequantize_mxfp4(*quantize_mxfp4(jnp.swapaxes(w, 1, 2))), 1, 2)
    getattr(dense, name)[...] = back
    assert float(jnp.abs(back - w).max()) > 0   # (quantization changed them)
  x = jax.random.normal(jax.random.key(3), (2, 5, 32))

  def loss(layer, x):
    y, _ = layer(x)
    return jnp.sum(jnp.sin(y)), y

  step = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True))
  (_, want), (gp_d, gx_d) = step(dense, x)
  (_, got), (gp_q, gx_q) = step(quant, x)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(gx_q, gx_d, rtol=1e-5, atol=1e-6)
  trained = {p[0] for p, _ in nnx.to_flat_state(gp_q)}
  assert "w_gate" not in trained and {"router", "b_gate", "router_logit_bias"} <= trained
  stored = sum(v.get_value().nbytes for _, v in nnx.to_flat_state(nnx.state(quant, QuantizedData)))
  # per matrix [E, K, N]: codes rows of code_width(K) bytes (K / 2, padded to 128) + K / 32 scales
  assert stored == sum(4 * n * (code_width(k) + k // 32) for k, n in ((32, 64), (32, 64), (64, 32)))
  bad = MoE(48, 4, 2, 64, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="groups of 32"):
    bad.quantize_experts()
  with pytest.raises(ValueError, match="expert_format"):
    MoE(32, 4, 2, 64, expert_format="nf4", rngs=nnx.Rngs(0))


@pytest.mark.parametrize("kwargs,match", [
    (dict(expert_bias=True, capacity_factor=1.0), "expert_bias"),
    (dict(activation="gelu"), "activation"),
    (dict(router_logit_bias=1), "router_logit_bias"),
    (dict(top_k=9), "top_k"),
    (dict(num_experts=6, n_group=4), "n_group"),
    (dict(topk_group=5), "topk_group"),
    (dict(score_func="tanh"), "score_func"),
    (dict(capacity_factor=-1.0), "capacity_factor"),
    (dict(implementation="megablox"), "implementation"),
    (dict(expert_dim=0), "expert_dim"),
    (dict(num_shared_experts=-1), "num_shared_experts"),
    (dict(z_loss_coef=-1.0), "z_loss_coef"),
    (dict(expert_parallel=True, capacity_factor=1.0), "expert_parallel"),
    (dict(shared_dim=0), "shared_dim"),  # 0 must not pass for "the default"
    (dict(bias_update_rate=-1e-3), "bias_update_rate"),
    (dict(block_size=0), "block_size"),
    (dict(top_k=True), "top_k"),  # bool, not the int 1
])
def test_config_errors(kwargs, match):
  with pytest.raises(ValueError, match=match):
    _moe(**kwargs)


def test_call_errors():
  with pytest.raises(ValueError, match="x"):
    _moe()(jnp.ones((2, 3, D + 1)))
  with pytest.raises(ValueError, match="expert_parallel"):
    _moe(expert_parallel=True)(_x())


def test_lora_on_mxfp4_experts_and_scanned_mxfp4_models():
  """QLoRA on MXFP4 experts: per-expert adapters train over the frozen codes (the adapted layer
  equals the dequantized base plus the adapters' update, which starts at zero); merging into the
  codes is refused, unmerged unloading works.  A scanned gpt-oss model built with
  ``moe_expert_format="mxfp4"`` runs, its codes stacked per layer."""
  from jaxattn.configs import get_config
  from jaxattn.nn.lora import LoRAParam, apply_lora, merge_lora, unload_lora
  from jaxattn.nn.model import DecoderLM
  class Block(nnx.Module):   # (adapters are found below a model's root)
    def __init__(self):
      self.ffn = MoE(32, 4, 2, 64, rngs=nnx.Rngs(0))

    def __call__(self, x):
      return self.ffn(x)

  layer = Block()
  layer.ffn.quantize_experts()
  x = jax.random.normal(jax.random.key(5), (2, 3, 32))
  before, _ = layer(x)
  paths = apply_lora(layer, r"ffn/w_(gate|up|down)$", rank=4, rngs=nnx.Rngs(1))
  assert len(paths) == 3
  after, _ = layer(x)
  np.testing.assert_allclose(after, before, rtol=1e-6, atol=1e-6)   # B = 0 at the start
  grads = nnx.grad(lambda m: jnp.sum(m(x)[0] ** 2), argnums=nnx.DiffState(0, LoRAParam))(layer)
  assert float(jnp.abs(grads["ffn"]["w_gate_lora"]["lora_b"][...]).max()) > 0
  with pytest.raises(ValueError, match="held in MXFP4"):
    merge_lora(layer)
  unload_lora(layer, merge=False)
  np.testing.assert_allclose(layer(x)[0], before, rtol=1e-6, atol=1e-6)
  cfg = get_config("gpt-oss", embed_dim=32, mlp_dim=32, moe_expert_dim=32, head_dim=8,
                   num_layers=4, scan_layers=True, moe_expert_format="mxfp4", max_seq_len=32)
  model = DecoderLM(cfg, rngs=nnx.Rngs(0))
  codes = model.moe_sites()[0].w_gate.codes
  assert codes.shape[0] == 2 and codes.get_metadata()["logical_axes"][0] == "layers"
  assert model(jnp.ones((1, 5), jnp.int32)).shape == (1, 5, cfg.vocab_size)
