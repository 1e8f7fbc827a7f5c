"""Serving throughput: continuous batching against static batching on the same workload.

    python -m experiments.bench_serve [--preset llama] [--requests 32] [--max-batch 8]
        [--prompt-lens 8,96] [--new-tokens 4,64] [--shared-prefix 0] [--chunk 32]
        [--page-size 16] [--num-pages N] [--max-seq-len N] [--layer-pattern P]
        [--sliding-window W] [--window-num-pages N] [--compare-whole-table]
        [--compare-on-demand] [--compare-quantized int8] [--compare-speculative K] [--seed 0]
        [--out runs/bench_serve]

A synthetic workload of ``--requests`` requests with prompt lengths and new-token counts drawn
uniformly from the two ranges, all submitted at once, greedy decoding, a tiny preset
(``jaxattn.configs``) with random weights; ``--shared-prefix N`` starts every prompt with the same
``N`` tokens (a system prompt) before its own.  The runs use ``jaxattn.serving.Engine`` with the
same slots, pages, chunk and compiled step programs; only admission and caching differ:

    static       new requests enter only when the whole batch has finished (a batch waits for
                 its longest request: the baseline, as a fixed-batch ``generate`` loop runs)
    continuous   a finished request's slot takes the next request at the next step
    +prefix      continuous, with the prefix cache (``prefix_cache=True``): a request starts
                 from the cached pages of its prompt's longest computed prefix

``--max-seq-len`` sets the model's longest sequence (default 256, or what the workload needs):
the page tables' width; ``--compare-whole-table`` adds a continuous run whose calls read the
whole table (``Engine(narrow_tables=False)``); ``--compare-on-demand`` a continuous run that
reserves pages as they are reached (``Engine(allocation="on_demand")``: more requests at once on
a small pool, preempting and recomputing the latest when it runs short; ``preempted`` counts
them); ``--compare-quantized int8`` (or ``float8_e4m3fn``) a continuous run over a quantized KV
cache (``Engine(dtype=...)``: its cache bytes, speed, and how many tokens equal the float run's;
it is left out of the identity check); ``--compare-speculative K`` a continuous run with
speculative decoding (``Engine(num_draft_tokens=K)``, prompt-lookup drafts: fewer steps, more
rows; its greedy outputs are in the identity check).  ``--num-pages`` sizes each layer's page pool
(default: every slot at the model's longest sequence); a smaller pool makes admission wait for
pages.  Sliding-window layers (``mistral``; ``--layer-pattern SSSA --sliding-window 64``: local
layers interleaved with global ones, as Gemma-2 / 3) return the pages behind each window to their
pools after every step, and have pools of their own size (``--window-num-pages``, default every
slot's window), except with the prefix cache (whose pages outlive the window): its ``+prefix``
run then holds every request's whole length in every layer.

Each runs the workload twice; the second (warm: every step shape compiled; the prefix cache
emptied first) is timed.

    steps        engine steps (each feeds every busy slot once); calls: model calls (a step
                 makes one for the slots reading prompts, one for the decoding slots)
    fed          tokens fed (prompt chunks + decode tokens)
    hit          prompt tokens read from the prefix cache instead of fed
    rows         token rows computed (b x T per call, padding included): the compute the call
                 shapes cost, where ``fed`` is the useful part
    occupancy    slot-steps that served a request / (steps x max_batch)
    tokens/s     generated tokens / wall seconds (host loop included)
    TTFT         mean time from the run's start to a request's first token (all are queued at 0)
    cache MB     device memory of the engine's cache (page pools, tables, states)
    speedup      continuous tokens/s / static tokens/s, measured in the same run

The runs must produce identical tokens for every request (greedy): checked and printed.
Timings on a shared CPU are noisy (read ratios, not the digits); the step counts are exact.
Prints a table, writes ``results.json`` and a plot of busy slots per step under ``--out``.
"""

from __future__ import annotations

import argparse
import pathlib
import time

import jax
import numpy as np
from flax import nnx

