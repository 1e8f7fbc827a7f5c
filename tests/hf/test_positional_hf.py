"""Positional encodings against Hugging Face transformers (PyTorch, CPU).

T5 buckets bit for bit; T5 bias, Bloom's ALiBi slopes, Llama and DeepSeek RoPE, and the RoPE scaling
init functions within stated fp32 tolerances.
"""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.nn.positional import T5RelativePositionBias
from jaxattn.ops.alibi import alibi_bias, alibi_slopes
from jaxattn.ops.rope import RopeScaling, apply_rope, rope_frequencies, yarn_mscale
from jaxattn.ops.t5_bias import t5_relative_position_bucket

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from flax import nnx  # noqa: E402
from transformers import LlamaConfig, T5Config  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.bloom.modeling_bloom import _get_alibi_slopes, build_alibi_tensor  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_deepseek  # noqa: E402
from transformers.models.llama import modeling_llama as hf_llama  # noqa: E402
from transformers.models.t5.modeling_t5 import T5Attention  # noqa: E402

pytestmark = pytest.mark.hf


# -- T5 ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets, max_distance", [(32, 128), (64, 256), (16, 100), (8, 20)])
def test_t5_bucket_bit_for_bit(bidirectional, num_buckets, max_distance):
  near = np.arange(-3000, 3001)
  far = np.array([2**k for k in range(12, 31)] + [10**k for k in range(4, 10)])
  rel = np.concatenate([near, far, -far]).astype(np.int64)
  want = T5Attention._relative_position_bucket(torch.from_numpy(rel), bidirectional=bidirectional,
                                               num_buckets=num_buckets, max_distance=max_distance)
  got = t5_relative_position_bucket(rel.astype(np.int32), bidirectional=bidirectional,
                                    num_buckets=num_buckets, max_distance=max_distance)
  assert got.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(got), want.numpy())


@pytest.mark.parametrize("is_decoder, past", [(False, 0), (True, 0), (True, 5)])
def test_t5_bias_matches_compute_bias(is_decoder, past):
  heads, buckets, max_distance = 3, 16, 40
  config = T5Config(d_model=12, d_kv=4, num_heads=heads, relative_attention_num_buckets=buckets,
                    relative_attention_max_distance=max_distance, is_decoder=is_decoder)
  hf = T5Attention(config, has_relative_attention_bias=True, layer_idx=0)
  ours = T5RelativePositionBias(heads, bidirectional=not is_decoder, num_buckets=buckets,
                                max_distance=max_distance, rngs=nnx.Rngs(0))
  ours.embedding[...] = jnp.asarray(hf.relative_attention_bias.weight.detach().numpy())
  t, s = 7, 60
  with torch.no_grad():
    want = hf.compute_bias(t, s, past_seen_tokens=past).numpy()
  got = ours(past + jnp.arange(t), jnp.arange(s))
  assert got.shape == (1, heads, t, s)
  np.testing.assert_array_equal(np.asarray(got), want)  # a gather: exact


# -- ALiBi ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_heads", list(range(1, 21)) + [24, 32, 40, 48, 64, 80, 96, 128])
def test_alibi_slopes_match_bloom(num_heads):
  want = _get_alibi_slopes(num_heads, "cpu").numpy()
  # Bloom raises an fp32-rounded ratio to the k-th power (k <= N), ours rounds the exact power once:
  # they agree to a few fp32 ulps (measured <= 7e-7 relative up to 128 heads).
  np.testing.assert_allclose(np.asarray(alibi_slopes(num_heads)), want, rtol=1e-6, atol=0)


def test_alibi_softmax_equals_bloom_tensor():
  heads, t = 6, 9
  alibi = build_alibi_tensor(torch.ones(1, t), heads, torch.float32).numpy().reshape(heads, 1, t)
  logits = np.random.default_rng(0).standard_normal((heads, t, t)).astype(np.float32)
  causal = np.tril(np.ones((t, t), bool))

  def softmax(x):
    x = np.where(causal, x, -np.inf)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)

  ours = np.asarray(alibi_bias(alibi_slopes(heads), jnp.arange(t), jnp.arange(t)))
  # slope * (j - i) and Bloom's slope * j differ by slope * i, constant along each row.
  np.testing.assert_allclose(softmax(logits + ours), softmax(logits + alibi), rtol=1e-5, atol=1e-7)


# -- RoPE ----------------------------------------------------------------------------------------

def _llama_config(head_dim=16, max_position_embeddings=64, rope_parameters=None):
  return LlamaConfig(hidden_size=2 * head_dim, num_attention_heads=2, head_dim=head_dim,
                     max_position_embeddings=max_position_embeddings,
                     rope_parameters=rope_parameters or {"rope_type": "default",
                                                         "rope_theta": 10000.0})


