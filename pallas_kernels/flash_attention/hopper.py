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
* softmax in base 2 with ``log2(e)`` folded into the scale (``exp2`` is one ``ex2.approx``), the
  running max and sum in the wgmma row layout.

Masks are band masks, evaluated from positions: no mask, causal, sliding windows (``left`` /
``right``), their conjunctions, with a static query offset; plus the zero-padding of ragged
lengths and the logit soft-cap.  Per consumer the key blocks split into runs:
``[skip | masked | full | masked | skip]``: FULL blocks never evaluate the mask and blocks outside
the band are not computed (a consumer still waits for and releases them, which keeps the
mbarrier phases of the two consumers in step).  The CTA loads only the union of its two consumers'
runs.  Data masks (segment ids, per-row lengths), ALiBi and fp32 inputs are the Triton kernel's
(``supports`` says which); the backward is the Triton kernels' (they take this forward's
log-sum-exp unchanged).

Tested on CPU with Mosaic GPU's interpreter (threads, barriers and TMA simulated, races detected),
lowered for CUDA in tests (``jax.export``); speed only on a Hopper GPU
(``experiments/device_check.sh``).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxattn.ops.masks import AndMask, CausalMask, FullMask, Mask, SlidingWindowMask

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
_PRODUCER_REGS = 40
_CONSUMER_REGS = 232


@dataclasses.dataclass(frozen=True)
class Config:
  """Tiles and switches of the Hopper kernel (speed only; results agree to rounding).

  block_q: query rows per consumer warpgroup (a CTA holds two: ``2 * block_q`` rows); 64 is one
    wgmma M tile.  block_k: keys per step (a multiple of 64).  stages: K/V slots in shared memory
    (>= 2).  pingpong: consumers alternate on the tensor cores (one's softmax overlaps the
    other's matmuls).
  """

  block_q: int = 64
  block_k: int = 128
  stages: int = 2
  pingpong: bool = True

  def __post_init__(self):
    if self.block_q != 64:
      raise ValueError(f"hopper.Config: `block_q` must be 64 (one wgmma tile per consumer), got "
                       f"{self.block_q!r}.")
    if self.block_k < 64 or self.block_k % 64:
      raise ValueError(f"hopper.Config: `block_k` must be a positive multiple of 64, got "
                       f"{self.block_k!r}.")
    if self.stages < 2:
      raise ValueError(f"hopper.Config: `stages` must be >= 2, got {self.stages!r}.")


def band(mask: Mask | None) -> tuple[bool, int | None, int | None]:
  """``(ok, left, right)``: whether ``mask`` is a band ``p - left <= j <= p + right`` (None:
  unbounded on that side), and its reach."""
  if mask is None or isinstance(mask, FullMask):
    return True, None, None
  if isinstance(mask, CausalMask):
    return True, None, 0
  if isinstance(mask, SlidingWindowMask):
    return True, mask.left, mask.right
  if isinstance(mask, AndMask):
    ok_a, la, ra = band(mask.a)
    ok_b, lb, rb = band(mask.b)
    pick = lambda x, y: y if x is None else x if y is None else min(x, y)  # noqa: E731
    return ok_a and ok_b, pick(la, lb), pick(ra, rb)
  return False, None, None


_SMEM_BYTES = 227 * 1024  # shared memory one H100 / H200 CTA may hold


def smem_bytes(head_dim: int, config: Config) -> int:
  """Shared memory of one CTA: two query / output tiles, ``stages`` key and value slots (16-bit),
  the log-sum-exp rows and the barriers."""
  c = config
  return 2 * (2 * c.block_q * head_dim + 2 * c.stages * c.block_k * head_dim) + 8 * c.block_q + 256


def default_config(head_dim: int) -> Config:
  """128-key steps up to head size 128; 64 at 256 (two 128 x 256 slots would not fit)."""
  return Config(block_k=128 if head_dim <= 128 else 64)


