"""Qwen3-Next: Gated DeltaNet + gated full attention hybrid with a softmax-routed MoE.

Layout differences from ours:
  * every ``Qwen3NextRMSNorm`` (layer norms, final norm, per-head q/k norms) computes
    ``x_hat * (1 + w)``; we store the scale ``1 + w`` (exact in fp32, where both are computed);
    the Gated DeltaNet's output norm multiplies by ``w`` itself;
  * full attention: ``q_proj`` emits ``[N, 2H]`` per head, query then output gate -> our ``q_proj``
    and ``gate_proj``; partial RoPE (``partial_rotary_factor``) with half-split pairs;
  * Gated DeltaNet: ``in_proj_qkvz`` is grouped per key head ``[K, (H | H | G h | G h)]`` with
    ``G = N / K`` value heads per key head, ``in_proj_ba`` likewise ``[K, (G | G)]``, and the
    depthwise ``conv1d.weight [C, 1, W]`` runs over the channels ``q | k | v``;
  * MoE: ``shared_expert`` (hidden ``shared_expert_intermediate_size``) scaled by
    ``sigmoid(shared_expert_gate x)``; softmax router, top-k, optionally renormalized;
  * multi-token prediction (``mtp_depth`` 0 or 1): ``mtp.pre_fc_norm_embedding`` /
    ``mtp.pre_fc_norm_hidden`` -> ``mtp[0].embed_norm`` / ``hidden_norm``, ``mtp.fc [D, 2D]``
    (input ``[embedding; hidden]``) -> ``proj [2D, D]``, ``mtp.layers.0`` (a gated-attention
    decoder layer, the main layers' rules) -> ``layer``, ``mtp.norm`` -> ``norm``; the
    embedding and the head are the model's.  The published configs state no depth: a config
    that does (``num_nextn_predict_layers``, as vLLM reads it) gives it, ``load_hf`` reads it
    from the weights (``mtp.*`` present: 1), and ``config_from_hf`` alone gives 0.  Deeper
    modules (vLLM's ``num_nextn_predict_layers > 1``) share ``fc`` and the norms across steps,
    which ours do not: depth 1 only.
"""

from __future__ import annotations

from typing import Any

from jaxattn.checks import is_int
from jaxattn.convert import common as C
from jaxattn.convert.llama import attention_rules, mlp_rules
from jaxattn.convert.rules import (Rule, copy, experts, linear, linear_out, plus_one,
                                   split_fused_experts, xp)
from jaxattn.nn.mtp import mtp_layer_kind

ARCHITECTURES = ("Qwen3NextForCausalLM",)

_FIELDS = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "hidden_act", "max_position_embeddings", "rms_norm_eps",
    "tie_word_embeddings", "rope_parameters", "rope_theta", "rope_scaling", "partial_rotary_factor",
    "attention_bias", "head_dim", "linear_conv_kernel_dim", "linear_key_head_dim",
    "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
    "decoder_sparse_step", "moe_intermediate_size", "shared_expert_intermediate_size",
    "num_experts_per_tok", "num_experts", "norm_topk_prob", "mlp_only_layers", "layer_types",
    "full_attention_interval", "num_nextn_predict_layers",
}
_KINDS = {"linear_attention": "D", "full_attention": "A"}


def _moe_layers(d) -> list[bool]:
  n, step = d["num_hidden_layers"], d.get("decoder_sparse_step")
  step = 1 if step is None else step
  if not is_int(step) or step < 1:   # (transformers takes (i + 1) % step)
    raise ValueError(f"`decoder_sparse_step` must be an int >= 1, got {step!r}.")
  only = set(d.get("mlp_only_layers") or [])
  return [i not in only and d.get("num_experts", 0) > 0 and (i + 1) % step == 0 for i in range(n)]


def _mtp_is_moe(d) -> bool:
  """Whether the checkpoint's MTP block is an MoE layer: as the main layers' rule decides for
  index 0 (``mtp.layers.0``; vLLM's reading, transformers has no Qwen3-Next MTP)."""
  step = d.get("decoder_sparse_step")
  return (0 not in set(d.get("mlp_only_layers") or []) and (d.get("num_experts") or 0) > 0
          and 1 % (1 if step is None else step) == 0)


