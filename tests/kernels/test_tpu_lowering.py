"""Every TPU kernel lowers to Mosaic MLIR at production sizes (the cases of
``experiments/tpu_compile_check.py``: flash forward and backward, sparse top-K prefill and paged
sparse MLA decode, paged GQA / MLA decode, the delta-rule state pass), against a stand-in TPU v5e.
Lowering runs the kernels' Pallas-to-Mosaic rules (block shapes, supported ops); the full TPU
compile, which also checks tiling and layouts, is ``tests/test_tpu_compile_check.py``."""

import jax
import pytest

from experiments import tpu_compile_check
from pallas_kernels.flash_attention import common


@pytest.mark.parametrize("name", list(tpu_compile_check.cases()))
def test_lowers_to_mosaic(name, tpu_target, monkeypatch):
  # cases that leave `interpret` to the dispatch: compiled, as on a TPU
  monkeypatch.setattr(common, "default_interpret",
                      lambda interpret: False if interpret is None else interpret)
  fn, shapes = tpu_compile_check.cases()[name]
  text = jax.jit(fn).trace(*shapes).lower(lowering_platforms=("tpu",)).as_text()
  assert ("tpu_custom_call" in text) == (name not in tpu_compile_check.BASELINES)
