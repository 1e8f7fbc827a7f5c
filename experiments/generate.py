"""Generate text from a trained (or converted) checkpoint with the KV cache, streaming tokens.

    python -m experiments.generate --run runs/train [--prompt "The "] [--max-new-tokens 200]
        [--temperature 0.8] [--top-k 50] [--top-p 0.95] [--min-p 0.05] [--seed 0] [--step N]
        [--eos-id ID] [--repetition-penalty 1.2] [--presence-penalty 0.5] [--frequency-penalty 0.5]
    python -m experiments.generate --checkpoint converted/ --tokenizer hf_dir/ --prompt "The "

``--run`` is a directory written by ``experiments.train`` (``config.json`` + ``checkpoints/``); the
newest readable step is loaded unless ``--step``.  ``--checkpoint`` instead loads a checkpoint
written by ``python -m jaxattn.convert`` (converted Hugging Face weights).  Prefill runs the prompt
once, then one jitted decode step per token; greedy when ``--temperature 0``.  Text is byte-level
(``jaxattn.train.data.ByteTokenizer``) for trained runs.  A converted model has its own vocabulary:
``--tokenizer`` names the Hugging Face directory its tokenizer files are in (needs
``transformers``), or ``--prompt-ids`` takes raw token ids (and raw ids are printed).

Generation stops early at the end-of-sequence token: by default the tokenizer's (the byte-level
EOS that ``experiments.train`` appends to every document, or the Hugging Face tokenizer's
``eos_token_id``); ``--eos-id N`` names another, ``--eos-id -1`` never stops early.
``--cache-dtype int8`` (or ``float8_e4m3fn``) decodes from a quantized KV cache.

``--draft ngram`` (prompt lookup), ``--draft mtp`` (the model's own multi-token prediction, for a
model trained with ``--set mtp_depth=1``) or ``--draft RUN`` (an ``experiments.train`` output whose
model, of the same vocabulary, drafts) decodes speculatively (``jaxattn.speculative``): the draft
proposes ``--num-draft-tokens`` tokens that the model checks in one call.  Greedy text is the
same as without it; sampled text has the same distribution (other draws).  The acceptance rate
and tokens per model call are printed after the text, to stderr.  Arguments the library refuses
(a draft of another vocabulary, say) stop the script with its message, as the flags' errors do.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time

import jax
import numpy as np
from flax import nnx

from jaxattn.generation import TextStream, generate
from jaxattn.nn.model import DecoderLM, ModelConfig
from jaxattn.speculative import speculative_generate
from jaxattn.train.checkpoint import Checkpointer
from jaxattn.train.data import ByteTokenizer
from jaxattn.train.step import init_train_state, make_optimizer


def load_run(run: str | pathlib.Path, step: int | None = None) -> tuple[DecoderLM, int]:
  """The model of a training run at ``step`` (default: newest readable), and that step."""
  run = pathlib.Path(run)
  cfg_path = run / "config.json"
  if not cfg_path.exists():
    raise FileNotFoundError(f"{cfg_path} not found: `--run` must be an experiments.train output "
                            "directory (with config.json and checkpoints/).")
  cfg = ModelConfig.from_dict(json.loads(cfg_path.read_text()))
  tx = make_optimizer()  # only the optimizer state's structure matters for the restore target
  abstract_model = nnx.eval_shape(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0)))

  def init():
    model = DecoderLM(cfg, rngs=nnx.Rngs(0))
    return init_train_state(model, tx)[1]

  target = jax.eval_shape(init)
  ckpt = Checkpointer(run / "checkpoints")
  # (a reader: a corrupted newest step is skipped, not moved aside under the training run)
  state, _ = ckpt.restore(step, target=target, fallback=step is None, quarantine=False)
  ckpt.close()
  graphdef, _, _ = nnx.split(abstract_model, nnx.Param, ...)
  return nnx.merge(graphdef, state.params, state.rest), int(state.step)


def _text_codec(args, vocab_size: int):
  """``(encode, decode, eos_id)`` for the model's vocabulary: a Hugging Face tokenizer
  (``--tokenizer``), the byte-level one when the vocabulary is its, else ``decode=None`` (raw ids
  are printed), an ``encode`` that asks for ``--prompt-ids`` and no end-of-sequence id."""
  if args.tokenizer:
    try:
      from transformers import AutoTokenizer
    except ImportError as e:
      raise SystemExit(f"--tokenizer needs transformers ({e}); or pass --prompt-ids.") from e
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    return (lambda text: np.asarray(tok(text)["input_ids"], np.int32),
            lambda ids: tok.decode([int(i) for i in ids]), tok.eos_token_id)
  if vocab_size == ByteTokenizer.vocab_size or (args.run and vocab_size > ByteTokenizer.vocab_size):
    # experiments.train feeds byte ids to any vocabulary of at least the byte tokenizer's size.
    tokenizer = ByteTokenizer()
    return lambda text: tokenizer.encode(text, add_bos=True), tokenizer.decode, tokenizer.eos_id

  def refuse(text):
    raise SystemExit(f"the model's vocabulary has {vocab_size} tokens, not the byte-level "
                     f"{ByteTokenizer.vocab_size}: pass --tokenizer DIR (its Hugging Face "
                     "tokenizer) or --prompt-ids to give the prompt.")
  return refuse, None, None


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  src = p.add_mutually_exclusive_group(required=True)
  src.add_argument("--run", help="experiments.train output directory")
  src.add_argument("--checkpoint", help="a jaxattn.convert checkpoint directory")
  p.add_argument("--step", type=int, default=None)
  p.add_argument("--prompt", default="The ")
  p.add_argument("--prompt-ids", default=None, help="comma-separated token ids instead of text")
  p.add_argument("--max-new-tokens", type=int, default=200)
  p.add_argument("--temperature", type=float, default=0.0)
  p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely (0: all)")
  p.add_argument("--top-p", type=float, default=1.0)
  p.add_argument("--min-p", type=float, default=0.0,
                 help="drop tokens less likely than this times the most likely one (0: none)")
  p.add_argument("--repetition-penalty", type=float, default=1.0,
                 help="divide positive / multiply negative logits of tokens already in the "
                      "prompt or output by this (1: none)")
  p.add_argument("--presence-penalty", type=float, default=0.0,
                 help="subtract this from the logit of every token generated so far (0: none)")
  p.add_argument("--frequency-penalty", type=float, default=0.0,
                 help="subtract this times its count so far from each token's logit (0: none)")
  p.add_argument("--tokenizer", default=None,
                 help="a Hugging Face tokenizer directory (a converted model's vocabulary)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--cache-dtype", choices=("int8", "float8_e4m3fn"), default=None,
                 help="a quantized KV cache (default: the model's compute dtype)")
  p.add_argument("--eos-id", type=int, default=None,
                 help="stop a sequence at this token id (default: the tokenizer's end-of-sequence "
                      "id; -1: never stop early)")
  p.add_argument("--draft", default=None,
                 help="speculative decoding: 'ngram' (prompt lookup), 'mtp' (the model's "
                      "multi-token prediction) or an experiments.train output directory whose "
                      "model drafts")
  p.add_argument("--num-draft-tokens", type=int, default=None,
                 help="with --draft: tokens drafted per model call (default 4)")
  args = p.parse_args(argv)
  # Checked before loading anything, as argparse errors naming the flag (not a traceback).
  if not (math.isfinite(args.temperature) and args.temperature >= 0):
    p.error(f"argument --temperature: must be a number >= 0 (0: greedy), got {args.temperature}")
  if args.top_k < 0:
    p.error(f"argument --top-k: must be an int >= 0 (0: all), got {args.top_k}")
  if not 0 < args.top_p <= 1:   # also refuses NaN
    p.error(f"argument --top-p: must be in (0, 1], got {args.top_p}")
  if not 0 <= args.min_p <= 1:   # also refuses NaN
    p.error(f"argument --min-p: must be in [0, 1], got {args.min_p}")
  if not (math.isfinite(args.repetition_penalty) and args.repetition_penalty > 0):
    p.error(f"argument --repetition-penalty: must be a number > 0 (1: none), got "
            f"{args.repetition_penalty}")
  for flag, value in (("presence", args.presence_penalty), ("frequency", args.frequency_penalty)):
    if not math.isfinite(value):
      p.error(f"argument --{flag}-penalty: must be a finite number (0: none), got {value}")
  if args.max_new_tokens < 0:
    p.error(f"argument --max-new-tokens: must be an int >= 0, got {args.max_new_tokens}")
  if args.eos_id is not None and args.eos_id < -1:
    p.error(f"argument --eos-id: must be a token id >= 0, or -1 (never stop early), "
            f"got {args.eos_id}")
  if args.prompt_ids:
    try:
      prompt_ids = [int(t) for t in args.prompt_ids.split(",")]
    except ValueError:
      p.error(f"argument --prompt-ids: must be comma-separated ints, got {args.prompt_ids!r}")
  if args.draft is not None and args.draft not in ("ngram", "mtp") and not (
      pathlib.Path(args.draft) / "config.json").exists():
    p.error(f"argument --draft: must be 'ngram', 'mtp' or an experiments.train output directory "
            f"(with config.json and checkpoints/), got {args.draft!r}")
  if args.num_draft_tokens is not None and args.draft is None:
    p.error("argument --num-draft-tokens: needs --draft")
  num_draft_tokens = 4 if args.num_draft_tokens is None else args.num_draft_tokens

  if args.run:
    model, step = load_run(args.run, args.step)
    print(f"loaded {args.run} at step {step}", file=sys.stderr)
  else:
    from jaxattn.convert import load_checkpoint
    model = load_checkpoint(args.checkpoint)
  draft = args.draft
  if draft is not None and draft not in ("ngram", "mtp"):
    draft, draft_step = load_run(args.draft)
    print(f"loaded draft {args.draft} at step {draft_step}", file=sys.stderr)
  encode, decode, eos_id = _text_codec(args, model.config.vocab_size)
  if args.eos_id is not None:
    eos_id = None if args.eos_id == -1 else args.eos_id
  if eos_id is not None and eos_id >= model.config.vocab_size:
    p.error(f"argument --eos-id: {eos_id} is not in the model's vocabulary of "
            f"{model.config.vocab_size} tokens")
  if args.prompt_ids:
    prompt = np.array([prompt_ids], np.int32)
  else:
    prompt = encode(args.prompt)[None, :]
    print(args.prompt, end="", flush=True)
  if decode is None:
    show = lambda ids: print(f" {int(ids[0])}", end="", flush=True)
  else:
    text = TextStream(decode)   # whole characters, and the tokenizer's spacing
    show = lambda ids: print(text.feed(ids[:1]), end="", flush=True)
  shown = []
  stream = lambda ids: shown.append(1) or show(ids)
  settings = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                  min_p=args.min_p, seed=args.seed, eos_id=eos_id, on_token=stream,
                  cache_dtype=args.cache_dtype)
  settings.update(repetition_penalty=args.repetition_penalty,
                  presence_penalty=args.presence_penalty,
                  frequency_penalty=args.frequency_penalty)
  t0 = time.perf_counter()
  try:
    if draft is None:
      out, stats = generate(model, prompt, args.max_new_tokens, **settings), None
    else:
      out, stats = speculative_generate(model, prompt, args.max_new_tokens, draft=draft,
                                        num_draft_tokens=num_draft_tokens, **settings)
  except ValueError as e:
    if shown:       # refused mid-generation: not a usage error
      raise
    # The library checks its arguments before generating anything: its message, as a usage error.
    print(file=sys.stderr)
    p.error(str(e))
  dt = time.perf_counter() - t0
  if decode is not None:
    print(text.flush(), end="")
  n = out.shape[1] - prompt.shape[1]
  print(f"\n[{n} tokens in {dt:.2f} s incl. compile]", file=sys.stderr)
  if stats is not None:
    name = args.draft if args.draft in ("ngram", "mtp") else f"draft {args.draft}"
    print(f"[speculative ({name}, {num_draft_tokens} drafts per call): acceptance "
          f"{stats.acceptance_rate:.1%} ({stats.accepted}/{stats.drafted}), "
          f"{stats.tokens_per_call:.2f} tokens per model call over {stats.rounds} calls after "
          f"the prefill]", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
