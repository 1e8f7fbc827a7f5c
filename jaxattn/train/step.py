"""The training step: loss, optimizer, and a ``jax.jit`` step with explicit shardings on a mesh.

The model is handled functionally: ``nnx.split`` gives a static ``graphdef``, the trainable
``params`` (``nnx.Param``) and the ``rest`` (non-trainable variables such as MoE router biases,
updated outside the gradient).  A ``TrainState`` holds ``params``, ``rest``, the optax state and the
step; ``make_train_step`` jits ``(state, batch) -> (state, metrics)`` with ``in_shardings`` /
``out_shardings`` taken from the state's placement (parameters by the logical rules of
``jaxattn.sharding``, optimizer moments like their parameters, batches over ``data`` x ``fsdp``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxattn.nn.model import DecoderLM, ModelConfig
from jaxattn.nn.mtp import mtp_layer_kind, shift_left
from jaxattn.sharding import logical_to_spec, param_shardings

Batch = dict[str, jax.Array]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
  """Everything that changes during training (a pytree; the ``graphdef`` lives outside)."""

  params: Any
  rest: Any
  opt_state: Any
  step: jax.Array


def make_optimizer(*, learning_rate: float = 3e-3, warmup_steps: int = 100,
                   total_steps: int = 1000, weight_decay: float = 0.1, clip_norm: float = 1.0,
                   b1: float = 0.9, b2: float = 0.95, min_lr_ratio: float = 0.1
                   ) -> optax.GradientTransformation:
  """AdamW on a linear-warmup + cosine schedule, after global-norm gradient clipping.

  Weight decay applies to matrices only (``decay_mask``): norms' scales and biases are not decayed,
  scanned (stacked) or not.
  """
  for name, v in (("learning_rate", learning_rate), ("total_steps", total_steps)):
    if not v > 0:
      raise ValueError(f"`{name}` must be positive, got {v!r}.")
  if not 0 <= warmup_steps <= total_steps:
    raise ValueError(f"`warmup_steps` must be in [0, total_steps={total_steps}], got {warmup_steps}.")
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=learning_rate, warmup_steps=warmup_steps,
      decay_steps=max(total_steps, warmup_steps + 1), end_value=learning_rate * min_lr_ratio)
  return optax.chain(
      optax.clip_by_global_norm(clip_norm),
      optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay, mask=decay_mask))


def decay_mask(params):
  """True for the matrices weight decay applies to: ``ndim >= 2`` not counting a scanned stack's
  ``layers`` axis, so that the stacked ``[L, D]`` norm scales and biases of ``scan_layers`` are
  left alone as their unrolled ``[D]`` twins are (read from each Variable's logical axes)."""
  def decays(v) -> bool:
    if not isinstance(v, nnx.Variable):
      return np.ndim(v) >= 2
    ndim = np.ndim(v.get_value())
    axes = v.get_metadata().get("logical_axes") or ()
    return ndim - sum(a == "layers" for a in axes) >= 2
  variables = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
  treedef = jax.tree.structure(params)
  if len(variables) != treedef.num_leaves:   # a plain pytree of arrays: no stacks to know of
    return jax.tree.map(lambda p: np.ndim(p) >= 2, params)
  return jax.tree.unflatten(treedef, [decays(v) for v in variables])


def cross_entropy(logits, targets, mask=None):
  """Summed token cross-entropy and the token count (fp32).  ``logits [B, T, V]``."""
  logits = logits.astype(jnp.float32)
  logz = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  nll = logz - picked
  mask = jnp.ones_like(nll) if mask is None else mask.astype(jnp.float32)
  return jnp.sum(nll * mask), jnp.sum(mask)


def model_inputs(model_cfg: ModelConfig, batch: Batch) -> dict:
  """The model's keyword inputs from a packed batch (positions restart per document)."""
  del model_cfg
  return dict(positions=batch.get("positions"), segment_ids=batch.get("segment_ids"))


def mtp_targets(batch: Batch, depth: int):
  """Depth ``depth``'s targets and mask ``([B, T], [B, T])``: at position ``i`` the token
  ``i + depth + 1`` (``targets[i + depth]``), counted where that target is real, in the row and,
  with ``segment_ids``, in position ``i``'s document."""
  targets = batch["targets"]
  mask = batch.get("loss_mask")
  mask = jnp.ones(targets.shape, jnp.float32) if mask is None else mask.astype(jnp.float32)
  mask = shift_left(mask, depth)       # (padding shifts in as 0)
  seg = batch.get("segment_ids")
  if seg is not None:
    mask = mask * (shift_left(seg, depth) == seg)
  return shift_left(targets, depth), mask


def loss_fn(model: DecoderLM, batch: Batch):
  """Mean next-token cross-entropy over ``loss_mask`` plus the MoE and indexer auxiliary losses,
  and with multi-token prediction (``mtp_depth = D > 0``) ``mtp_loss_weight / D`` times the sum of
  the ``D`` depths' mean cross-entropies (``mtp_targets``; metric ``mtp_loss``: their mean).

  Returns ``(total, (metrics, moe_loads))``.
  """
  cfg = model.config
  inputs = model_inputs(cfg, batch)
  if cfg.mtp_depth:
    hidden, aux = model(batch["tokens"], return_aux=True, return_hidden=True, **inputs)
    logits = model.head(hidden).astype(jnp.float32)
  else:
    logits, aux = model(batch["tokens"], return_aux=True, **inputs)
  nll, count = cross_entropy(logits, batch["targets"], batch.get("loss_mask"))
  ce = nll / jnp.maximum(count, 1.0)
  moe_aux, indexer = aux["moe_aux_loss"], aux["indexer_loss"]
  loads = list(aux["moe_loads"])
  total = ce + moe_aux + indexer
  metrics = {"loss": ce}
  if cfg.mtp_depth:
    depth_logits, mtp_aux = model.mtp_forward(hidden, batch["tokens"], return_aux=True, **inputs)
    losses = []
    for k, lg in enumerate(depth_logits, start=1):
      targets, mask = mtp_targets(batch, k)
      s, c = cross_entropy(lg, targets, mask)
      losses.append(s / jnp.maximum(c, 1.0))
    mtp_loss = sum(losses) / cfg.mtp_depth
    moe_aux, indexer = moe_aux + mtp_aux["moe_aux_loss"], indexer + mtp_aux["indexer_loss"]
    total = total + cfg.mtp_loss_weight * mtp_loss + mtp_aux["moe_aux_loss"] \
        + mtp_aux["indexer_loss"]
    loads += mtp_aux["moe_loads"]
    metrics["mtp_loss"] = mtp_loss
  metrics.update({"total_loss": total, "moe_aux_loss": moe_aux, "indexer_loss": indexer,
                  "tokens": count})
  return total, (metrics, loads)


def split_model(model: DecoderLM):
  """``(graphdef, params, rest)``."""
  return nnx.split(model, nnx.Param, ...)


def init_train_state(model: DecoderLM, tx: optax.GradientTransformation, *,
                     mesh: Mesh | None = None):
  """``(graphdef, state)`` with parameters on their shards (when ``mesh``) and optimizer moments
  placed like their parameters."""
  graphdef, params, rest = split_model(model)
  if mesh is not None:
    params = jax.device_put(params, param_shardings(params, mesh))
    rest = jax.device_put(rest, param_shardings(rest, mesh))
  # jit propagates each parameter's sharding to its zeros-like moments.
  opt_state = jax.jit(tx.init)(params)
  step = jnp.zeros((), jnp.int32)
  if mesh is not None:
    # leaves not derived from a parameter (counts, the step) are replicated over the mesh
    rep = NamedSharding(mesh, P())
    place = lambda x: x if isinstance(x.sharding, NamedSharding) else jax.device_put(x, rep)
    opt_state = jax.tree.map(place, opt_state)
    step = jax.device_put(step, rep)
  return graphdef, TrainState(params, rest, opt_state, step)


def state_shardings(state: TrainState):
  """The ``NamedSharding`` (or ``SingleDeviceSharding``) of every leaf, as placed."""
  return jax.tree.map(lambda x: x.sharding, state)


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
  """Batches are split over ``data`` x ``fsdp`` on their leading axis and, with context
  parallelism, over ``context`` on their second (the sequence)."""
  spec = logical_to_spec(("batch", "length")[:ndim] + (None,) * (ndim - 2), mesh=mesh)
  return NamedSharding(mesh, spec)


def shard_batch(batch: dict, mesh: Mesh | None):
  """Host numpy batch -> device arrays (split over the batch axes of ``mesh``).

  With several processes each host passes its own rows (``PackedDataset`` with ``process_index``)
  and the global array is assembled from them.
  """
  if mesh is None:
    return {k: jnp.asarray(v) for k, v in batch.items()}
  if jax.process_count() > 1:
    return {k: jax.make_array_from_process_local_data(batch_sharding(mesh, np.ndim(v)),
                                                      np.asarray(v))
            for k, v in batch.items()}
  return {k: jax.device_put(np.asarray(v), batch_sharding(mesh, np.ndim(v)))
          for k, v in batch.items()}


def _train_step(graphdef, tx, state: TrainState, batch: Batch):
  def loss(params):
    # copy: fresh Variables in this trace.  The router biases in `rest` belong to the outer jit
    # trace, and nnx.scan / nnx.remat refuse Variables from another trace level.
    model = nnx.merge(graphdef, params, state.rest, copy=True)
    total, (metrics, loads) = loss_fn(model, batch)
    # The forward's non-parameter state after the call: dropout's RNG counters have moved on
    # (the copy above is discarded, so without this every step would draw the same masks).
    return total, (metrics, loads, split_model(model)[2])

  (_, (metrics, loads, rest)), grads = jax.value_and_grad(loss, has_aux=True)(state.params)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  if loads:  # auxiliary-loss-free balancing: router biases move against their load
    model = nnx.merge(graphdef, params, rest)
    model.update_router_biases(loads)
    _, _, rest = split_model(model)
  metrics = dict(metrics, grad_norm=global_norm(grads))
  return TrainState(params, rest, opt_state, state.step + 1), metrics


def global_norm(tree) -> jax.Array:
  """The l2 norm of every array of ``tree`` together, in fp32 (what ``optax.clip_by_global_norm``
  clips; optax's own helper for it has changed names across the versions this project supports).
  """
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def make_train_step(graphdef, tx, state: TrainState, *, mesh: Mesh | None = None,
                    donate: bool = True) -> Callable[[TrainState, Batch], tuple[TrainState, dict]]:
  """``jax.jit`` of one optimizer step with explicit in/out shardings (from ``state``'s placement
  and ``batch_sharding``) when ``mesh`` is given."""
  fn = lambda state, batch: _train_step(graphdef, tx, state, batch)
  kw = dict(donate_argnums=(0,) if donate else ())
  if mesh is None:
    return jax.jit(fn, **kw)
  s = state_shardings(state)
  b = batch_sharding(mesh)
  rep = NamedSharding(mesh, P())
  return jax.jit(fn, in_shardings=(s, b), out_shardings=(s, rep), **kw)


def make_eval_step(graphdef, *, mesh: Mesh | None = None):
  """``jax.jit`` of ``(params, rest, batch) -> (summed nll, token count, mtp)``, in eval mode.

  ``mtp``: ``{}`` without multi-token prediction; else per depth ``[D]`` arrays ``nll`` (summed),
  ``count`` and ``correct`` (top-1 hits: depth 1's rate is the share of first drafts a greedy
  ``speculative_generate(draft="mtp")`` would keep on teacher-forced text)."""
  def fn(params, rest, batch):
    model = nnx.merge(graphdef, params, rest)
    model.eval()   # dropout off: evaluation is deterministic (the state passed in is not changed)
    inputs = model_inputs(model.config, batch)
    if not model.config.mtp_depth:
      logits = model(batch["tokens"], **inputs)
      return cross_entropy(logits, batch["targets"], batch.get("loss_mask")) + ({},)
    hidden = model(batch["tokens"], return_hidden=True, **inputs)
    nll, count = cross_entropy(model.head(hidden).astype(jnp.float32), batch["targets"],
                               batch.get("loss_mask"))
    sums, counts, correct = [], [], []
    for k, lg in enumerate(model.mtp_forward(hidden, batch["tokens"], **inputs), start=1):
      targets, mask = mtp_targets(batch, k)
      s, c = cross_entropy(lg, targets, mask)
      hit = (jnp.argmax(lg, axis=-1) == targets).astype(jnp.float32)
      sums.append(s)
      counts.append(c)
      correct.append(jnp.sum(hit * mask))
    return nll, count, dict(nll=jnp.stack(sums), count=jnp.stack(counts),
                            correct=jnp.stack(correct))
  return jax.jit(fn)


def evaluate(eval_step, state: TrainState, batches, *, mesh: Mesh | None = None) -> dict:
  """Mean loss and perplexity over ``batches``; with multi-token prediction also
  ``eval_mtp_loss`` (the depths' mean cross-entropy, averaged over depths as the training loss
  is) and ``eval_mtp_accuracy`` (per depth, top-1)."""
  nll, count, mtp = 0.0, 0.0, None
  for batch in batches:
    s, c, extra = eval_step(state.params, state.rest, shard_batch(batch, mesh))
    nll += float(s)
    count += float(c)
    if extra:
      extra = {k: np.asarray(v, np.float64) for k, v in extra.items()}
      mtp = extra if mtp is None else {k: mtp[k] + extra[k] for k in mtp}
  loss = nll / max(count, 1.0)
  out = {"eval_loss": loss, "eval_ppl": float(np.exp(min(loss, 50.0))), "eval_tokens": count}
  if mtp is not None:
    denom = np.maximum(mtp["count"], 1.0)
    out["eval_mtp_loss"] = float(np.mean(mtp["nll"] / denom))
    out["eval_mtp_accuracy"] = [float(x) for x in mtp["correct"] / denom]
  return out


def mean_keys_per_query(seq_len: int, limit: int | None = None) -> float:
  """Mean number of keys a causal query attends over a sequence of ``seq_len`` tokens when each
  sees at most ``limit`` keys (None: all earlier ones, ``(T + 1) / 2`` on average)."""
  t = np.arange(1, seq_len + 1, dtype=np.float64)
  return float(np.mean(t if limit is None else np.minimum(t, limit)))


# Leading logical axes of tables read by index (a gather, no FLOPs per token): the token
# embedding [V, D], a learned position table [max_seq_len, D], T5's bucket bias [buckets, N].
_LOOKUP_AXES = ("vocab", "position", "relpos_buckets")


def _is_lookup_table(names: list[str], axes: tuple) -> bool:
  """Whether a parameter is an embedding lookup table: the top-level ``embed``, any ``embedding``
  (``pos_embed/embedding``, a layer's ``rel_bias/embedding``, an ``nnx.Embed``), or one whose
  first logical axis past a scanned ``layers`` axis is a lookup axis.  The untied head
  ``lm_head`` ([D, V]) is a matmul and is not one."""
  if names[:1] == ["embed"] or (names and names[-1] == "embedding"):
    return True
  rest = [a for a in axes if a != "layers"]
  return bool(rest) and rest[0] in _LOOKUP_AXES


def model_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
  """Training FLOPs per token (forward + backward = 3x forward): 6 x active matmul parameters plus
  each attention layer's score and value products, ``6 N (d_qk + d_v)`` per attended key, over the
  keys a causal query actually attends on average: all earlier ones (A, M), at most
  ``sliding_window + 1`` (S), at most ``index_topk`` (I, sparse mode) plus the lightning
  indexer's ``6 H_I d_I`` per earlier key.  Gated DeltaNet layers count their projections only
  (their chunked state update is linear in T and small next to them).  Multi-token-prediction
  modules count as layers of their kind, with one more pass through the head each."""
  model = nnx.eval_shape(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0)))
  params = nnx.state(model, nnx.Param)
  active = 0.0
  is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
  for path, var in jax.tree_util.tree_leaves_with_path(params, is_leaf=is_var):
    leaf = var.get_value() if is_var(var) else var
    axes = (var.get_metadata().get("logical_axes") or ()) if is_var(var) else ()
    n = int(np.prod(leaf.shape))
    names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
    # a scanned stack's [L, D] norm scales are vectors too (as in decay_mask)
    if leaf.ndim - sum(a == "layers" for a in axes) < 2 or _is_lookup_table(names, axes):
      continue  # norms/biases; lookup tables are gathers, not matmuls (tied head: counted below)
    if any(n_ in ("w_gate", "w_up", "w_down") for n_ in names):
      n = n * cfg.num_experts_per_tok / max(cfg.num_experts, 1)  # only top-k experts run
    active += n
  active += cfg.vocab_size * cfg.embed_dim if cfg.tie_embeddings else 0
  active += cfg.mtp_depth * cfg.vocab_size * cfg.embed_dim    # the MTP depths' shared head
  head_dim = cfg.head_dim or cfg.embed_dim // cfg.num_heads
  mla_qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
  mla_v = cfg.v_head_dim if cfg.v_head_dim is not None else cfg.qk_nope_head_dim
  full = mean_keys_per_query(seq_len)
  attn = 0.0
  kinds = [cfg.layer_kind(i)[0] for i in range(cfg.num_layers)]
  kinds += [mtp_layer_kind(cfg)[0]] * cfg.mtp_depth
  for kind in kinds:
    if kind == "A":
      attn += 6 * cfg.num_heads * 2 * head_dim * full
    elif kind == "S":
      attn += 6 * cfg.num_heads * 2 * head_dim * mean_keys_per_query(seq_len,
                                                                     cfg.sliding_window + 1)
    elif kind == "M":
      attn += 6 * cfg.num_heads * (mla_qk + mla_v) * full
    elif kind == "I":
      keys = full if cfg.dsa_attention_mode == "dense" else mean_keys_per_query(seq_len,
                                                                               cfg.index_topk)
      attn += 6 * cfg.num_heads * (mla_qk + mla_v) * keys
      attn += 6 * cfg.index_num_heads * cfg.index_head_dim * full
  return 6 * active + attn