def supports(*, dtype, head_dim: int, v_head_dim: int, static_mask, static_q_offset,
             has_alibi: bool, has_segments: bool, has_lengths: bool,
             config: Config | None = None) -> str | None:
  """None when the Hopper kernel runs this call, else the reason it does not."""
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"dtype {jnp.dtype(dtype).name} (the wgmma path takes bfloat16 / float16)"
  if head_dim != v_head_dim or head_dim not in (64, 128, 256):
    return f"head sizes {head_dim} / {v_head_dim} (equal, one of 64 / 128 / 256)"
  if not band(static_mask)[0]:
    return f"mask {type(static_mask).__name__} (band masks only)"
  if static_q_offset is None:
    return "a traced q_offset"
  if has_alibi or has_segments or has_lengths:
    return "ALiBi / segment ids / per-row lengths"
  config = config or default_config(head_dim)
  if smem_bytes(head_dim, config) > _SMEM_BYTES:
    return (f"{config} needs {smem_bytes(head_dim, config)} bytes of shared memory at head size "
            f"{head_dim} (at most {_SMEM_BYTES})")
  return None


@dataclasses.dataclass(frozen=True)
class _Static:
  batch: int
  q_len: int
  kv_len: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  dtype: str
  left: int | None
  right: int | None
  q_offset: int
  scale: float
  soft_cap: float | None
  config: Config
  interpret: object


def forward(query, key, value, *, mask: Mask | None = None, scale: float | None = None,
            q_offset: int = 0, logits_soft_cap: float | None = None,
            config: Config | None = None, interpret=None):
  """``(out [B, T, N, H], lse [B, N, T] fp32, natural log)`` of band-masked attention.

  ``query [B, T, N, H]``, ``key`` / ``value [B, S, K, H]`` in bf16 or fp16 (``N`` a multiple of
  ``K``); rows without an allowed key give 0 and ``lse = -inf``.  ``interpret``: None runs the
  hardware, or pass ``plgpu.InterpretParams`` / True to run Mosaic GPU's interpreter on CPU.
  """
  b, t, n, h = query.shape
  s, kh = key.shape[1], key.shape[2]
  config = config or default_config(h)
  reason = supports(dtype=query.dtype, head_dim=h, v_head_dim=value.shape[3], static_mask=mask,
                    static_q_offset=q_offset, has_alibi=False, has_segments=False,
                    has_lengths=False, config=config)
  if reason is not None:
    raise ValueError(f"hopper.forward: unsupported call: {reason}.")
  if n % kh:
    raise ValueError(f"hopper.forward: query heads {n} must be a multiple of key heads {kh}.")
  if key.shape != (b, s, kh, h) or value.shape != key.shape or key.dtype != query.dtype or (
      value.dtype != query.dtype):
    raise ValueError(f"hopper.forward: key {key.shape} {key.dtype} and value {value.shape} "
                     f"{value.dtype} must both be [B={b}, S, K, H={h}] in {query.dtype}.")
  if interpret is True:
    interpret = plgpu.InterpretParams() if hasattr(plgpu, "InterpretParams") else _interpret_params()
  _, left, right = band(mask)
  st = _Static(batch=b, q_len=t, kv_len=s, num_heads=n, num_kv_heads=kh, head_dim=h,
               dtype=jnp.dtype(query.dtype).name, left=left, right=right, q_offset=int(q_offset),
               scale=float(h ** -0.5 if scale is None else scale),
               soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
               config=config, interpret=interpret or None)
  return _call(st)(query, key, value)


def _interpret_params():
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  return InterpretGPUParams()


def _kernel(body, **kwargs):
  """``plgpu.kernel`` with ``out_type`` (``out_shape`` on jax versions before the rename)."""
  try:
    return plgpu.kernel(body, **kwargs)
  except TypeError:
    kwargs["out_shape"] = kwargs.pop("out_type")
    return plgpu.kernel(body, **kwargs)