from experiments.cli import at_least, int_list
from experiments.timing import write_json
from jaxattn.configs import PRESETS, get_config
from jaxattn.nn.model import DecoderLM
from jaxattn.serving import Engine

# Every preset has a paged form (T5-bias layers decode on the XLA path).
SERVABLE = tuple(PRESETS)
TINY = dict(embed_dim=64, mlp_dim=128, num_layers=2, max_seq_len=256, vocab_size=256)


def workload(requests: int, prompt_lens, new_tokens, vocab: int, seed: int,
             shared_prefix: int = 0):
  """``[(prompt, max_new_tokens)]`` drawn uniformly from the inclusive ranges, every prompt
  after the same ``shared_prefix`` tokens."""
  rng = np.random.default_rng(seed)
  system = rng.integers(1, vocab, size=shared_prefix)
  return [(np.concatenate([system, rng.integers(
               1, vocab, size=int(rng.integers(prompt_lens[0], prompt_lens[1] + 1)))])
           .astype(np.int32), int(rng.integers(new_tokens[0], new_tokens[1] + 1)))
          for _ in range(requests)]


def serve(model, work, *, policy: str, max_batch: int, chunk: int, page_size: int,
          prefix_cache: bool = False, num_pages: int | None = None,
          narrow_tables: bool = True, window_num_pages: int | None = None,
          allocation: str = "reserve", cache_dtype: str | None = None,
          num_draft_tokens: int = 0) -> dict:
  """Runs ``work`` twice on one engine (the first compiles every step shape); times the second."""
  engine = Engine(model, max_batch=max_batch, page_size=page_size, chunk=chunk, policy=policy,
                  prefix_cache=prefix_cache, num_pages=num_pages, narrow_tables=narrow_tables,
                  window_num_pages=None if prefix_cache else window_num_pages,
                  allocation=allocation, dtype=cache_dtype, num_draft_tokens=num_draft_tokens)
  for prompt, n in work:                               # warm-up: the same workload
    engine.submit(prompt, n)
  engine.run()
  engine.clear_prefix_cache()                          # the timed run starts cold
  before = dict(vars(engine.stats))
  ids = [engine.submit(prompt, n) for prompt, n in work]
  busy, first = [], {}
  start = time.perf_counter()

  def on_token(rid, _):
    first.setdefault(rid, time.perf_counter() - start)

  while engine.pending:
    served = engine.stats.busy_slot_steps
    for rid, token in engine.step():
      on_token(rid, token)
    busy.append(engine.stats.busy_slot_steps - served)
  seconds = time.perf_counter() - start
  stats = {k: v - before[k] for k, v in vars(engine.stats).items()}
  results = engine.results
  name = (policy + ("+prefix" if prefix_cache else "") + ("" if narrow_tables else " (whole table)")
          + (" (on demand)" if allocation == "on_demand" else "")
          + (f" ({cache_dtype} cache)" if cache_dtype else "")
          + (f" (k={num_draft_tokens} drafts)" if num_draft_tokens else ""))
  return dict(policy=name, seconds=seconds,
              steps=stats["steps"], calls=stats["calls"], fed=stats["fed_tokens"],
              hit=stats["prefix_hit_tokens"], rows=stats["computed_rows"],
              table_columns=stats["table_columns"], cache_bytes=engine.cache.nbytes,
              preempted=stats["preempted"], drafted=stats["drafted"],
              accepted_drafts=stats["accepted_drafts"],
              generated=stats["generated"],
              occupancy=stats["busy_slot_steps"] / max(stats["slot_steps"], 1),
              tokens_per_second=stats["generated"] / seconds,
              ttft_seconds=float(np.mean([first[i] for i in ids])),
              outputs=[results[i].tolist() for i in ids], busy_per_step=busy)


