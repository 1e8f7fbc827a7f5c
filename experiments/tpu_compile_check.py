"""Compile every TPU Pallas kernel for real TPU chips on a machine without one (deviceless AOT).

    pip install -e ".[tpu-compile]"        # libtpu: the TPU compiler, usable without a TPU
    python -m experiments.tpu_compile_check [--chips v5e,v6e] [--only NAME,...]
                                            [--out runs/tpu_compile_check]

Interpret mode checks what the kernels compute; it cannot check that Mosaic accepts them (tile
alignment of slices and DMAs, layouts, VMEM limits).  This script asks libtpu for a chip's
topology (``jax.experimental.topologies``), lowers each kernel at production sizes with
``interpret=False`` and runs the whole TPU compiler on it -- Mosaic included -- exactly as a TPU VM
would before running it.  Per chip and kernel it prints whether it compiled, the compile time, the
compiled program's scratch and argument bytes (``memory_analysis()``), and every copy of at least
1 MiB that XLA inserted around the kernel (a relayout of an input is a full extra pass over it).

Cases (bf16): flash attention forward at T = 8192 (causal GQA 32/8 x 128, default blocks) and
forward + backward at T = 4096 with segments, ALiBi and a soft-cap, and at T = 2048 with a learned
dense bias shared over the batch (its gradient too) and a boolean mask array per row, and with a
one-row bias and key-padding mask; top-K sparse attention for DeepSeek-V3.2 prefill (MLA: 128 heads,
512 + 64 latents; GQA 32/8), 8 tokens selecting 2048 of 32k; paged decode (GQA with split-KV, also
heads of 64 and MQA; absorbed MLA dense and sparse, 2 sequences x 32k; MLA at batch 1 too, whose
default split count follows the chip's TensorCores: v4 and v5p are compiled as megacore) and a
512-token prefill through the same paged caches (GQA 32/8; MLA, 128 heads); decode over contiguous
GQA and MLA caches (8 x 8k); the gated delta-rule state pass (fp32, heads of 128, chunks of 64); the
MoE grouped-matmul kernels over gpt-oss-20b's MXFP4 experts (forward and input gradient, 2048
tokens; beside it, the baseline of dequantizing them whole for XLA's ragged_dot; a baseline's
failure would not set the exit status) and Qwen3-30B-A3B's bf16 experts (forward and backward). And
on a 4-chip slice (``data`` 2 x ``tensor`` 2), the kernels in ``jax.shard_map`` as a sharded step
calls them: flash forward + backward, sparse MLA prefill, paged MLA decode; and (``data`` 2 x
``context`` 2) context-parallel causal attention forward + backward at T = 8192 with the flash
kernel, all-gather and ring (about 25 s and 40 s of compiling: ``--skip`` leaves cases out). Exit
status 1 if any case failed.
"""

from __future__ import annotations

import os

# Before jax initializes: compile for TPU through libtpu while JAX itself runs on the CPU, without
# looking for TPU hosts or metadata servers.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("TPU_WORKER_ID", "0")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-1")
# Other processes with libtpu loaded (test workers that imported jax) hold its lockfile, which
# guards TPU chips against sharing; there is no chip here to share.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

# chip -> (one-chip topology, 4-chip topology, tpu_info.ChipVersion name)
CHIPS = {"v4": ("v4:1x1x1", "v4:2x2x1", "TPU_V4"), "v5e": ("v5e:1x1", "v5e:2x2", "TPU_V5E"),
         "v5p": ("v5p:1x1x1", "v5p:2x2x1", "TPU_V5P"), "v6e": ("v6e:1x1", "v6e:2x2", "TPU_V6E")}
MEGACORE = ("v4", "v5p")
# Cases without a kernel: XLA's way of doing what a kernel case does, compiled for its memory.
BASELINES = frozenset({"MoE experts: MXFP4 dequantized + ragged_dot"})
_COPY = re.compile(r"= (\w+)\[([\d,]*)\][^ ]* (?:copy|copy-start|transpose)\(")


