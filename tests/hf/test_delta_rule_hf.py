"""The gated delta rule and the Gated DeltaNet layer against Hugging Face's Qwen3-Next (PyTorch, CPU).

transformers' ``torch_recurrent_gated_delta_rule`` / ``torch_chunk_gated_delta_rule`` take the same
layouts as ours (``q, k [B, T, K, H]``, ``v [B, T, N, h]``, ``g, beta [B, T, N]``, state
``[B, N, H, h]``), always scale queries by ``1/sqrt(H)`` and L2-normalize q and k when
``use_qk_l2norm_in_kernel``.  Both compute in fp32; differences come from summation order only, so
outputs and states are compared at 2e-5 (1e-4 for the full layer, which adds projections, the
convolution and the gated norm around the rule).
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxattn.nn.gated_deltanet import GatedDeltaNet
from jaxattn.ops.delta_rule import gated_delta_rule

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import Qwen3NextConfig  # noqa: E402
from transformers.models.qwen3_next import modeling_qwen3_next as hf  # noqa: E402

pytestmark = pytest.mark.hf


def _torch_fn(fn):
  # The module-level names may be wrapped to dispatch to optional fused kernels; take the
  # plain PyTorch function underneath.
  return getattr(fn, "__wrapped__", fn)


def _inputs(b=2, t=45, k=2, n=4, h=16, hv=8, seed=0):
  rng = np.random.default_rng(seed)
  return dict(
      query=rng.standard_normal((b, t, k, h)).astype(np.float32),
      key=rng.standard_normal((b, t, k, h)).astype(np.float32),
      value=rng.standard_normal((b, t, n, hv)).astype(np.float32),
      g=(-np.logaddexp(0, rng.standard_normal((b, t, n))) * 0.5).astype(np.float32),
      beta=(1 / (1 + np.exp(-rng.standard_normal((b, t, n))))).astype(np.float32),
      initial_state=rng.standard_normal((b, n, h, hv)).astype(np.float32))


@pytest.mark.parametrize("hf_name, impl, with_state", [
    ("torch_recurrent_gated_delta_rule", "recurrent", True),
    ("torch_chunk_gated_delta_rule", "chunked", True),
    ("torch_recurrent_gated_delta_rule", "chunked", False),
    ("torch_chunk_gated_delta_rule", "recurrent", False),
])
def test_rule_matches_qwen3_next(hf_name, impl, with_state):
  x = _inputs()
  if not with_state:
    x.pop("initial_state")
  kwargs = dict(chunk_size=16) if hf_name == "torch_chunk_gated_delta_rule" else {}
  want, want_s = _torch_fn(getattr(hf, hf_name))(
      **{k: torch.from_numpy(v) for k, v in x.items()}, output_final_state=True,
      use_qk_l2norm_in_kernel=True, **kwargs)
  got, got_s = gated_delta_rule(**{k: jnp.asarray(v) for k, v in x.items()}, use_qk_l2norm=True,
                                output_final_state=True, chunk_size=16, implementation=impl)
  np.testing.assert_allclose(got, want.numpy(), atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(got_s, want_s.numpy(), atol=2e-5, rtol=2e-5)


def _hf_layer(d=32, k=2, n=4, h=16, hv=8):
  torch.manual_seed(0)
  config = Qwen3NextConfig(hidden_size=d, linear_num_key_heads=k, linear_num_value_heads=n,
                           linear_key_head_dim=h, linear_value_head_dim=hv,
                           linear_conv_kernel_dim=4, num_hidden_layers=1, rms_norm_eps=1e-6,
                           layer_types=["linear_attention"])
  layer = hf.Qwen3NextGatedDeltaNet(config, layer_idx=0).eval()
  with torch.no_grad():  # make the norm weight and dt_bias matter
    layer.norm.weight.uniform_(0.5, 1.5)
    layer.dt_bias.normal_()
  return layer


def _copy_weights(layer, ours, d, k, n, h, hv):
  """Qwen3-Next fuses q, k, v, z per key-head group ([K, H | H | G*h | G*h]) and b, a likewise."""
  grp = n // k

  def t(w):
    return w.detach().numpy().T

  qkvz = t(layer.in_proj_qkvz.weight).reshape(d, k, 2 * h + 2 * grp * hv)
  ours.q_proj.kernel[...] = jnp.asarray(qkvz[..., :h])
  ours.k_proj.kernel[...] = jnp.asarray(qkvz[..., h:2 * h])
  ours.v_proj.kernel[...] = jnp.asarray(qkvz[..., 2 * h:2 * h + grp * hv].reshape(d, n, hv))
  ours.z_proj.kernel[...] = jnp.asarray(qkvz[..., 2 * h + grp * hv:].reshape(d, n, hv))
  ba = t(layer.in_proj_ba.weight).reshape(d, k, 2 * grp)
  ours.b_proj.kernel[...] = jnp.asarray(ba[..., :grp].reshape(d, n))
  ours.a_proj.kernel[...] = jnp.asarray(ba[..., grp:].reshape(d, n))
  conv = layer.conv1d.weight.detach().numpy()[:, 0, :].T                # [W, channels q | k | v]
  ours.conv_q[...] = jnp.asarray(conv[:, :k * h].reshape(4, k, h))
  ours.conv_k[...] = jnp.asarray(conv[:, k * h:2 * k * h].reshape(4, k, h))
  ours.conv_v[...] = jnp.asarray(conv[:, 2 * k * h:].reshape(4, n, hv))
  ours.A_log[...] = jnp.asarray(layer.A_log.detach().numpy())
  ours.dt_bias[...] = jnp.asarray(layer.dt_bias.detach().numpy())
  ours.norm_scale[...] = jnp.asarray(layer.norm.weight.detach().numpy())
  ours.o_proj.kernel[...] = jnp.asarray(t(layer.out_proj.weight).reshape(n, hv, d))


def test_layer_matches_qwen3_next_gated_deltanet():
  d, k, n, h, hv = 32, 2, 4, 16, 8
  layer = _hf_layer(d, k, n, h, hv)
  ours = GatedDeltaNet(d, n, k, h, v_head_dim=hv, chunk_size=16, rngs=nnx.Rngs(0))
  _copy_weights(layer, ours, d, k, n, h, hv)
  x = np.random.default_rng(1).standard_normal((2, 37, d)).astype(np.float32)
  with torch.no_grad():
    want = layer(torch.from_numpy(x)).numpy()
  np.testing.assert_allclose(ours(jnp.asarray(x)), want, atol=1e-4, rtol=1e-4)
