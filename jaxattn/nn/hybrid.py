"""Hybrid stacks: Gated DeltaNet layers interleaved with full or sliding-window attention layers.

Qwen3-Next repeats three Gated DeltaNet layers and one full-attention layer (``"DDDA"``); the
Gated DeltaNet paper's hybrids pair it with sliding-window attention (``"DS"``).  The fixed-size
memory compresses the whole past, while the attention layers keep exact entries (of every token, or
of the last ``w``) for precise retrieval.  Every layer is a pre-norm residual block::

    h = x + Mixer(Norm(x));      y = h + MLP(Norm(h))

Pattern letters: ``D`` Gated DeltaNet, ``A`` full (causal) attention, ``S`` sliding-window attention.
The stack maps ``[B, T, D] -> [B, T, D]``; embeddings, the final norm and the head belong to the
model around it.  Its cache is a tuple with one entry per layer (``DeltaNetCache`` or ``KVCache``).
"""

from __future__ import annotations

from typing import Any, Literal

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from jaxattn.nn.block import TransformerBlock
from jaxattn.nn.gated_deltanet import DeltaNetCache, GatedDeltaNet
from jaxattn.nn.mlp import MLP
from jaxattn.nn.norms import make_norm
from jaxattn.sharding import shard

LAYER_KINDS = {"D": "Gated DeltaNet", "A": "full attention", "S": "sliding-window attention"}


class DeltaNetBlock(nnx.Module):
  """Pre-norm residual block with Gated DeltaNet as the token mixer, then an MLP.

  Extra keyword arguments go to ``GatedDeltaNet`` (``num_key_heads``, ``head_dim``, ...).
  ``norm_eps`` is the epsilon of every norm in the block, the Gated DeltaNet's gated norm included.
  """

  def __init__(self, embed_dim: int, num_heads: int, mlp_dim: int, *,
               norm: Literal["rms", "layer"] = "rms", norm_eps: float = 1e-6,
               mlp_activation: str = "silu", gated_mlp: bool = True, rngs: nnx.Rngs, dtype=None,
               param_dtype=jnp.float32, **deltanet_kwargs):
    self.mixer_norm = make_norm(norm, embed_dim, eps=norm_eps, rngs=rngs, param_dtype=param_dtype)
    self.mixer = GatedDeltaNet(embed_dim, num_heads, norm_eps=norm_eps, rngs=rngs, dtype=dtype,
                               param_dtype=param_dtype, **deltanet_kwargs)
    self.mlp_norm = make_norm(norm, embed_dim, eps=norm_eps, rngs=rngs, param_dtype=param_dtype)
    self.mlp = MLP(embed_dim, mlp_dim, activation=mlp_activation, gated=gated_mlp, rngs=rngs,
                   dtype=dtype, param_dtype=param_dtype)

  def init_cache(self, batch: int, max_len: int | None = None, dtype=None) -> DeltaNetCache:
    return self.mixer.init_cache(batch, max_len, dtype)

  def __call__(self, x, *, positions=None, segment_ids=None, mask=None, cache=None):
    """``x [B, T, D]`` -> ``[B, T, D]`` (and the cache, when given).  ``positions`` and ``mask``
    are accepted for interface parity with ``TransformerBlock`` and unused."""
    del positions
    if mask is not None:
      raise ValueError("`mask` is not supported by a Gated DeltaNet block (it is causal by "
                       "construction; use `segment_ids` for packed sequences).")
    x = shard(x, ("batch", "length", "act_embed"))
    a = self.mixer(self.mixer_norm(x), segment_ids=segment_ids, cache=cache)
    if cache is not None:
      a, cache = a
    h = x + a
    y = shard(h + self.mlp(self.mlp_norm(h)), ("batch", "length", "act_embed"))
    return y if cache is None else (y, cache)


