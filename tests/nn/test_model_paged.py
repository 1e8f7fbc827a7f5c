"""``DecoderLM`` serving from a paged cache (``init_paged_cache``): ragged chunks through the whole
model (``num_tokens``: one sequence prefills a chunk while another decodes and a third waits) give
each sequence the logits of the full forward over that sequence alone; a finished sequence's slot,
freed (``cache.free``), serves a new sequence as a fresh cache would; scanned stacks, MLA, DSA,
MoE, Gated DeltaNet layers (hybrid), learned positions, mHC streams, sliding windows (and their
pages released), ALiBi, T5 bias, hybrid prefixes from saved states; the errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxattn.configs import get_config
from jaxattn.nn.model import DecoderLM, PagedModelCache
from jaxattn.paged_cache import PagedKVCache

SMALL = dict(embed_dim=32, mlp_dim=64, max_seq_len=64, vocab_size=97)
MLA_DIMS = dict(kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4,
                v_head_dim=8, index_head_dim=8, index_rope_dim=4, index_topk=3)
DELTANET = dict(deltanet_head_dim=8, deltanet_v_head_dim=8, deltanet_chunk_size=4, rotary_dim=4)
SCHEDULE = np.array([[3, 1, 0], [1, 3, 0], [0, 2, 3], [2, 0, 3]])      # [steps, B] chunks
T = 3
CASES = {
    "llama-scanned": ("llama", dict(num_layers=2, scan_layers=True)),
    "llama-learned-mhc": ("llama-learned", dict(num_layers=2, residual="mhc", num_streams=2)),
    "deepseek-v3-moe": ("deepseek-v3", dict(num_layers=2, first_k_dense=1, moe_expert_dim=16,
                                            **MLA_DIMS)),
    "deepseek-v3.2-dsa": ("deepseek-v3.2", dict(num_layers=2, first_k_dense=1, moe_expert_dim=16,
                                                **MLA_DIMS)),
    # Units of one Gated DeltaNet and one attention layer (the preset's "DDDA" compiles three
    # DeltaNet layers per unit for the same paths); scanned: two units.
    "qwen3-next-hybrid": ("qwen3-next", dict(num_layers=2, layer_pattern="DA", first_k_dense=2,
                                             **DELTANET)),
    "qwen3-next-scanned": ("qwen3-next", dict(num_layers=4, layer_pattern="DA", first_k_dense=0,
                                              scan_layers=True, moe_expert_dim=16, **DELTANET)),
    # A window of 3 over pages of 2: whole pages fall out of it.
    "mistral-window": ("mistral", dict(num_layers=2, sliding_window=3)),
    "llama-alibi": ("llama-alibi", dict(num_layers=2)),
    "llama-t5": ("llama-t5", dict(num_layers=2)),
}


def model_for(case):
  name, kw = CASES[case]
  return DecoderLM(get_config(name, **SMALL).replace(**kw), rngs=nnx.Rngs(0))


@nnx.jit
def _step(model, tokens, num_tokens, cache):
  return model(tokens, cache=cache, num_tokens=num_tokens)


_full = nnx.jit(lambda model, tokens: model(tokens))


def run_schedule(model, seqs, cache, schedule, release=False):
  """Feeds ``schedule``'s chunks of ``seqs [B, S]``; returns each sequence's logits in order.
  ``release``: the pages behind the sliding-window layers' windows go back to their pools after
  each step."""
  rng = np.random.default_rng(3)
  b = seqs.shape[0]
  done = np.zeros(b, int)
  outs = [[] for _ in range(b)]
  for nt in schedule:
    tokens = rng.integers(0, 97, size=(b, T)).astype(np.int32)      # padding: any tokens
    for i, n in enumerate(nt):
      tokens[i, :n] = seqs[i, done[i]:done[i] + n]
    logits, cache = _step(model, jnp.asarray(tokens), jnp.asarray(nt, jnp.int32), cache)
    if release:
      cache = cache.release_behind()
    for i, n in enumerate(nt):
      outs[i].append(np.asarray(logits[i, :n]))
    done += nt
  return [np.concatenate(o) for o in outs], cache


@pytest.mark.parametrize("case", list(CASES))
def test_ragged_chunks_equal_each_sequence_alone(case):
  model = model_for(case)
  seqs = np.random.default_rng(1).integers(1, 97, size=(3, SCHEDULE.sum(0).max()), dtype=np.int32)
  cache = model.init_paged_cache(3, num_pages=12, page_size=2, max_pages_per_seq=4)
  outs, cache = run_schedule(model, seqs, cache, SCHEDULE)
  full = np.asarray(_full(model, jnp.asarray(seqs)))
  for i in range(3):
    np.testing.assert_allclose(outs[i], full[i], rtol=2e-4, atol=2e-4, err_msg=f"row {i}")
  np.testing.assert_array_equal(cache.lengths, SCHEDULE.sum(0))


def test_pages_behind_the_window_go_back_to_the_pool():
  """mistral, window 3 over pages of 2: 12 tokens per sequence in ragged chunks of up to 3, the
  pages behind each window released after every step.  Three sequences run on 12 pages (18
  without the release) with the full forward's logits; at the end each holds only pages
  ``(12 - 3) // 2 = 4`` and on, the rest back in the pool."""
  model = model_for("mistral-window")
  seqs = np.random.default_rng(4).integers(1, 97, size=(3, 12), dtype=np.int32)
  cache = model.init_paged_cache(3, num_pages=12, page_size=2, max_pages_per_seq=6)
  outs, cache = run_schedule(model, seqs, cache, np.concatenate([SCHEDULE, SCHEDULE]), release=True)
  full = np.asarray(_full(model, jnp.asarray(seqs)))
  for i in range(3):
    np.testing.assert_allclose(outs[i], full[i], rtol=2e-4, atol=2e-4, err_msg=f"row {i}")
  for layer in cache.groups[0]:
    table = np.asarray(layer.table.page_table)
    assert (table[:, :4] == -1).all() and (table[:, 4:] >= 0).all()
    assert int(layer.table.num_free) == 12 - 3 * 2
  cache = cache.free(jnp.ones((3,), bool))
  assert all(int(layer.table.num_free) == 12 for layer in cache.groups[0])


