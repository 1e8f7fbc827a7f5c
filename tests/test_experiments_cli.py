"""experiments/cli.py's comma-list argparse types, and the experiment scripts that use them: valid
lists parse to the lists the scripts used before, bad ones stop at parse time with an argparse
error naming the flag (exit status 2), before any JAX work."""

import argparse
import importlib

import pytest

from experiments import bench_train, demo, length_extrapolation, moe_balance, recall, report
from experiments.cli import CommaList, choice_list, float_list, int_list


def _refused(parse, text, *fragments):
  with pytest.raises(argparse.ArgumentTypeError) as e:
    parse(text)
  for f in fragments:
    assert f in str(e.value), (f, str(e.value))


# ---------------------------------------------------------------------------------------------
# The factories.
# ---------------------------------------------------------------------------------------------

def test_int_list():
  parse = int_list(minimum=1)
  assert parse("4096,8192") == [4096, 8192]
  assert parse(" 1 , 2,,3, ") == [1, 2, 3]           # spaces stripped, empty items dropped
  assert parse("7") == [7] and parse("2,2") == [2, 2]
  _refused(parse, "", "empty", "integers >= 1")
  _refused(parse, " , ,", "empty")
  _refused(parse, "4k,8192,1.5", "'4k', '1.5'", "integers >= 1")
  _refused(parse, "8,0,-3", "'0', '-3'", ">= 1")
  _refused(int_list(maximum=8), "9", "'9'", "integers <= 8")
  _refused(int_list(minimum=8, maximum=519), "7,520", "'7', '520'", "integers >= 8 and <= 519")
  assert int_list()("-1,0") == [-1, 0]
  assert int_list(allow_empty=True)(" ") == []


def test_float_list():
  assert float_list()("1, 2.5,1e3") == [1.0, 2.5, 1000.0]
  for bad in ("nan", "inf", "-inf", "x"):
    _refused(float_list(), f"1,{bad}", repr(bad), "finite numbers")
  nonneg = float_list(minimum=0)
  assert nonneg("0,0.1") == [0.0, 0.1]
  _refused(nonneg, "0,-0.1", "'-0.1'", ">= 0")
  positive = float_list(minimum=0, min_exclusive=True)
  assert positive("1,0.5") == [1.0, 0.5]
  _refused(positive, "0,1", "'0'", "> 0")
  _refused(float_list(maximum=1.0), "0.5,2", "'2'", "<= 1.0")
  _refused(positive, "", "empty")


def test_choice_list():
  parse = choice_list(("none", "bias", "bias+seq"))
  assert parse("bias, none") == ["bias", "none"]        # the order given
  assert parse("bias+seq") == ["bias+seq"]
  _refused(parse, "none,nope,Bias", "unknown 'nope', 'Bias'", "none, bias, bias+seq")
  _refused(parse, ",", "empty", "none, bias, bias+seq")
  assert choice_list({"a": 1, "b": 2})("b,a") == ["b", "a"]     # a dict's keys
  assert choice_list("ab", allow_empty=True)("") == []


