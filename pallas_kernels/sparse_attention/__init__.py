"""Top-K sparse attention (DeepSeek Sparse Attention) as a Pallas TPU-style kernel.

Not registered with the dense dispatcher: it takes selected positions, not a mask.  Use
``sparse_attention_tpu`` / ``sparse_mla_attention_tpu``; ``jaxattn.ops.sparse`` holds the gather
reference they are tested against.
"""

from pallas_kernels.sparse_attention.tpu import sparse_attention_tpu, sparse_mla_attention_tpu

__all__ = ["sparse_attention_tpu", "sparse_mla_attention_tpu"]
