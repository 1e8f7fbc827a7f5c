"""Speculative decoding: greedy output equals ``generate``'s for every draft and cache; speculative
sampling emits tokens distributed as the model's own sampling; prompt lookup finds its n-grams."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxattn.configs import get_config
from jaxattn.generation import filtered_logits, generate, token_key
from jaxattn.nn.model import DecoderLM
from jaxattn.speculative import (ngram_propose, rewind_cache, speculative_accept,
                                 speculative_functions, speculative_generate)

SMALL = dict(embed_dim=32, mlp_dim=64)
PROMPT = np.array([[1, 40, 50, 60, 40, 50], [1, 70, 80, 90, 70, 80]], np.int32)


@pytest.fixture(scope="module")
def llama():
  return DecoderLM(get_config("llama", num_layers=2, **SMALL), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def small_draft():
  return DecoderLM(get_config("llama", num_layers=1, **SMALL), rngs=nnx.Rngs(5))


@pytest.mark.parametrize("which", ["ngram", "itself", "small"])
def test_greedy_output_is_generates_for_every_draft(llama, small_draft, which):
  """Token for token, streamed in order; the model as its own draft keeps every draft (k + 1
  tokens per call), an unrelated draft almost none (one token per call, still exact)."""
  draft = {"ngram": "ngram", "itself": llama, "small": small_draft}[which]
  want = generate(llama, PROMPT, 20)
  streamed = []
  out, stats = speculative_generate(llama, PROMPT, 20, draft=draft, num_draft_tokens=4,
                                    on_token=lambda ids: streamed.append(ids.copy()))
  np.testing.assert_array_equal(out, want)
  np.testing.assert_array_equal(np.stack(streamed, 1), out[:, PROMPT.shape[1]:])
  assert stats.emitted == 19 and stats.drafted == 4 * stats.rounds
  if which == "itself":
    assert stats.accepted == stats.drafted and stats.rounds == 4    # 1 + 4 * 5 > 20
  assert stats.emitted <= stats.rounds * 5
  assert stats.tokens_per_call == pytest.approx(stats.emitted / stats.rounds)
  np.testing.assert_array_equal(generate(llama, PROMPT, 20, draft=draft), want)


def test_eos_and_quantized_cache(llama, small_draft):
  """A row that emits ``eos_id`` pads with it and stops counting towards the rounds' kept drafts;
  an int8 cache rewinds as a float one does."""
  free = generate(llama, PROMPT, 12)
  eos = int(free[0, PROMPT.shape[1] + 3])
  want = generate(llama, PROMPT, 12, eos_id=eos, cache_dtype=jnp.int8)
  out, _ = speculative_generate(llama, PROMPT, 12, draft=small_draft, num_draft_tokens=3,
                                eos_id=eos, cache_dtype=jnp.int8)
  np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("preset", ["deepseek-v3", "deepseek-v3.2", "mistral"])
def test_latent_sparse_and_window_caches_rewind(preset):
  """MLA's latent cache, DSA's indexer keys and a sliding window: the rewound slots are masked
  and overwritten as a KV cache's are."""
  extra = dict(sliding_window=5) if preset == "mistral" else {}
  cfg = get_config(preset, num_layers=2, **extra)
  model = DecoderLM(cfg, rngs=nnx.Rngs(1))
  prompt = PROMPT[:1]
  np.testing.assert_array_equal(speculative_generate(model, prompt, 10, draft=model)[0],
                                generate(model, prompt, 10))


