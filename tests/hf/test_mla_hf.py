"""MLA against Hugging Face transformers' ``DeepseekV3Attention`` (PyTorch, CPU, fp32).

A tiny DeepSeek-V3 attention layer with random weights (norm scales and biases included) is copied
into ``jaxattn.nn.MLA``; both inference paths, and prefill + token-by-token decode, must reproduce
its output.  The configurations cover query compression on and off, both RoPE pair layouts, and
YaRN with ``mscale_all_dim`` (softmax scale ``* mscale**2``) and with ``mscale != mscale_all_dim``
(an extra factor on cos/sin of the position stream only).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxattn.nn.mla import MLA
from jaxattn.ops.rope import RopeScaling

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import DeepseekV3Config  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_deepseek  # noqa: E402

pytestmark = pytest.mark.hf

D, N, P, R, HV, C, CQ = 32, 4, 8, 4, 6, 12, 16

CONFIGS = {
    # DeepSeek-V3's own recipe scaled down: query LoRA, interleaved pairs, YaRN factor 40 with
    # mscale == mscale_all_dim (cos/sin factor 1, softmax scale x (0.1 ln 40 + 1)^2).
    "v3_like_yarn": dict(q_lora_rank=CQ, rope_interleave=True, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4,
        mscale=1.0, mscale_all_dim=1.0, beta_fast=32, beta_slow=1)),
    # V2-Lite-like: no query compression; half-split pairs; biases on the projections that have them.
    "no_q_lora_half_split_bias": dict(q_lora_rank=None, rope_interleave=False, attention_bias=True,
                                      rope_parameters=dict(rope_type="default", rope_theta=500.0)),
    # mscale != mscale_all_dim: cos and sin carry 0.707-vs-1 yarn factors, the softmax scale another.
    "yarn_unequal_mscale": dict(q_lora_rank=CQ, rope_interleave=True, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=8,
        mscale=0.707, mscale_all_dim=1.0)),
}


def _hf_layer(name, seed=0):
  cfg = DeepseekV3Config(hidden_size=D, num_attention_heads=N, num_key_value_heads=N,
                         kv_lora_rank=C, qk_nope_head_dim=P, qk_rope_head_dim=R, v_head_dim=HV,
                         num_hidden_layers=1, max_position_embeddings=64,
                         attn_implementation="eager", **CONFIGS[name])
  torch.manual_seed(seed)
  layer = hf_deepseek.DeepseekV3Attention(cfg, layer_idx=0).eval()
  with torch.no_grad():  # make the RMSNorm scales and the biases matter
    for pname, p in layer.named_parameters():
      if "layernorm" in pname:
        p.copy_(1 + 0.2 * torch.randn_like(p))
      elif pname.endswith("bias"):
        p.copy_(0.1 * torch.randn_like(p))
  return cfg, layer, hf_deepseek.DeepseekV3RotaryEmbedding(cfg)


def _hf_forward(cfg, layer, rotary, x):
  b, t, _ = x.shape
  xt = torch.from_numpy(np.asarray(x))
  pos = torch.arange(t)[None].expand(b, t)
  causal = torch.full((t, t), float("-inf")).triu(1)[None, None]
  with torch.no_grad():
    y, _ = layer(xt, rotary(xt, pos), causal)
  return y.numpy()


def _mla_from_hf(cfg, layer) -> MLA:
  """``MLA`` with ``layer``'s weights (torch ``Linear`` stores ``[out, in]``, our kernels
  ``[in, ...]``)."""
  rope = cfg.rope_parameters
  mla = nnx.eval_shape(lambda: MLA(
      D, N, kv_lora_rank=C, qk_nope_head_dim=P, qk_rope_head_dim=R, v_head_dim=HV,
      q_lora_rank=cfg.q_lora_rank, rope_base=rope["rope_theta"], rope_interleaved=cfg.rope_interleave,
      rope_scaling=RopeScaling.from_hf(rope, max_position_embeddings=cfg.max_position_embeddings),
      use_bias=cfg.attention_bias, rngs=nnx.Rngs(0)))

  def w(t):
    return t.detach().numpy()

  def put(var, value):
    var.set_value(jnp.asarray(value, jnp.float32))

  if cfg.q_lora_rank is None:
    put(mla.q_proj.kernel, w(layer.q_proj.weight).T.reshape(D, N, P + R))
  else:
    put(mla.q_down.kernel, w(layer.q_a_proj.weight).T)
    put(mla.q_norm.scale, w(layer.q_a_layernorm.weight))
    put(mla.q_up.kernel, w(layer.q_b_proj.weight).T.reshape(CQ, N, P + R))
  kv_a = w(layer.kv_a_proj_with_mqa.weight)          # [C + R, D]: latent rows, then the RoPE key
  put(mla.kv_down.kernel, kv_a[:C].T)
  put(mla.k_rope_proj.kernel, kv_a[C:].T)
  put(mla.kv_norm.scale, w(layer.kv_a_layernorm.weight))
  kv_b = w(layer.kv_b_proj.weight).reshape(N, P + HV, C)  # per head: content-key rows, value rows
  put(mla.k_up.kernel, kv_b[:, :P].transpose(2, 0, 1))
  put(mla.v_up.kernel, kv_b[:, P:].transpose(2, 0, 1))
  put(mla.o_proj.kernel, w(layer.o_proj.weight).T.reshape(N, HV, D))
  if cfg.attention_bias:
    if cfg.q_lora_rank is not None:
      put(mla.q_down.bias, w(layer.q_a_proj.bias))
    kv_a_bias = w(layer.kv_a_proj_with_mqa.bias)
    put(mla.kv_down.bias, kv_a_bias[:C])
    put(mla.k_rope_proj.bias, kv_a_bias[C:])
    put(mla.o_proj.bias, w(layer.o_proj.bias))
  return mla


@nnx.jit
def _both_modes(m, x):
  return m(x, mode="naive"), m(x, mode="absorbed")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_deepseek_v3_attention(name):
  cfg, layer, rotary = _hf_layer(name)
  mla = _mla_from_hf(cfg, layer)
  assert mla.scale == pytest.approx(layer.scaling, rel=1e-12)  # incl. YaRN's mscale**2
  x = np.random.default_rng(1).standard_normal((2, 9, D)).astype(np.float32)
  want = _hf_forward(cfg, layer, rotary, x)
  naive, absorbed = _both_modes(mla, jnp.asarray(x))
  # fp32 on both sides, different summation orders and RoPE tables (measured ~1e-6).
  np.testing.assert_allclose(naive, want, atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(absorbed, want, atol=2e-5, rtol=2e-5)


def test_parity_would_catch_a_missing_mscale():
  # The YaRN softmax factor is large here ((0.1 ln 40 + 1)^2 = 1.87): an MLA without it must miss
  # transformers' output by far more than the parity tolerance.
  cfg, layer, rotary = _hf_layer("v3_like_yarn")
  assert layer.scaling == pytest.approx((0.1 * np.log(40.0) + 1) ** 2 * (P + R) ** -0.5)
  mla = _mla_from_hf(cfg, layer)
  mla.scale = (P + R) ** -0.5
  x = np.random.default_rng(1).standard_normal((2, 9, D)).astype(np.float32)
  wrong, _ = _both_modes(mla, jnp.asarray(x))
  assert np.abs(np.asarray(wrong) - _hf_forward(cfg, layer, rotary, x)).max() > 1e-2


@pytest.mark.parametrize("mode", ["naive", "absorbed"])
def test_prefill_and_decode_match_transformers(mode):
  cfg, layer, rotary = _hf_layer("v3_like_yarn", seed=3)
  mla = _mla_from_hf(cfg, layer)
  x = np.random.default_rng(2).standard_normal((1, 7, D)).astype(np.float32)
  want = _hf_forward(cfg, layer, rotary, x)
  step = nnx.jit(lambda m, c, xt: m(xt, cache=c, mode=mode))
  cache = mla.init_cache(1, 8)
  y, cache = step(mla, cache, jnp.asarray(x[:, :4]))
  outs = [y]
  for t in range(4, 7):
    y, cache = step(mla, cache, jnp.asarray(x[:, t:t + 1]))
    outs.append(y)
  np.testing.assert_allclose(jnp.concatenate(outs, 1), want, atol=2e-5, rtol=2e-5)
  assert jax.tree.leaves(cache)[0].shape == (1, 8, C + R)  # the cache holds only C + R per token