def run(*, preset: str = "llama", requests: int = 32, max_batch: int = 8,
        prompt_lens=(8, 96), new_tokens=(4, 64), shared_prefix: int = 0, chunk: int = 32,
        page_size: int = 16, seed: int = 0, num_pages: int | None = None,
        max_seq_len: int | None = None, compare_whole_table: bool = False,
        layer_pattern: str | None = None, sliding_window: int | None = None,
        window_num_pages: int | None = None, compare_on_demand: bool = False,
        compare_quantized: str | None = None, compare_speculative: int = 0) -> dict:
  cfg = get_config(preset, **TINY)
  if max_seq_len is not None:
    cfg = cfg.replace(max_seq_len=max_seq_len)
  if layer_pattern is not None or sliding_window is not None:
    cfg = cfg.replace(**{k: v for k, v in (("layer_pattern", layer_pattern),
                                            ("sliding_window", sliding_window)) if v is not None})
  if cfg.num_layers < len(cfg.layer_pattern):   # qwen3-next: DDDA, an attention layer too
    cfg = cfg.replace(num_layers=len(cfg.layer_pattern))
  need = shared_prefix + prompt_lens[1] + new_tokens[1]
  if need > cfg.max_seq_len:
    cfg = cfg.replace(max_seq_len=need)
  model = DecoderLM(cfg, rngs=nnx.Rngs(seed))
  work = workload(requests, prompt_lens, new_tokens, cfg.vocab_size, seed, shared_prefix)
  kw = dict(max_batch=max_batch, chunk=chunk, page_size=page_size, num_pages=num_pages)
  rows = [serve(model, work, policy=p, window_num_pages=window_num_pages, **kw)
          for p in ("static", "continuous")]
  rows.append(serve(model, work, policy="continuous", prefix_cache=True, **kw))
  if compare_whole_table:
    rows.append(serve(model, work, policy="continuous", narrow_tables=False, **kw))
  if compare_on_demand:
    rows.append(serve(model, work, policy="continuous", allocation="on_demand",
                      window_num_pages=window_num_pages, **kw))
  if compare_speculative:
    rows.append(serve(model, work, policy="continuous", num_draft_tokens=compare_speculative,
                      window_num_pages=window_num_pages, **kw))
  same = all(r["outputs"] == rows[0]["outputs"] for r in rows)
  agreement = None
  if compare_quantized:     # not in the identity check: its tokens may differ, counted instead
    quant = serve(model, work, policy="continuous", cache_dtype=compare_quantized,
                  window_num_pages=window_num_pages, **kw)
    pairs = [(a, b) for want, got in zip(rows[0]["outputs"], quant["outputs"])
             for a, b in zip(want, got)]
    agreement = sum(a == b for a, b in pairs) / len(pairs)
    rows.append(quant)
  for r in rows:
    del r["outputs"]
  return dict(config=dict(preset=preset, requests=requests, max_batch=max_batch,
                          prompt_lens=list(prompt_lens), new_tokens=list(new_tokens),
                          shared_prefix=shared_prefix, chunk=chunk, page_size=page_size,
                          num_pages=num_pages, max_seq_len=cfg.max_seq_len,
                          layer_pattern=cfg.layer_pattern, sliding_window=cfg.sliding_window,
                          window_num_pages=window_num_pages,
                          seed=seed, jax=jax.__version__, backend=jax.default_backend()),
              rows=rows, identical_outputs=same, quantized_token_agreement=agreement,
              speedup=rows[1]["tokens_per_second"] / rows[0]["tokens_per_second"],
              step_ratio=rows[0]["steps"] / rows[1]["steps"],
              prefix_speedup=rows[2]["tokens_per_second"] / rows[1]["tokens_per_second"],
              prefix_row_ratio=rows[1]["rows"] / rows[2]["rows"])


