"""Conversion without transformers: the layout rules are exact inverses, the orbax checkpoint
round-trips, sharded loading puts every parameter on its shards, and bad input raises.

Configs are ``config.json``-style dicts; state dicts come from ``to_hf`` of a randomly initialized
``DecoderLM`` (the transformers side is covered by tests/hf/test_convert_hf.py).
"""

import copy

import jax
import numpy as np
import pytest
from flax import nnx

from jaxattn.convert.hf import _FAMILIES, abstract_state
from jaxattn.convert import (config_from_hf, load_checkpoint, model_from_state, save_checkpoint,
                             state_from_hf, to_hf)
from jaxattn.sharding import make_mesh, param_shardings

SMALL = dict(vocab_size=32, hidden_size=16, num_hidden_layers=2, max_position_embeddings=64,
             rms_norm_eps=1e-6, tie_word_embeddings=False)
CONFIGS = {
    "llama": dict(SMALL, architectures=["LlamaForCausalLM"], intermediate_size=24,
                  num_attention_heads=4, num_key_value_heads=2, attention_bias=True, mlp_bias=True,
                  rope_parameters=dict(rope_type="linear", rope_theta=500.0, factor=2.0)),
    "mistral": dict(SMALL, architectures=["MistralForCausalLM"], intermediate_size=24,
                    num_attention_heads=4, num_key_value_heads=1, sliding_window=4,
                    tie_word_embeddings=True),
    "deepseek_v3": dict(SMALL, architectures=["DeepseekV3ForCausalLM"], intermediate_size=24,
                        moe_intermediate_size=8, num_attention_heads=2, n_routed_experts=4,
                        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                        n_group=2, topk_group=1, kv_lora_rank=8, q_lora_rank=None,
                        qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=6,
                        routed_scaling_factor=2.5, rope_interleave=False),
    "deepseek_v32": dict(SMALL, architectures=["DeepseekV32ForCausalLM"], intermediate_size=24,
                         moe_intermediate_size=8, num_attention_heads=2, n_routed_experts=4,
                         num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                         n_group=1, topk_group=1, kv_lora_rank=8, q_lora_rank=12,
                         qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=6, index_topk=4,
                         index_head_dim=8, index_n_heads=2),
    "qwen3_next": dict(SMALL, architectures=["Qwen3NextForCausalLM"], intermediate_size=24,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                       linear_num_value_heads=4, linear_key_head_dim=4, linear_value_head_dim=2,
                       linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=8, shared_expert_intermediate_size=12,
                       attention_bias=True,
                       rope_parameters=dict(rope_theta=1e4, partial_rotary_factor=0.5)),
    "gpt_oss": dict(SMALL, architectures=["GptOssForCausalLM"], intermediate_size=8,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=4, sliding_window=3,
                    layer_types=["sliding_attention", "full_attention"], num_local_experts=4,
                    num_experts_per_tok=2, swiglu_limit=5.0),
}


def _random_model(config, seed=0):
  """A DecoderLM with every variable drawn from N(0, 1) in NumPy (eager initialization would
  compile each initializer op separately, seconds per model)."""
  rng = np.random.default_rng(seed)
  graphdef, state = abstract_state(config)
  for _, var in nnx.to_flat_state(state):
    shape = var.get_value().shape
    var.set_value(jax.numpy.asarray(rng.standard_normal(shape).astype(np.float32)))
  return nnx.merge(graphdef, state)


def _model(name, seed=0):
  return _random_model(config_from_hf(CONFIGS[name]), seed)


def _leaves(model):
  return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_export_then_import_is_exact(name):
  ours = _model(name)
  if name in ("qwen3_next", "gpt_oss"):  # no tensor for our ranking-only router bias: zero it
    for moe in ours.moe_sites():
      moe.router_bias[...] = np.zeros(moe.router_bias.shape, np.float32)
  hf_config, sd = to_hf(ours)
  assert config_from_hf(hf_config) == ours.config
  back = model_from_state(ours.config, state_from_hf(sd, ours.config))
  want, got = _leaves(ours), _leaves(back)
  assert want.keys() == got.keys()
  for p in want:
    if name == "qwen3_next" and p[-1] == "scale":
      # Qwen3-Next stores norm scales as w with the norm computing 1 + w: (s - 1) + 1 rounds
      # to within an ulp of 1 (importing a transformers checkpoint, 1 + w, is exact).
      np.testing.assert_allclose(got[p], want[p], rtol=0, atol=2 ** -23, err_msg=str(p))
    else:
      np.testing.assert_array_equal(got[p], want[p], err_msg=str(p))


