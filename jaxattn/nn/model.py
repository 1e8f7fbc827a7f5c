"""A decoder-only language model assembled from jaxattn's mechanisms by a ``ModelConfig``.

    tokens [B, T] -> embed (+ learned / sinusoidal positions) -> [mHC: n streams]
                  -> layers (mixer per ``layer_pattern``, dense MLP or MoE) -> final norm -> logits

Layer pattern letters (``layer_pattern`` repeats to ``num_layers``; layer ``i`` uses
``pattern[i % len(pattern)]``):

    A  attention: MHA / GQA / MQA by ``num_kv_heads``          (``jaxattn.nn.Attention``)
    S  sliding-window attention with ``sliding_window``        (``Attention``)
    M  multi-head latent attention, decoupled RoPE             (``jaxattn.nn.MLA``)
    I  DeepSeek sparse attention: MLA + lightning indexer      (``jaxattn.nn.DSA``)
    D  Gated DeltaNet                                          (``jaxattn.nn.GatedDeltaNet``)

``num_experts > 0`` makes every layer from ``first_k_dense`` on a DeepSeek-style MoE.
``mtp_depth > 0`` adds DeepSeek-V3's multi-token-prediction modules (``jaxattn.nn.mtp``, held as
``model.mtp``; ``mtp_forward`` runs them over a training sequence, the forward itself ignores
them).

Depth without pain: with ``scan_layers=True`` the layers after the dense prefix are grouped into
identical *units* of one pattern period, created with ``nnx.vmap`` (parameters stacked on a leading
``layers`` axis) and run with ``nnx.scan``, so compile time does not grow with depth.  A remainder
that does not fill a unit runs unrolled.  ``remat`` wraps each layer (or unit) in
``jax.checkpoint`` with the named policy.

The call convention follows the modules: ``logits = model(tokens)``; with a cache from
``model.init_cache(...)``, ``logits, cache = model(tokens, cache=cache)``; ``return_aux=True``
appends a dict with the MoE auxiliary loss, the DSA indexer loss and the per-site expert loads.

Serving: ``model.init_paged_cache(batch, num_pages, page_size)`` gives every attention layer a
paged cache (a pool of pages, a page table and a length per sequence; Gated DeltaNet layers keep
their fixed-size state per sequence), so the sequences of a batch have their own lengths; with
``num_tokens [B]`` a call is a ragged chunk (continuous batching: one sequence prefills a chunk,
another decodes a token, a third waits), and ``cache.free(done)`` empties finished sequences'
slots for new ones (``jaxattn.serving.Engine`` runs that loop).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Int

from jaxattn.checks import is_int
from jaxattn.cache import KVCache
from jaxattn.mla_cache import LatentCache
from jaxattn.paged_cache import PagedKVCache, PageTable
from jaxattn.nn.attention import Attention
from jaxattn.nn.dsa import DSA
from jaxattn.nn.gated_deltanet import DeltaNetCache, GatedDeltaNet
from jaxattn.nn.linear import Einsum, param
from jaxattn.nn.mhc import HyperConnection, StreamCollapse
from jaxattn.nn.mla import MLA
from jaxattn.nn.mlp import MLP
from jaxattn.ops.moe import IMPLEMENTATIONS as MOE_IMPLEMENTATIONS, ClampedSwiGLU
from jaxattn.nn.moe import MoE
from jaxattn.nn.mtp import MTPModule, shift_left
from jaxattn.nn.norms import make_norm
from jaxattn.nn.positional import LearnedPositionalEmbedding
from jaxattn.ops.decode import check_num_tokens, check_ragged_needs_paged
from jaxattn.ops.hyper import hc_read, hc_write
from jaxattn.ops.moe import bias_update
from jaxattn.ops.rope import RopeScaling
from jaxattn.ops.sinusoidal import sinusoidal_positions
from jaxattn.sharding import _active_mesh, check_auto_mesh, shard, split_axis

LAYER_KINDS = {"A": "attention (MHA/GQA/MQA)", "S": "sliding-window attention",
               "M": "multi-head latent attention", "I": "DeepSeek sparse attention (MLA + indexer)",
               "D": "Gated DeltaNet"}
POSITIONS = ("rope", "alibi", "t5", "learned", "sinusoidal", "none")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Everything that defines a ``DecoderLM``; frozen, hashable, JSON round-trippable.

  Fields are grouped by the mechanism they configure; a field of a mechanism the pattern does not
  use is ignored.  ``dtype`` is the compute dtype (``"bfloat16"`` = mixed precision: fp32
  parameters, bf16 matmuls, fp32 softmax / norms / logits); ``param_dtype`` the storage dtype.
  """

  vocab_size: int = 259
  embed_dim: int = 128
  num_layers: int = 4
  num_heads: int = 4
  mlp_dim: int = 384
  layer_pattern: str = "A"
  # attention (A / S)
  num_kv_heads: int | None = None
  head_dim: int | None = None
  position: str = "rope"
  max_seq_len: int = 2048                     # the learned table's rows; also the default cache
  rope_base: float = 10000.0
  rotary_dim: int | None = None
  rope_interleaved: bool = False
  rope_scaling: dict | None = None            # RopeScaling fields, e.g. {"type": "yarn", ...}
  sliding_window: int | None = None
  logits_soft_cap: float | None = None
  attention_bias: bool = False
  attention_qk_norm: bool = False            # per-head RMSNorm on q and k before RoPE (Qwen3-Next)
  attention_output_gate: bool = False        # out * sigmoid(x W_gate) per head (Qwen3-Next)
  attention_sinks: bool = False              # a learned sink logit per head (gpt-oss)
  t5_num_buckets: int = 32
  t5_max_distance: int = 128
  attention_implementation: str | None = None
  # MLA (M / I)
  kv_lora_rank: int = 64
  q_lora_rank: int | None = None
  qk_nope_head_dim: int = 32
  qk_rope_head_dim: int = 16
  v_head_dim: int | None = None
  mla_mode: str = "naive"
  mla_rope_interleaved: bool = True
  # DSA (I)
  index_num_heads: int = 4
  index_head_dim: int = 32
  index_rope_dim: int = 16
  index_topk: int = 64
  dsa_attention_mode: str = "sparse"
  indexer_loss_weight: float = 1.0
  # Gated DeltaNet (D)
  deltanet_num_heads: int | None = None
  deltanet_num_key_heads: int | None = None
  deltanet_head_dim: int | None = None
  deltanet_v_head_dim: int | None = None
  deltanet_chunk_size: int = 64
  # norms and MLP
  norm: str = "rms"
  norm_position: str = "pre"
  norm_eps: float = 1e-6
  mlp_activation: str = "silu"
  gated_mlp: bool = True
  mlp_bias: bool = False
  # MoE (num_experts > 0)
  num_experts: int = 0
  num_experts_per_tok: int = 2
  moe_expert_dim: int | None = None
  num_shared_experts: int = 0
  first_k_dense: int = 0
  moe_score_func: str = "sigmoid"
  moe_n_group: int = 1
  moe_topk_group: int | None = None
  moe_norm_topk_prob: bool = True
  moe_routed_scaling_factor: float = 1.0
  moe_seq_balance_alpha: float = 1e-4
  moe_bias_update_rate: float = 1e-3
  moe_capacity_factor: float | None = None
  moe_shared_dim: int | None = None          # shared-expert hidden size (default shared x expert)
  moe_shared_gate: bool = False              # sigmoid(x w) gate on the shared expert (Qwen3-Next)
  moe_activation: str = "swiglu"             # or "clamped_swiglu" (gpt-oss)
  moe_swiglu_alpha: float = 1.702            # clamped_swiglu: g' sigmoid(alpha g') (up + 1) ...
  moe_swiglu_limit: float = 7.0              # ... with g' = min(g, limit), up clipped to +-limit
  moe_expert_bias: bool = False              # biases on the experts' projections (gpt-oss)
  moe_router_bias: bool = False              # a learned bias on the router logits (gpt-oss)
  moe_expert_format: str = "dense"           # "mxfp4": routed experts held in MXFP4, frozen
  moe_implementation: str | None = None      # grouped matmul: jaxattn.ops.moe.IMPLEMENTATIONS
  # residual streams
  residual: str = "plain"                     # plain | mhc | hc
  num_streams: int = 4
  # head
  tie_embeddings: bool = True
  # multi-token prediction (jaxattn.nn.mtp): D modules predicting 2 .. D + 1 tokens ahead
  mtp_depth: int = 0
  mtp_loss_weight: float = 0.3               # lambda: total += lambda / D * sum_k CE_k
  # numerics and compilation
  dtype: str = "float32"
  param_dtype: str = "float32"
  scan_layers: bool = False
  remat: str = "none"

  def __post_init__(self):
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      if isinstance(v, np.generic):  # np.int64 from a sweep, np.bool_ from a comparison: the
        object.__setattr__(self, f.name, v.item())  # Python value (JSON, hashing, equality)
    def positive(name, allow_none=False):
      v = getattr(self, name)
      if v is None and allow_none:
        return
      if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"`{name}` must be a positive int, got {v!r}.")
    for name in ("vocab_size", "embed_dim", "num_layers", "num_heads", "mlp_dim", "max_seq_len"):
      positive(name)
    for name in ("num_kv_heads", "head_dim", "moe_expert_dim", "moe_shared_dim",
                 "deltanet_num_heads", "deltanet_num_key_heads", "deltanet_head_dim",
                 "deltanet_v_head_dim"):
      positive(name, allow_none=True)
    positive("deltanet_chunk_size")
    if self.deltanet_chunk_size & (self.deltanet_chunk_size - 1):
      raise ValueError(f"`deltanet_chunk_size` must be a power of two, got "
                       f"{self.deltanet_chunk_size!r}.")
    for f in dataclasses.fields(self):
      # A string such as "false" is truthy: it would silently mean True.
      if f.type == "bool" and not isinstance(getattr(self, f.name), bool):
        raise ValueError(f"`{f.name}` must be a bool, got {getattr(self, f.name)!r}.")
    pat = self.layer_pattern
    if not isinstance(pat, str) or not pat or set(pat) - set(LAYER_KINDS):
      raise ValueError(f"`layer_pattern` must be a non-empty string of {sorted(LAYER_KINDS)} "
                       f"({'; '.join(f'{k}: {v}' for k, v in LAYER_KINDS.items())}), got {pat!r}.")
    if self.position not in POSITIONS:
      raise ValueError(f"`position` must be one of {POSITIONS}, got {self.position!r}.")
    if self.sliding_window is not None and (not is_int(self.sliding_window)
                                            or self.sliding_window < 0):
      raise ValueError(f"`sliding_window` must be None or a non-negative int, got "
                       f"{self.sliding_window!r}.")
    positive("num_streams")
    if not is_int(self.mtp_depth) or not 0 <= self.mtp_depth <= 8:
      raise ValueError(f"`mtp_depth` must be an int in [0, 8], got {self.mtp_depth!r}.")
    w = self.mtp_loss_weight
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not w >= 0:
      raise ValueError(f"`mtp_loss_weight` must be a number >= 0, got "
                       f"{self.mtp_loss_weight!r}.")
    if self.mtp_depth and self.residual != "plain":
      raise ValueError(f"multi-token prediction (mtp_depth={self.mtp_depth}) needs "
                       f"residual='plain', got {self.residual!r}.")
    if self.moe_expert_format not in ("dense", "mxfp4"):
      raise ValueError(f"`moe_expert_format` must be 'dense' or 'mxfp4', got "
                       f"{self.moe_expert_format!r}.")
    if self.moe_implementation is not None and self.moe_implementation not in MOE_IMPLEMENTATIONS:
      raise ValueError(f"`moe_implementation` must be None or one of {MOE_IMPLEMENTATIONS}, got "
                       f"{self.moe_implementation!r}.")
    if self.moe_activation not in ("swiglu", "clamped_swiglu"):
      raise ValueError(f"`moe_activation` must be 'swiglu' or 'clamped_swiglu', got "
                       f"{self.moe_activation!r}.")
    if not is_int(self.num_experts) or not is_int(self.first_k_dense):
      raise ValueError(f"`num_experts` ({self.num_experts!r}) and `first_k_dense` "
                       f"({self.first_k_dense!r}) must be ints.")
    if self.num_experts > 0 and (not is_int(self.num_experts_per_tok)
                                 or not 1 <= self.num_experts_per_tok <= self.num_experts):
      raise ValueError(f"`num_experts_per_tok` must be an int in [1, num_experts="
                       f"{self.num_experts}], got {self.num_experts_per_tok!r}.")
    if "S" in self.kinds() and self.sliding_window is None:  # (a negative one is refused above)
      raise ValueError(f"`layer_pattern` {pat!r} has sliding-window layers (S): `sliding_window` "
                       f"must be a non-negative int, got {self.sliding_window!r}.")
    if self.norm not in ("rms", "layer"):
      raise ValueError(f"`norm` must be 'rms' or 'layer', got {self.norm!r}.")
    if self.norm_position not in ("pre", "post"):
      raise ValueError(f"`norm_position` must be 'pre' or 'post', got {self.norm_position!r}.")
    if self.residual not in ("plain", "mhc", "hc"):
      raise ValueError(f"`residual` must be 'plain', 'mhc' or 'hc', got {self.residual!r}.")
    if self.residual != "plain" and self.norm_position != "pre":
      raise ValueError(f"`residual={self.residual!r}` needs norm_position='pre', got "
                       f"{self.norm_position!r}.")
    if self.dtype not in DTYPES or self.param_dtype not in DTYPES:
      raise ValueError(f"`dtype` ({self.dtype!r}) and `param_dtype` ({self.param_dtype!r}) must be "
                       f"one of {sorted(DTYPES)}.")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"`remat` must be one of {REMAT_POLICIES}, got {self.remat!r}.")
    if self.num_experts and self.first_k_dense < self.num_layers and self.mlp_activation != "silu":
      # the routed experts are SwiGLU (jaxattn.ops.moe); another activation would be ignored
      raise ValueError(f"MoE layers (num_experts={self.num_experts}) compute SwiGLU experts: "
                       f"`mlp_activation` must be 'silu', got {self.mlp_activation!r}.")
    if self.num_experts and self.first_k_dense < self.num_layers and not self.gated_mlp:
      raise ValueError(f"MoE layers (num_experts={self.num_experts}) compute gated (SwiGLU) "
                       "experts: `gated_mlp` must be True (it would apply to the dense layers "
                       "only).")
    if self.rope_scaling is not None:
      # Built here, so that a bad dict is refused with the config, not when the model is built.
      _rope_scaling(self)
    if self.num_experts < 0 or not 0 <= self.first_k_dense <= self.num_layers:
      raise ValueError(f"`num_experts` ({self.num_experts}) must be >= 0 and `first_k_dense` "
                       f"({self.first_k_dense}) in [0, num_layers={self.num_layers}].")
    if self.position in ("alibi", "t5") and self.kinds() & set("MI"):
      raise ValueError(f"`position={self.position!r}` applies to A/S attention layers only; MLA and "
                       f"DSA layers (in {pat!r}) always use decoupled RoPE. Use 'rope' or 'none'.")

  def __hash__(self):  # rope_scaling is a dict: hash the canonical JSON form instead
    return hash(self.to_json())

  # -- helpers ---------------------------------------------------------------------------------

  def kinds(self) -> set[str]:
    return set(self.layer_pattern[i % len(self.layer_pattern)] for i in range(self.num_layers))

  def moe_expert_activation(self):
    """The experts' ``ClampedSwiGLU`` (None: plain SwiGLU)."""
    if self.moe_activation == "swiglu":
      return None
    return ClampedSwiGLU(alpha=float(self.moe_swiglu_alpha), limit=float(self.moe_swiglu_limit))

  def layer_kind(self, i: int) -> tuple[str, bool]:
    """``(mixer letter, is_moe)`` of layer ``i``."""
    return self.layer_pattern[i % len(self.layer_pattern)], self.num_experts > 0 and i >= self.first_k_dense

  @property
  def compute_dtype(self):
    return DTYPES[self.dtype]

  @property
  def parameter_dtype(self):
    return DTYPES[self.param_dtype]

  def replace(self, **changes) -> "ModelConfig":
    unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
    if unknown:  # (dataclasses.replace raises a TypeError that names no allowed field)
      raise ValueError(f"unknown ModelConfig field(s) {unknown}.")
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
      raise ValueError(f"unknown ModelConfig field(s) {unknown}.")
    return cls(**d)

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), indent=2, sort_keys=True)


