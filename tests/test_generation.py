"""Generation: greedy == argmax of the full forward, nucleus sampling keeps only the nucleus."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxattn.configs import get_config
from jaxattn.generation import (decode_functions, generate, penalized_rows, sample_logits,
                                sample_rows, token_key)
from jaxattn.nn.model import DecoderLM


def test_greedy_generation_equals_argmax_of_the_uncached_forward():
  cfg = get_config("mistral", embed_dim=32, mlp_dim=64, num_layers=2, sliding_window=3)
  model = DecoderLM(cfg, rngs=nnx.Rngs(0))
  prompt = np.array([[1, 40, 50, 60], [1, 70, 80, 90]], np.int32)
  streamed = []
  out = generate(model, prompt, 6, on_token=lambda ids: streamed.append(ids.copy()))
  assert out.shape == (2, 10) and (out[:, :4] == prompt).all()
  np.testing.assert_array_equal(np.stack(streamed, 1), out[:, 4:])
  forward = nnx.jit(lambda m, t: m(t))
  seq = prompt
  for _ in range(6):  # no cache: recompute everything each step
    nxt = np.asarray(jnp.argmax(forward(model, jnp.asarray(seq))[:, -1], -1))[:, None]
    seq = np.concatenate([seq, nxt.astype(np.int32)], 1)
  np.testing.assert_array_equal(out, seq)


def test_later_calls_reuse_the_compiled_programs():
  """``generate`` on a model of the same structure reuses its jitted prefill and step (it used to
  make new ones, and compile both again, on every call): a new prompt length compiles a new
  prefill only, a new model of the same structure nothing, and the outputs are its own."""
  cfg = get_config("llama", embed_dim=32, mlp_dim=64, num_layers=2)
  model, other = DecoderLM(cfg, rngs=nnx.Rngs(0)), DecoderLM(cfg, rngs=nnx.Rngs(1))
  prompt = np.array([[1, 40, 50, 60]], np.int32)
  # (another test in this process may have compiled programs for the same structure already)
  decode_functions.cache_clear()
  first = generate(model, prompt, 3)
  prefill, step = decode_functions(nnx.split(model)[0], 1, 128, temperature=0.0, top_p=1.0,
                                   top_k=0, min_p=0.0)
  sizes = prefill._cache_size(), step._cache_size()
  assert sizes == (1, 1)
  np.testing.assert_array_equal(generate(model, prompt, 3), first)
  assert (prefill._cache_size(), step._cache_size()) == sizes
  generate(model, prompt[:, :3], 3)
  assert (prefill._cache_size(), step._cache_size()) == (2, 1)
  theirs = generate(other, prompt, 3)
  assert (prefill._cache_size(), step._cache_size()) == (2, 1)
  forward = nnx.jit(lambda m, t: m(t))
  np.testing.assert_array_equal(   # the other model's weights, not the first's
      theirs[:, 4], np.argmax(np.asarray(forward(other, jnp.asarray(prompt)))[:, -1], -1))


def test_generation_runs_without_dropout():
  """A model holding LoRA dropout decodes as in eval mode (dropout used to be applied to every
  prefill and step, with the same masks each call)."""
  from jaxattn.nn.lora import LoRA, apply_lora
  cfg = get_config("llama", embed_dim=32, mlp_dim=64, num_layers=2)
  model = DecoderLM(cfg, rngs=nnx.Rngs(0))
  apply_lora(model, r"mixer/(q|v)_proj$", rank=4, dropout=0.9, rngs=nnx.Rngs(1))
  for i, (_, m) in enumerate(nnx.iter_graph(model)):
    if isinstance(m, LoRA):  # non-zero adapters, so that dropout changes the output
      b = m.lora_b.get_value()
      m.lora_b.set_value(jax.random.normal(jax.random.key(i), b.shape, b.dtype))
  prompt = np.array([[1, 40, 50, 60], [1, 70, 80, 90]], np.int32)
  out = generate(model, prompt, 2)
  model.eval()
  forward = nnx.jit(lambda m, t: m(t))
  seq = prompt
  for _ in range(2):
    nxt = np.asarray(jnp.argmax(forward(model, jnp.asarray(seq))[:, -1], -1))[:, None]
    seq = np.concatenate([seq, nxt.astype(np.int32)], 1)
  np.testing.assert_array_equal(out, seq)
  model.train()
  train_logits = np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(seq)))
  model.eval()
  eval_logits = np.asarray(forward(model, jnp.asarray(seq)))
  assert not np.allclose(train_logits, eval_logits)   # dropout does matter for this model


def test_decode_step_updates_the_cache_in_place():
  """The decode step donates its cache: the compiled step aliases every cache buffer to its
  output (no copy of the whole cache per token), and the cache passed in is consumed."""
  cfg = get_config("llama", embed_dim=32, mlp_dim=64, num_layers=2)
  graphdef, state = nnx.split(DecoderLM(cfg, rngs=nnx.Rngs(0)))
  prefill, step = decode_functions(graphdef, 2, 16)
  token, cache = prefill(state, jnp.ones((2, 3), jnp.int32), jax.random.key(0))
  cache_bytes = sum(x.nbytes for x in jax.tree.leaves(cache))
  compiled = step.lower(state, token, cache, jax.random.key(1)).compile()
  assert compiled.memory_analysis().alias_size_in_bytes >= cache_bytes
  before = jax.tree.leaves(cache)
  token2, cache2 = step(state, token, cache, jax.random.key(1))
  assert all(x.is_deleted() for x in before if x.nbytes > 64)        # the K/V buffers
  assert not any(x.is_deleted() for x in jax.tree.leaves(cache2))
  step(state, token2, cache2, jax.random.key(2))                      # the returned cache lives on


def test_default_capacity_is_whole_blocks(monkeypatch):
  """The default cache holds prompt + new tokens rounded up to 128 (the TPU decode kernel reads a
  contiguous cache whose length is a multiple of 16 in place); an explicit max_len is kept."""
  import jaxattn.generation as generation  # noqa: PLC0415
  seen = []

  def recording(graphdef, batch, max_len, **kw):
    seen.append(max_len)
    return decode_functions(graphdef, batch, max_len, **kw)
  monkeypatch.setattr(generation, "decode_functions", recording)
  model = DecoderLM(get_config("llama", embed_dim=32, mlp_dim=64, num_layers=1), rngs=nnx.Rngs(0))
  prompt = np.array([[1, 2, 3]], np.int32)
  generation.generate(model, prompt, 2)
  generation.generate(model, prompt, 2, max_len=7)
  assert seen == [128, 7]


def test_generation_stops_at_eos_and_checks_arguments():
  cfg = get_config("llama", embed_dim=32, mlp_dim=64, num_layers=1)
  model = DecoderLM(cfg, rngs=nnx.Rngs(0))
  prompt = np.array([[1, 2, 3]], np.int32)
  first = generate(model, prompt, 1)[0, -1]
  out = generate(model, prompt, 10, eos_id=int(first))
  assert out.shape == (1, 4)
  with pytest.raises(ValueError, match="prompt"):
    generate(model, np.zeros((3,), np.int32), 2)
  with pytest.raises(ValueError, match="max_len"):
    generate(model, prompt, 5, max_len=4)
  learned = DecoderLM(cfg.replace(position="learned", max_seq_len=6), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="learned position table"):
    generate(learned, prompt, 5)


def test_nucleus_sampling_draws_only_from_the_top_p_set():
  probs = jnp.array([0.5, 0.3, 0.15, 0.05])
  logits = jnp.tile(jnp.log(probs), (4000, 1))
  draws = np.asarray(sample_logits(logits, jax.random.key(0), temperature=1.0, top_p=0.7))
  counts = np.bincount(draws, minlength=4) / draws.size
  assert counts[2] == 0 and counts[3] == 0                 # outside the 0.8-mass nucleus {0, 1}
  np.testing.assert_allclose(counts[:2], [0.5 / 0.8, 0.3 / 0.8], atol=0.03)  # renormalized
  full = np.asarray(sample_logits(logits, jax.random.key(1), temperature=1.0))
  np.testing.assert_allclose(np.bincount(full, minlength=4) / full.size, probs, atol=0.03)
  greedy = sample_logits(logits[:2], jax.random.key(0))
  assert (np.asarray(greedy) == 0).all()
  with pytest.raises(ValueError, match="top_p"):
    sample_logits(logits, jax.random.key(0), temperature=1.0, top_p=0.0)
  with pytest.raises(ValueError, match="temperature"):
    sample_logits(logits, jax.random.key(0), temperature=-1.0)
  for bad in (logits[0], logits[None]):  # [V] or [B, T, V]: not the last position's [B, V]
    with pytest.raises(ValueError, match=r"`logits` must be \[B, V\]"):
      sample_logits(bad, jax.random.key(0), temperature=1.0, top_p=0.7)


def test_a_tiny_temperature_samples_the_most_likely_token():
  """``logits / 1e-39`` overflowed to inf (NaN after the softmax) and sampled token 0; the logits
  are shifted by their maximum first, so a tiny temperature is the argmax (also with top-p)."""
  logits = jnp.array([[1.0, 2.0, 5.0, 3.0], [4.0, -1.0, 0.5, 3.9]])
  for kw in (dict(), dict(top_p=0.9), dict(top_k=2)):
    got = sample_logits(logits, jax.random.key(0), temperature=1e-39, **kw)
    np.testing.assert_array_equal(got, [2, 0])
  # the shift leaves ordinary sampling unchanged: the same draws as from logits + 100
  draws = sample_logits(jnp.tile(logits[:1], (64, 1)), jax.random.key(3), temperature=0.7)
  same = sample_logits(jnp.tile(logits[:1] + 100.0, (64, 1)), jax.random.key(3), temperature=0.7)
  np.testing.assert_array_equal(draws, same)


def test_top_k_keeps_the_k_most_likely_then_top_p():
  probs = jnp.array([0.4, 0.3, 0.2, 0.1])
  logits = jnp.tile(jnp.log(probs), (4000, 1))
  draws = np.asarray(sample_logits(logits, jax.random.key(0), temperature=1.0, top_k=2))
  counts = np.bincount(draws, minlength=4) / draws.size
  assert counts[2] == 0 and counts[3] == 0
  np.testing.assert_allclose(counts[:2], [0.4 / 0.7, 0.3 / 0.7], atol=0.03)  # renormalized
  # top_p then acts on the top-k distribution (transformers' order): 0.4/0.7 = 0.57 >= 0.5.
  both = np.asarray(sample_logits(logits, jax.random.key(1), temperature=1.0, top_k=2, top_p=0.5))
  assert (both == 0).all()
  # k at or above the vocabulary is no limit.
  wide = np.asarray(sample_logits(logits, jax.random.key(2), temperature=1.0, top_k=10))
  np.testing.assert_allclose(np.bincount(wide, minlength=4) / wide.size, probs, atol=0.03)


def test_penalized_rows_ahead_counts_the_drafts_before_each_position():
  """``penalized_rows(..., ahead=)``: a check's position ``j`` is penalized as the history with
  the first ``j`` drafts appended (generated: seen and counted; ``-1``: no draft); ``[B, V]``
  logits take all of them; ``[B, T, V]`` logits without ``ahead``, the history's state at every
  position; ``ahead`` of the wrong width is refused, naming it."""
  v = 6
  logits = 3.0 * jax.random.normal(jax.random.key(0), (2, 3, v))
  history = jnp.array([[1, 2, -1, -1], [3, 3, 4, -1]], jnp.int32)
  num_prompt = jnp.array([1, 2], jnp.int32)
  settings = (jnp.array([1.5, 2.0]), jnp.array([0.5, 0.0]), jnp.array([0.25, 1.0]))
  ahead = jnp.array([[2, 5], [4, -1]], jnp.int32)
  got = penalized_rows(logits, history, num_prompt, *settings, ahead=ahead)
  for j in range(3):
    grown = jnp.concatenate([history, ahead[:, :j]], axis=1)
    want = penalized_rows(logits[:, j], grown, num_prompt, *settings)
    np.testing.assert_allclose(got[:, j], want, rtol=1e-6, err_msg=f"position {j}")
  assert not np.allclose(got[:, 2], penalized_rows(logits[:, 2], history, num_prompt, *settings))
  np.testing.assert_allclose(
      penalized_rows(logits[:, 0], history, num_prompt, *settings, ahead=ahead),
      penalized_rows(logits[:, 0], jnp.concatenate([history, ahead], 1), num_prompt, *settings))
  # [B, T, V] logits without drafts: every position penalized with the history alone
  plain = penalized_rows(logits, history, num_prompt, *settings)
  for j in range(3):
    np.testing.assert_allclose(plain[:, j],
                               penalized_rows(logits[:, j], history, num_prompt, *settings),
                               rtol=1e-6, err_msg=f"no drafts, position {j}")
  with pytest.raises(ValueError, match=r"`ahead` must be \[B, T - 1 = 2\]"):
    penalized_rows(logits, history, num_prompt, *settings, ahead=ahead[:, :1])


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=float("nan")), "`temperature` must be a finite number >= 0"),
    (dict(temperature=float("inf")), "`temperature` must be a finite number >= 0"),
    (dict(temperature="0.5"), "`temperature` must be a finite number >= 0"),
    (dict(top_p=float("nan")), "`top_p` must be in"),
    (dict(top_k=-1), "`top_k` must be an int >= 0"),
    (dict(top_k=2.5), "`top_k` must be an int >= 0"),
    (dict(min_p=-0.1), r"`min_p` must be in \[0, 1\]"),
    (dict(min_p=float("nan")), r"`min_p` must be in \[0, 1\]"),
])
def test_sampling_arguments_are_checked(kwargs, match):
  with pytest.raises(ValueError, match=match):
    sample_logits(jnp.zeros((1, 4)), jax.random.key(0), **kwargs)
  model = DecoderLM(get_config("llama", embed_dim=32, mlp_dim=64, num_layers=1), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=match):  # even with nothing to sample
    generate(model, np.array([[1, 2]], np.int32), 0, **kwargs)


def test_finished_sequences_are_padded_with_eos():
  cfg = get_config("llama", embed_dim=32, mlp_dim=64, num_layers=1)
  model = DecoderLM(cfg, rngs=nnx.Rngs(0))
  prompt = np.array([[1, 2, 3], [4, 5, 6]], np.int32)
  free = generate(model, prompt, 6)
  eos = int(free[0, 3])                      # row 0 emits it first
  rows = [np.flatnonzero(free[r, 3:] == eos) for r in range(2)]
  stream = []
  out = generate(model, prompt, 6, eos_id=eos, on_token=lambda ids: stream.append(ids.copy()))
  np.testing.assert_array_equal(np.stack(stream, 1), out[:, 3:])
  for r in range(2):
    first = rows[r][0] if rows[r].size else None
    if first is None:                         # never finished: the free continuation
      np.testing.assert_array_equal(out[r, 3:], free[r, 3:out.shape[1]])
    else:                                     # up to its EOS as without, then EOS only
      np.testing.assert_array_equal(out[r, 3:3 + first + 1], free[r, 3:3 + first + 1])
      assert (out[r, 3 + first:] == eos).all()
  assert rows[0].size and (out[0, 4:] == eos).all()


def test_prompt_and_capacity_checks():
  cfg = get_config("llama", embed_dim=32, mlp_dim=64, num_layers=1)
  model = DecoderLM(cfg, rngs=nnx.Rngs(0))
  prompt = np.array([[1, 2, 3]], np.int32)
  for bad in (np.array([[1, cfg.vocab_size]]), np.array([[-1, 2]])):
    with pytest.raises(ValueError, match=r"`prompt` token ids must be in \[0, 259\)"):
      generate(model, bad, 2)
  with pytest.raises(ValueError, match="`prompt` must hold integer token ids"):
    generate(model, prompt.astype(np.float32), 2)
  # eos_id: one token id in the vocabulary (a list would silently mean one id per row).
  for bad in (cfg.vocab_size, -3, [1, 2], True):
    with pytest.raises(ValueError, match="`eos_id` must be None or one token id"):
      generate(model, prompt, 2, eos_id=bad)
  for name, bad in (("max_len", 0), ("max_len", 9.5), ("seed", 1.5)):
    with pytest.raises(ValueError, match=f"`{name}` must be an int"):
      generate(model, prompt, 2, **{name: bad})
  # The last new token is never fed back: T + n - 1 slots (and learned positions) suffice.
  want = generate(model, prompt, np.int64(4))
  np.testing.assert_array_equal(generate(model, prompt, 4, max_len=6), want)
  learned = DecoderLM(cfg.replace(position="learned", max_seq_len=6), rngs=nnx.Rngs(0))
  assert generate(learned, prompt, 4).shape == (1, 7)


def test_text_stream_keeps_multibyte_characters_whole():
  """Streamed byte tokens decoded one at a time showed every non-ASCII character as U+FFFD."""
  from jaxattn.generation import TextStream
  from jaxattn.train.data import ByteTokenizer
  tok = ByteTokenizer()
  text = "café – naïve 👍"
  stream = TextStream(tok.decode)
  pieces = [stream.feed([i]) for i in tok.encode(text)] + [stream.flush()]
  assert "".join(pieces) == text and "\ufffd" not in "".join(pieces)
  assert pieces[3] == "" and pieces[4] == "é"       # held until the character completes
  cut = TextStream(tok.decode)                        # a truly invalid byte shows at the end
  assert cut.feed(tok.encode("a")) == "a" and cut.feed([0xE2 + 3]) == ""
  assert cut.flush() == "\ufffd"


def test_sample_rows_gives_each_row_what_sample_logits_gives_it_alone():
  """Per-row settings (greedy, temperature, top-p, top-k, both, a k past the vocabulary) and
  per-row keys ``token_key(seed, index)``: row ``i`` equals ``sample_logits`` on that row alone,
  over many seeds; a row-count mismatch is refused by name."""
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(6, 50)) * 3, jnp.float32)
  settings = [(0.0, 1.0, 0, 0.0), (1.0, 1.0, 0, 0.0), (0.7, 0.9, 0, 0.0), (1.3, 1.0, 5, 0.0),
              (0.5, 0.5, 3, 0.0), (2.0, 0.3, 50, 0.0), (1.5, 1.0, 0, 0.05), (1.0, 0.9, 8, 0.3)]
  t, p, k, m = (jnp.asarray(x) for x in zip(*settings))
  logits = jnp.concatenate([logits, logits[:2]])
  b = len(settings)
  rows = jax.jit(sample_rows)
  draws = []
  for _ in range(12):
    seeds, index = rng.integers(0, 2**31 - 1, size=b), rng.integers(0, 100, size=b)
    got = np.asarray(rows(logits, jnp.asarray(seeds, jnp.int32), jnp.asarray(index, jnp.int32),
                          t.astype(jnp.float32), p.astype(jnp.float32), k.astype(jnp.int32),
                          m.astype(jnp.float32)))
    for i, (ti, pi, ki, mi) in enumerate(settings):
      want = sample_logits(logits[i:i + 1], token_key(int(seeds[i]), int(index[i])),
                           temperature=ti, top_p=pi, top_k=ki, min_p=mi)
      assert got[i] == int(want[0]), (i, settings[i])
    draws.append(got)
  assert len({d[1] for d in draws}) > 2                  # the sampled rows do vary with the key
  with pytest.raises(ValueError, match=r"`top_k` must be \[B=8\]"):
    sample_rows(logits, jnp.zeros(b, jnp.int32), jnp.zeros(b, jnp.int32), t, p, k[:5])
  with pytest.raises(ValueError, match=r"`min_p` must be \[B=8\]"):
    sample_rows(logits, jnp.zeros(b, jnp.int32), jnp.zeros(b, jnp.int32), t, p, k, m[:5])


def test_min_p_one_keeps_only_the_most_likely_token():
  """``min_p = 1`` keeps only tokens as likely as the most likely one: sampling at any
  temperature is greedy decoding, for ``generate``, speculative decoding (the draft's and the
  model's distributions filtered alike) and the serving engine; ``min_p = 0.5`` does sample."""
  from jaxattn.serving import Engine
  from jaxattn.speculative import speculative_generate
  model = DecoderLM(get_config("llama", embed_dim=32, mlp_dim=64, num_layers=1), rngs=nnx.Rngs(0))
  prompt = np.array([[5, 9, 2, 7], [1, 3, 3, 8]], np.int32)
  greedy = generate(model, prompt, 8)
  sampled = dict(temperature=1.7, min_p=1.0, seed=3)
  np.testing.assert_array_equal(generate(model, prompt, 8, **sampled), greedy)
  out, _ = speculative_generate(model, prompt, 8, draft=model, num_draft_tokens=3, **sampled)
  np.testing.assert_array_equal(out, greedy)
  engine = Engine(model, max_batch=2, page_size=4, **sampled)
  ids = [engine.submit(p, 8) for p in prompt]
  results = engine.run()
  for rid, want in zip(ids, greedy):
    np.testing.assert_array_equal(results[rid], want)
  assert not np.array_equal(generate(model, prompt, 8, temperature=1.7, min_p=0.5, seed=3),
                            greedy)


def _penalized_numpy(logits, seen, counts, rep, presence, frequency):
  x = logits.astype(np.float64)
  x = np.where(seen, np.where(x > 0, x / rep, x * rep), x)
  return x - presence * (counts > 0) - frequency * counts


def test_penalties_equal_their_formula():
  """``penalized_logits``: CTRL's repetition penalty on every seen token (divide where positive,
  multiply where negative), OpenAI's presence and frequency penalties on the generated counts."""
  from jaxattn.generation import penalized_logits
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(3, 50)).astype(np.float32) * 3
  seen = rng.random((3, 50)) < 0.3
  counts = np.where(rng.random((3, 50)) < 0.2, rng.integers(1, 4, (3, 50)), 0).astype(np.int32)
  for rep, presence, frequency in [(1.3, 0.0, 0.0), (0.7, 0.5, 0.0), (1.0, 0.0, 0.8),
                                   (1.5, -0.4, 0.3)]:
    got = penalized_logits(jnp.asarray(logits), jnp.asarray(seen), jnp.asarray(counts),
                           repetition_penalty=rep, presence_penalty=presence,
                           frequency_penalty=frequency)
    want = _penalized_numpy(logits, seen, counts, rep, presence, frequency)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)
  same = penalized_logits(jnp.asarray(logits), jnp.asarray(seen), jnp.asarray(counts))
  np.testing.assert_array_equal(np.asarray(same), logits)   # the defaults change nothing


