"""Top-K sparse attention (DeepSeek Sparse Attention) as Pallas kernels that fetch only the
selected rows: TPU (``tpu.py``: manual row DMAs, ``block_k`` rows per step) and NVIDIA GPU
(``gpu.py``: Triton vector gathers).

``jaxattn.ops.sparse.sparse_attention`` / ``sparse_mla_attention`` dispatch to them
(``implementation="pallas_tpu" | "pallas_gpu"``, picked by default on those backends); the gather
references there are what they are tested against.
"""

from pallas_kernels.sparse_attention.gpu import (sparse_attention_gpu, sparse_mla_attention_gpu,
                                                 sparse_mla_latent_gpu)
from pallas_kernels.sparse_attention.tpu import (gather_attention, sparse_attention_tpu,
                                                 sparse_mla_attention_tpu, sparse_mla_latent_tpu)

__all__ = ["gather_attention", "sparse_attention_gpu", "sparse_attention_tpu",
           "sparse_mla_attention_gpu", "sparse_mla_attention_tpu", "sparse_mla_latent_gpu",
           "sparse_mla_latent_tpu"]