@pytest.fixture(scope="module")
def llama_mtp():
  return DecoderLM(get_config("llama", num_layers=2, mtp_depth=1, **SMALL), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("preset", ["llama", "deepseek-v3"])
def test_mtp_draft_greedy_is_generates(llama_mtp, preset):
  """The model's own depth-1 MTP module drafts (a chain of k proposals): greedy output is
  ``generate``'s, over a KV cache and an MLA + MoE model's latent cache; sampling at top-1 too."""
  model = llama_mtp if preset == "llama" else DecoderLM(
      get_config(preset, num_layers=2, mtp_depth=1), rngs=nnx.Rngs(1))
  want = generate(model, PROMPT, 15)
  out, stats = speculative_generate(model, PROMPT, 15, draft="mtp", num_draft_tokens=3)
  np.testing.assert_array_equal(out, want)
  assert stats.drafted == 3 * stats.rounds and stats.emitted == 14
  if preset == "llama":
    out, _ = speculative_generate(model, PROMPT, 15, draft="mtp", num_draft_tokens=2,
                                  temperature=0.9, top_k=1, seed=4)
    np.testing.assert_array_equal(out, want)


def test_mtp_draft_state_is_the_uncached_module(llama_mtp):
  """After the prefill and after every round, the draft's first proposal comes from the module's
  output at the last kept position, computed over the model's true hidden states and the tokens
  that followed them: equal to ``mtp_forward`` over the whole sequence so far, uncached.  (The
  rounds' stand-in positions must be rewound and re-read for this to hold.)"""
  model, k = llama_mtp, 3
  graphdef, state = nnx.split(model)
  prefill, round_ = speculative_functions(graphdef, "mtp", 2, 64, k, model.config.vocab_size)
  first, cache, draft_cache, _ = prefill(state, None, jnp.asarray(PROMPT), token_key(0, 0))
  seq, n = np.concatenate([PROMPT, np.asarray(first)[:, None]], axis=1), PROMPT.shape[1]

  def check():
    tokens = jnp.asarray(seq)
    want = model.mtp_forward(model(tokens, return_hidden=True), tokens)[0][:, n - 1]
    np.testing.assert_allclose(draft_cache[2], want, atol=2e-4)
    assert int(draft_cache[0].index) == n and int(cache.index) == n

  check()
  for r in range(4):
    tokens, kept, _, cache, draft_cache, _ = round_(
        state, None, cache, draft_cache, None, jnp.asarray(seq[:, n - 1:n + 1]), jnp.int32(n),
        jnp.zeros((2, k), jnp.int32), jnp.zeros((2,), bool), token_key(0, r + 1))
    seq = np.concatenate([seq, np.asarray(tokens)[:, :int(kept) + 1]], axis=1)
    n += int(kept) + 1
    check()


PENALTIES = dict(repetition_penalty=1.8, presence_penalty=0.3, frequency_penalty=0.6)


@pytest.mark.parametrize("which", ["ngram", "itself", "small", "mtp"])
def test_penalized_greedy_is_generates(llama, small_draft, llama_mtp, which):
  """Repetition / presence / frequency penalties: each draft and each checked position is
  penalized as if the drafts before it had been emitted, so greedy output is ``generate``'s with
  the penalties (which change it), and the model drafting for itself still keeps every draft
  (its drafts' penalty state is the check's)."""
  model = llama_mtp if which == "mtp" else llama
  draft = {"ngram": "ngram", "itself": llama, "small": small_draft, "mtp": "mtp"}[which]
  want = generate(model, PROMPT, 16, **PENALTIES)
  assert not np.array_equal(want, generate(model, PROMPT, 16))
  out, stats = speculative_generate(model, PROMPT, 16, draft=draft, num_draft_tokens=3,
                                    **PENALTIES)
  np.testing.assert_array_equal(out, want)
  if which == "itself":
    assert stats.accepted == stats.drafted
  np.testing.assert_array_equal(generate(model, PROMPT, 16, draft=draft, num_draft_tokens=3,
                                         **PENALTIES), want)


def test_penalized_sampling(llama, small_draft):
  """Sampling with penalties: the prefill's token is ``generate``'s (same key, same penalized
  distribution); at top-1 every later token too, whatever the draft proposed (the check's point
  mass is the penalized argmax after the kept drafts)."""
  first = generate(llama, PROMPT, 1, temperature=1.0, seed=7, **PENALTIES)
  out, _ = speculative_generate(llama, PROMPT, 1, draft="ngram", temperature=1.0, seed=7,
                                **PENALTIES)
  np.testing.assert_array_equal(out, first)
  out, _ = speculative_generate(llama, PROMPT, 12, draft=small_draft, temperature=0.8, top_k=1,
                                seed=3, **PENALTIES)
  np.testing.assert_array_equal(out, generate(llama, PROMPT, 12, **PENALTIES))


@pytest.fixture(scope="module")
def hybrid():
  """Gated DeltaNet + attention (Qwen3-Next's mixers) with a multi-token-prediction module."""
  return DecoderLM(get_config("qwen3-next", num_layers=2, layer_pattern="DA", mtp_depth=1),
                   rngs=nnx.Rngs(0))


@pytest.mark.parametrize("draft", ["ngram", "mtp"])
def test_hybrid_deltanet_model_speculates(hybrid, draft):
  """A recurrent state is rewound from the check call's per-token snapshots: greedy output is
  ``generate``'s with prompt lookup and with the model's own MTP module."""
  out, stats = speculative_generate(hybrid, PROMPT, 12, draft=draft, num_draft_tokens=3)
  np.testing.assert_array_equal(out, generate(hybrid, PROMPT, 12))


def test_deltanet_state_rewinds_to_the_last_kept_token(hybrid):
  """Rounds driven with the model's own continuation as drafts, one of them spoiled at a chosen
  place: every draft kept, then 1, 0 and 2 of 3.  Each later token depends on the Gated DeltaNet
  state having been rewound to the snapshot after the last kept token (not the chunk's end)."""
  model, k = hybrid, 3
  want = np.asarray(generate(model, PROMPT, 18))
  graphdef, state = nnx.split(model)
  prefill, round_ = speculative_functions(graphdef, None, 2, 64, k, model.config.vocab_size)
  first, cache, _, _ = prefill(state, None, jnp.asarray(PROMPT), token_key(0, 0))
  seq, n = np.concatenate([PROMPT, np.asarray(first)[:, None]], axis=1), PROMPT.shape[1]
  for r, spoil in enumerate([None, 1, 0, 2]):
    drafts = want[:, n + 1:n + 1 + k].copy()
    if spoil is not None:
      drafts[:, spoil] = (drafts[:, spoil] + 1) % model.config.vocab_size
    tokens, kept, _, cache, _, _ = round_(
        state, None, cache, None, None, jnp.asarray(seq[:, n - 1:n + 1]), jnp.int32(n),
        jnp.asarray(drafts), jnp.zeros((2,), bool), token_key(0, r + 1))
    assert int(kept) == (k if spoil is None else spoil)
    seq = np.concatenate([seq, np.asarray(tokens)[:, :int(kept) + 1]], axis=1)
    n += int(kept) + 1
  np.testing.assert_array_equal(seq, want[:, :seq.shape[1]])
  assert seq.shape[1] == PROMPT.shape[1] + 1 + 4 + 2 + 1 + 3


def test_sampling_with_top_k_one_is_greedy(llama, small_draft):
  """Top-1 sampling is a point mass on the argmax: speculative sampling must return exactly the
  greedy tokens whatever the draft proposed (the draft samples its own top-1 too)."""
  out, stats = speculative_generate(llama, PROMPT, 12, draft=small_draft, temperature=0.8,
                                    top_k=1, seed=3)
  np.testing.assert_array_equal(out, generate(llama, PROMPT, 12))


def test_sampled_first_token_is_generates(llama):
  """The prefill samples the first token as ``generate`` does (same key): the same token."""
  want = generate(llama, PROMPT, 1, temperature=1.0, seed=7)
  out, _ = speculative_generate(llama, PROMPT, 1, draft="ngram", temperature=1.0, seed=7)
  np.testing.assert_array_equal(out, want)


def test_speculative_sampling_keeps_the_model_distribution():
  """Over many independent rounds with a fixed model distribution ``p_j`` per position and an
  unlike draft ``q_j``: the first emitted token is distributed as ``p_0``; given the first draft
  kept, the second as ``p_1`` (and the third as ``p_2``); a draft is kept with probability
  ``sum_x min(p(x), q(x))``.  Tokens outside the model's top-k are never emitted."""
  n, k, v = 60000, 2, 6
  logits = jax.random.normal(jax.random.key(0), (k + 1, v)) * 1.5
  temperature, top_k = 0.7, 4
  p = np.asarray(jax.nn.softmax(filtered_logits(logits, temperature=temperature, top_k=top_k)))
  q = np.array(jax.nn.softmax(jax.random.normal(jax.random.key(1), (k, v)) * 2.0))
  q[0, np.argmax(p[0])] = 0.0                 # the model's favourite never drafted first
  q = q / q.sum(-1, keepdims=True)
  drafts = jax.random.categorical(jax.random.key(2), jnp.log(jnp.asarray(q)), shape=(n, k))
  tokens, accepted = speculative_accept(
      jnp.broadcast_to(logits, (n, k + 1, v)), drafts.astype(jnp.int32),
      jnp.broadcast_to(jnp.asarray(q, jnp.float32), (n, k, v)), jax.random.key(3),
      temperature=temperature, top_k=top_k)
  tokens, accepted = np.asarray(tokens), np.asarray(accepted)
  freq = lambda x: np.bincount(x, minlength=v) / x.size  # noqa: E731
  np.testing.assert_allclose(freq(tokens[:, 0]), p[0], atol=0.012)
  assert np.mean(accepted >= 1) == pytest.approx(np.minimum(p[0], q[0]).sum(), abs=0.012)
  np.testing.assert_allclose(freq(tokens[accepted >= 1, 1]), p[1], atol=0.02)
  np.testing.assert_allclose(freq(tokens[accepted >= 2, 2]), p[2], atol=0.03)
  for j in range(k + 1):     # emitted positions only: j <= accepted
    emitted = tokens[accepted >= j, j]
    assert (p[j][emitted] > 0).all()


def test_greedy_accept_keeps_the_agreeing_prefix():
  logits = jax.nn.one_hot(jnp.array([[3, 1, 4, 2]]), 6) * 5.0
  tokens, accepted = speculative_accept(logits, jnp.array([[3, 1, 0]]), None, jax.random.key(0))
  assert int(accepted[0]) == 2 and np.asarray(tokens)[0, :3].tolist() == [3, 1, 4]
  tokens, accepted = speculative_accept(logits, jnp.array([[3, 1, 4]]), None, jax.random.key(0))
  assert int(accepted[0]) == 3 and np.asarray(tokens)[0].tolist() == [3, 1, 4, 2]


def test_ngram_propose_finds_the_latest_occurrence_and_repeats_its_period():
  def propose(seq, k, g):
    return ngram_propose(np.array(seq), k, g).tolist()
  # "1 2" occurred at 0: continue "3 4 1 2" and repeat (period 4)
  assert propose([1, 2, 3, 4, 1, 2], 6, 3) == [3, 4, 1, 2, 3, 4]
  # the latest of two occurrences of "1 2" (at 3), continued "8 1 2 8"
  assert propose([1, 2, 9, 1, 2, 8, 1, 2], 4, 2) == [8, 1, 2, 8]
  # a longer n-gram first: "8 1 2" at 0, though "1 2" occurs later
  assert propose([8, 1, 2, 5, 9, 1, 2, 8, 1, 2], 2, 3) == [5, 9]
  # nothing to find (too short for a 3-gram, no earlier "6"): the last token repeated
  assert propose([5, 6], 3, 3) == [6, 6, 6]
  assert propose([4, 4], 3, 3) == [4, 4, 4]       # "4" found at 0, period 1
  assert propose([7], 2, 3) == [7, 7]


def test_refused(llama, small_draft, hybrid):
  with pytest.raises(ValueError, match="draft.*DeltaNetCache"):   # a draft rewinds by index
    speculative_generate(llama, PROMPT, 4, draft=hybrid)
  other = DecoderLM(get_config("llama", num_layers=1, vocab_size=100, **SMALL), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="vocab_size \\(100\\) must equal"):
    speculative_generate(llama, PROMPT, 4, draft=other)
  with pytest.raises(ValueError, match="`draft` must be a DecoderLM, 'ngram'"):
    speculative_generate(llama, PROMPT, 4, draft="lookup")
  with pytest.raises(ValueError, match="mtp_depth=0"):
    speculative_generate(llama, PROMPT, 4, draft="mtp")
  with pytest.raises(ValueError, match="`num_draft_tokens` must be an int in \\[1, 64\\]"):
    speculative_generate(llama, PROMPT, 4, num_draft_tokens=0)
  with pytest.raises(ValueError, match="`ngram_size` must be an int >= 1"):
    speculative_generate(llama, PROMPT, 4, ngram_size=0)
  with pytest.raises(ValueError, match="`max_len` must be an int >= .* = 14"):
    speculative_generate(llama, PROMPT, 4, max_len=13)
  with pytest.raises(ValueError, match="`temperature`"):
    speculative_generate(llama, PROMPT, 4, temperature=-1.0)
  with pytest.raises(ValueError, match="`presence_penalty`"):
    speculative_generate(llama, PROMPT, 4, presence_penalty=float("nan"))
  with pytest.raises(ValueError, match="`draft_probs` must be"):
    speculative_accept(jnp.zeros((1, 3, 5)), jnp.zeros((1, 2), jnp.int32), None,
                       jax.random.key(0), temperature=1.0)
  with pytest.raises(ValueError, match="ModelCache"):
    rewind_cache(llama.init_paged_cache(1, 4, 8), 0)