def test_penalized_generation_equals_the_uncached_reference():
  """Greedy with all three penalties: each step's token is the argmax of the uncached forward's
  last logits after the penalties, with the prompt's and the generated tokens seen and only the
  generated ones counted; the penalties change the output of this model (a prompt of repeats)."""
  cfg = get_config("llama", embed_dim=32, mlp_dim=64, num_layers=2)
  model = DecoderLM(cfg, rngs=nnx.Rngs(0))
  prompt = np.array([[1, 40, 40, 40, 50], [1, 70, 80, 70, 80]], np.int32)
  kw = dict(repetition_penalty=1.8, presence_penalty=0.3, frequency_penalty=0.6)
  out = generate(model, prompt, 8, **kw)
  forward = nnx.jit(lambda m, t: m(t))
  seq, v = prompt, cfg.vocab_size
  for _ in range(8):
    logits = np.asarray(forward(model, jnp.asarray(seq))[:, -1], np.float64)
    seen = np.zeros((2, v), bool)
    counts = np.zeros((2, v), np.int64)
    for b in range(2):
      seen[b, seq[b]] = True
      np.add.at(counts[b], seq[b, prompt.shape[1]:], 1)
    x = _penalized_numpy(logits, seen, counts, kw["repetition_penalty"], kw["presence_penalty"],
                         kw["frequency_penalty"])
    seq = np.concatenate([seq, x.argmax(-1)[:, None].astype(np.int32)], 1)
  np.testing.assert_array_equal(out, seq)
  assert not np.array_equal(out, generate(model, prompt, 8))
  # sampled: a fixed seed repeats, and the settings reach the program
  a = generate(model, prompt, 6, temperature=1.0, seed=4, **kw)
  np.testing.assert_array_equal(a, generate(model, prompt, 6, temperature=1.0, seed=4, **kw))


@pytest.mark.parametrize("kwargs, match", [
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty"),
    (dict(presence_penalty=float("inf")), "presence_penalty"),
    (dict(frequency_penalty="1"), "frequency_penalty"),
    (dict(repetition_penalty=-1.0, draft="ngram"), "repetition_penalty"),
])
def test_penalty_arguments_are_checked(kwargs, match):
  cfg = get_config("llama", embed_dim=32, mlp_dim=64, num_layers=1)
  model = DecoderLM(cfg, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=match):
    generate(model, np.array([[1, 2, 3]], np.int32), 2, **kwargs)
