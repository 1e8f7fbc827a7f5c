"""DecoderLM: every preset builds, runs and decodes == forward; scanned == unrolled; remat; errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxattn.configs import PRESETS, get_config
from jaxattn.nn.model import DecoderLM, ModelConfig, plan_groups

SMALL = dict(embed_dim=32, mlp_dim=64, max_seq_len=64)


def small_config(name, **kw):
  cfg = get_config(name, **SMALL)
  layers = len(cfg.layer_pattern) + (1 if cfg.num_experts else 0)
  extra = dict(num_layers=layers)
  if cfg.num_experts:
    extra.update(moe_expert_dim=16, first_k_dense=1)
  if cfg.kinds() & set("MI"):
    extra.update(kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4,
                 v_head_dim=8, index_head_dim=8, index_rope_dim=4, index_topk=5)
  if "D" in cfg.layer_pattern:
    extra.update(deltanet_head_dim=8, deltanet_v_head_dim=8, deltanet_chunk_size=4, rotary_dim=4)
  if "S" in cfg.layer_pattern:
    extra.update(sliding_window=3)
  extra.update(kw)
  return cfg.replace(**extra)


def decode_matches_forward(model, tokens, prefill):
  graphdef, state = nnx.split(model)

  @jax.jit
  def full(state, tokens):
    return nnx.merge(graphdef, state)(tokens)

  @jax.jit
  def step(state, tokens, cache):
    return nnx.merge(graphdef, state)(tokens, cache=cache)

  ref = full(state, tokens)
  cache = model.init_cache(tokens.shape[0], tokens.shape[1])
  out, cache = step(state, tokens[:, :prefill], cache)
  outs = [out]
  for i in range(prefill, tokens.shape[1]):
    o, cache = step(state, tokens[:, i:i + 1], cache)
    outs.append(o)
  dec = jnp.concatenate(outs, axis=1)
  assert int(cache.index) == tokens.shape[1]
  return ref, dec


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds_runs_and_decodes_like_forward(name):
  cfg = small_config(name)
  model = DecoderLM(cfg, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, cfg.vocab_size)
  ref, dec = decode_matches_forward(model, tokens, prefill=6)
  assert ref.shape == (2, 9, cfg.vocab_size) and ref.dtype == jnp.float32
  assert np.isfinite(np.asarray(ref)).all()
  np.testing.assert_allclose(dec, ref, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("name", ["llama", "deepseek-v3", "qwen3-next", "gpt-oss"])
def test_full_size_presets_have_the_published_shape(name):
  cfg = get_config(name, size="full")
  model = nnx.eval_shape(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0)))
  n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  expected = {"llama": 8.03e9, "deepseek-v3": 671e9, "qwen3-next": 80e9, "gpt-oss": 20.9e9}[name]
  assert abs(n - expected) / expected < 0.05, n


def _stack_unrolled_into_scanned(unrolled, scanned):
  """Copies the unrolled model's parameters into the scanned model (stacking per unit)."""
  u_state = nnx.state(unrolled)
  s_state = nnx.state(scanned)
  layers = u_state["groups"][0]["unit"]["layers"]
  period = len(scanned.config.layer_pattern)
  count = scanned.config.num_layers // period
  stacked = {j: jax.tree.map(lambda *xs: jnp.stack(xs),
                             *[layers[c * period + j] for c in range(count)])
             for j in range(period)}
  new = dict(nnx.to_pure_dict(s_state))
  u_pure = nnx.to_pure_dict(u_state)
  for key in new:
    if key != "groups":
      new[key] = u_pure[key]
  new["groups"] = {0: {"units": {"layers": {j: nnx.to_pure_dict(nnx.State(stacked[j]))
                                            for j in stacked}}}}
  nnx.replace_by_pure_dict(s_state, new)
  nnx.update(scanned, s_state)


@pytest.mark.parametrize("preset,pattern", [("mistral", "A"), ("mistral", "SA"),
                                            ("gpt-oss", "SA")])
def test_scanned_and_rematerialized_stacks_equal_the_unrolled_stack(preset, pattern):
  """(gpt-oss: its sinks, attention biases and MoE units, scanned as the full preset is.)"""
  cfg = small_config(preset, layer_pattern=pattern, num_layers=4, first_k_dense=0)
  unrolled = DecoderLM(cfg, rngs=nnx.Rngs(0))
  scanned = DecoderLM(cfg.replace(scan_layers=True), rngs=nnx.Rngs(1))
  remat = DecoderLM(cfg.replace(scan_layers=True, remat="full"), rngs=nnx.Rngs(2))
  assert [g[0] for g in plan_groups(scanned.config)] == ["scanned"]
  _stack_unrolled_into_scanned(unrolled, scanned)
  _stack_unrolled_into_scanned(unrolled, remat)
  # the stacked parameters carry the leading "layers" axis name
  kernel = scanned.groups[0].units.layers[0].mixer.q_proj.kernel
  assert kernel.get_metadata()["logical_axes"][0] == "layers" and kernel.shape[0] == 4 // len(pattern)
  tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, cfg.vocab_size)

  def loss(model):
    return jnp.mean(jax.nn.log_softmax(model(tokens))[..., 0])

  results = [nnx.jit(nnx.value_and_grad(loss))(m) for m in (unrolled, scanned, remat)]
  (l0, g0), (l1, g1), (l2, g2) = results
  np.testing.assert_allclose(l1, l0, rtol=1e-5)
  np.testing.assert_allclose(l2, l0, rtol=1e-5)
  # gradients of layer 1's query projection (unit 1 // period, position 1 % period)
  p = len(pattern)
  ref = g0["groups"][0]["unit"]["layers"][1]["mixer"]["q_proj"]["kernel"][...]
  for g in (g1, g2):
    got = g["groups"][0]["units"]["layers"][1 % p]["mixer"]["q_proj"]["kernel"][...][1 // p]
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-6)


