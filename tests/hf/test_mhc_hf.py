"""mHC against the DeepSeek-V4 reference in Hugging Face transformers (PyTorch, CPU).

``DeepseekV4HyperConnection`` (pre / post / Sinkhorn comb weights and the collapsed sublayer input),
the decoder layer's stream update ``post * F + comb^T @ streams``, and ``DeepseekV4HyperHead``, on
copied parameters.  Tolerances: fp32 on both sides; the reference's eps = 1e-6 guards are reproduced
by ``log_domain=False`` (then ~1e-6 agreement), the log-domain form differs by O(eps).
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxattn.nn.mhc import HyperConnection, StreamCollapse
from jaxattn.ops.hyper import hc_read, hc_write

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
hf = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config  # noqa: E402

pytestmark = pytest.mark.hf

N, D = 4, 16


def _config(hc_eps=1e-6):
  return DeepseekV4Config(hidden_size=D, hc_mult=N, hc_sinkhorn_iters=20, hc_eps=hc_eps,
                          rms_norm_eps=1e-6)


def _streams(seed=0):
  return np.random.default_rng(seed).standard_normal((2, 5, N, D)).astype(np.float32) * 1.5


def _hf_site(seed=0, hc_eps=1e-6):
  torch.manual_seed(seed)
  site = hf.DeepseekV4HyperConnection(_config(hc_eps))
  with torch.no_grad():
    # Nontrivial static and dynamic parts (as a trained checkpoint would have).
    site.fn.normal_(0.0, 0.2)
    site.base.normal_(0.0, 0.5)
    site.scale.copy_(torch.tensor([0.8, 1.2, 1.5]))
  return site


def _ours_from(site, **kw):
  ours = HyperConnection(D, N, kind="mhc", rngs=nnx.Rngs(0), **kw)
  k = N * (N + 2)
  # fn [(2 + n) n, n D] acts on the streams flattened row-major ([n, D] -> n D).
  ours.proj[...] = jnp.asarray(site.fn.detach().numpy().T.reshape(N, D, k))
  ours.bias[...] = jnp.asarray(site.base.detach().numpy())
  ours.scale[...] = jnp.asarray(site.scale.detach().numpy())
  return ours


# The plain form with the reference's eps reproduces it; the log-domain form has no eps, and the
# reference's eps (added to entries as small as ~1e-3 here) moves its result by up to ~1e-4, so the
# log-domain comparison runs against the reference with a negligible eps.
@pytest.mark.parametrize("log_domain, hc_eps, atol", [(False, 1e-6, 2e-6), (True, 1e-12, 5e-6)])
def test_hyper_connection_matches_deepseek_v4(log_domain, hc_eps, atol):
  site = _hf_site(hc_eps=hc_eps)
  x = _streams()
  with torch.no_grad():
    post, comb, collapsed = site(torch.from_numpy(x))
  ours = _ours_from(site, log_domain=log_domain, eps=hc_eps)
  pre, post_o, res = ours.coefficients(jnp.asarray(x))
  np.testing.assert_allclose(post_o, post.numpy(), atol=atol)
  # The reference's comb[i_in, o_out] is our H_res[o_out, i_in].
  np.testing.assert_allclose(res, np.swapaxes(comb.numpy(), -1, -2), atol=atol)
  np.testing.assert_allclose(hc_read(jnp.asarray(x), pre), collapsed.numpy(), atol=atol * 10)


def test_stream_update_matches_the_decoder_layer():
  site = _hf_site(1)
  x = _streams(1)
  f = np.random.default_rng(2).standard_normal((2, 5, D)).astype(np.float32)
  with torch.no_grad():
    post, comb, _ = site(torch.from_numpy(x))
    # DeepseekV4DecoderLayer.forward: post * F(...) + comb^T @ streams.
    want = (post.unsqueeze(-1) * torch.from_numpy(f).unsqueeze(-2)
            + torch.matmul(comb.transpose(-1, -2), torch.from_numpy(x))).numpy()
  ours = _ours_from(site, log_domain=False)
  _, post_o, res = ours.coefficients(jnp.asarray(x))
  np.testing.assert_allclose(hc_write(jnp.asarray(x), jnp.asarray(f), post_o, res), want, atol=1e-5)


def test_hyper_head_matches_deepseek_v4():
  torch.manual_seed(0)
  head = hf.DeepseekV4HyperHead(_config())
  with torch.no_grad():
    head.hc_fn.normal_(0.0, 0.2)
    head.hc_base.normal_(0.0, 0.5)
    head.hc_scale.fill_(1.3)
  x = _streams(3)
  with torch.no_grad():
    want = head(torch.from_numpy(x)).numpy()
  ours = StreamCollapse(D, N, rngs=nnx.Rngs(0))
  ours.proj[...] = jnp.asarray(head.hc_fn.detach().numpy().T.reshape(N, D, N))
  ours.bias[...] = jnp.asarray(head.hc_base.detach().numpy())
  ours.scale[...] = jnp.asarray(head.hc_scale.detach().numpy())
  np.testing.assert_allclose(ours(jnp.asarray(x)), want, atol=2e-5)


def test_initialization_follows_the_references():
  # DeepseekV4PreTrainedModel._init_weights: fn ~ N(0, initializer_range), base = 0, scale = 1; the
  # mHC paper's gates start at 0.01 (our default), gate_init=1.0 gives the transformers init.
  cfg = _config()
  site = hf.DeepseekV4HyperConnection(cfg)
  hf.DeepseekV4PreTrainedModel._init_weights(hf.DeepseekV4PreTrainedModel(cfg), site)
  ours = HyperConnection(256, N, kind="mhc", gate_init=1.0, rngs=nnx.Rngs(0))
  np.testing.assert_allclose(np.asarray(ours.proj[...]).std(), cfg.initializer_range, rtol=0.02)
  np.testing.assert_allclose(site.fn.detach().numpy().std(), cfg.initializer_range, rtol=0.1)
  np.testing.assert_array_equal(ours.bias[...], site.base.detach().numpy())
  np.testing.assert_array_equal(ours.scale[...], site.scale.detach().numpy())
  np.testing.assert_allclose(HyperConnection(D, N, rngs=nnx.Rngs(0)).scale[...], 0.01)
  assert cfg.hc_sinkhorn_iters == ours.sinkhorn_iters == 20