def test_checkpoint_round_trip_and_sharded_restore(tmp_path):
  ours = _model("deepseek_v3")
  save_checkpoint(ours, str(tmp_path / "ckpt"))
  back = load_checkpoint(str(tmp_path / "ckpt"))
  assert back.config == ours.config
  want = _leaves(ours)
  for p, v in _leaves(back).items():
    np.testing.assert_array_equal(v, want[p], err_msg=str(p))

  mesh = make_mesh({"fsdp": 2, "tensor": 2, "expert": 2})
  sharded = load_checkpoint(str(tmp_path / "ckpt"), mesh=mesh)
  _check_on_shards(sharded, mesh, want)


def test_state_from_hf_places_parameters_on_the_mesh():
  ours = _model("qwen3_next")
  for moe in ours.moe_sites():  # not in the Qwen3-Next checkpoint: loads as zeros
    moe.router_bias[...] = np.zeros(moe.router_bias.shape, np.float32)
  _, sd = to_hf(ours)
  mesh = make_mesh({"fsdp": 2, "tensor": 2, "expert": 2})
  placed = model_from_state(ours.config, state_from_hf(sd, ours.config, mesh=mesh))
  unplaced = model_from_state(ours.config, state_from_hf(sd, ours.config))
  _check_on_shards(placed, mesh, _leaves(unplaced))


def _check_on_shards(model, mesh, want):
  shardings = dict(nnx.to_flat_state(param_shardings(nnx.state(model), mesh)))
  split = 0
  for p, var in nnx.to_flat_state(nnx.state(model)):
    value = var.get_value()
    assert value.sharding.is_equivalent_to(shardings[p], value.ndim), p
    split += value.addressable_shards[0].data.shape != value.shape
    np.testing.assert_array_equal(np.asarray(value), want[p], err_msg=str(p))
  assert split > 0  # some parameters really are split across devices


# -- errors -------------------------------------------------------------------------------------

def _with(name, **changes):
  d = copy.deepcopy(CONFIGS[name])
  d.update(changes)
  return d


@pytest.mark.parametrize("config, match", [
    (dict(CONFIGS["llama"], architectures=["GPT2LMHeadModel"]), "GPT2LMHeadModel"),
    ({"model_type": "gpt2"}, "model_type.*gpt2"),
    (_with("llama", quantization_config={"bits": 4}), "quantization_config"),
    (_with("llama", rope_parameters=dict(rope_type="longrope", rope_theta=1e4)), "longrope"),
    (_with("llama", hidden_act="gelu"), "hidden_act.*gelu"),
    (_with("llama", rope_parameters=dict(rope_theta=1e4, partial_rotary_factor=0.5)),
     "partial_rotary_factor"),
    (_with("deepseek_v3", attention_bias=True), "attention_bias"),
    (_with("deepseek_v3", scoring_func="softmax"), "scoring_func"),
    (_with("deepseek_v3", rms_norm_eps=1e-3), "rms_norm_eps"),
    (_with("qwen3_next", mlp_only_layers=[1]), "dense prefix"),
    (_with("qwen3_next", linear_conv_kernel_dim=3), "linear_conv_kernel_dim"),
    (_with("qwen3_next", layer_types=["linear_attention", "sliding_attention"]), "layer_types"),
    (_with("qwen3_next", layer_types=None, full_attention_interval=0),   # (% 0)
     "`full_attention_interval` must be an int >= 1, got 0"),
    (_with("qwen3_next", decoder_sparse_step=0), "`decoder_sparse_step` must be an int >= 1"),
    ({k: v for k, v in CONFIGS["llama"].items() if k != "vocab_size"},   # (a KeyError)
     "LlamaForCausalLM: the config has no field 'vocab_size'"),
])
def test_unsupported_configs_raise(config, match):
  with pytest.raises(ValueError, match=match):
    config_from_hf(config)


