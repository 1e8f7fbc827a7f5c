"""Context parallelism: attention with the sequence split over the mesh axis ``context`` equals the
unsharded formula, forward, log-sum-exp and gradients, for both strategies."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxattn.ops import GlobalTokensMask, dot_product_attention, sliding_window
from jaxattn.ops.masks import SegmentMask
from jaxattn.ops import context_parallel as cp
from jaxattn.sharding import make_mesh

B, T, N, K, H = 2, 32, 4, 2, 16


def _inputs(dtype=jnp.float32, seed=0):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (B, T, N, H), dtype)
  k = jax.random.normal(ks[1], (B, T, K, H), dtype)
  v = jax.random.normal(ks[2], (B, T, K, H), dtype)
  return q, k, v, jax.random.normal(ks[3], (B, T, N, H), jnp.float32)


def _loss(q, k, v, d_out, **kw):
  out, lse = dot_product_attention(q, k, v, return_residuals=True, **kw)
  # the log-sum-exp is an output too (a caller may merge it): its cotangent is tested as well
  lse_term = jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)) * 0.25
  return jnp.sum(out.astype(jnp.float32) * d_out) + lse_term, (out, lse)


def _run(mesh, q, k, v, d_out, **kw):
  """(out, lse, grads) of the jitted loss, inputs split over the mesh (or not, ``mesh`` None)."""
  fn = jax.jit(jax.value_and_grad(lambda *a: _loss(*a, d_out, **kw), argnums=(0, 1, 2),
                                  has_aux=True))
  if mesh is None:
    (_, (out, lse)), grads = fn(q, k, v)
    return out, lse, grads, None
  with jax.set_mesh(mesh):
    spec = NamedSharding(mesh, P("data", "context"))
    args = [jax.device_put(x, spec) for x in (q, k, v)]
    (_, (out, lse)), grads = fn(*args)
    hlo = fn.lower(*args).compile().as_text()
  return out, lse, grads, hlo


def _close(got, want, tol):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  np.testing.assert_allclose(np.where(np.isfinite(want), got, 0), np.where(np.isfinite(want),
                             want, 0), rtol=tol, atol=tol)
  np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))


def _close_results(got, want, tols):
  """Each result (an array or a tuple of gradients) against its reference, at its tolerance."""
  for g, w, tol in zip(got, want, tols):
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(w)):
      _close(a, b, tol)


SEG = np.repeat(np.array([[0] * 13 + [1] * 19]), B, 0).astype(np.int32)
CASES = {
    "causal": dict(is_causal=True),
    "bidirectional": dict(),
    "causal_window": dict(is_causal=True, local_window_size=5),
    "two_sided_window": dict(local_window_size=(3, 9)),
    "segments_alibi_softcap": dict(is_causal=True, segment_ids=SEG, logits_soft_cap=4.0,
                                   alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625], np.float32)),
    "lengths": dict(is_causal=True, kv_lengths=np.array([21, 32], np.int32)),
}


# Both strategies on every case (load balancing where it applies: causal masks); the contiguous
# layouts (load_balance=False) on the causal cases, where they differ from the default.
COMBOS = ([(case, strategy, None) for case in CASES for strategy in ("all_gather", "ring")]
          + [(case, strategy, False) for case in ("causal", "lengths")
             for strategy in ("all_gather", "ring")])


@pytest.mark.parametrize("case,strategy,load_balance", COMBOS)
def test_matches_the_unsharded_formula(case, strategy, load_balance):
  """fp32, GQA (4 query heads on 2 KV heads), 8 rows per device; the segment boundary (13) and
  the window radii fall inside devices' chunks."""
  kw = CASES[case]
  q, k, v, d_out = _inputs()
  out0, lse0, g0, _ = _run(None, q, k, v, d_out, **kw)
  mesh = make_mesh({"data": 2, "context": 4})
  with cp.set_options(strategy=strategy, load_balance=load_balance):
    out, lse, grads, hlo = _run(mesh, q, k, v, d_out, **kw)
  _close_results((out, lse, grads), (out0, lse0, g0), (2e-5, 2e-5, 5e-5))
  # the strategy's collectives are in the program: gathered keys, or a ring of permutes
  if strategy == "all_gather":
    assert "all-gather" in hlo
    swapped = "collective-permute" in hlo
    assert swapped == (load_balance is None and case in ("causal", "lengths",
                                                         "segments_alibi_softcap")), case
  else:
    assert "collective-permute" in hlo and "all-gather" not in hlo
  # without a position mask or ALiBi one program serves every device: no per-device branches
  assert (" conditional(" in hlo) == (case != "bidirectional"), case


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_bf16_and_heads_split_over_tensor(strategy):
  """bf16 inputs on a data x context x tensor mesh (heads split two ways inside each context
  group); tolerances of bf16 outputs (8 bits of mantissa)."""
  q, k, v, d_out = _inputs(jnp.bfloat16, seed=1)
  out0, lse0, g0, _ = _run(None, q, k, v, d_out, is_causal=True)
  mesh = make_mesh({"data": 2, "context": 2, "tensor": 2})
  with cp.set_options(strategy=strategy):
    out, lse, grads, _ = _run(mesh, q, k, v, d_out, is_causal=True)
  _close(out, out0, 2e-2)
  _close(lse, lse0, 1e-2)
  for a, b in zip(grads, g0):
    scale = float(np.abs(np.asarray(b, np.float32)).max())
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               atol=3e-2 * scale)


