"""Continuous batching: many requests decoded together from one paged cache.

A static batch (``jaxattn.generation.generate``) starts its sequences together and holds every
slot until the longest is done: short requests idle, long prompts are padded.  ``Engine`` keeps a
fixed number of sequence slots busy instead.  Each step feeds every busy slot once: the slots
still reading their prompt feed up to ``chunk`` prompt tokens each (chunked prefill) in one jitted
model call with a ragged chunk (``DecoderLM(..., num_tokens=...)``), the decoding slots their last
sampled token in another (``T = 1``).  Each call runs on its slots alone (``PagedModelCache.take``
/ ``put``: their page-table rows and recurrent states; the page pools are shared), so a decoding
slot never computes a prefill chunk's rows.  A finished request's pages go back to the pool
(``PagedModelCache.free``) and the next waiting request takes its slot on the next step.

    engine = Engine(model, max_batch=8, page_size=16, chunk=64)
    ids = [engine.submit(p, max_new_tokens=128, eos_id=tok.eos_id) for p in prompts]
    results = engine.run(on_token=lambda rid, token: ...)       # {request id: prompt + generated}

Admission is first come, first served (among requests of one ``submit(..., priority=)``: lower
values go first, and preempt running requests of larger values when short of a slot or pages;
``priority_aging`` lowers a request's value as it waits, so none starves),
and by default reserves a request's whole page need up
front (prompt + ``max_new_tokens - 1`` positions: the last sampled token is returned, never fed
back), so a running request never finds the pool empty; a request waits while the pool cannot
hold it.  ``allocation="on_demand"`` reserves only the prompt's pages and the rest a page at a
time as the request decodes, so more requests run at once when ``max_new_tokens`` is a generous
bound; when the pool runs short, the most recently admitted request is preempted (its pages
freed, it goes back to the head of the queue and later reads its prompt and outputs so far
again: recompute, from cached pages with a prefix cache) -- vLLM's policy.  Greedy
decoding in fp32 gives each request exactly what ``generate`` gives it alone (tested for attention,
MLA, DSA, hybrid Gated DeltaNet and dropless MoE models).  So does sampling: each request has its
own settings and seed (``submit(..., temperature=, top_p=, top_k=, min_p=, seed=)``; penalties
``repetition_penalty=, presence_penalty=, frequency_penalty=``, with speculative decoding too), and
its output ``i`` draws with ``token_key(seed, i)`` whatever the batch, chunking or preemptions
around it;
``Engine(logprobs=True)`` returns the generated tokens' log-probabilities too.  Two cases where the
batch shows: bf16 (XLA fuses a differently shaped step differently: roundings, and so a near-tie,
may differ), and MoE with ``moe_capacity_factor`` (the tokens of one step compete for the experts'
slots, as in any batched call: a request's routing then depends on its neighbours).

Call shapes: ``[b, T]`` with ``b`` the number of slots served rounded up to a power of two (at most
``max_batch``; the padding rows feed nothing) and ``T`` the smallest power of two (up to
``chunk``) covering the longest prompt remainder, or 1 for decoding; and the page-table width
``W`` the call reads: the smallest power of two (at least ``MIN_TABLE_PAGES`` = 16, at most
``max_pages_per_seq``) holding its sequences' pages, so a step's cost follows the lengths being
served, not the longest one the engine admits (the XLA decode path gathers ``W`` pages per
sequence; the kernels' grids span ``W``).  So at most ``(ceil(log2(max_batch)) + 1) x
(ceil(log2(chunk)) + 1) x (widths)`` step programs are compiled, each once.

Speculative decoding (``Engine(num_draft_tokens=k)``): each decoding slot feeds its last token
and up to ``k`` drafts -- prompt lookup over its prompt and output, a draft model's
continuation (``draft=model``, with a paged cache of its own), or the model's own multi-token
prediction module's (``draft="mtp"``, fed the model's hidden states after every call) -- as one
ragged chunk; the model keeps the drafts it agrees with (``jaxattn.speculative.accept_rows``:
greedy, or speculative sampling with the request's seed) and each sequence is rewound to them
(``PagedModelCache.rewind``), so a step emits 1 to ``k + 1`` tokens per slot.  Greedy results
stay ``generate``'s.  A request with penalties has each check position penalized as if the
row's drafts before it had been emitted (``penalized_rows``' ``ahead``), and a draft model's or
the MTP module's proposals are penalized the same way (prompt lookup's are what they are).

Under a device mesh (``Engine(model, mesh=mesh)``, or the mesh set by ``jax.set_mesh`` when the
engine is built; Auto axes, ``jaxattn.sharding.make_mesh``) the weights are placed by their
logical axes (``jaxattn.sharding.param_shardings``: heads and MLP over ``"tensor"``, experts over
``"expert"``, ...), each layer's page pools split over the mesh axes of its KV heads
(``PagedModelCache.shard``) and every device call runs under the mesh, returning the cache in
that layout: a tensor-parallel server holds ``1 / tensor`` of the weights and of the KV cache per
device.  Results equal the single-device engine's (greedy fp32, tested on the simulated 8-device
mesh).  The pools are not split over ``"data"`` (any slot may own any page): serve data-parallel
replicas as separate engines.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hashlib
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxattn.checks import is_int
from jaxattn.generation import (NO_PENALTIES, check_penalties, check_sampling, eval_model,
                                history_state, penalized_by_state, penalized_rows, penalty_add,
                                sample_rows)
from jaxattn.nn.model import DecoderLM, PagedModelCache
from jaxattn.nn.mtp import mtp_layer_kind, shift_left
from jaxattn.paged_cache import PageTable
from jaxattn.speculative import accept_rows, ngram_propose, propose_rows
from jaxattn.sharding import check_auto_mesh, context_mesh, param_shardings


POLICIES = ("continuous", "static")
_SEEDS = 2 ** 31            # request seeds are int32 on the device
ALLOCATIONS = ("reserve", "on_demand")
# The narrowest page table a model call reads (a call reads the first power-of-two columns that
# hold its sequences, at least these, at most max_pages_per_seq).
MIN_TABLE_PAGES = 16


@dataclasses.dataclass
class _Request:
  rid: int
  prompt: np.ndarray          # [L] int32
  max_new_tokens: int
  eos_id: frozenset           # token ids that end the request (returned)
  pages: int                  # pages its whole life needs (only window layers: at once)
  fed: int = 0                # prompt tokens already in the cache
  out: list = dataclasses.field(default_factory=list)
  keys: list = dataclasses.field(default_factory=list)     # prefix-cache keys of its full pages
  shared: list = dataclasses.field(default_factory=list)   # prefix-cache pages it reads
  fresh: int = 0              # pages reserved from the free pool (pages - matched)
  window_pages: int = 0       # in a model with layers of both kinds: its sliding-window layers'
                              # reservation (``pages`` is then the other layers')
  feed: np.ndarray | None = None   # what the reading phase feeds: the prompt, and after a
  refed: int = 0                   # preemption the first ``refed`` outputs too
  admitted: int = -1          # admission order (the most recent is preempted first)
  seed: int = 0
  temperature: float = 0.0
  top_p: float = 1.0
  top_k: int = 0
  min_p: float = 0.0
  repetition_penalty: float = 1.0
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  logprobs: list = dataclasses.field(default_factory=list)   # of the outputs
  stop: tuple = ()            # token sequences that end the request when its output ends so
  priority: int = 0           # lower first: queued ahead of, and preempts, larger values
  stop_strings: tuple = ()    # texts that end the request when its decoded output contains one
  detokenize: Callable | None = None   # token ids -> text (the engine's), for stop_strings
  draft_held: int = 0         # with a draft model: its entries are this request's up to here
  submitted: int = 0          # the engine's step count when it was submitted (priority aging)
  drafts: np.ndarray | None = None   # with MTP drafting: the module's proposals for the next step

  def finished(self) -> bool:
    out = self.out
    return bool(out) and (len(out) == self.max_new_tokens or out[-1] in self.eos_id
                          or any(len(out) >= len(q) and tuple(out[-len(q):]) == q
                                 for q in self.stop)
                          or self._stop_string_ends(out))

  def _stop_string_ends(self, out) -> bool:
    """Whether the text of the output's last tokens contains a stop string.  The window (4 tokens
    a character of the longest string, and 4 more) holds any string the newest token completed,
    as long as no token of it decodes to nothing; checked at every token, so the first
    occurrence ends the request at the token that completes it."""
    if not self.stop_strings:
      return False
    window = 4 * max(map(len, self.stop_strings)) + 4
    text = self.detokenize([int(t) for t in out[-window:]])
    return any(s in text for s in self.stop_strings)

  def __post_init__(self):
    if self.feed is None:
      self.feed = self.prompt

  @property
  def reading(self) -> bool:
    return self.fed < self.feed.size

  @property
  def penalized(self) -> bool:
    return (self.repetition_penalty, self.presence_penalty,
            self.frequency_penalty) != NO_PENALTIES

  @property
  def tokens(self) -> np.ndarray:
    """The prompt and the outputs so far (int32)."""
    return np.concatenate([self.prompt, np.asarray(self.out, np.int32)])

  @property
  def held(self) -> int:
    """Tokens in the cache (and read by recurrent states): the feed read so far and the
    generated tokens after it but the last (sampled, not fed yet)."""
    return self.fed + max(len(self.out) - self.refed - 1, 0)


@dataclasses.dataclass
class EngineStats:
  """Counts since the engine was made: steps (each feeds every busy slot once), model calls (one
  or two a step), tokens fed to them (prompt + decode), token rows computed (``b x T`` per call,
  padding included), slots offered (``steps x max_batch``) and busy, tokens generated, requests
  finished; with a prefix cache, prompt tokens read from cached pages instead of fed
  (``prefix_hit_tokens``), cached pages given back to the pool for new requests
  (``evicted_pages``), admissions a request sat out waiting for a prefix page another request
  was computing (``prefix_waits``), for models with recurrent layers, snapshots of their
  states saved at cached page ends (``saved_states``), and the page-table entries the calls
  read (``table_columns``: ``b x`` the call's table width, the pages per sequence the decode
  paths visit), and with ``allocation="on_demand"`` the preemptions (``preempted``) and the
  cached tokens they dropped, to be computed again (``preempted_tokens``); with speculative
  decoding, the prompt-lookup drafts fed (``drafted``) and those the model kept
  (``accepted_drafts``); requests ended by ``Engine.abort`` (``aborted``, not in
  ``finished``)."""

  steps: int = 0
  calls: int = 0
  fed_tokens: int = 0
  computed_rows: int = 0
  slot_steps: int = 0
  busy_slot_steps: int = 0
  generated: int = 0
  finished: int = 0
  prefix_hit_tokens: int = 0
  evicted_pages: int = 0
  prefix_waits: int = 0
  saved_states: int = 0
  table_columns: int = 0
  preempted: int = 0
  preempted_tokens: int = 0
  drafted: int = 0
  accepted_drafts: int = 0
  aborted: int = 0

  @property
  def acceptance_rate(self) -> float:
    """With speculative decoding (``num_draft_tokens``): drafts kept / drafts proposed."""
    return self.accepted_drafts / self.drafted if self.drafted else 0.0

  @property
  def occupancy(self) -> float:
    """Fraction of slot-steps that served a request."""
    return self.busy_slot_steps / self.slot_steps if self.slot_steps else 0.0


def _positive_int(name, v):
  if not is_int(v) or v < 1:
    raise ValueError(f"`{name}` must be a positive int, got {v!r}.")
  return int(v)


def _step(m: DecoderLM, tokens, num_tokens, rows, cache, sampling, pages, greedy,
          release_windows, penalties=None):
  """``step_functions``' step on a merged model: ``(next, logprob, cache, h, sub)``, ``h [b, T,
  D]`` the rows' final hidden states and ``sub`` their cache rows after the call (before
  ``release_windows``)."""
  full, cache = cache, cache.take(rows, pages)
  # The head on each row's last real position only: [B, T, V] fp32 logits of a prefill chunk
  # would be T times the memory and head FLOPs (128 MiB at B = 8, T = 32, V = 128k).
  h, sub = m(tokens, cache=cache, num_tokens=num_tokens, return_hidden=True)
  last = jnp.maximum(num_tokens - 1, 0)[:, None, None]
  logits = m.head(jnp.take_along_axis(h, last, axis=1))[:, 0]              # [b, V]
  cache = full.put(rows, sub)
  if release_windows:
    cache = cache.release_behind()
  logits = logits.astype(jnp.float32)
  chosen = logits if penalties is None else penalized_rows(logits, *penalties)
  nxt = (jnp.argmax(chosen, axis=-1).astype(jnp.int32) if greedy
         else sample_rows(chosen, *sampling))
  logprob = jnp.take_along_axis(jax.nn.log_softmax(logits), nxt[:, None], axis=-1)[:, 0]
  return nxt, logprob, cache, h, sub


def _verify(m: DecoderLM, tokens, num_tokens, rows, cache, sampling, pages, greedy,
            release_windows, draft_probs=None, penalties=None):
  """``verify_function``'s verify on a merged model: ``(tokens, accepted, logprob, cache, h,
  sub)``, as ``_step``'s (``sub`` rewound to the kept tokens)."""
  full, cache = cache, cache.take(rows, pages)
  before = cache.lengths
  # (recurrent layers keep their state after each token: the rewind picks the kept one)
  h, cache = m(tokens, cache=cache.with_snapshots(), num_tokens=num_tokens, return_hidden=True)
  drafts = jnp.maximum(num_tokens - 1, 0)
  logits = m.head(h).astype(jnp.float32)
  judged = logits     # position j penalized as if the drafts before it had been emitted
  if penalties is not None:
    judged = penalized_rows(logits, *penalties, ahead=tokens[:, 1:])
  out, accepted, logprob = accept_rows(judged, tokens[:, 1:], drafts, *sampling, greedy=greedy,
                                       draft_probs=draft_probs)
  if penalties is not None:   # the log-probabilities stay the model's
    logprob = jnp.take_along_axis(jax.nn.log_softmax(logits), out[..., None], axis=-1)[..., 0]
  sub = cache.rewind(jnp.where(num_tokens > 0, before + accepted + 1, before), before)
  cache = full.put(rows, sub)
  if release_windows:
    cache = cache.release_behind()
  return out, accepted, logprob, cache, h, sub