def test_top_level_rope_theta_fills_a_rope_parameters_dict_without_one():
  """transformers reads {"rope_type": "default"} beside rope_theta=5e5 as base 5e5 (it was 1e4)."""
  d = _with("llama", rope_theta=5e5, rope_parameters=dict(rope_type="default"))
  assert config_from_hf(d).rope_base == 5e5
  d["rope_parameters"]["rope_theta"] = 300.0          # the dict's own value wins
  assert config_from_hf(d).rope_base == 300.0


def test_state_dict_errors_name_the_tensor():
  ours = _model("llama")
  _, sd = to_hf(ours)
  cfg = ours.config
  bad = dict(sd)
  bad["model.layers.1.self_attn.k_proj.weight"] = np.zeros((12, 16), np.float32)  # 3 KV heads
  with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.k_proj\.weight` has shape "
                                       r"\(12, 16\).*implies \(8, 16\).*layers/1/mixer/k_proj"):
    state_from_hf(bad, cfg)
  bad = dict(sd)
  bad["model.layers.0.mlp.up_proj.weight"] = np.zeros((25, 16), np.float32)
  with pytest.raises(ValueError,
                     match=r"up_proj\.weight` has shape \(25, 16\).*\(24, 16\).*ffn/up"):
    state_from_hf(bad, cfg)
  bad = dict(sd)
  del bad["model.layers.0.self_attn.q_proj.bias"]
  with pytest.raises(ValueError, match=r"q_proj\.bias` is missing"):
    state_from_hf(bad, cfg)
  bad = dict(sd, **{"model.layers.0.self_attn.extra.weight": np.zeros(3, np.float32)})
  with pytest.raises(ValueError, match=r"extra\.weight"):
    state_from_hf(bad, cfg)
  bad = dict(sd, **{"model.layers.2.input_layernorm.weight": np.zeros(16, np.float32)})
  with pytest.raises(ValueError, match=r"layers\.2\.input_layernorm"):  # a layer too many
    state_from_hf(bad, cfg)


def test_deepseek_multi_token_prediction_layers_are_skipped():
  """Under a config without MTP modules (``mtp_depth=0``) the MTP layers are skipped."""
  ours = _model("deepseek_v3")
  _, sd = to_hf(ours)
  sd["model.layers.2.eh_proj.weight"] = np.zeros((16, 32), np.float32)  # MTP layer (layer L)
  back = model_from_state(ours.config, state_from_hf(sd, ours.config))
  np.testing.assert_array_equal(np.asarray(back.embed.get_value()),
                                np.asarray(ours.embed.get_value()))


def test_qwen3_next_multi_token_prediction_and_empty_tensors_are_skipped():
  """Published Qwen3-Next checkpoints hold an ``mtp.*`` module, and transformers saves zero-width
  shared experts; transformers skips both, and so does the import under a config without MTP
  modules (``mtp_depth=0``: config_from_hf of a config that states none)."""
  ours = _model("qwen3_next")
  for moe in ours.moe_sites():
    moe.router_bias[...] = np.zeros(moe.router_bias.shape, np.float32)
  _, sd = to_hf(ours)
  sd["mtp.fc.weight"] = np.zeros((16, 32), np.float32)
  sd["mtp.layers.0.input_layernorm.weight"] = np.zeros(16, np.float32)
  sd["model.layers.1.mlp.shared_expert.extra.weight"] = np.zeros((0, 16), np.float32)
  back = model_from_state(ours.config, state_from_hf(sd, ours.config))
  for p, v in _leaves(back).items():  # exact up to the (1 + w) norm storage's rounding
    np.testing.assert_allclose(v, _leaves(ours)[p], rtol=0, atol=1e-6, err_msg=str(p))
  sd["model.layers.1.mlp.shared_expert.extra.weight"] = np.zeros((1, 16), np.float32)
  with pytest.raises(ValueError, match=r"shared_expert\.extra\.weight.*have no place"):
    state_from_hf(sd, ours.config)


def test_export_refuses_what_the_family_cannot_express():
  ours = _model("qwen3_next")  # random, so its router biases are not zero
  with pytest.raises(ValueError, match="router_bias.*not zero"):
    to_hf(ours)
  mhc = _random_model(config_from_hf(CONFIGS["llama"]).replace(residual="mhc"))
  with pytest.raises(ValueError, match="residual"):
    to_hf(mhc)


def _hf_config(cfg, architecture):
  """The transformers config export writes for ``cfg`` (no model needed)."""
  return _FAMILIES[architecture].config_to_hf(cfg, architecture)