def test_dense_bias_and_global_tokens_with_all_gather():
  """A dense [1, N, T, S] bias (e.g. T5's) is split with the queries' rows; a Longformer mask
  (absolute positions: global tokens 0 and 17) sees the gathered keys in their own coordinates."""
  q, k, v, d_out = _inputs(seed=2)
  bias = jax.random.normal(jax.random.key(9), (1, N, T, T))
  mask = sliding_window(3, causal=False) | GlobalTokensMask((0, 17))
  mesh = make_mesh({"data": 2, "context": 4})
  for kw in (dict(bias=bias, is_causal=True), dict(mask=mask)):
    out0, lse0, g0, _ = _run(None, q, k, v, d_out, **kw)
    out, lse, grads, hlo = _run(mesh, q, k, v, d_out, **kw)
    assert "all-gather" in hlo
    _close_results((out, lse, grads), (out0, lse0, g0), (2e-5, 2e-5, 5e-5))


@pytest.mark.parametrize("strategy,load_balance,kw", [
    ("all_gather", None, dict(is_causal=True)),
    ("ring", None, dict(is_causal=True)),              # zigzag layout
    ("ring", False, dict(is_causal=True, local_window_size=5)),  # contiguous, shortened ring
    ("ring", None, dict(segment_ids=SEG, logits_soft_cap=4.0)),
])
def test_dense_bias_and_mask_array_on_both_strategies(strategy, load_balance, kw):
  """A learned bias shared over the batch ``[1, N, T, T]`` and a boolean mask array per row
  ``[B, 1, T, T]`` (with a row that sees no key): both split with the query rows, each block
  reading its keys' columns (the ring: the chunk's, in the zigzag layout the two half-chunks'),
  the bias' gradient added into its own rows' columns on the device; outputs, log-sum-exp and
  every gradient, the bias' included, equal the unsharded formula's.  The ring gathers nothing."""
  q, k, v, d_out = _inputs(seed=4)
  bias = jax.random.normal(jax.random.key(10), (1, N, T, T))
  allowed = jax.random.uniform(jax.random.key(11), (B, 1, T, T)) < 0.7
  allowed = allowed.at[1, :, 9].set(False)

  def loss(q, k, v, bias):
    return _loss(q, k, v, d_out, bias=bias, mask=allowed, **kw)

  fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
  (_, (out0, lse0)), g0 = fn(q, k, v, bias)
  mesh = make_mesh({"data": 2, "context": 4})
  with jax.set_mesh(mesh), cp.set_options(strategy=strategy, load_balance=load_balance):
    args = [jax.device_put(x, NamedSharding(mesh, P("data", "context"))) for x in (q, k, v)]
    (_, (out, lse)), grads = fn(*args, bias)
    hlo = fn.lower(*args, bias).compile().as_text()
  assert ("all-gather" in hlo) == (strategy == "all_gather")
  assert np.all(np.asarray(lse0[1, :, 9]) == -np.inf)
  assert float(jnp.abs(g0[3]).max()) > 0.05
  _close_results((out, lse, grads), (out0, lse0, g0), (2e-5, 2e-5, 5e-5))