def _rope_scaling(cfg: ModelConfig) -> RopeScaling | None:
  d = cfg.rope_scaling
  if d is None:
    return None
  fields = [f.name for f in dataclasses.fields(RopeScaling)]
  if not isinstance(d, dict) or set(d) - set(fields) or "type" not in d or "factor" not in d:
    raise ValueError(f"`rope_scaling` must be None or a dict of RopeScaling fields {fields} "
                     f"(with 'type' and 'factor'), got {d!r}.")
  return RopeScaling(**d)


@dataclasses.dataclass(frozen=True)
class Unit:
  """Static description of a run of layers: ``kinds[j] = (letter, is_moe)`` per layer in it."""
  kinds: tuple[tuple[str, bool], ...]


def _zero():
  return jnp.zeros((), jnp.float32)


class DecoderLayer(nnx.Module):
  """One residual block: ``mixer`` (per ``kind``) and ``ffn`` (MLP or MoE), norms pre or post,
  optionally over mHC / HC residual streams.  ``__call__`` returns ``(y, cache, aux)``."""

  def __init__(self, cfg: ModelConfig, kind: str, moe: bool, *, layer_index: int = 0,
               rngs: nnx.Rngs):
    d, dtype, pdt = cfg.embed_dim, cfg.compute_dtype, cfg.parameter_dtype
    self.kind, self.is_moe, self.residual = kind, moe, cfg.residual
    self.norm_position = cfg.norm_position
    self.indexer_weight = cfg.indexer_loss_weight
    common = dict(rngs=rngs, dtype=dtype, param_dtype=pdt)
    self.mixer_norm = make_norm(cfg.norm, d, eps=cfg.norm_eps, rngs=rngs, param_dtype=pdt)
    if kind in "AS":
      pos = cfg.position if cfg.position in ("rope", "alibi", "t5") else "none"
      self.mixer = Attention(
          d, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, position=pos, rope_base=cfg.rope_base,
          rotary_dim=cfg.rotary_dim, rope_interleaved=cfg.rope_interleaved,
          rope_scaling=_rope_scaling(cfg), t5_num_buckets=cfg.t5_num_buckets,
          t5_max_distance=cfg.t5_max_distance,
          sliding_window=cfg.sliding_window if kind == "S" else None,
          logits_soft_cap=cfg.logits_soft_cap, use_bias=cfg.attention_bias,
          qk_norm=cfg.attention_qk_norm, output_gate=cfg.attention_output_gate,
          attention_sinks=cfg.attention_sinks, norm_eps=cfg.norm_eps,
          implementation=cfg.attention_implementation, **common)
    elif kind in "MI":
      mla = dict(kv_lora_rank=cfg.kv_lora_rank, q_lora_rank=cfg.q_lora_rank,
                 qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
                 v_head_dim=cfg.v_head_dim, mode=cfg.mla_mode, rope_base=cfg.rope_base,
                 rope_interleaved=cfg.mla_rope_interleaved, rope_scaling=_rope_scaling(cfg),
                 norm_eps=cfg.norm_eps, implementation=cfg.attention_implementation, **common)
      if kind == "M":
        self.mixer = MLA(d, cfg.num_heads, **mla)
      else:
        self.mixer = DSA(d, cfg.num_heads, index_num_heads=cfg.index_num_heads,
                         index_head_dim=cfg.index_head_dim, index_rope_dim=cfg.index_rope_dim,
                         index_topk=cfg.index_topk, attention_mode=cfg.dsa_attention_mode, **mla)
    else:
      self.mixer = GatedDeltaNet(
          d, cfg.num_heads if cfg.deltanet_num_heads is None else cfg.deltanet_num_heads,
          num_key_heads=cfg.deltanet_num_key_heads,
          head_dim=cfg.deltanet_head_dim, v_head_dim=cfg.deltanet_v_head_dim,
          chunk_size=cfg.deltanet_chunk_size, norm_eps=cfg.norm_eps, **common)
    self.ffn_norm = make_norm(cfg.norm, d, eps=cfg.norm_eps, rngs=rngs, param_dtype=pdt)
    if moe:
      self.ffn = MoE(d, cfg.num_experts, cfg.num_experts_per_tok,
                     cfg.moe_expert_dim or cfg.mlp_dim, num_shared_experts=cfg.num_shared_experts,
                     score_func=cfg.moe_score_func, n_group=cfg.moe_n_group,
                     topk_group=cfg.moe_topk_group, norm_topk_prob=cfg.moe_norm_topk_prob,
                     routed_scaling_factor=cfg.moe_routed_scaling_factor,
                     seq_balance_alpha=cfg.moe_seq_balance_alpha,
                     bias_update_rate=cfg.moe_bias_update_rate,
                     capacity_factor=cfg.moe_capacity_factor, shared_dim=cfg.moe_shared_dim,
                     shared_gate=cfg.moe_shared_gate, activation=cfg.moe_expert_activation(),
                     expert_bias=cfg.moe_expert_bias, router_logit_bias=cfg.moe_router_bias,
                     expert_format=cfg.moe_expert_format,
                     implementation=cfg.moe_implementation, **common)
    else:
      self.ffn = MLP(d, cfg.mlp_dim, activation=cfg.mlp_activation, gated=cfg.gated_mlp,
                     use_bias=cfg.mlp_bias, **common)
    if cfg.residual == "plain":
      self.mixer_hc = self.ffn_hc = None
    else:
      hk = dict(kind=cfg.residual, layer_index=layer_index, rngs=rngs, param_dtype=pdt)
      self.mixer_hc = HyperConnection(d, cfg.num_streams, **hk)
      self.ffn_hc = HyperConnection(d, cfg.num_streams, **hk)

  def init_cache(self, batch: int, max_len: int, dtype=None, *, rolling: bool = False):
    if self.kind == "D":
      return self.mixer.init_cache(batch, max_len, dtype)
    if rolling and self.kind == "S":
      return self.mixer.init_rolling_cache(batch, dtype)
    return self.mixer.init_cache(batch, max_len, dtype)

  def init_paged_cache(self, batch: int, num_pages: int, page_size: int, max_pages_per_seq,
                       dtype=None, window_num_pages=None):
    if self.kind == "D":    # a fixed-size recurrent state per sequence: nothing to page
      return self.mixer.init_cache(batch, dtype=dtype)
    if self.kind == "S" and window_num_pages is not None:
      num_pages = window_num_pages
    return self.mixer.init_paged_cache(batch, num_pages, page_size,
                                       max_pages_per_seq=max_pages_per_seq, dtype=dtype)

  def cache_bytes(self, seq_len: int, batch: int = 1, dtype=jnp.bfloat16) -> int:
    return self.mixer.cache_bytes(seq_len, batch, dtype)

  def _mix(self, h, positions, segment_ids, cache, want_aux, num_tokens=None):
    aux = _zero()
    ragged = {} if num_tokens is None else {"num_tokens": num_tokens}
    if self.kind in "ASM":
      out = self.mixer(h, positions=positions, segment_ids=segment_ids, cache=cache, **ragged)
    elif self.kind == "I":
      out = self.mixer(h, positions=positions, cache=cache, return_aux=want_aux,
                       segment_ids=segment_ids, **ragged)
      if want_aux:
        *out, a = out if isinstance(out, tuple) else (out,)
        out = out[0] if len(out) == 1 else tuple(out)
        aux = a["indexer_loss"] * self.indexer_weight
    else:
      out = self.mixer(h, segment_ids=segment_ids, cache=cache, **ragged)
    if cache is not None:
      out, cache = out
    return out, cache, aux

  def _ffn(self, h, token_mask, segment_ids=None):
    if self.is_moe:
      y, stats = self.ffn(h, token_mask=token_mask, segment_ids=segment_ids)
      return y, stats.aux_loss, stats.load
    return self.ffn(h), _zero(), None

  def __call__(self, x, *, positions=None, segment_ids=None, cache=None, want_aux=False,
               num_tokens=None):
    token_mask = None if segment_ids is None else segment_ids > 0
    if num_tokens is not None:    # a ragged chunk's padding rows are not routed to experts
      token_mask = jnp.arange(x.shape[1], dtype=jnp.int32)[None, :] < num_tokens[:, None]
    if self.residual == "plain":
      x = shard(x, ("batch", "length", "act_embed"))
      if self.norm_position == "pre":
        a, cache, ix = self._mix(self.mixer_norm(x), positions, segment_ids, cache, want_aux,
                                 num_tokens)
        h = x + a
        f, moe_aux, load = self._ffn(self.ffn_norm(h), token_mask, segment_ids)
        y = h + f
      else:
        a, cache, ix = self._mix(x, positions, segment_ids, cache, want_aux, num_tokens)
        h = self.mixer_norm(x + a)
        f, moe_aux, load = self._ffn(h, token_mask, segment_ids)
        y = self.ffn_norm(h + f)
      y = shard(y, ("batch", "length", "act_embed"))
    else:
      x = shard(x, ("batch", "length", None, "act_embed"))
      pre, post, res = self.mixer_hc.coefficients(x)
      a, cache, ix = self._mix(self.mixer_norm(hc_read(x, pre)), positions, segment_ids, cache,
                               want_aux, num_tokens)
      x = hc_write(x, a, post, res)
      pre, post, res = self.ffn_hc.coefficients(x)
      f, moe_aux, load = self._ffn(self.ffn_norm(hc_read(x, pre)), token_mask, segment_ids)
      y = shard(hc_write(x, f, post, res), ("batch", "length", None, "act_embed"))
    aux = {"moe_aux_loss": moe_aux, "indexer_loss": ix}
    if load is not None:
      aux["moe_load"] = load
    return y, cache, aux


