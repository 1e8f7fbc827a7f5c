"""Multi-token-prediction modules in checkpoint conversion, without transformers: the MTP rules
are exact inverses (DeepSeek-V3 MLA + MoE, V3.2, Qwen3-Next), ``load_hf`` keeps the modules the
weights hold, ``mtp_depth`` (override or CLI) keeps fewer, and bad input raises.

Configs and random models as in test_convert_mapping.py (the transformers side is
tests/hf/test_mtp_convert.py).
"""

import json

import numpy as np
import pytest

from jaxattn.convert import (config_from_hf, load_checkpoint, load_hf, model_from_state, save_hf,
                             state_from_hf, to_hf)
from jaxattn.convert.__main__ import main
from jaxattn.convert.hf import _FAMILIES

from test_convert_mapping import CONFIGS, _leaves, _random_model

MTP = {name: dict(CONFIGS[name], num_nextn_predict_layers=1)
       for name in ("deepseek_v3", "deepseek_v32", "qwen3_next")}
# the MTP module's own tensors, beside its decoder layer's (those of a main layer, renamed)
OWN = {"deepseek_v3": {"model.layers.2.enorm.weight", "model.layers.2.hnorm.weight",
                       "model.layers.2.eh_proj.weight", "model.layers.2.shared_head.norm.weight",
                       "model.layers.2.embed_tokens.weight",
                       "model.layers.2.shared_head.head.weight"},
       "qwen3_next": {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight",
                      "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"}}
OWN["deepseek_v32"] = OWN["deepseek_v3"]
BLOCK = {"deepseek_v3": "model.layers.2.", "deepseek_v32": "model.layers.2.",
         "qwen3_next": "mtp.layers.0."}


def _model(name, seed=0):
  model = _random_model(config_from_hf(MTP[name]), seed)
  if name == "qwen3_next":  # no tensor for our ranking-only router bias: zero it
    for moe in model.moe_sites():
      moe.router_bias[...] = np.zeros(moe.router_bias.shape, np.float32)
  return model


def _assert_same(got, want, name):
  assert got.keys() == want.keys()
  for p in want:
    if name == "qwen3_next" and p[-1] == "scale":   # (1 + w) norm storage: within an ulp of 1
      np.testing.assert_allclose(got[p], want[p], rtol=0, atol=2 ** -23, err_msg=str(p))
    else:
      np.testing.assert_array_equal(got[p], want[p], err_msg=str(p))


@pytest.mark.parametrize("name", sorted(MTP))
def test_mtp_export_then_import_is_exact(name):
  ours = _model(name)
  assert ours.config.mtp_depth == 1
  hf_config, sd = to_hf(ours)
  assert hf_config["num_nextn_predict_layers"] == 1
  assert config_from_hf(hf_config) == ours.config
  # the module's own tensors, and its block as a main layer's (the last one: MoE) renamed
  last = {k[len("model.layers.1."):] for k in sd if k.startswith("model.layers.1.")}
  block = {k[len(BLOCK[name]):] for k in sd if k.startswith(BLOCK[name])}
  own = {k[len(BLOCK[name]):] for k in OWN[name] if k.startswith(BLOCK[name])}
  assert OWN[name] <= set(sd) and block == last | own
  # eh_proj / fc [D, 2D] reads [embedding; hidden] as our proj [2D, D] does
  proj = "mtp.fc.weight" if name == "qwen3_next" else "model.layers.2.eh_proj.weight"
  np.testing.assert_array_equal(sd[proj], np.asarray(ours.mtp[0].proj.kernel[...]).T)
  if name != "qwen3_next":  # DeepSeek stores copies of the shared embedding and head
    np.testing.assert_array_equal(sd["model.layers.2.embed_tokens.weight"],
                                  sd["model.embed_tokens.weight"])
    np.testing.assert_array_equal(sd["model.layers.2.shared_head.head.weight"],
                                  sd["lm_head.weight"])
  back = model_from_state(ours.config, state_from_hf(sd, ours.config))
  _assert_same(_leaves(back), _leaves(ours), name)


@pytest.mark.parametrize("name", ["deepseek_v3", "qwen3_next"])
def test_load_hf_keeps_the_modules_the_weights_hold(name, tmp_path):
  """``load_hf`` keeps the MTP module when its weights are there, also under a config that
  states none (Qwen3-Next's published ones), and loads none when a config states one that the
  weights lack (transformers' save_pretrained); ``mtp_depth=0`` drops it."""
  ours = _model(name)
  save_hf(ours, str(tmp_path))
  _assert_same(_leaves(load_hf(str(tmp_path))), _leaves(ours), name)
  config_file = tmp_path / "config.json"
  d = json.loads(config_file.read_text())
  del d["num_nextn_predict_layers"]
  config_file.write_text(json.dumps(d))
  got = load_hf(str(tmp_path))
  assert got.config.mtp_depth == 1
  dropped = load_hf(str(tmp_path), mtp_depth=0)
  assert dropped.config.mtp_depth == 0 and dropped.mtp is None
  want = {p: v for p, v in _leaves(ours).items() if p[0] != "mtp"}
  _assert_same(_leaves(dropped), want, name)
  # a config stating one module, over weights without it
  save_hf(dropped, str(tmp_path / "none"))
  d = json.loads((tmp_path / "none" / "config.json").read_text())
  (tmp_path / "none" / "config.json").write_text(json.dumps(dict(d, num_nextn_predict_layers=1)))
  assert load_hf(str(tmp_path / "none")).config.mtp_depth == 0
  with pytest.raises(ValueError, match=r"`mtp_depth`=1 is not available: the checkpoint has 0"):
    load_hf(str(tmp_path / "none"), mtp_depth=1)


