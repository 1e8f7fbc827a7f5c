"""``python -m jaxattn.convert --from-hf PATH --out CHECKPOINT`` on a tiny transformers Llama."""

import json
import pathlib

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


def _logits(model, tokens):
  return np.asarray(model(np.asarray(tokens, np.int32)), np.float32)


def test_sharded_checkpoints_read_what_their_index_names(llama_dir, tmp_path):
  """Shards are read as the index names them; other weight files in the directory (Mistral's
  repositories ship a `consolidated.safetensors` in their own naming) are left alone."""
  from safetensors.numpy import save_file
  from jaxattn.convert.hf import read_hf_weights
  want = read_hf_weights(llama_dir)
  names = sorted(want)
  halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
            "model-00002-of-00002.safetensors": names[len(names) // 2:]}
  sharded = tmp_path / "sharded"
  sharded.mkdir()
  (sharded / "config.json").write_text((pathlib.Path(llama_dir) / "config.json").read_text())
  for file, keys in halves.items():
    save_file({k: np.ascontiguousarray(want[k]) for k in keys}, str(sharded / file))
  index = {"metadata": {}, "weight_map": {k: f for f, keys in halves.items() for k in keys}}
  (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
  save_file({"tok_embeddings.weight": np.zeros((2, 2), np.float32)},
            str(sharded / "consolidated.safetensors"))
  got = read_hf_weights(str(sharded))
  assert sorted(got) == names
  tokens = [[1, 5, 9, 3]]
  np.testing.assert_array_equal(_logits(load_hf(str(sharded)), tokens),
                                _logits(load_hf(llama_dir), tokens))
  # The same shards as pytorch_model-*.bin with their index.
  bins = tmp_path / "bins"
  bins.mkdir()
  (bins / "config.json").write_text((sharded / "config.json").read_text())
  for i, keys in enumerate(halves.values()):
    torch.save({k: torch.from_numpy(np.array(want[k])) for k in keys},
               bins / f"pytorch_model-0000{i + 1}-of-00002.bin")
  (bins / "pytorch_model.bin.index.json").write_text(json.dumps(
      {"weight_map": {k: f"pytorch_model-0000{i + 1}-of-00002.bin"
                      for i, keys in enumerate(halves.values()) for k in keys}}))
  # a stray safetensors file (another naming) beside them is not what transformers would load
  save_file({"tok_embeddings.weight": np.zeros((2, 2), np.float32)},
            str(bins / "consolidated.safetensors"))
  got = read_hf_weights(str(bins))
  assert sorted(got) == names
  for k in names:
    np.testing.assert_array_equal(got[k], want[k])
  # An index naming a shard that is not there is an error that names it.
  index["weight_map"][names[0]] = "model-00003-of-00002.safetensors"
  (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
  with pytest.raises(ValueError, match="model-00003-of-00002.safetensors"):
    read_hf_weights(str(sharded))


def test_generate_cli_on_a_converted_checkpoint(llama_dir, tmp_path, capsys):
  """A converted model has its own vocabulary: text needs its tokenizer (``--tokenizer``), or
  raw ids; the byte-level tokenizer is not used for it."""
  from tokenizers import Tokenizer, models, pre_tokenizers
  from experiments import generate as generate_cli
  ckpt = tmp_path / "ckpt"
  assert main(["--from-hf", llama_dir, "--out", str(ckpt)]) == 0
  words = ["<unk>", "the", "cat", "sat", "on", "mat"]
  tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(
      tmp_path / "tok")
  capsys.readouterr()
  assert generate_cli.main(["--checkpoint", str(ckpt), "--tokenizer", str(tmp_path / "tok"),
                            "--prompt", "the cat", "--max-new-tokens", "3"]) == 0
  assert capsys.readouterr().out.startswith("the cat")
  assert generate_cli.main(["--checkpoint", str(ckpt), "--prompt-ids", "1,2,60",
                            "--max-new-tokens", "3"]) == 0
  printed = capsys.readouterr().out.split()
  assert len(printed) == 3 and all(0 <= int(t) < 64 for t in printed)   # raw ids
  with pytest.raises(SystemExit, match="64 tokens, not the byte-level 259: pass --tokenizer"):
    generate_cli.main(["--checkpoint", str(ckpt), "--prompt", "The "])
