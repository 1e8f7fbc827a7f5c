"""Scaled dot-product attention: the formula and its one dispatch point.

Shapes (the package docstring defines the letters): ``query [B, T, N, H]``, ``key [B, S, K, H]``,
``value [B, S, K, h]``, output ``[B, T, N, h]``.  ``N % K == 0``: ``K == N`` is MHA, ``K == 1`` MQA,
anything between GQA, where query head ``n`` reads KV head ``n // (N // K)``.

Order of operations (``jaxattn.ops.scores``): scale -> bias (incl. ALiBi) -> soft-cap -> mask ->
softmax (fp32) -> weighted sum of values.  A query row that the mask empties entirely gives zeros
(and log-sum-exp ``-inf``), never NaN.
"""

from __future__ import annotations

import math
from typing import Callable, Literal, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from jaxattn.checks import check_float_array, check_positive, is_number
from jaxattn.ops import scores as S
from jaxattn.ops import context_parallel
from jaxattn.ops.masks import Mask, make_mask

Implementation = Literal["xla", "xla_chunked", "cpu", "cudnn", "pallas_tpu", "pallas_gpu"]
IMPLEMENTATIONS: tuple[str, ...] = ("xla", "xla_chunked", "cpu", "cudnn", "pallas_tpu",
                                    "pallas_gpu")

# name -> callable with the normalized signature of `_attention_xla`; Pallas kernels register here.
_REGISTRY: dict[str, Callable] = {}
# name -> reason it is not available (explicit requests raise with this reason).
_UNAVAILABLE: dict[str, str] = {
    "pallas_tpu": "no Pallas TPU flash-attention kernel is registered in this build of jaxattn",
    "pallas_gpu": "no Pallas GPU flash-attention kernel is registered in this build of jaxattn",
}


class UnsupportedError(ValueError):
  """A backend cannot compute this call (e.g. a kernel given a dense bias).

  With ``implementation=None`` the dispatcher then tries the next backend in its order and, if none
  can, reports every reason; an explicitly requested backend lets it propagate.
  """


def register_implementation(name: str, fn: Callable) -> None:
  """Registers a backend under ``name`` (one of ``IMPLEMENTATIONS``); used by ``pallas_kernels``."""
  if name not in IMPLEMENTATIONS:
    raise ValueError(f"`name` must be one of {IMPLEMENTATIONS}, got {name!r}.")
  _REGISTRY[name] = fn
  _UNAVAILABLE.pop(name, None)


def _auto_order() -> list[str]:
  platform = jax.default_backend()
  if platform == "tpu":
    return ["pallas_tpu", "xla_chunked"]
  if platform in ("gpu", "cuda", "rocm"):
    # cuDNN first where it computes the call (faster than the Pallas kernel on an H200, see
    # jaxattn.ops.attention_cudnn); the Pallas kernel for the rest (segments, ALiBi, soft-cap...).
    return ["cudnn", "pallas_gpu", "xla_chunked"]
  return ["cpu", "xla_chunked"]


def _resolve(implementation) -> Callable:
  if implementation is None:
    order = _auto_order()
  elif isinstance(implementation, str):
    order = [implementation]
  else:
    order = list(implementation)
  reasons = []
  for name in order:
    if name not in IMPLEMENTATIONS:
      raise ValueError(f"`implementation` must be None, one of {IMPLEMENTATIONS} or a sequence of "
                       f"them, got {implementation!r}.")
    _load_builtin(name)
    if name in _REGISTRY:
      return _REGISTRY[name]
    reasons.append(f"{name}: {_UNAVAILABLE.get(name, 'not registered')}")
  raise ValueError("no requested attention implementation is available (explicit choices never "
                   "fall back): " + "; ".join(reasons))


def _load_builtin(name):
  if name in _REGISTRY:
    return
  if name == "xla":
    _REGISTRY["xla"] = _attention_xla
  elif name == "xla_chunked":
    from jaxattn.ops.attention_chunked import chunked_attention  # noqa: PLC0415 (import cycle)
    _REGISTRY["xla_chunked"] = chunked_attention
  elif name == "cpu":
    from jaxattn.ops.attention_cpu import cpu_attention  # noqa: PLC0415 (import cycle)
    _REGISTRY["cpu"] = cpu_attention
  elif name == "cudnn":
    from jaxattn.ops.attention_cudnn import cudnn_attention  # noqa: PLC0415 (import cycle)
    _REGISTRY["cudnn"] = cudnn_attention
  elif name in ("pallas_tpu", "pallas_gpu"):
    try:  # Kernels register themselves on import.
      import pallas_kernels.flash_attention  # noqa: F401, PLC0415
    except ImportError:
      pass


