"""Speculative decoding in the serving engine (``Engine(num_draft_tokens=k)``, prompt lookup or a
draft model; the model's own MTP module in tests/test_serving_mtp.py): greedy requests get
exactly ``generate``'s tokens (attention, a prefix cache, pages on demand with preemptions, a
hybrid Gated DeltaNet model, requests with penalties; sliding windows in
tests/test_serving_fuzz.py; MLA's latent pages truncate through the same page tables, and its
chunk path is chunked prefill's) and the pools (the draft's too) come back whole; sampled
requests do not depend on their neighbours and keep the model's distribution; rewinding a paged
cache returns the pages past the kept tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax import nnx

from jaxattn.configs import get_config
from jaxattn.generation import filtered_logits, generate, sample_rows
from jaxattn.nn.model import DecoderLM
from jaxattn.paged_cache import PageTable
from jaxattn.serving import Engine
from jaxattn.speculative import accept_rows, propose_rows
from tests.test_serving import SMALL, _pools_whole, alone, model_for

# Random prompts (the random models' greedy outputs then repeat in part: prompt lookup's drafts
# are kept some of the time, not always) and repetitive ones.
_RNG = np.random.default_rng(0)
WORK = [(_RNG.integers(1, 61, size=n).astype(np.int32), m) for n, m in ((8, 12), (6, 9), (5, 7))]
WORK += [(np.array([20, 21, 22, 20, 21, 22, 20], np.int32), 1),
         (np.array([8, 8, 8, 8], np.int32), 10)]


def _draft(**kw):
  """A 1-layer llama of the test models' vocabulary: a draft that agrees with them sometimes."""
  return DecoderLM(get_config("llama", **SMALL).replace(num_layers=1, **kw), rngs=nnx.Rngs(3))


@pytest.mark.parametrize("name,kw", [
    ("llama", dict()),
    ("llama", dict(allocation="on_demand", num_pages=9, max_pages_per_seq=6, prefix_cache=True)),
    # Gated DeltaNet states rewound from the check call's per-token snapshots (and saved for the
    # prefix cache at page ends, restored after preemption's recompute)
    ("qwen3-next", dict(allocation="on_demand", num_pages=9, max_pages_per_seq=6,
                        prefix_cache=True)),
])
def test_greedy_requests_equal_generate_alone(name, kw):
  model = model_for(name)
  engine = Engine(model, max_batch=3, page_size=4, chunk=4, num_draft_tokens=3, **kw)
  ids = [engine.submit(p, n) for p, n in WORK]
  results = engine.run()
  for rid, (p, n) in zip(ids, WORK):
    np.testing.assert_array_equal(results[rid], alone(model, p, n), err_msg=f"request {rid}")
  st = engine.stats
  assert st.generated == sum(n for _, n in WORK)
  assert 0 < st.accepted_drafts < st.drafted            # drafts kept and drafts rejected
  # kept drafts are tokens emitted without a step of their own
  assert st.generated >= st.steps - 1
  if kw.get("allocation"):
    assert st.preempted >= 1
    engine.clear_prefix_cache()
  assert _pools_whole(engine) and engine._free_pages == engine.num_pages


# (An MLA model with a draft: tests/test_serving_mesh.py's cases and the prompt-lookup test above
# cover the pieces; on CPU each such engine costs 30 s of compiling.)
@pytest.mark.parametrize("name,kw", [
    ("llama", dict()),
    ("llama", dict(allocation="on_demand", num_pages=9, max_pages_per_seq=6)),
])
def test_a_draft_model_gives_generates_tokens(name, kw):
  """A draft model (its cache indexed by the model's page table, fed every prompt chunk):
  greedy results are ``generate``'s, the model's pool comes back whole; the model drafting for
  itself has every draft kept."""
  model = model_for(name)
  engine = Engine(model, max_batch=3, page_size=4, chunk=4, num_draft_tokens=3, draft=_draft(),
                  **kw)
  ids = [engine.submit(p, n) for p, n in WORK]
  results = engine.run()
  results = [results[rid] for rid in ids]
  for rid, got, (p, n) in zip(ids, results, WORK):
    np.testing.assert_array_equal(got, alone(model, p, n), err_msg=f"request {rid}")
  st = engine.stats
  assert st.drafted > 0 and st.generated == sum(n for _, n in WORK)
  if kw:
    assert st.preempted >= 1
  assert _pools_whole(engine)
  if name == "llama" and not kw:
    itself = Engine(model, max_batch=3, page_size=4, chunk=4, num_draft_tokens=3, draft=model)
    ids = [itself.submit(p, n) for p, n in WORK]
    again = itself.run()
    assert all((again[i] == want).all() for i, want in zip(ids, results))
    assert itself.stats.accepted_drafts == itself.stats.drafted > 0
    assert itself.stats.steps < st.steps


