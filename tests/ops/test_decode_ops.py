"""Paged decode formulas against independent references: float64 NumPy attention per sequence and
head on the contiguous keys (GQA / MQA / MHA, ragged lengths incl. zero, several new tokens,
soft-cap, bf16), naive-form MLA in NumPy and the ``mla_attention`` formula, DSA's
``sparse_mla_attention`` for sparse mode; the dispatcher and its errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.ops.decode import paged_attention, paged_mla_decode, resolve_implementation
from jaxattn.ops.sparse import sparse_mla_attention
from jaxattn.paged_cache import PagedKVCache, PagedLatentCache

PAGE = 4
LENGTHS = (9, 0, 4, 6)  # ragged: spans pages, an empty sequence, an exact page


def _shuffled(table, seed):
  """The table with its free pages in random order, so sequences get scattered pages."""
  order = np.random.default_rng(seed).permutation(table.num_pages).astype(np.int32)
  return dataclasses.replace(table, free_pages=jnp.asarray(order))


def kv_cache(kh, h=8, hv=6, dtype=jnp.float32, seed=0):
  """A paged cache holding LENGTHS tokens of random keys/values in randomly placed pages, and the
  contiguous keys/values ``[B, S, K, H|h]`` it should hold."""
  b, s = len(LENGTHS), max(LENGTHS)
  rng = np.random.default_rng(seed)
  key = jnp.asarray(rng.standard_normal((b, s, kh, h)), dtype)
  value = jnp.asarray(rng.standard_normal((b, s, kh, hv)), dtype)
  cache = PagedKVCache.init(b, 12, PAGE, kh, h, hv, max_pages_per_seq=4, dtype=dtype)
  cache = dataclasses.replace(cache, table=_shuffled(cache.table, seed))
  cache = cache.append(key, value, np.array(LENGTHS))
  np.testing.assert_array_equal(cache.lengths, LENGTHS)
  return cache, key, value


def _softmax_np(logits):
  logits = logits - logits.max(-1, keepdims=True)
  p = np.exp(logits)
  return p / p.sum(-1, keepdims=True)


def dense_reference(q, key, value, lengths, *, scale=None, logits_soft_cap=None, window=None,
                    slopes=None):
  """NumPy, float64, one sequence and head at a time: the last ``T`` tokens of each sequence
  attend causally to its own prefix (head n reads KV head n // G), the last ``window + 1`` of it
  with a window, ALiBi ``slope * (j - i)`` with slopes; empty rows give zeros."""
  q, key, value = (np.asarray(x, np.float64) for x in (q, key, value))
  b, t, n, h = q.shape
  g = n // key.shape[2]
  scale = h ** -0.5 if scale is None else scale
  out = np.zeros((b, t, n, value.shape[-1]))
  for i, length in enumerate(lengths):
    for j in range(t):
      pos = length - t + j                                # this query's position
      if pos < 0:
        continue
      lo = 0 if window is None else max(pos - window, 0)
      for head in range(n):
        logits = key[i, lo:pos + 1, head // g] @ q[i, j, head] * scale
        if slopes is not None:
          logits = logits + slopes[head] * (np.arange(lo, pos + 1) - pos)
        if logits_soft_cap is not None:
          logits = logits_soft_cap * np.tanh(logits / logits_soft_cap)
        out[i, j, head] = _softmax_np(logits) @ value[i, lo:pos + 1, head // g]
  return out


def mla_reference(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, lengths, scale):
  """NumPy float64 MLA in its naive (per-head keys and values) form, per sequence."""
  q_nope, q_rope, c_kv, k_rope, w_uk, w_uv = (np.asarray(x, np.float64) for x in (
      q_nope, q_rope, c_kv, k_rope, w_uk, w_uv))
  b, t, n, _ = q_nope.shape
  out = np.zeros((b, t, n, w_uv.shape[-1]))
  for i, length in enumerate(lengths):
    for j in range(t):
      pos = length - t + j
      if pos < 0:
        continue
      for head in range(n):
        k_c = c_kv[i, :pos + 1] @ w_uk[:, head]           # [S, P] this head's content keys
        v = c_kv[i, :pos + 1] @ w_uv[:, head]             # [S, h]
        logits = (k_c @ q_nope[i, j, head] + k_rope[i, :pos + 1] @ q_rope[i, j, head]) * scale
        out[i, j, head] = _softmax_np(logits) @ v
  return out


@pytest.mark.parametrize("n,kh", [(4, 4), (4, 2), (4, 1)])  # MHA, GQA, MQA
@pytest.mark.parametrize("t", [1, 3])
def test_paged_equals_contiguous(n, kh, t):
  cache, key, value = kv_cache(kh)
  (q,) = _normal(5, (len(LENGTHS), t, n, 8))
  got = paged_attention(q, cache.key_pool, cache.value_pool, cache.page_table, cache.lengths,
                        implementation="xla")
  np.testing.assert_allclose(got, dense_reference(q, key, value, LENGTHS), rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(got[1], 0.0)          # zero-length sequence
  if t == 1:  # a [B, N, H] query is T = 1
    got3 = paged_attention(q[:, 0], cache.key_pool, cache.value_pool, cache.page_table,
                           cache.lengths, implementation="xla")
    np.testing.assert_array_equal(got3, got[:, 0])
  # The cache keeps a token's KV heads side by side ([P, page, K * H]); the split form
  # [P, page, K, H] of the same pools is accepted too.
  assert cache.key_pool.shape[2:] == (kh * 8,) and cache.value_pool.shape[2:] == (kh * 6,)
  split = paged_attention(q, cache.key_pool.reshape(12, PAGE, kh, 8),
                          cache.value_pool.reshape(12, PAGE, kh, 6), cache.page_table,
                          cache.lengths, implementation="xla")
  np.testing.assert_array_equal(split, got)


@pytest.mark.parametrize("window,alibi", [(0, False), (2, False), (5, True), (None, True)])
def test_sliding_window_and_alibi(window, alibi):
  """A window of 0 (each query sees itself), 2 (the 9-token sequence's first pages fall out of
  it) and 5, ALiBi slopes alone and with a window, with a soft-cap on top; ragged chunks
  (``num_tokens``) read their rows at their own positions."""
  cache, key, value = kv_cache(2)
  (q,) = _normal(7, (len(LENGTHS), 3, 4, 8))
  slopes = np.array([0.5, 0.25, 0.125, 1.0]) if alibi else None
  kw = dict(scale=0.6, logits_soft_cap=3.0)
  args = (cache.key_pool, cache.value_pool, cache.page_table, cache.lengths)
  got = paged_attention(q, *args, implementation="xla", local_window_size=window,
                        alibi_slopes=slopes, **kw)
  ref = dense_reference(q, key, value, LENGTHS, window=window, slopes=slopes, **kw)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
  # A ragged chunk: rows 2, 0, 1, 3 new tokens; row b's first num_tokens[b] queries are its last.
  nt = np.array([2, 0, 1, 3])
  ragged = paged_attention(q, *args, implementation="xla", local_window_size=window,
                           alibi_slopes=slopes, num_tokens=jnp.asarray(nt), **kw)
  for b, n in enumerate(nt):
    want = dense_reference(q[b:b + 1, :n], key[b:b + 1], value[b:b + 1], LENGTHS[b:b + 1],
                           window=window, slopes=slopes, **kw)
    np.testing.assert_allclose(ragged[b, :n], want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(ragged[b, n:], 0.0)
  if window == 0:   # a query sees only its own token: its value
    np.testing.assert_allclose(got[0, :, :2], value[0, 6:9, :1].repeat(2, 1), rtol=1e-6)


def test_relative_bias_equals_the_dense_formula():
  """A T5 bias (``RelativeBias``: learned buckets of ``j - i``) through the paged XLA path, with a
  window and ragged chunks, equals ``dot_product_attention`` over each sequence's contiguous keys
  with the bias of its positions; the kernels refuse it."""
  from jaxattn import dot_product_attention  # noqa: PLC0415
  from jaxattn.ops.decode import RelativeBias  # noqa: PLC0415
  from jaxattn.ops.t5_bias import t5_position_bias  # noqa: PLC0415

  cache, key, value = kv_cache(2)
  (q, table) = _normal(8, (len(LENGTHS), 3, 4, 8), (8, 4))
  rel = RelativeBias(table, num_buckets=8, max_distance=6)
  args = (cache.key_pool, cache.value_pool, cache.page_table, cache.lengths)
  nt = np.array([3, 0, 2, 1])
  for window in (None, 4):
    got = paged_attention(q, *args, relative_bias=rel, local_window_size=window, scale=0.5,
                          num_tokens=jnp.asarray(nt))
    for b, (length, n) in enumerate(zip(LENGTHS, nt)):
      if n == 0:
        np.testing.assert_array_equal(got[b], 0.0)
        continue
      qb, pos = q[b:b + 1, :n], jnp.arange(length - n, length)
      bias = t5_position_bias(table, pos, jnp.arange(length), bidirectional=False, num_buckets=8,
                              max_distance=6)
      want = dot_product_attention(qb, key[b:b + 1, :length], value[b:b + 1, :length], bias,
                                   scale=0.5, is_causal=True, q_offset=length - n,
                                   local_window_size=window, implementation="xla")
      np.testing.assert_allclose(got[b, :n], want[0], rtol=1e-5, atol=1e-6, err_msg=f"{b}")
  plain = paged_attention(q, *args, scale=0.5)
  assert float(jnp.max(jnp.abs(plain - paged_attention(q, *args, scale=0.5, relative_bias=rel)))
               ) > 0.05
  with pytest.raises(ValueError, match="runs on implementation='xla' only"):
    paged_attention(q, *args, relative_bias=rel, implementation="pallas_tpu")
  with pytest.raises(ValueError, match=r"`relative_bias.table` must be \[num_buckets=8, N=4\]"):
    paged_attention(q, *args, relative_bias=RelativeBias(table[:, :2], num_buckets=8))
  with pytest.raises(ValueError, match="`relative_bias` must be a RelativeBias or None"):
    paged_attention(q, *args, relative_bias=table)


def test_soft_cap_scale_and_bf16():
  cache, key, value = kv_cache(2, dtype=jnp.bfloat16)
  q = _normal(6, (len(LENGTHS), 2, 4, 8), scale=3.0)[0].astype(jnp.bfloat16)
  kw = dict(scale=0.7, logits_soft_cap=2.0)
  got = paged_attention(q, cache.key_pool, cache.value_pool, cache.page_table, cache.lengths,
                        implementation="xla", **kw)
  assert got.dtype == jnp.bfloat16
  ref = dense_reference(q.astype(jnp.float32), key.astype(jnp.float32),
                        value.astype(jnp.float32), LENGTHS, **kw)
  # Both compute in fp32 from the same bf16 inputs; only the final bf16 rounding differs (2^-8).
  np.testing.assert_allclose(got.astype(jnp.float32), ref, rtol=1e-2, atol=1e-2)
  uncapped = paged_attention(q, cache.key_pool, cache.value_pool, cache.page_table,
                             cache.lengths, implementation="xla", scale=0.7)
  assert float(jnp.max(jnp.abs(uncapped.astype(jnp.float32) - got.astype(jnp.float32)))) > 0.05


def latent_cache(c=12, r=4, seed=1, rope_align=1):
  b, s = len(LENGTHS), max(LENGTHS)
  rng = np.random.default_rng(seed)
  c_kv = jnp.asarray(rng.standard_normal((b, s, c)), jnp.float32)
  k_rope = jnp.asarray(rng.standard_normal((b, s, r)), jnp.float32)
  cache = PagedLatentCache.init(b, 12, PAGE, c, r, max_pages_per_seq=4, rope_align=rope_align)
  cache = dataclasses.replace(cache, table=_shuffled(cache.table, seed))
  cache = cache.append(c_kv, k_rope, num_tokens=np.array(LENGTHS))
  return cache, c_kv, k_rope


def _normal(seed, *shapes, scale=1.0):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(scale * rng.standard_normal(sh), jnp.float32) for sh in shapes]


@pytest.mark.parametrize("t,rope_align", [(1, 1), (2, 1), (2, 16)])
def test_mla_paged_equals_mla_attention(t, rope_align):
  """Latent output, up-projected by W_up^V, equals the module formula (naive mode: independent of
  the absorbed algebra) on each sequence's contiguous latents; also with the k^R pool stored
  zero-padded to 16 columns (the TPU layout's 128 for R = 64, scaled down)."""
  n, p, r, c, hv = 3, 5, 4, 12, 6
  cache, c_kv, k_rope = latent_cache(c, r, rope_align=rope_align)
  assert cache.k_rope_pool.shape[2] == max(r, rope_align)
  q_nope, q_rope = _normal(7, (len(LENGTHS), t, n, p), (len(LENGTHS), t, n, r))
  w_uk, w_uv = _normal(8, (c, n, p), (c, n, hv), scale=0.4)
  scale = 0.3
  q_lat = jnp.einsum("btnp,cnp->btnc", q_nope, w_uk)
  got = paged_mla_decode(q_lat, q_rope, cache.c_kv_pool, cache.k_rope_pool, cache.page_table,
                         cache.lengths, scale=scale, implementation="xla")
  assert got.shape == (len(LENGTHS), t, n, c)
  got = jnp.einsum("btnc,cnh->btnh", got, w_uv)
  ref = mla_reference(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, LENGTHS, scale)
  np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
  np.testing.assert_array_equal(got[1], 0.0)


@pytest.mark.parametrize("rope_align", [1, 16])
def test_sparse_mla_equals_gather_reference(rope_align):
  n, p, r, c, hv, k = 3, 5, 4, 12, 6, 5
  cache, c_kv, k_rope = latent_cache(c, r, rope_align=rope_align)
  b = len(LENGTHS)
  q_nope, q_rope = _normal(9, (b, 1, n, p), (b, 1, n, r))
  w_uk, w_uv = _normal(10, (c, n, p), (c, n, hv), scale=0.4)
  # Distinct random picks among each sequence's positions; -1 where it has fewer than k.
  rng = np.random.default_rng(11)
  idx = np.full((b, 1, k), -1, np.int32)
  for i, length in enumerate(LENGTHS):
    picks = rng.permutation(length)[:k]
    idx[i, 0, :len(picks)] = picks
  idx[0, 0, 1] = -1
  idx = jnp.asarray(idx)
  q_lat = jnp.einsum("btnp,cnp->btnc", q_nope, w_uk)
  got = paged_mla_decode(q_lat[:, 0], q_rope[:, 0], cache.c_kv_pool, cache.k_rope_pool,
                         cache.page_table, cache.lengths, scale=0.3, indices=idx[:, 0],
                         implementation="xla")                         # [B, N, C], indices [B, k]
  got = jnp.einsum("bnc,cnh->bnh", got, w_uv)
  ref = sparse_mla_attention(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, idx, scale=0.3)[:, 0]
  np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
  np.testing.assert_array_equal(got[1], 0.0)
  # Positions at or past the length are ignored (their pages may belong to someone else).
  far = idx.at[2, 0, 0].set(LENGTHS[2] + 3)
  got_far = paged_mla_decode(q_lat, q_rope, cache.c_kv_pool, cache.k_rope_pool, cache.page_table,
                             cache.lengths, scale=0.3, indices=far, implementation="xla")
  ref_far = paged_mla_decode(q_lat, q_rope, cache.c_kv_pool, cache.k_rope_pool, cache.page_table,
                             cache.lengths, scale=0.3, indices=far.at[2, 0, 0].set(-1),
                             implementation="xla")
  np.testing.assert_array_equal(got_far, ref_far)


def test_tpu_default_runs_long_prefills_in_the_kernel(monkeypatch):
  """On TPU the default is the decode kernel for every dense call, a long prefill through a paged
  cache included (the kernel takes its query rows in blocks that fit VMEM); sparse (DSA) calls
  default to the XLA gather."""
  with monkeypatch.context() as m:
    m.setattr(jax, "default_backend", lambda: "tpu")
    assert resolve_implementation(None) == "pallas_tpu"
    assert resolve_implementation(None, sparse=True) == "xla"
    assert resolve_implementation("pallas_tpu", sparse=True) == "pallas_tpu"  # explicit: kept


def test_gpu_default_takes_the_kernels_where_pages_fit(monkeypatch):
  """On an NVIDIA sm_80+ GPU the default is the Triton decode kernels for dense calls whose pages
  are multiples of 16 tokens; other page sizes, sparse calls and older GPUs take the XLA path;
  an explicit choice is kept."""
  from jaxattn.ops import attention_cudnn  # noqa: PLC0415
  m = monkeypatch
  m.setattr(jax, "default_backend", lambda: "gpu")
  m.setattr(attention_cudnn, "nvidia_reason", lambda device=None: None)
  assert resolve_implementation(None) == "pallas_gpu"
  assert resolve_implementation(None, page_size=64) == "pallas_gpu"
  assert resolve_implementation(None, page_size=8) == "xla"
  assert resolve_implementation(None, page_size=24) == "xla"
  assert resolve_implementation(None, sparse=True, page_size=64) == "xla"
  assert resolve_implementation("xla", page_size=64) == "xla"
  m.setattr(attention_cudnn, "nvidia_reason", lambda device=None: "compute capability 7.5")
  assert resolve_implementation(None, page_size=64) == "xla"


def test_automatic_dispatch_falls_back_where_the_kernels_cannot_read_the_cache(monkeypatch):
  """A contiguous cache whose length no page size of 16+ divides: automatic dispatch on a GPU
  computes with the XLA path (the result equals it); an explicit kernel request says why not."""
  from jaxattn.ops import attention_cudnn  # noqa: PLC0415
  from jaxattn.ops.decode import cache_attention  # noqa: PLC0415
  b, s, n, kh, h = 2, 20, 4, 2, 8
  q = jax.random.normal(jax.random.key(0), (b, 1, n, h))
  key = jax.random.normal(jax.random.key(1), (b, s, kh, h))
  value = jax.random.normal(jax.random.key(2), (b, s, kh, h))
  lengths = jnp.asarray([7, 20], jnp.int32)
  want = cache_attention(q, key, value, lengths, implementation="xla")
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(attention_cudnn, "nvidia_reason", lambda device=None: None)
  np.testing.assert_array_equal(np.asarray(cache_attention(q, key, value, lengths)),
                                np.asarray(want))
  with pytest.raises(ValueError, match="multiple of 16"):
    cache_attention(q, key, value, lengths, implementation="pallas_gpu")


def test_scales_given_as_arrays_and_empty_queries():
  """``scale`` / ``logits_soft_cap`` are compiled into the kernels: NumPy scalars and concrete
  one-element arrays are taken as Python floats (every implementation gives the float's result),
  a traced value is refused with a clear error.  A call with no new token (T = 0) returns an
  empty result on every implementation."""
  from jaxattn.ops.decode import cache_attention, cache_mla_decode  # noqa: PLC0415
  cache, _, _ = kv_cache(2)
  args = (cache.key_pool, cache.value_pool, cache.page_table, cache.lengths)
  q = _normal(3, (len(LENGTHS), 2, 4, 8))[0]
  for impl in ("xla", "pallas_tpu", "pallas_gpu"):
    kw = dict(implementation=impl, interpret=True)
    if impl != "pallas_gpu":                       # (the GPU kernel wants pages of 16+ tokens)
      want = paged_attention(q, *args, scale=0.5, logits_soft_cap=2.0, **kw)
      for scale, cap in ((np.float32(0.5), jnp.float32(2.0)),
                         (jnp.asarray([0.5]), np.float64(2))):
        got = paged_attention(q, *args, scale=scale, logits_soft_cap=cap, **kw)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    empty = paged_attention(q[:, :0], *args, **kw)
    assert empty.shape == (len(LENGTHS), 0, 4, 6)
    assert cache_attention(q[:, :0], jnp.ones((4, 16, 16)), jnp.ones((4, 16, 12)), cache.lengths,
                           **kw).shape == (4, 0, 4, 6)
    ql, qr = jnp.ones((4, 0, 3, 16)), jnp.ones((4, 0, 3, 4))
    assert cache_mla_decode(ql, qr, jnp.ones((4, 16, 20)), cache.lengths, scale=0.1,
                            **kw).shape == (4, 0, 3, 16)
  lat, _, _ = latent_cache()
  got = paged_mla_decode(jnp.ones((len(LENGTHS), 0, 3, 12)), jnp.ones((len(LENGTHS), 0, 3, 4)),
                         lat.c_kv_pool, lat.k_rope_pool, lat.page_table, lat.lengths,
                         scale=np.float32(0.1), implementation="pallas_tpu", interpret=True)
  assert got.shape == (len(LENGTHS), 0, 3, 12)
  with pytest.raises(ValueError, match="concrete"):
    jax.jit(lambda s: paged_attention(q, *args, scale=s))(0.5)
  for bad in (True, jnp.ones(2), "0.5", np.nan):
    with pytest.raises(ValueError, match="scale"):
      paged_attention(q, *args, scale=bad)


def test_dispatch_and_errors():
  assert resolve_implementation(None) == ("pallas_tpu" if jax.default_backend() == "tpu"
                                          else "xla")
  cache, _, _ = kv_cache(2)
  args = (cache.key_pool, cache.value_pool, cache.page_table, cache.lengths)
  q = jnp.ones((len(LENGTHS), 4, 8))
  with pytest.raises(ValueError, match="implementation"):
    paged_attention(q, *args, implementation="xla_chunked")
  with pytest.raises(ValueError, match="multiple"):
    paged_attention(jnp.ones((len(LENGTHS), 3, 8)), *args)
  with pytest.raises(ValueError, match="query"):
    paged_attention(jnp.ones((4, 8)), *args)
  with pytest.raises(ValueError, match="key_pool"):              # K * H = 16: H = 6 divides not
    paged_attention(jnp.ones((len(LENGTHS), 4, 6)), *args)
  with pytest.raises(ValueError, match="key_pool"):              # K = 2, value width 13
    paged_attention(q, args[0], jnp.ones((12, PAGE, 13)), *args[2:])
  with pytest.raises(ValueError, match="key_pool"):              # merged key, split value
    paged_attention(q, args[0], args[1].reshape(12, PAGE, 2, -1), *args[2:])
  with pytest.raises(ValueError, match="key_pool"):              # split, with another H
    paged_attention(q, args[0].reshape(12, PAGE, 4, 4), args[1].reshape(12, PAGE, 4, -1),
                    *args[2:])
  with pytest.raises(ValueError, match="page_table"):
    paged_attention(q, *args[:2], cache.page_table[:2], cache.lengths)
  with pytest.raises(ValueError, match="lengths"):
    paged_attention(q, *args[:3], jnp.array([1, 2, 3, 17]))
  with pytest.raises(ValueError, match="lengths"):
    paged_attention(q, *args[:3], cache.lengths.astype(jnp.float32))
  with pytest.raises(ValueError, match="`lengths` must be an integer array, got list"):
    paged_attention(q, *args[:3], [1, 2, 3, 4])          # (an AttributeError on `.shape`)
  with pytest.raises(ValueError, match=r"`page_table` must be \[B=4, max_pages >= 1\]"):
    paged_attention(q, *args[:2], cache.page_table[:, :0], jnp.zeros((4,), jnp.int32))
  with pytest.raises(ValueError, match="scale"):
    paged_attention(q, *args, scale=-1.0)
  with pytest.raises(ValueError, match="logits_soft_cap"):
    paged_attention(q, *args, logits_soft_cap=0.0)
  for bad in (-1, 2.0, (2, 0), True):
    with pytest.raises(ValueError, match=r"`local_window_size` must be None or an int >= 0"):
      paged_attention(q, *args, local_window_size=bad)
  with pytest.raises(ValueError, match=r"`alibi_slopes` must have shape \[N\] = \(4,\)"):
    paged_attention(q, *args, alibi_slopes=np.ones(2))
  with pytest.raises(ValueError, match="`alibi_slopes` must be real numbers"):
    paged_attention(q, *args, alibi_slopes=np.ones(4, bool))
  for bad in (0, True, 2.0):
    with pytest.raises(ValueError, match="`num_splits` must be a positive int or None"):
      paged_attention(q, *args, num_splits=bad)
  np.testing.assert_array_equal(paged_attention(q, *args, num_splits=np.int64(2)),
                                paged_attention(q, *args, num_splits=2))   # a NumPy int is an int
  # integer queries gave truncated integer outputs; an int8 / bool pool was read as raw numbers
  for i, name in ((0, "q"), (1, "key_pool"), (2, "value_pool")):
    bad = [q, *args[:2]]
    bad[i] = bad[i].astype(jnp.int32)
    with pytest.raises(ValueError, match=f"`{name}` must be a floating-point array"):
      paged_attention(*bad, *args[2:])
  # int8 pools are quantized codes: they need their scales (tests/ops/test_kv_quant.py)
  with pytest.raises(ValueError, match="`key_scale` and `value_scale` must be given exactly"):
    paged_attention(q, args[0].astype(jnp.int8), args[1].astype(jnp.int8), *args[2:])
  lat, _, _ = latent_cache()
  largs = (lat.c_kv_pool, lat.k_rope_pool, lat.page_table, lat.lengths)
  ql, qr = jnp.ones((len(LENGTHS), 3, 12)), jnp.ones((len(LENGTHS), 3, 4))
  with pytest.raises(ValueError, match="scale"):
    paged_mla_decode(ql, qr, *largs, scale=None)
  with pytest.raises(ValueError, match="q_rope"):
    paged_mla_decode(ql, qr[:, :2], *largs, scale=0.1)
  with pytest.raises(ValueError, match="c_kv_pool"):
    paged_mla_decode(jnp.ones((len(LENGTHS), 3, 10)), qr, *largs, scale=0.1)
  with pytest.raises(ValueError, match="k_rope_pool"):        # wider than the pool (R_p = 4)
    paged_mla_decode(ql, jnp.ones((len(LENGTHS), 3, 6)), *largs, scale=0.1)
  with pytest.raises(ValueError, match="k_rope_pool"):
    paged_mla_decode(ql, qr, largs[0], largs[1][:-1], *largs[2:], scale=0.1)
  with pytest.raises(ValueError, match="indices"):
    paged_mla_decode(ql, qr, *largs, scale=0.1, indices=jnp.ones((2, 3), jnp.int32))
  for i, name in enumerate(("q_latent", "q_rope", "c_kv_pool", "k_rope_pool")):
    bad = [ql, qr, *largs[:2]]
    bad[i] = bad[i].astype(jnp.int8)
    with pytest.raises(ValueError, match=f"`{name}` must be a floating-point array"):
      paged_mla_decode(*bad, *largs[2:], scale=0.1)
  with pytest.raises(ValueError, match="indices"):
    paged_mla_decode(ql, qr, *largs, scale=0.1, indices=jnp.ones((len(LENGTHS), 3)))