def config_from_hf(d: dict[str, Any], architecture: str) -> dict[str, Any]:
  C.check_fields(d, _FIELDS, architecture)
  C.require(d, "linear_conv_kernel_dim", 4, architecture, 4)
  layers, heads = d["num_hidden_layers"], d["num_attention_heads"]
  types = d.get("layer_types")
  if types is None:
    interval = d.get("full_attention_interval", 4)
    if not is_int(interval) or interval < 1:
      raise ValueError(f"{architecture}: `full_attention_interval` must be an int >= 1, got "
                       f"{interval!r}.")
    types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
             for i in range(layers)]
  bad = sorted(set(types) - set(_KINDS))
  if bad or len(types) != layers:
    raise ValueError(f"{architecture}: `layer_types` must list {layers} entries of "
                     f"{sorted(_KINDS)}, got {types!r}.")
  moe = _moe_layers(d)
  first = moe.index(True) if any(moe) else layers
  if moe != [False] * first + [True] * (layers - first):
    raise ValueError(f"{architecture}: MoE layers {[i for i, m in enumerate(moe) if m]} (from "
                     f"decoder_sparse_step={d.get('decoder_sparse_step')}, mlp_only_layers="
                     f"{d.get('mlp_only_layers')}) are not a dense prefix followed by MoE layers, "
                     "the only layout supported.")
  mtp = d.get("num_nextn_predict_layers") or 0
  if mtp not in (0, 1):
    raise ValueError(f"{architecture}: `num_nextn_predict_layers`={mtp!r} is not supported: "
                     "deeper Qwen3-Next MTP modules share mtp.fc and the norms, ours do not; "
                     "load with mtp_depth=1 (the first module) or 0.")
  head_dim = d.get("head_dim") or d["hidden_size"] // heads
  rp = C.rope_parameters(d, architecture)
  partial = rp.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
  rotary = int(head_dim * partial)
  kwargs = dict(
      vocab_size=d["vocab_size"], embed_dim=d["hidden_size"], num_layers=layers, num_heads=heads,
      num_kv_heads=d.get("num_key_value_heads") or heads, head_dim=head_dim,
      mlp_dim=d["intermediate_size"], layer_pattern="".join(_KINDS[t] for t in types),
      position="rope", rope_base=float(rp.get("rope_theta", 10000.0)),
      rotary_dim=None if rotary == head_dim else rotary, rope_interleaved=False,
      rope_scaling=C.rope_scaling(rp, d.get("max_position_embeddings"), architecture),
      max_seq_len=d.get("max_position_embeddings") or 2048,
      attention_bias=bool(d.get("attention_bias", False)), attention_qk_norm=True,
      attention_output_gate=True, deltanet_num_heads=d["linear_num_value_heads"],
      deltanet_num_key_heads=d["linear_num_key_heads"],
      deltanet_head_dim=d["linear_key_head_dim"], deltanet_v_head_dim=d["linear_value_head_dim"],
      mlp_activation=C.activation(d, architecture), gated_mlp=True, norm="rms",
      norm_position="pre", norm_eps=d.get("rms_norm_eps", 1e-6),
      tie_embeddings=bool(d.get("tie_word_embeddings", False)),
      num_experts=d.get("num_experts", 0) if first < layers else 0, first_k_dense=first
      if first < layers else 0, mtp_depth=mtp)
  if mtp and _mtp_is_moe(d) != moe[-1]:
    raise ValueError(f"{architecture}: the multi-token-prediction layer is "
                     f"{'an MoE' if _mtp_is_moe(d) else 'a dense'} layer (mtp.layers.0 by "
                     "mlp_only_layers / decoder_sparse_step), but ours takes the kind of the "
                     "last layer; load with mtp_depth=0 to drop it.")
  if first < layers:
    shared = d.get("shared_expert_intermediate_size") or 0
    kwargs.update(num_experts_per_tok=d["num_experts_per_tok"],
                  moe_expert_dim=d["moe_intermediate_size"], num_shared_experts=1 if shared else 0,
                  moe_shared_dim=shared or None, moe_shared_gate=bool(shared),
                  moe_score_func="softmax", moe_n_group=1, moe_topk_group=None,
                  moe_norm_topk_prob=bool(d.get("norm_topk_prob", True)),
                  moe_routed_scaling_factor=1.0)
  return kwargs


