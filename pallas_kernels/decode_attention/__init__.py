"""Paged decode attention (GQA / MQA / MHA) as a Pallas TPU-style kernel, split-KV.

Reached through ``jaxattn.ops.decode.paged_attention(..., implementation="pallas_tpu")`` (the
default on TPU); ``jaxattn.ops.decode.paged_attention_xla`` is the reference it is tested against.
``tpu.py`` also holds the online-softmax update, finalize and split-KV combine shared with
``pallas_kernels.mla_decode``.  ``gpu.py``: the same for NVIDIA GPUs (Pallas Triton,
``implementation="pallas_gpu"``, the default on NVIDIA sm_80+ GPUs: validated on an H200).
"""

from pallas_kernels.decode_attention.gpu import paged_attention_gpu
from pallas_kernels.decode_attention.tpu import combine, paged_attention_tpu

__all__ = ["combine", "paged_attention_gpu", "paged_attention_tpu"]
