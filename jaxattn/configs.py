"""Model presets named after the families they imitate, each at a tiny CPU size and a real size.

    llama          GQA + RoPE + RMSNorm + SwiGLU                         (Llama-3.1-8B)
    mistral        llama + sliding-window attention                        (Mistral-7B)
    deepseek-v3    MLA + MoE (sigmoid routing, shared expert, dense prefix) (DeepSeek-V3, 671B)
    deepseek-v3.2  deepseek-v3 + DeepSeek Sparse Attention                 (DeepSeek-V3.2)
    qwen3-next     Gated DeltaNet / attention hybrid "DDDA" + MoE         (Qwen3-Next-80B-A3B)
    gpt-oss        sliding / full attention with sinks + clamped-SwiGLU MoE (gpt-oss-20b)
    llama-learned, llama-sinusoidal, llama-t5, llama-alibi, llama-nope
                   llama with another positional scheme (the length-extrapolation experiment)

``get_config("llama")`` is the tiny size (byte vocabulary, trains on a CPU in minutes);
``get_config("deepseek-v3", size="full")`` the published shape (build it with ``nnx.eval_shape``
to count parameters and plan shardings without allocating).  Keyword overrides replace fields.
The full sizes follow the published configs (``jaxattn.convert.to_hf`` of a full preset writes the
published architecture); ``max_seq_len`` is the default cache length, and the docstring of each
builder says where it differs from the published context.
"""

from __future__ import annotations

from typing import Callable

from jaxattn.nn.model import ModelConfig

SIZES = ("tiny", "full")
BYTE_VOCAB = 259  # 256 bytes + pad / bos / eos (jaxattn.train.data.ByteTokenizer)


def _tiny(**kw) -> ModelConfig:
  base = dict(vocab_size=BYTE_VOCAB, embed_dim=128, num_layers=4, num_heads=4, num_kv_heads=2,
              mlp_dim=384, max_seq_len=1024, tie_embeddings=True)
  base.update(kw)
  return ModelConfig(**base)


def llama(size: str) -> ModelConfig:
  """GQA + RoPE (half-split pairs) + RMSNorm + SwiGLU; full = Llama-3.1-8B (RoPE base 5e5 with the
  Llama-3.1 frequency scaling; ``max_seq_len`` 8192 of its 131072 positions)."""
  if size == "tiny":
    return _tiny()
  return ModelConfig(vocab_size=128256, embed_dim=4096, num_layers=32, num_heads=32,
                     num_kv_heads=8, head_dim=128, mlp_dim=14336, max_seq_len=8192,
                     rope_base=500000.0, rope_scaling=dict(type="llama3", factor=8.0,
                                                           original_max_position_embeddings=8192,
                                                           low_freq_factor=1.0,
                                                           high_freq_factor=4.0),
                     norm_eps=1e-5, tie_embeddings=False, dtype="bfloat16",
                     scan_layers=True, remat="dots_no_batch")


def mistral(size: str) -> ModelConfig:
  """llama + sliding-window attention in every layer; full = Mistral-7B-v0.1 (window 4096: a query
  sees itself and the 4095 keys before it, ``sliding_window=4095`` here)."""
  if size == "tiny":
    return _tiny(layer_pattern="S", sliding_window=128)
  return ModelConfig(vocab_size=32000, embed_dim=4096, num_layers=32, num_heads=32,
                     num_kv_heads=8, head_dim=128, mlp_dim=14336, layer_pattern="S",
                     sliding_window=4095, max_seq_len=32768, norm_eps=1e-5, tie_embeddings=False,
                     dtype="bfloat16", scan_layers=True, remat="dots_no_batch")