def format_table(results: dict) -> str:
  c = results["config"]
  window = (f" (window {c['sliding_window']})" if "S" in c["layer_pattern"] else "")
  lines = [f"{c['preset']} (tiny, layers {c['layer_pattern']}{window}), {c['requests']} "
           f"requests, prompts {c['prompt_lens']} after "
           f"a shared prefix of {c['shared_prefix']}, new tokens {c['new_tokens']}, "
           f"{c['max_batch']} slots, chunk {c['chunk']}, pages of {c['page_size']}; "
           f"{c['backend']}, jax {c['jax']}"]
  head = (f"{'policy':>24} {'steps':>6} {'calls':>6} {'fed':>7} {'hit':>6} {'rows':>7} "
          f"{'generated':>9} {'occupancy':>9} {'seconds':>8} {'tokens/s':>9} {'TTFT s':>7} "
          f"{'cache MB':>8} {'preempted':>9}")
  lines += [head, "-" * len(head)]
  for r in results["rows"]:
    lines.append(f"{r['policy']:>24} {r['steps']:6d} {r['calls']:6d} {r['fed']:7d} "
                 f"{r['hit']:6d} {r['rows']:7d} {r['generated']:9d} "
                 f"{100 * r['occupancy']:8.1f}% {r['seconds']:8.2f} "
                 f"{r['tokens_per_second']:9.1f} {r['ttft_seconds']:7.2f} "
                 f"{r['cache_bytes'] / 2**20:8.2f} {r['preempted']:9d}")
  lines.append(f"continuous / static: {results['speedup']:.2f}x tokens/s, "
               f"{results['step_ratio']:.2f}x fewer steps; prefix cache: "
               f"{results['prefix_row_ratio']:.2f}x fewer rows, {results['prefix_speedup']:.2f}x "
               f"tokens/s; identical greedy outputs: {results['identical_outputs']}")
  by_name = {r["policy"]: r for r in results["rows"]}
  if "continuous (on demand)" in by_name:
    lazy, reserve = by_name["continuous (on demand)"], by_name["continuous"]
    lines.append(f"continuous, pages on demand vs reserved whole: "
                 f"{lazy['tokens_per_second'] / reserve['tokens_per_second']:.2f}x tokens/s, "
                 f"{reserve['steps'] / lazy['steps']:.2f}x fewer steps, occupancy "
                 f"{100 * lazy['occupancy']:.1f}% vs {100 * reserve['occupancy']:.1f}%, "
                 f"{lazy['preempted']} preemptions")
  quant = [r for r in results["rows"] if r["policy"].endswith(" cache)")]
  if quant:
    q, reserve = quant[0], by_name["continuous"]
    ratio = q["cache_bytes"] / reserve["cache_bytes"]
    lines.append(f"{q['policy']} vs the float cache: {ratio:.2f}x the cache bytes, "
                 f"{q['tokens_per_second'] / reserve['tokens_per_second']:.2f}x "
                 f"tokens/s, {100 * results['quantized_token_agreement']:.1f}% of the tokens "
                 f"(prompts and greedy outputs) the same")
  spec = [r for r in results["rows"] if r["policy"].endswith(" drafts)")]
  if spec:
    sp, reserve = spec[0], by_name["continuous"]
    lines.append(f"{sp['policy']} vs without: {reserve['steps'] / sp['steps']:.2f}x fewer "
                 f"steps, {sp['rows'] / reserve['rows']:.2f}x the rows, "
                 f"{sp['tokens_per_second'] / reserve['tokens_per_second']:.2f}x tokens/s, "
                 f"{sp['accepted_drafts']} of {sp['drafted']} drafts kept")
  if "continuous (whole table)" in by_name:
    narrow, whole = by_name["continuous"], by_name["continuous (whole table)"]
    lines.append(f"continuous, page tables narrowed to the lengths served vs the whole table: "
                 f"{narrow['tokens_per_second'] / whole['tokens_per_second']:.2f}x tokens/s, "
                 f"{whole['table_columns'] / max(narrow['table_columns'], 1):.1f}x fewer "
                 f"table columns read")
  return "\n".join(lines)