@functools.lru_cache(maxsize=32)
def step_functions(graphdef, *, release_windows: bool = False):
  """The engine's two jitted programs for a split model (``nnx.split(model)``), made once per
  graph definition (engines over models of one structure share them, and their compiled
  programs):

  * ``step(state, tokens [b, T], num_tokens [b], rows [b], cache, sampling, pages=None,
    greedy=False) -> (next [b], logprob [b], cache)``: a ragged chunk through the model on the
    cache slots ``rows`` (``PagedModelCache.take`` / ``put``; an entry ``>= B`` is padding and
    must have ``num_tokens`` 0) reading the first ``pages`` page-table columns (static; None:
    all); ``next[i]`` is sampled from the logits of row ``i``'s last real token (meaningless for
    a row with ``num_tokens[i] = 0``) with the row's settings ``sampling = (seeds, index,
    temperature, top_p, top_k, min_p)`` (``jaxattn.generation.sample_rows``; ``greedy``,
    static: every row's temperature is 0, argmax only), and ``logprob[i]`` is its
    log-probability under the model (``log_softmax`` of those logits); ``penalties=(history [b,
    L], num_prompt [b], repetition [b], presence [b], frequency [b])`` (or None) applies
    ``jaxattn.generation.penalized_rows`` to the logits the token is chosen from (the logprob
    stays the model's);
  * ``free(cache, done [B]) -> cache``.

  ``release_windows``: ``step`` returns the pages behind each sequence's window to the pools
  of the sliding-window layers (``PagedModelCache.release_behind``).

  Both donate the cache (it is updated in place; use the returned one), and return it in the
  layout ``PagedModelCache.shard`` gives it on the active mesh (unchanged without one)."""

  @functools.partial(jax.jit, donate_argnums=4, static_argnames=("pages", "greedy"))
  def step(state, tokens, num_tokens, rows, cache, sampling, pages=None, greedy=False,
           penalties=None):
    m = eval_model(graphdef, state)
    nxt, logprob, cache, *_ = _step(m, tokens, num_tokens, rows, cache, sampling, pages, greedy,
                                    release_windows, penalties)
    return nxt, logprob, cache.shard()

  @functools.partial(jax.jit, donate_argnums=0)
  def free(cache: PagedModelCache, done, keep=None):
    return cache.free(done, keep).shard()

  return step, free


@functools.lru_cache(maxsize=32)
def verify_function(graphdef, *, release_windows: bool = False):
  """The engine's speculative step for a split model: ``verify(state, tokens [b, T],
  num_tokens [b], rows [b], cache, sampling, pages=None, greedy=False) -> (tokens [b, T],
  accepted [b], logprob [b, T], cache)``.  Row ``i`` feeds its last token and
  ``num_tokens[i] - 1`` drafts (``tokens[i, 1:num_tokens[i]]``) as a ragged chunk; the model's
  verdict is ``jaxattn.speculative.accept_rows`` with the rows' ``sampling`` (as ``step``'s,
  ``index`` the first output's), and each sequence is rewound to the tokens kept
  (``PagedModelCache.rewind``: its last token and ``accepted[i]`` drafts; the pages past them
  back to the pools).  ``draft_probs [b, T - 1, V]``: the distributions sampled drafts were drawn
  from (a draft model's, ``draft_functions``); None: one-hot drafts.  ``penalties``: ``step``'s;
  the check's position ``j`` is penalized as if the row's drafts before it had been emitted
  (``penalized_rows``' ``ahead``), so greedy rows keep what ``step`` would have chosen and
  sampled rows their distribution.  Donates the cache and returns it as ``step`` does."""

  @functools.partial(jax.jit, donate_argnums=4, static_argnames=("pages", "greedy"))
  def verify(state, tokens, num_tokens, rows, cache, sampling, pages=None, greedy=False,
             draft_probs=None, penalties=None):
    m = eval_model(graphdef, state)
    out, accepted, logprob, cache, *_ = _verify(m, tokens, num_tokens, rows, cache, sampling,
                                                pages, greedy, release_windows, draft_probs,
                                                penalties)
    return out, accepted, logprob, cache.shard()

  return verify


def _draft_tokens(logits, sampling, index):
  """A proposer's draft per row from its logits ``[b, V]``: the argmax without ``sampling``
  (every row greedy); else ``propose_rows`` for each row's output ``index[i]``.  Returns
  ``(drafts [b], q [b, V] or None)``."""
  if sampling is None:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), None
  seeds, _, *settings = sampling
  return propose_rows(logits, seeds, index, *settings)


def _draft_penalizer(penalties, emitted=None):
  """A proposer's penalties (None without): ``penalize(logits [b, V], drafts) -> logits`` as
  ``penalized_rows`` gives them after the rows' history, then ``emitted [b, e]`` (tokens the
  call keeps before the drafts, ``-1``: none), then ``drafts`` (a list of the ``[b]`` drafts
  so far): the state the check will judge each draft with."""
  if penalties is None:
    return None
  history, num_prompt, *settings = penalties
  states = []  # states[j]: after the history, ``emitted`` and the first j drafts (built once)

  def penalize(logits, drafts):
    if not states:
      state = history_state(history, num_prompt, logits.shape[-1])
      states.append(state if emitted is None else penalty_add(state, emitted))
    for d in drafts[len(states) - 1:]:       # the proposer's loop adds one draft per call
      states.append(penalty_add(states[-1], d[:, None]))
    return penalized_by_state(logits, states[len(drafts)], *settings)

  return penalize


def _mtp_drafts(m: DecoderLM, h, ahead, num, start, table: PageTable, mtp_cache: PagedModelCache,
                k: int, sampling=None, base=None, penalize=None):
  """The depth-1 MTP module after a model call: it reads the pairs ``(h [b, T, D], ahead
  [b, T])`` of the ``num[i]`` positions row ``i`` kept (the model's hidden state at each, the
  token after it) from position ``start[i]`` on, then drafts ``k`` tokens, chaining on its own
  output.  Its block's pool is indexed by the model's page table of the call's rows
  (``table``, after the call): the module writes its entry of position ``i`` at the page and slot
  where the model holds position ``i``, so its cache needs no allocation or bookkeeping of its
  own, and shares the prefix cache's pages.  The chained drafts' positions past the sequence go
  to the spare pages past the model's pool (freed with the call).  Greedy drafts without
  ``sampling``; with it, row ``i``'s draft ``j`` is sampled for its output ``base[i] + j``
  (``propose_rows``); ``k = 0``: the read alone; ``penalize``: ``_draft_penalizer``'s, applied
  to each draft's logits.  Returns ``(drafts [b, k], q [b, k, V] or None, mtp_cache)``."""
  (layer,), = mtp_cache.groups
  pool = layer.table.num_pages
  spare = jnp.arange(pool - 1, table.num_pages - 1, -1, dtype=jnp.int32)     # pool ids past P
  stack = jnp.zeros((pool,), jnp.int32).at[:spare.size].set(spare)
  cache = mtp_cache.on_table(dataclasses.replace(
      table, free_pages=stack, num_free=jnp.asarray(spare.size, jnp.int32)), start)
  module = m.mtp[0]

  def draft(g, j):
    logits = m.mtp_logits(module, g)[:, 0]
    if penalize is not None:
      logits = penalize(logits, drafts)
    return _draft_tokens(logits, sampling, base + j)

  drafts = []
  g, cache = m.mtp_decode(h, ahead, cache, num_tokens=num)
  if not k:                                                  # the read alone
    return (jnp.zeros((num.size, 0), jnp.int32), None,
            cache.on_table(layer.table, mtp_cache.lengths).shard())
  g = jnp.take_along_axis(g, jnp.maximum(num - 1, 0)[:, None, None], axis=1)     # [b, 1, D]
  tok, q = draft(g, 0)
  drafts.append(tok)
  probs, feed = [q], (num > 0).astype(jnp.int32)
  for j in range(1, k):
    g, cache = m.mtp_decode(g, tok[:, None], cache, num_tokens=feed)
    tok, q = draft(g, j)
    drafts.append(tok)
    probs.append(q)
  return (jnp.stack(drafts, axis=1), None if sampling is None else jnp.stack(probs, axis=1),
          cache.on_table(layer.table, mtp_cache.lengths).shard())    # the pools, written