@pytest.mark.parametrize("drafter", ["lookup", "itself"])
def test_penalized_requests_equal_generate_alone(drafter):
  """Repetition / presence / frequency penalties (the engine's defaults, a request's own, none;
  one request sampled at top-1, so the batch takes the sampling path) with prompt lookup or the
  model drafting for itself: each request gets what ``generate`` gives it alone with its
  penalties (which change the tokens); a draft model's proposals are penalized with the state
  the check judges them with (drafting for itself, every draft is kept); the log-probabilities
  reported are the model's, unpenalized."""
  model = model_for("llama")
  defaults = dict(repetition_penalty=1.6, frequency_penalty=0.4)
  own = [dict(), dict(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0),
         dict(repetition_penalty=2.0, presence_penalty=0.5), dict(frequency_penalty=1.5),
         dict(temperature=0.8, top_k=1, presence_penalty=1.0)]
  engine = Engine(model, max_batch=3, page_size=4, chunk=4, num_draft_tokens=3,
                  draft=model if drafter == "itself" else None, logprobs=True, **defaults)
  ids = [engine.submit(p, n, **o) for (p, n), o in zip(WORK, own)]
  results = engine.run()
  forward = nnx.jit(lambda m, t: jax.nn.log_softmax(m(t).astype(jnp.float32)))
  changed = False
  for rid, (p, n), o in zip(ids, WORK, own):
    settings = {**defaults, **{key: v for key, v in o.items() if key.endswith("penalty")}}
    want = generate(model, p[None], n, **settings)[0]
    tokens, logprob = results[rid]
    np.testing.assert_array_equal(tokens, want, err_msg=f"request {rid}")
    changed |= not np.array_equal(tokens, alone(model, p, n))
    ref = np.asarray(forward(model, jnp.asarray(tokens[None, :-1])))[0, p.size - 1:]
    np.testing.assert_allclose(logprob, ref[np.arange(n), tokens[p.size:]], atol=2e-4)
  assert changed and engine.stats.drafted > 0
  if drafter == "itself":   # (prompt lookup's repeats are what the penalties discourage)
    assert engine.stats.accepted_drafts == engine.stats.drafted


def _greedy_chains(model, length: int = 48):
  """``chain(seq, n) -> [n]``: ``model``'s greedy continuation of ``seq`` without a cache (one
  jitted full pass a token, over ``seq`` padded to ``length``: causal, the padding is unread)."""
  graphdef, state = nnx.split(model)
  logits = jax.jit(lambda tokens: nnx.merge(graphdef, state)(tokens)[0])

  def chain(seq, n):
    seq = list(seq)
    for _ in range(n):
      padded = np.zeros((1, length), np.int32)
      padded[0, :len(seq)] = seq
      seq.append(int(np.argmax(np.asarray(logits(padded))[len(seq) - 1])))
    return np.asarray(seq[-n:] if n else [], np.int32)
  return chain