def test_cache_overflow_raises_for_scanned_stacks_too():
  """``nnx.scan`` traces each layer's cache index, so the layer's own overflow check cannot raise;
  the model checks its concrete index against its smallest bounded layer cache instead."""
  from jaxattn.nn.model import cache_capacity  # noqa: PLC0415
  cfg = small_config("mistral", layer_pattern="SA", num_layers=4, scan_layers=True)
  model = DecoderLM(cfg, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(2), (1, 6), 0, cfg.vocab_size)
  cache = model.init_cache(1, 4, rolling=True)
  assert cache_capacity(cache) == 4                      # the full layers; rolling ones unbounded
  _, cache = model(tokens[:, :4], cache=cache)
  with pytest.raises(ValueError, match="overflow"):
    model(tokens[:, 4:6], cache=cache)
  assert cache_capacity(DecoderLM(small_config("qwen3-next"), rngs=nnx.Rngs(0))
                        .init_cache(1, 8)) == 8


def test_dense_prefix_then_scanned_moe_units_and_an_unrolled_remainder():
  cfg = small_config("deepseek-v3", num_layers=4, first_k_dense=1, layer_pattern="MM",
                     scan_layers=True)
  plan = plan_groups(cfg)
  assert [(m, c, f) for m, _, c, f in plan] == [("unrolled", 1, 0), ("scanned", 1, 1),
                                                 ("unrolled", 1, 3)]
  model = DecoderLM(cfg, rngs=nnx.Rngs(0))
  logits, aux = model(jnp.zeros((1, 4), jnp.int32), return_aux=True)
  assert len(aux["moe_loads"]) == 3 and aux["moe_loads"][1].shape == (1, 8)  # stacked site
  before = model.groups[1].units.layers[0].ffn.router_bias[...]
  model.update_router_biases(aux["moe_loads"])
  assert before.shape == (1, 8)
  assert not np.allclose(model.groups[1].units.layers[0].ffn.router_bias[...], before)


def test_sliding_window_model_decodes_with_a_rolling_cache_of_the_window():
  cfg = small_config("mistral", num_layers=2)
  model = DecoderLM(cfg, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, cfg.vocab_size)
  cache = model.init_cache(2, rolling=True)
  assert all(c.key.shape[1] == cfg.sliding_window for c in cache.groups[0])  # w slots, not T
  step = nnx.jit(lambda m, t, c: m(t, cache=c))
  out, cache = step(model, tokens[:, :5], cache)
  outs = [out]
  for i in range(5, 9):
    o, cache = step(model, tokens[:, i:i + 1], cache)
    outs.append(o)
  np.testing.assert_allclose(jnp.concatenate(outs, 1), model(tokens), atol=2e-5)


def test_tied_and_untied_heads_and_cache_bytes():
  cfg = small_config("llama")
  tied = DecoderLM(cfg, rngs=nnx.Rngs(0))
  untied = DecoderLM(cfg.replace(tie_embeddings=False), rngs=nnx.Rngs(0))
  assert tied.lm_head is None and untied.lm_head.kernel.shape == (32, cfg.vocab_size)
  # GQA: 2 (k, v) x layers x kv heads x head dim x 2 bytes per token
  assert tied.cache_bytes(10) == 10 * 2 * cfg.num_layers * 2 * 8 * 2


