"""MoE formulas: DeepSeek-V3 routing (seed example, groups, bias), balancing, grouped dispatch."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn import sharding
from jaxattn.ops import moe


def _rand(i, shape, scale=1.0):
  return jax.random.normal(jax.random.key(i), shape) * scale


# ---------------------------------------------------------------------------------------------
# Routing
# ---------------------------------------------------------------------------------------------


def test_seed_worked_example():
  # Four experts, top-2.  Expert 1 has the largest raw score, but its bias of -0.5 drops it to
  # 0.3 < 0.4, so experts 2 and 3 run; their UNBIASED scores 0.5 and 0.4 give 0.5/0.9 and 0.4/0.9.
  scores = jnp.array([0.2, 0.8, 0.5, 0.4])
  bias = jnp.array([0.0, -0.5, 0.0, 0.0])
  weights, idx = moe.select_experts(scores, bias, top_k=2)
  np.testing.assert_array_equal(idx, [2, 3])
  np.testing.assert_allclose(weights, [0.5 / 0.9, 0.4 / 0.9], rtol=1e-6)
  np.testing.assert_allclose(np.round(weights, 2), [0.56, 0.44])
  # Without the bias expert 1 wins: the bias is what changed the selection.
  w0, idx0 = moe.select_experts(scores, None, top_k=2)
  np.testing.assert_array_equal(idx0, [1, 2])
  np.testing.assert_allclose(w0, [0.8 / 1.3, 0.5 / 1.3], rtol=1e-6)
  # The same example through sigmoid logits.
  logits = jnp.log(scores / (1 - scores))
  r = moe.route(logits, bias, top_k=2, score_func="sigmoid")
  np.testing.assert_array_equal(r.indices, [2, 3])
  np.testing.assert_allclose(r.weights, [0.5 / 0.9, 0.4 / 0.9], rtol=1e-5)


def _numpy_select(scores, bias, top_k, n_group, topk_group, norm, factor):
  """Independent per-token loops of DeepSeek-V3's group-limited routing."""
  scores, bias = np.asarray(scores, np.float64), np.asarray(bias, np.float64)
  m, e = scores.shape
  per = e // n_group
  out_w, out_i = np.zeros((m, top_k)), np.zeros((m, top_k), int)
  for t in range(m):
    choice = scores[t] + bias
    gscore = [sorted(choice[g * per:(g + 1) * per])[-min(2, per):] for g in range(n_group)]
    gscore = np.array([sum(v) for v in gscore])
    groups = np.argsort(-gscore, kind="stable")[:topk_group]
    allowed = [i for i in range(e) if i // per in groups]
    sel = sorted(allowed, key=lambda i: -choice[i])[:top_k]
    w = scores[t, sel]
    if norm:
      w = w / w.sum()
    out_w[t], out_i[t] = w * factor, sel
  return out_w, out_i


@pytest.mark.parametrize("n_group,topk_group,top_k,norm", [(1, 1, 3, True), (4, 2, 3, True),
                                                           (8, 3, 2, False), (4, 1, 4, True)])
def test_group_limited_routing_matches_numpy(n_group, topk_group, top_k, norm):
  scores = jax.nn.sigmoid(_rand(0, (64, 16), 2.0))
  bias = _rand(1, (16,), 0.1)
  w, idx = moe.select_experts(scores, bias, top_k=top_k, n_group=n_group, topk_group=topk_group,
                              norm_topk_prob=norm, routed_scaling_factor=2.5)
  want_w, want_i = _numpy_select(scores, bias, top_k, n_group, topk_group, norm, 2.5)
  np.testing.assert_array_equal(idx, want_i)
  np.testing.assert_allclose(w, want_w, rtol=1e-5)
  if n_group > 1:
    # Every selected expert lies in one of `topk_group` groups.
    assert (np.array([len(set(row)) for row in np.asarray(idx) // (16 // n_group)])
            <= topk_group).all()


def test_bias_changes_selection_but_never_the_weights():
  scores = jax.nn.sigmoid(_rand(2, (256, 8)))
  bias = _rand(3, (8,), 0.1)
  select = jax.jit(lambda s, b: moe.select_experts(s, b, top_k=2))
  w, idx = select(scores, bias)
  w0, idx0 = select(scores, jnp.zeros_like(bias))
  changed = np.any(np.sort(idx, -1) != np.sort(idx0, -1), -1)
  assert 0.1 < changed.mean() < 0.9, changed.mean()  # the bias does move selections
  # Weights are always the unbiased scores of whatever was selected, normalized.
  s_sel = np.take_along_axis(np.asarray(scores), np.asarray(idx), -1)
  np.testing.assert_allclose(w, s_sel / s_sel.sum(-1, keepdims=True), rtol=1e-6)
  # Where the selected set is unchanged, each expert's weight is unchanged (order may differ).
  gate = lambda w, i: np.asarray(jnp.einsum("mke,mk->me", jax.nn.one_hot(i, 8), w))
  np.testing.assert_allclose(gate(w, idx)[~changed], gate(w0, idx0)[~changed], rtol=1e-6)
  # No gradient reaches the bias; the scores do get one.
  f = lambda s, b: jnp.sum(moe.select_experts(s, b, top_k=2)[0] * jnp.arange(2.0))
  gs, gb = jax.grad(f, argnums=(0, 1))(scores, bias)
  assert float(jnp.abs(gb).max()) == 0.0
  assert float(jnp.abs(gs).max()) > 0.0


def test_softmax_scores_and_unnormalized_weights():
  logits = _rand(4, (5, 6))
  r = moe.route(logits, top_k=2, score_func="softmax", norm_topk_prob=False,
                routed_scaling_factor=3.0)
  p = np.asarray(jax.nn.softmax(logits))
  np.testing.assert_allclose(r.scores, p, rtol=1e-6)
  np.testing.assert_array_equal(r.indices, np.argsort(-p, -1)[:, :2])
  np.testing.assert_allclose(r.weights, 3.0 * np.sort(p, -1)[:, ::-1][:, :2], rtol=1e-6)


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_experts=4, top_k=5), "top_k"),
    (dict(num_experts=6, top_k=2, n_group=4), "n_group"),
    (dict(num_experts=8, top_k=2, n_group=4, topk_group=5), "topk_group"),
    (dict(num_experts=8, top_k=5, n_group=4, topk_group=2), "top_k"),
    (dict(num_experts=8, top_k=0), "top_k"),
])
def test_routing_config_errors(kwargs, match):
  with pytest.raises(ValueError, match=match):
    moe.check_routing_config(**kwargs)
  e = kwargs.pop("num_experts")
  with pytest.raises(ValueError, match=match):
    moe.select_experts(jnp.ones((3, e)), **kwargs)


