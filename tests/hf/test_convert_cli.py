"""``python -m jaxattn.convert --from-hf PATH --out CHECKPOINT`` on a tiny transformers Llama."""

import json

import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxattn.convert import load_checkpoint, load_hf  # noqa: E402
from jaxattn.convert.__main__ import main  # noqa: E402

pytestmark = pytest.mark.hf


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
  torch.manual_seed(0)
  config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2)
  path = tmp_path_factory.mktemp("llama_hf")
  transformers.LlamaForCausalLM(config).save_pretrained(path)
  return str(path)


def _leaves(model):
  return {p: np.asarray(v.get_value(), np.float32) for p, v in nnx.to_flat_state(nnx.state(model))}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cli_writes_a_loadable_checkpoint(llama_dir, tmp_path, dtype, capsys):
  out = tmp_path / "ckpt"
  assert main(["--from-hf", llama_dir, "--out", str(out), "--dtype", dtype]) == 0
  assert "wrote" in capsys.readouterr().out
  config = json.loads((out / "config.json").read_text())
  assert config["param_dtype"] == dtype and config["layer_pattern"] == "A"
  loaded = load_checkpoint(str(out))
  assert loaded.config == load_hf(llama_dir, dtype=dtype).config
  want = _leaves(load_hf(llama_dir))  # fp32 conversion of the same directory
  got = _leaves(loaded)
  assert got.keys() == want.keys()
  tol = 0 if dtype == "float32" else 2 ** -8  # bf16 keeps 8 significant bits
  for p in want:
    np.testing.assert_allclose(got[p], want[p], rtol=tol, atol=0, err_msg=str(p))
  assert {str(v.get_value().dtype) for _, v in nnx.to_flat_state(nnx.state(loaded))} == {dtype}


def test_cli_rejects_an_unsupported_checkpoint(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
  with pytest.raises(ValueError, match="GPT2LMHeadModel"):
    main(["--from-hf", str(tmp_path), "--out", str(tmp_path / "out")])


def test_bf16_safetensors_load_exactly(tmp_path):
  torch.manual_seed(1)
  config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                    num_hidden_layers=1, num_attention_heads=4,
                                    tie_word_embeddings=True)
  theirs = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
  theirs.save_pretrained(tmp_path)
  ours = load_hf(str(tmp_path))  # bf16 on disk, fp32 parameters: every value exact
  np.testing.assert_array_equal(np.asarray(ours.embed.get_value()),
                                theirs.model.embed_tokens.weight.detach().float().numpy())
  up = theirs.model.layers[0].mlp.up_proj.weight.detach().float().numpy()
  np.testing.assert_array_equal(np.asarray(ours.groups[0].unit.layers[0].ffn.up.kernel.get_value()),
                                up.T)
