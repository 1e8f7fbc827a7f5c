"""DeepSeek-V3 (MLA + DeepSeekMoE) and DeepSeek-V3.2 (MLA + lightning indexer, DSA).

MLA tensors: ``q_a_proj``/``q_a_layernorm``/``q_b_proj`` (or ``q_proj`` without query LoRA) ->
``q_down``/``q_norm``/``q_up`` (per head ``[P nope | R rope]``, the same order as ours);
``kv_a_proj_with_mqa [C + R, D]`` -> ``kv_down [D, C]`` and ``k_rope_proj [D, R]``;
``kv_b_proj [N (P + h), C]`` -> ``k_up [C, N, P]`` and ``v_up [C, N, h]``.

RoPE pairs: with ``rope_interleave`` (V3's default, and always in V3.2) transformers regroups the
rope coordinates of q and k by the same permutation before its half-split rotation, which is an
interleaved rotation of the stored coordinates followed by a permutation that cancels in ``q . k``;
we rotate interleaved pairs of the weights as stored (``mla_rope_interleaved=True``), no permutation
of the weights.  ``rope_interleave=False`` is the half split.  The YaRN ``mscale_all_dim`` factor
enters the softmax scale (``jaxattn.ops.mla.mla_softmax_scale``).

MoE: ``gate.weight [E, D]`` -> ``router [D, E]``; ``gate.e_score_correction_bias`` -> our
``router_bias`` (it only ranks experts, as transformers); experts per expert (or fused) -> stacked
``w_gate, w_up, w_down``; ``shared_experts`` -> ``shared`` (hidden ``n_shared * moe_intermediate``).

The V3.2 indexer: ``wq_b [H_I d_I, Cq]`` -> ``indexer.wq [Cq, H_I, d_I]``; ``wk``; ``k_norm``
(LayerNorm, weight and bias); ``weights_proj``.  Its RoPE is the half split over the first
``qk_rope_head_dim`` coordinates, with the main rotary embedding (its YaRN scaling included, as
our indexer applies the attention's ``rope_scaling``).

Multi-token prediction (``num_nextn_predict_layers`` <-> ``mtp_depth``): module ``k`` is stored as
one more layer, ``model.layers.{L + k - 1}`` (``L = num_hidden_layers``), holding a full decoder
layer (attention, MoE, norms: the same tensors and rules as a main layer) beside ``enorm`` /
``hnorm`` -> ``mtp[k-1].embed_norm`` / ``hidden_norm``, ``eh_proj [D, 2D]`` (input ``[embedding;
hidden]``) -> ``proj [2D, D]`` and ``shared_head.norm`` -> ``norm``.  The module shares the
model's embedding and head: the copies DeepSeek's checkpoints store (``embed_tokens.weight``,
``shared_head.head.weight`` of that layer) must equal them on import and are written back on
export (``shared_tensors``).  transformers builds every MTP block as an MoE layer, ours takes the
last layer's kind: a model whose last layer is dense is refused with MTP modules.
"""

from __future__ import annotations

import re
from typing import Any

from jaxattn.convert import common as C
from jaxattn.convert.llama import head_rules, mlp_rules
from jaxattn.convert.rules import (Rule, copy, experts, linear, linear_out,
                                   split_fused_experts, xp)
from jaxattn.nn.mtp import mtp_layer_kind

ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM")
MODEL_TYPES = {"DeepseekV3ForCausalLM": "deepseek_v3", "DeepseekV32ForCausalLM": "deepseek_v32"}

_FIELDS = {
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "n_shared_experts", "n_routed_experts",
    "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim",
    "qk_nope_head_dim", "n_group", "topk_group", "num_experts_per_tok", "first_k_dense_replace",
    "norm_topk_prob", "hidden_act", "max_position_embeddings", "rms_norm_eps",
    "tie_word_embeddings", "rope_parameters", "rope_theta", "rope_scaling", "attention_bias",
    "pretraining_tp", "num_nextn_predict_layers",
    "qk_head_dim", "head_dim",                     # derived by transformers (P + R, and R)
    # DeepSeek's own config.json fields, checked below
    "scoring_func", "topk_method", "moe_layer_freq", "ep_size", "aux_loss_alpha", "seq_aux",
}
_V3_FIELDS = _FIELDS | {"rope_interleave"}
_V32_FIELDS = _FIELDS | {"mlp_layer_types", "layer_types", "index_topk", "index_head_dim",
                         "index_n_heads", "mlp_bias"}


