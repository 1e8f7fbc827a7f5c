"""Ragged chunks in the paged decode ops (``num_tokens``: continuous batching, where one sequence
prefills a chunk while others decode a token): each sequence's first ``num_tokens[b]`` queries are
its newest tokens, the rest padding with zero outputs.

The reference is the established ``T``-query contract applied to each sequence alone (its real
queries sliced out, ``T = num_tokens[b]``); the XLA path, the TPU kernels (interpret mode, race
detection) and the GPU kernels (interpret mode) must all match it, dense and sparse (DSA), fp32
and bf16."""

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jaxattn.ops.decode import align_queries, paged_attention, paged_mla_decode, unalign_queries
from jaxattn.paged_cache import PagedKVCache, PagedLatentCache
from jaxattn.testing import scrambled_paged_cache

PAGE, C, R, SCALE = 16, 16, 4, 0.25
RACES = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)
LENGTHS = (37, 3, 0, 50, 16)
NUM_TOKENS = (3, 1, 0, 4, 0)       # a chunk, a decode, an empty row, a full chunk, an idle row
T = 4


def kv_cache(lengths, dtype, kh=2, h=8, seed=0):
  """``lengths`` random tokens per sequence in scattered pages; empty slots NaN."""
  b, s = len(lengths), max(lengths)
  cache = scrambled_paged_cache(
      PagedKVCache.init(b, 24, PAGE, kh, h, h, max_pages_per_seq=4, dtype=dtype), seed)
  return cache.append(normal((b, s, kh, h), dtype, seed + 10), normal((b, s, kh, h), dtype,
                                                                      seed + 11),
                      np.asarray(lengths))


def latent_cache(lengths, dtype, seed=0):
  b, s = len(lengths), max(lengths)
  cache = scrambled_paged_cache(
      PagedLatentCache.init(b, 24, PAGE, C, R, max_pages_per_seq=4, dtype=dtype), seed)
  return cache.append(normal((b, s, C), dtype, seed + 10), normal((b, s, R), dtype, seed + 11),
                      num_tokens=np.asarray(lengths))


def normal(shape, dtype, seed):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def per_sequence(fn, b_size, num_tokens):
  """``[B, T, ...]`` assembled from ``fn(b, n)`` run on sequence ``b`` alone with its ``n`` real
  queries (zeros after them)."""
  rows = []
  for b in range(b_size):
    n = int(num_tokens[b])
    out = fn(b, n)                                     # [1, n, ...]
    pad = jnp.zeros((1, T - n) + out.shape[2:], out.dtype)
    rows.append(jnp.concatenate([out, pad], axis=1))
  return jnp.concatenate(rows)


def tol(dtype):
  return dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gqa_ragged_chunks(dtype):
  cache = kv_cache(LENGTHS, dtype)
  q = normal((len(LENGTHS), T, 4, 8), dtype, 1)
  nt = jnp.asarray(NUM_TOKENS, jnp.int32)

  def call(q, c, **kw):
    return paged_attention(q, c.key_pool, c.value_pool, c.page_table, c.lengths, **kw)

  def one(b, n):                   # sequence b alone, its n real queries: the T-query contract
    return paged_attention(q[b:b + 1, :n], cache.key_pool, cache.value_pool,
                           cache.page_table[b:b + 1], cache.lengths[b:b + 1],
                           implementation="xla")

  want = per_sequence(one, len(LENGTHS), NUM_TOKENS)
  got = {impl: call(q, cache, num_tokens=nt, implementation=impl, **kw) for impl, kw in [
      ("xla", {}), ("pallas_tpu", dict(num_splits=2, interpret=RACES)),
      ("pallas_gpu", dict(num_splits=2, interpret=True))]}
  for impl, out in got.items():
    assert out.shape == q.shape and out.dtype == dtype, impl
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                               err_msg=impl, **tol(dtype))
    for b, n in enumerate(NUM_TOKENS):
      np.testing.assert_array_equal(np.asarray(out[b, n:], np.float32), 0.0, err_msg=impl)