class LayerUnit(nnx.Module):
  """Consecutive layers run as one step (one pattern period); stacked and scanned as a whole."""

  def __init__(self, cfg: ModelConfig, unit: Unit, *, first_index: int, rngs: nnx.Rngs):
    self.layers = nnx.List([DecoderLayer(cfg, k, moe, layer_index=first_index + j, rngs=rngs)
                            for j, (k, moe) in enumerate(unit.kinds)])

  def init_cache(self, batch, max_len, dtype=None, *, rolling=False):
    return tuple(l.init_cache(batch, max_len, dtype, rolling=rolling) for l in self.layers)

  def init_paged_cache(self, *args):
    return tuple(l.init_paged_cache(*args) for l in self.layers)

  def __call__(self, x, positions, segment_ids, cache, want_aux, num_tokens=None):
    new_cache, auxes = [], []
    for j, layer in enumerate(self.layers):
      x, c, aux = layer(x, positions=positions, segment_ids=segment_ids,
                        cache=None if cache is None else cache[j], want_aux=want_aux,
                        num_tokens=num_tokens)
      new_cache.append(c)
      auxes.append(aux)
    return x, (None if cache is None else tuple(new_cache)), tuple(auxes)


def _remat_policy(name: str):
  return {"full": None, "dots": jax.checkpoint_policies.checkpoint_dots,
          "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}[name]


def _add_leading_axis_name(module: nnx.Module, name: str) -> None:
  """Stacked parameters gain a leading axis: prepend its logical name to ``logical_axes``."""
  for _, var in nnx.iter_graph(module):
    if isinstance(var, nnx.Variable):
      axes = var.get_metadata().get("logical_axes")
      if axes is not None:
        var.set_metadata("logical_axes", (name,) + tuple(axes))


class ScannedUnits(nnx.Module):
  """``count`` identical ``LayerUnit`` s with stacked parameters, run by ``nnx.scan``."""

  def __init__(self, cfg: ModelConfig, unit: Unit, count: int, *, first_index: int,
               rngs: nnx.Rngs):
    self.count, self.remat = count, cfg.remat

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(r):
      return LayerUnit(cfg, unit, first_index=first_index, rngs=r)

    self.units = make(rngs)
    _add_leading_axis_name(self.units, "layers")
    if cfg.residual == "hc":
      # Every vmapped copy was built with `first_index`; HC's static read vector depends on the
      # layer index (stream layer_index mod n), so copy c gets its own, as unrolled layers do.
      size, n = len(unit.kinds), cfg.num_streams
      for j, layer in enumerate(self.units.layers):
        pre = jax.nn.one_hot((first_index + size * np.arange(count) + j) % n, n)
        for hc in (layer.mixer_hc, layer.ffn_hc):
          hc.static_pre[...] = pre.astype(hc.static_pre[...].dtype)

  def init_cache(self, batch, max_len, dtype=None, *, rolling=False):
    # Cache shapes depend only on static attributes, identical across the stack.
    one = self.units.init_cache(batch, max_len, dtype, rolling=rolling)
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (self.count,) + a.shape), one)

  def init_paged_cache(self, *args):
    one = self.units.init_paged_cache(*args)
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (self.count,) + a.shape), one)

  def __call__(self, x, positions, segment_ids, cache, want_aux, num_tokens=None):
    def body(x, unit, cache):
      y, c, aux = unit(x, positions, segment_ids, cache, want_aux, num_tokens)
      return y, (c, aux)

    if self.remat != "none" and cache is None:
      body = nnx.remat(body, policy=_remat_policy(self.remat), prevent_cse=False)
    if cache is None:
      step = nnx.scan(lambda x, unit: body(x, unit, None), in_axes=(nnx.Carry, 0),
                      out_axes=(nnx.Carry, 0))
      x, (_, aux) = step(x, self.units)
      return x, None, aux
    step = nnx.scan(body, in_axes=(nnx.Carry, 0, 0), out_axes=(nnx.Carry, 0))
    x, (cache, aux) = step(x, self.units, cache)
    return x, cache, aux


