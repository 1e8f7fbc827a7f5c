"""Mixture of experts: DeepSeek-V3 routing, load balancing and token dispatch as pure functions.

Shape letters (beyond the package's): ``M`` tokens (batch and length flattened), ``E`` routed
experts, ``k`` experts selected per token (lower case: ``K`` already names KV heads), ``A = M * k``
token-expert assignments, ``F`` an expert's hidden size, ``G`` expert groups.

Routing (DeepSeek-V3 v2, section 2.1.2, eqs. 12-17), for one token with router logits ``z``::

    s      = sigmoid(z)  (or softmax(z))                       unbiased scores, fp32
    s_sel  = s + b                                             the bias b only ranks experts
    groups = top `topk_group` of the G groups by the sum of each group's two largest s_sel
    E_sel  = TopKIndices(s_sel restricted to those groups, k)
    g_i    = s_i / sum_{j in E_sel} s_j  (if norm_topk_prob)   weights from the UNBIASED scores
    g_i   *= routed_scaling_factor

so the bias changes which experts run but never how much their outputs count, and no gradient
reaches it.  Balancing: ``bias_update`` (auxiliary-loss-free, ``b_i += rate * sign(mean_load -
load_i)``), ``sequence_balance_loss`` (DeepSeek-V3's per-sequence loss), ``switch_aux_loss``
(Switch/GShard) and ``router_z_loss`` (ST-MoE).

Dispatch: ``routed_experts`` sorts the assignments by expert and runs each expert's SwiGLU on its
contiguous rows with a grouped matmul (dropless), or packs them into an ``[E, C, D]`` buffer of
fixed capacity ``C`` and drops the overflow (``capacity_factor``).  ``routed_experts_sharded`` is the
dropless path with experts split over a mesh axis, tokens exchanged with all-to-all inside
``jax.shard_map``.  ``dense_experts`` runs every expert on every token and masks: the reference.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Literal, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from jaxattn.checks import check_bool, check_int_array, check_nonnegative, check_positive
from jaxattn.ops.mxfp4 import MXFP4Array
from jaxattn.sharding import constrain, is_explicit, shard

ScoreFunc = Literal["sigmoid", "softmax"]
SCORE_FUNCS: tuple[str, ...] = ("sigmoid", "softmax")
Implementation = Literal["ragged_dot", "blocked", "dense", "pallas_tpu", "pallas_gpu"]
IMPLEMENTATIONS: tuple[str, ...] = ("ragged_dot", "blocked", "dense", "pallas_tpu", "pallas_gpu")
_BLOCKED = ("blocked", "pallas_tpu", "pallas_gpu")   # the implementations over the block layout


@dataclasses.dataclass(frozen=True)
class LoRAWeight:
  """An expert matrix with a per-expert LoRA update, kept factored: ``W_e + scaling * A_e B_e``
  with ``base`` ``[E, K, N]`` (an array or an ``MXFP4Array``), ``a [E, K, r]``, ``b [E, r, N]``.
  The dispatch paths over the block layout and ``ragged_dot`` compute ``x W + scaling (x A) B``,
  never the ``[E, K, N]`` update (nor, for MXFP4 through the kernels, ``W`` itself); the others
  add the update to the dequantized matrix.  A pytree (``scaling`` static)."""
  base: "Weight"
  a: Float[Array, "E K r"]
  b: Float[Array, "E r N"]
  scaling: float

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.base.shape)

  @property
  def ndim(self) -> int:
    return len(self.shape)

  def dense(self, dtype) -> Float[Array, "E K N"]:
    base = _dense(self.base, dtype).astype(jnp.float32)
    update = jnp.einsum("ekr,ern->ekn", self.a.astype(jnp.float32), self.b.astype(jnp.float32))
    return (base + self.scaling * update).astype(dtype)


jax.tree_util.register_dataclass(LoRAWeight, data_fields=["base", "a", "b"],
                                 meta_fields=["scaling"])

# An expert matrix: an array, MXFP4 codes and scales (``jaxattn.ops.mxfp4.MXFP4Array``), or
# either with a factored LoRA update (``LoRAWeight``).
Weight = Float[Array, "E K N"] | MXFP4Array | LoRAWeight


# ---------------------------------------------------------------------------------------------
# Routing
# ---------------------------------------------------------------------------------------------


class Routing(NamedTuple):
  """A router's decision for every token.

  ``weights [*B, k]`` (fp32) multiply the outputs of the experts ``indices [*B, k]``; ``scores
  [*B, E]`` are the unbiased fp32 scores of all experts (the balance losses read them); ``logits
  [*B, E]`` are the router's raw outputs (the z-loss reads them).
  """
  weights: Float[Array, "*B k"]
  indices: Int[Array, "*B k"]
  scores: Float[Array, "*B E"]
  logits: Float[Array, "*B E"]


def check_routing_config(num_experts: int, top_k: int, n_group: int = 1,
                         topk_group: int | None = None) -> None:
  """Raises ``ValueError`` unless ``top_k`` experts fit in ``topk_group`` of ``n_group`` groups."""
  for name, v in (("num_experts", num_experts), ("top_k", top_k), ("n_group", n_group)):
    # bool is an int subclass: True would silently mean 1.
    if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
      raise ValueError(f"`{name}` must be a positive int, got {v!r}.")
  if top_k > num_experts:
    raise ValueError(f"`top_k` ({top_k}) must be <= `num_experts` ({num_experts}).")
  if num_experts % n_group:
    raise ValueError(f"`num_experts` ({num_experts}) must be divisible by `n_group` ({n_group}): "
                     "experts are split into equal groups.")
  topk_group = n_group if topk_group is None else topk_group
  if (not isinstance(topk_group, (int, np.integer)) or isinstance(topk_group, bool)
      or not 1 <= topk_group <= n_group):
    raise ValueError(f"`topk_group` must be an int in [1, n_group={n_group}], got {topk_group!r}.")
  if top_k > topk_group * (num_experts // n_group):
    raise ValueError(f"`top_k` ({top_k}) exceeds the {topk_group * (num_experts // n_group)} experts "
                     f"in the `topk_group`={topk_group} groups of {num_experts // n_group} that a "
                     "token may use.")


def router_scores(logits: Float[Array, "*B E"], score_func: ScoreFunc = "sigmoid"
                  ) -> Float[Array, "*B E"]:
  """Per-expert affinities in fp32: ``sigmoid`` (DeepSeek-V3) or ``softmax`` (V2, Mixtral)."""
  if score_func not in SCORE_FUNCS:
    raise ValueError(f"`score_func` must be one of {SCORE_FUNCS}, got {score_func!r}.")
  logits = logits.astype(jnp.float32)
  return jax.nn.sigmoid(logits) if score_func == "sigmoid" else jax.nn.softmax(logits, axis=-1)


def select_experts(
    scores: Float[Array, "*B E"],
    bias: Float[Array, "E"] | None = None,
    *,
    top_k: int,
    n_group: int = 1,
    topk_group: int | None = None,
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 1.0,
) -> tuple[Float[Array, "*B k"], Int[Array, "*B k"]]:
  """Picks ``top_k`` experts per token by ``scores + bias``; weights them by ``scores`` alone.

  Group-limited routing (``n_group > 1``): the ``E`` experts form ``n_group`` equal groups, a group
  scores the sum of its two largest biased scores (its one score if it has a single expert), and only
  the best ``topk_group`` groups compete.  Returns fp32 ``weights`` and int32 ``indices`` ordered by
  biased score, best first.  The seed's example: scores ``(.2, .8, .5, .4)``, bias ``(0, -.5, 0, 0)``,
  ``top_k=2`` select experts 2 and 3 with weights ``.5/.9 = .56`` and ``.4/.9 = .44``.
  """
  num_experts = scores.shape[-1]
  check_routing_config(num_experts, top_k, n_group, topk_group)
  check_positive("routed_scaling_factor", routed_scaling_factor)
  check_bool("norm_topk_prob", norm_topk_prob)
  topk_group = n_group if topk_group is None else topk_group
  if bias is not None and bias.shape != (num_experts,):
    raise ValueError(f"`bias` must have shape ({num_experts},), got {bias.shape}.")
  scores = scores.astype(jnp.float32)
  choice = scores if bias is None else scores + bias.astype(jnp.float32)
  if topk_group < n_group:
    per_group = num_experts // n_group
    grouped = choice.reshape(*choice.shape[:-1], n_group, per_group)
    group_score = jax.lax.top_k(grouped, min(2, per_group))[0].sum(-1)        # [*B, G]
    _, keep = jax.lax.top_k(group_score, topk_group)                           # [*B, topk_group]
    group_ok = jnp.any(keep[..., :, None] == jnp.arange(n_group), axis=-2)     # [*B, G]
    expert_ok = jnp.repeat(group_ok, per_group, axis=-1)                       # [*B, E]
    choice = jnp.where(expert_ok, choice, -jnp.inf)
  _, indices = jax.lax.top_k(choice, top_k)
  # The bias is used for ranking only: the weights gather the unbiased scores (no gradient to bias).
  weights = jnp.take_along_axis(scores, indices, axis=-1)
  if norm_topk_prob:
    # 1e-20 as DeepSeek / transformers: sigmoid scores are positive, this only guards underflow.
    weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
  return weights * routed_scaling_factor, indices.astype(jnp.int32)


def route(
    logits: Float[Array, "*B E"],
    bias: Float[Array, "E"] | None = None,
    *,
    top_k: int,
    score_func: ScoreFunc = "sigmoid",
    n_group: int = 1,
    topk_group: int | None = None,
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 1.0,
) -> Routing:
  """``select_experts(router_scores(logits), bias, ...)``, keeping scores and logits for losses."""
  scores = router_scores(logits, score_func)
  weights, indices = select_experts(scores, bias, top_k=top_k, n_group=n_group,
                                    topk_group=topk_group, norm_topk_prob=norm_topk_prob,
                                    routed_scaling_factor=routed_scaling_factor)
  return Routing(weights, indices, scores, logits.astype(jnp.float32))


# ---------------------------------------------------------------------------------------------
# Balancing
# ---------------------------------------------------------------------------------------------


def _token_weights(shape, token_mask):
  if token_mask is None:
    return jnp.ones(shape, jnp.float32)
  if token_mask.shape != tuple(shape):
    raise ValueError(f"`token_mask` must have the tokens' shape {tuple(shape)}, got "
                     f"{token_mask.shape}.")
  if token_mask.dtype != jnp.bool_:   # segment ids as a mask would weight tokens by their id
    raise ValueError(f"`token_mask` must be a bool array (False: padding), got dtype "
                     f"{token_mask.dtype}; for segment ids pass `segment_ids > 0`.")
  return token_mask.astype(jnp.float32)


def expert_load(indices: Int[Array, "*B k"], num_experts: int,
                token_mask: Bool[Array, "*B"] | None = None) -> Float[Array, "E"]:
  """Assignments per expert (fp32 counts; tokens where ``token_mask`` is False do not count)."""
  w = _token_weights(indices.shape[:-1], token_mask)
  hot = jax.nn.one_hot(indices, num_experts, dtype=jnp.float32)               # [*B, k, E]
  return jnp.einsum("...ke,...->e", hot, w)


def load_imbalance(load: Float[Array, "E"]) -> Float[Array, ""]:
  """``max(load) / mean(load)``: 1 when balanced, ``E / k`` when all tokens pick the same experts."""
  return jnp.max(load) / jnp.maximum(jnp.mean(load), 1e-9)


def bias_update(bias: Float[Array, "E"], load: Float[Array, "E"], *, rate: float
                ) -> Float[Array, "E"]:
  """Auxiliary-loss-free balancing: ``b_i += rate * sign(mean(load) - load_i)``.

  An overloaded expert's bias falls, an underloaded one's rises (DeepSeek-V3: ``rate`` = 0.001 for
  most of training).  Apply it in the training step after each batch, outside the gradient.
  """
  if load.shape != bias.shape:
    raise ValueError(f"`load` {load.shape} must have the shape of `bias` {bias.shape} ([E]).")
  check_nonnegative("rate", rate)   # negative: overloaded experts would gain
  load = load.astype(jnp.float32)
  return (bias.astype(jnp.float32) + rate * jnp.sign(jnp.mean(load) - load)).astype(bias.dtype)


def check_segment_ids(segment_ids, b: int, t: int) -> None:
  """``segment_ids``: ``[B, T]`` integers (packed rows; 0 = padding)."""
  if segment_ids.shape != (b, t):
    raise ValueError(f"`segment_ids` must be [B, T] = {(b, t)}, got {segment_ids.shape}.")
  check_int_array("segment_ids", segment_ids)


def _segment_ranks(segment_ids: Int[Array, "B T"]) -> Int[Array, "B T"]:
  """Each token's segment as a rank in ``[0, T)`` among its row's distinct ids (any int ids)."""
  srt = jnp.sort(segment_ids, axis=-1)
  first = jax.vmap(jnp.searchsorted)(srt, segment_ids)              # first index of the id
  new = jnp.concatenate([jnp.zeros_like(srt[:, :1]), (srt[:, 1:] != srt[:, :-1]).astype(srt.dtype)],
                        axis=-1)
  return jnp.take_along_axis(jnp.cumsum(new, axis=-1), first, axis=-1)


def sequence_balance_loss(scores: Float[Array, "B T E"], indices: Int[Array, "B T k"],
                          token_mask: Bool[Array, "B T"] | None = None,
                          segment_ids: Int[Array, "B T"] | None = None) -> Float[Array, ""]:
  """DeepSeek-V3's sequence-wise balance loss without its ``alpha`` (eqs. 17-20), mean over the
  sequences of the batch.

  Per sequence of ``T`` tokens: ``f_i = E / (k T) * #{t : i selected for t}``, ``P_i = (1/T)
  sum_t s_it / sum_j s_jt`` and the loss is ``sum_i f_i P_i`` (1 when balanced, up to ``E / k``).
  A sequence is a row, or with ``segment_ids [B, T]`` (packed rows; 0 = padding, left out) each
  segment of a row: a row packing two sequences that each use one expert is balanced as a row,
  not as two sequences.
  """
  if scores.ndim != 3 or indices.ndim != 3 or indices.shape[:2] != scores.shape[:2]:
    raise ValueError(f"`scores` [B, T, E] and `indices` [B, T, k] must agree, got {scores.shape} "
                     f"and {indices.shape}.")
  num_experts, k = scores.shape[-1], indices.shape[-1]
  b, t = scores.shape[:2]
  w = _token_weights(scores.shape[:2], token_mask)                             # [B, T]
  hot = jax.nn.one_hot(indices, num_experts, dtype=jnp.float32).sum(-2)       # [B, T, E]
  s = scores.astype(jnp.float32)
  s = s / jnp.maximum(s.sum(-1, keepdims=True), 1e-20)
  if segment_ids is None:
    n_tok = jnp.maximum(w.sum(-1), 1.0)                                        # [B]
    f = num_experts / k * jnp.einsum("bte,bt->be", hot, w) / n_tok[:, None]
    p = jnp.einsum("bte,bt->be", s, w) / n_tok[:, None]
    return jnp.mean(jnp.sum(f * p, -1))
  check_segment_ids(segment_ids, b, t)
  w = w * (segment_ids > 0)
  seq = (jnp.arange(b)[:, None] * t + _segment_ranks(segment_ids)).reshape(-1)  # [B*T] ids
  sums = lambda v: jax.ops.segment_sum(v.reshape(b * t, -1), seq, num_segments=b * t)  # noqa: E731
  n_tok = sums(w)[:, 0]                                                        # [B*T]
  f = num_experts / k * sums(hot * w[..., None]) / jnp.maximum(n_tok, 1.0)[:, None]
  p = sums(s * w[..., None]) / jnp.maximum(n_tok, 1.0)[:, None]
  real = n_tok > 0
  return jnp.sum(jnp.where(real, jnp.sum(f * p, -1), 0.0)) / jnp.maximum(real.sum(), 1)


def switch_aux_loss(probs: Float[Array, "*B E"], indices: Int[Array, "*B k"],
                    token_mask: Bool[Array, "*B"] | None = None) -> Float[Array, ""]:
  """Switch Transformer / GShard balance loss ``E * sum_i f_i P_i`` over all tokens of the batch.

  ``f_i`` is the fraction of tokens that selected expert ``i`` (summing to ``k``), ``P_i`` the mean
  router probability of ``i``: the convention of transformers' ``load_balancing_loss_func``, so a
  balanced router gives ``k`` (1 for Switch's top-1).
  """
  num_experts = probs.shape[-1]
  w = _token_weights(probs.shape[:-1], token_mask)
  n_tok = jnp.maximum(w.sum(), 1.0)
  f = expert_load(indices, num_experts, token_mask) / n_tok
  p = jnp.einsum("...e,...->e", probs.astype(jnp.float32), w) / n_tok
  return num_experts * jnp.sum(f * p)


def router_z_loss(logits: Float[Array, "*B E"], token_mask: Bool[Array, "*B"] | None = None
                  ) -> Float[Array, ""]:
  """ST-MoE's router z-loss: the token mean of ``logsumexp(logits)^2`` (keeps logits small)."""
  w = _token_weights(logits.shape[:-1], token_mask)
  z = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
  return jnp.sum(z ** 2 * w) / jnp.maximum(w.sum(), 1.0)


# ---------------------------------------------------------------------------------------------
# Grouped matmul: rows sorted by group, one weight matrix per group
# ---------------------------------------------------------------------------------------------


def sort_by_expert(indices: Int[Array, "M k"], num_experts: int
                   ) -> tuple[Int[Array, "A"], Int[Array, "E"]]:
  """``order [A]`` (assignment ids ``m * k + j`` sorted by expert, stable) and ``group_sizes [E]``.

  Row ``i`` of the sorted buffer is token ``order[i] // k``; expert ``e`` owns rows
  ``sum(group_sizes[:e]) .. sum(group_sizes[:e + 1])``.  An index outside ``[0, E)`` (a ``-1``
  "no expert" mark) sorts last and belongs to no group: its assignment is dropped, as in
  ``dense_experts`` (``bincount`` would have counted a negative one for expert 0).
  """
  flat = _no_expert_last(indices.reshape(-1), num_experts)
  order = jnp.argsort(flat, stable=True).astype(jnp.int32)
  return order, jnp.bincount(flat, length=num_experts).astype(jnp.int32)


def _no_expert_last(flat, num_experts: int):
  """Indices outside ``[0, E)`` become ``E``: past every expert's group (dropped)."""
  return jnp.where((flat >= 0) & (flat < num_experts), flat, num_experts)


def _auto_implementation(mxfp4: bool = False) -> str:
  # XLA:TPU lowers ragged_dot natively.  XLA:CPU (measured, jax 0.10) expands it into one masked
  # matmul over ALL groups, slower than running every expert densely; the blocked loop does
  # only the selected work, so it is the default everywhere else.  MXFP4 weights on a TPU go to
  # the Pallas kernels, which read them packed (4.5 bits a weight, where dequantizing them whole
  # for ragged_dot reads them, writes bf16 and reads that): one gpt-oss-20b layer's experts over
  # 2048 tokens (forward and input gradient) compile to 1.0 GiB of temporaries against 2.8 GiB
  # (v6e; experiments/tpu_compile_check.py).
  if jax.default_backend() == "tpu":
    return "pallas_tpu" if mxfp4 else "ragged_dot"
  return "blocked"


def _check_implementation(implementation, *weights):
  if implementation is None:
    return _auto_implementation(any(isinstance(getattr(w, "base", w), MXFP4Array)
                                    for w in weights))
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"`implementation` must be None or one of {IMPLEMENTATIONS}, got "
                     f"{implementation!r}.")
  return implementation


