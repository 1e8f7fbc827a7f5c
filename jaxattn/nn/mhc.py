"""Hyper-connection residual sites (mHC and the original HC) and the stream collapse at the output.

A model with hyper-connections keeps ``n`` residual streams ``[B, T, n, D]`` between its blocks:

    streams = expand_streams(embed(tokens), n)                 # [B, T, n, D]
    for block in blocks:                                       # TransformerBlock(residual="mhc")
      streams = block(streams)                                 # each sublayer: read, F, write
    x = StreamCollapse(D, n)(streams)                          # [B, T, D] -> final norm, head

Formulas in ``jaxattn.ops.hyper``; this file owns the parameters and their initialization.
"""

from __future__ import annotations

from typing import Callable, Literal

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from jaxattn.checks import check_int, check_nonnegative
from jaxattn.nn.linear import param
from jaxattn.ops import hyper

HyperKind = Literal["mhc", "hc"]


def _check_dims(embed_dim, num_streams):
  # check_int: NumPy ints are accepted, bools refused.
  check_int("embed_dim", embed_dim)
  check_int("num_streams", num_streams)


def _check_eps(eps, norm_eps):
  # eps is added to the read / collapse weights: negative, it can make them negative.  norm_eps is
  # added to the mean square under the RMS norm's rsqrt: negative, it can give NaN.
  check_nonnegative("eps", eps)
  check_nonnegative("norm_eps", norm_eps)


def _const(value):
  """An initializer that ignores the key and returns ``value`` (for the static maps)."""
  return lambda key, shape, dtype: jnp.broadcast_to(jnp.asarray(value, dtype), shape)


class HyperConnection(nnx.Module):
  """One residual site (before attention, or before the MLP) with ``num_streams`` streams.

  ``kind="mhc"`` (manifold-constrained, as DeepSeek-V4): ``proj [n, D, n(n+2)]``, ``bias [n(n+2)]``,
  ``scale [3]`` (the gates ``alpha``).  ``proj ~ N(0, init_std = 0.02)`` and ``bias = 0`` as the
  DeepSeek-V4 reference in Hugging Face transformers initializes them; the gates start at
  ``gate_init = 0.01``, the mHC paper's value (its Table 5; the transformers reference sets them to
  1, ``gate_init=1.0``).  The small gate keeps the dynamic logits small at any width (with gate 1 they
  have std ``0.02 sqrt(n D)``, 2.6 at ``D = 4096``, where 20 Sinkhorn steps no longer balance the
  columns).  At initialization ``h_pre ~ 0.5``, ``h_post ~ 1`` and ``H_res ~ 1/n`` everywhere (a
  near-uniform average of the streams).  ``H_res`` is doubly stochastic by construction
  (Sinkhorn-Knopp, ``sinkhorn_iters`` steps, log domain unless ``log_domain=False``).

  ``kind="hc"`` (the unconstrained original): ``proj [D, n + 2]`` (dynamic part, zero at init),
  static ``pre [n] = e_(layer_index mod n)``, ``post [n] = 1``, ``res [n, n] = I`` and gates
  ``scale = (gate_init, gate_init)``, the Hyper-Connections paper's initialization: at init every
  stream gets the sublayer output added and the sublayer reads stream ``layer_index mod n``, so an
  ``n = 1`` HC block is exactly a pre-norm residual block.

  ``coefficients(streams)`` gives ``(h_pre [B, T, n], h_post [B, T, n], H_res [B, T, n, n])``;
  ``read``/``write`` apply them; ``site(streams, sublayer)`` does all three.
  """

  def __init__(self, embed_dim: int, num_streams: int = 4, *, kind: HyperKind = "mhc",
               layer_index: int = 0, sinkhorn_iters: int = 20, log_domain: bool = True,
               eps: float = 1e-6, norm_eps: float = 1e-6, init_std: float = 0.02,
               gate_init: float = 0.01, rngs: nnx.Rngs, param_dtype=jnp.float32):
    _check_dims(embed_dim, num_streams)
    if kind not in ("mhc", "hc"):
      raise ValueError(f"`kind` must be 'mhc' or 'hc', got {kind!r}.")
    # bool is an int subclass; sinkhorn() refuses it, so refuse it here, not at the first call.
    check_int("sinkhorn_iters", sinkhorn_iters)
    # eps is added to the read weights h_pre (and to the plain Sinkhorn's sums).
    _check_eps(eps, norm_eps)
    check_int("layer_index", layer_index, minimum=0)
    for name, v in (("init_std", init_std), ("gate_init", gate_init)):
      check_nonnegative(name, v, what="a finite number >= 0")   # (NaN gave NaN coefficients)
    n, d = int(num_streams), int(embed_dim)
    self.kind, self.num_streams, self.embed_dim = kind, n, d
    self.sinkhorn_iters, self.log_domain = sinkhorn_iters, log_domain
    self.eps, self.norm_eps = eps, norm_eps
    if kind == "mhc":
      k = n * (n + 2)
      self.proj = param(rngs, nnx.initializers.normal(init_std), (n, d, k), (None, "embed", None),
                        param_dtype)
      self.bias = param(rngs, nnx.initializers.zeros_init(), (k,), (None,), param_dtype)
      self.scale = param(rngs, _const(gate_init), (3,), (None,), param_dtype)
    else:
      self.proj = param(rngs, nnx.initializers.zeros_init(), (d, n + 2), ("embed", None), param_dtype)
      self.static_pre = param(rngs, _const(jax.nn.one_hot(layer_index % n, n)), (n,), (None,),
                              param_dtype)
      self.static_post = param(rngs, nnx.initializers.ones_init(), (n,), (None,), param_dtype)
      self.static_res = param(rngs, _const(jnp.eye(n)), (n, n), (None, None), param_dtype)
      self.scale = param(rngs, _const(gate_init), (2,), (None,), param_dtype)

  def _check(self, streams):
    if streams.ndim < 2 or streams.shape[-2:] != (self.num_streams, self.embed_dim):
      raise ValueError(f"`streams` must be [..., n={self.num_streams}, D={self.embed_dim}], got shape "
                       f"{streams.shape}; expand the embedding with jaxattn.ops.hyper.expand_streams.")

  def coefficients(self, streams: Float[Array, "*B n D"]):
    """``(h_pre [*B, n], h_post [*B, n], H_res [*B, n, n])`` for these streams (fp32)."""
    self._check(streams)
    if self.kind == "mhc":
      return hyper.mhc_coefficients(streams, self.proj[...], self.bias[...], self.scale[...],
                                    num_iters=self.sinkhorn_iters, log_domain=self.log_domain,
                                    eps=self.eps, norm_eps=self.norm_eps)
    return hyper.hc_coefficients(streams, self.proj[...], self.static_pre[...],
                                 self.static_post[...], self.static_res[...], self.scale[...],
                                 norm_eps=self.norm_eps)

  def site(self, streams: Float[Array, "*B n D"],
           sublayer: Callable[[jax.Array], jax.Array]) -> Float[Array, "*B n D"]:
    """``H_res @ streams + h_post * sublayer(h_pre . streams)``."""
    h_pre, h_post, h_res = self.coefficients(streams)
    return hyper.hc_write(streams, sublayer(hyper.hc_read(streams, h_pre)), h_post, h_res)

  def __call__(self, streams, sublayer):
    return self.site(streams, sublayer)