class UnrolledUnit(nnx.Module):
  """Layers run one after another (the dense prefix, a remainder, or everything unscanned)."""

  def __init__(self, cfg: ModelConfig, unit: Unit, *, first_index: int, rngs: nnx.Rngs):
    self.unit = LayerUnit(cfg, unit, first_index=first_index, rngs=rngs)
    self.remat = cfg.remat

  def init_cache(self, batch, max_len, dtype=None, *, rolling=False):
    return self.unit.init_cache(batch, max_len, dtype, rolling=rolling)

  def init_paged_cache(self, *args):
    return self.unit.init_paged_cache(*args)

  def __call__(self, x, positions, segment_ids, cache, want_aux, num_tokens=None):
    if self.remat != "none" and cache is None:
      new_aux = []
      for layer in self.unit.layers:
        f = nnx.remat(lambda layer, x: layer(x, positions=positions, segment_ids=segment_ids,
                                             want_aux=want_aux),
                      policy=_remat_policy(self.remat), prevent_cse=True)
        x, _, aux = f(layer, x)
        new_aux.append(aux)
      return x, None, tuple(new_aux)
    return self.unit(x, positions, segment_ids, cache, want_aux, num_tokens)


def plan_groups(cfg: ModelConfig) -> list[tuple[str, Unit, int, int]]:
  """How the layers are grouped: ``(mode, unit, count, first_layer)`` with mode ``"unrolled"``
  (``count`` = 1) or ``"scanned"`` (``count`` stacked copies of ``unit``)."""
  kinds = [cfg.layer_kind(i) for i in range(cfg.num_layers)]
  if not cfg.scan_layers:
    return [("unrolled", Unit(tuple(kinds)), 1, 0)]
  groups = []
  k = cfg.first_k_dense if cfg.num_experts > 0 else 0
  if k:
    groups.append(("unrolled", Unit(tuple(kinds[:k])), 1, 0))
  p = len(cfg.layer_pattern)
  rest = cfg.num_layers - k
  count = rest // p
  if count >= 1:
    groups.append(("scanned", Unit(tuple(kinds[k:k + p])), count, k))
  tail = k + count * p
  if tail < cfg.num_layers:
    groups.append(("unrolled", Unit(tuple(kinds[tail:])), 1, tail))
  return groups


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelCache:
  """The decode state of a ``DecoderLM``: one entry per layer group, and the tokens seen so far."""

  groups: tuple
  index: Int[Array, ""]

  def with_snapshots(self) -> "ModelCache":
    """This cache with every Gated DeltaNet state asking for per-token snapshots on the next
    call (``DeltaNetCache.with_snapshots``; ``jaxattn.speculative.rewind_cache`` reads them)."""
    return ModelCache(_snapshot_groups(self.groups), self.index)


def _split_heads(c: DeltaNetCache) -> DeltaNetCache:
  """Gated DeltaNet states (a slot's, or a snapshot store's) split over the mesh axes of their
  heads (a no-op without a mesh)."""
  if _active_mesh() is None:
    return c
  return DeltaNetCache(conv_q=split_axis(c.conv_q, -2, "kv_heads"),
                       conv_k=split_axis(c.conv_k, -2, "kv_heads"),
                       conv_v=split_axis(c.conv_v, -2, "heads"),
                       state=split_axis(c.state, -3, "heads"))


def _snapshot_groups(groups: tuple) -> tuple:
  """``groups`` with every Gated DeltaNet state asking for per-token snapshots."""
  return tuple(tuple(c.with_snapshots() if isinstance(c, DeltaNetCache) else c for c in group)
               for group in groups)


def _copy_slots(dst: DeltaNetCache, to, src: DeltaNetCache, frm, axis: int) -> DeltaNetCache:
  """``dst`` with its slots ``to [n]`` (on ``axis``; out-of-range entries dropped) set to
  ``src``'s slots ``frm [n]`` (clipped into range), in every array of the Gated DeltaNet state:
  a snapshot saved from slots, or slots restored from snapshots."""
  where = (slice(None),) * axis + (to,)
  return jax.tree.map(lambda d, x: d.at[where].set(jnp.take(x, frm, axis=axis, mode="clip"),
                                                   mode="drop"), dst, src)