def test_routing_input_errors():
  with pytest.raises(ValueError, match="score_func"):
    moe.route(jnp.ones((2, 4)), top_k=1, score_func="relu")
  with pytest.raises(ValueError, match="bias"):
    moe.select_experts(jnp.ones((2, 4)), jnp.zeros((3,)), top_k=1)


# ---------------------------------------------------------------------------------------------
# Balancing
# ---------------------------------------------------------------------------------------------


def test_bias_update_moves_a_skewed_router_toward_balance():
  m, e, k = 2048, 16, 2
  # A skewed router: expert i's logits are shifted by 2 * i / e, so high ids are overloaded.
  logits = _rand(5, (m, e)) + 2.0 * jnp.arange(e) / e
  bias = jnp.zeros((e,))

  @jax.jit
  def step(bias):
    r = moe.route(logits, bias, top_k=k)
    load = moe.expert_load(r.indices, e)
    return moe.bias_update(bias, load, rate=0.002), moe.load_imbalance(load), load

  _, start, load0 = step(bias)
  # One step: the most loaded expert's bias falls, the least loaded one's rises.
  b1 = step(bias)[0]
  assert b1[int(jnp.argmax(load0))] < 0 < b1[int(jnp.argmin(load0))]
  history = []
  for _ in range(300):
    bias, imb, _ = step(bias)
    history.append(float(imb))
  assert float(start) > 2.0, start
  assert np.mean(history[-20:]) < 1.25, history[-20:]
  assert np.mean(history[-20:]) < 0.5 * float(start)


