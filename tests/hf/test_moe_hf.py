"""MoE parity with Hugging Face transformers: DeepSeek-V3 router and MoE block, Mixtral's aux loss."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from transformers import DeepseekV3Config  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (  # noqa: E402
    DeepseekV3MoE, DeepseekV3TopkRouter)

from jaxattn.nn.moe import MoE  # noqa: E402
from jaxattn.ops import moe as ops  # noqa: E402

pytestmark = pytest.mark.hf

D, F, E, K = 32, 16, 16, 4


def _config(**kw):
  cfg = dict(hidden_size=D, moe_intermediate_size=F, n_routed_experts=E, num_experts_per_tok=K,
             n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
             norm_topk_prob=True, hidden_act="silu", num_hidden_layers=1, vocab_size=32)
  cfg.update(kw)
  config = DeepseekV3Config(**cfg)
  config._experts_implementation = "eager"  # the per-expert loop: the plainest reference
  return config


def _randomize(module, seed):
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for p in module.parameters():
      p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    # A correction bias large enough to change the selected groups and experts.
    router = module if isinstance(module, DeepseekV3TopkRouter) else module.gate
    router.e_score_correction_bias.copy_(torch.randn(E, generator=g) * 0.1)


def _gates(weights, indices):
  """[tokens, E] matrix of routing weights (order-free: transformers' top-k is unsorted)."""
  out = np.zeros((weights.shape[0], E))
  np.put_along_axis(out, np.asarray(indices, np.int64), np.asarray(weights, np.float64), axis=-1)
  return out


def _layer_from(hf: DeepseekV3MoE, config) -> MoE:
  layer = MoE(D, E, K, F, num_shared_experts=config.n_shared_experts, n_group=config.n_group,
              topk_group=config.topk_group, norm_topk_prob=config.norm_topk_prob,
              routed_scaling_factor=config.routed_scaling_factor, rngs=nnx.Rngs(0))
  t = lambda p: jnp.asarray(p.detach().numpy())
  layer.router[...] = t(hf.gate.weight).T                                     # [E, D] -> [D, E]
  layer.router_bias[...] = t(hf.gate.e_score_correction_bias)
  gate_up = t(hf.experts.gate_up_proj)                                         # [E, 2F, D]: gate; up
  layer.w_gate[...] = gate_up[:, :F].transpose(0, 2, 1)
  layer.w_up[...] = gate_up[:, F:].transpose(0, 2, 1)
  layer.w_down[...] = t(hf.experts.down_proj).transpose(0, 2, 1)               # [E, D, F] -> [E, F, D]
  layer.shared.gate.kernel[...] = t(hf.shared_experts.gate_proj.weight).T
  layer.shared.up.kernel[...] = t(hf.shared_experts.up_proj.weight).T
  layer.shared.down.kernel[...] = t(hf.shared_experts.down_proj.weight).T
  return layer


@pytest.mark.parametrize("norm", [True, False])
def test_group_limited_router_matches_deepseek_v3(norm):
  config = _config(norm_topk_prob=norm)
  router = DeepseekV3TopkRouter(config)
  _randomize(router, 0)
  x = torch.randn(64, D, generator=torch.Generator().manual_seed(1))
  with torch.no_grad():
    logits, weights, indices = router(x)
  r = ops.route(jnp.asarray(x.numpy()) @ jnp.asarray(router.weight.detach().numpy()).T,
                jnp.asarray(router.e_score_correction_bias.numpy()), top_k=K, n_group=4,
                topk_group=2, norm_topk_prob=norm, routed_scaling_factor=2.5)
  np.testing.assert_allclose(r.logits, logits.numpy(), atol=1e-5)
  np.testing.assert_array_equal(np.sort(r.indices, -1), np.sort(indices.numpy(), -1))
  np.testing.assert_allclose(_gates(r.weights, r.indices), _gates(weights.numpy(), indices.numpy()),
                             rtol=1e-5, atol=1e-6)
  # The bias mattered: routing without it differs for some tokens.
  r0 = ops.route(r.logits, None, top_k=K, n_group=4, topk_group=2)
  assert np.any(np.sort(r0.indices, -1) != np.sort(r.indices, -1))


def test_moe_block_matches_deepseek_v3():
  config = _config()
  hf = DeepseekV3MoE(config).eval()
  _randomize(hf, 2)
  x = torch.randn(2, 24, D, generator=torch.Generator().manual_seed(3))
  with torch.no_grad():
    want = hf(x).numpy()
  layer = _layer_from(hf, config)
  y, stats = nnx.jit(lambda m, x: m(x))(layer, jnp.asarray(x.numpy()))
  np.testing.assert_allclose(y, want, atol=1e-5, rtol=1e-5)
  # The statistics count the same selection transformers made.
  with torch.no_grad():
    _, _, idx = hf.gate(x)
  np.testing.assert_allclose(stats.load, np.bincount(idx.numpy().ravel(), minlength=E))


def test_switch_aux_loss_matches_mixtral_load_balancing_loss():
  mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
  g = torch.Generator().manual_seed(4)
  logits = torch.randn(2 * 10, 8, generator=g)
  mask = torch.ones(2, 10)
  mask[1, 6:] = 0
  want = mixtral.load_balancing_loss_func((logits,), 8, top_k=2, attention_mask=mask)
  lj = jnp.asarray(logits.numpy())
  r = ops.route(lj, top_k=2, score_func="softmax")
  got = ops.switch_aux_loss(r.scores, r.indices, jnp.asarray(mask.numpy().reshape(-1) > 0))
  np.testing.assert_allclose(got, want.item(), rtol=1e-5)
  want_nomask = mixtral.load_balancing_loss_func((logits,), 8, top_k=2)
  np.testing.assert_allclose(ops.switch_aux_loss(r.scores, r.indices), want_nomask.item(), rtol=1e-5)


# ----------------------------------------------------------------------------------------------
# gpt-oss: a softmax over the top-k router logits (with a learned logit bias), clamped SwiGLU
# experts with biases
# ----------------------------------------------------------------------------------------------


def _gpt_oss_layer(hf, implementation=None, **kw):
  from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP  # noqa: F401
  layer = MoE(D, E, K, F, score_func="softmax", norm_topk_prob=True,
              activation=ops.ClampedSwiGLU(alpha=1.702, limit=7.0), expert_bias=True,
              router_logit_bias=True, implementation=implementation, rngs=nnx.Rngs(0), **kw)
  t = lambda p: jnp.asarray(p.detach().numpy())  # noqa: E731
  layer.router[...] = t(hf.router.weight).T                                   # [E, D] -> [D, E]
  layer.router_logit_bias[...] = t(hf.router.bias)
  gate_up, gate_up_bias = t(hf.experts.gate_up_proj), t(hf.experts.gate_up_proj_bias)
  layer.w_gate[...], layer.w_up[...] = gate_up[..., ::2], gate_up[..., 1::2]  # interleaved
  layer.b_gate[...], layer.b_up[...] = gate_up_bias[..., ::2], gate_up_bias[..., 1::2]
  layer.w_down[...] = t(hf.experts.down_proj)                                 # [E, F, D]
  layer.b_down[...] = t(hf.experts.down_proj_bias)
  return layer


@pytest.mark.parametrize("implementation", ["blocked", "dense", "ragged_dot"])
def test_gpt_oss_moe_block(implementation):
  """transformers' ``GptOssMLP`` (router + experts, eager loop) on random weights scaled so that
  the clamps (7) bind on some units: our ``MoE`` with its gpt-oss options, every grouped-matmul
  path."""
  from transformers import GptOssConfig
  from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
  config = GptOssConfig(hidden_size=D, intermediate_size=F, num_local_experts=E,
                        num_experts_per_tok=K, num_hidden_layers=1, vocab_size=32)
  config._experts_implementation = "eager"
  hf = GptOssMLP(config)
  g = torch.Generator().manual_seed(3)
  with torch.no_grad():
    for p in hf.parameters():
      p.copy_(torch.randn(p.shape, generator=g) * 2.0)
  x = torch.randn(3, 10, D, generator=torch.Generator().manual_seed(4))
  with torch.no_grad():
    want, _ = hf(x)
    gate_up = x.reshape(-1, D) @ hf.experts.gate_up_proj[0] + hf.experts.gate_up_proj_bias[0]
  assert float(gate_up[..., ::2].max()) > 7.0 and float(gate_up[..., 1::2].abs().max()) > 7.0
  layer = _gpt_oss_layer(hf, implementation)
  got, stats = layer(jnp.asarray(x.numpy()))
  scale = float(want.abs().max())
  np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=1e-4, atol=1e-5 * scale)
  assert int(stats.dropped) == 0