def plot(results: dict, path: pathlib.Path) -> pathlib.Path:
  """Busy slots per step for both policies."""
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  fig, ax = plt.subplots(figsize=(8, 3.2))
  colors = ("tab:orange", "tab:blue", "tab:green", "tab:gray", "tab:purple", "tab:brown")
  for r, color in zip(results["rows"], colors):
    ax.step(range(len(r["busy_per_step"])), r["busy_per_step"], where="post", color=color,
            label=f"{r['policy']}: {r['steps']} steps, {100 * r['occupancy']:.0f}% occupied")
  ax.set(xlabel="engine step", ylabel="busy slots",
         ylim=(0, results["config"]["max_batch"] + 0.5),
         title="static vs continuous batching (+ prefix cache): slots serving a request")
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def _range(flag):
  parse = int_list(minimum=1)

  def f(text):
    lo_hi = parse(text)
    if len(lo_hi) != 2 or lo_hi[0] > lo_hi[1]:
      raise argparse.ArgumentTypeError(f"{flag} must be 'low,high' with 1 <= low <= high, got "
                                       f"{text!r}")
    return tuple(lo_hi)
  f.__name__ = "range"
  return f


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--preset", choices=SERVABLE, default="llama")
  ap.add_argument("--requests", type=at_least(1), default=32)
  ap.add_argument("--max-batch", type=at_least(1), default=8)
  ap.add_argument("--prompt-lens", type=_range("--prompt-lens"), default=(8, 96))
  ap.add_argument("--new-tokens", type=_range("--new-tokens"), default=(4, 64))
  ap.add_argument("--shared-prefix", type=at_least(0), default=0)
  ap.add_argument("--chunk", type=at_least(1), default=32)
  ap.add_argument("--page-size", type=at_least(1), default=16)
  ap.add_argument("--num-pages", type=at_least(1), default=None,
                  help="pages in each pool of a layer holding whole sequences (default: every "
                  "slot at max_seq_len); with sliding-window layers only, in theirs")
  ap.add_argument("--layer-pattern", default=None,
                  help="override the preset's layer pattern (e.g. SSSA: three sliding-window "
                  "layers per global one)")
  ap.add_argument("--sliding-window", type=at_least(0), default=None,
                  help="the S layers' window (override)")
  ap.add_argument("--window-num-pages", type=at_least(1), default=None,
                  help="pages in each sliding-window layer's pool beside global layers "
                  "(default: every slot's window)")
  ap.add_argument("--max-seq-len", type=at_least(1), default=None,
                  help="the model's longest sequence: the page tables' width (default 256)")
  ap.add_argument("--compare-whole-table", action="store_true",
                  help="add a continuous run whose calls read the whole page table "
                  "(Engine(narrow_tables=False)): the baseline of the table narrowing")
  ap.add_argument("--compare-on-demand", action="store_true",
                  help="add a continuous run reserving pages as they are reached "
                  "(Engine(allocation='on_demand'), preempting when the pool runs short)")
  ap.add_argument("--compare-quantized", choices=("int8", "float8_e4m3fn"), default=None,
                  help="a continuous run over a quantized KV cache (Engine(dtype=...)): its "
                       "bytes, speed and token agreement with the float cache")
  ap.add_argument("--compare-speculative", type=at_least(1), default=0, metavar="K",
                  help="a continuous run with speculative decoding, K prompt-lookup drafts per "
                       "decoding slot and step (Engine(num_draft_tokens=K))")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--out", default="runs/bench_serve")
  args = ap.parse_args(argv)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  results = run(preset=args.preset, requests=args.requests, max_batch=args.max_batch,
                prompt_lens=args.prompt_lens, new_tokens=args.new_tokens,
                shared_prefix=args.shared_prefix, chunk=args.chunk,
                page_size=args.page_size, seed=args.seed, num_pages=args.num_pages,
                max_seq_len=args.max_seq_len, compare_whole_table=args.compare_whole_table,
                layer_pattern=args.layer_pattern, sliding_window=args.sliding_window,
                window_num_pages=args.window_num_pages,
                compare_on_demand=args.compare_on_demand,
                compare_quantized=args.compare_quantized,
                compare_speculative=args.compare_speculative)
  print(format_table(results))
  write_json(out / "results.json", results)
  png = plot(results, out / "bench_serve.png")
  print(f"\nwrote {out / 'results.json'} and {png}")
  return results


if __name__ == "__main__":
  main()