@pytest.mark.parametrize("name, changes", [
    ("qwen3_next", dict(moe_routed_scaling_factor=2.5)),
    ("qwen3_next", dict(moe_n_group=2, moe_topk_group=1)),
    ("qwen3_next", dict(logits_soft_cap=2.0)),
    ("qwen3_next", dict(position="none")),
    ("qwen3_next", dict(moe_capacity_factor=0.5)),
    ("deepseek_v3", dict(moe_capacity_factor=0.5)),
    ("deepseek_v3", dict(gated_mlp=False, num_experts=0)),  # (MoE layers refuse it themselves)
    ("deepseek_v3", dict(norm="layer")),
    ("deepseek_v32", dict(norm_eps=1e-2)),
    ("deepseek_v3", dict(norm_eps=1e-2)),   # transformers' latent norms use a fixed 1e-6
    ("deepseek_v32", dict(index_rope_dim=1)),
    ("deepseek_v32", dict(dsa_attention_mode="dense")),
    ("llama", dict(logits_soft_cap=2.0)),
    ("llama", dict(gated_mlp=False)),
    ("llama", dict(attention_sinks=True)),
    ("qwen3_next", dict(moe_activation="clamped_swiglu")),
    ("qwen3_next", dict(moe_expert_bias=True)),
    ("gpt_oss", dict(attention_sinks=False)),
    ("gpt_oss", dict(moe_router_bias=False)),
])
def test_export_refuses_configs_the_family_would_load_differently(name, changes):
  """Each of these exported silently, as a checkpoint transformers loads as another model."""
  cfg = config_from_hf(CONFIGS[name]).replace(**changes)
  field = next(iter(changes))
  with pytest.raises(ValueError, match=f"has no .* equivalent: .*'{field}'"):
    _hf_config(cfg, CONFIGS[name]["architectures"][0])