@pytest.mark.parametrize("strategy,load_balance,kw", [
    ("all_gather", None, dict(is_causal=True)),
    ("ring", None, dict(is_causal=True)),              # zigzag layout
    ("ring", False, dict(segment_ids=SEG)),            # contiguous, packed sequences
])
def test_key_padding_mask_joins_the_segment_ids(strategy, load_balance, kw):
  """A key-padding mask ``[B, 1, 1, T]`` (left padding on row 0, a hole on row 1) is not
  and'ed into a dense view per block: each block's chunk of it joins the segment ids (a masked
  key gets an id no query has).  Results and gradients equal the unsharded formula's."""
  q, k, v, d_out = _inputs(seed=6)
  keep = np.ones((B, 1, 1, T), bool)
  keep[0, ..., :7] = False
  keep[1, ..., 20:26] = False
  keep = jnp.asarray(keep)
  # (cp._block_mask: no dense view, the ids carry the mask)
  cfg = cp._Config(size=4, t=8, band=None, static=None)
  mask = cp._block_mask(cfg, None, None, None, keep, rows=8, cols=T, batch=B)
  assert isinstance(mask, SegmentMask)

  def loss(q, k, v):
    return _loss(q, k, v, d_out, mask=keep, **kw)

  fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
  (_, (out0, lse0)), g0 = fn(q, k, v)
  mesh = make_mesh({"data": 2, "context": 4})
  with jax.set_mesh(mesh), cp.set_options(strategy=strategy, load_balance=load_balance):
    args = [jax.device_put(x, NamedSharding(mesh, P("data", "context"))) for x in (q, k, v)]
    (_, (out, lse)), grads = fn(*args)
  assert np.all(np.asarray(lse0[0, :, :7]) == -np.inf) == bool(kw.get("is_causal"))
  _close_results((out, lse, grads), (out0, lse0, g0), (2e-5, 2e-5, 5e-5))


def test_load_balancing_gives_every_device_the_same_work():
  """Under a causal mask, device c's rows read (c + 1) t keys without balancing: its work (query
  rows x keys read) grows with c.  With the swap of query halves every device does the same work,
  h (C t + h), about half the last device's unbalanced t (C t) -- from the key ranges the
  per-device programs read (``_key_range``)."""
  size, t = 8, 16
  h = t // 2
  cfg = cp._Config(size=size, t=t, band=(float("inf"), 0.0))
  width = lambda start, rows: np.subtract(*cp._key_range(cfg, start, rows, size * t)[::-1])  # noqa
  plain = [t * width(c * t, t) for c in range(size)]
  assert plain == [t * (c + 1) * t for c in range(size)]
  balanced = [h * width(c * t, h) + h * width((size - c) * t - h, h) for c in range(size)]
  assert balanced == [h * (size * t + h)] * size
  assert max(balanced) / max(plain) == pytest.approx((2 * size + 1) / (4 * size))