def paged_positions(lengths: Int[Array, "B"], t: int,
                    num_tokens: Int[Array, "B"] | None = None) -> Int[Array, "B T"]:
  """Positions of a chunk of ``t`` tokens that each sequence continues at its own length:
  ``lengths[b] + arange(t)``; with ``num_tokens`` (a ragged chunk) a row's padding repeats its
  last real position (a learned table's end is then no error)."""
  rows = jnp.arange(t, dtype=jnp.int32)[None, :]
  positions = lengths[:, None] + rows
  if num_tokens is None:
    return positions
  last = jnp.maximum(lengths + num_tokens - 1, 0)[:, None]
  return jnp.where(rows < num_tokens[:, None], positions, last)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedModelCache:
  """The serving state of a ``DecoderLM`` (``init_paged_cache``): one entry per layer group (a
  ``PagedKVCache`` / ``PagedLatentCache`` per attention layer, a ``DeltaNetCache`` per Gated
  DeltaNet layer; a scanned group's stacked on a leading layer axis, ``stacked``) and the tokens
  each sequence holds, ``lengths [B]``."""

  groups: tuple
  lengths: Int[Array, "B"]
  stacked: tuple = dataclasses.field(metadata=dict(static=True))

  @property
  def batch(self) -> int:
    return self.lengths.shape[0]

  def free(self, done, keep=None) -> "PagedModelCache":
    """The sequences where ``done [B]`` (bool) emptied: their pages back to every layer's pool
    (except those where ``keep [P]`` (bool) is True: shared or prefix-cached pages, see
    ``attach``), their recurrent states zero, their lengths 0, ready for new sequences."""
    done = jnp.asarray(done)
    if done.shape != (self.batch,) or done.dtype != jnp.bool_:
      raise ValueError(f"`done` must be a bool array [B={self.batch}], got "
                       f"{done.dtype}{list(done.shape)}.")

    def one(c):
      return c.reset(done) if isinstance(c, DeltaNetCache) else c.free(done, keep)

    groups = tuple(tuple(jax.vmap(one)(c) if stacked else one(c) for c in group)
                   for group, stacked in zip(self.groups, self.stacked))
    return PagedModelCache(groups, jnp.where(done, 0, self.lengths), self.stacked)

  def shard(self) -> "PagedModelCache":
    """This cache laid out on the active mesh (``jax.set_mesh``; without one it is returned as
    is): each attention layer's key / value pools split over the mesh axes of its KV heads (the
    ``"kv_heads"`` rule, when they divide the head count: a device holds its heads' pages, the
    ones its share of the attention reads), each Gated DeltaNet state over its heads; page
    tables, lengths, free-page stacks and MLA latents (read by every head) replicated.  No pool
    is split over the batch axes: any sequence may own any page.  Eagerly it places the arrays;
    under jit it constrains them, so a step that returns ``cache.shard()`` keeps the layout from
    one call to the next (``jaxattn.serving.Engine(mesh=...)``)."""
    if _active_mesh() is None:
      return self
    every = lambda tree: jax.tree.map(lambda x: split_axis(x, None), tree)  # noqa: E731

    def one(c):
      if isinstance(c, DeltaNetCache):
        return _split_heads(c)
      if isinstance(c, PagedKVCache):
        k = c.num_kv_heads
        scales = ({} if not c.quantized else  # [P, 1, K * page]: K-major, as the rows
                  {f"{n}_scale_pool": split_axis(getattr(c, f"{n}_scale_pool"), -1, "kv_heads", k)
                   for n in ("key", "value")})
        return dataclasses.replace(c, key_pool=split_axis(c.key_pool, -1, "kv_heads", k),
                                   value_pool=split_axis(c.value_pool, -1, "kv_heads", k),
                                   table=every(c.table), **scales)
      return every(c)                                   # latent pools: shared by the heads

    groups = tuple(tuple(one(c) for c in group) for group in self.groups)
    return PagedModelCache(groups, split_axis(self.lengths, None), self.stacked)

  @property
  def nbytes(self) -> int:
    """Device bytes the cache holds: every layer's page pools (all pages, used or not), page
    tables and free stacks, recurrent states, and the lengths."""
    return int(sum(x.nbytes for x in jax.tree.leaves((self.groups, self.lengths))))

  @property
  def recurrent(self) -> bool:
    """Whether some layer keeps a recurrent state (Gated DeltaNet): its history is not in pages,
    so pages alone cannot be shared between sequences (``attach`` then needs a snapshot of the
    states after the shared tokens: ``save_states``)."""
    return any(isinstance(c, DeltaNetCache) for group in self.groups for c in group)

  @property
  def paged(self) -> bool:
    """Whether some layer keeps its history in pages (attention, MLA, DSA)."""
    return any(not isinstance(c, DeltaNetCache) for group in self.groups for c in group)

  def state_store(self, count: int) -> tuple:
    """An empty store of ``count`` snapshots of the recurrent states: per group a tuple with,
    for each Gated DeltaNet layer, a ``DeltaNetCache`` of ``count`` rows (on axis 1 for a
    scanned group), None for each paged layer; on a mesh split over the heads as the slots'
    states are (``shard``).  ``save_states`` fills it, ``attach`` reads it."""
    def one(c, stacked):
      if not isinstance(c, DeltaNetCache):
        return None
      shape = lambda x: x.shape[:int(stacked)] + (count,) + x.shape[int(stacked) + 1:]  # noqa: E731
      return _split_heads(jax.tree.map(lambda x: jnp.zeros(shape(x), x.dtype), c))
    return tuple(tuple(one(c, stacked) for c in group)
                 for group, stacked in zip(self.groups, self.stacked))

  def save_states(self, store: tuple, rows, ids) -> tuple:
    """``store`` (``state_store``) with the recurrent states of slots ``rows [n]`` copied into its
    snapshots ``ids [n]``: the states after the tokens each slot holds (a prefix cache keeps
    them for later requests that share those tokens).  Negative or out-of-range ids (padding)
    are dropped."""
    rows, ids = jnp.asarray(rows), jnp.asarray(ids)

    def one(c, kept, stacked):
      if kept is None:
        return None
      axis = int(stacked)
      to = jnp.where(ids < 0, kept.state.shape[axis], ids)           # padding: dropped
      return _split_heads(_copy_slots(kept, to, c, rows, axis))
    return tuple(tuple(one(c, k, stacked) for c, k in zip(group, kept))
                 for group, kept, stacked in zip(self.groups, store, self.stacked))

  @property
  def page_table(self) -> Int[Array, "B M"]:
    """``whole_table()``'s page table."""
    return self.whole_table().page_table

  def whole_table(self) -> PageTable:
    """The ``PageTable`` of the first paged layer that holds whole sequences (the layers append
    the same token counts into pools of one size, so their tables are equal; a sliding-window
    layer's differs once ``release_behind`` released pages, or with a pool of its own size),
    else of the first paged layer (of a scanned stack, its first layer's)."""
    tables = [jax.tree.map(lambda x: x[0], c.table) if stacked else c.table
              for group, stacked in zip(self.groups, self.stacked) for c in group
              if not isinstance(c, DeltaNetCache)]
    if not tables:
      raise ValueError("this cache has no paged layer (only recurrent states).")
    whole = [t for t, w in zip(tables, self.windows) if w is None]
    return (whole or tables)[0]

  def _tables(self, fn) -> tuple:
    """The groups with every paged layer's ``PageTable`` replaced by ``fn(table, layer cache)``
    (the layer's ``window`` read there, say)."""
    def one(c):
      return c if isinstance(c, DeltaNetCache) else dataclasses.replace(c, table=fn(c.table, c))
    return tuple(tuple(jax.vmap(one)(c) if stacked else one(c) for c in group)
                 for group, stacked in zip(self.groups, self.stacked))

  def attach(self, rows, page_table, lengths, store: tuple | None = None,
             state_ids=None) -> "PagedModelCache":
    """Prefix sharing: slots ``rows [n]`` (empty ones) start from the whole pages
    ``page_table [n, M]`` (ids; -1 = none) holding their first ``lengths [n]`` tokens, which
    another sequence computed; in every layer (``PageTable.attach``).  Their next tokens go at
    ``lengths``.  A model with recurrent layers needs their states after those tokens too:
    snapshots ``state_ids [n]`` of ``store`` (``save_states``).  Entries of ``rows`` that are
    negative or ``>= B`` are dropped."""
    if self.recurrent and (store is None or state_ids is None):
      raise ValueError("`attach` (prefix sharing) on a model with recurrent (Gated DeltaNet) "
                       "layers needs their states after the shared tokens: pass `store` "
                       "(state_store / save_states) and `state_ids`.")
    rows = jnp.where(jnp.asarray(rows) < 0, self.batch, jnp.asarray(rows))
    groups = self._tables(lambda t, _: t.attach(rows, page_table, lengths))
    if self.recurrent:
      ids = jnp.asarray(state_ids)

      def restore(c, kept, stacked):
        return c if kept is None else _copy_slots(c, rows, kept, ids, int(stacked))
      groups = tuple(tuple(restore(c, k, stacked) for c, k in zip(group, kept))
                     for group, kept, stacked in zip(groups, store, self.stacked))
    return PagedModelCache(groups, self.lengths.at[rows].set(jnp.asarray(lengths, jnp.int32),
                                                             mode="drop"), self.stacked)

  def release_behind(self) -> "PagedModelCache":
    """Each sliding-window layer's pages wholly behind each sequence's window back to that
    layer's pool (``PageTable.release_behind`` with the layer's ``PagedKVCache.window``), so that
    a sequence holds about ``window / page_size + 1`` pages in such a layer, not its length's;
    the other layers (full attention, MLA, DSA) keep every page.  Not with shared pages (a
    prefix cache): they outlive the window."""
    def one(table, c):
      window = getattr(c, "window", None)
      return table if window is None else table.release_behind(window)
    return PagedModelCache(self._tables(one), self.lengths, self.stacked)

  @property
  def windows(self) -> tuple:
    """The sliding windows of the paged layers (None: full attention, MLA, DSA), in order."""
    return tuple(getattr(c, "window", None) for group in self.groups for c in group
                 if not isinstance(c, DeltaNetCache))

  def with_snapshots(self) -> "PagedModelCache":
    """This cache with every Gated DeltaNet state asking for per-token snapshots on the next
    call (``DeltaNetCache.with_snapshots``), so that ``rewind`` can go back into that call."""
    return PagedModelCache(_snapshot_groups(self.groups), self.lengths, self.stacked)

  def rewind(self, lengths: Int[Array, "B"], start: Int[Array, "B"] | None = None
             ) -> "PagedModelCache":
    """Every sequence cut back to its first ``lengths[b]`` tokens, in every layer
    (``PageTable.truncate``: the pages past them back to the pools).  Recurrent (Gated DeltaNet)
    states cannot drop tokens they have read: they are taken from the snapshots of the last call
    (``with_snapshots`` before it), whose sequences held ``start[b]`` tokens before it (so
    ``lengths[b]`` is in ``[start[b], start[b] + its tokens]``); without snapshots a model with
    recurrent layers cannot be rewound."""
    lengths = jnp.minimum(jnp.asarray(lengths, jnp.int32), self.lengths)
    kinds = [c for group in self.groups for c in group if isinstance(c, DeltaNetCache)]
    if kinds and (start is None or not all(c.snapshots for c in kinds)):
      raise ValueError("`rewind` needs every layer's state to be a cache of positions, or the "
                       "recurrent (Gated DeltaNet) states' snapshots of the last call "
                       "(`with_snapshots` before it, and its `start` lengths): their states "
                       "cannot drop tokens they have read.")
    tables = self._tables(lambda t, _: t.truncate(lengths))
    if kinds:
      pick = jnp.maximum(lengths - jnp.asarray(start, jnp.int32), 0)
      tables = tuple(tuple(c.at(pick) if isinstance(c, DeltaNetCache) else c for c in g)
                     for g in tables)
    return PagedModelCache(tables, lengths, self.stacked)

  def on_table(self, table: PageTable, lengths: Int[Array, "B"]) -> "PagedModelCache":
    """This cache with every paged layer's ``PageTable`` replaced by ``table`` (its lengths set
    to ``lengths``): for a cache indexed by another cache's table instead of keeping its own (a
    draft model's or an MTP block's by the serving model's, ``jaxattn.serving``); its pools must
    hold ``table``'s pages."""
    view = dataclasses.replace(table, lengths=lengths)
    return PagedModelCache(self._tables(lambda *_: view), lengths, self.stacked)

  def reserve_ahead(self, num_tokens: Int[Array, "B"], t: int) -> "PagedModelCache":
    """Every paged layer's pages for each sequence's next ``num_tokens[b] <= t`` tokens (``t``
    static) allocated now, its length unchanged: the call that writes those tokens finds them in
    place (``PageTable.reserve`` counts the pages a table holds past its length), and a cache
    indexed by the same table (a draft model's, ``jaxattn.serving``) can write at those
    positions first.  That call must follow: ``free`` returns only the pages under a length."""
    def ahead(table, _):
      grown, _, _ = table.reserve(t, num_tokens)
      return dataclasses.replace(grown, lengths=table.lengths)
    return PagedModelCache(self._tables(ahead), self.lengths, self.stacked)

  def push_pages(self, pages) -> "PagedModelCache":
    """``pages [n]`` (ids; negative entries are padding) back to every layer's free stack: pages
    a prefix cache held and no sequence holds any more (``PageTable.push``)."""
    return PagedModelCache(self._tables(lambda t, _: t.push(pages)), self.lengths, self.stacked)

  def take(self, rows: Int[Array, "b"], pages: int | None = None) -> "PagedModelCache":
    """The sub-batch of sequence slots ``rows [b]``: every layer's page-table rows and lengths
    and recurrent states of those slots, with the page pools and free-page stacks whole (shared:
    a call on the sub-batch reads and allocates from them).  An entry ``>= B`` or negative
    (padding of a fixed-size sub-batch) reads the last slot; it must feed no token
    (``num_tokens`` 0), and ``put`` drops it.  ``pages``: keep only the first ``pages`` columns
    of the page tables (the call's sequences, new tokens included, must fit in them): the decode
    paths then read ``pages`` pages per sequence, not the table's width."""
    rows = self._padding_past_end(rows)
    sub = self._rows(lambda x, axis: jnp.take(x, rows, axis=axis, mode="clip"), None)
    if pages is None or pages >= self.page_table.shape[-1]:
      return sub
    return PagedModelCache(sub._tables(lambda t, _: dataclasses.replace(
        t, page_table=t.page_table[:, :pages])), sub.lengths, sub.stacked)

  def _padding_past_end(self, rows):
    """Negative entries as ``B``: a -1 would otherwise be clipped to slot 0 by ``take`` and wrap
    to slot ``B - 1`` in ``put`` (two slots sharing pages)."""
    rows = jnp.asarray(rows)
    return jnp.where(rows < 0, self.batch, rows)

  def put(self, rows: Int[Array, "b"], sub: "PagedModelCache") -> "PagedModelCache":
    """This cache with ``sub`` (``take(rows[, pages])`` after a model call) written back: the
    slots' rows (their first ``pages`` table columns), and the pools and free stacks whole.
    Entries ``>= B`` or negative are dropped."""
    rows = self._padding_past_end(rows)

    def write(x, axis, new):
      index = (slice(None),) * axis + (rows,)
      if x.ndim == new.ndim > axis + 1 and new.shape[-1] < x.shape[-1]:   # a narrowed table
        index = index + (slice(None),) * (x.ndim - axis - 2) + (slice(0, new.shape[-1]),)
      return x.at[index].set(new, mode="drop")
    return self._rows(write, sub)

  def _rows(self, fn, sub):
    """Applies ``fn(x, axis[, new])`` to every per-slot array (the others from ``sub`` if given):
    page-table rows and lengths of the paged caches, all of a ``DeltaNetCache``."""
    def one(c, new, axis):
      f = (lambda x, n: fn(x, axis)) if sub is None else (lambda x, n: fn(x, axis, n))
      if isinstance(c, DeltaNetCache):
        return jax.tree.map(f, c, c if new is None else new)
      base = c if new is None else new                 # pools, free stack: shared, as they are
      table = dataclasses.replace(
          base.table, page_table=f(c.table.page_table, base.table.page_table),
          lengths=f(c.table.lengths, base.table.lengths))
      return dataclasses.replace(base, table=table)

    groups = tuple(
        tuple(one(c, None if sub is None else n, 1 if stacked else 0)
              for c, n in zip(group, group if sub is None else new_group))
        for group, new_group, stacked in zip(self.groups,
                                             self.groups if sub is None else sub.groups,
                                             self.stacked))
    lengths = fn(self.lengths, 0) if sub is None else fn(self.lengths, 0, sub.lengths)
    return PagedModelCache(groups, lengths, self.stacked)