def test_bias_update_formula():
  b = jnp.array([0.1, 0.0, -0.2, 0.3])
  load = jnp.array([10.0, 2.0, 4.0, 4.0])  # mean 5
  np.testing.assert_allclose(moe.bias_update(b, load, rate=0.01), b + 0.01 * jnp.array([-1, 1, 1, 1]))
  np.testing.assert_allclose(moe.bias_update(b, jnp.full((4,), 3.0), rate=0.01), b)  # balanced


def test_expert_load_and_imbalance():
  idx = jnp.array([[0, 1], [0, 2], [0, 1]])
  np.testing.assert_allclose(moe.expert_load(idx, 4), [3, 2, 1, 0])
  np.testing.assert_allclose(moe.expert_load(idx, 4, jnp.array([True, False, True])), [2, 2, 0, 0])
  np.testing.assert_allclose(moe.load_imbalance(jnp.array([3.0, 2, 1, 0])), 3 / 1.5)


def test_sequence_balance_loss_matches_definition():
  b, t, e, k = 3, 10, 8, 2
  scores = jax.nn.sigmoid(_rand(6, (b, t, e)))
  idx = moe.select_experts(scores, top_k=k)[1]
  mask = jnp.arange(t)[None, :] < jnp.array([[10], [7], [3]])
  s, i, mk = np.asarray(scores, np.float64), np.asarray(idx), np.asarray(mask)
  want = []
  for bi in range(b):
    n = mk[bi].sum()
    f = np.zeros(e)
    for tt in range(t):
      if mk[bi, tt]:
        f[i[bi, tt]] += 1
    f *= e / (k * n)
    p = (s[bi] / s[bi].sum(-1, keepdims=True))[mk[bi]].sum(0) / n
    want.append((f * p).sum())
  np.testing.assert_allclose(moe.sequence_balance_loss(scores, idx, mask), np.mean(want), rtol=1e-5)
  # Uniform scores with a perfectly balanced selection give 1; all tokens on the same experts
  # with all the probability there give E / k.
  uni = jnp.full((1, 4, 4), 0.5)
  bal = jnp.array([[[0, 1], [2, 3], [0, 1], [2, 3]]])
  np.testing.assert_allclose(moe.sequence_balance_loss(uni, bal), 1.0, rtol=1e-6)
  peaked = jnp.tile(jnp.array([1.0, 1.0, 0.0, 0.0]), (1, 4, 1))
  np.testing.assert_allclose(moe.sequence_balance_loss(peaked, jnp.zeros((1, 4, 2), int) +
                                                       jnp.array([0, 1])), 2.0, rtol=1e-6)
  with pytest.raises(ValueError, match="scores"):
    moe.sequence_balance_loss(scores[0], idx[0])


def test_sequence_balance_loss_per_packed_sequence():
  """With segment ids, each sequence of a packed row is balanced on its own (DeepSeek-V3's loss
  is per sequence): equal to the loss over the sequences laid out as rows of their own."""
  e = 4   # (top-1 routing: idx below has one choice per token)
  # row 0: two sequences, each routed to a single expert (balanced only as a whole row);
  # row 1: sequences with arbitrary, non-contiguous ids (9, 3, 9) and two padding tokens
  idx = jnp.array([[0, 0, 0, 0, 1, 1, 1, 1], [2, 3, 2, 0, 1, 2, 0, 0]])[..., None]
  scores = jax.nn.sigmoid(_rand(7, (2, 8, e))) + 3 * jax.nn.one_hot(idx[..., 0], e)
  seg = jnp.array([[1, 1, 1, 1, 2, 2, 2, 2], [9, 9, 3, 3, 9, 3, 0, 0]])
  got = moe.sequence_balance_loss(scores, idx, seg > 0, seg)
  rows = []
  for r, sid in ((0, 1), (0, 2), (1, 9), (1, 3)):
    keep = np.asarray(seg[r] == sid)
    rows.append(moe.sequence_balance_loss(scores[r][keep][None], idx[r][keep][None]))
  np.testing.assert_allclose(got, np.mean(rows), rtol=1e-6)
  # row 0 is imbalanced per sequence (each uses one expert), far less so as one row
  per_seq, per_row = (float(moe.sequence_balance_loss(scores[:1], idx[:1], None, s))
                      for s in (seg[:1], None))
  assert per_seq > 1.5 * per_row
  # one segment per row is the row loss
  np.testing.assert_allclose(moe.sequence_balance_loss(scores, idx, None, jnp.ones((2, 8), int)),
                             moe.sequence_balance_loss(scores, idx), rtol=1e-6)
  with pytest.raises(ValueError, match="`segment_ids` must be an integer array"):
    moe.sequence_balance_loss(scores, idx, None, seg.astype(jnp.float32))
  with pytest.raises(ValueError, match=r"`token_mask` must be a bool array .* got dtype int"):
    moe.sequence_balance_loss(scores, idx, seg)   # segment ids are not a mask