def check_q_offset(q_offset, per_sequence: str = "use kv_lengths, or a mask") -> None:
  """Raises unless ``q_offset`` is one integer (Python, NumPy or a traced 0-d array): a ``[B]``
  array would broadcast against the query rows instead (a wrong causal mask when ``B == T``).
  ``per_sequence`` says what to do instead, in the caller's terms."""
  if jnp.ndim(q_offset) != 0 or not jnp.issubdtype(jnp.asarray(q_offset).dtype, jnp.integer):
    raise ValueError(f"`q_offset` must be one integer (a scalar, Python or traced), got "
                     f"{q_offset!r}; per-sequence offsets are not supported ({per_sequence}).")


def check_kv_lengths(kv_lengths, b: int) -> None:
  """``kv_lengths``: None or ``[B]`` integers (valid keys per sequence)."""
  if kv_lengths is not None and (tuple(np.shape(kv_lengths)) != (b,) or not jnp.issubdtype(
      jnp.asarray(kv_lengths).dtype, jnp.integer)):
    raise ValueError(f"`kv_lengths` must be [B] = ({b},) integers, got shape "
                     f"{tuple(np.shape(kv_lengths))} of {jnp.asarray(kv_lengths).dtype}.")


def check_scale(scale) -> None:
  """Raises unless ``scale`` is None, an array (traced values cannot be checked) or a positive
  finite number: the one check of a logits scale for every attention formula."""
  if scale is None or isinstance(scale, (jax.Array, jax.core.Tracer)):
    return
  if not is_number(scale) or not (math.isfinite(scale) and scale > 0):
    raise ValueError(f"`scale` must be a positive finite float or None, got {scale!r}.")


def _validate(query, key, value, bias, mask, scale, alibi_slopes, logits_soft_cap,
              segment_ids=None, kv_lengths=None, q_offset=0):
  for name, x in (("query", query), ("key", key), ("value", value)):
    if x.ndim != 4:
      raise ValueError(f"`{name}` must have rank 4 ([B, T|S, heads, head_dim]), got shape {x.shape}.")
  b, t, n, h = query.shape
  if key.shape[0] != b or value.shape[0] != b:
    raise ValueError(f"batch sizes differ: query {query.shape}, key {key.shape}, value {value.shape}.")
  if key.shape[1] != value.shape[1] or key.shape[2] != value.shape[2]:
    raise ValueError(f"`key` {key.shape} and `value` {value.shape} must share [B, S, K].")
  if key.shape[3] != h:
    raise ValueError(f"`key` head_dim {key.shape[3]} must equal `query` head_dim {h}.")
  kh = key.shape[2]
  if n % kh != 0:
    raise ValueError(f"query heads N={n} must be a multiple of key/value heads K={kh} "
                     "(MHA: K == N, GQA: N % K == 0, MQA: K == 1).")
  if not (query.dtype == key.dtype == value.dtype):
    raise ValueError(f"`query`, `key`, `value` dtypes must match, got {query.dtype}, {key.dtype}, "
                     f"{value.dtype}.")
  check_float_array("query", query)    # (integer inputs gave an integer, truncated output)
  s = key.shape[1]
  if bias is not None:
    try:
      np.broadcast_shapes(bias.shape, (b, n, t, s))
    except ValueError:
      raise ValueError(f"`bias` shape {bias.shape} must broadcast to [B, N, T, S] = {(b, n, t, s)}.")
    if bias.ndim != 4 or bias.shape[1] not in (1, n):
      raise ValueError(f"`bias` must be 4-D [B|1, N|1, T|1, S|1], got shape {bias.shape}.")
  if mask is not None and not isinstance(mask, Mask):
    if jnp.issubdtype(jnp.asarray(mask).dtype, jnp.inexact):
      # an additive 0 / -inf mask cast to bool would be inverted (-inf -> True)
      raise ValueError(f"`mask` must be boolean (True = attend), got dtype "
                       f"{jnp.asarray(mask).dtype}; pass an additive mask as `bias`.")
    mshape = np.shape(mask)
    if len(mshape) != 4 or mshape[1] not in (1, n):
      raise ValueError(f"`mask` array must be 4-D [B|1, N|1, T|1, S|1], got shape {mshape}.")
    try:
      np.broadcast_shapes(mshape, (b, n, t, s))
    except ValueError:
      raise ValueError(f"`mask` shape {mshape} must broadcast to [B, N, T, S] = {(b, n, t, s)}.")
  check_scale(scale)
  if alibi_slopes is not None and tuple(np.shape(alibi_slopes)) != (n,):
    raise ValueError(f"`alibi_slopes` must have shape [N] = ({n},), got {np.shape(alibi_slopes)}.")
  if logits_soft_cap is not None:   # inf would make cap * tanh(x / cap) = inf * 0 = NaN
    check_positive("logits_soft_cap", logits_soft_cap)
  check_q_offset(q_offset)
  if segment_ids is not None:
    # Out-of-range ids are not an error inside the mask (a gather fills them), so the shapes are
    # checked here: a short array would otherwise pass as a segment of its own.
    pair = isinstance(segment_ids, (tuple, list))
    if pair and len(segment_ids) != 2:
      raise ValueError(f"`segment_ids` must be [B, T] or a (q_ids [B, T], kv_ids [B, S]) pair, got "
                       f"{len(segment_ids)} arrays.")
    ids = tuple(segment_ids) if pair else (segment_ids, segment_ids)
    for name, a, want in (("q_ids", ids[0], (b, t)), ("kv_ids", ids[1], (b, s))):
      if tuple(np.shape(a)) != want or not jnp.issubdtype(jnp.asarray(a).dtype, jnp.integer):
        form = (f"{name} {want} of the (q_ids [B, T], kv_ids [B, S]) pair" if pair else
                f"[B, T] = {(b, t)} integers (T == S; a (q_ids, kv_ids) pair when T != S)")
        raise ValueError(f"`segment_ids` must be {form}, got shape {tuple(np.shape(a))} of "
                         f"{jnp.asarray(a).dtype}.")
  check_kv_lengths(kv_lengths, b)