@functools.lru_cache(maxsize=32)
def mtp_functions(graphdef, k: int, *, release_windows: bool = False):
  """The engine's calls when the model's own multi-token prediction drafts
  (``Engine(draft="mtp")``): ``step_functions``' step and ``verify_function``'s verify, each
  followed by the depth-1 MTP module on the positions the call kept, which writes them into its
  block's pool at the pages of the model's page table (``PagedModelCache.whole_table``; the
  pool has ``P + spare`` pages for a ``P``-page layer, see ``_mtp_drafts``) and proposes each
  slot's next ``k`` drafts:

  * ``step(state, tokens, num_tokens, rows, cache, sampling, mtp_cache, following, probs,
    pages=None, greedy=False, draft=True) -> (next, logprob, cache, drafts [b, k], mtp_cache,
    probs)``; ``following[i]``: the token after row ``i``'s chunk when the chunk is part of its
    prompt, -1 when it is the token this call samples; ``draft`` (static) False: the module only
    reads (no row's chunk ends its prompt: no drafts wanted; ``drafts [b, 0]``);
  * ``verify(state, tokens, num_tokens, rows, cache, sampling, mtp_cache, probs, pages=None,
    greedy=False) -> (tokens, accepted, logprob, cache, drafts, mtp_cache, probs)``: the pair at
    each kept position is the model's hidden state and the next token kept (a draft, or the
    model's own at the last).

  Sampled rows' drafts are sampled from the module's filtered distribution with the row's
  settings (``propose_rows``, keyed by the output each would be), kept in ``probs [B, k, V]``
  (the slots' rows) until the next call judges them with it (``accept_rows``' speculative
  sampling); greedy rows' drafts are the argmax.  With ``greedy`` (static: every row greedy)
  ``probs`` is passed through untouched (None is fine).  Both donate the caches and ``probs``."""

  def propose(m, h, ahead, num, sub, mtp_cache, sampling, base, rows, probs, greedy, n=k,
              penalize=None):
    drafts, q, mtp_cache = _mtp_drafts(m, h, ahead, num, sub.lengths - num, sub.whole_table(),
                                       mtp_cache, n, None if greedy else sampling, base, penalize)
    if q is not None:
      probs = probs.at[rows].set(q, mode="drop")
    return drafts, mtp_cache, probs

  @functools.partial(jax.jit, donate_argnums=(4, 6, 8),
                     static_argnames=("pages", "greedy", "draft"))
  def step(state, tokens, num_tokens, rows, cache, sampling, mtp_cache, following, probs,
           pages=None, greedy=False, draft=True, penalties=None):
    m = eval_model(graphdef, state)
    nxt, logprob, cache, h, sub = _step(m, tokens, num_tokens, rows, cache, sampling, pages,
                                        greedy, release_windows, penalties)
    last = jnp.arange(tokens.shape[1])[None, :] == (num_tokens - 1)[:, None]
    after = jnp.where(following >= 0, following, nxt)
    ahead = jnp.where(last, after[:, None], shift_left(tokens, 1))
    penalize = _draft_penalizer(penalties, jnp.where(following >= 0, -1, nxt)[:, None])
    drafts, mtp_cache, probs = propose(m, h, ahead, num_tokens, sub, mtp_cache, sampling,
                                       sampling[1] + 1, rows, probs, greedy, k if draft else 0,
                                       penalize)
    return nxt, logprob, cache.shard(), drafts, mtp_cache, probs

  @functools.partial(jax.jit, donate_argnums=(4, 6, 7), static_argnames=("pages", "greedy"))
  def verify(state, tokens, num_tokens, rows, cache, sampling, mtp_cache, probs, pages=None,
             greedy=False, penalties=None):
    m = eval_model(graphdef, state)
    q = None if greedy else jnp.take(probs, rows, axis=0, mode="clip")[:, :tokens.shape[1] - 1]
    out, accepted, logprob, cache, h, sub = _verify(m, tokens, num_tokens, rows, cache, sampling,
                                                    pages, greedy, release_windows, q, penalties)
    kept = jnp.where(num_tokens > 0, accepted + 1, 0)
    emitted = jnp.where(jnp.arange(out.shape[1])[None, :] < kept[:, None], out, -1)
    drafts, mtp_cache, probs = propose(m, h, out, kept, sub, mtp_cache, sampling,
                                       sampling[1] + accepted + 1, rows, probs, greedy,
                                       penalize=_draft_penalizer(penalties, emitted))
    return out, accepted, logprob, cache.shard(), drafts, mtp_cache, probs

  return step, verify


@functools.lru_cache(maxsize=32)
def draft_functions(graphdef, k: int):
  """A draft model's two calls beside the engine's model (``Engine(draft=model)``), its cache
  indexed by the model's page table (``PagedModelCache.whole_table``, through ``on_table``: the
  draft writes position ``i`` of a sequence at the page and slot where the model holds it, so it
  has no pages of its own, shares the prefix cache's and needs no allocation, rewind or free):

  * ``read(state, tokens [b, T], num_tokens [b], rows [b], cache, model_cache, pages=None) ->
    cache``: the draft reads the prompt chunk the model has just read (``model_cache``: after
    that call; read, not donated);
  * ``propose(state, first [b, F], num_first [b], start [b], num_drafts [b], rows [b], cache,
    model_cache, sampling, t, pages=None, greedy=True) -> (drafts [b, k], q [b, k, V] or None,
    cache, model_cache)``: the pages of the model's next check (``num_drafts + 1`` tokens a row,
    at most ``t``, static) are allocated first (``PagedModelCache.reserve_ahead``), so the
    draft's entries at the positions the check keeps land on the model's pages; each row feeds
    the tokens the draft has not read, ``first[i, :num_first[i]]`` (its sequence from position
    ``start[i]`` to its last token), then its own drafts, ``num_drafts[i]`` of them (padding rows,
    ``rows >= B``, feed nothing).  A greedy row's drafts are the argmax; a sampled row's are
    sampled from the draft's filtered distribution with the row's ``sampling`` (draft ``j`` for
    output ``index + j``: ``propose_rows``), returned in ``q`` for the check (``draft_probs``).
    ``greedy`` (static): every row greedy, no ``q``.

  Both donate the draft's cache; ``propose`` the model's too."""

  @functools.partial(jax.jit, donate_argnums=4, static_argnames=("pages",))
  def read(state, tokens, num_tokens, rows, cache, model_cache, pages=None):
    m = eval_model(graphdef, state)
    table = model_cache.whole_table()
    before = table.lengths.at[rows].add(-num_tokens, mode="drop")
    full = cache.on_table(table, before)
    _, sub = m(tokens, cache=full.take(rows, pages), num_tokens=num_tokens, return_hidden=True)
    return full.put(rows, sub).shard()

  @functools.partial(jax.jit, donate_argnums=(6, 7), static_argnames=("t", "pages", "greedy"))
  def propose(state, first, num_first, start, num_drafts, rows, cache, model_cache, sampling, t,
              pages=None, greedy=True, penalties=None):
    m = eval_model(graphdef, state)
    penalize = _draft_penalizer(penalties)
    real = rows < model_cache.batch
    check = jnp.zeros_like(model_cache.lengths).at[rows].set(num_drafts + 1, mode="drop")
    model_cache = model_cache.reserve_ahead(check, t)
    table = model_cache.whole_table()
    full = cache.on_table(table, table.lengths.at[rows].set(start, mode="drop"))
    sub = full.take(rows, pages)

    def draft(logits, j):
      if penalize is not None:
        logits = penalize(logits, drafts)
      return _draft_tokens(logits, None if greedy else sampling, sampling[1] + j)

    drafts = []
    count = jnp.where(real, num_first, 0)
    logits, sub = m(first, cache=sub, num_tokens=count)
    last = jnp.take_along_axis(logits, jnp.maximum(count - 1, 0)[:, None, None], axis=1)
    tok, q = draft(last[:, 0], 0)
    drafts.append(tok)
    probs = [q]
    for j in range(1, k):
      logits, sub = m(tok[:, None], cache=sub,
                      num_tokens=(real & (num_drafts > j)).astype(jnp.int32))
      tok, q = draft(logits[:, 0], j)
      drafts.append(tok)
      probs.append(q)
    return (jnp.stack(drafts, axis=1), None if greedy else jnp.stack(probs, axis=1),
            full.put(rows, sub).shard(), model_cache.shard())

  return read, propose


@functools.lru_cache(maxsize=32)
def draft_verify_function(graphdef, draft_graphdef, k: int):
  """The engine's speculative step with a draft model, as one program: ``draft_functions``'
  ``propose`` then ``verify_function``'s ``verify`` of its drafts (one dispatch a step, the drafts
  never leave the device between the two):

  ``speculate(state, draft_state, first, num_first, start, tokens [b, T], num_tokens [b],
  rows [b], cache, draft_cache, sampling, t, pages=None, greedy=True) -> (tokens, accepted,
  logprob, cache, draft_cache, drafts [b, k])``: row ``i`` feeds ``tokens[i, 0]`` (its last
  token) and ``num_tokens[i] - 1`` drafts the draft model proposes (``first`` / ``num_first`` /
  ``start`` as ``propose`` takes them), judged with their distributions when sampled.  Donates
  both caches."""
  _, propose = draft_functions(draft_graphdef, k)
  verify = verify_function(graphdef)

  @functools.partial(jax.jit, donate_argnums=(8, 9), static_argnames=("t", "pages", "greedy"))
  def speculate(state, draft_state, first, num_first, start, tokens, num_tokens, rows, cache,
                draft_cache, sampling, t, pages=None, greedy=True, penalties=None):
    drafts, q, draft_cache, cache = propose(draft_state, first, num_first, start, num_tokens - 1,
                                            rows, draft_cache, cache, sampling, t=t, pages=pages,
                                            greedy=greedy, penalties=penalties)
    tokens = tokens.at[:, 1:].set(drafts[:, :t - 1])          # the verify masks past counts
    out, accepted, logprob, cache = verify(state, tokens, num_tokens, rows, cache, sampling,
                                           pages=pages, greedy=greedy,
                                           draft_probs=None if q is None else q[:, :t - 1],
                                           penalties=penalties)
    return out, accepted, logprob, cache, draft_cache, drafts

  return speculate


@functools.partial(jax.jit, donate_argnums=0)
def _prefix_update(cache: PagedModelCache, evict, rows, tables, lengths, store, state_ids):
  """Evicted prefix-cache pages back to the pools, then cached prefixes attached to new slots
  (with recurrent layers: their states restored from the snapshots ``state_ids`` of ``store``)."""
  return cache.push_pages(evict).attach(rows, tables, lengths, store, state_ids).shard()


@functools.partial(jax.jit, donate_argnums=1)
def _save_states(cache: PagedModelCache, store, rows, ids):
  """The recurrent states of slots ``rows`` copied into snapshots ``ids`` of ``store``."""
  return cache.save_states(store, rows, ids)


def _page_key(parent: bytes, tokens: np.ndarray) -> bytes:
  """The prefix cache's key of a full page: a digest of every token up to the page's end (the
  parent page's key and this page's tokens), so equal keys mean equal prefixes."""
  return hashlib.blake2b(parent + tokens.astype(np.int32).tobytes(), digest_size=16).digest()


class _PrefixCache:
  """The host side of prefix caching: full pages of computed tokens by the key of their prefix.
  A page is *in use* while running requests read it (``refs``), *idle* otherwise: kept for
  later requests with the same prefix, and evicted (least recently used first, the deepest page
  of a prefix before its parents) when a new request needs its room."""

  def __init__(self):
    self.page_of: dict[bytes, int] = {}
    self.key_of: dict[int, bytes] = {}
    self.refs: dict[int, int] = {}
    self.idle: collections.OrderedDict[int, None] = collections.OrderedDict()

  def __len__(self):
    return len(self.page_of)

  def match(self, keys) -> list[int]:
    """The cached pages of the longest run of ``keys`` from the start."""
    pages = []
    for k in keys:
      if k not in self.page_of:
        break
      pages.append(self.page_of[k])
    return pages

  def acquire(self, pages) -> None:
    for p in pages:
      self.refs[p] += 1
      self.idle.pop(p, None)

  def release(self, pages) -> None:
    for p in reversed(pages):              # the deepest first: evicted before its parents
      self.refs[p] -= 1
      if self.refs[p] == 0:
        self.idle[p] = None

  def add(self, key: bytes, page: int) -> bool:
    """Caches ``page`` under ``key`` (in use by its writer); False if the key is cached (another
    request computed the same prefix at the same time: this page stays private)."""
    if key in self.page_of:
      return False
    self.page_of[key], self.key_of[page], self.refs[page] = page, key, 1
    return True

  def evictable(self, keep=()) -> list[int]:
    return [p for p in self.idle if p not in keep]

  def evict(self, page: int) -> None:
    del self.page_of[self.key_of.pop(page)], self.refs[page], self.idle[page]

  def mask(self, num_pages: int) -> np.ndarray:
    keep = np.zeros((num_pages,), bool)
    keep[list(self.key_of)] = True
    return keep