def test_routing_argument_errors():
  s = jnp.full((2, 4), 0.5)
  for bad in (-1.0, float("nan"), 0.0, None):
    with pytest.raises(ValueError, match="`routed_scaling_factor` must be a finite number > 0"):
      moe.select_experts(s, top_k=1, routed_scaling_factor=bad)
  with pytest.raises(ValueError, match="`norm_topk_prob` must be a bool, got 'no'"):
    moe.select_experts(s, top_k=1, norm_topk_prob="no")
  for bad in (float("inf"), "1.0"):
    with pytest.raises(ValueError, match="`capacity_factor` must be a finite number > 0"):
      moe.expert_capacity(8, 4, 1, bad)
  with pytest.raises(ValueError, match="`rate` must be"):
    moe.bias_update(jnp.zeros(4), jnp.ones(4), rate=-1.0)
  with pytest.raises(ValueError, match="`token_mask` must be a bool array"):
    moe.expert_load(jnp.zeros((2, 1), jnp.int32), 4, jnp.ones((2,), jnp.int32))


def test_switch_loss_and_z_loss_match_numpy():
  logits = _rand(7, (40, 8))
  probs = jax.nn.softmax(logits)
  idx = moe.route(logits, top_k=2, score_func="softmax").indices
  p, i = np.asarray(probs, np.float64), np.asarray(idx)
  f = np.array([(i == j).sum() for j in range(8)]) / 40
  np.testing.assert_allclose(moe.switch_aux_loss(probs, idx), 8 * (f * p.mean(0)).sum(), rtol=1e-5)
  lse = np.log(np.exp(np.asarray(logits, np.float64)).sum(-1))
  np.testing.assert_allclose(moe.router_z_loss(logits), (lse ** 2).mean(), rtol=1e-5)
  mask = jnp.arange(40) < 25
  np.testing.assert_allclose(moe.router_z_loss(logits, mask), (lse[:25] ** 2).mean(), rtol=1e-5)
  with pytest.raises(ValueError, match="token_mask"):
    moe.router_z_loss(logits, mask[:10])


# ---------------------------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------------------------

E, D, F = 8, 16, 48   # multiples of 16: the Triton kernels' (pallas_gpu) smallest tile


def _bs(implementation, block_size):
  """``block_size`` for a test, at least a Triton dot tile (16 rows) for ``pallas_gpu``."""
  return max(block_size, 16) if implementation == "pallas_gpu" else block_size


def _experts(seed=10):
  return (_rand(seed, (E, D, F), D ** -0.5), _rand(seed + 1, (E, D, F), D ** -0.5),
          _rand(seed + 2, (E, F, D), F ** -0.5))


def _routing(m=48, k=2, seed=20, skew=0.0):
  r = moe.route(_rand(seed, (m, E)) + skew * jnp.arange(E), top_k=k)
  return _rand(seed + 1, (m, D)), r.indices, r.weights


@pytest.mark.parametrize("implementation", moe.IMPLEMENTATIONS)
def test_grouped_matmul_matches_per_row_numpy(implementation):
  group_sizes = jnp.array([3, 0, 5, 1, 0, 7, 2, 4])  # empty groups; 22 of 26 rows used
  x, w = _rand(30, (26, D)), _rand(31, (E, D, F))
  y = moe.grouped_matmul(x, w, group_sizes, implementation=implementation,
                         block_size=_bs(implementation, 4))
  gid = np.repeat(np.arange(E), np.asarray(group_sizes))
  want = np.zeros((26, F))
  for r, g in enumerate(gid):
    want[r] = np.asarray(x[r], np.float64) @ np.asarray(w[g], np.float64)
  np.testing.assert_allclose(y, want, atol=1e-5, rtol=1e-5)  # rows 22.. are exactly zero


