"""The serving engine drafting with the model's own multi-token-prediction module
(``Engine(draft="mtp")``): greedy requests get exactly ``generate``'s tokens (attention with pages
on demand and preemptions, MLA, a prefix cache), and every draft the engine proposes is the
uncached module's (its first draft from the model's hidden states of the whole sequence, the
later ones chained on its own output)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxattn.generation import generate, penalized_rows
from jaxattn.nn.mtp import shift_left
from jaxattn.serving import Engine
from tests.test_serving import alone, model_for
from tests.test_serving_speculative import WORK, _draft, _pools_whole


def _reference(model, k: int, penalties=None):
  """The uncached depth-1 module's drafts, one jitted program for every length: ``ref(full
  [1, T], L, drafts [k]) -> [k]`` after the model has read ``full[:L]`` and sampled ``full[L]``:
  ``d_1`` from the pair ``(h_{L-1}, t_L)``, then ``d_{j+1}`` from the module's own output at the
  position before with ``d_j`` (``drafts[j - 1]``, the engine's, chained on).  Positions past
  ``L + j`` are ignored padding (everything is causal).  ``penalties`` (``generate``'s keywords):
  ``ref(full, L, drafts, num_prompt)``, draft ``d_{j+1}`` the argmax after the penalties of
  ``full[:L + 1]`` (its first ``num_prompt`` tokens the prompt) and ``d_1 .. d_j``."""
  graphdef, state = nnx.split(model)

  @jax.jit
  def ref(full, length, drafts, num_prompt=0):
    m = nnx.merge(graphdef, state)
    module = m.mtp[0]
    t = full.shape[1]
    h, ahead = m(full, return_hidden=True), shift_left(full, 1)
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    out = []
    for j in range(k):
      g, _, _ = module(h, m.mtp_embed(ahead), positions=pos)
      g = jax.lax.dynamic_slice_in_dim(g, length - 1 + j, 1, axis=1)
      logits = m.mtp_logits(module, g)[0]
      if penalties is not None:
        history = jnp.where(jnp.arange(t) <= length, full, -1)
        logits = penalized_rows(
            logits, history, jnp.reshape(num_prompt, (1,)),
            *(jnp.full((1,), penalties[name], jnp.float32) for name in
              ("repetition_penalty", "presence_penalty", "frequency_penalty")),
            ahead=drafts[None, :j] if j else None)
      out.append(jnp.argmax(logits[0]))
      h = jax.lax.dynamic_update_slice_in_dim(h, g.astype(h.dtype), length + j, axis=1)
      ahead = jax.lax.dynamic_update_slice_in_dim(ahead, drafts[None, j:j + 1], length + j,
                                                  axis=1)
    return jnp.stack(out)

  return ref


def _model(name, **kw):
  model = model_for(name, mtp_depth=1, **kw)
  # A random module rarely agrees with the model; one leaning to its input token does where the
  # model's greedy output repeats a token, so some drafts are kept (and the rewinds after them,
  # which decide the module's later drafts, are checked too).
  d, proj = model.config.embed_dim, model.mtp[0].proj.kernel
  proj[...] = jnp.concatenate([3.0 * jnp.eye(d, dtype=proj.dtype), proj[...][d:]], axis=0)
  return model


def _serve(engine, work, seen):
  """Runs ``work`` to the end, appending ``(request id, its sequence's length when drafted, the
  drafts)`` to ``seen`` after every step; returns the request ids and results."""
  ids = [engine.submit(p, n) for p, n in work]
  while engine.pending:
    engine.step()
    for r in engine._slots:
      if r is not None and not r.reading:
        seen.append((r.rid, r.prompt.size + len(r.out) - 1, r.drafts.copy()))
  return ids, engine.pop_results()


def _check(model, work, ids, results, seen, k, penalties=None):
  """Greedy results are ``generate``'s, and every draft proposed is the uncached module's
  (with ``penalties``, every request's, both after them)."""
  for rid, (p, n) in zip(ids, work):
    want = generate(model, p[None], n, **(penalties or {}))[0]
    np.testing.assert_array_equal(results[rid], want, err_msg=f"request {rid}")
  ref = _reference(model, k, penalties)
  prompt_size = {rid: p.size for rid, (p, _) in zip(ids, work)}
  t = model.config.max_seq_len
  for rid, length, d in seen:
    full = np.zeros((1, t), np.int32)
    full[0, :results[rid].size] = results[rid]
    want = np.asarray(ref(jnp.asarray(full), length, jnp.asarray(d),
                          *([prompt_size[rid]] if penalties else [])))
    np.testing.assert_array_equal(d, want, err_msg=f"request {rid} at length {length}")


@pytest.mark.parametrize("name,model_kw,kw", [
    ("llama", dict(), dict(allocation="on_demand", num_pages=9, max_pages_per_seq=6)),
    # an MLA block (one layer: MoE MTP blocks are the model's MoE, tested in
    # tests/nn/test_mtp.py and tests/test_speculative.py)
    ("deepseek-v3", dict(num_layers=1, first_k_dense=1), dict()),
])
def test_mtp_drafts_are_the_modules_and_greedy_requests_equal_generate(name, model_kw, kw):
  model, k = _model(name, **model_kw), 3
  engine = Engine(model, max_batch=3, page_size=4, chunk=4, num_draft_tokens=k, draft="mtp",
                  **kw)
  # A call whose rows are all mid-prompt only feeds the module (no chained drafts): the flag
  # each plain step got, and whether some row's chunk ended its prompt or was a decode step.
  flags, step = [], engine._mtp_step

  def recording(*args, draft=True, **kw):
    rows, following = np.asarray(args[3]), np.asarray(args[7])     # (padding rows: -1)
    flags.append((draft, bool(((following < 0) & (rows < engine.max_batch)).any())))
    return step(*args, draft=draft, **kw)

  engine._mtp_step = recording
  seen = []
  ids, results = _serve(engine, WORK, seen)
  _check(model, WORK, ids, results, seen, k)
  assert (False, False) in flags and (True, True) in flags
  assert all(drafted == wanted for drafted, wanted in flags)
  st = engine.stats
  assert 0 < st.accepted_drafts < st.drafted and st.generated == sum(n for _, n in WORK)
  if kw:
    assert st.preempted >= 1
  assert _pools_whole(engine)


def test_penalized_requests_draft_and_check_with_their_penalties():
  """Repetition / presence / frequency penalties (the engine's defaults) with the module
  drafting: greedy results are ``generate``'s with the penalties (which change them), and every
  draft is the uncached module's argmax after the penalties of the sequence so far and the
  drafts before it (the state the check judges it with)."""
  model, k = _model("llama"), 3
  penalties = dict(repetition_penalty=1.6, presence_penalty=3.0, frequency_penalty=0.4)
  engine = Engine(model, max_batch=3, page_size=4, chunk=4, num_draft_tokens=k, draft="mtp",
                  **penalties)
  seen = []
  ids, results = _serve(engine, WORK, seen)
  _check(model, WORK, ids, results, seen, k, penalties)
  assert any((results[rid] != alone(model, p, n)).any() for rid, (p, n) in zip(ids, WORK))
  assert len(seen) > 0


def test_mtp_drafts_over_cached_prefixes():
  """With a prefix cache the module reads its entries of the cached pages as the model does;
  the entry at a cached prefix's last position pairs it with the token that followed it in the
  request that computed it, so a request going on with another token recomputes that page.
  (A module free to attend: the copying one's drafts hardly depend on one entry.)"""
  model, k = model_for("llama", mtp_depth=1), 3
  engine = Engine(model, max_batch=2, page_size=4, chunk=4, num_draft_tokens=k, draft="mtp",
                  prefix_cache=True)
  rng = np.random.default_rng(1)
  system = rng.integers(1, 61, size=8).astype(np.int32)           # two pages
  first = [(np.concatenate([system, [5, 6, 7]]).astype(np.int32), 6)]
  later = [(np.concatenate([system, [9, 6]]).astype(np.int32), 6),    # another next token
           (np.concatenate([system, [5, 2]]).astype(np.int32), 6)]    # the same next token
  seen = []
  ids, results = _serve(engine, first, seen)
  ids2, results2 = _serve(engine, later, seen)
  _check(model, first + later, ids + ids2, {**results, **results2}, seen, k)
  # the first page only for the other next token; both pages for the same one
  assert engine.stats.prefix_hit_tokens == 4 + 8


def test_sampled_requests_draft_from_the_modules_distribution():
  """Sampled requests' drafts are sampled from the module's filtered distribution and judged
  with it: a request's tokens and log-probabilities do not depend on its neighbours or the
  schedule, top-1 sampling gives the greedy tokens, and sampled drafts get kept."""
  model, k = _model("llama"), 3
  p0, n0 = WORK[0]
  got = []
  for kw, neighbours in ((dict(max_batch=1, chunk=8), False), (dict(max_batch=3, chunk=2), True)):
    engine = Engine(model, page_size=4, num_draft_tokens=k, draft="mtp", logprobs=True, **kw)
    rid = engine.submit(p0, n0, temperature=0.9, seed=7)
    if neighbours:
      top1 = engine.submit(WORK[1][0], WORK[1][1], temperature=1.0, top_k=1)
      greedy = engine.submit(*WORK[2])
    while engine.pending:
      engine.step()
      for slot, r in enumerate(engine._slots):   # the distribution each draft was drawn from
        if r is not None and not r.reading and r.temperature > 0:
          q = np.asarray(engine.mtp_probs[slot])
          np.testing.assert_allclose(q.sum(-1), 1.0, rtol=1e-5)
          assert (q[np.arange(k), r.drafts] > 0).all()
    res = engine.pop_results()
    got.append(res[rid])
    assert engine.stats.accepted_drafts > 0
  np.testing.assert_array_equal(got[0][0], got[1][0])
  np.testing.assert_allclose(got[0][1], got[1][1], rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(res[top1][0], alone(model, *WORK[1]))
  np.testing.assert_array_equal(res[greedy][0], alone(model, *WORK[2]))


def test_a_cache_budget_counts_the_mtp_block_and_a_draft_model():
  """``cache_bytes`` sizes the pages so that the model's cache and the MTP block's pool with its
  sampled drafts' distributions (or a draft model's cache) fit together; one page more would
  not."""
  model, budget = _model("llama"), 40_000
  probs = 2 * 5 * model.config.vocab_size * 4     # mtp_probs: [max_batch, k, V] fp32
  for draft in ("mtp", _draft()):
    engine = Engine(model, max_batch=2, page_size=4, num_draft_tokens=5, draft=draft,
                    cache_bytes=budget)
    extra = engine.mtp_cache if draft == "mtp" else engine.draft_cache
    fixed = probs if draft == "mtp" else 0
    assert engine.cache.nbytes + extra.nbytes + fixed <= budget
    p = engine.num_pages + 1
    bigger = model.init_paged_cache(2, p, 4, max_pages_per_seq=engine.max_pages_per_seq)
    if draft == "mtp":     # its pool: the model's pages and a spare page a slot (4 drafts ahead)
      assert extra.groups[0][0].table.num_pages == engine.num_pages + 2
      more = model.init_mtp_paged_cache(2, p + 2, 4, max_pages_per_seq=engine.max_pages_per_seq)
    else:
      more = draft.init_paged_cache(2, p, 4, max_pages_per_seq=engine.max_pages_per_seq)
    assert bigger.nbytes + more.nbytes + fixed > budget
    if draft == "mtp":   # the distributions it counted are the ones a sampled request makes
      engine.submit([1, 2, 3], 3, temperature=1.0)
      engine.run()
      assert engine.mtp_probs.nbytes == probs
    alone_ = Engine(model, max_batch=2, page_size=4, cache_bytes=budget)
    assert alone_.num_pages > engine.num_pages


def test_errors():
  llama = model_for("llama")
  with pytest.raises(ValueError, match="this model has none \\(mtp_depth=0\\)"):
    Engine(llama, num_draft_tokens=2, draft="mtp")
  mtp = model_for("llama", mtp_depth=1)
  with pytest.raises(ValueError, match="give num_draft_tokens >= 1"):
    Engine(mtp, draft="mtp")
  with pytest.raises(ValueError, match="shares the page table of a model layer that does; "
                     "this model has none \\(layer kinds \\['D'\\]\\)"):
    Engine(model_for("qwen3-next", layer_pattern="D", mtp_depth=1), num_draft_tokens=2,
           draft="mtp")
  with pytest.raises(ValueError, match="`draft` must be None \\(prompt lookup\\), 'mtp'"):
    Engine(mtp, num_draft_tokens=2, draft="ngram")
  with pytest.raises(ValueError, match="init_mtp_paged_cache: this model has no"):
    llama.init_mtp_paged_cache(1, 4, 4)
