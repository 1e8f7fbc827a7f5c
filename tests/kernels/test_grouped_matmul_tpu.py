"""The grouped-matmul Pallas TPU kernels (``pallas_kernels.grouped_matmul``) in interpret mode
against the XLA blocked loop (``jaxattn.ops.moe.block_matmul``) and the dequantized MXFP4 weights:
forward, ``dxb`` and ``dW``, fp32 and bf16, tiles that divide the axes and ragged last tiles,
empty experts and unused blocks, race detection on."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jaxattn import sharding
from jaxattn.ops import moe
from jaxattn.ops.mxfp4 import FP4_VALUES, MXFP4Array, code_width, e2m1_values
from pallas_kernels.grouped_matmul import tpu as G

RACES = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)
TOL = {jnp.float32: dict(atol=2e-4, rtol=2e-4), jnp.bfloat16: dict(atol=6e-2, rtol=2e-2)}


def _rand(seed, shape, dtype=jnp.float32, scale=1.0):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape) * scale, dtype)


def _layout(group_sizes, rows, bm):
  return moe.block_layout(jnp.asarray(group_sizes, jnp.int32), rows, bm)


def _close(got, want, dtype, name):
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             err_msg=name, **TOL[dtype])


def test_e2m1_codes_decode_to_their_values():
  """The bit-built E2M1 decoder (the kernels' and XLA's) gives the 16 OCP values (and -0.0 for
  code 8)."""
  got = np.asarray(e2m1_values(jnp.arange(16, dtype=jnp.int32)))
  np.testing.assert_array_equal(got, FP4_VALUES)
  assert np.signbit(got[8]) and not np.signbit(got[0])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("k,n", [(256, 384), (576, 600)])   # tiles dividing; ragged last tiles
def test_dense_kernels_match_the_xla_loop(dtype, k, n, race_states):
  rows, bm = 37, 16
  lay = _layout([10, 0, 20, 5], rows, bm)          # an empty expert; 2 rows past the groups
  xb = moe._pad(_rand(0, (rows, k), dtype), lay)
  w = _rand(1, (4, k, n), dtype, scale=k ** -0.5)
  dy = _rand(2, (lay.num_blocks, bm, n), dtype)
  interp = RACES if k == 256 else True

  def run(fn):
    out, vjp = jax.vjp(lambda a, b: fn(a, b, lay.block_group, lay.num_used), xb, w)
    return (out,) + vjp(dy)

  got = run(lambda *a: G.block_matmul_tpu(*a, interp))
  want = run(moe.block_matmul)
  for g, r, name in zip(got, want, ("y", "dxb", "dW")):
    assert g.dtype == r.dtype == dtype
    _close(g, r, dtype, name)
  # blocks past num_used are zeros; the empty expert's gradient is zero
  used = int(lay.num_used)
  assert not np.any(np.asarray(got[0][used:], np.float32))
  assert not np.any(np.asarray(got[2][1], np.float32))
  if interp is RACES:
    assert race_states and not any(s.races_found for s in race_states)


def test_no_used_block_gives_zeros():
  """Every row past the groups (all assignments dropped): outputs and gradients are zeros."""
  lay = _layout([0, 0, 0], 9, 8)
  xb = _rand(0, (lay.num_blocks, 8, 128))
  w = _rand(1, (3, 128, 128))
  out, vjp = jax.vjp(lambda a, b: G.block_matmul_tpu(a, b, lay.block_group, lay.num_used, True),
                     xb, w)
  dxb, dw = vjp(jnp.ones_like(out))
  assert int(lay.num_used) == 0
  for a in (out, dxb, dw):
    assert not np.any(np.asarray(a))


def _mxfp4(seed, e, k, n):
  """An MXFP4 matrix ``[E, K, N]`` whose groups' scales spread over 2^-4 .. 2^4 (times
  ``1 / sqrt(K)``)."""
  exponents = np.random.default_rng(seed + 1).integers(-4, 5, (e, k // 32, n))
  factor = jnp.repeat(jnp.exp2(jnp.asarray(exponents, jnp.float32)), 32, axis=1)
  return MXFP4Array.quantize(_rand(seed, (e, k, n), scale=k ** -0.5) * factor / 4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("k,n", [(512, 256), (1088, 200)])   # one tile; ragged K and N tiles
def test_mxfp4_kernels_match_the_dequantized_weights(dtype, k, n, race_states):
  rows, bm = 29, 8
  lay = _layout([7, 12, 0, 9], rows, bm)
  q = _mxfp4(3, 4, k, n)
  w = q.dequantize(dtype)
  xb = moe._pad(_rand(5, (rows, k), dtype, scale=0.05), lay)
  dy = _rand(6, (lay.num_blocks, bm, n), dtype)
  interp = RACES if k == 512 else True
  codes, scales = G.mxfp4_kernel_operands(q.codes, q.scales)

  out, vjp = jax.vjp(lambda a: G.block_matmul_mxfp4_tpu(a, codes, scales, lay.block_group,
                                                        lay.num_used, interp), xb)
  want, vjp_ref = jax.vjp(lambda a: moe.block_matmul(a, w, lay.block_group, lay.num_used), xb)
  scale = float(jnp.max(jnp.abs(want.astype(jnp.float32))))
  assert out.dtype == dtype
  _close(out / scale, want / scale, dtype, "y")
  (dxb,), (dxb_ref,) = vjp(dy), vjp_ref(dy)
  scale = float(jnp.max(jnp.abs(dxb_ref.astype(jnp.float32))))
  _close(dxb / scale, dxb_ref / scale, dtype, "dxb")
  if interp is RACES:
    assert race_states and not any(s.races_found for s in race_states)


def _mxfp4_problem(seed, e, d, f, m):
  """Tokens, top-2 routing and three MXFP4 expert matrices, with their dequantized values."""
  x = _rand(seed, (m, d))
  idx = jnp.asarray(np.random.default_rng(seed + 1).integers(0, e, (m, 2)))
  wts = jnp.abs(_rand(seed + 2, (m, 2)))
  q = [_mxfp4(seed + 3, e, d, f), _mxfp4(seed + 5, e, d, f), _mxfp4(seed + 7, e, f, d)]
  return x, idx, wts, q, [a.dequantize() for a in q]


@pytest.mark.parametrize("implementation", moe.IMPLEMENTATIONS)
def test_mxfp4_weights_on_every_implementation(implementation):
  """An ``MXFP4Array`` where a weight goes: the kernels read it packed, the other paths
  dequantize it; every one equals the dispatch over the dequantized matrices."""
  x, idx, wts, q, dq = _mxfp4_problem(7, e=4, d=64, f=96, m=21)
  want = moe.dense_experts(x, idx, wts, *dq)
  bs = 16 if implementation == "pallas_gpu" else 8
  got, _ = moe.routed_experts(x, idx, wts, *q, implementation=implementation, block_size=bs)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(want))))
  # the frozen weights pass no gradient; the input's equals the dequantized matrices'
  loss = lambda fn, x: jnp.sum(jnp.sin(fn(x)))
  g = jax.grad(lambda x: loss(lambda x: moe.routed_experts(
      x, idx, wts, *q, implementation=implementation, block_size=bs)[0], x))(x)
  g_ref = jax.grad(lambda x: loss(lambda x: moe.dense_experts(x, idx, wts, *dq), x))(x)
  np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(g_ref))))


def test_expert_parallel_kernels_with_mxfp4_weights():
  """``routed_experts_sharded`` runs the kernels per device (inside its ``shard_map``) with the
  MXFP4 codes and scales split over the experts: values and input gradients as one device."""
  x, idx, wts, q, dq = _mxfp4_problem(20, e=8, d=64, f=64, m=24)
  want = moe.dense_experts(x, idx, wts, *dq)
  g_ref = jax.grad(lambda x: jnp.sum(jnp.sin(moe.dense_experts(x, idx, wts, *dq))))(x)
  mesh = sharding.make_mesh({"expert": 4, "data": 2})
  fn = lambda x: moe.routed_experts_sharded(x, idx, wts, *q, implementation="pallas_tpu",
                                            block_size=8)
  with jax.set_mesh(mesh):
    got = jax.jit(fn)(x)
    g = jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(fn(x)))))(x)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(want))))
  np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(g_ref))))


def test_mxfp4_array_layout_and_errors():
  w = _rand(30, (2, 64, 48))
  q = MXFP4Array.quantize(w)
  # rows of K / 2 = 32 bytes padded with zeros to 128 (code_width); 2 scales a row
  assert q.codes.shape == (2, 48, 128) and q.scales.shape == (2, 48, 2) and q.shape == (2, 64, 48)
  assert q.blocks().shape == (2, 48, 2, 16) and not np.any(np.asarray(q.codes[..., 32:]))
  assert code_width(2880) == 1536 and code_width(4096) == 2048
  with pytest.raises(ValueError, match="`x` \\[M, D\\] and `w` \\[E, D, F\\]"):
    moe.grouped_matmul(jnp.ones((3, 32)), q, jnp.array([3, 0]), implementation="pallas_tpu")


def test_automatic_choice_on_a_tpu(monkeypatch):
  """On a TPU, MXFP4 weights go to the kernels (dequantizing them whole does not fit: see
  ``moe._auto_implementation``), bf16 weights to XLA's ragged_dot; elsewhere the blocked loop."""
  q = MXFP4Array.quantize(_rand(40, (2, 32, 8)))
  dense = jnp.ones((2, 32, 8))
  assert moe._check_implementation(None, dense, q) == "blocked"
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  assert moe._check_implementation(None, dense, q) == "pallas_tpu"
  assert moe._check_implementation(None, dense, dense) == "ragged_dot"
  assert moe._check_implementation("blocked", q) == "blocked"
  with pytest.raises(ValueError, match="`implementation` must be None or one of"):
    moe._check_implementation("megablox", q)


