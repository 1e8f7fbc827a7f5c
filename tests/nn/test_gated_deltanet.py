"""The GatedDeltaNet layer: decode equals the full pass, packed sequences, gates and initializations,
the causal convolution, gradients, sharding, errors.

Tolerances: fp32 at 2e-5 (the chunked and recurrent rule reassociate sums); bf16 compute against
fp32 at 5e-2 on unit-scale outputs (several bf16 roundings, 2^-8 each, through projections).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxattn import sharding
from jaxattn.nn import gated_deltanet as gdn
from jaxattn.nn.gated_deltanet import DeltaNetCache, GatedDeltaNet, causal_depthwise_conv

D = 32


def _layer(**kw):
  """A layer per configuration, built once: eager parameter initialization costs seconds on CPU
  (every initializer compiles); tests only read the parameters."""
  return _build(tuple(sorted(kw.items())))


@functools.lru_cache(maxsize=None)
def _build(items):
  cfg = dict(num_heads=4, num_key_heads=2, head_dim=8, v_head_dim=6, chunk_size=8)
  cfg.update(dict(items))
  return GatedDeltaNet(D, rngs=nnx.Rngs(0), **cfg)


@nnx.jit
def _fwd(layer, x):
  return layer(x)


def _x(t=13, b=2, seed=1):
  return jnp.asarray(np.random.default_rng(seed).standard_normal((b, t, D)), jnp.float32)


def test_prefill_then_decode_equals_full_pass():
  layer = _layer()
  x = _x()
  full = _fwd(layer, x)
  cache = layer.init_cache(batch=2)
  nbytes = cache.nbytes
  step = nnx.jit(lambda m, c, xt: m(xt, cache=c))
  y0, cache = step(layer, cache, x[:, :2])  # a prefill shorter than the conv window
  y1, cache = step(layer, cache, x[:, 2:6])
  outs = [y0, y1]
  for t in range(6, 13):
    yt, cache = step(layer, cache, x[:, t:t + 1])
    outs.append(yt)
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, atol=2e-5, rtol=2e-5)
  assert cache.nbytes == nbytes  # the decode state does not grow
  assert cache.state.dtype == jnp.float32


def test_cache_bytes_constant_and_counted():
  layer = _layer()
  cache = layer.init_cache(batch=3, dtype=jnp.bfloat16)
  assert cache.nbytes == layer.cache_bytes(10, batch=3) == layer.cache_bytes(10**6, batch=3)
  # 3 x (conv tails 3 x (2*2*8 + 4*6) bf16 + memory 4*8*6 fp32)
  assert cache.nbytes == 3 * (3 * (32 + 24) * 2 + 4 * 8 * 6 * 4)
  with pytest.raises(ValueError, match="`batch` must be >= 1"):
    DeltaNetCache.init(0, 4, 2, 8, 6)


def test_packed_sequences_equal_separate_runs():
  layer = _layer()
  n = 6   # three segments of 6: the second straddles the chunk boundary at 8
  x = _x(t=3 * n, b=1)
  seg = jnp.repeat(jnp.arange(3), n)[None]
  got = nnx.jit(lambda m, x, s: m(x, segment_ids=s))(layer, x, seg)
  want = jnp.concatenate([_fwd(layer, x[:, i * n:(i + 1) * n]) for i in range(3)], 1)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
  # Without the ids the later segments see the earlier ones (the test can fail).
  assert not np.allclose(_fwd(layer, x)[:, n:], got[:, n:], atol=1e-3)
  # A reused id starts a new sequence too, in the convolutions as in the memory: ids 0, 1, 0
  # give the same split as 0, 1, 2 (an equality test in the convolution would let the third
  # segment's first taps read the first segment).
  reused = jnp.asarray([0, 1, 0]).repeat(n)[None]
  got_reused = nnx.jit(lambda m, x, s: m(x, segment_ids=s))(layer, x, reused)
  np.testing.assert_allclose(got_reused, want, atol=2e-5, rtol=2e-5)


def test_recurrent_and_chunked_layer_agree():
  layer = _layer()
  x = _x()
  rec = nnx.jit(lambda m, x: m(x, implementation="recurrent"))(layer, x)
  np.testing.assert_allclose(rec, _fwd(layer, x), atol=2e-5, rtol=2e-5)


def test_reference_initializations():
  key = jax.random.key(0)
  a = np.exp(np.asarray(gdn._a_log_init(0.01, 16.0)(key, (4096,))))
  assert a.min() >= 0.01 and a.max() <= 16.0                         # A ~ U(0.01, 16)
  np.testing.assert_allclose(a.mean(), 8.005, atol=0.3)
  dt = np.asarray(jax.nn.softplus(gdn._dt_bias_init(1e-3, 0.1, 1e-4)(key, (4096,))))
  assert dt.min() >= 1e-3 * (1 - 1e-4) and dt.max() <= 0.1 * (1 + 1e-4)
  np.testing.assert_allclose(np.median(np.log10(dt)), -2.0, atol=0.1)  # log-uniform over 2 decades
  w = np.asarray(gdn._conv_init(4)(key, (4, 512)))
  assert np.abs(w).max() <= 0.5 and np.abs(w).max() > 0.49           # U(-1/sqrt(4), 1/sqrt(4))
  layer = _layer()
  np.testing.assert_array_equal(layer.norm_scale[...], 1.0)
  assert np.exp(np.asarray(layer.A_log[...])).max() <= 16.0


def test_gates():
  layer = _layer()
  g, beta = layer.gates(_x(t=5))
  assert g.dtype == beta.dtype == jnp.float32
  assert (np.asarray(g) < 0).all() and ((0 < np.asarray(beta)) & (np.asarray(beta) < 1)).all()
  # g = -exp(A_log) * softplus(a + dt_bias), by hand for one entry
  x = _x(t=1)
  a_in = np.asarray(layer.a_proj(x))[0, 0, 3]
  want = -np.exp(float(layer.A_log[...][3])) * np.logaddexp(0, a_in + float(layer.dt_bias[...][3]))
  np.testing.assert_allclose(layer.gates(x)[0][0, 0, 3], want, rtol=1e-5)


def test_causal_depthwise_conv_matches_numpy():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((2, 9, 3, 2)).astype(np.float32)
  w = rng.standard_normal((4, 3, 2)).astype(np.float32)
  got, tail = causal_depthwise_conv(jnp.asarray(x), jnp.asarray(w))
  want = np.zeros_like(x)
  for b in range(2):
    for c in range(3):
      for e in range(2):
        # np.convolve flips the kernel: w[3] multiplies the current token.
        want[b, :, c, e] = np.convolve(x[b, :, c, e], w[::-1, c, e])[:9]
  np.testing.assert_allclose(got, want, atol=1e-5)
  np.testing.assert_array_equal(tail, x[:, -3:])
  # A prefix continues the sequence.
  y2, _ = causal_depthwise_conv(jnp.asarray(x[:, 5:]), jnp.asarray(w), prefix=jnp.asarray(x[:, 2:5]))
  np.testing.assert_allclose(y2, want[:, 5:], atol=1e-5)
  # With segment ids the prefix still continues the first segment; taps stop at each id change.
  seg = jnp.asarray([[0, 0, 3, 3], [5, 5, 5, 5]])
  y3, _ = causal_depthwise_conv(jnp.asarray(x[:, 5:]), jnp.asarray(w),
                                prefix=jnp.asarray(x[:, 2:5]), segment_ids=seg)
  np.testing.assert_allclose(y3[1], want[1, 5:], atol=1e-5)
  np.testing.assert_allclose(y3[0, :2], want[0, 5:7], atol=1e-5)
  fresh, _ = causal_depthwise_conv(jnp.asarray(x[:1, 7:]), jnp.asarray(w))
  np.testing.assert_allclose(y3[0, 2:], fresh[0], atol=1e-5)


def test_gradients_reach_every_parameter():
  layer = _layer()
  x = _x()

  @nnx.jit
  def loss(m):
    return jnp.sum(m(x) ** 2)

  grads = nnx.jit(nnx.grad(loss))(layer)
  for path, g in nnx.to_flat_state(nnx.state(grads, nnx.Param)):
    g = np.asarray(g.get_value() if hasattr(g, "get_value") else g.value)
    assert np.isfinite(g).all() and np.abs(g).max() > 0, path


def test_bf16_compute_with_fp32_params():
  layer32 = _layer()
  layer16 = _layer(dtype=jnp.bfloat16)
  x = _x()
  y16 = _fwd(layer16, x.astype(jnp.bfloat16))
  assert y16.dtype == jnp.bfloat16
  assert layer16.q_proj.kernel[...].dtype == jnp.float32
  np.testing.assert_allclose(y16.astype(jnp.float32), _fwd(layer32, x), atol=5e-2, rtol=5e-2)


def test_parameters_carry_logical_axes_and_shard():
  layer = _layer(num_heads=8, num_key_heads=4)
  specs = dict(nnx.to_flat_state(sharding.param_specs(nnx.state(layer))))
  mesh = sharding.make_mesh({"fsdp": 2, "tensor": 4})
  spec_on_mesh = dict(nnx.to_flat_state(sharding.param_specs(nnx.state(layer), mesh=mesh)))
  assert spec_on_mesh[("q_proj", "kernel")] == P("fsdp", "tensor", None)
  assert spec_on_mesh[("v_proj", "kernel")] == P("fsdp", "tensor", None)
  assert spec_on_mesh[("o_proj", "kernel")] == P("tensor", None, "fsdp")
  assert spec_on_mesh[("conv_v",)] == P(None, "tensor", None)
  assert spec_on_mesh[("A_log",)] == P("tensor")
  assert len(specs) == len(spec_on_mesh)

  x = _x(b=4)
  want = _fwd(layer, x)
  sharded = layer  # placed on the mesh in place: same values, now sharded
  with jax.set_mesh(mesh):
    sharding.shard_module(sharded, mesh)
    assert sharded.q_proj.kernel[...].sharding.spec == P("fsdp", "tensor", None)
    xs = jax.device_put(x, jax.NamedSharding(mesh, P(("data", "fsdp"), None, None)))
    got = nnx.jit(lambda m, x: m(x))(sharded, xs)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


def test_errors():
  with pytest.raises(ValueError, match="`num_heads` \\(6\\) must be a multiple of `num_key_heads` \\(4\\)"):
    GatedDeltaNet(D, 6, 4, 8, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="`embed_dim` \\(32\\) is not divisible by `num_heads` \\(3\\)"):
    GatedDeltaNet(D, 3, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="`a_init_range`"):
    GatedDeltaNet(D, 4, a_init_range=(0.0, 16.0), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="`dt_min`"):
    GatedDeltaNet(D, 4, dt_min=0.2, dt_max=0.1, rngs=nnx.Rngs(0))
  for kw in (dict(conv_kernel_size=0), dict(conv_kernel_size=True), dict(conv_kernel_size=2.5),
             dict(num_heads=True), dict(num_key_heads=True), dict(embed_dim=0)):
    name, bad = next(iter(kw.items()))           # (True passed as 1, 2.5 was a TypeError)
    with pytest.raises(ValueError, match=f"`{name}` must be an int >= 1, got {bad!r}"):
      GatedDeltaNet(**{"embed_dim": D, "num_heads": 4, **kw}, rngs=nnx.Rngs(0))
  layer = _layer()
  with pytest.raises(ValueError, match="`segment_ids`.*cannot be combined"):
    layer(_x(t=3), segment_ids=jnp.zeros((2, 3), jnp.int32), cache=layer.init_cache(2))
  with pytest.raises(ValueError, match="`weight`"):
    causal_depthwise_conv(jnp.zeros((1, 3, 2)), jnp.zeros((4, 3)))
  with pytest.raises(ValueError, match="`prefix` must have shape"):
    causal_depthwise_conv(jnp.zeros((1, 3, 2)), jnp.zeros((4, 2)), prefix=jnp.zeros((1, 2, 2)))
  for bad in (jnp.zeros((2, 3, D - 4)), jnp.zeros((3, D)), jnp.zeros((1, 3, 2, D))):
    with pytest.raises(ValueError, match=rf"`x` must be \[B, T, D={D}\], got shape"):
      layer(bad)
  # Segment ids are checked before the convolution uses them (not a broadcasting error).
  with pytest.raises(ValueError, match=r"`segment_ids` must have shape \[B, T\] = \(2, 3\)"):
    layer(_x(t=3), segment_ids=jnp.zeros((2, 4), jnp.int32))
  with pytest.raises(ValueError, match="`segment_ids` must be integers"):
    causal_depthwise_conv(jnp.zeros((1, 3, 2)), jnp.zeros((4, 2)),
                          segment_ids=jnp.zeros((1, 3), jnp.float32))
  for name in ("head_dim", "v_head_dim"):
    with pytest.raises(ValueError, match=f"`{name}` must be (None or )?an int >= 1, got 0"):
      GatedDeltaNet(D, 4, **{name: 0}, rngs=nnx.Rngs(0))
  for kwargs, match in ((dict(chunk_size=48), "`chunk_size` must be a power of two"),
                        (dict(implementation="foo"), "`implementation` must be None or one of"),
                        (dict(norm_eps=-1.0), "`norm_eps` must be a number >= 0")):
    with pytest.raises(ValueError, match=match):   # at construction, not at the first call
      GatedDeltaNet(D, 4, **kwargs, rngs=nnx.Rngs(0))


def test_snapshot_call_keeps_the_cache_after_each_token():
  """``with_snapshots``: a T-token call returns the outputs and, per token, the cache that decode
  steps reach after it, bit for bit (``at(j)``); the plain chunk's outputs agree.  Refused: ``at``
  on a plain cache, snapshots of a ragged chunk."""
  layer = GatedDeltaNet(D, 4, 2, 8, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 9, D))
  _, cache = layer(x[:, :4], cache=layer.init_cache(2))
  y, snaps = layer(x[:, 4:], cache=cache.with_snapshots())
  assert snaps.snapshots and snaps.state.shape[:2] == (2, 6)
  for a, b in zip(jax.tree.leaves(snaps.at(0)), jax.tree.leaves(cache)):
    np.testing.assert_array_equal(a, b)
  step, after = cache, [cache]
  for j in range(5):
    yj, step = layer(x[:, 4 + j:5 + j], cache=step)
    after.append(step)
    np.testing.assert_array_equal(y[:, j], yj[:, 0])
    for a, b in zip(jax.tree.leaves(snaps.at(j + 1)), jax.tree.leaves(step)):
      np.testing.assert_array_equal(a, b)
  np.testing.assert_allclose(layer(x[:, 4:], cache=cache)[0], y, atol=1e-5)
  # per row, and ragged (row 0 reads 2 tokens; its snapshots past them repeat the second's)
  rows = snaps.at(jnp.array([3, 1]))
  for a, b0, b1 in zip(*(jax.tree.leaves(c) for c in (rows, after[3], after[1]))):
    np.testing.assert_array_equal(a[0], b0[0])
    np.testing.assert_array_equal(a[1], b1[1])
  y2, ragged = layer(x[:, 4:], cache=cache.with_snapshots(), num_tokens=jnp.array([2, 0]))
  np.testing.assert_array_equal(y2[0, :2], y[0, :2])
  assert not np.asarray(y2[0, 2:]).any() and not np.asarray(y2[1]).any()
  for a, b, c in zip(*(jax.tree.leaves(t) for t in (ragged.at(jnp.array([2, 0])),
                                                     after[2], cache))):
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], c[1])
  with pytest.raises(ValueError, match="not per-token snapshots"):
    cache.at(0)
