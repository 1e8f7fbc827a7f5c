"""The top-K sparse attention Pallas kernels (TPU: manual row DMAs, interpreted with race detection;
GPU: Triton gathers, interpreted) vs the gather reference, and the dispatch through
``jaxattn.ops.sparse`` (forward and gradients)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jaxattn.ops.sparse import (indexer_scores, sparse_attention, sparse_mla_attention,
                                topk_indices)
from pallas_kernels.sparse_attention import (gather_attention, sparse_attention_gpu,
                                             sparse_attention_tpu, sparse_mla_attention_gpu,
                                             sparse_mla_attention_tpu, sparse_mla_latent_gpu,
                                             sparse_mla_latent_tpu)

RACES = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)


def _indices(b, t, s, k, seed, q_offset=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  qi = jax.random.normal(ks[0], (b, t, 2, 8))
  ki = jax.random.normal(ks[1], (b, s, 8))
  w = jax.random.uniform(ks[2], (b, t, 2)) - 0.2
  lengths = jnp.full((b,), q_offset + t, jnp.int32)
  return topk_indices(indexer_scores(qi, ki, w, q_offset=q_offset, kv_lengths=lengths), k)


def _scattered(b, t, s, k, seed):
  """Random positions with holes: ``-1`` in the middle of rows, a whole row of ``-1`` (batch 0,
  token 1), one out-of-range position, trailing ``-1`` on the last token.  Position 0 is never
  selected (so its row, where kernels may point unused slots, can be poisoned)."""
  idx = jax.random.randint(jax.random.key(seed), (b, t, k), -4, s)
  idx = jnp.where(idx < 0, -1, jnp.maximum(idx, 1))
  idx = idx.at[0, 1].set(-1).at[-1, -1, k // 2:].set(-1).at[-1, 0, 0].set(s + 5)
  return idx


def _gqa(b, t, s, n, kh, h, hv, dtype, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(ks[0], (b, t, n, h)).astype(dtype)
  key = jax.random.normal(ks[1], (b, s, kh, h)).astype(dtype)
  v = jax.random.normal(ks[2], (b, s, kh, hv)).astype(dtype)
  return q, key, v


def _reference(q, key, v, idx):
  """The gather reference in fp32 with out-of-range positions as ``-1``."""
  idx = jnp.where((idx >= 0) & (idx < key.shape[1]), idx, -1)
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  return sparse_attention(f32(q), f32(key), f32(v), idx, implementation="xla")


def _poison_unselected(key, v, idx):
  """NaN in every cache row no token selects: a kernel that reads (or multiplies by) an
  unselected row produces NaN."""
  b, s = key.shape[:2]
  used = jnp.zeros((b, s), bool)
  safe = jnp.where((idx >= 0) & (idx < s), idx, s)
  used = jax.vmap(lambda u, i: u.at[i.reshape(-1)].set(True, mode="drop"))(used, safe)
  nan = ~used[:, :, None, None]
  return jnp.where(nan, jnp.nan, key), jnp.where(nan, jnp.nan, v)


# Race detection (slow: it tracks every DMA) on the GQA cases; plain interpret mode on the MQA one.
# Two simulated cores: each takes half of the tokens (an odd count: the last half is padded).
@pytest.mark.parametrize("b,t,n,kh,k,block_k,interpret", [(2, 5, 4, 2, 21, 8, RACES),
                                                          (1, 5, 2, 1, 13, 8, RACES),
                                                          (2, 5, 3, 1, 9, 16, True)])
def test_tpu_kernel_blocks_holes_and_races(b, t, n, kh, k, block_k, interpret, race_states):
  """Several double-buffered blocks of row DMAs (k = 21 in blocks of 8), each token's first block
  fetched during the previous token's last one, holes, an empty token, trailing unused slots
  (blocks skipped), an out-of-range position; unselected rows are NaN."""
  s = 30
  q, key, v = _gqa(b, t, s, n, kh, 16, 8, jnp.float32)
  idx = _scattered(b, t, s, k, 1)
  key, v = _poison_unselected(key, v, idx)
  got = sparse_attention_tpu(q, key, v, idx, block_k=block_k, interpret=interpret)
  np.testing.assert_allclose(got, _reference(q, jnp.nan_to_num(key), jnp.nan_to_num(v), idx),
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(got[0, 1], 0.0)                      # no position selected
  if interpret is RACES:
    assert race_states and not any(st.races_found for st in race_states)


def test_gpu_kernel_blocks_holes_and_padding():
  """Triton gathers: GQA groups of 3 and head sizes 24 / 20 (padded to Triton tiles), k = 37 in
  blocks of 16; unselected rows are NaN."""
  b, t, s = 2, 4, 40
  q, key, v = _gqa(b, t, s, 6, 2, 24, 20, jnp.float32, seed=2)
  idx = _scattered(b, t, s, 37, 3)
  key, v = _poison_unselected(key, v, idx)
  got = sparse_attention_gpu(q, key, v, idx, block_k=16, interpret=True)
  np.testing.assert_allclose(got, _reference(q, jnp.nan_to_num(key), jnp.nan_to_num(v), idx),
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(got[0, 1], 0.0)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_kernels_bf16(backend):
  b, t, s = 1, 3, 24
  q, key, v = _gqa(b, t, s, 4, 2, 32, 32, jnp.bfloat16, seed=4)
  idx = _indices(b, t, s, 10, 5, q_offset=s - t)
  if backend == "tpu":
    got = sparse_attention_tpu(q, key, v, idx, block_k=8, interpret=True)
  else:
    got = sparse_attention_gpu(q, key, v, idx, block_k=16, interpret=True)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(got.astype(jnp.float32), _reference(q, key, v, idx),
                             rtol=2e-2, atol=2e-2)


def _mla_inputs(b, t, s, n, dtype, seed):
  p, r, c, hv = 8, 4, 16, 8
  ks = jax.random.split(jax.random.key(seed), 6)
  return (jax.random.normal(ks[0], (b, t, n, p)).astype(dtype),
          jax.random.normal(ks[1], (b, t, n, r)).astype(dtype),
          jax.random.normal(ks[2], (b, s, c)).astype(dtype),
          jax.random.normal(ks[3], (b, s, r)).astype(dtype),
          (jax.random.normal(ks[4], (c, n, p)) * 0.3).astype(dtype),
          (jax.random.normal(ks[5], (c, n, hv)) * 0.3).astype(dtype))


def test_mla_latent_kernels_with_race_detection(race_states):
  """DSA on MLA: the TPU kernel gathers ``c_KV`` and ``k^R`` rows from their own arrays (the value
  is the gathered ``c_KV`` row), the GPU path runs the sparse MLA decode kernel over the cache as
  one page per batch row; both equal the concatenated-key reference."""
  b, t, s = 2, 3, 20
  args = _mla_inputs(b, t, s, 4, jnp.float32, 6)
  idx = _indices(b, t, s, 12, 7, q_offset=s - t)
  ref = sparse_mla_attention(*args, idx, implementation="xla")
  got = sparse_mla_attention_tpu(*args, idx, block_k=8, interpret=RACES)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
  assert race_states and not any(st.races_found for st in race_states)
  got = sparse_mla_attention_gpu(*args, idx, num_splits=2, interpret=True)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu"])
def test_dispatch_forward_and_gradients(impl):
  """``sparse_attention(implementation=...)``: the kernel's output and the reference's gradients
  (the kernels are forward-only; their backward is the chunked reference VJP), out-of-range
  positions treated as ``-1`` by every path."""
  b, t, s = 2, 4, 18
  q, key, v = _gqa(b, t, s, 4, 2, 16, 8, jnp.float32, seed=8)
  idx = _scattered(b, t, s, 7, 9)

  def loss(impl, q, key, v):
    return jnp.sum(jnp.sin(sparse_attention(q, key, v, idx, implementation=impl)))

  ref, ref_g = jax.value_and_grad(loss, (1, 2, 3))("xla", q, key, v)
  got, got_g = jax.value_and_grad(loss, (1, 2, 3))(impl, q, key, v)
  np.testing.assert_allclose(got, ref, rtol=1e-5)
  for g, r in zip(got_g, ref_g):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
  assert float(jnp.abs(ref_g[1]).sum()) > 0
  # sparse_mla_attention's dispatch and gradients: tests/nn/test_dsa.py, through the module.


def test_tpu_default_takes_the_kernel_for_prefill_only(monkeypatch):
  """On TPU the kernel's row gathers need the cache re-tiled on every call, so the default takes
  it only when a call gathers at least as many rows as the cache holds (prefill); decode-sized
  calls and paged sparse decode take the XLA gather.  Explicit names are never replaced."""
  from jaxattn.ops import sparse as sparse_ops  # noqa: PLC0415
  from jaxattn.ops.decode import paged_mla_decode  # noqa: PLC0415

  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  assert sparse_ops._resolve_implementation(None, 4096 * 2048, 32768) == "pallas_tpu"
  assert sparse_ops._resolve_implementation(None, 1 * 2048, 32768) == "xla"
  assert sparse_ops._resolve_implementation("pallas_tpu", 1, 32768) == "pallas_tpu"
  ql, qr = jnp.ones((2, 1, 4, 16)), jnp.ones((2, 1, 4, 4))
  pools = (jnp.ones((6, 8, 16)), jnp.ones((6, 8, 4)))
  table, lens = jnp.arange(6, dtype=jnp.int32).reshape(2, 3), jnp.array([20, 9], jnp.int32)
  idx = jnp.zeros((2, 1, 4), jnp.int32)
  jaxpr = jax.make_jaxpr(lambda *a: paged_mla_decode(*a, scale=0.1, indices=idx))(
      ql, qr, *pools, table, lens)
  assert "pallas_call" not in str(jaxpr)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_sharded_under_a_mesh_equals_unsharded(backend):
  """Under the simulated 8-device mesh (data 2 x tensor 4) the kernels run in ``shard_map``: batch
  over data, query / KV heads (GQA) or query heads (MLA latents, the cache whole per batch shard)
  over tensor; the result equals the unsharded gather reference."""
  from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: PLC0415

  from jaxattn import sharding  # noqa: PLC0415

  mesh = sharding.make_mesh({"data": 2, "tensor": 4})
  b, t, s = 2, 3, 20
  q, key, v = _gqa(b, t, s, 8, 4, 16, 8, jnp.float32, seed=11)
  idx = _scattered(b, t, s, 9, 12)
  lat = (jax.random.normal(jax.random.key(13), (b, t, 4, 16)),
         jax.random.normal(jax.random.key(14), (b, t, 4, 4)),
         jax.random.normal(jax.random.key(15), (b, s, 16)),
         jax.random.normal(jax.random.key(16), (b, s, 4)))
  if backend == "tpu":
    gqa = lambda *a: sparse_attention_tpu(*a, block_k=8, interpret=True)  # noqa: E731
    latent = lambda *a: sparse_mla_latent_tpu(*a, scale=0.2, interpret=True)  # noqa: E731
  else:
    gqa = lambda *a: sparse_attention_gpu(*a, block_k=16, interpret=True)  # noqa: E731
    latent = lambda *a: sparse_mla_latent_gpu(*a, scale=0.2, interpret=True)  # noqa: E731
  heads = NamedSharding(mesh, P("data", None, "tensor", None))
  rows = NamedSharding(mesh, P("data", None, None))
  with jax.set_mesh(mesh):
    args = (*(jax.device_put(x, heads) for x in (q, key, v)), jax.device_put(idx, rows))
    assert "shard_map" in str(jax.make_jaxpr(gqa)(*args))
    got = jax.jit(gqa)(*args)
    largs = (*(jax.device_put(x, heads) for x in lat[:2]),
             *(jax.device_put(x, rows) for x in lat[2:]), jax.device_put(idx, rows))
    got_lat = jax.jit(latent)(*largs)
  np.testing.assert_allclose(got, _reference(q, key, v, idx), rtol=1e-5, atol=1e-6)
  from jaxattn.ops.sparse import _latent_reference  # noqa: PLC0415
  want_lat = _latent_reference(*lat, jnp.where(idx < s, idx, -1), scale=0.2)
  np.testing.assert_allclose(got_lat, want_lat, rtol=1e-5, atol=1e-5)


def test_errors():
  q = jnp.ones((1, 2, 2, 8))
  kv = jnp.ones((1, 4, 1, 8))
  idx = jnp.array([[[-1, -1], [2, -1]]], jnp.int32)
  for kernel in (sparse_attention_tpu, sparse_attention_gpu):
    with pytest.raises(ValueError, match="indices"):
      kernel(q, kv, kv, idx[:, :1], interpret=True)
    with pytest.raises(ValueError, match="multiple"):
      kernel(jnp.ones((1, 2, 3, 8)), jnp.ones((1, 4, 2, 8)), jnp.ones((1, 4, 2, 8)), idx,
             interpret=True)
  with pytest.raises(ValueError, match="block_k"):
    sparse_attention_tpu(q, kv, kv, idx, block_k=12, interpret=True)
  with pytest.raises(ValueError, match="block_k"):
    sparse_attention_gpu(q, kv, kv, idx, block_k=24, interpret=True)
  with pytest.raises(ValueError, match="exactly one"):
    gather_attention((q[0],), (kv[0, :, 0],), idx[0], kv_heads=1, scale=1.0)
  with pytest.raises(ValueError, match="implementation"):
    sparse_attention(q, kv, kv, idx, implementation="pallas")
  lat = (jnp.ones((1, 2, 2, 16)), jnp.ones((1, 2, 2, 4)), jnp.ones((1, 4, 16)))
  for kernel in (sparse_mla_latent_tpu, sparse_mla_latent_gpu):
    with pytest.raises(ValueError, match="k_rope"):
      kernel(*lat, jnp.ones((1, 4, 8)), idx, scale=1.0)


def test_gpu_kernels_lower_to_triton(cuda_target):
  """DeepSeek-V3.2-sized prefill lowers to Triton IR for CUDA: GQA top-2048 over 32k keys (bf16),
  and DSA on MLA (128 heads, 512 + 64 latents); compiling the IR needs a GPU."""
  bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)  # noqa: E731
  idx = jax.ShapeDtypeStruct((1, 8, 2048), jnp.int32)

  def gqa(q, k, v, i):
    return sparse_attention_gpu(q, k, v, i, interpret=False)

  def mla(ql, qr, c, kr, i):
    return sparse_mla_latent_gpu(ql, qr, c, kr, i, scale=0.07, interpret=False)

  for name, f, args in [
      ("jaxattn_sparse_attention_gpu", gqa,
       (bf16(1, 8, 32, 128), bf16(1, 32768, 8, 128), bf16(1, 32768, 8, 128), idx)),
      ("jaxattn_sparse_mla_decode_gpu", mla,
       (bf16(1, 8, 128, 512), bf16(1, 8, 128, 64), bf16(1, 32768, 512), bf16(1, 32768, 64), idx)),
  ]:
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert name in text


def test_benchmark_script(tmp_path):
  """``experiments.bench_sparse_kernel`` at a tiny size: both kinds, the kernel checked against the
  reference, results written."""
  from experiments import bench_sparse_kernel  # noqa: PLC0415

  rows = bench_sparse_kernel.main(["--contexts", "40", "--queries", "3", "--topk", "20",
                                   "--mla-heads", "4", "--impl", "pallas_gpu", "--check",
                                   "--repeats", "1", "--dtype", "float32",
                                   "--out", str(tmp_path)])
  assert [r["kind"] for r in rows] == ["mla", "gqa"]
  assert all(r["max_rel_err"] < 1e-4 and r["kernel_s"] > 0 for r in rows)
  assert (tmp_path / "results.json").exists()
  rows = bench_sparse_kernel.main(["--contexts", "40", "--queries", "3", "--topk", "20",
                                   "--mla-heads", "4", "--impl", "pallas_gpu", "--check",
                                   "--backward", "--kind", "gqa", "--repeats", "1",
                                   "--dtype", "float32", "--out", str(tmp_path)])
  assert rows[0]["backward"] and rows[0]["max_rel_err"] < 1e-4
