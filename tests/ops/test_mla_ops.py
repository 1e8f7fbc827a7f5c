"""MLA formulas: naive and absorbed paths against a NumPy statement of the seed's equations,
gradients, bf16, the weight-absorption identities, the softmax scale, errors."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.ops.mla import (absorb_output_weights, absorb_query_weights, mla_attention,
                             mla_score_terms, mla_softmax_scale)
from jaxattn.ops.rope import RopeScaling

B, N, P, R, C, HV = 2, 4, 8, 4, 12, 6


def _inputs(t, s, seed=0, dtype=np.float32):
  rng = np.random.default_rng(seed)
  arrays = dict(q_nope=(B, t, N, P), q_rope=(B, t, N, R), c_kv=(B, s, C), k_rope=(B, s, R),
                w_uk=(C, N, P), w_uv=(C, N, HV))
  return {k: (rng.standard_normal(shape) / (math.sqrt(shape[0]) if k.startswith("w") else 1))
          .astype(dtype) for k, shape in arrays.items()}


def _reference(a, *, scale, causal, q_offset=0, kv_lengths=None, mask=None):
  """The seed's equations in float64: per-head keys/values from the latent, content + position."""
  a = {k: np.asarray(v, np.float64) for k, v in a.items()}
  k_nope = np.einsum("bsc,cnp->bsnp", a["c_kv"], a["w_uk"])
  value = np.einsum("bsc,cnh->bsnh", a["c_kv"], a["w_uv"])
  logits = scale * (np.einsum("btnp,bsnp->bnts", a["q_nope"], k_nope)
                    + np.einsum("btnr,bsr->bnts", a["q_rope"], a["k_rope"]))
  t, s = logits.shape[-2:]
  allowed = np.ones((B, 1, t, s), bool)
  if causal:
    allowed &= (np.arange(s)[None, :] <= q_offset + np.arange(t)[:, None])[None, None]
  if kv_lengths is not None:
    allowed &= (np.arange(s)[None, :] < np.asarray(kv_lengths)[:, None])[:, None, None, :]
  if mask is not None:
    allowed = allowed & mask
  logits = np.where(allowed, logits, -np.inf)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("bnts,bsnh->btnh", p, value)


def _head_mask(t, s):
  """A random per-head boolean mask ``[B, N, T, S]``; key 0 stays visible so no row is empty."""
  mask = np.random.default_rng(9).random((B, N, t, s)) < 0.6
  mask[..., 0] = True
  return mask


CASES = {
    "prefill_causal": dict(t=7, s=7, kw=dict(is_causal=True)),
    "bidirectional": dict(t=5, s=9, kw=dict()),
    # One query at position 5 against a cache of capacity 10 whose rows hold 6 and 4 valid tokens.
    "decode_kv_lengths": dict(t=1, s=10, kw=dict(is_causal=True, q_offset=5,
                                                  kv_lengths=np.array([6, 4], np.int32))),
    # A per-head boolean mask, on the reference backend.
    "mask_array_xla": dict(t=4, s=6, kw=dict(mask=_head_mask(4, 6), implementation="xla")),
}