class StreamCollapse(nnx.Module):
  """Collapses ``[*B, n, D]`` streams to ``[*B, D]`` at the output of the stack.

  ``kind="mhc"``: DeepSeek-V4's head, ``w = sigmoid(scale * (RMSNorm(vec(x)) @ proj) + bias) + eps``
  and ``y = sum_i w_i x_i`` (``proj [n, D, n] ~ N(0, init_std)``, ``bias = 0``, ``scale = 1``).
  ``kind="sum"``: the plain sum of the streams (the HC paper; no parameters).  Either way a final norm
  usually follows.
  """

  def __init__(self, embed_dim: int, num_streams: int = 4, *, kind: Literal["mhc", "sum"] = "mhc",
               eps: float = 1e-6, norm_eps: float = 1e-6, init_std: float = 0.02,
               rngs: nnx.Rngs | None = None, param_dtype=jnp.float32):
    _check_dims(embed_dim, num_streams)
    if kind not in ("mhc", "sum"):
      raise ValueError(f"`kind` must be 'mhc' or 'sum', got {kind!r}.")
    _check_eps(eps, norm_eps)
    self.kind, self.num_streams, self.embed_dim = kind, int(num_streams), int(embed_dim)
    self.eps, self.norm_eps = eps, norm_eps
    if kind == "mhc":
      if rngs is None:
        raise ValueError("`rngs` is required for kind='mhc' (it has parameters).")
      n, d = num_streams, embed_dim
      self.proj = param(rngs, nnx.initializers.normal(init_std), (n, d, n), (None, "embed", None),
                        param_dtype)
      self.bias = param(rngs, nnx.initializers.zeros_init(), (n,), (None,), param_dtype)
      self.scale = param(rngs, nnx.initializers.ones_init(), (1,), (None,), param_dtype)

  def weights(self, streams: Float[Array, "*B n D"]) -> Float[Array, "*B n"] | None:
    """The collapse weights ``[*B, n]`` (None for ``kind="sum"``)."""
    if streams.ndim < 2 or streams.shape[-2:] != (self.num_streams, self.embed_dim):
      raise ValueError(f"`streams` must be [..., n={self.num_streams}, D={self.embed_dim}], got shape "
                       f"{streams.shape}.")
    if self.kind == "sum":
      return None
    x = streams.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=(-2, -1)) + self.norm_eps)
    z = jnp.einsum("...nd,ndk->...k", x, self.proj[...].astype(jnp.float32)) * inv[..., None]
    return jax.nn.sigmoid(self.scale[...].astype(jnp.float32) * z + self.bias[...]) + self.eps

  def __call__(self, streams: Float[Array, "*B n D"]) -> Float[Array, "*B D"]:
    return hyper.collapse_streams(streams, self.weights(streams))