def test_full_num_tokens_is_the_plain_call():
  cache = kv_cache((37, 16), jnp.float32)
  q = normal((2, T, 4, 8), jnp.float32, 2)
  args = (q, cache.key_pool, cache.value_pool, cache.page_table, cache.lengths)
  for impl, kw in [("xla", {}), ("pallas_tpu", dict(interpret=True))]:
    np.testing.assert_allclose(
        paged_attention(*args, num_tokens=jnp.full((2,), T), implementation=impl, **kw),
        paged_attention(*args, implementation=impl, **kw), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_mla_dense_ragged_chunks(dtype):
  cache = latent_cache(LENGTHS, dtype)
  b = len(LENGTHS)
  ql, qr = normal((b, T, 4, C), dtype, 1), normal((b, T, 4, R), dtype, 2)
  nt = jnp.asarray(NUM_TOKENS, jnp.int32)

  def one(b, n):
    return paged_mla_decode(ql[b:b + 1, :n], qr[b:b + 1, :n], cache.c_kv_pool,
                            cache.k_rope_pool, cache.page_table[b:b + 1],
                            cache.lengths[b:b + 1], scale=SCALE, implementation="xla")

  want = per_sequence(one, b, NUM_TOKENS)
  for impl, kw in [("xla", {}), ("pallas_tpu", dict(num_splits=2, interpret=RACES)),
                   ("pallas_gpu", dict(num_splits=2, interpret=True))]:
    out = paged_mla_decode(ql, qr, cache.c_kv_pool, cache.k_rope_pool, cache.page_table,
                           cache.lengths, scale=SCALE, num_tokens=nt, implementation=impl, **kw)
    assert out.shape == ql.shape and out.dtype == dtype, impl
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                               err_msg=impl, **tol(dtype))


def test_mla_sparse_ragged_chunks():
  cache = latent_cache(LENGTHS, jnp.float32)
  b = len(LENGTHS)
  ql, qr = normal((b, T, 4, C), jnp.float32, 3), normal((b, T, 4, R), jnp.float32, 4)
  rng = np.random.default_rng(5)
  idx = jnp.asarray(rng.integers(-1, 52, size=(b, T, 3)), jnp.int32)
  nt = jnp.asarray(NUM_TOKENS, jnp.int32)

  def one(b, n):
    return paged_mla_decode(ql[b:b + 1, :n], qr[b:b + 1, :n], cache.c_kv_pool,
                            cache.k_rope_pool, cache.page_table[b:b + 1],
                            cache.lengths[b:b + 1], scale=SCALE, indices=idx[b:b + 1, :n],
                            implementation="xla")

  want = per_sequence(one, b, NUM_TOKENS)
  for impl, kw in [("xla", {}), ("pallas_tpu", dict(interpret=True)),
                   ("pallas_gpu", dict(interpret=True))]:
    out = paged_mla_decode(ql, qr, cache.c_kv_pool, cache.k_rope_pool, cache.page_table,
                           cache.lengths, scale=SCALE, indices=idx, num_tokens=nt,
                           implementation=impl, **kw)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5, err_msg=impl)


def test_align_and_unalign_are_inverse_shifts():
  x = jnp.arange(2 * 4 * 3).reshape(2, 4, 3) + 1
  nt = jnp.asarray([1, 3])
  a = align_queries(x, nt, fill=-1)
  np.testing.assert_array_equal(a[0, :, 0], [-1, -1, -1, 1])
  np.testing.assert_array_equal(a[1, :, 0], [-1, 13, 16, 19])
  back = unalign_queries(a, nt)
  np.testing.assert_array_equal(back[0], np.where(np.arange(4)[:, None] < 1, x[0], 0))
  np.testing.assert_array_equal(back[1], np.where(np.arange(4)[:, None] < 3, x[1], 0))


def test_num_tokens_past_the_lengths_is_refused():
  """The new tokens are counted in ``lengths``: more of them than a sequence holds would put its
  queries at negative positions (silent zeros)."""
  cache = kv_cache((2, 5), jnp.float32)
  q = normal((2, T, 4, 8), jnp.float32, 2)
  with pytest.raises(ValueError, match=r"`num_tokens` \[3 1\] exceeds `lengths` \[2 5\] "
                                       r"\(rows \[0\]\)"):
    paged_attention(q, cache.key_pool, cache.value_pool, cache.page_table, cache.lengths,
                    num_tokens=np.array([3, 1]))


@pytest.mark.parametrize("num_tokens,match", [
    (np.array([1, 2, 3]), r"`num_tokens` must be \[B=2\]"),
    (np.array([1.0, 2.0]), r"`num_tokens` must be an integer array"),
    (np.array([0, 5]), r"`num_tokens` must lie in \[0, T=4\]"),
    (np.array([-1, 2]), r"`num_tokens` must lie in \[0, T=4\]"),
    ([1, 2], r"`num_tokens` must be an integer array \[B=2\] or None, got list"),
])
def test_num_tokens_errors(num_tokens, match):
  cache = kv_cache(LENGTHS[:2], jnp.float32)
  q = normal((2, T, 4, 8), jnp.float32, 2)
  with pytest.raises(ValueError, match=match):
    paged_attention(q, cache.key_pool, cache.value_pool, cache.page_table, cache.lengths,
                    num_tokens=num_tokens)
  lc = latent_cache(LENGTHS[:2], jnp.float32)
  with pytest.raises(ValueError, match=match):
    paged_mla_decode(normal((2, T, 4, C), jnp.float32, 1), normal((2, T, 4, R), jnp.float32, 1),
                     lc.c_kv_pool, lc.k_rope_pool, lc.page_table, lc.lengths, scale=SCALE,
                     num_tokens=num_tokens)
