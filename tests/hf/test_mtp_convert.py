"""Multi-token-prediction checkpoints against transformers' own MTP model (PyTorch, CPU, fp32).

Each family's tiny random transformers model is saved with ``save_pretrained``; its checkpoint
then gets one MTP module in the published layout, with fresh random values: DeepSeek-V3's extra
layer ``model.layers.{L}`` (a full decoder layer, MLA + MoE, beside ``enorm`` / ``hnorm`` /
``eh_proj`` / ``shared_head.norm`` and the copies of the embedding and the head), Qwen3-Next's
``mtp.*`` (``fc``, ``pre_fc_norm_embedding`` / ``pre_fc_norm_hidden``, a gated-attention MoE
layer ``layers.0``, ``norm``; zero-centred norms).  transformers reads that checkpoint with its
generic ``MtpModel.from_pretrained`` (its own renaming of the checkpoint names, its own decoder
layer, norm and ``eh_proj`` Linear, the main model's embedding and head); ``load_hf`` reads the
same directory.  Contract: given the same hidden states, depth 1's logits of
``DecoderLM.mtp_forward`` equal ``MtpModel``'s within ``1e-4`` (fp32; observed ~1e-6).
"""

import importlib
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxattn.convert import load_hf, to_hf  # noqa: E402
from test_convert_hf import COMMON, VOCAB, _deepseek_v3, _qwen3_next  # noqa: E402

pytestmark = pytest.mark.hf

MtpModel = getattr(importlib.import_module("transformers.modeling_layers"), "MtpModel", None)

# The families' tiny models of the conversion tests; transformers' DeepSeek-V3 config states
# one MTP layer by default (num_nextn_predict_layers=1), so its checkpoint here gets one.
D = COMMON["hidden_size"]


def _deepseek_mtp(sd, g):
  """DeepSeek's MTP layer ``model.layers.2``: the tensors of a decoder layer like layer 1, the
  module's own four, and copies of the embedding and the head."""
  out = {"model.layers.2." + k[len("model.layers.1."):]: v for k, v in sd.items()
         if k.startswith("model.layers.1.")}
  out.update({"model.layers.2.enorm.weight": sd["model.norm.weight"],
              "model.layers.2.hnorm.weight": sd["model.norm.weight"],
              "model.layers.2.shared_head.norm.weight": sd["model.norm.weight"],
              "model.layers.2.eh_proj.weight": torch.zeros(D, 2 * D)})
  out = _randomized(out, g)
  out["model.layers.2.embed_tokens.weight"] = sd["model.embed_tokens.weight"].clone()
  out["model.layers.2.shared_head.head.weight"] = sd["lm_head.weight"].clone()
  return out


