"""Multi-token prediction: depth k at position i predicts token i + k + 1 from tokens <= i + k
alone; packed documents do not see each other; the loss adds lambda / D * sum_k CE_k and leaves
the model's own gradients alone at lambda = 0; MoE modules' router biases are balanced too."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxattn.nn.model import DecoderLM, ModelConfig
from jaxattn.nn.mtp import mtp_layer_kind
from jaxattn.train.step import loss_fn, model_flops_per_token, mtp_targets, split_model

BASE = dict(vocab_size=40, embed_dim=32, num_layers=2, num_heads=2, mlp_dim=64)


def _model(**kw):
  return DecoderLM(ModelConfig(**{**BASE, **kw}), rngs=nnx.Rngs(0))


def _depth_logits(model, tokens, **kw):
  hidden = model(tokens, return_hidden=True, **kw)
  return model.mtp_forward(hidden, tokens, **kw)


@pytest.mark.parametrize("kw", [dict(), dict(layer_pattern="M", num_experts=4, first_k_dense=1)])
def test_depth_k_sees_tokens_up_to_i_plus_k(kw):
  """Changing token j moves depth k's logits at position j - k (its embedding enters there) and
  nothing before it."""
  model = _model(mtp_depth=2, **kw)
  tokens = jnp.asarray(np.random.RandomState(0).randint(0, 40, (1, 12)))
  j = 8
  base = _depth_logits(model, tokens)
  moved = _depth_logits(model, tokens.at[0, j].set((tokens[0, j] + 1) % 40))
  assert len(base) == 2
  for k, (a, b) in enumerate(zip(base, moved), start=1):
    chex.assert_shape(a, (1, 12, 40))
    np.testing.assert_allclose(a[0, :j - k], b[0, :j - k], atol=1e-5)
    assert float(jnp.max(jnp.abs(a[0, j - k] - b[0, j - k]))) > 1e-3


def test_mtp_targets_shift_and_mask_documents():
  tokens = np.array([[5, 6, 7, 8, 9, 10]])
  seg = np.array([[1, 1, 1, 2, 2, 0]])
  batch = dict(targets=jnp.asarray(tokens), segment_ids=jnp.asarray(seg),
               loss_mask=jnp.asarray([[1, 1, 0, 1, 0, 0]], jnp.float32))
  targets, mask = mtp_targets(batch, 1)
  np.testing.assert_array_equal(targets, [[6, 7, 8, 9, 10, 0]])
  # position 0 -> targets[1] (same document, real); 1 -> targets[2] (not real); 2 -> targets[3]
  # (the next document); 3 -> targets[4] (not real); 4 -> padding; 5 -> past the row
  np.testing.assert_array_equal(mask, [[1, 0, 0, 0, 0, 0]])
  targets, mask = mtp_targets(dict(targets=jnp.asarray(tokens)), 2)
  np.testing.assert_array_equal(targets, [[7, 8, 9, 10, 0, 0]])
  np.testing.assert_array_equal(mask, [[1, 1, 1, 1, 0, 0]])


def test_packed_documents_equal_separate_rows():
  """Two documents packed in one row (positions restarting, segment ids) give each depth's
  logits at their counted positions as the documents alone."""
  model = _model(mtp_depth=2)
  rng = np.random.RandomState(1)
  a, b = rng.randint(0, 40, 7), rng.randint(0, 40, 5)
  packed = jnp.asarray(np.concatenate([a, b])[None])
  seg = jnp.asarray([[1] * 7 + [2] * 5])
  pos = jnp.asarray([list(range(7)) + list(range(5))])
  together = _depth_logits(model, packed, positions=pos, segment_ids=seg)
  alone_a = _depth_logits(model, jnp.asarray(a[None]))
  alone_b = _depth_logits(model, jnp.asarray(b[None]))
  same = seg[:, 1:] == seg[:, :-1]
  batch = dict(targets=jnp.pad(packed[:, 1:], ((0, 0), (0, 1))), segment_ids=seg,
               loss_mask=jnp.pad(same, ((0, 0), (0, 1))).astype(jnp.float32))
  for k in (1, 2):
    mask = np.asarray(mtp_targets(batch, k)[1][0]).astype(bool)
    assert mask.sum() == (6 - k) + (4 - k)     # token i + k + 1 in position i's document
    want = np.concatenate([alone_a[k - 1][0], alone_b[k - 1][0]])
    np.testing.assert_allclose(np.asarray(together[k - 1][0])[mask], want[mask], atol=1e-4)


def test_loss_adds_weighted_mean_and_zero_weight_leaves_the_model_alone():
  rng = np.random.RandomState(2)
  tokens = jnp.asarray(rng.randint(0, 40, (2, 10)))
  batch = dict(tokens=tokens[:, :-1], targets=tokens[:, 1:])
  plain, with_mtp = _model(), _model(mtp_depth=2, mtp_loss_weight=0.5)
  # the modules are made after the model's own layers: the same seed gives the same model
  chex.assert_trees_all_equal(nnx.state(plain.groups), nnx.state(with_mtp.groups))
  _, (m, _) = loss_fn(with_mtp, batch)
  hidden = with_mtp(batch["tokens"], return_hidden=True)
  ce = []
  for k, lg in enumerate(with_mtp.mtp_forward(hidden, batch["tokens"]), start=1):
    t, mask = mtp_targets(batch, k)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(lg), t[..., None], -1)[..., 0]
    ce.append(float(jnp.sum(nll * mask) / jnp.sum(mask)))
  assert float(m["mtp_loss"]) == pytest.approx(np.mean(ce), rel=1e-5)
  assert float(m["total_loss"]) == pytest.approx(float(m["loss"]) + 0.5 * np.mean(ce), rel=1e-5)

  def trunk_grads(model):
    graphdef, params, rest = split_model(model)
    grads = jax.grad(lambda p: loss_fn(nnx.merge(graphdef, p, rest, copy=True), batch)[0])(params)
    return grads["groups"]

  want = trunk_grads(plain)
  zero = _model(mtp_depth=2, mtp_loss_weight=0.0)
  chex.assert_trees_all_close(trunk_grads(zero), want, atol=1e-6)
  moved = jax.tree.leaves(jax.tree.map(lambda x, y: jnp.max(jnp.abs(x - y)),
                                       trunk_grads(with_mtp), want))
  assert max(float(x) for x in moved) > 1e-4


def test_moe_module_is_routed_and_balanced():
  """A MoE model's module gets a MoE block; its load comes back with the layers' and moves its
  own router bias; a forward without the modules still updates the layers' alone."""
  model = _model(mtp_depth=1, layer_pattern="M", num_experts=4, first_k_dense=1)
  assert mtp_layer_kind(model.config) == ("M", True) and model.mtp[0].layer.is_moe
  tokens = jnp.asarray(np.random.RandomState(3).randint(0, 40, (2, 9)))
  _, (m, loads) = loss_fn(model, dict(tokens=tokens[:, :-1], targets=tokens[:, 1:]))
  sites = model.moe_sites()
  assert len(loads) == len(sites) == 2 and sites[-1] is model.mtp[0].layer.ffn
  assert float(m["moe_aux_loss"]) > 0
  before = np.asarray(sites[-1].router_bias[...])
  model.update_router_biases(loads)
  assert not np.allclose(np.asarray(sites[-1].router_bias[...]), before)
  _, aux = model(tokens, return_aux=True)
  model.update_router_biases(aux["moe_loads"])     # the layers' loads alone