def dot_product_attention(
    query: Float[Array, "B T N H"],
    key: Float[Array, "B S K H"],
    value: Float[Array, "B S K h"],
    bias: Float[Array, "#B #N #T #S"] | None = None,
    mask: Bool[Array, "#B #N #T #S"] | Mask | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    local_window_size: int | tuple[int | None, int | None] | None = None,
    segment_ids: Int[Array, "B T"] | tuple[Int[Array, "B T"], Int[Array, "B S"]] | None = None,
    kv_lengths: Int[Array, "B"] | None = None,
    q_offset: int | Int[Array, ""] = 0,
    alibi_slopes: Float[Array, "N"] | None = None,
    logits_soft_cap: float | None = None,
    sinks: Float[Array, "N"] | None = None,
    return_residuals: bool = False,
    implementation: Implementation | Sequence[Implementation] | None = None,
) -> Float[Array, "B T N h"] | tuple[Float[Array, "B T N h"], Float[Array, "B N T"]]:
  """Scaled dot-product attention with GQA/MQA, masks, biases and soft-capping.

  Args:
    query, key, value: ``[B, T, N, H]``, ``[B, S, K, H]``, ``[B, S, K, h]``, one dtype.
    bias: additive logits bias broadcastable as ``[B|1, N|1, T, S]`` (e.g. a T5 relative bias).
    mask: a boolean array ``[B|1, N|1, T, S]`` (True = attend) or a ``jaxattn.ops.masks.Mask``.
    scale: logits scale, default ``1 / sqrt(H)``.
    is_causal: queries attend only to keys at positions ``<=`` their own.
    local_window_size: sliding-window radius ``w`` (``[p-w, p]`` when causal, ``[p-w, p+w]``
      otherwise) or an explicit ``(left, right)`` pair as in ``jax.nn.dot_product_attention``.
    segment_ids: ``[B, T]`` (self-attention) or a ``(q_ids [B, T], kv_ids [B, S])`` pair for packed
      sequences; tokens attend only within their segment.
    kv_lengths: ``[B]`` number of valid keys per batch row (padding / unfilled cache slots).
    q_offset: position of query row 0 in key coordinates (a KV-cache decode passes the number of
      tokens already cached); 0 aligns a causal mask top-left as ``jax.nn`` does.
    alibi_slopes: ``[N]`` ALiBi slopes; adds ``slope * (j - i)`` computed from positions.
    logits_soft_cap: if set, ``logits = cap * tanh(logits / cap)`` after the bias.
    sinks: ``[N]`` attention-sink logits (gpt-oss's learned sinks): each head's softmax gets one
      more entry, of logit ``sinks[n]`` and a zero value, so a row may give weight to nothing
      (``sum_j p_ij = 1 - sigmoid(sinks[n] - lse_i)``).  Applied to any backend's ``(out, lse)``:
      ``out * sigmoid(lse - sink)``, ``lse`` becoming ``logaddexp(lse, sink)``; differentiated
      (through the backends' log-sum-exp cotangent).  A row that sees no key gives zeros.
    return_residuals: also return the fp32 log-sum-exp of each row, ``[B, N, T]`` (``-inf`` for a
      fully masked row), as the flash backward pass consumes it.
    implementation: None (auto: on TPU the Pallas kernel; on an NVIDIA GPU cuDNN where it
      computes the call, else the Pallas kernel; on CPU the native kernel ``"cpu"`` where it
      computes the call; else ``"xla_chunked"``), one of ``"xla"``
      (materializes ``T x S`` logits), ``"xla_chunked"`` (online softmax over key blocks, skipping
      blocks the mask empties), ``"cpu"`` (fused C++ kernels through XLA's FFI, forward and
      backward: band masks, segment ids, lengths, ALiBi, soft-cap, no dense bias or mask array;
      ``jaxattn.ops.attention_cpu``), ``"cudnn"`` (cuDNN's flash attention through
      ``jax.nn.dot_product_attention``: bf16 / fp16, causal and left-window masks, no bias,
      ALiBi, soft-cap or residuals; ``jaxattn.ops.attention_cudnn``), ``"pallas_tpu"``,
      ``"pallas_gpu"`` (the Pallas flash kernels: position masks, one segment mask, lengths,
      ALiBi, soft-cap, a dense bias and mask array streamed in blocks, not an ``OrMask`` with a
      data-dependent side; ``pallas_kernels.flash_attention``),
      or a sequence of preferences, tried in order as the automatic order is (a backend that
      is unavailable or cannot compute the call passes to the next).  A single explicit choice
      that is unavailable or cannot compute the call raises; it never falls back silently.

  Gradients: every backend differentiates ``query``, ``key``, ``value``, ``bias``,
  ``alibi_slopes`` and a traced ``scale``.  The kernels (CPU, cuDNN, Pallas) leave the last two to
  the chunked formula's backward pass, run only when they are being differentiated (learned slopes
  or a temperature cost one more chunked forward and backward pass; constant slopes cost nothing).

  Returns:
    ``[B, T, N, h]`` in the query dtype; with ``return_residuals``, ``(out, lse)``.
  """
  if sinks is not None:
    sinks = check_sinks(sinks, query.shape[2])
    out, lse = dot_product_attention(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal,
        local_window_size=local_window_size, segment_ids=segment_ids, kv_lengths=kv_lengths,
        q_offset=q_offset, alibi_slopes=alibi_slopes, logits_soft_cap=logits_soft_cap,
        return_residuals=True, implementation=implementation)
    out, lse = apply_sinks(out, lse, sinks)
    return (out, lse) if return_residuals else out
  kwargs = _backend_kwargs(query, key, value, bias, mask, scale=scale, is_causal=is_causal,
                           local_window_size=local_window_size, segment_ids=segment_ids,
                           kv_lengths=kv_lengths, q_offset=q_offset, alibi_slopes=alibi_slopes,
                           logits_soft_cap=logits_soft_cap, return_residuals=return_residuals)
  if query.shape[1] == 0 or key.shape[1] == 0:
    # Nothing to attend (S = 0) or nobody asking (T = 0): the no-visible-key result, zeros and a
    # -inf log-sum-exp, the same from every backend (some cannot tile an empty axis).
    if implementation is not None:
      _resolve(implementation)  # an unavailable explicit choice still raises
    out, lse = no_visible_keys(query, value)
    return (out, lse) if return_residuals else out
  cp_size = context_parallel.mesh_axis_size()
  if cp_size > 1:  # the sequence is split over the mesh axis `context`
    opts = context_parallel.get_options()
    if context_parallel.unsupported(
        query, key, bias=kwargs["bias"], mask_array=kwargs["mask_array"],
        q_offset=kwargs["q_offset"], scale=kwargs["scale"], size=cp_size,
        strategy=opts["strategy"], mask=kwargs["mask"]) is None:
      return context_parallel.attention(
          query, key, value, kwargs, size=cp_size, strategy=opts["strategy"],
          load_balance=opts["load_balance"], mesh=None, implementation=implementation)
  attempt = lambda backend: _with_scalar_grads(backend)(query, key, value, **kwargs)  # noqa: E731
  if implementation is None:
    return _first_accepting(attempt)[1]
  if isinstance(implementation, str):
    return attempt(_resolve(implementation))
  return _first_accepting(attempt, _sequence(implementation))[1]