def test_block_layout_pads_each_group_to_whole_blocks():
  lay = moe.block_layout(jnp.array([3, 0, 5, 1]), 10, 4)
  # Groups occupy blocks [0], [], [1, 2], [3]; row 9 is past the groups.
  np.testing.assert_array_equal(lay.position, [0, 1, 2, 4, 5, 6, 7, 8, 12, lay.num_blocks * 4])
  np.testing.assert_array_equal(lay.block_group[:4], [0, 2, 2, 3])
  assert int(lay.num_used) == 4 and lay.num_blocks == 3 + 4


def _value_and_grads(fn, x, idx, w, wg, wu, wd):
  """(output, grads of sum(sin(output)) w.r.t. x, weights and the expert matrices), one jit."""
  def f(x, w, wg, wu, wd):
    out = fn(x, idx, w, wg, wu, wd)
    out = out[0] if isinstance(out, tuple) else out
    return jnp.sum(jnp.sin(out)), out
  (_, out), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4), has_aux=True))(
      x, w, wg, wu, wd)
  return out, grads


def _assert_same(got, want):
  np.testing.assert_allclose(got[0], want[0], atol=2e-5, rtol=1e-5)
  for name, g, r in zip(("x", "weights", "w_gate", "w_up", "w_down"), got[1], want[1]):
    np.testing.assert_allclose(g, r, atol=5e-5, rtol=1e-4, err_msg=name)


@pytest.mark.parametrize("implementation", moe.IMPLEMENTATIONS)
def test_dropless_dispatch_equals_dense_every_expert_reference(implementation):
  x, idx, w = _routing(skew=0.3)
  args = (x, idx, w) + _experts()
  # Forward and gradients (x, routing weights, all expert matrices) against every-expert-and-mask.
  got = _value_and_grads(lambda *a: moe.routed_experts(*a, implementation=implementation,
                                                       block_size=_bs(implementation, 8)), *args)
  _assert_same(got, _dense_reference())


@functools.lru_cache(maxsize=None)
def _dense_reference():
  x, idx, w = _routing(skew=0.3)
  return _value_and_grads(moe.dense_experts, x, idx, w, *_experts())


def test_dense_reference_is_a_per_token_loop():
  x, idx, w = _routing(m=6)
  wg, wu, wd = (np.asarray(a, np.float64) for a in _experts())
  want = np.zeros((6, D))
  for t in range(6):
    for j in range(2):
      e = int(idx[t, j])
      h = np.asarray(x[t], np.float64)
      g = h @ wg[e]
      want[t] += float(w[t, j]) * ((g / (1 + np.exp(-g)) * (h @ wu[e])) @ wd[e])
  np.testing.assert_allclose(moe.dense_experts(x, idx, w, *_experts()), want, atol=1e-5)


