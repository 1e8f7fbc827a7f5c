"""``attention_gradients``: one key block's share of the gradients, given the whole rows' output
and log-sum-exp.  Over a partition of the keys the shares sum to the whole call's gradients, for
every backend; the kernels run their backward pass alone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels.flash_attention  # noqa: F401  (registers the Pallas backends)
from jaxattn.ops import attention_gradients, dot_product_attention

B, T, N, K, H, HV = 2, 37, 4, 2, 16, 8
CUT = 19   # the key blocks: [0, 19) and [19, 37); neither a multiple of a block size
SLOPES = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)
IDS = np.repeat(np.array([[0] * 11 + [1] * 26]), B, 0).astype(np.int32)


def _inputs(dtype, seed=0):
  ks = jax.random.split(jax.random.key(seed), 5)
  q = jax.random.normal(ks[0], (B, T, N, H), dtype)
  k = jax.random.normal(ks[1], (B, T, K, H), dtype)
  v = jax.random.normal(ks[2], (B, T, K, HV), dtype)
  d_out = jax.random.normal(ks[3], (B, T, N, HV), dtype)
  d_lse = jax.random.normal(ks[4], (B, N, T), jnp.float32)
  return q, k, v, d_out, d_lse


def _whole(q, k, v, d_out, d_lse, **kw):
  """``(out, lse)`` of the whole call and its gradients (query, key, value, slopes)."""
  def f(q, k, v, sl):
    return dot_product_attention(q, k, v, alibi_slopes=sl, return_residuals=True,
                                 implementation="xla", **kw)
  (out, lse), vjp = jax.vjp(f, q, k, v, jnp.asarray(SLOPES))
  return out, lse, vjp((d_out, d_lse))


def _blocks(q, k, v, out, lse, d_out, d_lse, implementation, **kw):
  """The two key blocks' shares, summed (query, slopes) and concatenated (key, value)."""
  shares = []
  for lo, hi in ((0, CUT), (CUT, T)):
    shares.append(attention_gradients(
        q, k[:, lo:hi], v[:, lo:hi], out, lse, d_out, d_lse, q_offset=-lo,
        segment_ids=(IDS, IDS[:, lo:hi]), alibi_slopes=SLOPES, implementation=implementation,
        **kw))
  (dq1, dk1, dv1, db1, ds1), (dq2, dk2, dv2, db2, ds2) = shares
  assert db1 is None and db2 is None
  return (dq1 + dq2, jnp.concatenate([dk1, dk2], 1), jnp.concatenate([dv1, dv2], 1), ds1 + ds2)


KW = dict(is_causal=True, logits_soft_cap=5.0)


@pytest.mark.parametrize("implementation", ["xla", "xla_chunked", "cpu", "pallas_tpu",
                                            "pallas_gpu"])
def test_block_shares_sum_to_the_whole_gradient(implementation):
  """fp32; causal, GQA, ALiBi (its slopes' gradient too), soft-cap, segment ids whose boundary
  sits inside the first block; ``d_lse`` nonzero."""
  q, k, v, d_out, d_lse = _inputs(jnp.float32)
  out, lse, want = _whole(q, k, v, d_out, d_lse, segment_ids=IDS, **KW)
  got = _blocks(q, k, v, out, lse, d_out, d_lse, implementation, **KW)
  for g, w, tol in zip(got, want, (2e-5, 2e-5, 2e-5, 2e-4)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol)


@pytest.mark.parametrize("implementation", ["xla_chunked", "cpu", "pallas_tpu"])
def test_bf16(implementation):
  q, k, v, d_out, d_lse = _inputs(jnp.bfloat16, seed=1)
  out, lse, want = _whole(q, k, v, d_out, d_lse, segment_ids=IDS, **KW)
  got = _blocks(q, k, v, out, lse, d_out, d_lse, implementation, **KW)
  for g, w in zip(got[:3], want[:3]):
    assert g.dtype == jnp.bfloat16
    w = np.asarray(w, np.float32)
    np.testing.assert_allclose(np.asarray(g, np.float32), w, atol=3e-2 * np.abs(w).max())


