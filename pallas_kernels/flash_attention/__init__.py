"""Flash attention as Pallas kernels: TPU (Mosaic) and GPU (Triton), forward and backward.

Importing this package registers both kernels with the one dispatch point,
``jaxattn.ops.attention.dot_product_attention(..., implementation="pallas_tpu" | "pallas_gpu")``;
``implementation=None`` picks them on TPU / GPU backends.  They compute the dispatcher's function
for every argument: a dense ``bias`` is streamed in blocks beside the keys (and differentiated), a
boolean ``mask`` array as int8 blocks that also prune the block tables.

Direct use (block sizes, interpret mode, an explicit mesh)::

    from pallas_kernels.flash_attention import BlockSizes, flash_attention_tpu
    out = flash_attention_tpu(q, k, v, CausalMask(), block_sizes=BlockSizes.tpu())

Files: ``common.py`` (block sizes, plan, block tables, the shared score), ``tpu.py`` and ``gpu.py``
(kernels and their custom VJPs), ``hopper.py`` (Mosaic GPU forward and backward for sm_90, the
GPU kernel's default there for the calls it takes: ``gpu.set_options``), ``sharded.py``
(``shard_map`` over batch and heads).
"""

from __future__ import annotations

from jaxattn.ops.attention import register_implementation
from pallas_kernels.flash_attention.common import BlockSizes, block_counts
from pallas_kernels.flash_attention.gpu import flash_attention as flash_attention_gpu
from pallas_kernels.flash_attention.tpu import flash_attention as flash_attention_tpu
from pallas_kernels.flash_attention.tpu import vmem_bytes_forward


def _as_backend(kernel, label: str):
  """Adapts a kernel to the normalized backend signature of ``dot_product_attention``."""

  def attention(query, key, value, *, bias, mask, mask_array, scale, alibi_slopes, logits_soft_cap,
                q_offset, return_residuals, residuals=None):
    return kernel(query, key, value, mask, scale=scale, alibi_slopes=alibi_slopes,
                  logits_soft_cap=logits_soft_cap, q_offset=q_offset,
                  return_residuals=return_residuals, residuals=residuals, bias=bias,
                  mask_array=mask_array)

  attention.__name__ = f"{label}_attention"
  return attention


register_implementation("pallas_tpu", _as_backend(flash_attention_tpu, "pallas_tpu"))
register_implementation("pallas_gpu", _as_backend(flash_attention_gpu, "pallas_gpu"))

__all__ = ["BlockSizes", "block_counts", "flash_attention_tpu", "flash_attention_gpu",
           "vmem_bytes_forward"]