@pytest.mark.parametrize("implementation", moe.IMPLEMENTATIONS)
def test_gpt_oss_experts_per_token_loop(implementation):
  """gpt-oss's experts (clamped SwiGLU, gate / up biases) on every dispatch path, the capacity
  path with room for everything and the dense reference: a per-token NumPy loop, with inputs
  large enough that the clamps bind; a row with no expert (-1) gives 0; gradients of the biases
  equal the dense reference's."""
  x, idx, w = _routing(m=10, seed=40)
  x = x * 4.0
  idx = idx.at[3, 1].set(-1)
  wg, wu, wd = _experts(seed=41)
  bg, bu = _rand(44, (E, F)), _rand(45, (E, F))
  act = moe.ClampedSwiGLU(alpha=1.702, limit=1.5)
  want = np.zeros((10, D))
  for t in range(10):
    for j in range(2):
      e = int(idx[t, j])
      if e < 0:
        continue
      h = np.asarray(x[t], np.float64)
      g = np.minimum(h @ np.asarray(wg[e]) + np.asarray(bg[e]), 1.5)
      u = np.clip(h @ np.asarray(wu[e]) + np.asarray(bu[e]), -1.5, 1.5)
      want[t] += float(w[t, j]) * (((u + 1) * g / (1 + np.exp(-1.702 * g))) @ np.asarray(wd[e]))
  assert np.abs(np.asarray(x) @ np.asarray(wg[0])).max() > 1.5   # the clamp binds
  kw = dict(activation=act, gate_up_bias=(bg, bu))
  got, _ = moe.routed_experts(x, idx, w, wg, wu, wd, implementation=implementation,
                              block_size=_bs(implementation, 4), **kw)
  np.testing.assert_allclose(got, want, atol=2e-5)
  cap, dropped = moe.routed_experts(x, idx, w, wg, wu, wd, capacity_factor=8.0, **kw)
  assert int(dropped) == 0
  np.testing.assert_allclose(cap, want, atol=2e-5)
  np.testing.assert_allclose(moe.dense_experts(x, idx, w, wg, wu, wd, **kw), want, atol=2e-5)

  def grads(fn):
    return jax.grad(lambda b0, b1: jnp.sum(jnp.sin(fn(b0, b1))), argnums=(0, 1))(bg, bu)
  g_got = grads(lambda b0, b1: moe.routed_experts(
      x, idx, w, wg, wu, wd, implementation=implementation, block_size=_bs(implementation, 4),
      activation=act, gate_up_bias=(b0, b1))[0])
  g_want = grads(lambda b0, b1: moe.dense_experts(x, idx, w, wg, wu, wd, activation=act,
                                                  gate_up_bias=(b0, b1)))
  for a, b in zip(g_got, g_want):
    np.testing.assert_allclose(a, b, atol=5e-5, rtol=1e-4)
  for cf in (None, 1.0):
    with pytest.raises(ValueError, match="`gate_up_bias` must be two"):
      moe.routed_experts(x, idx, w, wg, wu, wd, gate_up_bias=(bg[:, :3], bu), capacity_factor=cf)


def test_capacity_mode_drops_overflow_first_choices_first():
  m, k = 48, 2
  x, idx, w = _routing(m=m, k=k, skew=0.6)
  wg, wu, wd = _experts()
  # Ample capacity: nothing dropped, identical to dropless.
  y, dropped = moe.routed_experts(x, idx, w, wg, wu, wd, capacity_factor=float(E))
  assert int(dropped) == 0
  np.testing.assert_allclose(y, moe.dense_experts(x, idx, w, wg, wu, wd), atol=2e-5)
  # Capacity 1.0: C = 12 slots per expert. Simulate the priority rule (all first choices in token
  # order, then all second choices) independently and zero the weights of what overflows.
  cap = moe.expert_capacity(m, E, k, 1.0)
  assert cap == 12
  i = np.asarray(idx)
  used, keep = np.zeros(E, int), np.zeros((m, k), bool)
  for j, t in itertools.product(range(k), range(m)):
    keep[t, j] = used[i[t, j]] < cap
    used[i[t, j]] += 1
  assert (~keep).sum() > 0
  y, dropped = moe.routed_experts(x, idx, w, wg, wu, wd, capacity_factor=1.0)
  assert int(dropped) == (~keep).sum()
  want = moe.dense_experts(x, idx, jnp.where(keep, w, 0.0), wg, wu, wd)
  np.testing.assert_allclose(y, want, atol=2e-5)


def test_dispatch_errors():
  x, idx, w = _routing()
  wg, wu, wd = _experts()
  with pytest.raises(ValueError, match="implementation"):
    moe.routed_experts(x, idx, w, wg, wu, wd, implementation="cuda")
  with pytest.raises(ValueError, match="capacity_factor"):
    moe.routed_experts(x, idx, w, wg, wu, wd, capacity_factor=0.0)
  with pytest.raises(ValueError, match="want `x`"):
    moe.routed_experts(x, idx[:, :1], w, wg, wu, wd)
  with pytest.raises(ValueError, match="w_gate"):
    moe.routed_experts(x[:, :4], idx, w, wg, wu, wd)
  with pytest.raises(ValueError, match="`indices` must be an integer array"):
    moe.routed_experts(x, idx.astype(jnp.float32), w, wg, wu, wd)
  with pytest.raises(ValueError, match="expert weights"):
    moe.grouped_swiglu(x, jnp.zeros((E,), jnp.int32), wg, wu, wu)
  with pytest.raises(ValueError, match="group_sizes"):
    moe.grouped_matmul(x, wg, jnp.zeros((3,), jnp.int32))
  with pytest.raises(ValueError, match="block_size"):
    moe.grouped_matmul(x, wg, jnp.zeros((E,), jnp.int32), implementation="blocked", block_size=-4)


