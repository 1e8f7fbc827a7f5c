"""Speculative decoding: a cheap draft proposes ``k`` tokens, the model checks them in one call.

    out, stats = speculative_generate(model, prompt, 128, draft=small_model, num_draft_tokens=4)
    out, stats = speculative_generate(model, prompt, 128, draft="ngram")   # prompt lookup
    out = generate(model, prompt, 128, draft="ngram")                     # the same, tokens only
    out, stats = speculative_generate(mtp_model, prompt, 128, draft="mtp")  # self-speculation

Each round the draft proposes ``d_1 .. d_k`` after the last token ``x_n``; the model runs
``[x_n, d_1, .., d_k]`` through its cache as one chunk (``k + 1`` positions, one call: decode is
memory-bound, so this costs about what one token does) and keeps the longest prefix of drafts it
agrees with, plus one token of its own: between 1 and ``k + 1`` tokens per call.  The caches are
then rewound to the kept tokens (``rewind_cache``: a contiguous cache's slots past its index are
masked, so rewinding is setting the index).

* Greedy (``temperature == 0``): a draft is kept while it equals the model's argmax; the output is
  exactly ``generate``'s (the same argmaxes, computed over chunks).
* Sampling: speculative sampling (Leviathan et al. 2023; Chen et al. 2023).  Draft ``d_j`` drawn
  from the draft's distribution ``q_j`` is kept with probability ``min(1, p_j(d_j) / q_j(d_j))``,
  ``p_j`` the model's; at the first rejection a token is drawn from ``max(p_j - q_j, 0)``
  (normalized), and after ``k`` kept drafts from ``p_{k+1}``.  Every emitted token is then
  distributed exactly as sampling the model alone (``p`` and ``q`` are the temperature / top-k /
  top-p filtered distributions ``generate`` samples from), whatever the draft; a better draft only
  keeps more tokens per call.  The tokens differ from ``generate``'s with the same seed (other
  random numbers), their distribution does not.
* Repetition / presence / frequency penalties: draft ``d_j`` is proposed, and the check's
  position ``j`` judged, with the penalty state the sequence would have after ``d_1 .. d_{j-1}``
  / ``d_1 .. d_j`` were emitted (``_Penalties``), so both statements above still hold.

Drafts: a ``DecoderLM`` with the same vocabulary (a smaller model; it keeps a cache of its own,
rewound with the model's), or ``"ngram"``: prompt lookup, no model at all: the last ``ngram_size``
tokens (down to 1) are looked up in the sequence so far and the tokens that followed their latest
earlier occurrence are proposed (repeating with that period where they run into the present);
strong where the output copies its input (code edits, extraction, summaries with quotes).  Or
``"mtp"``: the model's own multi-token-prediction module (``ModelConfig.mtp_depth >= 1``,
``jaxattn.nn.mtp``; DeepSeek-V3's inference use of it): depth 1 reads the model's last hidden
state and the token just chosen and proposes the one after, then chains on its own output for the
rest (``_mtp_functions``); no second model, one small block per draft.

Rows of a batch advance together: a round keeps the fewest tokens any unfinished row agreed on (a
row that agreed on more gets its own next token from that shorter prefix, which is still exact),
so batches of unlike sequences gain less than batch 1.  A Gated DeltaNet layer's recurrent state
cannot be rewound by an index: the check call asks it for its state after each of the ``k + 1``
tokens (``ModelCache.with_snapshots``; computed token by token, as decode steps) and the rewind
keeps the one after the last kept token, so hybrid models (Qwen3-Next) speculate too; a draft
model must still be rewindable by its index.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from jaxattn.cache import KVCache
from jaxattn.checks import is_int
from jaxattn.dsa_cache import DSACache
from jaxattn.generation import (NO_PENALTIES, _check, after_each, check_penalties, check_sampling,
                                eval_model, filtered_logits, penalized_logits, penalty_add,
                                penalty_start, row_filtered, token_key)
from jaxattn.mla_cache import LatentCache
from jaxattn.nn.gated_deltanet import DeltaNetCache
from jaxattn.nn.model import DecoderLM, ModelCache
from jaxattn.ops.quantization import check_cache_dtype

_CACHE_TYPES = (KVCache, LatentCache, DSACache)


@dataclasses.dataclass
class SpeculativeStats:
  """What the rounds of one ``speculative_generate`` call did.

  ``rounds``: model calls after the prefill (each verifies ``num_draft_tokens`` drafts);
  ``drafted`` / ``accepted``: drafts proposed / kept (rows advance together: a round's kept count
  is the smallest over unfinished rows); ``emitted``: tokens generated after the prefill's first.
  """

  rounds: int = 0
  drafted: int = 0
  accepted: int = 0
  emitted: int = 0

  @property
  def acceptance_rate(self) -> float:
    """Kept drafts / proposed drafts."""
    return self.accepted / self.drafted if self.drafted else 0.0

  @property
  def tokens_per_call(self) -> float:
    """Tokens generated per model call after the prefill (1.0 without speculation)."""
    return self.emitted / self.rounds if self.rounds else 0.0


def rewind_cache(cache: ModelCache, index: Int[Array, ""]) -> ModelCache:
  """``cache`` holding its first ``index`` positions only (``index`` <= what it holds): every
  layer's index set back.  The slots past it keep their contents, masked as any slot past the
  index is, and are overwritten by the next call.  A Gated DeltaNet layer's state is taken from
  the snapshots of the last call (``ModelCache.with_snapshots`` before it; ``index`` within that
  call's tokens).  Raises ``ValueError`` for caches that cannot be rewound (a Gated DeltaNet state
  without snapshots, a ring buffer)."""
  if not isinstance(cache, ModelCache):
    raise ValueError(f"`cache` must be a ModelCache (DecoderLM.init_cache), got "
                     f"{type(cache).__name__}.")

  def one(c):
    if isinstance(c, DSACache):
      return dataclasses.replace(c, latent=one(c.latent))
    if isinstance(c, (KVCache, LatentCache)):
      return dataclasses.replace(c, index=jnp.full_like(c.index, index))
    if isinstance(c, DeltaNetCache) and c.snapshots:
      t = c.state.shape[-4] - 1    # the last call's tokens: cache.index - t .. cache.index - 1
      return c.at(jnp.clip(index - cache.index + t, 0, t))
    raise ValueError(f"speculative decoding rewinds the cache to the kept tokens; a "
                     f"{type(c).__name__} cannot be rewound by its index (KVCache, LatentCache "
                     f"and DSACache can, and a DeltaNetCache with snapshots of the last call).")

  groups = tuple(tuple(one(c) for c in group) for group in cache.groups)
  return ModelCache(groups, jnp.asarray(index, jnp.int32))


def check_rewindable(model: DecoderLM, where: str, *, snapshots: bool = False) -> None:
  """Raises ``ValueError`` unless ``model``'s decode cache can be rewound (``rewind_cache``);
  ``snapshots``: Gated DeltaNet states count (the caller takes per-token snapshots)."""
  types = _CACHE_TYPES + ((DeltaNetCache,) if snapshots else ())
  abstract = jax.eval_shape(lambda: model.init_cache(1, 8))
  for group in abstract.groups:
    for c in group:
      if not isinstance(c, types):
        raise ValueError(f"{where}: the model has layers whose decode state is a "
                         f"{type(c).__name__} (a recurrent state, not a cache of positions); it "
                         f"cannot be rewound to the kept tokens, so speculative decoding is not "
                         f"available for it.")


def _leading_true(accept: Array) -> Int[Array, "B"]:
  """How many leading entries of each row of ``accept [B, k]`` are True."""
  return jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def speculative_accept(logits: Float[Array, "B k1 V"], drafts: Int[Array, "B k"],
                       draft_probs: Float[Array, "B k V"] | None, key, *,
                       temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                       min_p: float = 0.0) -> tuple[Int[Array, "B k1"], Int[Array, "B"]]:
  """The model's verdict on ``k`` drafted tokens: ``(tokens [B, k + 1], accepted [B])``.

  ``logits [B, k + 1, V]``: the model's at ``[x_n, d_1, .., d_k]`` (position ``j`` predicts the
  token after ``d_j``); ``draft_probs [B, k, V]``: the distributions the drafts were drawn from
  (filtered as here; one-hot for a deterministic draft; unused when greedy).  ``accepted[b]``
  drafts are kept; ``tokens[b, :accepted[b]]`` are those drafts and ``tokens[b, accepted[b]]``
  the model's own next token (see the module docstring); later entries are the drafts, which a
  caller keeping fewer tokens than ``accepted[b] + 1`` may emit (a kept draft is a valid token).
  """
  check_sampling(temperature, top_p, top_k, min_p)
  b, k1, v = logits.shape
  k = k1 - 1
  if drafts.shape != (b, k):
    raise ValueError(f"`drafts` must be [B={b}, k={k}] (one fewer than the logits' positions), "
                     f"got shape {drafts.shape}.")
  if temperature == 0.0:
    best = jnp.argmax(logits.astype(jnp.float32), axis=-1).astype(jnp.int32)
    return best, _leading_true(drafts == best[:, :k])
  if draft_probs is None or draft_probs.shape != (b, k, v):
    raise ValueError(f"`draft_probs` must be [B={b}, k={k}, V={v}] when sampling, got "
                     f"{None if draft_probs is None else draft_probs.shape}.")
  p = jax.nn.softmax(filtered_logits(logits, temperature=temperature, top_p=top_p, top_k=top_k,
                                     min_p=min_p), axis=-1)
  q = draft_probs.astype(jnp.float32)
  pick = lambda dist: jnp.take_along_axis(dist, drafts[..., None], axis=-1)[..., 0]  # noqa: E731
  key_u, key_c = jax.random.split(key)
  u = jax.random.uniform(key_u, (b, k))
  accepted = _leading_true(u * pick(q) < pick(p[:, :k]))     # u < p(d) / q(d), q(d) > 0
  residual = jnp.maximum(p[:, :k] - q, 0.0)
  mass = jnp.sum(residual, axis=-1, keepdims=True)
  # p == q leaves no residual mass; then no draft is ever rejected (u < 1), p is only a stand-in.
  residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p[:, :k])
  last = jnp.concatenate([residual, p[:, k:]], axis=1)          # [B, k + 1, V]
  dist = jnp.take_along_axis(last, accepted[:, None, None], axis=1)[:, 0]
  own = jax.random.categorical(key_c, jnp.log(dist), axis=-1).astype(jnp.int32)
  tokens = jnp.concatenate([drafts, drafts[:, :1]], axis=1).astype(jnp.int32)
  tokens = tokens.at[jnp.arange(b), accepted].set(own)
  return tokens, accepted


def ngram_propose(tokens, k: int, ngram_size: int = 3) -> np.ndarray:
  """Prompt-lookup drafts for one sequence ``tokens [n + 1]`` (host side, numpy): for ``g =
  ngram_size .. 1`` its last ``g`` tokens are looked for earlier in it; at the first ``g``
  found, the latest occurrence's continuation is proposed, ``k`` tokens, repeating with the
  period that occurrence implies where it reaches the present.  With no match, the last token
  ``k`` times.  Returns ``[k]`` int32."""
  tokens = np.asarray(tokens, np.int32).reshape(-1)
  n = tokens.size - 1
  for g in range(min(ngram_size, n), 0, -1):
    # windows starting at 0 .. n - g: occurrences ending before the last token
    windows = np.lib.stride_tricks.sliding_window_view(tokens[:n], g)
    hits = np.flatnonzero((windows == tokens[n + 1 - g:]).all(axis=1))
    if hits.size:
      start = int(hits[-1]) + g
      return tokens[start + np.arange(k) % (n + 1 - start)]
  return np.full((k,), tokens[-1], np.int32)


def _draft_dist(logits, key, temperature, top_p, top_k, min_p):
  """A draft token from the draft's last logits ``[B, V]`` and the distribution it came from."""
  if temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), None
  f = filtered_logits(logits, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
  return (jax.random.categorical(key, f, axis=-1).astype(jnp.int32),
          jax.nn.softmax(f, axis=-1))


class _Penalties:
  """Repetition / presence / frequency penalties (``generation.penalized_logits``) through
  speculative rounds.  The state ``(seen [B, V] bool, counts [B, V] int32)`` holds the tokens
  emitted so far (the prompt's seen, not counted); a draft ``d_j`` and the model's check at
  position ``j`` of ``[x_n, d_1, .., d_k]`` are penalized as the sequence would be after
  ``d_1 .. d_j`` (the state of a step of ``generate`` that had emitted them), so greedy output is
  ``generate``'s with the same penalties and sampling keeps its distribution (the check's ``p``
  and the draft's ``q`` are the penalized ones).  ``settings`` None: no penalties, every method
  the identity (the state is None)."""

  def __init__(self, settings: tuple[float, float, float] | None):
    self.on = settings is not None
    if self.on:
      rep, presence, frequency = settings
      self.apply = functools.partial(penalized_logits, repetition_penalty=rep,
                                     presence_penalty=presence, frequency_penalty=frequency)

  def start(self, prompt, vocab_size: int):
    """The state after the prompt (``generation.penalty_start``)."""
    return penalty_start(prompt, vocab_size) if self.on else None

  def add(self, pstate, tokens, keep=None):
    """``pstate`` with ``tokens [B, m]`` emitted (those where ``keep [B, m]``, default all)."""
    return penalty_add(pstate, tokens, keep) if self.on else None

  def __call__(self, logits, pstate):
    """``logits [B, V]`` penalized with ``pstate``."""
    return logits if not self.on else self.apply(logits, *pstate)

  def check(self, logits, pstate, drafts):
    """The check's ``logits [B, k + 1, V]``: position ``j`` penalized with ``pstate`` after
    ``drafts[:, :j]`` (``drafts [B, k]``)."""
    return self.apply(logits, *after_each(*pstate, drafts)) if self.on else logits


@functools.lru_cache(maxsize=16)
def speculative_functions(graphdef, draft_graphdef, batch: int, max_len: int, k: int,
                          vocab_size: int, *, temperature: float = 0.0,
                          top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
                          cache_dtype=None, penalties: tuple[float, float, float] | None = None):
  """The jitted programs of ``speculative_generate`` (made once per structure and settings):

  * ``prefill(state, draft_state, prompt [B, T], key) -> (first [B], cache, draft_cache,
    pstate)``;
  * ``round(state, draft_state, cache, draft_cache, pstate, recent [B, 2], n, drafts [B, k],
    done [B], key) -> (tokens [B, k + 1], kept, accepted [B], cache, draft_cache, pstate)``:
    ``recent`` the sequence's tokens ``n - 1`` and ``n`` (the model's cache holds its first
    ``n``; the last one is fed now, the draft re-reads both), ``drafts`` the prompt-lookup
    drafts (unused with a draft model, which drafts here), ``kept + 1`` tokens of
    ``tokens`` are emitted (``kept``: the fewest drafts an unfinished row kept), the model's
    cache rewound to ``n + kept + 1`` positions.  The caches are donated.

  ``draft_graphdef`` None: prompt-lookup drafts (``ngram_propose``, made on the host).
  ``penalties``: ``(repetition, presence, frequency)`` (``_Penalties``); ``pstate`` is their
  state after the emitted tokens (None without penalties).
  """
  settings = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
  pen = _Penalties(penalties)

  if draft_graphdef == "mtp":
    return _mtp_functions(graphdef, batch, max_len, k, settings, cache_dtype, pen)

  @jax.jit
  def prefill(state, draft_state, prompt, key):
    m = eval_model(graphdef, state)
    logits, cache = m(prompt, cache=m.init_cache(batch, max_len, cache_dtype))
    pstate = pen.start(prompt, vocab_size)
    first = _draft_dist(pen(logits[:, -1], pstate), key, **settings)[0]
    draft_cache = None
    if draft_graphdef is not None:
      d = eval_model(draft_graphdef, draft_state)
      _, draft_cache = d(prompt, cache=d.init_cache(batch, max_len, cache_dtype))
    return first, cache, draft_cache, pen.add(pstate, first[:, None])

  @functools.partial(jax.jit, donate_argnums=(2, 3, 4))
  def round_(state, draft_state, cache, draft_cache, pstate, recent, n, drafts, done, key):
    last = recent[:, 1]
    if draft_graphdef is None:
      probs = jax.nn.one_hot(drafts, vocab_size, dtype=jnp.float32)
    else:
      d = eval_model(draft_graphdef, draft_state)
      # The draft's cache holds x_0 .. x_{n-2} at least (it has not seen the last round's final
      # kept draft when every draft was kept): it re-reads x_{n-1} with x_n, a fixed shape.
      draft_cache = rewind_cache(draft_cache, n - 1)
      logits, draft_cache = d(recent, cache=draft_cache)
      drafts, probs, ahead = [], [], pstate    # ahead: the penalties' state after the drafts
      for j in range(k):
        tok, q = _draft_dist(pen(logits[:, -1], ahead), jax.random.fold_in(key, j), **settings)
        drafts.append(tok)
        probs.append(q)
        if j + 1 < k:
          ahead = pen.add(ahead, tok[:, None])
          logits, draft_cache = d(tok[:, None], cache=draft_cache)
      drafts = jnp.stack(drafts, axis=1)
      probs = None if temperature == 0.0 else jnp.stack(probs, axis=1)
    m = eval_model(graphdef, state)
    logits, cache = m(jnp.concatenate([last[:, None], drafts], axis=1),
                      cache=cache.with_snapshots())
    tokens, accepted = speculative_accept(pen.check(logits, pstate, drafts), drafts, probs,
                                          jax.random.fold_in(key, k), **settings)
    kept = jnp.min(jnp.where(done, k, accepted))
    cache = rewind_cache(cache, n + kept + 1)    # (the draft's is rewound by the next round)
    return tokens, kept, accepted, cache, draft_cache, _emitted(pen, pstate, tokens, kept)

  return prefill, round_


def _emitted(pen: _Penalties, pstate, tokens, kept):
  """The penalties' state after a round emits ``tokens[:, :kept + 1]``."""
  return pen.add(pstate, tokens, jnp.arange(tokens.shape[1])[None, :] <= kept)


def _mtp_run(m: DecoderLM, tokens, h_prev, mtp_cache: ModelCache):
  """Depth 1 of ``m``'s multi-token prediction continuing ``mtp_cache`` (``mtp_decode``): pairs
  ``(h_prev [B, T, D], tokens [B, T])`` (the hidden state at a position and the token after it)
  -> ``(h [B, T, D], logits [B, T, V], cache)``; position ``i``'s logits predict token ``i + 2``."""
  h, mtp_cache = m.mtp_decode(h_prev, tokens, mtp_cache)
  return h, m.mtp_logits(m.mtp[0], h), mtp_cache


def _mtp_functions(graphdef, batch: int, max_len: int, k: int, settings: dict, cache_dtype,
                   pen: _Penalties):
  """``speculative_functions`` with the model's own multi-token prediction as the draft
  (self-speculation).  The draft state is ``(cache, h [B, 1, D], logits [B, V])``: the depth-1
  module's cache holds the pairs ``(h_i, x_{i+1})`` of every position before the model's last
  token ``x_n``, and ``h`` / ``logits`` are its output at position ``n - 1``, whose logits
  predict ``x_{n+1}``: the first draft.  Later drafts chain the module on its own output
  (position ``n + j`` reads the module's hidden state in place of the model's, which is not
  known yet).  After the model's check the module's cache is rewound to ``n`` and re-reads the
  model's true hidden states with the tokens that followed them (``k + 1`` positions at once,
  those past the kept ones are rewound away): its output at the last kept position is the next
  round's first draft (penalized, as every draft and check, with ``pen``'s state)."""

  @jax.jit
  def prefill(state, draft_state, prompt, key):
    del draft_state
    m = eval_model(graphdef, state)
    h, cache = m(prompt, cache=m.init_cache(batch, max_len, cache_dtype), return_hidden=True)
    pstate = pen.start(prompt, m.config.vocab_size)
    first = _draft_dist(pen(m.head(h[:, -1]).astype(jnp.float32), pstate), key, **settings)[0]
    mtp_cache = m.init_mtp_cache(batch, max_len, cache_dtype)
    ahead = jnp.concatenate([prompt[:, 1:], first[:, None]], axis=1)
    g, logits, mtp_cache = _mtp_run(m, ahead, h, mtp_cache)
    return first, cache, (mtp_cache, g[:, -1:], logits[:, -1]), pen.add(pstate, first[:, None])

  @functools.partial(jax.jit, donate_argnums=(2, 3, 4))
  def round_(state, draft_state, cache, draft_cache, pstate, recent, n, drafts, done, key):
    del draft_state, drafts
    m = eval_model(graphdef, state)
    mtp_cache, g, logits = draft_cache
    drafts, probs, ahead = [], [], pstate
    tok, q = _draft_dist(pen(logits, ahead), jax.random.fold_in(key, 0), **settings)
    for j in range(k):
      drafts.append(tok)
      probs.append(q)
      if j + 1 < k:     # position n + j: the module's own output stands for the model's
        ahead = pen.add(ahead, tok[:, None])
        g, lg, mtp_cache = _mtp_run(m, tok[:, None], g, mtp_cache)
        tok, q = _draft_dist(pen(lg[:, -1], ahead), jax.random.fold_in(key, j + 1), **settings)
    drafts = jnp.stack(drafts, axis=1)
    probs = None if settings["temperature"] == 0.0 else jnp.stack(probs, axis=1)
    h, cache = m(jnp.concatenate([recent[:, 1:], drafts], axis=1),
                 cache=cache.with_snapshots(), return_hidden=True)
    tokens, accepted = speculative_accept(pen.check(m.head(h).astype(jnp.float32), pstate, drafts),
                                          drafts, probs, jax.random.fold_in(key, k), **settings)
    kept = jnp.min(jnp.where(done, k, accepted))
    cache = rewind_cache(cache, n + kept + 1)
    # the model's hidden state at n + j with the token after it (tokens[:, j]), j <= kept
    g, lg, mtp_cache = _mtp_run(m, tokens, h, rewind_cache(mtp_cache, n))
    g = jax.lax.dynamic_slice_in_dim(g, kept, 1, axis=1)
    lg = jax.lax.dynamic_index_in_dim(lg, kept, axis=1, keepdims=False)
    return (tokens, kept, accepted, cache, (rewind_cache(mtp_cache, n + kept + 1), g, lg),
            _emitted(pen, pstate, tokens, kept))

  return prefill, round_


def speculative_generate(model: DecoderLM, prompt: Int[Array, "B T"], max_new_tokens: int, *,
                         draft: DecoderLM | str = "ngram", num_draft_tokens: int = 4,
                         ngram_size: int = 3, temperature: float = 0.0, top_p: float = 1.0,
                         top_k: int = 0, min_p: float = 0.0, seed: int = 0,
                         max_len: int | None = None, eos_id: int | None = None,
                         on_token: Callable[[np.ndarray], None] | None = None,
                         cache_dtype=None, repetition_penalty: float = 1.0,
                         presence_penalty: float = 0.0, frequency_penalty: float = 0.0
                         ) -> tuple[np.ndarray, SpeculativeStats]:
  """``generate`` with speculative decoding (module docstring): ``(tokens [B, T + n], stats)``.

  ``draft``: a ``DecoderLM`` with ``model``'s vocabulary, ``"ngram"`` (prompt lookup, the last
  ``ngram_size`` tokens down to 1) or ``"mtp"`` (the model's multi-token prediction, depth 1);
  ``num_draft_tokens`` (``k``) drafts per round.  The other
  arguments are ``generate``'s: greedy output equals ``generate``'s token for token; sampled
  output has its distribution.  ``max_len`` (default: ``T + max_new_tokens + k`` rounded up to
  128) must leave room for a round's ``k + 1`` positions past the last kept token.
  ``on_token`` receives each emitted ``[B]`` array in order.  ``repetition_penalty`` /
  ``presence_penalty`` / ``frequency_penalty``: ``generate``'s; each draft and each position of
  the check is penalized as the sequence would be with the drafts before it emitted
  (``_Penalties``), so greedy output is still ``generate``'s and sampling its distribution.
  """
  check_sampling(temperature, top_p, top_k, min_p)
  check_penalties(repetition_penalty, presence_penalty, frequency_penalty)
  penalties = (float(repetition_penalty), float(presence_penalty), float(frequency_penalty))
  _check(model, prompt, max_new_tokens, None, eos_id)
  where = "speculative_generate"
  if not is_int(seed):
    raise ValueError(f"`seed` must be an int, got {seed!r}.")
  if not is_int(num_draft_tokens) or not 1 <= num_draft_tokens <= 64:
    raise ValueError(f"`num_draft_tokens` must be an int in [1, 64], got {num_draft_tokens!r}.")
  if not is_int(ngram_size) or ngram_size < 1:
    raise ValueError(f"`ngram_size` must be an int >= 1, got {ngram_size!r}.")
  if isinstance(draft, str):
    if draft not in ("ngram", "mtp"):
      raise ValueError(f"`draft` must be a DecoderLM, 'ngram' (prompt lookup) or 'mtp' (the "
                       f"model's multi-token prediction), got {draft!r}.")
    if draft == "mtp" and not model.config.mtp_depth:
      raise ValueError("`draft='mtp'` drafts with the model's multi-token-prediction modules; "
                       "this model has none (mtp_depth=0).")
  elif isinstance(draft, DecoderLM):
    if draft.config.vocab_size != model.config.vocab_size:
      raise ValueError(f"`draft`'s vocab_size ({draft.config.vocab_size}) must equal the "
                       f"model's ({model.config.vocab_size}): drafts are the model's tokens.")
    check_rewindable(draft, f"{where} (draft)")
  else:
    raise ValueError(f"`draft` must be a DecoderLM, 'ngram' or 'mtp', got "
                     f"{type(draft).__name__}.")
  check_rewindable(model, where, snapshots=True)
  prompt = np.asarray(prompt).astype(np.int32)
  b, t = prompt.shape
  k, max_new_tokens = int(num_draft_tokens), int(max_new_tokens)
  need = t + max_new_tokens + k
  if max_len is None:
    max_len = -(-need // 128) * 128
  elif not is_int(max_len) or max_len < need:
    raise ValueError(f"`max_len` must be an int >= prompt length + max_new_tokens + "
                     f"num_draft_tokens = {need} (a round's drafts are cached before they are "
                     f"checked), got {max_len!r}.")
  cfg = model.config
  if cfg.position == "learned" and need > cfg.max_seq_len:
    raise ValueError(f"prompt length + max_new_tokens + num_draft_tokens = {need} exceeds the "
                     f"learned position table (max_seq_len={cfg.max_seq_len}).")
  quant = ({} if cache_dtype is None else
           dict(cache_dtype=check_cache_dtype(cache_dtype, where, "cache_dtype")))
  if penalties != NO_PENALTIES:   # (passed only when set, as cache_dtype)
    quant["penalties"] = penalties
  graphdef, state = nnx.split(model)
  if isinstance(draft, str):
    draft_graphdef, draft_state = (None if draft == "ngram" else draft), None
  else:
    draft_graphdef, draft_state = nnx.split(draft)
  prefill, round_ = speculative_functions(
      graphdef, draft_graphdef, b, int(max_len), k, cfg.vocab_size,
      temperature=float(temperature), top_p=float(top_p), top_k=int(top_k), min_p=float(min_p),
      **quant)
  stats = SpeculativeStats()
  if max_new_tokens == 0:
    return prompt, stats
  # the sequence so far (prompt lookup reads it), with room for a whole round
  context = np.zeros((b, max_len + k + 1), np.int32)
  context[:, :t] = prompt
  out, done = [prompt], np.zeros((b,), bool)

  def emit(tokens: np.ndarray) -> bool:
    """Appends ``tokens [B, m]`` one position at a time; True once generation is over."""
    nonlocal done
    for col in tokens.T:
      col = col.astype(np.int32)
      if eos_id is not None:
        col = np.where(done, eos_id, col).astype(np.int32)
      out.append(col[:, None])
      if on_token is not None:
        on_token(col)
      if eos_id is not None:
        done = done | (col == eos_id)
      if len(out) - 1 == max_new_tokens or done.all():
        return True
    return False

  first, cache, draft_cache, pstate = prefill(state, draft_state, jnp.asarray(prompt),
                                              token_key(seed, 0))
  first = np.asarray(first)
  finished = emit(first[:, None])
  n = t                                     # the last token's index (the cache holds n)
  context[:, n] = out[-1][:, 0]
  drafts = np.zeros((b, k), np.int32)
  while not finished:
    if draft_graphdef is None:
      drafts = np.stack([ngram_propose(row[:n + 1], k, ngram_size) for row in context])
    tokens, kept, _, cache, draft_cache, pstate = round_(
        state, draft_state, cache, draft_cache, pstate, jnp.asarray(context[:, n - 1:n + 1]),
        jnp.int32(n), jnp.asarray(drafts), jnp.asarray(done), token_key(seed, len(out) - 1))
    kept = int(kept)
    tokens = np.asarray(tokens)[:, :kept + 1]
    stats.rounds += 1
    stats.drafted += k
    stats.accepted += kept
    before = len(out)
    finished = emit(tokens)
    stats.emitted += len(out) - before
    context[:, n + 1:n + 1 + tokens.shape[1]] = tokens
    n += tokens.shape[1]
  return np.concatenate(out, axis=1), stats


def accept_rows(logits: Float[Array, "b T V"], drafts: Int[Array, "b k"],
                num_drafts: Int[Array, "b"], seeds: Int[Array, "b"], index: Int[Array, "b"],
                temperature: Float[Array, "b"], top_p: Float[Array, "b"], top_k: Int[Array, "b"],
                min_p: Float[Array, "b"] | None = None, *, greedy: bool = False,
                draft_probs: Float[Array, "b k V"] | None = None):
  """``speculative_accept`` for deterministic drafts (prompt lookup) with each row's own
  settings and draft count, its random numbers keyed by the row's seed and output index alone
  (``jaxattn.serving.Engine``: a request's tokens do not depend on its neighbours).

  ``logits [b, k + 1, V]`` at ``[x_n, d_1, .., d_k]``; row ``i`` drafted its first
  ``num_drafts[i]`` of ``drafts [b, k]``, whose first output has index ``index[i]``.  Returns
  ``(tokens [b, k + 1], accepted [b], logprob [b, k + 1])``: ``tokens[i, :accepted[i] + 1]``
  are emitted, ``logprob`` the model's log-probabilities of ``tokens`` (before temperature and
  filters).  With one-hot drafts, draft ``d`` at output ``m`` is kept when
  ``uniform(fold_in(token_key(seed, m), 1)) < p(d)``; the model's own token at output ``m`` is
  drawn with ``token_key(seed, m)`` from ``p`` without the rejected draft (all of ``p`` after the
  last draft): with no draft it is ``sample_rows``' token.  ``greedy`` (static): every row has
  temperature 0.  ``draft_probs [b, k, V]``: the distributions sampled drafts were drawn from
  (``propose_rows``; a greedy row's one-hot): a draft is kept when ``u < p(d) / q(d)``, and the
  token after the first rejected one is drawn from ``max(p - q, 0)`` normalized -- speculative
  sampling, the model's distribution whatever ``q``.  ``min_p`` None: 0 for every row."""
  b, t, v = logits.shape
  min_p = jnp.zeros((b,), jnp.float32) if min_p is None else min_p
  if drafts.shape != (b, t - 1) or t < 2:
    raise ValueError(f"`drafts` must be [b={b}, k={t - 1}] with k >= 1 (one fewer than the "
                     f"logits' positions), got shape {drafts.shape}.")
  logits = logits.astype(jnp.float32)
  best = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  within = jnp.arange(t - 1)[None, :] < num_drafts[:, None]
  if greedy:
    tokens, accepted = best, _leading_true((drafts == best[:, :-1]) & within)
  elif draft_probs is None:
    tokens, accepted = jax.vmap(_accept_row)(logits, best, drafts, within, num_drafts, seeds,
                                             index, temperature, top_p, top_k, min_p)
  else:
    if draft_probs.shape != (b, t - 1, v):
      raise ValueError(f"`draft_probs` must be [b={b}, k={t - 1}, V={v}], got shape "
                       f"{draft_probs.shape}.")
    tokens, accepted = jax.vmap(_accept_row)(logits, best, drafts, within, num_drafts, seeds,
                                             index, temperature, top_p, top_k, min_p,
                                             draft_probs.astype(jnp.float32))
  logprob = jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[..., None], axis=-1)[..., 0]
  return tokens, accepted, logprob


def propose_rows(logits: Float[Array, "b V"], seeds: Int[Array, "b"], index: Int[Array, "b"],
                 temperature: Float[Array, "b"], top_p: Float[Array, "b"], top_k: Int[Array, "b"],
                 min_p: Float[Array, "b"] | None = None
                 ) -> tuple[Int[Array, "b"], Float[Array, "b V"]]:
  """A draft per row from a proposer's logits ``[b, V]`` for the row's output ``index[i]``,
  with its own settings (``accept_rows``' ``draft_probs``): ``(drafts [b], q [b, V])``, ``q`` the
  filtered distribution sampled with ``fold_in(token_key(seed, index), 2)`` (independent of the
  acceptance draw and the model's own token); a greedy row's draft is the argmax, its ``q``
  one-hot (``min_p`` None: 0 for every row)."""
  best = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  min_p = jnp.zeros(best.shape, jnp.float32) if min_p is None else min_p

  def one(lg, b, seed, i, temp, p_, k_, m_):
    x = row_filtered(lg.astype(jnp.float32), temp, p_, k_, m_)
    key = jax.random.fold_in(token_key(seed, i), 2)
    d = jnp.where(temp > 0, jax.random.categorical(key, x).astype(jnp.int32), b)
    q = jnp.where(temp > 0, jax.nn.softmax(x), jax.nn.one_hot(b, lg.shape[-1]))
    return d, q

  return jax.vmap(one)(logits, best, seeds, index, temperature, top_p, top_k, min_p)


def _accept_row(logits, best, drafts, within, num_drafts, seed, index, temperature, top_p,
                top_k, min_p, q=None):
  """One row of ``accept_rows`` (sampling settings traced; temperature 0: greedy; ``q [k, V]``
  the drafts' distributions, None: one-hot)."""
  t, v = logits.shape
  x = jax.vmap(row_filtered, in_axes=(0, None, None, None, None))(logits, temperature, top_p,
                                                                  top_k, min_p)
  p = jax.nn.softmax(x, axis=-1)
  keys = jax.vmap(lambda i: token_key(seed, index + i))(jnp.arange(t))
  u = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 1)))(keys[:-1])
  pick = lambda dist: jnp.take_along_axis(dist, drafts[:, None], axis=-1)[:, 0]  # noqa: E731
  ratio_ok = u < pick(p[:-1]) if q is None else u * pick(q) < pick(p[:-1])
  kept = jnp.where(temperature > 0, ratio_ok, drafts == best[:-1])
  accepted = _leading_true((kept & within)[None])[0]
  rejected = jnp.where(accepted < num_drafts, drafts[jnp.minimum(accepted, t - 2)], -1)
  if q is None:          # p without the rejected draft
    own_logits = jnp.where(jnp.arange(v) == rejected, -jnp.inf, x[accepted])
  else:                  # max(p - q, 0) normalized after a rejection (p == q: none, keep p)
    residual = jnp.maximum(p[accepted] - q[jnp.minimum(accepted, t - 2)], 0.0)
    residual = jnp.where((rejected >= 0) & (jnp.sum(residual) > 0), residual, p[accepted])
    own_logits = jnp.log(residual)
  own = jnp.where(temperature > 0,
                  jax.random.categorical(keys[accepted], own_logits).astype(jnp.int32),
                  best[accepted])
  tokens = jnp.concatenate([drafts, drafts[:1]]).astype(jnp.int32).at[accepted].set(own)
  return tokens, accepted
