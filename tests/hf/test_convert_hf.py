"""Hugging Face checkpoints -> DecoderLM, per family: logits, greedy generation, round trip.

Each family's tiny random transformers model (2 layers, hidden 64, vocabulary 128; CPU, fp32,
seed fixed) is saved with ``save_pretrained`` (safetensors) and loaded by
``jaxattn.convert.load_hf``.
Contracts:
  * logits on random token ids: ``max |ours - theirs| <= 1e-4 * max |theirs|`` (fp32; the only
    differences are summation orders, ~1e-6 relative);
  * 20 greedy tokens decoded with our cache (one token per jitted step, prompt included) equal
    transformers' ``generate(do_sample=False)``;
  * round trip: ``save_hf`` -> ``from_pretrained`` gives back the same logits.
Weights are drawn wider than transformers' init (std 0.1 instead of 0.02) so that attention
patterns, gates and routing are far from uniform and a wrong layout shows in the logits.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxattn.convert import config_from_hf, load_hf, save_hf  # noqa: E402

pytestmark = pytest.mark.hf

VOCAB, PROMPT, NEW = 128, 12, 20
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, max_position_embeddings=256,
              initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None,
              tie_word_embeddings=False)


def _llama():
  # Biases on, llama3 RoPE scaling whose band boundaries fall inside the frequencies used.
  return transformers.LlamaConfig(
      **COMMON, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
      attention_bias=True, mlp_bias=True, rope_parameters=dict(
          rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
          high_freq_factor=4.0, original_max_position_embeddings=16))


def _mistral():
  # A window of 6 keys, shorter than the prompt: the band matters in prefill and in decode.
  return transformers.MistralConfig(**COMMON, intermediate_size=96, num_attention_heads=4,
                                    num_key_value_heads=2, sliding_window=6)


def _deepseek_v3():
  # Layer 0 dense, layer 1 MoE (8 experts in 4 groups, 2 groups kept, top-2, shared expert), query
  # LoRA, interleaved RoPE pairs with YaRN whose mscale_all_dim enters the softmax scale.
  return transformers.DeepseekV3Config(
      **COMMON, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
      num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
      first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
      kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
      rope_interleave=True, rope_parameters=dict(
          rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=8,
          mscale=0.707, mscale_all_dim=1.0, beta_fast=32, beta_slow=1))


def _deepseek_v32():
  # DSA: the indexer keeps 8 of up to 32 keys, so prefill and decode both attend sparsely.  16
  # indexer heads make exact score ties (all heads' ReLU at 0) too rare to reorder the top-k.
  # YaRN (as the published model): the indexer rotates with the scaled cos / sin too.
  return transformers.DeepseekV32Config(
      **COMMON, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
      num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
      first_k_dense_replace=1, n_group=4, topk_group=2, kv_lora_rank=16, q_lora_rank=24,
      qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, index_topk=8, index_head_dim=16,
      index_n_heads=16, rope_parameters=dict(
          rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=8,
          mscale=0.707, mscale_all_dim=1.0, beta_fast=32, beta_slow=1))


def _qwen3_next():
  # Gated DeltaNet (2 key heads, 4 value heads) then gated attention with partial RoPE (4 of 16
  # coordinates), both layers MoE (softmax top-2 of 4, gated shared expert).
  return transformers.Qwen3NextConfig(
      **COMMON, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
      layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
      linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
      shared_expert_intermediate_size=32, rope_parameters=dict(
          rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25))


def _gpt_oss():
  # Sliding (a window of 6 keys) then full attention, both with sinks; 4 experts top-2 with clamped
  # SwiGLU and biases; YaRN without truncation.
  return transformers.GptOssConfig(
      **COMMON, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
      sliding_window=6, num_local_experts=4, num_experts_per_tok=2, rope_parameters=dict(
          rope_type="yarn", rope_theta=150000.0, factor=4.0, original_max_position_embeddings=16,
          beta_fast=32.0, beta_slow=1.0, truncate=False))


FAMILIES = {
    "llama": (_llama, "LlamaForCausalLM"),
    "mistral": (_mistral, "MistralForCausalLM"),
    "deepseek_v3": (_deepseek_v3, "DeepseekV3ForCausalLM"),
    "deepseek_v32": (_deepseek_v32, "DeepseekV32ForCausalLM"),
    "qwen3_next": (_qwen3_next, "Qwen3NextForCausalLM"),
    "gpt_oss": (_gpt_oss, "GptOssForCausalLM"),
}


def _hf_model(config_fn, cls_name):
  torch.manual_seed(0)
  config = config_fn()
  config._attn_implementation = "eager"
  model = getattr(transformers, cls_name)(config).eval()
  with torch.no_grad():  # make norm scales and correction biases matter
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1 + 0.2 * torch.randn_like(p))
      if name.endswith(("sinks", "router.bias", "_bias")):   # gpt-oss: sinks and biases matter
        p.copy_(torch.randn_like(p))
    for name, b in model.named_buffers():
      if name.endswith("e_score_correction_bias"):
        b.copy_(0.05 * torch.randn_like(b))
  return model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def converted(request, tmp_path_factory):
  config_fn, cls_name = FAMILIES[request.param]
  theirs = _hf_model(config_fn, cls_name)
  path = tmp_path_factory.mktemp(request.param)
  theirs.save_pretrained(path)
  return theirs, load_hf(str(path)), tmp_path_factory.mktemp(request.param + "_export")


def _hf_logits(model, ids):
  with torch.no_grad():
    return model(torch.from_numpy(np.asarray(ids))).logits.numpy()


@nnx.jit
def _forward(model, tokens):
  return model(tokens)


@nnx.jit
def _step(model, tokens, cache):
  logits, cache = model(tokens, cache=cache)
  return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache


def _greedy(model, prompt, steps):
  """Greedy decoding through the cache, one token per call: the prompt is fed token by token too,
  so a single compiled step serves prefill and decode."""
  cache = model.init_cache(prompt.shape[0], prompt.shape[1] + steps)
  prompt = jnp.asarray(prompt, jnp.int32)
  for t in range(prompt.shape[1]):
    token, cache = _step(model, prompt[:, t:t + 1], cache)
  out = [token]
  for _ in range(steps - 1):
    token, cache = _step(model, token[:, None], cache)
    out.append(token)
  return np.stack([np.asarray(t) for t in out], axis=1)


def _check_logits(got, want):
  err = np.abs(np.asarray(got) - want).max()
  assert err <= 1e-4 * np.abs(want).max(), (err, np.abs(want).max())


def test_logits_match(converted):
  theirs, ours, _ = converted
  # The config object reads as config.json.  transformers' DeepSeek-V3 config states one MTP layer
  # (its default) that its model and save_pretrained leave out: load_hf keeps what the weights hold.
  assert config_from_hf(theirs.config, mtp_depth=0) == ours.config
  ids = np.random.default_rng(0).integers(0, VOCAB, (2, 24))
  _check_logits(_forward(ours, jnp.asarray(ids)), _hf_logits(theirs, ids))


def test_greedy_generation_matches(converted):
  theirs, ours, _ = converted
  prompt = np.random.default_rng(1).integers(0, VOCAB, (2, PROMPT))
  with torch.no_grad():
    want = theirs.generate(torch.from_numpy(prompt), attention_mask=torch.ones(prompt.shape,
                                                                                 dtype=torch.long),
                           max_new_tokens=NEW, do_sample=False)
  want = want.numpy()[:, PROMPT:]
  got = _greedy(ours, prompt, NEW)
  np.testing.assert_array_equal(got, want)
  assert len(np.unique(want)) > 2  # the generation is not one repeated token


def test_round_trip(converted):
  theirs, ours, out_dir = converted
  save_hf(ours, str(out_dir))
  back = transformers.AutoModelForCausalLM.from_pretrained(str(out_dir)).eval()
  ids = np.random.default_rng(2).integers(0, VOCAB, (1, 16))
  _check_logits(_hf_logits(back, ids), _hf_logits(theirs, ids))


def test_mxfp4_dequantization_matches_transformers():
  """The published gpt-oss experts' MXFP4 (blocks + E8M0 scales) against transformers' own
  dequantization, in the layout its ``GptOssExperts`` uses (``[E, D, 2F]``)."""
  from transformers.integrations.mxfp4 import convert_moe_packed_tensors

  from jaxattn.convert.gpt_oss import _MXFP4Tensor
  rng = np.random.default_rng(7)
  blocks = rng.integers(0, 256, (3, 10, 4, 16), dtype=np.uint8)     # E, 2F, D/32, 16
  scales = rng.integers(110, 140, (3, 10, 4), dtype=np.uint8)
  want = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                    dtype=torch.float32).numpy()
  got = np.asarray(_MXFP4Tensor(blocks, scales))
  assert got.shape == want.shape == (3, 128, 10)
  np.testing.assert_array_equal(got, want)


def test_gpt_oss_mxfp4_export_loads_in_transformers(tmp_path):
  """A gpt-oss model whose experts we quantized to MXFP4 (``DecoderLM.quantize_experts``) saves
  as transformers' MXFP4 checkpoint (codes, scales and ``quantization_config``): transformers
  loads it (dequantizing, on CPU) to the same logits, and so do we, keeping the codes."""
  config = transformers.GptOssConfig(
      **dict(COMMON, hidden_size=64), intermediate_size=64, num_attention_heads=4,
      num_key_value_heads=2, head_dim=16, sliding_window=6, num_local_experts=4,
      num_experts_per_tok=2)
  theirs = _hf_model(lambda: config, "GptOssForCausalLM")
  theirs.save_pretrained(tmp_path / "dense")
  ours = load_hf(str(tmp_path / "dense"))
  ours.quantize_experts()
  assert ours.config.moe_expert_format == "mxfp4"
  save_hf(ours, str(tmp_path / "mxfp4"))
  back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "mxfp4")).eval()
  ids = np.random.default_rng(3).integers(0, VOCAB, (1, 16))
  want = np.asarray(_hf_logits(back, ids), np.float32)
  _check_logits(_forward(ours, jnp.asarray(ids)), want)
  kept = load_hf(str(tmp_path / "mxfp4"), moe_expert_format="mxfp4")
  np.testing.assert_array_equal(kept.moe_sites()[0].w_gate.codes[...],
                                ours.moe_sites()[0].w_gate.codes[...])
