"""A transformer block: attention and MLP sublayers with residuals, norms pre or post (seed 3.8).

    pre-LN  (default):  h = x + Attn(Norm(x));      y = h + MLP(Norm(h))
    post-LN (original): h = Norm(x + Attn(x));      y = Norm(h + MLP(h))

With ``residual="mhc"`` or ``"hc"`` the block carries ``n`` residual streams ``[B, T, n, D]`` instead
of one (``jaxattn.nn.mhc``); each sublayer reads a weighted sum of the streams and writes back:

    streams = H_res @ streams + h_post * Attn(Norm(h_pre . streams))      (then the same for the MLP)
"""

from __future__ import annotations

from typing import Literal

import jax.numpy as jnp
from flax import nnx

from jaxattn.cache import KVCache
from jaxattn.nn.attention import Attention
from jaxattn.nn.mhc import HyperConnection
from jaxattn.nn.mlp import MLP
from jaxattn.nn.norms import make_norm
from jaxattn.ops.hyper import hc_read, hc_write
from jaxattn.sharding import shard


class TransformerBlock(nnx.Module):
  """Attention + MLP with residuals; ``norm`` is ``"rms"`` or ``"layer"``, placed ``"pre"``/``"post"``.

  Extra keyword arguments go to ``Attention`` (``num_kv_heads``, ``position``, ``sliding_window``...).
  ``norm_eps`` is the epsilon of every norm in the block, the attention's ``qk_norm`` included.

  ``residual``: ``"plain"`` (one stream, ``x [B, T, D]``), ``"mhc"`` (manifold-constrained
  hyper-connections) or ``"hc"`` (the unconstrained original) with ``num_streams`` streams: the block
  then takes and returns ``[B, T, num_streams, D]`` (pre-norm only).  ``layer_index`` sets HC's static
  read stream; ``hyper_kwargs`` go to both ``HyperConnection`` sites (``sinkhorn_iters``,
  ``log_domain``, ``init_std``...).
  """

  def __init__(self, embed_dim: int, num_heads: int, mlp_dim: int, *,
               norm: Literal["rms", "layer"] = "rms",
               norm_position: Literal["pre", "post"] = "pre", norm_eps: float = 1e-6,
               mlp_activation: str = "silu", gated_mlp: bool = True,
               residual: Literal["plain", "hc", "mhc"] = "plain", num_streams: int = 4,
               layer_index: int = 0, hyper_kwargs: dict | None = None, rngs: nnx.Rngs, dtype=None,
               param_dtype=jnp.float32, **attention_kwargs):
    if norm_position not in ("pre", "post"):
      raise ValueError(f"`norm_position` must be 'pre' or 'post', got {norm_position!r}.")
    if residual not in ("plain", "hc", "mhc"):
      raise ValueError(f"`residual` must be 'plain', 'hc' or 'mhc', got {residual!r}.")
    if residual != "plain" and norm_position != "pre":
      raise ValueError(f"`residual={residual!r}` needs norm_position='pre' (the sublayer reads a mix "
                       f"of streams and writes back unnormalized), got {norm_position!r}.")
    self.norm_position, self.residual = norm_position, residual
    self.attn_norm = make_norm(norm, embed_dim, eps=norm_eps, rngs=rngs, param_dtype=param_dtype)
    self.attn = Attention(embed_dim, num_heads, norm_eps=norm_eps, rngs=rngs, dtype=dtype,
                          param_dtype=param_dtype, **attention_kwargs)
    self.mlp_norm = make_norm(norm, embed_dim, eps=norm_eps, rngs=rngs, param_dtype=param_dtype)
    self.mlp = MLP(embed_dim, mlp_dim, activation=mlp_activation, gated=gated_mlp, rngs=rngs,
                   dtype=dtype, param_dtype=param_dtype)
    if residual == "plain":
      self.num_streams, self.attn_hc, self.mlp_hc = 1, None, None
    else:
      hk = dict(kind=residual, layer_index=layer_index, rngs=rngs, param_dtype=param_dtype,
                **(hyper_kwargs or {}))
      self.num_streams = num_streams
      self.attn_hc = HyperConnection(embed_dim, num_streams, **hk)
      self.mlp_hc = HyperConnection(embed_dim, num_streams, **hk)

  def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
    return self.attn.init_cache(batch, max_len, dtype)

  def __call__(self, x, *, positions=None, segment_ids=None, mask=None, cache=None):
    """``x [B, T, D]`` -> ``[B, T, D]`` (and the cache, when given).

    With ``residual="mhc"``/``"hc"``: ``x [B, T, n, D]`` streams -> ``[B, T, n, D]``.
    """
    kw = dict(positions=positions, segment_ids=segment_ids, mask=mask, cache=cache)
    if self.residual != "plain":
      return self._hyper_call(x, kw)
    x = shard(x, ("batch", "length", "act_embed"))
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

  def _hyper_call(self, x, kw):
    if x.ndim != 4 or x.shape[2] != self.num_streams:
      raise ValueError(f"with residual={self.residual!r} the block takes streams [B, T, n="
                       f"{self.num_streams}, D], got shape {x.shape}.")
    x = shard(x, ("batch", "length", None, "act_embed"))
    cache = kw["cache"]
    pre, post, res = self.attn_hc.coefficients(x)
    a = self.attn(self.attn_norm(hc_read(x, pre)), **kw)
    if cache is not None:
      a, cache = a
    x = hc_write(x, a, post, res)
    pre, post, res = self.mlp_hc.coefficients(x)
    y = hc_write(x, self.mlp(self.mlp_norm(hc_read(x, pre))), post, res)
    y = shard(y, ("batch", "length", None, "act_embed"))
    return y if cache is None else (y, cache)