@pytest.mark.parametrize("itself", [False, True])
def test_a_draft_model_shares_the_prefix_cache_and_proposes_its_own_continuations(itself):
  """A draft model's cache is indexed by the model's page table, so a prefix cache shares its
  pages too: greedy results are ``generate``'s, prompts with a common prefix read it from the
  cache, and every proposal equals the draft's greedy continuation of the sequence computed
  without a cache -- after prefix hits, preemptions (recompute) and checks that kept every draft
  (the model drafting for itself: the draft's entry of the last kept draft is written by the
  next proposal, and its page cached only then)."""
  model = model_for("llama")
  draft = model if itself else _draft()
  rng = np.random.default_rng(5)
  common = rng.integers(1, 61, size=10).astype(np.int32)
  work = [(np.concatenate([common, rng.integers(1, 61, size=n).astype(np.int32)]), m)
          for n, m in ((1, 9), (3, 8), (1, 9), (2, 9))]
  engine = Engine(model, max_batch=2, page_size=4, chunk=4, num_draft_tokens=3, draft=draft,
                  prefix_cache=True, allocation="on_demand", num_pages=7, max_pages_per_seq=8)
  def poison():   # entries the draft did not write are NaN: reading one spoils its drafts
    engine.draft_cache = jax.tree.map(
        lambda x: jnp.full_like(x, jnp.nan) if jnp.issubdtype(x.dtype, jnp.floating) else x,
        engine.draft_cache)

  poison()
  seen, speculate = [], engine._draft_verify

  def recording(state, draft_state, first, num_first, start, tokens, num_tokens, rows, *args,
                **kw):
    out = speculate(state, draft_state, first, num_first, start, tokens, num_tokens, rows, *args,
                    **kw)
    for row, n, drafts in zip(np.asarray(rows), np.asarray(num_tokens) - 1, np.asarray(out[-1])):
      if row < engine.max_batch:
        r = engine._slots[row]
        seen.append((np.concatenate([r.prompt, np.asarray(r.out, np.int32)]), drafts[:n]))
    return out

  engine._draft_verify = recording
  ids = [engine.submit(p, n) for p, n in work]
  results = engine.run()
  st = engine.stats
  assert st.prefix_hit_tokens >= 8 * 3 and st.preempted >= 1
  # A conversation goes on with a whole sequence ending on a page boundary and a new token: its
  # pages are cached, but not the last, whose last entry (the last kept draft's, when the
  # check kept every draft) the draft never wrote.
  engine.clear_prefix_cache()
  poison()
  hits = st.prefix_hit_tokens
  work.append(work[3])
  ids.append(engine.submit(*work[-1]))
  results.update(engine.run())
  work.append((np.append(results[ids[-1]], 7).astype(np.int32), 3))
  ids.append(engine.submit(*work[-1]))
  results.update(engine.run())
  assert st.prefix_hit_tokens - hits >= 16
  for rid, (p, n) in zip(ids, work):
    np.testing.assert_array_equal(results[rid], alone(model, p, n), err_msg=f"request {rid}")
  if itself:
    assert st.accepted_drafts == st.drafted > 0
  else:
    assert 0 < st.accepted_drafts < st.drafted
  chain = _greedy_chains(draft)
  assert len(seen) >= 6
  for seq, drafts in seen:
    np.testing.assert_array_equal(drafts, chain(seq, drafts.size), err_msg=f"after {seq}")
  engine.clear_prefix_cache()
  assert _pools_whole(engine) and engine._free_pages == engine.num_pages


@pytest.mark.parametrize("drafter", ["model", "mtp"])
def test_abort_beside_a_drafter(drafter):
  """A request aborted mid-decode beside a draft model's cache or the MTP block's (indexed by
  the model's page table), with a prefix cache and pages on demand: its result is a prefix of
  ``generate``'s, the others' are ``generate``'s, and every page comes back."""
  model = model_for("llama", mtp_depth=1)
  rng = np.random.default_rng(0)
  ps = [rng.integers(1, 61, size=n).astype(np.int32) for n in (9, 6, 7)]
  engine = Engine(model, max_batch=2, page_size=4, chunk=4, num_draft_tokens=3,
                  draft=_draft() if drafter == "model" else "mtp", prefix_cache=True,
                  allocation="on_demand", num_pages=12, max_pages_per_seq=8)
  ids = [engine.submit(p, 10) for p in ps]
  for _ in range(4):
    engine.step()
  assert engine.abort(ids[0])
  results = {**engine.pop_results(), **engine.run()}
  cut = results[ids[0]].size
  assert ps[0].size < cut < ps[0].size + 10
  np.testing.assert_array_equal(results[ids[0]], alone(model, ps[0], 10)[:cut])
  for rid, p in zip(ids[1:], ps[1:]):
    np.testing.assert_array_equal(results[rid], alone(model, p, 10))
  engine.clear_prefix_cache()
  assert _pools_whole(engine) and engine._free_pages == engine.num_pages


def test_eos_inside_a_kept_run_ends_the_request_there():
  """A request whose end token comes among the tokens a step keeps stops at it (the later kept
  tokens are dropped), as without drafts."""
  model = model_for("llama")
  p, n = WORK[1]
  free = alone(model, p, n)
  eos = int(free[p.size + 4])
  assert eos not in free[p.size:p.size + 4]
  engine = Engine(model, max_batch=2, page_size=4, num_draft_tokens=4)
  rid = engine.submit(p, n, eos_id=eos)
  np.testing.assert_array_equal(engine.run()[rid], alone(model, p, n, eos_id=eos)[
      :p.size + 1 + list(free[p.size:]).index(eos)])