def config_from_hf(d: dict[str, Any], architecture: str) -> dict[str, Any]:
  v32 = architecture == "DeepseekV32ForCausalLM"
  C.check_fields(d, _V32_FIELDS if v32 else _V3_FIELDS, architecture)
  for name, allowed, default in (("attention_bias", False, False), ("mlp_bias", False, False),
                                 ("scoring_func", "sigmoid", "sigmoid"),
                                 ("topk_method", "noaux_tc", "noaux_tc"),
                                 ("moe_layer_freq", 1, 1)):
    C.require(d, name, allowed, architecture, default)
  layers = d["num_hidden_layers"]
  mtp = d.get("num_nextn_predict_layers") or 0   # (checked by jaxattn.convert.hf)
  p, r = d["qk_nope_head_dim"], d["qk_rope_head_dim"]
  if d.get("qk_head_dim") not in (None, p + r):
    raise ValueError(f"{architecture}: `qk_head_dim`={d['qk_head_dim']} must equal "
                     f"qk_nope_head_dim + qk_rope_head_dim = {p + r}.")
  rp = C.rope_parameters(d, architecture)
  C.require(rp, "partial_rotary_factor", (None, 1.0), architecture)
  scaling = C.rope_scaling(rp, d.get("max_position_embeddings"), architecture)
  if d.get("rms_norm_eps", 1e-6) != 1e-6:
    raise ValueError(f"{architecture}: `rms_norm_eps`={d['rms_norm_eps']} is not supported: our "
                     "MLA latent norms (and the V3.2 indexer's LayerNorm) use it, transformers' "
                     "q_a / kv_a norms (and indexer) a fixed 1e-6.")
  experts_n = d.get("n_routed_experts") or 0
  first_dense = min(d.get("first_k_dense_replace", 0), layers) if experts_n else layers
  kwargs = dict(
      vocab_size=d["vocab_size"], embed_dim=d["hidden_size"], num_layers=layers,
      num_heads=d["num_attention_heads"], mlp_dim=d["intermediate_size"],
      layer_pattern="I" if v32 else "M", kv_lora_rank=d["kv_lora_rank"],
      q_lora_rank=d.get("q_lora_rank"), qk_nope_head_dim=p, qk_rope_head_dim=r,
      v_head_dim=d["v_head_dim"], position="rope", rope_base=float(rp.get("rope_theta", 10000.0)),
      rope_scaling=scaling, mla_rope_interleaved=True if v32 else bool(d.get("rope_interleave",
                                                                              True)),
      max_seq_len=d.get("max_position_embeddings") or 2048,
      mlp_activation=C.activation(d, architecture), gated_mlp=True, norm="rms",
      norm_position="pre", norm_eps=d.get("rms_norm_eps", 1e-6),
      tie_embeddings=bool(d.get("tie_word_embeddings", False)),
      num_experts=experts_n, first_k_dense=first_dense if experts_n else 0, mtp_depth=mtp)
  if mtp and experts_n and first_dense >= layers:
    raise ValueError(f"{architecture}: the {mtp} multi-token-prediction layer(s) are MoE layers "
                     f"(as transformers builds them), but the last of the {layers} layers is "
                     f"dense (first_k_dense_replace={d.get('first_k_dense_replace')}) and ours "
                     "take its kind; load with mtp_depth=0 to drop them.")
  if experts_n:
    kwargs.update(num_experts_per_tok=d["num_experts_per_tok"],
                  moe_expert_dim=d["moe_intermediate_size"],
                  num_shared_experts=d.get("n_shared_experts") or 0, moe_score_func="sigmoid",
                  moe_n_group=d.get("n_group") or 1, moe_topk_group=d.get("topk_group"),
                  moe_norm_topk_prob=bool(d.get("norm_topk_prob", True)),
                  moe_routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)))
  if v32:
    want_mlp = ["dense"] * first_dense + ["sparse"] * (layers - first_dense)
    if d.get("mlp_layer_types") not in (None, want_mlp):
      raise ValueError(f"{architecture}: `mlp_layer_types`={d['mlp_layer_types']!r} is not a dense "
                       f"prefix of first_k_dense_replace={first_dense} layers followed by MoE "
                       "layers, the only layout supported.")
    if d.get("layer_types") not in (None, ["indexed_attention"] * layers):
      raise ValueError(f"{architecture}: `layer_types`={d['layer_types']!r} is not supported "
                       "(every layer must be 'indexed_attention').")
    kwargs.update(index_num_heads=d.get("index_n_heads", 64),
                  index_head_dim=d.get("index_head_dim", 128), index_rope_dim=r,
                  index_topk=d.get("index_topk", 2048), dsa_attention_mode="sparse")
  return kwargs