def test_gpt_oss_config_and_quantized_experts():
  """Its window counts the query (ours is one less), its layers alternate from the default
  ``layer_types``; MXFP4 expert tensors (as published) load as their dequantized values."""
  from jaxattn.ops.mxfp4 import FP4_VALUES, dequantize_mxfp4_host as dequantize_mxfp4
  d = dict(CONFIGS["gpt_oss"])
  del d["layer_types"]
  cfg = config_from_hf(dict(d, num_hidden_layers=4))
  assert cfg.layer_pattern == "SASA" and cfg.sliding_window == 2 and cfg.attention_sinks
  assert cfg.moe_activation == "clamped_swiglu" and cfg.moe_swiglu_limit == 5.0
  ours = _model("gpt_oss")
  for moe in ours.moe_sites():
    moe.router_bias[...] = np.zeros(moe.router_bias.shape, np.float32)
  _, state = to_hf(ours)
  rng = np.random.default_rng(5)
  quantized, want = dict(state), dict(state)
  for i in range(2):
    e = f"model.layers.{i}.mlp.experts"
    for name, rows, cols in (("gate_up_proj", 16, 16), ("down_proj", 16, 8)):
      # [E, D, 2F] (x @ W) is stored as [E, 2F, D/32, 16] bytes: rows = 2F, cols = D here
      blocks = rng.integers(0, 256, (4, rows, 1, cols // 2), dtype=np.uint8)
      scales = rng.integers(124, 130, (4, rows, 1), dtype=np.uint8)
      del quantized[e + "." + name]
      quantized[f"{e}.{name}_blocks"], quantized[f"{e}.{name}_scales"] = blocks, scales
      want[f"{e}.{name}"] = np.swapaxes(dequantize_mxfp4(blocks, scales), 1, 2)
  cfg = config_from_hf(CONFIGS["gpt_oss"])
  got, ref = _leaves(model_from_state(cfg, state_from_hf(quantized, cfg))), _leaves(
      model_from_state(cfg, state_from_hf(want, cfg)))
  for p in ref:
    np.testing.assert_array_equal(got[p], ref[p], err_msg=str(p))
  # the format itself: byte 0x2F is the low nibble 0xF (-6.0), then the high one 0x2 (1.0), both
  # times 2^(128 - 127)
  np.testing.assert_array_equal(
      dequantize_mxfp4(np.array([[[0x2F]]], np.uint8), np.array([[128]], np.uint8)),
      [[-12.0, 2.0]])
  assert FP4_VALUES[0x7] == 6.0 and FP4_VALUES[0xF] == -6.0
  with pytest.raises(ValueError, match="MXFP4 wants uint8"):
    dequantize_mxfp4(np.zeros((2, 4), np.float32), np.zeros((2,), np.uint8))


# gpt-oss-20b's published config.json (its fields and values)
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
    "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
    "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05, "rope_scaling": {
        "beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
        "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
    "swiglu_limit": 7.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.55.0", "use_cache": True, "vocab_size": 201088}


def test_gpt_oss_20b_config_is_the_preset_and_fits_in_mxfp4():
  """The published config reads as the full ``gpt-oss`` preset; with its experts kept in MXFP4
  the model's weights take 14.4 GB (bf16 elsewhere) instead of 41.8 GB all in bf16 (counted on
  the abstract model: nothing is allocated)."""
  from jaxattn.configs import get_config
  from jaxattn.nn.model import DecoderLM
  from jaxattn.ops.rope import RopeScaling
  cfg = config_from_hf(GPT_OSS_20B, dtype="bfloat16", scan_layers=True, remat="dots_no_batch",
                       moe_seq_balance_alpha=0.0)
  preset = get_config("gpt-oss", "full")
  # the same layers (the preset repeats "SA") and the same YaRN (the preset omits defaults)
  assert [cfg.layer_kind(i) for i in range(24)] == [preset.layer_kind(i) for i in range(24)]
  assert RopeScaling(**cfg.rope_scaling) == RopeScaling(**preset.rope_scaling)
  assert cfg.replace(layer_pattern="SA", rope_scaling=preset.rope_scaling) == preset.replace(
      param_dtype="bfloat16")

  def gigabytes(c):
    model = nnx.eval_shape(lambda: DecoderLM(c, rngs=nnx.Rngs(0)))
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model))) / 1e9
  dense, mxfp4 = gigabytes(cfg), gigabytes(cfg.replace(moe_expert_format="mxfp4"))
  # (13.8 GB at exactly 4.25 bits per expert weight; the codes' rows of 1440 bytes are padded to
  # 1536, whole TPU lane tiles: see jaxattn.ops.mxfp4.code_width)
  assert abs(dense - 41.8) < 0.1 and abs(mxfp4 - 14.4) < 0.1, (dense, mxfp4)


def test_gpt_oss_mxfp4_experts_kept_as_stored():
  """``moe_expert_format="mxfp4"`` keeps a checkpoint's MXFP4 experts as they are (the export
  writes them back with transformers' ``quantization_config``; codes and scales move bit for
  bit), while the default format dequantizes them: both models compute the same logits."""
  from jaxattn.nn.moe import QuantizedData
  d = dict(CONFIGS["gpt_oss"], hidden_size=32, intermediate_size=32, head_dim=8)
  cfg_q = config_from_hf(d).replace(moe_expert_format="mxfp4")
  rng = np.random.default_rng(3)
  graphdef, state = abstract_state(cfg_q)
  for path, var in nnx.to_flat_state(state):
    shape = var.get_value().shape
    if isinstance(var, QuantizedData):   # codes anywhere, scales near 2^0
      hi, lo = (256, 0) if path[-1] == "codes" else (131, 122)
      vals = rng.integers(lo, hi, shape)
      if path[-1] == "codes":   # every expert matrix has K = 32: bytes past 16 are row padding
        vals[..., 16:] = 0
      var.set_value(jax.numpy.asarray(vals, jax.numpy.uint8))
    else:
      var.set_value(jax.numpy.asarray(rng.standard_normal(shape).astype(np.float32)))
  ours = nnx.merge(graphdef, state)
  for moe in ours.moe_sites():
    moe.router_bias[...] = np.zeros(moe.router_bias.shape, np.float32)
  hf_config, sd = to_hf(ours)
  assert hf_config["quantization_config"]["quant_method"] == "mxfp4"
  blocks = sd["model.layers.1.mlp.experts.gate_up_proj_blocks"]
  assert blocks.dtype == np.uint8 and blocks.shape == (4, 64, 1, 16)
  assert config_from_hf(hf_config, moe_expert_format="mxfp4") == cfg_q
  back = model_from_state(cfg_q, state_from_hf(sd, cfg_q))
  want, got = _leaves(ours), _leaves(back)
  for p in want:
    assert got[p].dtype == want[p].dtype
    np.testing.assert_array_equal(got[p], want[p], err_msg=str(p))
  cfg = config_from_hf(hf_config)                      # the default: dequantized on reading
  assert cfg.moe_expert_format == "dense"
  dense = model_from_state(cfg, state_from_hf(sd, cfg))
  np.testing.assert_array_equal(dense.moe_sites()[0].w_up[...],
                                ours.moe_sites()[0].w_up.dequantize())
  ids = jax.numpy.asarray(np.random.default_rng(4).integers(0, 32, (1, 6)))
  np.testing.assert_allclose(back(ids), dense(ids), rtol=1e-5, atol=1e-5)
  _, sd_dense = to_hf(dense)
  with pytest.raises(ValueError, match="moe_expert_format='mxfp4' reads MXFP4"):
    state_from_hf(sd_dense, cfg_q)