def test_names_and_argparse_message(capsys):
  assert repr(int_list(minimum=1)) == int_list(minimum=1).__name__ == "int_list(minimum=1)"
  assert repr(int_list(minimum=0)) == "int_list(minimum=0)"
  assert repr(float_list(minimum=0, min_exclusive=True)) == (
      "float_list(minimum=0, min_exclusive=True)")
  assert repr(choice_list(("gqa", "mla"))) == "choice_list(gqa, mla)"
  ap = argparse.ArgumentParser(prog="prog")
  ap.add_argument("--contexts", type=int_list(minimum=1), default="1024, 4096")
  assert ap.parse_args([]).contexts == [1024, 4096]      # a string default goes through the type
  with pytest.raises(SystemExit) as e:
    ap.parse_args(["--contexts", "4k"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert ("argument --contexts: invalid '4k'; expected a comma-separated list of integers >= 1"
          in err)


def test_comma_list_custom_item():
  def pair(s):
    a, b = s.split(":")
    return int(a), int(b)

  parse = CommaList(pair, "A:B pairs of integers", name="pair_list")
  assert parse("1:2, 3:4") == [(1, 2), (3, 4)]
  _refused(parse, "1:2,3,x:1", "invalid '3', 'x:1'", "A:B pairs")
  assert repr(parse) == "pair_list"


# ---------------------------------------------------------------------------------------------
# The scripts.
# ---------------------------------------------------------------------------------------------

class _Parsed(Exception):
  """Raised in place of returning from ``parse_args``: carries the namespace, stops ``main``."""


def _parse_only(monkeypatch, name, argv):
  """The namespace ``experiments.<name>.main(argv)`` parses; nothing after the parsing runs."""
  module = importlib.import_module(f"experiments.{name}")
  original = argparse.ArgumentParser.parse_args

  def parse_args(self, args=None, namespace=None):
    raise _Parsed(original(self, args, namespace))

  monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
  with pytest.raises(_Parsed) as e:
    module.main(argv)
  return e.value.args[0]


def _defaults():
  return {
      "bench_decode": dict(kind=["gqa", "mla"], contexts=[1024, 4096], batches=[1, 4],
                           impls=["contiguous", "xla_paged"]),
      "bench_deltanet": dict(lengths=[1024, 2048, 4096, 8192, 16384],
                             contexts=[1024, 4096, 16384, 65536, 262144]),
      "bench_mla": dict(contexts=[1024, 4096, 16384, 32768], kv_heads=[16, 4]),
      "bench_moe": dict(paths=None),
      "bench_sparse": dict(lengths=[4096, 8192, 16384, 32768]),
      "bench_sparse_kernel": dict(kind=["mla", "gqa"], contexts=[8192, 32768]),
      "bench_train": dict(presets=list(bench_train.PRESETS)),
      "demo": dict(schemes=list(demo.SCHEMES)),
      "hadamard_quant": dict(outliers=[1.0, 10.0, 30.0, 100.0, 300.0, 1000.0]),
      "length_extrapolation": dict(eval_lens=[256, 512, 1024, 2048],
                                   schemes=list(length_extrapolation.SCHEMES)),
      "lora_finetune": dict(mem_sizes=["1024x8x8192"]),
      "mhc_stability": dict(drift=[0.0, 0.1, 0.2, 0.4]),
      "moe_balance": dict(modes=list(moe_balance.MODES)),
      "recall": dict(lengths=[32, 64, 128, 256], models=list(recall.MODELS)),
  }


def test_defaults_parse_to_the_lists_used_before(monkeypatch):
  for name, want in _defaults().items():
    args = _parse_only(monkeypatch, name, [])
    assert {k: getattr(args, k) for k in want} == want, name
    monkeypatch.undo()


def test_valid_values_and_the_report_flags_parse(monkeypatch, tmp_path):
  args = _parse_only(monkeypatch, "bench_decode", ["--kind", "mla", "--contexts", "32768",
                                                   "--batches", "8, 32"])
  assert (args.kind, args.contexts, args.batches) == (["mla"], [32768], [8, 32])
  monkeypatch.undo()
  args = _parse_only(monkeypatch, "bench_moe", ["--paths", "blocked,capacity"])
  assert args.paths == ["blocked", "capacity"]
  monkeypatch.undo()
  assert _parse_only(monkeypatch, "bench_moe", ["--paths", ""]).paths == []   # -> the default
  monkeypatch.undo()
  assert _parse_only(monkeypatch, "lora_finetune", ["--mem-sizes", ""]).mem_sizes == []
  monkeypatch.undo()
  # Every flag set the report passes (experiments/report.py) still parses.
  for name, sizes in report.FLAGS.items():
    for flags in sizes.values():
      _parse_only(monkeypatch, name, list(flags) + ["--out", str(tmp_path)])
      monkeypatch.undo()


BAD = [
    ("bench_decode", ["--contexts", "4k"], "--contexts", "'4k'"),
    ("bench_decode", ["--kind", "gqa,mha"], "--kind", "unknown 'mha'"),
    ("bench_decode", ["--impls", "xla_paged,paged"], "--impls", "unknown 'paged'"),
    ("bench_decode", ["--batches", "0"], "--batches", ">= 1"),
    ("bench_deltanet", ["--contexts", "1024,x"], "--contexts", "'x'"),
    ("bench_mla", ["--kv-heads", "16,0"], "--kv-heads", "'0'"),
    ("bench_mla", ["--contexts", "1024,4096.5"], "--contexts", "'4096.5'"),
    ("bench_moe", ["--paths", "dense,sparse"], "--paths", "unknown 'sparse'"),
    ("bench_sparse", ["--lengths", "4096,8k"], "--lengths", "'8k'"),
    ("bench_sparse_kernel", ["--kind", "mla,mha"], "--kind", "unknown 'mha'"),
    ("bench_sparse_kernel", ["--kind", " , "], "--kind", "empty"),
    ("bench_sparse_kernel", ["--contexts", "8192,-1"], "--contexts", "'-1'"),
    ("bench_serve", ["--prompt-lens", "8"], "--prompt-lens", "'low,high'"),
    ("bench_serve", ["--new-tokens", "9,3"], "--new-tokens", "'low,high'"),
    ("bench_serve", ["--prompt-lens", "0,4"], "--prompt-lens", "'0'"),
    ("bench_serve", ["--max-batch", "0"], "--max-batch", "must be an int >= 1, got 0"),
    ("bench_serve", ["--shared-prefix", "-1"], "--shared-prefix", "must be an int >= 0, got -1"),
    ("bench_serve", ["--preset", "gpt-2"], "--preset", "invalid choice: 'gpt-2'"),
    ("bench_train", ["--presets", "llama,gpt2"], "--presets", "unknown 'gpt2'"),
    ("bench_train", ["--steps", "0"], "--steps", "must be an int >= 1, got 0"),
    ("bench_train", ["--warmup", "-1"], "--warmup", "must be an int >= 0, got -1"),
    ("bench_train", ["--matmul-size", "0"], "--matmul-size", "must be an int >= 1, got 0"),
    ("bench_train", ["--batch-size", "0"], "--batch-size", "must be an int >= 1, got 0"),
    ("bench_train", ["--seq-len", "1"], "--seq-len", "must be an int >= 2, got 1"),
    ("bench_train", ["--steps", "2.5"], "--steps", "must be an int >= 1, got '2.5'"),
    ("demo", ["--schemes", "rope,xpos"], "--schemes", "unknown 'xpos'"),
    ("hadamard_quant", ["--outliers", "1,inf"], "--outliers", "'inf'"),
    ("hadamard_quant", ["--outliers", "0,10"], "--outliers", "> 0"),
    ("length_extrapolation", ["--eval-lens", "256,-512"], "--eval-lens", "'-512'"),
    ("length_extrapolation", ["--schemes", "rope,kerple"], "--schemes", "unknown 'kerple'"),
    ("lora_finetune", ["--mem-sizes", "64x1"], "--mem-sizes", "'64x1'"),
    ("mhc_stability", ["--drift", "0,-0.1"], "--drift", ">= 0"),
    ("mhc_stability", ["--drift", "0,nan"], "--drift", "'nan'"),
    ("moe_balance", ["--modes", "none,aux"], "--modes", "unknown 'aux'"),
    ("moe_balance", ["--modes", ""], "--modes", "empty"),
    ("recall", ["--lengths", "4,64"], "--lengths", "'4'"),
    ("recall", ["--models", "dn,rnn"], "--models", "unknown 'rnn'"),
]


@pytest.mark.parametrize("name,argv,flag,fragment", BAD,
                         ids=[f"{b[0]}{b[1][0]}={b[1][1]}" for b in BAD])
def test_bad_list_is_an_argparse_error(name, argv, flag, fragment, capsys, tmp_path):
  """The real ``main`` (no patching): a bad value exits 2 at parse time, nothing written."""
  module = importlib.import_module(f"experiments.{name}")
  out = tmp_path / "out"
  with pytest.raises(SystemExit) as e:
    module.main(argv + ["--out", str(out)])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert f"argument {flag}: " in err and fragment in err, err
  assert not out.exists()   # refused before the script created its output folder


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(steps=0), "`steps` must be an int >= 1, got 0."),
    (dict(warmup=-1), "`warmup` must be an int >= 0, got -1."),
    (dict(matmul_size=0), "`matmul_size` must be an int >= 1, got 0."),
    (dict(batch_size=0), "`batch_size` must be an int >= 1, got 0."),
    (dict(seq_len=1), "`seq_len` must be an int >= 2, got 1."),
    (dict(steps=2.0), "`steps` must be an int >= 1, got 2.0."),
])
def test_bench_train_run_checks_its_counts_before_any_work(monkeypatch, kwargs, fragment):
  """``steps=0`` died in the matmul timing with statistics' "no median for empty data" (naming no
  argument), ``warmup=-1`` only after a full matmul timing: both are refused before any work."""
  def no_work(*a, **k):
    raise AssertionError("ran work before checking the arguments")

  for name in ("tokenize_documents", "matmul_gflops", "bench_preset"):
    monkeypatch.setattr(bench_train, name, no_work)
  with pytest.raises(ValueError) as e:
    bench_train.run(**{**dict(presets=["llama"], batch_size=2, seq_len=8, matmul_size=8,
                              steps=1, warmup=0), **kwargs})
  assert fragment in str(e.value)


