"""The reduced-precision indexer (``dot_dtype="bfloat16"``): its scores against an independent
reference, its selection against the fp32 one (recall up to near-ties), the fp32 path untouched,
and the option's errors and module pass-through."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxattn.nn.dsa import DSA, LightningIndexer
from jaxattn.ops.sparse import indexer_scores, indexer_topk, topk_indices


def _inputs(seed, b=2, t=512, hi=4, d=32):
  ks = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(ks[0], (b, t, hi, d)), jax.random.normal(ks[1], (b, t, d)),
          jax.random.uniform(ks[2], (b, t, hi)))


def _recall(ref, got):
  """Per row ``|got & ref| / |ref|`` (``-1`` padding ignored)."""
  ref, got = np.asarray(ref), np.asarray(got)
  out = []
  for r, g in zip(ref.reshape(-1, ref.shape[-1]), got.reshape(-1, got.shape[-1])):
    r = r[r >= 0]
    out.append(np.isin(r, g).mean() if r.size else 1.0)
  return np.array(out)


def test_bf16_scores_match_reference_on_rounded_operands():
  q, k, w = _inputs(0, t=64)
  got = np.asarray(indexer_scores(q, k, w, dot_dtype="bfloat16"))
  # Independent reference: operands rounded to bf16, everything else in float64.
  qr = np.asarray(q.astype(jnp.bfloat16).astype(jnp.float32), np.float64)
  kr = np.asarray(k.astype(jnp.bfloat16).astype(jnp.float32), np.float64)
  ref = np.einsum("btj,btjs->bts", np.asarray(w, np.float64),
                  np.maximum(np.einsum("btjd,bsd->btjs", qr, kr), 0.0))
  causal = np.tril(np.ones((64, 64), bool))
  np.testing.assert_allclose(got[:, causal], ref[:, causal], rtol=1e-5, atol=1e-5)
  assert np.all(np.isneginf(got[:, ~causal]))
  # The option really rounds: fp32 scores differ (by ~2^-9 relative), but not by more.
  f32 = np.asarray(indexer_scores(q, k, w))
  assert not np.allclose(got[:, causal], f32[:, causal], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got[:, causal], f32[:, causal], rtol=2e-2, atol=0.1)


def test_bf16_selection_recall_of_fp32_selection():
  q, k, w = _inputs(1, t=384)
  kw = dict(block_size=64, query_block=64, order="position")   # the order DSA uses
  ref = indexer_topk(q, k, w, 32, **kw)
  got = indexer_topk(q, k, w, 32, dot_dtype="bfloat16", **kw)
  rec = _recall(ref, got)
  assert rec.mean() >= 0.99, rec.mean()
  # The streaming bf16 path agrees with the all-pairs bf16 composition up to last-bit near-ties.
  both = _recall(topk_indices(indexer_scores(q, k, w, dot_dtype="bfloat16"), 32), got)
  assert both.mean() >= 0.999 and both.min() >= 0.9


def test_fp32_path_never_rounds_and_bf16_path_does():
  # The default (fp32) program has no bf16 value at all, so it is the program it was before the
  # option existed; the bf16 one has bf16 dot operands.
  q, k, w = _inputs(2, b=1, t=96)
  for fn in (lambda dd: indexer_topk(q, k, w, 8, block_size=32, query_block=32, dot_dtype=dd),
             lambda dd: indexer_scores(q, k, w, dot_dtype=dd)):
    assert "bf16" not in str(jax.make_jaxpr(lambda: fn(None))())
    assert "bf16" in str(jax.make_jaxpr(lambda: fn("bfloat16"))())


def test_dot_dtype_errors():
  q, k, w = _inputs(3, b=1, t=8)
  with pytest.raises(ValueError, match="`dot_dtype`.*float16"):
    indexer_scores(q, k, w, dot_dtype="float16")
  with pytest.raises(ValueError, match="`dot_dtype`.*float16"):
    indexer_topk(q, k, w, 2, dot_dtype="float16")
  with pytest.raises(ValueError, match="`dot_dtype`"):
    LightningIndexer(16, 16, num_heads=2, head_dim=8, rope_dim=4, dot_dtype="fp8",
                     rngs=nnx.Rngs(0))


def test_dsa_module_passes_index_dot_dtype():
  mla = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
             q_lora_rank=24)
  make = lambda dd: DSA(32, 4, index_num_heads=3, index_head_dim=16, index_rope_dim=4,
                        index_topk=4, index_dot_dtype=dd, rngs=nnx.Rngs(0), **mla)
  m16, m32 = make("bfloat16"), make(None)
  assert m16.indexer.dot_dtype == "bfloat16" and m32.indexer.dot_dtype is None
  x = jax.random.normal(jax.random.key(4), (2, 24, 32))
  # Both selection paths (streaming ``indexer_topk`` without aux, all-pairs scores with aux)
  # score in bf16 only when asked; the rest of the fp32 model has no bf16 value.
  for kw in (dict(), dict(return_aux=True)):
    assert "bf16" in str(jax.make_jaxpr(lambda x: m16(x, **kw))(x))
    assert "bf16" not in str(jax.make_jaxpr(lambda x: m32(x, **kw))(x))


@pytest.mark.parametrize("quant", ["int8", "fp8"])
def test_bf16_on_quantized_codes_equals_fp32_quantized_scoring(quant):
  # One scale per vector: the bf16 dots run on the 8-bit codes (exact in bf16) and the scales
  # come after, so the scores are the fp32 quantized scores up to fp32 rounding -- far closer
  # than rounding the dequantized values to bf16 would be.
  q, k, w = _inputs(5, t=256)
  kw = dict(quant=quant, quant_block_size=32)           # = d: one block per vector
  ref = np.asarray(indexer_scores(q, k, w, **kw))
  got = np.asarray(indexer_scores(q, k, w, dot_dtype="bfloat16", **kw))
  fin = np.isfinite(ref)
  np.testing.assert_array_equal(np.isfinite(got), fin)
  np.testing.assert_allclose(got[fin], ref[fin], rtol=1e-5, atol=1e-5)
  sel = dict(block_size=64, query_block=64, order="position")
  ref_idx = indexer_topk(q, k, w, 16, **kw, **sel)
  got_idx = indexer_topk(q, k, w, 16, dot_dtype="bfloat16", **kw, **sel)
  assert _recall(ref_idx, got_idx).mean() >= 0.999
  # Streaming and all-pairs agree (the same exact integer dots; last-bit near-ties aside).
  assert _recall(topk_indices(jnp.asarray(got), 16), got_idx).mean() >= 0.999


def test_bf16_with_blockwise_quant_rounds_dequantized_values():
  # Several scales per vector: the dequantized values are rounded to bf16 (close, not exact).
  q, k, w = _inputs(6, b=1, t=64)
  kw = dict(quant="int8", quant_block_size=8)
  ref = np.asarray(indexer_scores(q, k, w, **kw))
  got = np.asarray(indexer_scores(q, k, w, dot_dtype="bfloat16", **kw))
  fin = np.isfinite(ref)
  np.testing.assert_allclose(got[fin], ref[fin], rtol=2e-2, atol=0.1)