@pytest.mark.parametrize("scan", [False, True])
def test_local_global_layers_release_only_the_window_layers_pages(scan):
  """Sliding-window layers interleaved with full-attention ones (Gemma-2 / 3 style, "SA"; scanned:
  the unit "SA" stacked twice) over pools of two sizes: the window layers' 12 pages
  (``window_num_pages``), the full layers' 18.  ``release_behind`` frees only the window layers'
  dead pages; the full layers keep every page; logits are the full forward's."""
  model = DecoderLM(get_config("llama", **SMALL).replace(
      num_layers=4, layer_pattern="SA", sliding_window=3, scan_layers=scan), rngs=nnx.Rngs(0))
  seqs = np.random.default_rng(4).integers(1, 97, size=(3, 12), dtype=np.int32)
  cache = model.init_paged_cache(3, num_pages=18, page_size=2, max_pages_per_seq=6,
                                 window_num_pages=12)
  assert cache.windows == ((3, None) if scan else (3, None, 3, None))
  outs, cache = run_schedule(model, seqs, cache, np.concatenate([SCHEDULE, SCHEDULE]), release=True)
  full = np.asarray(_full(model, jnp.asarray(seqs)))
  for i in range(3):
    np.testing.assert_allclose(outs[i], full[i], rtol=2e-4, atol=2e-4, err_msg=f"row {i}")
  layers = [c for group in cache.groups for c in group]
  assert len(layers) == (2 if scan else 4)
  for layer in layers:
    table, free = np.asarray(layer.table.page_table), np.asarray(layer.table.num_free)
    if layer.window is None:
      assert layer.key_pool.shape[-3] == 18 and (table >= 0).all() and (free == 0).all()
    else:
      assert layer.key_pool.shape[-3] == 12
      assert (table[..., :4] == -1).all() and (table[..., 4:] >= 0).all() and (free == 6).all()
  # The page table the engine reads for prefix caching is a full layer's.
  np.testing.assert_array_equal(np.asarray(cache.page_table),
                                np.asarray(layers[1].table.page_table[0] if scan
                                           else layers[1].table.page_table))
  with pytest.raises(ValueError, match="window_num_pages"):
    model.init_paged_cache(3, num_pages=18, page_size=2, window_num_pages=0)


@pytest.mark.parametrize("case", ["llama-scanned", "qwen3-next-scanned"])
def test_a_freed_slot_serves_a_new_sequence(case):
  """The freed row's pages go back to the pool (all 9 were in use) and its recurrent states
  (Gated DeltaNet, stacked by the scan) are emptied: the new sequence there sees none of the
  old one."""
  model = model_for(case)
  rng = np.random.default_rng(2)
  seqs = rng.integers(1, 97, size=(3, 6), dtype=np.int32)
  cache = model.init_paged_cache(3, num_pages=9, page_size=2, max_pages_per_seq=4)
  _, cache = run_schedule(model, seqs, cache, SCHEDULE)          # 3 x 6 tokens: all 9 pages
  paged = [c for c in jax.tree_util.tree_leaves(
      cache.groups, is_leaf=lambda c: isinstance(c, PagedKVCache)) if isinstance(c, PagedKVCache)]
  assert paged and all((np.asarray(c.table.num_free) == 0).all() for c in paged)
  cache = cache.free(jnp.asarray([False, True, False]))
  np.testing.assert_array_equal(cache.lengths, [6, 0, 6])
  new = rng.integers(1, 97, size=(3, 5), dtype=np.int32)
  outs, cache = run_schedule(model, new, cache, np.array([[0, 3, 0], [0, 2, 0]]))
  np.testing.assert_allclose(outs[1], np.asarray(_full(model, jnp.asarray(new[1:2])))[0],
                             rtol=2e-4, atol=2e-4)
  np.testing.assert_array_equal(cache.lengths, [6, 5, 6])