def check_sinks(sinks, num_heads: int):
  """``sinks`` as an fp32 ``[N]`` array, or a ValueError naming it."""
  shape = tuple(np.shape(sinks))
  if shape != (num_heads,):
    raise ValueError(f"`sinks` must be a [N] array of one logit per query head, N={num_heads}, "
                     f"got shape {shape}.")
  if not jnp.issubdtype(jnp.result_type(sinks), jnp.floating):
    raise ValueError(f"`sinks` must be floating point, got {jnp.result_type(sinks)}.")
  return jnp.asarray(sinks, jnp.float32)


def apply_sinks(out: Float[Array, "B T N h"], lse: Float[Array, "B N T"], sinks: Float[Array, "N"]):
  """``(out, lse)`` of attention with one more softmax entry per head, of logit ``sinks[n]`` and
  a zero value: ``out * exp(lse - lse')``, ``lse' = logaddexp(lse, sink)`` (fp32)."""
  sink = jnp.asarray(sinks, jnp.float32)[None, :, None]  # [1, N, 1]
  new = jnp.logaddexp(lse, sink)
  w = jnp.exp(lse - new)  # lse = -inf (no key): 0
  out = (out.astype(jnp.float32) * jnp.swapaxes(w, 1, 2)[..., None]).astype(out.dtype)
  return out, new