def config_to_hf(cfg, architecture: str) -> dict[str, Any]:
  moe = cfg.num_experts > 0
  C.check_exportable(
      cfg, architecture,
      layer_pattern=None if set(cfg.layer_pattern) <= set("AD") else cfg.layer_pattern,
      attention_qk_norm=None if cfg.attention_qk_norm else False,
      attention_output_gate=None if cfg.attention_output_gate else False,
      rope_interleaved=cfg.rope_interleaved or None, mlp_bias=cfg.mlp_bias or None,
      moe_score_func=None if not moe or cfg.moe_score_func == "softmax" else cfg.moe_score_func,
      moe_shared=None if not moe or cfg.num_shared_experts == int(cfg.moe_shared_gate) else
      (cfg.num_shared_experts, cfg.moe_shared_gate),
      # Qwen3-Next routes over all experts, unscaled: no group limit, no routed scaling factor.
      moe_n_group=None if not moe or cfg.moe_n_group == 1 else cfg.moe_n_group,
      moe_routed_scaling_factor=None if not moe or cfg.moe_routed_scaling_factor == 1.0 else
      cfg.moe_routed_scaling_factor,
      # one module, whose block the exported config must read as ours: mtp.layers.0 is dense
      # when the dense prefix (mlp_only_layers) is not empty
      mtp_depth=cfg.mtp_depth if cfg.mtp_depth > 1 else None,
      mtp_moe_block=True if cfg.mtp_depth and moe and cfg.first_k_dense
      and mtp_layer_kind(cfg)[1] else None)
  head_dim = cfg.head_dim or cfg.embed_dim // cfg.num_heads
  rp = C.rope_to_hf(cfg)
  rp["partial_rotary_factor"] = (cfg.rotary_dim or head_dim) / head_dim
  types = [{"D": "linear_attention", "A": "full_attention"}[cfg.layer_kind(i)[0]]
           for i in range(cfg.num_layers)]
  d = dict(
      architectures=[architecture], model_type="qwen3_next", vocab_size=cfg.vocab_size,
      hidden_size=cfg.embed_dim, intermediate_size=cfg.mlp_dim, num_hidden_layers=cfg.num_layers,
      num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads or cfg.num_heads,
      head_dim=head_dim, hidden_act=C.ACTIVATIONS_TO_HF[cfg.mlp_activation],
      max_position_embeddings=C.max_position_embeddings(cfg), rms_norm_eps=cfg.norm_eps,
      tie_word_embeddings=cfg.tie_embeddings, rope_parameters=rp,
      attention_bias=cfg.attention_bias, linear_conv_kernel_dim=4,
      linear_num_value_heads=cfg.deltanet_num_heads or cfg.num_heads,
      linear_num_key_heads=cfg.deltanet_num_key_heads or cfg.deltanet_num_heads or cfg.num_heads,
      # the sizes the layers use (rules() derives the same defaults); None is not a size
      linear_key_head_dim=cfg.deltanet_head_dim or cfg.embed_dim // (cfg.deltanet_num_heads
                                                                     or cfg.num_heads),
      linear_value_head_dim=cfg.deltanet_v_head_dim or cfg.deltanet_head_dim
      or cfg.embed_dim // (cfg.deltanet_num_heads or cfg.num_heads),
      layer_types=types, num_experts=cfg.num_experts,
      num_experts_per_tok=cfg.num_experts_per_tok,
      moe_intermediate_size=cfg.moe_expert_dim or cfg.mlp_dim,
      shared_expert_intermediate_size=(cfg.moe_shared_dim or cfg.moe_expert_dim or cfg.mlp_dim)
      if cfg.num_shared_experts else 0,
      norm_topk_prob=cfg.moe_norm_topk_prob, decoder_sparse_step=1,
      mlp_only_layers=list(range(cfg.first_k_dense)) if cfg.num_experts else [],
      dtype="float32")
  if cfg.mtp_depth:   # (no key: no module, as config_from_hf reads a config without one)
    d["num_nextn_predict_layers"] = cfg.mtp_depth
  return d


