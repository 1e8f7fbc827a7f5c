"""What a quantized KV cache costs in quality: a trained model reading held-out text through a
float, an int8 and an FP8 (e4m3) cache.

    python -m experiments.kv_quant_quality [--run runs/train] [--train-steps 80] [--docs 16]
        [--seq-len 256] [--chunk 16] [--page-size 16] [--out runs/kv_quant_quality]

``--run`` is an ``experiments.train`` output (the newest checkpoint is loaded); without it a small
model is trained first (``experiments.train --steps --train-steps`` under ``--out/train``).  The
held-out documents (the training run's split: every 20th document), each ``[BOS] + bytes`` cut
into rows of ``--seq-len`` predictions, give ``--docs`` rows that go through the model's paged
cache together, ragged (a document's last row is shorter), in chunks of ``--chunk`` tokens per
row: every chunk is appended to
the cache and attends to everything it holds, as serving does (``DecoderLM.init_paged_cache(dtype=
...)``, ``num_tokens``).  For each cache, over every predicted token:

* held-out perplexity (the next byte's log-probability);
* mean KL divergence from the float cache's next-token distribution (nats), and its largest;
* top-1 agreement with the float cache (greedy decoding would pick the same byte);
* the attention layers' cache bytes per token (``cache_bytes``), against bf16.

The float cache's logits are also checked against the model's full forward pass without a cache
(the paged path must reproduce it; its largest difference is printed).  KL by position (is the
error larger deep into the context, where more quantized keys compete?) is plotted to
``kv_quant_quality.png``; ``results.json`` holds every figure.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from experiments.cli import at_least
from jaxattn.train.data import BOS, ByteTokenizer, load_text, split_documents, tokenize_documents

CACHES = {"float": None, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


def held_out(num_rows: int, seq_len: int, eval_every: int = 20) -> list[np.ndarray]:
  """The first ``num_rows`` rows of the held-out documents of the default text: each document
  ``[BOS] + bytes`` cut into consecutive rows of ``seq_len + 1`` tokens (``seq_len``
  predictions; a document's last row shorter: the batch is ragged); rows under 2 tokens are
  skipped."""
  _, docs = split_documents(load_text(None), eval_every=eval_every)
  out = []
  for ids in tokenize_documents(docs, ByteTokenizer()):
    doc = np.concatenate([[BOS], ids]).astype(np.int32)
    for start in range(0, doc.size - 1, seq_len + 1):
      row = doc[start:start + seq_len + 1]
      if row.size >= 2:
        out.append(row)
      if len(out) == num_rows:
        return out
  return out


@nnx.jit
def _step(model, tokens, num_tokens, cache):
  logits, cache = model(tokens, cache=cache, num_tokens=num_tokens)
  return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), cache


@nnx.jit
def _full(model, tokens):
  return jax.nn.log_softmax(model(tokens).astype(jnp.float32), axis=-1)


def read_through_cache(model, docs, dtype, chunk: int, page_size: int) -> list[np.ndarray]:
  """Per document, the log-probabilities ``[len - 1, V]`` the model gives its next tokens when
  the documents are fed together through a paged cache of ``dtype``, ``chunk`` tokens at a time
  each (ragged: a finished document feeds nothing)."""
  b, longest = len(docs), max(d.size for d in docs)
  pages = -(-longest // page_size)
  cache = model.init_paged_cache(b, b * pages, page_size, max_pages_per_seq=pages, dtype=dtype)
  outs = [[] for _ in docs]
  for start in range(0, longest - 1, chunk):
    tokens = np.zeros((b, chunk), np.int32)
    counts = np.zeros((b,), np.int32)
    for i, d in enumerate(docs):
      piece = d[start:min(start + chunk, d.size - 1)]        # the last token is only a target
      tokens[i, :piece.size], counts[i] = piece, piece.size
    logp, cache = _step(model, jnp.asarray(tokens), jnp.asarray(counts), cache)
    logp = np.asarray(logp)
    for i, n in enumerate(counts):
      outs[i].append(logp[i, :n])
  return [np.concatenate(o) for o in outs]


def compare(logps: dict[str, list[np.ndarray]], docs, position_bins: int = 8) -> dict:
  """Perplexity per cache; KL from the float cache, top-1 agreement, KL by relative position."""
  targets = [d[1:] for d in docs]
  ref = logps["float"]
  out = {}
  for name, lp in logps.items():
    nll = np.concatenate([-x[np.arange(t.size), t] for x, t in zip(lp, targets)])
    kl = np.concatenate([np.sum(np.exp(r) * (r - x), axis=-1) for r, x in zip(ref, lp)])
    agree = np.concatenate([r.argmax(-1) == x.argmax(-1) for r, x in zip(ref, lp)])
    pos = np.concatenate([np.arange(t.size) for t in targets])
    edges = np.linspace(0, pos.max() + 1, position_bins + 1)
    by_pos = [float(kl[(pos >= lo) & (pos < hi)].mean()) if ((pos >= lo) & (pos < hi)).any()
              else None for lo, hi in zip(edges[:-1], edges[1:])]
    out[name] = dict(tokens=int(nll.size), perplexity=float(np.exp(nll.mean())),
                     kl_mean=float(kl.mean()), kl_max=float(kl.max()),
                     top1_agreement=float(agree.mean()), kl_by_position=by_pos,
                     position_edges=edges.tolist())
  return out


def train_small(out: pathlib.Path, steps: int, seq_len: int) -> pathlib.Path:
  """A small byte-level model trained by ``experiments.train`` (resumed if ``out`` holds one)."""
  from experiments import train  # noqa: PLC0415
  rc = train.main(["--steps", str(steps), "--batch-size", "8", "--seq-len", str(seq_len),
                   "--warmup", str(max(1, steps // 8)), "--eval-every", "0",
                   "--sample-tokens", "0", "--save-every", str(steps), "--out", str(out)])
  if rc:
    raise RuntimeError(f"experiments.train exited with {rc}")
  return out


def _plot(results: dict, path: pathlib.Path) -> None:
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  fig, ax = plt.subplots(figsize=(7, 4))
  for name, r in results.items():
    if name == "float":
      continue
    edges = r["position_edges"]
    mids = [(a + b) / 2 for a, b in zip(edges[:-1], edges[1:])]
    pts = [(m, k) for m, k in zip(mids, r["kl_by_position"]) if k is not None]
    ax.plot(*zip(*pts), "o-", label=f"{name} cache")
  ax.set(xlabel="position in the document (tokens)", ylabel="mean KL from the float cache (nats)",
         yscale="log", title="quantized KV cache: next-token distribution vs float")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--run", default=None, help="an experiments.train output directory")
  ap.add_argument("--train-steps", type=at_least(1), default=80,
                  help="without --run: steps of the model trained first")
  ap.add_argument("--docs", type=at_least(1), default=16)
  ap.add_argument("--seq-len", type=at_least(2), default=256)
  ap.add_argument("--chunk", type=at_least(1), default=16)
  ap.add_argument("--page-size", type=at_least(1), default=16)
  ap.add_argument("--out", default="runs/kv_quant_quality")
  args = ap.parse_args(argv)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  from experiments.generate import load_run  # noqa: PLC0415
  run = (pathlib.Path(args.run) if args.run else
         train_small(out / "train", args.train_steps, min(args.seq_len, 128)))
  model, step = load_run(run)
  docs = held_out(args.docs, args.seq_len)
  print(f"model from {run} (step {step}), {len(docs)} held-out rows of "
        f"{min(d.size for d in docs)}-{max(d.size for d in docs)} tokens, chunks of "
        f"{args.chunk}, pages of {args.page_size}", flush=True)
  logps, seconds = {}, {}
  for name, dtype in tqdm(CACHES.items(), desc="caches"):
    t0 = time.perf_counter()
    logps[name] = read_through_cache(model, docs, dtype, args.chunk, args.page_size)
    seconds[name] = time.perf_counter() - t0
  # The float cache must give the full forward pass's log-probabilities.
  full_err = 0.0
  for d, lp in zip(docs, logps["float"]):
    full = np.asarray(_full(model, jnp.asarray(d[None, :-1])))[0]
    full_err = max(full_err, float(np.abs(full - lp).max()))
  results = compare(logps, docs)
  bf16_bytes = model.cache_bytes(1, 1, jnp.bfloat16)
  for name, dtype in CACHES.items():
    results[name]["cache_bytes_per_token"] = model.cache_bytes(
        1, 1, jnp.bfloat16 if dtype is None else dtype)
    results[name]["vs_bf16_bytes"] = results[name]["cache_bytes_per_token"] / bf16_bytes
    results[name]["seconds"] = seconds[name]
  print(f"float cache vs full forward: max |log p difference| = {full_err:.2e}")
  print(f"{'cache':6} {'ppl':>8} {'KL mean':>10} {'KL max':>9} {'top-1':>7} {'bytes/tok':>10} "
        f"{'vs bf16':>8}")
  for name, r in results.items():
    print(f"{name:6} {r['perplexity']:8.3f} {r['kl_mean']:10.2e} {r['kl_max']:9.2e} "
          f"{r['top1_agreement']:7.2%} {r['cache_bytes_per_token']:10d} "
          f"{r['vs_bf16_bytes']:8.2f}")
  print("(float: the compute dtype's cache, its bytes counted in bf16; KL and top-1 against it)")
  record = dict(run=str(run), step=step, docs=len(docs), seq_len=args.seq_len, chunk=args.chunk,
                page_size=args.page_size, full_forward_max_err=full_err, caches=results)
  (out / "results.json").write_text(json.dumps(record, indent=1))
  _plot(results, out / "kv_quant_quality.png")
  print(f"wrote {out / 'results.json'} and {out / 'kv_quant_quality.png'}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