def test_pages_reserved_ahead_are_the_ones_the_next_call_writes():
  """``reserve_ahead`` allocates every layer's pages for the next tokens (scanned layers: each
  layer's stacked table alike) without changing the lengths; the call that then feeds those
  tokens writes into them (no page popped) and gives the logits it gives without the
  reservation."""
  model = model_for("llama-scanned")
  seqs = np.random.default_rng(4).integers(1, 97, size=(3, 6), dtype=np.int32)
  cache = model.init_paged_cache(3, num_pages=12, page_size=2, max_pages_per_seq=4)
  _, cache = run_schedule(model, seqs, cache, SCHEDULE[:2])          # lengths 4, 4, 0
  tables = lambda c: [x.table for x in jax.tree_util.tree_leaves(  # noqa: E731
      c.groups, is_leaf=lambda x: isinstance(x, PagedKVCache)) if isinstance(x, PagedKVCache)]
  counts = jnp.asarray([1, 3, 2], jnp.int32)     # pages: 1 (pos 4), 2 (pos 4-6), 1 (pos 0-1)
  ahead = cache.reserve_ahead(counts, T)
  np.testing.assert_array_equal(ahead.lengths, cache.lengths)
  for before, after in zip(tables(cache), tables(ahead)):
    np.testing.assert_array_equal(after.lengths, before.lengths)
    np.testing.assert_array_equal(np.asarray(after.num_free), np.asarray(before.num_free) - 4)
  tokens = jnp.asarray(np.random.default_rng(5).integers(1, 97, size=(3, T)), jnp.int32)
  want, plain = _step(model, tokens, counts, cache)
  got, written = _step(model, tokens, counts, ahead)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
  for a, b in zip(tables(written), tables(ahead)):
    np.testing.assert_array_equal(np.asarray(a.page_table), np.asarray(b.page_table))
    np.testing.assert_array_equal(np.asarray(a.num_free), np.asarray(b.num_free))
  for a, b in zip(tables(written), tables(plain)):
    np.testing.assert_array_equal(np.asarray(a.page_table), np.asarray(b.page_table))


def test_padding_rows_stay_inside_a_learned_position_table():
  """A ragged chunk near the end of a learned table: the padding rows' default positions would
  run past it (the eager table check raised on a valid call); they reuse the last real one."""
  name, kw = CASES["llama-learned-mhc"]
  model = DecoderLM(get_config(name, **dict(SMALL, max_seq_len=8)).replace(**kw),
                    rngs=nnx.Rngs(0))
  seq = np.random.default_rng(4).integers(1, 97, size=(1, 7), dtype=np.int32)
  cache = model.init_paged_cache(1, num_pages=4, page_size=2)
  _, cache = model(jnp.asarray(seq[:, :6]), cache=cache)
  tokens = jnp.asarray(np.concatenate([seq[:, 6:], np.zeros((1, 2), np.int32)], 1))
  logits, cache = model(tokens, cache=cache, num_tokens=jnp.asarray([1]))      # eager
  np.testing.assert_allclose(logits[0, 0], _full(model, jnp.asarray(seq))[0, 6], rtol=2e-4,
                             atol=2e-4)
  assert int(cache.lengths[0]) == 7


def test_paged_model_cache_is_a_pytree_with_static_layout():
  model = model_for("llama-scanned")
  cache = model.init_paged_cache(2, num_pages=4, page_size=2)
  leaves, treedef = jax.tree_util.tree_flatten(cache)
  again = jax.tree_util.tree_unflatten(treedef, leaves)
  assert isinstance(again, PagedModelCache) and again.stacked == (True,)
  assert cache.groups[0][0].key_pool.shape[0] == 2                  # stacked: [layers, P, ...]


