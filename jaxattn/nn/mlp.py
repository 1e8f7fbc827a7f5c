"""Feed-forward blocks: the gated MLP (SwiGLU, as Llama) and the classic two-layer MLP."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxattn.nn.linear import Einsum
from jaxattn.sharding import shard

_ACTIVATIONS = {"silu": jax.nn.silu, "gelu": jax.nn.gelu, "relu": jax.nn.relu,
                "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


class MLP(nnx.Module):
  """``down(act(gate(x)) * up(x))`` when ``gated`` (SwiGLU with ``silu``), else ``down(act(up(x)))``."""

  def __init__(self, embed_dim: int, hidden_dim: int, *, activation: str = "silu",
               gated: bool = True, use_bias: bool = False, rngs: nnx.Rngs, dtype=None,
               param_dtype=jnp.float32):
    if activation not in _ACTIVATIONS:
      raise ValueError(f"`activation` must be one of {sorted(_ACTIVATIONS)}, got {activation!r}.")
    for name, v in (("embed_dim", embed_dim), ("hidden_dim", hidden_dim)):
      if int(v) < 1:
        raise ValueError(f"`{name}` must be >= 1, got {v!r}.")
    self.activation, self.gated = activation, gated
    kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype, use_bias=use_bias)
    self.up = Einsum("BTD,DF->BTF", (embed_dim, hidden_dim), ("embed", "mlp"), **kw)
    self.gate = (Einsum("BTD,DF->BTF", (embed_dim, hidden_dim), ("embed", "mlp"), **kw)
                 if gated else None)
    self.down = Einsum("BTF,FD->BTD", (hidden_dim, embed_dim), ("mlp", "embed"), **kw)

  def __call__(self, x):
    act = _ACTIVATIONS[self.activation]
    h = act(self.gate(x)) * self.up(x) if self.gated else act(self.up(x))
    h = shard(h, ("batch", "length", "mlp"))
    return self.down(h)