def test_mtp_depth_zero_skips_the_tensors_in_state_from_hf():
  ours = _model("deepseek_v3")
  _, sd = to_hf(ours)
  cfg = config_from_hf(MTP["deepseek_v3"], mtp_depth=0)
  assert cfg == ours.config.replace(mtp_depth=0)
  back = model_from_state(cfg, state_from_hf(sd, cfg))
  assert back.mtp is None
  _assert_same(_leaves(back), {p: v for p, v in _leaves(ours).items() if p[0] != "mtp"},
               "deepseek_v3")


def test_cli_mtp_depth(tmp_path, capsys):
  save_hf(_model("deepseek_v3"), str(tmp_path / "hf"))
  assert main(["--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt"),
               "--mtp-depth", "0"]) == 0
  assert "0 MTP modules" in capsys.readouterr().out
  assert load_checkpoint(str(tmp_path / "ckpt")).mtp is None


@pytest.mark.parametrize("depth", [2, -1, True, "1", 0.0])
def test_bad_mtp_depth_raises(depth):
  with pytest.raises(ValueError, match=r"DeepseekV3ForCausalLM: `mtp_depth`=.* is not available: "
                                       r"the checkpoint has 1 multi-token-prediction module\(s\); "
                                       r"`mtp_depth` keeps the first ones, an int in \[0, 1\]"):
    config_from_hf(MTP["deepseek_v3"], mtp_depth=depth)


def test_mtp_config_errors():
  with pytest.raises(ValueError, match=r"LlamaForCausalLM: `mtp_depth`=1 .* has 0"):
    config_from_hf(CONFIGS["llama"], mtp_depth=1)
  assert config_from_hf(CONFIGS["llama"], mtp_depth=0).mtp_depth == 0
  with pytest.raises(ValueError, match=r"has 0 multi-token-prediction module\(s\) \(its config "
                                       r"states no `num_nextn_predict_layers`; load_hf counts"):
    config_from_hf(CONFIGS["qwen3_next"], mtp_depth=1)   # (a published Qwen3-Next config)
  with pytest.raises(ValueError, match=r"`num_nextn_predict_layers` must be an int >= 0"):
    config_from_hf(dict(MTP["deepseek_v3"], num_nextn_predict_layers=-1))
  # Qwen3-Next's deeper modules share fc and the norms: the first one alone can be kept
  deep = dict(MTP["qwen3_next"], num_nextn_predict_layers=2)
  with pytest.raises(ValueError, match=r"`num_nextn_predict_layers`=2 is not supported"):
    config_from_hf(deep)
  assert config_from_hf(deep, mtp_depth=1).mtp_depth == 1
  # an MTP block of another kind than the last layer (transformers' DeepSeek MTP layers are
  # MoE; Qwen3-Next's mtp.layers.0 is dense when layer 0 is): refused, fine without the module
  dense_last = dict(MTP["deepseek_v3"], first_k_dense_replace=2)
  with pytest.raises(ValueError, match=r"multi-token-prediction layer\(s\) are MoE layers"):
    config_from_hf(dense_last)
  assert config_from_hf(dense_last, mtp_depth=0).mtp_depth == 0
  dense_first = dict(MTP["qwen3_next"], mlp_only_layers=[0])
  with pytest.raises(ValueError, match=r"multi-token-prediction layer is a dense layer"):
    config_from_hf(dense_first)


def test_mtp_export_refusals():
  cfg = config_from_hf(MTP["qwen3_next"])
  family = _FAMILIES["Qwen3NextForCausalLM"]
  for changes, field in ((dict(mtp_depth=2), "mtp_depth"),
                         (dict(first_k_dense=1), "mtp_moe_block")):
    with pytest.raises(ValueError, match=f"has no .* equivalent: .*'{field}'"):
      family.config_to_hf(cfg.replace(**changes), "Qwen3NextForCausalLM")
  cfg = config_from_hf(MTP["deepseek_v3"]).replace(first_k_dense=2)
  with pytest.raises(ValueError, match="has no .* equivalent: .*'mtp_depth'"):
    _FAMILIES["DeepseekV3ForCausalLM"].config_to_hf(cfg, "DeepseekV3ForCausalLM")


def test_shared_copies_must_equal_the_originals():
  ours = _model("deepseek_v3")
  _, sd = to_hf(ours)
  del sd["model.layers.2.embed_tokens.weight"]   # the copies are optional
  state_from_hf(sd, ours.config)
  sd["model.layers.2.shared_head.head.weight"] = sd["lm_head.weight"] + 1
  with pytest.raises(ValueError, match=r"`model\.layers\.2\.shared_head\.head\.weight` differs "
                                       r"from `lm_head\.weight`"):
    state_from_hf(sd, ours.config)


def test_mtp_tensors_must_be_complete():
  ours = _model("qwen3_next")
  _, sd = to_hf(ours)
  del sd["mtp.layers.0.self_attn.k_proj.weight"]
  with pytest.raises(ValueError, match=r"`mtp\.layers\.0\.self_attn\.k_proj\.weight` is missing "
                                       r".*mtp/0/layer/mixer/k_proj"):
    state_from_hf(sd, ours.config)