def test_sampled_requests_do_not_depend_on_their_neighbours():
  """A sampled request's tokens (and log-probabilities) alone equal those it gets among others,
  on another schedule.  (Top-1 sampling equal to greedy: tests/test_speculative.py.)"""
  model = model_for("llama")
  outs = []
  # (with a draft model; prompt lookup's verdicts go through the same accept_rows)
  for kw, work in ((dict(max_batch=1, chunk=8), WORK[:1]), (dict(max_batch=2, chunk=2), WORK[:3])):
    kw["draft"] = _draft()
    engine = Engine(model, page_size=4, num_draft_tokens=3, temperature=0.9, seed=4,
                    logprobs=True, **kw)
    ids = [engine.submit(p, n) for p, n in work]
    res = engine.run()
    outs.append(res[ids[0]])
  np.testing.assert_array_equal(outs[0][0], outs[1][0])
  np.testing.assert_allclose(outs[0][1], outs[1][1], rtol=1e-5, atol=1e-5)


def test_accept_rows_keeps_the_model_distribution():
  """Many rows, one fixed distribution per position and a fixed draft: the first token is
  distributed as ``p_0``, the draft kept with probability ``p_0(d)``, and given it kept, the next
  as ``p_1``; with no draft a row samples what ``sample_rows`` samples (same key)."""
  n, v = 20000, 5
  logits = jax.random.normal(jax.random.key(0), (3, v)) * 1.5
  temperature, top_k = 0.8, 4
  p = np.asarray(jax.nn.softmax(filtered_logits(logits, temperature=temperature, top_k=top_k)))
  drafts = jnp.broadcast_to(jnp.array([int(np.argsort(p[0])[-2]), int(np.argmax(p[1]))]),
                            (n, 2)).astype(jnp.int32)
  rows = lambda x, dt: jnp.full((n,), x, dt)  # noqa: E731
  seeds = jnp.arange(n, dtype=jnp.int32)
  settings = (seeds, rows(3, jnp.int32), rows(temperature, jnp.float32),
              rows(1.0, jnp.float32), rows(top_k, jnp.int32))
  tokens, accepted, _ = accept_rows(jnp.broadcast_to(logits, (n, 3, v)), drafts,
                                    rows(2, jnp.int32), *settings)
  tokens, accepted = np.asarray(tokens), np.asarray(accepted)
  freq = lambda x: np.bincount(x, minlength=v) / x.size  # noqa: E731
  np.testing.assert_allclose(freq(tokens[:, 0]), p[0], atol=0.016)      # ~5 sigma
  d0 = int(drafts[0, 0])
  assert np.mean(accepted >= 1) == pytest.approx(p[0][d0], abs=0.016)
  np.testing.assert_allclose(freq(tokens[accepted >= 1, 1]), p[1], atol=0.025)
  assert (p[0][tokens[:, 0]] > 0).all()
  none, _, _ = accept_rows(jnp.broadcast_to(logits, (n, 3, v))[:64], drafts[:64],
                           rows(0, jnp.int32)[:64], *(x[:64] for x in settings))
  np.testing.assert_array_equal(np.asarray(none)[:, 0], np.asarray(
      sample_rows(jnp.broadcast_to(logits[0], (64, v)), *(x[:64] for x in settings))))


