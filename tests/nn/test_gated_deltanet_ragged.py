"""GatedDeltaNet with ragged chunks (continuous batching: `num_tokens`) and DeltaNetCache.reset.

The reference for a ragged call is the same layer called on each row alone with only that row's
real tokens, from that row's own cache.  Tolerances: fp32 at 2e-5 (the per-row calls have other
lengths, so the chunked rule picks other chunk sizes and reassociates sums); bf16 at 5e-2.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxattn.nn.gated_deltanet import DeltaNetCache, GatedDeltaNet

D = 32
FIELDS = ("conv_q", "conv_k", "conv_v", "state")
# Ragged steps of one serving loop (B = 4): prefill chunks, one-token decodes and idle rows mixed,
# so that the rows' caches reach the last step after different numbers of tokens.
STEPS = ((4, (4, 2, 3, 0)), (4, (1, 4, 0, 2)), (1, (1, 0, 1, 1)), (4, (3, 1, 0, 4)))


@functools.lru_cache(maxsize=None)
def _layer(dtype=None):
  """Built once per dtype: eager parameter initialization compiles every initializer."""
  return GatedDeltaNet(D, num_heads=4, num_key_heads=2, head_dim=8, v_head_dim=6, chunk_size=8,
                       rngs=nnx.Rngs(0), dtype=dtype)


@functools.partial(nnx.jit, static_argnames=("implementation",))
def _ragged(layer, cache, x, num_tokens, implementation=None):
  return layer(x, cache=cache, num_tokens=num_tokens, implementation=implementation)


@functools.partial(nnx.jit, static_argnames=("implementation",))
def _plain(layer, cache, x, implementation=None):
  return layer(x, cache=cache, implementation=implementation)


def _row(cache, b):
  return jax.tree.map(lambda a: a[b:b + 1], cache)


def _x(t, n, seed, dtype=jnp.float32):
  """``[4, t, D]`` inputs whose padding (positions >= n[b]) is huge, with one NaN: padding must
  not reach the outputs or the cache whatever it holds."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((len(n), t, D)).astype(np.float32)
  pad = np.arange(t)[None, :] >= np.asarray(n)[:, None]
  x[pad] = 1e4 * rng.standard_normal((int(pad.sum()), D))
  if pad.any():
    x[np.argwhere(pad)[0][0], np.argwhere(pad)[0][1], 3] = np.nan
  return jnp.asarray(x, dtype)


def _check_steps(layer, cache, implementation=None, tol=2e-5, jit=True, steps=STEPS):
  """Runs ``steps`` ragged and, as the reference, row by row; compares outputs and every cache field
  after each step.  Returns the final ragged cache."""
  refs = [_row(cache, b) for b in range(cache.state.shape[0])]
  for i, (t, n) in enumerate(steps):
    x = _x(t, n, seed=i, dtype=layer.dtype or jnp.float32)
    nt = jnp.asarray(n, jnp.int32)
    if jit:
      y, new = _ragged(layer, cache, x, nt, implementation=implementation)
    else:
      y, new = layer(x, cache=cache, num_tokens=nt, implementation=implementation)
    assert y.shape == x.shape and y.dtype == x.dtype
    for b, nb in enumerate(n):
      if nb:
        want, refs[b] = _plain(layer, refs[b], x[b:b + 1, :nb], implementation=implementation)
        np.testing.assert_allclose(np.asarray(y[b, :nb], np.float32),
                                   np.asarray(want[0], np.float32), atol=tol, rtol=tol)
      else:   # an idle row keeps its cache bit for bit
        for f in FIELDS:
          np.testing.assert_array_equal(getattr(new, f)[b], getattr(cache, f)[b])
      np.testing.assert_array_equal(y[b, nb:], 0)     # padding outputs exactly zero
      for f in FIELDS:
        got, ref = getattr(new, f)[b:b + 1], getattr(refs[b], f)
        assert got.dtype == ref.dtype == getattr(cache, f).dtype
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32),
                                   atol=tol, rtol=tol, err_msg=f"step {i} row {b} {f}")
    cache = new
  return cache


@pytest.mark.parametrize("implementation", [None, "recurrent"])
def test_ragged_steps_equal_per_row_calls(implementation):
  layer = _layer()
  cache = _check_steps(layer, layer.init_cache(batch=4), implementation)
  assert cache.state.dtype == jnp.float32 and np.isfinite(np.asarray(cache.state)).all()
  # The comparison can fail: row 1's last step had 1 real token of 4, and treating its padding
  # as tokens (finite padding this time) moves its memory far from the ragged result.
  x = _x(4, (4, 4, 4, 4), seed=3)
  _, unmasked = _plain(layer, jax.tree.map(lambda a: a, cache), x)
  assert not np.allclose(unmasked.state[1], cache.state[1], atol=1e-3)