def test_zigzag_ring_gives_every_device_the_same_work_at_every_step():
  """The balanced ring: at every step every device computes about 2 h^2 query-key pairs (two full
  half-pairs, or the two diagonals and one full half-pair), half of the t^2 that the contiguous
  ring's busiest device computes at every step under a causal mask."""
  for size in (2, 4, 8):
    t = 16
    h = t // 2
    cfg = cp._Config(size=size, t=t, band=(float("inf"), 0.0), load_balance=True,
                     position_free=False)
    blocks, _ = cp._ring_plan(cfg)
    work = {cp._NONE: 0, cp._DIAGONAL: h * (h + 1) // 2, cp._FULL: h * h}
    for c in range(size):
      for j in range(size):
        kinds = [cp._pair_kind(qi, ki) for qi in (2 * c, 2 * size - 1 - 2 * c)
                 for ki in (2 * j, 2 * size - 1 - 2 * j)]
        cost = sum(work[x] for x in kinds)
        assert cost == (2 * h * h if j != c else h * (h + 1) + h * h), (size, c, j, kinds)
    # the contiguous ring: device c computes a whole block at every step s in 1..c
    plain = cp._Config(size=size, t=t, band=(float("inf"), 0.0), load_balance=False,
                       position_free=False)
    blocks, _ = cp._ring_plan(plain)
    assert [b is None for b in blocks] == [d < 0 for d in cp._distances(plain)]


def test_other_calls_under_a_context_mesh_take_the_usual_path():
  """Decode-like calls (T != S, an offset) are not context-parallel; they still compute the
  formula under the mesh."""
  q, k, v, _ = _inputs(seed=3)
  mesh = make_mesh({"data": 2, "context": 4})
  q1 = q[:, :4]
  want = dot_product_attention(q1, k, v, is_causal=True, q_offset=28)
  with jax.set_mesh(mesh):
    got = jax.jit(lambda q, k, v: dot_product_attention(q, k, v, is_causal=True, q_offset=28))(
        q1, k, v)
  _close(got, want, 2e-5)
  assert cp.unsupported(q1, k, bias=None, mask_array=None, q_offset=0, scale=0.25, size=4,
                        strategy="all_gather") == "it is not self-attention (T=4, S=32)"
  # What the configured strategy cannot compute falls back too (the explicit entry point raises,
  # test_errors): the ring and a Longformer mask; a forced load_balance applies where it can.
  mask = sliding_window(2, causal=False) | GlobalTokensMask((5,))
  want = dot_product_attention(q, k, v, mask=mask)
  for opts in (dict(strategy="ring"), dict(strategy="all_gather", load_balance=True)):
    with jax.set_mesh(mesh), cp.set_options(**opts):
      got = jax.jit(lambda q, k, v: dot_product_attention(q, k, v, mask=mask))(q, k, v)
    _close(got, want, 2e-5)


def test_errors():
  q, k, v, _ = _inputs()
  mesh = make_mesh({"data": 2, "context": 4})
  with pytest.raises(ValueError, match="`strategy` must be one of"):
    cp.set_options(strategy="ulysses")
  with pytest.raises(ValueError, match="`load_balance` must be a bool"):
    cp.set_options(load_balance="yes")
  with pytest.raises(ValueError, match="`mesh` must have a `context` axis"):
    cp.context_parallel_attention(q, k, v, is_causal=True)
  with pytest.raises(ValueError, match="`mesh` must have a `context` axis"):
    cp.context_parallel_attention(q, k, v, mesh=make_mesh({"data": 8}))
  with pytest.raises(ValueError, match="T=30 is not a multiple of the context axis size 4"):
    cp.context_parallel_attention(q[:, :30], k[:, :30], v[:, :30], mesh=mesh)
  with pytest.raises(ValueError, match="ring strategy takes band masks"):
    cp.context_parallel_attention(q, k, v, mask=GlobalTokensMask((0,)), strategy="ring",
                                  mesh=mesh)
  with pytest.raises(ValueError, match="`load_balance` needs a causal mask"):
    cp.context_parallel_attention(q, k, v, is_causal=True, strategy="ring", load_balance=True,
                                  alibi_slopes=np.ones(N, np.float32), mesh=mesh)
  with pytest.raises(ValueError, match="`load_balance` needs a causal mask"):
    cp.context_parallel_attention(q, k, v, load_balance=True, mesh=mesh)
  # set_options restores the previous options as a context manager
  with cp.set_options(strategy="ring", load_balance=False):
    assert cp.get_options() == {"strategy": "ring", "load_balance": False}
  assert cp.get_options() == {"strategy": "all_gather", "load_balance": None}


def test_explicit_call_with_a_mesh_argument():
  """``context_parallel_attention(..., mesh=)`` outside ``jax.set_mesh``, ring strategy."""
  q, k, v, _ = _inputs(seed=4)
  mesh = make_mesh({"data": 2, "context": 4})
  want = dot_product_attention(q, k, v, is_causal=True)
  spec = NamedSharding(mesh, P("data", "context"))
  args = [jax.device_put(x, spec) for x in (q, k, v)]
  got = jax.jit(lambda q, k, v: cp.context_parallel_attention(
      q, k, v, is_causal=True, strategy="ring", mesh=mesh))(*args)
  _close(got, want, 2e-5)


# ----------------------------------------------------------------------------------------------
# The gated delta rule (Gated DeltaNet layers) under a context axis
# ----------------------------------------------------------------------------------------------


def _delta_inputs(dtype, seed=0, b=2, t=40, kh=2, n=4, hk=8, hv=6):
  from jax.nn import sigmoid, softplus
  ks = jax.random.split(jax.random.key(seed), 8)
  q = jax.random.normal(ks[0], (b, t, kh, hk), dtype)
  k = jax.random.normal(ks[1], (b, t, kh, hk), dtype)
  v = jax.random.normal(ks[2], (b, t, n, hv), dtype)
  g = -softplus(jax.random.normal(ks[3], (b, t, n))).astype(dtype)
  beta = sigmoid(jax.random.normal(ks[4], (b, t, n))).astype(dtype)
  s0 = jax.random.normal(ks[5], (b, n, hk, hv))
  d_out = jax.random.normal(ks[6], (b, t, n, hv))
  d_state = jax.random.normal(ks[7], (b, n, hk, hv))
  return (q, k, v, g, beta, s0), d_out, d_state


def _delta_run(mesh, args, d_out, d_state, **kw):
  from jaxattn.ops.delta_rule import gated_delta_rule

  def loss(q, k, v, g, beta, s0):
    out, final = gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                  use_qk_l2norm=True, chunk_size=4, **kw)
    return (jnp.sum(out.astype(jnp.float32) * d_out) + jnp.sum(final * d_state), (out, final))

  fn = jax.jit(jax.value_and_grad(loss, argnums=range(6), has_aux=True))
  if mesh is None:
    (_, (out, final)), grads = fn(*args)
    return out, final, grads, None
  with jax.set_mesh(mesh):
    split = NamedSharding(mesh, P("data", "context"))
    placed = [jax.device_put(x, split) for x in args[:5]] + [args[5]]
    (_, (out, final)), grads = fn(*placed)
    hlo = fn.lower(*placed).compile().as_text()
  return out, final, grads, hlo