def test_sampled_drafts_with_their_distributions_keep_the_model_distribution():
  """Drafts sampled from a proposer's ``q`` (``propose_rows``) and judged with it
  (``draft_probs``): drafts distributed as ``q``, the first token as ``p_0`` whatever ``q``,
  kept with probability ``sum min(p_0, q)``, the next token as ``p_1`` given a kept draft."""
  n, v = 20000, 5
  logits = jax.random.normal(jax.random.key(0), (2, v)) * 1.5
  proposer = jax.random.normal(jax.random.key(1), (v,)) * 1.5
  temperature, top_k = 0.8, 4
  filt = lambda x: np.asarray(jax.nn.softmax(filtered_logits(x, temperature=temperature,  # noqa
                                                             top_k=top_k)))
  p, q = filt(logits), filt(proposer[None])[0]
  rows = lambda x, dt: jnp.full((n,), x, dt)  # noqa: E731
  settings = (jnp.arange(n, dtype=jnp.int32), rows(3, jnp.int32), rows(temperature, jnp.float32),
              rows(1.0, jnp.float32), rows(top_k, jnp.int32))
  drafts, probs = propose_rows(jnp.broadcast_to(proposer, (n, v)), *settings)
  tokens, accepted, _ = accept_rows(jnp.broadcast_to(logits, (n, 2, v)), drafts[:, None],
                                    rows(1, jnp.int32), *settings, draft_probs=probs[:, None])
  tokens, accepted, drafts = map(np.asarray, (tokens, accepted, drafts))
  freq = lambda x: np.bincount(x, minlength=v) / x.size  # noqa: E731
  np.testing.assert_allclose(freq(drafts), q, atol=0.016)
  np.testing.assert_allclose(np.asarray(probs)[0], q, atol=1e-6)
  np.testing.assert_allclose(freq(tokens[:, 0]), p[0], atol=0.016)
  assert np.mean(accepted) == pytest.approx(np.minimum(p[0], q).sum(), abs=0.016)
  np.testing.assert_allclose(freq(tokens[accepted == 1, 1]), p[1], atol=0.025)
  # a greedy row: its draft the argmax, one-hot
  d, one = propose_rows(proposer[None], *(x[:1] for x in settings[:2]), jnp.zeros((1,)),
                        jnp.ones((1,)), jnp.zeros((1,), jnp.int32))
  assert int(d[0]) == int(jnp.argmax(proposer)) and float(one[0, int(d[0])]) == 1.0


def test_truncate_returns_the_pages_past_the_kept_tokens():
  table = PageTable.init(2, num_pages=8, page_size=4)
  table, _, _ = table.reserve(10)                     # 3 pages each: 6 popped
  assert int(table.num_free) == 2
  cut = table.truncate(jnp.array([5, 12]))            # row 0 keeps 2 pages; row 1 stays (10)
  assert np.asarray(cut.lengths).tolist() == [5, 10] and int(cut.num_free) == 3
  assert (np.asarray(cut.page_table)[0, 2:] == -1).all()
  assert np.asarray(cut.page_table)[0, :2].tolist() == np.asarray(table.page_table)[0, :2].tolist()
  again, _, _ = cut.reserve(4)              # a page each; row 0 pops first: the one it freed
  assert int(again.num_free) == 1 and np.asarray(again.lengths).tolist() == [9, 14]
  assert int(np.asarray(again.page_table)[0, 2]) == int(np.asarray(table.page_table)[0, 2])
  with pytest.raises(ValueError, match="`lengths` must be \\[B=2\\]"):
    table.truncate(jnp.array([1]))
  with pytest.raises(ValueError, match="`lengths` must be >= 0"):
    table.truncate(jnp.array([-1, 0]))


def test_errors():
  with pytest.raises(ValueError, match="`num_draft_tokens` must be an int in \\[0, 64\\]"):
    Engine(model_for("llama"), num_draft_tokens=-1)
  with pytest.raises(ValueError, match="`ngram_size` must be a positive int"):
    Engine(model_for("llama"), num_draft_tokens=2, ngram_size=0)
  llama = model_for("llama")
  with pytest.raises(ValueError, match="give num_draft_tokens >= 1"):
    Engine(llama, draft=_draft())
  with pytest.raises(ValueError, match="vocab_size \\(259\\) must equal the model's \\(61\\)"):
    Engine(llama, num_draft_tokens=2, draft=_draft(vocab_size=259))
  with pytest.raises(ValueError, match="`draft` has layers of kinds \\['S'\\]"):
    Engine(llama, num_draft_tokens=2, draft=_draft(layer_pattern="S", sliding_window=4))
  with pytest.raises(ValueError, match="the model has layers of kinds \\['S'\\]"):
    Engine(model_for("mistral"), num_draft_tokens=2, draft=_draft())
  with pytest.raises(ValueError, match="`draft` must be None, 'mtp' or a DecoderLM, got int"):
    Engine(llama, num_draft_tokens=2, draft=3)
  hybrid = model_for("qwen3-next")
  with pytest.raises(ValueError, match="the model has layers of kinds \\['A', 'D'\\]"):
    Engine(hybrid, max_batch=2, num_draft_tokens=2, draft=_draft())
  with pytest.raises(ValueError, match="`rewind` needs"):
    hybrid.init_paged_cache(1, 4, 4).rewind(jnp.array([0]))
