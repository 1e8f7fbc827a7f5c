"""The grouped-matmul Pallas Triton kernels (``pallas_kernels.grouped_matmul.gpu``) -- in interpret
mode off a GPU, compiled on one (``experiments/device_check.sh``, ``PART=moe``) -- against the XLA blocked loop and the dequantized MXFP4 weights (forward, ``dxb``, ``dW``;
fp32 and bf16; several K and N tiles; empty experts and unused blocks), their tile errors, and the
lowering to Triton for CUDA at gpt-oss and Qwen3-MoE sizes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.ops import moe
from jaxattn.ops.mxfp4 import MXFP4Array
from pallas_kernels.grouped_matmul import gpu as G

TOL = {jnp.float32: dict(atol=2e-4, rtol=2e-4), jnp.bfloat16: dict(atol=6e-2, rtol=2e-2)}


def _rand(seed, shape, dtype=jnp.float32, scale=1.0):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape) * scale, dtype)


def _close(got, want, dtype, name):
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             err_msg=name, **TOL[dtype])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dense_kernels_match_the_xla_loop(dtype):
  rows, bm, k, n = 45, 16, 192, 320          # 3 K tiles of 64, 5 N tiles of 64
  lay = moe.block_layout(jnp.asarray([12, 0, 25, 6], jnp.int32), rows, bm)
  xb = moe._pad(_rand(0, (rows, k), dtype), lay)
  w = _rand(1, (4, k, n), dtype, scale=k ** -0.5)
  dy = _rand(2, (lay.num_blocks, bm, n), dtype)

  def run(fn):
    out, vjp = jax.vjp(lambda a, b: fn(a, b, lay.block_group, lay.num_used), xb, w)
    return (out,) + vjp(dy)

  got = run(lambda *a: G.block_matmul_gpu(*a))       # interpreted off a GPU, compiled on one
  want = run(moe.block_matmul)
  for g, r, name in zip(got, want, ("y", "dxb", "dW")):
    assert g.dtype == r.dtype == dtype
    _close(g, r, dtype, name)
  assert not np.any(np.asarray(got[0][int(lay.num_used):], np.float32))   # unused blocks
  assert not np.any(np.asarray(got[2][1], np.float32))                      # the empty expert


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_mxfp4_kernels_match_the_dequantized_weights(dtype):
  rows, bm, k, n = 30, 16, 640, 96            # codes rows of 384 bytes: 3 tiles; N tiles of 32
  lay = moe.block_layout(jnp.asarray([9, 14, 0, 7], jnp.int32), rows, bm)
  exponents = np.random.default_rng(4).integers(-4, 5, (4, k // 32, n))
  factor = jnp.repeat(jnp.exp2(jnp.asarray(exponents, jnp.float32)), 32, axis=1)
  q = MXFP4Array.quantize(_rand(3, (4, k, n), scale=k ** -0.5) * factor / 4)
  assert q.codes.shape[-1] == 384
  w = q.dequantize(dtype)
  xb = moe._pad(_rand(5, (rows, k), dtype, scale=0.05), lay)
  dy = _rand(6, (lay.num_blocks, bm, n), dtype)
  ops = G.mxfp4_kernel_operands(q.codes, q.scales)
  out, vjp = jax.vjp(lambda a: G.block_matmul_mxfp4_gpu(a, *ops, lay.block_group, lay.num_used),
                     xb)
  want, vjp_ref = jax.vjp(lambda a: moe.block_matmul(a, w, lay.block_group, lay.num_used), xb)
  scale = float(jnp.max(jnp.abs(want.astype(jnp.float32))))
  _close(out / scale, want / scale, dtype, "y")
  (dxb,), (dxb_ref,) = vjp(dy), vjp_ref(dy)
  scale = float(jnp.max(jnp.abs(dxb_ref.astype(jnp.float32))))
  _close(dxb / scale, dxb_ref / scale, dtype, "dxb")


def test_tile_errors():
  x, w = jnp.ones((20, 32)), jnp.ones((2, 32, 24))
  with pytest.raises(ValueError, match="multiple of 16"):
    moe.grouped_matmul(x, w, jnp.array([10, 10]), implementation="pallas_gpu")
  with pytest.raises(ValueError, match="power of two >= 16"):
    moe.grouped_matmul(x, jnp.ones((2, 32, 32)), jnp.array([10, 10]),
                       implementation="pallas_gpu", block_size=8)
  # the default block size is raised to 16 for this implementation
  y = moe.grouped_matmul(x, jnp.ones((2, 32, 32)), jnp.array([10, 10]),
                         implementation="pallas_gpu")
  np.testing.assert_allclose(y, 32.0)


def test_lowers_to_triton(cuda_target):
  """gpt-oss-20b's MXFP4 experts (forward and input gradient) and Qwen3-30B-A3B's bf16 experts
  (forward and backward) over 2048 tokens lower to Triton for CUDA; compiling the IR needs a
  GPU."""
  sds = jax.ShapeDtypeStruct
  bf16 = lambda *s: sds(s, jnp.bfloat16)  # noqa: E731

  def mxfp4(x, idx, wts, *arrays):
    ws = [MXFP4Array(arrays[i], arrays[i + 1]) for i in range(0, 6, 2)]
    f = lambda x: jnp.sum(moe.routed_experts(x, idx, wts, *ws, implementation="pallas_gpu")[0]
                          .astype(jnp.float32))
    return jax.grad(f)(x)

  def dense(x, idx, wts, *ws):
    f = lambda x, *ws: jnp.sum(moe.routed_experts(x, idx, wts, *ws, implementation="pallas_gpu")[0]
                               .astype(jnp.float32))
    return jax.grad(f, argnums=(0, 1, 2, 3))(x, *ws)

  u8 = lambda *s: sds(s, jnp.uint8)  # noqa: E731
  cases = [(mxfp4, (bf16(2048, 2880), sds((2048, 4), jnp.int32), sds((2048, 4), jnp.float32),
                    u8(32, 2880, 1536), u8(32, 2880, 90), u8(32, 2880, 1536), u8(32, 2880, 90),
                    u8(32, 2880, 1536), u8(32, 2880, 90))),
           (dense, (bf16(2048, 2048), sds((2048, 8), jnp.int32), sds((2048, 8), jnp.float32),
                    bf16(128, 2048, 768), bf16(128, 2048, 768), bf16(128, 768, 2048)))]
  from pallas_kernels.decode_attention import gpu as decode_gpu  # noqa: PLC0415
  for fn, args in cases:
    with pytest.MonkeyPatch.context() as mp:   # lowered as on a GPU, not interpreted
      mp.setattr(decode_gpu, "default_interpret", lambda interpret: False)
      mp.setattr(G, "default_interpret", lambda interpret: False)
      text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("jaxattn_grouped_matmul") >= 3, fn.__name__