def cache_capacity(cache: ModelCache) -> int | None:
  """Slots of the smallest bounded layer cache in ``cache`` (``KVCache``, ``LatentCache``; a
  scanned group's caches are stacked on a leading layer axis), None when no layer has a bound
  (recurrent states, rolling windows, paged caches)."""
  caps = []

  def visit(x):
    if isinstance(x, KVCache):
      caps.append(x.key.shape[-2])
    elif isinstance(x, LatentCache):
      caps.append(x.kv.shape[-2])
    return x

  jax.tree_util.tree_map(visit, cache.groups,
                         is_leaf=lambda x: isinstance(x, (KVCache, LatentCache)))
  return min(caps) if caps else None


class DecoderLM(nnx.Module):
  """A decoder-only language model from a ``ModelConfig`` (see the module docstring)."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    cfg = self.config = config
    d, v, pdt = cfg.embed_dim, cfg.vocab_size, cfg.parameter_dtype
    # std 1/sqrt(D): tied logits start at unit scale (loss ~ log V), not sqrt(D) times that.
    self.embed = param(rngs, nnx.initializers.normal(stddev=d ** -0.5), (v, d), ("vocab", "embed"),
                       pdt)
    self.pos_embed = (LearnedPositionalEmbedding(cfg.max_seq_len, d, rngs=rngs, param_dtype=pdt)
                      if cfg.position == "learned" else None)
    groups = []
    for mode, unit, count, first in plan_groups(cfg):
      if mode == "scanned":
        groups.append(ScannedUnits(cfg, unit, count, first_index=first, rngs=rngs))
      else:
        groups.append(UnrolledUnit(cfg, unit, first_index=first, rngs=rngs))
    self.groups = nnx.List(groups)
    self.collapse = (StreamCollapse(d, cfg.num_streams, kind="mhc", rngs=rngs, param_dtype=pdt)
                     if cfg.residual != "plain" else None)
    # Pre-LN leaves the residual stream unnormalized: one norm before the head.  Post-LN layers
    # end with their own norm (the original Transformer has no final one).
    self.final_norm = (make_norm(cfg.norm, d, eps=cfg.norm_eps, rngs=rngs, param_dtype=pdt)
                       if cfg.norm_position == "pre" else None)
    self.lm_head = (None if cfg.tie_embeddings else
                    Einsum("BTD,DV->BTV", (d, v), ("embed", "vocab"), rngs=rngs,
                           dtype=cfg.compute_dtype, param_dtype=pdt))
    self.mtp = (nnx.List([MTPModule(cfg, k, rngs=rngs) for k in range(1, cfg.mtp_depth + 1)])
                if cfg.mtp_depth else None)

  # -- cache -----------------------------------------------------------------------------------

  def init_cache(self, batch: int, max_len: int | None = None, dtype=None, *,
                 rolling: bool = False) -> ModelCache:
    """An empty decode cache for ``batch`` sequences of up to ``max_len`` (default
    ``max_seq_len``) tokens; ``rolling=True`` keeps only the window in sliding-window layers."""
    max_len = max_len or self.config.max_seq_len
    dtype = dtype or self.config.compute_dtype
    return ModelCache(tuple(g.init_cache(batch, max_len, dtype, rolling=rolling)
                            for g in self.groups), jnp.zeros((), jnp.int32))

  def init_paged_cache(self, batch: int, num_pages: int, page_size: int, *,
                       max_pages_per_seq: int | None = None, dtype=None,
                       window_num_pages: int | None = None) -> PagedModelCache:
    """An empty serving cache for ``batch`` sequence slots: each attention layer gets a pool of
    ``num_pages`` pages of ``page_size`` tokens (``jaxattn.paged_cache``; at most
    ``max_pages_per_seq`` per sequence, default ``num_pages``), each Gated DeltaNet layer its
    recurrent state per slot.  Sliding-window layers read only their window's pages and can
    release the others (``PagedModelCache.release_behind``), so they may have a smaller pool:
    ``window_num_pages`` pages each (default ``num_pages``).  T5-bias layers decode on the XLA
    path (the kernels take no learned bias)."""
    if window_num_pages is not None and (not is_int(window_num_pages) or window_num_pages < 1):
      raise ValueError(f"`window_num_pages` must be None or a positive int, got "
                       f"{window_num_pages!r}.")
    dtype = dtype or self.config.compute_dtype
    args = (batch, num_pages, page_size, max_pages_per_seq, dtype, window_num_pages)
    return PagedModelCache(tuple(g.init_paged_cache(*args) for g in self.groups),
                           jnp.zeros((batch,), jnp.int32),
                           tuple(isinstance(g, ScannedUnits) for g in self.groups))

  def cache_bytes(self, seq_len: int, batch: int = 1, dtype=jnp.bfloat16) -> int:
    """Decode-cache bytes after ``seq_len`` tokens, summed over layers (the seeds' formulas)."""
    total = 0
    for i in range(self.config.num_layers):
      total += _layer_at(self, i).cache_bytes(seq_len, batch, dtype)
    return total

  # -- forward ---------------------------------------------------------------------------------

  def embed_tokens(self, tokens, positions):
    cfg = self.config
    x = jnp.take(self.embed[...], tokens, axis=0).astype(cfg.compute_dtype)
    if cfg.position == "learned":
      x = x + self.pos_embed(positions).astype(x.dtype)
    elif cfg.position == "sinusoidal":
      # As the original Transformer: embeddings scaled by sqrt(D) so the unit-amplitude encoding
      # (norm sqrt(D / 2)) does not drown the token identity.
      x = x * jnp.sqrt(float(cfg.embed_dim)).astype(x.dtype)
      x = x + sinusoidal_positions(positions, cfg.embed_dim).astype(x.dtype)
    return x

  def __call__(self, tokens: Int[Array, "B T"], *, positions: Int[Array, "B T"] | None = None,
               segment_ids: Int[Array, "B T"] | None = None, cache: ModelCache | None = None,
               return_aux: bool = False, return_hidden: bool = False,
               num_tokens: Int[Array, "B"] | None = None):
    """``tokens [B, T]`` -> fp32 logits ``[B, T, V]`` (+ cache) (+ aux).

    ``positions [B, T]`` default to ``cache.index + arange(T)``; for packed rows pass positions
    that restart per segment along with ``segment_ids`` (0 = padding).  ``return_aux`` adds
    ``{"moe_aux_loss", "indexer_loss", "moe_loads"}`` (``moe_loads``: one ``[E]`` or stacked
    ``[L, E]`` array per MoE site, in ``moe_sites()`` order).

    With a ``PagedModelCache`` (``init_paged_cache``) each sequence continues at its own length
    (default positions ``cache.lengths[b] + arange(T)``), and ``num_tokens [B]`` makes the call a
    ragged chunk: sequence ``b``'s new tokens are its first ``num_tokens[b]`` of ``T`` (the
    logits past them are meaningless; nothing of them is cached).
    """
    cfg = self.config
    if tokens.ndim != 2:
      raise ValueError(f"`tokens` must be [B, T] integers, got shape {tokens.shape}.")
    check_auto_mesh(_active_mesh(), "DecoderLM")
    b, t = tokens.shape
    if cache is not None and segment_ids is not None:
      raise ValueError("`segment_ids` (packed rows) cannot be combined with a decode `cache`.")
    paged = isinstance(cache, PagedModelCache)
    if paged:
      if cache.batch != b:
        raise ValueError(f"`cache` holds {cache.batch} sequence slots, `tokens` has B={b} rows.")
      if return_aux:
        raise ValueError("`return_aux` (training losses) is not available with a paged cache.")
      num_tokens = check_num_tokens(num_tokens, b, t)
    else:
      check_ragged_needs_paged(num_tokens, "PagedModelCache (init_paged_cache)")
    if cache is not None and not paged and not isinstance(cache.index, jax.core.Tracer):
      # Checked here, where the index is concrete: a scanned stack traces each layer's cache,
      # whose own check could then not raise.
      cap = cache_capacity(cache)
      if cap is not None and int(cache.index) + t > cap:
        raise ValueError(f"cache overflow: index {int(cache.index)} + {t} new tokens > the "
                         f"cache's {cap} slots (init_cache(batch, max_len) sets them).")
    if positions is None and paged:
      positions = paged_positions(cache.lengths, t, num_tokens)
    elif positions is None:
      offset = 0 if cache is None else cache.index
      positions = jnp.broadcast_to(offset + jnp.arange(t, dtype=jnp.int32), (b, t))
    x = self.embed_tokens(tokens, positions)
    if cfg.residual != "plain":
      x = jnp.broadcast_to(x[:, :, None, :], (b, t, cfg.num_streams, cfg.embed_dim))
    new_groups, auxes = [], []
    for i, group in enumerate(self.groups):
      x, c, aux = group(x, positions, segment_ids, None if cache is None else cache.groups[i],
                        return_aux, num_tokens)
      new_groups.append(c)
      auxes.append(aux)
    if self.collapse is not None:
      x = self.collapse(x).astype(cfg.compute_dtype)
    h = x if self.final_norm is None else self.final_norm(x)
    logits = h if return_hidden else self.head(h)
    logits = shard(logits.astype(jnp.float32), ("batch", "length", None))
    out = (logits,)
    if paged:
      added = t if num_tokens is None else num_tokens
      out += (PagedModelCache(tuple(new_groups), cache.lengths + added, cache.stacked),)
    elif cache is not None:
      out += (ModelCache(tuple(new_groups), cache.index + t),)
    if return_aux:
      out += (_reduce_aux(auxes),)
    return out[0] if len(out) == 1 else out

  def head(self, h: Array) -> Array:
    """Logits ``[..., V]`` of final hidden states ``h [..., D]`` (``return_hidden=True``'s output):
    the tied embedding or ``lm_head``.  A decoder that needs few positions' logits (the last of
    each sequence) applies it to those alone."""
    cfg = self.config
    if self.lm_head is None:
      return jnp.einsum("...d,vd->...v", h.astype(cfg.compute_dtype),
                        self.embed[...].astype(cfg.compute_dtype))
    return self.lm_head(h.astype(cfg.compute_dtype))

  # -- multi-token prediction (jaxattn.nn.mtp) ------------------------------------------------

  def mtp_embed(self, tokens: Int[Array, "B T"]) -> Array:
    """The MTP modules' token embeddings: the shared table, no positions."""
    return jnp.take(self.embed[...], tokens, axis=0).astype(self.config.compute_dtype)

  def mtp_logits(self, module: MTPModule, h: Array) -> Array:
    """fp32 logits of an MTP module's output ``h [B, T, D]`` through the shared head."""
    logits = self.head(module.norm(h))
    return shard(logits.astype(jnp.float32), ("batch", "length", None))

  def mtp_forward(self, hidden: Array, tokens: Int[Array, "B T"], *,
                  positions: Int[Array, "B T"] | None = None,
                  segment_ids: Int[Array, "B T"] | None = None, return_aux: bool = False):
    """Every MTP depth over a training sequence: ``hidden [B, T, D]`` the model's final hidden
    states (``return_hidden=True``) for ``tokens [B, T]``.  Returns a list of ``D`` fp32 logits
    ``[B, T, V]``: depth ``k``'s at position ``i`` predict token ``i + k + 1`` (meaningless where
    that is past the row or, with ``segment_ids``, in another document: ``mtp_targets`` masks
    them); ``return_aux`` also returns the modules' auxiliary losses and MoE loads, as
    ``__call__`` does."""
    self._mtp_first("mtp_forward")
    b, t = tokens.shape
    if hidden.shape[:2] != (b, t):
      raise ValueError(f"`hidden` must be [B={b}, T={t}, D], got shape {hidden.shape}.")
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    h, outs, auxes = hidden.astype(self.config.compute_dtype), [], []
    for module in self.mtp:
      h, _, aux = module(h, self.mtp_embed(shift_left(tokens, module.depth)),
                         positions=positions, segment_ids=segment_ids, want_aux=return_aux)
      outs.append(self.mtp_logits(module, h))
      auxes.append(aux)
    return (outs, _reduce_aux([auxes])) if return_aux else outs

  def init_mtp_cache(self, batch: int, max_len: int | None = None, dtype=None) -> ModelCache:
    """An empty decode cache of the depth-1 MTP module's block (``mtp_decode``), as
    ``init_cache``'s: its position ``i`` holds the pair ``(h_i, t_{i+1})``."""
    module = self._mtp_first("init_mtp_cache")
    max_len = max_len or self.config.max_seq_len
    return ModelCache(((module.init_cache(batch, max_len, dtype or self.config.compute_dtype),),),
                      jnp.zeros((), jnp.int32))

  def init_mtp_paged_cache(self, batch: int, num_pages: int, page_size: int, *,
                           max_pages_per_seq: int | None = None, dtype=None) -> PagedModelCache:
    """An empty serving cache of the depth-1 MTP module's block (one pool of ``num_pages``
    pages), as ``init_paged_cache``'s: position ``i`` of a sequence holds ``(h_i, t_{i+1})``."""
    module = self._mtp_first("init_mtp_paged_cache")
    layer = module.layer.init_paged_cache(batch, num_pages, page_size, max_pages_per_seq,
                                          dtype or self.config.compute_dtype)
    return PagedModelCache(((layer,),), jnp.zeros((batch,), jnp.int32), (False,))

  def mtp_decode(self, hidden: Array, tokens: Int[Array, "B T"], cache,
                 num_tokens: Int[Array, "B"] | None = None):
    """Depth 1 of the multi-token prediction, decoding: the pairs ``(hidden [B, T, D], tokens
    [B, T])`` (the model's hidden state at a position, or the module's own output standing for
    it, and the token after that position) continue ``cache`` (``init_mtp_cache`` /
    ``init_mtp_paged_cache``; with a paged one, each sequence at its own length, ``num_tokens``
    a ragged chunk's counts).  Returns ``(h [B, T, D], cache)``: ``mtp_logits(mtp[0], h)`` at
    position ``i`` predict token ``i + 2``."""
    module = self._mtp_first("mtp_decode")
    b, t = tokens.shape
    paged = isinstance(cache, PagedModelCache)
    if paged:
      num_tokens = check_num_tokens(num_tokens, b, t)
      positions = paged_positions(cache.lengths, t, num_tokens)
    else:
      check_ragged_needs_paged(num_tokens, "PagedModelCache (init_mtp_paged_cache)")
      positions = jnp.broadcast_to(cache.index + jnp.arange(t, dtype=jnp.int32), (b, t))
    ragged = {} if num_tokens is None else {"num_tokens": num_tokens}
    h, layer, _ = module(hidden.astype(self.config.compute_dtype), self.mtp_embed(tokens),
                         positions=positions, cache=cache.groups[0][0], **ragged)
    if paged:
      added = t if num_tokens is None else num_tokens
      return h, PagedModelCache(((layer,),), cache.lengths + added, cache.stacked)
    return h, ModelCache(((layer,),), cache.index + t)

  def _mtp_first(self, where: str) -> MTPModule:
    if self.mtp is None:
      raise ValueError(f"{where}: this model has no multi-token-prediction modules "
                       f"(mtp_depth=0).")
    return self.mtp[0]

  # -- MoE router biases ---------------------------------------------------------------------

  def moe_sites(self, *, mtp: bool = True) -> list[MoE]:
    """The MoE modules in the order ``return_aux``'s ``moe_loads`` lists their loads (then, with
    ``mtp``, the MTP modules' in ``mtp_forward``'s order)."""
    sites = [m for m in _iter_layers_static(self) if m is not None]
    if mtp and self.mtp is not None:
      sites += [m.layer.ffn for m in self.mtp if m.layer.is_moe]
    return sites

  def quantize_experts(self) -> None:
    """Every MoE's routed experts to MXFP4 (``MoE.quantize_experts``; frozen, 3.5x to 3.8x fewer
    bytes than bf16), the config then saying so (``moe_expert_format="mxfp4"``: a checkpoint
    export writes them as transformers reads MXFP4).  Scanned stacks are quantized per layer."""
    sites = self.moe_sites()
    if not sites:
      raise ValueError("this model has no MoE layer to quantize.")
    for moe in sites:
      moe.quantize_experts()
    self.config = self.config.replace(moe_expert_format="mxfp4")

  def update_router_biases(self, moe_loads) -> None:
    """Auxiliary-loss-free balancing after a step: each router bias moves against its load
    (``moe_loads``: the layers' loads, then the MTP modules' if it has theirs as well)."""
    sites = self.moe_sites()
    if len(moe_loads) == len(self.moe_sites(mtp=False)):
      sites = self.moe_sites(mtp=False)
    if len(sites) != len(moe_loads):
      raise ValueError(f"got {len(moe_loads)} load arrays for {len(sites)} MoE sites.")
    for moe, load in zip(sites, moe_loads):
      bias = moe.router_bias[...]
      if bias.ndim == 2:  # stacked layers: one update per layer
        new = jax.vmap(lambda b_, l_: bias_update(b_, l_, rate=moe.bias_update_rate))(bias, load)
      else:
        new = bias_update(bias, load, rate=moe.bias_update_rate)
      moe.router_bias[...] = new


def _iter_layers_static(model: DecoderLM):
  """MoE modules of every layer (stacked modules once per stack), in forward order."""
  for group in model.groups:
    unit = group.units if isinstance(group, ScannedUnits) else group.unit
    for layer in unit.layers:
      yield layer.ffn if layer.is_moe else None


def _layer_at(model: DecoderLM, i: int) -> DecoderLayer:
  """Layer ``i`` (for a scanned stack, the module holding the whole stack's static structure)."""
  for (_, unit, count, first), group in zip(plan_groups(model.config), model.groups):
    n = len(unit.kinds) * count
    if first <= i < first + n:
      u = group.units if isinstance(group, ScannedUnits) else group.unit
      return u.layers[(i - first) % len(unit.kinds)]
  raise IndexError(f"layer {i} out of range (num_layers={model.config.num_layers}).")


def _reduce_aux(auxes) -> dict:
  """Sums the per-layer losses; keeps each MoE site's load (stacked for scanned units)."""
  moe_aux, index_loss, loads = _zero(), _zero(), []
  for group_aux in auxes:
    for layer_aux in group_aux:
      moe_aux = moe_aux + jnp.sum(layer_aux["moe_aux_loss"])
      index_loss = index_loss + jnp.sum(layer_aux["indexer_loss"])
      if "moe_load" in layer_aux:
        loads.append(layer_aux["moe_load"])
  return {"moe_aux_loss": moe_aux, "indexer_loss": index_loss, "moe_loads": loads}