def test_config_round_trip_and_errors():
  cfg = get_config("deepseek-v3.2")
  assert ModelConfig.from_dict(cfg.to_dict()) == cfg
  with pytest.raises(ValueError, match="layer_pattern"):
    ModelConfig(layer_pattern="AQ")
  with pytest.raises(ValueError, match="sliding_window"):
    ModelConfig(layer_pattern="S")
  with pytest.raises(ValueError, match="decoupled RoPE"):
    ModelConfig(layer_pattern="M", position="alibi")
  with pytest.raises(ValueError, match="unknown ModelConfig field"):
    ModelConfig.from_dict({"hidden_size": 4})
  with pytest.raises(ValueError, match="unknown preset"):
    get_config("gpt-5")
  with pytest.raises(ValueError, match="remat"):
    ModelConfig(remat="sometimes")
  # Refused where the config is made, naming its field (not at build time as a module argument).
  with pytest.raises(ValueError, match="unknown ModelConfig field"):
    get_config("llama", bogus=1)
  for bad in (2.5, True, -1):
    with pytest.raises(ValueError, match="`sliding_window` must be None or a non-negative int"):
      ModelConfig(sliding_window=bad)
  with pytest.raises(ValueError, match="`num_experts_per_tok` must be an int in"):
    ModelConfig(num_experts=4, num_experts_per_tok=0)
  with pytest.raises(ValueError, match="`num_streams` must be a positive int"):
    ModelConfig(num_streams=0)
  # DeltaNet sizes are checked with the config, naming its fields (0 heads meant num_heads)
  for name in ("deltanet_num_heads", "deltanet_num_key_heads", "deltanet_head_dim",
               "deltanet_v_head_dim", "deltanet_chunk_size"):
    for bad in (0, True, 2.0):
      with pytest.raises(ValueError, match=f"`{name}` must be a positive int, got {bad!r}"):
        ModelConfig(layer_pattern="D", **{name: bad})
  with pytest.raises(ValueError, match="`deltanet_chunk_size` must be a power of two, got 48"):
    ModelConfig(layer_pattern="D", deltanet_chunk_size=48)
  # rope_scaling dicts are checked with the config (an unknown key was a TypeError at build time)
  for bad in ({"type": "linear", "factor": 2.0, "scale": 2}, {"factor": 2.0}, "yarn"):
    with pytest.raises(ValueError, match="`rope_scaling` must be None or a dict of RopeScaling"):
      ModelConfig(rope_scaling=bad)
  with pytest.raises(ValueError, match="RopeScaling `factor`"):
    ModelConfig(rope_scaling={"type": "linear", "factor": -1.0})
  with pytest.raises(ValueError, match="`gated_mlp` must be True"):
    ModelConfig(num_experts=4, num_experts_per_tok=2, gated_mlp=False)
  ModelConfig(num_experts=4, num_experts_per_tok=2, first_k_dense=2, num_layers=2,
              gated_mlp=False)   # no MoE layer: the dense MLPs may be ungated
  with pytest.raises(ValueError, match="tokens"):
    DecoderLM(small_config("llama"), rngs=nnx.Rngs(0))(jnp.zeros((4,), jnp.int32))


def test_config_takes_numpy_scalars_as_python_values():
  """np.int64 from a sweep, np.bool_ from a comparison: stored as Python values (a np.bool_ used
  to pass and then break to_json and hashing; a np.int64 was refused as not an int)."""
  dims = np.arange(16, 80, 16)
  cfg = ModelConfig(embed_dim=dims[1], num_heads=np.int32(4), tie_embeddings=np.bool_(False),
                    norm_eps=np.float32(1e-5), layer_pattern="A")
  ref = ModelConfig(embed_dim=32, num_heads=4, tie_embeddings=False,
                    norm_eps=float(np.float32(1e-5)), layer_pattern="A")
  assert cfg == ref and hash(cfg) == hash(ref) and cfg.to_json() == ref.to_json()
  assert type(cfg.embed_dim) is int and type(cfg.tie_embeddings) is bool
  with pytest.raises(ValueError, match="`embed_dim` must be a positive int"):
    ModelConfig(embed_dim=np.float64(32.0))


def test_scanned_hyper_connections_read_the_stream_of_their_layer():
  """HC's static read vector is e_(layer mod n): every scanned copy got the first layer's."""
  cfg = small_config("llama").replace(residual="hc", num_streams=3, num_layers=3)
  unrolled = DecoderLM(cfg, rngs=nnx.Rngs(0))
  scanned = DecoderLM(cfg.replace(scan_layers=True), rngs=nnx.Rngs(0))
  def reads(model):
    pres = [np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))
            if "mixer_hc" in p and p[-1] == "static_pre"]
    return np.concatenate([p.reshape(-1, 3) for p in pres]).argmax(-1).tolist()
  assert reads(unrolled) == [0, 1, 2]
  assert reads(scanned) == [0, 1, 2]


def test_post_ln_model_has_no_final_norm():
  """Post-LN layers end with their own norm: the head reads the last layer's output directly (a
  final norm on top normalized twice; pre-LN keeps its one final norm)."""
  cfg = small_config("llama").replace(norm_position="post", num_layers=2, norm="layer")
  model = DecoderLM(cfg, rngs=nnx.Rngs(0))
  assert model.final_norm is None
  assert not [p for p, _ in nnx.to_flat_state(nnx.state(model)) if "final_norm" in p]
  assert DecoderLM(cfg.replace(norm_position="pre"), rngs=nnx.Rngs(0)).final_norm is not None
  tokens = jnp.arange(10, dtype=jnp.int32)[None] % cfg.vocab_size
  hidden = model(tokens, return_hidden=True)[0]
  # the last layer's ffn_norm (LayerNorm, unit scale, zero bias at init) output: zero-mean,
  # unit-variance rows, left as they are
  np.testing.assert_allclose(np.asarray(hidden.mean(-1)), 0, atol=1e-4)
  np.testing.assert_allclose(np.asarray(hidden.var(-1)), 1, atol=1e-2)
