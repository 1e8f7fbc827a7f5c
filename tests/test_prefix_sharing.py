"""Prefix sharing: ``PageTable.attach`` / ``free(keep=...)`` / ``push`` (a sequence reads another's
full pages without copying them; shared pages outlive a finished sequence) and the serving engine's
prefix cache built on them (``Engine(prefix_cache=True)``): with greedy decoding every request
still gets exactly what ``generate`` gives it alone, while the cached prefix is not computed again
-- a shared system prompt, a later turn of a conversation (generated tokens cached too), the same
prompts again -- and under a pool too small to keep everything (idle cached pages evicted); the
page accounting adds up; the errors."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.paged_cache import PagedKVCache, PageTable
from jaxattn.serving import Engine
from tests.test_serving import alone, model_for


def test_attach_shares_pages_and_keep_holds_them_past_free():
  table = PageTable.init(3, 8, 4, max_pages_per_seq=4)
  table, _, _ = table.reserve(10, jnp.array([10, 0, 0]))
  owner = np.asarray(table.page_table[0])
  assert (owner[:3] >= 0).all() and int(table.num_free) == 5
  table = table.attach(jnp.array([1, 3]), jnp.array([[owner[0], owner[1], -1, -1]] * 2),
                       jnp.array([8, 8]))                     # row 3: padding, dropped
  np.testing.assert_array_equal(table.page_table[1], [owner[0], owner[1], -1, -1])
  assert int(table.lengths[1]) == 8 and int(table.num_free) == 5      # nothing popped
  # The attached row continues on a page of its own, at position 8.
  table, page, offset = table.reserve(3, jnp.array([0, 3, 0]))
  own = int(table.page_table[1, 2])
  assert own not in owner[:3] and int(table.num_free) == 4
  np.testing.assert_array_equal(page[1], [own] * 3)
  np.testing.assert_array_equal(offset[1], [0, 1, 2])
  keep = np.zeros(8, bool)
  keep[owner[:2]] = True
  table = table.free(jnp.array([True, False, False]), jnp.asarray(keep))
  assert int(table.num_free) == 5                    # the owner's third page only
  np.testing.assert_array_equal(table.page_table[1, :3], [owner[0], owner[1], own])
  table = table.free(jnp.array([False, True, False]), jnp.asarray(keep))
  assert int(table.num_free) == 6
  table = table.push(jnp.array([-1, owner[0], owner[1]]))
  assert int(table.num_free) == 8
  assert sorted(np.asarray(table.free_pages).tolist()) == list(range(8))
  assert (np.asarray(table.lengths) == 0).all()


def test_an_attached_row_reads_the_owners_tokens():
  rng = np.random.default_rng(0)
  cache = PagedKVCache.init(2, 6, 4, num_kv_heads=2, head_dim=3)
  k, v = (jnp.asarray(rng.normal(size=(2, 9, 2, 3)), jnp.float32) for _ in range(2))
  cache = cache.append(k, v, num_tokens=jnp.array([9, 0]))
  pages = cache.page_table[0]
  table = cache.table.attach(jnp.array([1]), jnp.where(jnp.arange(pages.size) < 2, pages, -1)[None],
                             jnp.array([8]))
  cache = PagedKVCache(cache.key_pool, cache.value_pool, table, cache.num_kv_heads)
  cache = cache.append(k[::-1], v[::-1], num_tokens=jnp.array([0, 2]))
  key, value = cache.gather()
  np.testing.assert_array_equal(key[1, :8], key[0, :8])
  np.testing.assert_array_equal(value[1, :8], value[0, :8])
  np.testing.assert_array_equal(key[1, 8:10], k[0, :2])             # its own tokens after them
  np.testing.assert_array_equal(key[0, :9], k[0])                   # the owner's untouched


def test_page_table_errors():
  table = PageTable.init(2, 4, 4, max_pages_per_seq=2)
  with pytest.raises(ValueError, match="page_table"):
    table.attach(jnp.array([0]), jnp.array([[4, -1]]), jnp.array([4]))
  with pytest.raises(ValueError, match="lengths"):
    table.attach(jnp.array([0]), jnp.array([[0, -1]]), jnp.array([5]))
  with pytest.raises(ValueError, match="must agree"):
    table.attach(jnp.array([0, 1]), jnp.array([[0, -1]]), jnp.array([4]))
  with pytest.raises(ValueError, match="rows"):
    table.attach(jnp.array([0.0]), jnp.array([[0, -1]]), jnp.array([4]))
  with pytest.raises(ValueError, match="not already free"):
    table.push(jnp.array([0]))                         # every page is free
  with pytest.raises(ValueError, match="keep"):
    table.free(jnp.array([True, False]), jnp.zeros((3,), bool))


def _system_requests(seed=0):
  rng = np.random.default_rng(seed)
  system = rng.integers(1, 61, size=13).astype(np.int32)        # 3 full pages of 4 and one token
  return [np.concatenate([system, rng.integers(1, 61, size=k).astype(np.int32)])
          for k in (3, 1, 6, 2, 5)]


def _check_pool(engine):
  """No request running: every page is free or cached, and the device agrees."""
  table = next(c.table for group in engine.cache.groups for c in group if hasattr(c, "table"))
  num_free = np.asarray(table.num_free).reshape(-1)
  assert (num_free == engine._free_pages).all()
  assert engine._free_pages + engine.cached_pages == engine.num_pages


@pytest.mark.parametrize("name", ["llama", "deepseek-v3", "qwen3-next"])
def test_prefix_cache_gives_the_same_tokens_without_computing_the_prefix(name):
  # The reference: the engine without a prefix cache, which gives each request what ``generate``
  # gives it alone (tests/test_serving.py), and shares the compiled step programs.
  model = model_for(name)
  prompts = _system_requests()
  runs = {}
  for cached in (False, True):
    engine = Engine(model, max_batch=2, page_size=4, chunk=4, prefix_cache=cached)
    first = [engine.submit(p, 5) for p in prompts]
    results = engine.run()
    again = [engine.submit(p, 3) for p in prompts[:2]]          # the same prompts later
    results.update(engine.run())
    runs[cached] = engine, [results[i] for i in first + again]
  (plain, want), (shared, got) = runs[False], runs[True]
  for i, (g, w) in enumerate(zip(got, want)):
    np.testing.assert_array_equal(g, w, err_msg=f"request {i}")
  np.testing.assert_array_equal(want[-1], alone(model, prompts[1], 3))
  # The first request computes the system prompt's 3 pages; the second, arriving with it, waits
  # for them (a free slot sits out a few steps) and the other three find them; the repeated
  # prompts (16 and 14 tokens) their own (L - 1) // 4 pages.
  plain, shared = plain.stats, shared.stats
  assert plain.prefix_hit_tokens == 0 and plain.prefix_waits == 0
  assert shared.prefix_hit_tokens == 4 * 12 + 12 + 12 and shared.prefix_waits > 0
  assert shared.fed_tokens == plain.fed_tokens - shared.prefix_hit_tokens
  assert shared.generated == plain.generated
  # qwen3-next (Gated DeltaNet layers): chunks of one page, so its states are saved at every
  # cached page's end and a request restores them with the pages.
  assert (shared.saved_states > 0) == (name == "qwen3-next")
  _check_pool(runs[True][0])


def test_state_snapshots_are_replaced_least_recently_used_first():
  from jaxattn.serving import _StateSnapshots  # noqa: PLC0415

  snaps = _StateSnapshots(2)
  assert snaps.take(b"a", set()) == 0 and snaps.take(b"b", set()) == 1
  assert snaps.use(b"a") == 0                       # a: most recently used now
  assert snaps.take(b"c", set()) == 1 and b"b" not in snaps and b"a" in snaps
  assert snaps.take(b"d", {0, 1}) is None           # both ids written by this call: none free
  snaps.drop(b"a")
  assert b"a" not in snaps and snaps.take(b"e", set()) == 0


@pytest.mark.parametrize("chunk,states", [(8, None)])
def test_hybrid_prefix_cache_restarts_from_saved_states(chunk, states):
  """A model with recurrent layers can share a prefix only up to a point where their states
  were saved: the end of a prefill chunk on a page boundary.  Chunks of 8 over pages of 4 save
  them every 8 tokens, so the 13-token system prompt's 12 cacheable tokens are shared up to 8.
  Results are those of the engine without a prefix cache."""
  model = model_for("qwen3-next")
  prompts = _system_requests()
  runs = {}
  for cached in (False, True):
    engine = Engine(model, max_batch=2, page_size=4, chunk=chunk, prefix_cache=cached,
                    prefix_states=states if cached else None)
    ids = [engine.submit(p, 4) for p in prompts]
    results = engine.run()
    runs[cached] = engine, [results[i] for i in ids]
  for i, (got, want) in enumerate(zip(runs[True][1], runs[False][1])):
    np.testing.assert_array_equal(got, want, err_msg=f"request {i}")
  st = runs[True][0].stats
  assert st.prefix_hit_tokens > 0 and st.saved_states > 0
  if chunk == 8:
    assert st.prefix_hit_tokens == 4 * 8                  # every later request: 8 tokens
  assert st.fed_tokens == runs[False][0].stats.fed_tokens - st.prefix_hit_tokens
  engine = runs[True][0]
  assert len(engine._snapshots.id_of) <= engine._snapshots.count
  _check_pool(engine)


@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_samples_of_one_prompt_compute_it_once(policy):
  """Many samples of one prompt submitted together (best-of-n, a group of RL rollouts): the first
  computes the prompt, the others wait for its pages and read them.  (The static policy admits a
  whole batch at once and does not wait: only the request after that batch reads them.)"""
  model = model_for("llama")
  prompt = _system_requests(2)[0][:13]                   # (13 - 1) // 4 = 3 pages to share
  runs = {}
  for cached in (False, True):
    engine = Engine(model, max_batch=4, page_size=4, chunk=4, prefix_cache=cached, policy=policy)
    ids = [engine.submit(prompt, 4) for _ in range(5)]
    results = engine.run()
    runs[cached] = engine, [results[i] for i in ids]
  (plain, want), (shared, got) = runs[False], runs[True]
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)
  np.testing.assert_array_equal(want[0], alone(model, prompt, 4))
  hits = shared.stats.prefix_hit_tokens
  if policy == "continuous":
    assert hits == 4 * 12 and shared.stats.prefix_waits > 0
  else:
    assert hits == 12 and shared.stats.prefix_waits == 0
  assert shared.stats.fed_tokens == plain.stats.fed_tokens - hits
  _check_pool(shared)


def test_calls_read_only_the_page_table_columns_they_need():
  """Pages of one token: a table of 64 columns (max_seq_len).  Each call narrows the tables to
  the power of two (>= 16) holding its sequences' pages -- here 16 or 32, never 64 -- with the
  prefix cache attaching pages, and every request still gets what ``generate`` gives it alone."""
  model = model_for("llama")
  engine = Engine(model, max_batch=2, page_size=1, chunk=4, prefix_cache=True)
  assert engine.max_pages_per_seq == 64
  prompts = _system_requests(4)                              # 14 to 19 tokens
  ids = [engine.submit(p, 6) for p in prompts]
  results = engine.run()
  for rid, p in zip(ids, prompts):
    np.testing.assert_array_equal(results[rid], alone(model, p, 6), err_msg=f"request {rid}")
  st = engine.stats
  assert st.prefix_hit_tokens > 0
  assert 16 * st.calls <= st.table_columns <= 2 * 32 * st.calls     # b <= 2 rows x W <= 32
  _check_pool(engine)


def test_a_later_turn_reads_the_generated_tokens_from_the_cache():
  model = model_for("llama")
  engine = Engine(model, max_batch=2, page_size=4, chunk=4, prefix_cache=True)
  prompt = _system_requests(1)[0]                                  # 16 tokens
  rid = engine.submit(prompt, 7)
  turn1 = engine.run()[rid]                                        # 23 tokens, 22 of them cached
  follow = np.concatenate([turn1, np.array([5, 9, 33], np.int32)])
  hits = engine.stats.prefix_hit_tokens
  rid = engine.submit(follow, 4)
  np.testing.assert_array_equal(engine.run()[rid], alone(model, follow, 4))
  assert engine.stats.prefix_hit_tokens - hits == 20                     # 22 // 4 = 5 pages
  _check_pool(engine)


def test_idle_pages_are_evicted_when_the_pool_runs_short():
  model = model_for("llama")
  # 12 pages: two requests of up to 5 pages each run together; what they leave cached must make
  # way for the next ones.
  rng = np.random.default_rng(3)
  prompts = [rng.integers(1, 61, size=n).astype(np.int32) for n in (14, 13, 15, 12, 14, 9)]
  prompts[4][:8] = prompts[0][:8]                       # shares two pages with the first request
  runs = []
  for cached in (False, True):
    engine = Engine(model, max_batch=2, page_size=4, chunk=4, num_pages=12,
                    max_pages_per_seq=6, prefix_cache=cached)
    ids = [engine.submit(p, 5) for p in prompts]
    results = engine.run()
    runs.append([results[i] for i in ids])
  for i, (got, want) in enumerate(zip(*runs[::-1])):
    np.testing.assert_array_equal(got, want, err_msg=f"request {i}")
  np.testing.assert_array_equal(runs[1][4], alone(model, prompts[4], 5))
  st = engine.stats
  assert st.evicted_pages > 0 and st.finished == len(prompts)
  _check_pool(engine)
  cached = engine.cached_pages
  assert cached > 0 and engine.clear_prefix_cache() == cached
  assert engine.cached_pages == 0 and engine._free_pages == engine.num_pages
  _check_pool(engine)


def test_prefix_cache_errors():
  hybrid = model_for("qwen3-next")
  with pytest.raises(ValueError, match="`prefix_states` must be a positive int"):
    Engine(hybrid, max_batch=2, page_size=4, prefix_cache=True, prefix_states=0)
  recurrent_only = model_for("qwen3-next", layer_pattern="D")  # no paged layer
  with pytest.raises(ValueError, match="no paged layer"):
    Engine(recurrent_only, max_batch=2, page_size=4, prefix_cache=True)
  cache = hybrid.init_paged_cache(2, num_pages=4, page_size=4)
  with pytest.raises(ValueError, match="needs their states after the shared tokens"):
    cache.attach(jnp.array([1]), jnp.array([[0, -1, -1, -1]]), jnp.array([4]))
  with pytest.raises(ValueError, match="prefix_cache"):
    Engine(model_for("llama"), max_batch=2, page_size=4, prefix_cache="yes")
  engine = Engine(model_for("llama"), max_batch=2, page_size=4)
  assert engine.cached_pages == 0 and engine.clear_prefix_cache() == 0