@pytest.mark.parametrize("implementation,forward_name", [
    ("cpu", "jaxattn_flash_attention_fwd_f32"), ("pallas_tpu", "jaxattn_flash_fwd"),
    ("pallas_gpu", "jaxattn_flash_fwd_gpu")])
def test_kernels_run_no_forward_pass(implementation, forward_name):
  """Given the residuals, a kernel backend runs its backward kernels and not its forward one
  (the ``"xla"`` reference recomputes the block's forward: its shares are tested above)."""
  q, k, v, d_out, d_lse = _inputs(jnp.float32)
  out, lse, _ = _whole(q, k, v, d_out, d_lse, **KW)
  jaxpr = str(jax.make_jaxpr(lambda q, k, v: attention_gradients(
      q, k, v, out, lse, d_out, d_lse, implementation=implementation, **KW))(q, k, v))
  assert forward_name not in jaxpr
  backward = {"cpu": "jaxattn_flash_attention_bwd_f32", "pallas_tpu": "jaxattn_flash_dq",
              "pallas_gpu": "jaxattn_flash_dq_gpu"}[implementation]
  assert backward in jaxpr
  # and the ordinary call's gradient does run the forward kernel (the names are the right ones)
  full = str(jax.make_jaxpr(jax.grad(lambda q: jnp.sum(dot_product_attention(
      q, k, v, implementation=implementation, **KW))))(q))
  assert forward_name in full


def test_automatic_dispatch_and_no_lse_cotangent():
  """``implementation=None`` (the CPU kernel here) and ``d_lse`` None (zero)."""
  q, k, v, d_out, _ = _inputs(jnp.float32, seed=2)
  zero = jnp.zeros((B, N, T), jnp.float32)
  out, lse, want = _whole(q, k, v, d_out, zero, **KW)
  dq, dk, dv, db, ds = attention_gradients(q, k, v, out, lse, d_out, alibi_slopes=SLOPES, **KW)
  for g, w in zip((dq, dk, dv, ds), want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-4, atol=2e-5)


def test_a_dense_bias_takes_its_gradient():
  """A T5-style bias (only the formula backends take it) gets its block's share."""
  q, k, v, d_out, d_lse = _inputs(jnp.float32, seed=3)
  bias = jax.random.normal(jax.random.key(9), (1, N, T, T))

  def f(q, k, v, b):
    return dot_product_attention(q, k, v, b, is_causal=True, return_residuals=True)
  (out, lse), vjp = jax.vjp(f, q, k, v, bias)
  want = vjp((d_out, d_lse))
  got = [attention_gradients(q, k[:, lo:hi], v[:, lo:hi], out, lse, d_out, d_lse,
                             bias[..., lo:hi], is_causal=True, q_offset=-lo)
         for lo, hi in ((0, CUT), (CUT, T))]
  np.testing.assert_allclose(got[0][0] + got[1][0], want[0], rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(jnp.concatenate([got[0][3], got[1][3]], -1), want[3], rtol=2e-5,
                             atol=2e-5)


def test_errors():
  q, k, v, d_out, d_lse = _inputs(jnp.float32)
  out, lse, _ = _whole(q, k, v, d_out, d_lse, **KW)
  with pytest.raises(ValueError, match=r"`out` must have shape \(2, 37, 4, 8\)"):
    attention_gradients(q, k, v, out[:, :5], lse, d_out, d_lse)
  with pytest.raises(ValueError, match=r"`lse` must have shape \(2, 4, 37\)"):
    attention_gradients(q, k, v, out, lse[:, 0], d_out, d_lse)
  with pytest.raises(ValueError, match="`return_residuals` is implied"):
    attention_gradients(q, k, v, out, lse, d_out, return_residuals=True)
  with pytest.raises(ValueError, match="`implementation`"):
    attention_gradients(q, k, v, out, lse, d_out, implementation="flash")