def big_copies(hlo_text: str, min_bytes: int = 1 << 20) -> list[str]:
  """``dtype[shape] (MiB)`` of every copy / transpose of at least ``min_bytes`` in the HLO."""
  out = []
  for line in hlo_text.splitlines():
    m = _COPY.search(line)
    if not m:
      continue
    dtype, dims = m.group(1), [int(d) for d in m.group(2).split(",") if d]
    itemsize = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2}.get(dtype, 4)
    size = int(np.prod(dims, dtype=np.int64)) * itemsize
    if size >= min_bytes:
      out.append(f"{dtype}[{','.join(map(str, dims))}] ({size / 2**20:.0f} MiB)")
  return out


def cases():
  """``name -> (function, argument shapes)``: every kernel called with ``interpret=False``."""
  from jaxattn.ops import masks as M  # noqa: PLC0415
  from jaxattn.ops.decode import (cache_attention, cache_mla_decode,  # noqa: PLC0415
                                  paged_attention, paged_mla_decode)
  from jaxattn.ops.moe import ClampedSwiGLU, routed_experts  # noqa: PLC0415
  from jaxattn.ops.mxfp4 import MXFP4Array  # noqa: PLC0415
  from pallas_kernels.delta_rule.tpu import chunked_delta_rule_tpu  # noqa: PLC0415
  from pallas_kernels.flash_attention import flash_attention_tpu  # noqa: PLC0415
  from pallas_kernels.sparse_attention import (sparse_attention_tpu,  # noqa: PLC0415
                                               sparse_mla_latent_tpu)

  def sds(dtype):
    return lambda *shape: jax.ShapeDtypeStruct(shape, dtype)
  bf16, f32, i32 = sds(jnp.bfloat16), sds(jnp.float32), sds(jnp.int32)

  def flash_fwd(q, k, v):
    return flash_attention_tpu(q, k, v, M.CausalMask(), interpret=False)

  def flash_grads(q, k, v, ids, slopes):
    mask = M.CausalMask() & M.SegmentMask(ids, ids)

    def loss(q, k, v):
      out = flash_attention_tpu(q, k, v, mask, alibi_slopes=slopes, logits_soft_cap=30.0,
                                interpret=False)
      return jnp.sum(out.astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  def flash_bias_grads(q, k, v, bias, allowed):
    """A learned bias shared over the batch (T5-style) and a boolean mask array per row: their
    [bq, bk] tiles streamed (the mask's as int8), transposed in the dK/dV kernel, the bias'
    gradient summed over the batch in its own kernel (one row: column sums per key block)."""
    def loss(q, k, v, bias):
      out = flash_attention_tpu(q, k, v, M.CausalMask(), bias=bias, mask_array=allowed,
                                interpret=False)
      return jnp.sum(out.astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, bias)

  def gqa_decode(q, k, v, t, n):
    return paged_attention(q, k, v, t, n, implementation="pallas_tpu", logits_soft_cap=30.0,
                           num_splits=4, interpret=False)

  def contiguous_decode(q, k, v, n, *scales):
    kw = dict(key_scale=scales[0], value_scale=scales[1]) if scales else {}
    return cache_attention(q, k, v, n, implementation="pallas_tpu", num_splits=4,
                           interpret=False, **kw)

  def quant_decode(q, k, v, t, n, ks, vs):
    return paged_attention(q, k, v, t, n, implementation="pallas_tpu", num_splits=4,
                           key_scale=ks, value_scale=vs, interpret=False)

  def moe_grads(x, idx, wts, *weights, implementation, mxfp4):
    """The routed experts' output and the input's gradient (frozen MXFP4 weights: only that;
    bf16 weights: theirs too)."""
    if mxfp4:   # [codes, scales] per matrix
      weights = [MXFP4Array(weights[i], weights[i + 1]) for i in range(0, 6, 2)]
    argnums = (0,) if mxfp4 else (0, 1, 2, 3)

    def loss(x, *ws):
      ws = ws if not mxfp4 else weights
      y, _ = routed_experts(x, idx, wts, *ws, implementation=implementation,
                            activation=ClampedSwiGLU() if mxfp4 else None)
      return jnp.sum(y.astype(jnp.float32)), y
    return jax.grad(loss, argnums=argnums, has_aux=True)(x, *([] if mxfp4 else weights))

  u8, i8, f8 = sds(jnp.uint8), sds(jnp.int8), sds(jnp.float8_e4m3fn)
  moe_mxfp4_shapes = (bf16(2048, 2880), i32(2048, 4), f32(2048, 4),
                      u8(32, 2880, 1536), u8(32, 2880, 90), u8(32, 2880, 1536), u8(32, 2880, 90),
                      u8(32, 2880, 1536), u8(32, 2880, 90))
  idx = i32(1, 8, 2048)
  table, lens = i32(2, 512), i32(2)
  # The k^R pool as PagedLatentCache stores it on TPU: 64 columns zero-padded to 128, one lane
  # tile per row (a 64-wide pool is laid out page-minor and relaid out on every call).
  latent = (bf16(2, 128, 512), bf16(2, 128, 64), bf16(1024, 64, 512), bf16(1024, 64, 128))
  return {
      "flash forward": (flash_fwd, (bf16(1, 8192, 32, 128), bf16(1, 8192, 8, 128),
                                    bf16(1, 8192, 8, 128))),
      "flash forward + backward": (flash_grads, (bf16(1, 4096, 32, 128), bf16(1, 4096, 8, 128),
                                                 bf16(1, 4096, 8, 128), i32(1, 4096), f32(32))),
      "flash forward + backward, dense bias and mask array": (
          flash_bias_grads, (bf16(2, 2048, 16, 128), bf16(2, 2048, 8, 128),
                             bf16(2, 2048, 8, 128), bf16(1, 16, 2048, 2048),
                             sds(jnp.bool_)(2, 1, 2048, 2048))),
      # a per-key bias and a key-padding mask ([B, 1, 1, S], as Hugging Face builds it): read as
      # one-row blocks, never broadcast over the queries
      "flash forward + backward, one-row bias and key-padding mask": (
          flash_bias_grads, (bf16(2, 2048, 16, 128), bf16(2, 2048, 8, 128),
                             bf16(2, 2048, 8, 128), bf16(1, 16, 1, 2048),
                             sds(jnp.bool_)(2, 1, 1, 2048))),
      "sparse MLA prefill": (
          lambda ql, qr, c, kr, i: sparse_mla_latent_tpu(ql, qr, c, kr, i, scale=0.07,
                                                         interpret=False),
          (bf16(1, 8, 128, 512), bf16(1, 8, 128, 64), bf16(1, 32768, 512), bf16(1, 32768, 64),
           idx)),
      "sparse GQA prefill": (
          lambda q, k, v, i: sparse_attention_tpu(q, k, v, i, interpret=False),
          (bf16(1, 8, 32, 128), bf16(1, 32768, 8, 128), bf16(1, 32768, 8, 128), idx)),
      # KV pools as PagedKVCache stores them, [P, page, K * H]; heads of 64 (Llama-3.2-1B) and
      # MQA (Gemma-2B) too, whose [P, page, K, H] pools XLA would re-tile on every step.
      "paged GQA decode": (gqa_decode, (bf16(2, 2, 32, 128), bf16(1024, 64, 8 * 128),
                                        bf16(1024, 64, 8 * 128), table, lens)),
      "paged GQA decode, heads of 64": (gqa_decode, (bf16(2, 1, 32, 64), bf16(1024, 64, 8 * 64),
                                                      bf16(1024, 64, 8 * 64), table, lens)),
      "paged MQA decode, heads of 256": (gqa_decode, (bf16(2, 1, 8, 256), bf16(1024, 64, 256),
                                                       bf16(1024, 64, 256), table, lens)),
      # Mistral-7B's sliding window (4096 keys) with ALiBi slopes: the page axis spans the
      # window's 65 pages of 64, not the table's 512.
      "paged GQA decode, window + ALiBi": (
          lambda q, k, v, t, n, s: paged_attention(q, k, v, t, n, implementation="pallas_tpu",
                                                   local_window_size=4095, alibi_slopes=s,
                                                   interpret=False),
          (bf16(2, 1, 32, 128), bf16(1024, 64, 8 * 128), bf16(1024, 64, 8 * 128), table, lens,
           f32(32))),
      # Quantized caches (PagedKVCache(dtype=int8 | float8_e4m3fn)): one-byte codes, scales
      # [P, 1, K * page] fp32 fetched page by page beside them (as [P, K, page], XLA relaid the
      # whole scale pool out on every step); pages of 64 and of 16.
      "paged GQA decode, int8 cache": (quant_decode, (
          bf16(2, 1, 32, 128), i8(1024, 64, 8 * 128), i8(1024, 64, 8 * 128), table, lens,
          f32(1024, 1, 8 * 64), f32(1024, 1, 8 * 64))),
      "paged GQA decode, fp8 cache": (quant_decode, (
          bf16(2, 1, 32, 128), f8(1024, 64, 8 * 128), f8(1024, 64, 8 * 128), table, lens,
          f32(1024, 1, 8 * 64), f32(1024, 1, 8 * 64))),
      "paged GQA decode, int8 cache, pages of 16": (quant_decode, (
          bf16(2, 1, 32, 128), i8(4096, 16, 8 * 128), i8(4096, 16, 8 * 128), i32(2, 2048),
          lens, f32(4096, 1, 8 * 16), f32(4096, 1, 8 * 16))),
      "contiguous-cache GQA decode, int8 cache": (contiguous_decode, (
          bf16(8, 1, 32, 128), i8(8, 8192, 8 * 128), i8(8, 8192, 8 * 128), i32(8),
          f32(8, 8, 8192), f32(8, 8, 8192))),
      # A contiguous KVCache (rows [B, S, K * H]) read as pages of itself (what Attention runs
      # on TPU for a cached step); flash attention would transpose the whole cache every step.
      "contiguous-cache GQA decode": (contiguous_decode, (
          bf16(8, 1, 32, 128), bf16(8, 8192, 8 * 128), bf16(8, 8192, 8 * 128), i32(8))),
      "contiguous-cache GQA decode, heads of 64": (contiguous_decode, (
          bf16(8, 1, 32, 64), bf16(8, 8192, 8 * 64), bf16(8, 8192, 8 * 64), i32(8))),
      # MHA, 32 KV heads of 128 (Llama-2-7B): pages sized to VMEM (128 tokens, not 512).
      "contiguous-cache MHA decode": (contiguous_decode, (
          bf16(4, 1, 32, 128), bf16(4, 8192, 32 * 128), bf16(4, 8192, 32 * 128), i32(4))),
      # A contiguous LatentCache as allocated on TPU: rows [c_KV 512 | k^R 64 | 64 zeros].
      "contiguous-cache MLA decode": (
          lambda ql, qr, kv, n: cache_mla_decode(ql, qr, kv, n, scale=0.07, num_splits=4,
                                                 implementation="pallas_tpu", interpret=False),
          (bf16(8, 1, 16, 512), bf16(8, 1, 16, 64), bf16(8, 8192, 640), i32(8))),
      "paged MLA decode": (
          lambda ql, qr, c, kr, t, n: paged_mla_decode(ql, qr, c, kr, t, n, scale=0.07,
                                                       implementation="pallas_tpu", num_splits=4,
                                                       interpret=False),
          (*latent, table, lens)),
      # A quantized latent cache: c_KV int8 codes and their scales [P, 1, page] fp32, k^R bf16.
      "paged MLA decode, int8 cache": (
          lambda ql, qr, c, kr, t, n, cs: paged_mla_decode(
              ql, qr, c, kr, t, n, scale=0.07, implementation="pallas_tpu", num_splits=4,
              c_kv_scale=cs, interpret=False),
          (*latent[:2], i8(1024, 64, 512), latent[3], table, lens, f32(1024, 1, 64))),
      # A contiguous LatentCache over int8 latents: codes [B, S, C], k^R [B, S, 128] bf16 (64
      # columns zero-padded), scales [B, 1, S]; read in place as pages of themselves.
      "contiguous-cache MLA decode, int8 cache": (
          lambda ql, qr, kv, n, kr, cs: cache_mla_decode(
              ql, qr, kv, n, scale=0.07, num_splits=4, implementation="pallas_tpu",
              interpret=False, k_rope=kr, c_kv_scale=cs),
          (bf16(8, 1, 16, 512), bf16(8, 1, 16, 64), i8(8, 8192, 512), i32(8),
           bf16(8, 8192, 128), f32(8, 1, 8192))),
      # Prefill through the caches: 512 new tokens, their query rows in blocks that fit VMEM
      # (GQA: 256 rows of a KV head's 2048; MLA: 512 of 512 x 128 heads), each block reading
      # only the pages its tokens can see.
      "paged GQA prefill (512 tokens)": (
          lambda q, k, v, t, n: paged_attention(q, k, v, t, n, implementation="pallas_tpu",
                                                interpret=False),
          (bf16(2, 512, 32, 128), bf16(1024, 64, 8 * 128), bf16(1024, 64, 8 * 128), table, lens)),
      "paged MLA prefill (512 tokens x 128 heads)": (
          lambda ql, qr, c, kr, t, n: paged_mla_decode(ql, qr, c, kr, t, n, scale=0.07,
                                                       implementation="pallas_tpu",
                                                       interpret=False),
          (bf16(2, 512, 128, 512), bf16(2, 512, 128, 64), *latent[2:], table, lens)),
      # Batch 1 with the default split count: one partition on a v5e / v6e; on a megacore
      # chip (v4, v5p) one per TensorCore, on the leading grid axis.
      "paged MLA decode (batch 1)": (
          lambda ql, qr, c, kr, t, n: paged_mla_decode(ql, qr, c, kr, t, n, scale=0.07,
                                                       implementation="pallas_tpu",
                                                       interpret=False),
          (bf16(1, 1, 128, 512), bf16(1, 1, 128, 64), *latent[2:], i32(1, 512), i32(1))),
      "paged sparse MLA decode": (
          lambda ql, qr, c, kr, t, n, i: paged_mla_decode(ql, qr, c, kr, t, n, scale=0.07,
                                                          indices=i, implementation="pallas_tpu",
                                                          interpret=False),
          (*latent, table, lens, i32(2, 2048))),
      # gpt-oss-20b's experts (32 of 2880 x 2880, top-4) over 2048 tokens, MXFP4 as published:
      # the kernels reading the codes packed, and (for the memory) XLA's ragged_dot after
      # dequantizing them whole; then Qwen3-30B-A3B's bf16 experts (128 of 2048 x 768, top-8),
      # forward and backward.
      "MoE experts: MXFP4 kernels (gpt-oss)": (
          lambda *a: moe_grads(*a, implementation="pallas_tpu", mxfp4=True), moe_mxfp4_shapes),
      "MoE experts: MXFP4 dequantized + ragged_dot": (
          lambda *a: moe_grads(*a, implementation="ragged_dot", mxfp4=True), moe_mxfp4_shapes),
      "MoE experts: bf16 kernels fwd + bwd (Qwen3-MoE)": (
          lambda *a: moe_grads(*a, implementation="pallas_tpu", mxfp4=False),
          (bf16(2048, 2048), i32(2048, 8), f32(2048, 8), bf16(128, 2048, 768),
           bf16(128, 2048, 768), bf16(128, 768, 2048))),
      "delta rule state pass": (
          lambda *a: chunked_delta_rule_tpu(*a, chunk_size=64, interpret=False),
          (f32(2, 1024, 4, 128), f32(2, 1024, 4, 128), f32(2, 1024, 4, 2, 128),
           f32(2, 1024, 4, 2), f32(2, 1024, 4, 2), f32(2, 4, 2, 128, 128), f32(2, 1024))),
  }


def sharded_cases(mesh):
  """``name -> (function, sharded argument shapes)`` on a ``data`` x ``tensor`` mesh: the kernels
  in ``jax.shard_map``, batch over ``data`` and heads over ``tensor``, as a jit-sharded training or
  serving step calls them."""
  from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: PLC0415

  from jaxattn.ops import masks as M  # noqa: PLC0415
  from pallas_kernels.flash_attention import flash_attention_tpu  # noqa: PLC0415
  from pallas_kernels.mla_decode import paged_mla_decode_tpu  # noqa: PLC0415
  from pallas_kernels.sparse_attention import sparse_mla_latent_tpu  # noqa: PLC0415

  def sds(dtype, *spec):
    sharding = NamedSharding(mesh, P(*spec))
    return lambda *shape: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
  heads, rows = ("data", None, "tensor", None), ("data", None, None)
  bf16_h, bf16_r, i32_r = sds(jnp.bfloat16, *heads), sds(jnp.bfloat16, *rows), sds(jnp.int32, *rows)

  def flash_grads(q, k, v, ids):
    mask = M.CausalMask() & M.SegmentMask(ids, ids)

    def loss(q, k, v):
      out = flash_attention_tpu(q, k, v, mask, logits_soft_cap=30.0, interpret=False, mesh=mesh)
      return jnp.sum(out.astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  whole = sds(jnp.bfloat16)
  return {**context_cases(mesh.devices), **{
      "flash fwd + bwd (2x2 mesh)": (flash_grads, (
          bf16_h(2, 4096, 32, 128), bf16_h(2, 4096, 8, 128), bf16_h(2, 4096, 8, 128),
          sds(jnp.int32, "data", None)(2, 4096))),
      "sparse MLA prefill (2x2 mesh)": (
          lambda ql, qr, c, kr, i: sparse_mla_latent_tpu(ql, qr, c, kr, i, scale=0.07,
                                                         interpret=False, mesh=mesh),
          (bf16_h(2, 8, 128, 512), bf16_h(2, 8, 128, 64), bf16_r(2, 32768, 512),
           bf16_r(2, 32768, 64), i32_r(2, 8, 2048))),
      "paged MLA decode (2x2 mesh)": (
          lambda ql, qr, c, kr, t, n: paged_mla_decode_tpu(ql, qr, c, kr, t, n, scale=0.07,
                                                           num_splits=4, interpret=False,
                                                           mesh=mesh),
          (bf16_h(2, 1, 128, 512), bf16_h(2, 1, 128, 128), whole(1024, 64, 512),
           whole(1024, 64, 128), sds(jnp.int32, "data", None)(2, 512), sds(jnp.int32, "data")(2))),
  }}


def context_cases(grid):
  """Context parallelism on a ``data`` x ``context`` slice: the sequence (8192 tokens) split over
  two chips, causal GQA forward + backward with the TPU flash kernel on each chip's blocks,
  all-gather (with its query-half swap) and ring."""
  from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: PLC0415

  from jaxattn.ops import context_parallel as cp  # noqa: PLC0415
  mesh = jax.sharding.Mesh(grid, ("data", "context"))
  split = NamedSharding(mesh, P("data", "context"))
  shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=split)  # noqa: E731

  def grads(strategy):
    def loss(q, k, v):
      out = cp.context_parallel_attention(q, k, v, is_causal=True, strategy=strategy, mesh=mesh,
                                          implementation="pallas_tpu")
      return jnp.sum(out.astype(jnp.float32))
    return lambda q, k, v: jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  args = (shape(2, 8192, 32, 128), shape(2, 8192, 8, 128), shape(2, 8192, 8, 128))
  return {f"context {s} fwd + bwd (2x2 mesh)": (grads(s), args) for s in cp.STRATEGIES}


def pick_names(arg: str, known, flag: str) -> set:
  """The case names in ``arg``, comma-separated; names holding commas themselves ("paged GQA
  decode, int8 cache") are matched whole against ``known`` (the longest first).  An unknown name
  is refused, naming ``flag``."""
  pieces = [p.strip() for p in arg.split(",")]
  names, i = set(), 0
  while i < len(pieces):
    if not pieces[i]:
      i += 1
      continue
    j = next((j for j in range(len(pieces), i, -1) if ", ".join(pieces[i:j]) in known), None)
    if j is None:
      raise SystemExit(f"{flag}: unknown case {pieces[i]!r}; cases: {sorted(known)}")
    names.add(", ".join(pieces[i:j]))
    i = j
  return names


def compile_for(chip: str, only: str = "", skip: str = ""):
  """Compiles every case for ``chip`` (``only`` / ``skip``: comma-separated case names, as the
  command line's); returns one result dict per case."""
  from jax._src.pallas.mosaic import tpu_info  # noqa: PLC0415
  from jax.experimental import topologies  # noqa: PLC0415

  one_chip, four_chips, version = CHIPS[chip]

  def devices(name, bounds):
    return topologies.get_topology_desc(platform="tpu", topology_name=name,
                                        chip_config_name="default",
                                        chips_per_host_bounds=bounds, num_slices=1).devices

  # Some Mosaic lowering rules read the local device's chip description: stand in the target.
  # v4 and v5p run as megacore: two TensorCores behind each JAX device.
  info = tpu_info.get_tpu_info_for_chip(getattr(tpu_info.ChipVersion, version),
                                        2 if chip in MEGACORE else 1)
  local = jax.devices()[0].device_kind
  tpu_info.registry[local] = lambda: info
  mesh = jax.sharding.Mesh(devices(one_chip, (1, 1, 1))[:1], ("x",))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  todo = [(name, fn, [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated)
                      for s in shapes]) for name, (fn, shapes) in cases().items()]
  grid = np.asarray(devices(four_chips, (2, 2, 1))[:4]).reshape(2, 2)
  todo += [(name, fn, list(shapes)) for name, (fn, shapes)
           in sharded_cases(jax.sharding.Mesh(grid, ("data", "tensor"))).items()]
  # The dispatcher runs Pallas kernels interpreted off a TPU; here the target is a TPU.
  from pallas_kernels.flash_attention import common  # noqa: PLC0415
  interpret_default = common.default_interpret
  common.default_interpret = lambda interpret: False if interpret is None else interpret
  known = [name for name, _, _ in todo]
  only, skip = pick_names(only, known, "--only"), pick_names(skip, known, "--skip")
  results = []
  try:
    for name, fn, args in todo:
      if (only and name not in only) or name in skip:
        continue
      row = dict(chip=chip, case=name)
      t0 = time.perf_counter()
      try:
        compiled = jax.jit(fn).trace(*args).lower().compile()
        mem = compiled.memory_analysis()
        row.update(ok=True, seconds=time.perf_counter() - t0,
                   temp_bytes=int(mem.temp_size_in_bytes),
                   argument_bytes=int(mem.argument_size_in_bytes),
                   copies=big_copies(compiled.as_text()))
      except Exception as e:  # noqa: BLE001 - every failure is reported, none stops the run
        row.update(ok=False, seconds=time.perf_counter() - t0,
                   error=f"{type(e).__name__}: {str(e).strip()[:2000]}")
      results.append(row)
      status = (f"compiled in {row['seconds']:5.1f}s  scratch {row['temp_bytes'] / 2**20:8.1f} "
                f"MiB  inputs {row['argument_bytes'] / 2**20:8.1f} MiB"
                + (f"  copies: {', '.join(row['copies'])}" if row["copies"] else "")
                if row["ok"] else "FAILED\n    " + row["error"].replace("\n", "\n    "))
      print(f"{chip:>4}  {name:<29} {status}", flush=True)
  finally:
    tpu_info.registry.pop(local, None)
    common.default_interpret = interpret_default
  return results


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--chips", default="v5e,v6e", help=f"comma-separated, of {sorted(CHIPS)}")
  ap.add_argument("--only", default="", help="comma-separated case names (default: all)")
  ap.add_argument("--skip", default="", help="comma-separated case names to leave out")
  ap.add_argument("--out", default="runs/tpu_compile_check")
  args = ap.parse_args(argv)
  chips = [c for c in args.chips.split(",") if c]
  bad = [c for c in chips if c not in CHIPS]
  if bad:
    raise SystemExit(f"--chips: unknown {bad}; choose from {sorted(CHIPS)}")
  try:
    import libtpu  # noqa: F401, PLC0415
  except ImportError:
    raise SystemExit("libtpu is not installed: pip install -e '.[tpu-compile]'") from None
  print(f"jax {jax.__version__}: compiling the TPU kernels for {', '.join(chips)} (no TPU needed)")
  results = [r for chip in chips for r in compile_for(chip, args.only, args.skip)]
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "results.json").write_text(json.dumps(results, indent=1))
  failed = [f"{r['chip']} {r['case']}" for r in results if not r["ok"]]
  print(f"{len(results) - len(failed)} of {len(results)} compiled"
        + (f"; failed: {', '.join(failed)}" if failed else ""))
  # A baseline that does not fit the chip is a finding about XLA's way, not a kernel failure.
  return 1 if any(not r["ok"] and r["case"] not in BASELINES for r in results) else 0


if __name__ == "__main__":
  raise SystemExit(main())