def _qwen3_next_mtp(sd, g):
  """Qwen3-Next's ``mtp.*``: a decoder layer like layer 1 (full attention) as ``mtp.layers.0``,
  ``fc`` and three zero-centred norms."""
  out = {"mtp.layers.0." + k[len("model.layers.1."):]: v for k, v in sd.items()
         if k.startswith("model.layers.1.")}
  out.update({f"mtp.{n}.weight": sd["model.norm.weight"]
              for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")})
  out["mtp.fc.weight"] = torch.zeros(D, 2 * D)
  return _randomized(out, g)


FAMILIES = {"deepseek_v3": (_deepseek_v3, "DeepseekV3ForCausalLM", _deepseek_mtp),
            "qwen3_next": (_qwen3_next, "Qwen3NextForCausalLM", _qwen3_next_mtp)}


def _randomized(tensors, g):
  """Fresh values of each tensor's shape: norm scales and the router's correction bias far from
  their initial values, so that a misplaced one shows in the logits."""
  out = {}
  for k, v in tensors.items():
    noise = torch.randn(v.shape, generator=g)
    if k.endswith("norm.weight"):
      out[k] = 1 + 0.2 * noise
    elif k.endswith("e_score_correction_bias"):
      out[k] = 0.05 * noise
    else:
      out[k] = 0.1 * noise
  return out


@pytest.fixture(scope="module")
def quiet_transformers():
  # from_pretrained lists the MTP tensors the main model does not use (as unexpected keys)
  level = transformers.logging.get_verbosity()
  transformers.logging.set_verbosity_error()
  yield
  transformers.logging.set_verbosity(level)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory, quiet_transformers):
  """``(name, directory, transformers' MtpModel)`` of a checkpoint with one MTP module."""
  from safetensors.torch import load_file, save_file
  if MtpModel is None:
    pytest.skip("this transformers has no MtpModel")
  config_fn, cls_name, mtp_fn = FAMILIES[request.param]
  torch.manual_seed(0)
  config = config_fn()
  config._attn_implementation = "eager"
  path = str(tmp_path_factory.mktemp(request.param + "_mtp"))
  getattr(transformers, cls_name)(config).save_pretrained(path)
  file = os.path.join(path, "model.safetensors")
  sd = load_file(file)
  sd.update(mtp_fn(sd, torch.Generator().manual_seed(1)))
  save_file(sd, file, metadata={"format": "pt"})
  main = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
  if request.param == "deepseek_v3":
    # MtpModel finds the MTP tensors by the main model's ignore patterns, which name the
    # published model's layer 61
    main._keys_to_ignore_on_load_unexpected = [r"model\.layers\.2\..*"]
  else:
    # transformers' Qwen3NextConfig has no MTP fields: one module, a full-attention block
    main.config.num_mtp_layers = 1
    main.config.mtp_layer_types = ["full_attention"]
  mtp = MtpModel.from_pretrained(main.eval()).eval()   # raises on any MTP tensor it misses
  return request.param, path, mtp


@nnx.jit
def _mtp_logits(model, hidden, tokens):
  return model.mtp_forward(hidden, tokens)[0]


def test_mtp_logits_match_transformers(checkpoint):
  _, path, theirs = checkpoint
  ours = load_hf(path)
  assert ours.config.mtp_depth == 1 and len(ours.mtp) == 1
  rng = np.random.default_rng(0)
  hidden = rng.standard_normal((2, 12, D)).astype(np.float32)
  tokens = rng.integers(0, VOCAB, (2, 12))
  # Depth 1 at position i reads h_i and the embedding of token i + 1 (ours pads past the row
  # with token 0: so does the input given to transformers).
  ahead = np.concatenate([tokens[:, 1:], np.zeros((2, 1), tokens.dtype)], axis=1)
  positions = torch.arange(12)[None].expand(2, 12)
  with torch.no_grad():
    h = theirs.forward_layer(0, torch.from_numpy(hidden), positions, None,
                             input_ids=torch.from_numpy(ahead))
    want = theirs._project_to_logits(h).numpy()
  got = np.asarray(_mtp_logits(ours, jnp.asarray(hidden), jnp.asarray(tokens)))
  err = np.abs(got - want).max()
  assert err <= 1e-4, (err, np.abs(want).max())
  assert np.abs(want).max() > 1.0  # logits of some size: the comparison is not of near-zeros


def test_mtp_tensors_export_as_read(checkpoint):
  """Export writes back every tensor of the checkpoint, the MTP module's (and DeepSeek's copies
  of the embedding and the head) included, under the same names."""
  from safetensors.numpy import load_file
  name, path, _ = checkpoint
  want = load_file(os.path.join(path, "model.safetensors"))
  _, got = to_hf(load_hf(path))
  assert sorted(got) == sorted(want)
  # Qwen3-Next stores its norms as w with the norm computing 1 + w: (1 + w) - 1 rounds
  tol = 2 ** -23 * 4 if name == "qwen3_next" else 0
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=0, atol=tol, err_msg=k)


def test_mtp_depth_zero_drops_the_module(checkpoint):
  _, path, _ = checkpoint
  ours = load_hf(path, mtp_depth=0)
  assert ours.config.mtp_depth == 0 and ours.mtp is None
