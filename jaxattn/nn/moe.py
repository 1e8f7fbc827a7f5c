"""Mixture-of-experts feed-forward layer: DeepSeek-V3 routing, SwiGLU experts, shared experts."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from jaxattn.checks import check_int, check_nonnegative, check_positive
from jaxattn.nn.linear import param
from jaxattn.nn.mlp import MLP
from jaxattn.ops import moe as M
from jaxattn.ops.mxfp4 import GROUP as MXFP4_GROUP, MXFP4Array, code_width
from jaxattn.sharding import _active_mesh, shard


class RouterBias(nnx.Variable):
  """The per-expert selection bias of auxiliary-loss-free balancing.

  Not an ``nnx.Param``: no gradient reaches it (it only ranks experts) and an optimizer built over
  ``nnx.Param`` leaves it alone.  The training step moves it with ``MoE.update_bias``.
  """


class QuantizedData(nnx.Variable):
  """Quantized weight storage (codes and scales): not an ``nnx.Param``, so no gradient reaches it
  and an optimizer built over ``nnx.Param`` leaves it alone (the experts are frozen, as QLoRA's)."""


class MXFP4Weight(nnx.Module):
  """An expert matrix ``[..., E, K, N]`` (``x @ W``) held in MXFP4 along its contraction axis ``K``:
  ``codes [..., E, N, code_width(K)]`` (two E2M1 codes a byte, rows padded to whole 128-byte tiles)
  and ``scales [..., E, N, K / 32]`` uint8 (``jaxattn.ops.mxfp4``), 4.25 bits per weight (plus the
  rows' padding: 4.52 for gpt-oss's 2880).  The published gpt-oss checkpoints' blocks
  ``[..., E, N, K / 32, 16]`` are these codes with the byte axis split and unpadded; flat and
  padded, the codes are row-major on a TPU (a minor axis of 16 bytes would be padded to 128 lanes,
  8x; one of 1440 would be stored transposed), and the grouped-matmul kernel reads them in place.
  Dequantized where used, except by that kernel (``implementation="pallas_tpu"``), which keeps
  them packed.  ``in_axis`` / ``out_axis``: the logical names of ``K`` / ``N``."""

  def __init__(self, codes, scales, in_axis: str | None, out_axis: str | None):
    self.in_axis = in_axis
    self.codes = QuantizedData(codes, logical_axes=("expert", out_axis, None))
    self.scales = QuantizedData(scales, logical_axes=("expert", out_axis, None))

  @classmethod
  def quantize(cls, w: Float[Array, "... E K N"], in_axis, out_axis) -> "MXFP4Weight":
    return cls(*MXFP4Array.quantize(w), in_axis, out_axis)

  @classmethod
  def zeros(cls, shape: tuple[int, int, int], in_axis, out_axis) -> "MXFP4Weight":
    e, k, n = shape
    if k % MXFP4_GROUP:
      raise ValueError(f"MXFP4 experts quantize along the contraction axis in groups of "
                       f"{MXFP4_GROUP}: its size {k} (of {list(shape)}) does not divide.")
    return cls(jnp.zeros((e, n, code_width(k)), jnp.uint8),
               jnp.zeros((e, n, k // MXFP4_GROUP), jnp.uint8), in_axis, out_axis)

  @property
  def shape(self) -> tuple[int, ...]:
    *lead, n, g = self.scales.shape
    return (*lead, g * MXFP4_GROUP, n)

  @property
  def logical_axes(self) -> tuple:
    """The logical axis names of the matrix ``[..., E, K, N]`` (``"layers"`` first when scanned)."""
    axes = tuple(self.codes.get_metadata().get("logical_axes"))
    return axes[:-2] + (self.in_axis, axes[-2])

  def packed(self) -> MXFP4Array:
    """The codes and scales as an ``MXFP4Array`` (what the grouped-matmul kernel reads)."""
    return MXFP4Array(self.codes[...], self.scales[...])

  def dequantize(self, dtype=jnp.float32) -> Float[Array, "... E K N"]:
    return self.packed().dequantize(dtype)


EXPERT_FORMATS = ("dense", "mxfp4")
# The routed experts' matrices [E, K, N]: the logical names of their K (contracted) and N axes.
_EXPERT_AXES = {"w_gate": ("embed", "mlp"), "w_up": ("embed", "mlp"), "w_down": ("mlp", "embed")}


class MoEStats(NamedTuple):
  """Routing statistics of one call, for logging and for the bias update.

  ``load [E]``: assignments per expert (before capacity drops); ``max_over_mean``: ``max(load) /
  mean(load)``; ``dropped``: assignments dropped by the capacity limit (0 when dropless);
  ``aux_loss``: the weighted sum of the enabled balance losses, to add to the training loss;
  ``sequence_balance_loss``, ``switch_aux_loss``, ``z_loss``: the unweighted terms (0 when disabled).
  """
  load: Float[Array, "E"]
  max_over_mean: Float[Array, ""]
  dropped: Int[Array, ""]
  aux_loss: Float[Array, ""]
  sequence_balance_loss: Float[Array, ""]
  switch_aux_loss: Float[Array, ""]
  z_loss: Float[Array, ""]


class MoE(nnx.Module):
  """``y = shared(x) + sum_{i in E_sel(x)} g_i(x) SwiGLU_i(x)`` over ``num_experts`` routed experts.

  Routing is ``jaxattn.ops.moe.route``: ``score_func`` scores (sigmoid as DeepSeek-V3, or softmax),
  a ``RouterBias`` that only ranks experts, group-limited selection (``n_group``, ``topk_group``),
  ``top_k`` experts weighted by their unbiased scores (normalized if ``norm_topk_prob``) times
  ``routed_scaling_factor``.  ``num_shared_experts`` shared experts always run, as one SwiGLU MLP of
  hidden size ``shared_dim`` (default ``num_shared_experts * expert_dim``, as transformers), scaled
  per token by ``sigmoid(x . w)`` when ``shared_gate`` (Qwen3-Next's ``shared_expert_gate``).

  Dispatch: dropless (sort by expert + grouped matmul; ``implementation``, ``block_size`` as in
  ``grouped_swiglu``) or, with ``capacity_factor``, a fixed ``[E, C, D]`` buffer that drops
  overflow.  Under a mesh whose ``expert`` axis has size > 1 the dropless path runs expert-parallel
  (``routed_experts_sharded``: all-to-all inside ``jax.shard_map``) unless
  ``expert_parallel=False``; under another mesh the Pallas implementations dispatch each device's
  tokens locally in ``shard_map`` (all experts on every device).

  Balancing: ``seq_balance_alpha`` (DeepSeek-V3's sequence-wise loss, alpha ~1e-4),
  ``switch_loss_alpha`` (Switch/GShard) and ``z_loss_coef`` (ST-MoE) weight the losses summed in
  ``stats.aux_loss``; ``update_bias(stats.load)`` applies the auxiliary-loss-free bias update.

  Parameters: ``router`` ``[D, E]`` (fp32 math), ``w_gate``/``w_up`` ``[E, D, F]``, ``w_down``
  ``[E, F, D]`` on the ``expert`` logical axis, ``shared`` (an ``MLP``), ``router_bias`` ``[E]``.

  gpt-oss: ``activation=ClampedSwiGLU()`` (``(clip(u) + 1) * g' sigmoid(1.702 g')``, ``g' =
  min(g, 7)``), ``expert_bias`` (``b_gate``/``b_up`` ``[E, F]``, ``b_down`` ``[E, D]``; dropless
  only), ``router_logit_bias`` (a learned ``[E]`` bias on the router's logits), with
  ``score_func="softmax"`` and ``norm_topk_prob=True`` (a softmax over the top-k logits).
  """

  def __init__(
      self,
      embed_dim: int,
      num_experts: int,
      top_k: int,
      expert_dim: int,
      *,
      num_shared_experts: int = 0,
      shared_dim: int | None = None,
      shared_gate: bool = False,
      score_func: M.ScoreFunc = "sigmoid",
      n_group: int = 1,
      topk_group: int | None = None,
      norm_topk_prob: bool = True,
      routed_scaling_factor: float = 1.0,
      seq_balance_alpha: float = 0.0,
      switch_loss_alpha: float = 0.0,
      z_loss_coef: float = 0.0,
      bias_update_rate: float = 1e-3,
      capacity_factor: float | None = None,
      expert_parallel: bool | None = None,
      activation: M.ClampedSwiGLU | None = None,
      expert_bias: bool = False,
      router_logit_bias: bool = False,
      expert_format: str = "dense",
      implementation: M.Implementation | None = None,
      block_size: int | None = None,
      rngs: nnx.Rngs,
      dtype=None,
      param_dtype=jnp.float32,
  ):
    for name, v in (("embed_dim", embed_dim), ("expert_dim", expert_dim)):
      check_int(name, v)
    M.check_routing_config(num_experts, top_k, n_group, topk_group)
    if score_func not in M.SCORE_FUNCS:
      raise ValueError(f"`score_func` must be one of {M.SCORE_FUNCS}, got {score_func!r}.")
    check_int("num_shared_experts", num_shared_experts, minimum=0)
    # None picks the default size (shared: num_shared_experts * expert_dim; blocks: from the
    # token count); 0 is no size, and must not pass for "default".
    for name, v in (("shared_dim", shared_dim), ("block_size", block_size)):
      check_int(name, v, allow_none=True)
    if capacity_factor is not None:
      check_positive("capacity_factor", capacity_factor)
    check_positive("routed_scaling_factor", routed_scaling_factor)
    if not isinstance(norm_topk_prob, bool):
      raise ValueError(f"`norm_topk_prob` must be a bool, got {norm_topk_prob!r}.")
    if implementation is not None and implementation not in M.IMPLEMENTATIONS:
      raise ValueError(f"`implementation` must be None or one of {M.IMPLEMENTATIONS}, got "
                       f"{implementation!r}.")
    M.check_activation(activation)
    if expert_format not in EXPERT_FORMATS:
      raise ValueError(f"`expert_format` must be one of {EXPERT_FORMATS}, got {expert_format!r}.")
    for name, v in (("expert_bias", expert_bias), ("router_logit_bias", router_logit_bias)):
      if not isinstance(v, bool):
        raise ValueError(f"`{name}` must be a bool, got {v!r}.")
    if expert_bias and capacity_factor is not None:
      raise ValueError("`expert_bias` takes the dropless path (`capacity_factor=None`): a dropped "
                       "assignment would still receive its expert's output bias.")
    if expert_parallel and capacity_factor is not None:
      raise ValueError("`expert_parallel=True` is the dropless path; with `capacity_factor` the "
                       "[E, C, D] buffer is split over the `expert` axis by XLA instead.")
    # A negative bias_update_rate would raise the bias of overloaded experts: more imbalance.
    for name, v in (("seq_balance_alpha", seq_balance_alpha),
                    ("switch_loss_alpha", switch_loss_alpha), ("z_loss_coef", z_loss_coef),
                    ("bias_update_rate", bias_update_rate)):
      check_nonnegative(name, v)
    self.embed_dim, self.num_experts, self.top_k, self.expert_dim = (embed_dim, num_experts, top_k,
                                                                     expert_dim)
    self.score_func, self.n_group, self.topk_group = score_func, n_group, topk_group
    self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor
    self.seq_balance_alpha, self.switch_loss_alpha = seq_balance_alpha, switch_loss_alpha
    self.z_loss_coef, self.bias_update_rate = z_loss_coef, bias_update_rate
    self.capacity_factor, self.expert_parallel = capacity_factor, expert_parallel
    block_size = None if block_size is None else int(block_size)   # static: a Python int
    self.implementation, self.block_size, self.dtype = implementation, block_size, dtype
    self.activation = activation

    d, e, f = embed_dim, num_experts, expert_dim
    expert_init = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=1,
                                                    out_axis=2, batch_axis=(0,))
    # Routing needs every expert's score for a token, so the router's expert axis stays whole.
    self.router = param(rngs, nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal"),
                        (d, e), ("embed", None), param_dtype)
    for name, shape in (("w_gate", (e, d, f)), ("w_up", (e, d, f)), ("w_down", (e, f, d))):
      in_axis, out_axis = _EXPERT_AXES[name]
      if expert_format == "mxfp4":   # frozen MXFP4 storage, filled by a checkpoint loader
        setattr(self, name, MXFP4Weight.zeros(shape, in_axis, out_axis))
      else:
        setattr(self, name, param(rngs, expert_init, shape, ("expert", in_axis, out_axis),
                                  param_dtype))
    self.router_bias = RouterBias(jnp.zeros((e,), jnp.float32), logical_axes=(None,))
    # gpt-oss: a learned bias on the router's logits (it changes the scores too, unlike
    # `router_bias`), and biases on every expert's gate, up and down projections.
    zeros = nnx.initializers.zeros_init()
    self.router_logit_bias = (param(rngs, zeros, (e,), (None,), param_dtype)
                              if router_logit_bias else None)
    self.b_gate, self.b_up, self.b_down = (
        (param(rngs, zeros, (e, f), ("expert", "mlp"), param_dtype),
         param(rngs, zeros, (e, f), ("expert", "mlp"), param_dtype),
         param(rngs, zeros, (e, d), ("expert", "embed"), param_dtype))
        if expert_bias else (None, None, None))
    shared_dim = num_shared_experts * expert_dim if shared_dim is None else shared_dim
    self.shared = (MLP(d, shared_dim, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
                   if num_shared_experts > 0 else None)
    # Qwen3-Next scales the shared expert per token by sigmoid(x . w_gate).
    self.shared_gate = (param(rngs, nnx.initializers.zeros_init(), (d,), ("embed",), param_dtype)
                        if shared_gate and num_shared_experts > 0 else None)

  # -- routing ---------------------------------------------------------------------------------

  def route(self, x: Float[Array, "*B D"]) -> M.Routing:
    """The router's decision for each token of ``x`` (fp32 logits and scores)."""
    router = self.router[...].astype(jnp.float32)
    logits = jnp.einsum("...d,de->...e", x.astype(jnp.float32), router)
    if self.router_logit_bias is not None:
      logits = logits + self.router_logit_bias[...].astype(jnp.float32)
    return M.route(logits, self.router_bias[...], top_k=self.top_k, score_func=self.score_func,
                   n_group=self.n_group, topk_group=self.topk_group,
                   norm_topk_prob=self.norm_topk_prob,
                   routed_scaling_factor=self.routed_scaling_factor)

  def update_bias(self, load: Float[Array, "E"], rate: float | None = None) -> None:
    """``router_bias += rate * sign(mean(load) - load)`` (default ``rate``: ``bias_update_rate``)."""
    rate = self.bias_update_rate if rate is None else rate
    check_nonnegative("rate", rate)   # negative: overloaded experts would gain
    self.router_bias[...] = M.bias_update(self.router_bias[...], load, rate=rate)

  def _use_expert_parallel(self) -> bool:
    if self.capacity_factor is not None or self.expert_parallel is False:
      return False
    mesh = _active_mesh()
    has_axis = mesh is not None and dict(mesh.shape).get("expert", 1) > 1
    if self.expert_parallel and not has_axis:
      raise ValueError("`expert_parallel=True` needs an active mesh (jax.set_mesh) with an `expert` "
                       "axis of size > 1.")
    return has_axis

  def _token_local(self, *weights) -> bool:
    """The Pallas kernels under a mesh without expert parallelism: each device dispatches its own
    tokens to all the experts inside ``shard_map`` (``routed_experts_sharded(expert_axis=None)``)
    rather than the kernels seeing the whole global batch."""
    if self.capacity_factor is not None:
      return False
    mesh = _active_mesh()
    if mesh is None or mesh.size == 1:
      return False
    return M._check_implementation(self.implementation, *weights) in ("pallas_tpu", "pallas_gpu")

  def quantize_experts(self) -> None:
    """Replaces the routed experts' matrices by MXFP4 storage (``MXFP4Weight``, 4.25 bits per
    weight, or a little more where rows are padded: 3.5x to 3.8x fewer bytes than bf16), quantized
    along their contraction axes (``D`` for ``w_gate`` / ``w_up``, ``F`` for ``w_down``: multiples
    of 32). They are then frozen (no gradient); everything else of the layer trains as before."""
    for name, (in_axis, out_axis) in _EXPERT_AXES.items():
      w = getattr(self, name)
      if isinstance(w, MXFP4Weight):
        continue
      if w.shape[-2] % MXFP4_GROUP:
        raise ValueError(f"`{name}` {list(w.shape)}: MXFP4 quantizes its contraction axis in "
                         f"groups of {MXFP4_GROUP}, which does not divide {w.shape[-2]}.")
      if getattr(self, f"{name}_lora", None) is not None:
        raise ValueError(f"`{name}` carries a LoRA adapter; quantize the experts before "
                         "attaching adapters (jaxattn.nn.lora.apply_lora).")
      setattr(self, name, MXFP4Weight.quantize(w[...], in_axis, out_axis))

  def expert_kernel(self, name: str, dtype=None) -> jax.Array | MXFP4Array | M.LoRAWeight:
    """``w_gate`` / ``w_up`` / ``w_down`` as the experts use it, in ``dtype`` (default: the
    module's, else fp32): held in MXFP4, the packed ``MXFP4Array`` (the grouped-matmul kernels
    read it packed, the other dispatch paths dequantize it); with a LoRA adapter attached by
    ``jaxattn.nn.lora.apply_lora`` (``<name>_lora``, unmerged), a ``LoRAWeight`` -- ``W + scaling
    * A_e B_e`` kept factored, so the dropless paths compute ``x W + scaling (x A) B`` without
    the ``[E, K, N]`` update (QLoRA over MXFP4 experts through the kernels never dequantizes
    them)."""
    dtype = dtype or self.dtype or jnp.float32
    w = getattr(self, name)
    w = w.packed() if isinstance(w, MXFP4Weight) else w[...].astype(dtype)
    adapter = getattr(self, f"{name}_lora", None)
    if adapter is None or adapter.merged:
      return w
    return M.LoRAWeight(w, adapter.lora_a[...], adapter.lora_b[...], float(adapter.scaling))

  # -- forward ---------------------------------------------------------------------------------

  def __call__(self, x: Float[Array, "B T D"], *, token_mask: Bool[Array, "B T"] | None = None,
               segment_ids: Int[Array, "B T"] | None = None
               ) -> tuple[Float[Array, "B T D"], MoEStats]:
    """``x [B, T, D]`` -> ``(y [B, T, D], stats)``.

    ``token_mask [B, T]`` (False for padding) keeps tokens out of the experts (their routed output
    is zero: no expert slot or compute spent on them), the load, the losses and the statistics.
    ``segment_ids [B, T]`` (packed rows, 0 = padding) implies that mask, and makes each segment a
    sequence of its own for the sequence-wise balance loss.
    """
    if x.ndim != 3 or x.shape[-1] != self.embed_dim:
      raise ValueError(f"`x` must be [B, T, D={self.embed_dim}], got shape {x.shape}.")
    b, t, d = x.shape
    if segment_ids is not None:
      M.check_segment_ids(segment_ids, b, t)
      if token_mask is None:
        token_mask = segment_ids > 0
    dtype = self.dtype or x.dtype
    x = shard(x.astype(dtype), ("batch", "length", "act_embed"))
    r = self.route(x)
    # (first: it checks the mask's shape and dtype)
    load = jax.lax.stop_gradient(M.expert_load(r.indices, self.num_experts, token_mask))
    indices = r.indices
    if token_mask is not None:
      indices = jnp.where(token_mask[..., None], indices, -1)  # -1: no expert
    wg, wu, wd = (self.expert_kernel(name, dtype) for name in ("w_gate", "w_up", "w_down"))
    xf, idx, wts = x.reshape(b * t, d), indices.reshape(b * t, -1), r.weights.reshape(b * t, -1)
    flat = (xf, idx, wts, wg, wu, wd)
    extra = dict(implementation=self.implementation, block_size=self.block_size,
                 activation=self.activation,
                 gate_up_bias=None if self.b_gate is None else (self.b_gate[...],
                                                                self.b_up[...]))
    if self._use_expert_parallel():
      y = M.routed_experts_sharded(*flat, **extra)
      dropped = jnp.zeros((), jnp.int32)
    elif self._token_local(wg, wu, wd):
      y = M.routed_experts_sharded(*flat, expert_axis=None, **extra)
      dropped = jnp.zeros((), jnp.int32)
    else:
      y, dropped = M.routed_experts(*flat, capacity_factor=self.capacity_factor, **extra)
    if self.b_down is not None:
      # sum_j w_j (h_j W_d + b_d[e_j]): the output bias of each chosen expert, weighted
      valid = (idx >= 0) & (idx < self.num_experts)
      b_sel = self.b_down[...].astype(jnp.float32)[jnp.where(valid, idx, 0)]      # [M, k, D]
      w_sel = jnp.where(valid, wts.astype(jnp.float32), 0.0)
      y = (y.astype(jnp.float32) + jnp.einsum("mk,mkd->md", w_sel, b_sel)).astype(y.dtype)
    y = y.reshape(b, t, d)
    if self.shared is not None:
      s = self.shared(x)
      if self.shared_gate is not None:
        g = jax.nn.sigmoid(jnp.einsum("btd,d->bt", x.astype(jnp.float32),
                                      self.shared_gate[...].astype(jnp.float32)))
        s = (s.astype(jnp.float32) * g[..., None]).astype(s.dtype)
      y = y + s
    y = shard(y, ("batch", "length", "act_embed"))
    return y, self._stats(r, load, dropped, token_mask, segment_ids)

  def _stats(self, r: M.Routing, load, dropped, token_mask, segment_ids) -> MoEStats:
    zero = jnp.zeros((), jnp.float32)
    seq = (M.sequence_balance_loss(r.scores, r.indices, token_mask, segment_ids)
           if self.seq_balance_alpha else zero)
    # Switch's P_i are probabilities: softmax scores as they are, sigmoid scores normalized per
    # token (DeepSeek-V3's s'_i).
    probs = r.scores / jnp.maximum(r.scores.sum(-1, keepdims=True), 1e-20)
    switch = M.switch_aux_loss(probs, r.indices, token_mask) if self.switch_loss_alpha else zero
    z = M.router_z_loss(r.logits, token_mask) if self.z_loss_coef else zero
    aux = self.seq_balance_alpha * seq + self.switch_loss_alpha * switch + self.z_loss_coef * z
    return MoEStats(load, M.load_imbalance(load), dropped, aux, seq, switch, z)