def test_dynamic_rope_exports_its_trained_length():
  """transformers reads ``max_position_embeddings`` as dynamic NTK's trained length, so that is
  what export writes, whatever cache length ``max_seq_len`` asks for."""
  d = _with("llama", rope_parameters=dict(rope_type="dynamic", rope_theta=1e4, factor=2.0))
  cfg = config_from_hf(d, max_seq_len=4096)
  assert cfg.rope_scaling["original_max_position_embeddings"] == 64
  back = _hf_config(cfg, "LlamaForCausalLM")
  assert back["max_position_embeddings"] == 64
  assert config_from_hf(back).rope_scaling == cfg.rope_scaling


@pytest.mark.parametrize("name", ["deepseek_v3", "qwen3_next"])
def test_fused_expert_tensors_load_like_per_expert_ones(name):
  """In-memory transformers models fuse experts (``gate_up_proj [E, 2F, D]``: gate rows then up
  rows; ``down_proj [E, D, F]``); checkpoints on disk keep one tensor per expert."""
  ours = _model(name)
  cfg = ours.config
  for moe in ours.moe_sites():  # exportable to either family
    moe.router_bias[...] = np.zeros(moe.router_bias.shape, np.float32)
  _, sd = to_hf(ours)
  fused = dict(sd)
  for i in range(cfg.first_k_dense, cfg.num_layers):
    prefix = f"model.layers.{i}.mlp.experts"
    per = lambda e, n: fused.pop(f"{prefix}.{e}.{n}_proj.weight")  # noqa: E731
    gate_up, down = [], []
    for e in range(cfg.num_experts):
      gate_up.append(np.concatenate([per(e, "gate"), per(e, "up")], axis=0))
      down.append(per(e, "down"))
    fused[f"{prefix}.gate_up_proj"] = np.stack(gate_up)
    fused[f"{prefix}.down_proj"] = np.stack(down)
  want = _leaves(model_from_state(cfg, state_from_hf(sd, cfg)))
  got = _leaves(model_from_state(cfg, state_from_hf(fused, cfg)))
  for p in want:
    np.testing.assert_array_equal(got[p], want[p], err_msg=str(p))


@pytest.mark.parametrize("preset, architecture, published", [
    ("gpt-oss", "GptOssForCausalLM", dict(
        num_hidden_layers=24, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
        num_key_value_heads=8, head_dim=64, intermediate_size=2880,
        layer_types=["sliding_attention", "full_attention"] * 2, rope_parameters=dict(
            rope_theta=150000.0, rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
            truncate=False, original_max_position_embeddings=4096))),
    ("mistral", "MistralForCausalLM", dict(sliding_window=4096, num_key_value_heads=8,
                                           intermediate_size=14336)),
    ("qwen3-next", "Qwen3NextForCausalLM", dict(
        num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, linear_num_key_heads=16, linear_num_value_heads=32,
        head_dim=256, num_key_value_heads=2, layer_types=["linear_attention"] * 3
        + ["full_attention"], partial_rotary_factor=0.25)),
    ("deepseek-v3", "DeepseekV3ForCausalLM", dict(
        n_routed_experts=256, n_group=8, topk_group=4, routed_scaling_factor=2.5,
        first_k_dense_replace=3, kv_lora_rank=512, q_lora_rank=1536)),
    # YaRN x40 over 4096 positions, as published (the indexer rotates with it too)
    ("deepseek-v3.2", "DeepseekV32ForCausalLM", dict(
        n_routed_experts=256, index_n_heads=64, index_head_dim=128, index_topk=2048,
        first_k_dense_replace=3, kv_lora_rank=512, max_position_embeddings=163840)),
    ("llama", "LlamaForCausalLM", dict(
        num_hidden_layers=32, num_key_value_heads=8, intermediate_size=14336,
        rope_parameters=dict(rope_theta=500000.0, rope_type="llama3", factor=8.0,
                             original_max_position_embeddings=8192, low_freq_factor=1.0,
                             high_freq_factor=4.0))),
])
def test_full_presets_export_the_published_architecture(preset, architecture, published):
  from jaxattn.configs import get_config
  d = _hf_config(get_config(preset, size="full"), architecture)
  d["partial_rotary_factor"] = d.get("rope_parameters", {}).get("partial_rotary_factor")
  d["layer_types"] = (d.get("layer_types") or [])[:4]
  assert {k: d[k] for k in published} == published