def _dense(w: Weight, dtype) -> Float[Array, "E K N"]:
  """An expert matrix as an array: MXFP4 is dequantized (to ``dtype``), a LoRA update added, an
  array kept."""
  if isinstance(w, LoRAWeight):
    return w.dense(dtype)
  return w.dequantize(dtype) if isinstance(w, MXFP4Array) else w


def _with_lora(mm, x, w: LoRAWeight, *args, mm_factors=None):
  """``mm(x, base) + scaling * mm_factors(mm_factors(x, a), b)``, the sum in fp32."""
  mm_factors = mm_factors or mm
  low = mm_factors(x, w.a.astype(x.dtype), *args)
  up = mm_factors(low, w.b.astype(x.dtype), *args)
  return (mm(x, w.base, *args).astype(jnp.float32)
          + w.scaling * up.astype(jnp.float32)).astype(x.dtype)


def _block_matmul_fn(impl: str, dtype):
  """``(xb, w, layout) -> yb`` for the blocked layout: the XLA loop or the Pallas kernels (TPU or
  GPU; they read MXFP4 weights packed).  A ``LoRAWeight`` runs as ``x W + scaling (x A) B``."""
  def loop(xb, w, layout):
    if isinstance(w, LoRAWeight):
      return _with_lora(loop, xb, w, layout)
    return block_matmul(xb, _dense(w, dtype), layout.block_group, layout.num_used)

  if impl in ("pallas_tpu", "pallas_gpu"):
    from pallas_kernels.grouped_matmul import gpu, tpu  # noqa: PLC0415
    kernels = tpu if impl == "pallas_tpu" else gpu
    dense, mxfp4 = ((tpu.block_matmul_tpu, tpu.block_matmul_mxfp4_tpu) if impl == "pallas_tpu"
                    else (gpu.block_matmul_gpu, gpu.block_matmul_mxfp4_gpu))

    def run(xb, w, layout):
      if isinstance(w, LoRAWeight):
        # the rank-r factors: through the XLA loop where Triton's 16-wide tiles do not fit them
        tiny = impl == "pallas_gpu" and w.a.shape[-1] % 16
        return _with_lora(run, xb, w, layout, mm_factors=loop if tiny else None)
      if impl == "pallas_gpu":
        gpu.check_block_size(layout.block_size)
      if isinstance(w, MXFP4Array):
        return mxfp4(xb, *kernels.mxfp4_kernel_operands(w.codes, w.scales), layout.block_group,
                     layout.num_used)
      return dense(xb, w.astype(xb.dtype), layout.block_group, layout.num_used)
    return run
  return loop