def test_expert_parallel_equals_single_device():
  mesh = sharding.make_mesh({"expert": 8})
  x, idx, w = _routing(m=64, skew=0.5)  # skewed: some devices receive far more than others
  args = (x, idx, w) + _experts()
  want = _value_and_grads(moe.dense_experts, *args)
  with jax.set_mesh(mesh):
    got = _value_and_grads(moe.routed_experts_sharded, *args)
  _assert_same(got, want)
  # Capacity mode under the same mesh: XLA partitions the [E, C, D] buffer, the result is unchanged.
  cap = jax.jit(lambda *a: moe.routed_experts(*a, capacity_factor=1.0))
  want_cap = cap(*args)
  with jax.set_mesh(mesh):
    got_cap = cap(*args)
  np.testing.assert_allclose(got_cap[0], want_cap[0], atol=2e-5)
  assert int(got_cap[1]) == int(want_cap[1]) > 0
  wg = args[3]
  # Experts that do not divide over the axis.
  with pytest.raises(ValueError, match="divisible"):
    moe.routed_experts_sharded(x, idx, w, wg[:6], wg[:6], args[5][:6], mesh=mesh)
  with pytest.raises(ValueError, match="no mesh"):
    moe.routed_experts_sharded(*args)


@pytest.mark.parametrize("m", [1, 3, 13])
@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_expert_parallel_pads_tokens_that_do_not_divide_over_the_shards(m, axis_type):
  # 8 token shards (data x expert) and M = 1 (a decode step), 3, 13: weight-0 padding rows fill the
  # shards; values and gradients (x, routing weights, expert matrices) stay the dense reference's.
  t = getattr(jax.sharding.AxisType, axis_type.capitalize())
  mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(t, t))
  x, idx, w = _routing(m=m, skew=0.5)
  args = (x, idx, w) + _experts()
  want = _value_and_grads(moe.dense_experts, *args)
  with jax.set_mesh(mesh):
    got = _value_and_grads(moe.routed_experts_sharded, *args)
  assert got[0].shape == (m, D) and got[1][0].shape == (m, D) and got[1][1].shape == idx.shape
  _assert_same(got, want)


def test_no_expert_marks_are_dropped_on_every_path():
  """``-1`` (or E) in ``indices`` adds nothing, as in ``dense_experts``: the dropless paths used to
  run it through expert 0 (``bincount`` counted it there) and capacity mode through the last
  expert; gradients match the dense reference too.  Zero tokens give an empty output (every
  path crashed in a reshape)."""
  x, idx, w = _routing(m=12)
  idx = idx.at[1, 1].set(-1).at[4, 0].set(E).at[7, 1].set(-5)
  args = (x, idx, w) + _experts()
  want = _value_and_grads(moe.dense_experts, *args)
  for impl in moe.IMPLEMENTATIONS:
    _assert_same(_value_and_grads(functools.partial(moe.routed_experts, implementation=impl,
                                                    block_size=_bs(impl, 8)), *args), want)
  _assert_same(_value_and_grads(functools.partial(moe.routed_experts, capacity_factor=8.0),
                                *args), want)
  mesh = sharding.make_mesh({"expert": 4, "data": 2})
  with jax.set_mesh(mesh):
    _assert_same(_value_and_grads(moe.routed_experts_sharded, *args), want)
  np.testing.assert_array_equal(moe.sort_by_expert(idx, E)[1].sum(), 12 * 2 - 3)
  empty = (jnp.zeros((0, D)), jnp.zeros((0, 2), jnp.int32), jnp.zeros((0, 2))) + _experts()
  for impl in moe.IMPLEMENTATIONS:
    assert moe.routed_experts(*empty, implementation=impl)[0].shape == (0, D)
  assert moe.routed_experts(*empty, capacity_factor=1.0)[0].shape == (0, D)


def test_bias_update_checks_its_load():
  with pytest.raises(ValueError, match=r"`load` \(2, 8\) must have the shape of `bias`"):
    moe.bias_update(jnp.zeros(E), jnp.ones((2, E)), rate=1e-3)