# ---------------------------------------------------------------------------------------------
# experiments.generate --draft (speculative decoding).
# ---------------------------------------------------------------------------------------------

def _untrained_run(out, **overrides):
  """An ``experiments.train`` output without the training: ``config.json`` and a tiny llama's
  initial train state as step 0, what ``experiments.generate.load_run`` reads."""
  from flax import nnx

  from jaxattn.configs import get_config
  from jaxattn.nn.model import DecoderLM
  from jaxattn.train.checkpoint import Checkpointer
  from jaxattn.train.step import init_train_state, make_optimizer
  cfg = get_config("llama", **{**dict(num_layers=1, embed_dim=32, mlp_dim=64), **overrides})
  _, state = init_train_state(DecoderLM(cfg, rngs=nnx.Rngs(0)), make_optimizer())
  out.mkdir(parents=True)
  (out / "config.json").write_text(cfg.to_json())
  ckpt = Checkpointer(out / "checkpoints")
  ckpt.save(0, state, force=True)
  ckpt.close()
  return out


def test_generate_draft_ngram_gives_the_same_greedy_text(tmp_path, capsys):
  """``--draft ngram`` / ``--draft RUN`` / ``--draft mtp``: the greedy text without the draft,
  and the speculative statistics after it; a draft of another vocabulary, a draft that is no run and
  ``--num-draft-tokens`` without ``--draft`` stop as usage errors (exit status 2) with the
  library's / the flag's message."""
  from experiments import generate as generate_cli
  run = _untrained_run(tmp_path / "run", num_layers=2)
  base = ["--run", str(run), "--prompt", "abcabcabc", "--max-new-tokens", "12", "--eos-id", "-1"]
  assert generate_cli.main(base) == 0
  plain = capsys.readouterr()
  assert "speculative" not in plain.err
  assert generate_cli.main(base + ["--draft", "ngram", "--num-draft-tokens", "3"]) == 0
  spec = capsys.readouterr()
  assert spec.out == plain.out and spec.out.startswith("abcabcabc")
  penalties = ["--repetition-penalty", "1.3", "--presence-penalty", "0.2",
               "--frequency-penalty", "0.2"]
  assert generate_cli.main(base + penalties) == 0
  penalized = capsys.readouterr().out
  assert penalized.startswith("abcabcabc")
  assert generate_cli.main(base + penalties + ["--draft", "ngram", "--num-draft-tokens", "3"]) == 0
  assert capsys.readouterr().out == penalized          # greedy: the same text with drafts
  assert "[speculative (ngram, 3 drafts per call): acceptance " in spec.err
  assert "tokens per model call" in spec.err
  draft = _untrained_run(tmp_path / "draft")
  assert generate_cli.main(base + ["--draft", str(draft)]) == 0
  spec = capsys.readouterr()
  assert spec.out == plain.out and f"[speculative (draft {draft}, 4 drafts" in spec.err
  mtp = _untrained_run(tmp_path / "mtp", num_layers=2, mtp_depth=1)   # drafts with its module
  mtp_base = ["--run", str(mtp)] + base[2:]
  assert generate_cli.main(mtp_base) == 0
  plain_mtp = capsys.readouterr()
  assert generate_cli.main(mtp_base + ["--draft", "mtp", "--num-draft-tokens", "2"]) == 0
  spec = capsys.readouterr()
  assert spec.out == plain_mtp.out and "[speculative (mtp, 2 drafts per call)" in spec.err
  other = _untrained_run(tmp_path / "other", vocab_size=300)
  for argv, fragment in [
      (["--draft", str(other)], "`draft`'s vocab_size (300) must equal the model's (259)"),
      (["--draft", str(tmp_path)], "argument --draft: must be 'ngram', 'mtp' or an"),
      (["--num-draft-tokens", "2"], "argument --num-draft-tokens: needs --draft"),
      (["--draft", "ngram", "--num-draft-tokens", "0"], "`num_draft_tokens` must be an int in"),
      (["--draft", "mtp"], "this model has none (mtp_depth=0)"),
      (["--repetition-penalty", "0"], "argument --repetition-penalty: must be a number > 0"),
      (["--frequency-penalty", "nan"], "argument --frequency-penalty: must be a finite number"),
  ]:
    with pytest.raises(SystemExit) as e:
      generate_cli.main(base + argv)
    assert e.value.code == 2, argv
    assert fragment in capsys.readouterr().err, argv