def _q_gate(hf: str, q: tuple, g: tuple, head_dim: int) -> Rule:
  """``[N * 2H, ...]`` (per head: query then gate) <-> our ``q_proj`` and ``gate_proj``."""
  def to_ours(w, *, shapes):
    if w.ndim == 1:  # bias [N * 2H]
      w2 = w.reshape(-1, 2 * head_dim)
      return w2[:, :head_dim].reshape(shapes[0]), w2[:, head_dim:].reshape(shapes[1])
    wt = w.T.reshape(w.shape[1], -1, 2 * head_dim)
    return wt[..., :head_dim], wt[..., head_dim:]

  def to_hf(qk, gk):
    both = xp(qk, gk).concatenate([qk, gk], axis=-1)
    return (both.reshape(-1),) if qk.ndim == 2 else (both.reshape(qk.shape[0], -1).T,)

  return Rule((hf,), (q, g), to_ours, to_hf)


def _qkvz(hf: str, m: tuple, k: int, h: int, g: int, hv: int) -> Rule:
  paths = tuple(m + (n, "kernel") for n in ("q_proj", "k_proj", "v_proj", "z_proj"))

  def to_ours(w, *, shapes):
    wt = w.T.reshape(w.shape[1], k, 2 * h + 2 * g * hv)
    d = w.shape[1]
    return (wt[..., :h], wt[..., h:2 * h],
            wt[..., 2 * h:2 * h + g * hv].reshape(d, k * g, hv),
            wt[..., 2 * h + g * hv:].reshape(d, k * g, hv))

  def to_hf(q, kk, v, z):
    d = q.shape[0]
    parts = [q, kk, v.reshape(d, k, g * hv), z.reshape(d, k, g * hv)]
    return (xp(q).concatenate(parts, axis=-1).reshape(d, -1).T,)

  return Rule((hf,), paths, to_ours, to_hf)


def _ba(hf: str, m: tuple, k: int, g: int) -> Rule:
  def to_ours(w, *, shapes):
    wt = w.T.reshape(w.shape[1], k, 2 * g)
    d = w.shape[1]
    return wt[..., :g].reshape(d, k * g), wt[..., g:].reshape(d, k * g)

  def to_hf(b, a):
    d = b.shape[0]
    parts = [b.reshape(d, k, g), a.reshape(d, k, g)]
    return (xp(b).concatenate(parts, axis=-1).reshape(d, -1).T,)

  return Rule((hf,), (m + ("b_proj", "kernel"), m + ("a_proj", "kernel")), to_ours, to_hf)


def _conv(hf: str, m: tuple) -> Rule:
  def to_ours(w, *, shapes):
    c = w[:, 0, :].T                                     # [W, channels q | k | v]
    nq = shapes[0][1] * shapes[0][2]
    return (c[:, :nq].reshape(shapes[0]), c[:, nq:2 * nq].reshape(shapes[1]),
            c[:, 2 * nq:].reshape(shapes[2]))

  def to_hf(q, kk, v):
    w = q.shape[0]
    c = xp(q).concatenate([q.reshape(w, -1), kk.reshape(w, -1), v.reshape(w, -1)], axis=1)
    return (c.T[:, None, :],)

  return Rule((hf,), (m + ("conv_q",), m + ("conv_k",), m + ("conv_v",)), to_ours, to_hf)


def _shared_gate(hf: str, path: tuple) -> Rule:
  return Rule((hf,), (path,), lambda w, *, shapes: (w.reshape(shapes[0]),),
              lambda w: (w.reshape(1, -1),))


def normalize(sd: dict, cfg) -> None:
  """Drops the multi-token-prediction module the published checkpoints hold (``mtp.*``;
  transformers skips it too) when ``cfg.mtp_depth`` is 0, and the blocks past the first
  (``mtp.layers.{k >= 1}``) when it is 1; rewrites fused in-memory expert tensors to the
  per-expert names of checkpoints on disk."""
  for key in [k for k in sd if k.startswith("mtp.")]:
    if not cfg.mtp_depth or (key.startswith("mtp.layers.")
                             and int(key.split(".")[2]) >= cfg.mtp_depth):
      del sd[key]
  for i in range(cfg.num_layers):
    split_fused_experts(sd, f"model.layers.{i}.mlp.experts")
  if cfg.mtp_depth:
    split_fused_experts(sd, "mtp.layers.0.mlp.experts")


