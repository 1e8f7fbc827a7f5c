"""Sampling filters against Hugging Face transformers' logits warpers (PyTorch, CPU).

``generate`` / ``Engine`` / speculative decoding all draw from ``filtered_logits`` (one setting for
the batch) or ``row_filtered`` (settings per row, traced): the distribution must be the one
transformers samples from with the same ``temperature``, ``top_k``, ``top_p`` and ``min_p`` -- its
``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper`` and ``MinPLogitsWarper``,
applied in that order.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.generation import filtered_logits, penalized_logits, row_filtered

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers.generation.logits_process import (  # noqa: E402
    MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper,
    TopPLogitsWarper)

pytestmark = pytest.mark.hf


def _transformers(logits: np.ndarray, temperature: float, top_k: int, top_p: float,
                  min_p: float = 0.0):
  """The probabilities transformers' ``generate`` samples from (``do_sample=True``)."""
  warpers = [TemperatureLogitsWarper(temperature)]
  if top_k:
    warpers.append(TopKLogitsWarper(top_k))
  if top_p < 1.0:
    warpers.append(TopPLogitsWarper(top_p))
  if min_p > 0.0:
    warpers.append(MinPLogitsWarper(min_p))
  x = torch.from_numpy(logits)
  for w in warpers:
    x = w(None, x)
  return torch.softmax(x, dim=-1).numpy()


@pytest.mark.parametrize("temperature", [0.7, 1.3])
@pytest.mark.parametrize("top_k", [0, 1, 5, 64])
@pytest.mark.parametrize("top_p", [1.0, 0.9, 0.3])
@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3])
def test_filters_give_transformers_distribution(temperature, top_k, top_p, min_p):
  """Random logits (distinct values): the same support and probabilities, batch-wide settings
  and per-row traced settings alike (top_k = 64 is past the vocabulary of 40: no filter)."""
  logits = (3.0 * np.random.default_rng(top_k).normal(size=(6, 40))).astype(np.float32)
  want = _transformers(logits, temperature, top_k, top_p, min_p)
  batch = np.asarray(jax.nn.softmax(filtered_logits(
      jnp.asarray(logits), temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)))
  rows = np.asarray(jax.nn.softmax(jax.vmap(row_filtered, in_axes=(0, None, None, None, None))(
      jnp.asarray(logits), jnp.float32(temperature), jnp.float32(top_p), jnp.int32(top_k),
      jnp.float32(min_p))))
  for got in (batch, rows):
    np.testing.assert_array_equal(got > 0, want > 0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
  if top_k == 1 or top_p == 0.3 or min_p == 0.3:
    assert (want > 0).sum(axis=-1).min() < 40        # (the filters did cut something)


def test_top_k_keeps_ties_at_the_kth_logit_as_transformers_does():
  """Tokens tied with the k-th largest logit stay in (both libraries compare with ``<``)."""
  logits = np.array([[2.0, 1.0, 1.0, 1.0, 0.5, -1.0]], np.float32)
  want = _transformers(logits, 1.0, 2, 1.0)
  got = np.asarray(jax.nn.softmax(filtered_logits(jnp.asarray(logits), temperature=1.0,
                                                  top_k=2)))
  np.testing.assert_array_equal(got > 0, [[True, True, True, True, False, False]])
  np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("penalty", [0.6, 1.0, 1.3, 2.0])
def test_repetition_penalty_is_transformers(penalty):
  """``penalized_logits(repetition_penalty=)`` on the tokens seen so far (prompt and output,
  repeats included) is transformers' ``RepetitionPenaltyLogitsProcessor`` on those input ids."""
  rng = np.random.default_rng(int(penalty * 10))
  logits = (3.0 * rng.normal(size=(4, 60))).astype(np.float32)
  ids = rng.integers(0, 60, size=(4, 12))
  want = RepetitionPenaltyLogitsProcessor(penalty)(torch.from_numpy(ids),
                                                    torch.from_numpy(logits.copy())).numpy()
  seen = np.zeros((4, 60), bool)
  for b in range(4):
    seen[b, ids[b]] = True
  got = penalized_logits(jnp.asarray(logits), jnp.asarray(seen), jnp.zeros((4, 60), jnp.int32),
                         repetition_penalty=penalty)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)