@pytest.mark.parametrize("mode", ["naive", "absorbed"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_seed_equations(mode, case):
  c = CASES[case]
  a = _inputs(c["t"], c["s"])
  scale = 0.3
  kw = c["kw"]
  got = mla_attention(**a, mode=mode, scale=scale, **kw)
  assert got.shape == (B, c["t"], N, HV) and got.dtype == jnp.float32
  want = _reference(a, scale=scale, causal=kw.get("is_causal", False), q_offset=kw.get("q_offset", 0),
                    kv_lengths=kw.get("kv_lengths"), mask=kw.get("mask"))
  # fp32 matmuls of length <= 12 and a softmax over <= 10 keys: ~1e-6 relative error.
  np.testing.assert_allclose(np.asarray(got), want, atol=2e-6, rtol=2e-5)


def test_default_scale_is_inverse_sqrt_qk_head_dim():
  a = _inputs(3, 3)
  got = mla_attention(**a, mode="absorbed", is_causal=True)
  want = _reference(a, scale=1 / math.sqrt(P + R), causal=True)
  np.testing.assert_allclose(np.asarray(got), want, atol=2e-6, rtol=2e-5)


def test_gradients_agree_between_modes_and_with_reference():
  a = {k: jnp.asarray(v) for k, v in _inputs(5, 5, seed=1).items()}
  ct = jax.random.normal(jax.random.key(3), (B, 5, N, HV))

  def loss(args, mode):
    return jnp.sum(mla_attention(**args, mode=mode, is_causal=True) * ct)

  grad = jax.jit(jax.grad(loss), static_argnums=1)
  g_naive = grad(a, "naive")
  g_abs = grad(a, "absorbed")
  for name in a:
    assert float(jnp.abs(g_naive[name]).max()) > 0, name  # every input receives a gradient
    np.testing.assert_allclose(g_abs[name], g_naive[name], atol=1e-5, rtol=1e-4, err_msg=name)
  # And the naive gradient against central differences of the float64 reference, for one input.
  eps = 1e-4
  a64 = {k: np.asarray(v, np.float64) for k, v in a.items()}
  direction = np.random.default_rng(5).standard_normal(a64["c_kv"].shape)

  def ref_loss(c_kv):
    return float(np.sum(_reference({**a64, "c_kv": c_kv}, scale=1 / math.sqrt(P + R), causal=True)
                        * np.asarray(ct, np.float64)))

  numeric = (ref_loss(a64["c_kv"] + eps * direction)
             - ref_loss(a64["c_kv"] - eps * direction)) / (2 * eps)
  analytic = float(np.sum(np.asarray(g_naive["c_kv"], np.float64) * direction))
  np.testing.assert_allclose(analytic, numeric, rtol=1e-3)


@pytest.mark.parametrize("mode", ["naive", "absorbed"])
def test_bf16_close_to_fp32_reference(mode):
  a32 = _inputs(6, 6, seed=2)
  a16 = {k: jnp.asarray(v, jnp.bfloat16) for k, v in a32.items()}
  got = mla_attention(**a16, mode=mode, is_causal=True)
  assert got.dtype == jnp.bfloat16
  want = _reference({k: np.asarray(v, np.float32) for k, v in a16.items()},
                    scale=1 / math.sqrt(P + R), causal=True)
  # bf16 keeps 8 significant bits (relative step 2^-8 = 0.4%); a few roundings of O(1) values.
  np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=4e-2, rtol=4e-2)


def test_score_terms_are_content_and_position():
  a = _inputs(3, 5, seed=4)
  content, position = mla_score_terms(a["q_nope"], a["q_rope"], a["c_kv"], a["k_rope"], a["w_uk"])
  assert content.shape == position.shape == (B, N, 3, 5)
  k_nope = np.einsum("bsc,cnp->bsnp", a["c_kv"], a["w_uk"])
  np.testing.assert_allclose(content, np.einsum("btnp,bsnp->bnts", a["q_nope"], k_nope), rtol=1e-5,
                             atol=1e-5)
  # The position term uses one key for every head.
  np.testing.assert_allclose(position, np.einsum("btnr,bsr->bnts", a["q_rope"], a["k_rope"]),
                             rtol=1e-5, atol=1e-5)


def test_absorbed_weight_identities():
  rng = np.random.default_rng(6)
  cq, d = 10, 16
  c_q = rng.standard_normal((3, cq)).astype(np.float32)         # query latents of 3 tokens
  c_kv = rng.standard_normal((5, C)).astype(np.float32)         # key latents of 5 tokens
  w_uq = rng.standard_normal((cq, N, P)).astype(np.float32)
  w_uk = rng.standard_normal((C, N, P)).astype(np.float32)
  a = absorb_query_weights(w_uq, w_uk)
  assert a.shape == (cq, N, C)
  # c_Q A_i c_KV^T == (c_Q W_up^Q_i) . (c_KV W_up^K_i)
  lhs = np.einsum("tq,qnc,sc->nts", c_q, a, c_kv)
  rhs = np.einsum("tnp,snp->nts", np.einsum("tq,qnp->tnp", c_q, w_uq),
                  np.einsum("sc,cnp->snp", c_kv, w_uk))
  np.testing.assert_allclose(lhs, rhs, rtol=1e-4, atol=1e-3)
  w_uv = rng.standard_normal((C, N, HV)).astype(np.float32)
  w_o = rng.standard_normal((N, HV, d)).astype(np.float32)
  o_latent = rng.standard_normal((3, N, C)).astype(np.float32)
  merged = absorb_output_weights(w_uv, w_o)
  assert merged.shape == (N, C, d)
  np.testing.assert_allclose(np.einsum("tnc,ncd->td", o_latent, merged),
                             np.einsum("tnh,nhd->td", np.einsum("tnc,cnh->tnh", o_latent, w_uv), w_o),
                             rtol=1e-4, atol=1e-3)
  with pytest.raises(ValueError, match="w_uq_nope"):
    absorb_query_weights(w_uq[:, :2], w_uk)
  with pytest.raises(ValueError, match="w_uv"):
    absorb_output_weights(w_uv, w_o[:, :2])


def test_softmax_scale_with_yarn_mscale():
  assert mla_softmax_scale(192) == pytest.approx(192 ** -0.5, rel=1e-12)
  # DeepSeek-V3: factor 40, mscale_all_dim 1 -> (0.1 ln 40 + 1)^2 / sqrt(192).
  v3 = RopeScaling(type="yarn", factor=40.0, original_max_position_embeddings=4096, mscale=1.0,
                   mscale_all_dim=1.0)
  assert mla_softmax_scale(192, v3) == pytest.approx((0.1 * math.log(40) + 1) ** 2 / math.sqrt(192),
                                                     rel=1e-12)
  assert mla_softmax_scale(192, v3) == pytest.approx(0.135234, rel=1e-5)
  # Without mscale_all_dim the scale is unchanged (the yarn factor goes into cos/sin instead).
  plain = RopeScaling(type="yarn", factor=4.0, original_max_position_embeddings=16)
  assert mla_softmax_scale(24, plain) == pytest.approx(24 ** -0.5, rel=1e-12)
  with pytest.raises(ValueError, match="qk_head_dim"):
    mla_softmax_scale(0)


@pytest.mark.parametrize("change, match", [
    (dict(mode="fast"), "mode"),
    (dict(q_nope=np.zeros((B, 3, N), np.float32)), "q_nope"),
    (dict(q_rope=np.zeros((B, 3, N + 1, R), np.float32)), "q_rope"),
    (dict(c_kv=np.zeros((B, 4, C), np.float32)), "c_kv"),  # S differs from k_rope's
    (dict(k_rope=np.zeros((B, 5, R + 2), np.float32)), "k_rope.*rotary"),
    (dict(w_uk=np.zeros((C, N, P + 1), np.float32)), "w_uk"),
    (dict(w_uv=np.zeros((C + 1, N, HV), np.float32)), "w_uv"),
    (dict(c_kv=np.zeros((B, 5, C), np.float16)), "dtypes"),
    (dict(scale=-1.0), "scale"),
])
def test_errors(change, match):
  a = _inputs(3, 5)
  kwargs = {**a, **change}
  with pytest.raises(ValueError, match=match):
    mla_attention(**kwargs)
