"""Memory-efficient (flash-style) attention in plain XLA: online softmax over key blocks.

The ``"xla_chunked"`` implementation of ``jaxattn.ops.attention.dot_product_attention`` and the
default on CPU.  It computes the same function as the reference ``_attention_xla`` (same argument
normalization, same score math from ``jaxattn.ops.scores.block_logits``) without ever holding the
``T x S`` logits: memory is linear in the sequence length.

Shapes (the package docstring defines the letters): ``query [B, T, N, H]``, ``key [B, S, K, H]``,
``value [B, S, K, h]``; inside, query heads are grouped by the KV head they read (``N = K * G``),
so GQA/MQA never repeat keys or values in memory:

    q    [B, K, G, T, H]     k [B, K, S, H]     v [B, K, S, h]
    block logits  [B, K, G, bq, bk]   (the only quadratic-in-block temporary)

Forward (for each query block ``i``, for each *non-empty* key block ``j``)::

    s     = block_logits(q_i, k_j)             scale -> bias -> ALiBi -> soft-cap -> mask
    m_new = max(m, rowmax(s))                  running max (fp32)
    p     = exp(s - m_new)
    l     = exp(m - m_new) * l + rowsum(p)     running sum (fp32)
    acc   = exp(m - m_new) * acc + p @ v_j     fp32 accumulator
    out_i = acc / l,   lse_i = m + log(l)      (zeros and -inf for a fully masked row)

Backward (flash-attention-2 style, recomputing ``p = exp(s - lse)`` per block; for each key block
``j``, for each non-empty query block ``i``)::

    dv_j += p^T @ do_i           dp = do_i @ v_j^T          ds = p * (dp - delta_i)
    dk_j += ds^T @ q_i           dq_i += ds @ k_j           dbias_ij = ds (reduced over broadcasts)

with ``delta = rowsum(do * out)`` (minus the cotangent of ``lse`` when that output is used) and,
with a soft-cap, ``ds`` multiplied by the cap's derivative ``1 - tanh^2``.

Block skipping: the position-only ("static") part of the mask gives, at trace time, a block view
``EMPTY / PARTIAL / FULL`` (``jaxattn.ops.masks``).  Empty blocks are never visited (causal costs
about half of full attention, a sliding window ``O(T * w)``); FULL blocks are computed without any
mask; only PARTIAL blocks evaluate the mask.  Data masks (segment ids, padding), a boolean mask
array and the padding of a ragged last key block turn the non-empty blocks PARTIAL.  A traced
``q_offset`` makes the block view unknowable, so then every block is computed (still exact).

Loop structure (chosen by measurement on CPU): an outer ``fori_loop`` over query blocks, and two
inner ``fori_loop`` over the FULL and the PARTIAL key blocks of that row, read from constant
block tables.  The program size does not grow with the sequence (compiles in about a second at any
``T``) and each iteration is a few large ops (two batched matmuls over all heads, two elementwise
passes), so the per-op dispatch overhead is amortized by big blocks.  Operands are kept in the
layout each matmul reads (keys transposed, ``[bq, bk]`` blocks never transposed), so the only
per-iteration copies are the block slices themselves.

Where the CPU time goes (causal, 8 heads of 64, fp32, 2-core AVX-512 machine; one core, process
CPU time, so the figures hold on a shared machine).  Timed alone in a loop on 512 x 256 blocks of 8
heads, the ``q k^T`` matmul runs at ~130 GFLOP/s per core, the ``p v`` matmul (64 output columns)
at ~86, the ``exp`` pass at ~2.5 G elements/s; these three alone cap the loop at ~90 useful
GFLOP/s per core, about two thirds of the per-core rate of a 4096^3 matmul, before the row max, row
sum, block slices, mask and setup copies.  The whole forward reaches ~80 GFLOP/s per core of CPU
time and loses about a fifth more when the two cores split each op.

Tried against this layout and not kept (change in CPU time at T = 8192, within the ~5-10%
run-to-run noise of a shared machine unless stated):

* ``exp2`` with ``log2 e`` folded into the query scale: XLA:CPU's ``exp`` and ``exp2`` cost the
  same per element.
* Row sums from the ``p v`` matmul with a column of ones appended to ``v`` (no separate sum pass):
  the 65-column matmul costs what the sum pass saved.
* Skipping the row max after the first key block of a query row, gated per row by the
  Cauchy-Schwarz bound ``|q_i| max_j |k_j| - m_i`` (no overflow possible) with a ``lax.cond`` to the
  exact path: ~5% less CPU time; a per-block gate made XLA copy the logits into the conditional
  (slower), and under ``jax.vmap`` a batched predicate turns ``cond`` into ``select`` and runs both
  paths, so it was not worth its complexity.
* Other block shapes (1024x256, 512x512, 512x128, 1024x128, 256x128, 1024x64; most of them measured
  together with the row-max skipping above): none better than 512 x 256 beyond noise, 1024x64
  clearly worse (~20% more CPU time); the isolated ``q k^T`` matmul is ~10% faster at 512 x 128,
  the ``p v`` matmul and the extra per-block ops eat it.
* Two query blocks per outer iteration (``i`` and ``nq - 1 - i``: independent chains the runtime
  could overlap on the two cores): correct, but its effect could not be told apart from the noise
  of a loaded machine; not kept.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float

from jaxattn.ops import scores as S
from jaxattn.ops.masks import EMPTY, FULL, PARTIAL, AndMask, Mask
from jaxattn.sharding import is_explicit

# Default block sizes, measured on a 2-core AVX-512 CPU for causal attention with 8 heads of 64
# (fp32), forward time in ms for (block_q x block_k):
#
#     T       128x128  256x256  256x512  512x256  512x512  1024x256
#     1024       18.7     16.0     14.9     13.0     28.4        -
#     2048       66.6     58.8     49.1     44.1     57.1      54.9
#     4096      253      216      174      155      160          -
#     8192     1042      835      646      577      574       574
#
# Each iteration is a handful of XLA ops over all heads (two batched matmuls, two elementwise
# passes, two row reductions): small blocks pay the per-op dispatch and thread synchronization,
# large ones spill the [B, K, G, bq, bk] fp32 block out of cache and waste more of the diagonal
# blocks of a causal mask.  512 x 256 is the best or within noise of it at every length measured,
# forward and backward.
DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_K = 256
# Block lengths are rounded up to a multiple of this (vector width of fp32 on AVX-512 / a TPU
# sublane) when a sequence is split evenly into blocks.
_BLOCK_ALIGN = 8


# ----------------------------------------------------------------------------------------------
# Public entry point (normalized signature of `dot_product_attention` backends)
# ----------------------------------------------------------------------------------------------


def chunked_attention(
    query: Float[Array, "B T N H"],
    key: Float[Array, "B S K H"],
    value: Float[Array, "B S K h"],
    *,
    bias: Float[Array, "#B #N #T #S"] | None = None,
    mask: Mask | None = None,
    mask_array: Bool[Array, "#B #N #T #S"] | None = None,
    scale: float,
    alibi_slopes: Float[Array, "N"] | None = None,
    logits_soft_cap: float | None = None,
    q_offset: int | Array = 0,
    return_residuals: bool = False,
    block_q: int | None = None,
    block_k: int | None = None,
    residuals: tuple[Float[Array, "B T N h"], Float[Array, "B N T"]] | None = None,
) -> Float[Array, "B T N h"] | tuple[Float[Array, "B T N h"], Float[Array, "B N T"]]:
  """Attention with online softmax over key blocks; see the module docstring.

  Args:
    query, key, value: ``[B, T, N, H]``, ``[B, S, K, H]``, ``[B, S, K, h]``, one dtype.
    bias: additive logits bias ``[B|1, N|1, T|1, S|1]``; differentiable (its gradient is reduced
      over the broadcast dimensions).
    mask: a ``jaxattn.ops.masks.Mask`` or None.  Its position-only part decides which blocks are
      skipped; the whole mask is evaluated on partially masked blocks.
    mask_array: optional boolean array broadcastable to ``[B, N|1, T, S]`` (True = attend).
    scale: logits scale (python float or a scalar array; a traced scale is differentiated).
    alibi_slopes: optional ``[N]`` ALiBi slopes (differentiated).
    logits_soft_cap: optional soft-cap ``cap * tanh(logits / cap)``.
    q_offset: position of query row 0 in key coordinates, a python int (static block skipping) or a
      traced int scalar (every block is computed).
    return_residuals: also return the fp32 log-sum-exp ``[B, N, T]`` (``-inf`` for empty rows).
    block_q, block_k: maximum query / key block lengths (default ``DEFAULT_BLOCK_Q/K``).  A sequence
      is split into ``ceil(T / block_q)`` equal blocks (rounded up to a multiple of 8, never above
      ``block_q``) and padded internally; padded keys are masked out.
    residuals: ``(out, lse)`` given: returned as the result without computing it, and the
      backward pass runs from them (``jaxattn.ops.attention.attention_gradients``).

  Returns:
    ``[B, T, N, h]`` in the query dtype; with ``return_residuals``, ``(out, lse)``.
  """
  b, t, n, hd = query.shape
  s, kh = key.shape[1], key.shape[2]
  hv = value.shape[3]
  if n % kh:
    raise ValueError(f"query heads N={n} must be a multiple of key/value heads K={kh}.")
  bq = _block_len(t, DEFAULT_BLOCK_Q if block_q is None else block_q, "block_q")
  bk = _block_len(s, DEFAULT_BLOCK_K if block_k is None else block_k, "block_k")

  # Everything static goes into a hashable config (one traced program per config); arrays go into
  # `aux`, the non-differentiable inputs of the custom-VJP function.
  static_offset = _concrete(q_offset, int)
  static_scale = _concrete(scale, float)
  mask_leaves, mask_treedef = jax.tree.flatten(mask)
  cfg = _Config(
      shape=(b, t, n, hd, s, kh, hv), dtype=jnp.dtype(query.dtype).name, block_q=bq, block_k=bk,
      mask_treedef=mask_treedef, static_scale=static_scale, static_q_offset=static_offset,
      logits_soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
      bias_shape=None if bias is None else tuple(bias.shape),
      mask_array_shape=None if mask_array is None else tuple(np.shape(mask_array)),
      has_alibi=alibi_slopes is not None)
  aux = {
      "mask": mask_leaves,
      "mask_array": None if mask_array is None else jnp.asarray(mask_array, bool),
      "q_offset": None if static_offset is not None else jnp.asarray(q_offset, jnp.int32),
  }
  # The differentiable scalars: ALiBi slopes and a traced scale (their cotangents are reductions
  # of the logits' cotangent that the backward pass takes on the fly).
  params = {
      "alibi_slopes": None if alibi_slopes is None else jnp.asarray(alibi_slopes, jnp.float32),
      "scale": None if static_scale is not None else jnp.asarray(scale, jnp.float32),
  }
  run = _build(cfg)
  if is_explicit(jax.sharding.get_abstract_mesh()):
    run = _with_auto_axes(run, query)
  given = None if residuals is None else (residuals[0].astype(query.dtype),
                                           jnp.asarray(residuals[1], jnp.float32))
  out, lse = run(query, key, value, bias, params, aux, given)
  return (out, lse) if return_residuals else out


def _with_auto_axes(run, query):
  """``run`` under Auto axes when the mesh has Explicit ones (``jax.make_mesh``'s default): its
  block loops start from unsharded buffers that sharded inputs would change the type of (a
  TypeError).  The outputs keep the query's batch / length / heads sharding."""
  spec = tuple(jax.typeof(query).sharding.spec)
  b, t, n = (spec + (None,) * 4)[:3]
  return jax.sharding.auto_axes(run, out_sharding=(P(b, t, n, None), P(b, n, t)))


def _concrete(x, kind):
  """``kind(x)`` for a python / NumPy / concrete JAX scalar; None for a tracer (run-time value)."""
  try:
    return kind(x)
  except TypeError:  # jax.errors.ConcretizationTypeError and friends are TypeErrors
    return None


def _block_len(length: int, block: int, name: str) -> int:
  """Splits ``length`` into ``ceil(length / block)`` near-equal blocks; returns the block length."""
  if not isinstance(block, (int, np.integer)) or block <= 0:
    raise ValueError(f"`{name}` must be a positive int, got {block!r}.")
  if length <= block:
    return max(length, 1)
  nblocks = -(-length // block)
  even = -(-length // nblocks)
  return min(block, -(-even // _BLOCK_ALIGN) * _BLOCK_ALIGN)


# ----------------------------------------------------------------------------------------------
# Static configuration and block tables
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Config:
  shape: tuple[int, ...]  # (B, T, N, H, S, K, h)
  dtype: str
  block_q: int
  block_k: int
  mask_treedef: Any
  static_scale: float | None  # None: traced (in aux)
  static_q_offset: int | None  # None: traced (in aux)
  logits_soft_cap: float | None
  bias_shape: tuple[int, ...] | None
  mask_array_shape: tuple[int, ...] | None
  has_alibi: bool

  @property
  def num_q_blocks(self):
    return -(-self.shape[1] // self.block_q)

  @property
  def num_k_blocks(self):
    return -(-self.shape[4] // self.block_k)


def split_static(mask: Mask | None) -> tuple[Mask | None, Mask | None]:
  """``(static_part, data_part)`` of a mask, each the conjunction of its conjuncts of that kind.

  The mask is ``static_part & data_part``.  A block EMPTY in the static part is EMPTY in the whole
  mask, so the static part alone decides which blocks to skip.  An ``OrMask`` with a data-dependent
  side cannot be split and counts as data.
  """
  if mask is None:
    return None, None
  if mask.is_static:
    return mask, None
  if isinstance(mask, AndMask):
    sa, da = split_static(mask.a)
    sb, db = split_static(mask.b)
    return _and(sa, sb), _and(da, db)
  return None, mask


def _and(a, b):
  return b if a is None else (a if b is None else a & b)


def block_kinds(cfg: _Config, mask: Mask | None) -> np.ndarray:
  """``[nq, nk]`` int8 EMPTY/PARTIAL/FULL: what each block pair of this call computes."""
  t, s = cfg.shape[1], cfg.shape[4]
  nq, nk = cfg.num_q_blocks, cfg.num_k_blocks
  static, data = split_static(mask)
  if static is None:
    kinds = np.full((nq, nk), FULL, np.int8)
  elif cfg.static_q_offset is None:  # traced offset: the static part is known only at run time.
    kinds = np.full((nq, nk), PARTIAL, np.int8)
  else:
    kinds = np.array(static.block_view(t, s, cfg.block_q, cfg.block_k, cfg.static_q_offset),
                     np.int8)
  if data is not None or cfg.mask_array_shape is not None:
    kinds[kinds == FULL] = PARTIAL
  if s % cfg.block_k:  # The ragged last key block holds padding keys that must be masked out.
    kinds[:, -1][kinds[:, -1] == FULL] = PARTIAL
  return kinds


def block_schedule(query_shape, key_shape, *, mask: Mask | None = None, q_offset: int = 0,
                   block_q: int | None = None, block_k: int | None = None,
                   mask_array_shape=None) -> dict[str, int]:
  """How many block pairs ``chunked_attention`` computes for these shapes and this mask.

  Returns ``{"full", "partial", "empty", "total"}`` counts of (query block, key block) pairs; the
  forward and backward passes visit exactly the ``full + partial`` non-empty pairs.
  """
  b, t, n, hd = query_shape
  s, kh = key_shape[1], key_shape[2]
  bq = _block_len(t, DEFAULT_BLOCK_Q if block_q is None else block_q, "block_q")
  bk = _block_len(s, DEFAULT_BLOCK_K if block_k is None else block_k, "block_k")
  cfg = _Config(shape=(b, t, n, hd, s, kh, hd), dtype="float32", block_q=bq, block_k=bk,
                mask_treedef=None, static_scale=1.0, static_q_offset=int(q_offset),
                logits_soft_cap=None, bias_shape=None, mask_array_shape=mask_array_shape,
                has_alibi=False)
  kinds = block_kinds(cfg, mask)
  return {"full": int((kinds == FULL).sum()), "partial": int((kinds == PARTIAL).sum()),
          "empty": int((kinds == EMPTY).sum()), "total": int(kinds.size)}


def _tables(kinds: np.ndarray, kind: int, axis: int) -> tuple[np.ndarray, np.ndarray]:
  """For each row (axis=1: query block) or column (axis=0: key block), the indices of the blocks of
  ``kind`` along the other axis, as a padded ``[rows, max_count]`` table and a ``[rows]`` count."""
  sel = (kinds == kind) if axis == 1 else (kinds == kind).T
  counts = sel.sum(axis=1).astype(np.int32)
  table = np.zeros((sel.shape[0], max(1, int(counts.max(initial=0)))), np.int32)
  for r in range(sel.shape[0]):
    idx = np.flatnonzero(sel[r])
    table[r, :idx.size] = idx
  return table, counts


# ----------------------------------------------------------------------------------------------
# The custom-VJP function for one static configuration
# ----------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=128)
def _build(cfg: _Config):
  """The jitted ``(q, k, v, bias, aux) -> (out, lse)`` with its flash backward, for ``cfg``."""

  @jax.custom_vjp
  def attention(query, key, value, bias, params, aux, given):
    if given is not None:
      return given
    return _forward(cfg, query, key, value, bias, params, aux)[0]

  def fwd(query, key, value, bias, params, aux, given):
    if given is None:
      (out, lse), res = _forward(cfg, query, key, value, bias, params, aux)
    else:  # the forward's results, given: the backward's grouped, padded log-sum-exp from them
      (out, lse), res = given, _grouped_lse(cfg, given[1])
    return (out, lse), (query, key, value, bias, params, aux, out, res)

  def bwd(residuals, cotangents):
    query, key, value, bias, params, aux, out, res = residuals
    d_out, d_lse = cotangents
    grads = _backward(cfg, query, key, value, bias, params, aux, out, res, d_out, d_lse)
    return (*grads, None, None)

  attention.defvjp(fwd, bwd)
  return jax.jit(attention)


class _Prepared:
  """Grouped, padded, block-addressable views of the inputs shared by forward and backward."""

  def __init__(self, cfg: _Config, query, key, value, bias, params, aux):
    b, t, n, hd, s, kh, hv = cfg.shape
    self.cfg = cfg
    bq, bk = cfg.block_q, cfg.block_k
    self.tp, self.sp = cfg.num_q_blocks * bq, cfg.num_k_blocks * bk
    g = n // kh
    # fp32 queries are pre-multiplied by the scale (exact up to one rounding; saves one pass over
    # every block of logits); lower precisions keep their dtype for the matmul and scale the fp32
    # logits instead, so bf16 inputs are not rounded twice.
    scale = cfg.static_scale if cfg.static_scale is not None else params["scale"]
    self.scale = scale
    self.prescaled = jnp.finfo(query.dtype).bits >= 32
    q = jnp.swapaxes(query, 1, 2)  # [B, N, T, H]
    if self.prescaled:
      q = q * jnp.asarray(scale, query.dtype)
    self.q = _pad_axis(S.group_heads(q, kh), 3, self.tp)  # [B, K, G, Tp, H]
    self.k = _pad_axis(jnp.swapaxes(key, 1, 2), 2, self.sp)  # [B, K, Sp, H]
    self.v = _pad_axis(jnp.swapaxes(value, 1, 2), 2, self.sp)  # [B, K, Sp, h]
    self.logit_scale = 1.0 if self.prescaled else scale
    self.bias = None if bias is None else self._pad_tb(S.group_heads(bias, kh))
    marr = aux["mask_array"]
    self.mask_array = None if marr is None else self._pad_tb(S.group_heads(marr, kh))
    slopes = params["alibi_slopes"]
    self.slopes = None if slopes is None else slopes.reshape(kh, g)
    self.q_offset = cfg.static_q_offset if cfg.static_q_offset is not None else aux["q_offset"]
    self.mask = jax.tree.unflatten(cfg.mask_treedef, aux["mask"])
    self.ragged_k = s % bk != 0
    self.kinds = block_kinds(cfg, self.mask)

  def _pad_tb(self, x):
    """Pads the T and S axes (last two) of a grouped bias / mask array to the block multiples."""
    if x.shape[-2] != 1:
      x = _pad_axis(x, x.ndim - 2, self.tp)
    if x.shape[-1] != 1:
      x = _pad_axis(x, x.ndim - 1, self.sp)
    return x

  def q_block(self, x, i, axis=3):
    return lax.dynamic_slice_in_dim(x, i * self.cfg.block_q, self.cfg.block_q, axis)

  def k_block(self, x, j, axis=2):
    return lax.dynamic_slice_in_dim(x, j * self.cfg.block_k, self.cfg.block_k, axis)

  def _tb_block(self, x, i, j):
    if x is None:
      return None
    if x.shape[-2] != 1:
      x = self.q_block(x, i, x.ndim - 2)
    if x.shape[-1] != 1:
      x = self.k_block(x, j, x.ndim - 1)
    return x

  def logits(self, q_blk, k_blk, i, j, partial: bool):
    """fp32 logits ``[B, K, G, bq, bk]`` of block (i, j); masked only when ``partial``."""
    bq, bk = self.cfg.block_q, self.cfg.block_k
    q_idx = i * bq + jnp.arange(bq, dtype=jnp.int32)
    kv_idx = j * bk + jnp.arange(bk, dtype=jnp.int32)
    mask_array = None
    if partial:
      mask_array = self._tb_block(self.mask_array, i, j)
      if self.ragged_k:
        valid = kv_idx < self.cfg.shape[4]  # [bk]: padding keys are never attended.
        mask_array = valid if mask_array is None else mask_array & valid
    logits, _ = S.block_logits(
        q_blk, k_blk, scale=self.logit_scale, q_idx=q_idx, kv_idx=kv_idx, q_offset=self.q_offset,
        bias=self._tb_block(self.bias, i, j), alibi_slopes=self.slopes,
        logits_soft_cap=self.cfg.logits_soft_cap, mask=self.mask if partial else None,
        mask_array=mask_array)
    return logits


def _pad_axis(x, axis, size):
  if x.shape[axis] == size:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, pad)


def _visit(tables, outer, carry, step):
  """Runs ``step(index, carry, partial)`` over the FULL, then the PARTIAL blocks of ``outer``."""
  for partial, (table, counts) in ((False, tables[0]), (True, tables[1])):
    if not counts.any():
      continue
    table, counts = jnp.asarray(table), jnp.asarray(counts)

    def body(idx, c, table=table, partial=partial):
      return step(table[outer, idx], c, partial)

    carry = lax.fori_loop(0, counts[outer], body, carry)
  return carry


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------


def _forward(cfg: _Config, query, key, value, bias, params, aux):
  """Returns ``((out [B, T, N, h], lse [B, N, T]), residuals)``."""
  b, t, n, hd, s, kh, hv = cfg.shape
  g = n // kh
  bq = cfg.block_q
  pr = _Prepared(cfg, query, key, value, bias, params, aux)
  tables = (_tables(pr.kinds, FULL, 1), _tables(pr.kinds, PARTIAL, 1))
  # Keys stored transposed: the per-block slice (a copy anyway) then yields the [H, bk] operand the
  # CPU matmul wants, instead of a second, transposing copy in every iteration.
  k_t = jnp.swapaxes(pr.k, 2, 3)  # [B, K, H, Sp]

  def q_row(i, bufs):
    out_buf, lse_buf = bufs
    q_blk = pr.q_block(pr.q, i)  # [B, K, G, bq, H]

    def kv_step(j, carry, partial):
      m, l, acc = carry  # [B, K, G, bq, 1] x2, [B, K, G, bq, h]
      k_blk = jnp.swapaxes(pr.k_block(k_t, j, axis=3), 2, 3)  # [B, K, bk, H], stored [.., H, bk]
      logits = pr.logits(q_blk, k_blk, i, j, partial)  # [B, K, G, bq, bk]
      m_new = jnp.maximum(m, jnp.max(logits, axis=-1, keepdims=True))
      m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # all -inf so far: exp(-inf - 0) = 0
      p = jnp.exp(logits - m_safe)
      alpha = jnp.exp(m - m_safe)
      v_blk = pr.k_block(pr.v, j)  # [B, K, bk, h]
      pv = jnp.einsum("bkgts,bksh->bkgth", p.astype(_pv_dtype(v_blk)), v_blk,
                      preferred_element_type=jnp.float32)
      return m_new, alpha * l + jnp.sum(p, axis=-1, keepdims=True), alpha * acc + pv

    init = (jnp.full((b, kh, g, bq, 1), -jnp.inf, jnp.float32),
            jnp.zeros((b, kh, g, bq, 1), jnp.float32),
            jnp.zeros((b, kh, g, bq, hv), jnp.float32))
    m, l, acc = _visit(tables, i, init, kv_step)
    out_buf = lax.dynamic_update_slice_in_dim(out_buf, S.finalize(acc, l, query.dtype), i * bq, 3)
    lse = S.lse_from_stats(m, l)[..., 0]  # [B, K, G, bq]
    lse_buf = lax.dynamic_update_slice_in_dim(lse_buf, lse, i * bq, 3)
    return out_buf, lse_buf

  bufs = (jnp.zeros((b, kh, g, pr.tp, hv), query.dtype),
          jnp.full((b, kh, g, pr.tp), -jnp.inf, jnp.float32))
  out_g, lse_g = lax.fori_loop(0, cfg.num_q_blocks, q_row, bufs)
  out = S.ungroup(out_g[:, :, :, :t])
  lse = S.ungroup_lse(lse_g[:, :, :, :t])
  return (out, lse), lse_g


def _grouped_lse(cfg: _Config, lse):
  """``[B, N, T]`` -> the forward's residual layout ``[B, K, G, Tp]`` (padded rows ``-inf``)."""
  b, t, n, _, _, kh, _ = cfg.shape
  grouped = lse.reshape(b, kh, n // kh, t)
  return jnp.pad(grouped, ((0, 0), (0, 0), (0, 0), (0, cfg.num_q_blocks * cfg.block_q - t)),
                 constant_values=-jnp.inf)


def _pv_dtype(v):
  # Probabilities meet values in the values' dtype when that is narrower than fp32 (bf16 matmuls
  # run several times faster, e.g. on AMX, and the bf16 output cannot hold more precision anyway);
  # fp32 values keep fp32 probabilities.
  return v.dtype if jnp.finfo(v.dtype).bits < 32 else jnp.float32


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------


def _backward(cfg: _Config, query, key, value, bias, params, aux, out, lse_g, d_out, d_lse):
  b, t, n, hd, s, kh, hv = cfg.shape
  g = n // kh
  bq, bk = cfg.block_q, cfg.block_k
  pr = _Prepared(cfg, query, key, value, bias, params, aux)
  tables = (_tables(pr.kinds, FULL, 0), _tables(pr.kinds, PARTIAL, 0))
  cap = cfg.logits_soft_cap

  do = _pad_axis(S.group_heads(jnp.swapaxes(d_out, 1, 2), kh), 3, pr.tp)  # [B, K, G, Tp, h]
  # delta_i = sum_h dO * O  (= sum_j p_ij dp_ij); the lse cotangent enters as p * d_lse.
  delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B, T, N]
  delta = jnp.swapaxes(delta, 1, 2) - d_lse.astype(jnp.float32)  # [B, N, T]
  delta = _pad_axis(delta.reshape(b, kh, g, t), 3, pr.tp)  # [B, K, G, Tp]
  lse_safe = jnp.where(jnp.isfinite(lse_g), lse_g, 0.0)  # empty rows: exp(-inf - 0) = 0

  def reduce_to(x, shape):
    """Sums ``x`` over the axes that ``shape`` broadcasts (size 1)."""
    axes = tuple(a for a, (xs, ts) in enumerate(zip(x.shape, shape)) if ts == 1 and xs != 1)
    return jnp.sum(x, axis=axes, keepdims=True) if axes else x

  # Operands are stored in the layout their matmul reads (contraction axis leading on the right,
  # trailing on the left), so that the per-block slice, a copy anyway, is the only copy: XLA's CPU
  # matmuls would otherwise transpose [bq, h] / [bk, h] blocks inside the loop on every visit.
  # Block-major transposed queries and output cotangents: [B, K, nq, H|h, G, bq].
  nq = cfg.num_q_blocks
  q_t = jnp.transpose(pr.q.reshape(b, kh, g, nq, bq, hd), (0, 1, 3, 5, 2, 4))
  do_t = jnp.transpose(do.reshape(b, kh, g, nq, bq, hv), (0, 1, 3, 5, 2, 4))
  k_t, v_t = jnp.swapaxes(pr.k, 2, 3), jnp.swapaxes(pr.v, 2, 3)  # [B, K, H|h, Sp]

  def k_col(j, bufs):
    dq_buf, dk_buf, dv_buf, dbias_buf, dslope_buf = bufs
    k_blk = pr.k_block(pr.k, j)  # [B, K, bk, H]
    k_blk_t = pr.k_block(k_t, j, axis=3)  # [B, K, H, bk]
    v_blk_t = pr.k_block(v_t, j, axis=3)  # [B, K, h, bk]

    def q_step(i, carry, partial):
      dq_buf, dbias_buf, dslope_buf, dk_acc, dv_acc = carry
      q_blk = pr.q_block(pr.q, i)  # [B, K, G, bq, H]
      q_blk_t = lax.dynamic_index_in_dim(q_t, i, 2, keepdims=False)  # [B, K, H, G, bq]
      do_blk = pr.q_block(do, i)  # [B, K, G, bq, h]
      do_blk_t = lax.dynamic_index_in_dim(do_t, i, 2, keepdims=False)  # [B, K, h, G, bq]
      # (The transpose is taken inside the loop so that the loop carries k in [H, bk] layout.)
      logits = pr.logits(q_blk, jnp.swapaxes(k_blk_t, 2, 3), i, j, partial)  # [B, K, G, bq, bk]
      p = jnp.exp(logits - pr.q_block(lse_safe, i)[..., None])
      # The [bq, bk] blocks p and ds stay in the orientation the logits were computed in; dk and
      # dv are accumulated transposed ([H|h, bk]) so that no matmul needs a transposed copy of a
      # [bq, bk] block (measured ~3x slower per block pair when XLA inserts those transposes).
      dv_acc = dv_acc + jnp.einsum("bkhgt,bkgts->bkhs", do_blk_t, p.astype(_pv_dtype(do_blk)),
                                   preferred_element_type=jnp.float32)
      dp = jnp.einsum("bkgth,bkhs->bkgts", do_blk, v_blk_t, preferred_element_type=jnp.float32)
      ds = p * (dp - pr.q_block(delta, i)[..., None])  # d logits (after soft-cap)
      if cap is not None:  # d cap*tanh(x/cap) / dx = 1 - tanh^2; masked entries (-inf) give 0.
        tanh = jnp.clip(logits / jnp.float32(cap), -1.0, 1.0)
        ds = ds * (1.0 - tanh * tanh)
      if dbias_buf is not None:
        contrib = reduce_to(ds, dbias_buf.shape[:-2] + (bq, bk))
        start_t = i * bq if dbias_buf.shape[-2] != 1 else 0
        start_s = j * bk if dbias_buf.shape[-1] != 1 else 0
        contrib = reduce_to(contrib, dbias_buf.shape)
        idx = (0,) * (dbias_buf.ndim - 2) + (start_t, start_s)
        old = lax.dynamic_slice(dbias_buf, idx, contrib.shape)
        dbias_buf = lax.dynamic_update_slice(dbias_buf, old + contrib, idx)
      if dslope_buf is not None:  # logits += slope * (j - i - q_offset): d slope = sum ds * rel
        rel = ((j * bk + jnp.arange(bk, dtype=jnp.int32))[None, :]
               - (i * bq + jnp.arange(bq, dtype=jnp.int32) + pr.q_offset)[:, None])
        dslope_buf = dslope_buf + jnp.sum(ds * rel.astype(jnp.float32), axis=(0, 3, 4))
      ds_mm = ds.astype(_pv_dtype(q_blk))
      dk_acc = dk_acc + jnp.einsum("bkhgt,bkgts->bkhs", q_blk_t, ds_mm,
                                   preferred_element_type=jnp.float32)
      dq_blk = jnp.einsum("bkgts,bksh->bkgth", ds_mm, k_blk, preferred_element_type=jnp.float32)
      dq_buf = lax.dynamic_update_slice_in_dim(dq_buf, pr.q_block(dq_buf, i) + dq_blk, i * bq, 3)
      return dq_buf, dbias_buf, dslope_buf, dk_acc, dv_acc

    init = (dq_buf, dbias_buf, dslope_buf, jnp.zeros((b, kh, hd, bk), jnp.float32),
            jnp.zeros((b, kh, hv, bk), jnp.float32))
    # dk, dv: [B, K, H|h, bk]
    dq_buf, dbias_buf, dslope_buf, dk_acc, dv_acc = _visit(tables, j, init, q_step)
    dk_buf = lax.dynamic_update_slice_in_dim(dk_buf, jnp.swapaxes(dk_acc, 2, 3), j * bk, 2)
    dv_buf = lax.dynamic_update_slice_in_dim(dv_buf, jnp.swapaxes(dv_acc, 2, 3), j * bk, 2)
    return dq_buf, dk_buf, dv_buf, dbias_buf, dslope_buf

  dbias_buf = None
  if bias is not None:
    dbias_buf = jnp.zeros(pr.bias.shape, jnp.float32)
  bufs = (jnp.zeros((b, kh, g, pr.tp, hd), jnp.float32), jnp.zeros((b, kh, pr.sp, hd), jnp.float32),
          jnp.zeros((b, kh, pr.sp, hv), jnp.float32), dbias_buf,
          None if pr.slopes is None else jnp.zeros((kh, g), jnp.float32))
  dq_g, dk_g, dv_g, dbias_g, dslope_g = lax.fori_loop(0, cfg.num_k_blocks, k_col, bufs)

  # logits = scale * q.k: dq = scale * ds @ k always; dk = ds^T @ (scale * q) is exact already when
  # the queries were pre-scaled, else it takes the scale here.
  scale = jnp.asarray(pr.scale, jnp.float32)
  ds_k = S.ungroup(dq_g[:, :, :, :t])  # ds @ k, [B, T, N, H]
  dq = (ds_k * scale).astype(query.dtype)
  dk = dk_g[:, :, :s] if pr.prescaled else dk_g[:, :, :s] * scale
  dk = jnp.swapaxes(dk, 1, 2).astype(key.dtype)
  dv = jnp.swapaxes(dv_g[:, :, :s], 1, 2).astype(value.dtype)
  dbias = None
  if bias is not None:
    dbias_g = dbias_g[..., :dbias_g.shape[-2] if bias.shape[2] == 1 else t,
                      :dbias_g.shape[-1] if bias.shape[3] == 1 else s]
    dbias = dbias_g.reshape(bias.shape).astype(bias.dtype)
  dparams = {"alibi_slopes": None if dslope_g is None else dslope_g.reshape(n),
             "scale": None}
  if params["scale"] is not None:  # d scale = sum_ij ds_ij q_i.k_j = sum_i q_i . (ds @ k)_i
    dparams["scale"] = jnp.sum(ds_k * query.astype(jnp.float32)).reshape(params["scale"].shape)
  return dq, dk, dv, dbias, dparams


__all__ = ["chunked_attention", "block_schedule", "block_kinds", "split_static",
           "DEFAULT_BLOCK_Q", "DEFAULT_BLOCK_K"]
