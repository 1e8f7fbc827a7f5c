"""Flash attention forward for NVIDIA Hopper (Pallas Mosaic GPU): TMA, wgmma, warp specialisation.

The Triton kernel (``gpu.py``) reaches 0.73-0.75x of cuDNN on an H200: Triton schedules one
warpgroup's loads, matmuls and softmax in program order.  This kernel is written for the Hopper
machine directly (FlashAttention-3's shape of the algorithm):

* one CTA per ``(2 * block_q query rows, head, batch row)`` runs three warpgroups: a **producer**
  (few registers, ``set_max_registers`` lowered) that streams ``[block_k, H]`` key and value blocks
  with TMA into a ring of ``stages`` shared-memory slots, and two **consumers** that each own
  ``block_q`` query rows (more registers) and run ``q k^T`` and ``p v`` as asynchronous ``wgmma``
  from shared memory into fp32 register accumulators;
* slots are handed over with mbarriers: ``k_ready[s]`` / ``v_ready[s]`` (TMA completion) and
  ``free[s]`` (both consumers are done with the slot), so loads run ``stages - 1`` blocks ahead;
* the two consumers share every K/V block (one load per CTA, 256 query rows per byte of K/V at the
  default tiles); with ``pingpong`` they also take turns on the tensor cores: one consumer's
  softmax (exponentials on the MUFU unit) runs while the other's matmuls run;
* with ``overlap`` (FlashAttention-3's intra-warpgroup pipelining) each consumer's step j issues
  ``q k_j^T`` and block j-1's ``p v`` as two wgmma groups, waits for the first alone and runs block
  j's softmax while ``p v`` still runs; K and V then sit in rings of their own (``k_free`` /
  ``v_free``: a K slot is refilled once its logits are read, a V slot a step later).  With
  ``pingpong`` as well, the turns are one-way hand-offs around each step's issue (``go``);
* with ``persistent`` the grid is one CTA per SM, each walking query tiles with one K/V ring
  across them (the producer runs ahead into the next tile);
* softmax in base 2 with ``log2(e)`` folded into the exponent: without ALiBi or a soft-cap the row
  max is taken over the raw logits and ``p = exp2(s c - m)`` is one fused multiply-add and one
  ``ex2.approx`` per logit; the running max and sum in the wgmma row layout.

Masks are band masks, evaluated from positions: no mask, causal, sliding windows (``left`` /
``right``), their conjunctions, with a query offset (static, or traced and read by the kernels at
run time); plus the zero-padding of ragged
lengths and the logit soft-cap.  Per consumer the key blocks split into runs:
``[skip | masked | full | masked | skip]``: FULL blocks never evaluate the mask and blocks outside
the band are not computed (a consumer still waits for and releases them, which keeps the
mbarrier phases of the two consumers in step).  The CTA loads only the union of its two consumers'
runs.

Block-sparse masks walk block lists instead (``list_table``): a mask that is not a band but is
built of full / causal / window / global-token masks with ``&`` and ``|`` (Longformer's window
and global tokens; a causal window with attention sinks; ``listable``), and a mask array, each
with a static query offset.  Per CTA the table lists the blocks either consumer's tile may see
(the static mask's block kinds met with the data's), in order, and each consumer's runs over
those list positions; the producer loads ``blocks[t]`` at step ``t`` and the consumers read the
same entry, so blocks between a row's sinks and its window, or a mask array's emptied blocks, are
neither loaded nor computed.  In masked blocks the mask is evaluated from the positions
(``common.eval_mask``: one compare per global token).

Data masks refine the runs per batch row at run time: segment ids (packed sequences) and key
lengths give, per 64-row (or, in the dK/dV kernel, 64-key) tile, the block range that can hold an
allowed pair and the FULL run inside it (``run_table``, from ``common.pair_kinds``: the blocks'
id ranges and the lengths), read from global memory by all three warpgroups and intersected with
the band's runs; in masked blocks the ids (the consumer's rows resident, each key block's streamed
by TMA beside K) and ``j < kv_lengths[b]`` join the band test.  ALiBi adds
``slope * (j - (i + q_offset))`` to every block's logits (slope read per head) before the
soft-cap.  A dense bias ``[B|1, N|1, T, S]`` is streamed by TMA as a ``[2 block_q, block_k]``
tile in each K slot (the dQ kernel likewise; the dK/dV kernel reads the bias transposed, a
``[128 keys, 64 rows]`` tile beside each query block), each consumer loading its rows into the
wgmma layout and adding them after the scale (the scale then is not folded into the exponent);
its gradient is ``gpu.py``'s (the Triton kernel of its own).  A boolean mask array of that
shape (Flax's ``make_attention_mask``) takes the same tiles as 0 / 1 in the inputs' dtype,
and'ed with the other masks in masked blocks; its blocks refine the run table over all heads
(EMPTY where no head allows a pair: skipped; FULL where every head allows every pair: not
evaluated).  A bias or mask with one row for all queries ``[B|1, N|1, 1, S]`` (a bias of any
float dtype) is streamed as an fp32 vector of each slot's keys, broadcast over the rows.  fp32
inputs, other masks (or a non-band one with a traced offset) and a mask array with a bias are
the Triton kernel's (``supports`` / ``gpu.hopper_reason`` say why).

The backward (``backward``) is FlashAttention-2's two passes on the same skeleton (``_Ctx``: a
producer ring, two consumers, skip / masked / full runs): a dQ kernel over query tiles streams
K / V blocks (``s = q k^T``, ``dp = do v^T``, ``dq += ds k``), and a dK/dV kernel over key tiles
streams ``q`` / ``do`` blocks with their log-sum-exp and ``delta`` rows (``s^T = k q^T``,
``dv += p^T do``, ``dp^T = v do^T``, ``dk += ds^T q``), walking the ``G`` query heads of its KV
head in turn so that GQA gradients are summed in fp32 registers (unequal head sizes up to 192,
MLA's 192 / 128: a dK kernel and a dV kernel, one accumulator each).  With ``backward_overlap``
(default: ``overlap``) a step's independent matmuls are in flight together: ``s`` and ``dp`` are
issued at once and ``p`` is computed while ``dp`` runs; in the dK/dV kernel ``dv += p^T do`` runs
while ``ds`` is computed.  Either backward (this or Triton's) takes either forward's output.

Tested on CPU with Mosaic GPU's interpreter (threads, barriers and TMA simulated, races detected),
lowered for CUDA in tests (``jax.export``); speed only on a Hopper GPU
(``experiments/device_check.sh``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxattn.ops.masks import (EMPTY, FULL, AndMask, CausalMask, FullMask, GlobalTokensMask, Mask,
                               OrMask, SlidingWindowMask, _band)
from pallas_kernels.flash_attention.common import (eval_mask, mask_array_kinds, mask_kinds,
                                                   pad_edge, pair_kinds)

# ``plgpu.load(ref, idx, *, layout)`` in jax 0.10 (``idx`` required), optional in 0.11, gone
# in 0.12.
_LOAD_IDX = ((),) if "idx" in inspect.signature(plgpu.load).parameters else ()

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
_PRODUCER_REGS = 40  # at most; fewer when the consumers take more (``_registers``)


def _registers(config: "Config") -> tuple[int, int]:
  """``(consumer, producer)`` registers per thread: two consumer warpgroups and one producer
  within the SM's 65,536 (multiples of 8)."""
  producer = min(_PRODUCER_REGS, (65536 - 256 * config.registers) // 128 // 8 * 8)
  return config.registers, producer


@dataclasses.dataclass(frozen=True)
class Config:
  """Tiles and switches of the Hopper kernel (speed only; results agree to rounding).

  block_q: query rows per consumer warpgroup (a CTA holds two: ``2 * block_q`` rows); 64 is one
    wgmma M tile.  block_k: keys per step (a multiple of 64).  stages: K/V slots in shared memory
    (>= 2).  pingpong: consumers alternate on the tensor cores (one's softmax overlaps the
    other's matmuls).  overlap (forward): each consumer overlaps its own softmax with its
    matmuls (FlashAttention-3's intra-warpgroup pipelining): step j issues ``q k_j^T`` and the
    previous block's ``p v`` together and computes block j's softmax while ``p v`` runs; K and
    V slots are then released separately.  With ``pingpong`` too (FlashAttention-3's full
    schedule): the consumers pass the tensor cores to each other one way, a consumer issuing
    its step's matmuls only on its turn (the plain ping-pong's turns are a rendezvous).
    backward_overlap (None: as ``overlap``): the backward kernels issue a step's independent
    matmuls together (``s`` with ``dp``; ``dv`` before ``ds`` is computed) and compute while the
    later ones run (within a step: no block is held over).
    persistent (forward): one CTA per SM, each walking query tiles ``cta, cta + CTAs, ...``
    (longest causal tiles first) with one K/V ring across its tiles, so the producer streams the
    next tile's blocks while the consumers finish a tile and no CTA is launched per tile.
    registers: per consumer thread (``set_max_registers``); the producer warpgroup gets what is
    left of the 64K register file, at most 40 (32 at 240).
    dq_block_k (backward): keys per step of the dQ kernel, 64 or 128 (its ``s`` and ``dp`` tiles
    are ``[64, dq_block_k]`` fp32 beside the ``[64, H]`` dQ accumulator; 128 halves the steps
    and their hand-overs and widens each wgmma).  The dK/dV kernel's tiles stay 64 x 64: its two
    accumulators leave no registers for wider logit tiles.

  Defaults from an H200 (jax 0.11.2, bf16, B=2, 16 heads of 128, T = 8k: ``python -m
  experiments.bench_flash --sweep 8192 --backward --sweep-kernels hopper``): 128-key blocks, 2
  stages, no ping-pong -- 533-554 TFLOP/s non-causal, 543 causal, 472 forward + backward causal,
  against 493-499 / 471 / 405 with ping-pong; 64-key blocks: 491-495 / 492-495 / 436-454.
  """

  block_q: int = 64
  block_k: int = 128
  stages: int = 2
  pingpong: bool = False
  overlap: bool = False
  registers: int = 232
  backward_overlap: bool | None = None
  persistent: bool = False
  dq_block_k: int = 64

  @property
  def overlaps_backward(self) -> bool:
    return self.overlap if self.backward_overlap is None else self.backward_overlap

  def __post_init__(self):
    if (not isinstance(self.registers, int) or self.registers % 8 or not
        64 <= self.registers <= 240):
      raise ValueError(f"hopper.Config: `registers` must be a multiple of 8 in [64, 240] (the "
                       f"producer keeps at least 24 of the 64K register file), got "
                       f"{self.registers!r}.")
    if self.block_q != 64:
      raise ValueError(f"hopper.Config: `block_q` must be 64 (one wgmma tile per consumer), got "
                       f"{self.block_q!r}.")
    if self.block_k < 64 or self.block_k % 64:
      raise ValueError(f"hopper.Config: `block_k` must be a positive multiple of 64, got "
                       f"{self.block_k!r}.")
    if self.stages < 2:
      raise ValueError(f"hopper.Config: `stages` must be >= 2, got {self.stages!r}.")
    if not isinstance(self.persistent, bool):
      raise ValueError(f"hopper.Config: `persistent` must be True or False, got "
                       f"{self.persistent!r}.")
    if self.dq_block_k not in (64, 128):
      raise ValueError(f"hopper.Config: `dq_block_k` must be 64 or 128, got "
                       f"{self.dq_block_k!r}.")
    if not isinstance(self.backward_overlap, (bool, type(None))):
      raise ValueError(f"hopper.Config: `backward_overlap` must be None (as `overlap`), True or "
                       f"False, got {self.backward_overlap!r}.")


def band(mask: Mask | None) -> tuple[bool, int | None, int | None]:
  """``(ok, left, right)``: whether ``mask`` is a band ``p - left <= j <= p + right`` (None:
  unbounded on that side), and its reach (``jaxattn.ops.masks._band`` in the kernels' terms)."""
  reach = (math.inf, math.inf) if mask is None else _band(mask)
  if reach is None:
    return False, None, None
  left, right = (None if x == math.inf else int(x) for x in reach)
  return True, left, right


def listable(mask: Mask | None) -> bool:
  """Whether the kernels take a position mask that is not a band (block lists, ``list_table``):
  full, causal, sliding-window and global-token masks joined by ``&`` and ``|`` (Longformer's
  window plus global tokens), each evaluated in masked blocks with a few compares per logit."""
  return _foreign_part(mask) is None


def _foreign_part(mask: Mask | None) -> Mask | None:
  """The first part of ``mask`` that ``listable`` does not take (None: every part is taken)."""
  if isinstance(mask, (AndMask, OrMask)):
    a = _foreign_part(mask.a)
    return a if a is not None else _foreign_part(mask.b)
  if isinstance(mask, (FullMask, CausalMask, SlidingWindowMask, GlobalTokensMask)):
    return None
  return mask


_SMEM_BYTES = 227 * 1024  # shared memory one H100 / H200 CTA may hold


def _kib(n: int) -> int:
  """``n`` bytes as Mosaic GPU allocates a scratch buffer: rounded up to whole KiB."""
  return -(-n // 1024) * 1024


def smem_bytes(head_dim: int, config: Config, v_head_dim: int | None = None, *,
               segments: bool = True, bias: bool | str = False) -> int:
  """Shared memory of the forward's CTA as Mosaic GPU lays it out: every scratch buffer rounded
  up to 1 KiB -- two query tiles (which take the output when the head sizes agree or the values
  are narrower, ``_aliased_out_rows``; else two output tiles of their own), ``stages`` key and
  value slots (16-bit) and, with ``segments`` (assumed when not known), the id vectors of the
  rows and of each key slot, with ``bias`` a 16-bit ``[2 block_q, block_k]`` bias tile per key
  slot (``bias="row"``: a one-row bias' fp32 ``[block_k]`` vector) -- plus 8 bytes per
  mbarrier.  The log-sum-exp rows are stored
  from registers and no cross-warp reduction space is reserved (``_launch``).

  On an H200 (jax 0.11.2) the 128-key, 3-stage forward at head size 128 asked for 232,544 bytes
  when it still kept the log-sum-exp rows in shared memory and Mosaic GPU's default 2 KiB of
  reduction space: its 229,376 bytes of tiles + 1,024 + 2,048 + 12 barriers, this model's
  terms exactly."""
  c, hv = config, head_dim if v_head_dim is None else v_head_dim
  aliased = hv == head_dim or _aliased_out_rows(head_dim, hv, c.block_q) is not None
  tiles = [2 * 2 * c.block_q * head_dim, 2 * c.stages * c.block_k * head_dim,
           2 * c.stages * c.block_k * hv] + ([] if aliased else [2 * 2 * c.block_q * hv])
  ids = [4 * 2 * c.block_q, 4 * c.stages * c.block_k] if segments else []
  if bias == "row":
    ids.append(4 * c.stages * c.block_k)
  elif bias:
    tiles.append(2 * c.stages * 2 * c.block_q * c.block_k)
  # q_ready[2], k_ready / v_ready / free (k_free and v_free when overlapped) per stage, the
  # turn, the overlapped ping-pong's go[2], the ids' ready barriers
  barriers = (2 + c.stages * (4 if c.overlap else 3) + 1 + (2 if c.overlap and c.pingpong else 0)
              + ((2 + c.stages) if segments else 0) + (c.stages if bias else 0))
  return sum(map(_kib, tiles + ids)) + 8 * barriers


def default_config(head_dim: int, v_head_dim: int | None = None, *,
                   bias: bool | str = False) -> Config:
  """128-key steps where two stages of them fit in shared memory (head sizes up to 128, and
  DeepSeek's 192 / 128 of MLA's prefill, whose output shares the query tiles), else 64 (256);
  ``bias``: with a dense bias' tiles in the ring too (``"row"``: a one-row bias' vectors)."""
  wide = Config(block_k=128)
  fits = smem_bytes(head_dim, wide, v_head_dim, bias=bias) <= _SMEM_BYTES
  return wide if fits else Config(block_k=64)


_COMPILER_PARAMS = dict(approx_math=True)
if "reduction_scratch_bytes" in {f.name for f in dataclasses.fields(plgpu.CompilerParams)}:
  # the kernels reduce only along accumulator rows (within a warp): no cross-warp space
  _COMPILER_PARAMS["reduction_scratch_bytes"] = 0


HEAD_SIZES = (64, 128, 192, 256)  # wgmma contracts over multiples of 64; at most 256 wide


def supports(*, dtype, head_dim: int, v_head_dim: int, static_mask,
             config: Config | None = None, segments: bool = True, bias: bool | str = False,
             static_offset: bool = True) -> str | None:
  """None when the Hopper kernel runs this call, else the reason it does not (ALiBi, segment
  ids, key lengths and any query offset, static or traced, are always taken with a band mask;
  a non-band mask that ``listable`` takes needs a static offset: ``static_offset``).
  ``segments``: whether the call has segment ids (their buffers count against shared memory;
  True when not known); ``bias``: whether it has a dense bias (the forward's tiles of it,
  likewise; ``"row"``: a one-row bias, streamed as vectors)."""
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"dtype {jnp.dtype(dtype).name} (the wgmma path takes bfloat16 / float16)"
  if head_dim not in HEAD_SIZES or v_head_dim not in HEAD_SIZES:
    return f"head sizes {head_dim} / {v_head_dim} (each one of 64 / 128 / 192 / 256)"
  if not band(static_mask)[0]:
    if (part := _foreign_part(static_mask)) is not None:
      return (f"mask {type(part).__name__} (band masks, and full / causal / window / "
              f"global-token masks joined by & and |)")
    if not static_offset:
      return (f"mask {type(static_mask).__name__} with a traced q_offset (a non-band mask's "
              f"block lists are built from a static offset)")
  config = config or default_config(head_dim, v_head_dim, bias=bias)
  need = smem_bytes(head_dim, config, v_head_dim, segments=segments, bias=bias)
  if need > _SMEM_BYTES:
    return (f"{config} needs {need} bytes of shared memory at head sizes {head_dim} / "
            f"{v_head_dim} (at most {_SMEM_BYTES})")
  return None


@dataclasses.dataclass(frozen=True)
class _Static:
  batch: int
  q_len: int
  kv_len: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  v_head_dim: int
  dtype: str
  left: int | None
  right: int | None
  q_offset: int | None  # None: traced, an input of the kernels (``_q_offset``)
  scale: float
  soft_cap: float | None
  config: Config
  interpret: object
  alibi: bool = False
  segments: bool = False
  lengths: bool = False
  bias: tuple[int, int] | None = None  # a dense bias' (batch, heads) sizes, each 1 or B / N
  dense_mask: bool = False  # the dense tile is a boolean mask array (1: allowed), not a bias
  bias_row: bool = False  # a one-row bias [B|1, N|1, 1, S]: streamed as fp32 key vectors
  mask: Mask | None = None  # a position mask that is not a band (``listable``)

  def bias_index(self, batch, head):
    """The (batch, head) of the bias' block that batch row ``batch`` and query head ``head``
    read (0 along a size-1 dim)."""
    return (batch if self.bias[0] > 1 else 0), (head if self.bias[1] > 1 else 0)

  @property
  def generic_reads(self) -> bool:
    """Whether consumers read a streamed slot through the generic proxy (segment ids, bias
    tiles): its release is fenced (``_Ctx.release``)."""
    return self.segments or self.bias is not None

  @property
  def data(self) -> bool:
    """Whether the kernels read a block table: segment ids / key lengths / a mask array refine
    the blocks' runs (per batch row, at run time), or the blocks come from lists (``listed``)."""
    return self.segments or self.lengths or self.dense_mask or self.mask is not None

  @property
  def listed(self) -> bool:
    """Whether each CTA walks a list of blocks (``list_table``) rather than one range: for a
    non-band mask, and for a mask array with a static query offset (whose blocks may leave
    holes that a range would load and evaluate)."""
    return (self.mask is not None or self.dense_mask) and self.q_offset is not None


def forward(query, key, value, *, mask: Mask | None = None, scale: float | None = None,
            q_offset=0, logits_soft_cap: float | None = None, alibi_slopes=None,
            segment_ids=None, kv_lengths=None, config: Config | None = None, interpret=None,
            bias=None, mask_array=None):
  """``(out [B, T, N, Hv], lse [B, N, T] fp32, natural log)`` of masked attention (a band mask,
  or with a static ``q_offset`` a block-sparse one that ``listable`` takes).

  ``query [B, T, N, H]``, ``key [B, S, K, H]``, ``value [B, S, K, Hv]`` in bf16 or fp16 (``N`` a
  multiple of ``K``); rows without an allowed key give 0 and ``lse = -inf``.  ``q_offset``: the
  first query's position among the keys, a Python int or a traced int32 scalar (chunked prefill:
  the kernels then read it at run time and compute their block runs from it).
  ``alibi_slopes [N]`` adds ``slope * (j - (i + q_offset))`` to the scaled logits (before the
  soft-cap);
  ``segment_ids = (q_ids [B, T], kv_ids [B, S])`` allows pairs of equal ids; ``kv_lengths [B]``
  allows keys ``j < kv_lengths[b]``.  ``bias [B|1, N|1, T, S]`` in the inputs' dtype: a dense
  additive bias (a T5 relative bias), added after the scale, before ALiBi and the soft-cap;
  streamed by TMA as ``[2 block_q, block_k]`` tiles beside each key block; ``[B|1, N|1, 1, S]``
  (one row for all queries, any float dtype): streamed as fp32 ``[block_k]`` vectors.
  ``mask_array [B|1, N|1, T|1, S]`` bool (True: allowed; Flax's ``make_attention_mask``
  shape), and'ed with the other masks: streamed as the bias is (0 / 1; not with a ``bias``), its
  blocks refining the run table.  ``interpret``: None runs the hardware, or pass
  ``plgpu.InterpretParams`` / True to run Mosaic GPU's interpreter on CPU.
  """
  data = dict(alibi_slopes=alibi_slopes, segment_ids=segment_ids, kv_lengths=kv_lengths,
              q_offset=q_offset)
  data.update(_dense_input("forward", query, bias, mask_array))
  st = _static("forward", query, key, value, mask=mask, scale=scale,
               logits_soft_cap=logits_soft_cap, config=config, interpret=interpret, **data)
  return _call(st)(query, key, value, _aux(st, **data))


def _dense_input(name: str, query, bias, mask_array) -> dict:
  """The dense tile input of a call: ``{"bias": bias}``, or a boolean ``mask_array`` as a 0 / 1
  tile in the inputs' dtype (``dense_mask``); ``{}`` without either."""
  if mask_array is None:
    return {} if bias is None else dict(bias=bias)
  if bias is not None:
    raise ValueError(f"hopper.{name}: `bias` and `mask_array` stream through the same tiles; "
                     f"pass one (the Triton kernels take both).")
  if getattr(mask_array, "dtype", None) != jnp.bool_:
    raise ValueError(f"hopper.{name}: `mask_array` must be bool, got "
                     f"{getattr(mask_array, 'dtype', type(mask_array).__name__)}.")
  return dict(bias=mask_array.astype(query.dtype), dense_mask=True)


def _static(name: str, query, key, value, *, mask, scale, q_offset, logits_soft_cap, config,
            interpret, alibi_slopes=None, segment_ids=None, kv_lengths=None,
            bias=None, dense_mask: bool = False) -> _Static:
  """Checks a call of ``forward`` / ``backward`` (``ValueError`` naming what is unsupported) and
  returns its static description."""
  b, t, n, h = query.shape
  s, kh, hv = key.shape[1], key.shape[2], value.shape[-1]
  bias_row = bias is not None and np.ndim(bias) == 4 and bias.shape[2] == 1
  kind = "row" if bias_row else bias is not None
  config = config or default_config(h, hv, bias=kind)
  if np.ndim(q_offset) != 0:
    raise ValueError(f"hopper.{name}: `q_offset` must be a scalar, got shape "
                     f"{np.shape(q_offset)}.")
  try:
    static_offset = int(q_offset)
  except (TypeError, jax.errors.ConcretizationTypeError):  # traced: read by the kernels
    static_offset = None
  reason = supports(dtype=query.dtype, head_dim=h, v_head_dim=hv, static_mask=mask,
                    config=config, segments=segment_ids is not None, bias=kind,
                    static_offset=static_offset is not None)
  if reason is None and name == "backward":
    reason = supports_backward(head_dim=h, v_head_dim=hv, config=config, bias=kind)
  if reason is not None:
    raise ValueError(f"hopper.{name}: unsupported call: {reason}.")
  if n % kh:
    raise ValueError(f"hopper.{name}: query heads {n} must be a multiple of key heads {kh}.")
  if key.shape != (b, s, kh, h) or value.shape != (b, s, kh, hv) or (
      key.dtype != query.dtype or value.dtype != query.dtype):
    raise ValueError(f"hopper.{name}: key {key.shape} {key.dtype} and value {value.shape} "
                     f"{value.dtype} must be [B={b}, S, K, H={h}] and [B, S, K, Hv] in "
                     f"{query.dtype}.")
  if alibi_slopes is not None and tuple(alibi_slopes.shape) != (n,):
    raise ValueError(f"hopper.{name}: `alibi_slopes` must have shape [N] = ({n},), got "
                     f"{tuple(alibi_slopes.shape)}.")
  if segment_ids is not None and (
      len(segment_ids) != 2 or tuple(segment_ids[0].shape) != (b, t)
      or tuple(segment_ids[1].shape) != (b, s)):
    raise ValueError(f"hopper.{name}: `segment_ids` must be (q_ids [B, T] = {(b, t)}, kv_ids "
                     f"[B, S] = {(b, s)}), got {tuple(tuple(x.shape) for x in segment_ids)}.")
  if bias is not None and (np.ndim(bias) != 4 or bias.shape[0] not in (1, b)
                           or bias.shape[1] not in (1, n)
                           or tuple(bias.shape[2:]) not in ((t, s), (1, s))
                           or not (bias.dtype == query.dtype or (
                               bias_row and jnp.issubdtype(bias.dtype, jnp.floating)))):
    what = "mask_array" if dense_mask else "bias"
    raise ValueError(f"hopper.{name}: `{what}` must be [B|1, N|1, T|1, S] with [B, N, T, S] = "
                     f"{(b, n, t, s)}" + ("" if dense_mask else f" in {query.dtype} (one row: "
                                          f"any float dtype)")
                     + f", got {tuple(np.shape(bias))}"
                     + ("" if dense_mask else f" {getattr(bias, 'dtype', None)}") + ".")
  if kv_lengths is not None and tuple(kv_lengths.shape) != (b,):
    raise ValueError(f"hopper.{name}: `kv_lengths` must have shape [B] = ({b},), got "
                     f"{tuple(kv_lengths.shape)}.")
  if interpret is True:
    interpret = _interpret_params()
  is_band, left, right = band(mask)
  return _Static(batch=b, q_len=t, kv_len=s, num_heads=n, num_kv_heads=kh, head_dim=h,
                 v_head_dim=hv,
                 dtype=jnp.dtype(query.dtype).name, left=left, right=right,
                 q_offset=static_offset, scale=float(h ** -0.5 if scale is None else scale),
                 soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
                 config=config, interpret=interpret or None, alibi=alibi_slopes is not None,
                 segments=segment_ids is not None, lengths=kv_lengths is not None,
                 bias=None if bias is None else (int(bias.shape[0]), int(bias.shape[1])),
                 dense_mask=dense_mask, bias_row=bias_row, mask=None if is_band else mask)


def _aux(st: _Static, *, alibi_slopes, segment_ids, kv_lengths, q_offset, bias=None,
         dense_mask: bool = False) -> dict:
  """The data inputs of a call (unpadded), by the names the kernels read them under."""
  aux = {}
  if st.q_offset is None:
    aux["q_offset"] = jnp.asarray(q_offset, jnp.int32).reshape(1)
  if st.alibi:
    aux["slopes"] = alibi_slopes.astype(jnp.float32)
  if st.lengths:
    aux["lengths"] = kv_lengths.astype(jnp.int32)
  if st.segments:
    aux["q_ids"], aux["kv_ids"] = (x.astype(jnp.int32) for x in segment_ids)
  if st.bias is not None:
    aux["bias"] = bias
  return aux


def _interpret_params():
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  return InterpretGPUParams()


def _launch(st: "_Static", entry, out_type, grid, grid_names):
  """``plgpu.kernel`` with a producer and two consumer warpgroups (axis ``"wg"``), approximate
  math, and ``out_type`` (``out_shape`` on jax versions before the rename)."""
  kwargs = dict(out_type=out_type, grid=grid, grid_names=grid_names, num_threads=3,
                thread_name="wg", compiler_params=plgpu.CompilerParams(**_COMPILER_PARAMS),
                interpret=st.interpret)
  try:
    return plgpu.kernel(entry, **kwargs)
  except TypeError:
    kwargs["out_shape"] = kwargs.pop("out_type")
    return plgpu.kernel(entry, **kwargs)


def _cdiv(a, b):
  return -(-a // b)


_BIG = 1 << 20  # offsets keep divisions of possibly negative positions non-negative


def _fdiv(x, d: int):
  """floor(x / d) of a traced int32 (``lax.div`` truncates toward zero)."""
  return lax.div(x + d * _BIG, jnp.int32(d)) - _BIG


def _cdiv_t(x, d: int):
  return _fdiv(x + (d - 1), d)


def _clamp(lo, x, hi):
  return lax.min(lax.max(x, lo), hi)


def _runs(lo, hi, f_lo, f_hi):
  """Clamps a FULL run into ``[lo, hi)`` (``lo <= f_lo <= f_hi <= hi``)."""
  hi = lax.max(hi, lo)
  f_lo = _clamp(lo, f_lo, hi)
  f_hi = _clamp(f_lo, f_hi, hi)
  return lo, hi, f_lo, f_hi


def key_blocks(st: "_Static", r0, nrows: int, bk: int, kv_len_blocks: int, q_offset):
  """Key blocks ``[lo, hi)`` that query rows ``r0 .. r0 + nrows - 1`` may see, and the FULL run
  ``[f_lo, f_hi)`` inside it (every key of the block allowed for every row, no padding key);
  ``q_offset`` (``_q_offset``) static or read at run time."""
  i32 = jnp.int32
  p0 = r0 + q_offset
  p1 = p0 + (nrows - 1)
  lo = i32(0) if st.left is None else _fdiv(lax.max(p0 - st.left, i32(0)), bk)
  hi_key = i32(st.kv_len) if st.right is None else _clamp(i32(0), p1 + st.right + 1,
                                                            i32(st.kv_len))
  hi = lax.min(_cdiv_t(hi_key, bk), i32(kv_len_blocks))
  f_lo = lo if st.left is None else _cdiv_t(p1 - st.left, bk)
  full_end = i32(st.kv_len) if st.right is None else _clamp(i32(0), p0 + st.right + 1,
                                                              i32(st.kv_len))
  return _runs(lo, hi, f_lo, _fdiv(full_end, bk))


def query_blocks(st: "_Static", k0, nkeys: int, bq: int, q_offset):
  """Query blocks ``[lo, hi)`` whose rows may see keys ``k0 .. k0 + nkeys - 1``, and the FULL
  run (every row of the block sees every key of the tile).  Key padding is not masked here: the
  gradients of padding keys are dropped, and real keys' gradients do not depend on them."""
  i32 = jnp.int32
  k1 = k0 + (nkeys - 1)
  r_lo = i32(0) if st.right is None else _clamp(i32(0), k0 - st.right - q_offset,
                                                  i32(st.q_len))
  r_end = i32(st.q_len) if st.left is None else _clamp(i32(0), k1 + st.left - q_offset + 1,
                                                         i32(st.q_len))
  lo, hi = _fdiv(r_lo, bq), _cdiv_t(r_end, bq)
  f_lo = lo if st.right is None else _cdiv_t(k1 - st.right - q_offset, bq)
  f_hi = hi if st.left is None else _fdiv(k0 + st.left - q_offset + 1, bq)
  return _runs(lo, hi, f_lo, f_hi)


class _Ctx:
  """What every kernel body shares: layouts (none when interpreted), the ping-pong turn, the
  producer's ring and the consumers' runs."""

  def __init__(self, st: "_Static", stages: int, pingpong: bool):
    self.st, self.stages, self.pingpong = st, stages, pingpong
    self.interpret = bool(st.interpret)
    self.consumer_regs, self.producer_regs = _registers(st.config)

  def cast(self, x, layout):
    return x if self.interpret else plgpu.layout_cast(x, layout)

  def full(self, shape, value):
    layout = plgpu.Layout.WGMMA if len(shape) == 2 else plgpu.Layout.WGMMA.reduce(1)
    return self.cast(jnp.full(shape, value, jnp.float32), layout)

  def iota(self, shape, dim):
    return self.cast(lax.broadcasted_iota(jnp.int32, shape, dim), plgpu.Layout.WGMMA)

  def load_vec(self, ref, axis: int):
    """A ``[n]`` fp32 row (``axis=1``: one value per accumulator row) or column vector."""
    if self.interpret:
      return ref[...]
    return plgpu.load(ref, *_LOAD_IDX, layout=plgpu.Layout.WGMMA.reduce(axis))

  def load_tile(self, ref):
    """A 16-bit ``[64, n]`` shared-memory tile as fp32 registers in the wgmma row layout."""
    if self.interpret:
      return ref[...].astype(jnp.float32)
    return plgpu.load(ref, *_LOAD_IDX, layout=plgpu.Layout.WGMMA).astype(jnp.float32)

  def take_turn(self, turn):
    if self.pingpong:
      plgpu.barrier_arrive(turn)
      plgpu.barrier_wait(turn)

  def release(self, free, slot, generic_reads: bool = False):
    """Hands slot ``slot`` back to the producer.  Reads of the slot through the generic proxy
    (``plgpu.load`` of the streamed id / log-sum-exp rows; every read, when interpreted) are
    fenced first (``commit_smem``: ``fence.proxy.async``), so that they are ordered before the
    TMA write that refills the slot; ``wgmma`` reads are in the async proxy already."""
    if generic_reads or self.interpret:
      plgpu.commit_smem()
    plgpu.barrier_arrive(free.at[slot])

  def _after_issue(self, turn):
    if callable(turn):
      turn()
    elif turn is not None:
      self.take_turn(turn)

  def mm(self, a_ref, b_ref, shape, *, transpose_b: bool, turn=None):
    """``a @ b`` (``b^T`` with ``transpose_b``) of two shared-memory tiles into fresh fp32
    registers; ``turn`` hands the tensor cores over between issue and wait (a ping-pong
    barrier, or a function to call there)."""
    if self.interpret:  # the interpreter's wgmma takes no transposed or register operands
      dims = (((1,), (1,)), ((), ())) if transpose_b else (((1,), (0,)), ((), ()))
      out = lax.dot_general(a_ref[...], b_ref[...], dims, preferred_element_type=jnp.float32)
      self._after_issue(turn)
      return out

    def body(acc_ref):
      plgpu.wgmma(acc_ref, a_ref, b_ref.transpose((1, 0)) if transpose_b else b_ref)
      self._after_issue(turn)
      return acc_ref[...]

    return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))

  def mm_acc(self, acc, a, b_ref, turn=None):
    """``acc + a @ b``: ``a`` a 16-bit register tile, ``b`` a shared-memory tile; on hardware the
    accumulator is the wgmma's own (updated in place).  ``turn``: as ``mm``'s."""
    if self.interpret:
      out = acc + jnp.dot(a, b_ref[...], preferred_element_type=jnp.float32)
      self._after_issue(turn)
      return out

    def body(acc_ref):
      plgpu.wgmma(acc_ref, a, b_ref)
      self._after_issue(turn)

    return pl.run_state(body)(plgpu.ACC.init(acc))

  def produce(self, total, free, load, t0=None):
    """The producer warpgroup: ``load(t, slot)`` issues the TMA copies of global step ``t``;
    slot ``t % stages`` is refilled once both consumers released step ``t - stages``; at the end
    it observes the last phases of ``free`` (no barrier left mid-phase at exit).  ``free`` and
    ``load`` may be tuples of rings released separately (the overlapped forward's K and V): each
    buffer is refilled as soon as its own slot is free, in the tuple's order.  ``t0`` (a
    persistent CTA's tile): the ring's global step of this tile's first block; no register
    change and no drain (``drain`` follows the CTA's last tile)."""
    i32, stages = jnp.int32, self.stages
    frees, loads = (free, load) if isinstance(free, tuple) else ((free,), (load,))
    if t0 is not None:  # a tile of a persistent CTA: the ring goes on from step t0
      @pl.loop(0, total)
      def _step(s):
        t = t0 + s
        slot = lax.rem(t, stages)
        for fr, ld in zip(frees, loads, strict=True):
          pl.when(t >= stages)(lambda fr=fr: plgpu.barrier_wait(fr.at[slot]))
          ld(s, slot)
      return
    plgpu.set_max_registers(self.producer_regs, action="decrease")

    @pl.loop(0, lax.min(total, i32(stages)))
    def _prologue(t):
      for ld in loads:
        ld(t, t)

    @pl.loop(stages, lax.max(total, i32(stages)))
    def _steady(t):
      slot = lax.rem(t, stages)
      for fr, ld in zip(frees, loads, strict=True):
        plgpu.barrier_wait(fr.at[slot])
        ld(t, slot)

    @pl.loop(lax.max(total - stages, i32(0)), total)
    def _drain(t):
      for fr in frees:
        plgpu.barrier_wait(fr.at[lax.rem(t, stages)])

  def drain(self, total, free):
    """The producer observes the last phases of ``free`` after ``total`` steps in all."""
    frees = free if isinstance(free, tuple) else (free,)

    @pl.loop(lax.max(total - self.stages, jnp.int32(0)), total)
    def _drain(t):
      for fr in frees:
        plgpu.barrier_wait(fr.at[lax.rem(t, self.stages)])

  def consume(self, carry, *, outer: int, cta_lo, steps, runs, ready, free, turn, compute,
              block_of, t0=None):
    """One consumer's walk over ``outer`` passes of the CTA's ``steps`` blocks (global step
    ``t = o * steps + s``): ``[skip | masked | full | masked | skip]`` from its own ``runs``.
    Step ``s`` holds block ``block_of(s)`` (``_cta_walk``: ``cta_lo + s``, or a block list's
    entry, whose ``runs`` count list positions with ``cta_lo`` 0).
    ``compute(t, slot, block, o, carry, masked) -> carry`` must hand the slot back
    (``release``) and take two turns; a skipped step waits for its copies, releases the slot and
    takes its two turns, so both consumers see every barrier phase.  ``t0``: as ``produce``'s
    (the ring's step of the tile's first block; None: 0)."""
    lo, hi, f_lo, f_hi = runs  # clamped into the CTA's range (an empty run skips every step)
    a, b, c, d = (_clamp(jnp.int32(0), x - cta_lo, steps) for x in (lo, f_lo, f_hi, hi))
    stages = self.stages
    ring = (lambda t: t) if t0 is None else (lambda t: t0 + t)

    def skip(o):
      def body(s, carry):
        slot = lax.rem(ring(o * steps + s), stages)
        for bar in ready:
          plgpu.barrier_wait(bar.at[slot])
        plgpu.barrier_arrive(free.at[slot])
        self.take_turn(turn)
        self.take_turn(turn)
        return carry
      return body

    def run(o, masked):
      def body(s, carry):
        t = o * steps + s
        return compute(t, lax.rem(ring(t), stages), block_of(s), o, carry, masked)
      return body

    def one_pass(o, carry):
      lax.fori_loop(0, a, skip(o), None)
      carry = lax.fori_loop(a, b, run(o, True), carry)
      carry = lax.fori_loop(b, c, run(o, False), carry)
      carry = lax.fori_loop(c, d, run(o, True), carry)
      lax.fori_loop(d, steps, skip(o), None)
      return carry

    if outer == 1:
      return one_pass(jnp.int32(0), carry)
    return lax.fori_loop(0, outer, one_pass, carry)

  def consume_overlapped(self, carry, *, cta_lo, steps, runs, ready, frees, first, step, last,
                         block_of, idle=None, t0=None):
    """``consume`` for a loop whose step ``s`` finishes block ``s - 1``: blocks are computed over
    the same ``[skip | masked | full | masked | skip]`` runs, but the first computed block runs
    ``first(slot, block, carry)`` (always masked: exact for any block), each later one
    ``step(slot, block, carry, masked)`` (which completes the previous block, holding its slot
    until then) and the last computed block is completed by ``last(carry)``.  Skipped steps wait
    for every ``ready`` barrier and release every ring in ``frees``.  Loops of zero or one trip
    stand in for conditionals (a consumer with no computed block runs neither end).  ``idle()``
    (ping-pong turns): called once per skipped step, and once more by a consumer without a
    computed block, so that every consumer takes ``steps + 1`` turns.  ``t0``, ``block_of``:
    as ``consume``'s."""
    i32, stages = jnp.int32, self.stages
    lo, hi, f_lo, f_hi = runs
    a, b, c, d = (_clamp(i32(0), x - cta_lo, steps) for x in (lo, f_lo, f_hi, hi))
    ring = (lambda t: t) if t0 is None else (lambda t: t0 + t)

    def skip(s, carry):
      slot = lax.rem(ring(s), stages)
      for bar in ready:
        plgpu.barrier_wait(bar.at[slot])
      for bar in frees:
        plgpu.barrier_arrive(bar.at[slot])
      if idle is not None:
        idle()
      return carry

    def run(masked):
      return lambda s, carry: step(lax.rem(ring(s), stages), block_of(s), carry, masked)

    lax.fori_loop(0, a, skip, None)
    one = lax.min(a + 1, d)
    carry = lax.fori_loop(a, one, lambda s, carry: first(lax.rem(ring(s), stages), block_of(s),
                                                         carry), carry)
    b1, c1 = lax.max(b, one), lax.max(c, one)
    carry = lax.fori_loop(one, b1, run(True), carry)
    carry = lax.fori_loop(b1, c1, run(False), carry)
    carry = lax.fori_loop(c1, d, run(True), carry)
    carry = lax.fori_loop(lax.max(d - 1, a), d, lambda s, carry: last(carry), carry)
    lax.fori_loop(d, steps, skip, None)
    if idle is not None:
      lax.fori_loop(0, jnp.where(a < d, i32(0), i32(1)), lambda s, carry: idle(), None)
    return carry


def _logits(ctx: _Ctx, s, bias=None):
  """Base-2 logits of raw ``q . k`` (fp32) plus ``bias`` (ALiBi, natural units) and, with a
  soft-cap, ``tanh`` of the capped logit (its chain rule is ``1 - tanh^2``)."""
  st = ctx.st
  if st.soft_cap is None:
    x = s * (st.scale * _LOG2E)
    return (x if bias is None else x + bias * _LOG2E), None
  if bias is None:
    t = jnp.tanh(s * (st.scale / st.soft_cap))
  else:
    t = jnp.tanh((s * st.scale + bias) * (1.0 / st.soft_cap))
  return (st.soft_cap * _LOG2E) * t, t


def _scores(ctx: _Ctx, s, *, q0, k0, rows_dim: int, masked: bool, q_offset, slope=None,
            limit=None, q_seg=None, k_seg=None, raw: bool = False, dense=None):
  """Base-2 logits (and the soft-cap's tanh) of a raw ``q . k`` tile whose query rows start at
  ``q0`` along axis ``rows_dim`` and keys at ``k0`` along the other, in the order scale -> ALiBi
  (``slope * (j - (i + q_offset))``) -> soft-cap -> mask.  Only ``masked`` blocks evaluate the
  mask: the band, keys ``>= limit`` (None: no bound) and unequal segment ids (``q_seg`` /
  ``k_seg``: the tile's row and column id vectors).  ``raw`` (no ALiBi, no soft-cap): the tile
  masked but not scaled, for a caller that folds the scale into its exponent (``_folds``).
  ``dense``: the tile of a dense bias (fp32, natural units), added with ALiBi's (a one-row
  bias: the keys' vector, broadcast over the rows); ``st.mask`` (a non-band mask) joins the
  masked blocks' tests (``eval_mask``: compares of the positions); with
  ``st.dense_mask`` the tile of a mask array (1: allowed), and'ed with the others (its run
  table's FULL blocks allow every pair, so ``masked`` still decides)."""
  st = ctx.st
  kd = 1 - rows_dim
  if dense is not None and dense.ndim == 1:  # a one-row bias: the tile's keys' vector
    dense = lax.broadcast_in_dim(dense, s.shape, [kd])
  allowed = None
  if dense is not None and st.dense_mask:   # (FULL blocks of the run table: all allowed)
    allowed, dense = dense > 0.5, None
  if slope is not None or masked:
    q_pos = ctx.iota(s.shape, rows_dim) + (q0 + q_offset)
    k_pos = ctx.iota(s.shape, kd) + k0
  bias = None if slope is None else slope * (k_pos - q_pos).astype(jnp.float32)
  if dense is not None:
    bias = dense if bias is None else bias + dense
  if raw:
    assert bias is None and st.soft_cap is None
    tanh = None
  else:
    s, tanh = _logits(ctx, s, bias)
  if not masked:
    return s, tanh
  ok = None
  for cond in ((k_pos < limit) if limit is not None else None,
               (k_pos >= q_pos - st.left) if st.left is not None else None,
               (k_pos <= q_pos + st.right) if st.right is not None else None,
               (lax.broadcast_in_dim(q_seg, s.shape, [rows_dim])
                == lax.broadcast_in_dim(k_seg, s.shape, [kd])) if q_seg is not None else None,
               eval_mask(st.mask, q_pos, k_pos, 0) if st.mask is not None else None,
               allowed):
    if cond is not None:
      ok = cond if ok is None else ok & cond
  return (s if ok is None else jnp.where(ok, s, -jnp.inf)), tanh


def _folds(st: _Static) -> bool:
  """Whether the forward folds the scale into its exponent (``_scores(raw=True)``): no ALiBi,
  no dense bias (a mask array's tiles are compared, not added), no soft-cap, and a positive
  scale (the max of the raw logits is then the max of the scaled)."""
  return (st.soft_cap is None and not st.alibi and (st.bias is None or st.dense_mask)
          and st.scale > 0)


def _backward_folds(st: _Static) -> tuple[bool, float | None]:
  """``(raw, c)`` of the backward kernels: without ALiBi, a bias or a soft-cap they take raw
  logits and ``p = exp2(s c - lse)`` (one fused multiply-add; no max is taken, so any sign of
  scale)."""
  raw = st.soft_cap is None and not st.alibi and (st.bias is None or st.dense_mask)
  return raw, (st.scale * _LOG2E if raw else None)


def _minus(s, c, x):
  """``s c - x`` (``s - x`` when ``c`` is None: ``s`` already scaled)."""
  return s - x if c is None else s * c - x


def _with_data(band_runs, tab_ref, batch, tile):
  """A consumer's runs: its band runs intersected with row ``tile`` of the data table
  (``[B, R, 4]``: the block range that segment ids / key lengths allow and its FULL run)."""
  if tab_ref is None:
    return band_runs
  lo, hi, f_lo, f_hi = band_runs
  d_lo, d_hi, d_flo, d_fhi = (tab_ref[batch, tile, i] for i in range(4))
  return _runs(lax.max(lo, d_lo), lax.min(hi, d_hi), lax.max(f_lo, d_flo), lax.min(f_hi, d_fhi))


def _union(runs_a, runs_b):
  """``(cta_lo, steps)``: the block range a CTA loads, the smallest holding both consumers'
  non-empty runs (0 steps when both are empty)."""
  i32 = jnp.int32
  (lo_a, hi_a, _, _), (lo_b, hi_b, _, _) = runs_a, runs_b
  e_a, e_b = hi_a <= lo_a, hi_b <= lo_b
  lo = lax.min(jnp.where(e_a, i32(_BIG), lo_a), jnp.where(e_b, i32(_BIG), lo_b))
  hi = lax.max(jnp.where(e_a, i32(0), hi_a), jnp.where(e_b, i32(0), hi_b))
  steps = lax.max(hi - lo, i32(0))
  return jnp.where(steps > 0, lo, i32(0)), steps


def run_table(kinds):
  """``[B, R, 4]`` int32 ``(lo, hi, f_lo, f_hi)`` per row of block kinds ``[B, R, C]``: the
  blocks from the row's first to its last non-EMPTY one, and its FULL run when the row's FULL
  blocks are contiguous (else none: they are evaluated masked, which is exact)."""
  c = kinds.shape[-1]
  i32 = jnp.int32

  def first(m):
    return jnp.argmax(m, axis=-1).astype(i32)

  def end(m):
    return (c - jnp.argmax(m[..., ::-1], axis=-1)).astype(i32)

  some, full = kinds != EMPTY, kinds == FULL
  any_some = some.any(-1)
  lo, hi = jnp.where(any_some, first(some), 0), jnp.where(any_some, end(some), 0)
  f_lo, f_hi = first(full), end(full)
  contiguous = full.any(-1) & (full.sum(-1, dtype=i32) == f_hi - f_lo)
  return jnp.stack([lo, hi, jnp.where(contiguous, f_lo, lo), jnp.where(contiguous, f_hi, lo)],
                   axis=-1).astype(i32)


def list_table(kinds, width: int | None = None):
  """``[B, R/2, 9 + width]`` int32 block lists of kinds ``[B, R, C]`` (``R`` even), one per CTA
  (rows ``2 i`` and ``2 i + 1``: its two consumers' tiles): ``[count, runs of tile 2 i, runs of
  tile 2 i + 1, blocks...]``.  The CTA loads ``count`` blocks, those either tile needs, in
  order (positions past ``count``: 0, never read); each tile's runs ``(lo, hi, f_lo, f_hi)``
  are ``run_table``'s over those positions (a block only the other tile needs, inside a run, is
  evaluated masked: exact).  ``width``: at least the largest count (default ``C``)."""
  i32 = jnp.int32
  width = kinds.shape[-1] if width is None else width
  ka, kb = kinds[:, 0::2], kinds[:, 1::2]
  need = (ka != EMPTY) | (kb != EMPTY)
  count = need.sum(-1, dtype=i32)
  order = jnp.argsort(~need, axis=-1, stable=True)[..., :width].astype(i32)  # needed first
  valid = jnp.arange(width, dtype=i32) < count[..., None]

  def listed(k):  # a tile's kinds at the list's positions
    return jnp.where(valid, jnp.take_along_axis(k, order, axis=-1), EMPTY)

  return jnp.concatenate([count[..., None], run_table(listed(ka)), run_table(listed(kb)),
                          jnp.where(valid, order, 0)], axis=-1).astype(i32)


def _data_table(st: _Static, aux: dict, q_pad: int, kv_pad: int, bq: int, bk: int,
                transpose: bool):
  """The block table of a kernel over ``bq``-row query tiles and ``bk``-key blocks
  (``transpose``: over ``bk``-key tiles and ``bq``-row query blocks): ``list_table``'s lists
  (``st.listed``), else the run table; None without segment ids / key lengths / a mask array
  (whose blocks count over all its heads: EMPTY where none allows a pair, FULL where all allow
  every pair) / a non-band mask."""
  if not st.data:
    return None
  if st.listed:
    return _list_table(st, aux, q_pad, kv_pad, bq, bk, transpose)
  kinds = _data_kinds(st, aux, q_pad, kv_pad, bq, bk)
  return run_table(jnp.swapaxes(kinds, 1, 2) if transpose else kinds)


def _data_kinds(st: _Static, aux: dict, q_pad: int, kv_pad: int, bq: int, bk: int):
  """``[B, q_pad/bq, kv_pad/bk]`` kinds that segment ids, key lengths and a mask array (over all
  its heads) allow (FULL: unconstrained)."""
  kinds = pair_kinds(st.batch, q_pad, kv_pad, bq, bk, aux.get("q_ids"), aux.get("kv_ids"),
                     aux.get("lengths"))
  if st.dense_mask:
    kinds = jnp.minimum(kinds, mask_array_kinds(aux["bias"] > 0, st.batch, q_pad, kv_pad, bq, bk))
  return kinds


def _list_table(st: _Static, aux: dict, q_pad: int, kv_pad: int, bq: int, bk: int,
                transpose: bool):
  """``list_table`` of the position mask's blocks (static) met with the data's (segment ids, key
  lengths, the mask array's over all heads), per batch row; its width the static lists' widest
  (the data only empties blocks)."""
  mask = st.mask
  if mask is None and (st.left is not None or st.right is not None):
    mask = SlidingWindowMask(st.left, st.right)
  static = mask_kinds(mask, st.q_len, st.kv_len, q_pad, kv_pad, st.q_offset, bq, bk)
  kinds = jnp.minimum(jnp.asarray(static)[None], _data_kinds(st, aux, q_pad, kv_pad, bq, bk))
  if transpose:
    static, kinds = static.T, jnp.swapaxes(kinds, 1, 2)
  need = (static[0::2] != EMPTY) | (static[1::2] != EMPTY)
  return list_table(kinds, max(1, int(need.sum(-1).max(initial=0))))


def _data_names(st: _Static) -> tuple[str, ...]:
  """The kernels' inputs after their tensors, in order."""
  return ((("tab",) if st.data else ()) + (("q_offset",) if st.q_offset is None else ())
          + (("slopes",) if st.alibi else ())
          + (("lengths",) if st.lengths else ()) + (("q_ids", "kv_ids") if st.segments else ())
          + (("bias",) if st.bias is not None else ()))


def _data_inputs(st: _Static, aux: dict, tab, q_pad: int, kv_pad: int,
                 transpose: bool = False) -> list:
  vals = dict(aux, tab=tab)
  if st.segments:
    vals["q_ids"], vals["kv_ids"] = pad_edge(aux["q_ids"], q_pad), pad_edge(aux["kv_ids"], kv_pad)
  if st.bias_row:  # [B|1, N|1, Sp] fp32 key vectors (padded keys are masked or dropped)
    b = aux["bias"][:, :, 0].astype(jnp.float32)
    vals["bias"] = jnp.pad(b, ((0, 0), (0, 0), (0, kv_pad - b.shape[2])))
  elif st.bias is not None:  # whole tiles for TMA (padded rows / keys are masked or dropped)
    b = aux["bias"]
    vals["bias"] = jnp.pad(b, ((0, 0), (0, 0), (0, q_pad - b.shape[2]), (0, kv_pad - b.shape[3])))
    if transpose:  # [B|1, N|1, Sp, Tp]: the dK/dV kernel's s^T orientation
      vals["bias"] = jnp.swapaxes(vals["bias"], 2, 3)
  return [vals[name] for name in _data_names(st)]


def _q_offset(st: _Static, refs):
  """The query offset: static, or (``st.q_offset`` None: traced by the caller) read from the
  ``[1]`` input ``q_offset`` by every warpgroup."""
  return st.q_offset if st.q_offset is not None else refs["q_offset"][0]


def _key_limit(st: _Static, refs, batch, always: bool):
  """Keys at or past this index are masked: ``min(kv_lengths[b], S)``, else ``S`` when
  ``always`` (padding keys), else None."""
  if st.lengths:
    return lax.min(refs["lengths"][batch], jnp.int32(st.kv_len))
  return jnp.int32(st.kv_len) if always else None


def _query_cta(st: "_Static", refs, tp: int, bq: int, bk: int, sp: int, index=None):
  """``(tile, head, batch, wg, kv_head, cta_lo, steps, runs, block_of)`` of a kernel over query
  tiles of two consumers' ``bq`` rows (grid ``("q", "heads", "batch")``, or ``index``: a
  persistent CTA's tile number, in the same order); ``runs(r0)``: the runs of the consumer whose
  rows start at ``r0``; ``block_of(s)``: the key block of the CTA's step ``s`` (``_cta_walk``).
  Tiles run last-first: under a causal mask the last tiles see the most keys, and starting them
  first shortens the final wave (as in the Triton kernel)."""
  rows = 2 * bq
  if index is None:
    q_index, head, batch = (lax.axis_index(n) for n in ("q", "heads", "batch"))
  else:  # the grid's order: "q" slowest, then "heads", then "batch"
    per_q = jnp.int32(st.num_heads * st.batch)
    q_index, rest = lax.div(index, per_q), lax.rem(index, per_q)
    head, batch = lax.div(rest, jnp.int32(st.batch)), lax.rem(rest, jnp.int32(st.batch))
  tile = (tp // rows - 1) - q_index
  kv_head = lax.div(head, jnp.int32(st.num_heads // st.num_kv_heads))
  q_offset = _q_offset(st, refs)

  def band_runs(r0):
    return key_blocks(st, r0, bq, bk, sp // bk, q_offset)

  walk = _cta_walk(st, refs, batch, tile, bq, band_runs)
  return (tile, head, batch, lax.axis_index("wg"), kv_head) + walk


def _cta_walk(st: "_Static", refs, batch, tile, bt: int, band_runs):
  """``(cta_lo, steps, runs, block_of)`` of CTA ``tile`` (two consumers' ``bt``-row or -key
  tiles, ``2 tile`` and ``2 tile + 1`` of the table): it loads ``steps`` blocks, step ``s`` block
  ``block_of(s)``; ``runs(x0)`` are the runs of the consumer whose tile starts at ``x0``.  A
  range: ``cta_lo + s`` over the union of the consumers' band runs (``band_runs(x0)``) met with
  the data table; a block list (``st.listed``): row ``tile`` of ``list_table``, its runs over
  list positions (``cta_lo`` 0)."""
  tab = refs.get("tab")
  if st.listed:
    def runs(x0):
      col = 1 + 4 * lax.rem(lax.div(x0, jnp.int32(bt)), jnp.int32(2))
      return tuple(tab[batch, tile, col + i] for i in range(4))
    return jnp.int32(0), tab[batch, tile, 0], runs, lambda s: tab[batch, tile, 9 + s]

  def runs(x0):
    return _with_data(band_runs(x0), tab, batch, lax.div(x0, jnp.int32(bt)))

  cta_lo, steps = _union(runs(2 * bt * tile), runs(2 * bt * tile + bt))
  return cta_lo, steps, runs, lambda s: cta_lo + s


def _persistent_ctas(st: "_Static", n_tiles: int) -> int:
  """CTAs of a persistent forward: one per SM (two when interpreted, so that each walks
  several tiles), at most one per tile."""
  if st.interpret:
    return min(n_tiles, 2)
  sms = getattr(jax.devices()[0], "core_count", None) or 132  # an H100 / H200 has 132
  return min(n_tiles, int(sms))


def _load_resident(wg, *copies):
  """A consumer's tiles that stay for the whole loop: each ``(src, dst, barriers)`` copied by TMA
  to ``barriers[wg]``, then all awaited."""
  for src, dst, bar in copies:
    plgpu.copy_gmem_to_smem(src, dst, bar.at[wg])
  for _, _, bar in copies:
    plgpu.barrier_wait(bar.at[wg])


def _kv_loader(st: "_Static", refs, scratch, batch, kv_head, block_of, bk: int,
               split: bool = False, bias_rows=None):
  """The producer's ``load(t, slot)`` of key block ``block_of(t)``: K, V (and the keys' segment
  ids; with ``bias_rows = (bias batch, bias head, rows)`` the dense bias' tile of those rows and
  keys) by TMA, each to its own ready barrier.  ``split``: ``(load_k, load_v)``, K (with the ids
  and the bias tile) and V as two loads, for rings released separately."""
  def load_k(t, slot):
    keys = pl.ds(block_of(t) * bk, bk)
    plgpu.copy_gmem_to_smem(refs["k"].at[batch, keys, kv_head], scratch["k"].at[slot],
                            scratch["k_ready"].at[slot])
    if st.segments:
      plgpu.copy_gmem_to_smem(refs["kv_ids"].at[batch, keys], scratch["kseg"].at[slot],
                              scratch["kseg_ready"].at[slot])
    if bias_rows is not None:
      bb, nb, rows_ = bias_rows
      src = refs["bias"].at[bb, nb, keys] if st.bias_row else refs["bias"].at[bb, nb, rows_, keys]
      plgpu.copy_gmem_to_smem(src, scratch["bias"].at[slot], scratch["bias_ready"].at[slot])

  def load_v(t, slot):
    keys = pl.ds(block_of(t) * bk, bk)
    plgpu.copy_gmem_to_smem(refs["v"].at[batch, keys, kv_head], scratch["v"].at[slot],
                            scratch["v_ready"].at[slot])

  if split:
    return load_k, load_v

  def load(t, slot):
    load_k(t, slot)
    load_v(t, slot)
  return load


def _shapes(st: "_Static", rows: int, kv_multiple: int):
  return _cdiv(st.q_len, rows) * rows, _cdiv(st.kv_len, kv_multiple) * kv_multiple


def _tiled():
  return (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def _aliased_out_rows(h: int, hv: int, bq: int) -> int | None:
  """Rows ``r`` of the ``[2, r, hv]`` output tiles that share the ``[2, bq, h]`` query tiles'
  bytes when the value heads are narrower (``r hv = bq h``, ``r`` whole 8-row tiles: consumer
  c's output rows then start where its query tile does); None: the output takes the query tiles
  themselves (equal sizes) or needs tiles of its own."""
  if hv >= h or (bq * h) % hv or (bq * h // hv) % 8:
    return None
  return bq * h // hv


def _entry(names: tuple[str, ...], scratch: dict, kernel):
  """The kernel entry: refs by name (inputs, data inputs, outputs), scratch by name."""
  def entry(*refs):
    named = dict(zip(names, refs, strict=True))
    pl.run_scoped(lambda **s: kernel(named, s), collective_axes="wg", **scratch)
  return entry


def _ring_scratch(st: _Static, dtype, stages: int, *, resident: tuple, streamed: tuple) -> dict:
  """Shared memory and barriers of a kernel: each consumer's resident tiles (``2`` of each) and
  the producer's ring (``stages`` of each), every buffer with its ready barriers, plus ``free``
  and the ping-pong ``turn``.  ``resident`` / ``streamed``: ``(name, rows, dtype[, width])``, a
  16-bit ``[rows, width]`` tile (width: ``H`` unless given) when ``dtype`` is None, else a
  ``[rows]`` vector."""
  scratch = dict(free=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
                 turn=plgpu.Barrier(num_arrivals=2))
  for count, buffers in ((2, resident), (stages, streamed)):
    for name, rows, vec_dtype, *width in buffers:
      width = width[0] if width else st.head_dim
      scratch[name] = (plgpu.SMEM((count, rows, width), dtype, transforms=_tiled())
                       if vec_dtype is None else plgpu.SMEM((count, rows), vec_dtype))
      scratch[name + "_ready"] = plgpu.Barrier(num_barriers=count)
  return scratch


def _ids(st: _Static, name: str, rows: int) -> tuple:
  """The segment-id vector buffer ``name`` of a kernel, when the call has segment ids."""
  return ((name, rows, jnp.int32),) if st.segments else ()


def _bias_buffer(st: _Static, rows: int, width: int, keys: int) -> tuple:
  """A kernel's streamed bias buffer: a 16-bit ``[rows, width]`` tile per slot (a bias or mask
  array), or a one-row bias' fp32 vector of the slot's ``keys``; none without."""
  if st.bias is None:
    return ()
  return (("bias", keys, jnp.float32),) if st.bias_row else (("bias", rows, None, width),)


def _bias_part(ctx: _Ctx, scratch, slot, start, size: int, keys: bool = False):
  """This consumer's part of the bias in ``slot`` (None without one): the tile's rows ``start ..
  start + size`` (16-bit, as fp32 in the wgmma layout), or a one-row bias' key vector: all of
  it, or with ``keys`` (the dK/dV kernel, whose consumers own the slot's keys in halves) those
  same entries, laid out along the tile's rows."""
  st = ctx.st
  if st.bias is None:
    return None
  ref = scratch["bias"].at[slot]
  if not st.bias_row:
    return ctx.load_tile(ref.at[pl.ds(start, size)])
  return ctx.load_vec(ref.at[pl.ds(start, size)], 1) if keys else ctx.load_vec(ref, 0)


def _key_ready(st: _Static, scratch) -> tuple:
  return (scratch["k_ready"], scratch["v_ready"]) + (
      (scratch["kseg_ready"],) if st.segments else ()) + (
      (scratch["bias_ready"],) if st.bias is not None else ())


def _query_rows(ctx: _Ctx, refs, scratch, wg, batch, head, rows_, my_tiles):
  """A consumer of a kernel over query tiles loads its resident tiles (``my_tiles``: ``(src,
  dst, barriers)``, plus its rows' segment ids) and returns its data-feature arguments of
  ``_scores`` (the slope, the key limit, the rows' ids)."""
  st = ctx.st
  copies = list(my_tiles)
  if st.segments:
    copies.append((refs["q_ids"].at[batch, rows_], scratch["qseg"].at[wg],
                   scratch["qseg_ready"]))
  _load_resident(wg, *copies)
  return dict(q_offset=_q_offset(st, refs), slope=refs["slopes"][head] if st.alibi else None,
              limit=_key_limit(st, refs, batch, always=True),
              q_seg=ctx.load_vec(scratch["qseg"].at[wg], 1) if st.segments else None)


def _streamed_ids(ctx: _Ctx, scratch, name: str, slot, masked: bool):
  """The segment ids of the streamed block in ``slot`` of buffer ``name`` (a column vector of
  the logit tile), where a masked block needs them."""
  if not (ctx.st.segments and masked):
    return None
  return ctx.load_vec(scratch[name].at[slot], 0)


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _call(st: _Static):
  cfg = st.config
  bq, bk, stages = cfg.block_q, cfg.block_k, cfg.stages
  rows = 2 * bq
  tp, sp = _shapes(st, rows, bk)
  dtype = jnp.dtype(st.dtype)
  h, hv = st.head_dim, st.v_head_dim
  # the output is written into the query's tiles: the same tiles when the head sizes agree,
  # else (value heads narrower) the same bytes seen as ``[bq h / hv, hv]`` tiles (a RefUnion,
  # compiled only: the interpreter takes no aliased refs); tiles of its own otherwise
  alias = None if st.interpret else _aliased_out_rows(h, hv, bq)
  own_out = hv != h and alias is None
  # the plain schedule's ping-pong turns are a rendezvous (``_Ctx.take_turn``); the overlapped
  # schedule's are one-way hand-offs (``handoff``)
  ctx = _Ctx(st, stages, cfg.pingpong and not cfg.overlap)
  fold, c = _folds(st), st.scale * _LOG2E
  handoff = cfg.overlap and cfg.pingpong

  def one_tile(refs, scratch, tile, head, batch, wg, kv_head, cta_lo, steps, runs, block_of,
               t0=None, first_tile=True, last_tile=True):
    """One query tile: the whole kernel, or (``t0``: the K/V ring's step at its first block) one
    tile of a persistent CTA; ``first_tile`` / ``last_tile`` (traced for a persistent CTA): the
    CTA's first and last (the overlapped ping-pong's turns run on from tile to tile)."""
    k_ready, v_ready, turn = (scratch[n] for n in ("k_ready", "v_ready", "turn"))
    free, k_free, v_free = (scratch.get(n) for n in ("free", "k_free", "v_free"))

    @pl.when(wg < 2)
    def _consumer():
      if t0 is None:
        plgpu.set_max_registers(ctx.consumer_regs, action="increase")
      r0 = tile * rows + wg * bq
      q_tiles, o_tiles = scratch["q"] if alias else (scratch["q"], None)
      my_q = q_tiles.at[wg]
      rows_ = pl.ds(r0, bq)
      data = _query_rows(ctx, refs, scratch, wg, batch, head, rows_,
                         [(refs["q"].at[batch, rows_, head], my_q, scratch["q_ready"])])
      if ctx.pingpong:
        pl.when(wg == 1)(lambda: ctx.take_turn(turn))  # consumer 0 goes first

      def wait_k(slot):
        plgpu.barrier_wait(k_ready.at[slot])
        if st.segments:
          plgpu.barrier_wait(scratch["kseg_ready"].at[slot])
        if st.bias is not None:
          plgpu.barrier_wait(scratch["bias_ready"].at[slot])

      def softmax(s, m, l, slot, block, masked):
        """The online softmax of raw logits ``s``: ``(m_new, alpha, l_new, p16)``, the running
        max ``m`` in base-2 logit units.  Without ALiBi or a soft-cap the scale is folded into
        the exponent: the max of the raw tile times ``scale log2(e)``, then ``p = exp2(s c -
        m)``, one fused multiply-add per logit where scaling first takes a multiply and a
        subtraction."""
        dense = _bias_part(ctx, scratch, slot, wg * bq, bq)
        s, _ = _scores(ctx, s, q0=r0, k0=block * bk, rows_dim=0, masked=masked,
                       k_seg=_streamed_ids(ctx, scratch, "kseg", slot, masked), raw=fold,
                       dense=dense, **data)
        m_new = jnp.maximum(m, s.max(axis=1) * c if fold else s.max(axis=1))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no allowed key yet
        alpha = jnp.exp2(m - m_use)
        m_b = lax.broadcast_in_dim(m_use, s.shape, [0])
        p = jnp.exp2(s * c - m_b if fold else s - m_b)
        return m_new, alpha, l * alpha + p.sum(axis=1), p.astype(dtype)

      def compute(t, slot, block, o, carry, masked):
        del t, o
        acc, m, l = carry
        wait_k(slot)
        s = ctx.mm(my_q, scratch["k"].at[slot], (bq, bk), transpose_b=True, turn=turn)
        m_new, alpha, l, p16 = softmax(s, m, l, slot, block, masked)
        plgpu.barrier_wait(v_ready.at[slot])
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        acc = ctx.mm_acc(acc, p16, scratch["v"].at[slot])
        ctx.take_turn(turn)
        ctx.release(free, slot, generic_reads=st.generic_reads)
        return acc, m_new, l

      # -- the overlapped schedule (``Config.overlap``): step j issues ``q k_j^T`` and then
      # ``p_{j-1} v_{j-1}`` as two wgmma groups, waits for the first only and runs block j's
      # softmax while the second runs; the output is rescaled once both are done.  K slots are
      # released as soon as the logits are read, V slots one step later (their own ring).
      # With ping-pong too (FlashAttention-3's full schedule) the consumers hand the tensor
      # cores to each other one way: a consumer waits for its turn (``go[wg]``) before issuing
      # a step's matmuls and passes it on (``go[1 - wg]``) once they are issued, so one's
      # softmax runs while the other's matmuls do.  Every consumer takes ``steps + 1`` turns.
      go = scratch.get("go")

      def my_turn():
        if handoff:
          plgpu.barrier_wait(go.at[wg])

      def pass_turn():
        if handoff:
          plgpu.barrier_arrive(go.at[1 - wg])

      def idle():
        my_turn()
        pass_turn()

      def first(slot, block, carry):
        acc, m, l, _, _ = carry
        wait_k(slot)
        my_turn()
        s = ctx.mm(my_q, scratch["k"].at[slot], (bq, bk), transpose_b=True, turn=pass_turn)
        m, _, l, p16 = softmax(s, m, l, slot, block, True)
        ctx.release(k_free, slot, generic_reads=st.generic_reads)
        return acc, m, l, p16, slot

      def step(slot, block, carry, masked):
        acc, m, l, p16, prev = carry
        wait_k(slot)
        plgpu.barrier_wait(v_ready.at[prev])
        my_turn()
        if ctx.interpret:
          s = ctx.mm(my_q, scratch["k"].at[slot], (bq, bk), transpose_b=True)
          acc = ctx.mm_acc(acc, p16, scratch["v"].at[prev], turn=pass_turn)
          m, alpha, l, p16 = softmax(s, m, l, slot, block, masked)
          ctx.release(k_free, slot, generic_reads=st.generic_reads)
        else:
          def body(refs):
            s_ref, o_ref, m_ref, l_ref, p_ref, alpha_ref = refs
            plgpu.wgmma(s_ref, my_q, scratch["k"].at[slot].transpose((1, 0)))
            plgpu.wgmma(o_ref, p16, scratch["v"].at[prev])
            pass_turn()
            s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # q k^T done, p v may run on
            if not st.generic_reads:
              ctx.release(k_free, slot)
            m_ref[...], alpha_ref[...], l_ref[...], p_ref[...] = softmax(s, m, l, slot, block,
                                                                         masked)
            if st.generic_reads:  # the ids / bias were read from the K slot's ring
              ctx.release(k_free, slot, generic_reads=True)

          _, acc, m, l, p16, alpha = pl.run_state(body)(
              (plgpu.ACC.init(ctx.full((bq, bk), 0.0)), plgpu.ACC.init(acc), m, l, p16, m))
        ctx.release(v_free, prev)
        return acc * lax.broadcast_in_dim(alpha, acc.shape, [0]), m, l, p16, slot

      def last(carry):
        acc, m, l, p16, prev = carry
        plgpu.barrier_wait(v_ready.at[prev])
        my_turn()
        acc = ctx.mm_acc(acc, p16, scratch["v"].at[prev], turn=pass_turn)
        ctx.release(v_free, prev)
        return acc, m, l, p16, prev

      carry = (ctx.full((bq, hv), 0.0), ctx.full((bq,), -jnp.inf), ctx.full((bq,), 0.0))
      if cfg.overlap:
        # Consumer 0 goes first: consumer 1 grants it the CTA's first turn.  On a persistent
        # CTA's later tiles consumer 1's last pass of the previous tile is that grant (a second
        # arrival on go[0] before consumer 0 has seen the first would complete its phase twice).
        if handoff:
          pl.when((wg == 1) & first_tile)(lambda: plgpu.barrier_arrive(go.at[0]))
        carry += (ctx.full((bq, bk), 0.0).astype(dtype), jnp.int32(0))
        acc, m, l, _, _ = ctx.consume_overlapped(
            carry, cta_lo=cta_lo, steps=steps, runs=runs(r0), ready=_key_ready(st, scratch),
            frees=(k_free, v_free), first=first, step=step, last=last,
            idle=idle if handoff else None, t0=t0, block_of=block_of)
        if handoff:  # consumer 1's last pass (the CTA's last tile's: see the grant above)
          pl.when((wg == 0) & last_tile)(lambda: plgpu.barrier_wait(go.at[0]))
      else:
        acc, m, l = ctx.consume(carry, outer=1, cta_lo=cta_lo, steps=steps, runs=runs(r0),
                                ready=_key_ready(st, scratch), free=free, turn=turn,
                                compute=compute, t0=t0, block_of=block_of)
      if ctx.pingpong:
        pl.when(wg == 0)(lambda: ctx.take_turn(turn))  # balance consumer 1's first turn

      ok = l != 0.0  # NaN rows stay NaN (a fully masked row has l == 0)
      inv = jnp.where(ok, 1.0 / jnp.where(ok, l, 1.0), 0.0)
      my_o = (scratch["out"].at[wg] if own_out else
              o_tiles.at[wg].at[pl.ds(0, bq)] if alias else my_q)
      my_o[...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(dtype)
      # the rows' log-sum-exp straight from registers (no shared-memory buffer for it)
      refs["lse"].at[batch, head, rows_][...] = jnp.where(
          ok, (m + jnp.log2(jnp.where(ok, l, 1.0))) * _LN2, -jnp.inf)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(my_o, refs["o"].at[batch, rows_, head])
      # a persistent CTA's next tile may reload the query tile once the store has read it
      plgpu.wait_smem_to_gmem(0, wait_read_only=t0 is not None)

    @pl.when(wg == 2)
    def _producer():
      bias_rows = None
      if st.bias is not None:  # the tile's rows of its (batch row, head) of the bias
        bias_rows = (*st.bias_index(batch, head), pl.ds(tile * rows, rows))
      load = _kv_loader(st, refs, scratch, batch, kv_head, block_of, bk, split=cfg.overlap,
                        bias_rows=bias_rows)
      ctx.produce(steps, (k_free, v_free) if cfg.overlap else free, load, t0=t0)

  n_tiles = (tp // rows) * st.num_heads * st.batch
  ctas = _persistent_ctas(st, n_tiles) if cfg.persistent else None

  def kernel(refs, scratch):
    if not cfg.persistent:
      one_tile(refs, scratch, *_query_cta(st, refs, tp, bq, bk, sp))
      return
    # persistent: CTA c walks tiles c, c + CTAs, ... (``_query_cta``'s order: the last query
    # tiles of every head and batch row first); the ring's step count runs on across them
    wg, cta = lax.axis_index("wg"), lax.axis_index("cta")
    pl.when(wg < 2)(lambda: plgpu.set_max_registers(ctx.consumer_regs, action="increase"))
    pl.when(wg == 2)(lambda: plgpu.set_max_registers(ctx.producer_regs, action="decrease"))

    mine = _cdiv_t(jnp.int32(n_tiles) - cta, ctas)  # >= 1: at most one CTA per tile

    def tile_body(i, t0):
      where = _query_cta(st, refs, tp, bq, bk, sp, index=cta + i * ctas)
      one_tile(refs, scratch, *where, t0=t0, first_tile=i == 0, last_tile=i == mine - 1)
      return t0 + where[6]  # + steps

    total = lax.fori_loop(0, mine, tile_body, jnp.int32(0))
    frees = (scratch["k_free"], scratch["v_free"]) if cfg.overlap else scratch["free"]
    pl.when(wg == 2)(lambda: ctx.drain(total, frees))
    pl.when(wg < 2)(lambda: plgpu.wait_smem_to_gmem(0))  # the last outputs written

  scratch = _ring_scratch(st, dtype, stages, resident=(("q", bq, None),) + _ids(st, "qseg", bq),
                          streamed=(("k", bk, None), ("v", bk, None, hv)) + _ids(st, "kseg", bk)
                          + _bias_buffer(st, rows, bk, bk))
  if own_out:
    scratch["out"] = plgpu.SMEM((2, bq, hv), dtype, transforms=_tiled())
  if alias:  # consumer c's output rows start at consumer c's query tile
    scratch["q"] = plgpu.RefUnion(scratch["q"],
                                  plgpu.SMEM((2, alias, hv), dtype, transforms=_tiled()))
  if cfg.overlap:  # K and V slots are released separately
    del scratch["free"]
    for name in ("k_free", "v_free"):
      scratch[name] = plgpu.Barrier(num_arrivals=2, num_barriers=stages)
    if cfg.pingpong:
      scratch["go"] = plgpu.Barrier(num_arrivals=1, num_barriers=2)
  names = ("q", "k", "v") + _data_names(st) + ("o", "lse")
  grid = ((ctas,), ("cta",)) if cfg.persistent else (
      (tp // rows, st.num_heads, st.batch), ("q", "heads", "batch"))
  call = _launch(st, _entry(names, scratch, kernel),
                 (jax.ShapeDtypeStruct((st.batch, tp, st.num_heads, hv), dtype),
                  jax.ShapeDtypeStruct((st.batch, st.num_heads, tp), jnp.float32)), *grid)

  def run(q, k, v, aux):
    tab = _data_table(st, aux, tp, sp, bq, bk, transpose=False)
    out, lse = call(_pad_seq(q, tp), _pad_seq(k, sp), _pad_seq(v, sp),
                    *_data_inputs(st, aux, tab, tp, sp))
    return out[:, :st.q_len], lse[:, :, :st.q_len]

  return jax.jit(run)


def _pad_seq(x, length: int):
  if x.shape[1] == length:
    return x
  return jnp.pad(x, ((0, 0), (0, length - x.shape[1])) + ((0, 0),) * (x.ndim - 2))


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------


def supports_backward(*, head_dim: int, v_head_dim: int | None = None,
                      config: Config | None = None, bias: bool | str = False) -> str | None:
  """None when the Hopper backward kernels take a call that the forward takes, else why not:
  equal head sizes up to 128 in one dK/dV kernel (``_fused_dkv``), other sizes up to 192 (MLA's
  192 / 128) with dK and dV from kernels of their own; ``bias``: with a dense bias' tiles
  (``"row"``: a one-row bias' vectors)."""
  hv = head_dim if v_head_dim is None else v_head_dim
  if max(head_dim, hv) > 192:
    return (f"head sizes {head_dim} / {hv} (the backward's resident key and value tiles and "
            f"streamed query and output-gradient slots: at most 192)")
  config = config or default_config(head_dim, hv, bias=bias)
  need = backward_smem_bytes(head_dim, config, hv, bias=bias)
  if need > _SMEM_BYTES:
    return (f"{config} needs {need} bytes of shared memory in the backward at head sizes "
            f"{head_dim} / {hv} (at most {_SMEM_BYTES})")
  return None


def backward_smem_bytes(head_dim: int, config: Config, v_head_dim: int | None = None, *,
                        bias: bool | str = False) -> int:
  """Shared memory of the larger backward CTA: two resident 64-row tiles of each of two
  operands (``q`` and ``do``, or ``k`` and ``v``) and ``stages`` slots of the other two (64 rows
  in the dK/dV kernel, ``dq_block_k`` keys in the dQ kernel), head sizes ``H`` and ``Hv``; fp32
  row vectors (``lse``, ``delta``) and segment ids (assumed) in 1 KiB buffers; barriers (the
  dK/dV kernel's: more ready barriers per slot); with ``bias`` a 16-bit bias tile per slot
  (``[128, dq_block_k]`` in the dQ kernel, ``[128 keys, 64 rows]`` of the transposed bias in
  the dK/dV kernel; ``bias="row"``: a one-row bias' fp32 vector of the slot's keys, 128 in the
  dK/dV kernel) and its ready barriers.  ``smem_bytes``' terms."""
  c, hv = config, head_dim if v_head_dim is None else v_head_dim
  rows = _BWD_BLOCK

  def need(streamed: int, vectors: list[int], barriers: int, keys: int) -> int:
    tiles = [2 * 2 * rows * head_dim, 2 * 2 * rows * hv, 2 * c.stages * streamed * head_dim,
             2 * c.stages * streamed * hv]
    if bias == "row":
      vectors = vectors + [4 * c.stages * keys]
      barriers += c.stages
    elif bias:
      tiles.append(2 * c.stages * 2 * rows * streamed)
      barriers += c.stages
    return sum(map(_kib, tiles + vectors)) + 8 * barriers

  # dK/dV: resident k, v (+ ids), streamed q, do, lse, delta (+ ids); dQ: resident q, do, lse,
  # delta (+ ids), streamed k, v (+ ids); barriers: one per buffer and slot, free, the turn
  dkv = need(rows, [4 * 2 * rows] + [4 * c.stages * rows] * 3, 2 * 3 + c.stages * 6 + 1,
             2 * rows)
  dq = need(c.dq_block_k, [4 * 2 * rows] * 3 + [4 * c.stages * c.dq_block_k],
            2 * 5 + c.stages * 4 + 1, c.dq_block_k)
  return max(dkv, dq)


def _fused_dkv(st: "_Static") -> bool:
  """Whether one kernel computes dK and dV (equal head sizes up to 128: both fp32 accumulators
  fit in registers beside the two logit tiles); else two kernels, one accumulator each."""
  return st.head_dim == st.v_head_dim and st.head_dim <= 128


def backward(query, key, value, out, lse, d_out, d_lse=None, *, mask: Mask | None = None,
             scale: float | None = None, q_offset=0,
             logits_soft_cap: float | None = None, alibi_slopes=None, segment_ids=None,
             kv_lengths=None, config: Config | None = None, interpret=None, bias=None,
             mask_array=None):
  """``(dq, dk, dv)`` of ``forward`` from its ``out`` and ``lse`` (FlashAttention-2's backward on
  Hopper: a dQ kernel over query tiles and a dK/dV kernel over key tiles, each a producer and two
  ping-ponging ``wgmma`` consumers; the dK/dV kernel walks the ``G`` query heads of its KV head in
  turn, so GQA gradients are summed in fp32 in the kernel).  ``d_lse``: the cotangent of ``lse``
  (None: zero).  The data arguments and ``bias`` are ``forward``'s (they get no gradient here:
  a bias' is ``ds``, which ``gpu.py`` computes with its own kernel); the dK/dV kernel streams
  the bias transposed (``[B|1, N|1, S, T]``, one XLA transpose) so that its tiles arrive in the
  ``s^T`` orientation; a ``mask_array`` likewise."""
  data = dict(alibi_slopes=alibi_slopes, segment_ids=segment_ids, kv_lengths=kv_lengths,
              q_offset=q_offset)
  data.update(_dense_input("backward", query, bias, mask_array))
  st = _static("backward", query, key, value, mask=mask, scale=scale,
               logits_soft_cap=logits_soft_cap, config=config, interpret=interpret, **data)
  aux = _aux(st, **data)
  delta = jnp.einsum("btnh,btnh->bnt", d_out.astype(jnp.float32), out.astype(jnp.float32))
  if d_lse is not None:
    delta = delta - d_lse.astype(jnp.float32)
  # Base-2 log-sum-exp; rows without keys (-inf) -> +inf, so that p = exp2(s - lse) = 0.
  lse2 = jnp.where(jnp.isfinite(lse), lse * _LOG2E, jnp.inf).astype(jnp.float32)
  d_out = d_out.astype(query.dtype)
  dq = _dq_call(st)(query, key, value, d_out, lse2, delta, aux)
  args = (query, key, value, d_out, lse2, delta, aux)
  if _fused_dkv(st):
    dk, dv = _dkv_call(st)(*args)
  else:  # e.g. 192 / 128: a [64, 192] dK and a [64, 128] dV accumulator do not fit together
    dk, dv = _dkv_call(st, "dk")(*args), _dkv_call(st, "dv")(*args)
  return dq, dk, dv


_BWD_BLOCK = 64  # query rows per consumer and keys per step (dQ); keys per consumer and query
                 # rows per step (dK/dV): two [64, 64] fp32 logit tiles next to the accumulators


def _pad_rows(x, length: int, value: float):  # [B, N, T] vectors
  if x.shape[-1] == length:
    return x
  return jnp.pad(x, ((0, 0), (0, 0), (0, length - x.shape[-1])), constant_values=value)


def _rows(lse2, delta, tp: int):
  """Padded rows: ``lse = +inf`` (p = 0) and ``delta = 0``."""
  return (_pad_rows(lse2, tp, jnp.inf),
          _pad_rows(jnp.where(jnp.isfinite(delta), delta, 0.0), tp, 0.0))


@functools.lru_cache(maxsize=64)
def _dq_call(st: _Static):
  cfg = st.config
  bq, bk = _BWD_BLOCK, cfg.dq_block_k
  stages = cfg.stages
  rows = 2 * bq
  tp, sp = _shapes(st, rows, 2 * _BWD_BLOCK)
  dtype = jnp.dtype(st.dtype)
  h = st.head_dim
  ctx = _Ctx(st, stages, cfg.pingpong)
  raw, c = _backward_folds(st)
  overlap = cfg.overlaps_backward

  def kernel(refs, scratch):
    (tile, head, batch, wg, kv_head, cta_lo, steps, runs,
     block_of) = _query_cta(st, refs, tp, bq, bk, sp)
    k_ready, v_ready, free, turn = (scratch[n] for n in ("k_ready", "v_ready", "free", "turn"))

    @pl.when(wg < 2)
    def _consumer():
      plgpu.set_max_registers(ctx.consumer_regs, action="increase")
      r0 = tile * rows + wg * bq
      my_q, my_do = scratch["q"].at[wg], scratch["do"].at[wg]
      rows_ = pl.ds(r0, bq)
      data = _query_rows(
          ctx, refs, scratch, wg, batch, head, rows_,
          [(refs["q"].at[batch, rows_, head], my_q, scratch["q_ready"]),
           (refs["do"].at[batch, rows_, head], my_do, scratch["do_ready"]),
           (refs["lse"].at[batch, head, rows_], scratch["lse"].at[wg], scratch["lse_ready"]),
           (refs["delta"].at[batch, head, rows_], scratch["delta"].at[wg],
            scratch["delta_ready"])])
      lse = ctx.load_vec(scratch["lse"].at[wg], 1)
      delta = ctx.load_vec(scratch["delta"].at[wg], 1)
      if cfg.pingpong:
        pl.when(wg == 1)(lambda: ctx.take_turn(turn))

      def probs(s, slot, block, masked):
        dense = _bias_part(ctx, scratch, slot, wg * bq, bq)
        s, tanh = _scores(ctx, s, q0=r0, k0=block * bk, rows_dim=0, masked=masked,
                          k_seg=_streamed_ids(ctx, scratch, "kseg", slot, masked), raw=raw,
                          dense=dense, **data)
        return jnp.exp2(_minus(s, c, lax.broadcast_in_dim(lse, s.shape, [0]))), tanh

      def grad_logits(p, tanh, dp):  # 16-bit ds
        ds = p * (dp - lax.broadcast_in_dim(delta, dp.shape, [0]))
        return (ds if tanh is None else ds * (1.0 - tanh * tanh)).astype(dtype)

      def compute(t, slot, block, o, dq, masked):
        del t, o
        plgpu.barrier_wait(k_ready.at[slot])
        if st.segments:
          plgpu.barrier_wait(scratch["kseg_ready"].at[slot])
        if st.bias is not None:
          plgpu.barrier_wait(scratch["bias_ready"].at[slot])
        k_slot, v_slot = scratch["k"].at[slot], scratch["v"].at[slot]
        if overlap:  # q k^T and do v^T in flight together; p computed while do v^T runs
          plgpu.barrier_wait(v_ready.at[slot])
          if ctx.interpret:
            s = ctx.mm(my_q, k_slot, (bq, bk), transpose_b=True)
            dp = ctx.mm(my_do, v_slot, (bq, bk), transpose_b=True, turn=turn)
            ds = grad_logits(*probs(s, slot, block, masked), dp)
          else:
            def body(refs_):
              s_ref, dp_ref, ds_ref = refs_
              plgpu.wgmma(s_ref, my_q, k_slot.transpose((1, 0)))
              plgpu.wgmma(dp_ref, my_do, v_slot.transpose((1, 0)))
              ctx.take_turn(turn)
              p, tanh = probs(plgpu.wgmma_accumulator_load(s_ref, wait_n=1), slot, block, masked)
              ds_ref[...] = grad_logits(p, tanh, plgpu.wgmma_accumulator_load(dp_ref))

            zero = ctx.full((bq, bk), 0.0)
            _, _, ds = pl.run_state(body)(
                (plgpu.ACC.init(zero), plgpu.ACC.init(zero), zero.astype(dtype)))
        else:
          s = ctx.mm(my_q, k_slot, (bq, bk), transpose_b=True, turn=turn)
          p, tanh = probs(s, slot, block, masked)
          plgpu.barrier_wait(v_ready.at[slot])
          ds = grad_logits(p, tanh, ctx.mm(my_do, v_slot, (bq, bk), transpose_b=True))
        dq = ctx.mm_acc(dq, ds, k_slot)
        ctx.take_turn(turn)
        ctx.release(free, slot, generic_reads=st.generic_reads)
        return dq

      dq = ctx.consume(ctx.full((bq, h), 0.0), outer=1, cta_lo=cta_lo, steps=steps,
                       runs=runs(r0), ready=_key_ready(st, scratch), free=free, turn=turn,
                       compute=compute, block_of=block_of)
      if cfg.pingpong:
        pl.when(wg == 0)(lambda: ctx.take_turn(turn))
      my_q[...] = (dq * st.scale).astype(dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(my_q, refs["dq"].at[batch, rows_, head])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _producer():
      bias_rows = None
      if st.bias is not None:  # the tile's rows of its (batch row, head) of the bias
        bias_rows = (*st.bias_index(batch, head), pl.ds(tile * rows, rows))
      ctx.produce(steps, free, _kv_loader(st, refs, scratch, batch, kv_head, block_of, bk,
                                          bias_rows=bias_rows))

  scratch = _ring_scratch(
      st, dtype, stages,
      resident=(("q", bq, None), ("do", bq, None, st.v_head_dim), ("lse", bq, jnp.float32),
                ("delta", bq, jnp.float32)) + _ids(st, "qseg", bq),
      streamed=(("k", bk, None), ("v", bk, None, st.v_head_dim)) + _ids(st, "kseg", bk)
      + _bias_buffer(st, rows, bk, bk))
  names = ("q", "k", "v", "do", "lse", "delta") + _data_names(st) + ("dq",)
  call = _launch(st, _entry(names, scratch, kernel),
                 jax.ShapeDtypeStruct((st.batch, tp, st.num_heads, h), dtype),
                 (tp // rows, st.num_heads, st.batch), ("q", "heads", "batch"))

  def run(q, k, v, do, lse2, delta, aux):
    tab = _data_table(st, aux, tp, sp, bq, bk, transpose=False)
    dq = call(_pad_seq(q, tp), _pad_seq(k, sp), _pad_seq(v, sp), _pad_seq(do, tp),
              *_rows(lse2, delta, tp), *_data_inputs(st, aux, tab, tp, sp))
    return dq[:, :st.q_len]

  return jax.jit(run)


@functools.lru_cache(maxsize=64)
def _dkv_call(st: _Static, part: str = "both"):
  """The dK/dV kernel over key tiles; ``part``: ``"both"`` (``_fused_dkv``), or ``"dk"`` /
  ``"dv"``: one of them (``dv`` skips ``dp`` and ``ds``)."""
  cfg = st.config
  bq = bk = _BWD_BLOCK
  stages = cfg.stages
  keys_per_cta = 2 * bk
  tp, sp = _shapes(st, 2 * _BWD_BLOCK, keys_per_cta)
  dtype = jnp.dtype(st.dtype)
  h, hv = st.head_dim, st.v_head_dim
  groups = st.num_heads // st.num_kv_heads
  ctx = _Ctx(st, stages, cfg.pingpong)
  raw, c = _backward_folds(st)
  overlap = cfg.overlaps_backward

  def kernel(refs, scratch):
    tile = lax.axis_index("k")  # key tiles in order: under a causal mask the first see most rows
    kv_head, batch = lax.axis_index("kv_heads"), lax.axis_index("batch")
    wg = lax.axis_index("wg")
    free, turn = scratch["free"], scratch["turn"]
    q_offset = _q_offset(st, refs)  # read once, not per step

    cta_lo, steps, runs, block_of = _cta_walk(
        st, refs, batch, tile, bk, lambda k0: query_blocks(st, k0, bk, bq, q_offset))

    @pl.when(wg < 2)
    def _consumer():
      plgpu.set_max_registers(ctx.consumer_regs, action="increase")
      k0 = tile * keys_per_cta + wg * bk
      my_k, my_v = scratch["k"].at[wg], scratch["v"].at[wg]
      keys = pl.ds(k0, bk)
      copies = [(refs["k"].at[batch, keys, kv_head], my_k, scratch["k_ready"]),
                (refs["v"].at[batch, keys, kv_head], my_v, scratch["v_ready"])]
      if st.segments:
        copies.append((refs["kv_ids"].at[batch, keys], scratch["kseg"].at[wg],
                       scratch["kseg_ready"]))
      _load_resident(wg, *copies)
      k_seg = ctx.load_vec(scratch["kseg"].at[wg], 1) if st.segments else None
      limit = _key_limit(st, refs, batch, always=False)  # padding keys' gradients are dropped
      if cfg.pingpong:
        pl.when(wg == 1)(lambda: ctx.take_turn(turn))

      # the step's other streamed buffers: the rows' ids, the transposed bias tile
      streamed_extra = (("qseg",) if st.segments else ()) + (
          ("bias",) if st.bias is not None else ())

      def probs(s, slot, block, o, masked):
        """``(p^T, tanh)`` of the raw logits ``s^T`` of query block ``block``."""
        slope = refs["slopes"][kv_head * groups + o] if st.alibi else None
        q_seg = _streamed_ids(ctx, scratch, "qseg", slot, masked)
        dense = _bias_part(ctx, scratch, slot, wg * bk, bk, keys=True)
        s, tanh = _scores(ctx, s, q0=block * bq, k0=k0, rows_dim=1, masked=masked,
                          q_offset=q_offset, slope=slope,
                          limit=limit, q_seg=q_seg, k_seg=k_seg, raw=raw, dense=dense)
        lse = ctx.load_vec(scratch["lse"].at[slot], 0)
        return jnp.exp2(_minus(s, c, lax.broadcast_in_dim(lse, s.shape, [1]))), tanh

      def grad_logits(p, dp, tanh, slot):
        """``ds^T`` (16-bit) from ``p^T`` and ``dp^T``."""
        delta = ctx.load_vec(scratch["delta"].at[slot], 0)
        ds = p * (dp - lax.broadcast_in_dim(delta, dp.shape, [1]))
        return (ds if tanh is None else ds * (1.0 - tanh * tanh)).astype(dtype)

      def unpack(carry):
        """``(dk, dv)`` from the ``part``-shaped carry (None for the one not computed)."""
        return {"both": carry, "dk": (carry, None), "dv": (None, carry)}[part]

      def pack(dk, dv):
        return {"both": (dk, dv), "dk": dk, "dv": dv}[part]

      def compute(t, slot, block, o, carry, masked):
        """One step, its matmuls issued in turn: ``dv += p^T do`` and ``dk += ds^T q`` (both,
        or with ``part`` the one; ``carry`` holds what is computed)."""
        del t
        dk, dv = unpack(carry)
        for name in ("q", "lse") + streamed_extra:
          plgpu.barrier_wait(scratch[name + "_ready"].at[slot])
        q_slot, do_slot = scratch["q"].at[slot], scratch["do"].at[slot]
        s = ctx.mm(my_k, q_slot, (bk, bq), transpose_b=True, turn=turn)  # s^T
        p, tanh = probs(s, slot, block, o, masked)
        for name in ("do", "delta"):
          plgpu.barrier_wait(scratch[name + "_ready"].at[slot])
        if dv is not None:
          dv = ctx.mm_acc(dv, p.astype(dtype), do_slot)
        if dk is not None:
          dp = ctx.mm(my_v, do_slot, (bk, bq), transpose_b=True)  # dp^T
          dk = ctx.mm_acc(dk, grad_logits(p, dp, tanh, slot), q_slot)
        ctx.take_turn(turn)
        ctx.release(free, slot, generic_reads=True)
        return pack(dk, dv)

      def compute_overlapped(t, slot, block, o, carry, masked):
        """``compute`` with its matmuls in flight together (``Config.backward_overlap``):
        ``s^T`` and ``dp^T`` are issued at once and ``p^T`` computed while ``dp^T`` runs, then
        ``dv += p^T do`` is issued and ``ds^T`` computed while it runs, then ``dk += ds^T q``
        (the dK kernel of unequal sizes, ``part="dk"``: no ``dv``, ``ds^T`` once ``dp^T`` is
        done)."""
        del t
        dk, dv = unpack(carry)  # (part "dv" never overlaps: no dp^T)
        for name in ("q", "lse", "do", "delta") + streamed_extra:
          plgpu.barrier_wait(scratch[name + "_ready"].at[slot])
        q_slot, do_slot = scratch["q"].at[slot], scratch["do"].at[slot]
        if ctx.interpret:
          s = ctx.mm(my_k, q_slot, (bk, bq), transpose_b=True)
          dp = ctx.mm(my_v, do_slot, (bk, bq), transpose_b=True, turn=turn)
          p, tanh = probs(s, slot, block, o, masked)
          if dv is not None:
            dv = ctx.mm_acc(dv, p.astype(dtype), do_slot)
          dk = ctx.mm_acc(dk, grad_logits(p, dp, tanh, slot), q_slot)
        else:
          def body(refs_):
            s_ref, dp_ref, dk_ref, *dv_ref = refs_
            plgpu.wgmma(s_ref, my_k, q_slot.transpose((1, 0)))
            plgpu.wgmma(dp_ref, my_v, do_slot.transpose((1, 0)))
            ctx.take_turn(turn)
            s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # s^T done, dp^T may run on
            p, tanh = probs(s, slot, block, o, masked)
            if dv_ref:
              plgpu.wgmma(dv_ref[0], p.astype(dtype), do_slot)
            dp = plgpu.wgmma_accumulator_load(dp_ref, wait_n=len(dv_ref))  # dv may run on
            plgpu.wgmma(dk_ref, grad_logits(p, dp, tanh, slot), q_slot)

          zero = ctx.full((bk, bq), 0.0)
          accs = (plgpu.ACC.init(zero), plgpu.ACC.init(zero), plgpu.ACC.init(dk)) + (
              () if dv is None else (plgpu.ACC.init(dv),))
          _, _, dk, *dv = pl.run_state(body)(accs)
          dv = dv[0] if dv else None
        ctx.take_turn(turn)
        ctx.release(free, slot, generic_reads=True)
        return pack(dk, dv)

      ready = tuple(scratch[n + "_ready"] for n in ("q", "do", "lse", "delta") + streamed_extra)
      walk = dict(outer=groups, cta_lo=cta_lo, steps=steps, runs=runs(k0), ready=ready,
                  free=free, turn=turn, block_of=block_of)
      # the dV kernel has no dp^T to overlap: its matmuls are issued in turn
      step = compute_overlapped if overlap and part != "dv" else compute
      if part == "both":
        dk, dv = ctx.consume((ctx.full((bk, h), 0.0), ctx.full((bk, hv), 0.0)), **walk,
                             compute=step)
      else:
        dk = dv = ctx.consume(ctx.full((bk, h if part == "dk" else hv), 0.0), **walk,
                              compute=step)
      if cfg.pingpong:
        pl.when(wg == 0)(lambda: ctx.take_turn(turn))
      if part in ("both", "dk"):
        my_k[...] = (dk * st.scale).astype(dtype)
      if part in ("both", "dv"):
        my_v[...] = dv.astype(dtype)
      plgpu.commit_smem()
      if part in ("both", "dk"):
        plgpu.copy_smem_to_gmem(my_k, refs["dk"].at[batch, keys, kv_head])
      if part in ("both", "dv"):
        plgpu.copy_smem_to_gmem(my_v, refs["dv"].at[batch, keys, kv_head])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _producer():
      def load(t, slot):
        g = lax.div(t, steps)
        head = kv_head * groups + g
        rows_ = pl.ds(block_of(t - g * steps) * bq, bq)
        for name, src in (("q", refs["q"].at[batch, rows_, head]),
                          ("lse", refs["lse"].at[batch, head, rows_]),
                          ("do", refs["do"].at[batch, rows_, head]),
                          ("delta", refs["delta"].at[batch, head, rows_])):
          plgpu.copy_gmem_to_smem(src, scratch[name].at[slot], scratch[name + "_ready"].at[slot])
        if st.segments:
          plgpu.copy_gmem_to_smem(refs["q_ids"].at[batch, rows_], scratch["qseg"].at[slot],
                                  scratch["qseg_ready"].at[slot])
        if st.bias is not None:  # [CTA's keys, rows] of the transposed bias (a row: keys)
          cta_keys = pl.ds(tile * keys_per_cta, keys_per_cta)
          src = refs["bias"].at[(*st.bias_index(batch, head), cta_keys)
                                + (() if st.bias_row else (rows_,))]
          plgpu.copy_gmem_to_smem(src, scratch["bias"].at[slot],
                                  scratch["bias_ready"].at[slot])

      ctx.produce(groups * steps, free, load)

  scratch = _ring_scratch(
      st, dtype, stages,
      resident=(("k", bk, None), ("v", bk, None, hv)) + _ids(st, "kseg", bk),
      streamed=(("q", bq, None), ("do", bq, None, hv), ("lse", bq, jnp.float32),
                ("delta", bq, jnp.float32)) + _ids(st, "qseg", bq)
      + _bias_buffer(st, keys_per_cta, bq, keys_per_cta))
  outs = {"both": ("dk", "dv")}.get(part, (part,))
  names = ("q", "k", "v", "do", "lse", "delta") + _data_names(st) + outs
  shapes = {n: jax.ShapeDtypeStruct((st.batch, sp, st.num_kv_heads, h if n == "dk" else hv),
                                    dtype) for n in outs}
  call = _launch(st, _entry(names, scratch, kernel), tuple(shapes[n] for n in outs),
                 (sp // keys_per_cta, st.num_kv_heads, st.batch), ("k", "kv_heads", "batch"))

  def run(q, k, v, do, lse2, delta, aux):
    tab = _data_table(st, aux, tp, sp, bq, bk, transpose=True)
    got = call(_pad_seq(q, tp), _pad_seq(k, sp), _pad_seq(v, sp), _pad_seq(do, tp),
               *_rows(lse2, delta, tp), *_data_inputs(st, aux, tab, tp, sp, transpose=True))
    got = tuple(x[:, :st.kv_len] for x in got)
    return got if part == "both" else got[0]

  return jax.jit(run)
