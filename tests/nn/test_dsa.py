"""DSA module: indexer formula, dense/sparse modes, decode == prefill, quantized cache, training."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxattn.dsa_cache import DSACache
from jaxattn.nn.dsa import DSA, LightningIndexer
from jaxattn.ops.rope import apply_rope
from jaxattn.ops.sparse import indices_to_mask

D, N, T = 32, 4, 10
MLA_KW = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
              q_lora_rank=24)


def _dsa(topk=4, quant=None, mode="sparse", seed=0):
  return DSA(D, N, index_num_heads=3, index_head_dim=16, index_rope_dim=4, index_topk=topk,
             index_quant=quant, attention_mode=mode, rngs=nnx.Rngs(seed), **MLA_KW)


def _x(seed=1, b=2, t=T):
  return jax.random.normal(jax.random.key(seed), (b, t, D))


def test_indexer_matches_direct_formula():
  ix = LightningIndexer(D, 24, num_heads=3, head_dim=16, rope_dim=4, rotate=True,
                        rngs=nnx.Rngs(0))
  x, c = _x(), jax.random.normal(jax.random.key(2), (2, T, 24))
  got = ix(x, c)
  pos = jnp.arange(T)[None]
  q = apply_rope(jnp.einsum("btc,cje->btje", c, ix.wq.kernel[...]), pos, rotary_dim=4)
  k = jnp.einsum("btd,de->bte", x, ix.wk.kernel[...])
  k = (k - k.mean(-1, keepdims=True)) / jnp.sqrt(k.var(-1, keepdims=True) + 1e-6)
  k = apply_rope(k[:, :, None], pos, rotary_dim=4)[:, :, 0]
  w = jnp.einsum("btd,dj->btj", x, ix.weights_proj.kernel[...]) / jnp.sqrt(3 * 16)
  # Hadamard rotation leaves the scores of the unrotated formula unchanged.
  ref = jnp.einsum("btj,btjs->bts", w, jax.nn.relu(jnp.einsum("btje,bse->btjs", q, k)))
  causal = jnp.tril(jnp.ones((T, T), bool))
  np.testing.assert_allclose(got, jnp.where(causal, ref, -jnp.inf), rtol=1e-4, atol=1e-4)


def test_topk_at_least_t_equals_dense_mla():
  m = _dsa(topk=T)
  x = _x()
  np.testing.assert_allclose(m(x), m(x, attention_mode="dense"), rtol=1e-4, atol=1e-5)
  y_mla = super(DSA, m).__call__(x, mode="absorbed")              # plain MLA, same weights
  np.testing.assert_allclose(m(x), y_mla, rtol=1e-4, atol=1e-5)


def test_small_topk_equals_mla_under_selection_mask():
  m = _dsa(topk=3)
  x = _x()
  y, aux = m(x, return_aux=True)
  mask = indices_to_mask(aux["indices"], T)
  y_ref = super(DSA, m).__call__(x, mask=mask, mode="naive", implementation="xla")
  np.testing.assert_allclose(y, y_ref, rtol=1e-4, atol=1e-5)
  assert not np.allclose(y, m(x, attention_mode="dense"), atol=1e-3)


@pytest.mark.parametrize("quant", [None, "int8", "fp8"])
def test_decode_equals_prefill(quant):
  m = _dsa(topk=4, quant=quant)
  x = _x(3)
  full = m(x)
  cache = m.init_cache(2, 16)
  y0, cache = m(x[:, :4], cache=cache)
  ys = [y0]
  for i in range(4, T):
    yi, cache = m(x[:, i:i + 1], cache=cache)
    ys.append(yi)
  np.testing.assert_allclose(jnp.concatenate(ys, 1), full, rtol=1e-4, atol=1e-5)
  want = {None: jnp.float32, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn}[quant]
  assert cache.index_keys.dtype == want and int(cache.index) == T


def test_training_losses_and_gradients():
  m = _dsa(topk=4)
  x = _x(4)
  graphdef, params, rest = nnx.split(m, nnx.Param, ...)

  def losses(p, mode):
    mod = nnx.merge(graphdef, p, rest)
    y, aux = mod(x, attention_mode=mode, return_aux=True)
    return jnp.mean(y ** 2), aux["indexer_loss"]

  for mode in ("dense", "sparse"):
    # One compiled program: both losses and their gradients.
    lm, li, g_main, g_idx = jax.jit(lambda p: (
        *losses(p, mode), jax.grad(lambda p_: losses(p_, mode)[0])(p),
        jax.grad(lambda p_: losses(p_, mode)[1])(p)))(params)
    assert float(li) >= 0.0 and np.isfinite(float(lm))
    # The indexer loss trains the indexer only; the LM loss never reaches the indexer.
    assert float(jnp.abs(g_idx["indexer"]["wq"]["kernel"][...]).max()) > 0
    assert float(jnp.abs(g_idx["kv_down"]["kernel"][...]).max()) == 0
    assert float(jnp.abs(g_main["indexer"]["wq"]["kernel"][...]).max()) == 0
    assert float(jnp.abs(g_main["kv_down"]["kernel"][...]).max()) > 0


def test_errors():
  with pytest.raises(ValueError, match="index_topk"):
    _dsa(topk=0)
  with pytest.raises(ValueError, match="causal"):
    DSA(D, N, index_num_heads=2, index_head_dim=16, index_rope_dim=4, index_topk=2, causal=False,
        rngs=nnx.Rngs(0), **MLA_KW)
  with pytest.raises(ValueError, match="power of two"):
    DSA(D, N, index_num_heads=2, index_head_dim=12, index_rope_dim=4, index_topk=2,
        rngs=nnx.Rngs(0), **MLA_KW)
  with pytest.raises(ValueError, match="attention_mode"):
    _dsa()(_x(), attention_mode="block")
  # a prefill past the cache: the cache's own error (the indexer keys were written first, a
  # TypeError from dynamic_update_slice)
  m = _dsa()
  with pytest.raises(ValueError, match="exceed the cache capacity max_len=4"):
    m(_x(t=6), cache=m.init_cache(2, 4))
  with pytest.raises(ValueError, match="quant"):
    _dsa(quant="int4")
  with pytest.raises(ValueError, match="rope_base"):  # the indexer's own RoPE, at construction
    DSA(D, N, index_num_heads=2, index_head_dim=16, index_rope_dim=4, index_topk=2,
        rope_base=-1.0, rngs=nnx.Rngs(0), **MLA_KW)
  with pytest.raises(ValueError, match="cache"):
    _dsa()(_x(), cache=object())
  assert isinstance(_dsa().init_cache(1, 8), DSACache)


def test_streaming_selection_equals_full_scores_path():
  # Sparse mode without aux streams the selection (indexer_topk); with aux it takes top-K of the
  # full scores.  Same outputs and the same gradients to the main weights (decode == prefill on
  # the streaming path: test_decode_equals_prefill).
  m = _dsa(topk=3, quant="int8")
  x = _x(5, t=13)
  # (jitted: op by op, the two paths and their gradients compiled every small op: 19 s)
  y_stream = nnx.jit(lambda m, x: m(x))(m, x)
  y_full, _ = nnx.jit(lambda m, x: m(x, return_aux=True))(m, x)
  np.testing.assert_allclose(y_stream, y_full, rtol=1e-5, atol=1e-6)
  graphdef, params, rest = nnx.split(m, nnx.Param, ...)

  def lm_loss(p, aux):
    out = nnx.merge(graphdef, p, rest)(x, return_aux=aux)
    return jnp.mean((out[0] if aux else out) ** 2)

  g_stream = jax.jit(jax.grad(lambda p: lm_loss(p, False)))(params)
  g_full = jax.jit(jax.grad(lambda p: lm_loss(p, True)))(params)
  np.testing.assert_allclose(g_stream["kv_down"]["kernel"][...], g_full["kv_down"]["kernel"][...],
                             rtol=1e-4, atol=1e-6)
  assert float(jnp.abs(g_stream["kv_down"]["kernel"][...]).max()) > 0


@pytest.mark.parametrize("first_id", [1, 0])
@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_dsa_packed_segments_equal_separate_sequences(mode, first_id):
  """Two documents packed in one row (segment ids) give each document's own output; id 0 is a
  document like any other in both modes (sparse mode used to zero it as padding)."""
  dsa = DSA(32, 2, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, index_num_heads=2,
            index_head_dim=8, index_rope_dim=4, index_topk=3, attention_mode=mode,
            rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (1, 9, 32))
  seg = jnp.array([[0, 0, 0, 0, 0, 1, 1, 1, 1]]) + first_id
  pos = jnp.array([[0, 1, 2, 3, 4, 0, 1, 2, 3]])
  packed, aux = dsa(x, positions=pos, segment_ids=seg, return_aux=True)
  first = dsa(x[:, :5])
  second = dsa(x[:, 5:])
  np.testing.assert_allclose(packed[:, :5], first, atol=1e-5)
  np.testing.assert_allclose(packed[:, 5:], second, atol=1e-5)
  if mode == "sparse":  # no selected key crosses a document boundary
    idx = np.asarray(aux["indices"][0])
    for t in range(9):
      sel = idx[t][idx[t] >= 0]
      assert ((sel < 5) == (t < 5)).all() and (sel <= t).all()
  with pytest.raises(ValueError, match="segment_ids"):
    dsa(x, segment_ids=seg[:, :4])


@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu"])
def test_sparse_kernels_through_the_module(impl):
  """``implementation="pallas_tpu" | "pallas_gpu"`` reaches the top-K sparse kernels (interpreted
  here): the output and the main loss's gradients equal the XLA path's."""
  m = _dsa(topk=4)
  x = _x(5)
  graphdef, params, rest = nnx.split(m, nnx.Param, ...)

  def loss(p, impl):
    return jnp.mean(nnx.merge(graphdef, p, rest)(x, implementation=impl) ** 2)

  want, g_want = jax.value_and_grad(loss)(params, "xla")
  got, g_got = jax.value_and_grad(loss)(params, impl)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  assert "pallas_call" in str(jax.make_jaxpr(lambda p: loss(p, impl))(params))


@pytest.mark.parametrize("quant", [None, "int8", "fp8"])
def test_cache_bytes_count_the_indexer_keys(quant):
  """cache_bytes counted only the latent rows (MLA's); the cache also holds each token's indexer
  key and scales: it now equals the bytes init_cache allocates."""
  dsa = DSA(32, 2, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, index_num_heads=2,
            index_head_dim=16, index_rope_dim=4, index_topk=3, index_quant=quant,
            rngs=nnx.Rngs(0))
  cache = dsa.init_cache(3, 40, dtype=jnp.bfloat16)
  assert dsa.cache_bytes(40, batch=3, dtype=jnp.bfloat16) == cache.nbytes
