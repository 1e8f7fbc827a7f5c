"""The quantized contiguous latent cache (``LatentCache.init(dtype=int8 | float8_e4m3fn)``): the
update / ``c_kv`` round trip within the quantization step; ``cache_mla_decode`` over the codes
equal to ``paged_mla_decode`` (XLA) on the dequantized float cache; the TPU kernel (interpreted,
race detection on; under a mesh) equal to XLA on the same codes; the MLA module's prefill + decode
with an int8 cache close to the float cache, its kernel route equal to its XLA route; DSA (dense
and sparse) on an FP8 cache; ``generate(cache_dtype=int8)`` on tiny DeepSeek-V3 / V3.2 models
giving the serving engine's greedy tokens over an int8 paged cache; ``cache_bytes``; the
errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxattn import sharding
from jaxattn.configs import get_config
from jaxattn.dsa_cache import DSACache
from jaxattn.generation import generate
from jaxattn.mla_cache import LatentCache
from jaxattn.nn.dsa import DSA
from jaxattn.nn.mla import MLA
from jaxattn.nn.model import DecoderLM
from jaxattn.ops.decode import cache_mla_decode, paged_mla_decode
from jaxattn.ops.quantization import quantize_kv
from jaxattn.serving import Engine
from jaxattn.testing import prefill_then_decode, random_module
from tests.kernels.test_mla_kv_quant import D, _rel, _x  # the same inputs and error measure

C, R, S, SCALE = 16, 4, 32, 0.25
LENGTHS = (9, 0, 32)                          # ragged, one empty sequence, one full cache
QUANT = (jnp.int8, jnp.float8_e4m3fn)


def rows(b, t, seed=0):
  """Latent rows with a spread of magnitudes per token, and rotated keys ``[B, T, C|R]``."""
  rng = np.random.default_rng(seed)
  c_kv = rng.standard_normal((b, t, C)) * rng.uniform(0.1, 4.0, (b, t, 1))
  return (jnp.asarray(c_kv, jnp.float32), jnp.asarray(rng.standard_normal((b, t, R)),
                                                       jnp.float32))


def filled(dtype, b=len(LENGTHS), t=S, seed=0, **kw):
  """A cache of ``S`` slots written in two updates (all ``t`` positions)."""
  cache = LatentCache.init(b, S, C, R, dtype, rope_align=1, length_align=1, **kw)
  c_kv, k_rope = rows(b, t, seed)
  return cache.update(c_kv[:, :5], k_rope[:, :5]).update(c_kv[:, 5:], k_rope[:, 5:]), c_kv, k_rope


def queries(t, n=3, seed=1):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.standard_normal((len(LENGTHS), t, n, C)), jnp.float32),
          jnp.asarray(rng.standard_normal((len(LENGTHS), t, n, R)), jnp.float32))


@pytest.mark.parametrize("dtype", QUANT)
def test_update_and_c_kv_round_trip(dtype):
  """``update`` stores ``quantize_kv``'s codes and scales (exactly); ``c_kv`` is codes * scale,
  within the quantization step of the latents (int8: ``amax / 254`` per token; e4m3: 2^-4
  relative, plus the subnormal step ``2^-9 * amax / 448``); ``k_rope`` exact in its float dtype;
  ``nbytes`` counts codes, scales and k^R."""
  cache, c_kv, k_rope = filled(dtype)
  assert cache.quantized and int(cache.index) == S
  assert cache.kv.dtype == dtype and cache.kv.shape == (3, S, C)
  assert cache.k_rope_buf.dtype == jnp.float32 and cache.c_kv_scale.shape == (3, 1, S)
  codes, scale = quantize_kv(c_kv, dtype)
  np.testing.assert_array_equal(np.asarray(cache.kv, np.float32), np.asarray(codes, np.float32))
  np.testing.assert_array_equal(cache.c_kv_scale[:, 0], scale)
  got, x = np.asarray(cache.c_kv), np.asarray(c_kv)
  assert got.dtype == np.float32
  amax = np.abs(x).max(-1, keepdims=True)
  bound = (amax / 254 if dtype == jnp.int8 else np.abs(x) * 2.0 ** -4 + amax / 448 * 2.0 ** -9)
  assert (np.abs(got - x) <= bound * (1 + 1e-5)).all()
  assert np.abs(got - x).max() > 0
  np.testing.assert_array_equal(cache.k_rope, k_rope)
  assert cache.nbytes == 3 * S * (C + 4 + R * 4)
  # A bf16 k^R and a padded one: the pad columns stay zero.
  padded = LatentCache.init(3, S, C, R, dtype, rope_align=8, rope_dtype=jnp.bfloat16)
  padded = padded.update(c_kv[:, :2], k_rope[:, :2])
  assert padded.k_rope_buf.shape == (3, S, 8) and padded.k_rope_buf.dtype == jnp.bfloat16
  np.testing.assert_array_equal(padded.k_rope_buf[..., R:], 0.0)
  assert padded.k_rope.shape == (3, S, R)
  # The unquantized form is unchanged: one fused buffer.
  flat = LatentCache.init(3, S, C, R, jnp.float32, rope_align=8)
  assert not flat.quantized and flat.kv.shape == (3, S, C + 8) and flat.k_rope_buf is None


@pytest.mark.parametrize("dtype", QUANT)
@pytest.mark.parametrize("t", [1, 3])
def test_cache_mla_decode_equals_paged_xla_on_dequantized(dtype, t):
  """``cache_mla_decode`` over the codes (``k_rope`` and ``c_kv_scale`` given) == XLA's
  ``paged_mla_decode`` over the dequantized float cache (one page per sequence)."""
  cache, _, _ = filled(dtype)
  ql, qr = queries(t)
  lengths = jnp.asarray(LENGTHS, jnp.int32)
  got = cache_mla_decode(ql, qr, cache.kv, lengths, scale=SCALE, implementation="xla",
                         k_rope=cache.k_rope_buf, c_kv_scale=cache.c_kv_scale)
  table = jnp.arange(3, dtype=jnp.int32)[:, None]
  ref = paged_mla_decode(ql, qr, cache.c_kv, cache.k_rope, table, lengths, scale=SCALE,
                         implementation="xla")
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(got[1], 0.0)                         # length 0
  # 3-D queries (one token) too.
  got1 = cache_mla_decode(ql[:, 0], qr[:, 0], cache.kv, lengths, scale=SCALE,
                          implementation="xla", k_rope=cache.k_rope_buf,
                          c_kv_scale=cache.c_kv_scale)
  ref1 = paged_mla_decode(ql[:, 0], qr[:, 0], cache.c_kv, cache.k_rope, table, lengths,
                          scale=SCALE, implementation="xla")
  np.testing.assert_allclose(got1, ref1, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", QUANT)
def test_tpu_kernel_equals_xla_on_the_same_codes(dtype, race_states):
  """The dense TPU kernel (interpreted, race detection on, split KV) over the quantized buffers
  read as pages of themselves (48 slots: pages of 16, three per sequence) == the XLA path; k^R
  padded to 8 columns, NaN in the never-written slots of every float buffer."""
  cache = LatentCache.init(3, 48, C, R, dtype, rope_align=8, length_align=1)
  nan = dict(kv=jnp.full_like(cache.kv, jnp.nan) if dtype != jnp.int8 else cache.kv,
             k_rope_buf=jnp.full_like(cache.k_rope_buf, jnp.nan),
             c_kv_scale=jnp.full_like(cache.c_kv_scale, jnp.nan))
  cache = LatentCache(index=cache.index, kv_lora_rank=C, rope_dim=R, **nan)
  c_kv, k_rope = rows(3, 40)
  cache = cache.update(c_kv, k_rope)                                  # slots 40.. stay NaN
  lengths = jnp.asarray((9, 0, 40), jnp.int32)
  ql, qr = queries(2, n=4)
  args = (ql, qr, cache.kv, lengths)
  kw = dict(scale=SCALE, k_rope=cache.k_rope_buf, c_kv_scale=cache.c_kv_scale)
  ref = cache_mla_decode(*args, implementation="xla", **kw)
  got = cache_mla_decode(*args, implementation="pallas_tpu", num_splits=2, **kw,
                         interpret=pltpu.InterpretParams(detect_races=True,
                                                         num_cores_or_threads=2))
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
  assert np.isfinite(np.asarray(got)).all()
  assert race_states and not any(st.races_found for st in race_states)


def test_tpu_kernel_sharded_under_mesh():
  """On a simulated 2 x 4 mesh, the codes, k^R and scales split over batch (``"data"``) and the
  query heads over ``"tensor"``: the kernel (interpreted) == the XLA path unsharded."""
  cache = LatentCache.init(2, S, C, R, jnp.int8, rope_align=1, length_align=1)
  c_kv, k_rope = rows(2, 20)
  cache = cache.update(c_kv, k_rope)
  lens = jnp.asarray((9, 20), jnp.int32)
  rng = np.random.default_rng(3)
  ql = jnp.asarray(rng.standard_normal((2, 8, C)), jnp.float32)        # [B, N, C]: one token
  qr = jnp.asarray(rng.standard_normal((2, 8, R)), jnp.float32)
  kw = dict(scale=SCALE)
  want = cache_mla_decode(ql, qr, cache.kv, lens, implementation="xla", k_rope=cache.k_rope_buf,
                          c_kv_scale=cache.c_kv_scale, **kw)
  mesh = sharding.make_mesh({"data": 2, "tensor": 4})
  with jax.set_mesh(mesh):
    heads = NamedSharding(mesh, P("data", "tensor", None))
    buf = NamedSharding(mesh, P("data", None, None))
    got = jax.jit(lambda ql, qr, kv, kr, sc, n: cache_mla_decode(
        ql, qr, kv, n, implementation="pallas_tpu", k_rope=kr, c_kv_scale=sc, **kw))(
        jax.device_put(ql, heads), jax.device_put(qr, heads),
        *(jax.device_put(x, buf) for x in (cache.kv, cache.k_rope_buf, cache.c_kv_scale)), lens)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# -- the modules ---------------------------------------------------------------------------------

MLA_DIMS = dict(kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)


@nnx.jit(static_argnames=("implementation", "attention_mode"))
def _step(m, cache, xt, implementation=None, attention_mode=None):
  kw = {} if attention_mode is None else dict(attention_mode=attention_mode)
  return m(xt, cache=cache, implementation=implementation, **kw)


def test_mla_int8_contiguous_cache_close_to_float_and_kernel_route():
  """Prefill 4 tokens, decode 3, with an int8 contiguous cache and a fp32 one.  Per-token absmax
  INT8 rounds each latent entry by at most ``amax / 254``; the RMS-normed latents' amax is ~2-3x
  their RMS at C = 32, so the rounding's RMS (uniform) is ~``amax / 254 / sqrt(3)``, about 0.5% of
  the latents', entering the logits and the output linearly: a relative error ~1%, bounded here by
  3e-2 (measured: 6.9e-3, as the paged cache on the same layer).  The TPU kernel route (16 slots,
  absorbed mode, interpreted) == the XLA route on the same cache."""
  module = random_module(lambda: MLA(D, 4, mode="absorbed", rngs=nnx.Rngs(0), **MLA_DIMS))
  x = _x(7)

  def run(dtype, implementation=None):
    cache = module.init_cache(2, 16, dtype=dtype)
    return prefill_then_decode(lambda m, c, xt: _step(m, c, xt, implementation), module, cache,
                               x, 4)

  ref, _ = run(jnp.float32)
  got, cache = run(jnp.int8)
  assert cache.quantized and cache.kv.dtype == jnp.int8
  assert cache.k_rope_buf.dtype == jnp.float32                        # the compute dtype
  assert np.isfinite(np.asarray(got)).all()
  assert 0 < _rel(got, ref) < 3e-2
  assert module._decode_kernel(1, "absorbed", None, "pallas_tpu", cache)
  kern, kcache = run(jnp.int8, "pallas_tpu")                          # decode steps: the kernel
  np.testing.assert_allclose(kern, got, rtol=2e-5, atol=2e-5)
  np.testing.assert_array_equal(kcache.kv, cache.kv)
  y_xla, _ = _step(module, cache, x[:, :1], implementation="xla")
  y_tpu, _ = _step(module, cache, x[:, :1], implementation="pallas_tpu")
  np.testing.assert_allclose(y_tpu, y_xla, rtol=2e-5, atol=2e-5)
  # naive mode reads the dequantized latents: the same attention as absorbed
  naive, _ = module(x[:, :1], cache=cache, mode="naive")
  np.testing.assert_allclose(naive, y_xla, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attention_mode", ["dense", "sparse"])
def test_dsa_fp8_contiguous_cache_close_to_float(attention_mode):
  """A DSA layer with an FP8 contiguous latent cache (indexer keys int8, their own format): the
  indexer does not read the latents, so the selection is the float cache's and the output is
  the float cache's up to the latents' rounding (e4m3: at most 2^-4 relative per entry, ~2% RMS;
  measured 2.0e-2 dense, 2.1e-2 sparse; bounded by 1e-1 as the paged FP8 test)."""
  kw = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
            q_lora_rank=24)
  module = random_module(lambda: DSA(D, 4, index_num_heads=3, index_head_dim=16,
                                     index_rope_dim=4, index_topk=3, index_quant="int8",
                                     attention_mode=attention_mode, rngs=nnx.Rngs(0), **kw))
  x = _x(6, seed=2)

  def run(dtype):
    return prefill_then_decode(_step, module, module.init_cache(2, 8, dtype=dtype), x, 3)

  ref, _ = run(jnp.float32)
  got, cache = run(jnp.float8_e4m3fn)
  assert isinstance(cache, DSACache) and cache.quantized
  assert cache.latent.kv.dtype == jnp.float8_e4m3fn and cache.index_keys.dtype == jnp.int8
  assert np.isfinite(np.asarray(got)).all()
  assert 0 < _rel(got, ref) < 1e-1
  assert cache.nbytes == 2 * 8 * (16 + 4 + 4 * 4) + cache.index_keys.nbytes \
      + cache.index_scales.nbytes


SMALL = dict(embed_dim=32, mlp_dim=64, max_seq_len=64, vocab_size=61)
TINY = dict(num_layers=2, first_k_dense=1, moe_expert_dim=16, kv_lora_rank=16, q_lora_rank=24,
            qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
DSA_TINY = dict(index_head_dim=8, index_rope_dim=4, index_topk=3)


@pytest.mark.parametrize("preset,kw", [("deepseek-v3", TINY),
                                       ("deepseek-v3.2", {**TINY, **DSA_TINY})])
def test_generate_int8_latent_cache_equals_engine(preset, kw):
  """``generate(cache_dtype=int8)`` over contiguous int8 latent caches gives each prompt the
  greedy tokens of the serving engine over an int8 paged cache (chunked prefills): the same
  codes and scales per token, however the tokens were batched and chunked."""
  model = DecoderLM(get_config(preset, **SMALL).replace(**kw), rngs=nnx.Rngs(0))
  rng = np.random.default_rng(1)
  prompts = [rng.integers(1, 61, size=n).astype(np.int32) for n in (7, 2, 5)]
  news = (5, 6, 3)
  engine = Engine(model, max_batch=2, page_size=4, chunk=4, dtype=jnp.int8)
  ids = [engine.submit(p, n) for p, n in zip(prompts, news)]
  results = engine.run()
  for rid, p, n in zip(ids, prompts, news):
    np.testing.assert_array_equal(results[rid],
                                  generate(model, p[None], n, cache_dtype=jnp.int8)[0])
  cache = model.init_cache(1, 8, jnp.int8)
  assert any(x.dtype == jnp.int8 for x in jax.tree.leaves(cache))


def test_cache_bytes_and_errors():
  """``MLA.cache_bytes`` of a quantized dtype == the contiguous cache's ``nbytes`` (no padding);
  a non-float, non-quantized dtype, a quantized ``rope_dtype``, a ``rope_dtype`` apart from a
  float ``dtype`` and mismatched decode arguments raise."""
  mla = nnx.eval_shape(lambda: MLA(D, 2, rngs=nnx.Rngs(0), **MLA_DIMS))
  for dtype in QUANT:
    cache = LatentCache.init(2, 8, 32, 4, dtype, rope_align=1, length_align=1)
    assert mla.cache_bytes(8, 2, dtype) == cache.nbytes
  with pytest.raises(ValueError, match=r"LatentCache.init: `dtype` must be a float dtype, or int8 / float8_e4m3fn"):
    mla.init_cache(2, 8, dtype=jnp.int32)
  with pytest.raises(ValueError, match="`rope_dtype` must be a float dtype"):
    LatentCache.init(2, 8, C, R, jnp.int8, rope_dtype=jnp.int8)
  with pytest.raises(ValueError, match="`rope_dtype` .* differs from `dtype`"):
    LatentCache.init(2, 8, C, R, jnp.float32, rope_dtype=jnp.bfloat16)
  cache, _, _ = filled(jnp.int8)
  ql, qr = queries(1)
  lengths = jnp.asarray(LENGTHS, jnp.int32)
  with pytest.raises(ValueError, match="`c_kv_scale` .* comes with `k_rope`"):
    cache_mla_decode(ql, qr, cache.kv, lengths, scale=SCALE, c_kv_scale=cache.c_kv_scale)
  with pytest.raises(ValueError, match="`c_kv_pool` must be a floating-point array, or int8"):
    cache_mla_decode(ql, qr, cache.kv, lengths, scale=SCALE, k_rope=cache.k_rope_buf,
                     implementation="xla")
  with pytest.raises(ValueError, match=r"`c_kv_scale` must be float32 \[B, 1, S\]"):
    cache_mla_decode(ql, qr, cache.kv, lengths, scale=SCALE, k_rope=cache.k_rope_buf,
                     c_kv_scale=cache.c_kv_scale[:, :, :8])
  with pytest.raises(ValueError, match=r"`k_rope` must be \[B, S, R_p\]"):
    cache_mla_decode(ql, qr, cache.kv, lengths, scale=SCALE, k_rope=cache.k_rope_buf[:, :8],
                     c_kv_scale=cache.c_kv_scale)