def config_to_hf(cfg, architecture: str) -> dict[str, Any]:
  v32 = architecture == "DeepseekV32ForCausalLM"
  C.check_exportable(
      cfg, architecture,
      layer_pattern=None if set(cfg.layer_pattern) == {"I" if v32 else "M"} else cfg.layer_pattern,
      moe_score_func=None if not cfg.num_experts or cfg.moe_score_func == "sigmoid" else
      cfg.moe_score_func, moe_shared_gate=cfg.moe_shared_gate or None,
      moe_shared_dim=cfg.moe_shared_dim, mlp_bias=cfg.mlp_bias or None,
      rope_interleaved=None if not v32 or cfg.mla_rope_interleaved else False,
      # What config_from_hf refuses for V3.2, and the indexer transformers builds: RoPE over the
      # attention's rope dims, and sparse attention.
      norm_eps=None if cfg.norm_eps == 1e-6 else cfg.norm_eps,
      index_rope_dim=None if not v32 or cfg.index_rope_dim == cfg.qk_rope_head_dim else
      cfg.index_rope_dim,
      dsa_attention_mode=None if not v32 or cfg.dsa_attention_mode == "sparse" else
      cfg.dsa_attention_mode,
      # transformers' MTP blocks are MoE layers whenever the model has experts
      mtp_depth=cfg.mtp_depth if cfg.mtp_depth and cfg.num_experts
      and not mtp_layer_kind(cfg)[1] else None)
  d = dict(
      architectures=[architecture], model_type=MODEL_TYPES[architecture],
      vocab_size=cfg.vocab_size, hidden_size=cfg.embed_dim, intermediate_size=cfg.mlp_dim,
      num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
      num_key_value_heads=cfg.num_heads, kv_lora_rank=cfg.kv_lora_rank,
      q_lora_rank=cfg.q_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
      qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim or cfg.qk_nope_head_dim,
      hidden_act=C.ACTIVATIONS_TO_HF[cfg.mlp_activation],
      max_position_embeddings=C.max_position_embeddings(cfg),
      rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
      rope_parameters=C.rope_to_hf(cfg), attention_bias=False, dtype="float32",
      n_routed_experts=cfg.num_experts or None,
      first_k_dense_replace=cfg.first_k_dense if cfg.num_experts else cfg.num_layers,
      moe_intermediate_size=cfg.moe_expert_dim or cfg.mlp_dim,
      num_experts_per_tok=cfg.num_experts_per_tok, n_shared_experts=cfg.num_shared_experts,
      n_group=cfg.moe_n_group, topk_group=cfg.moe_topk_group or cfg.moe_n_group,
      norm_topk_prob=cfg.moe_norm_topk_prob,
      routed_scaling_factor=cfg.moe_routed_scaling_factor,
      # written even when 0: transformers' default is one MTP layer
      num_nextn_predict_layers=cfg.mtp_depth)
  if v32:
    d.update(index_n_heads=cfg.index_num_heads, index_head_dim=cfg.index_head_dim,
             index_topk=cfg.index_topk)
  else:
    d["rope_interleave"] = cfg.mla_rope_interleaved
  return d


def _kv_a(hf: str, down: tuple, rope: tuple) -> Rule:
  def to_ours(w, *, shapes):
    c = shapes[0][1]
    return w.T[:, :c], w.T[:, c:]

  def to_hf(kd, kr):
    return (xp(kd, kr).concatenate([kd, kr], axis=1).T,)

  return Rule((hf,), (down, rope), to_ours, to_hf)


def _kv_b(hf: str, k_up: tuple, v_up: tuple) -> Rule:
  def to_ours(w, *, shapes):
    (c, n, p), (_, _, hv) = shapes
    wt = w.T.reshape(c, n, p + hv)
    return wt[..., :p], wt[..., p:]

  def to_hf(k, v):
    return (xp(k, v).concatenate([k, v], axis=-1).reshape(k.shape[0], -1).T,)

  return Rule((hf,), (k_up, v_up), to_ours, to_hf)


def normalize(sd: dict, cfg) -> None:
  """Drops the multi-token-prediction layers past ``cfg.mtp_depth`` (``model.layers.{L + k}``,
  all of them for ``mtp_depth=0``: transformers skips them too), and rewrites fused in-memory
  expert tensors to the per-expert names of checkpoints on disk."""
  last = cfg.num_layers + cfg.mtp_depth
  for key in [k for k in sd if re.match(r"model\.layers\.(\d+)\.", k)]:
    if int(key.split(".")[2]) >= last:
      del sd[key]
  for i in range(cfg.first_k_dense if cfg.num_experts else last, last):
    split_fused_experts(sd, f"model.layers.{i}.mlp.experts")