def _deepseek(size: str, dsa: bool) -> ModelConfig:
  if size == "tiny":
    extra = dict(index_num_heads=4, index_head_dim=32, index_rope_dim=16, index_topk=64) if dsa else {}
    return _tiny(layer_pattern="I" if dsa else "M", num_kv_heads=None, kv_lora_rank=64,
                 q_lora_rank=96, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                 num_experts=8, num_experts_per_tok=2, moe_expert_dim=96, num_shared_experts=1,
                 first_k_dense=1, moe_n_group=2, moe_topk_group=1, moe_routed_scaling_factor=1.0,
                 **extra)
  extra = dict(index_num_heads=64, index_head_dim=128, index_rope_dim=64,
               index_topk=2048) if dsa else {}
  return ModelConfig(
      vocab_size=129280, embed_dim=7168, num_layers=61, num_heads=128,
      layer_pattern="I" if dsa else "M", kv_lora_rank=512, q_lora_rank=1536,
      qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, mlp_dim=18432,
      num_experts=256, num_experts_per_tok=8, moe_expert_dim=2048, num_shared_experts=1,
      first_k_dense=3, moe_n_group=8, moe_topk_group=4, moe_routed_scaling_factor=2.5,
      max_seq_len=163840, rope_scaling=dict(type="yarn", factor=40.0,
                                            original_max_position_embeddings=4096, beta_fast=32.0,
                                            beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
      tie_embeddings=False, dtype="bfloat16", scan_layers=True, remat="dots_no_batch", **extra)


def deepseek_v3(size: str) -> ModelConfig:
  """MLA (q and kv LoRA, decoupled RoPE) + MoE with group-limited sigmoid routing, one shared
  expert and a dense prefix; full = DeepSeek-V3 (61 layers, 256 experts, top-8, YaRN x40)."""
  return _deepseek(size, dsa=False)


def deepseek_v32(size: str) -> ModelConfig:
  """deepseek-v3 with DeepSeek Sparse Attention (lightning indexer, top-K 2048 at full size)."""
  return _deepseek(size, dsa=True)


_QWEN3_NEXT = dict(attention_qk_norm=True, attention_output_gate=True, moe_shared_gate=True)


def qwen3_next(size: str) -> ModelConfig:
  """Three Gated DeltaNet layers per full-attention layer ("DDDA"); the attention layers with
  partial RoPE, QK norm and a sigmoid output gate; MoE with a gated shared expert; full =
  Qwen3-Next-80B-A3B (512 experts, top-10)."""
  if size == "tiny":
    return _tiny(layer_pattern="DDDA", rotary_dim=16, deltanet_num_heads=4,
                 deltanet_num_key_heads=2, deltanet_head_dim=32, deltanet_v_head_dim=32,
                 num_experts=8, num_experts_per_tok=2, moe_expert_dim=96, num_shared_experts=1,
                 moe_score_func="softmax", **_QWEN3_NEXT)
  return ModelConfig(vocab_size=151936, embed_dim=2048, num_layers=48, num_heads=16,
                     num_kv_heads=2, head_dim=256, rotary_dim=64, mlp_dim=5120,
                     layer_pattern="DDDA", deltanet_num_heads=32, deltanet_num_key_heads=16,
                     deltanet_head_dim=128, deltanet_v_head_dim=128, num_experts=512,
                     num_experts_per_tok=10, moe_expert_dim=512, num_shared_experts=1,
                     moe_score_func="softmax", rope_base=10000000.0, max_seq_len=262144,
                     tie_embeddings=False, dtype="bfloat16", scan_layers=True,
                     remat="dots_no_batch", **_QWEN3_NEXT)


_GPT_OSS = dict(layer_pattern="SA", attention_sinks=True, attention_bias=True, num_kv_heads=None,
                moe_score_func="softmax", moe_activation="clamped_swiglu", moe_expert_bias=True,
                moe_router_bias=True, moe_seq_balance_alpha=0.0, tie_embeddings=False)


def gpt_oss(size: str) -> ModelConfig:
  """Sliding-window (128 keys) and full attention layers in turn, GQA with learned attention
  sinks and biases, YaRN RoPE; every layer MoE: a softmax over the top-k router logits (with a
  learned bias), clamped-SwiGLU experts with biases; full = gpt-oss-20b (24 layers, 32 experts,
  top-4; ``max_seq_len`` 131072 as published)."""
  if size == "tiny":
    return _tiny(**dict(_GPT_OSS, num_kv_heads=2), head_dim=32, sliding_window=63, num_experts=8,
                 num_experts_per_tok=2, mlp_dim=128, moe_expert_dim=128)
  return ModelConfig(vocab_size=201088, embed_dim=2880, num_layers=24, num_heads=64,
                     **dict(_GPT_OSS, num_kv_heads=8), head_dim=64, mlp_dim=2880,
                     sliding_window=127, num_experts=32, num_experts_per_tok=4,
                     moe_expert_dim=2880, rope_base=150000.0, max_seq_len=131072,
                     rope_scaling=dict(type="yarn", factor=32.0,
                                       original_max_position_embeddings=4096, beta_fast=32.0,
                                       beta_slow=1.0, truncate=False),
                     norm_eps=1e-5, dtype="bfloat16", scan_layers=True, remat="dots_no_batch")


def _positional(position: str) -> Callable[[str], ModelConfig]:
  def build(size: str) -> ModelConfig:
    cfg = llama(size)
    return cfg.replace(position=position)
  build.__doc__ = f"llama with position={position!r} (for the length-extrapolation experiment)."
  return build


PRESETS: dict[str, Callable[[str], ModelConfig]] = {
    "llama": llama,
    "mistral": mistral,
    "deepseek-v3": deepseek_v3,
    "deepseek-v3.2": deepseek_v32,
    "qwen3-next": qwen3_next,
    "gpt-oss": gpt_oss,
    "llama-learned": _positional("learned"),
    "llama-sinusoidal": _positional("sinusoidal"),
    "llama-t5": _positional("t5"),
    "llama-alibi": _positional("alibi"),
    "llama-nope": _positional("none"),
}


def get_config(name: str, size: str = "tiny", **overrides) -> ModelConfig:
  """The preset ``name`` at ``size`` ("tiny" or "full"), with ``overrides`` applied."""
  if name not in PRESETS:
    raise ValueError(f"unknown preset {name!r}; available: {sorted(PRESETS)}.")
  if size not in SIZES:
    raise ValueError(f"`size` must be one of {SIZES}, got {size!r}.")
  cfg = PRESETS[name](size)
  return cfg.replace(**overrides) if overrides else cfg
