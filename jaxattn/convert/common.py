"""Config checks shared by the Hugging Face families: known fields, activations, RoPE parameters.

Every field of a transformers config must be understood: used, checked against the one value we
support, or known not to change the forward pass (dropout, token ids, initializer ranges).  Anything
else raises, so a checkpoint with a feature we do not implement never loads as a silently different
model.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping

from jaxattn.ops.rope import RopeScaling

# Fields every transformers config carries (``PreTrainedConfig().to_dict()``), and fields that do
# not change the logits of a forward pass.
GENERIC_FIELDS = frozenset({
    "_name_or_path", "architectures", "chunk_size_feed_forward", "dtype", "torch_dtype",
    "id2label", "label2id", "is_encoder_decoder", "model_type", "output_attentions",
    "output_hidden_states", "problem_type", "return_dict", "transformers_version",
    "initializer_range", "use_cache", "attention_dropout", "pad_token_id", "bos_token_id",
    "eos_token_id", "output_router_logits", "router_aux_loss_coef", "tokenizer_class",
    "_attn_implementation_autoset",
})

ROPE_FIELDS = frozenset({
    "rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
    "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate", "low_freq_factor",
    "high_freq_factor", "partial_rotary_factor",
})

# transformers' hidden_act -> our MLP activation.  Plain "gelu" is the exact erf form in PyTorch
# and is not read (we have no erf form); our "gelu" is jax.nn.gelu's default, the tanh
# approximation, so it exports as gelu_pytorch_tanh like "gelu_tanh".
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh",
               "gelu_new": "gelu_tanh", "relu": "relu"}
ACTIVATIONS_TO_HF = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu_pytorch_tanh",
                     "relu": "relu"}


def as_dict(hf_config) -> dict[str, Any]:
  """A transformers config object or a ``config.json`` dict, as a plain dict."""
  if isinstance(hf_config, Mapping):
    return dict(hf_config)
  if hasattr(hf_config, "to_dict"):
    return hf_config.to_dict()
  raise ValueError(f"`hf_config` must be a transformers config or a dict, got "
                   f"{type(hf_config).__name__}.")


def check_fields(d: Mapping[str, Any], known: Iterable[str], architecture: str) -> None:
  """Raises on any field that is neither generic nor in ``known``."""
  unknown = sorted(set(d) - GENERIC_FIELDS - set(known))
  if unknown:
    raise ValueError(f"{architecture}: config field(s) {unknown} are not understood by the "
                     f"converter (values: {[d[k] for k in unknown]}); refusing to build a model "
                     "that may differ from the checkpoint.")


def require(d: Mapping[str, Any], name: str, allowed, architecture: str, default=None) -> None:
  """Raises unless ``d[name]`` (or ``default`` when absent) is one of ``allowed``."""
  value = d.get(name, default)
  allowed = tuple(allowed) if isinstance(allowed, (list, tuple, set, frozenset)) else (allowed,)
  if value not in allowed:
    raise ValueError(f"{architecture}: config field `{name}`={value!r} is not supported; allowed: "
                     f"{list(allowed)}.")


def activation(d: Mapping[str, Any], architecture: str, key: str = "hidden_act") -> str:
  act = d.get(key, "silu")
  if act not in ACTIVATIONS:
    raise ValueError(f"{architecture}: `{key}`={act!r} is not supported; allowed: "
                     f"{sorted(ACTIVATIONS)}.")
  return ACTIVATIONS[act]


def rope_parameters(d: Mapping[str, Any], architecture: str) -> dict[str, Any]:
  """The RoPE dict of a config: transformers 5's ``rope_parameters``, or the older top-level
  ``rope_theta`` + ``rope_scaling`` (+ ``partial_rotary_factor``)."""
  rp = d.get("rope_parameters")
  rp = dict(d.get("rope_scaling") or {}) if rp is None else dict(rp)
  # The top-level fields fill what the dict leaves out, as transformers does (a rope_parameters
  # of {"rope_type": "default"} beside rope_theta=5e5 is base 5e5, not 1e4).
  rp.setdefault("rope_theta", d.get("rope_theta", 10000.0))
  if d.get("partial_rotary_factor") is not None:
    rp.setdefault("partial_rotary_factor", d["partial_rotary_factor"])
  unknown = sorted(set(rp) - ROPE_FIELDS)
  if unknown:
    raise ValueError(f"{architecture}: RoPE parameter(s) {unknown} are not understood.")
  return rp


def rope_scaling(rp: Mapping[str, Any], max_position_embeddings, architecture: str
                 ) -> dict[str, Any] | None:
  """Our ``ModelConfig.rope_scaling`` dict (``RopeScaling`` fields) or None for default RoPE."""
  kind = rp.get("rope_type", rp.get("type", "default"))
  allowed = ("default", "linear", "dynamic", "yarn", "llama3")
  if kind not in allowed:
    raise ValueError(f"{architecture}: RoPE `rope_type`={kind!r} is not supported; allowed: "
                     f"{list(allowed)}.")
  scaling = RopeScaling.from_hf(rp, max_position_embeddings=max_position_embeddings)
  return None if scaling is None else dataclasses.asdict(scaling)


def rope_to_hf(cfg) -> dict[str, Any]:
  """``rope_parameters`` for a transformers config, from our ``ModelConfig``."""
  rp: dict[str, Any] = {"rope_theta": float(cfg.rope_base), "rope_type": "default"}
  if cfg.rope_scaling is not None:
    s = RopeScaling(**cfg.rope_scaling)
    rp["rope_type"] = s.type
    rp["factor"] = s.factor
    if s.original_max_position_embeddings is not None and s.type != "dynamic":
      rp["original_max_position_embeddings"] = s.original_max_position_embeddings
    if s.type == "yarn":
      rp.update(beta_fast=s.beta_fast, beta_slow=s.beta_slow, truncate=s.truncate)
      for k in ("mscale", "mscale_all_dim", "attention_factor"):
        if getattr(s, k) is not None:
          rp[k] = getattr(s, k)
    if s.type == "llama3":
      rp.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor)
  return rp


def check_exportable(cfg, architecture: str, **family) -> None:
  """Raises unless ``architecture`` can express ``cfg``: what no family here can (other
  positions, norms or residuals, an ungated MLP, a logit soft-cap, a capacity-limited MoE) and
  ``family``'s own limits (name -> the offending value, None where the config is fine)."""
  common = dict(
      position=None if cfg.position == "rope" else cfg.position,
      norm=None if cfg.norm == "rms" and cfg.norm_position == "pre" else
      f"{cfg.norm}, {cfg.norm_position}-LN",
      residual=None if cfg.residual == "plain" else cfg.residual,
      gated_mlp=None if cfg.gated_mlp else False, logits_soft_cap=cfg.logits_soft_cap,
      moe_capacity_factor=cfg.moe_capacity_factor if cfg.num_experts else None,
      # gpt-oss's mechanisms (its family lifts these)
      attention_sinks=cfg.attention_sinks or None,
      moe_activation=None if cfg.moe_activation == "swiglu" or not cfg.num_experts else
      cfg.moe_activation,
      moe_expert_bias=(cfg.moe_expert_bias and cfg.num_experts > 0) or None,
      moe_router_bias=(cfg.moe_router_bias and cfg.num_experts > 0) or None)
  problems = {k: v for k, v in {**common, **family}.items() if v is not None}
  if problems:
    raise ValueError(f"this ModelConfig has no {architecture} equivalent: {problems}.")


def max_position_embeddings(cfg) -> int:
  """``max_position_embeddings`` for a transformers config: our ``max_seq_len``, except under
  dynamic-NTK RoPE, where transformers reads it as the trained length the base rescales from."""
  s = cfg.rope_scaling
  if s is not None and s.get("type") == "dynamic" and s.get("original_max_position_embeddings"):
    return int(s["original_max_position_embeddings"])
  return cfg.max_seq_len


def layer(i: int) -> tuple:
  """Path of layer ``i`` in an unscanned ``DecoderLM``'s state."""
  return ("groups", 0, "unit", "layers", i)
