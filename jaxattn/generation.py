"""Autoregressive generation with the KV cache: one jitted prefill, then one jitted decode step per
token; greedy, temperature, top-k, nucleus (top-p) and min-p sampling; repetition, presence and
frequency penalties (here, with speculative decoding too, and in ``jaxattn.serving.Engine``);
tokens streamed to a callback.

    out = generate(model, prompt, max_new_tokens=64, temperature=0.8, top_p=0.95, seed=0,
                   on_token=lambda ids: print(tok.decode(ids), end=""))
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from jaxattn.checks import is_int, is_number
from jaxattn.ops.quantization import check_cache_dtype
from jaxattn.nn.model import DecoderLM


class TextStream:
  """Text of token ids that arrive a few at a time (streamed generation).

  ``feed(ids)`` returns the text the new ids add; ``flush()`` what is left at the end.  Each call
  decodes every id so far and returns what was not returned yet, so a multi-byte UTF-8 character
  split over byte tokens, or a tokenizer's leading-space rule, comes out as ``decode`` of the
  whole sequence would give it (decoding each token alone shows a U+FFFD per byte of a cut
  character).  A trailing U+FFFD (a character still incomplete) is held back until it resolves.
  """

  def __init__(self, decode: Callable[[list[int]], str]):
    self.decode, self.ids, self.done = decode, [], 0

  def feed(self, ids) -> str:
    self.ids.extend(int(i) for i in np.asarray(ids).reshape(-1))
    text = self.decode(self.ids)
    end = len(text)
    while end > self.done and text[end - 1] == "\ufffd":
      end -= 1
    new, self.done = text[self.done:end], max(self.done, end)
    return new

  def flush(self) -> str:
    text = self.decode(self.ids)
    new, self.done = text[self.done:], max(self.done, len(text))
    return new


def check_sampling(temperature, top_p, top_k=0, min_p=0.0) -> None:
  """Raises ``ValueError`` unless ``temperature >= 0``, ``0 < top_p <= 1``, ``top_k >= 0`` and
  ``0 <= min_p <= 1``."""
  # `not >=` also refuses NaN; inf would divide every logit to 0 (uniform over the vocabulary).
  if not is_number(temperature) or not temperature >= 0 or not math.isfinite(temperature):
    raise ValueError(f"`temperature` must be a finite number >= 0 (0: greedy), got "
                     f"{temperature!r}.")
  if not is_number(top_p) or not 0.0 < top_p <= 1.0:
    raise ValueError(f"`top_p` must be in (0, 1], got {top_p!r}.")
  if not is_int(top_k) or top_k < 0:
    raise ValueError(f"`top_k` must be an int >= 0 (0: no limit), got {top_k!r}.")
  if not is_number(min_p) or not 0.0 <= min_p <= 1.0:
    raise ValueError(f"`min_p` must be in [0, 1] (0: no limit), got {min_p!r}.")


# (repetition, presence, frequency): the settings that change nothing
NO_PENALTIES = (1.0, 0.0, 0.0)


def check_penalties(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0) -> None:
  """Raises ``ValueError`` unless ``repetition_penalty > 0`` and both other penalties are finite."""
  if not is_number(repetition_penalty) or not repetition_penalty > 0 or not math.isfinite(
      repetition_penalty):
    raise ValueError(f"`repetition_penalty` must be a finite number > 0 (1: none), got "
                     f"{repetition_penalty!r}.")
  for name, value in (("presence_penalty", presence_penalty),
                      ("frequency_penalty", frequency_penalty)):
    if not is_number(value) or not math.isfinite(value):
      raise ValueError(f"`{name}` must be a finite number (0: none), got {value!r}.")


def penalized_logits(logits: Float[Array, "B V"], seen: Array, counts: Int[Array, "B V"], *,
                     repetition_penalty: float = 1.0, presence_penalty: float = 0.0,
                     frequency_penalty: float = 0.0) -> Float[Array, "B V"]:
  """Repetition, presence and frequency penalties, applied to the raw logits (before temperature
  and the top-k / top-p / min-p filters, as transformers and vLLM order them).

  * ``repetition_penalty`` (CTRL; transformers' ``RepetitionPenaltyLogitsProcessor``): every token
    in ``seen [B, V]`` (the prompt's and the generated tokens) has its logit divided by the
    penalty where positive, multiplied by it where negative (> 1 discourages repeats);
  * ``presence_penalty`` / ``frequency_penalty`` (OpenAI / vLLM): ``logit - presence * (count >
    0) - frequency * count``, with ``counts [B, V]`` how often each token was generated so far
    (the prompt does not count)."""
  x = logits.astype(jnp.float32)
  if repetition_penalty != 1.0:
    x = _repetition(x, seen, jnp.float32(repetition_penalty))
  if presence_penalty != 0.0:
    x = x - jnp.float32(presence_penalty) * (counts > 0)
  if frequency_penalty != 0.0:
    x = x - jnp.float32(frequency_penalty) * counts.astype(jnp.float32)
  return x


def penalty_start(tokens: Int[Array, "B T"], vocab_size: int) -> tuple[Array, Array]:
  """The penalty state after a prompt: ``(seen [B, V] bool, counts [B, V] int32)``, its tokens
  seen, none counted."""
  b = tokens.shape[0]
  seen = jnp.zeros((b, vocab_size), bool).at[jnp.arange(b)[:, None], tokens].set(True)
  return seen, jnp.zeros((b, vocab_size), jnp.int32)


def penalty_add(pstate, tokens: Int[Array, "B m"], keep=None) -> tuple[Array, Array]:
  """``pstate`` with ``tokens [B, m]`` generated (seen and counted; those where ``keep [B, m]``,
  default all)."""
  seen, counts = pstate
  hits = jax.nn.one_hot(tokens, counts.shape[-1], dtype=counts.dtype)
  if keep is not None:
    hits = hits * keep[..., None].astype(counts.dtype)
  hits = jnp.sum(hits, axis=1)
  return seen | (hits > 0), counts + hits


def after_each(seen, counts, ahead: Int[Array, "B m"]) -> tuple[Array, Array]:
  """``(seen, counts)`` ``[B, m + 1, V]``: position ``j`` the state after ``ahead[:, :j]`` were
  generated (``-1``: none), for a check of ``m`` drafts."""
  hits = jax.nn.one_hot(ahead, counts.shape[-1], dtype=counts.dtype)
  cum = jnp.concatenate([jnp.zeros_like(hits[:, :1]), jnp.cumsum(hits, axis=1)], axis=1)
  return seen[:, None] | (cum > 0), counts[:, None] + cum


def _repetition(x, seen, r):
  return jnp.where(seen, jnp.where(x > 0, x / r, x * r), x)


def penalized_rows(logits: Float[Array, "B *T V"], history: Int[Array, "B L"],
                   num_prompt: Int[Array, "B"], repetition: Float[Array, "B"],
                   presence: Float[Array, "B"], frequency: Float[Array, "B"],
                   ahead: Int[Array, "B m"] | None = None) -> Float[Array, "B *T V"]:
  """``penalized_logits`` with settings per row (traced: one program for any mix), the seen set
  and counts built from each row's ``history`` (its prompt, then its generated tokens; ``-1``
  pads): row ``i``'s first ``num_prompt[i]`` entries are seen, the rest seen and counted.

  ``ahead [B, m]`` (speculative decoding: drafts, ``-1`` for none), tokens generated after the
  history: with ``logits [B, V]`` all of them count; with ``logits [B, T, V]`` (``m = T - 1``,
  a check of ``T - 1`` drafts) position ``j`` is penalized as if ``ahead[:, :j]`` had been."""
  seen, counts = history_state(history, num_prompt, logits.shape[-1])
  if ahead is not None:                                        # (-1: no token)
    if logits.ndim == 3:
      if ahead.shape[1] != logits.shape[1] - 1:
        raise ValueError(f"`ahead` must be [B, T - 1 = {logits.shape[1] - 1}] with logits "
                         f"[B, T, V], got shape {ahead.shape}.")
      seen, counts = after_each(seen, counts, ahead)
    else:
      seen, counts = penalty_add((seen, counts), ahead)
  return penalized_by_state(logits, (seen, counts), repetition, presence, frequency)


def history_state(history: Int[Array, "B L"], num_prompt: Int[Array, "B"],
                  vocab_size: int) -> tuple[Array, Array]:
  """``penalized_rows``' state of each row's ``history`` (``-1`` pads): ``(seen [B, V] bool,
  counts [B, V] fp32)``, the first ``num_prompt[i]`` entries seen, the rest seen and counted."""
  b = history.shape[0]
  valid = history >= 0
  ids = jnp.where(valid, history, 0)
  rows = jnp.arange(b)[:, None]
  seen = jnp.zeros((b, vocab_size), jnp.int32).at[rows, ids].max(valid.astype(jnp.int32)) > 0
  generated = valid & (jnp.arange(history.shape[1])[None, :] >= num_prompt[:, None])
  counts = jnp.zeros((b, vocab_size), jnp.float32).at[rows, ids].add(
      generated.astype(jnp.float32))
  return seen, counts


def penalized_by_state(logits: Float[Array, "B *T V"], pstate, repetition: Float[Array, "B"],
                       presence: Float[Array, "B"], frequency: Float[Array, "B"]
                       ) -> Float[Array, "B *T V"]:
  """fp32 ``logits`` penalized with per-row settings and the state ``pstate = (seen, counts)``
  (``[B, V]``, for every position of ``logits [B, T, V]`` too, or ``[B, T, V]`` per position)."""
  seen, counts = pstate
  settings = [repetition, presence, frequency]
  if logits.ndim == 3:
    settings = [x[:, None] for x in settings]
    if seen.ndim == 2:
      seen, counts = seen[:, None], counts[:, None]
  repetition, presence, frequency = (x[..., None] for x in settings)
  x = _repetition(logits.astype(jnp.float32), seen, repetition)
  return x - presence * (counts > 0) - frequency * counts


def sample_logits(logits: Float[Array, "B V"], key, *, temperature: float = 0.0,
                  top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0) -> Int[Array, "B"]:
  """Next tokens from the last position's logits.

  ``temperature == 0``: greedy (argmax).  Otherwise sample from ``softmax(logits / temperature)``
  restricted to the ``top_k`` most likely tokens (0: all of them; ties at the k-th logit are
  kept), then to the smallest set of those whose probability reaches ``top_p`` (the most likely
  token is always kept), then to those at least ``min_p`` times as likely as the most likely
  one (0: no limit), renormalized: the order transformers applies them in.
  """
  check_sampling(temperature, top_p, top_k, min_p)
  if jnp.ndim(logits) != 2:
    raise ValueError(f"`logits` must be [B, V] (the last position of each sequence), got shape "
                     f"{jnp.shape(logits)}.")
  if temperature == 0.0:
    return jnp.argmax(logits.astype(jnp.float32), axis=-1).astype(jnp.int32)
  logits = filtered_logits(logits, temperature=temperature, top_p=top_p, top_k=top_k,
                           min_p=min_p)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def filtered_logits(logits: Float[Array, "... V"], *, temperature: float, top_p: float = 1.0,
                    top_k: int = 0, min_p: float = 0.0) -> Float[Array, "... V"]:
  """The fp32 logits ``sample_logits`` draws from at ``temperature > 0`` (over the last axis):
  divided by the temperature, tokens outside the top-k, then outside the nucleus, then below
  ``min_p`` times the most likely token's probability at -inf.  ``softmax`` of them is the
  sampling distribution (speculative decoding compares the target's and the draft's)."""
  check_sampling(temperature, top_p, top_k, min_p)
  if not temperature > 0:
    raise ValueError(f"`temperature` must be > 0 here (0 is greedy: no distribution), got "
                     f"{temperature!r}.")
  shape = jnp.shape(logits)
  logits = jnp.reshape(logits, (-1, shape[-1])).astype(jnp.float32)
  # Shifted by the row maximum first (softmax is shift-invariant), the maximum kept at 0: a tiny
  # temperature then sends the other tokens to -inf, not the logits to inf / NaN (a subnormal
  # one flushes to 0: 0 / 0); that sampled token 0.
  top = jnp.max(logits, axis=-1, keepdims=True)
  shifted = logits - jnp.where(jnp.isfinite(top), top, 0.0)
  logits = jnp.where(shifted == 0, 0.0, shifted / temperature)
  if 0 < top_k < logits.shape[-1]:
    kth = jax.lax.top_k(logits, int(top_k))[0][..., -1:]
    logits = jnp.where(logits >= kth, logits, -jnp.inf)
  if top_p < 1.0:
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs        # mass strictly above each token
    keep_sorted = before < top_p                        # the first token always has before = 0
    keep = jnp.zeros_like(keep_sorted).at[
        jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
    logits = jnp.where(keep, logits, -jnp.inf)
  if min_p > 0.0:      # the most likely token's logit is 0 here: p / p_max = exp(logit)
    logits = jnp.where(logits < math.log(min_p), -jnp.inf, logits)
  return jnp.reshape(logits, shape)


def token_key(seed, index):
  """The key token ``index`` (0 = the first generated) of a sequence with ``seed`` samples with:
  ``fold_in(key(seed), index)``.  ``generate`` and ``jaxattn.serving.Engine`` both use it, so a
  request sampled by the engine gets the tokens ``generate`` gives it alone with that seed,
  however it was batched, chunked or preempted."""
  return jax.random.fold_in(jax.random.key(seed), index)


def sample_rows(logits: Float[Array, "B V"], seeds: Int[Array, "B"], index: Int[Array, "B"],
                temperature: Float[Array, "B"], top_p: Float[Array, "B"],
                top_k: Int[Array, "B"], min_p: Float[Array, "B"] | None = None
                ) -> Int[Array, "B"]:
  """``sample_logits`` with settings of its own for each row: row ``i`` gets exactly what
  ``sample_logits(logits[i:i + 1], token_key(seeds[i], index[i]), temperature=temperature[i],
  top_p=top_p[i], top_k=top_k[i], min_p=min_p[i])`` gives (greedy where ``temperature[i] ==
  0``; ``min_p`` None: 0 for every row).  The settings are arrays (traced, one compiled program
  for any mix); they are not validated here (``check_sampling`` them first)."""
  if jnp.ndim(logits) != 2:
    raise ValueError(f"`logits` must be [B, V], got shape {jnp.shape(logits)}.")
  b = logits.shape[0]
  min_p = jnp.zeros((b,), jnp.float32) if min_p is None else min_p
  for name, x in (("seeds", seeds), ("index", index), ("temperature", temperature),
                  ("top_p", top_p), ("top_k", top_k), ("min_p", min_p)):
    if jnp.shape(x) != (b,):
      raise ValueError(f"`{name}` must be [B={b}], got shape {jnp.shape(x)}.")
  return jax.vmap(_sample_row)(logits.astype(jnp.float32), seeds, index, temperature, top_p,
                               top_k, min_p)


def _sample_row(logits, seed, index, temperature, top_p, top_k, min_p):
  """One row of ``sample_rows``: ``sample_logits``'s steps with traced settings."""
  greedy = jnp.argmax(logits).astype(jnp.int32)
  sampled = jax.random.categorical(token_key(seed, index),
                                   row_filtered(logits, temperature, top_p, top_k, min_p))
  return jnp.where(temperature > 0, sampled.astype(jnp.int32), greedy)


def row_filtered(logits: Float[Array, "V"], temperature, top_p, top_k,
                 min_p=0.0) -> Float[Array, "V"]:
  """``filtered_logits`` of one row ``[V]`` with traced settings (a ``temperature`` of 0 is
  taken as 1 here: the caller picks the argmax for such rows)."""
  v = logits.shape[-1]
  top = jnp.max(logits)
  shifted = logits - jnp.where(jnp.isfinite(top), top, 0.0)
  x = jnp.where(shifted == 0, 0.0, shifted / jnp.where(temperature > 0, temperature, 1.0))
  # One sort serves both filters: top-k sends only values below the k-th to -inf, already the
  # tail of this order, so the kept tokens' order (and their cumulative mass) is unchanged.
  order = jnp.argsort(-x)
  kth = x[order[jnp.clip(top_k - 1, 0, v - 1)]]
  x = jnp.where((top_k > 0) & (top_k < v) & (x < kth), -jnp.inf, x)
  probs = jax.nn.softmax(x[order])
  keep = jnp.zeros((v,), bool).at[order].set(jnp.cumsum(probs) - probs < top_p)
  x = jnp.where((top_p < 1.0) & ~keep, -jnp.inf, x)
  return jnp.where(x < jnp.log(min_p), -jnp.inf, x)     # (log 0 = -inf: nothing below it)


def _check(model, prompt, max_new_tokens, max_len, eos_id=None):
  prompt = np.asarray(prompt)
  if prompt.ndim != 2 or prompt.shape[1] < 1:
    raise ValueError(f"`prompt` must be [B, T] token ids with T >= 1, got shape {prompt.shape}.")
  if not np.issubdtype(prompt.dtype, np.integer):
    raise ValueError(f"`prompt` must hold integer token ids, got dtype {prompt.dtype}.")
  vocab = model.config.vocab_size
  if prompt.min() < 0 or prompt.max() >= vocab:
    bad = prompt[(prompt < 0) | (prompt >= vocab)]
    raise ValueError(f"`prompt` token ids must be in [0, {vocab}) (vocab_size), got "
                     f"{sorted(set(bad.tolist()))[:8]}.")
  if (not isinstance(max_new_tokens, (int, np.integer)) or isinstance(max_new_tokens, bool)
      or max_new_tokens < 0):
    raise ValueError(f"`max_new_tokens` must be an int >= 0, got {max_new_tokens!r}.")
  if max_len is not None and (not is_int(max_len) or max_len < 1):
    raise ValueError(f"`max_len` must be an int >= 1 or None (default capacity), got {max_len!r}.")
  if eos_id is not None and (not is_int(eos_id) or not 0 <= eos_id < vocab):
    raise ValueError(f"`eos_id` must be None or one token id, an int in [0, {vocab}) "
                     f"(vocab_size), got {eos_id!r}.")
  # The last sampled token is returned, never fed back: T + n - 1 positions are attended.
  need = prompt.shape[1] + max(int(max_new_tokens) - 1, 0)
  if max_len is not None and max_len < need:
    raise ValueError(f"`max_len` ({max_len}) is below prompt length + max_new_tokens - 1 "
                     f"({need}), the positions the cache must hold.")
  if model.config.position == "learned" and need > model.config.max_seq_len:
    raise ValueError(f"prompt length + max_new_tokens - 1 = {need} exceeds the learned position "
                     f"table (max_seq_len={model.config.max_seq_len}).")


def eval_model(graphdef, state) -> DecoderLM:
  """The model of a split ``(graphdef, state)`` (``nnx.split(model)``), in eval mode: no dropout
  while decoding (a LoRA adapter trained with dropout, say).  What every jitted decode program
  (here, ``jaxattn.speculative``, ``jaxattn.serving``) starts with."""
  m = nnx.merge(graphdef, state)
  m.eval()
  return m


@functools.lru_cache(maxsize=32)
def decode_functions(graphdef, batch: int, max_len: int, *, temperature: float = 0.0,
                     top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, cache_dtype=None,
                     penalties: tuple[float, float, float] | None = None):
  """The two jitted programs of ``generate`` for a split model (``nnx.split(model)``), made once
  per graph definition, batch, capacity and sampling settings (so later ``generate`` calls on a
  model of the same structure reuse them and their compiled programs; a new prompt length
  compiles only its prefill):

  * ``prefill(state, tokens [B, T], key) -> (next [B], cache)`` with a fresh cache of ``max_len``
    (in ``cache_dtype``; None: the model's compute dtype);
  * ``step(state, token [B], cache, key) -> (next [B], cache)``, one token per sequence.

  ``step`` donates its cache: the new token's keys are written into the same buffers (without
  donation XLA allocates a new cache and copies all of it, every layer, on every token).  The
  cache passed to ``step`` is therefore consumed; use the returned one.

  ``penalties``: ``(repetition, presence, frequency)`` (``penalized_logits``); then the programs
  also carry the penalty state ``(seen [B, V] bool, counts [B, V] int32)``: ``prefill(state,
  tokens, key) -> (next, cache, pstate)`` and ``step(state, token, cache, pstate, key) -> (next,
  cache, pstate)``, each sampled token counted before the next draw (``pstate`` donated too).
  """
  sample = functools.partial(sample_logits, temperature=temperature, top_p=top_p, top_k=top_k,
                             min_p=min_p)
  if penalties is not None:
    rep, presence, frequency = penalties
    penalize = functools.partial(penalized_logits, repetition_penalty=rep,
                                 presence_penalty=presence, frequency_penalty=frequency)

    def counted(pstate, token):  # the sampled token joins the seen set and the counts
      return penalty_add(pstate, token[:, None])

  @jax.jit
  def prefill(state, tokens, key):
    m = eval_model(graphdef, state)
    logits, cache = m(tokens, cache=m.init_cache(batch, max_len, cache_dtype))
    if penalties is None:
      return sample(logits[:, -1], key), cache
    pstate = penalty_start(tokens, logits.shape[-1])
    token = sample(penalize(logits[:, -1], *pstate), key)
    return token, cache, counted(pstate, token)

  if penalties is None:
    @functools.partial(jax.jit, donate_argnums=2)
    def step(state, token, cache, key):
      m = eval_model(graphdef, state)
      logits, cache = m(token[:, None], cache=cache)
      return sample(logits[:, -1], key), cache
  else:
    @functools.partial(jax.jit, donate_argnums=(2, 3))
    def step(state, token, cache, pstate, key):
      m = eval_model(graphdef, state)
      logits, cache = m(token[:, None], cache=cache)
      token = sample(penalize(logits[:, -1], *pstate), key)
      return token, cache, counted(pstate, token)

  return prefill, step


def generate(model: DecoderLM, prompt: Int[Array, "B T"], max_new_tokens: int, *,
             temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
             seed: int = 0, max_len: int | None = None, eos_id: int | None = None,
             on_token: Callable[[np.ndarray], None] | None = None,
             cache_dtype=None, draft=None, num_draft_tokens: int = 4,
             repetition_penalty: float = 1.0, presence_penalty: float = 0.0,
             frequency_penalty: float = 0.0) -> np.ndarray:
  """``prompt [B, T]`` (equal lengths) -> ``[B, T + n]`` token ids, ``n <= max_new_tokens``.

  Prefill runs the prompt through ``model`` with a fresh cache of ``max_len`` slots (default:
  ``T + max_new_tokens`` rounded up to a multiple of 128; slots past the tokens are masked), then
  each step decodes one token per sequence (``sample_logits``: greedy at temperature 0, else
  top-k, then top-p, then min-p; generated token ``i`` draws with ``token_key(seed, i)``).
  ``on_token`` receives each new ``[B]`` array as soon as it is sampled (streaming).  With
  ``eos_id``, a sequence that has produced it is finished: its later positions hold ``eos_id``
  (as padding), and generation stops when every sequence has finished.  ``cache_dtype``: the KV
  cache's dtype (None: the model's compute dtype); ``jnp.int8`` or ``jnp.float8_e4m3fn`` quantize
  keys and values (a scale per token and KV head), about half the bytes of a bf16 cache.

  ``draft``: speculative decoding (``jaxattn.speculative.speculative_generate``, whose statistics
  this drops): a smaller ``DecoderLM`` of the same vocabulary, ``"ngram"`` (prompt lookup) or
  ``"mtp"`` (the model's multi-token prediction) proposes ``num_draft_tokens`` tokens that the
  model checks in one call.  Greedy output is the
  same; sampled output has the same distribution (other draws).

  ``repetition_penalty`` (1: none), ``presence_penalty`` and ``frequency_penalty`` (0: none):
  ``penalized_logits`` on every step's logits before temperature and the filters; the counts hold
  the sampled tokens (a finished sequence's no longer matter).  With ``draft`` too (each draft
  and checked position penalized as if the drafts before it had been emitted).
  """
  check_penalties(repetition_penalty, presence_penalty, frequency_penalty)
  penalties = (float(repetition_penalty), float(presence_penalty), float(frequency_penalty))
  penalized = penalties != NO_PENALTIES
  if draft is not None:
    from jaxattn.speculative import speculative_generate
    return speculative_generate(model, prompt, max_new_tokens, draft=draft,
                                num_draft_tokens=num_draft_tokens, temperature=temperature,
                                top_p=top_p, top_k=top_k, min_p=min_p, seed=seed,
                                max_len=max_len, eos_id=eos_id, on_token=on_token,
                                cache_dtype=cache_dtype, repetition_penalty=repetition_penalty,
                                presence_penalty=presence_penalty,
                                frequency_penalty=frequency_penalty)[0]
  check_sampling(temperature, top_p, top_k, min_p)
  _check(model, prompt, max_new_tokens, max_len, eos_id)
  if not is_int(seed):
    raise ValueError(f"`seed` must be an int, got {seed!r}.")
  prompt = jnp.asarray(prompt, jnp.int32)
  b, t = prompt.shape
  max_new_tokens = int(max_new_tokens)
  # Default capacity: what is needed, rounded up to whole 128-token blocks, so that on TPU the
  # decode kernel reads the cache as pages of itself (lengths a multiple of 16; 128+ per page).
  if max_len is None:
    max_len = -(-(t + max_new_tokens) // 128) * 128
  graphdef, state = nnx.split(model)
  # (cache_dtype passed only when set: the cached functions' key is the call's keywords)
  quant = ({} if cache_dtype is None else
           dict(cache_dtype=check_cache_dtype(cache_dtype, "generate", "cache_dtype")))
  if penalized:  # (passed only when set, as cache_dtype)
    quant["penalties"] = penalties
  prefill, step = decode_functions(graphdef, b, max_len, temperature=temperature, top_p=top_p,
                                   top_k=int(top_k), min_p=float(min_p), **quant)
  out = [np.asarray(prompt)]
  if max_new_tokens == 0:
    return out[0]
  token, cache, *pstate = prefill(state, prompt, token_key(seed, 0))
  done = np.zeros((b,), bool)
  for i in range(max_new_tokens):
    host = np.asarray(token)
    if eos_id is not None:
      host = np.where(done, eos_id, host).astype(host.dtype)  # finished rows: padding
    out.append(host[:, None])
    if on_token is not None:
      on_token(host)
    if eos_id is not None:
      done |= host == eos_id
      if done.all():
        break
      token = jnp.asarray(host)
    if i + 1 < max_new_tokens:
      token, cache, *pstate = step(state, token, cache, *pstate, token_key(seed, i + 1))
  return np.concatenate(out, axis=1)