class _StateSnapshots:
  """The host side of a hybrid model's prefix cache: which prefix (a page key) each of ``count``
  device snapshots of the recurrent states holds, least recently used first.  A snapshot is a
  copy: overwriting one never breaks a running request (its state was restored at admission)."""

  def __init__(self, count: int):
    self.count = count
    self.id_of: collections.OrderedDict[bytes, int] = collections.OrderedDict()
    self.unused = list(range(count - 1, -1, -1))

  def __contains__(self, key) -> bool:
    return key in self.id_of

  def use(self, key: bytes) -> int:
    self.id_of.move_to_end(key)
    return self.id_of[key]

  def take(self, key: bytes, busy: set[int]) -> int | None:
    """A snapshot id for ``key``: an unused one, else the least recently used one's (not one of
    ``busy``, the ids written by the same device call); None when there is none."""
    if self.unused:
      sid = self.unused.pop()
    else:
      old = next((k for k, i in self.id_of.items() if i not in busy), None)
      if old is None:
        return None
      sid = self.id_of.pop(old)
    self.id_of[key] = sid
    return sid

  def drop(self, key: bytes) -> None:
    if key in self.id_of:
      self.unused.append(self.id_of.pop(key))


class Engine:
  """Continuous batching over a ``DecoderLM``'s paged cache (see the module docstring).

  Args:
    model: the ``DecoderLM`` (any preset; its weights are read once, at construction).  When it
      has sliding-window layers and there is no prefix cache, the pages behind each sequence's
      window go back to those layers' pools after every step: a request holds at most
      ``window_pages`` pages in each of them, and their pools can be that much smaller
      (``window_num_pages``; Mistral: every layer; Gemma-2 / 3, gpt-oss: local layers
      interleaved with global ones, whose pools still hold whole sequences).
    max_batch: sequence slots decoded together.
    page_size: tokens per cache page.
    num_pages: pages in each pool of a layer holding whole sequences (full attention, MLA,
      DSA; with a prefix cache, every layer); default enough for every slot at
      ``max_seq_len``.  For a model whose paged layers all have sliding windows, the pages of
      their pools (default enough for every slot's ``window_pages``).
    window_num_pages: pages in each sliding-window layer's pool when the model also has layers
      holding whole sequences (and no prefix cache); default enough for every slot's
      ``window_pages`` (at most ``num_pages``).
    cache_bytes: a memory budget for the cache instead of ``num_pages``: ``num_pages`` becomes
      the most whose cache (every layer's pools, page tables, recurrent states, the prefix
      cache's snapshots of them, and a draft model's or the MTP block's cache beside them; at
      the ``dtype``, so a quantized cache gets about twice the pages of a bf16 one) fits in this
      many bytes.  A budget below one page
      per pool, or below the window pools' fixed size, is refused.
    max_pages_per_seq: the page-table width (the longest request, in pages); default
      ``ceil(max_seq_len / page_size)``.
    chunk: the most prompt tokens a slot feeds per step (chunked prefill).
    temperature, top_p, top_k, min_p: the requests' default sampling, as in ``sample_logits`` (0:
      greedy); ``submit`` may give a request its own.
    repetition_penalty, presence_penalty, frequency_penalty: the requests' default penalties, as
      in ``generate`` (``jaxattn.generation.penalized_logits``: the prompt and the output so far
      are seen, the output counted; the logprobs reported stay the model's); ``submit`` may give
      a request its own.  With speculative decoding too: each draft is proposed and each
      position of the check judged as if the drafts before it had been emitted.
    seed: the requests' default seeds: request ``rid`` samples with ``seed + rid`` unless
      ``submit`` gives it one.  Generated token ``i`` of a request with seed ``s`` draws with
      ``jaxattn.generation.token_key(s, i)``, as ``generate`` does: a sampled request gets the
      tokens ``generate`` gives it alone with that seed (fp32), however it was batched, chunked
      or preempted.
    logprobs: each result is ``(tokens, logprobs)``, ``logprobs [n]`` (fp32) the model's
      log-probabilities of the ``n`` generated tokens (``log_softmax`` of the logits they were
      sampled from, before temperature, top-k and top-p).
    dtype: the cache's dtype (default the model's compute dtype); ``jnp.int8`` or
      ``jnp.float8_e4m3fn``: a quantized KV cache (one-byte keys and values with a scale per
      token and KV head: about half the bytes of a bf16 page, twice the pages per gigabyte).
    policy: ``"continuous"`` (a free slot takes the next request at once) or ``"static"`` (new
      requests enter only when every slot is empty: classic static batching, kept as the
      baseline ``experiments/bench_serve.py`` measures against).
    prefix_cache: keep the full pages of computed tokens (prompts and generated ones) after a
      request finishes, keyed by the tokens up to their end, and start a request whose prompt
      begins with a cached prefix from those pages (read in place, shared by every request
      using them) instead of computing it again: a shared system prompt, the earlier turns of
      a conversation, many samples of one prompt (a request whose prefix another running
      request is computing waits for its pages rather than computing them too).  Idle cached
      pages are evicted (least recently used) when a new request needs room.  Greedy fp32
      results are unchanged (tested); bf16 ones as the batch caveat above.  For models with
      recurrent (Gated DeltaNet) layers the pages are not enough: the cache also keeps
      snapshots of those layers' states at cached page ends (``prefix_states``), taken where a
      step ends on a page boundary (prefill chunks are a power of two tokens from a page
      boundary: every ``chunk`` tokens, every page when ``chunk <= page_size``; a decode step
      ends at every token), and a request starts from the longest cached prefix that has one.
      A model with no paged layer at all is refused.
    prefix_states: with a prefix cache on a model with recurrent layers, how many state
      snapshots to keep (least recently used replaced first); default ``4 * max_batch``.  Each
      holds every recurrent layer's state and convolution tails for one sequence (Qwen3-Next-80B:
      36 layers x 32 heads x 128 x 128 fp32 = 75 MB).
    allocation: ``"reserve"`` (a request's whole page need at admission: never preempted) or
      ``"on_demand"`` (its prompt's pages at admission, then each page as it is reached; the
      most recently admitted request is preempted and recomputed when the pool runs short; see
      the module docstring).  Sliding-window pools are reserved whole either way (a window's
      pages).
    narrow_tables: each call reads only the page-table columns its sequences need (a power of
      two, at least ``MIN_TABLE_PAGES``; see the module docstring), so a step costs what the
      lengths served need, not ``max_seq_len``.  False: always the whole table (fewer compiled
      programs; ``experiments/bench_serve.py --compare-whole-table`` measures the difference).
    mesh: a device mesh (Auto axes) to serve on: the weights placed by their logical axes, the
      cache's pools split over the KV heads' mesh axes, every call run under it (see the module
      docstring).  Default: the mesh set by ``jax.set_mesh`` when the engine is built, if any.
    detokenize: token ids -> text (e.g. a Hugging Face tokenizer's ``decode``), for requests
      with ``stop_strings``.
    num_draft_tokens: speculative decoding with prompt-lookup drafts (0: off): each decoding
      slot feeds its last token and up to this many drafts (``jaxattn.speculative.ngram_propose``
      over its prompt and output, ``ngram_size`` tokens down to 1) as one ragged chunk; the model
      keeps the drafts it agrees with (``accept_rows``) and each sequence is rewound to them
      (``PagedModelCache.rewind``).  A step then emits 1 to ``num_draft_tokens + 1`` tokens per
      slot.  Greedy results are unchanged (a request gets ``generate``'s tokens); sampled ones
      keep the model's distribution, their draws keyed by the request's seed and output index
      (independent of the batch).  Recurrent (Gated DeltaNet) layers keep their state after
      each token of the check (``DeltaNetCache.with_snapshots``) and the rewind picks the kept
      one.
    ngram_size: the longest n-gram prompt lookup matches.
    draft: a smaller ``DecoderLM`` of the same vocabulary that drafts instead of prompt lookup
      (with ``num_draft_tokens`` >= 1): its paged cache (pools of ``num_pages`` pages, counted
      in ``cache_bytes``) is indexed by the model's page table, so it needs no pages of its
      own and shares the prefix cache's; it reads every prompt chunk after the model, and
      each step proposes its continuation of every decoding slot, checked by the model in the
      same program (``draft_functions``, ``draft_verify_function``: greedy
      for greedy requests, sampled with a sampled request's settings, its distributions then
      judged by ``accept_rows``' speculative sampling) into the pages of the model's check,
      allocated first.  Its layers must hold whole sequences (attention, MLA, DSA: no sliding
      window, no recurrent state), as must the model's.
      ``"mtp"``: the model's own multi-token-prediction module drafts (a model with
      ``mtp_depth >= 1``; DeepSeek-V3's self-speculation): after every call it reads the
      model's hidden states of the positions kept with the tokens that follow them, into its
      block's pool at the pages of the model's page table (``init_mtp_paged_cache``: one
      block's pages, and spare ones for its chained drafts; counted in ``cache_bytes`` with
      ``mtp_probs``),
      and proposes each slot's next drafts, as a draft model does (``mtp_functions``; a sampled
      request's distributions kept for the next step, ``k x V`` floats a slot).  Any model with a
      paged layer (recurrent ones keep snapshots, as with prompt lookup); with a prefix cache,
      a cached prefix whose last entry the module paired with another next token than the
      request's has its last page recomputed.
    priority_aging: a waiting (or running) request's priority value drops by one for every
      this many steps since it was submitted (None: never), so a request of a large value is
      not starved by a stream of smaller ones: it overtakes the requests submitted
      ``priority_aging x (difference)`` steps after it, and running long protects a request
      from preemption by newcomers.  Among requests of one priority the order is unchanged.
  """

  def __init__(self, model: DecoderLM, *, max_batch: int = 8, page_size: int = 16,
               num_pages: int | None = None, max_pages_per_seq: int | None = None,
               window_num_pages: int | None = None, chunk: int = 64,
               temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
               min_p: float = 0.0, seed: int = 0, logprobs: bool = False, dtype=None,
               policy: str = "continuous",
               prefix_cache: bool = False, prefix_states: int | None = None,
               narrow_tables: bool = True, allocation: str = "reserve",
               mesh: jax.sharding.Mesh | None = None,
               detokenize: Callable[[Sequence[int]], str] | None = None,
               cache_bytes: int | None = None, num_draft_tokens: int = 0,
               ngram_size: int = 3, draft: DecoderLM | str | None = None,
               priority_aging: int | None = None, repetition_penalty: float = 1.0,
               presence_penalty: float = 0.0, frequency_penalty: float = 0.0):
    check_sampling(temperature, top_p, top_k, min_p)
    check_penalties(repetition_penalty, presence_penalty, frequency_penalty)
    self.penalties = dict(repetition_penalty=float(repetition_penalty),
                          presence_penalty=float(presence_penalty),
                          frequency_penalty=float(frequency_penalty))
    self.priority_aging = (None if priority_aging is None
                           else _positive_int("priority_aging", priority_aging))
    if not is_int(num_draft_tokens) or not 0 <= num_draft_tokens <= 64:
      raise ValueError(f"`num_draft_tokens` must be an int in [0, 64] (0: no speculative "
                       f"decoding), got {num_draft_tokens!r}.")
    self.num_draft_tokens = int(num_draft_tokens)
    self.ngram_size = _positive_int("ngram_size", ngram_size)
    if policy not in POLICIES:
      raise ValueError(f"`policy` must be one of {POLICIES}, got {policy!r}.")
    if allocation not in ALLOCATIONS:
      raise ValueError(f"`allocation` must be one of {ALLOCATIONS}, got {allocation!r}.")
    self.policy, self.allocation = policy, allocation
    self.max_batch = _positive_int("max_batch", max_batch)
    self.page_size = _positive_int("page_size", page_size)
    self.chunk = _positive_int("chunk", chunk)
    if not is_int(seed) or not 0 <= seed < _SEEDS:
      raise ValueError(f"`seed` must be an int in [0, 2**31), got {seed!r}.")
    if not isinstance(logprobs, bool):
      raise ValueError(f"`logprobs` must be a bool, got {logprobs!r}.")
    self.seed, self.logprobs = int(seed), logprobs
    self.sampling = dict(temperature=float(temperature), top_p=float(top_p), top_k=int(top_k),
                         min_p=float(min_p))
    self.config = model.config
    if detokenize is not None and not callable(detokenize):
      raise ValueError(f"`detokenize` must be None or a callable (token ids -> str), got "
                       f"{detokenize!r}.")
    self.detokenize = detokenize
    if not isinstance(prefix_cache, bool):
      raise ValueError(f"`prefix_cache` must be a bool, got {prefix_cache!r}.")
    # Sliding-window layers hold only the pages of each sequence's window: the others go back to
    # their pools after each step (not with a prefix cache, whose pages outlive the window).
    kinds = self.config.kinds()
    self.window = (self.config.sliding_window if "S" in kinds and not prefix_cache else None)
    # Whether some paged layer holds whole sequences (then its pools are `num_pages`, and the
    # window layers' `window_num_pages`); else the window layers' pools are `num_pages`.
    self._whole = self.window is None or bool(kinds - {"S", "D"})
    # Window layers with pools of their own (`window_num_pages`), counted apart at admission.
    self._window_pools = self.window is not None and self._whole
    # Pages reserved as requests reach them; sliding-window-only models reserve their bounded
    # need whole either way.
    self._on_demand = allocation == "on_demand" and self._whole
    per_seq = -(-self.config.max_seq_len // self.page_size)
    self.max_pages_per_seq = (per_seq if max_pages_per_seq is None
                              else _positive_int("max_pages_per_seq", max_pages_per_seq))
    if num_pages is not None:
      _positive_int("num_pages", num_pages)
    if cache_bytes is not None:
      _positive_int("cache_bytes", cache_bytes)
      if num_pages is not None:
        raise ValueError(f"give `num_pages` ({num_pages}) or `cache_bytes` ({cache_bytes}), "
                         "not both: the budget sets the pages.")
    if window_num_pages is not None:
      _positive_int("window_num_pages", window_num_pages)
      if not self._window_pools:
        raise ValueError(f"`window_num_pages` ({window_num_pages}) sizes the pools of "
                         "sliding-window layers beside layers holding whole sequences; this "
                         f"engine has none (layer kinds {sorted(kinds)}, prefix_cache="
                         f"{prefix_cache}): use `num_pages`.")
    window_fill = (None if self.window is None else
                   self.max_batch * min(self.max_pages_per_seq, self.window_pages))
    if self._whole:
      self.num_pages = (self.max_batch * self.max_pages_per_seq if num_pages is None
                        else int(num_pages))
      self.window_num_pages = (None if self.window is None else
                               min(self.num_pages, window_fill) if window_num_pages is None
                               else int(window_num_pages))
    else:
      self.num_pages = window_fill if num_pages is None else int(num_pages)
      self.window_num_pages = self.num_pages
    if draft is not None:
      self._check_draft(draft, model)
    if prefix_states is not None:
      _positive_int("prefix_states", prefix_states)
    # With a prefix cache over recurrent layers: snapshots of their states (in cache_bytes too).
    self._store_count = ((4 * self.max_batch if prefix_states is None else int(prefix_states))
                         if prefix_cache and "D" in kinds else 0)
    if cache_bytes is not None:
      self.num_pages = self._pages_within(model, int(cache_bytes), dtype, draft)
      if not self._whole:
        self.window_num_pages = self.num_pages
      elif self._window_pools and window_num_pages is None:   # (sized before: smaller is fine)
        self.window_num_pages = min(self.num_pages, window_fill)
    if mesh is None:
      mesh = context_mesh()
    elif not isinstance(mesh, jax.sharding.Mesh):
      raise ValueError(f"`mesh` must be a jax.sharding.Mesh or None, got {type(mesh).__name__}.")
    check_auto_mesh(mesh, "Engine")
    self.mesh = mesh
    with self._on_mesh():
      self.cache = model.init_paged_cache(self.max_batch, self.num_pages, self.page_size,
                                          max_pages_per_seq=self.max_pages_per_seq,
                                          window_num_pages=self.window_num_pages,
                                          dtype=dtype).shard()
    if not isinstance(narrow_tables, bool):
      raise ValueError(f"`narrow_tables` must be a bool, got {narrow_tables!r}.")
    self.narrow_tables = narrow_tables
    if prefix_cache and not self.cache.paged:
      raise ValueError("`prefix_cache=True` shares cached pages; this model has no paged layer "
                       "(only recurrent ones): nothing to share.")
    self._prefix = _PrefixCache() if prefix_cache else None
    self._follow: dict[int, int] = {}     # with MTP: each cached page's next token (_resumable)
    self._snapshots, self._store = None, None
    if self._store_count:
      self._snapshots = _StateSnapshots(self._store_count)
      with self._on_mesh():
        self._store = self.cache.state_store(self._store_count)
    self._wait_for_prefix = prefix_cache and policy == "continuous"
    graphdef, self._state = nnx.split(model)
    if mesh is not None:
      self._state = jax.device_put(self._state, param_shardings(self._state, mesh))
    self._step, self._free = step_functions(graphdef, release_windows=self.window is not None)
    self._verify = (verify_function(graphdef, release_windows=self.window is not None)
                    if self.num_draft_tokens else None)
    self.draft_cache, self._draft_verify, self.mtp_cache, self.mtp_probs = None, None, None, None
    self._mtp = isinstance(draft, str) and draft == "mtp"
    if self._mtp:
      self._check_mtp_table()
      self._mtp_step, self._mtp_verify = mtp_functions(
          graphdef, self.num_draft_tokens, release_windows=self.window is not None)
      with self._on_mesh():
        self.mtp_cache = self._init_mtp_cache(model, self.num_pages, dtype).shard()
    elif draft is not None:
      draft_graphdef, self._draft_state = nnx.split(draft)
      if mesh is not None:
        self._draft_state = jax.device_put(self._draft_state,
                                           param_shardings(self._draft_state, mesh))
      with self._on_mesh():
        self.draft_cache = draft.init_paged_cache(
            self.max_batch, self.num_pages, self.page_size,
            max_pages_per_seq=self.max_pages_per_seq, dtype=dtype).shard()
      self._draft_read, _ = draft_functions(draft_graphdef, self.num_draft_tokens)
      self._draft_verify = draft_verify_function(graphdef, draft_graphdef, self.num_draft_tokens)
    self._free_pages = self.num_pages       # pages neither reserved by a request nor cached
    self._admissions = 0
    # With layers of both kinds: the window layers' pools, counted apart.
    self._free_window_pages = self.window_num_pages if self._window_pools else 0
    self._slots: list[_Request | None] = [None] * self.max_batch
    self._waiting: collections.deque[_Request] = collections.deque()
    self._results: dict[int, np.ndarray] = {}
    self._next_id = 0
    self._clock = 0                # step() calls so far (priority aging)
    self._aborted: set[int] = set()    # requests aborted since the last step began
    self.stats = EngineStats()

  def _check_draft(self, draft, model: DecoderLM) -> None:
    """Refuses a ``draft`` the engine cannot run beside ``model`` (see ``Engine``'s ``draft``)."""
    if isinstance(draft, str) and draft != "mtp":
      raise ValueError(f"`draft` must be None (prompt lookup), 'mtp' (the model's own "
                       f"multi-token prediction) or a DecoderLM, got {draft!r}.")
    if not isinstance(draft, (DecoderLM, str)):
      raise ValueError(f"`draft` must be None, 'mtp' or a DecoderLM, got "
                       f"{type(draft).__name__}.")
    if not self.num_draft_tokens:
      raise ValueError("`draft` proposes `num_draft_tokens` tokens per step: give "
                       "num_draft_tokens >= 1.")
    if draft == "mtp":
      if not model.config.mtp_depth:
        raise ValueError("`draft='mtp'` drafts with the model's multi-token-prediction module; "
                         "this model has none (mtp_depth=0).")
      return
    if draft.config.vocab_size != model.config.vocab_size:
      raise ValueError(f"`draft`'s vocab_size ({draft.config.vocab_size}) must equal the "
                       f"model's ({model.config.vocab_size}): drafts are the model's tokens.")
    for who, cfg in (("`draft`", draft.config), ("the model", model.config)):
      if not cfg.kinds() <= {"A", "M", "I"}:
        raise ValueError(f"{who} has layers of kinds {sorted(cfg.kinds())}; a draft model runs "
                         f"beside models whose layers hold whole sequences (A, M, I: no sliding "
                         f"window, no recurrent state).")

  def _check_mtp_table(self) -> None:
    """With MTP drafting: the module's block shares ``PagedModelCache.whole_table`` (a layer
    holding whole sequences, else the first paged layer), whose pool has ``num_pages`` pages
    (window layers have pools of their own only beside whole ones); a block holding whole
    sequences needs such a layer, a sliding-window block any paged one."""
    windows = self.cache.windows
    if not (None in windows or (windows and mtp_layer_kind(self.config)[0] == "S")):
      raise ValueError("`draft='mtp'`: the MTP module's block holds whole sequences and shares "
                       "the page table of a model layer that does; this model has none (layer "
                       f"kinds {sorted(self.config.kinds())}).")

  def _init_mtp_cache(self, model: DecoderLM, pool: int, dtype) -> PagedModelCache:
    """The MTP block's pool: the shared table's ``pool`` pages, and spare ones for its chained
    drafts past a sequence's end (``k - 1`` positions a slot)."""
    spare = self.max_batch * -(-(self.num_draft_tokens - 1) // self.page_size)
    return model.init_mtp_paged_cache(self.max_batch, pool + spare, self.page_size,
                                      max_pages_per_seq=self.max_pages_per_seq, dtype=dtype)

  def _mtp_probs_shape(self) -> jax.ShapeDtypeStruct:
    """``mtp_probs``: the MTP module's distributions of each slot's sampled drafts, kept for the
    next step's verify (``[max_batch, k, V]`` fp32; made on the first sampled call)."""
    return jax.ShapeDtypeStruct((self.max_batch, self.num_draft_tokens,
                                 self.config.vocab_size), jnp.float32)

  def _pages_within(self, model: DecoderLM, budget: int, dtype, draft) -> int:
    """The most ``num_pages`` whose cache fits ``budget`` bytes (``cache_bytes``): the cache's
    size -- with the prefix cache's state snapshots, and the draft model's or the MTP block's
    (and ``mtp_probs``) beside it -- is linear in the pages, measured on abstract caches (nothing
    allocated)."""
    def size(pages):
      window = self.window_num_pages if self._whole else pages
      whole = lambda: model.init_paged_cache(  # noqa: E731
          self.max_batch, pages, self.page_size, max_pages_per_seq=self.max_pages_per_seq,
          window_num_pages=window, dtype=dtype)
      cache = jax.eval_shape(whole)
      store = (jax.eval_shape(lambda: whole().state_store(self._store_count))
               if self._store_count else ())
      if isinstance(draft, str):   # its pool, and the sampled drafts' distributions
        extra = (jax.eval_shape(lambda: self._init_mtp_cache(model, pages, dtype)),
                 self._mtp_probs_shape())
      elif draft is not None:
        extra = jax.eval_shape(lambda: draft.init_paged_cache(
            self.max_batch, pages, self.page_size, max_pages_per_seq=self.max_pages_per_seq,
            dtype=dtype))
      else:
        extra = ()
      return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((cache, store, extra)))
    fixed = size(1)
    per_page = size(2) - fixed
    pages = 1 + (budget - fixed) // per_page if budget >= fixed else 0
    if pages < 1:
      raise ValueError(f"`cache_bytes` {budget} is below the smallest cache of this engine "
                       f"({fixed} bytes: one page per pool, page tables, recurrent states"
                       + (f", sliding-window pools of {self.window_num_pages} pages"
                          if self._window_pools else "") + ").")
    return int(pages)

  def _on_mesh(self):
    """The context every device call of the engine runs in: ``jax.set_mesh(self.mesh)``."""
    return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

  # -- requests --------------------------------------------------------------------------------

  def submit(self, prompt, max_new_tokens: int, *, eos_id=None, stop=None,
             temperature: float | None = None, top_p: float | None = None,
             top_k: int | None = None, min_p: float | None = None, seed: int | None = None,
             priority: int = 0,
             stop_strings=None, repetition_penalty: float | None = None,
             presence_penalty: float | None = None,
             frequency_penalty: float | None = None) -> int:
    """Queues a request: ``prompt`` (1-D token ids, at least one) and up to ``max_new_tokens``
    new tokens (fewer when ``eos_id`` is sampled: it ends the request and is returned; one id or
    several, as Llama-3's two end tokens; or when the output ends with one of the token
    sequences ``stop``, also returned; or when the text of the output contains one of the
    strings ``stop_strings``, decoded with the engine's ``detokenize``: the result ends with the
    token that completed it, which the caller's text can be cut at).
    ``temperature`` / ``top_p`` / ``top_k`` / ``min_p`` / ``seed``: this request's sampling
    (default: the engine's, and seed ``engine.seed + id``); requests with different settings share
    the engine's steps.  ``priority``: lower values are served first (vLLM's convention): a request
    queues ahead of every waiting request with a larger value (first come, first served among
    equals), and when it cannot be admitted for lack of a slot or pages, running requests with
    larger values are preempted (the largest first, then the most recently admitted) to make room,
    and recomputed later as on-demand preemptions are (with ``Engine(priority_aging=n)`` every value
    compared is less one per ``n`` steps since its request was submitted).
    ``repetition_penalty`` / ``presence_penalty`` / ``frequency_penalty``: this request's
    penalties (default: the engine's).  Returns the request id, the key of its result in ``run``
    / ``results``."""
    prompt = np.asarray(prompt)
    vocab = self.config.vocab_size
    if prompt.ndim != 1 or prompt.size < 1 or not np.issubdtype(prompt.dtype, np.integer):
      raise ValueError(f"`prompt` must be a non-empty 1-D array of token ids, got "
                       f"{prompt.dtype}{list(prompt.shape)}.")
    if prompt.min() < 0 or prompt.max() >= vocab:
      raise ValueError(f"`prompt` token ids must be in [0, {vocab}) (vocab_size), got "
                       f"{sorted(set(prompt[(prompt < 0) | (prompt >= vocab)].tolist()))[:8]}.")
    if not is_int(max_new_tokens) or max_new_tokens < 0:
      raise ValueError(f"`max_new_tokens` must be an int >= 0, got {max_new_tokens!r}.")
    eos = () if eos_id is None else (eos_id,) if is_int(eos_id) else eos_id
    if (isinstance(eos, (str, bytes)) or not hasattr(eos, "__iter__")
        or not all(is_int(e) and 0 <= e < vocab for e in eos)):
      raise ValueError(f"`eos_id` must be None, a token id or a sequence of token ids in "
                       f"[0, {vocab}), got {eos_id!r}.")
    texts = () if stop_strings is None else stop_strings
    if (isinstance(texts, (str, bytes)) or not hasattr(texts, "__iter__")
        or not all(isinstance(s, str) and s for s in texts)):
      raise ValueError(f"`stop_strings` must be None or a sequence of non-empty strings, got "
                       f"{stop_strings!r}.")
    if texts and self.detokenize is None:
      raise ValueError("`stop_strings` needs the engine's `detokenize` (token ids -> text): "
                       "Engine(model, detokenize=tokenizer.decode).")
    stops = () if stop is None else stop
    if (isinstance(stops, (str, bytes)) or not hasattr(stops, "__iter__")
        or not all(hasattr(q, "__iter__") and len(q) > 0
                   and all(is_int(x) and 0 <= x < vocab for x in q) for q in stops)):
      raise ValueError(f"`stop` must be None or a sequence of non-empty token-id sequences "
                       f"(ids in [0, {vocab})), got {stop!r}.")
    sampling = {k: d if v is None else v for (k, d), v in zip(
        self.sampling.items(), (temperature, top_p, top_k, min_p))}
    check_sampling(**sampling)
    penalties = {k: d if v is None else v for (k, d), v in zip(
        self.penalties.items(), (repetition_penalty, presence_penalty, frequency_penalty))}
    check_penalties(**penalties)
    penalties = {k: float(v) for k, v in penalties.items()}
    if seed is not None and (not is_int(seed) or not 0 <= seed < _SEEDS):
      raise ValueError(f"`seed` must be None or an int in [0, 2**31), got {seed!r}.")
    if not is_int(priority):
      raise ValueError(f"`priority` must be an int (lower is served first), got {priority!r}.")
    positions = prompt.size + max(int(max_new_tokens) - 1, 0)
    logical = -(-positions // self.page_size)
    window = logical if self.window is None else min(logical, self.window_pages)
    pages = logical if self._whole else window
    if (logical > self.max_pages_per_seq or pages > self.num_pages
        or (self.window is not None and window > self.window_num_pages)):
      pools = (f"num_pages={self.num_pages}, window_num_pages={self.window_num_pages}"
               if self._window_pools else f"num_pages={self.num_pages}")
      at_once = "" if self.window is None else f" ({window} at once in a sliding-window layer)"
      raise ValueError(f"a request of {prompt.size} prompt + {max_new_tokens} new tokens needs "
                       f"{logical} pages of {self.page_size}{at_once}, more than a sequence may "
                       f"hold (max_pages_per_seq={self.max_pages_per_seq}, {pools}).")
    if self.config.position == "learned" and positions > self.config.max_seq_len:
      raise ValueError(f"prompt + max_new_tokens - 1 = {positions} exceeds the learned position "
                       f"table (max_seq_len={self.config.max_seq_len}).")
    rid, self._next_id = self._next_id, self._next_id + 1
    request = _Request(rid, prompt.astype(np.int32), int(max_new_tokens),
                       frozenset(int(e) for e in eos), pages,
                       window_pages=window if self._window_pools else 0,
                       seed=(self.seed + rid) % _SEEDS if seed is None else int(seed),
                       temperature=float(sampling["temperature"]),
                       top_p=float(sampling["top_p"]), top_k=int(sampling["top_k"]),
                       min_p=float(sampling["min_p"]), **penalties,
                       stop=tuple(tuple(int(x) for x in q) for q in stops),
                       priority=int(priority), stop_strings=tuple(texts),
                       detokenize=self.detokenize, submitted=self._clock)
    if self._prefix is not None:
      self._extend_keys(request, request.prompt)
    if request.max_new_tokens == 0:
      self._results[rid] = self._result(request)
      self.stats.finished += 1
    else:
      self._enqueue(request)
    return rid

  def _enqueue(self, r: _Request, *, front: bool = False) -> None:
    """``r`` into the queue, ordered by priority: behind the waiting requests of its priority or
    a lower one (a new request), or ahead of those of its priority (``front``: a preempted one,
    which came first)."""
    at, rank = len(self._waiting), self._rank(r)
    while at and (self._rank(self._waiting[at - 1]) >= rank if front
                  else self._rank(self._waiting[at - 1]) > rank):
      at -= 1
    self._waiting.insert(at, r)

  def _rank(self, r: _Request) -> int:
    """``r``'s priority value now: its ``priority``, less one for every ``priority_aging``
    steps since it was submitted (no aging: its ``priority``)."""
    if self.priority_aging is None:
      return r.priority
    return r.priority - (self._clock - r.submitted) // self.priority_aging

  def _result(self, r: _Request):
    return (r.tokens, np.asarray(r.logprobs, np.float32)) if self.logprobs else r.tokens

  @property
  def window_pages(self) -> int | None:
    """With sliding-window layers whose pages are released (``window``), the most pages a
    sequence holds at once in each of them: its window's and one step's new tokens (up to
    ``chunk``, or ``num_draft_tokens + 1``), over one page more when they start mid-page; None
    otherwise."""
    if self.window is None:
      return None
    step = max(self.chunk, self.num_draft_tokens + 1)
    return -(-(self.window + step) // self.page_size) + 1

  @property
  def pending(self) -> int:
    """Requests not finished: waiting or in a slot."""
    return len(self._waiting) + sum(r is not None for r in self._slots)

  @property
  def results(self) -> dict[int, np.ndarray]:
    """Finished requests not yet handed out by ``run`` / ``pop_results``: id -> prompt followed
    by the generated tokens."""
    return dict(self._results)

  def pop_results(self) -> dict[int, np.ndarray]:
    """``results``, forgotten by the engine (a long-running server would otherwise keep every
    finished request's tokens)."""
    out, self._results = self._results, {}
    return out

  # -- the loop --------------------------------------------------------------------------------

  def _admit(self) -> None:
    """First come, first served: the head of the queue takes a free slot when the pool can hold
    its page need (``_first_need``: all of it, or on demand its prompt's; a later, smaller
    request does not overtake it: no starvation).  The
    static policy admits only into an empty batch.  With a prefix cache, a request's cached
    prefix pages are attached to its slot (at most its prompt's full pages but the last token:
    the first output needs that token's logits), it reserves only the rest, and idle cached
    pages are evicted when the free pages do not cover that.

    A request whose next uncached prefix page is being computed right now by a running request
    (the same prompt sampled many times, a system prompt shared by requests that arrive
    together) waits for it instead of computing it again: it stays in the queue, later requests
    may take the free slot meanwhile, and it is admitted, reading those pages, once they are
    cached (continuous policy only)."""
    if self.policy == "static" and any(r is not None for r in self._slots):
      return
    evict, attach = [], []
    waiting = self._wait_for_prefix and self._waiting and None in self._slots
    coming = self._pages_in_flight() if waiting else set()
    at = 0                                       # the first request of the queue not waiting
    for slot, r in enumerate(self._slots):
      if r is not None:
        continue
      matched, state = [], -1
      while at < len(self._waiting):
        request = self._waiting[at]
        if self._prefix is not None:
          matched, key, waits = self._match(request, coming)
          if waits:
            self.stats.prefix_waits += 1
            at += 1
            continue
          if key is not None:
            state = self._snapshots.use(key)
        break
      if at == len(self._waiting):
        break
      need = self._first_need(request) - len(matched)
      if request.window_pages > self._free_window_pages:
        break                                  # (no prefix cache: nothing to evict)
      if need > self._free_pages:
        if self._prefix is None:
          break
        spare = self._prefix.evictable(keep=set(matched))
        if need > self._free_pages + len(spare):
          break
        short = need - self._free_pages
        for page in spare[:short]:
          self._evict(page)
          evict.append(page)
        self._free_pages += short
      del self._waiting[at]
      if self._wait_for_prefix:
        coming.update(self._uncached_prompt_keys(request))
      self._free_pages -= need
      self._free_window_pages -= request.window_pages
      request.fresh = need
      request.admitted, self._admissions = self._admissions, self._admissions + 1
      self._slots[slot] = request
      if matched:
        self._prefix.acquire(matched)
        request.shared = matched
        request.fed = request.draft_held = len(matched) * self.page_size
        self.stats.prefix_hit_tokens += request.fed
        attach.append((slot, matched, state))
    self._update_pages(evict, attach)

  def _match(self, r: _Request, coming) -> tuple[list[int], bytes | None, bool]:
    """``r``'s cached prefix pages (at most its feed's full pages but the last token; with
    recurrent layers, up to the last page with a state snapshot), that snapshot's key (None
    without one), and whether ``r`` waits for its next prefix page, in ``coming`` (computed by
    a running request)."""
    usable = r.keys[:(r.feed.size - 1) // self.page_size]
    matched = self._prefix.match(usable)
    if len(usable) > len(matched) and usable[len(matched)] in coming:
      return matched, None, True
    while matched and not self._resumable(r, matched, usable):
      matched = matched[:-1]
    if self._snapshots is not None and matched:
      return matched, usable[len(matched) - 1], False
    return matched, None, False

  def _resumable(self, r: _Request, matched: list[int], usable: list[bytes]) -> bool:
    """Whether ``r`` can read the cached pages ``matched`` and go on after them: with recurrent
    layers, a snapshot of the states after the last one is saved; with MTP drafting, the module's
    entry at the last one's last position pairs it with ``r``'s next token (the request that
    computed the page may have gone on with another)."""
    if self._snapshots is not None and usable[len(matched) - 1] not in self._snapshots:
      return False
    return not self._mtp or self._follow[matched[-1]] == r.feed[len(matched) * self.page_size]

  def _victim(self, active: list[tuple[int, _Request]]) -> tuple[int, _Request]:
    """The running request preempted first: the largest priority value, then the most recently
    admitted."""
    return max(active, key=lambda sr: (self._rank(sr[1]), sr[1].admitted))

  def _make_room(self) -> None:
    """Priority preemption: while the head of the queue cannot be admitted (no free slot, or
    too few free and evictable pages) and running requests with a larger priority value hold
    enough to admit it, the largest of them (then the most recently admitted) is preempted.
    A head waiting for a prefix page a running request computes, or one that preempting every
    such request would not admit, preempts nothing."""
    if self.policy == "static" or not self._waiting:
      return
    head = self._waiting[0]
    # (First, as it is cheap: with one priority, every step ends here.)
    lower = [(s, r) for s, r in enumerate(self._slots)
             if r is not None and self._rank(r) > self._rank(head)]
    if not lower:
      return
    matched = []
    if self._prefix is not None:
      coming = self._pages_in_flight() if self._wait_for_prefix else set()
      matched, _, waits = self._match(head, coming)
      if waits:
        return
    need = self._first_need(head) - len(matched)

    def fits(freed_slot, pages, window_pages):
      spare = 0 if self._prefix is None else len(self._prefix.evictable(keep=set(matched)))
      return ((None in self._slots or freed_slot)
              and need <= self._free_pages + spare + pages
              and head.window_pages <= self._free_window_pages + window_pages)

    if fits(False, 0, 0):
      return
    # What preempting all of them frees: their own pages, and the cached pages only they read
    # (idle then: evictable).
    freed = sum(r.fresh for _, r in lower)
    if self._prefix is not None:
      readers = collections.Counter(p for _, r in lower for p in r.shared)
      freed += sum(n == self._prefix.refs[p] and p not in matched for p, n in readers.items())
    if not fits(True, freed, sum(r.window_pages for _, r in lower)):
      return
    while lower and not fits(False, 0, 0):
      victim = self._victim(lower)
      self._preempt(*victim)
      lower.remove(victim)

  def _first_need(self, r: _Request) -> int:
    """Pages ``r`` reserves at admission (its prefix-cache hits included): its whole life's
    (``allocation="reserve"``), or on demand those of its feed (the prompt; after a preemption
    the outputs so far too), the rest as it decodes (``_grow``).  Sliding-window-only models
    reserve their bounded need whole either way."""
    if not self._on_demand:
      return r.pages
    return min(r.pages, -(-r.feed.size // self.page_size))

  def _grow(self) -> None:
    """``allocation="on_demand"``: reserves the pages the running requests' next tokens need
    (a decoding request's token that starts a page), evicting idle prefix-cache pages, then
    preempting the most recently admitted requests while the free pages cannot cover it."""
    if not self._on_demand:
      return
    ps = self.page_size

    def short(r):
      n = min(self.chunk, r.feed.size - r.fed) if r.reading else 1 + self._num_drafts(r)
      return max(0, -(-(r.held + n) // ps) - len(r.shared) - r.fresh)

    while True:
      active = [(s, r) for s, r in enumerate(self._slots) if r is not None]
      want = sum(short(r) for _, r in active)
      if want <= self._free_pages:
        break
      if self._prefix is not None:
        spare = self._prefix.evictable()
        if want <= self._free_pages + len(spare):
          evict = spare[:want - self._free_pages]
          for page in evict:
            self._evict(page)
          self._update_pages(evict, [])
          self._free_pages += len(evict)
          break
      self._preempt(*self._victim(active))
    for _, r in active:
      n = short(r)
      r.fresh += n
      self._free_pages -= n

  def _num_drafts(self, r: _Request) -> int:
    """Drafts a decoding request feeds this step: ``num_draft_tokens``, fewer near its end
    (``max_new_tokens``) or its page table's, so that its cache never passes the positions it
    reserved (prompt + ``max_new_tokens - 1``)."""
    if not self.num_draft_tokens:
      return 0
    room = self.max_pages_per_seq * self.page_size - r.held - 1
    return max(0, min(self.num_draft_tokens, r.max_new_tokens - len(r.out) - 1, room))

  def _preempt(self, slot: int, r: _Request) -> None:
    """Takes ``r`` out of its slot and back to the head of the queue: its pages return to the
    pool (its cached ones to the prefix cache), and it will read its prompt and its outputs so
    far again (recompute, from cached pages where a prefix cache kept them).  The slot is freed
    on the device at once, while the prefix cache still holds its cached pages (``keep``): an
    eviction right after must push them to the free stack once, not twice."""
    done = np.zeros((self.max_batch,), bool)
    done[slot] = True
    self._free_slots(done)
    self.stats.preempted += 1
    self.stats.preempted_tokens += r.held
    self._free_pages += r.fresh
    self._free_window_pages += r.window_pages
    if self._prefix is not None:
      self._prefix.release(r.shared)
    r.feed = r.tokens
    r.refed, r.fed, r.shared, r.fresh, r.draft_held = len(r.out), 0, [], 0, 0
    r.drafts = None
    if self._prefix is not None:
      self._extend_keys(r, r.feed)
    self._slots[slot] = None
    self._enqueue(r, front=True)

  def _uncached_prompt_keys(self, r: _Request) -> list[bytes]:
    """Keys of ``r``'s full prompt pages not cached yet: ones its prefill will compute."""
    return [k for k in r.keys[:r.feed.size // self.page_size] if k not in self._prefix.page_of]

  def _pages_in_flight(self) -> set[bytes]:
    """Keys of the prompt pages the running requests are computing (cached once full)."""
    return {k for r in self._slots if r is not None and r.reading
            for k in self._uncached_prompt_keys(r)}

  def _evict(self, page: int) -> None:
    """An idle cached page out of the prefix cache (and its state snapshot, if any)."""
    if self._snapshots is not None:
      self._snapshots.drop(self._prefix.key_of[page])
    self._prefix.evict(page)

  def _update_pages(self, evict: list[int], attach: list[tuple[int, list[int], int]]) -> None:
    """One device call: the ``evict`` pages back to the pools, then each ``(slot, pages,
    snapshot)`` of ``attach`` started from those cached pages (and, with recurrent layers, from
    that state snapshot; fixed shapes: one compiled program)."""
    self.stats.evicted_pages += len(evict)
    if not (evict or attach):
      return
    b, m = self.max_batch, self.max_pages_per_seq
    pages = np.full((self.num_pages,), -1, np.int32)
    pages[:len(evict)] = evict
    rows, tables = np.full((b,), b, np.int32), np.full((b, m), -1, np.int32)
    lengths, states = np.zeros((b,), np.int32), np.zeros((b,), np.int32)
    for i, (slot, matched, state) in enumerate(attach):
      rows[i], tables[i, :len(matched)], states[i] = slot, matched, state
      lengths[i] = len(matched) * self.page_size
    with self._on_mesh():
      self.cache = _prefix_update(self.cache, *map(jnp.asarray, (pages, rows, tables, lengths)),
                                  self._store, None if self._store is None else jnp.asarray(states))

  def _save_states(self) -> None:
    """Snapshots of the recurrent states of the slots whose tokens end on a cached page's end
    (one device call); a later request sharing that prefix starts from them."""
    ps, rows, ids = self.page_size, [], []
    for slot, r in enumerate(self._slots):
      if r is None:
        continue
      held = r.held
      if held == 0 or held % ps or held // ps > len(r.keys):
        continue
      key = r.keys[held // ps - 1]
      if key not in self._prefix.page_of or key in self._snapshots:
        continue
      sid = self._snapshots.take(key, set(ids))
      if sid is None:
        break
      rows.append(slot)
      ids.append(sid)
    if not rows:
      return
    b = self.max_batch
    rows_a, ids_a = np.full((b,), b, np.int32), np.full((b,), -1, np.int32)
    rows_a[:len(rows)], ids_a[:len(ids)] = rows, ids
    with self._on_mesh():
      self._store = _save_states(self.cache, self._store, jnp.asarray(rows_a),
                                 jnp.asarray(ids_a))
    self.stats.saved_states += len(rows)

  def _extend_keys(self, r: _Request, tokens: np.ndarray) -> None:
    """``r.keys`` extended over the full pages of ``tokens`` (its token sequence so far)."""
    ps = self.page_size
    for j in range(len(r.keys), tokens.size // ps):
      r.keys.append(_page_key(r.keys[-1] if r.keys else b"", tokens[j * ps:(j + 1) * ps]))

  def _cache_pages(self) -> None:
    """Puts the pages the busy slots have filled since the last step into the prefix cache."""
    ps, table = self.page_size, None
    for slot, r in enumerate(self._slots):
      if r is None:
        continue
      held = r.held
      # With a draft model a page is cached once its entries are final too (a check that kept
      # every draft leaves the draft's entry of the last one to the next proposal).
      full = (held if self._draft_verify is None else min(held, r.draft_held)) // ps
      first = len(r.shared)
      if full <= first:
        continue
      if held > r.prompt.size:
        self._extend_keys(r, r.tokens[:-1])
      if table is None:
        table = np.asarray(self.cache.page_table)
      for j in range(first, full):
        page = int(table[slot, j])
        if self._prefix.add(r.keys[j], page):
          r.shared.append(page)
          r.fresh -= 1                             # the cache owns it from now on
          if self._mtp:       # the token the MTP module paired the page's last position with
            after = (j + 1) * ps
            self._follow[page] = int(r.prompt[after] if after < r.prompt.size
                                     else r.out[after - r.prompt.size])
        else:
          break          # a page of its own past this one would hang off a private parent

  def _sub_batch(self, n: int) -> int:
    """Rows of a sub-batch call serving ``n`` slots: the next power of two, at most
    ``max_batch`` (few compiled shapes)."""
    return min(self.max_batch, 1 << (n - 1).bit_length())

  def _call(self, group, t: int, speculate: bool = False) -> list[list[tuple[int, float]]]:
    """One model call on the slots of ``group`` (``[(slot, request, count)]``) with ``T = t``,
    through ``take`` / ``put`` of their cache rows; returns each slot's sampled tokens with their
    log-probabilities: one, or with ``speculate`` (decoding slots feeding their last token and
    ``count - 1`` drafts: prompt lookup's, or the draft model's, proposed first in this call)
    the drafts kept and the model's next token."""
    size = self._sub_batch(len(group))
    rows = np.full((size,), self.max_batch, np.int32)          # padding entries: dropped
    tokens = np.zeros((size, t), np.int32)
    counts = np.zeros((size,), np.int32)
    seeds, index, top_k, start = (np.zeros((size,), np.int32) for _ in range(4))
    first = np.zeros((size, 2), np.int32)         # with a draft model: the tokens it has not
    num_first = np.zeros((size,), np.int32)       # read (its input before its drafts)
    following = np.full((size,), -1, np.int32)     # with MTP: the token after a prompt chunk
    temperature, top_p = np.zeros((size,), np.float32), np.ones((size,), np.float32)
    min_p = np.zeros((size,), np.float32)
    for i, (s, r, n) in enumerate(group):
      rows[i], counts[i] = s, n
      # The token this call samples for r is its output number len(r.out) (a mid-prompt one is
      # dropped): its key depends on that index alone, not on the step or the batch.
      seeds[i], index[i] = r.seed, len(r.out)
      temperature[i], top_p[i], top_k[i], min_p[i] = r.temperature, r.top_p, r.top_k, r.min_p
      if r.reading:
        tokens[i, :n] = r.feed[r.fed:r.fed + n]
        if r.fed + n < r.feed.size:
          following[i] = r.feed[r.fed + n]
      else:
        tokens[i, 0] = r.out[-1]
        if self._mtp:                    # the module's proposals, made by the last call
          tokens[i, 1:n] = r.drafts[:n - 1]
        elif self._draft_verify is not None:    # the draft model's input: what it has not read,
          start[i], num_first[i] = r.draft_held, r.held + 1 - r.draft_held   # one or two tokens
          if not 1 <= num_first[i] <= 2:
            raise RuntimeError(f"the draft model is {num_first[i]} tokens behind request "
                               f"{r.rid} (1 or 2 expected)")
          first[i, :num_first[i]] = r.tokens[r.draft_held:r.held + 1]
        elif n > 1:
          tokens[i, 1:n] = ngram_propose(r.tokens, n - 1, self.ngram_size)
    # The page-table columns the call needs (its sequences' pages after it), rounded up to a
    # power of two (few compiled shapes), at least MIN_TABLE_PAGES: the decode paths read that
    # many pages per sequence, not the table's width (max_seq_len).
    ps, m = self.page_size, self.max_pages_per_seq
    ahead = self.num_draft_tokens - 1 if self._mtp else 0     # the MTP module's chained drafts
    need = max(-(-(r.held + n + ahead) // ps) for _, r, n in group)
    pages = min(m, max(MIN_TABLE_PAGES, 1 << (max(need, 1) - 1).bit_length()))
    pages = pages if self.narrow_tables else m
    sampling = tuple(map(jnp.asarray, (seeds, index, temperature, top_p, top_k, min_p)))
    tokens, counts_d, rows_d = jnp.asarray(tokens), jnp.asarray(counts), jnp.asarray(rows)
    narrow = None if pages == m else pages
    static = dict(pages=narrow, greedy=not temperature.any())
    penalties = self._penalty_rows(group, size)
    with self._on_mesh():
      args = (self._state, tokens, counts_d, rows_d, self.cache, sampling)
      if self._mtp and not static["greedy"] and self.mtp_probs is None:
        probs = self._mtp_probs_shape()   # the sampled drafts' distributions
        self.mtp_probs = jnp.zeros(probs.shape, probs.dtype)
      if self._mtp and speculate:
        out, accepted, logprob, self.cache, drafts, self.mtp_cache, self.mtp_probs = (
            self._mtp_verify(*args, self.mtp_cache, self.mtp_probs, **static,
                             penalties=penalties))
      elif self._mtp:
        out, logprob, self.cache, drafts, self.mtp_cache, self.mtp_probs = self._mtp_step(
            *args, self.mtp_cache, jnp.asarray(following), self.mtp_probs, **static,
            draft=bool((following[:len(group)] < 0).any()),    # mid-prompt rows alone: no drafts
            penalties=penalties)
      elif self._draft_verify is not None and speculate:   # the draft proposes, the model checks
        out, accepted, logprob, self.cache, self.draft_cache, _ = self._draft_verify(
            self._state, self._draft_state, jnp.asarray(first), jnp.asarray(num_first),
            jnp.asarray(start), tokens, counts_d, rows_d, self.cache, self.draft_cache, sampling,
            t=t, **static, penalties=penalties)
      elif speculate:
        out, accepted, logprob, self.cache = self._verify(*args, **static, penalties=penalties)
      else:
        out, logprob, self.cache = self._step(*args, **static, penalties=penalties)
      if self._draft_verify is not None and group[0][1].reading:   # the draft reads prompts too
        self.draft_cache = self._draft_read(self._draft_state, tokens, counts_d, rows_d,
                                            self.draft_cache, self.cache, pages=narrow)
        for _, r, n in group:
          r.draft_held = r.fed + n
    if self._mtp:
      for (_, r, _), row in zip(group, np.asarray(drafts)):
        r.drafts = row
    self.stats.table_columns += size * pages
    self.stats.calls += 1
    self.stats.computed_rows += size * t
    out, logprob = np.asarray(out)[:len(group)], np.asarray(logprob)[:len(group)]
    if not speculate:
      return [[(int(x), float(lp))] for x, lp in zip(out, logprob)]
    accepted = np.asarray(accepted)[:len(group)]
    if self._draft_verify is not None:   # its entries of the kept: the last, the drafts it fed
      for (_, r, n), a in zip(group, accepted):
        r.draft_held = r.held + 1 + min(int(a), max(n - 2, 0))
    self.stats.drafted += int(counts.sum()) - len(group)
    self.stats.accepted_drafts += int(accepted.sum())
    return [[(int(x), float(lp)) for x, lp in zip(row[:a + 1], lps[:a + 1])]
            for row, lps, a in zip(out, logprob, accepted)]

  @staticmethod
  def _penalty_rows(group, size):
    """``penalized_rows``' arguments for the rows of ``group`` (None when no request of it has
    a penalty): each one's prompt and outputs so far, padded with -1 to a power of two (few
    compiled shapes)."""
    if not any(r.penalized for _, r, _ in group):
      return None
    need = max(r.prompt.size + len(r.out) for _, r, _ in group)
    history = np.full((size, max(16, 1 << (need - 1).bit_length())), -1, np.int32)
    num_prompt = np.zeros((size,), np.int32)
    repetition = np.ones((size,), np.float32)
    presence, frequency = np.zeros((size,), np.float32), np.zeros((size,), np.float32)
    for i, (_, r, _) in enumerate(group):
      tokens = r.tokens
      history[i, :tokens.size] = tokens
      num_prompt[i] = r.prompt.size
      repetition[i], presence[i] = r.repetition_penalty, r.presence_penalty
      frequency[i] = r.frequency_penalty
    return tuple(map(jnp.asarray, (history, num_prompt, repetition, presence, frequency)))

  def step(self) -> list[tuple[int, int]]:
    """Feeds every busy slot once -- the slots reading their prompt one chunk each (one model
    call), the decoding slots one token each (another call); returns the ``(request id, token)``
    pairs generated."""
    self._clock += 1
    self._aborted.clear()
    if self.priority_aging is not None:   # values fall with age: the queue in their order now
      self._waiting = collections.deque(sorted(self._waiting, key=self._rank))   # (stable)
    self._grow()
    self._make_room()
    self._admit()
    active = [(s, r) for s, r in enumerate(self._slots) if r is not None]
    if not active:
      return []
    reading = [(s, r) for s, r in active if r.reading]
    decoding = [(s, r, 1 + self._num_drafts(r)) for s, r in active if not r.reading]
    sampled = {}
    if reading:
      remaining = max(r.feed.size - r.fed for _, r in reading)
      t = min(self.chunk, 1 << (int(remaining) - 1).bit_length())
      group = [(s, r, min(t, r.feed.size - r.fed)) for s, r in reading]
      sampled.update(zip([s for s, _, _ in group], self._call(group, t)))
      for _, r, n in group:
        r.fed += n
      self.stats.fed_tokens += sum(n for _, _, n in group)
    if decoding:
      t = max(n for _, _, n in decoding)
      sampled.update(zip([s for s, _, _ in decoding], self._call(decoding, t, speculate=t > 1)))
      self.stats.fed_tokens += sum(n for _, _, n in decoding)
    emitted, done = [], np.zeros((self.max_batch,), bool)
    for s, r in active:
      if r.reading:
        continue                         # mid-prompt: the sample is not a token of the output
      for token, logprob in sampled[s]:      # one token, or with speculation up to k + 1
        r.out.append(token)
        r.logprobs.append(logprob)
        emitted.append((r.rid, token))
        if r.finished():
          break
    if self._prefix is not None:
      self._cache_pages()
      if self._snapshots is not None:
        self._save_states()
    for s, r in active:
      if r.finished():
        done[s] = True
        self._retire(s, r)
        self.stats.finished += 1
    st = self.stats
    st.steps += 1
    st.slot_steps += self.max_batch
    st.busy_slot_steps += len(active)
    st.generated += len(emitted)
    if done.any():
      self._free_slots(done)
    return emitted

  def _retire(self, slot: int, r: _Request) -> None:
    """``r`` out of ``slot`` for good (finished or aborted): its result recorded, its pages
    counted free again (those the prefix cache holds stay there); the caller frees the slot on
    the device (``_free_slots``)."""
    self._results[r.rid] = self._result(r)
    self._slots[slot] = None
    self._free_pages += r.fresh
    self._free_window_pages += r.window_pages
    if self._prefix is not None:
      self._prefix.release(r.shared)

  def abort(self, rid: int) -> bool:
    """Ends request ``rid`` now, waiting or running (its client has gone, a deadline passed): a
    running request's slot and pages are freed at once (the full pages it computed stay in the
    prefix cache, if there is one), and its result -- the prompt and the tokens generated so far,
    with ``logprobs`` their log-probabilities -- goes to ``results`` as a finished request's does
    (``stats.aborted`` counts it).  Safe between steps, e.g. from ``run``'s ``on_token`` (which then
    gets none of its tokens left from that step).  Returns False, doing nothing, when ``rid`` is not
    pending (unknown, finished or aborted already)."""
    waiting = [i for i, r in enumerate(self._waiting) if r.rid == rid]
    running = [s for s, r in enumerate(self._slots) if r is not None and r.rid == rid]
    if waiting:                               # (a waiting request holds no slot or page)
      r = self._waiting[waiting[0]]
      del self._waiting[waiting[0]]
      self._results[rid] = self._result(r)
    elif running:
      self._retire(running[0], self._slots[running[0]])
      done = np.zeros((self.max_batch,), bool)
      done[running[0]] = True
      self._free_slots(done)
    else:
      return False
    self.stats.aborted += 1
    self._aborted.add(rid)
    return True

  def _free_slots(self, done: np.ndarray) -> None:
    """The slots where ``done [B]`` emptied on the device (one call): their pages back to the
    pools, except those the prefix cache holds now."""
    keep = None if self._prefix is None else jnp.asarray(self._prefix.mask(self.num_pages))
    with self._on_mesh():
      self.cache = self._free(self.cache, jnp.asarray(done), keep)

  @property
  def cached_pages(self) -> int:
    """Pages the prefix cache holds (in use or idle); 0 without one."""
    return 0 if self._prefix is None else len(self._prefix)

  def clear_prefix_cache(self) -> int:
    """Evicts every idle cached page (back to the free pool); returns how many."""
    if self._prefix is None:
      return 0
    idle = self._prefix.evictable()
    for page in idle:
      self._evict(page)
    self._update_pages(idle, [])
    self._free_pages += len(idle)
    return len(idle)

  def run(self, on_token: Callable[[int, int], None] | None = None, *,
          progress: bool = False) -> dict[int, np.ndarray]:
    """Steps until every submitted request has finished; returns the finished requests'
    results and forgets them (``pop_results``).  ``on_token(rid, token)`` receives each token as
    it is generated (streaming; it may ``abort`` requests); ``progress`` shows a bar of finished
    requests (tqdm)."""
    bar = None
    if progress:
      from tqdm.auto import tqdm  # noqa: PLC0415 (optional dependency)
      bar = tqdm(total=self.stats.finished + self.pending, initial=self.stats.finished,
                 unit="req")
    while self.pending:
      before = self.stats.finished + self.stats.aborted
      for rid, token in self.step():
        if on_token is not None and rid not in self._aborted:
          on_token(rid, token)
      if bar is not None:
        bar.update(self.stats.finished + self.stats.aborted - before)
    if bar is not None:
      bar.close()
    return self.pop_results()


__all__ = ["ALLOCATIONS", "POLICIES", "Engine", "EngineStats", "mtp_functions",
           "draft_functions", "step_functions", "verify_function"]
