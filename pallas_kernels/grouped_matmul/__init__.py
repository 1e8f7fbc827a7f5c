"""The experts' grouped matmul as Pallas kernels, over ``jaxattn.ops.moe``'s blocked layout.

``jaxattn.ops.moe.grouped_matmul`` / ``grouped_swiglu`` / ``routed_experts`` run these with
``implementation="pallas_tpu"``; dense weights (forward, ``dx``, ``dW``) and MXFP4 weights kept
packed (forward, ``dx``).  See ``tpu.py``.
"""

from __future__ import annotations

from pallas_kernels.grouped_matmul.tpu import (block_matmul_mxfp4_tpu, block_matmul_tpu,
                                               mxfp4_kernel_operands)

__all__ = ["block_matmul_tpu", "block_matmul_mxfp4_tpu", "mxfp4_kernel_operands"]
