"""Llama and Mistral: GQA attention with half-split RoPE (and its scalings), RMSNorm, SwiGLU.

transformers rotates with ``rotate_half`` (pairs ``(x_i, x_{i+H/2})``): ``rope_interleaved=False``
with the weights as they are.  Mistral's ``sliding_window=w`` lets a query see ``w`` keys, itself
included (``kv_idx > q_idx - w``); our ``sliding_window`` counts the keys before it, so it is
``w - 1``.
"""

from __future__ import annotations

from typing import Any

from jaxattn.convert import common as C
from jaxattn.convert.rules import Rule, bias, copy, linear, linear_out

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral"}

_FIELDS = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
    "tie_word_embeddings", "rope_parameters", "rope_theta", "rope_scaling", "attention_bias",
    "pretraining_tp",  # a PyTorch matmul-splitting detail, no effect on the result
}
_LLAMA_FIELDS = _FIELDS | {"mlp_bias"}
_MISTRAL_FIELDS = _FIELDS | {"sliding_window"}


def config_from_hf(d: dict[str, Any], architecture: str) -> dict[str, Any]:
  """``ModelConfig`` keyword arguments for a Llama / Mistral config dict."""
  mistral = architecture == "MistralForCausalLM"
  C.check_fields(d, _MISTRAL_FIELDS if mistral else _LLAMA_FIELDS, architecture)
  heads = d["num_attention_heads"]
  rp = C.rope_parameters(d, architecture)
  C.require(rp, "partial_rotary_factor", (None, 1.0), architecture)
  window = d.get("sliding_window") if mistral else None
  if window is not None and (not isinstance(window, int) or window < 1):
    raise ValueError(f"{architecture}: `sliding_window` must be a positive int or None, got "
                     f"{window!r}.")
  return dict(
      vocab_size=d["vocab_size"], embed_dim=d["hidden_size"], num_layers=d["num_hidden_layers"],
      num_heads=heads, num_kv_heads=d.get("num_key_value_heads") or heads,
      head_dim=d.get("head_dim") or d["hidden_size"] // heads, mlp_dim=d["intermediate_size"],
      layer_pattern="A" if window is None else "S",
      sliding_window=None if window is None else window - 1,
      position="rope", rope_base=float(rp.get("rope_theta", 10000.0)), rope_interleaved=False,
      rope_scaling=C.rope_scaling(rp, d.get("max_position_embeddings"), architecture),
      max_seq_len=d.get("max_position_embeddings") or 2048,
      attention_bias=bool(d.get("attention_bias", False)),
      mlp_bias=bool(d.get("mlp_bias", False)), mlp_activation=C.activation(d, architecture),
      gated_mlp=True, norm="rms", norm_position="pre", norm_eps=d.get("rms_norm_eps", 1e-6),
      tie_embeddings=bool(d.get("tie_word_embeddings", False)))


def check_exportable(cfg, architecture: str) -> None:
  mistral = architecture == "MistralForCausalLM"
  want = "S" if mistral and cfg.sliding_window is not None else "A"
  C.check_exportable(
      cfg, architecture,
      layer_pattern=cfg.layer_pattern if set(cfg.layer_pattern) != {want} else None,
      rope_interleaved=cfg.rope_interleaved or None, rotary_dim=cfg.rotary_dim,
      num_experts=cfg.num_experts or None, attention_qk_norm=cfg.attention_qk_norm or None,
      attention_output_gate=cfg.attention_output_gate or None,
      mlp_bias=cfg.mlp_bias if mistral and cfg.mlp_bias else None)


def config_to_hf(cfg, architecture: str) -> dict[str, Any]:
  check_exportable(cfg, architecture)
  d = dict(
      architectures=[architecture], model_type=MODEL_TYPES[architecture],
      vocab_size=cfg.vocab_size, hidden_size=cfg.embed_dim, intermediate_size=cfg.mlp_dim,
      num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
      num_key_value_heads=cfg.num_kv_heads or cfg.num_heads,
      head_dim=cfg.head_dim or cfg.embed_dim // cfg.num_heads,
      hidden_act=C.ACTIVATIONS_TO_HF[cfg.mlp_activation],
      max_position_embeddings=C.max_position_embeddings(cfg),
      rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
      rope_parameters=C.rope_to_hf(cfg), attention_bias=cfg.attention_bias, dtype="float32")
  if architecture == "MistralForCausalLM":
    d["sliding_window"] = None if "S" not in cfg.layer_pattern else cfg.sliding_window + 1
  else:
    d["mlp_bias"] = cfg.mlp_bias
  return d


def attention_rules(cfg, layer, prefix: str, *, q_gate: bool = False) -> list[Rule]:
  """q/k/v/o projections (and biases) of ``self_attn`` at ``prefix`` <-> the attention of our
  layer ``layer`` (an index, or the path of a ``DecoderLayer``: an MTP module's block)."""
  m = (C.layer(layer) if isinstance(layer, int) else tuple(layer)) + ("mixer",)
  rules = [] if q_gate else [linear(f"{prefix}.q_proj.weight", m + ("q_proj", "kernel"))]
  rules += [linear(f"{prefix}.k_proj.weight", m + ("k_proj", "kernel")),
            linear(f"{prefix}.v_proj.weight", m + ("v_proj", "kernel")),
            linear_out(f"{prefix}.o_proj.weight", m + ("o_proj", "kernel"))]
  if cfg.attention_bias:
    names = ("k", "v", "o") if q_gate else ("q", "k", "v", "o")
    rules += [bias(f"{prefix}.{n}_proj.bias", m + (f"{n}_proj", "bias")) for n in names]
  return rules


def mlp_rules(cfg, prefix: str, path: tuple) -> list[Rule]:
  """A SwiGLU MLP ``{prefix}.gate_proj/up_proj/down_proj`` <-> our ``MLP`` at ``path``."""
  rules = [linear(f"{prefix}.{hf}_proj.weight", path + (ours, "kernel"))
           for hf, ours in (("gate", "gate"), ("up", "up"), ("down", "down"))]
  if cfg.mlp_bias:
    rules += [bias(f"{prefix}.{hf}_proj.bias", path + (ours, "bias"))
              for hf, ours in (("gate", "gate"), ("up", "up"), ("down", "down"))]
  return rules


def head_rules(cfg) -> list[Rule]:
  """Embedding, final norm and (untied) LM head."""
  rules = [copy("model.embed_tokens.weight", ("embed",)),
           copy("model.norm.weight", ("final_norm", "scale"))]
  if not cfg.tie_embeddings:
    rules.append(linear("lm_head.weight", ("lm_head", "kernel")))
  return rules


def rules(cfg) -> list[Rule]:
  out = head_rules(cfg)
  for i in range(cfg.num_layers):
    p = f"model.layers.{i}"
    out += [copy(f"{p}.input_layernorm.weight", C.layer(i) + ("mixer_norm", "scale")),
            copy(f"{p}.post_attention_layernorm.weight", C.layer(i) + ("ffn_norm", "scale"))]
    out += attention_rules(cfg, i, f"{p}.self_attn")
    out += mlp_rules(cfg, f"{p}.mlp", C.layer(i) + ("ffn",))
  return out
