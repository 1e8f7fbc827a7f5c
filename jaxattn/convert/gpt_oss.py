"""gpt-oss: GQA attention with learned sinks and biases, alternating sliding-window (128) and full
layers, YaRN RoPE, and a softmax-over-top-k MoE of clamped-SwiGLU experts with biases.

Layout differences from ours:
  * experts are fused: ``experts.gate_up_proj [E, D, 2F]`` (``x @ W``; gate and up columns
    interleaved, gate first) and ``gate_up_proj_bias [E, 2F]`` -> our ``w_gate`` / ``w_up``
    ``[E, D, F]`` and ``b_gate`` / ``b_up``; ``down_proj [E, F, D]`` and ``down_proj_bias`` as ours;
  * the router is ``router.weight [E, D]`` with ``router.bias`` (a bias on the logits);
  * a sliding window of ``W`` keys counts the query itself: our ``sliding_window`` is ``W - 1``;
  * attention sinks ``self_attn.sinks [N]``.
The published checkpoints store the expert matrices in MXFP4 (``gate_up_proj_blocks [E, 2F, D/32,
16]`` uint8, two FP4 E2M1 values per byte, low nibble first, and ``gate_up_proj_scales [E, 2F,
D/32]``, one E8M0 exponent per 32 values; ``down_proj_*`` likewise): ``normalize`` dequantizes
each one when it is read (``jaxattn.ops.mxfp4.dequantize_mxfp4_host``), into the unquantized
layout transformers' own models hold, which the converter also reads as is.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxattn.convert import common as C
from jaxattn.convert.llama import attention_rules, head_rules
from jaxattn.convert.rules import Rule, copy, linear, xp
from jaxattn.ops.mxfp4 import GROUP as MXFP4_GROUP, dequantize_mxfp4_host

ARCHITECTURES = ("GptOssForCausalLM",)

_FIELDS = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
    "tie_word_embeddings", "rope_parameters", "rope_theta", "rope_scaling", "sliding_window",
    "layer_types", "num_local_experts", "num_experts_per_tok", "swiglu_alpha", "swiglu_limit",
    "attention_bias", "experts_per_token", "initial_context_length", "quantization_config",
}
_KINDS = {"sliding_attention": "S", "full_attention": "A"}


def config_from_hf(d: dict[str, Any], architecture: str) -> dict[str, Any]:
  C.check_fields(d, _FIELDS, architecture)
  C.require(d, "attention_bias", True, architecture, True)
  quant = d.get("quantization_config")
  if quant is not None and (not isinstance(quant, dict) or quant.get("quant_method") != "mxfp4"):
    raise ValueError(f"{architecture}: `quantization_config` {quant!r} is not supported; the "
                     "published checkpoints' MXFP4 experts are (quant_method 'mxfp4').")
  layers, heads = d["num_hidden_layers"], d["num_attention_heads"]
  types = d.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                   for i in range(layers)]
  bad = sorted(set(types) - set(_KINDS))
  if bad or len(types) != layers:
    raise ValueError(f"{architecture}: `layer_types` must list {layers} entries of "
                     f"{sorted(_KINDS)}, got {types!r}.")
  window = d.get("sliding_window")
  if "sliding_attention" in types and (not isinstance(window, int) or window < 1):
    raise ValueError(f"{architecture}: sliding layers need an int `sliding_window` >= 1, got "
                     f"{window!r}.")
  rp = C.rope_parameters(d, architecture)
  if rp.get("partial_rotary_factor", 1.0) != 1.0:
    raise ValueError(f"{architecture}: partial RoPE is not part of gpt-oss.")
  return dict(
      vocab_size=d["vocab_size"], embed_dim=d["hidden_size"], num_layers=layers, num_heads=heads,
      num_kv_heads=d.get("num_key_value_heads") or heads,
      head_dim=d.get("head_dim") or d["hidden_size"] // heads, mlp_dim=d["intermediate_size"],
      layer_pattern="".join(_KINDS[t] for t in types), position="rope",
      rope_base=float(rp.get("rope_theta", 150000.0)), rope_interleaved=False,
      rope_scaling=C.rope_scaling(rp, d.get("max_position_embeddings"), architecture),
      max_seq_len=d.get("max_position_embeddings") or 2048,
      sliding_window=window - 1 if "sliding_attention" in types else None,
      attention_bias=True, attention_sinks=True, norm="rms", norm_position="pre",
      norm_eps=d.get("rms_norm_eps", 1e-5),
      tie_embeddings=bool(d.get("tie_word_embeddings", False)),
      num_experts=d["num_local_experts"],
      num_experts_per_tok=d.get("num_experts_per_tok", d.get("experts_per_token", 4)),
      moe_expert_dim=d["intermediate_size"], num_shared_experts=0, moe_score_func="softmax",
      moe_n_group=1, moe_topk_group=None, moe_norm_topk_prob=True, moe_routed_scaling_factor=1.0,
      moe_activation="clamped_swiglu", moe_swiglu_alpha=float(d.get("swiglu_alpha", 1.702)),
      moe_swiglu_limit=float(d.get("swiglu_limit", 7.0)), moe_expert_bias=True,
      moe_router_bias=True)


def config_to_hf(cfg, architecture: str) -> dict[str, Any]:
  """(A model whose experts are held in MXFP4 exports them as they are, with the
  ``quantization_config`` transformers reads them by.)"""
  moe = cfg.num_experts > 0
  C.check_exportable(
      cfg, architecture, attention_sinks=None if cfg.attention_sinks else False,
      attention_bias=None if cfg.attention_bias else False,
      layer_pattern=None if set(cfg.layer_pattern) <= set("AS") else cfg.layer_pattern,
      rope_interleaved=cfg.rope_interleaved or None, rotary_dim=cfg.rotary_dim,
      attention_qk_norm=cfg.attention_qk_norm or None,
      attention_output_gate=cfg.attention_output_gate or None,
      # every layer of gpt-oss is MoE with its expert options, a softmax over the top-k
      moe=None if moe and cfg.first_k_dense == 0 else (cfg.num_experts, cfg.first_k_dense),
      moe_activation=None if cfg.moe_activation == "clamped_swiglu" else cfg.moe_activation,
      moe_expert_bias=None if cfg.moe_expert_bias else False,
      moe_router_bias=None if cfg.moe_router_bias else False,
      moe_shared=cfg.num_shared_experts or None,
      moe_routing=None if (cfg.moe_score_func, cfg.moe_n_group, cfg.moe_norm_topk_prob,
                           cfg.moe_routed_scaling_factor) == ("softmax", 1, True, 1.0) else
      (cfg.moe_score_func, cfg.moe_n_group, cfg.moe_norm_topk_prob,
       cfg.moe_routed_scaling_factor),
      moe_expert_dim=None if (cfg.moe_expert_dim or cfg.mlp_dim) == cfg.mlp_dim else
      cfg.moe_expert_dim)
  types = [{"S": "sliding_attention", "A": "full_attention"}[cfg.layer_kind(i)[0]]
           for i in range(cfg.num_layers)]
  quant = {} if cfg.moe_expert_format == "dense" else {"quantization_config": dict(
      quant_method="mxfp4", modules_to_not_convert=[
          "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
          "lm_head"])}
  return dict(**quant,
      architectures=[architecture], model_type="gpt_oss", vocab_size=cfg.vocab_size,
      hidden_size=cfg.embed_dim, intermediate_size=cfg.mlp_dim, num_hidden_layers=cfg.num_layers,
      num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads or cfg.num_heads,
      head_dim=cfg.head_dim or cfg.embed_dim // cfg.num_heads,
      max_position_embeddings=C.max_position_embeddings(cfg), rms_norm_eps=cfg.norm_eps,
      tie_word_embeddings=cfg.tie_embeddings, rope_parameters=C.rope_to_hf(cfg),
      sliding_window=None if "S" not in cfg.layer_pattern else cfg.sliding_window + 1,
      layer_types=types, num_local_experts=cfg.num_experts,
      num_experts_per_tok=cfg.num_experts_per_tok, swiglu_alpha=cfg.moe_swiglu_alpha,
      swiglu_limit=cfg.moe_swiglu_limit, attention_bias=True, dtype="float32")


def _interleaved(hf: str, gate: tuple, up: tuple, axis: int = -1) -> Rule:
  """A tensor whose ``axis`` holds gate and up entries in turn (``2F``, gate first) <-> our gate
  and up tensors (``F`` there): the columns of ``gate_up_proj [E, D, 2F]`` (``axis=-1``) or the
  rows of its MXFP4 codes ``[E, 2F, D / 32, 16]`` (``axis=1``)."""
  def to_ours(w, *, shapes):
    lead = (slice(None),) * (axis % w.ndim)
    gates, ups = w[lead + (slice(0, None, 2),)], w[lead + (slice(1, None, 2),)]
    return gates.reshape(shapes[0]), ups.reshape(shapes[1])

  def to_hf(g, u):
    a = axis % g.ndim
    both = xp(g, u).stack([g, u], axis=a + 1)            # [..., F, 2, ...]
    return (both.reshape(g.shape[:a] + (2 * g.shape[a],) + g.shape[a + 1:]),)

  return Rule((hf,), (gate, up), to_ours, to_hf)


class _MXFP4Tensor:
  """An expert tensor stored as MXFP4 ``[E, R, G, B]`` + scales: ``[E, G * 2B, R]`` (the
  unquantized ``x @ W`` layout) when read, dequantized then, one tensor at a time."""

  def __init__(self, blocks, scales):
    self.blocks, self.scales = blocks, scales
    e, r, g, b = blocks.shape
    self.shape, self.dtype = (e, g * 2 * b, r), np.dtype(np.float32)

  def __array__(self, dtype=None, copy=None):
    out = np.ascontiguousarray(np.swapaxes(dequantize_mxfp4_host(self.blocks, self.scales), 1, 2))
    return out if dtype is None else out.astype(dtype)


def normalize(sd: dict, cfg) -> None:
  """The published checkpoints' MXFP4 expert tensors (``{name}_blocks`` + ``{name}_scales``) as
  ``{name}``, dequantized when the converter reads them -- unless the model keeps its experts in
  MXFP4 (``moe_expert_format="mxfp4"``), which reads the codes and scales as they are."""
  if cfg.moe_expert_format == "mxfp4":
    dense = sorted(k for k in sd if k.endswith(("experts.gate_up_proj", "experts.down_proj")))
    if dense:
      raise ValueError(f"GptOssForCausalLM: moe_expert_format='mxfp4' reads MXFP4 expert "
                       f"tensors (*_blocks, *_scales), but the checkpoint holds {dense[0]!r} "
                       "unquantized; load it with the default format, then "
                       "MoE.quantize_experts().")
    return
  for key in sorted(k for k in sd if k.endswith("_blocks")):
    name = key[:-len("_blocks")]
    scales = sd.pop(f"{name}_scales", None)
    if scales is None:
      raise ValueError(f"GptOssForCausalLM: `{key}` has no `{name}_scales` beside it.")
    blocks = sd.pop(key)
    to_np = lambda x: x.numpy() if hasattr(x, "numpy") else np.asarray(x)  # noqa: E731
    sd[name] = _MXFP4Tensor(to_np(blocks), to_np(scales))


def _mxfp4(hf: str, ours: tuple, interleaved: bool) -> Rule:
  """A published MXFP4 tensor (``{hf}_blocks [E, R, G, 16]`` + ``{hf}_scales [E, R, G]``) <-> our
  ``MXFP4Weight``s' codes ``[E, N, code_width]`` (the bytes flat, zero-padded to whole lane tiles)
  and scales: of one weight, or of gate and up from rows in turn (``interleaved``, ``R = 2N``).
  Bytes move, nothing is re-quantized."""
  names = (f"{hf}_blocks", f"{hf}_scales")
  mats = ours if interleaved else ours[:1]
  paths = tuple(m + ("codes",) for m in mats) + tuple(m + ("scales",) for m in mats)

  def to_ours(blocks, scales, *, shapes):
    x = xp(blocks, scales)
    flat = blocks.reshape(blocks.shape[:-2] + (-1,))
    flat = x.pad(flat, ((0, 0), (0, 0), (0, shapes[0][-1] - flat.shape[-1])))
    parts = [(flat[:, 0::2], flat[:, 1::2]), (scales[:, 0::2], scales[:, 1::2])] if interleaved \
        else [(flat,), (scales,)]
    return tuple(a.reshape(s) for a, s in zip(parts[0] + parts[1], shapes))

  def to_hf(*arrays):
    codes, scales = arrays[:len(mats)], arrays[len(mats):]
    x = xp(*arrays)
    if interleaved:   # rows in turn: [E, N, 2, .] -> [E, 2N, .]
      codes, scales = ((x.stack(pair, axis=2).reshape(pair[0].shape[0], -1, pair[0].shape[-1]),)
                       for pair in (codes, scales))
    (c,), (s,) = codes, scales
    g = s.shape[-1]
    return c[..., :g * (MXFP4_GROUP // 2)].reshape(c.shape[:-1] + (g, MXFP4_GROUP // 2)), s

  return Rule(names, paths, to_ours, to_hf)


def _mxfp4_rules(e: str, f: tuple) -> list[Rule]:
  """MXFP4 experts kept as they are: ``gate_up_proj_blocks / _scales`` rows (gate and up
  interleaved) <-> ``w_gate`` / ``w_up``; ``down_proj_*`` <-> ``w_down``."""
  return [_mxfp4(f"{e}.gate_up_proj", (f + ("w_gate",), f + ("w_up",)), interleaved=True),
          _mxfp4(f"{e}.down_proj", (f + ("w_down",),), interleaved=False)]


def rules(cfg) -> list[Rule]:
  out = head_rules(cfg)
  for i in range(cfg.num_layers):
    hp, L = f"model.layers.{i}", C.layer(i)
    m, f = L + ("mixer",), L + ("ffn",)
    e = f"{hp}.mlp.experts"
    out += [copy(f"{hp}.input_layernorm.weight", L + ("mixer_norm", "scale")),
            copy(f"{hp}.post_attention_layernorm.weight", L + ("ffn_norm", "scale")),
            copy(f"{hp}.self_attn.sinks", m + ("sinks",))]
    out += attention_rules(cfg, i, f"{hp}.self_attn")
    out += [linear(f"{hp}.mlp.router.weight", f + ("router",)),
            copy(f"{hp}.mlp.router.bias", f + ("router_logit_bias",)),
            _interleaved(f"{e}.gate_up_proj_bias", f + ("b_gate",), f + ("b_up",)),
            copy(f"{e}.down_proj_bias", f + ("b_down",))]
    if cfg.moe_expert_format == "mxfp4":
      out += _mxfp4_rules(e, f)
    else:
      out += [_interleaved(f"{e}.gate_up_proj", f + ("w_gate",), f + ("w_up",)),
              copy(f"{e}.down_proj", f + ("w_down",))]
  return out