class HybridStack(nnx.Module):
  """A stack of blocks whose token mixers follow ``pattern`` (e.g. ``"DDDA"``, ``"DSDS"``).

  Args:
    embed_dim: ``D``.
    pattern: one letter per layer: ``D`` Gated DeltaNet, ``A`` full attention, ``S`` sliding-window
      attention with window ``sliding_window`` (a query sees itself and the previous ``w`` keys).
    num_heads: attention query heads, and the Gated DeltaNet value heads unless ``deltanet``
      overrides ``num_heads``.
    mlp_dim: hidden size of every block's gated MLP.
    sliding_window: ``w`` for ``S`` layers (required when the pattern has one).
    attention: extra keyword arguments for every ``Attention`` (``num_kv_heads``, ``head_dim``,
      ``rope_base``, ...); not the arguments the stack sets itself (``num_heads``,
      ``sliding_window``, ``norm``, ``norm_eps``, ``dtype``, ``param_dtype``, ``rngs``, ...).
    deltanet: extra keyword arguments for every ``GatedDeltaNet`` (``num_heads``,
      ``num_key_heads``, ``head_dim``, ``v_head_dim``, ``chunk_size``, ...); not the arguments the
      stack sets itself (``norm``, ``norm_eps``, ``dtype``, ``param_dtype``, ``rngs``, ...).
    norm_eps: epsilon of every norm: the blocks' and the mixers' own (QK norm, gated norm).
  """

  def __init__(
      self,
      embed_dim: int,
      pattern: str = "DDDA",
      *,
      num_heads: int,
      mlp_dim: int,
      sliding_window: int | None = None,
      attention: dict[str, Any] | None = None,
      deltanet: dict[str, Any] | None = None,
      norm: Literal["rms", "layer"] = "rms",
      norm_eps: float = 1e-6,
      rngs: nnx.Rngs,
      dtype=None,
      param_dtype=jnp.float32,
  ):
    if not isinstance(pattern, str) or not pattern or set(pattern) - set(LAYER_KINDS):
      raise ValueError(f"`pattern` must be a non-empty string of {sorted(LAYER_KINDS)} "
                       f"({', '.join(f'{k}: {v}' for k, v in LAYER_KINDS.items())}), got {pattern!r}.")
    if "S" in pattern and (sliding_window is None or int(sliding_window) < 0):
      raise ValueError(f"`pattern` {pattern!r} has sliding-window layers: `sliding_window` must be "
                       f"a non-negative int, got {sliding_window!r}.")
    # The arguments the stack passes to every layer itself: the same key in `attention` or
    # `deltanet` would be a second value for it (a TypeError deep in the constructor).  The Gated
    # DeltaNet's `num_heads` is the one override allowed (it defaults to the stack's).
    own = ("embed_dim", "mlp_dim", "norm", "norm_eps", "rngs", "dtype", "param_dtype")
    for name, extra, reserved in (("attention", attention, own + ("num_heads", "sliding_window")),
                                  ("deltanet", deltanet, own)):
      for key in reserved:
        if extra and key in extra:
          why = ("it is the epsilon of every norm in the stack" if key == "norm_eps"
                 else "the stack sets it for every layer")
          raise ValueError(f"`{name}` sets {key}={extra[key]!r}: set `{key}` on the HybridStack "
                           f"instead, {why}.")
    self.pattern = pattern
    common = dict(norm=norm, norm_eps=norm_eps, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    deltanet = dict(deltanet or {})
    dn_heads = deltanet.pop("num_heads", num_heads)
    layers = []
    for kind in pattern:
      if kind == "D":
        layers.append(DeltaNetBlock(embed_dim, dn_heads, mlp_dim, **common, **deltanet))
      else:
        window = sliding_window if kind == "S" else None
        layers.append(TransformerBlock(embed_dim, num_heads, mlp_dim, sliding_window=window,
                                       **common, **(attention or {})))
    self.layers = nnx.List(layers)

  def init_cache(self, batch: int, max_len: int, dtype=None) -> tuple:
    """One cache per layer: ``DeltaNetCache`` (fixed size) or ``KVCache`` (``max_len`` slots)."""
    return tuple(layer.init_cache(batch, max_len, dtype) for layer in self.layers)

  def cache_bytes(self, seq_len: int, batch: int = 1, dtype=jnp.bfloat16) -> int:
    """Decode-cache bytes after ``seq_len`` tokens, summed over layers."""
    total = 0
    for layer in self.layers:
      mixer = layer.mixer if isinstance(layer, DeltaNetBlock) else layer.attn
      total += mixer.cache_bytes(seq_len, batch, dtype)
    return total

  def __call__(self, x: Float[Array, "B T D"], *, positions: Int[Array, "B T"] | None = None,
               segment_ids: Int[Array, "B T"] | None = None, cache: tuple | None = None):
    """``x [B, T, D]`` -> ``[B, T, D]``, and the updated per-layer caches when given."""
    if cache is not None and len(cache) != len(self.layers):
      raise ValueError(f"`cache` has {len(cache)} entries for {len(self.layers)} layers "
                       f"(pattern {self.pattern!r}); build it with init_cache().")
    new_cache = []
    for i, layer in enumerate(self.layers):
      out = layer(x, positions=positions, segment_ids=segment_ids,
                  cache=None if cache is None else cache[i])
      if cache is None:
        x = out
      else:
        x, c = out
        new_cache.append(c)
    return x if cache is None else (x, tuple(new_cache))
