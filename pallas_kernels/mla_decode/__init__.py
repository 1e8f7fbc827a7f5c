"""Absorbed MLA decode over a paged latent cache as Pallas TPU-style kernels: dense split-KV and
DSA sparse (top-K rows only).

Reached through ``jaxattn.ops.decode.paged_mla_decode(..., implementation="pallas_tpu")`` (the
default on TPU); ``jaxattn.ops.decode.paged_mla_decode_xla`` is the reference.  ``gpu.py``: both
modes for NVIDIA GPUs (Pallas Triton, ``implementation="pallas_gpu"``; dense is the default on
NVIDIA sm_80+ GPUs, validated on an H200; sparse is opt-in: checked there, not yet timed).
"""

from pallas_kernels.mla_decode.gpu import paged_mla_decode_gpu
from pallas_kernels.mla_decode.tpu import paged_mla_decode_tpu

__all__ = ["paged_mla_decode_gpu", "paged_mla_decode_tpu"]
