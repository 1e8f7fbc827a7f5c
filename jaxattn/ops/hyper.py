"""Hyper-connections: ``n`` residual streams mixed between sublayers (HC, and mHC's constrained form).

A plain residual carries one vector per token, ``x_{l+1} = x_l + F(x_l)``.  Hyper-connections carry
``n`` streams ``x_l [n, D]`` per token and give every sublayer three small mixing maps:

    x_in      = sum_i h_pre[i] * x_l[i]                          read    ([n, D] -> [D])
    x_{l+1}   = H_res @ x_l  +  h_post[:, None] * F(x_in)        write   ([n, D] -> [n, D])

(``H_res[o, i]`` is the weight of input stream ``i`` in output stream ``o``.)  The embedding is copied to
all streams at the input (``expand_streams``) and the streams are collapsed at the output.

*HC* (Hyper-Connections, the unconstrained original) learns ``h_pre``, ``h_post`` and ``H_res`` as static
matrices plus a ``tanh`` dynamic part; nothing bounds the product ``H_res^(L) ... H_res^(1)`` across depth,
which is how its signal gain can grow.  *mHC* (manifold-constrained) computes the maps from the
RMS-normalized flattened streams and constrains them:

    h_pre  = sigmoid(a_pre  * z_pre  + b_pre) (+ eps)          non-negative read weights
    h_post = 2 * sigmoid(a_post * z_post + b_post)             non-negative write weights in (0, 2)
    H_res  = Sinkhorn-Knopp(a_res * z_res + b_res)             doubly stochastic: every entry >= 0,
                                                               every row and column sums to 1

with ``z = RMSNorm(vec(x_l)) @ phi``.  A product of doubly stochastic matrices is doubly stochastic, so
the composite mixing stays a weighted average at any depth: its gain (largest absolute row or column
sum) is 1.  Sinkhorn-Knopp only approximates the projection with a finite number of row/column
normalizations (20 by default): the rows are exact after the last step, the columns close.

Shape letters: ``*B`` leading batch dims (usually ``B T``), ``n`` streams, ``D`` model size.
All maps are computed in fp32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jaxattn.checks import check_int, check_nonnegative


def _check_num_iters(num_iters):
  check_int("num_iters", num_iters)


def _check_square(name, m):
  if m.ndim < 2 or m.shape[-1] != m.shape[-2]:
    raise ValueError(f"`{name}` must end in a square [n, n] matrix, got shape {m.shape}.")


def sinkhorn(
    logits: Float[Array, "*B n n"],
    *,
    num_iters: int = 20,
    log_domain: bool = True,
    eps: float = 0.0,
) -> Float[Array, "*B n n"]:
  """Sinkhorn-Knopp: projects ``exp(logits)`` towards the doubly stochastic matrices (fp32).

  Each iteration normalizes the columns (sums over axis -2) and then the rows (axis -1), as the mHC
  paper's ``M <- T_r(T_c(M))``: after the last step every row sums to 1 exactly and every column to
  within the residual of the iteration.

  ``log_domain=True`` iterates on ``log M`` with ``logsumexp``: stable for any logit range (a plain
  ``exp`` underflows to exact zeros once a logit range exceeds ~88 in fp32, and a whole column of zeros
  divides 0 by 0).  ``log_domain=False`` is the plain multiplicative form of the DeepSeek-V4 reference:
  ``M = softmax(logits, over columns) + eps`` and ``M / (sum + eps)`` at every step; with ``eps = 0`` the
  two forms are the same function.  ``eps`` is only used by the plain form.
  """
  _check_square("logits", logits)
  _check_num_iters(num_iters)
  check_nonnegative("eps", eps)
  if log_domain and eps != 0:
    raise ValueError(f"`eps` ({eps!r}) is only used by the plain form; pass log_domain=False or eps=0.")
  return _sinkhorn(logits, num_iters, log_domain, float(eps))


# Jitted with static settings so eager calls (tests, notebooks) reuse one compiled loop per shape.
@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _sinkhorn(logits, num_iters, log_domain, eps):
  x = logits.astype(jnp.float32)
  if log_domain:
    def step(_, lm):
      lm = lm - jax.nn.logsumexp(lm, axis=-2, keepdims=True)
      return lm - jax.nn.logsumexp(lm, axis=-1, keepdims=True)
    return jnp.exp(jax.lax.fori_loop(0, num_iters, step, x))

  # The first column normalization is a softmax (max-subtracted, so exp cannot overflow).
  m = jax.nn.softmax(x, axis=-2) + eps
  m = m / (jnp.sum(m, axis=-1, keepdims=True) + eps)

  def plain_step(_, m):
    m = m / (jnp.sum(m, axis=-2, keepdims=True) + eps)
    return m / (jnp.sum(m, axis=-1, keepdims=True) + eps)
  return jax.lax.fori_loop(0, num_iters - 1, plain_step, m)


# ---------------------------------------------------------------------------------------------
# Streams: expand, read, write, collapse
# ---------------------------------------------------------------------------------------------


def expand_streams(x: Float[Array, "*B D"], num_streams: int) -> Float[Array, "*B n D"]:
  """Copies the embedding to every stream: ``[*B, D] -> [*B, n, D]``."""
  check_int("num_streams", num_streams)
  return jnp.broadcast_to(x[..., None, :], (*x.shape[:-1], num_streams, x.shape[-1]))


def _check_streams(streams, *maps):
  if streams.ndim < 2:
    raise ValueError(f"`streams` must be [*B, n, D], got shape {streams.shape}.")
  n = streams.shape[-2]
  for name, m, trailing in maps:
    if m.shape[-trailing:] != (n,) * trailing:
      raise ValueError(f"`{name}` must end in {(n,) * trailing} for {n} streams, got shape {m.shape}.")


def hc_read(streams: Float[Array, "*B n D"], h_pre: Float[Array, "*#B n"]) -> Float[Array, "*B D"]:
  """The sublayer input ``sum_i h_pre[i] * streams[i]`` (fp32 sum, input dtype out)."""
  _check_streams(streams, ("h_pre", h_pre, 1))
  y = jnp.einsum("...n,...nd->...d", h_pre.astype(jnp.float32), streams.astype(jnp.float32))
  return y.astype(streams.dtype)


def hc_write(streams: Float[Array, "*B n D"], output: Float[Array, "*B D"],
             h_post: Float[Array, "*#B n"], h_res: Float[Array, "*#B n n"]) -> Float[Array, "*B n D"]:
  """New streams ``H_res @ streams + h_post[:, None] * output`` (fp32, input dtype out).

  ``H_res[o, i]`` weighs input stream ``i`` in output stream ``o`` (the DeepSeek-V4 reference stores
  the transpose, ``comb[i, o]``, and multiplies by ``comb^T``).
  """
  _check_streams(streams, ("h_post", h_post, 1), ("h_res", h_res, 2))
  if output.shape[-1] != streams.shape[-1]:
    raise ValueError(f"`output` feature size {output.shape[-1]} != streams' {streams.shape[-1]}.")
  f32 = jnp.float32
  mixed = jnp.einsum("...oi,...id->...od", h_res.astype(f32), streams.astype(f32))
  y = mixed + h_post.astype(f32)[..., None] * output.astype(f32)[..., None, :]
  return y.astype(streams.dtype)


def collapse_streams(streams: Float[Array, "*B n D"],
                     weights: Float[Array, "*#B n"] | None = None) -> Float[Array, "*B D"]:
  """``sum_i weights[i] * streams[i]`` (all ones when ``weights`` is None: the HC paper's sum)."""
  if weights is None:
    return jnp.sum(streams.astype(jnp.float32), axis=-2).astype(streams.dtype)
  return hc_read(streams, weights)


# ---------------------------------------------------------------------------------------------
# Mixing maps
# ---------------------------------------------------------------------------------------------


def _inv_rms(x, axes, eps):
  return jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=axes, keepdims=True) + eps)


