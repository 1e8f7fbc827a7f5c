"""cuDNN's fused flash attention as a backend of ``dot_product_attention`` (``"cudnn"``).

On an H200 cuDNN's kernel (through ``jax.nn.dot_product_attention(implementation="cudnn")``) is
the fastest attention measured for the calls it computes (docs/performance.md: 543 / 458 TFLOP/s
forward, non-causal / causal at T = 8192, against 407 / 334 for the Pallas Triton kernel; 463
against 267 forward + backward), so on NVIDIA GPUs automatic dispatch tries it first and the Pallas
kernel (``"pallas_gpu"``) computes what cuDNN does not: segment ids of packed sequences, key
lengths, ALiBi, soft-capping, fp32, a query offset (chunked prefill), value head sizes other than
the key's, and the log-sum-exp residuals.

The call is mapped onto ``jax.nn.dot_product_attention``'s arguments; everything else raises
``UnsupportedError`` (so ``implementation=None`` moves on):

    mask (a band, q_offset = 0)           jax.nn arguments
    none / FullMask                       -
    causal                                is_causal=True
    causal window [p - w, p]              is_causal=True, local_window_size=(w, 0)

Masks go to cuDNN only with ``T == S``, so no case depends on how either side aligns a causal
mask when the lengths differ; ``implementation="xla"`` of ``jax.nn`` computes the same function
on any device, which is what the tests check the mapping against on CPU.  Rows are never fully
masked under these masks, so the "zeros, not NaN" contract of empty rows holds trivially.

Under a mesh (``jax.set_mesh``) the call runs in ``jax.shard_map`` with batch and heads split, as
the Pallas kernels do (``pallas_kernels.flash_attention.sharded``).

Needs an NVIDIA GPU of compute capability 8.0 or newer and bf16 / fp16 inputs; jax.nn checks the
rest (head sizes, the cuDNN version) when the call is traced, and those refusals become
``UnsupportedError`` too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxattn.ops import masks as M
from jaxattn.ops.attention import UnsupportedError

_DTYPES = (jnp.bfloat16, jnp.float16)


def nvidia_reason(device=None) -> str | None:
  """None when ``device`` (default: the first device) is an NVIDIA GPU of compute capability 8.0
  or newer (what cuDNN's flash attention and the Pallas Triton kernels need), else why not."""
  device = jax.devices()[0] if device is None else device
  kind = getattr(device, "device_kind", device)
  cc = getattr(device, "compute_capability", None)
  major = str(cc).split(".")[0]
  if cc is None or not major.isdigit():
    return (f"device {kind!r} reports no NVIDIA compute capability (got {cc!r}); the kernels are "
            "built for NVIDIA sm_80 and newer")
  if int(major) < 8:
    return f"device {kind!r} has compute capability {cc}; the kernels need sm_80 or newer"
  return None


def _band_arguments(mask) -> dict:
  """``jax.nn.dot_product_attention`` keyword arguments of a band ``mask``, or UnsupportedError."""
  band = M._band(mask) if mask is not None else (float("inf"), float("inf"))
  if band is None:
    raise UnsupportedError(f"cuDNN (through jax.nn) takes causal and left-window masks, not "
                           f"{type(mask).__name__} (segment ids, key lengths, global tokens)")
  left, right = band
  if left == float("inf") and right == float("inf"):
    return {}
  if right != 0:
    raise UnsupportedError(f"cuDNN takes a window only to the left of the query (causal); this "
                           f"mask reaches {right:g} keys to the right")
  if left == float("inf"):
    return dict(is_causal=True)
  return dict(is_causal=True, local_window_size=(int(left), 0))


def cudnn_attention(query, key, value, *, bias, mask, mask_array, scale, alibi_slopes,
                    logits_soft_cap, q_offset, return_residuals, residuals=None):
  """The dispatcher's normalized backend signature (``jaxattn.ops.attention``) on cuDNN."""
  if jax.default_backend() not in ("gpu", "cuda"):
    raise UnsupportedError(f"cuDNN needs an NVIDIA GPU; the default backend is "
                           f"{jax.default_backend()!r}")
  if (why := nvidia_reason()) is not None:
    raise UnsupportedError(why)
  declined = [name for name, present in (
      ("a dense `bias`", bias is not None), ("a boolean `mask` array", mask_array is not None),
      ("`alibi_slopes`", alibi_slopes is not None), ("`logits_soft_cap`", logits_soft_cap is not None),
      ("`return_residuals` (fp32 log-sum-exp)", return_residuals),
      ("given `residuals`", residuals is not None)) if present]
  if declined:
    raise UnsupportedError("this backend does not take " + ", ".join(declined))
  if query.dtype not in _DTYPES:
    raise UnsupportedError(f"cuDNN flash attention takes bf16 / fp16 inputs, got {query.dtype}")
  if value.shape[-1] != key.shape[-1]:
    raise UnsupportedError(f"jax.nn's cuDNN path needs the value head size ({value.shape[-1]}) to "
                           f"equal the key's ({key.shape[-1]})")
  if isinstance(q_offset, jax.Array) or isinstance(q_offset, jax.core.Tracer) or q_offset != 0:
    raise UnsupportedError(f"cuDNN aligns masks top-left only; `q_offset` must be a static 0, "
                           f"got {q_offset!r}")
  if isinstance(scale, (jax.Array, jax.core.Tracer)):
    raise UnsupportedError("cuDNN takes a static (Python float) `scale`, got a traced one")
  kwargs = _band_arguments(mask)
  if kwargs and query.shape[1] != key.shape[1]:
    raise UnsupportedError(f"a causal mask goes to cuDNN only for self-attention (T == S), got "
                           f"T={query.shape[1]}, S={key.shape[1]}")
  from pallas_kernels.flash_attention import sharded  # noqa: PLC0415 (import cycle)

  def local(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, scale=float(scale), implementation="cudnn",
                                        **kwargs)

  def specs(mesh):
    bax, hax = sharded.plan_specs(mesh, query.shape[0], query.shape[2], key.shape[2])
    spec = P(bax, None, hax, None)
    return [spec, spec, spec], spec

  try:  # under a mesh, as the Pallas kernels: batch and heads split in shard_map
    return sharded.run_sharded(local, [query, key, value], None, specs)
  except (NotImplementedError, ValueError, RuntimeError) as e:
    raise UnsupportedError(f"jax.nn's cuDNN path refused the call: {e}") from e