def test_flops_count_the_modules():
  cfg = ModelConfig(**BASE)
  more = model_flops_per_token(cfg.replace(mtp_depth=1), 64) - model_flops_per_token(cfg, 64)
  d = cfg.embed_dim
  layer = 4 * d * d + 3 * d * cfg.mlp_dim + 2 * d * d       # q k v o, the MLP, the projection
  attention = 6 * cfg.num_heads * 2 * (d // cfg.num_heads) * (64 + 1) / 2
  assert more == pytest.approx(6 * (layer + cfg.vocab_size * d) + attention)


def test_deltanet_last_layer_gets_an_attention_module():
  model = _model(mtp_depth=1, layer_pattern="DA", num_layers=3)
  assert model.config.layer_kind(2)[0] == "D" and model.mtp[0].layer.kind == "A"


def test_errors():
  with pytest.raises(ValueError, match="mtp_depth"):
    ModelConfig(**BASE, mtp_depth=-1)
  with pytest.raises(ValueError, match="mtp_depth"):
    ModelConfig(**BASE, mtp_depth=1.5)
  with pytest.raises(ValueError, match="mtp_loss_weight"):
    ModelConfig(**BASE, mtp_depth=1, mtp_loss_weight=-0.1)
  with pytest.raises(ValueError, match="residual='plain'"):
    ModelConfig(**BASE, mtp_depth=1, residual="mhc")
  model = _model()
  with pytest.raises(ValueError, match="mtp_depth=0"):
    model.mtp_forward(jnp.zeros((1, 4, 32)), jnp.zeros((1, 4), jnp.int32))
  with pytest.raises(ValueError, match="hidden"):
    _model(mtp_depth=1).mtp_forward(jnp.zeros((1, 3, 32)), jnp.zeros((1, 4), jnp.int32))


def test_evaluation_reports_the_depths_loss_and_accuracy():
  """``evaluate`` over two batches: the depths' loss is the training loss's ``mtp_loss`` (one
  batch: the same), the accuracy the share of counted positions whose argmax is the target."""
  from jaxattn.train.step import TrainState, evaluate, make_eval_step
  model = _model(mtp_depth=2)
  graphdef, params, rest = split_model(model)
  state = TrainState(params, rest, None, jnp.zeros((), jnp.int32))
  tokens = jnp.asarray(np.random.RandomState(4).randint(0, 40, (2, 11)))
  batch = dict(tokens=tokens[:, :-1], targets=tokens[:, 1:])
  ev = evaluate(make_eval_step(graphdef), state, [batch, batch])
  _, (m, _) = loss_fn(model, batch)
  assert ev["eval_loss"] == pytest.approx(float(m["loss"]), rel=1e-5)
  assert ev["eval_mtp_loss"] == pytest.approx(float(m["mtp_loss"]), rel=1e-5)
  hidden = model(batch["tokens"], return_hidden=True)
  for k, lg in enumerate(model.mtp_forward(hidden, batch["tokens"]), start=1):
    t, mask = mtp_targets(batch, k)
    hits = np.asarray((jnp.argmax(lg, -1) == t) * mask).sum() / np.asarray(mask).sum()
    assert ev["eval_mtp_accuracy"][k - 1] == pytest.approx(float(hits))
  plain = _model()
  graphdef, params, rest = split_model(plain)
  ev = evaluate(make_eval_step(graphdef), TrainState(params, rest, None, 0), [batch])
  assert "eval_mtp_loss" not in ev