def mhc_coefficients(
    streams: Float[Array, "*B n D"],
    proj: Float[Array, "n D k"],
    bias: Float[Array, "k"],
    scale: Float[Array, "3"],
    *,
    num_iters: int = 20,
    log_domain: bool = True,
    eps: float = 1e-6,
    norm_eps: float = 1e-6,
) -> tuple[Float[Array, "*B n"], Float[Array, "*B n"], Float[Array, "*B n n"]]:
  """mHC's ``(h_pre, h_post, H_res)`` of one residual site, from the streams themselves (fp32).

  ``z = RMSNorm(vec(streams)) @ proj`` with ``proj [n, D, k]``, ``k = n (n + 2)`` laid out as
  ``[pre (n) | post (n) | res (n * n)]`` and the res block in the DeepSeek-V4 order
  ``comb[i_in, o_out]`` at ``i * n + o``; ``bias [k]`` the static part; ``scale [3]`` the gates
  ``(a_pre, a_post, a_res)``.  The RMS norm has no gain (a gain would only rescale ``proj``) and is
  applied after the matmul, ``(x @ proj) * rsqrt(mean(x^2))``, which equals ``RMSNorm(x) @ proj`` and
  is the order the mHC paper uses to read the wide ``n * D`` input once.

  ``h_pre = sigmoid(.) + eps``; ``h_post = 2 sigmoid(.)``; ``H_res = sinkhorn(., num_iters,
  log_domain)`` (the plain form uses ``eps`` as the reference does).  Returns ``h_pre [*B, n]``,
  ``h_post [*B, n]``, ``H_res [*B, n, n]`` with ``H_res[o, i]`` as in ``hc_write``.
  """
  n, d = streams.shape[-2:]
  k = n * (n + 2)
  if proj.shape != (n, d, k):
    raise ValueError(f"`proj` must have shape (n, D, n(n+2)) = {(n, d, k)}, got {proj.shape}.")
  if bias.shape != (k,):
    raise ValueError(f"`bias` must have shape ({k},), got {bias.shape}.")
  if scale.shape != (3,):
    raise ValueError(f"`scale` must have shape (3,) (pre, post, res gates), got {scale.shape}.")
  # eps is added to h_pre (negative, the read weights can be negative); norm_eps to the mean square
  # under the rsqrt (negative, NaN).
  check_nonnegative("eps", eps)
  check_nonnegative("norm_eps", norm_eps)
  f32 = jnp.float32
  x = streams.astype(f32)
  z = jnp.einsum("...nd,ndk->...k", x, proj.astype(f32)) * _inv_rms(x, (-2, -1), norm_eps)[..., 0]
  a, b = scale.astype(f32), bias.astype(f32)
  h_pre = jax.nn.sigmoid(a[0] * z[..., :n] + b[:n]) + eps
  h_post = 2.0 * jax.nn.sigmoid(a[1] * z[..., n:2 * n] + b[n:2 * n])
  comb = (a[2] * z[..., 2 * n:] + b[2 * n:]).reshape(*z.shape[:-1], n, n)   # [*B, i_in, o_out]
  h_res = sinkhorn(jnp.swapaxes(comb, -1, -2), num_iters=num_iters, log_domain=log_domain,
                   eps=0.0 if log_domain else eps)
  return h_pre, h_post, h_res