def no_visible_keys(query, value) -> tuple[Float[Array, "B T N h"], Float[Array, "B N T"]]:
  """``(out, lse)`` of rows that see no key: zeros and a ``-inf`` log-sum-exp."""
  b, t, n, _ = query.shape
  return (jnp.zeros((b, t, n, value.shape[-1]), query.dtype),
          jnp.full((b, n, t), -jnp.inf, jnp.float32))


def _zero_cotangent(x):
  dtype = x.dtype if jnp.issubdtype(x.dtype, jnp.inexact) else jax.dtypes.float0
  return np.zeros(x.shape, dtype) if dtype == jax.dtypes.float0 else jnp.zeros(x.shape, dtype)


def _with_scalar_grads(backend: Callable) -> Callable:
  """``backend`` with gradients for ``alibi_slopes`` and a traced ``scale``.

  The formula backends (``"xla"``, ``"xla_chunked"``) differentiate both themselves; the kernels
  (CPU, cuDNN, Pallas) treat them as constants.  For a kernel given slopes or a traced scale, the
  call becomes a custom VJP whose backward pass takes ``query``/``key``/``value``/``bias``
  gradients from the kernel's own backward and, only when the slopes or the scale are being
  differentiated (``symbolic_zeros``' ``perturbed``), theirs from the chunked formula's backward
  (one more forward and backward pass over the blocks, in XLA).  Constant slopes cost nothing.
  """
  _load_builtin("xla")
  _load_builtin("xla_chunked")
  if backend in (_REGISTRY["xla"], _REGISTRY["xla_chunked"]):
    return backend

  def call(query, key, value, *, alibi_slopes, scale, bias, **rest):
    traced_scale = isinstance(scale, jax.core.Tracer)
    if alibi_slopes is None and not traced_scale:
      return backend(query, key, value, alibi_slopes=alibi_slopes, scale=scale, bias=bias, **rest)
    scalars = {"alibi_slopes": None if alibi_slopes is None else jnp.asarray(alibi_slopes),
               "scale": jnp.asarray(scale) if traced_scale else None}
    # The arrays among the other arguments (segment ids, lengths, a traced offset) enter the
    # custom VJP as operands, not closed over: a closed-over tracer fails to lower when the call
    # sits in a branch of lax.switch (context parallelism's per-device programs).
    leaves, treedef = jax.tree.flatten(rest)
    is_array = [isinstance(x, (jax.Array, jax.core.Tracer)) for x in leaves]
    dyn = [x for x, a in zip(leaves, is_array) if a]

    def rebuild(dyn):
      it = iter(dyn)
      return jax.tree.unflatten(treedef, [next(it) if a else x for x, a in zip(leaves, is_array)])

    def run(fn, q, k, v, b, sc, dyn):
      sc_scale = scale if sc["scale"] is None else sc["scale"]
      return fn(q, k, v, alibi_slopes=sc["alibi_slopes"], scale=sc_scale, bias=b, **rebuild(dyn))

    @jax.custom_vjp
    def f(q, k, v, b, sc, dyn):
      return run(backend, q, k, v, b, sc, dyn)

    def fwd(q, k, v, b, sc, dyn):  # leaves are CustomVJPPrimal(value, perturbed)
      bias_wanted = b is not None and b.perturbed
      q, k, v, b, sc_val, dyn = jax.tree.map(lambda x: x.value, (q, k, v, b, sc, dyn))
      wanted = any(x.perturbed for x in jax.tree.leaves(sc))
      if bias_wanted or b is None:
        out, kernel_vjp = jax.vjp(lambda q, k, v, b: run(backend, q, k, v, b, sc_val, dyn),
                                  q, k, v, b)
        const_bias = {}
      else:  # a constant bias stays out of the kernel's VJP: no bias gradient is computed
        out, kernel_vjp = jax.vjp(lambda q, k, v: run(backend, q, k, v, b, sc_val, dyn), q, k, v)
        const_bias = {"bias": None}  # (the structure is the flag)
      return out, (kernel_vjp, const_bias, (q, k, v, b) if wanted else None, sc_val, dyn)

    def bwd(res, ct):
      kernel_vjp, const_bias, inputs, sc_val, dyn = res
      ct = jax.tree.map(lambda c: jnp.zeros(c.shape, c.dtype) if isinstance(
          c, jax.custom_derivatives.SymbolicZero) else c, ct,
          is_leaf=lambda c: isinstance(c, jax.custom_derivatives.SymbolicZero))
      grads = kernel_vjp(ct)
      if const_bias:
        grads = (*grads, None)  # a zero cotangent for the constant bias
      if inputs is None:
        d_sc = jax.tree.map(jnp.zeros_like, sc_val)
      else:
        q, k, v, b = inputs
        _, sc_vjp = jax.vjp(lambda sc: run(_REGISTRY["xla_chunked"], q, k, v, b, sc, dyn),
                            sc_val)
        (d_sc,) = sc_vjp(ct)
      return (*grads, d_sc, [_zero_cotangent(x) for x in dyn])

    f.defvjp(fwd, bwd, symbolic_zeros=True)
    return f(query, key, value, bias, scalars, dyn)

  return call


