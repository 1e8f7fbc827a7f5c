"""The jit train step: sharded on the 8-device mesh == one device; AdamW schedule; MoE biases."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxattn.configs import get_config
from jaxattn.nn.model import DecoderLM
from jaxattn.ops import context_parallel
from jaxattn.sharding import make_mesh
from jaxattn.train.step import (init_train_state, make_optimizer, make_train_step, shard_batch,
                                cross_entropy, model_flops_per_token)


def _batch(vocab, b=8, t=12, seed=0):
  rng = np.random.default_rng(seed)
  tok = rng.integers(3, vocab, (b, t + 1)).astype(np.int32)
  seg = np.ones((b, t), np.int32)
  seg[:, t // 2:] = 2                                      # two packed documents per row
  pos = np.concatenate([np.arange(t // 2), np.arange(t - t // 2)])[None].repeat(b, 0)
  mask = np.ones((b, t), np.float32)
  mask[:, t // 2 - 1] = 0.0                                # no target across the boundary
  return dict(tokens=tok[:, :-1], targets=tok[:, 1:], segment_ids=seg,
              positions=pos.astype(np.int32), loss_mask=mask)


def _one_step(cfg, mesh):
  model = DecoderLM(cfg, rngs=nnx.Rngs(0))
  tx = make_optimizer(learning_rate=1e-2, warmup_steps=0, total_steps=10)
  graphdef, state = init_train_state(model, tx, mesh=mesh)
  if mesh is None:
    step = make_train_step(graphdef, tx, state, donate=False)
    new, metrics = step(state, shard_batch(_batch(cfg.vocab_size), None))
  else:
    with jax.set_mesh(mesh):
      step = make_train_step(graphdef, tx, state, mesh=mesh, donate=False)
      new, metrics = step(state, shard_batch(_batch(cfg.vocab_size), mesh))
  return state, new, metrics


@pytest.mark.parametrize("preset,mesh_shape", [
    ("llama", {"data": 2, "tensor": 4}),
    ("deepseek-v3", {"data": 2, "expert": 4}),
    # context parallelism: the sequence (12 tokens, two packed documents) split two ways
    ("llama", {"data": 2, "context": 2, "tensor": 2}),
])
def test_sharded_step_matches_one_device(preset, mesh_shape, monkeypatch):
  cfg = get_config(preset, embed_dim=32, mlp_dim=64, num_layers=2, max_seq_len=64,
                   num_heads=4)
  calls = []
  real = context_parallel.attention
  monkeypatch.setattr(context_parallel, "attention", lambda *a, **kw: calls.append(kw["size"])
                      or real(*a, **kw))
  if cfg.num_experts:   # with a multi-token-prediction module (MLA + MoE, its router balanced)
    cfg = cfg.replace(moe_expert_dim=16, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8,
                      qk_rope_head_dim=4, v_head_dim=8, mtp_depth=1)
  mesh = make_mesh(mesh_shape)
  _, ref, m_ref = _one_step(cfg, None)
  state0, got, m_got = _one_step(cfg, mesh)
  # every attention layer's call (forward; the backward is its transpose) was context-parallel
  assert calls == [2] * cfg.num_layers if "context" in mesh_shape else not calls
  # parameters really are split over the mesh
  specs = {str(x.sharding.spec) for x in jax.tree.leaves(state0.params)}
  assert any(("tensor" in s) or ("expert" in s) for s in specs), specs
  for k in ("loss", "grad_norm", "moe_aux_loss") + (("mtp_loss",) if cfg.mtp_depth else ()):
    np.testing.assert_allclose(m_got[k], m_ref[k], rtol=2e-5, atol=1e-7)
  # Adam's first step is about lr * sign(g) (lr = 1e-2): on a near-zero gradient the sharded sum's
  # rounding can move it by a fraction of lr, so updated parameters agree to 10% of one step.
  for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(ref.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=1e-3)
  for a, b in zip(jax.tree.leaves(got.rest), jax.tree.leaves(ref.rest)):  # MoE router biases
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-7)
  if cfg.num_experts:   # every router bias (the MTP module's too) moved against its load
    assert all(np.abs(np.asarray(b)).max() > 0 for b in jax.tree.leaves(got.rest))
  # warmup_steps=0: the first step already moves the parameters (it used to run at LR 0).
  assert any(not np.array_equal(np.asarray(a), np.asarray(b))
             for a, b in zip(jax.tree.leaves(ref.params), jax.tree.leaves(state0.params)))


@pytest.mark.parametrize("preset", ["deepseek-v3", "qwen3-next"])
def test_moe_step_with_scanned_layers_and_remat(preset):
  """MoE models train with scan_layers and remat, as the full-size presets are configured: the
  router biases (non-parameter state) used to be refused by nnx.scan / nnx.remat as Variables of
  another trace level.  Remat changes no value."""
  cfg = get_config(preset, embed_dim=32, mlp_dim=64, num_layers=4, max_seq_len=64, num_heads=4,
                   moe_expert_dim=16, scan_layers=True)
  if preset == "deepseek-v3":
    cfg = cfg.replace(kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=4,
                      v_head_dim=8)
  else:
    # Units of one Gated DeltaNet and one attention layer (the preset's "DDDA" holds three
    # DeltaNet layers per unit): two scanned units, half the compile.
    cfg = cfg.replace(rotary_dim=4, deltanet_head_dim=8, deltanet_v_head_dim=8, layer_pattern="DA")
  _, plain, m_plain = _one_step(cfg, None)
  _, remat, m_remat = _one_step(cfg.replace(remat="dots"), None)
  np.testing.assert_allclose(m_remat["loss"], m_plain["loss"], rtol=1e-6)
  # (recomputed activations may round differently: the norm over ~10^4 fp32 gradients agrees to
  # a few ulps of its summands)
  np.testing.assert_allclose(m_remat["grad_norm"], m_plain["grad_norm"], rtol=5e-5)
  for a, b in zip(jax.tree.leaves(remat.rest), jax.tree.leaves(plain.rest)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-7)
  assert max(np.abs(np.asarray(x)).max() for x in jax.tree.leaves(remat.rest)) > 0


def test_weight_decay_skips_norms_and_biases_scanned_or_not():
  """A scanned stack holds its norm scales as [L, D]: still vectors, not decayed."""
  from jaxattn.train.step import decay_mask, split_model
  masks = {}
  for scan in (False, True):
    cfg = get_config("llama", embed_dim=16, mlp_dim=32, num_layers=2, num_heads=2,
                     num_kv_heads=1, scan_layers=scan, attention_bias=True)
    _, params, _ = split_model(DecoderLM(cfg, rngs=nnx.Rngs(0)))
    flat = jax.tree_util.tree_leaves_with_path(decay_mask(params))
    masks[scan] = {jax.tree_util.keystr(p).split("'")[-2]: m for p, m in flat}
    tx = make_optimizer(learning_rate=1.0, warmup_steps=0, total_steps=10, weight_decay=0.5,
                        clip_norm=1e9)
    # (jitted: op by op, optax's update compiled each small op of every leaf: 20 s)
    upd, _ = jax.jit(tx.update)(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    for p, u in jax.tree_util.tree_leaves_with_path(upd):   # zero gradients: decay alone moves
      moved = bool(np.abs(np.asarray(u)).max() > 0)
      name = jax.tree_util.keystr(p)
      assert moved == ("kernel" in name or "embed" in name), (scan, name)
  assert masks[True] == masks[False] and not masks[True]["scale"] and masks[True]["kernel"]


def test_cross_entropy_matches_a_direct_formula():
  logits = jax.random.normal(jax.random.key(0), (2, 3, 7))
  targets = jnp.array([[1, 2, 3], [4, 5, 6]])
  mask = jnp.array([[1, 0, 1], [1, 1, 1]], jnp.float32)
  s, n = cross_entropy(logits, targets, mask)
  p = jax.nn.softmax(logits)
  want = -sum(np.log(p[b, t, targets[b, t]]) for b in range(2) for t in range(3) if mask[b, t])
  np.testing.assert_allclose(s, want, rtol=1e-5)
  assert float(n) == 5


def test_optimizer_schedule_and_errors():
  tx = make_optimizer(learning_rate=1.0, warmup_steps=4, total_steps=20, weight_decay=0.0,
                      clip_norm=1e9)
  params = {"w": jnp.ones((2, 2))}
  state = tx.init(params)
  sizes = []
  for _ in range(6):
    upd, state = tx.update({"w": jnp.ones((2, 2))}, state, params)
    sizes.append(float(jnp.abs(upd["w"]).max()))
  assert sizes[0] == 0.0 and sizes[1] < sizes[2] < sizes[3] < sizes[4]  # linear warmup
  with pytest.raises(ValueError, match="warmup_steps"):
    make_optimizer(warmup_steps=50, total_steps=10)
  with pytest.raises(ValueError, match="learning_rate"):
    make_optimizer(learning_rate=0.0)


def test_model_flops_counts_active_parameters():
  dense = get_config("llama")
  moe = get_config("deepseek-v3")
  f_dense = model_flops_per_token(dense, 256)
  d = dense.embed_dim
  per_layer = d * (4 * 32 * 2 + 2 * 32 * 2) + 3 * d * dense.mlp_dim  # q,o: 4 heads; k,v: 2 heads
  want = 6 * (dense.num_layers * per_layer + dense.vocab_size * d) \
      + 12 * dense.num_layers * d * (256 + 1) / 2  # causal: (T + 1) / 2 keys per query
  assert f_dense == pytest.approx(want, rel=1e-6)
  assert model_flops_per_token(moe, 256) > 0
  # A sliding window of w sees min(t, w + 1) keys: with w >= T it is causal attention.
  assert model_flops_per_token(dense.replace(layer_pattern="S", sliding_window=4096), 256) == \
      pytest.approx(f_dense, rel=1e-9)
  windowed = model_flops_per_token(dense.replace(layer_pattern="S", sliding_window=15), 256)
  keys = (sum(range(1, 17)) + 16 * (256 - 16)) / 256
  assert f_dense - windowed == pytest.approx(
      12 * dense.num_layers * d * ((256 + 1) / 2 - keys), rel=1e-9)
  # DSA: top-k keys for the main attention plus the indexer over every earlier key.
  dsa = get_config("deepseek-v3.2")
  sparse, dense_mode = (model_flops_per_token(dsa, 512),
                        model_flops_per_token(dsa.replace(dsa_attention_mode="dense"), 512))
  assert sparse < dense_mode


def test_mixed_precision_step_tracks_fp32():
  cfg = get_config("llama", embed_dim=32, mlp_dim=64, num_layers=2, max_seq_len=64)
  _, ref, m_ref = _one_step(cfg, None)
  _, got, m_got = _one_step(cfg.replace(dtype="bfloat16"), None)
  # parameters and optimizer stay fp32; the loss is computed in fp32 from bf16 matmuls
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(got.params))
  assert m_got["loss"].dtype == jnp.float32
  np.testing.assert_allclose(m_got["loss"], m_ref["loss"], rtol=2e-2)
  np.testing.assert_allclose(m_got["grad_norm"], m_ref["grad_norm"], rtol=5e-2)


@pytest.mark.parametrize("scan", [True])   # the stacked (per-layer split) RNG state
def test_dropout_draws_new_masks_each_step_and_eval_is_deterministic(scan):
  """A LoRA adapter with dropout: each train step advances the dropout RNG carried in ``rest``
  (the step used to return the old ``rest``, so every step drew the same masks), and the eval
  step runs without dropout."""
  import dataclasses
  from jaxattn.nn.lora import apply_lora
  from jaxattn.train.step import make_eval_step
  cfg = get_config("llama", embed_dim=16, mlp_dim=32, num_layers=2, num_heads=2,
                   max_seq_len=32, scan_layers=scan)
  model = DecoderLM(cfg, rngs=nnx.Rngs(0))
  apply_lora(model, r"mixer/(q|v)_proj$", rank=2, dropout=0.5, rngs=nnx.Rngs(1))
  tx = make_optimizer(learning_rate=3e-2, warmup_steps=0, total_steps=10)
  graphdef, s0 = init_train_state(model, tx)
  step = make_train_step(graphdef, tx, s0, donate=False)
  batch = shard_batch(_batch(cfg.vocab_size), None)
  s1, _ = step(s0, batch)        # the adapters' B move off zero: dropout now changes the output
  s2, m2 = step(s1, batch)
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(s0.rest),
                                                      jax.tree.leaves(s1.rest)))
  # the same parameters under the next step's RNG state draw other masks: another loss
  _, m_next = step(dataclasses.replace(s1, rest=s2.rest), batch)
  assert float(m_next["loss"]) != float(m2["loss"])
  # the step itself is a function of its state
  _, m_again = step(s1, batch)
  assert float(m_again["loss"]) == float(m2["loss"])
  evaluate = make_eval_step(graphdef)
  e1 = evaluate(s2.params, s1.rest, batch)
  e2 = evaluate(s2.params, s2.rest, batch)
  np.testing.assert_array_equal(np.asarray(e1[0]), np.asarray(e2[0]))


@pytest.mark.parametrize("preset", ["llama", "deepseek-v3", "qwen3-next"])
def test_model_flops_do_not_depend_on_scanning(preset):
  """Scanned [L, D] norm scales were counted as matmul weights (FLOPs grew with scan_layers)."""
  a = model_flops_per_token(get_config(preset), 128)
  assert model_flops_per_token(get_config(preset, scan_layers=True), 128) == a


@pytest.mark.parametrize("scan", [False, True])
def test_model_flops_skip_every_embedding_lookup_table(scan):
  """Position tables are gathers, not matmuls: the learned table [max_seq_len, D] (and T5's
  per-layer bucket bias) was counted as 6 * max_seq_len * D FLOPs per token (+14% MFU for
  llama-learned, +110% at max_seq_len 8192).  Per-token compute does not depend on max_seq_len."""
  rope = model_flops_per_token(get_config("llama", scan_layers=scan), 256)
  for preset in ("llama-learned", "llama-t5", "llama-sinusoidal", "llama-alibi", "llama-nope"):
    cfg = get_config(preset, scan_layers=scan)
    assert model_flops_per_token(cfg, 256) == rope, preset
    assert model_flops_per_token(cfg.replace(max_seq_len=8192), 256) == rope, preset
  # the untied head [D, V] is a matmul and still counted, as the tied one is
  untied = get_config("llama-learned", scan_layers=scan, tie_embeddings=False)
  assert model_flops_per_token(untied, 256) == rope