def default_block_size(num_rows: int, num_groups: int) -> int:
  """Rows per block of the blocked layout: the average group size as a power of two in [8, 256]."""
  avg = max(1, -(-num_rows // max(num_groups, 1)))
  return int(min(256, max(8, 1 << (avg - 1).bit_length())))


class BlockLayout(NamedTuple):
  """Where each sorted row lives when every group is padded to whole blocks of ``block_size`` rows.

  ``position [M]``: row index in the padded buffer (``num_blocks * block_size`` for rows past
  ``sum(group_sizes)``, which belong to no group); ``block_group [num_blocks]``: the group of each
  block; ``num_used``: blocks that hold rows (the rest are zero padding at the end).
  """
  position: Int[Array, "M"]
  block_group: Int[Array, "NB"]
  num_used: Int[Array, ""]
  num_blocks: int
  block_size: int


def block_layout(group_sizes: Int[Array, "E"], num_rows: int, block_size: int) -> BlockLayout:
  """The padded block layout of ``num_rows`` sorted rows (static size ``ceil(M / bm) + E`` blocks)."""
  num_groups = group_sizes.shape[0]
  if not isinstance(block_size, (int, np.integer)) or block_size < 1:
    raise ValueError(f"`block_size` must be a positive int, got {block_size!r}.")
  bm = int(block_size)
  # Each group wastes < 1 block of padding, so ceil(M / bm) + E blocks always suffice.
  num_blocks = -(-num_rows // bm) + num_groups
  gs = group_sizes.astype(jnp.int32)
  ends = jnp.cumsum(gs)
  starts = ends - gs
  nblk = (gs + bm - 1) // bm
  blk_end = jnp.cumsum(nblk)
  blk_start = blk_end - nblk
  row = jnp.arange(num_rows, dtype=jnp.int32)
  gid = jnp.searchsorted(ends, row, side="right").astype(jnp.int32)            # E past the end
  gidc = jnp.minimum(gid, num_groups - 1)
  position = jnp.where(gid < num_groups, blk_start[gidc] * bm + row - starts[gidc], num_blocks * bm)
  block_group = jnp.searchsorted(blk_end, jnp.arange(num_blocks, dtype=jnp.int32), side="right")
  block_group = jnp.minimum(block_group, num_groups - 1).astype(jnp.int32)
  return BlockLayout(position.astype(jnp.int32), block_group, blk_end[-1], num_blocks, bm)


def _block_matmul_loop(xb, w, block_group, num_used, transpose_w: bool = False):
  """``y[b] = xb[b] @ w[block_group[b]]`` (``@ w[g]^T`` with ``transpose_w``: each block's matrix
  read transposed, never a transposed copy of ``w``) for ``b < num_used``, zeros after; fp32
  accumulation."""
  nb, bm, _ = xb.shape

  def body(b, y):
    wb = jax.lax.dynamic_index_in_dim(w, block_group[b], keepdims=False)
    xw = jnp.dot(jax.lax.dynamic_index_in_dim(xb, b, keepdims=False),
                 wb.T if transpose_w else wb, preferred_element_type=jnp.float32)
    return jax.lax.dynamic_update_index_in_dim(y, xw.astype(y.dtype), b, 0)

  n = w.shape[1] if transpose_w else w.shape[2]
  return jax.lax.fori_loop(0, num_used, body, jnp.zeros((nb, bm, n), xb.dtype))


@jax.custom_vjp
def block_matmul(xb: Float[Array, "NB bm D"], w: Float[Array, "E D F"], block_group: Int[Array, "NB"],
                 num_used: Int[Array, ""]) -> Float[Array, "NB bm F"]:
  """Each block of rows times its group's matrix, looping over the used blocks only.

  A ``custom_vjp`` because the loop has a data-dependent trip count: the backward pass is the same
  loop with ``w`` transposed for ``dxb`` and a per-block ``xb^T dy`` accumulated into ``dw``.
  Reverse mode only: ``jax.jvp`` / ``jax.jacfwd`` through it raise (use
  ``implementation="dense"`` for forward-mode derivatives).
  """
  return _block_matmul_loop(xb, w, block_group, num_used)


def _block_matmul_fwd(xb, w, block_group, num_used):
  return _block_matmul_loop(xb, w, block_group, num_used), (xb, w, block_group, num_used)


def _block_matmul_bwd(res, dy):
  # Both cotangents: under jit XLA drops the one nobody reads (a frozen matrix's dW).
  # (``symbolic_zeros`` would skip it at trace time, but custom_vjp with symbolic zeros cannot
  # run in an eager shard_map, where the expert-parallel dispatch calls this.)
  xb, w, block_group, num_used = res
  # (dy has the output's dtype: xb's)
  dxb = _block_matmul_loop(dy, w, block_group, num_used, transpose_w=True)

  def body(b, dw):
    g = jnp.dot(jax.lax.dynamic_index_in_dim(xb, b, keepdims=False).T,
                jax.lax.dynamic_index_in_dim(dy, b, keepdims=False),
                preferred_element_type=jnp.float32)
    e = block_group[b]
    return jax.lax.dynamic_update_index_in_dim(
        dw, jax.lax.dynamic_index_in_dim(dw, e, keepdims=False) + g, e, 0)

  dw = jax.lax.fori_loop(0, num_used, body, jnp.zeros(w.shape, jnp.float32))
  return dxb, dw.astype(w.dtype), None, None


block_matmul.defvjp(_block_matmul_fwd, _block_matmul_bwd)


def _layout(group_sizes, num_rows, block_size, impl="blocked"):
  if block_size is None:
    block_size = default_block_size(num_rows, group_sizes.shape[0])
    if impl == "pallas_gpu":   # a Triton dot tile has at least 16 rows
      block_size = max(block_size, 16)
  return block_layout(group_sizes, num_rows, block_size)


def _pad(x, layout: BlockLayout):
  rows = layout.num_blocks * layout.block_size
  xp = jnp.zeros((rows, x.shape[-1]), x.dtype).at[layout.position].set(x, mode="drop")
  return xp.reshape(layout.num_blocks, layout.block_size, x.shape[-1])


def _unpad(yb, layout: BlockLayout):
  y = yb.reshape(-1, yb.shape[-1])
  return y.at[layout.position].get(mode="fill", fill_value=0)


def _dense_group_matmul(x, w, group_sizes):
  # Reference: every row times every group's matrix, then keep its own group's product.
  ends = jnp.cumsum(group_sizes)
  gid = jnp.searchsorted(ends, jnp.arange(x.shape[0]), side="right")
  all_y = jnp.einsum("md,gdf->mgf", x, w, preferred_element_type=jnp.float32)
  hot = jax.nn.one_hot(gid, w.shape[0], dtype=jnp.float32)                     # 0 past the end
  return jnp.einsum("mgf,mg->mf", all_y, hot).astype(x.dtype)


def grouped_matmul(
    x: Float[Array, "M D"],
    w: Weight,
    group_sizes: Int[Array, "E"],
    *,
    implementation: Implementation | None = None,
    block_size: int | None = None,
) -> Float[Array, "M F"]:
  """``y[i] = x[i] @ w[g(i)]`` where rows are sorted by group ``g``; rows past ``sum(group_sizes)``
  give zeros.

  ``implementation``: ``"ragged_dot"`` (``jax.lax.ragged_dot``), ``"blocked"`` (groups padded to
  blocks of ``block_size`` rows and a loop over the used blocks), ``"pallas_tpu"`` /
  ``"pallas_gpu"`` (the same layout through the Pallas kernels of
  ``pallas_kernels.grouped_matmul``, Mosaic TPU / Triton; interpreted off their device; the GPU
  one takes powers of two >= 16 for ``block_size`` and multiples of 16 for ``D`` and ``F``),
  ``"dense"`` (every row through every group's matrix, then masked: the reference), or
  ``None`` (on a TPU: ragged_dot, or the Pallas kernels for MXFP4 weights; elsewhere blocked).

  ``w`` may be an ``MXFP4Array`` (frozen MXFP4 weights): the Pallas kernels read it packed and
  dequantize tile by tile; the other implementations dequantize it whole first.
  """
  impl = _check_implementation(implementation, w)
  _check_grouped(x, w, group_sizes)
  if impl in _BLOCKED:
    layout = _layout(group_sizes, x.shape[0], block_size, impl)
    return _unpad(_block_matmul_fn(impl, x.dtype)(_pad(x, layout), w, layout), layout)
  if impl == "ragged_dot":
    def ragged(x, w, group_sizes):
      if isinstance(w, LoRAWeight):
        return _with_lora(ragged, x, w, group_sizes)
      return jax.lax.ragged_dot(x, _dense(w, x.dtype), group_sizes,
                                preferred_element_type=jnp.float32).astype(x.dtype)
    return ragged(x, w, group_sizes)
  return _dense_group_matmul(x, _dense(w, x.dtype), group_sizes)


def _check_grouped(x, w, group_sizes):
  if x.ndim != 2 or len(w.shape) != 3 or x.shape[1] != w.shape[1]:
    raise ValueError(f"`x` [M, D] and `w` [E, D, F] must agree on D, got {x.shape} and "
                     f"{tuple(w.shape)}.")
  if group_sizes.shape != (w.shape[0],):
    raise ValueError(f"`group_sizes` must have shape ({w.shape[0]},), got {group_sizes.shape}.")


@dataclasses.dataclass(frozen=True)
class ClampedSwiGLU:
  """gpt-oss's expert activation: ``(clip(u, -limit, limit) + 1) * g' sigmoid(alpha g')`` with
  ``g' = min(g, limit)``."""
  alpha: float = 1.702
  limit: float = 7.0


def check_activation(activation) -> None:
  if activation is not None and not isinstance(activation, ClampedSwiGLU):
    raise ValueError(f"`activation` must be None (SwiGLU) or a ClampedSwiGLU, got {activation!r}.")


def _swiglu(g, u, dtype, activation: ClampedSwiGLU | None = None, bias=None):
  # The gate nonlinearity in fp32, as every gate in the package.  Zero rows stay zero (without
  # biases; with them the callers mask or discard the rows that belong to no expert).
  g, u = g.astype(jnp.float32), u.astype(jnp.float32)
  if bias is not None:            # (b_gate, b_up), broadcast to g's shape
    g, u = g + bias[0], u + bias[1]
  if activation is None:
    return (jax.nn.silu(g) * u).astype(dtype)
  g = jnp.minimum(g, activation.limit)
  u = jnp.clip(u, -activation.limit, activation.limit)
  return ((u + 1.0) * g * jax.nn.sigmoid(activation.alpha * g)).astype(dtype)


def _per_expert(gate_up_bias):
  """``(b_gate, b_up)`` ``[E, F]`` broadcast over an ``[E, rows, F]`` layout (fp32), or None."""
  return None if gate_up_bias is None else tuple(
      b.astype(jnp.float32)[:, None, :] for b in gate_up_bias)


def _check_gate_up_bias(gate_up_bias, w_gate) -> None:
  e, f = w_gate.shape[0], w_gate.shape[2]
  if gate_up_bias is not None and (len(gate_up_bias) != 2 or any(
      jnp.shape(b) != (e, f) for b in gate_up_bias)):
    raise ValueError(f"`gate_up_bias` must be two [E, F] = [{e}, {f}] arrays, got "
                     f"{[jnp.shape(b) for b in gate_up_bias]}.")


def grouped_swiglu(
    x: Float[Array, "M D"],
    group_sizes: Int[Array, "E"],
    w_gate: Weight,
    w_up: Weight,
    w_down: Weight,
    *,
    implementation: Implementation | None = None,
    block_size: int | None = None,
    activation: ClampedSwiGLU | None = None,
    gate_up_bias: tuple[Float[Array, "E F"], Float[Array, "E F"]] | None = None,
) -> Float[Array, "M D"]:
  """Each row through its group's SwiGLU ``(silu(x W_g) * x W_u) W_d``; rows past the groups: 0.

  The blocked path pads once and runs all three matmuls in the padded layout.  ``activation``:
  None (SwiGLU) or ``ClampedSwiGLU`` (gpt-oss).  ``gate_up_bias``: ``(b_gate, b_up)`` ``[E, F]``
  added to each row's ``x W_g`` / ``x W_u`` by its group (gpt-oss).  Weights may be
  ``MXFP4Array``s, as ``grouped_matmul``'s.
  """
  impl = _check_implementation(implementation, w_gate, w_up, w_down)
  _check_grouped(x, w_gate, group_sizes)
  if w_up.shape != w_gate.shape or w_down.shape != (w_gate.shape[0], w_gate.shape[2], x.shape[1]):
    raise ValueError(f"expert weights disagree: w_gate {w_gate.shape}, w_up {w_up.shape}, "
                     f"w_down {w_down.shape} (want [E, D, F], [E, D, F], [E, F, D]).")
  num_groups = w_gate.shape[0]
  _check_gate_up_bias(gate_up_bias, w_gate)
  if impl not in _BLOCKED:
    mm = partial(grouped_matmul, group_sizes=group_sizes, implementation=impl)
    bias = None
    if gate_up_bias is not None:  # each row's group; rows past the groups get none
      gid = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(x.shape[0]), side="right")
      inside = (gid < num_groups)[:, None]
      bias = tuple(jnp.where(inside, b.astype(jnp.float32)[jnp.minimum(gid, num_groups - 1)],
                             0.0) for b in gate_up_bias)
    return mm(_swiglu(mm(x, w_gate), mm(x, w_up), x.dtype, activation, bias), w_down)
  layout = _layout(group_sizes, x.shape[0], block_size, impl)
  xb = _pad(x, layout)
  run = _block_matmul_fn(impl, x.dtype)
  mm = lambda a, w: run(a, w, layout)
  # (with biases a padding row's h is not 0; its output row is never read back)
  bias = None if gate_up_bias is None else tuple(
      b.astype(jnp.float32)[layout.block_group][:, None, :] for b in gate_up_bias)
  h = _swiglu(mm(xb, w_gate), mm(xb, w_up), x.dtype, activation, bias)
  return _unpad(mm(h, w_down), layout)


# ---------------------------------------------------------------------------------------------
# Routed experts: dispatch, compute, combine
# ---------------------------------------------------------------------------------------------


def _check_dispatch(x, indices, weights, w_gate):
  if x.ndim != 2 or indices.ndim != 2 or weights.shape != indices.shape or \
      indices.shape[0] != x.shape[0]:
    raise ValueError(f"want `x` [M, D], `indices` and `weights` [M, k]; got {x.shape}, "
                     f"{indices.shape}, {weights.shape}.")
  if len(w_gate.shape) != 3 or w_gate.shape[1] != x.shape[1]:
    raise ValueError(f"`w_gate` must be [E, D={x.shape[1]}, F], got {tuple(w_gate.shape)}.")
  check_int_array("indices", indices)


def _combine(y_assign, weights, dtype):
  """``sum_j weights[m, j] * y_assign[m, j]`` in fp32."""
  return jnp.einsum("mkd,mk->md", y_assign.astype(jnp.float32),
                    weights.astype(jnp.float32)).astype(dtype)


def expert_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
  """Slots per expert: ``ceil(capacity_factor * num_tokens * top_k / num_experts)``."""
  check_positive("capacity_factor", capacity_factor)
  return max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


def routed_experts(
    x: Float[Array, "M D"],
    indices: Int[Array, "M k"],
    weights: Float[Array, "M k"],
    w_gate: Weight,
    w_up: Weight,
    w_down: Weight,
    *,
    capacity_factor: float | None = None,
    implementation: Implementation | None = None,
    block_size: int | None = None,
    activation: ClampedSwiGLU | None = None,
    gate_up_bias: tuple[Float[Array, "E F"], Float[Array, "E F"]] | None = None,
) -> tuple[Float[Array, "M D"], Int[Array, ""]]:
  """``y[m] = sum_j weights[m, j] * SwiGLU_{indices[m, j]}(x[m])``, and the dropped assignments.

  Dropless (``capacity_factor=None``): assignments sorted by expert, one grouped SwiGLU
  (``grouped_swiglu``, ``implementation`` and ``block_size`` as there); nothing is dropped.

  Capacity mode: each expert has ``C = expert_capacity(M, E, k, capacity_factor)`` slots in an
  ``[E, C, D]`` buffer (GShard).  First choices claim slots before second choices, and within a
  choice rank earlier tokens first; assignments that find their expert full are dropped (they add
  nothing: the token keeps only its other experts and the residual).  The buffer carries the
  ``expert`` logical axis, so under a mesh XLA splits it over experts and inserts the all-to-all.

  An index outside ``[0, E)`` (e.g. ``-1`` for "no expert") adds nothing, on every path (as in
  ``dense_experts``); it is not counted as dropped.  ``activation`` and ``gate_up_bias`` as
  ``grouped_swiglu``'s; so are the weights (arrays or ``MXFP4Array``s; the capacity path
  dequantizes MXFP4).
  """
  _check_dispatch(x, indices, weights, w_gate)
  check_activation(activation)
  _check_gate_up_bias(gate_up_bias, w_gate)
  m, k = indices.shape
  num_experts = w_gate.shape[0]
  if capacity_factor is None:
    order, group_sizes = sort_by_expert(indices, num_experts)
    ys = grouped_swiglu(x[order // k], group_sizes, w_gate, w_up, w_down,
                        implementation=implementation, block_size=block_size,
                        activation=activation, gate_up_bias=gate_up_bias)
    y_assign = jnp.zeros_like(ys).at[order].set(ys)
    return (_combine(y_assign.reshape(m, k, ys.shape[-1]), weights, x.dtype),
            jnp.zeros((), jnp.int32))

  cap = expert_capacity(m, num_experts, k, capacity_factor)
  w_gate, w_up, w_down = (_dense(w, x.dtype) for w in (w_gate, w_up, w_down))
  # Choice-major flattening (all first choices, then all second ...) gives first choices priority.
  flat = _no_expert_last(indices.T.reshape(-1), num_experts)                  # [k * M]
  order = jnp.argsort(flat, stable=True)
  expert = flat[order]
  group_sizes = jnp.bincount(flat, length=num_experts)
  starts = jnp.cumsum(group_sizes) - group_sizes
  slot = jnp.arange(m * k) - starts[expert]                                    # rank in its expert
  token = order % m
  buf = jnp.zeros((num_experts, cap, x.shape[1]), x.dtype)
  buf = buf.at[expert, slot].set(x[token], mode="drop")                        # slot >= C: dropped
  buf = shard(buf, ("expert", None, "act_embed"))
  mm = lambda a, w: jnp.einsum("ecd,edf->ecf", a, w, preferred_element_type=jnp.float32)
  h = _swiglu(mm(buf, w_gate), mm(buf, w_up), x.dtype, activation,
              _per_expert(gate_up_bias))   # (with biases, empty slots: never read back)
  out = mm(h, w_down).astype(x.dtype)
  out = shard(out, ("expert", None, "act_embed"))
  ys = out.at[expert, slot].get(mode="fill", fill_value=0)                     # [k * M, D]
  y_assign = (jnp.zeros_like(ys).at[order].set(ys).reshape(k, m, ys.shape[-1])
              .transpose(1, 0, 2))
  dropped = jnp.sum(jnp.maximum(group_sizes - cap, 0)).astype(jnp.int32)
  return _combine(y_assign, weights, x.dtype), dropped


def dense_experts(
    x: Float[Array, "M D"],
    indices: Int[Array, "M k"],
    weights: Float[Array, "M k"],
    w_gate: Weight,
    w_up: Weight,
    w_down: Weight,
    *,
    activation: ClampedSwiGLU | None = None,
    gate_up_bias: tuple[Float[Array, "E F"], Float[Array, "E F"]] | None = None,
) -> Float[Array, "M D"]:
  """The reference: EVERY expert runs on every token, and a ``[M, E]`` gate matrix (the routing
  weights at the selected experts, 0 elsewhere) masks and combines them.  ``E / k`` times the work
  of the dispatched paths."""
  _check_dispatch(x, indices, weights, w_gate)
  check_activation(activation)
  _check_gate_up_bias(gate_up_bias, w_gate)
  w_gate, w_up, w_down = (_dense(w, x.dtype) for w in (w_gate, w_up, w_down))
  num_experts = w_gate.shape[0]
  gates = jnp.einsum("mke,mk->me", jax.nn.one_hot(indices, num_experts, dtype=jnp.float32),
                     weights.astype(jnp.float32))
  mm = lambda eq, a, w: jnp.einsum(eq, a, w, preferred_element_type=jnp.float32)
  h = _swiglu(mm("md,edf->emf", x, w_gate), mm("md,edf->emf", x, w_up), x.dtype, activation,
              _per_expert(gate_up_bias))
  y = mm("emf,efd->emd", h, w_down)
  return jnp.einsum("emd,me->md", y, gates).astype(x.dtype)


# ---------------------------------------------------------------------------------------------
# Expert parallelism
# ---------------------------------------------------------------------------------------------


def _mesh_or_context(mesh):
  if mesh is not None:
    return mesh
  abstract = jax.sharding.get_abstract_mesh()
  if abstract is None or abstract.empty:
    raise ValueError("`mesh` is None and no mesh is set (use `jax.set_mesh(mesh)` or pass `mesh`).")
  return abstract


def _whole_rows(a, mesh):
  """``a`` with its row axis unsplit, so that it can be padded or sliced to a size the shards do
  not divide: Explicit axes refuse that on a split axis (Auto axes leave it to XLA)."""
  return constrain(a, mesh, P()) if is_explicit(mesh) else a


def routed_experts_sharded(
    x: Float[Array, "M D"],
    indices: Int[Array, "M k"],
    weights: Float[Array, "M k"],
    w_gate: Weight,
    w_up: Weight,
    w_down: Weight,
    *,
    mesh=None,
    expert_axis: str | None = "expert",
    token_axes: Sequence[str] = ("data", "fsdp", "expert"),
    implementation: Implementation | None = None,
    block_size: int | None = None,
    activation: ClampedSwiGLU | None = None,
    gate_up_bias: tuple[Float[Array, "E F"], Float[Array, "E F"]] | None = None,
) -> Float[Array, "M D"]:
  """``routed_experts`` (dropless) with the experts split over ``expert_axis`` of ``mesh``.

  Inside ``jax.shard_map`` each device holds ``E / P`` experts and ``M / (tokens' mesh size)``
  tokens (split over the ``token_axes`` present in the mesh).  A device sorts its assignments by
  expert, sends each to the device that owns its expert with ``all_to_all``, runs a grouped SwiGLU
  over what it received, and an ``all_to_all`` brings the results home to be weighted and summed.

  The exchange buffers hold ``P * A_local`` rows, the worst case of every local assignment wanting
  one device: dropless by construction, at ``P`` times the average traffic.  (XLA:CPU does not
  implement ``jax.lax.ragged_all_to_all``, which would send only the real rows.)  ``mesh=None``
  uses the mesh set with ``jax.set_mesh``.

  ``expert_axis=None``: no exchange -- every device runs all the experts (their weights gathered
  whole, as FSDP does) on its own tokens, sorted locally.  That is how the Pallas kernels run
  under a data-parallel mesh: each device's kernel call in ``shard_map`` over its shard, where a
  global sort would leave XLA to gather every token to every device around the kernel.

  Any ``M`` works: when it does not divide over the token shards (a decode step, an odd prompt),
  zero rows of weight 0 are appended up to the next multiple and cut from the output.  They add
  nothing to any output or gradient; they are not routing decisions, so no load statistic sees
  them.
  """
  _check_dispatch(x, indices, weights, w_gate)
  check_activation(activation)
  _check_gate_up_bias(gate_up_bias, w_gate)
  # An index outside [0, E) is dropped, as in routed_experts: here it becomes a zero-weight
  # assignment to expert 0 (no value, and no gradient to its weight).
  valid = (indices >= 0) & (indices < w_gate.shape[0])
  indices, weights = jnp.where(valid, indices, 0), jnp.where(valid, weights, 0)
  mesh = _mesh_or_context(mesh)
  sizes = dict(mesh.shape)
  if expert_axis is not None and expert_axis not in sizes:
    raise ValueError(f"`expert_axis` {expert_axis!r} is not a mesh axis; mesh axes: {tuple(sizes)}.")
  n_dev = 1 if expert_axis is None else sizes[expert_axis]
  num_experts = w_gate.shape[0]
  if num_experts % n_dev:
    raise ValueError(f"`num_experts` ({num_experts}) must be divisible by the {expert_axis!r} mesh "
                     f"axis size ({n_dev}).")
  tok_axes = tuple(a for a in token_axes if a in sizes and sizes[a] > 1)
  if expert_axis is not None and expert_axis not in tok_axes and n_dev > 1:
    tok_axes = tok_axes + (expert_axis,)
  n_tok_shards = int(np.prod([sizes[a] for a in tok_axes])) if tok_axes else 1
  num_tokens = x.shape[0]
  pad = -num_tokens % n_tok_shards
  if pad:
    # shard_map needs equal shards.  A padding row has input 0 and weight 0 (expert 0, any valid
    # index): its expert output is multiplied by 0 and its input gives the expert weights a zero
    # gradient, so real rows' values and all gradients are those of the unpadded call.
    rows = ((0, pad), (0, 0))
    x, indices, weights = (jnp.pad(_whole_rows(a, mesh), rows) for a in (x, indices, weights))
  local_experts = num_experts // n_dev
  k = indices.shape[1]
  tok_spec = P(tok_axes if tok_axes else None, None)

  def exchange(a):
    return a if n_dev == 1 else jax.lax.all_to_all(a, expert_axis, 0, 0, tiled=True)

  def local(x, indices, weights, w_gate, w_up, w_down, *biases):
    m_loc = x.shape[0]
    a_loc = m_loc * k
    order, _ = sort_by_expert(indices, num_experts)
    expert = indices.reshape(-1)[order]                                        # [A_loc] sorted
    dest = expert // local_experts
    send_counts = jnp.bincount(dest, length=n_dev)
    slot = jnp.arange(a_loc) - (jnp.cumsum(send_counts) - send_counts)[dest]   # row in dest chunk
    send = jnp.zeros((n_dev, a_loc, x.shape[1]), x.dtype).at[dest, slot].set(x[order // k])
    # Local expert id of every row; `local_experts` marks an empty row.
    send_ids = jnp.full((n_dev, a_loc), local_experts, jnp.int32).at[dest, slot].set(
        expert % local_experts)
    recv = exchange(send)                                                      # [P(src), A_loc, D]
    recv_ids = exchange(send_ids).reshape(-1)
    order2 = jnp.argsort(recv_ids, stable=True)                                # empties sort last
    group_sizes = jnp.bincount(recv_ids, length=local_experts).astype(jnp.int32)
    # The buffer has P * A_loc rows but receives A_loc on average: size blocks for the average.
    bm = block_size
    if bm is None:
      bm = default_block_size(a_loc, local_experts)
      bm = max(bm, 16) if implementation == "pallas_gpu" else bm
    out = grouped_swiglu(recv.reshape(-1, x.shape[1])[order2], group_sizes, w_gate, w_up, w_down,
                         implementation=implementation, block_size=bm, activation=activation,
                         gate_up_bias=biases or None)
    out = jnp.zeros_like(out).at[order2].set(out).reshape(n_dev, a_loc, -1)
    back = exchange(out)                                                       # [P(dest), A_loc, D]
    ys = back[dest, slot]                                                       # sorted order
    y_assign = jnp.zeros_like(ys).at[order].set(ys).reshape(m_loc, k, ys.shape[-1])
    return _combine(y_assign, weights, x.dtype)

  # on their specs before shard_map (Explicit axes never reshard implicitly)
  args = [constrain(a, mesh, tok_spec) for a in (x, indices, weights)]
  # every array of a weight (MXFP4 codes and scales, LoRA factors) is [E, ...]: split alike
  w_specs = [jax.tree.map(lambda a: P(expert_axis, *(None,) * (a.ndim - 1)), w)
             for w in (w_gate, w_up, w_down)]
  args += [jax.tree.map(lambda a, sp: constrain(a, mesh, sp), w, spec)
           for w, spec in zip((w_gate, w_up, w_down), w_specs)]
  bias_spec = P(expert_axis, None)
  biases = [] if gate_up_bias is None else [constrain(b, mesh, bias_spec) for b in gate_up_bias]
  # check_vma=False: the fori_loop carries of the blocked matmul start as (unvarying) zeros.
  fn = jax.shard_map(local, mesh=mesh,
                     in_specs=(tok_spec,) * 3 + tuple(w_specs) + (bias_spec,) * len(biases),
                     out_specs=tok_spec, check_vma=False)
  y = fn(*args, *biases)
  return _whole_rows(y, mesh)[:num_tokens] if pad else y