def mtp_depth_stored(sd, d: dict) -> int:
  """How many multi-token-prediction modules a state dict holds (``mtp.layers.{k}``)."""
  n = 0
  while any(k.startswith(f"mtp.layers.{n}.") for k in sd):
    n += 1
  return n


def layer_rules(cfg, hp: str, L: tuple, kind: str, is_moe: bool) -> list[Rule]:
  """One decoder layer's tensors ``{hp}.*`` <-> our ``DecoderLayer`` at path ``L`` (a main layer,
  or the MTP module's block)."""
  head_dim = cfg.head_dim or cfg.embed_dim // cfg.num_heads
  n = cfg.deltanet_num_heads or cfg.num_heads
  k = cfg.deltanet_num_key_heads or n
  h = cfg.deltanet_head_dim or cfg.embed_dim // n
  hv = cfg.deltanet_v_head_dim or h
  m = L + ("mixer",)
  out = [plus_one(f"{hp}.input_layernorm.weight", L + ("mixer_norm", "scale")),
         plus_one(f"{hp}.post_attention_layernorm.weight", L + ("ffn_norm", "scale"))]
  if kind == "A":
    a = f"{hp}.self_attn"
    out.append(_q_gate(f"{a}.q_proj.weight", m + ("q_proj", "kernel"),
                       m + ("gate_proj", "kernel"), head_dim))
    if cfg.attention_bias:
      out.append(_q_gate(f"{a}.q_proj.bias", m + ("q_proj", "bias"), m + ("gate_proj", "bias"),
                         head_dim))
    out += attention_rules(cfg, L, a, q_gate=True)
    out += [plus_one(f"{a}.q_norm.weight", m + ("q_norm", "scale")),
            plus_one(f"{a}.k_norm.weight", m + ("k_norm", "scale"))]
  else:
    a = f"{hp}.linear_attn"
    out += [_qkvz(f"{a}.in_proj_qkvz.weight", m, k, h, n // k, hv),
            _ba(f"{a}.in_proj_ba.weight", m, k, n // k),
            _conv(f"{a}.conv1d.weight", m),
            copy(f"{a}.A_log", m + ("A_log",)), copy(f"{a}.dt_bias", m + ("dt_bias",)),
            copy(f"{a}.norm.weight", m + ("norm_scale",)),
            linear_out(f"{a}.out_proj.weight", m + ("o_proj", "kernel"))]
  f = L + ("ffn",)
  if is_moe:
    out.append(linear(f"{hp}.mlp.gate.weight", f + ("router",)))
    out += experts(f"{hp}.mlp.experts", cfg.num_experts, f)
    if cfg.num_shared_experts:
      out += mlp_rules(cfg, f"{hp}.mlp.shared_expert", f + ("shared",))
      out.append(_shared_gate(f"{hp}.mlp.shared_expert_gate.weight", f + ("shared_gate",)))
  else:
    out += mlp_rules(cfg, f"{hp}.mlp", f)
  return out


def rules(cfg) -> list[Rule]:
  out = [copy("model.embed_tokens.weight", ("embed",)),
         plus_one("model.norm.weight", ("final_norm", "scale"))]
  if not cfg.tie_embeddings:
    out.append(linear("lm_head.weight", ("lm_head", "kernel")))
  for i in range(cfg.num_layers):
    out += layer_rules(cfg, f"model.layers.{i}", C.layer(i), *cfg.layer_kind(i))
  if cfg.mtp_depth:
    M = ("mtp", 0)
    out += [plus_one("mtp.pre_fc_norm_embedding.weight", M + ("embed_norm", "scale")),
            plus_one("mtp.pre_fc_norm_hidden.weight", M + ("hidden_norm", "scale")),
            linear("mtp.fc.weight", M + ("proj", "kernel")),
            plus_one("mtp.norm.weight", M + ("norm", "scale"))]
    out += layer_rules(cfg, "mtp.layers.0", M + ("layer",), *mtp_layer_kind(cfg))
  return out
