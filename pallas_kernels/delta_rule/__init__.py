"""The gated delta rule's sequential chunk pass as a Pallas TPU (Mosaic) kernel.

Importing this package registers ``implementation="pallas_tpu"`` with
``jaxattn.ops.delta_rule.gated_delta_rule``.  Automatic dispatch does not pick it: it has only
been validated in interpret mode, never timed on a TPU (see ``tpu.py``).
"""

from __future__ import annotations

from jaxattn.ops.delta_rule import register_implementation
from pallas_kernels.delta_rule.tpu import chunked_delta_rule_tpu, state_pass_tpu

register_implementation("pallas_tpu", chunked_delta_rule_tpu)

__all__ = ["chunked_delta_rule_tpu", "state_pass_tpu"]
