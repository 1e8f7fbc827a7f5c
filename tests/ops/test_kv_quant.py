"""Quantized KV caches (``PagedKVCache(dtype=int8 | float8_e4m3fn)``): ``quantize_kv``'s error
bounds, the cache's codes and per-token, per-head scales (append, ragged chunks, gather, bytes),
``paged_attention`` over codes == the formula over the dequantized cache, a whole model decoding
from a quantized cache close to a float one (and the serving engine on it); the contiguous
``KVCache`` and ``generate(cache_dtype=)``; and the errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxattn.cache import KVCache
from jaxattn.configs import get_config
from jaxattn.generation import generate
from jaxattn.nn.model import DecoderLM
from jaxattn.ops.decode import paged_attention
from jaxattn.ops.quantization import check_cache_dtype, kv_quantized, quantize_kv
from jaxattn.paged_cache import PagedKVCache
from jaxattn.rolling_cache import RollingKVCache
from jaxattn.serving import Engine

INT8, FP8 = jnp.int8, jnp.float8_e4m3fn


def normal(shape, seed=0, scale=1.0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, jnp.float32)


def test_quantize_kv_error_bounds():
  # Rows of very different magnitudes (one scale per row must follow each), and a zero row.
  x = normal((3, 5, 16)) * jnp.asarray([1e-3, 1.0, 50.0])[:, None, None]
  x = x.at[0, 0].set(0.0)
  codes, scale = quantize_kv(x, INT8)
  assert codes.dtype == jnp.int8 and scale.shape == (3, 5) and scale.dtype == jnp.float32
  amax = np.abs(np.asarray(x)).max(-1)
  np.testing.assert_allclose(scale, np.maximum(amax, 1e-4) / 127, rtol=1e-6)
  err = np.abs(np.asarray(codes, np.float32) * np.asarray(scale)[..., None] - np.asarray(x))
  assert (err <= np.asarray(scale)[..., None] / 2 * (1 + 1e-5)).all()   # round to nearest
  assert (np.asarray(codes)[0, 0] == 0).all()
  assert np.abs(np.asarray(codes)).max() == 127                         # the row's amax maps to 127
  codes, scale = quantize_kv(x, FP8)
  assert codes.dtype == jnp.float8_e4m3fn
  deq = np.asarray(codes, np.float32) * np.asarray(scale)[..., None]
  # e4m3: 3 mantissa bits, relative error <= 2^-4 for normal codes; subnormals (below 2^-6 of
  # the scale) within half their step 2^-9.
  bound = np.maximum(np.abs(np.asarray(x)) * 2.0 ** -4, np.asarray(scale)[..., None] * 2.0 ** -10)
  assert (np.abs(deq - np.asarray(x)) <= bound * (1 + 1e-5)).all()
  with pytest.raises(ValueError, match="quantize_kv: `dtype` must be one of"):
    quantize_kv(x, jnp.int16)


def test_cache_dtypes():
  assert kv_quantized(jnp.int8) and kv_quantized("float8_e4m3fn") and not kv_quantized(jnp.bfloat16)
  assert not kv_quantized("nonsense")
  assert check_cache_dtype("bfloat16", "here") == jnp.bfloat16
  for bad in (jnp.int32, jnp.uint8, "nonsense", jnp.bool_):
    with pytest.raises(ValueError, match=r"PagedKVCache.init: `dtype` must be a float dtype, or "
                                         r"int8 / float8_e4m3fn"):
      PagedKVCache.init(2, 4, 4, 2, 8, dtype=bad)


@pytest.mark.parametrize("dtype", [INT8, FP8])
def test_paged_cache_holds_codes_and_scales(dtype):
  b, kh, h, hv, page = 3, 2, 8, 4, 4
  cache = PagedKVCache.init(b, 12, page, kh, h, hv, dtype=dtype)
  assert cache.quantized and cache.key_pool.dtype == dtype
  assert cache.key_scale_pool.shape == cache.value_scale_pool.shape == (12, 1, kh * page)
  # Bytes: 1 per entry + 4 per token and KV head for each of keys and values.
  assert cache.nbytes == 12 * page * kh * (h + hv + 8)
  assert not PagedKVCache.init(b, 12, page, kh, h, hv).quantized
  key, value = normal((b, 6, kh, h), 1), normal((b, 6, kh, hv), 2)
  # Two ragged chunks: the second at each sequence's own length.
  cache = cache.append(key[:, :3], value[:, :3], np.array([3, 1, 0]))
  cache = cache.append(key[:, 3:], value[:, 3:], np.array([2, 3, 1]))
  np.testing.assert_array_equal(cache.lengths, [5, 4, 1])
  gk, gv = cache.gather()
  assert gk.dtype == jnp.float32 and gk.shape[2:] == (kh, h) and gv.shape[2:] == (kh, hv)
  held = [np.r_[0:3, 3:5], np.r_[0:1, 3:6], np.r_[3:4]]          # input positions, in order
  for i, pos in enumerate(held):
    for got, x in ((gk, key), (gv, value)):
      want_codes, want_scale = quantize_kv(x[i, pos], dtype)
      np.testing.assert_array_equal(got[i, :len(pos)],
                                    np.asarray(want_codes, np.float32) * want_scale[..., None])
      np.testing.assert_array_equal(got[i, len(pos):], 0.0)


@pytest.mark.parametrize("dtype", [INT8, FP8])
def test_attention_over_codes_is_the_formula_over_the_dequantized_cache(dtype):
  """The XLA path folds nothing: codes times scales, gathered.  So its result is the float
  path's over a float cache holding exactly the dequantized values; and close to the unquantized
  cache's (int8: 1%, fp8: 6% of the output's range here)."""
  b, t, n, kh, h = 3, 2, 4, 2, 16
  lengths = np.array([11, 0, 6])
  key, value = normal((b, 11, kh, h), 3), normal((b, 11, kh, h), 4)
  q = normal((b, t, n, h), 5)
  cache = PagedKVCache.init(b, 12, 4, kh, h, dtype=dtype).append(key, value, lengths)
  got = paged_attention(q, cache.key_pool, cache.value_pool, cache.page_table, cache.lengths,
                        key_scale=cache.key_scale_pool, value_scale=cache.value_scale_pool,
                        implementation="xla")
  dk, dv = cache.gather()
  deq = PagedKVCache.init(b, 12, 4, kh, h).append(dk[:, :11], dv[:, :11], lengths)
  want = paged_attention(q, deq.key_pool, deq.value_pool, deq.page_table, deq.lengths,
                         implementation="xla")
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  plain = PagedKVCache.init(b, 12, 4, kh, h).append(key, value, lengths)
  exact = paged_attention(q, plain.key_pool, plain.value_pool, plain.page_table, plain.lengths,
                          implementation="xla")
  tol = 0.01 if dtype == INT8 else 0.06
  assert 0 < np.abs(np.asarray(got - exact)).max() <= tol * np.abs(np.asarray(exact)).max()


def test_scale_errors():
  cache = PagedKVCache.init(2, 4, 4, 2, 8, dtype=INT8).append(normal((2, 3, 2, 8)),
                                                               normal((2, 3, 2, 8)))
  plain = PagedKVCache.init(2, 4, 4, 2, 8)
  q = normal((2, 1, 4, 8))
  args = (cache.key_pool, cache.value_pool, cache.page_table, cache.lengths)
  scales = dict(key_scale=cache.key_scale_pool, value_scale=cache.value_scale_pool)
  msg = "`key_scale` and `value_scale` must be given exactly when"
  with pytest.raises(ValueError, match=msg):
    paged_attention(q, *args)                                      # codes without scales
  with pytest.raises(ValueError, match=msg):
    paged_attention(q, *args, key_scale=cache.key_scale_pool)      # one of two
  with pytest.raises(ValueError, match=msg):                       # a float pool with scales
    paged_attention(q, plain.key_pool, plain.value_pool, *args[2:], **scales)
  with pytest.raises(ValueError, match=msg):                       # int8 keys, float values
    paged_attention(q, cache.key_pool, plain.value_pool, *args[2:], **scales)
  with pytest.raises(ValueError,
                     match=r"`key_scale` must be float32 \[P, 1, K \* page\] = \[4, 1, 8\]"):
    paged_attention(q, *args, key_scale=cache.key_scale_pool.reshape(4, 2, 4),
                    value_scale=cache.value_scale_pool)
  with pytest.raises(ValueError, match=r"`value_scale` must be float32"):
    paged_attention(q, *args, key_scale=cache.key_scale_pool,
                    value_scale=cache.value_scale_pool.astype(jnp.bfloat16))


SMALL = dict(embed_dim=32, mlp_dim=64, max_seq_len=64, vocab_size=61)


@nnx.jit
def _step(model, tokens, num_tokens, cache):
  return model(tokens, cache=cache, num_tokens=num_tokens)


@pytest.mark.parametrize("preset,kw", [
    ("llama", dict(num_layers=2)),
    # A hybrid: the Gated DeltaNet layer's state keeps the compute dtype.
    ("qwen3-next", dict(num_layers=2, layer_pattern="DA", first_k_dense=2, deltanet_head_dim=8,
                        deltanet_v_head_dim=8, deltanet_chunk_size=4, rotary_dim=4)),
])
def test_a_model_decodes_from_a_quantized_cache(preset, kw):
  """Ragged chunks of three sequences through a paged cache: int8 logits within 5% (fp8: 12%)
  of the float cache's largest logit; the attention layers hold codes, the recurrent state
  float; the engine runs on an int8 cache."""
  model = DecoderLM(get_config(preset, **SMALL).replace(**kw), rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  schedule = np.array([[3, 1, 0], [1, 3, 2], [2, 2, 3]])
  tokens = rng.integers(1, 61, size=(len(schedule), 3, 3)).astype(np.int32)

  def run(dtype):
    cache = model.init_paged_cache(3, 12, 2, dtype=dtype)
    out = []
    for tok, nt in zip(tokens, schedule):
      logits, cache = _step(model, jnp.asarray(tok), jnp.asarray(nt, jnp.int32), cache)
      out.append(np.concatenate([np.asarray(logits[i, :n]) for i, n in enumerate(nt)]))
    return np.concatenate(out), cache

  ref, _ = run(None)
  for dtype, tol in ((INT8, 0.05), (FP8, 0.12)):
    got, cache = run(dtype)
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert 0 < err <= tol, (dtype, err)
  leaves = jax.tree.leaves(cache.groups)
  assert any(x.dtype == FP8 for x in leaves)
  for group in cache.groups:
    for c in group:
      if isinstance(c, PagedKVCache):
        assert c.quantized
      else:   # a DeltaNet state: float
        assert all(jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != FP8
                   for x in jax.tree.leaves(c))
  engine = Engine(model, max_batch=2, page_size=4, chunk=4, dtype=INT8)
  rid = engine.submit(rng.integers(1, 61, size=5).astype(np.int32), 4)
  assert engine.run()[rid].shape == (9,)
  assert all(c.quantized for g in engine.cache.groups for c in g if isinstance(c, PagedKVCache))


@pytest.mark.parametrize("dtype", [INT8, FP8])
def test_contiguous_cache_holds_codes_and_scales(dtype):
  cache = KVCache.init(2, 10, 2, 8, 4, dtype=dtype)
  assert cache.quantized and cache.key.dtype == dtype and cache.key_scale.shape == (2, 2, 10)
  assert cache.nbytes == 2 * 10 * 2 * (8 + 4 + 8)
  key, value = normal((2, 7, 2, 8), 1), normal((2, 7, 2, 4), 2)
  cache = cache.update(key[:, :4], value[:, :4]).update(key[:, 4:], value[:, 4:])
  assert int(cache.index) == 7
  gk, gv = cache.split_heads()
  for got, x in ((gk, key), (gv, value)):
    codes, scale = quantize_kv(x, dtype)
    np.testing.assert_array_equal(got[:, :7], np.asarray(codes, np.float32) * scale[..., None])


def test_generate_with_a_quantized_cache():
  """Greedy generation with an int8 / fp8 cache: the prefill's logits are those of the float
  cache within 3% (int8), and generation runs whole; the errors."""
  model = DecoderLM(get_config("llama", **SMALL).replace(num_layers=2), rngs=nnx.Rngs(0))
  prompt = np.random.default_rng(0).integers(1, 61, size=(2, 7)).astype(np.int32)
  exact, _ = model(jnp.asarray(prompt), cache=model.init_cache(2, 16))
  quant, cache = model(jnp.asarray(prompt), cache=model.init_cache(2, 16, INT8))
  assert 0 < np.abs(np.asarray(quant - exact)).max() <= 0.03 * np.abs(np.asarray(exact)).max()
  assert any(x.dtype == INT8 for x in jax.tree.leaves(cache))
  for dtype in (INT8, "float8_e4m3fn"):
    assert generate(model, prompt, 6, cache_dtype=dtype).shape == (2, 13)
  with pytest.raises(ValueError, match=r"generate: `cache_dtype` must be a float dtype, or int8"):
    generate(model, prompt, 2, cache_dtype=jnp.int32)
  with pytest.raises(ValueError, match=r"RollingKVCache.init: `dtype` int8 \(a quantized cache\)"):
    RollingKVCache.init(2, 4, 2, 8, dtype=INT8)
  with pytest.raises(ValueError, match=r"KVCache.init: `dtype` must be a float dtype"):
    KVCache.init(2, 4, 2, 8, dtype=jnp.int32)


def test_cache_bytes_count_codes_and_scales():
  """``Attention.cache_bytes`` / ``MLA.cache_bytes`` of a quantized dtype are what the caches
  allocate per token (codes, scales, and MLA's float k^R)."""
  from jaxattn.nn.attention import Attention  # noqa: PLC0415
  from jaxattn.nn.mla import MLA  # noqa: PLC0415
  from jaxattn.paged_cache import PagedLatentCache  # noqa: PLC0415
  attn = Attention(64, num_heads=4, num_kv_heads=2, rngs=nnx.Rngs(0))
  for dtype in (INT8, FP8, jnp.bfloat16):
    assert attn.cache_bytes(8 * 4, 1, dtype) == attn.init_paged_cache(1, 8, 4, dtype=dtype).nbytes
  mla = MLA(64, num_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=8,
            qk_rope_head_dim=4, v_head_dim=8, rngs=nnx.Rngs(0))
  cache = PagedLatentCache.init(1, 8, 4, 32, 4, dtype=INT8, rope_dtype=jnp.float32, rope_align=1)
  assert mla.cache_bytes(8 * 4, 1, INT8) == cache.nbytes == 8 * 4 * (32 + 4 + 4 * 4)


@pytest.mark.parametrize("preset,kw", [
    ("llama", dict(num_layers=2)),
    # Sinks, a window of 3 on one layer of two, MoE with biases.
    ("gpt-oss", dict(num_layers=2, sliding_window=3, head_dim=8, moe_expert_dim=16,
                     num_kv_heads=2)),
])
def test_engine_on_an_int8_cache_equals_generate_on_one(preset, kw):
  """Continuous batching over an int8 paged cache, chunked prefills and a prefix cache, gives each
  request the greedy tokens ``generate(cache_dtype=int8)`` gives it alone over a contiguous int8
  cache: the same codes and scales, however the tokens were batched and chunked."""
  model = DecoderLM(get_config(preset, **SMALL).replace(**kw), rngs=nnx.Rngs(0))
  rng = np.random.default_rng(1)
  prompts = [rng.integers(1, 61, size=n).astype(np.int32) for n in (7, 2, 11, 5)]
  news = (5, 9, 1, 6)
  engine = Engine(model, max_batch=2, page_size=4, chunk=4, dtype=INT8, prefix_cache=True)
  ids = [engine.submit(p, n) for p, n in zip(prompts, news)]
  results = engine.run()
  for rid, p, n in zip(ids, prompts, news):
    np.testing.assert_array_equal(results[rid], generate(model, p[None], n, cache_dtype=INT8)[0])
