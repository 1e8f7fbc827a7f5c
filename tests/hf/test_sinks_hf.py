"""Attention sinks against Hugging Face transformers' gpt-oss attention (PyTorch, CPU)."""

import numpy as np
import pytest

from jaxattn.ops import dot_product_attention

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers.models.gpt_oss import modeling_gpt_oss as hf_gpt_oss  # noqa: E402

pytestmark = pytest.mark.hf


@pytest.mark.parametrize("window", [None, 4])
def test_gpt_oss_eager_attention(window):
  """transformers' ``eager_attention_forward`` (sinks concatenated to the logits, dropped after
  the softmax) with its additive causal (and sliding-window) mask, GQA 8 heads on 2."""
  b, t, n, kh, h = 2, 13, 8, 2, 16
  rng = np.random.default_rng(0)
  q, k, v = (rng.standard_normal((b, t, m, h)).astype(np.float32) for m in (n, kh, kh))
  sinks = rng.standard_normal(n).astype(np.float32) * 2

  module = torch.nn.Module()
  module.sinks = torch.nn.Parameter(torch.from_numpy(sinks))
  module.num_key_value_groups = n // kh
  module.training = False
  i, j = np.arange(t)[:, None], np.arange(t)[None, :]
  keep = (j <= i) if window is None else (j <= i) & (j >= i - window)
  mask = torch.from_numpy(np.where(keep, 0.0, -np.inf).astype(np.float32))[None, None]
  to_heads = lambda x: torch.from_numpy(x).transpose(1, 2)  # noqa: E731  -> [B, N, T, H]
  want, _ = hf_gpt_oss.eager_attention_forward(module, to_heads(q), to_heads(k), to_heads(v),
                                               mask, scaling=h ** -0.5)
  got = dot_product_attention(q, k, v, is_causal=True, local_window_size=window, sinks=sinks)
  np.testing.assert_allclose(np.asarray(got), want.detach().numpy(), rtol=2e-5, atol=2e-5)
