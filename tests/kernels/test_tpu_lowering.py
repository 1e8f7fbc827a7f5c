"""Every TPU kernel lowers to Mosaic MLIR at production sizes (the cases of
``experiments/tpu_compile_check.py``: flash forward and backward, sparse top-K prefill and paged
sparse MLA decode, paged GQA / MLA decode, the delta-rule state pass), against a stand-in TPU v5e.
Lowering runs the kernels' Pallas-to-Mosaic rules (block shapes, supported ops); the full TPU
compile, which also checks tiling and layouts, is ``tests/test_tpu_compile_check.py``."""

import jax
import pytest
from jax.extend import core as jcore

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


def _kernel_dots(jaxpr, in_kernel=False):
  """``(lhs, rhs, result)`` dtypes of each ``dot_general`` in a ``pallas_call`` of ``jaxpr``."""
  found = []
  for eqn in jaxpr.eqns:
    inside = in_kernel or eqn.primitive.name == "pallas_call"
    if in_kernel and eqn.primitive.name == "dot_general":
      found.append(tuple(str(v.aval.dtype) for v in (*eqn.invars, *eqn.outvars)))
    for value in eqn.params.values():
      for sub in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(sub, (jcore.Jaxpr, jcore.ClosedJaxpr)):
          found += _kernel_dots(getattr(sub, "jaxpr", sub), inside)
  return found


# The delta rule's state pass multiplies its fp32 state (and fp32 chunk terms) on purpose.
_FP32_DOTS = {"delta rule state pass"}


@pytest.mark.parametrize("name", [n for n in tpu_compile_check.cases()
                                  if n not in tpu_compile_check.BASELINES])
def test_bf16_kernels_multiply_bf16(name, monkeypatch):
  """Every case is called with bf16 activations and bf16 (or one-byte quantized) caches and
  weights: the kernels' dots take bf16 operands (the MXU's native rate; fp32 operands take
  several passes) and accumulate in fp32 -- quantized codes widened to bf16, not to fp32."""
  monkeypatch.setattr(common, "default_interpret",
                      lambda interpret: False if interpret is None else interpret)
  fn, shapes = tpu_compile_check.cases()[name]
  dots = _kernel_dots(jax.make_jaxpr(fn)(*shapes).jaxpr)
  assert dots, name
  want = ("float32",) * 3 if name in _FP32_DOTS else ("bfloat16", "bfloat16", "float32")
  assert set(dots) == {want}, (name, set(dots))