def _backend_kwargs(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                    local_window_size=None, segment_ids=None, kv_lengths=None, q_offset=0,
                    alibi_slopes=None, logits_soft_cap=None, return_residuals=False) -> dict:
  """Validates ``dot_product_attention``'s arguments and returns the backends' normalized keyword
  arguments: one ``Mask`` (or None), a boolean mask array apart, a concrete default scale."""
  _validate(query, key, value, bias, mask, scale, alibi_slopes, logits_soft_cap, segment_ids,
            kv_lengths, q_offset)
  mask_obj = mask if isinstance(mask, Mask) else None
  mask_array = None if (mask is None or isinstance(mask, Mask)) else jnp.asarray(mask, bool)
  mask_obj = make_mask(is_causal=is_causal, local_window_size=local_window_size,
                       segment_ids=segment_ids, kv_lengths=kv_lengths, mask=mask_obj)
  if scale is None:
    scale = 1.0 / math.sqrt(query.shape[-1])
  return dict(bias=bias, mask=mask_obj, mask_array=mask_array, scale=scale,
              alibi_slopes=alibi_slopes, logits_soft_cap=logits_soft_cap, q_offset=q_offset,
              return_residuals=return_residuals)


def _sequence(implementation) -> list[str]:
  """A sequence of backend names, checked (a typo raises instead of being skipped)."""
  order = list(implementation)
  if not order or any(name not in IMPLEMENTATIONS for name in order):
    raise ValueError(f"`implementation` must be None, one of {IMPLEMENTATIONS} or a sequence of "
                     f"them, got {implementation!r}.")
  return order


def _first_accepting(attempt: Callable, order: list[str] | None = None
                     ) -> tuple[str, object, dict[str, str]]:
  """Automatic dispatch: ``attempt(backend)`` for each backend of ``order`` (default
  ``_auto_order()``; a user's sequence of preferences) until one does not raise
  ``UnsupportedError``.  Returns ``(name, its result, {earlier name: why not})``; raises
  ``ValueError`` with every reason when none accepts."""
  reasons: dict[str, str] = {}
  for name in (_auto_order() if order is None else order):
    _load_builtin(name)
    if name not in _REGISTRY:
      reasons[name] = _UNAVAILABLE.get(name, "not registered")
      continue
    try:
      return name, attempt(_REGISTRY[name]), reasons
    except UnsupportedError as e:
      reasons[name] = str(e)
  raise ValueError("no attention implementation can compute this call: "
                   + "; ".join(f"{k}: {v}" for k, v in reasons.items()))