def test_model_with_mxfp4_experts_through_the_kernels():
  """``ModelConfig.moe_implementation="pallas_tpu"``: gpt-oss with MXFP4 experts gives the
  logits of the default dispatch (which dequantizes them); a bad name is refused."""
  from flax import nnx  # noqa: PLC0415

  from jaxattn.configs import get_config  # noqa: PLC0415
  from jaxattn.nn.model import DecoderLM  # noqa: PLC0415

  cfg = get_config("gpt-oss", embed_dim=64, mlp_dim=64, moe_expert_dim=64, head_dim=16,
                   num_layers=2, max_seq_len=32)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9)))
  logits = []
  for impl in (None, "pallas_tpu"):
    model = DecoderLM(cfg.replace(moe_implementation=impl), rngs=nnx.Rngs(0))
    model.quantize_experts()
    logits.append(model(tokens))
  np.testing.assert_allclose(logits[1], logits[0], atol=1e-4, rtol=1e-4)
  with pytest.raises(ValueError, match="`moe_implementation` must be None or one of"):
    cfg.replace(moe_implementation="megablox")


def test_token_local_dispatch_under_a_data_mesh():
  """Without an expert axis, ``routed_experts_sharded(expert_axis=None)`` runs the kernels per
  device on its own tokens (all experts everywhere, no exchange): values and gradients of the
  tokens, routing weights and expert matrices equal the single-device reference.  ``MoE`` takes
  that path for the Pallas implementations under such a mesh (its program holds a shard_map)."""
  from flax import nnx  # noqa: PLC0415

  from jaxattn.nn.moe import MoE  # noqa: PLC0415
  e, d, f, m = 4, 32, 64, 20       # 20 tokens over 8 shards: padded rows too
  x = _rand(50, (m, d))
  idx = jnp.asarray(np.random.default_rng(51).integers(0, e, (m, 2)))
  wts = jnp.abs(_rand(52, (m, 2)))
  ws = (_rand(53, (e, d, f), scale=d ** -0.5), _rand(54, (e, d, f), scale=d ** -0.5),
        _rand(55, (e, f, d), scale=f ** -0.5))

  def value_and_grads(fn):
    loss = lambda x, wts, *ws: jnp.sum(jnp.sin(fn(x, idx, wts, *ws)))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))(x, wts, *ws)

  want = value_and_grads(moe.dense_experts)
  mesh = sharding.make_mesh({"data": 4, "fsdp": 2})
  with jax.set_mesh(mesh):
    got = value_and_grads(lambda *a: moe.routed_experts_sharded(
        *a, expert_axis=None, implementation="pallas_tpu", block_size=8))
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  for g, r in zip(got[1], want[1]):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)

  layer = MoE(d, e, 2, f, implementation="pallas_tpu", block_size=8, rngs=nnx.Rngs(0))
  xs = _rand(56, (2, 10, d))
  ref, _ = layer(xs)
  with jax.set_mesh(mesh):
    out, _ = nnx.jit(lambda l, x: l(x))(layer, xs)
    jaxpr = str(jax.make_jaxpr(lambda x: layer(x)[0])(xs))
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
  assert "shard_map" in jaxpr