def mtp_depth_stored(sd, d: dict) -> int:
  """How many multi-token-prediction layers a state dict holds: the consecutive layers from
  ``model.layers.{num_hidden_layers}`` on."""
  layers = {int(m.group(1)) for m in map(re.compile(r"model\.layers\.(\d+)\.").match, sd) if m}
  n = 0
  while d["num_hidden_layers"] + n in layers:
    n += 1
  return n


def shared_tensors(cfg) -> dict[str, str]:
  """The copies of the embedding and the head each MTP layer stores (name -> the original)."""
  head = "model.embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"
  out = {}
  for k in range(cfg.mtp_depth):
    hp = f"model.layers.{cfg.num_layers + k}"
    out[f"{hp}.embed_tokens.weight"] = "model.embed_tokens.weight"
    out[f"{hp}.shared_head.head.weight"] = head
  return out


def layer_rules(cfg, hp: str, L: tuple, is_moe: bool) -> list[Rule]:
  """One decoder layer's tensors ``{hp}.*`` <-> our ``DecoderLayer`` at path ``L`` (a main layer,
  or an MTP module's block)."""
  m, a = L + ("mixer",), f"{hp}.self_attn"
  out = [copy(f"{hp}.input_layernorm.weight", L + ("mixer_norm", "scale")),
         copy(f"{hp}.post_attention_layernorm.weight", L + ("ffn_norm", "scale"))]
  if cfg.q_lora_rank is None:
    out.append(linear(f"{a}.q_proj.weight", m + ("q_proj", "kernel")))
  else:
    out += [linear(f"{a}.q_a_proj.weight", m + ("q_down", "kernel")),
            copy(f"{a}.q_a_layernorm.weight", m + ("q_norm", "scale")),
            linear(f"{a}.q_b_proj.weight", m + ("q_up", "kernel"))]
  out += [_kv_a(f"{a}.kv_a_proj_with_mqa.weight", m + ("kv_down", "kernel"),
                m + ("k_rope_proj", "kernel")),
          copy(f"{a}.kv_a_layernorm.weight", m + ("kv_norm", "scale")),
          _kv_b(f"{a}.kv_b_proj.weight", m + ("k_up", "kernel"), m + ("v_up", "kernel")),
          linear_out(f"{a}.o_proj.weight", m + ("o_proj", "kernel"))]
  if "I" in cfg.layer_pattern:
    ix, x = f"{a}.indexer", m + ("indexer",)
    out += [linear(f"{ix}.wq_b.weight", x + ("wq", "kernel")),
            linear(f"{ix}.wk.weight", x + ("wk", "kernel")),
            copy(f"{ix}.k_norm.weight", x + ("k_norm", "scale")),
            copy(f"{ix}.k_norm.bias", x + ("k_norm", "bias")),
            linear(f"{ix}.weights_proj.weight", x + ("weights_proj", "kernel"))]
  f = L + ("ffn",)
  if is_moe:
    out += [linear(f"{hp}.mlp.gate.weight", f + ("router",)),
            copy(f"{hp}.mlp.gate.e_score_correction_bias", f + ("router_bias",))]
    out += experts(f"{hp}.mlp.experts", cfg.num_experts, f)
    if cfg.num_shared_experts:
      out += mlp_rules(cfg, f"{hp}.mlp.shared_experts", f + ("shared",))
  else:
    out += mlp_rules(cfg, f"{hp}.mlp", f)
  return out


def rules(cfg) -> list[Rule]:
  out = head_rules(cfg)
  for i in range(cfg.num_layers):
    out += layer_rules(cfg, f"model.layers.{i}", C.layer(i), cfg.layer_kind(i)[1])
  for k in range(cfg.mtp_depth):
    hp, M = f"model.layers.{cfg.num_layers + k}", ("mtp", k)
    out += [copy(f"{hp}.enorm.weight", M + ("embed_norm", "scale")),
            copy(f"{hp}.hnorm.weight", M + ("hidden_norm", "scale")),
            linear(f"{hp}.eh_proj.weight", M + ("proj", "kernel")),
            copy(f"{hp}.shared_head.norm.weight", M + ("norm", "scale"))]
    out += layer_rules(cfg, hp, M + ("layer",), mtp_layer_kind(cfg)[1])
  return out
