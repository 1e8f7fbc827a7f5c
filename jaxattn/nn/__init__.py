"""Flax NNX modules built on ``jaxattn.ops`` (Linen users: ``flax.nnx.bridge.to_linen``)."""

from jaxattn.nn.attention import Attention
from jaxattn.nn.block import TransformerBlock
from jaxattn.nn.dsa import DSA, LightningIndexer
from jaxattn.nn.gated_deltanet import DeltaNetCache, GatedDeltaNet
from jaxattn.nn.hybrid import HybridStack
from jaxattn.nn.linear import Einsum, param
from jaxattn.nn.lora import (LoRA, LoRAParam, apply_lora, count_parameters, lora_optimizer,
                             merge_lora, unload_lora, unmerge_lora)
from jaxattn.nn.mhc import HyperConnection, StreamCollapse
from jaxattn.nn.mla import MLA
from jaxattn.nn.mlp import MLP
from jaxattn.nn.model import DecoderLM, ModelCache, ModelConfig, PagedModelCache
from jaxattn.nn.moe import MoE
from jaxattn.nn.mtp import MTPModule
from jaxattn.nn.norms import LayerNorm, RMSNorm
from jaxattn.nn.positional import LearnedPositionalEmbedding, T5RelativePositionBias

__all__ = ["DecoderLM", "ModelCache", "ModelConfig", "PagedModelCache", "DeltaNetCache", "GatedDeltaNet", "HybridStack", "DSA", "LightningIndexer", "MLA", "MLP", "MoE", "MTPModule", "HyperConnection", "StreamCollapse", "LoRA", "LoRAParam",
           "apply_lora", "count_parameters", "lora_optimizer", "merge_lora", "unload_lora",
           "unmerge_lora", "Attention", "Einsum", "LayerNorm", "LearnedPositionalEmbedding", "RMSNorm",
           "T5RelativePositionBias", "TransformerBlock", "param"]