@pytest.mark.parametrize("implementation", moe.IMPLEMENTATIONS)
def test_factored_lora_weights_on_every_implementation(implementation):
  """``LoRAWeight(base, a, b, scaling)`` (dense or MXFP4 base) where a weight goes: values and
  the gradients of the tokens and the factors equal the dispatch over the merged matrices."""
  e, d, f, m, r = 4, 64, 96, 21, 4
  x = _rand(60, (m, d))
  idx = jnp.asarray(np.random.default_rng(61).integers(0, e, (m, 2)))
  wts = jnp.abs(_rand(62, (m, 2)))
  bases = [_mxfp4(63, e, d, f), _rand(64, (e, d, f), scale=d ** -0.5), _mxfp4(65, e, f, d)]
  factors = [(_rand(66 + i, (e, k, r), scale=0.3), _rand(70 + i, (e, r, n), scale=0.3))
             for i, (k, n) in enumerate(((d, f), (d, f), (f, d)))]
  bs = 16 if implementation == "pallas_gpu" else 8

  def loss(fn, x, factors):
    ws = [moe.LoRAWeight(base, a, b, 0.5) for base, (a, b) in zip(bases, factors)]
    return jnp.sum(jnp.sin(fn(x, ws)))

  got = jax.value_and_grad(lambda x, fs: loss(lambda x, ws: moe.routed_experts(
      x, idx, wts, *ws, implementation=implementation, block_size=bs)[0], x, fs),
      argnums=(0, 1))(x, factors)
  want = jax.value_and_grad(lambda x, fs: loss(lambda x, ws: moe.dense_experts(
      x, idx, wts, *[w.dense(jnp.float32) for w in ws]), x, fs), argnums=(0, 1))(x, factors)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-4)
  for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(w))))