@pytest.mark.parametrize("segments", [False, True])
def test_delta_rule_matches_the_unsharded_rule(segments):
  """fp32, 40 tokens over 4 devices (chunks of 4 inside each), GQA-style 4 value heads on 2 key
  heads, an initial memory; packed sequences starting at a device boundary (10) and inside a
  device (23).  Outputs, final memory and every gradient (the initial memory's too) match."""
  args, d_out, d_state = _delta_inputs(jnp.float32)
  ids = np.repeat(np.array([[0] * 10 + [1] * 13 + [2] * 17]), 2, 0).astype(np.int32)
  kw = dict(segment_ids=jnp.asarray(ids)) if segments else {}
  out0, final0, g0, _ = _delta_run(None, args, d_out, d_state, **kw)
  mesh = make_mesh({"data": 2, "context": 4})
  out, final, grads, hlo = _delta_run(mesh, args, d_out, d_state, **kw)
  # only the chunks' [B, N, H, H + h] transitions are gathered, never the sequence
  assert "all-gather" in hlo
  _close_results((out, final, grads), (out0, final0, g0), (1e-5, 1e-5, 2e-5))


def test_delta_rule_bf16_with_heads_over_tensor():
  args, d_out, d_state = _delta_inputs(jnp.bfloat16, seed=5, t=32)
  out0, final0, g0, _ = _delta_run(None, args, d_out, d_state)
  mesh = make_mesh({"data": 2, "context": 2, "tensor": 2})
  out, final, grads, _ = _delta_run(mesh, args, d_out, d_state)
  _close(out, out0, 2e-2)
  _close(final, final0, 1e-3)   # fp32 memory from the same bf16 inputs
  for a, b in zip(grads, g0):
    scale = float(np.abs(np.asarray(b, np.float32)).max())
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               atol=2e-2 * scale)