def _hf_rope(config, q, positions, apply):
  """transformers' rotary module + ``apply`` on q ``[B, T, N, H]`` (fp32)."""
  rotary = hf_llama.LlamaRotaryEmbedding(config)
  qt = torch.from_numpy(q)
  with torch.no_grad():
    cos, sin = rotary(qt, torch.from_numpy(positions))
    out, _ = apply(qt, qt, cos, sin, unsqueeze_dim=2)
  return out.numpy()


SCALINGS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
             "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
               "rope_theta": 500000.0},
}


@pytest.mark.parametrize("name", list(SCALINGS))
def test_llama_rope_matches_transformers(name):
  params = dict(SCALINGS[name])
  config = _llama_config(rope_parameters=dict(params))
  q = np.random.default_rng(0).standard_normal((2, 5, 3, 16)).astype(np.float32)
  # Past the trained 64 positions, so dynamic rescales its base (transformers: max(pos) + 1).
  positions = np.array([[0, 1, 2, 30, 63], [5, 17, 64, 90, 99]])
  want = _hf_rope(config, q, positions, hf_llama.apply_rotary_pos_emb)
  scaling = RopeScaling.from_hf(params, max_position_embeddings=64)
  got = apply_rope(q, positions, base=params["rope_theta"], scaling=scaling)
  # fp32 on both sides; angles up to ~100 rad carry ~1e-5 absolute error in either.
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=2e-5)


def test_deepseek_interleaved_rope_is_a_permutation():
  # transformers' DeepSeek-V3 rotates consecutive pairs and returns them de-interleaved.
  config = _llama_config(head_dim=8)
  q = np.random.default_rng(1).standard_normal((1, 6, 2, 8)).astype(np.float32)
  positions = np.arange(6)[None] * 11
  want = _hf_rope(config, q, positions, hf_deepseek.apply_rotary_pos_emb_interleave)
  got = np.asarray(apply_rope(q, positions, interleaved=True))
  perm = np.concatenate([np.arange(0, 8, 2), np.arange(1, 8, 2)])
  np.testing.assert_allclose(got[..., perm], want, rtol=1e-5, atol=1e-5)


def test_yarn_mscale_matches_deepseek():
  # (transformers 5.25 moved it from the DeepSeek-V3 model file to modeling_rope_utils)
  hf_mscale = getattr(hf_deepseek, "yarn_get_mscale", None)
  if hf_mscale is None:
    from transformers import modeling_rope_utils  # noqa: PLC0415
    hf_mscale = modeling_rope_utils.yarn_get_mscale
  for scale, mscale in [(0.5, 1.0), (1.0, 1.0), (4.0, 1.0), (40.0, 0.707), (40.0, 1.0)]:
    assert yarn_mscale(scale, mscale) == hf_mscale(scale, mscale)


INIT_CASES = [
    ("linear", {"factor": 4.0}, {}),
    ("linear", {"factor": 2.5, "partial_rotary_factor": 0.5}, {}),
    ("dynamic", {"factor": 4.0}, {}),
    ("dynamic", {"factor": 4.0}, {"seq_len": 1000}),        # below the trained length: no change
    ("dynamic", {"factor": 4.0}, {"seq_len": 9000}),        # above: base rescaled
    ("dynamic", {"factor": 2.0, "partial_rotary_factor": 0.25}, {"seq_len": 5000}),
    ("yarn", {"factor": 4.0, "original_max_position_embeddings": 1024}, {}),
    ("yarn", {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 0.707,
              "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}, {}),  # DeepSeek style
    ("yarn", {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
              "mscale_all_dim": 1.0}, {}),                  # DeepSeek-V3: factor 1
    ("yarn", {"factor": 8.0, "original_max_position_embeddings": 2048, "attention_factor": 0.8,
              "beta_fast": 16, "beta_slow": 2}, {}),
    ("yarn", {"factor": 4.0, "original_max_position_embeddings": 1024, "truncate": False}, {}),
    ("yarn", {"factor": 4.0, "original_max_position_embeddings": 1024,
              "partial_rotary_factor": 0.5}, {}),
    ("llama3", {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}, {}),  # Llama 3.1
    ("llama3", {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 1024}, {}),
]


@pytest.mark.parametrize("kind, extra, call", INIT_CASES)
@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_rope_init_functions(kind, extra, call, theta):
  head_dim, max_pos = 128, 4096
  params = {"rope_type": kind, "rope_theta": theta, **extra}
  config = _llama_config(head_dim=head_dim, max_position_embeddings=max_pos,
                         rope_parameters=dict(params))
  want_freq, want_factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu", **call)
  rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
  scaling = RopeScaling.from_hf(params, max_position_embeddings=max_pos)
  got_freq, got_factor = rope_frequencies(rotary_dim, base=theta, scaling=scaling,
                                          seq_len=call.get("seq_len"))
  np.testing.assert_allclose(np.asarray(got_freq), want_freq.numpy(), rtol=1e-6, atol=0)
  assert math.isclose(got_factor, want_factor, rel_tol=1e-6)
