"""Decode over a paged cache: time per step and effective bandwidth against the device's copy rate.

    python -m experiments.bench_decode [--kind gqa,mla] [--contexts 1024,4096] [--batches 1,4]
                                       [--impls contiguous,xla_paged] [--dtype bfloat16]
                                       [--kv-quant none,int8,fp8]
                                       [--page-size 64] [--splits N] [--repeats 5]
                                       [--copy-mb 256] [--out runs/bench_decode]
                                       [--check | --check-only]

One decode step (one new token per sequence, every sequence ``--contexts`` tokens long) of one
layer's attention core, projections excluded:

* ``gqa``: ``--heads`` query heads over ``--kv-heads`` KV heads of ``--head-dim`` (Llama-3-8B:
  32 / 8 / 128); the cache read is ``B * S * K * 2H * bytes``.
* ``mla``: DeepSeek-V3's absorbed decode, ``--mla-heads`` heads in latent space over rows of
  ``--latent + --rope`` (512 + 64); the cache read is ``B * S * (C + R) * bytes``.  The default 16
  heads are DeepSeek-V3's 128 under 8-way tensor parallelism: memory-bound (about
  ``2 N (2C + R) / ((C + R) bytes)`` = 1.9 N FLOP per cached byte in bf16, 30 at N = 16).  With
  all 128 heads on one device it is ~240 FLOP/byte, above an H200's bf16 ridge point (~200):
  compute-bound, so a bandwidth percentage means little there.

``--kv-quant int8,fp8`` adds each implementation's rows over a quantized cache (``+int8``,
``+fp8``: one-byte codes with a fp32 scale per token and KV head, as ``PagedKVCache(dtype=
jnp.int8)`` / ``KVCache`` hold them; for MLA the latents ``c_KV`` with a scale per token, ``k^R``
in ``--dtype``, as ``PagedLatentCache`` / ``LatentCache`` hold them; ``none`` is the
``--dtype`` cache).  Their bandwidth counts the bytes they read (GQA: ``K * 2 (H + 4)`` per token; MLA:
``C + 4 + R * bytes``), their ``x contig`` the float cache's contiguous row: the speed-up a
quantized cache buys.  The contiguous XLA row of a quantized cache dequantizes it whole first
(what ``KVCache.split_heads`` feeds the dense path).

Implementations (``--impls``):

* ``contiguous``: the XLA path over a contiguous ``[B, S, ...]`` cache (``dot_product_attention``
  with ``kv_lengths``; MLA as ``mla_attention(mode="absorbed")`` calls it: one shared key of width
  ``C + R``) -- what ``KVCache`` / ``LatentCache`` decode runs today.
* ``xla_paged``: ``jaxattn.ops.decode`` with ``implementation="xla"`` on pages scattered at random
  through the pool: gathers the pages to a contiguous copy first.
* ``pallas_paged``: the same with ``implementation="pallas_tpu"`` (``--splits`` split-KV
  partitions).  Compiled only on a TPU; elsewhere it runs interpreted, so only tiny sizes make
  sense (``--allow-interpret``).
* ``pallas_contiguous``: the contiguous cache read in place by the TPU decode kernels
  (``jaxattn.ops.decode.cache_attention`` / ``cache_mla_decode``, what ``Attention`` / ``MLA``
  run for a cached step on TPU; MLA over the TPU ``LatentCache`` layout, ``k^R`` padded to a
  multiple of 128 columns).  TPU only, like ``pallas_paged``.
* ``pallas_gpu_paged``: the Pallas Triton kernels (``paged_attention_gpu`` /
  ``paged_mla_decode_gpu``, what ``implementation="pallas_gpu"`` runs); ``--splits`` split-KV
  partitions, 0 or unset = the kernels' automatic rule (about two programs per SM);
  ``--gpu-block-k``, ``--gpu-warps``, ``--gpu-stages`` tune them.  Runs only on an NVIDIA GPU
  (``--allow-interpret`` elsewhere, tiny sizes only).

``--check`` first compares ``pallas_gpu`` with the XLA formulas on the device at a realistic size
(bf16, 32k context, B = 4 with ragged lengths incl. 0, GQA, MLA with 16 and 128 heads, sparse
MLA with top-2048, and chunked prefills of 100-200 tokens in row blocks) and prints PASS / FAIL
with the max errors (a case that raises prints ``FAIL (<error>)`` and the others still run); the
exit status is 1 on FAIL.  ``--check-only`` stops there.

The named baseline is the device's copy bandwidth, measured in the same run: ``y = x + 1`` on a
``--copy-mb`` MB array moves ``2 x`` its bytes (read + write).  Each row prints time per step,
effective bandwidth (cache bytes read / time), its % of the copy bandwidth, the ratio to
``contiguous`` and the compiled program's peak memory (arguments + outputs + temporaries), as
soon as it is measured; an implementation that fails to build, compile or run gets a row with its
error instead (exit status 1).  Each round of the timing queues at least 20 steps (on an
accelerator), more until it lasts ~10 ms (at most 50).  ``results.json`` (strict JSON: missing
figures are ``null``) under ``--out`` is rewritten after every row; ``bench_decode.png`` at the
end.  On a shared CPU absolute numbers are noisy.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from experiments.cli import choice_list, int_list
from experiments.timing import (AUTO, best_time, compile_timed, error_text, peak_bytes,
                                write_json)
from jaxattn.ops.attention import dot_product_attention
from jaxattn.ops.decode import (cache_attention, cache_mla_decode, paged_attention,
                                paged_mla_decode)
from jaxattn.ops.quantization import quantize_kv
from jaxattn.paged_cache import default_rope_align, stored_rope_width
from pallas_kernels.decode_attention import paged_attention_gpu
from pallas_kernels.mla_decode import paged_mla_decode_gpu

IMPLS = ("contiguous", "xla_paged", "pallas_paged", "pallas_contiguous", "pallas_gpu_paged")


_L2_MB = 60  # an H100/H200's L2 is 50-60 MB


def _timing() -> dict:
  """``best_time`` keywords: each round queues calls until it lasts ~10 ms (at most 50); on an
  accelerator at least 20 back-to-back steps, which hide the host's dispatch (tens of
  microseconds, the size of a short decode step)."""
  return dict(inner=AUTO, min_inner=1 if jax.default_backend() == "cpu" else 20)


def copy_bandwidth(mb: int, repeats: int) -> float:
  """Bytes per second of ``x + 1`` over an ``mb`` MB fp32 array (read + write counted)."""
  n = mb * (1 << 20) // 4
  x = jnp.ones((n,), jnp.float32)
  f, _ = compile_timed(lambda x: x + 1, x)
  return 2 * n * 4 / best_time(f, (x,), repeats, **_timing())


def _pools(rng, b, s, page, shapes, dtype):
  """Random pools for ``b`` sequences of ``s`` tokens, pages scattered at random, and the
  equivalent contiguous buffers.  ``shapes``: the trailing shape of each pool.  The values are
  drawn on the device (host-side normals for a 32 x 32k cache would take minutes)."""
  m = -(-s // page)
  perm = rng.permutation(b * m).astype(np.int32)
  table = jnp.asarray(perm.reshape(b, m))
  pools, flats = [], []
  for shape in shapes:
    key = jax.random.key(int(rng.integers(2**31)))
    contiguous = jax.random.normal(key, (b, m * page) + shape, jnp.float32).astype(dtype)
    pool = jnp.zeros((b * m, page) + shape, dtype)
    pool = pool.at[table.reshape(-1)].set(contiguous.reshape((b * m, page) + shape))
    pools.append(pool)
    flats.append(contiguous)
  return pools, flats, table


KV_QUANT = {"none": None, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


def label(impl: str, quant: str) -> str:
  """A row's implementation name: ``impl``, or ``impl+int8`` / ``impl+fp8`` over a quantized
  cache."""
  return impl if quant == "none" else f"{impl}+{quant}"


def _quantized(pool, flat, table, kh, dt):
  """A pool and its contiguous cache as codes with scales, in ``PagedKVCache`` / ``KVCache``
  layouts: ``(codes pool, scales [P, 1, K * page], codes [B, S, K, H], scales [B, K, S])``."""
  page = pool.shape[1]
  codes, scale = quantize_kv(flat.astype(jnp.float32), dt)            # [B, S, K, H], [B, S, K]
  b, m = codes.shape[0], codes.shape[1] // page
  cpool = jnp.zeros(pool.shape, dt).at[table.reshape(-1)].set(
      codes.reshape((b * m, page) + pool.shape[2:]))
  spool = jnp.ones((b * m, 1, kh * page), jnp.float32).at[table.reshape(-1)].set(
      scale.reshape(b * m, page, kh).transpose(0, 2, 1).reshape(b * m, 1, kh * page))
  return cpool, spool, codes, scale.transpose(0, 2, 1)


def _gqa_fns(args, q, kp, vp, kc, vc, table, lengths, scales=None):
  """``{impl: (fn, args)}`` of one GQA case; ``scales``: ``(key pool scales, value pool scales,
  key cache scales, value cache scales)`` of quantized codes (the contiguous XLA row then
  dequantizes the cache first, as ``KVCache.split_heads`` does)."""
  h, w = args.head_dim, args.window
  win = dict(local_window_size=w)
  contiguous_kw = {} if w is None else dict(is_causal=True, q_offset=kc.shape[1] - 1, **win)

  def dense(q, k, v, lens, *sc):
    if sc:
      k = k.astype(jnp.float32) * jnp.swapaxes(sc[0], 1, 2)[..., None]
      v = v.astype(jnp.float32) * jnp.swapaxes(sc[1], 1, 2)[..., None]
      k, v = k.astype(q.dtype), v.astype(q.dtype)
    return dot_product_attention(q, k, v, kv_lengths=lens, implementation="xla",
                                 **contiguous_kw)

  pool_sc, cache_sc = (scales[:2], scales[2:]) if scales else ((), ())
  paged_args, cache_args = (q, kp, vp, table, lengths) + pool_sc, (q, kc, vc, lengths) + cache_sc

  def kw(sc):   # the trailing scale arguments (none for a float cache) as keywords
    return dict(key_scale=sc[0], value_scale=sc[1]) if sc else {}

  return {
      "contiguous": (dense, cache_args),
      "xla_paged": (lambda q, k, v, t, lens, *sc: paged_attention(
          q, k, v, t, lens, implementation="xla", **win, **kw(sc)), paged_args),
      "pallas_paged": (lambda q, k, v, t, lens, *sc: paged_attention(
          q, k, v, t, lens, implementation="pallas_tpu", num_splits=_tpu_splits(args), **win,
          **kw(sc)), paged_args),
      "pallas_gpu_paged": (lambda q, k, v, t, lens, *sc: paged_attention_gpu(
          q, k, v, t, lens, scale=h ** -0.5, **_gpu_kw(args), **win, **kw(sc)), paged_args),
      "pallas_contiguous": (lambda q, k, v, lens, *sc: cache_attention(
          q, k, v, lens, implementation="pallas_tpu", num_splits=_tpu_splits(args), **win,
          **kw(sc)), cache_args),
  }


def build_case(kind, b, s, args, dtype, rng):
  """``{label: (fn, args)}`` for one (kind, batch, context) and ``{label: cache bytes one step
  reads}``; a label is an implementation, ``impl+int8`` / ``impl+fp8`` over a quantized cache
  (``--kv-quant``)."""
  lengths = jnp.full((b,), s, jnp.int32)
  itemsize = jnp.dtype(dtype).itemsize
  if kind == "gqa":
    n, kh, h = args.heads, args.kv_heads, args.head_dim
    # Merged rows [P, page, K * H], as PagedKVCache stores them (the TPU kernel reads them in
    # place; a [P, page, K, H] pool with heads of 64 would be re-tiled on every step).
    (kp, vp), (kc, vc), table = _pools(rng, b, s, args.page_size, [(kh * h,), (kh * h,)], dtype)
    kc, vc = kc.reshape(b, -1, kh, h), vc.reshape(b, -1, kh, h)
    q = jnp.asarray(rng.standard_normal((b, 1, n, h)), dtype)
    # With a sliding window a step needs (and the bandwidth counts) the last w + 1 keys only.
    tokens = b * (s if args.window is None else min(s, args.window + 1))
    fns, nbytes = {}, {}
    for quant in getattr(args, "kv_quant", None) or ["none"]:
      if quant == "none":
        case = _gqa_fns(args, q, kp, vp, kc, vc, table, lengths)
        per_token = kh * 2 * h * itemsize
      else:
        (kq, ksp, kqc, ksc), (vq, vsp, vqc, vsc) = (
            _quantized(pool, flat, table, kh, KV_QUANT[quant])
            for pool, flat in ((kp, kc), (vp, vc)))
        case = _gqa_fns(args, q, kq, vq, kqc.reshape(kc.shape), vqc.reshape(vc.shape), table,
                        lengths, (ksp, vsp, ksc, vsc))
        per_token = kh * 2 * (h + 4)              # one byte per entry, a fp32 scale per head
      fns.update({label(i, quant): f for i, f in case.items()})
      nbytes.update({label(i, quant): tokens * per_token for i in case})
    return fns, nbytes
  n, c, r = args.mla_heads, args.latent, args.rope
  # The k^R pool as PagedLatentCache stores it: zero columns up to a multiple of 128 on TPU (the
  # bandwidth figures count the C + R useful columns only).
  width = stored_rope_width(r, default_rope_align())
  (cp, rp), (cc, rc), table = _pools(rng, b, s, args.page_size, [(c,), (width,)], dtype)
  rp, rc = rp.at[..., r:].set(0), rc[..., :r]
  # The LatentCache buffer [B, S, C + R_p] (rows [c_KV | k^R | zeros]) for pallas_contiguous.
  latent_rows = jnp.concatenate([cc, rc, jnp.zeros(rc.shape[:2] + (rp.shape[2] - r,), dtype)],
                                -1)
  ql = jnp.asarray(rng.standard_normal((b, 1, n, c)), dtype)
  qr = jnp.asarray(rng.standard_normal((b, 1, n, r)), dtype)
  scale = 1.0 / math.sqrt(args.mla_qk_dim)
  nbytes = b * s * (c + r) * itemsize

  def contiguous(ql, qr, c_kv, k_rope, lens):
    # As mla_attention(mode="absorbed"): the row [c_KV, k^R] is one shared key, [..:C] the value.
    kv = jnp.concatenate([c_kv, k_rope], axis=-1)[:, :, None, :]
    query = jnp.concatenate([ql, qr], axis=-1)
    return dot_product_attention(query, kv, kv, scale=scale, kv_lengths=lens,
                                 implementation="xla")[..., :c]

  fns = {
      "contiguous": (contiguous, (ql, qr, cc, rc, lengths)),
      "xla_paged": (lambda ql, qr, cp, rp, t, lens: paged_mla_decode(
          ql, qr, cp, rp, t, lens, scale=scale, implementation="xla"),
                    (ql, qr, cp, rp, table, lengths)),
      "pallas_paged": (lambda ql, qr, cp, rp, t, lens: paged_mla_decode(
          ql, qr, cp, rp, t, lens, scale=scale, implementation="pallas_tpu",
          num_splits=_tpu_splits(args)), (ql, qr, cp, rp, table, lengths)),
      "pallas_gpu_paged": (lambda ql, qr, cp, rp, t, lens: paged_mla_decode_gpu(
          ql, qr, cp, rp, t, lens, scale=scale, **_gpu_kw(args)),
                           (ql, qr, cp, rp, table, lengths)),
      "pallas_contiguous": (lambda ql, qr, kv, lens: cache_mla_decode(
          ql, qr, kv, lens, scale=scale, implementation="pallas_tpu",
          num_splits=_tpu_splits(args)), (ql, qr, latent_rows, lengths)),
  }
  nbytes = {k: nbytes for k in fns}
  for quant in getattr(args, "kv_quant", None) or ["none"]:
    if quant == "none":
      continue
    # c_KV as one-byte codes with a fp32 scale per token ([P, 1, page], PagedLatentCache's;
    # [B, 1, S] for the contiguous LatentCache, its k^R in a buffer of its own); k^R in --dtype.
    codes, sc = quantize_kv(cc.astype(jnp.float32), KV_QUANT[quant])    # [B, S, C], [B, S]
    pages = table.reshape(-1)
    cq = jnp.zeros(cp.shape, codes.dtype).at[pages].set(codes.reshape(cp.shape[0], -1, c))
    csp = jnp.ones((cp.shape[0], 1, cp.shape[1]), jnp.float32).at[pages].set(
        sc.reshape(cp.shape[0], 1, -1))

    def dense(ql, qr, codes, sc, k_rope, lens):
      c_kv = (codes.astype(jnp.float32) * sc[..., None]).astype(ql.dtype)
      return contiguous(ql, qr, c_kv, k_rope, lens)

    qfns = {
        "contiguous": (dense, (ql, qr, codes, sc, rc, lengths)),
        "xla_paged": (lambda ql, qr, cp, rp, t, lens, cs: paged_mla_decode(
            ql, qr, cp, rp, t, lens, scale=scale, implementation="xla", c_kv_scale=cs),
                      (ql, qr, cq, rp, table, lengths, csp)),
        "pallas_paged": (lambda ql, qr, cp, rp, t, lens, cs: paged_mla_decode(
            ql, qr, cp, rp, t, lens, scale=scale, implementation="pallas_tpu",
            num_splits=_tpu_splits(args), c_kv_scale=cs), (ql, qr, cq, rp, table, lengths, csp)),
        "pallas_gpu_paged": (lambda ql, qr, cp, rp, t, lens, cs: paged_mla_decode_gpu(
            ql, qr, cp, rp, t, lens, scale=scale, c_kv_scale=cs, **_gpu_kw(args)),
                             (ql, qr, cq, rp, table, lengths, csp)),
        "pallas_contiguous": (lambda ql, qr, kv, kr, cs, lens: cache_mla_decode(
            ql, qr, kv, lens, scale=scale, implementation="pallas_tpu",
            num_splits=_tpu_splits(args), k_rope=kr, c_kv_scale=cs),
                              (ql, qr, codes, latent_rows[..., c:], sc[:, None, :], lengths)),
    }
    fns.update({label(i, quant): f for i, f in qfns.items()})
    nbytes.update({label(i, quant): b * s * (c + 4 + r * itemsize) for i in qfns})
  return fns, nbytes


def _tpu_splits(args):
  """``num_splits`` of the TPU kernels: unset = 4, 0 = None (the kernels' automatic rule)."""
  return 4 if args.splits is None else (args.splits or None)


def _gpu_kw(args):
  """Keyword arguments of the GPU kernels from the flags (None / 0 = the kernels' defaults)."""
  kw = dict(num_splits=args.splits or None, block_k=args.gpu_block_k or None)
  if args.gpu_warps:
    kw["num_warps"] = args.gpu_warps
  if args.gpu_stages:
    kw["num_stages"] = args.gpu_stages
  return kw


def _on_gpu() -> bool:
  return jax.default_backend() in ("gpu", "cuda")


def run_check(page_size: int = 64, context: int = 32768) -> bool:
  """``pallas_gpu`` vs the XLA formulas on the device: bf16, 32k context, B = 4, ragged lengths
  (full, not a multiple of any block, 1, 0), automatic split-KV.  Error = max |got - want| over
  max |want| per sequence (a wrong page or a lost partition gives ~1; bf16 rounding ~1e-2 at
  most)."""
  if not _on_gpu():
    print("check: no GPU; the GPU decode kernels are tested in interpret mode by "
          "tests/kernels/test_decode_gpu.py")
    return True
  rng = np.random.default_rng(11)
  b, s, dtype, tol = 4, context, jnp.bfloat16, 2e-2
  lengths = jnp.asarray([s, s * 5 // 8 + 1, 1, 0], jnp.int32)
  ok = True

  def report(name, got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    finite = bool(np.isfinite(got).all())
    # Per sequence (a length-1 sequence returns one value row, O(1); a 32k one averages to
    # O(0.01)): a shared normalization would hide a wrong long sequence.
    err = max(float(np.max(np.abs(got[i] - want[i]))) / max(float(np.max(np.abs(want[i]))), 1e-6)
              for i in range(3))
    empty = float(np.max(np.abs(got[3])))           # the zero-length sequence must give zeros
    passed = finite and err <= tol and empty == 0.0
    print(f"check {name}: max err / max |ref| = {err:.2e} (tol {tol:g}), empty-sequence max "
          f"{empty:g}, finite {finite}: {'PASS' if passed else 'FAIL'}", flush=True)
    return passed

  def attempt(name, fn):
    """``fn()`` -> PASS / FAIL; an exception fails this case only (the others still run)."""
    nonlocal ok
    try:
      passed = bool(fn())
    except Exception as e:  # compile / launch / resource error of this case
      passed = False
      print(f"check {name}: FAIL ({error_text(e)})", flush=True)
    ok &= passed

  n, kh, h = 32, 8, 128
  pools = {}

  def gqa_pools():
    (kp, vp), _, table = _pools(rng, b, s, page_size, [(kh, h), (kh, h)], dtype)
    pools.update(gqa=(kp, vp, table))
    return True

  def gqa_case(t, n=n):
    kp, vp, table = pools["gqa"]
    q = jax.random.normal(jax.random.key(t), (b, t, n, h), jnp.float32).astype(dtype)
    got = jax.jit(lambda q, k, v, tb, ln: paged_attention(
        q, k, v, tb, ln, implementation="pallas_gpu"))(q, kp, vp, table, lengths)
    want = jax.jit(lambda q, k, v, tb, ln: paged_attention(
        q, k, v, tb, ln, implementation="xla"))(q, kp, vp, table, lengths)
    return report(f"gqa N={n} K={kh} H={h} T={t} bf16 ctx={s} B={b}", got, want)

  def quant_case(codes):
    # A quantized cache's pools: one-byte codes, scales [P, 1, K * page] (PagedKVCache's).
    kp, vp, table = pools["gqa"]
    quantized = []
    for pool in (kp, vp):
      c, sc = quantize_kv(pool, codes)                                   # [P, page, K, H], [.., K]
      quantized += [c, sc.transpose(0, 2, 1).reshape(sc.shape[0], 1, -1)]
    q = jax.random.normal(jax.random.key(7), (b, 1, n, h), jnp.float32).astype(dtype)
    outs = [jax.jit(lambda q, k, ks, v, vs, tb, ln, impl=impl: paged_attention(
        q, k, v, tb, ln, implementation=impl, key_scale=ks, value_scale=vs))(
            q, *quantized, table, lengths) for impl in ("pallas_gpu", "xla")]
    return report(f"gqa {jnp.dtype(codes).name} cache N={n} K={kh} H={h} T=1 ctx={s} B={b}",
                  *outs)

  attempt(f"gqa pools ctx={s} B={b}", gqa_pools)
  if "gqa" in pools:
    for t in (1, 2, 200):        # 200: a chunked prefill, 800 rows per KV head in 13 programs
      attempt(f"gqa N={n} K={kh} H={h} T={t} bf16 ctx={s} B={b}", lambda t=t: gqa_case(t))
    for codes in (jnp.int8, jnp.float8_e4m3fn):
      attempt(f"gqa {jnp.dtype(codes).name} cache ctx={s} B={b}",
              lambda codes=codes: quant_case(codes))
  pools.pop("gqa", None)
  c, r = 512, 64

  def mla_pools():
    (cp, rp), _, table = _pools(rng, b, s, page_size, [(c,), (r,)], dtype)
    pools.update(mla=(cp, rp, table))
    return True

  def mla_case(n, t):
    cp, rp, table = pools["mla"]
    kq = jax.random.split(jax.random.key(100 + n + t), 2)
    ql = jax.random.normal(kq[0], (b, t, n, c), jnp.float32).astype(dtype)
    qr = jax.random.normal(kq[1], (b, t, n, r), jnp.float32).astype(dtype)
    outs = [jax.jit(lambda ql, qr, cp, rp, tb, ln, impl=impl: paged_mla_decode(
        ql, qr, cp, rp, tb, ln, scale=192 ** -0.5, implementation=impl))(
            ql, qr, cp, rp, table, lengths) for impl in ("pallas_gpu", "xla")]
    return report(f"mla N={n} C={c} R={r} T={t} bf16 ctx={s} B={b}", *outs)

  def sparse_case(n, topk):
    # Sparse (DSA) mode: top-2048 positions per query, some -1 and some past the length.
    cp, rp, table = pools["mla"]
    kq = jax.random.split(jax.random.key(999), 2)
    ql = jax.random.normal(kq[0], (b, 1, n, c), jnp.float32).astype(dtype)
    qr = jax.random.normal(kq[1], (b, 1, n, r), jnp.float32).astype(dtype)
    idx = rng.integers(-1, s, size=(b, 1, topk)).astype(np.int32)
    idx = jnp.asarray(np.minimum(idx, np.maximum(np.asarray(lengths) - 1, 0)[:, None, None] + 5))
    outs = [jax.jit(lambda ql, qr, cp, rp, tb, ln, ix, impl=impl: paged_mla_decode(
        ql, qr, cp, rp, tb, ln, scale=192 ** -0.5, indices=ix, implementation=impl))(
            ql, qr, cp, rp, table, lengths, idx) for impl in ("pallas_gpu", "xla")]
    return report(f"mla sparse N={n} top-{topk} bf16 ctx={s} B={b}", *outs)

  def mla_quant_case(codes, sparse):
    # A quantized latent cache: c_KV codes, a scale per token [P, 1, page]; k^R bf16.
    cp, rp, table = pools["mla"]
    cq, sc = quantize_kv(cp, codes)                                       # [P, page, C], [P, page]
    sc = sc[:, None, :]
    kq = jax.random.split(jax.random.key(55), 2)
    ql = jax.random.normal(kq[0], (b, 1, 128, c), jnp.float32).astype(dtype)
    qr = jax.random.normal(kq[1], (b, 1, 128, r), jnp.float32).astype(dtype)
    idx = None
    if sparse:
      idx = rng.integers(-1, s, size=(b, 1, 2048)).astype(np.int32)
      idx = jnp.asarray(np.minimum(idx, np.maximum(np.asarray(lengths) - 1, 0)[:, None, None]))
    outs = [jax.jit(lambda ql, qr, cp, rp, tb, ln, cs, ix, impl=impl: paged_mla_decode(
        ql, qr, cp, rp, tb, ln, scale=192 ** -0.5, indices=ix, implementation=impl,
        c_kv_scale=cs))(ql, qr, cq, rp, table, lengths, sc, idx)
            for impl in ("pallas_gpu", "xla")]
    kind = "sparse top-2048" if sparse else "dense"
    return report(f"mla {jnp.dtype(codes).name} cache {kind} N=128 ctx={s} B={b}", *outs)

  attempt(f"mla pools ctx={s} B={b}", mla_pools)
  if "mla" in pools:
    for n, t in ((16, 1), (128, 1), (16, 2), (16, 100)):  # (16, 100): 1,600 rows, 100 blocks
      attempt(f"mla N={n} C={c} R={r} T={t} bf16 ctx={s} B={b}",
              lambda n=n, t=t: mla_case(n, t))
    attempt(f"mla sparse N=128 top-2048 bf16 ctx={s} B={b}", lambda: sparse_case(128, 2048))
    for codes, sparse in ((jnp.int8, False), (jnp.float8_e4m3fn, False), (jnp.int8, True)):
      attempt(f"mla {jnp.dtype(codes).name} cache ctx={s} B={b}",
              lambda codes=codes, sparse=sparse: mla_quant_case(codes, sparse))
  pools.clear()
  print(f"check: {'PASS' if ok else 'FAIL'}", flush=True)
  return bool(ok)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--kind", type=choice_list(("gqa", "mla")), default="gqa,mla",
                  help="gqa, mla or both")
  ap.add_argument("--contexts", type=int_list(minimum=1), default="1024,4096",
                  help="tokens per sequence (target on an accelerator: 4096,...,65536)")
  ap.add_argument("--batches", type=int_list(minimum=1), default="1,4",
                  help="target on an accelerator: 1,...,64")
  ap.add_argument("--impls", type=choice_list(IMPLS), default="contiguous,xla_paged",
                  help=f"comma list of {', '.join(IMPLS)}")
  ap.add_argument("--dtype", type=str, default="bfloat16")
  ap.add_argument("--kv-quant", type=choice_list(tuple(KV_QUANT)), default="none",
                  help="caches to time: none (--dtype), int8, fp8 (one-byte codes with a fp32 "
                       "scale per token and KV head; MLA: c_KV, k^R in --dtype); rows "
                       "impl+int8 / impl+fp8")
  ap.add_argument("--heads", type=int, default=32)
  ap.add_argument("--kv-heads", type=int, default=8)
  ap.add_argument("--head-dim", type=int, default=128)
  ap.add_argument("--mla-heads", type=int, default=16, help="DeepSeek-V3: 128 (16 per device "
                  "at 8-way tensor parallelism)")
  ap.add_argument("--latent", type=int, default=512)
  ap.add_argument("--rope", type=int, default=64)
  ap.add_argument("--mla-qk-dim", type=int, default=192, help="P + R, for the softmax scale")
  ap.add_argument("--page-size", type=int, default=64)
  ap.add_argument("--window", type=int, default=None,
                  help="gqa: a sliding window (Mistral: 4095); the bandwidth then counts the "
                  "window's bytes, the bytes a step needs")
  ap.add_argument("--splits", type=int, default=None,
                  help="split-KV partitions; unset: 4 for pallas_paged, automatic for "
                  "pallas_gpu_paged; 0 = automatic (1 on TPU)")
  ap.add_argument("--gpu-block-k", type=int, default=0, help="pallas_gpu_paged key block "
                  "(0 = the kernel's default: 64 for GQA, 32 for MLA)")
  ap.add_argument("--gpu-warps", type=int, default=0, help="pallas_gpu_paged num_warps (0 = 4)")
  ap.add_argument("--gpu-stages", type=int, default=0,
                  help="pallas_gpu_paged num_stages (0 = 2)")
  ap.add_argument("--check", action="store_true",
                  help="compare pallas_gpu with the XLA formulas on the GPU first (exit 1 on FAIL)")
  ap.add_argument("--check-only", action="store_true", help="--check, then stop")
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--copy-mb", type=int, default=None,
                  help="copy-bandwidth array size (default 2048 on accelerators, 256 on CPU: "
                  "large enough that launch cost vanishes)")
  ap.add_argument("--allow-interpret", action="store_true",
                  help="run pallas_paged off TPU (interpreted: tiny sizes only)")
  ap.add_argument("--max-cache-gb", type=float, default=8.0,
                  help="skip (kind, context, batch) cases whose cache exceeds this: the benchmark "
                  "holds the cache twice (pool and contiguous) plus the paged path's gathered copy")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--out", type=str, default="runs/bench_decode")
  args = ap.parse_args(argv)
  if args.splits is not None and args.splits < 0:
    ap.error(f"--splits must be >= 0 (0 = automatic), got {args.splits}")

  kinds, impls = args.kind, args.impls
  tpu_only = [i for i in ("pallas_paged", "pallas_contiguous") if i in impls]
  if tpu_only and jax.default_backend() != "tpu" and not args.allow_interpret:
    ap.error(f"{', '.join(tpu_only)} compile only on TPU; pass --allow-interpret to run "
             "interpreted")
  if "pallas_gpu_paged" in impls and not _on_gpu() and not args.allow_interpret:
    ap.error(f"pallas_gpu_paged compiles only on an NVIDIA GPU (backend here: "
             f"{jax.default_backend()!r}); pass --allow-interpret to run it interpreted")
  ok = True
  if args.check or args.check_only:
    try:
      ok = run_check(args.page_size)
    except Exception as e:  # outside any one case: still run the benchmark
      print(f"check: FAIL ({error_text(e)})", flush=True)
      ok = False
    if args.check_only:
      return 0 if ok else 1
  contexts, batches = args.contexts, args.batches
  dtype = jnp.dtype(args.dtype)
  rng = np.random.default_rng(args.seed)
  on_cpu = jax.default_backend() == "cpu"

  if args.copy_mb is None:
    args.copy_mb = 256 if on_cpu else 2048
  try:
    copy_bw = copy_bandwidth(args.copy_mb, args.repeats)
  except Exception as e:  # the decode rows are still worth having without the % copy column
    print(f"copy bandwidth: {error_text(e)}", flush=True)
    copy_bw = float("nan")
  print(f"device {jax.devices()[0].device_kind} ({jax.default_backend()}); copy bandwidth "
        f"(x + 1 over {args.copy_mb} MB, read + write): {copy_bw / 1e9:.1f} GB/s", flush=True)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  rows = []

  def save():  # after every row: a run killed by a time limit keeps what it measured
    write_json(out / "results.json", dict(args=vars(args), device=jax.devices()[0].device_kind,
                                          copy_gbps=copy_bw / 1e9, rows=rows))

  def emit(r):
    r["fits_l2"] = not on_cpu and r["cache_mb"] < 2 * _L2_MB  # L2 residency: a GPU effect
    rows.append(r)
    save()
    head = f"{r['kind']:4} {r['context']:>6} {r['batch']:>3} {r['impl']:16} "
    if r.get("error"):
      tqdm.write(head + f"error: {r['error']}")
    else:
      ratio = "" if r["vs_contiguous"] is None else f"{r['vs_contiguous']:.2f}"
      tqdm.write(head + f"{r['ms']:>9.3f} {r['cache_mb']:>9.1f} {r['gbps']:>7.1f} "
                 f"{r['pct_copy']:>7.1f} {ratio:>9} {r['peak_mb']:>9.1f}"
                 + ("  (fits in L2)" if r["fits_l2"] else ""))
    sys.stdout.flush()

  print(f"{'kind':4} {'ctx':>6} {'B':>3} {'impl':16} {'ms/step':>9} {'cache MB':>9} "
        f"{'GB/s':>7} {'% copy':>7} {'x contig':>9} {'peak MB':>9}", flush=True)
  # The contiguous row first, so every row can print its ratio to it as soon as it is measured;
  # then each quantized cache's rows, all against the float contiguous row.
  order = sorted(impls, key=lambda i: i != "contiguous")

  def labels(kind):
    quants = args.kv_quant
    first = ["contiguous"] if "contiguous" in impls and "none" not in quants else []
    return first + [label(i, q) for q in quants for i in order]

  bar = tqdm(total=len(contexts) * len(batches) * sum(len(labels(k)) for k in kinds),
             desc="bench_decode")
  try:
    for kind in kinds:
      for s in contexts:
        for b in batches:
          per_token = (2 * args.kv_heads * args.head_dim if kind == "gqa"
                       else args.latent + args.rope) * dtype.itemsize
          if b * s * per_token > args.max_cache_gb * 2**30:
            tqdm.write(f"skip {kind} context={s} batch={b}: cache "
                       f"{b * s * per_token / 2**30:.1f} GB > --max-cache-gb {args.max_cache_gb}")
            bar.update(len(labels(kind)))
            continue
          nbytes, case_error = {}, None
          try:
            fns, nbytes = build_case(kind, b, s, args, dtype, rng)
          except Exception as e:  # e.g. out of memory for the inputs: every impl fails
            fns, case_error = {}, error_text(e)
          base = None
          for impl in labels(kind):
            r = dict(kind=kind, context=s, batch=b, impl=impl, ms=None,
                     cache_mb=nbytes.get(impl, b * s * per_token) / 2**20, gbps=None,
                     pct_copy=None, peak_mb=None, vs_contiguous=None)
            try:
              if impl not in fns:
                raise RuntimeError(f"inputs not built: {case_error}")
              fn, fargs = fns[impl]
              compiled, _ = compile_timed(fn, *fargs)
              sec = best_time(compiled, fargs, args.repeats, **_timing())
              r.update(ms=sec * 1e3, gbps=nbytes[impl] / sec / 1e9,
                       pct_copy=100 * nbytes[impl] / sec / copy_bw,
                       peak_mb=peak_bytes(compiled) / 2**20)
              del compiled
            except Exception as e:  # one implementation's failure keeps the others' figures
              r["error"] = error_text(e)
            if impl == "contiguous":      # the float cache's contiguous XLA row
              base = r["ms"]
            # Against the contiguous row wherever --impls lists it (None when it is not listed).
            if base is not None and r["ms"] is not None:
              r["vs_contiguous"] = r["ms"] / base
            emit(r)
            bar.update()
          del fns
  finally:
    bar.close()
    save()

  failed = [r for r in rows if r.get("error")]
  print("x contig: time per step relative to the contiguous XLA path (lower is faster).")
  if any(r["fits_l2"] for r in rows):
    print(f"(fits in L2): a cache under ~{2 * _L2_MB} MB can stay in the GPU's L2 between the "
          "back-to-back timed steps, so its GB/s can exceed the HBM copy rate; in a model the "
          "other layers evict it.  Judge bandwidth on the larger rows.")
  if failed:
    print(f"{len(failed)} of {len(rows)} rows failed (error in the row; exit status 1)")
  try:
    _plot(rows, kinds, list(dict.fromkeys(r["impl"] for r in rows)), batches, args.dtype,
          out / "bench_decode.png")
    print(f"wrote {out / 'results.json'} and {out / 'bench_decode.png'}", flush=True)
  except Exception as e:  # the figures are printed and in results.json already
    print(f"wrote {out / 'results.json'}; no plot ({error_text(e)})", flush=True)
  return 0 if ok and not failed else 1


def _plot(rows, kinds, impls, batches, dtype_name, path):
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4), squeeze=False)
  for ax, kind in zip(axes[0], kinds):
    for impl in impls:
      for b in batches:
        pts = [(r["context"], r["pct_copy"]) for r in rows
               if r["kind"] == kind and r["impl"] == impl and r["batch"] == b
               and r["pct_copy"] is not None and math.isfinite(r["pct_copy"])]
        if not pts:
          continue
        ax.plot(*zip(*pts), marker="o", label=f"{impl} B={b}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens per sequence)")
    ax.set_ylabel("% of measured copy bandwidth")
    ax.set_title(f"{kind} decode, {dtype_name}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


if __name__ == "__main__":
  sys.exit(main())