def attention_gradients(
    query: Float[Array, "B T N H"],
    key: Float[Array, "B S K H"],
    value: Float[Array, "B S K h"],
    out: Float[Array, "B T N h"],
    lse: Float[Array, "B N T"],
    d_out: Float[Array, "B T N h"],
    d_lse: Float[Array, "B N T"] | None = None,
    bias: Float[Array, "#B #N #T #S"] | None = None,
    mask: Mask | None = None,
    *,
    implementation: Implementation | Sequence[Implementation] | None = None,
    **kwargs,
):
  """Gradients of one block of a larger attention: ``(d_query, d_key, d_value, d_bias,
  d_alibi_slopes)`` (None for an absent bias or slopes).

  The block is ``dot_product_attention(query, key, value, bias, mask, **kwargs)`` over a subset
  of the keys of rows whose whole output and log-sum-exp are ``out`` and ``lse`` (e.g. one chunk
  of a ring in context parallelism), and ``d_out`` / ``d_lse`` their cotangents.  The block's
  share of the gradients is the flash backward pass run with the whole rows' ``out`` and ``lse``
  in place of the block's own: probabilities ``exp(s - lse)``, ``delta = sum(d_out * out) -
  d_lse``.  The backends that take given ``residuals`` (``"xla_chunked"``, ``"cpu"``, the Pallas
  kernels) run only their backward; otherwise (``"xla"``) the block's own ``(out_b, lse_b)`` are
  computed and its VJP taken with the cotangents rescaled by ``exp(lse_b - lse)`` (one more
  forward pass).  Keyword arguments as ``dot_product_attention`` (``return_residuals`` excluded);
  ``implementation`` picks the backend as there.  The sum of the blocks' gradients over a
  partition of the keys is the gradient of the whole call.
  """
  if "return_residuals" in kwargs:
    raise ValueError("`return_residuals` is implied (the block's out and lse); do not pass it.")
  if kwargs.get("sinks") is not None:
    raise ValueError("`sinks` act on the whole rows' (out, lse), not on a block: apply them to the "
                     "merged result (`apply_sinks`), whose VJP gives this call's d_out / d_lse.")
  kwargs.pop("sinks", None)
  kw = _backend_kwargs(query, key, value, bias, mask, return_residuals=True, **kwargs)
  bias, slopes = kw.pop("bias"), kw.pop("alibi_slopes")
  b, t, n, _ = query.shape
  rows = (b, t, n, value.shape[-1])
  for name, x, shape in (("out", out, rows), ("lse", lse, (b, n, t)), ("d_out", d_out, rows),
                         ("d_lse", d_lse, (b, n, t))):
    if x is not None and tuple(jnp.shape(x)) != shape:
      raise ValueError(f"`{name}` must have shape {shape} (query {tuple(query.shape)}, value "
                       f"{tuple(value.shape)}), got {tuple(jnp.shape(x))}.")
  if d_lse is None:
    d_lse = jnp.zeros(lse.shape, jnp.float32)
  if query.shape[1] == 0 or key.shape[1] == 0:
    zero = lambda x: None if x is None else jnp.zeros(jnp.shape(x), x.dtype)  # noqa: E731
    return tuple(zero(x) for x in (query, key, value, bias, slopes))

  def given(backend):
    run = lambda q, k, v, b, sl: _with_scalar_grads(backend)(  # noqa: E731
        q, k, v, bias=b, alibi_slopes=sl, residuals=(out, lse), **kw)
    return jax.vjp(run, query, key, value, bias, slopes)[1]((d_out, d_lse))

  if implementation is None:
    order = _auto_order()
  elif isinstance(implementation, str):
    _resolve(implementation)  # an unavailable explicit choice raises
    order = [implementation]
  else:
    order = _sequence(implementation)
  for name in order:
    _load_builtin(name)
    if name in _REGISTRY:
      try:
        return given(_REGISTRY[name])
      except UnsupportedError:
        pass
  # No backend takes given residuals: the block's own (out_b, lse_b), and its VJP with the
  # cotangents of the whole rows carried over (d out_b = w d_out, d lse_b = w (d_out . (out_b -
  # out) + d_lse), w = exp(lse_b - lse)).
  f32 = jnp.float32
  rest = {k: v for k, v in kwargs.items() if k != "alibi_slopes"}

  def block(q, k, v, b, sl):
    return dot_product_attention(q, k, v, b, mask, alibi_slopes=sl, return_residuals=True,
                                 implementation=implementation, **rest)

  (o, l), vjp = jax.vjp(block, query, key, value, bias, slopes)
  finite = jnp.isfinite(lse) & jnp.isfinite(l)
  w = jnp.where(finite, jnp.exp(l - jnp.where(finite, lse, 0.0)), 0.0)  # [B, N, T]
  d_out32 = d_out.astype(f32)
  spread = jnp.swapaxes(jnp.sum(d_out32 * (o.astype(f32) - out.astype(f32)), axis=-1), 1, 2)
  return vjp(((jnp.swapaxes(w, 1, 2)[..., None] * d_out32).astype(o.dtype),
              w * (spread + d_lse.astype(f32))))