def test_gated_deltanet_layer_under_a_context_axis():
  """The Gated DeltaNet module on a context mesh (its causal convolution left to XLA's
  partitioning, its rule to ``context_parallel.delta_rule``): output and parameter gradients equal
  the unsharded layer's, packed sequences included."""
  from flax import nnx

  from jaxattn.nn import GatedDeltaNet
  layer = GatedDeltaNet(32, num_heads=4, num_key_heads=2, head_dim=8, chunk_size=4,
                        rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 24, 32))
  ids = jnp.asarray(np.repeat(np.array([[0] * 9 + [1] * 15]), 2, 0).astype(np.int32))
  d_y = jax.random.normal(jax.random.key(2), (2, 24, 32))

  @nnx.jit
  def run(layer, x):
    def loss(layer):
      y = layer(x, segment_ids=ids)
      return jnp.sum(y * d_y), y
    (_, y), grads = nnx.value_and_grad(loss, has_aux=True)(layer)
    return y, grads

  y0, g0 = run(layer, x)
  mesh = make_mesh({"data": 2, "context": 4})
  calls = []
  real = cp.delta_rule
  cp.delta_rule = lambda *a, **kw: calls.append(kw["size"]) or real(*a, **kw)
  try:
    with jax.set_mesh(mesh):
      y, grads = run(layer, jax.device_put(x, NamedSharding(mesh, P("data", "context"))))
  finally:
    cp.delta_rule = real
  assert calls == [4]
  _close(y, y0, 2e-5)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(g0)):
    _close(a, b, 5e-5)


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_learned_alibi_slopes_and_bias_get_their_gradients(strategy):
  """ALiBi slopes (replicated over the context axis) and a dense bias (split with the query rows)
  are differentiated: each device's share is summed.  (The ring's custom VJP used to treat the
  slopes as constants: a zero gradient.)"""
  q, k, v, d_out = _inputs(seed=6)
  slopes = jnp.array([0.5, 0.25, 0.125, 0.0625])
  bias = jax.random.normal(jax.random.key(7), (1, N, T, T))

  def loss(q, k, v, slopes, bias):
    out = dot_product_attention(q, k, v, bias=bias, alibi_slopes=slopes, is_causal=True)
    return jnp.sum(out * d_out)

  argnums = (3, 4)
  want = jax.grad(loss, argnums=argnums)(q, k, v, slopes, bias)
  mesh = make_mesh({"data": 2, "context": 4})
  with jax.set_mesh(mesh), cp.set_options(strategy=strategy):
    split = NamedSharding(mesh, P("data", "context"))
    args = [jax.device_put(x, split) for x in (q, k, v)]
    got = jax.jit(jax.grad(loss, argnums=argnums))(*args, slopes, bias)
  assert float(jnp.abs(want[0]).max()) > 1.0
  _close_results(got, want, (5e-5, 5e-5))


@pytest.mark.parametrize("load_balance", [None, False])
def test_ring_backward_runs_no_block_forward(load_balance):
  """The ring's backward pass differentiates each block from the rows' whole output and
  log-sum-exp (``attention_gradients``): the program of the gradient holds the forward ring's
  kernel calls and no more (the native CPU kernels, zigzag and contiguous layouts)."""
  from jaxattn import native
  if not native.available():
    pytest.skip(native.reason())
  q, k, v, d_out = _inputs(seed=5)
  mesh = make_mesh({"data": 2, "context": 4})
  attend = lambda q, k, v: dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
  loss = lambda q, k, v: jnp.sum(attend(q, k, v) * d_out)  # noqa: E731
  with jax.set_mesh(mesh), cp.set_options(strategy="ring", load_balance=load_balance):
    args = [jax.device_put(x, NamedSharding(mesh, P("data", "context"))) for x in (q, k, v)]
    forward = str(jax.make_jaxpr(attend)(*args))
    grad = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(*args))
  fwd, bwd = "jaxattn_flash_attention_fwd_f32", "jaxattn_flash_attention_bwd_f32"
  assert forward.count(fwd) > 0 and bwd not in forward
  assert grad.count(fwd) == forward.count(fwd)
  assert grad.count(bwd) > 0


def test_ring_under_a_causal_window_stops_when_no_key_is_left():
  """A causal window of 5 keys over chunks of 8 rows: only the own and the previous chunk hold
  visible keys, so the ring runs 2 steps of 4 (forward and backward scans), and the results
  (checked against the formula in ``test_matches_the_unsharded_formula``) stay exact: here with
  a window of 9 (3 steps) and the gradients."""
  q, k, v, d_out = _inputs(seed=6)
  assert [cp._ring_steps(4, 8, (w, 0.0), False) for w in (0, 5, 8, 9, 30)] == [1, 2, 2, 3, 4]
  assert cp._ring_steps(4, 8, (5.0, 0.0), True) == 4 and cp._ring_steps(4, 8, (3, 9), False) == 4
  kw = dict(is_causal=True, local_window_size=9)
  out0, lse0, g0, _ = _run(None, q, k, v, d_out, **kw)
  mesh = make_mesh({"data": 2, "context": 4})
  with cp.set_options(strategy="ring"):
    out, lse, grads, _ = _run(mesh, q, k, v, d_out, **kw)
    with jax.set_mesh(mesh):
      args = [jax.device_put(x, NamedSharding(mesh, P("data", "context"))) for x in (q, k, v)]
      jaxpr = str(jax.make_jaxpr(jax.grad(lambda *a: _loss(*a, d_out, **kw)[0],
                                          argnums=(0, 1, 2)))(*args))
  _close_results((out, lse, grads), (out0, lse0, g0), (2e-5, 2e-5, 5e-5))
  assert jaxpr.count("length=3") == 2 and "length=4" not in jaxpr
