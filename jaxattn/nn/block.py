"""A transformer block: attention and MLP sublayers with residuals, norms pre or post (seed 3.8).

    pre-LN  (default):  h = x + Attn(Norm(x));      y = h + MLP(Norm(h))
    post-LN (original): h = Norm(x + Attn(x));      y = Norm(h + MLP(h))
"""

from __future__ import annotations

from typing import Literal

import jax.numpy as jnp
from flax import nnx

from jaxattn.cache import KVCache
from jaxattn.nn.attention import Attention
from jaxattn.nn.mlp import MLP
from jaxattn.nn.norms import make_norm
from jaxattn.sharding import shard


class TransformerBlock(nnx.Module):
  """Attention + MLP with residuals; ``norm`` is ``"rms"`` or ``"layer"``, placed ``"pre"``/``"post"``.

  Extra keyword arguments go to ``Attention`` (``num_kv_heads``, ``position``, ``sliding_window``...).
  """

  def __init__(self, embed_dim: int, num_heads: int, mlp_dim: int, *,
               norm: Literal["rms", "layer"] = "rms",
               norm_position: Literal["pre", "post"] = "pre", norm_eps: float = 1e-6,
               mlp_activation: str = "silu", gated_mlp: bool = True, rngs: nnx.Rngs, dtype=None,
               param_dtype=jnp.float32, **attention_kwargs):
    if norm_position not in ("pre", "post"):
      raise ValueError(f"`norm_position` must be 'pre' or 'post', got {norm_position!r}.")
    self.norm_position = norm_position
    self.attn_norm = make_norm(norm, embed_dim, eps=norm_eps, rngs=rngs, param_dtype=param_dtype)
    self.attn = Attention(embed_dim, num_heads, rngs=rngs, dtype=dtype, param_dtype=param_dtype,
                          **attention_kwargs)
    self.mlp_norm = make_norm(norm, embed_dim, eps=norm_eps, rngs=rngs, param_dtype=param_dtype)
    self.mlp = MLP(embed_dim, mlp_dim, activation=mlp_activation, gated=gated_mlp, rngs=rngs,
                   dtype=dtype, param_dtype=param_dtype)

  def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
    return self.attn.init_cache(batch, max_len, dtype)

  def __call__(self, x, *, positions=None, segment_ids=None, mask=None, cache=None):
    """``x [B, T, D]`` -> ``[B, T, D]`` (and the cache, when given)."""
    x = shard(x, ("batch", "length", "act_embed"))
    kw = dict(positions=positions, segment_ids=segment_ids, mask=mask, cache=cache)
    attn_in = self.attn_norm(x) if self.norm_position == "pre" else x
    a = self.attn(attn_in, **kw)
    if cache is not None:
      a, cache = a
    if self.norm_position == "pre":
      h = x + a
      y = h + self.mlp(self.mlp_norm(h))
    else:
      h = self.attn_norm(x + a)
      y = self.mlp_norm(h + self.mlp(h))
    y = shard(y, ("batch", "length", "act_embed"))
    return y if cache is None else (y, cache)