def test_errors():
  model = model_for("llama-scanned")
  tokens = jnp.ones((2, T), jnp.int32)
  cache = model.init_paged_cache(2, num_pages=4, page_size=2)
  with pytest.raises(ValueError, match=r"`num_tokens` \(a ragged chunk\) needs a PagedModelCache"):
    model(tokens, num_tokens=jnp.asarray([1, 2]))
  with pytest.raises(ValueError, match=r"`num_tokens` \(a ragged chunk\) needs a PagedModelCache"):
    model(tokens, cache=model.init_cache(2, 8), num_tokens=jnp.asarray([1, 2]))
  with pytest.raises(ValueError, match=r"`num_tokens` must lie in \[0, T=3\]"):
    model(tokens, cache=cache, num_tokens=jnp.asarray([1, 5]))
  with pytest.raises(ValueError, match="holds 2 sequence slots, `tokens` has B=3"):
    model(jnp.ones((3, T), jnp.int32), cache=cache)
  with pytest.raises(ValueError, match="`return_aux`"):
    model(tokens, cache=cache, return_aux=True)
  with pytest.raises(ValueError, match=r"`done` must be a bool array \[B=2\]"):
    cache.free(jnp.asarray([1, 0]))


@pytest.mark.parametrize("case", ["llama-scanned", "qwen3-next-hybrid"])
def test_a_sub_batch_of_slots_equals_the_full_batch_call(case):
  """``take(rows)`` / ``put(rows, sub)``: a call on some slots (padded with an out-of-range
  entry that feeds nothing) leaves the same cache and logits as the full-batch call with the
  other slots idle; pools and free stacks are shared."""
  model = model_for(case)
  rng = np.random.default_rng(5)
  cache = model.init_paged_cache(3, num_pages=12, page_size=2, max_pages_per_seq=4)
  warm = jnp.asarray(rng.integers(1, 97, size=(3, T), dtype=np.int32))
  _, cache = _step(model, warm, jnp.asarray([3, 1, 2], jnp.int32), cache)
  tokens = rng.integers(1, 97, size=(3, T)).astype(np.int32)
  full_logits, full = _step(model, jnp.asarray(tokens), jnp.asarray([0, 3, 2], jnp.int32), cache)
  # Slots 1 and 2 in ascending order (pages are then allocated in the full call's order: equal
  # pools), and two padding entries.
  rows = jnp.asarray([1, 2, 3, -1], jnp.int32)          # (a -1 is padding too)
  sub_tokens = jnp.asarray(np.stack([tokens[1], tokens[2], tokens[0], tokens[0]]))
  logits, sub = _step(model, sub_tokens, jnp.asarray([3, 2, 0, 0], jnp.int32), cache.take(rows))
  merged = cache.put(rows, sub)
  np.testing.assert_allclose(logits[0], full_logits[1], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(logits[1, :2], full_logits[2, :2], rtol=1e-5, atol=1e-5)
  for a, b in zip(jax.tree_util.tree_leaves(merged), jax.tree_util.tree_leaves(full)):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("case", ["qwen3-next-scanned"])
def test_attach_with_saved_states_continues_a_hybrid_prefix(case):
  """Prefix sharing on a model with Gated DeltaNet layers: slot 0 reads 6 tokens (3 pages of
  2); its recurrent states are saved (``save_states``: a stacked group's on its layer axis) and
  slot 1 starts from its pages and those states (``attach``), then reads 3 more tokens: its
  logits are the full forward's over the 9 tokens.  A zero store (no state) does not give them."""
  model = model_for(case)
  seq = np.random.default_rng(7).integers(1, 97, size=(1, 9)).astype(np.int32)
  cache = model.init_paged_cache(2, num_pages=12, page_size=2, max_pages_per_seq=6)
  for lo in (0, 3):
    tokens = np.zeros((2, T), np.int32)
    tokens[0] = seq[0, lo:lo + 3]
    _, cache = _step(model, jnp.asarray(tokens), jnp.asarray([3, 0], jnp.int32), cache)
  empty = cache.state_store(3)
  store = cache.save_states(empty, jnp.asarray([0, 2]), jnp.asarray([1, -1]))  # 2nd: padding
  pages = jnp.where(jnp.arange(6) < 3, cache.page_table[0], -1)[None]
  full = np.asarray(_full(model, jnp.asarray(seq)))[0, 6:]
  tokens = np.zeros((2, T), np.int32)
  tokens[1] = seq[0, 6:]
  errors = []
  for kept in (store, empty):
    shared = cache.attach(jnp.asarray([1]), pages, jnp.asarray([6]), kept, jnp.asarray([1]))
    logits, _ = _step(model, jnp.asarray(tokens), jnp.asarray([0, 3], jnp.int32), shared)
    errors.append(float(np.max(np.abs(np.asarray(logits)[1] - full))))
  assert errors[0] < 1e-4 and errors[1] > 1e-2, errors