def test_overrides_that_change_the_model_are_refused():
  """tie_embeddings=True over an untied checkpoint dropped its lm_head silently."""
  with pytest.raises(ValueError, match=r"overrides \['tie_embeddings'\] would change"):
    config_from_hf(CONFIGS["llama"], tie_embeddings=True)
  with pytest.raises(ValueError, match=r"overrides \['norm_eps', 'num_layers'\]"):
    config_from_hf(CONFIGS["llama"], num_layers=1, norm_eps=1e-3)
  cfg = config_from_hf(CONFIGS["llama"], max_seq_len=32, scan_layers=True, remat="dots",
                       tie_embeddings=False)   # runtime fields, and a value equal to the file's
  assert cfg.max_seq_len == 32 and cfg.scan_layers and not cfg.tie_embeddings


def test_export_fills_in_default_sizes_and_tanh_gelu():
  """Default DeltaNet head sizes were written as null (transformers refused the config); our
  "gelu" (jax.nn.gelu's tanh form) raised a KeyError."""
  cfg = config_from_hf(CONFIGS["qwen3_next"]).replace(deltanet_head_dim=None,
                                                      deltanet_v_head_dim=None)
  d = _hf_config(cfg, "Qwen3NextForCausalLM")
  assert d["linear_key_head_dim"] == d["linear_value_head_dim"] == 16 // 4
  d = _hf_config(config_from_hf(CONFIGS["llama"]).replace(mlp_activation="gelu"),
                 "LlamaForCausalLM")
  assert d["hidden_act"] == "gelu_pytorch_tanh"


def test_moe_experts_refuse_another_activation_and_a_gate_without_expert_is_skipped():
  """The routed experts are SwiGLU: a relu MoE checkpoint loaded with silently wrong logits.
  Qwen3-Next without a shared expert still saves a [1, D] shared_expert_gate (it gates zeros)."""
  with pytest.raises(ValueError, match="compute SwiGLU experts: `mlp_activation` must be 'silu'"):
    config_from_hf(dict(CONFIGS["deepseek_v3"], hidden_act="relu"))
  from jaxattn.convert.hf import _ignored
  no_shared = config_from_hf(dict(CONFIGS["qwen3_next"], shared_expert_intermediate_size=0))
  assert no_shared.num_shared_experts == 0
  assert _ignored("model.layers.1.mlp.shared_expert_gate.weight", no_shared)
  assert not _ignored("model.layers.1.mlp.shared_expert_gate.weight",
                      config_from_hf(CONFIGS["qwen3_next"]))


def test_save_checkpoint_refuses_an_existing_checkpoint_before_writing(tmp_path):
  model = _random_model(config_from_hf(CONFIGS["llama"]))
  save_checkpoint(model, str(tmp_path / "c"))
  before = (tmp_path / "c" / "config.json").read_text()
  other = _random_model(config_from_hf(dict(CONFIGS["llama"], num_hidden_layers=1)))
  with pytest.raises(ValueError, match="already holds a checkpoint"):
    save_checkpoint(other, str(tmp_path / "c"))
  assert (tmp_path / "c" / "config.json").read_text() == before
  assert load_checkpoint(str(tmp_path / "c")).config == model.config