def test_ragged_eager_matches():
  """Concrete num_tokens outside jit (the validation path that reads the values); a decode step
  and a mixed chunk, to keep the op-by-op dispatch short."""
  layer = _layer()
  _check_steps(layer, layer.init_cache(batch=4), jit=False, steps=STEPS[2:])


def test_ragged_bf16():
  layer = _layer(jnp.bfloat16)
  cache = layer.init_cache(batch=4)
  assert cache.conv_q.dtype == jnp.bfloat16
  _check_steps(layer, cache, tol=5e-2)


def test_full_num_tokens_equals_call_without():
  layer = _layer()
  cache = layer.init_cache(batch=4)
  for i, t in enumerate((4, 3, 1)):
    x = _x(t, (t,) * 4, seed=10 + i)
    y, new = _ragged(layer, cache, x, jnp.full((4,), t, jnp.int32))
    want, ref = _plain(layer, cache, x)
    np.testing.assert_allclose(y, want, atol=1e-6, rtol=1e-6)
    for f in FIELDS:
      np.testing.assert_allclose(getattr(new, f), getattr(ref, f), atol=1e-6, rtol=1e-6)
    cache = new


def test_reset_empties_chosen_rows():
  layer = _layer()
  cache = layer.init_cache(batch=4)
  for i, (t, n) in enumerate(STEPS[:2]):
    _, cache = _ragged(layer, cache, _x(t, n, seed=i), jnp.asarray(n, jnp.int32))
  done = jnp.asarray([True, False, False, True])
  cleared = jax.jit(DeltaNetCache.reset)(cache, done)     # done traced
  eager = cache.reset(done)
  fresh = layer.init_cache(batch=4)
  for f in FIELDS:
    got, old = np.asarray(getattr(cleared, f)), np.asarray(getattr(cache, f))
    assert got.dtype == old.dtype
    np.testing.assert_array_equal(got, np.asarray(getattr(eager, f)))
    np.testing.assert_array_equal(got[[0, 3]], np.asarray(getattr(fresh, f))[[0, 3]])
    np.testing.assert_array_equal(got[[1, 2]], old[[1, 2]])
    assert np.abs(old[[0, 3]]).max() > 0          # the rows emptied held something
  # A reset row then serves a new request as a fresh cache would.
  n = (2, 1, 0, 4)
  x = _x(4, n, seed=7)
  y, _ = _ragged(layer, cleared, x, jnp.asarray(n, jnp.int32))
  for b in (0, 3):
    want, _ = _plain(layer, layer.init_cache(batch=1), x[b:b + 1, :n[b]])
    np.testing.assert_allclose(y[b, :n[b]], want[0], atol=2e-5, rtol=2e-5)
  # Reusing the slot without the reset would have carried the old sequence into the new one.
  y_stale, _ = _ragged(layer, cache, x, jnp.asarray(n, jnp.int32))
  assert not np.allclose(y_stale[3], y[3], atol=1e-3)


def test_errors():
  layer = _layer()
  cache = layer.init_cache(batch=2)
  x = jnp.zeros((2, 3, D))
  with pytest.raises(ValueError, match="`num_tokens` .*needs a decode `cache`"):
    layer(x, num_tokens=jnp.asarray([1, 2]))
  for bad, match in ((jnp.asarray([1, 2, 3]), r"`num_tokens` must be \[B=2\], got shape \(3,\)"),
                     (jnp.asarray([[1, 2]]), r"`num_tokens` must be \[B=2\], got shape \(1, 2\)"),
                     (jnp.asarray([1.0, 2.0]), "`num_tokens` must be an integer array, got dtype"),
                     (jnp.asarray([True, False]), "`num_tokens` must be an integer array"),
                     (jnp.asarray([1, 4]), r"`num_tokens` must lie in \[0, T=3\], got \[1 4\]"),
                     (jnp.asarray([-1, 0]), r"`num_tokens` must lie in \[0, T=3\]"),
                     ([1, 2], "`num_tokens` must be an integer array")):
    with pytest.raises(ValueError, match=match):
      layer(x, cache=cache, num_tokens=bad)
  for bad, match in ((jnp.asarray([True]), r"`done` must be a bool array of shape \[B=2\]"),
                     (jnp.asarray([[True, False]]), r"`done` must be a bool array of shape"),
                     (jnp.asarray([1, 0]), "`done` must be a bool array, got dtype int32"),
                     ([True, False], r"`done` must be a bool array of shape \[B=2\], got list")):
    with pytest.raises(ValueError, match=match):
      cache.reset(bad)
