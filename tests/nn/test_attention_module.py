"""The Attention module: KV-cache decode equals the full pass, cache size, positional schemes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxattn.nn.attention import Attention
from jaxattn.ops.rope import RopeScaling

D = 32

CONFIGS = {
    "mha_rope": dict(num_heads=4),
    "gqa_rope_interleaved": dict(num_heads=4, num_kv_heads=2, rope_interleaved=True),
    "mqa_partial_rope": dict(num_heads=4, num_kv_heads=1, rotary_dim=4),
    "alibi": dict(num_heads=4, position="alibi"),
    "t5": dict(num_heads=4, position="t5", t5_num_buckets=8, t5_max_distance=16),
    "sliding_window_softcap": dict(num_heads=4, num_kv_heads=2, sliding_window=3,
                                   logits_soft_cap=5.0),
    "yarn": dict(num_heads=4, num_kv_heads=2,
                 rope_scaling=RopeScaling(type="yarn", factor=4.0, original_max_position_embeddings=8)),
    "no_position_vhead": dict(num_heads=4, position="none", v_head_dim=6),
    "sinks_window": dict(num_heads=4, num_kv_heads=2, attention_sinks=True, sliding_window=4),
}


def _x(t=11, b=2, seed=1):
  return jax.random.normal(jax.random.key(seed), (b, t, D))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prefill_then_decode_equals_full_pass(name):
  attn = Attention(D, rngs=nnx.Rngs(0), **CONFIGS[name])
  if attn.rel_bias is not None:  # make the T5 bias matter
    attn.rel_bias.embedding[...] = jax.random.normal(jax.random.key(9), attn.rel_bias.embedding.shape)
  if attn.sinks is not None:     # and the sinks (initialized to 0)
    attn.sinks[...] = jnp.array([2.0, -1.0, 0.5, 4.0])
  x = _x()
  full = attn(x)
  cache = attn.init_cache(batch=2, max_len=16)
  y0, cache = attn(x[:, :5], cache=cache)  # prefill 5 tokens
  outs = [y0]
  step = nnx.jit(lambda m, c, xt: m(xt, cache=c))
  for t in range(5, 11):  # then one token at a time
    yt, cache = step(attn, cache, x[:, t:t + 1])
    outs.append(yt)
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, atol=2e-5, rtol=2e-5)
  assert int(cache.index) == 11


def test_cache_bytes_is_the_seed_formula():
  attn = Attention(4096, num_heads=32, num_kv_heads=8, head_dim=128, rngs=nnx.Rngs(0))
  # 2 x n x h_kv x d x bytes
  assert attn.cache_bytes(1000, dtype=jnp.bfloat16) == 2 * 1000 * 8 * 128 * 2
  cache = Attention(D, num_heads=4, num_kv_heads=2, rngs=nnx.Rngs(0)).init_cache(3, 10, jnp.bfloat16)
  assert cache.max_len >= 10 and cache.nbytes == 2 * 3 * cache.max_len * 2 * 8 * 2


def test_cache_overflow_and_packed_with_cache_raise():
  attn = Attention(D, num_heads=4, rngs=nnx.Rngs(0))
  cache = attn.init_cache(2, 4)
  with pytest.raises(ValueError, match="capacity"):
    attn(_x(t=5), cache=cache)
  _, filled = attn(_x(t=2), cache=cache)
  with pytest.raises(ValueError, match="overflow"):
    attn(_x(t=3), cache=filled)
  with pytest.raises(ValueError, match="segment_ids"):
    attn(_x(t=2), cache=cache, segment_ids=jnp.zeros((2, 2), jnp.int32))
  # an empty chunk leaves the cache as it was (the row reshape divided by T = 0)
  y, same = attn(_x(t=0), cache=filled)
  assert y.shape == (2, 0, D) and int(same.index) == 2
  np.testing.assert_array_equal(same.key, filled.key)
  for bad in (jnp.ones((3, D)), jnp.ones((2, 3, D + 1))):
    with pytest.raises(ValueError, match=r"`x` must be \[B, T, D=32\]"):
      attn(bad)
  with pytest.raises(ValueError, match="`max_len` must be an int >= 1, got 2.7"):
    attn.init_cache(2, 2.7)           # (was truncated to 2)
  # a cache of another batch or another layer is named as `cache` (was a bad `key`)
  gqa = Attention(D, num_heads=4, num_kv_heads=2, sliding_window=3, rngs=nnx.Rngs(0))
  for layer, other in ((attn, attn.init_cache(3, 4)), (attn, gqa.init_cache(2, 4)),
                       (gqa, gqa.init_rolling_cache(3))):
    with pytest.raises(ValueError, match=r"`cache` holds \[B, K, H, h\]"):
      layer(_x(t=2), cache=other)


def test_cache_overflow_under_jit_turns_the_outputs_nan():
  """Under jit the cache index is traced and cannot raise: a step past the capacity returns NaN
  (``nan_past_capacity``) rather than silently wrong outputs; steps that fit are unchanged.  The
  same for the MLA latent cache (both modes) and the DSA cache."""
  from jaxattn.nn.dsa import DSA  # noqa: PLC0415
  from jaxattn.nn.mla import MLA  # noqa: PLC0415
  step = nnx.jit(lambda m, c, x: m(x, cache=c))
  mla_dims = dict(kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4,
                  rngs=nnx.Rngs(0))
  for module in (Attention(D, num_heads=4, num_kv_heads=2, rngs=nnx.Rngs(0)),
                 MLA(D, 4, **mla_dims), MLA(D, 4, mode="absorbed", **mla_dims),
                 DSA(D, 4, index_num_heads=2, index_head_dim=8, index_rope_dim=4, index_topk=2,
                     **mla_dims)):
    x = _x(t=6)
    y, cache = step(module, module.init_cache(2, 4), x[:, :4])
    np.testing.assert_allclose(y, module(x[:, :4]), rtol=2e-5, atol=2e-5)
    assert np.isfinite(np.asarray(y)).all()
    y5, cache = step(module, cache, x[:, 4:5])
    assert np.isnan(np.asarray(y5)).all() and int(cache.index) == 5
    y6, _ = step(module, cache, x[:, 5:6])
    assert np.isnan(np.asarray(y6)).all()


def test_gqa_module_shapes_and_packed_sequences():
  attn = Attention(D, num_heads=4, num_kv_heads=2, rngs=nnx.Rngs(0))
  assert attn.q_proj.kernel.shape == (D, 4, 8) and attn.k_proj.kernel.shape == (D, 2, 8)
  x = _x(t=8, b=1)
  seg = jnp.array([[0, 0, 0, 1, 1, 1, 1, 1]])
  pos = jnp.array([[0, 1, 2, 0, 1, 2, 3, 4]])
  packed = attn(x, segment_ids=seg, positions=pos)
  np.testing.assert_allclose(packed[:, 3:], attn(x[:, 3:]), atol=2e-5)
  np.testing.assert_allclose(packed[:, :3], attn(x[:, :3]), atol=2e-5)


def test_grad_through_module():
  attn = Attention(D, num_heads=4, num_kv_heads=2, rngs=nnx.Rngs(0))
  grads = nnx.grad(lambda m: jnp.mean(m(_x()) ** 2))(attn)
  norms = jax.tree.leaves(jax.tree.map(lambda g: float(jnp.linalg.norm(g)), grads))
  assert len(norms) == 4 and all(np.isfinite(n) and n > 0 for n in norms)


def test_bad_configs_raise():
  with pytest.raises(ValueError, match="divisible by `num_kv_heads`"):
    Attention(D, num_heads=4, num_kv_heads=3, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="rotary_dim"):
    Attention(D, num_heads=4, rotary_dim=3, rngs=nnx.Rngs(0))
  for bad in (-2, True, 2.0):   # (True was a window of 1)
    with pytest.raises(ValueError, match="`sliding_window` must be a non-negative int or None"):
      Attention(D, num_heads=4, sliding_window=bad, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="position"):
    Attention(D, num_heads=4, position="sinusoidal-ish", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="embed_dim"):
    Attention(30, num_heads=4, rngs=nnx.Rngs(0))
  for base in (0.0, -1.0, float("nan")):
    with pytest.raises(ValueError, match="`rope_base`"):
      Attention(D, num_heads=4, rope_base=base, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="`rope_base`=1.0 must not be 1 with yarn"):
    Attention(D, num_heads=4, rope_base=1.0, rngs=nnx.Rngs(0), rope_scaling=RopeScaling(
        "yarn", 4.0, original_max_position_embeddings=8))
  with pytest.raises(ValueError, match="`rope_scaling` must be None or a RopeScaling"):
    Attention(D, num_heads=4, rope_scaling={"type": "linear", "factor": 2.0}, rngs=nnx.Rngs(0))
  alibi_msg = r"`position`='alibi' needs `causal`=True.*slope \* \(j - i\)"
  with pytest.raises(ValueError, match=alibi_msg):
    Attention(D, num_heads=4, causal=False, position="alibi", rngs=nnx.Rngs(0))


def test_bf16_compute_with_fp32_params():
  attn = Attention(D, num_heads=4, num_kv_heads=2, rngs=nnx.Rngs(0))
  attn16 = Attention(D, num_heads=4, num_kv_heads=2, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  x = _x()
  y16 = attn16(x.astype(jnp.bfloat16))
  assert y16.dtype == jnp.bfloat16 and attn16.q_proj.kernel[...].dtype == jnp.float32
  # bf16 projections + bf16 attention output: ~3 significant digits on O(1) activations.
  np.testing.assert_allclose(y16.astype(jnp.float32), attn(x), atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("causal", [True, False])
def test_t5_layer_on_the_flash_kernels_matches_xla(causal):
  """A T5 layer's learned bias ``[1, N, T, S]`` goes through the Pallas flash kernels (TPU kernel
  interpreted here; the dispatcher sends it there on a TPU): outputs and the gradients of every
  parameter, the bucket table's included (through the kernel's bias gradient), equal the XLA
  path's."""
  attn = Attention(D, rngs=nnx.Rngs(0), causal=causal, **CONFIGS["t5"])
  attn.rel_bias.embedding[...] = jax.random.normal(jax.random.key(9),
                                                   attn.rel_bias.embedding.shape)
  graphdef, params = nnx.split(attn)
  x = _x(t=13)

  def loss(params, impl):
    y = nnx.merge(graphdef, params)(x, implementation=impl)
    return jnp.sum(y * jnp.cos(y)), y

  (_, y_xla), g_xla = jax.value_and_grad(loss, has_aux=True)(params, "xla")
  (_, y_kernel), g_kernel = jax.value_and_grad(loss, has_aux=True)(params, "pallas_tpu")
  np.testing.assert_allclose(y_kernel, y_xla, atol=2e-5)
  flat_xla, flat_kernel = jax.tree.leaves(g_xla), jax.tree.leaves(g_kernel)
  assert len(flat_xla) == len(flat_kernel) >= 5
  for a, b in zip(flat_kernel, flat_xla):
    np.testing.assert_allclose(a, b, atol=1e-4)
  table = g_kernel["rel_bias"]["embedding"].value
  assert float(jnp.abs(table).max()) > 1e-3  # the bias' gradient reached the bucket table
