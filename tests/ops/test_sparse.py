"""DSA formulas: indexer scores vs a direct loop, top-K, sparse attention vs dense, MLA, KL loss."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.ops.attention import attention_weights, dot_product_attention
from jaxattn.ops.hadamard import hadamard_transform
from jaxattn.ops import sparse as sparse_mod
from jaxattn.ops.mla import mla_attention
from jaxattn.ops.sparse import (indexer_kl_loss, indexer_scores, indices_to_mask,
                                sparse_attention, sparse_mla_attention, topk_indices)

B, T, N, K, H = 2, 12, 4, 2, 8


def _qkv(seed=0, t=T, s=T):
  ks = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(ks[0], (B, t, N, H)), jax.random.normal(ks[1], (B, s, K, H)),
          jax.random.normal(ks[2], (B, s, K, H)))


def _indexer_inputs(seed=1, t=T, s=T, hi=3, d=16):
  ks = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(ks[0], (B, t, hi, d)), jax.random.normal(ks[1], (B, s, d)),
          jax.random.uniform(ks[2], (B, t, hi)) - 0.3)


def test_indexer_scores_direct_formula():
  q, k, w = _indexer_inputs()
  got = np.asarray(indexer_scores(q, k, w))
  qn, kn, wn = map(np.asarray, (q, k, w))
  for b in range(B):
    for t in range(T):
      for s in range(T):
        if s > t:
          assert got[b, t, s] == -np.inf
        else:
          ref = sum(wn[b, t, j] * max(0.0, float(qn[b, t, j] @ kn[b, s])) for j in range(3))
          np.testing.assert_allclose(got[b, t, s], ref, rtol=1e-5, atol=1e-5)


def test_indexer_decode_offset_and_lengths():
  q, k, w = _indexer_inputs()
  full = indexer_scores(q, k, w)
  # Query row 7 alone, as a decode step with 8 valid cache slots out of 12.
  step = indexer_scores(q[:, 7:8], k, w[:, 7:8], q_offset=7, kv_lengths=jnp.array([8, 8]))
  np.testing.assert_allclose(step, full[:, 7:8], rtol=1e-6)


def test_indexer_hadamard_invariance_and_quantized_close():
  q, k, w = _indexer_inputs(d=32)
  ref = indexer_scores(q, k, w)
  rot = indexer_scores(hadamard_transform(q), hadamard_transform(k), w)
  np.testing.assert_allclose(rot, ref, rtol=1e-4, atol=1e-4)
  for fmt in ("int8", "fp8"):
    got = indexer_scores(hadamard_transform(q), hadamard_transform(k), w, quant=fmt)
    fin = np.isfinite(np.asarray(ref))
    np.testing.assert_array_equal(np.isfinite(np.asarray(got)), fin)
    err = np.abs(np.asarray(got)[fin] - np.asarray(ref)[fin])
    assert err.max() < 0.1 * np.abs(np.asarray(ref))[fin].max(), fmt


def test_topk_basic_and_padding():
  scores = jnp.array([[[0.1, -jnp.inf, -jnp.inf, -jnp.inf],
                       [0.5, 0.9, -jnp.inf, -jnp.inf],
                       [0.3, 0.0, 0.8, -jnp.inf]]])
  idx = topk_indices(scores, 2)
  np.testing.assert_array_equal(idx, [[[0, -1], [1, 0], [2, 0]]])
  idx6 = topk_indices(scores, 6)  # k > S: everything available, padded with -1
  assert idx6.shape == (1, 3, 6)
  np.testing.assert_array_equal(idx6[0, 2], [2, 0, 1, -1, -1, -1])


def test_seed_example_selects_cat_and_mat():
  # "The cat sat on a mat near me": position 8 ("me") selects 2 and 6 (scores 0.8, 0.9).
  row = jnp.array([0.1, 0.8, 0.0, 0.2, 0.05, 0.9, 0.3, 0.1])[None, None]  # positions 1..8
  idx = topk_indices(row, 2) + 1
  assert sorted(np.asarray(idx)[0, 0].tolist()) == [2, 6]


@pytest.mark.parametrize("k", [T, T + 5])
def test_k_at_least_n_equals_dense_causal(k):
  q, kk, v = _qkv()
  qi, ki, w = _indexer_inputs()
  idx = topk_indices(indexer_scores(qi, ki, w), k)
  got = sparse_attention(q, kk, v, idx)
  ref = dot_product_attention(q, kk, v, is_causal=True, implementation="xla")
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_small_k_equals_dense_under_selection_mask():
  q, kk, v = _qkv(3)
  qi, ki, w = _indexer_inputs(4)
  idx = topk_indices(indexer_scores(qi, ki, w), 4)
  mask = indices_to_mask(idx, T)
  assert int(mask.sum(-1).max()) == 4
  got = sparse_attention(q, kk, v, idx)
  ref = dot_product_attention(q, kk, v, mask=mask, implementation="xla")
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
  # Gradients through the gather equal the dense masked ones.
  f = lambda fn: jax.grad(lambda q_, k_, v_: jnp.sum(jnp.sin(fn(q_, k_, v_))), (0, 1, 2))(q, kk, v)
  g_sp = f(lambda a, b, c: sparse_attention(a, b, c, idx))
  g_de = f(lambda a, b, c: dot_product_attention(a, b, c, mask=mask, implementation="xla"))
  for a, b in zip(g_sp, g_de):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_decode_row_matches_prefill_and_empty_row_is_zero():
  q, kk, v = _qkv(5)
  qi, ki, w = _indexer_inputs(6)
  idx = topk_indices(indexer_scores(qi, ki, w), 3)
  full = sparse_attention(q, kk, v, idx)
  step = topk_indices(indexer_scores(qi[:, 9:10], ki, w[:, 9:10], q_offset=9,
                                     kv_lengths=jnp.array([10, 10])), 3)
  np.testing.assert_array_equal(step, idx[:, 9:10])
  np.testing.assert_allclose(sparse_attention(q[:, 9:10], kk, v, step), full[:, 9:10], atol=1e-6)
  none = -jnp.ones((B, T, 3), jnp.int32)
  np.testing.assert_array_equal(sparse_attention(q, kk, v, none), 0.0)


def test_sparse_mla_matches_masked_mla():
  ks = jax.random.split(jax.random.key(7), 6)
  c, p, r, hv, s = 16, 8, 4, 6, T
  q_nope = jax.random.normal(ks[0], (B, T, N, p))
  q_rope = jax.random.normal(ks[1], (B, T, N, r))
  c_kv = jax.random.normal(ks[2], (B, s, c))
  k_rope = jax.random.normal(ks[3], (B, s, r))
  w_uk = jax.random.normal(ks[4], (c, N, p)) * 0.3
  w_uv = jax.random.normal(ks[5], (c, N, hv)) * 0.3
  qi, ki, w = _indexer_inputs(8)
  idx = topk_indices(indexer_scores(qi, ki, w), 5)
  got = sparse_mla_attention(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, idx)
  ref = mla_attention(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, indices_to_mask(idx, s),
                      mode="naive", implementation="xla")
  np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


def test_kl_loss_zero_when_matched_and_gradient_only_to_indexer():
  q, kk, _ = _qkv(9)
  probs = attention_weights(q, kk, is_causal=True)                # [B, N, T, S]
  target = jnp.sum(probs, axis=1) / N
  causal = jnp.tril(jnp.ones((T, T), bool))[None].repeat(B, 0)
  scores = jnp.where(causal, jnp.log(jnp.where(causal, target, 1.0)), -jnp.inf)
  assert float(indexer_kl_loss(probs, scores)) == pytest.approx(0.0, abs=1e-5)
  qi, ki, w = _indexer_inputs(10)
  sc = indexer_scores(qi, ki, w)
  loss = indexer_kl_loss(probs, sc)
  # Direct KL per row.
  p, s_ = np.asarray(target), np.asarray(sc)
  ref = 0.0
  for b in range(B):
    for t in range(T):
      lq = s_[b, t, :t + 1] - np.log(np.sum(np.exp(s_[b, t, :t + 1] - s_[b, t, :t + 1].max()))) \
          - s_[b, t, :t + 1].max()
      pt = p[b, t, :t + 1] / p[b, t, :t + 1].sum()
      ref += np.sum(pt * (np.log(pt) - lq))
  assert float(loss) == pytest.approx(ref / (B * T), rel=1e-4)
  g_attn = jax.grad(lambda a: indexer_kl_loss(a, sc))(probs)
  np.testing.assert_array_equal(g_attn, 0.0)                       # stop-gradient on the target
  g_sc = jax.grad(lambda x: indexer_kl_loss(probs, x))(sc)
  assert float(jnp.abs(g_sc).max()) > 0
  # Sparse stage: restricted to the selected set.
  idx = topk_indices(sc, 3)
  sel = indices_to_mask(idx, T)[:, 0]
  assert float(indexer_kl_loss(probs, sc, sel)) >= 0.0


def test_errors():
  q, kk, v = _qkv()
  qi, ki, w = _indexer_inputs()
  sc = indexer_scores(qi, ki, w)
  for bad in (0, -3, 2.0):
    with pytest.raises(ValueError, match="`k`"):
      topk_indices(sc, bad)
  with pytest.raises(ValueError, match="k_index"):
    indexer_scores(qi, ki[..., :8], w)
  with pytest.raises(ValueError, match="weights"):
    indexer_scores(qi, ki, w[..., :2])
  with pytest.raises(ValueError, match="indices"):
    sparse_attention(q, kk, v, jnp.zeros((B, T + 1, 2), jnp.int32))
  with pytest.raises(ValueError, match="value"):
    sparse_attention(q, kk, v[:, :5], jnp.zeros((B, T, 2), jnp.int32))
  idx = jnp.zeros((B, T, 2), jnp.int32)
  with pytest.raises(ValueError, match="`scale` must be a Python number .* got a traced value"):
    jax.jit(lambda s: sparse_attention(q, kk, v, idx, scale=s))(0.3)   # (an error about hashing)
  np.testing.assert_array_equal(sparse_attention(q, kk, v, idx, scale=jnp.float32(0.5)),
                                sparse_attention(q, kk, v, idx, scale=0.5))  # a concrete array
  with pytest.raises(ValueError, match="index_scores"):
    indexer_kl_loss(jnp.ones((B, N, T, T)), jnp.ones((B, T, T + 1)))
  with pytest.raises(ValueError, match="quant"):
    indexer_scores(qi, ki, w, quant="int4")
  for bad in (0.0, -1.0, float("inf")):   # as dot_product_attention refuses them
    with pytest.raises(ValueError, match="`scale` must be a positive finite float"):
      sparse_attention(q, kk, v, jnp.zeros((B, T, 2), jnp.int32), scale=bad)


def _sparse_case(b, t, s, n, kh, h, hv, k, dtype, seed):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (b, t, n, h)).astype(dtype)
  key = jax.random.normal(ks[1], (b, s, kh, h)).astype(dtype)
  v = jax.random.normal(ks[2], (b, s, kh, hv)).astype(dtype)
  idx = jax.random.randint(ks[3], (b, t, k), -3, s)
  return q, key, v, jnp.where(idx < 0, -1, idx).at[0, 0].set(-1)   # holes, an empty row


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_chunked_backward_equals_reference_gradient(dtype, monkeypatch):
  """``sparse_attention_vjp`` (the kernels' backward: query chunks, scatter-added row gradients)
  equals the autodiff of the gather reference; chunks of 2 rows over T = 5 (a padded last chunk),
  GQA, repeated positions within a row, holes and an empty row."""
  monkeypatch.setattr(sparse_mod, "BACKWARD_CHUNK_ELEMENTS", 2 * 2 * 6 * 2 * (8 + 4))
  q, key, v, idx = _sparse_case(2, 5, 9, 4, 2, 8, 4, 6, dtype, 3)
  d_out = jax.random.normal(jax.random.key(4), (2, 5, 4, 4)).astype(dtype)
  _, vjp = jax.vjp(lambda q, k, v: sparse_attention(q, k, v, idx, implementation="xla"), q, key, v)
  want = vjp(d_out)
  got = sparse_mod.sparse_attention_vjp(q, key, v, idx, 0.3535533905932738, d_out)
  tol = 1e-5 if dtype == jnp.float32 else 3e-2
  for g, w in zip(got, want):
    assert g.dtype == w.dtype == dtype
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=tol,
                               atol=tol)
  assert float(jnp.abs(got[1].astype(jnp.float32)).sum()) > 0


def test_chunked_backward_scratch_does_not_grow_with_queries():
  """The backward pass of the kernels holds one chunk of gathered rows: its compiled scratch is
  about the same at T = 64 and T = 1024 (cache fixed), while differentiating the gather reference
  holds all ``T * k`` gathered rows."""
  def scratch(fn, t):
    q, key, v, idx = _sparse_case(1, t, 128, 4, 1, 32, 32, 64, jnp.float32, 0)
    d = jnp.ones((1, t, 4, 32))
    return jax.jit(fn).lower(q, key, v, idx, d).compile().memory_analysis().temp_size_in_bytes

  def chunked(q, k, v, i, d):
    return sparse_mod.sparse_attention_vjp(q, k, v, i, 0.2, d)

  def reference(q, k, v, i, d):
    return jax.vjp(lambda *a: sparse_mod._sparse_attention_xla(*a, i, 0.2), q, k, v)[1](d)

  old = sparse_mod.BACKWARD_CHUNK_ELEMENTS
  sparse_mod.BACKWARD_CHUNK_ELEMENTS = 1 << 17                       # chunks of 16 rows
  try:
    small, large = scratch(chunked, 64), scratch(chunked, 1024)
  finally:
    sparse_mod.BACKWARD_CHUNK_ELEMENTS = old
  ref_small, ref_large = scratch(reference, 64), scratch(reference, 1024)
  assert ref_large > 8 * ref_small                                   # grows with T
  assert large < 2 * small + (1 << 20), (small, large)               # does not


@pytest.mark.parametrize("impl", ["xla", "cpu", "pallas_tpu"])
def test_unselected_rows_cannot_poison_outputs_or_gradients(impl):
  """A slot with -1 gathered row 0 and only masked its logit: an inf in that (unselected) row gave
  NaN outputs on the XLA path and NaN dq / dk on every path (their backward is shared)."""
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((1, 4, 2, 8)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((1, 6, 1, 8)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((1, 6, 1, 8)), jnp.float32)
  idx = jnp.array([[[1, -1], [2, 3], [-1, -1], [4, 5]]], jnp.int32)   # row 0 never selected
  k_bad, v_bad = k.at[0, 0].set(jnp.inf), v.at[0, 0].set(jnp.nan)

  def loss(q, k, v):
    return jnp.sum(sparse_attention(q, k, v, idx, implementation=impl) ** 2)

  out = sparse_attention(q, k_bad, v_bad, idx, implementation=impl)
  np.testing.assert_allclose(out, sparse_attention(q, k, v, idx, implementation=impl), atol=1e-6)
  np.testing.assert_array_equal(out[0, 2], 0.0)                  # nothing selected: zeros
  got = jax.grad(loss, argnums=(0, 1, 2))(q, k_bad, v_bad)
  want = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  for g, w in zip(got, want):   # the unselected row gets no gradient either way
    np.testing.assert_allclose(g, w, atol=1e-5)


def test_bad_offsets_and_empty_selections_are_refused():
  q = jnp.ones((2, 2, 2, 8))
  k = jnp.ones((2, 5, 8))
  w = jnp.ones((2, 2, 2))
  for fn in (indexer_scores, lambda *a, **kw: sparse_mod.indexer_topk(*a, 2, **kw)):
    with pytest.raises(ValueError, match="`q_offset` must be one integer"):
      fn(q, k, w, q_offset=jnp.array([0, 3]))
    # kv_lengths get dot_product_attention's check (a wrong shape failed deep inside; floats
    # were truncated)
    for bad in (jnp.array([1, 2, 3]), 3, jnp.array([2.9, 3.9])):
      with pytest.raises(ValueError, match=r"`kv_lengths` must be \[B\] = \(2,\) integers"):
        fn(q, k, w, kv_lengths=bad)
  # NumPy ints are ints (the default `candidates` computed from one was refused)
  for impl in ("xla", "cpu"):
    np.testing.assert_array_equal(
        sparse_mod.indexer_topk(q, k, w, np.int64(2), block_size=np.int64(8),
                                implementation=impl),
        sparse_mod.indexer_topk(q, k, w, 2, block_size=8, implementation=impl))
    with pytest.raises(ValueError, match="`q_offset` must be one integer"):
      fn(q, k, w, q_offset=1.5)   # one check with dot_product_attention's: integers only
  for impl in ("xla", "cpu", "pallas_tpu"):
    with pytest.raises(ValueError, match=r"k>=1"):
      sparse_attention(jnp.ones((1, 4, 2, 8)), jnp.ones((1, 4, 1, 8)), jnp.ones((1, 4, 1, 8)),
                       jnp.zeros((1, 4, 0), jnp.int32), implementation=impl)


def test_tpu_kernel_under_x64():
  """With jax_enable_x64 the kernel's loop index is int64: it crashed in lax.rem."""
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((1, 3, 2, 8)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((1, 5, 1, 8)), jnp.float32)
  idx = jnp.array([[[0, 1], [2, -1], [3, 4]]], jnp.int32)
  want = sparse_attention(q, k, k, idx, implementation="xla")
  with jax.enable_x64(True):
    got = sparse_attention(q, k, k, idx, implementation="pallas_tpu")
  np.testing.assert_allclose(got, want, atol=1e-5)
