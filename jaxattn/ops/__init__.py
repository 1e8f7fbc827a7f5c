"""Formulas: pure functions of arrays, the reference every faster path is tested against."""

from jaxattn.ops.alibi import alibi_bias, alibi_slopes
from jaxattn.ops.attention import (IMPLEMENTATIONS, apply_sinks, attention_gradients,
                                   attention_weights, dot_product_attention, explain_dispatch)
from jaxattn.ops.masks import (CausalMask, FullMask, GlobalTokensMask, Mask, PaddingMask,
                               SegmentMask, SlidingWindowMask, make_mask, sliding_window)
from jaxattn.ops.decode import (cache_attention, cache_mla_decode, paged_attention,
                                paged_mla_decode)
from jaxattn.ops.delta_rule import gated_delta_rule, gated_delta_rule_step
from jaxattn.ops.hadamard import hadamard_transform
from jaxattn.ops.hyper import sinkhorn
from jaxattn.ops.quantization import dequantize, quantize_fp8, quantize_int8
from jaxattn.ops.sparse import (indexer_kl_loss, indexer_scores, sparse_attention,
                                sparse_mla_attention, topk_indices)
from jaxattn.ops.nf4 import dequantize_nf4, quantize_nf4
from jaxattn.ops.mla import (absorb_output_weights, absorb_query_weights, mla_attention,
                             mla_score_terms, mla_softmax_scale)
from jaxattn.ops.norms import layer_norm, rms_norm
from jaxattn.ops.rope import RopeScaling, apply_rope, rope_frequencies, yarn_mscale
from jaxattn.ops.sinusoidal import sinusoidal_positions
from jaxattn.ops.t5_bias import t5_position_bias, t5_relative_position_bucket

__all__ = [
    "IMPLEMENTATIONS", "CausalMask", "FullMask", "GlobalTokensMask", "Mask", "PaddingMask",
    "RopeScaling", "SegmentMask", "SlidingWindowMask", "alibi_bias", "alibi_slopes", "apply_rope",
    "apply_sinks", "attention_gradients", "attention_weights", "dot_product_attention", "explain_dispatch",
    "layer_norm", "make_mask", "rms_norm",
    "rope_frequencies", "sinusoidal_positions", "sliding_window", "t5_position_bias",
    "t5_relative_position_bucket", "yarn_mscale", "absorb_output_weights", "absorb_query_weights",
    "mla_attention", "mla_score_terms", "mla_softmax_scale", "sinkhorn", "quantize_nf4",
    "dequantize_nf4", "hadamard_transform", "dequantize", "quantize_fp8", "quantize_int8",
    "gated_delta_rule", "gated_delta_rule_step", "cache_attention", "cache_mla_decode", "paged_attention", "paged_mla_decode", "indexer_kl_loss", "indexer_scores", "sparse_attention", "sparse_mla_attention", "topk_indices",
]
