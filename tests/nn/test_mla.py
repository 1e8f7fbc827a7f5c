"""The MLA module: naive == absorbed, decode == full pass, the latent cache, decoupled RoPE's relative
position term, gradients, sharding on the simulated mesh, errors; partial RoPE in ``Attention``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxattn.nn.attention as attention_module
from jaxattn import sharding
from jaxattn.mla_cache import LatentCache
from jaxattn.nn.attention import Attention
from jaxattn.nn.mla import MLA
from jaxattn.ops.rope import apply_rope
from jaxattn.paged_cache import default_rope_align, stored_rope_width
from jaxattn.testing import random_module

D, N = 32, 4
DIMS = dict(kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
C, R = DIMS["kv_lora_rank"], DIMS["qk_rope_head_dim"]

# YaRN (with prefill + decode in both modes) is covered against transformers in tests/hf.
CONFIGS = {
    "q_lora_interleaved": dict(q_lora_rank=16),
    "plain_q_half_split_bias": dict(rope_interleaved=False, use_bias=True),
}


def random_mla(seed=0, **config):
  """An MLA with random weights (norm scales and biases too, so that they matter in every test).

  Built abstractly and filled from NumPy: the module's own initializers run eagerly and compile
  once per parameter shape (~4 s of CPU for one MLA), which would dominate this file's runtime.
  Parameter metadata (logical axes) is the constructor's.
  """
  return random_module(lambda: MLA(D, N, rngs=nnx.Rngs(0), **{**DIMS, **config}), seed)


def _x(t=10, b=2, seed=1):
  return jax.random.normal(jax.random.key(seed), (b, t, D))


@nnx.jit(static_argnames="mode")
def _decode_step(m, cache, xt, mode):
  """Prefill (several tokens) or decode (one) against ``cache``: ``(y, cache)``."""
  return m(xt, cache=cache, mode=mode)


@nnx.jit(static_argnames="mode")
def _call(m, x, mode="naive", **kw):
  return m(x, mode=mode, **kw)


@nnx.jit
def _full_both(m, x):
  return m(x, mode="naive"), m(x, mode="absorbed")


# -- naive == absorbed, decode == full -----------------------------------------------------------

@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_modes_agree_and_decode_equals_full_pass(name):
  mla = random_mla(**CONFIGS[name])
  x = _x()
  full, full_absorbed = _full_both(mla, x)
  assert full.shape == (2, 10, D)
  # fp32: the two association orders of the same products differ by rounding only.
  np.testing.assert_allclose(full_absorbed, full, atol=1e-5, rtol=1e-5)
  decoded = {}
  for mode in ("naive", "absorbed"):
    cache = mla.init_cache(batch=2, max_len=12)
    y0, cache = _decode_step(mla, cache, x[:, :4], mode)  # prefill 4 tokens
    outs = [y0]
    for t in range(4, 10):  # then one token at a time
      yt, cache = _decode_step(mla, cache, x[:, t:t + 1], mode)
      outs.append(yt)
    decoded[mode] = jnp.concatenate(outs, axis=1)
    assert int(cache.index) == 10
    np.testing.assert_allclose(decoded[mode], full, atol=1e-5, rtol=1e-5, err_msg=mode)
  np.testing.assert_allclose(decoded["absorbed"], decoded["naive"], atol=1e-5, rtol=1e-5)


def test_cache_stores_only_latent_and_shared_rotated_key():
  mla = random_mla(q_lora_rank=16)
  x = _x(t=5)
  cache = mla.init_cache(batch=2, max_len=8)
  # On TPU the buffer is longer (a page multiple) and k^R is zero-padded to 128 columns.
  length, width = cache.max_len, C + stored_rope_width(R, default_rope_align())
  assert isinstance(cache, LatentCache) and cache.kv.shape == (2, length, width) and length >= 8
  _, cache = _decode_step(mla, cache, x, "absorbed")
  latent = mla.kv_norm(mla.kv_down(x))
  k_rope = apply_rope(mla.k_rope_proj(x)[:, :, None, :], jnp.arange(5), interleaved=True)[:, :, 0]
  np.testing.assert_allclose(cache.c_kv[:, :5], latent, atol=1e-6, rtol=1e-6)
  np.testing.assert_allclose(cache.k_rope[:, :5], k_rope, atol=1e-6, rtol=1e-6)
  np.testing.assert_array_equal(cache.kv[:, 5:], 0)  # nothing written past the index
  # Bytes: B x L x (C + R) x 4 for the fp32 buffer (as stored); (C + R) x 2 per token in bf16.
  assert cache.nbytes == 2 * length * width * 4
  assert mla.cache_bytes(1000) == 1000 * (C + R) * 2
  assert mla.init_cache(1, 4, jnp.bfloat16).kv.dtype == jnp.bfloat16


def test_deepseek_v3_cache_is_576_numbers_per_token():
  mla = nnx.eval_shape(lambda: MLA(7168, 128, kv_lora_rank=512, qk_nope_head_dim=128,
                                   qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=1536,
                                   rngs=nnx.Rngs(0)))
  assert mla.cache_bytes(1, dtype=jnp.bfloat16) == 576 * 2
  mha = nnx.eval_shape(lambda: Attention(7168, 128, head_dim=128, rngs=nnx.Rngs(0)))
  assert mha.cache_bytes(1, dtype=jnp.bfloat16) == 32768 * 2
  assert mla.scale == pytest.approx(192 ** -0.5)


def test_latent_cache_pytree_update_and_errors():
  cache = LatentCache.init(2, 4, kv_lora_rank=3, qk_rope_head_dim=2)
  leaves, treedef = jax.tree.flatten(cache)
  assert len(leaves) == 2  # kv and index; the rank is static metadata
  assert jax.tree.unflatten(treedef, leaves).kv_lora_rank == 3
  c = jnp.ones((2, 3, 3))
  k = 2 * jnp.ones((2, 3, 2))
  new = jax.jit(lambda cache: cache.update(c, k))(cache)
  assert int(new.index) == 3 and new.qk_rope_head_dim == 2
  np.testing.assert_array_equal(new.c_kv[:, :3], 1)
  np.testing.assert_array_equal(new.k_rope[:, :3], 2)
  with pytest.raises(ValueError, match="cache overflow"):
    new.update(c[:, :2], k[:, :2])
  with pytest.raises(ValueError, match="capacity"):
    cache.update(jnp.ones((2, 5, 3)), jnp.ones((2, 5, 2)))
  with pytest.raises(ValueError, match="c_kv"):
    cache.update(jnp.ones((2, 1, 4)), jnp.ones((2, 1, 2)))
  with pytest.raises(ValueError, match="k_rope"):
    cache.update(jnp.ones((2, 1, 3)), jnp.ones((2, 1, 3)))
  with pytest.raises(ValueError, match="max_len"):
    LatentCache.init(1, 0, 3, 2)


# -- decoupled RoPE ------------------------------------------------------------------------------

@pytest.mark.parametrize("interleaved", [True, False])
def test_position_term_depends_only_on_offset(interleaved):
  mla = random_mla(rope_interleaved=interleaved)
  x = _x(t=6, b=1, seed=3)
  positions = jnp.array([[0, 3, 4, 9, 10, 20]])
  content, position = mla.score_terms(x, positions=positions)
  content_shifted, position_shifted = mla.score_terms(x, positions=positions + 1000)
  # The content stream never sees a position: bit-identical.
  np.testing.assert_array_equal(content_shifted, content)
  # The position stream sees only n - m: equal up to fp32 rounding of angles ~1000 rad (~1e-4).
  np.testing.assert_allclose(position_shifted, position, atol=2e-4, rtol=1e-4)
  # ...and it does depend on the offsets (a different spacing changes it).
  _, position_spread = mla.score_terms(x, positions=2 * positions)
  assert float(jnp.abs(position_spread - position).max()) > 1e-2


def test_packed_segments_equal_separate_sequences():
  mla = random_mla(q_lora_rank=16)
  x = _x(t=7, b=1, seed=4)
  seg = jnp.array([[0, 0, 0, 1, 1, 1, 1]])
  pos = jnp.array([[0, 1, 2, 0, 1, 2, 3]])
  packed = _call(mla, x, "absorbed", positions=pos, segment_ids=seg)
  # The separate runs in naive mode: the packed absorbed run must match them too.
  first, second = _call(mla, x[:, :3]), _call(mla, x[:, 3:])
  np.testing.assert_allclose(packed, jnp.concatenate([first, second], 1), atol=1e-5, rtol=1e-5)


# -- gradients, dtypes ---------------------------------------------------------------------------

def test_gradients_reach_every_parameter_and_modes_agree():
  mla = random_mla(q_lora_rank=16, use_bias=True)
  x = _x(t=6)
  ct = jax.random.normal(jax.random.key(5), (2, 6, D))

  @nnx.jit(static_argnames="mode")
  def grads(m, mode):
    return nnx.grad(lambda m: jnp.sum(m(x, mode=mode) * ct))(m)

  g_naive = nnx.to_flat_state(grads(mla, "naive"))
  g_abs = dict(nnx.to_flat_state(grads(mla, "absorbed")))
  names = [path for path, _ in g_naive]
  assert len(names) == 13  # q_down/q_norm/q_up, kv_down/kv_norm, k_rope_proj, k_up, v_up, o_proj
  for path, g in g_naive:
    g = np.asarray(g.get_value())
    assert np.all(np.isfinite(g)) and np.abs(g).max() > 1e-6, path
    np.testing.assert_allclose(g_abs[path].get_value(), g, atol=1e-5, rtol=1e-4, err_msg=str(path))


def test_bf16_compute_with_fp32_params():
  mla32 = random_mla(q_lora_rank=16)
  mla16 = random_mla(q_lora_rank=16, dtype=jnp.bfloat16)
  assert mla16.k_up.kernel[...].dtype == jnp.float32
  x = _x(t=6)
  want = _call(mla32, x)
  for mode in ("naive", "absorbed"):
    got = _call(mla16, x.astype(jnp.bfloat16), mode)
    assert got.dtype == jnp.bfloat16
    # bf16 activations (8 significant bits) through ~6 matmuls of O(1) values.
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=6e-2, rtol=6e-2, err_msg=mode)


# -- default initialization and sharding ---------------------------------------------------------

def test_sharded_on_simulated_mesh_equals_single_device():
  mesh = sharding.make_mesh({"fsdp": 2, "tensor": 4})
  mla = random_mla(q_lora_rank=16)
  # Every parameter carries logical axes; heads go to `tensor`.
  specs = dict(nnx.to_flat_state(sharding.param_specs(nnx.state(mla, nnx.Param), mesh=mesh)))
  assert specs[("q_up", "kernel")] == P(None, "tensor", None)
  assert specs[("k_up", "kernel")] == P(None, "tensor", None)
  assert specs[("v_up", "kernel")] == P(None, "tensor", None)
  assert specs[("o_proj", "kernel")] == P("tensor", None, "fsdp")
  assert specs[("kv_down", "kernel")] == P("fsdp", None)
  assert specs[("q_down", "kernel")] == P("fsdp", None)
  assert specs[("kv_norm", "scale")] == P(None)
  for path, var in nnx.to_flat_state(nnx.state(mla, nnx.Param)):
    assert var.get_metadata().get("logical_axes") is not None, path

  x = _x(t=8, b=4)
  want_full, want_absorbed = _full_both(mla, x)
  # A cache holding the first 7 tokens (written straight from the projections, no prefill call).
  positions = jnp.arange(7)
  k_rope = apply_rope(mla.k_rope_proj(x[:, :7])[:, :, None], positions, interleaved=True)[:, :, 0]
  cache = mla.init_cache(4, 8).update(mla.kv_norm(mla.kv_down(x[:, :7])), k_rope)
  want_step, _ = _decode_step(mla, cache, x[:, 7:], "absorbed")
  with jax.set_mesh(mesh):
    sharding.shard_module(mla, mesh)
    assert mla.k_up.kernel[...].sharding.spec == P(None, "tensor", None)
    assert mla.k_up.kernel[...].addressable_shards[0].data.shape == (C, 1, DIMS["qk_nope_head_dim"])
    xs = jax.device_put(x, jax.NamedSharding(mesh, P(("data", "fsdp"), None, None)))
    got_full, got_absorbed = _full_both(mla, xs)
    got_step, new_cache = _decode_step(mla, cache, xs[:, 7:], "absorbed")
  np.testing.assert_allclose(got_full, want_full, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(got_absorbed, want_absorbed, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(got_step, want_step, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(got_step[:, 0], want_full[:, 7], atol=1e-5, rtol=1e-5)
  assert int(new_cache.index) == 8


# -- errors --------------------------------------------------------------------------------------

@pytest.mark.parametrize("change, match", [
    (dict(qk_rope_head_dim=3), "qk_rope_head_dim.*even"),
    (dict(qk_rope_head_dim=0), "qk_rope_head_dim"),
    (dict(kv_lora_rank=0), "kv_lora_rank"),
    (dict(kv_lora_rank=-4), "kv_lora_rank"),
    (dict(q_lora_rank=0), "q_lora_rank"),
    (dict(qk_nope_head_dim=0), "qk_nope_head_dim"),
    (dict(v_head_dim=0), "v_head_dim"),
    (dict(mode="fast"), "mode"),
    (dict(attention_scale=-1.0), "attention_scale"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling"),
    (dict(rope_base=0.0), "rope_base"),
])
def test_bad_configuration_raises(change, match):
  with pytest.raises(ValueError, match=match):
    MLA(D, N, rngs=nnx.Rngs(0), **{**DIMS, **change})
  with pytest.raises(ValueError, match="num_heads"):
    MLA(D, 0, rngs=nnx.Rngs(0), **DIMS)


def test_bad_call_raises():
  mla = random_mla()
  x = _x(t=3)
  with pytest.raises(ValueError, match="mode"):
    mla(x, mode="fast")
  with pytest.raises(ValueError, match="x"):
    mla(x[..., :8])
  cache = mla.init_cache(2, 4)
  with pytest.raises(ValueError, match="segment_ids"):
    mla(x, cache=cache, segment_ids=jnp.zeros((2, 3), jnp.int32))
  with pytest.raises(ValueError, match="cache overflow"):
    mla(jnp.concatenate([x, x], 1)[:, :5], cache=mla.init_cache(2, 5).update(
        jnp.zeros((2, 1, C)), jnp.zeros((2, 1, R))))
  with pytest.raises(ValueError, match="C=12"):
    mla(x, cache=LatentCache.init(2, 4, 8, R))


# -- partial RoPE in the foundation's Attention --------------------------------------------------

def test_attention_partial_rope_leaves_untouched_dims_exactly(monkeypatch):
  """``Attention(rotary_dim=R)`` rotates the first R dims of each head; the rest pass bit for bit."""
  seen = []
  real = attention_module.apply_rope

  def recording(x, positions, **kw):
    out = real(x, positions, **kw)
    seen.append((np.asarray(x), np.asarray(out), kw["rotary_dim"]))
    return out

  monkeypatch.setattr(attention_module, "apply_rope", recording)
  attn = nnx.eval_shape(lambda: Attention(D, N, head_dim=8, rotary_dim=4, causal=False,
                                          rngs=nnx.Rngs(0)))
  rng = np.random.default_rng(0)
  for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
    proj.kernel.set_value(jnp.asarray(rng.standard_normal(proj.kernel.get_value().shape) / 6,
                                      jnp.float32))
  x = _x(t=5)
  positions = jnp.array([[0, 7, 8, 30, 31]])
  y = attn(x, positions=positions)
  assert len(seen) == 2  # queries and keys
  for before, after, rotary_dim in seen:
    assert rotary_dim == 4
    np.testing.assert_array_equal(after[..., 4:], before[..., 4:])  # untouched: exactly
    assert np.abs(after[..., :4] - before[..., :4]).max() > 1e-3    # rotated: changed
  monkeypatch.undo()
  # Consequence: with q/k weights only on the untouched dims, the output ignores positions exactly.
  for proj in (attn.q_proj, attn.k_proj):
    proj.kernel[...] = proj.kernel[...].at[..., :4].set(0.0)
  np.testing.assert_array_equal(attn(x, positions=positions), attn(x, positions=3 * positions))
  assert y.shape == (2, 5, D)


def test_docstring_limits_decode_equals_full_pass_as_attention_does():
  # Decode == full pass holds only for causal layers and not with dynamic RoPE scaling (whose base
  # depends on the length so far); the docstring says so, as Attention's does.
  for cls in (MLA, Attention):
    doc = " ".join(cls.__doc__.split())
    assert "for a causal layer" in doc and 'rope_scaling`` of type ``"dynamic"``' in doc, cls