def hc_coefficients(
    streams: Float[Array, "*B n D"],
    proj: Float[Array, "D k"],
    static_pre: Float[Array, "n"],
    static_post: Float[Array, "n"],
    static_res: Float[Array, "n n"],
    scale: Float[Array, "2"],
    *,
    norm_eps: float = 1e-6,
) -> tuple[Float[Array, "*B n"], Float[Array, "*B n"], Float[Array, "*B n n"]]:
  """The original (unconstrained) Hyper-Connections' dynamic maps (fp32).

  Each stream is RMS-normalized on its own (``xbar [*B, n, D]``) and ``t = tanh(xbar @ proj)`` with
  ``proj [D, 2 + n]`` gives, per stream ``i``, a read weight ``t[i, 0]``, a write weight ``t[i, 1]``
  and a row ``t[i, 2:]`` of the residual matrix:

      h_pre  = static_pre  + s_alpha * t[:, 0]
      h_post = static_post + s_beta  * t[:, 1]
      H_res  = static_res  + s_alpha * t[:, 2:]^T           (``H_res[o, i]``: stream i -> o)

  ``scale = (s_alpha, s_beta)``.  Nothing constrains the signs or sums of these maps.
  """
  n, d = streams.shape[-2:]
  if proj.shape != (d, n + 2):
    raise ValueError(f"`proj` must have shape (D, n + 2) = {(d, n + 2)}, got {proj.shape}.")
  for name, v, shape in (("static_pre", static_pre, (n,)), ("static_post", static_post, (n,)),
                         ("static_res", static_res, (n, n)), ("scale", scale, (2,))):
    if v.shape != shape:
      raise ValueError(f"`{name}` must have shape {shape}, got {v.shape}.")
  check_nonnegative("norm_eps", norm_eps)
  f32 = jnp.float32
  x = streams.astype(f32)
  t = jnp.tanh(jnp.einsum("...nd,dk->...nk", x * _inv_rms(x, -1, norm_eps), proj.astype(f32)))
  s_alpha, s_beta = scale.astype(f32)[0], scale.astype(f32)[1]
  h_pre = static_pre.astype(f32) + s_alpha * t[..., 0]
  h_post = static_post.astype(f32) + s_beta * t[..., 1]
  h_res = static_res.astype(f32) + s_alpha * jnp.swapaxes(t[..., 2:], -1, -2)
  return h_pre, h_post, h_res


# ---------------------------------------------------------------------------------------------
# Composite mixing across depth
# ---------------------------------------------------------------------------------------------


def composite_mixing(h_res: Float[Array, "L *B n n"]) -> Float[Array, "L *B n n"]:
  """Running products ``P_l = H_res^(l) ... H_res^(1)`` over the leading depth axis (fp32)."""
  _check_square("h_res", h_res)
  return _composite_mixing(h_res)


@jax.jit
def _composite_mixing(h_res):
  def step(p, h):
    p = jnp.einsum("...oi,...ij->...oj", h, p)
    return p, p
  eye = jnp.broadcast_to(jnp.eye(h_res.shape[-1], dtype=jnp.float32), h_res.shape[1:])
  _, prods = jax.lax.scan(step, eye, h_res.astype(jnp.float32))
  return prods


def mixing_gain(m: Float[Array, "*B n n"]) -> tuple[Float[Array, "*B"], Float[Array, "*B"]]:
  """The mHC paper's "Amax gain" of a mixing matrix: ``(forward, backward)``.

  Forward gain = the largest absolute row sum (how much a stream can grow on the way up); backward
  gain = the largest absolute column sum (the same for gradients on the way down).  Both are 1 for
  any doubly stochastic matrix and for the identity of a plain residual.
  """
  _check_square("m", m)
  a = jnp.abs(m.astype(jnp.float32))
  return jnp.max(jnp.sum(a, axis=-1), axis=-1), jnp.max(jnp.sum(a, axis=-2), axis=-1)
