"""Length extrapolation of positional schemes: train at one length, evaluate at longer ones.

    python -m experiments.length_extrapolation [--steps 100] [--train-len 256]
        [--eval-lens 256,512,1024,2048] [--schemes learned,sinusoidal,t5,alibi,rope,nope]
        [--batch-size 8] [--out runs/length_extrapolation]

The seeds' section 3.2, property 4 (extrapolation): a positional scheme is judged by what a model
does at positions it never saw in training.  One tiny decoder per scheme -- same size, same data,
same steps, same seed, only ``position`` differs (the ``llama-*`` presets of ``jaxattn.configs``):

    learned      a trainable table with ``max_seq_len = train_len`` rows (it has no row beyond)
    sinusoidal   fixed sin/cos added to the embeddings
    t5           learned per-head bias over log-spaced relative-distance buckets
    alibi        fixed linear distance penalty per head
    rope         rotary embedding of queries and keys
    nope         no positional information at all (a causal mask alone), the control

Data: the built-in byte-level text (Python's documentation topics, ``jaxattn.train.data``),
split by document: every ``--eval-every``-th document is held out.  Training rows are the shuffled
training documents packed end to end (``[BOS] doc [EOS]``) and cut at ``--train-len``, attended
causally across document edges with positions ``0 .. T-1``: exactly the form of the evaluation
rows, so that the length is the only thing that changes between training and evaluation.
Evaluation concatenates the held-out documents into one stream and cuts the SAME first
``num_tokens`` tokens (a multiple of the longest evaluation length) into non-overlapping rows of
each evaluation length ``L``; the loss counts every next-token prediction that stays inside a
document.  Longer rows give later tokens more context, which by itself lowers the loss; a scheme
that does not extrapolate shows up as a loss that rises past the training length instead.

Writes ``results.json`` (per scheme: training curve, per-length loss / perplexity, loss on the
positions beyond the training length, binned loss by position) and ``length_extrapolation.png``
(perplexity vs evaluation length, log y; loss by position at the longest length) under ``--out``,
and prints a table.  Tiny CPU models trained for a few hundred thousand tokens: read the shapes of
the curves, not the absolute perplexities.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from experiments.cli import choice_list, int_list
from jaxattn.configs import get_config
from jaxattn.nn.model import DecoderLM, ModelConfig
from jaxattn.train.data import (BOS, EOS, PackedDataset, load_text, split_documents,
                                tokenize_documents)
from jaxattn.train.step import init_train_state, make_optimizer, make_train_step

try:
  from tqdm import tqdm
except ImportError:  # pragma: no cover - tqdm is optional
  def tqdm(it, **_):
    return it

# scheme -> the preset that differs from "llama" only in ``position``.
PRESETS = {"learned": "llama-learned", "sinusoidal": "llama-sinusoidal", "t5": "llama-t5",
           "alibi": "llama-alibi", "rope": "llama", "nope": "llama-nope"}
SCHEMES = tuple(PRESETS)
POSITION_BIN = 64  # tokens per bin of the loss-by-position curve


def scheme_config(scheme: str, *, train_len: int, max_eval_len: int, embed_dim: int = 64,
                  num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                  mlp_dim: int = 192) -> ModelConfig:
  """The tiny model of ``scheme``; only ``position`` (and the learned table's size) differ.

  ``learned`` gets ``max_seq_len = train_len``: a table as long as the training rows, as GPT-2's
  is as long as its context; every other scheme is sized for the longest evaluation.
  """
  if scheme not in PRESETS:
    raise ValueError(f"`scheme` must be one of {SCHEMES}, got {scheme!r}.")
  max_len = train_len if scheme == "learned" else max(train_len, max_eval_len)
  return get_config(PRESETS[scheme], embed_dim=embed_dim, num_layers=num_layers,
                    num_heads=num_heads, num_kv_heads=num_kv_heads, mlp_dim=mlp_dim,
                    max_seq_len=max_len)


def eval_stream(token_docs: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
  """Held-out documents as one stream ``[BOS] doc [EOS] [BOS] doc ...``: ``(tokens [N], doc [N])``
  with ``doc`` the document index of every token."""
  if len(token_docs) == 0:
    raise ValueError("eval_stream: `token_docs` is empty; give at least one held-out document.")
  toks, docs = [], []
  for i, d in enumerate(token_docs):
    piece = np.concatenate([[BOS], np.asarray(d, np.int32), [EOS]]).astype(np.int32)
    toks.append(piece)
    docs.append(np.full(piece.shape, i, np.int32))
  return np.concatenate(toks), np.concatenate(docs)


def eval_rows(tokens: Int[np.ndarray, "N"], doc: Int[np.ndarray, "N"], length: int,
              num_tokens: int) -> dict[str, np.ndarray]:
  """The first ``num_tokens`` inputs of the stream as ``R = num_tokens // length`` rows.

  Row ``r`` holds inputs ``tokens[r*L : r*L + L]`` and targets ``tokens[r*L + 1 : r*L + L + 1]``
  (``tokens``, ``targets``, ``loss_mask`` each ``[R, L]``); ``loss_mask`` is 0 where the target is
  in another document than its input (the EOS -> BOS step carries no language).  Every length sees
  the same ``num_tokens`` targets when ``num_tokens`` is a multiple of every length.
  """
  if length < 1 or num_tokens < length:
    raise ValueError(f"eval_rows: need 1 <= `length` <= `num_tokens`, got length={length}, "
                     f"num_tokens={num_tokens}.")
  if num_tokens + 1 > len(tokens):
    raise ValueError(f"eval_rows: `num_tokens`={num_tokens} needs {num_tokens + 1} stream tokens, "
                     f"the held-out stream has {len(tokens)}.")
  rows = num_tokens // length
  idx = np.arange(rows)[:, None] * length + np.arange(length)[None, :]
  return dict(tokens=tokens[idx], targets=tokens[idx + 1],
              loss_mask=(doc[idx] == doc[idx + 1]).astype(np.float32))


def train_model(cfg: ModelConfig, train_docs: Sequence[np.ndarray], *, steps: int,
                batch_size: int, seq_len: int, learning_rate: float = 3e-3, seed: int = 0,
                desc: str = "train"):
  """AdamW (warmup + cosine) for ``steps`` on packed rows of ``train_docs``.

  Returns ``(graphdef, state, losses)``; ``steps=0`` returns the initialized model.  The rows
  keep the packer's ``loss_mask`` but drop its ``segment_ids`` / ``positions``: attention runs
  across document edges with positions ``0 .. T-1``, the same form as the evaluation rows
  (module docstring).
  """
  model = DecoderLM(cfg, rngs=nnx.Rngs(seed))
  tx = make_optimizer(learning_rate=learning_rate, warmup_steps=max(1, steps // 10),
                      total_steps=max(steps, 1))
  graphdef, state = init_train_state(model, tx)
  losses = []
  if steps == 0:  # the untrained model (a baseline, and cheap for tests: no step to compile)
    return graphdef, state, losses
  step = make_train_step(graphdef, tx, state)
  data = PackedDataset(train_docs, batch_size=batch_size, seq_len=seq_len, seed=seed)
  bar = tqdm(range(steps), desc=desc, leave=False, disable=None)
  for _ in bar:
    batch = next(data)
    batch = {k: jnp.asarray(batch[k]) for k in ("tokens", "targets", "loss_mask")}
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
    if hasattr(bar, "set_postfix"):
      bar.set_postfix(loss=f"{losses[-1]:.3f}")
  return graphdef, state, losses


def _position_nll(graphdef, params, rest, tokens: Int[Array, "R L"], targets: Int[Array, "R L"],
                  mask: Float[Array, "R L"]) -> tuple[Float[Array, "L"], Float[Array, "L"]]:
  """Summed masked next-token NLL and token count per position (fp32), positions ``0 .. L-1``."""
  model = nnx.merge(graphdef, params, rest)
  logits = model(tokens).astype(jnp.float32)
  nll = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
  return jnp.sum(nll * mask, axis=0), jnp.sum(mask, axis=0)


_position_nll_jit = jax.jit(_position_nll, static_argnums=0)


def evaluate_lengths(graphdef, state, cfg: ModelConfig, stream: tuple[np.ndarray, np.ndarray],
                     eval_lens: Sequence[int], *, train_len: int, num_tokens: int,
                     tokens_per_batch: int = 8192, desc: str = "eval") -> dict[str, dict]:
  """Per evaluation length ``L``: ``loss`` (mean NLL, nats per byte), ``ppl``, ``beyond_loss`` /
  ``beyond_ppl`` (positions ``>= train_len`` only; None when ``L <= train_len``), ``tokens`` and
  ``position_loss`` (mean NLL per ``POSITION_BIN`` positions).

  A learned table cannot evaluate ``L > cfg.max_seq_len``: that entry is
  ``{"ppl": None, ..., "na": "n/a (no row for position >= max_seq_len)"}``.
  """
  out = {}
  for length in tqdm(list(eval_lens), desc=desc, leave=False, disable=None):
    if cfg.position == "learned" and length > cfg.max_seq_len:
      out[str(length)] = dict(loss=None, ppl=None, beyond_loss=None, beyond_ppl=None, tokens=0,
                              position_loss=None,
                              na=f"n/a (no row for position >= {cfg.max_seq_len})")
      continue
    rows = eval_rows(*stream, length, num_tokens)
    per_batch = min(max(1, tokens_per_batch // length), len(rows["tokens"]))
    # Pad to whole batches with masked rows: one batch shape per length, so one compilation.
    pad = -len(rows["tokens"]) % per_batch
    rows = {k: np.concatenate([v, np.zeros((pad, length), v.dtype)]) for k, v in rows.items()}
    nll = np.zeros(length, np.float64)
    count = np.zeros(length, np.float64)
    for start in range(0, len(rows["tokens"]), per_batch):
      batch = {k: jnp.asarray(v[start:start + per_batch]) for k, v in rows.items()}
      s, c = _position_nll_jit(graphdef, state.params, state.rest, batch["tokens"],
                               batch["targets"], batch["loss_mask"])
      nll += np.asarray(s, np.float64)
      count += np.asarray(c, np.float64)
    loss = float(nll.sum() / max(count.sum(), 1.0))
    beyond = None
    if length > train_len:
      beyond = float(nll[train_len:].sum() / max(count[train_len:].sum(), 1.0))
    bins = [float(nll[i:i + POSITION_BIN].sum() / max(count[i:i + POSITION_BIN].sum(), 1.0))
            for i in range(0, length, POSITION_BIN)]
    out[str(length)] = dict(loss=loss, ppl=_ppl(loss), beyond_loss=beyond,
                            beyond_ppl=None if beyond is None else _ppl(beyond),
                            tokens=int(count.sum()), position_loss=bins, na=None)
  return out


def _ppl(loss: float) -> float:
  return float(math.exp(min(loss, 50.0)))  # cap: a diverged model prints 5e21, not inf


def run(*, schemes: Sequence[str] = SCHEMES, steps: int = 100, train_len: int = 256,
        eval_lens: Sequence[int] = (256, 512, 1024, 2048), batch_size: int = 8,
        embed_dim: int = 64, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
        mlp_dim: int = 192, learning_rate: float = 3e-3, seed: int = 0, eval_every: int = 5,
        eval_tokens: int | None = None, docs: Sequence[str] | None = None) -> dict:
  """Trains one model per scheme and evaluates it at every length; returns the results dict.

  ``docs`` defaults to the built-in text; ``eval_tokens`` caps the evaluation tokens (rounded down
  to a multiple of the longest evaluation length; default: all held-out tokens).
  """
  bad = [s for s in schemes if s not in PRESETS]
  if bad or not schemes:
    raise ValueError(f"`schemes` must be a non-empty subset of {SCHEMES}, got {list(schemes)}.")
  if int(train_len) < 1:
    raise ValueError(f"`train_len` must be >= 1, got {train_len!r}.")
  if not eval_lens or min(eval_lens) < 1:
    raise ValueError(f"`eval_lens` must be positive lengths, got {list(eval_lens)}.")
  if int(steps) < 0:
    raise ValueError(f"`steps` must be >= 0 (0 = evaluate the initialized models), got {steps!r}.")
  eval_lens = sorted(set(int(x) for x in eval_lens))
  longest = eval_lens[-1]
  train_docs, held_docs = split_documents(load_text(None) if docs is None else list(docs),
                                          eval_every=eval_every)
  train_tokens = tokenize_documents(train_docs)
  stream = eval_stream(tokenize_documents(held_docs))
  available = (len(stream[0]) - 1) // longest * longest
  if eval_tokens is not None:
    available = min(available, int(eval_tokens) // longest * longest)
  if available < longest:
    raise ValueError(f"the held-out text has {len(stream[0]) - 1} targets (eval_tokens="
                     f"{eval_tokens}); the longest `eval_lens` entry {longest} needs at least one "
                     "row: hold out more documents (smaller eval_every) or shorten eval_lens.")
  # Every length evaluates the same targets only if it divides the common token count.
  uneven = [x for x in eval_lens if available % x]
  results = dict(config=dict(schemes=list(schemes), steps=steps, train_len=train_len,
                             eval_lens=eval_lens, batch_size=batch_size, embed_dim=embed_dim,
                             num_layers=num_layers, num_heads=num_heads,
                             num_kv_heads=num_kv_heads, mlp_dim=mlp_dim,
                             learning_rate=learning_rate, seed=seed, eval_every=eval_every,
                             eval_tokens=available, train_documents=len(train_docs),
                             held_out_documents=len(held_docs),
                             train_tokens_seen=steps * batch_size * train_len,
                             lengths_not_dividing_eval_tokens=uneven),
                 schemes={})
  for scheme in schemes:
    cfg = scheme_config(scheme, train_len=train_len, max_eval_len=longest, embed_dim=embed_dim,
                        num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
                        mlp_dim=mlp_dim)
    t0 = time.perf_counter()
    graphdef, state, losses = train_model(cfg, train_tokens, steps=steps, batch_size=batch_size,
                                          seq_len=train_len, learning_rate=learning_rate,
                                          seed=seed, desc=f"train {scheme:>10}")
    t1 = time.perf_counter()
    evals = evaluate_lengths(graphdef, state, cfg, stream, eval_lens, train_len=train_len,
                             num_tokens=available, desc=f"eval  {scheme:>10}")
    final = float(np.mean(losses[-max(1, steps // 10):])) if losses else None
    results["schemes"][scheme] = dict(
        preset=PRESETS[scheme], max_seq_len=cfg.max_seq_len, train_loss=losses,
        final_train_loss=final, train_seconds=t1 - t0, eval_seconds=time.perf_counter() - t1,
        eval=evals)
    print(f"  {scheme:>10}: final train loss {'-' if final is None else format(final, '.3f')} "
          f"({t1 - t0:.0f} s train, {time.perf_counter() - t1:.0f} s eval)", flush=True)
  return results


def format_table(results: dict) -> str:
  """Perplexity per scheme (rows) and evaluation length (columns), then the perplexity on the
  positions beyond the training length."""
  lens = results["config"]["eval_lens"]
  train_len = results["config"]["train_len"]

  def ppl_text(value, na):
    return na if value is None else format(value, ".3f")

  rows = []
  for scheme, r in results["schemes"].items():
    train = "-" if r["final_train_loss"] is None else format(r["final_train_loss"], ".3f")
    rows.append([scheme, train] + [ppl_text(r["eval"][str(x)]["ppl"], r["eval"][str(x)]["na"])
                                   for x in lens])
  header = ["scheme", "train loss"] + [f"ppl@{x}" for x in lens]
  widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
  fmt = lambda cells: " ".join(f"{c:>{w}}" for c, w in zip(cells, widths))
  lines = [fmt(header), "-" * len(fmt(header))] + [fmt(row) for row in rows]
  longer = [x for x in lens if x > train_len]
  if longer:
    lines += ["", f"perplexity on positions >= {train_len} only (never seen in training):"]
    sub = ["scheme"] + [f"ppl@{x}" for x in longer]
    body = [[s] + [ppl_text(r["eval"][str(x)]["beyond_ppl"], "n/a") for x in longer]
            for s, r in results["schemes"].items()]
    widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(sub)]
    lines += [fmt(sub)] + [fmt(row) for row in body]
  return "\n".join(lines)


def plot(results: dict, path: pathlib.Path) -> pathlib.Path:
  """Perplexity vs evaluation length (log y) and loss by position at the longest length."""
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  import matplotlib.ticker  # noqa: PLC0415

  cfg = results["config"]
  lens, train_len = cfg["eval_lens"], cfg["train_len"]
  fig, axes = plt.subplots(1, 2, figsize=(14, 4.5))
  for scheme, r in results["schemes"].items():
    xs = [x for x in lens if r["eval"][str(x)]["ppl"] is not None]
    ys = [r["eval"][str(x)]["ppl"] for x in xs]
    axes[0].plot(xs, ys, marker="o", label=scheme, ls=":" if scheme == "nope" else "-")
    longest = max(xs) if xs else None
    if longest is not None:
      bins = r["eval"][str(longest)]["position_loss"]
      centers = [POSITION_BIN * (i + 0.5) for i in range(len(bins))]
      axes[1].plot(centers, bins, label=f"{scheme} (L={longest})",
                   ls=":" if scheme == "nope" else "-")
  for ax in axes:
    ax.axvline(train_len, color="gray", ls="--", lw=0.8, label=f"train length {train_len}")
    ax.grid(alpha=0.3)
  axes[0].set(xscale="log", yscale="log", xlabel="evaluation length (tokens)",
              ylabel="perplexity (bytes)", title="held-out perplexity vs evaluation length")
  axes[0].set_xticks(lens, [str(x) for x in lens])
  axes[0].xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
  axes[0].yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%.0f"))
  axes[0].yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%.0f"))
  axes[1].set(xlabel="position in the row", ylabel="mean NLL (nats / byte)",
              title=f"loss by position ({POSITION_BIN}-token bins)")
  axes[0].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
  axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
  fig.suptitle(f"{cfg['steps']} steps x {cfg['batch_size']} x {train_len} bytes, "
               f"d={cfg['embed_dim']}, {cfg['num_layers']} layers", fontsize=9)
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--steps", type=int, default=100, help="AdamW steps per model")
  ap.add_argument("--train-len", type=int, default=256)
  ap.add_argument("--eval-lens", type=int_list(minimum=1), default="256,512,1024,2048")
  ap.add_argument("--schemes", type=choice_list(SCHEMES), default=",".join(SCHEMES),
                  help=f"comma list of {', '.join(SCHEMES)}")
  ap.add_argument("--batch-size", type=int, default=8)
  ap.add_argument("--embed-dim", type=int, default=64)
  ap.add_argument("--layers", type=int, default=2)
  ap.add_argument("--heads", type=int, default=4)
  ap.add_argument("--kv-heads", type=int, default=2)
  ap.add_argument("--mlp-dim", type=int, default=192)
  ap.add_argument("--lr", type=float, default=3e-3)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--eval-every", type=int, default=5,
                  help="hold out every N-th document (5: 15 documents, ~31k bytes)")
  ap.add_argument("--eval-tokens", type=int, default=None,
                  help="cap on evaluation targets (default: all held-out tokens)")
  ap.add_argument("--out", default="runs/length_extrapolation")
  args = ap.parse_args(argv)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  schemes = args.schemes
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}; schemes {schemes}, "
        f"{args.steps} steps x {args.batch_size} x {args.train_len} bytes")
  t0 = time.perf_counter()
  results = run(schemes=schemes, steps=args.steps, train_len=args.train_len,
                eval_lens=args.eval_lens, batch_size=args.batch_size,
                embed_dim=args.embed_dim, num_layers=args.layers, num_heads=args.heads,
                num_kv_heads=args.kv_heads, mlp_dim=args.mlp_dim, learning_rate=args.lr,
                seed=args.seed, eval_every=args.eval_every, eval_tokens=args.eval_tokens)
  results["seconds"] = time.perf_counter() - t0
  print(f"\nheld-out perplexity (bytes; {results['config']['eval_tokens']} targets at every "
        f"length, "
        f"{results['config']['held_out_documents']} documents) [{results['seconds']:.0f} s]")
  print(format_table(results))
  (out / "results.json").write_text(json.dumps(results, indent=1))
  png = plot(results, out / "length_extrapolation.png")
  print(f"\nwrote {out / 'results.json'} and {png}")
  return results


if __name__ == "__main__":
  main()
