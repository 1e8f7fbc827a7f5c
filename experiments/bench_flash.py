"""Flash attention: the Pallas kernels against the platform's attention baseline and matmul peak.

What it measures depends on the default JAX backend:

* GPU: the Pallas GPU kernel (``implementation="pallas_gpu"``) against
  ``jax.nn.dot_product_attention(implementation="cudnn")``, bf16, causal and not, for each
  sequence length; TFLOP/s of useful work and its share of a bf16 matmul's rate measured in the
  same run.
* TPU: the Pallas TPU kernel against ``jax.nn.dot_product_attention`` (XLA), the same columns.
* CPU: the memory-efficient XLA path (``implementation="xla_chunked"``) against
  ``jax.nn.dot_product_attention``, fp32, with peak memory; the Pallas kernels only run
  interpreted on CPU, which says nothing about speed.  Automatic dispatch on CPU picks the native
  ``implementation="cpu"`` kernel instead (``xla_chunked`` only where it cannot be built): that
  one is timed by ``experiments.bench_attention``.

Columns: best-of-``--repeats`` wall time per call of the compiled function (each round queues
enough calls to last ~10 ms, up to 50: ``timing.best_time(inner="auto")``, so host dispatch and
sync do not weigh on short calls); useful TFLOP/s (forward: ``2 B N (H + h) * pairs``, where
``pairs`` is ``T S`` or, causal, ``T (T + 1) / 2``; forward + backward: 3.5x that, the
FlashAttention-2 accounting); ``speedup`` = baseline time / our time (> 1: ours is faster);
``% peak`` = our TFLOP/s / the matmul's (timed the same way); peak memory (temp + arguments +
outputs from ``compiled.memory_analysis()``).  ``--check`` first compares outputs and gradients
with the formula on the accelerator (a correctness smoke test that needs no pytest); a case that
raises prints ``FAIL (<error>)`` and the others still run, then the benchmark (exit status 1).

    python -m experiments.bench_flash                                    # platform defaults
    python -m experiments.bench_flash --seq-lens 2048 4096 8192 16384 --backward
    python -m experiments.bench_flash --seq-lens 1024 2048 --no-plot
    python -m experiments.bench_flash --dense bias --backward   # a learned dense bias, both sides
    python -m experiments.bench_flash --dense bias --backward --shared-bias atomic  # its gradient
                                                                # by atomic adds (GPU)
    python -m experiments.bench_flash --roofline     # the TPU table of docs/performance.md
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from experiments.timing import (AUTO, best_time, compile_timed, error_text, matmul_rate,
                                peak_bytes)
from jaxattn.ops.attention import dot_product_attention
from pallas_kernels.flash_attention import BlockSizes

try:
  from tqdm import tqdm
except ImportError:  # tqdm is optional
  tqdm = None


def _platform() -> str:
  p = jax.default_backend()
  return "gpu" if p in ("gpu", "cuda", "rocm") else p


def attention_flops(b, t, s, n, h, hv, causal, backward, pairs=None) -> float:
  """Matmul flops of attention over ``pairs`` (query, key) pairs (default: causal or all)."""
  if pairs is None:
    pairs = t * (t + 1) / 2 if causal and t == s else t * s
  fwd = 2.0 * b * n * (h + hv) * pairs
  return fwd * (3.5 if backward else 1.0)


SINKS = 4  # --dense sinks: attention sinks (the first keys) ...


def sinks_window(t: int) -> int:
  """... beside a causal window of ``max(128, T / 8)`` keys."""
  return max(128, t // 8)


def sinks_mask(t: int):
  """``--dense sinks``' mask as the library's position mask (block-sparse: the kernels load a
  row's sinks' block and its window's, not those between)."""
  from jaxattn.ops import masks as M  # noqa: PLC0415
  return M.CausalMask() & (M.sliding_window(sinks_window(t))
                           | M.GlobalTokensMask(tuple(range(SINKS))))


def sinks_pairs(t: int) -> int:
  """Allowed (query, key) pairs of ``sinks_mask(t)``: row p sees ``min(p, W) + 1`` window keys
  and the sinks before its window."""
  p = np.arange(t, dtype=np.int64)
  w = sinks_window(t)
  return int((np.minimum(p, w) + 1 + np.clip(p - w, 0, SINKS)).sum())


def _make(kind, causal, backward, dense="none"):
  """The function timed for one implementation: forward, or forward + backward (grads of sum),
  of ``(q, k, v, extra)``: ``extra`` is the dense input of ``--dense`` (None for "none"), given
  to both implementations alike (``bias``: learned, so forward + backward differentiates it;
  ``sinks``: the baseline gets the boolean array, ours the position mask it came from)."""
  def dense_kwargs(extra):
    return {"none": {}, "bias": {"bias": extra}}.get(dense, {"mask": extra})

  if kind == "ours":
    impl = {"gpu": "pallas_gpu", "tpu": "pallas_tpu", "cpu": "xla_chunked"}[_platform()]

    def fwd(q, k, v, extra):
      if dense == "sinks":
        return dot_product_attention(q, k, v, mask=sinks_mask(q.shape[1]), implementation=impl)
      return dot_product_attention(q, k, v, is_causal=causal, implementation=impl,
                                   **dense_kwargs(extra))
  else:
    impl = "cudnn" if _platform() == "gpu" else "xla"

    def fwd(q, k, v, extra):
      return jax.nn.dot_product_attention(q, k, v, is_causal=causal and dense != "sinks",
                                          implementation=impl, **dense_kwargs(extra))

  if not backward:
    return fwd
  argnums = (0, 1, 2, 3) if dense == "bias" else (0, 1, 2)
  return jax.grad(lambda q, k, v, extra: jnp.sum(fwd(q, k, v, extra).astype(jnp.float32)),
                  argnums=argnums)


def dense_input(kind: str, b: int, t: int, heads: int, dtype, seed: int):
  """``--dense``'s extra input: a T5-style bias shared over the batch ``[1, N, T, T]`` (in the
  activations' dtype), a key-padding mask ``[B, 1, 1, T]`` hiding each row's last eighth
  ("mask"), or the Flax mask of the same padding ``[B, 1, T, T]`` ("flax-mask":
  ``make_attention_mask`` of queries and keys, so padded queries see nothing), or ``[1, 1, T,
  T]`` of ``sinks_mask`` ("sinks")."""
  if kind == "none":
    return None
  if kind == "sinks":
    return jnp.asarray(sinks_mask(t).dense(t, t))[None, None]
  if kind == "bias":
    return jax.random.normal(jax.random.key(seed), (1, heads, t, t), jnp.float32).astype(dtype)
  valid = jnp.arange(t) < t - t // 8
  if kind == "flax-mask":
    return jnp.broadcast_to(valid[:, None] & valid[None, :], (b, 1, t, t))
  return jnp.broadcast_to(valid, (b, 1, 1, t))


def run_benchmark(args) -> list[dict]:
  platform = _platform()
  dtype = jnp.dtype(args.dtype or ("float32" if platform == "cpu" else "bfloat16"))
  seq_lens = args.seq_lens or ([1024, 2048, 4096] if platform == "cpu"
                               else [2048, 4096, 8192, 16384])
  peak_size = args.matmul_size or (2048 if platform == "cpu" else 8192)
  # TFLOP/s on accelerators, GFLOP/s on CPU.
  unit, uname = (1e9, "GFLOP/s") if platform == "cpu" else (1e12, "TFLOP/s")
  peak = matmul_rate(peak_size, dtype, args.repeats) / unit
  base_name = {"gpu": "cudnn", "tpu": "jax.nn (XLA)", "cpu": "jax.nn (XLA)"}[platform]
  ours_name = {"gpu": "pallas_gpu", "tpu": "pallas_tpu", "cpu": "xla_chunked"}[platform]
  if platform == "gpu":
    from pallas_kernels.flash_attention import gpu as gpu_kernel  # noqa: PLC0415
    opts = gpu_kernel.get_options()
    sm90 = gpu_kernel.hopper_device_reason() is None
    passes = [opts["forward"]] + ([opts["backward"]] if args.backward else [])
    if any(o == "hopper" or (o == "auto" and sm90) for o in passes):
      ours_name = "pallas_gpu/hopper"
  print(f"platform={platform} device={jax.devices()[0].device_kind} jax={jax.__version__} "
        f"dtype={dtype.name} heads={args.heads}/{args.kv_heads} head_dim={args.head_dim}"
        f"{f'/{args.v_head_dim}' if args.v_head_dim != args.head_dim else ''} "
        f"tokens/batch={args.tokens} {'fwd+bwd' if args.backward else 'fwd'}"
        f"{'' if args.dense == 'none' else f' dense={args.dense}'}")
  print(f"matmul peak ({peak_size}^3, {dtype.name}): {peak:.1f} {uname}")
  print(f"{'T':>6} {'causal':>6} {'B':>3} | {ours_name + ' ms':>15} {uname:>8} {'% peak':>7} "
        f"{'mem MiB':>8} | {base_name + ' ms':>17} {uname:>8} {'mem MiB':>8} | {'speedup':>7}")
  # (the sinks' mask is causal: one row per length)
  jobs = [(t, c) for t in seq_lens for c in ((True,) if args.dense == "sinks" else (False, True))]
  it = tqdm(jobs, desc="bench_flash", leave=False, file=sys.stderr) if tqdm else jobs
  rows = []
  for t, causal in it:
    b = max(1, args.tokens // t)
    ks = jax.random.split(jax.random.key(t), 3)
    q = jax.random.normal(ks[0], (b, t, args.heads, args.head_dim), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (b, t, args.kv_heads, args.head_dim), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (b, t, args.kv_heads, args.v_head_dim),
                          jnp.float32).astype(dtype)
    extra = dense_input(args.dense, b, t, args.heads, dtype, t + 1)
    flops = attention_flops(b, t, t, args.heads, args.head_dim, args.v_head_dim, causal,
                            args.backward, sinks_pairs(t) if args.dense == "sinks" else None)
    row = {"T": t, "causal": causal, "B": b}
    for kind in ("ours", "base"):
      try:
        compiled, _ = compile_timed(_make(kind, causal, args.backward, args.dense), q, k, v,
                                    extra)
        sec = best_time(compiled, (q, k, v, extra), args.repeats, inner=AUTO)
        row[kind] = (sec, flops / sec / unit, peak_bytes(compiled) / 2**20)
      except Exception as e:  # a baseline may not support a shape (e.g. cuDNN limits): say why
        row[kind] = None
        row[kind + "_error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]}"
    rows.append(row)
    ours, base = row["ours"], row["base"]
    fmt = lambda r: (f"{r[0] * 1e3:15.2f} {r[1]:8.1f}" if r else f"{'n/a':>15} {'':>8}")  # noqa
    line = f"{t:>6} {str(causal):>6} {b:>3} | {fmt(ours)} "
    line += f"{100 * ours[1] / peak:6.1f}% {ours[2]:8.0f} | " if ours else f"{'':>7} {'':>8} | "
    line += (f"{base[0] * 1e3:17.2f} {base[1]:8.1f} {base[2]:8.0f} | " if base
             else f"{'n/a':>17} {'':>8} {'':>8} | ")
    line += f"{base[0] / ours[0]:6.2f}x" if (ours and base) else "     -"
    print(line, flush=True)
    for kind in ("ours", "base"):
      if row.get(kind + "_error"):
        print(f"       {kind}: {row[kind + '_error']}")
  _goal(rows, peak, platform, args)
  if args.plot:
    _plot(rows, peak, ours_name, base_name, uname, args.plot)
  return rows


def _goal(rows, peak, platform, args):
  if platform == "cpu":
    last = [r for r in rows if r["causal"] and r["ours"] and r["base"]]
    if last:
      r = last[-1]
      print(f"goal (CPU, causal T={r['T']}): {r['base'][0] / r['ours'][0]:.2f}x jax.nn time, "
            f"{r['base'][2] / r['ours'][2]:.1f}x less memory")
    return
  at = [r for r in rows if r["T"] == 8192 and r["ours"]]
  for r in at:
    share = r["ours"][1] / peak
    vs = (r["base"][0] / r["ours"][0]) if r["base"] else float("nan")
    ok = share >= 0.6 and (vs >= 1.0 or math.isnan(vs))
    print(f"goal (T=8192, causal={r['causal']}, {'fwd+bwd' if args.backward else 'fwd'}): "
          f"{100 * share:.0f}% of matmul peak (>= 60%), {vs:.2f}x the baseline (>= 1): "
          f"{'MET' if ok else 'NOT MET'}")


def _plot(rows, peak, ours_name, base_name, uname, path):
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib not installed: no plot")
    return
  fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
  for ax, causal in zip(axes, (False, True)):
    sel = [r for r in rows if r["causal"] == causal]
    ts = [r["T"] for r in sel]
    for kind, name in (("ours", ours_name), ("base", base_name)):
      ax.plot(ts, [r[kind][1] if r[kind] else np.nan for r in sel], marker="o", label=name)
    ax.axhline(peak, color="gray", ls="--", label="matmul peak")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length T")
    ax.set_title("causal" if causal else "full")
    ax.legend()
  axes[0].set_ylabel(uname)
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  print(f"plot: {path}")


# ----------------------------------------------------------------------------------------------
# TPU roofline on paper (docs/performance.md)
# ----------------------------------------------------------------------------------------------

# Public chip specifications (Cloud TPU documentation): bf16 peak FLOP/s, HBM bytes/s.
TPU_SPECS = {"v5e": (197e12, 819e9), "v6e": (918e12, 1638e9)}


def forward_step_intensity(block_q, block_k, head_dim, v_head_dim, itemsize, seq_k,
                           bias_itemsize=0):
  """FLOP per HBM byte of the TPU forward kernel over one query block's row of ``seq_k`` keys:
  every step fetches a ``[block_k, H]`` key and ``[block_k, h]`` value block (and, with a dense
  bias of ``bias_itemsize`` bytes, a ``[block_q, block_k]`` bias block); the query block, the
  output and the lane-replicated fp32 lse block move once per row."""
  steps = seq_k // block_k
  flops = 2.0 * block_q * seq_k * (head_dim + v_head_dim)
  moved = steps * block_k * (head_dim + v_head_dim) * itemsize
  moved += steps * block_q * block_k * bias_itemsize
  moved += block_q * (head_dim + v_head_dim) * itemsize + block_q * 128 * 4
  return flops / moved


def backward_intensities(block_q, block_k, head_dim, v_head_dim, itemsize, seq):
  """(dQ kernel, dK/dV kernel) FLOP per HBM byte over one row of the grid."""
  h, hv = head_dim, v_head_dim
  # dQ: per step k, v blocks; s = q k^T, dp = do v^T, dq += ds k: 3 matmuls.
  steps = seq // block_k
  flops = 2.0 * block_q * seq * (2 * h + hv)
  moved = steps * block_k * (h + hv) * itemsize + block_q * (h + 2 * hv) * itemsize \
      + 2 * block_q * 128 * 4 + block_q * h * 4
  dq = flops / moved
  # dK/dV: per step q, do blocks and the sublane-replicated lse and delta rows; 4 matmuls.
  steps = seq // block_q
  flops = 2.0 * block_k * seq * (2 * h + 2 * hv)
  moved = steps * (block_q * (h + hv) * itemsize + 2 * 8 * block_q * 4) \
      + block_k * (h + hv) * (itemsize + 4)
  return dq, flops / moved


def shared_bias_gradient_intensity(block_q, block_k, head_dim, v_head_dim, itemsize,
                                   bias_itemsize, shared):
  """FLOP per HBM byte of the TPU kernel for a shared bias' gradient (a row per query), summing
  ``shared`` (batch row, head) pairs per output block: every step fetches q, do, k, v and the
  lse / delta rows (2 matmuls: s and dp); the bias block is read and the gradient block written
  once per ``shared`` steps."""
  flops = 2.0 * block_q * block_k * (head_dim + v_head_dim)
  moved = (block_q + block_k) * (head_dim + v_head_dim) * itemsize + 2 * 8 * block_q * 4
  moved += 2 * block_q * block_k * bias_itemsize / shared
  return flops / moved


def _bound_cells(intensity) -> list[str]:
  """Per TPU chip: compute- or memory-bound at this FLOP/B, and the attainable share of peak."""
  cells = []
  for peak, bw in TPU_SPECS.values():
    frac = min(1.0, intensity * bw / peak)
    cells.append(f"{'compute' if frac >= 1 else 'memory'} {100 * frac:5.0f}%")
  return cells


def print_roofline(head_dim=128, seq=8192, itemsize=2):
  from pallas_kernels.flash_attention import tpu  # noqa: PLC0415
  print(f"TPU forward kernel, H = h = {head_dim}, {'bf16' if itemsize == 2 else 'fp32'}, "
        f"S = {seq}; ridge = peak / bandwidth:")
  for chip, (peak, bw) in TPU_SPECS.items():
    print(f"  {chip}: {peak / 1e12:.0f} TFLOP/s, {bw / 1e9:.0f} GB/s, ridge {peak / bw:.0f} FLOP/B")
  print(f"{'block_q':>7} {'block_k':>7} | {'FLOP/B fwd':>10} {'dQ':>6} {'dK/dV':>6} | "
        f"{'VMEM MiB fwd':>12} {'dQ':>5} {'dK/dV':>5} | "
        + " ".join(f"{c + ' fwd bound':>16}" for c in TPU_SPECS))
  for bq, bk in ((128, 128), (256, 256), (256, 512), (512, 512), (1024, 512), (1024, 1024),
                 (2048, 512)):
    i_f = forward_step_intensity(bq, bk, head_dim, head_dim, itemsize, seq)
    i_dq, i_dkv = backward_intensities(bq, bk, head_dim, head_dim, itemsize, seq)
    vmem = [f(bq, bk, head_dim, head_dim, itemsize) / 2**20
            for f in (tpu.vmem_bytes_forward, tpu.vmem_bytes_dq, tpu.vmem_bytes_dkv)]
    cells = _bound_cells(i_f)  # attainable share of peak (roofline) in the forward
    print(f"{bq:>7} {bk:>7} | {i_f:>10.0f} {i_dq:>6.0f} {i_dkv:>6.0f} | {vmem[0]:>12.1f} "
          f"{vmem[1]:>5.1f} {vmem[2]:>5.1f} | " + " ".join(f"{c:>16}" for c in cells))
  # A dense bias adds a [block_q, block_k] block to every step: the intensity tends to
  # 2 (H + h) / bias_itemsize however large the blocks (the bias is read once per head).
  print("with a dense bias or boolean mask array (forward; read once per query head):")
  print(f"{'block_q':>7} {'block_k':>7} {'bias':>5} | {'FLOP/B fwd':>10} | "
        + " ".join(f"{c + ' fwd bound':>16}" for c in TPU_SPECS))
  for bq, bk in ((512, 512), (1024, 512)):
    for name, size in (("bf16", 2), ("fp32", 4), ("mask", 1)):  # mask: a bool array, as int8
      i_f = forward_step_intensity(bq, bk, head_dim, head_dim, itemsize, seq, bias_itemsize=size)
      print(f"{bq:>7} {bk:>7} {name:>5} | {i_f:>10.0f} | "
            + " ".join(f"{c:>16}" for c in _bound_cells(i_f)))
  # A learned bias shared over the batch / heads (T5's [1, N, T, S]): its gradient kernel sums
  # `shared` (batch row, head) pairs per block in VMEM (2 extra matmuls per pair and block).
  print("gradient of a shared bf16 bias [1, N, T, S] (its own kernel, summing the batch rows):")
  print(f"{'block_q':>7} {'block_k':>7} {'rows':>5} | {'FLOP/B':>10} {'VMEM MiB':>8} | "
        + " ".join(f"{c + ' bound':>16}" for c in TPU_SPECS))
  for bq, bk in ((512, 512), (1024, 512)):
    vmem = tpu.vmem_bytes_dbias(bq, bk, head_dim, head_dim, itemsize, 2, 2, rows=True) / 2**20
    for shared in (2, 8, 32):
      i_b = shared_bias_gradient_intensity(bq, bk, head_dim, head_dim, itemsize, 2, shared)
      print(f"{bq:>7} {bk:>7} {shared:>5} | {i_b:>10.0f} {vmem:>8.1f} | "
            + " ".join(f"{c:>16}" for c in _bound_cells(i_b)))


# ----------------------------------------------------------------------------------------------
# Correctness smoke test on the accelerator (no pytest needed)
# ----------------------------------------------------------------------------------------------


def run_check() -> bool:
  """Kernel vs formula (outputs and gradients) for a few feature mixes, on the default device."""
  from jaxattn.ops import masks as M  # noqa: PLC0415
  from pallas_kernels.flash_attention import flash_attention_gpu, flash_attention_tpu  # noqa

  platform = _platform()
  kernel = {"gpu": flash_attention_gpu, "tpu": flash_attention_tpu}.get(platform)
  if kernel is None:
    print("check: no accelerator; the kernels are tested in interpret mode by tests/kernels/")
    return True
  blocks = BlockSizes.gpu() if platform == "gpu" else BlockSizes(128, 128, 128, 128)
  ok = True
  cases = [
      ("bf16 causal GQA", jnp.bfloat16, (2, 1000, 8, 2, 128), dict(is_causal=True), 3e-2),
      ("bf16 window+segments+alibi+softcap", jnp.bfloat16, (2, 777, 4, 4, 64),
       dict(local_window_size=100, segments=True, alibi=True, logits_soft_cap=20.0), 3e-2),
      ("fp32 padding, offset", jnp.float32, (2, 300, 4, 1, 64),
       dict(is_causal=True, kv_lengths=True, q_offset=0), 1e-2),  # TF32 matmuls on GPU
      ("bf16 causal window+softcap+offset, H=64", jnp.bfloat16, (2, 1500, 8, 1, 64),
       dict(is_causal=True, local_window_size=300, logits_soft_cap=30.0, q_offset=40), 3e-2),
  ]
  if platform == "gpu":
    from pallas_kernels.flash_attention import gpu as gpu_kernel  # noqa: PLC0415
    opts = gpu_kernel.get_options()
    print(f"check: GPU kernels forward={opts['forward']} backward={opts['backward']} (bf16 "
          "band-mask cases run the Hopper ones when set on an sm_90 GPU; the rest take Triton's)")

  def check_case(name, dtype, b, t, n, kh, h, kw, tol) -> bool:
    ks = jax.random.split(jax.random.key(7), 3)
    q = jax.random.normal(ks[0], (b, t, n, h), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (b, t, kh, h), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (b, t, kh, h), jnp.float32).astype(dtype)
    ref_kw = {key: val for key, val in kw.items() if key not in ("segments", "alibi", "kv_lengths")}
    if kw.get("segments"):
      ref_kw["segment_ids"] = jnp.asarray(np.arange(t)[None, :].repeat(b, 0) * 3 // t, jnp.int32)
    if kw.get("alibi"):
      ref_kw["alibi_slopes"] = jnp.asarray(0.5 ** np.arange(1, n + 1), jnp.float32)
    if kw.get("kv_lengths"):
      ref_kw["kv_lengths"] = jnp.asarray([t, t // 3], jnp.int32)
    mask = M.make_mask(is_causal=ref_kw.get("is_causal", False),
                       local_window_size=ref_kw.get("local_window_size"),
                       segment_ids=ref_kw.get("segment_ids"), kv_lengths=ref_kw.get("kv_lengths"))

    def ours(q, k, v):
      return kernel(q, k, v, mask, alibi_slopes=ref_kw.get("alibi_slopes"),
                    logits_soft_cap=ref_kw.get("logits_soft_cap"),
                    q_offset=ref_kw.get("q_offset", 0), block_sizes=blocks)

    def ref(q, k, v):
      f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
      return dot_product_attention(f32(q), f32(k), f32(v), implementation="xla", **ref_kw)

    def with_grads(f):
      def g(q, k, v):
        out, vjp = jax.vjp(f, q, k, v)
        return (out,) + vjp(jnp.cos(out.astype(jnp.float32)).astype(out.dtype))
      return jax.jit(g)

    got = with_grads(ours)(q, k, v)
    want = with_grads(ref)(q, k, v)
    errs = []
    for x, y in zip(got, want):
      x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
      errs.append(float(np.max(np.abs(x - y))) / max(1.0, float(np.max(np.abs(y)))))
    passed = all(e <= tol for e in errs) and not any(np.isnan(np.asarray(x, np.float32)).any()
                                                      for x in got)
    print(f"check {name}: max err out/dq/dk/dv = "
          + " ".join(f"{e:.2e}" for e in errs) + f" (tol {tol:g}) {'PASS' if passed else 'FAIL'}",
          flush=True)
    return passed

  for name, dtype, (b, t, n, kh, h), kw, tol in cases:
    try:
      passed = check_case(name, dtype, b, t, n, kh, h, kw, tol)
    except Exception as e:  # one case's compile or run error must not stop the others
      passed = False
      print(f"check {name}: FAIL ({error_text(e)})", flush=True)
    ok &= passed
  print(f"check: {'PASS' if ok else 'FAIL'}", flush=True)
  return bool(ok)


SWEEP_CONFIGS = (  # (block_q, block_k, num_warps, num_stages) of the GPU forward kernel
    (128, 64, 4, 3), (128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3))
SWEEP_BWD_CONFIGS = (  # (block_q_dkv, block_k_dkv, num_warps, num_stages), dQ and dK/dV kernels
    (64, 64, 4, 3), (64, 64, 8, 2), (32, 64, 4, 3), (32, 128, 4, 3), (32, 128, 8, 3),
    (64, 128, 8, 2))
SWEEP_OPTIONS = (  # code-generation switches of pallas_kernels.flash_attention.gpu
    {"exp": "exp", "affine": False, "reverse": False},
    {"exp": "exp2", "affine": False, "reverse": False},
    {"exp": "ex2asm", "affine": False, "reverse": False},
    {"exp": "ex2asm", "affine": True, "reverse": False},
    {"exp": "ex2asm", "affine": True, "reverse": True},
    {"exp": "exp2", "affine": True, "reverse": True})  # the default (last)


HOPPER_SWEEP = (  # hopper.Config settings of the Hopper (Mosaic GPU) forward kernel timed by
    # --sweep: schedules plain (the default), overlap (intra-warpgroup pipelining), pingpong
    # (turns between the consumers), both (overlap + one-way turns: FlashAttention-3's schedule)
    dict(block_k=128), dict(block_k=128, overlap=True), dict(block_k=128, overlap=True,
                                                             pingpong=True),
    dict(block_k=128, overlap=True, registers=240),
    dict(block_k=128, overlap=True, pingpong=True, registers=240),
    # larger steps and deeper rings (they fit since the log-sum-exp rows left shared memory)
    dict(block_k=192, overlap=True), dict(block_k=128, stages=3, overlap=True),
    # persistent CTAs (one per SM, one K/V ring across their tiles)
    dict(block_k=128, overlap=True, persistent=True),
    dict(block_k=128, pingpong=True), dict(block_k=64), dict(block_k=64, overlap=True),
    dict(block_k=64, overlap=True, pingpong=True), dict(block_k=64, stages=3, overlap=True),
    dict(block_k=192), dict(block_k=192, overlap=True, pingpong=True, registers=240),
    dict(block_k=128, stages=3), dict(block_k=128, persistent=True),
    dict(block_k=128, overlap=True, pingpong=True, registers=240, persistent=True))

HOPPER_BWD_SWEEP = (  # the same, forward + backward (--sweep --backward): the backward kernels'
    # own switch (backward_overlap: a step's matmuls in flight together; default = overlap)
    dict(block_k=128), dict(block_k=128, backward_overlap=True), dict(block_k=128, overlap=True),
    dict(block_k=128, overlap=True, backward_overlap=False),
    dict(block_k=128, overlap=True, registers=240), dict(block_k=128, pingpong=True),
    dict(block_k=128, pingpong=True, backward_overlap=True),
    # the dQ kernel at 128 keys per step (wider wgmma, half the hand-overs)
    dict(block_k=128, dq_block_k=128), dict(block_k=128, overlap=True, dq_block_k=128))


def hopper_label(cfg, backward: bool = False) -> str:
  """``bk=128 stages=2 overlap+pingpong regs=232`` (schedule ``plain`` without either); with
  ``backward``, `` bwd=overlap`` or `` bwd=plain`` (the backward kernels' schedule) and the dQ
  kernel's keys per step (`` dq_bk=128``) too."""
  schedule = "+".join(n for n in ("overlap", "pingpong", "persistent") if getattr(cfg, n)) or (
      "plain")
  label = f"bk={cfg.block_k:>3} stages={cfg.stages} {schedule:27} regs={cfg.registers}"
  if backward:
    label += f" bwd={'overlap' if cfg.overlaps_backward else 'plain':7} dq_bk={cfg.dq_block_k}"
  return label


def _time_jax_mgpu(q, k, v, causal, flops, base, peak, repeats):
  """JAX's own Hopper flash attention (Pallas on Mosaic GPU, FlashAttention-3 style:
  ``jax.experimental.pallas.ops.gpu.attention_mgpu``), forward, as a second reference point."""
  try:
    from jax.experimental.pallas.ops.gpu import attention_mgpu  # noqa: PLC0415
    config = attention_mgpu.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2,
                                         causal=causal)
    fn = lambda q, k, v: attention_mgpu.attention(q, k, v, config)  # noqa: E731
    # jax 0.11.2's kernel refused bf16 on an H200 ("src had type bfloat16 and dst had type
    # float16"): it is timed on fp16 copies of the inputs (the same work).
    args = tuple(x.astype(jnp.float16) for x in (q, k, v))
    sec = best_time(compile_timed(fn, *args)[0], args, repeats, inner=AUTO)
  except Exception as e:  # not in every JAX build, or the GPU is not a Hopper
    print(f"    jax attention_mgpu: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:100]}")
    return
  rate = flops / sec / 1e12
  print(f"    jax attention_mgpu (fp16, block_q 64, block_kv 128): {sec * 1e3:7.2f} ms {rate:6.1f} "
        f"TFLOP/s {100 * rate / peak:5.1f}% peak {base / sec:5.2f}x cudnn", flush=True)


def _sweep_hopper(q, k, v, mask, causal, flops, base, timed, rows, saved, backward=False,
                  first=None):
  """The Hopper forward (``gpu.set_options(forward="hopper")``) at each ``HOPPER_SWEEP`` config;
  with ``backward``, forward + backward (both passes on the Hopper kernels) at each
  ``HOPPER_BWD_SWEEP`` config."""
  from pallas_kernels.flash_attention import flash_attention_gpu, hopper  # noqa: PLC0415
  from pallas_kernels.flash_attention import gpu as gpu_kernel  # noqa: PLC0415

  for settings in (HOPPER_BWD_SWEEP if backward else HOPPER_SWEEP)[:first]:
    cfg = hopper.Config(**settings)
    if hopper.smem_bytes(q.shape[-1], cfg, v.shape[-1], segments=False) > hopper._SMEM_BYTES:
      continue
    try:
      gpu_kernel.set_options(**{**saved, "forward": "hopper", "hopper": cfg,
                                "backward": "hopper" if backward else saved["backward"]})
      fn = lambda q, k, v: flash_attention_gpu(q, k, v, mask)  # noqa: E731
      if backward:
        fn = jax.grad(lambda q, k, v, f=fn: jnp.sum(f(q, k, v).astype(jnp.float32)),
                      argnums=(0, 1, 2))
      got = timed(f"hopper{' fwd+bwd' if backward else ''} {hopper_label(cfg, backward)}", fn,
                  flops, base)
    finally:
      gpu_kernel.set_options(**saved)
    if got:
      rows.append(dict(causal=causal, backward=backward, forward="hopper",
                       **{f"hopper_{k}": x for k, x in dataclasses.asdict(cfg).items()},
                       ms=got[0] * 1e3, tflops=got[1],
                       vs_cudnn=base / got[0]))


def run_sweep(args) -> list[dict]:
  """GPU kernels' block sizes and code-generation switches at one length: TFLOP/s of each
  (block_q, block_k, warps, stages, switches), causal and not, against the same-run matmul peak
  and cuDNN; with ``--backward`` the forward + backward of the causal case too."""
  from jaxattn.ops import masks as M  # noqa: PLC0415
  from pallas_kernels.flash_attention import flash_attention_gpu  # noqa: PLC0415
  from pallas_kernels.flash_attention import gpu as gpu_kernel  # noqa: PLC0415

  if _platform() != "gpu":
    print("sweep: GPU only")
    return []
  dtype = jnp.dtype(args.dtype or "bfloat16")
  t = args.sweep
  b = max(1, args.tokens // t)
  peak = matmul_rate(args.matmul_size or 8192, dtype, args.repeats) / 1e12
  ks = jax.random.split(jax.random.key(t), 3)
  shape_q = (b, t, args.heads, args.head_dim)
  shape_kv = (b, t, args.kv_heads, args.head_dim)
  q = jax.random.normal(ks[0], shape_q, jnp.float32).astype(dtype)
  k = jax.random.normal(ks[1], shape_kv, jnp.float32).astype(dtype)
  v = jax.random.normal(ks[2], shape_kv[:3] + (args.v_head_dim,), jnp.float32).astype(dtype)
  print(f"sweep T={t} B={b} heads={args.heads}/{args.kv_heads} head_dim={args.head_dim}/"
        f"{args.v_head_dim} "
        f"{dtype.name}; matmul peak {peak:.1f} TFLOP/s")
  saved = gpu_kernel.get_options()
  rows = []

  def timed(label, fn, flops, base):
    try:
      sec = best_time(compile_timed(fn, q, k, v)[0], (q, k, v), args.repeats, inner=AUTO)
    except Exception as e:  # a config may not fit (shared memory, registers): say why
      print(f"    {label}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:100]}",
            flush=True)
      return None
    rate = flops / sec / 1e12
    print(f"    {label}: {sec * 1e3:7.2f} ms {rate:6.1f} TFLOP/s {100 * rate / peak:5.1f}% peak "
          f"{base / sec:5.2f}x cudnn", flush=True)
    return sec, rate

  passes = [(c, False) for c in (False, True)] + ([(True, True)] if args.backward else [])
  if args.backward_only:
    passes = [(True, True)]
  try:
    for causal, backward in passes:
      flops = attention_flops(b, t, t, args.heads, args.head_dim, args.v_head_dim, causal,
                              backward)
      try:
        base = best_time(compile_timed(_make("base", causal, backward), q, k, v, None)[0],
                         (q, k, v, None), args.repeats, inner=AUTO)
        print(f"  causal={causal} {'fwd+bwd' if backward else 'fwd'}: cudnn {base * 1e3:.2f} ms "
              f"{flops / base / 1e12:.1f} TFLOP/s", flush=True)
      except Exception as e:  # cuDNN may refuse a shape (head sizes): ratios become nan
        base = math.nan
        print(f"  causal={causal} {'fwd+bwd' if backward else 'fwd'}: cudnn n/a ({error_text(e)})",
              flush=True)
      if not backward:
        _time_jax_mgpu(q, k, v, causal, flops, base, peak, args.repeats)
      mask = M.make_mask(is_causal=causal)
      if backward:
        configs = [(128, 64, bqd, bkd, w, st) for bqd, bkd, w, st in SWEEP_BWD_CONFIGS]
        options = [SWEEP_OPTIONS[-1], {**SWEEP_OPTIONS[-1], "dq": "atomic"}]
        if "hopper" in args.sweep_kernels:
          _sweep_hopper(q, k, v, mask, causal, flops, base, timed, rows, saved, backward=True,
                        first=args.hopper_first)
      else:
        configs = [(bq, bk, 64, 64, w, st) for bq, bk, w, st in SWEEP_CONFIGS]
        options = SWEEP_OPTIONS if args.sweep_switches else [SWEEP_OPTIONS[-1]]
      if not backward and "hopper" in args.sweep_kernels:
        _sweep_hopper(q, k, v, mask, causal, flops, base, timed, rows, saved,
                      first=args.hopper_first)
      if "triton" not in args.sweep_kernels:
        options = []
      for opts in options:
        gpu_kernel.set_options(**{**saved, **opts, "forward": "triton", "backward": "triton"})
        for bq, bk, bqd, bkd, w, st in configs:
          blocks = BlockSizes(bq, bk, bqd, bkd, num_warps=w, num_stages=st)

          def fwd(q, k, v, blocks=blocks, mask=mask):
            return flash_attention_gpu(q, k, v, mask, block_sizes=blocks)

          fn = fwd
          if backward:
            fn = jax.grad(lambda q, k, v, f=fwd: jnp.sum(f(q, k, v).astype(jnp.float32)),
                          argnums=(0, 1, 2))
          label = (f"{opts['exp']:6} affine={int(opts['affine'])} rev={int(opts['reverse'])} "
                   + (f"dq={opts.get('dq', saved['dq']):6} " if backward else "")
                   + (f"bq_dkv={bqd:>3} bk_dkv={bkd:>3}" if backward else f"bq={bq:>3} bk={bk:>3}")
                   + f" warps={w} stages={st}")
          got = timed(label, fn, flops, base)
          if got:
            # the kernel's switches as option_*: its "backward" switch is not the pass's flag
            options_used = {f"option_{k}": x for k, x in {**saved, **opts}.items()}
            rows.append(dict(causal=causal, backward=backward, **options_used, block_q=bq,
                             block_k=bk, block_q_dkv=bqd, block_k_dkv=bkd, num_warps=w,
                             num_stages=st, ms=got[0] * 1e3, tflops=got[1],
                             vs_cudnn=base / got[0]))
  finally:
    gpu_kernel.set_options(**saved)
  for causal, backward in passes:
    mine = [r for r in rows if r["causal"] == causal and r["backward"] == backward]
    if mine:
      best = max(mine, key=lambda r: r["tflops"])
      print(f"  best causal={causal} {'fwd+bwd' if backward else 'fwd'}: {best}")
  return rows


def hopper_config(text: str):
  """``hopper.Config`` from ``"block_k=128,stages=2,overlap=1"`` (integers; switches 0 / 1)."""
  from pallas_kernels.flash_attention import hopper  # noqa: PLC0415
  fields = {f.name: f.type for f in dataclasses.fields(hopper.Config)}
  kw = {}
  for item in filter(None, text.split(",")):
    name, _, value = item.partition("=")
    if name not in fields or not value.strip().isdigit():
      raise argparse.ArgumentTypeError(
          f"{item!r}: expected name=integer with name one of {', '.join(fields)}")
    kw[name] = bool(int(value)) if "bool" in str(fields[name]) else int(value)
  try:
    return hopper.Config(**kw)
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from None


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--seq-lens", type=int, nargs="+", default=None,
                 help="sequence lengths (default: 2k..16k on accelerators, 1k..4k on CPU)")
  p.add_argument("--tokens", type=int, default=None,
                 help="tokens per call: batch = tokens // T (default 16384; CPU 4096)")
  p.add_argument("--heads", type=int, default=None, help="query heads (default 16; CPU 8)")
  p.add_argument("--kv-heads", type=int, default=None, help="KV heads (default: = heads)")
  p.add_argument("--head-dim", type=int, default=None, help="head size (default 128; CPU 64)")
  p.add_argument("--v-head-dim", type=int, default=None,
                 help="value head size (default: = head dim; e.g. 192 / 128 for MLA's prefill)")
  p.add_argument("--dtype", default=None, help="default bfloat16 (accelerators) / float32 (CPU)")
  p.add_argument("--backward", action="store_true", help="time forward + backward")
  p.add_argument("--dense", choices=("none", "bias", "mask", "flax-mask", "sinks"),
                 default="none",
                 help="give both implementations a learned T5-style bias [1, N, T, T], a "
                      "key-padding mask array [B, 1, 1, T] (the last eighth of keys hidden), "
                      "that padding as a Flax mask [B, 1, T, T] (queries too), or (sinks) 4 "
                      "attention sinks and a causal window of T/8 keys: the baseline as a "
                      "[1, 1, T, T] boolean mask, ours as the position mask (block-sparse); "
                      "rates count the allowed pairs only")
  p.add_argument("--shared-bias", choices=("kernel", "atomic"), default=None,
                 help="GPU, with --dense bias --backward: how the Triton kernels differentiate "
                 "the batch-shared bias (its own kernel, or atomic adds in the dQ kernel; "
                 "default: the library's, option `shared_bias`)")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--matmul-size", type=int, default=None)
  p.add_argument("--plot", default=None,
                 help="where to save the rate plot (default runs/bench_flash_<platform>.png)")
  p.add_argument("--no-plot", action="store_true")
  p.add_argument("--check", action="store_true", help="correctness check on the device first")
  p.add_argument("--check-only", action="store_true")
  p.add_argument("--sweep", type=int, default=None, metavar="T",
                 help="GPU: time the kernels' block sizes and code-generation switches at length T "
                 "(forward; with --backward also forward + backward, causal) and exit")
  p.add_argument("--sweep-kernels", type=lambda x: x.split(","), default=["triton", "hopper"],
                 help="with --sweep: which kernels' configs to time (triton,hopper)")
  p.add_argument("--hopper-first", type=int, default=None, metavar="N",
                 help="with --sweep: time only the first N Hopper settings of HOPPER_SWEEP "
                 "(HOPPER_BWD_SWEEP for forward + backward; default all)")
  p.add_argument("--backward-only", action="store_true",
                 help="with --sweep --backward: only the forward + backward (causal) pass")
  p.add_argument("--sweep-switches", action="store_true",
                 help="with --sweep: also time every code-generation switch combination")
  p.add_argument("--gpu-forward", choices=("triton", "hopper", "auto"), default=None,
                 help="GPU: the forward kernel of implementation='pallas_gpu' (default: the "
                 "library's, pallas_kernels.flash_attention.gpu option `forward`)")
  p.add_argument("--gpu-backward", choices=("triton", "hopper", "auto"), default=None,
                 help="GPU: the backward kernels of implementation='pallas_gpu' (default: the "
                 "library's, option `backward`)")
  p.add_argument("--hopper", type=hopper_config, default=None, metavar="K=V,...",
                 help="GPU: the Hopper kernels' config, e.g. block_k=128,stages=2,overlap=1 "
                 "(pallas_kernels.flash_attention.hopper.Config; default: per head size)")
  p.add_argument("--roofline", action="store_true",
                 help="print the TPU v5e/v6e roofline table of docs/performance.md and exit")
  args = p.parse_args(argv)
  if args.backward_only and not (args.sweep and args.backward):
    p.error("argument --backward-only: only with --sweep T --backward")
  if args.roofline:
    print_roofline(head_dim=args.head_dim or 128)
    print()
    print_roofline(head_dim=64)
    return 0
  cpu = _platform() == "cpu"
  args.tokens = args.tokens or (4096 if cpu else 16384)
  args.heads = args.heads or (8 if cpu else 16)
  args.kv_heads = args.kv_heads or args.heads
  args.head_dim = args.head_dim or (64 if cpu else 128)
  args.v_head_dim = args.v_head_dim or args.head_dim
  if args.no_plot:
    args.plot = None
  elif args.plot is None:
    suffix = "_bwd" if args.backward else ""
    args.plot = os.path.join("runs", f"bench_flash_{_platform()}{suffix}.png")
  if args.gpu_forward or args.gpu_backward or args.hopper or args.shared_bias:
    from pallas_kernels.flash_attention import gpu as gpu_kernel  # noqa: PLC0415
    gpu_kernel.set_options(**{k: v for k, v in (("forward", args.gpu_forward),
                                                ("backward", args.gpu_backward),
                                                ("hopper", args.hopper),
                                                ("shared_bias", args.shared_bias)) if v})
  if args.sweep:
    run_sweep(args)
    return 0
  ok = True
  if args.check or args.check_only:
    try:
      ok = run_check()
    except Exception as e:  # outside any one case (imports, options): still run the benchmark
      print(f"check: FAIL ({error_text(e)})", flush=True)
      ok = False
  if not args.check_only:
    run_benchmark(args)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