def explain_dispatch(query, key, value, bias=None, mask=None, **kwargs) -> tuple[str, dict]:
  """Which backend ``dot_product_attention(query, key, value, ...)`` takes with
  ``implementation=None`` on this platform, and why each one before it declined.

  Traces (``jax.eval_shape``: nothing is computed) each backend of the automatic order until one
  accepts the call, with the same arguments as ``dot_product_attention`` (``implementation``
  excluded).  Returns ``(chosen, reasons)``: ``reasons`` maps every backend tried before the
  chosen one to its refusal (``UnsupportedError`` text, or why it is not available).  Raises
  ``ValueError`` as ``dot_product_attention`` does when none accepts the call.

      >>> explain_dispatch(q, k, v, segment_ids=ids, is_causal=True)    # on an H200
      ('pallas_gpu', {'cudnn': 'cuDNN (through jax.nn) takes causal and left-window masks, ...'})
  """
  if "implementation" in kwargs:
    raise ValueError("`implementation` is what explain_dispatch finds; do not pass it.")
  if kwargs.pop("sinks", None) is not None:   # applied to a backend's (out, lse): residuals
    kwargs["return_residuals"] = True
  normalized = _backend_kwargs(query, key, value, bias, mask, **kwargs)
  name, _, reasons = _first_accepting(lambda backend: jax.eval_shape(
      lambda q, k, v: backend(q, k, v, **normalized), query, key, value))
  return name, reasons


def _attention_xla(query, key, value, *, bias, mask, mask_array, scale, alibi_slopes,
                   logits_soft_cap, q_offset, return_residuals, residuals=None):
  """Reference path: materializes the full ``[B, K, G, T, S]`` logits."""
  if residuals is not None:
    raise UnsupportedError("the reference path differentiates by autodiff; it takes no given "
                           "`residuals`")
  b, t, n, _ = query.shape
  s, kh = key.shape[1], key.shape[2]
  q = S.group_heads(jnp.swapaxes(query, 1, 2), kh)  # [B, K, G, T, H]
  k = jnp.swapaxes(key, 1, 2)  # [B, K, S, H]
  v = jnp.swapaxes(value, 1, 2)  # [B, K, S, h]
  slopes = None if alibi_slopes is None else jnp.asarray(alibi_slopes, jnp.float32).reshape(kh, n // kh)
  logits, _ = S.block_logits(
      q, k, scale=scale, q_idx=jnp.arange(t, dtype=jnp.int32), kv_idx=jnp.arange(s, dtype=jnp.int32),
      q_offset=q_offset, bias=S.group_heads(bias, kh), alibi_slopes=slopes,
      logits_soft_cap=logits_soft_cap, mask=mask, mask_array=S.group_heads(mask_array, kh))
  m, p, l = S.safe_softmax_stats(logits)  # [B, K, G, T, 1], [..., S], [..., 1]
  acc = jnp.einsum("bkgts,bksh->bkgth", p, v.astype(jnp.float32))
  out = S.ungroup(S.finalize(acc, l, query.dtype))
  if return_residuals:
    return out, S.ungroup_lse(S.lse_from_stats(m, l)[..., 0])
  return out


def attention_weights(query, key, **kwargs) -> Float[Array, "B N T S"]:
  """The softmax probabilities ``[B, N, T, S]`` (fp32) of the reference path; for tests and plots."""
  b, t, n, h = query.shape
  value = jnp.eye(key.shape[1], dtype=query.dtype)[None, :, None, :]
  value = jnp.broadcast_to(value, (b, key.shape[1], key.shape[2], key.shape[1]))
  out = dot_product_attention(query, key, value, implementation="xla", **kwargs)
  return jnp.swapaxes(out, 1, 2).astype(jnp.float32)
