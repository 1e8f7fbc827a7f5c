"""Continuous batching (``jaxattn.serving.Engine``): with greedy decoding every request gets exactly
what ``generate`` gives it alone -- with more requests than slots (queued, slots reused after a
free), prompts longer than the chunk (chunked prefill beside decodes), an end-of-sequence token, a
pool too small for all requests at once (admission waits for pages) -- for attention, MLA and
hybrid Gated DeltaNet models, and a sliding-window model holding only its windows' pages;
sampling is reproducible from the seed; the errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxattn.configs import get_config
from jaxattn.generation import generate
from jaxattn.nn.model import DecoderLM
from jaxattn.serving import Engine

SMALL = dict(embed_dim=32, mlp_dim=64, max_seq_len=64, vocab_size=61)
MODELS = {
    "llama": ("llama", dict(num_layers=2)),
    "deepseek-v3": ("deepseek-v3", dict(num_layers=2, first_k_dense=1, moe_expert_dim=16,
                                        kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8,
                                        qk_rope_head_dim=4, v_head_dim=8)),
    # Hybrid units of one Gated DeltaNet and one attention layer (the preset has three DeltaNet
    # layers per attention layer: twice the compile for the same paths).
    "qwen3-next": ("qwen3-next", dict(num_layers=2, layer_pattern="DA", first_k_dense=2,
                                      deltanet_head_dim=8, deltanet_v_head_dim=8,
                                      deltanet_chunk_size=4, rotary_dim=4)),
    # A window of 3 over pages of 4: every layer reads only its window's pages.
    "mistral": ("mistral", dict(num_layers=2, sliding_window=3)),
    # Sinks (the paged XLA path), a window of 3 on one layer of two, MoE with biases.
    "gpt-oss": ("gpt-oss", dict(num_layers=2, sliding_window=3, head_dim=8, moe_expert_dim=16,
                                num_kv_heads=2)),
    "llama-alibi": ("llama-alibi", dict(num_layers=2)),
    "llama-t5": ("llama-t5", dict(num_layers=2)),
}
# (prompt length, max_new_tokens): longer and shorter than the chunk, one new token, many.
REQUESTS = [(7, 5), (2, 9), (11, 1), (3, 4), (5, 6)]


def model_for(name, **overrides):
  preset, kw = MODELS[name]
  return DecoderLM(get_config(preset, **SMALL).replace(**{**kw, **overrides}), rngs=nnx.Rngs(0))


def _pools_whole(engine, cache=None):
  """Whether every pool of ``cache`` (default the engine's) has all its pages free."""
  cache = engine.cache if cache is None else cache
  tables = [c.table for c in jax.tree_util.tree_leaves(
      cache.groups, is_leaf=lambda c: hasattr(c, "table")) if hasattr(c, "table")]
  return tables and all((np.asarray(t.num_free) == engine.num_pages).all() for t in tables)


def prompts(seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(1, 61, size=n).astype(np.int32) for n, _ in REQUESTS]


def alone(model, prompt, n, eos_id=None):
  return generate(model, prompt[None], n, eos_id=eos_id)[0]


# (The window, ALiBi and T5 presets differ only inside their attention layers, which
# tests/nn/test_model_paged.py checks through the paged cache; the engine test of the window's
# page release below serves mistral.)
@pytest.mark.parametrize("name,policy", [(n, "continuous") for n in ("llama", "deepseek-v3",
                                                                     "qwen3-next", "gpt-oss")]
                         + [("llama", "static")])
def test_greedy_requests_equal_generate_alone(name, policy):
  model = model_for(name)
  engine = Engine(model, max_batch=2, page_size=4, chunk=4, policy=policy)
  ps = prompts()
  ids = [engine.submit(p, n) for p, (_, n) in zip(ps, REQUESTS)]
  streamed = {}
  results = engine.run(on_token=lambda rid, tok: streamed.setdefault(rid, []).append(tok))
  for rid, p, (_, n) in zip(ids, ps, REQUESTS):
    want = alone(model, p, n)
    np.testing.assert_array_equal(results[rid], want, err_msg=f"request {rid}")
    np.testing.assert_array_equal(streamed[rid], want[p.size:])
  st = engine.stats
  assert st.finished == len(REQUESTS) and st.generated == sum(n for _, n in REQUESTS)
  assert 0 < st.occupancy <= 1 and engine.pending == 0


def test_eos_ends_a_request_and_frees_its_slot():
  model = model_for("llama")
  ps = prompts(1)
  gen = alone(model, ps[1], 9)[ps[1].size:]
  j = next(j for j in range(1, gen.size) if gen[j] not in gen[:j])   # a token new at step j
  eos = int(gen[j])
  engine = Engine(model, max_batch=2, page_size=4, chunk=4)
  ids = [engine.submit(p, n, eos_id=eos) for p, (_, n) in zip(ps, REQUESTS)]
  results = engine.run()
  for rid, p, (_, n) in zip(ids, ps, REQUESTS):
    got, want = results[rid], alone(model, p, n, eos_id=eos)
    cut = np.flatnonzero(want[p.size:] == eos)
    want = want[:p.size + cut[0] + 1] if cut.size else want   # generate pads with eos after it
    np.testing.assert_array_equal(got, want, err_msg=f"request {rid}")
  assert results[ids[1]].size == ps[1].size + j + 1 and results[ids[1]][-1] == eos
  # Several end ids (any one ends it), and stop sequences (the output's end matched, returned).
  first = lambda q: next(i + len(q) for i in range(gen.size) if tuple(gen[i:i + len(q)]) == q)
  pair = (int(gen[2]), int(gen[3]))
  absent = next(t for t in range(61) if t not in gen)
  for kw, end in [(dict(eos_id=[absent, eos]), j + 1), (dict(eos_id=(absent,)), 9),
                  (dict(stop=[pair]), first(pair)), (dict(stop=[[absent, absent], pair],
                                                         eos_id=eos), min(first(pair), j + 1)),
                  (dict(stop=[tuple(gen) + (absent,)]), 9)]:
    engine = Engine(model, max_batch=2, page_size=4, chunk=4)
    rid = engine.submit(ps[1], 9, **kw)
    np.testing.assert_array_equal(engine.run()[rid], alone(model, ps[1], 9)[:ps[1].size + end],
                                  err_msg=str(kw))


def test_stop_strings_end_a_request_at_the_token_that_completes_them():
  """``stop_strings`` with the engine's ``detokenize``: the request ends at the first token whose
  text completes one of them (found in the decoded output, also across token boundaries and
  inside a token's text), and equals generate's tokens up to it; errors name the argument."""
  model = model_for("llama")
  p = prompts(1)[1]
  gen = [int(t) for t in alone(model, p, 12)[p.size:]]
  pieces = ["".join("xyz"[(t + i) % 3] for i in range(1 + t % 3)) for t in range(61)]
  decode = lambda ids: "".join(pieces[t] for t in ids)   # noqa: E731
  text = decode(gen)

  def ends_at(s):   # the first output length whose text holds s
    return next(n for n in range(1, len(gen) + 1) if s in decode(gen[:n]))

  across = text[len(decode(gen[:3])) - 1:len(decode(gen[:5])) + 1]   # spans tokens 2..5
  cases = [[across], [pieces[gen[6]][-1:] + "q", across], [text[-2:]], ["never"]]
  for stops in cases:
    engine = Engine(model, max_batch=2, page_size=4, chunk=4, detokenize=decode)
    rid = engine.submit(p, 12, stop_strings=stops)
    found = [ends_at(s) for s in stops if s in text]
    end = min(found) if found else 12
    np.testing.assert_array_equal(engine.run()[rid], np.concatenate([p, gen[:end]]),
                                  err_msg=str(stops))
  engine = Engine(model, max_batch=2, page_size=4, chunk=4)
  with pytest.raises(ValueError, match="`stop_strings` needs the engine's `detokenize`"):
    engine.submit(p, 4, stop_strings=["x"])
  engine = Engine(model, max_batch=2, page_size=4, chunk=4, detokenize=decode)
  for bad in ("x", [""], [1], ["x", None]):
    with pytest.raises(ValueError, match="`stop_strings` must be None or a sequence of non-empty"):
      engine.submit(p, 4, stop_strings=bad)
  with pytest.raises(ValueError, match="`detokenize` must be None or a callable"):
    Engine(model, max_batch=2, page_size=4, chunk=4, detokenize="tokenizer")


def test_padded_sub_batches_and_the_pool_comes_back_whole():
  """5 slots: calls on 3 (or 5, 6, 7) busy slots are padded to a power of two (entries past the
  batch that feed nothing and are dropped); every request still equals generate alone, and at
  the end every page is back in every layer's pool."""
  model = model_for("llama")
  rng = np.random.default_rng(6)
  work = [(rng.integers(1, 61, size=int(rng.integers(1, 12))).astype(np.int32),
           int(rng.integers(1, 6))) for _ in range(9)]
  engine = Engine(model, max_batch=5, page_size=4, num_pages=12, max_pages_per_seq=4, chunk=4)
  ids = [engine.submit(p, n) for p, n in work]
  results = engine.run()
  for rid, (p, n) in zip(ids, work):
    np.testing.assert_array_equal(results[rid], alone(model, p, n), err_msg=f"request {rid}")
  tables = [c.table for c in jax.tree_util.tree_leaves(
      engine.cache.groups, is_leaf=lambda c: hasattr(c, "table")) if hasattr(c, "table")]
  assert tables and all(int(t.num_free) == 12 for t in tables)
  assert (np.asarray(engine.cache.lengths) == 0).all()


def test_a_sliding_window_model_holds_only_its_windows_pages():
  """mistral (window 3): after each step the pages behind every sequence's window go back to
  the pool, so a request holds at most ``window_pages`` = ceil((3 + 4) / 4) + 1 = 3 pages of 4
  at once.  Requests of 8 logical pages each run two at a time on a pool of 6 pages (the same
  requests to llama need 8 pages each: refused), with the results of ``generate`` alone, and
  the pool comes back whole."""
  model = model_for("mistral")
  rng = np.random.default_rng(8)
  work = [(rng.integers(1, 61, size=n).astype(np.int32), m) for n, m in ((21, 9), (17, 12),
                                                                       (25, 6), (3, 20))]
  engine = Engine(model, max_batch=2, page_size=4, num_pages=6, max_pages_per_seq=8, chunk=4)
  assert engine.window == 3 and engine.window_pages == 3
  ids = [engine.submit(p, n) for p, n in work]
  results = engine.run()
  for rid, (p, n) in zip(ids, work):
    np.testing.assert_array_equal(results[rid], alone(model, p, n), err_msg=f"request {rid}")
  st = engine.stats
  assert st.busy_slot_steps > st.steps + 20              # mostly two at once: 3 + 3 pages fit
  tables = [c.table for group in engine.cache.groups for c in group]
  assert all(int(t.num_free) == 6 for t in tables) and engine._free_pages == 6
  with pytest.raises(ValueError, match=r"needs 8 pages of 4, more than"):
    Engine(model_for("llama"), max_batch=2, page_size=4, num_pages=6, max_pages_per_seq=8,
           chunk=4).submit(work[0][0], 9)
  # With a prefix cache the pages are kept (cached pages outlive the window): no release.
  assert Engine(model, max_batch=2, page_size=4, prefix_cache=True).window is None


def test_local_global_layers_hold_whole_sequences_and_windows_apart():
  """Window layers interleaved with full ones ("SA", window 3, pages of 4): the full layers'
  pools hold whole sequences (``num_pages``), the window layers' only each slot's
  ``window_pages`` = 3 (``window_num_pages``, default 2 x 3 = 6, not 16).  Results equal
  ``generate`` alone; with a window pool of 3 the requests run one at a time although the full
  pools hold two (admission counts both pools); the pools come back whole."""
  model = model_for("llama", layer_pattern="SA", sliding_window=3)
  rng = np.random.default_rng(9)
  work = [(rng.integers(1, 61, size=n).astype(np.int32), m) for n, m in ((21, 9), (9, 20),
                                                                       (14, 3))]
  engine = Engine(model, max_batch=2, page_size=4, num_pages=16, max_pages_per_seq=8, chunk=4)
  assert (engine.window, engine.window_pages, engine.window_num_pages) == (3, 3, 6)
  layers = [c for group in engine.cache.groups for c in group]
  assert [c.key_pool.shape[0] for c in layers] == [6, 16]
  ids = [engine.submit(p, n) for p, n in work]
  results = engine.run()
  for rid, (p, n) in zip(ids, work):
    np.testing.assert_array_equal(results[rid], alone(model, p, n), err_msg=f"request {rid}")
  assert engine.stats.busy_slot_steps > engine.stats.steps      # two at once at times
  layers = [c for group in engine.cache.groups for c in group]     # (the cache was donated)
  assert [int(c.table.num_free) for c in layers] == [6, 16]
  assert engine._free_pages == 16 and engine._free_window_pages == 6

  one = Engine(model, max_batch=2, page_size=4, num_pages=16, max_pages_per_seq=8, chunk=4,
               window_num_pages=3)
  ids = [one.submit(p, n) for p, n in work]
  results = one.run()
  for rid, (p, n) in zip(ids, work):
    np.testing.assert_array_equal(results[rid], alone(model, p, n), err_msg=f"request {rid}")
  assert one.stats.busy_slot_steps == one.stats.steps            # one at a time
  with pytest.raises(ValueError, match=r"3 at once in a sliding-window layer.*window_num_pages=2"):
    Engine(model, max_batch=2, page_size=4, num_pages=16, max_pages_per_seq=8, chunk=4,
           window_num_pages=2).submit(work[0][0], 9)
  for name, kw in (("llama", {}), ("mistral", {}), ("llama", dict(layer_pattern="SA",
                                                                  sliding_window=3))):
    with pytest.raises(ValueError, match="`window_num_pages` \\(4\\) sizes the pools"):
      Engine(model_for(name, **kw), max_batch=2, page_size=4, window_num_pages=4,
             prefix_cache=bool(kw))
  # With a prefix cache nothing is released: one pool size.
  assert Engine(model, max_batch=2, page_size=4, prefix_cache=True).window_num_pages is None


@pytest.mark.parametrize("name,prefix", [("llama", False), ("llama", True),
                                         ("qwen3-next", False)])
def test_on_demand_allocation_preempts_and_recomputes(name, prefix):
  """``allocation="on_demand"`` on a 10-page pool: requests of 6-7 pages each (prompts of 5-9
  tokens, 16-19 new, pages of 4) run one at a time when admission reserves their whole need,
  two or three at once on demand; when the pool runs short the latest admitted is preempted
  and later reads its prompt and outputs again (with a prefix cache, from its own cached pages:
  hits although no two prompts share a token).  Every result is ``generate``'s alone (hybrid
  model: its recurrent states recomputed), and the pool comes back whole.  (The whole-need run,
  the baseline, is made once: llama without a prefix cache.)"""
  model = model_for(name)
  rng = np.random.default_rng(11)
  work = [(rng.integers(1, 61, size=n).astype(np.int32), m)
          for n, m in ((9, 16), (5, 19), (7, 17), (6, 18), (8, 16))]
  kw = dict(max_batch=3, page_size=4, num_pages=10, max_pages_per_seq=8, chunk=4,
            prefix_cache=prefix)
  runs = {}
  for allocation in ("reserve", "on_demand") if (name, prefix) == ("llama", False) else (
      "on_demand",):
    engine = Engine(model, allocation=allocation, **kw)
    ids = [engine.submit(p, n) for p, n in work]
    results = engine.run()
    for rid, (p, n) in zip(ids, work):
      np.testing.assert_array_equal(results[rid], alone(model, p, n),
                                    err_msg=f"{allocation}: request {rid}")
    runs[allocation] = engine
  lazy = runs["on_demand"].stats
  assert lazy.preempted >= 1 and lazy.preempted_tokens > 0
  assert lazy.busy_slot_steps > lazy.steps                           # more than one at a time
  if "reserve" in runs:
    reserve = runs["reserve"].stats
    assert reserve.preempted == 0 and reserve.busy_slot_steps == reserve.steps   # one at a time
    assert lazy.steps < reserve.steps
  if prefix:
    assert lazy.prefix_hit_tokens > 0
  engine = runs["on_demand"]
  engine.clear_prefix_cache()
  tables = [c.table for c in jax.tree_util.tree_leaves(
      engine.cache.groups, is_leaf=lambda c: hasattr(c, "table")) if hasattr(c, "table")]
  assert tables and all((np.asarray(t.num_free) == 10).all() for t in tables)
  assert engine._free_pages == 10 and engine.pending == 0


def test_static_policy_refills_only_an_empty_batch():
  model = model_for("llama")
  ps = prompts(4)
  slots = {}
  for policy in ("continuous", "static"):
    engine = Engine(model, max_batch=2, page_size=4, chunk=4, policy=policy)
    for p, (_, n) in zip(ps, REQUESTS):
      engine.submit(p, n)
    engine.run()
    slots[policy] = engine.stats
  # Static batching leaves a slot idle while its partner finishes: more steps, lower occupancy.
  assert slots["static"].steps > slots["continuous"].steps
  assert slots["static"].occupancy < slots["continuous"].occupancy


def test_admission_waits_for_pages():
  """A pool of 6 pages of 4 holds one request of 11 + 1 tokens (3 pages) plus one of 7 + 5 - 1
  (3 pages) at a time: the others wait though slots are free, and all still match."""
  model = model_for("llama")
  engine = Engine(model, max_batch=4, page_size=4, num_pages=6, max_pages_per_seq=4, chunk=4)
  ps = prompts(2)
  ids = [engine.submit(p, n) for p, (_, n) in zip(ps, REQUESTS)]
  engine.step()
  assert sum(r is not None for r in engine._slots) == 2 and len(engine._waiting) == 3
  results = engine.run()
  for rid, p, (_, n) in zip(ids, ps, REQUESTS):
    np.testing.assert_array_equal(results[rid], alone(model, p, n))


@pytest.mark.parametrize("allocation,prefix", [("reserve", False), ("on_demand", True)])
def test_priorities_order_the_queue_and_preempt_larger_values(allocation, prefix):
  """``submit(..., priority=)``: lower values first.  The queue is ordered by priority (first
  come, first served among equals); a request that finds no slot, or too few pages, preempts
  running requests of larger values (the largest first) -- never equal or smaller ones -- and
  they resume later (recomputed).  Every result is still ``generate``'s alone."""
  model = model_for("llama")
  rng = np.random.default_rng(3)
  ps = [rng.integers(1, 61, size=n).astype(np.int32) for n in (6, 5, 7, 4, 9)]
  alone_of = lambda i, n: alone(model, ps[i], n)  # noqa: E731

  def check(engine, ids, news):
    results = engine.run()
    for rid, i in ids.items():
      np.testing.assert_array_equal(results[rid], alone_of(i, news[i]), err_msg=f"request {i}")
    engine.clear_prefix_cache()
    assert engine._free_pages == engine.num_pages and engine.pending == 0

  kw = dict(page_size=4, chunk=4, allocation=allocation, prefix_cache=prefix)
  # One slot, all submitted up front: admitted by (priority, arrival).
  engine = Engine(model, max_batch=1, **kw)
  news = [3, 3, 3, 3, 3]
  order = []
  ids = {engine.submit(ps[i], 3, priority=prio): i
         for i, prio in enumerate((0, 0, -1, 5, -1))}
  while engine.pending:
    for rid, _ in engine.step():
      if ids[rid] not in order:
        order.append(ids[rid])
  assert order == [2, 4, 0, 1, 3] and engine.stats.preempted == 0
  check(engine, ids, news)

  # A slot taken by a request of larger value: the urgent one preempts it at once; one of
  # equal value waits.
  engine = Engine(model, max_batch=1, **kw)
  news = [12, 3, 3, 3, 3]
  ids = {engine.submit(ps[0], 12, priority=1): 0}
  for _ in range(4):
    engine.step()
  ids[engine.submit(ps[1], 3, priority=1)] = 1                 # equal: waits its turn
  engine.step()
  assert engine.stats.preempted == 0 and engine._slots[0].rid == 0
  ids[engine.submit(ps[2], 3, priority=0)] = 2                 # smaller: preempts request 0
  first = [ids[rid] for rid, _ in engine.step()]
  assert engine.stats.preempted == 1 and first == [] and engine._slots[0].rid == 2
  assert [r.rid for r in engine._waiting] == [0, 1]            # the preempted one ahead
  check(engine, ids, news)

  # Pages, not slots: two slots, and a running request of a larger value holding (nearly) the
  # whole pool; the urgent request needs three pages.
  engine = Engine(model, max_batch=2, num_pages=5, max_pages_per_seq=5, **kw)
  news = [13, 3, 3, 3, 2]
  ids = {engine.submit(ps[0], 13, priority=2): 0}              # 6 + 12 = 18 positions: 5 pages
  while engine._free_pages > 1:                                # (on demand: as it decodes)
    engine.step()
  urgent = engine.submit(ps[4], 2, priority=1)                 # 9 + 1 positions: 3 pages
  ids[urgent] = 4
  engine.step()
  assert engine.stats.preempted == 1 and [r.rid for r in engine._slots if r] == [urgent]
  check(engine, ids, news)

  with pytest.raises(ValueError, match="`priority` must be an int"):
    engine.submit(ps[0], 2, priority=0.5)


def test_priority_aging_admits_a_request_a_stream_of_smaller_values_would_starve():
  """``Engine(priority_aging=n)``: a request's priority value drops by one every ``n`` steps
  since its submission.  One slot and a stream of priority-0 requests, one submitted per step
  (each done in one step): without aging the priority-3 request waits for the stream to end;
  with ``n = 2`` it ranks level with the newest at step 6 and goes first from then (ties keep
  arrival order), its results still ``generate``'s, and the stream behind it is not preempted
  by it nor does it preempt it."""
  model = model_for("llama")
  rng = np.random.default_rng(5)
  ps = [rng.integers(1, 61, size=4).astype(np.int32) for _ in range(13)]

  def admitted_at(aging):
    engine = Engine(model, max_batch=1, page_size=4, chunk=4, priority_aging=aging)
    low = engine.submit(ps[12], 3, priority=3)
    seen, ids = {}, {low: 12}
    for t in range(1, 30):
      if t <= 12:
        ids[engine.submit(ps[t - 1], 1)] = t - 1
      for rid, _ in engine.step():
        seen.setdefault(ids[rid], t)
      if not engine.pending:
        break
    assert engine.stats.preempted == 0
    results = engine.results
    for rid, i in ids.items():
      np.testing.assert_array_equal(results[rid], alone(model, ps[i], 1 if i < 12 else 3))
    return seen[12], engine

  starved, _ = admitted_at(None)
  aged, engine = admitted_at(2)
  # Without aging: after all twelve (one a step); with it: its first token at step 7 (ranked
  # first at step 6's end, when it ties the newcomer and came before it), ahead of six.
  assert starved == 13 and aged == 7
  with pytest.raises(ValueError, match="`priority_aging` must be a positive int"):
    Engine(model, priority_aging=0)
  with pytest.raises(ValueError, match="`priority_aging` must be a positive int"):
    Engine(model, priority_aging=1.5)


@pytest.mark.parametrize("prefix", [False, True])
def test_abort_ends_a_request_at_once_and_frees_its_pages(prefix):
  """``abort(rid)``: a running request leaves its slot and pages at once, its result the prompt
  and its tokens so far (a prefix of ``generate``'s); a waiting one never runs (its result the
  prompt); from ``run``'s ``on_token`` no more of the request's tokens arrive; the others are
  unaffected, ids not pending return False, and every page comes back (with pages on demand
  and, in one case, a prefix cache holding what the aborted request computed)."""
  model = model_for("llama")
  ps = prompts(4)
  engine = Engine(model, max_batch=2, page_size=4, chunk=4, allocation="on_demand",
                  prefix_cache=prefix, num_pages=10, max_pages_per_seq=6)
  a, b, c = (engine.submit(ps[i], n) for i, n in ((0, 12), (1, 6), (2, 5)))   # c waits
  for _ in range(4):
    engine.step()
  held = len(engine._slots[0].out)
  assert engine._slots[0].rid == a and 0 < held < 12 and engine._waiting[0].rid == c
  assert engine.abort(a) and engine.abort(c)
  assert engine._slots[0] is None and not engine._waiting
  assert not engine.abort(a) and not engine.abort(c) and not engine.abort(99)
  d = engine.submit(ps[3], 6)                                # takes the freed slot
  got = {}

  def on_token(rid, token):
    got.setdefault(rid, []).append(token)
    if rid == d and len(got[d]) == 2:
      assert engine.abort(d)

  results = engine.run(on_token)
  np.testing.assert_array_equal(results[a], alone(model, ps[0], 12)[:ps[0].size + held])
  np.testing.assert_array_equal(results[c], ps[2])
  np.testing.assert_array_equal(results[b], alone(model, ps[1], 6))
  np.testing.assert_array_equal(results[d], alone(model, ps[3], 6)[:ps[3].size + 2])
  assert len(got[d]) == 2 and engine.stats.aborted == 3 and engine.stats.finished == 1
  engine.clear_prefix_cache()
  assert _pools_whole(engine)
  assert engine._free_pages == engine.num_pages and engine.pending == 0


def test_sampled_requests_equal_generate_alone_with_their_seeds():
  """Sampling settings per request (the engine's defaults, greedy, top-p, top-k, min-p, own seeds)
  in one batch: each request gets what ``generate`` gives it alone with its settings and seed
  (request ``rid`` defaults to seed ``engine.seed + rid``), on two schedules (3 slots, chunk 8; 2
  slots, chunk 2 and pages on demand on a tight pool: preemptions).  And with ``logprobs``, each
  generated token's log-probability is ``log_softmax`` of the full forward's logits."""
  model = model_for("llama")
  ps = prompts(3)
  own = [dict(), dict(temperature=0.0), dict(top_p=0.6, temperature=1.3, seed=77),
         dict(top_k=0, temperature=2.0, min_p=0.1), dict(top_k=3, seed=5)]
  outs = []
  for kw in (dict(max_batch=3, chunk=8), dict(max_batch=2, chunk=2, num_pages=4,
                                              max_pages_per_seq=4, allocation="on_demand")):
    engine = Engine(model, page_size=4, temperature=0.8, top_k=10, seed=40, logprobs=True, **kw)
    ids = [engine.submit(p, n, **o) for p, (_, n), o in zip(ps, REQUESTS, own)]
    out = engine.run()
    outs.append([out[i] for i in ids])
    if kw.get("allocation"):
      assert engine.stats.preempted > 0
  for i, (p, (_, n), o) in enumerate(zip(ps, REQUESTS, own)):
    settings = dict(dict(temperature=0.8, top_k=10, top_p=1.0, min_p=0.0, seed=40 + i), **o)
    want = generate(model, p[None], n, **settings)[0]
    for tokens, logprobs in (outs[0][i], outs[1][i]):
      np.testing.assert_array_equal(tokens, want, err_msg=f"request {i}")
      logits = np.asarray(model(jax.numpy.asarray(tokens[None])))[0]
      full = jax.nn.log_softmax(logits[p.size - 1:-1], axis=-1)
      np.testing.assert_allclose(logprobs, np.take_along_axis(
          np.asarray(full), tokens[p.size:, None], axis=-1)[:, 0], rtol=1e-4, atol=1e-4)
  assert len({tuple(o[0]) for o in outs[0]}) == len(ps)


def test_zero_new_tokens_returns_the_prompt():
  ps = prompts(3)
  model = model_for("llama")
  engine = Engine(model, max_batch=1, page_size=4)
  rid = engine.submit(ps[0], 0)
  assert engine.pending == 0
  np.testing.assert_array_equal(engine.results[rid], ps[0])
  assert list(engine.pop_results()) == [rid] and engine.results == {}   # handed out, forgotten


def test_errors():
  model = model_for("llama")
  engine = Engine(model, max_batch=2, page_size=4, num_pages=4, max_pages_per_seq=3)
  ok = np.array([1, 2, 3], np.int32)
  for bad, match in [(np.array([], np.int32), "non-empty 1-D"), (np.ones((2, 2), np.int32),
                     "non-empty 1-D"), (np.array([1.0]), "non-empty 1-D"),
                     (np.array([1, 61]), r"must be in \[0, 61\)")]:
    with pytest.raises(ValueError, match=match):
      engine.submit(bad, 2)
  with pytest.raises(ValueError, match="`max_new_tokens` must be an int >= 0"):
    engine.submit(ok, -1)
  for bad in (61, [1, 61], "a", 1.0):
    with pytest.raises(ValueError, match="`eos_id` must be None, a token id or a sequence"):
      engine.submit(ok, 2, eos_id=bad)
  for bad in ([[]], "ab", [1, 2], [[1, 61]]):
    with pytest.raises(ValueError, match="`stop` must be None or a sequence of non-empty"):
      engine.submit(ok, 2, stop=bad)
  with pytest.raises(ValueError, match=r"needs 4 pages of 4, more than a"):
    engine.submit(ok, 11)
  for kw, match in [(dict(allocation="lazy"), "`allocation` must be one of"),
                    (dict(max_batch=0), "`max_batch` must be a positive int"),
                    (dict(chunk=2.0), "`chunk` must be a positive int"),
                    (dict(temperature=-1.0), "`temperature`"),
                    (dict(seed=0.5), "`seed` must be an int"),
                    (dict(policy="fifo"), "`policy` must be one of"),
                    (dict(narrow_tables=1), "`narrow_tables` must be a bool")]:
    with pytest.raises(ValueError, match=match):
      Engine(model, **kw)


def test_bench_serve_runs_and_both_policies_agree(tmp_path):
  from experiments import bench_serve  # noqa: PLC0415
  results = bench_serve.main(["--requests", "5", "--max-batch", "2", "--prompt-lens", "2,9",
                              "--new-tokens", "1,6", "--shared-prefix", "5", "--chunk", "4",
                              "--page-size", "4", "--layer-pattern", "SA", "--sliding-window",
                              "3", "--compare-on-demand", "--compare-quantized", "int8",
                              "--compare-speculative", "2", "--out", str(tmp_path)])
  assert results["identical_outputs"]                  # speculative decoding's included
  static, continuous, prefix, lazy, spec, quant = results["rows"]
  assert spec["policy"] == "continuous (k=2 drafts)" and spec["generated"] == static["generated"]
  assert spec["steps"] <= continuous["steps"] and spec["drafted"] > 0
  # An int8 cache: the same requests over codes and scales (fp32 compute, heads of 16: 2 (16 + 4)
  # bytes per token and KV head against 2 x 16 x 4; page tables besides), the same tokens nearly.
  assert quant["policy"] == "continuous (int8 cache)" and quant["generated"] == static["generated"]
  assert quant["cache_bytes"] < 0.5 * continuous["cache_bytes"]
  assert 0.9 <= results["quantized_token_agreement"] <= 1
  assert lazy["policy"] == "continuous (on demand)" and lazy["generated"] == static["generated"]
  # Local / global layers: the window layer's pool holds each slot's 3 window pages, not 64
  # (max_seq_len 256 / 4); with the prefix cache nothing is released: one size for both.
  assert continuous["cache_bytes"] < 0.6 * prefix["cache_bytes"]
  assert static["generated"] == continuous["generated"] == prefix["generated"]
  assert continuous["steps"] <= static["steps"]
  # Request 1 computes the shared prefix's full page; request 2, arriving with it, waits for the
  # page, and requests 3-5 find it.
  assert static["hit"] == continuous["hit"] == 0 and prefix["hit"] == 4 * 4
  assert prefix["fed"] == continuous["fed"] - prefix["hit"]
  assert (tmp_path / "results.json").exists() and (tmp_path / "bench_serve.png").exists()


def test_a_cache_budget_sets_the_pages():
  """``cache_bytes``: the most pages whose cache fits the budget (one more would not); an int8
  cache gets more pages in the same bytes (fp32 compute, heads of 16: 2 (16 + 4) bytes per token
  and KV head against 2 x 16 x 4); the requests still get ``generate``'s tokens; the errors."""
  model = model_for("llama")
  budget = 40_000
  engine = Engine(model, max_batch=2, page_size=4, chunk=4, cache_bytes=budget)
  assert engine.cache.nbytes <= budget
  bigger = model.init_paged_cache(2, engine.num_pages + 1, 4,
                                  max_pages_per_seq=engine.max_pages_per_seq)
  assert bigger.nbytes > budget
  quant = Engine(model, max_batch=2, page_size=4, chunk=4, cache_bytes=budget, dtype=jnp.int8)
  assert quant.cache.nbytes <= budget and quant.num_pages > 2 * engine.num_pages
  ps = prompts()
  ids = [engine.submit(p, n) for p, (_, n) in zip(ps, REQUESTS)]
  results = engine.run()
  for rid, p, (_, n) in zip(ids, ps, REQUESTS):
    np.testing.assert_array_equal(results[rid], alone(model, p, n))
  # Local / global layers: the window layers' pools are fixed, the budget sizes the others.
  mixed = model_for("gpt-oss")
  engine = Engine(mixed, max_batch=2, page_size=4, chunk=4, cache_bytes=60_000)
  assert engine.cache.nbytes <= 60_000 and engine.window_num_pages <= engine.num_pages
  # A prefix cache over recurrent layers: its state snapshots count too.
  hybrid = model_for("qwen3-next")
  engine = Engine(hybrid, max_batch=2, page_size=4, prefix_cache=True, prefix_states=3,
                  cache_bytes=60_000)
  store = sum(x.nbytes for x in jax.tree.leaves(engine._store))
  assert store > 0 and engine.cache.nbytes + store <= 60_000
  bigger = hybrid.init_paged_cache(2, engine.num_pages + 1, 4,
                                   max_pages_per_seq=engine.max_pages_per_seq)
  assert bigger.nbytes + store > 60_000
  with pytest.raises(ValueError, match=r"give `num_pages` \(8\) or `cache_bytes` \(1000\)"):
    Engine(model, num_pages=8, cache_bytes=1000)
  with pytest.raises(ValueError, match="`cache_bytes` 100 is below the smallest cache"):
    Engine(model, max_batch=2, page_size=4, cache_bytes=100)


def test_penalized_requests_equal_generate_alone():
  """Repetition / presence / frequency penalties per request (the engine's defaults, a request's
  own, one with none) next to each other, greedy and sampled, on two schedules (the second with
  preemptions: a recomputed request keeps its prompt and outputs as its history): each request
  gets what ``generate`` gives it alone with its penalties; the penalties change the tokens.
  (With speculative decoding: tests/test_serving_speculative.py, tests/test_serving_mtp.py.)"""
  model = model_for("llama")
  ps = prompts(5)
  own = [dict(), dict(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0),
         dict(repetition_penalty=2.0, presence_penalty=0.5), dict(frequency_penalty=1.5),
         dict(temperature=1.0, seed=9, presence_penalty=1.0)]
  defaults = dict(repetition_penalty=1.6, frequency_penalty=0.4)
  for kw in (dict(max_batch=3, chunk=8), dict(max_batch=2, chunk=2, num_pages=4,
                                              max_pages_per_seq=4, allocation="on_demand")):
    engine = Engine(model, page_size=4, seed=40, **defaults, **kw)
    ids = [engine.submit(p, n, **o) for p, (_, n), o in zip(ps, REQUESTS, own)]
    out = engine.run()
    if kw.get("allocation"):
      assert engine.stats.preempted > 0
    for i, (p, (_, n), o) in enumerate(zip(ps, REQUESTS, own)):
      settings = {**dict(seed=40 + i), **defaults, **o}
      want = generate(model, p[None], n, **settings)[0]
      np.testing.assert_array_equal(out[ids[i]], want, err_msg=f"request {i}, {kw}")
  plain = [generate(model, p[None], n)[0] for p, (_, n) in zip(ps, REQUESTS)]
  assert not np.array_equal(out[ids[0]], plain[0])         # the defaults did something
  np.testing.assert_array_equal(out[ids[1]], plain[1])     # penalties off: unchanged
  with pytest.raises(ValueError, match="repetition_penalty"):
    Engine(model).submit(ps[0], 4, repetition_penalty=-1.0)
