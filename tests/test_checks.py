"""The shared argument checks (``jaxattn.checks``) and the modules that use them: NumPy ints are
ints, bools are not, None / strings / NaN are refused with a ValueError naming the argument."""

import numpy as np
import pytest
from flax import nnx

from jaxattn.checks import check_int, check_nonnegative, check_positive, is_int, is_number
from jaxattn.nn.gated_deltanet import GatedDeltaNet
from jaxattn.nn.mhc import HyperConnection
from jaxattn.nn.moe import MoE


def test_int_and_number_predicates():
  assert is_int(3) and is_int(np.int64(3)) and is_int(np.uint8(3))
  assert not any(is_int(v) for v in (True, np.bool_(True), 3.0, "3", None))
  assert is_number(1e-6) and is_number(np.float32(0.5)) and is_number(np.int32(2))
  assert not any(is_number(v) for v in (False, np.bool_(False), "1e-6", None, 1j))


@pytest.mark.parametrize("bad", [None, "1e-6", True, -1e-3, float("nan"), float("inf")])
def test_nonnegative_refuses(bad):
  with pytest.raises(ValueError, match=r"`eps` must be a number >= 0, got"):
    check_nonnegative("eps", bad)


def test_int_and_positive_checks():
  check_int("n", np.int64(2))
  check_int("n", None, allow_none=True)
  check_int("n", 0, minimum=0)
  for bad in (0, True, 2.0, None, "2"):
    with pytest.raises(ValueError, match=r"`n` must be an int >= 1, got"):
      check_int("n", bad)
  with pytest.raises(ValueError, match=r"`n` must be None or an int >= 1, got 0"):
    check_int("n", 0, allow_none=True)
  check_positive("lr", np.float32(1e-3))
  for bad in (0.0, -1.0, float("nan"), None, False):
    with pytest.raises(ValueError, match=r"`lr` must be a finite number > 0"):
      check_positive("lr", bad)


def test_modules_refuse_none_eps_with_a_value_error():
  """These raised TypeError ('>=' not supported between NoneType and int) before."""
  with pytest.raises(ValueError, match="`norm_eps` must be a number >= 0, got None"):
    GatedDeltaNet(16, 2, head_dim=8, norm_eps=None, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="`eps` must be a number >= 0, got None"):
    HyperConnection(16, 4, eps=None, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="`bias_update_rate` must be a number >= 0, got None"):
    MoE(16, 4, 2, 8, bias_update_rate=None, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="`sinkhorn_iters` must be an int >= 1, got True"):
    HyperConnection(16, 4, sinkhorn_iters=True, rngs=nnx.Rngs(0))


def test_modules_take_numpy_ints():
  """A MoE sized from NumPy (np.int64 shared_dim / block_size) was refused as 'not an int'."""
  moe = MoE(16, 4, 2, 8, num_shared_experts=np.int64(1), shared_dim=np.int64(8),
            block_size=np.int64(4), rngs=nnx.Rngs(0))
  assert type(moe.block_size) is int and moe.shared is not None
  with pytest.raises(ValueError, match="`shared_dim` must be None or an int >= 1, got 0"):
    MoE(16, 4, 2, 8, num_shared_experts=1, shared_dim=0, rngs=nnx.Rngs(0))


def test_moe_and_nf4_argument_checks():
  """Each of these passed construction and failed (or went wrong) at the first call."""
  for kw, match in ((dict(capacity_factor=float("inf")), "`capacity_factor` must be a finite"),
                    (dict(capacity_factor=True), "`capacity_factor` must be a finite"),
                    (dict(routed_scaling_factor=None), "`routed_scaling_factor` must be a finite"),
                    (dict(routed_scaling_factor=float("nan")), "`routed_scaling_factor`"),
                    (dict(norm_topk_prob="no"), "`norm_topk_prob` must be a bool")):
    with pytest.raises(ValueError, match=match):
      MoE(16, 4, 2, 8, rngs=nnx.Rngs(0), **kw)
  moe = MoE(16, 4, 2, 8, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="`rate` must be a number >= 0, got -1.0"):
    moe.update_bias(np.array([4.0, 1.0, 1.0, 1.0]), rate=-1.0)
  from jaxattn.ops.nf4 import quantize_nf4
  w = np.random.default_rng(0).normal(size=(64, 8)).astype(np.float32)
  assert quantize_nf4(w, block_size=np.int64(64)) is not None   # NumPy ints are ints
