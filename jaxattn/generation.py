"""Autoregressive generation with the KV cache: one jitted prefill, then one jitted decode step per
token; greedy, temperature and nucleus (top-p) sampling; tokens streamed to a callback.

    out = generate(model, prompt, max_new_tokens=64, temperature=0.8, top_p=0.95, seed=0,
                   on_token=lambda ids: print(tok.decode(ids), end=""))
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from jaxattn.nn.model import DecoderLM


def sample_logits(logits: Float[Array, "B V"], key, *, temperature: float = 0.0,
                  top_p: float = 1.0) -> Int[Array, "B"]:
  """Next tokens from the last position's logits.

  ``temperature == 0``: greedy (argmax).  Otherwise sample from ``softmax(logits / temperature)``
  restricted to the smallest set of tokens whose probability reaches ``top_p`` (the most likely
  token is always kept).
  """
  if temperature < 0:
    raise ValueError(f"`temperature` must be >= 0, got {temperature!r}.")
  if not 0.0 < top_p <= 1.0:
    raise ValueError(f"`top_p` must be in (0, 1], got {top_p!r}.")
  logits = logits.astype(jnp.float32)
  if temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits / temperature
  if top_p < 1.0:
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs        # mass strictly above each token
    keep_sorted = before < top_p                        # the first token always has before = 0
    keep = jnp.zeros_like(keep_sorted).at[
        jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
    logits = jnp.where(keep, logits, -jnp.inf)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def _check(model, prompt, max_new_tokens, max_len):
  if prompt.ndim != 2 or prompt.shape[1] < 1:
    raise ValueError(f"`prompt` must be [B, T] token ids with T >= 1, got shape {prompt.shape}.")
  if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
    raise ValueError(f"`max_new_tokens` must be an int >= 0, got {max_new_tokens!r}.")
  need = prompt.shape[1] + max_new_tokens
  if max_len is not None and max_len < need:
    raise ValueError(f"`max_len` ({max_len}) is below prompt length + max_new_tokens ({need}).")
  if model.config.position == "learned" and need > model.config.max_seq_len:
    raise ValueError(f"prompt length + max_new_tokens = {need} exceeds the learned position table "
                     f"(max_seq_len={model.config.max_seq_len}).")


def decode_functions(graphdef, batch: int, max_len: int, *, temperature: float = 0.0,
                     top_p: float = 1.0):
  """The two jitted programs of ``generate`` for a split model (``nnx.split(model)``):

  * ``prefill(state, tokens [B, T], key) -> (next [B], cache)`` with a fresh cache of ``max_len``;
  * ``step(state, token [B], cache, key) -> (next [B], cache)``, one token per sequence.

  ``step`` donates its cache: the new token's keys are written into the same buffers (without
  donation XLA allocates a new cache and copies all of it, every layer, on every token).  The
  cache passed to ``step`` is therefore consumed; use the returned one.
  """

  @jax.jit
  def prefill(state, tokens, key):
    m = nnx.merge(graphdef, state)
    logits, cache = m(tokens, cache=m.init_cache(batch, max_len))
    return sample_logits(logits[:, -1], key, temperature=temperature, top_p=top_p), cache

  @functools.partial(jax.jit, donate_argnums=2)
  def step(state, token, cache, key):
    m = nnx.merge(graphdef, state)
    logits, cache = m(token[:, None], cache=cache)
    return sample_logits(logits[:, -1], key, temperature=temperature, top_p=top_p), cache

  return prefill, step


def generate(model: DecoderLM, prompt: Int[Array, "B T"], max_new_tokens: int, *,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
             max_len: int | None = None, eos_id: int | None = None,
             on_token: Callable[[np.ndarray], None] | None = None) -> np.ndarray:
  """``prompt [B, T]`` (equal lengths) -> ``[B, T + n]`` token ids, ``n <= max_new_tokens``.

  Prefill runs the prompt through ``model`` with a fresh cache of ``max_len`` slots (default:
  ``T + max_new_tokens`` rounded up to a multiple of 128; slots past the tokens are masked), then
  each step decodes one token per sequence.  ``on_token`` receives each
  new ``[B]`` array as soon as it is sampled (streaming).  Generation stops early when every
  sequence has produced ``eos_id``.
  """
  prompt = jnp.asarray(prompt, jnp.int32)
  _check(model, prompt, max_new_tokens, max_len)
  b, t = prompt.shape
  # Default capacity: what is needed, rounded up to whole 128-token blocks, so that on TPU the
  # decode kernel reads the cache as pages of itself (lengths a multiple of 16; 128+ per page).
  max_len = max_len or -(-(t + max_new_tokens) // 128) * 128
  graphdef, state = nnx.split(model)
  prefill, step = decode_functions(graphdef, b, max_len, temperature=temperature, top_p=top_p)
  key = jax.random.key(seed)
  out = [np.asarray(prompt)]
  if max_new_tokens == 0:
    return out[0]
  key, sub = jax.random.split(key)
  token, cache = prefill(state, prompt, sub)
  done = np.zeros((b,), bool)
  for i in range(max_new_tokens):
    host = np.asarray(token)
    out.append(host[:, None])
    if on_token is not None:
      on_token(host)
    if eos_id is not None:
      done |= host == eos_id
      if done.all():
        break
    if i + 1 < max_new_tokens:
      key, sub = jax.random.split(key)
      token, cache = step(state, token, cache, sub)
  return np.concatenate(out, axis=1)
