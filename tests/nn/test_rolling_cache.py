"""Rolling sliding-window KV cache: decode == full pass, O(w) memory, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxattn.nn.attention import Attention
from jaxattn.rolling_cache import RollingKVCache

D, T, W = 16, 8, 3


def _attn(**kw):
  return Attention(D, 4, num_kv_heads=2, sliding_window=W, rngs=nnx.Rngs(0), **kw)


@pytest.mark.parametrize("prefill", [1, 5])
def test_decode_equals_full_pass(prefill):
  m = _attn()
  x = jax.random.normal(jax.random.key(1), (2, T, D))
  full = m(x)
  cache = m.init_rolling_cache(2)
  y0, cache = m(x[:, :prefill], cache=cache)     # prefill longer than the window wraps the ring
  ys = [y0]
  for i in range(prefill, T):
    yi, cache = m(x[:, i:i + 1], cache=cache)
    ys.append(yi)
  np.testing.assert_allclose(jnp.concatenate(ys, 1), full, rtol=1e-5, atol=1e-5)
  assert cache.slots == W and int(cache.index) == T
  np.testing.assert_array_equal(sorted(np.asarray(cache.positions)), [T - 3, T - 2, T - 1])
  # Without the window the full pass differs: the window really cuts old keys off.
  m_full = Attention(D, 4, num_kv_heads=2, rngs=nnx.Rngs(0))
  assert not np.allclose(m_full(x), full, atol=1e-4)


def test_memory_is_window_sized():
  m = _attn()
  full = m.init_cache(1, W)                 # W slots (on TPU rounded up: compare per slot)
  assert m.init_rolling_cache(1).nbytes == full.nbytes // full.max_len * W
  assert m.init_rolling_cache(1).nbytes * 100 < m.init_cache(1, 100 * W + 1).nbytes


def test_errors():
  with pytest.raises(ValueError, match="sliding_window"):
    Attention(D, 4, rngs=nnx.Rngs(0)).init_rolling_cache(1)
  with pytest.raises(ValueError, match="window"):
    RollingKVCache.init(1, -1, 2, 4)
  assert RollingKVCache.init(1, np.int64(3), 2, 4).window == 3     # NumPy ints are ints
  m = _attn(position="alibi")
  with pytest.raises(ValueError, match="position"):
    m(jnp.ones((1, 2, D)), cache=m.init_rolling_cache(1))
  other = RollingKVCache.init(1, W + 1, 2, 4)
  with pytest.raises(ValueError, match="sliding_window"):
    _attn()(jnp.ones((1, 2, D)), cache=other)