def _cdiv(a, b):
  return -(-a // b)


@functools.lru_cache(maxsize=64)
def _call(st: _Static):
  cfg = st.config
  bq, bk, stages = cfg.block_q, cfg.block_k, cfg.stages
  rows = 2 * bq
  tp, sp = _cdiv(st.q_len, rows) * rows, _cdiv(st.kv_len, bk) * bk
  dtype = jnp.dtype(st.dtype)
  h = st.head_dim
  groups = st.num_heads // st.num_kv_heads
  scale2 = st.scale * _LOG2E  # logits in base 2
  i32 = jnp.int32

  def key_range(r0, nrows):
    """Key blocks ``[lo, hi)`` that rows ``r0 .. r0 + nrows - 1`` may see, and the FULL run
    ``[f_lo, f_hi)`` inside it (every key of the block allowed for every row)."""
    p0 = r0 + st.q_offset  # position of the first row
    p1 = p0 + nrows - 1
    lo = i32(0) if st.left is None else lax.div(lax.max(p0 - st.left, i32(0)), i32(bk))
    hi_key = i32(st.kv_len) if st.right is None else lax.clamp(i32(0), p1 + st.right + 1,
                                                                 i32(st.kv_len))
    hi = lax.div(hi_key + (bk - 1), i32(bk))
    hi = lax.max(hi, lo)
    # FULL: first key >= p1 - left, last key <= p0 + right, and no padding key.
    f_lo = lo if st.left is None else lax.max(lax.div(p1 - st.left + bk - 1, i32(bk)), lo)
    full_end = i32(st.kv_len) if st.right is None else lax.clamp(i32(0), p0 + st.right + 1,
                                                                   i32(st.kv_len))
    f_hi = lax.min(lax.div(full_end, i32(bk)), hi)
    f_lo = lax.min(f_lo, hi)
    f_hi = lax.max(f_hi, f_lo)
    return lo, hi, f_lo, f_hi

  def cast(x, layout):  # Mosaic GPU's interpreter runs without register layouts
    return x if st.interpret else plgpu.layout_cast(x, layout)

  def iota(dim):
    x = lax.broadcasted_iota(i32, (bq, bk), dim)
    return cast(x, plgpu.Layout.WGMMA)

  def kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, q_smem, k_smem, v_smem, lse_smem, q_ready,
             k_ready, v_ready, free, turn):
    # Query tiles last-first: under a causal mask the last tiles see the most keys, and starting
    # them first shortens the final wave (as in the Triton kernel).
    tile = (tp // rows - 1) - lax.axis_index("q")
    head, batch = lax.axis_index("heads"), lax.axis_index("batch")
    wg = lax.axis_index("wg")
    kv_head = lax.div(head, i32(groups))
    cta_lo, cta_hi, _, _ = key_range(tile * rows, rows)
    steps = cta_hi - cta_lo

    def take_turn():
      if cfg.pingpong:
        plgpu.barrier_arrive(turn)
        plgpu.barrier_wait(turn)

    @pl.when(wg < 2)
    def _consumer():
      plgpu.set_max_registers(_CONSUMER_REGS, action="increase")
      r0 = tile * rows + wg * bq
      lo, hi, f_lo, f_hi = key_range(r0, bq)
      my_q = q_smem.at[wg]
      plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(r0, bq), head], my_q, q_ready.at[wg])
      plgpu.barrier_wait(q_ready.at[wg])

      row_layout = plgpu.Layout.WGMMA.reduce(1)
      m = cast(jnp.full((bq,), -jnp.inf, jnp.float32), row_layout)
      l = cast(jnp.full((bq,), 0.0, jnp.float32), row_layout)
      acc = cast(jnp.full((bq, h), 0.0, jnp.float32), plgpu.Layout.WGMMA)
      if cfg.pingpong:
        pl.when(wg == 1)(take_turn)  # consumer 0 goes first

      def skip(step, carry):
        slot = lax.rem(step, stages)
        plgpu.barrier_wait(k_ready.at[slot])
        plgpu.barrier_wait(v_ready.at[slot])
        plgpu.barrier_arrive(free.at[slot])
        take_turn()
        take_turn()
        return carry

      def compute(step, carry, masked):
        acc, m, l = carry
        slot = lax.rem(step, stages)
        block = cta_lo + step
        plgpu.barrier_wait(k_ready.at[slot])

        def qk(acc_ref):
          plgpu.wgmma(acc_ref, my_q, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
          take_turn()  # the other consumer may issue its matmuls now
          return acc_ref[...]

        if st.interpret:  # the interpreter's wgmma takes no transposed or register operands
          s = lax.dot_general(my_q[...], k_smem[slot], (((1,), (1,)), ((), ())),
                              preferred_element_type=jnp.float32)
          take_turn()
        else:
          s = pl.run_scoped(qk, plgpu.ACC((bq, bk), jnp.float32))
        if st.soft_cap is not None:
          cap = st.soft_cap
          s = (cap * _LOG2E) * jnp.tanh(s * (st.scale / cap))
        else:
          s = s * scale2
        if masked:
          q_pos = iota(0) + (r0 + st.q_offset)
          k_pos = iota(1) + block * bk
          ok = k_pos < st.kv_len
          if st.left is not None:
            ok = ok & (k_pos >= q_pos - st.left)
          if st.right is not None:
            ok = ok & (k_pos <= q_pos + st.right)
          s = jnp.where(ok, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no allowed key yet
        alpha = jnp.exp2(m - m_use)
        p = jnp.exp2(s - lax.broadcast_in_dim(m_use, s.shape, [0]))
        l = l * alpha + p.sum(axis=1)
        p16 = p.astype(dtype)
        plgpu.barrier_wait(v_ready.at[slot])

        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        if st.interpret:
          acc = acc + jnp.dot(p16, v_smem[slot], preferred_element_type=jnp.float32)
        else:  # accumulate in place: the output tile is the wgmma accumulator (one fp32 tile)
          def pv(acc_ref):
            plgpu.wgmma(acc_ref, p16, v_smem.at[slot])

          acc = pl.run_state(pv)(plgpu.ACC.init(acc))
        take_turn()
        plgpu.barrier_arrive(free.at[slot])
        return acc, m_new, l

      carry = (acc, m, l)
      a, b_, c, d = lo - cta_lo, f_lo - cta_lo, f_hi - cta_lo, hi - cta_lo
      lax.fori_loop(0, a, skip, None)
      carry = lax.fori_loop(a, b_, functools.partial(compute, masked=True), carry)
      carry = lax.fori_loop(b_, c, functools.partial(compute, masked=False), carry)
      carry = lax.fori_loop(c, d, functools.partial(compute, masked=True), carry)
      lax.fori_loop(d, steps, skip, None)
      acc, m, l = carry
      if cfg.pingpong:
        pl.when(wg == 0)(take_turn)  # balance consumer 1's first turn

      ok = l > 0.0
      inv = jnp.where(ok, 1.0 / jnp.where(ok, l, 1.0), 0.0)
      my_q[...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(dtype)
      lse_smem.at[wg][...] = jnp.where(ok, (m + jnp.log2(jnp.where(ok, l, 1.0))) * _LN2, -jnp.inf)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(my_q, o_ref.at[batch, pl.ds(r0, bq), head])
      plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[batch, head, pl.ds(r0, bq)])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _producer():
      plgpu.set_max_registers(_PRODUCER_REGS, action="decrease")

      def load(step, slot):
        keys = pl.ds((cta_lo + step) * bk, bk)
        plgpu.copy_gmem_to_smem(k_ref.at[batch, keys, kv_head], k_smem.at[slot], k_ready.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[batch, keys, kv_head], v_smem.at[slot], v_ready.at[slot])

      @pl.loop(0, lax.min(steps, i32(stages)))
      def _prologue(step):
        load(step, step)

      @pl.loop(stages, lax.max(steps, i32(stages)))
      def _steady(step):
        slot = lax.rem(step, stages)
        plgpu.barrier_wait(free.at[slot])  # both consumers are done with block step - stages
        load(step, slot)

      @pl.loop(lax.max(steps - stages, i32(0)), steps)
      def _drain(step):  # observe every phase of `free` (no barrier left mid-phase at exit)
        plgpu.barrier_wait(free.at[lax.rem(step, stages)])

  def entry(q_ref, k_ref, v_ref, o_ref, lse_ref):
    transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    pl.run_scoped(
        lambda *scratch: kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *scratch),
        plgpu.SMEM((2, bq, h), dtype, transforms=transforms),
        plgpu.SMEM((stages, bk, h), dtype, transforms=transforms),
        plgpu.SMEM((stages, bk, h), dtype, transforms=transforms),
        plgpu.SMEM((2, bq), jnp.float32),
        plgpu.Barrier(num_barriers=2),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        plgpu.Barrier(num_arrivals=2),
        collective_axes="wg",
    )

  call = _kernel(
      entry,
      out_type=(jax.ShapeDtypeStruct((st.batch, tp, st.num_heads, h), dtype),
                jax.ShapeDtypeStruct((st.batch, st.num_heads, tp), jnp.float32)),
      grid=(tp // rows, st.num_heads, st.batch),
      grid_names=("q", "heads", "batch"),
      num_threads=3,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=st.interpret,
  )

  def run(q, k, v):
    if tp != st.q_len:
      q = jnp.pad(q, ((0, 0), (0, tp - st.q_len), (0, 0), (0, 0)))
    if sp != st.kv_len:
      k = jnp.pad(k, ((0, 0), (0, sp - st.kv_len), (0, 0), (0, 0)))
      v = jnp.pad(v, ((0, 0), (0, sp - st.kv_len), (0, 0), (0, 0)))
    out, lse = call(q, k, v)
    return out[:, :st.q_len], lse[:, :, :st.q_len]

  return jax.jit(run)