def _values(jaxpr):
  """The avals of every value a jaxpr computes, nested jaxprs (jit, custom_vjp, scan...) too."""
  for eqn in jaxpr.eqns:
    yield from (v.aval for v in eqn.outvars)
    for p in eqn.params.values():
      for sub in (p if isinstance(p, (tuple, list)) else (p,)):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _values(inner)


def test_qlora_over_mxfp4_experts_never_materializes_them():
  """QLoRA on a MoE with MXFP4 experts through the kernels: the training step's program holds
  no ``[E, K, N]`` floating-point array (neither the dequantized experts nor the LoRA update),
  and its adapter gradients equal those of the XLA path that dequantizes."""
  from flax import nnx  # noqa: PLC0415

  from jaxattn.nn.lora import LoRAParam, apply_lora  # noqa: PLC0415
  from jaxattn.nn.moe import MoE  # noqa: PLC0415
  e, d, f = 4, 64, 128

  class Layer(nnx.Module):
    def __init__(self, impl):
      self.ffn = MoE(d, e, 2, f, implementation=impl, block_size=8, rngs=nnx.Rngs(0))

    def __call__(self, x):
      return self.ffn(x)

  grads = {}
  for impl in ("pallas_tpu", "blocked"):
    layer = Layer(impl)
    layer.ffn.quantize_experts()
    apply_lora(layer, r"ffn/w_(gate|up|down)$", rank=4, rngs=nnx.Rngs(1))
    for name in ("w_gate", "w_up", "w_down"):   # B = 0 at init: give the update some weight
      lora = getattr(layer.ffn, f"{name}_lora")
      lora.lora_b[...] = _rand(80, lora.lora_b.shape, scale=0.1)
    x = _rand(81, (2, 6, d))
    loss = lambda layer, x: jnp.sum(jnp.sin(layer(x)[0]))  # noqa: E731
    step = nnx.grad(loss, argnums=nnx.DiffState(0, LoRAParam))
    grads[impl] = step(layer, x)
    graphdef, state = nnx.split(layer)
    jaxpr = jax.make_jaxpr(lambda s, x: step(nnx.merge(graphdef, s), x))(state, x)
    big = [a for a in _values(jaxpr.jaxpr) if getattr(a, "shape", None) in ((e, d, f), (e, f, d))
           and jnp.issubdtype(a.dtype, jnp.floating)]
    # the XLA path dequantizes (the check sees it); the kernels' program holds none
    assert bool(big) == (impl == "blocked"), (impl, big)
  for g, w in zip(jax.tree.leaves(grads["pallas_tpu"]), jax.tree.leaves(grads["blocked"])):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
