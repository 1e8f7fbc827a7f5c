"""LoRA and QLoRA for any NNX model: adapters on chosen ``Einsum`` / ``nnx.Linear`` kernels.

    model = MyModel(...)                                          # pretrained
    apply_lora(model, r"attn/(q|v)_proj$", rank=8, alpha=16, rngs=nnx.Rngs(0))
    print(count_parameters(model))                                # trainable vs frozen
    optimizer = lora_optimizer(model, optax.adamw(1e-3))          # state for the adapters only
    step = make_train_step(loss_fn)                               # grads w.r.t. LoRAParam only
    loss = step(model, optimizer, batch)
    merge_lora(model)                                             # W0 += s * A B (unmerge_lora undoes)

A MoE's routed experts are targets too, by the path of their weight (``r"ffn/w_(gate|up|down)$"``):
each gets per-expert adapters (``ExpertLoRA``, ``A [E, in, r]``, ``B [E, r, out]``) that the MoE adds
to its expert kernels before dispatch; merge / unmerge / unload / counts / the optimizer cover them.

``apply_lora(..., quantize_base=True)`` is QLoRA: the frozen base kernels are stored as NF4 with
double-quantized scales (``jaxattn.ops.nf4``) and dequantized on the fly in the forward pass; the
adapters stay in ``param_dtype``.

Adapter matrices are ``LoRAParam`` (a subclass of ``nnx.Param``), so ``nnx.state(model, LoRAParam)``,
``nnx.DiffState(0, LoRAParam)`` and ``nnx.Optimizer(model, tx, wrt=LoRAParam)`` select exactly them;
NF4 storage is ``NF4Weight`` (an ``nnx.Variable``, never a parameter).  Formulas: ``jaxattn.ops.lora``.

Stacked (scanned) layers: a layer whose kernel has more axes than its einsum's kernel term, as in
``DecoderLM(config)`` with ``scan_layers=True`` (kernels ``[L, ...]`` with the logical axis
``"layers"`` first), gets stacked adapters ``lora_a [L, ...in, r]``, ``lora_b [L, r, ...out]``
(A drawn independently per layer, B zero; the kernel's leading axis names prefixed) and, with
``quantize_base``, one NF4 code per layer.  They sit in the stacked state, so ``nnx.scan`` hands
each step its own layer's slice; ``merge`` / ``unmerge`` / ``delta`` / ``unload_lora`` work on the
whole stack (the update is vmapped over the leading axes).  A stacked layer runs one slice at a
time: call it inside ``nnx.scan`` / ``nnx.vmap`` over the leading axes, as the model does.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxattn.checks import check_bool, check_int, is_number
from jaxattn.nn.linear import Einsum, effective_kernel
from jaxattn.ops import lora as lora_ops
from jaxattn.ops import nf4 as nf4_ops

LINEAR_SPEC = "...i,io->...o"   # nnx.Linear as an einsum


class LoRAParam(nnx.Param):
  """A LoRA adapter matrix: the only parameters a LoRA optimizer trains."""


class NF4Weight(nnx.Variable):
  """Frozen NF4 storage of a base kernel (packed indices, block scales); not a parameter."""


def _kernel_axes(base) -> tuple:
  if isinstance(base, NF4Einsum):
    return base.kernel_axes
  axes = base.kernel.get_metadata().get("logical_axes")
  return tuple(axes) if axes is not None else (None,) * base.kernel[...].ndim


def _base_spec(base) -> str:
  if isinstance(base, (Einsum, NF4Einsum)):
    return base.spec
  if isinstance(base, nnx.Linear):
    return LINEAR_SPEC
  raise ValueError(f"LoRA supports jaxattn.nn.Einsum, flax.nnx.Linear and NF4Einsum layers, got "
                   f"{type(base).__name__}.")


def _kernel_shape(base) -> tuple[int, ...]:
  """The stored kernel's full shape, leading stacked axes included."""
  if isinstance(base, NF4Einsum):
    return base.stack_shape + base.kernel_shape
  return tuple(base.kernel[...].shape)


def _kernel_term_rank(spec: str) -> int:
  """Number of axes of the kernel term of ``spec`` (``"BTD,DNH->BTNH"``: 3)."""
  terms = spec.replace(" ", "").split("->")[0].split(",") if isinstance(spec, str) else ()
  if len(terms) != 2 or "..." in terms[1]:
    raise ValueError(f"`spec` must be an explicit two-operand einsum 'x,kernel->out' without '...' "
                     f"in the kernel term, got {spec!r}.")
  return len(terms[1])


def _num_stacked(spec: str, shape: Sequence[int], what: str) -> int:
  """How many leading axes of a kernel of ``shape`` stack copies of the ``spec`` kernel."""
  n = len(shape) - _kernel_term_rank(spec)
  if n < 0:
    raise ValueError(f"{what} of shape {tuple(shape)} has fewer axes than the kernel term of its "
                     f"spec {spec!r} ({_kernel_term_rank(spec)}); want the kernel, optionally with "
                     "leading stacked (scanned-layer) axes.")
  return n


def _over_stack(f: Callable, n: int) -> Callable:
  """``f`` mapped over ``n`` leading axes of every argument (``n = 0``: ``f`` itself)."""
  for _ in range(n):
    f = jax.vmap(f)
  return f


def _stacked_dropout(rate: float, rngs: nnx.Rngs, stack: tuple[int, ...]) -> nnx.Dropout:
  """A ``Dropout`` whose RNG state is split over ``stack`` (each scanned layer draws its own
  masks), created as the model creates its stacked layers."""
  if not stack:
    return nnx.Dropout(rate, rngs=rngs)

  @nnx.split_rngs(splits=stack[0])
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def make(r):
    return _stacked_dropout(rate, r, stack[1:])
  return make(rngs)


def _stacked_call_error(name: str, stack: tuple[int, ...]) -> ValueError:
  return ValueError(f"this {name} holds layers stacked over leading axes of shape {stack} (scanned "
                    "layers); call it on one slice, inside nnx.scan / nnx.vmap over those axes as "
                    "DecoderLM(scan_layers=True) does.")


class NF4Einsum(nnx.Module):
  """A frozen linear map whose kernel is stored in NF4 and dequantized on every call (QLoRA's base).

  Built from an ``Einsum`` or ``nnx.Linear`` with ``NF4Einsum.from_module(layer)``; computes
  ``einsum(spec, x, dequantize(kernel)) (+ bias)`` in ``dtype`` (default: the input's).  With
  ``recompute=True`` (``jaxattn.ops.nf4.nf4_einsum``) the backward pass dequantizes again rather than
  keeping the full-precision kernel between the passes.  The
  kernel is flattened row-major for quantization, so it is not shardable by logical axes (it is ~8x
  smaller).

  A ``kernel`` with more axes than the spec's kernel term is a stack of kernels (scanned layers,
  ``stack_shape`` = the extra leading axes): each is quantized on its own (``packed [L, n / 2]``,
  ``absmax [L, nb]``, ...), ``kernel_shape`` is one layer's, and the layer runs one slice at a time
  (inside ``nnx.scan``).
  """

  def __init__(self, spec: str, kernel: jax.Array, bias: jax.Array | None = None, *,
               kernel_axes: Sequence[str | None] | None = None, bias_axes: Sequence[str | None] = (),
               block_size: int = 64, double_quant: bool = True, scale_block_size: int = 256,
               dtype=None, recompute: bool = True, source: str = "einsum"):
    self.spec, self.dtype, self.source, self.recompute = spec, dtype, source, recompute
    n = _num_stacked(spec, kernel.shape, "`kernel`")
    self.stack_shape = tuple(int(s) for s in kernel.shape[:n])
    self.kernel_shape = tuple(int(s) for s in kernel.shape[n:])
    self.kernel_axes = tuple(kernel_axes) if kernel_axes is not None else (None,) * kernel.ndim
    self.param_dtype = jnp.dtype(kernel.dtype)
    self.block_size, self.scale_block_size = block_size, scale_block_size
    # Stacked layers: one code per layer (vmapped), so a scan step's slice is a plain NF4 kernel.
    q = _over_stack(lambda w: nf4_ops.quantize_nf4(w, block_size=block_size,
                                                   double_quant=double_quant,
                                                   scale_block_size=scale_block_size), n)(kernel)
    self.packed = NF4Weight(q.packed, num_elements=int(kernel.size))
    self.absmax = NF4Weight(q.absmax, num_elements=0)
    self.absmax_scale = None if q.absmax_scale is None else NF4Weight(q.absmax_scale, num_elements=0)
    self.absmax_offset = None if q.absmax_offset is None else NF4Weight(q.absmax_offset,
                                                                         num_elements=0)
    self.bias = None if bias is None else nnx.Param(bias, logical_axes=tuple(bias_axes))

  @classmethod
  def from_module(cls, layer, *, block_size: int = 64, double_quant: bool = True,
                  scale_block_size: int = 256) -> "NF4Einsum":
    """Quantizes an ``Einsum`` or ``nnx.Linear`` (its bias stays in full precision)."""
    spec = _base_spec(layer)
    if isinstance(layer, NF4Einsum):
      return layer
    bias = None if layer.bias is None else layer.bias[...]
    bias_axes = () if layer.bias is None else tuple(
        layer.bias.get_metadata().get("logical_axes") or (None,) * layer.bias[...].ndim)
    return cls(spec, layer.kernel[...], bias, kernel_axes=_kernel_axes(layer), bias_axes=bias_axes,
               block_size=block_size, double_quant=double_quant, scale_block_size=scale_block_size,
               dtype=layer.dtype, source="linear" if isinstance(layer, nnx.Linear) else "einsum")

  def quantized(self) -> nf4_ops.NF4Tensor:
    opt = lambda v: None if v is None else v[...]
    return nf4_ops.NF4Tensor(self.packed[...], self.absmax[...], opt(self.absmax_scale),
                             opt(self.absmax_offset))

  def _num_stacked_now(self) -> int:
    # From the array, not ``stack_shape``: inside nnx.scan the same module holds one slice.
    return self.packed[...].ndim - 1

  def dequantized_kernel(self, dtype=jnp.float32) -> jax.Array:
    """The kernel rebuilt from NF4 (leading stacked axes + ``kernel_shape``, ``dtype``)."""
    f = lambda q: nf4_ops.dequantize_nf4(q, self.kernel_shape, block_size=self.block_size,
                                         scale_block_size=self.scale_block_size, dtype=dtype)
    return _over_stack(f, self._num_stacked_now())(self.quantized())

  def effective_kernel(self) -> jax.Array:
    """The dequantized kernel in the parameter dtype (``jaxattn.nn.linear.effective_kernel``)."""
    return self.dequantized_kernel(self.param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    if self._num_stacked_now():
      raise _stacked_call_error("NF4Einsum", self.stack_shape)
    dtype = self.dtype or x.dtype
    if self.recompute:
      y = nf4_ops.nf4_einsum(self.spec, x, self.quantized(), self.kernel_shape,
                             block_size=self.block_size, scale_block_size=self.scale_block_size,
                             dtype=dtype)
    else:
      y = jnp.einsum(self.spec, x.astype(dtype), self.dequantized_kernel(dtype))
    if self.bias is not None:
      y = y + self.bias[...].astype(dtype)
    return y


def _check_dropout(dropout) -> None:
  if not is_number(dropout) or not 0 <= dropout < 1:
    raise ValueError(f"`dropout` must be a number in [0, 1), got {dropout!r}.")


class LoRA(nnx.Module):
  """``base(x) + scaling * B(A(dropout(x)))`` around a frozen ``Einsum``, ``nnx.Linear`` or ``NF4Einsum``.

  ``A`` (``lora_a``: the kernel's input axes + ``[r]``) is Kaiming-uniform as peft initializes it
  (bound ``1 / sqrt(fan_in)``), ``B`` (``lora_b``: ``[r]`` + output axes) is zero, so the wrapped layer
  starts as the base.  ``scaling = alpha / rank`` (``alpha / sqrt(rank)`` with ``use_rslora``).
  ``dropout`` applies to the adapter's input only (active unless ``model.eval()``).
  ``merge()`` adds ``scaling * A B`` to the base kernel and skips the adapter; ``unmerge()`` undoes it.

  A base whose kernel carries leading stacked axes (scanned layers, ``stack_shape``, e.g. ``[L]``)
  gets adapters stacked the same way (``[L, ...in, r]``, ``[L, r, ...out]``, A drawn independently
  per layer, logical axes prefixed with the kernel's leading names, dropout RNG split per layer);
  the forward pass then runs on one slice (inside ``nnx.scan``), ``merge``/``delta`` on the stack.
  """

  def __init__(self, base, *, rank: int = 8, alpha: float = 8.0, use_rslora: bool = False,
               dropout: float = 0.0, rngs: nnx.Rngs, param_dtype=jnp.float32):
    spec = _base_spec(base)
    _check_dropout(dropout)
    self.scaling = lora_ops.lora_scaling(rank, alpha, use_rslora=use_rslora)
    self.rank, self.alpha, self.use_rslora = rank, alpha, use_rslora
    self.specs = lora_ops.lora_einsum_specs(spec)
    self.base = base
    full_shape, full_axes = _kernel_shape(base), _kernel_axes(base)
    n = _num_stacked(spec, full_shape, f"the kernel of {type(base).__name__}")
    self.stack_shape = tuple(full_shape[:n])
    stack_axes, shape, axes = tuple(full_axes[:n]), full_shape[n:], full_axes[n:]
    sp = self.specs
    fan_in = int(np.prod([shape[i] for i in sp.in_axes]))
    bound = lora_ops.kaiming_uniform_bound(fan_in)
    a_axes = stack_axes + tuple(axes[i] for i in sp.shared_axes + sp.in_axes) + (None,)
    b_axes = (stack_axes + tuple(axes[i] for i in sp.shared_axes) + (None,)
              + tuple(axes[i] for i in sp.out_axes))
    a_shape = sp.a_shape(shape, rank)
    # Stacked layers: i.i.d. entries over the whole stack, i.e. an independent draw per layer, each
    # with one layer's bound.
    a = jax.random.uniform(rngs.params(), self.stack_shape + a_shape, param_dtype, -bound, bound)
    self.lora_a = LoRAParam(a, logical_axes=a_axes)
    self.lora_b = LoRAParam(jnp.zeros(self.stack_shape + sp.b_shape(shape, rank), param_dtype),
                            logical_axes=b_axes)
    self.dropout = _stacked_dropout(dropout, rngs, self.stack_shape) if dropout > 0 else None
    self.merged = False

  def _num_stacked_now(self) -> int:
    # From the array, not ``stack_shape``: inside nnx.scan the same module holds one slice.
    return self.lora_a[...].ndim - (len(self.specs.shared_axes) + len(self.specs.in_axes) + 1)

  def effective_kernel(self) -> jax.Array:
    """``W0 + scaling * A B`` (just ``W0`` once merged), in ``W0``'s dtype: what MLA's matrix
    absorption uses in place of the kernel (``jaxattn.nn.linear.effective_kernel``)."""
    w = effective_kernel(self.base)
    if self.merged:
      return w
    return (w.astype(jnp.float32) + self.delta()).astype(w.dtype)

  def delta(self) -> jax.Array:
    """The kernel-shaped update ``scaling * A B`` (fp32; stacked layers: vmapped over the stack)."""
    f = lambda a, b: lora_ops.lora_delta(self.specs, a, b, self.scaling)
    return _over_stack(f, self._num_stacked_now())(self.lora_a[...], self.lora_b[...])

  def merge(self) -> None:
    """``W0 <- W0 + scaling * A B`` in place; the adapter is then skipped in the forward pass."""
    if self.merged:
      return
    if isinstance(self.base, NF4Einsum):
      raise ValueError("cannot merge into an NF4 kernel exactly (re-quantizing would change it); use "
                       "unload_lora(model, merge=True) for dense merged layers.")
    k = self.base.kernel
    k[...] = (k[...].astype(jnp.float32) + self.delta()).astype(k[...].dtype)
    self.merged = True

  def unmerge(self) -> None:
    """Undoes ``merge`` (``W0 <- W0 - scaling * A B``): exact up to one rounding to the kernel's
    dtype each way (fp32 kernels: a last-bit difference; bf16 kernels can move by one bf16 ulp,
    as with peft; keep a copy of ``W0`` where the round trip must be exact)."""
    if not self.merged:
      return
    k = self.base.kernel
    k[...] = (k[...].astype(jnp.float32) - self.delta()).astype(k[...].dtype)
    self.merged = False

  def __call__(self, x: jax.Array) -> jax.Array:
    if self._num_stacked_now():
      raise _stacked_call_error("LoRA layer", self.stack_shape)
    y = self.base(x)
    if self.merged:
      return y
    h = x if self.dropout is None else self.dropout(x)
    dt = y.dtype
    z = jnp.einsum(self.specs.down, h.astype(dt), self.lora_a[...].astype(dt))      # [..., r]
    return y + (self.scaling * jnp.einsum(self.specs.up, z, self.lora_b[...].astype(dt))).astype(dt)


EXPERT_KERNELS = ("w_gate", "w_up", "w_down")   # the routed experts' weights of a MoE


class ExpertLoRA(nnx.Module):
  """Per-expert LoRA on a MoE's routed-expert weight ``W [..., E, in, out]``: expert ``e``'s kernel
  becomes ``W_e + scaling * A_e B_e`` with ``A [..., E, in, r]`` (Kaiming-uniform, bound
  ``1 / sqrt(in)``, as ``LoRA``) and ``B [..., E, r, out]`` (zero).  The MoE passes each expert
  weight with its factors (``MoE.expert_kernel``: a ``jaxattn.ops.moe.LoRAWeight``), and the
  dropless dispatch paths compute ``x W + scaling (x A) B`` (two rank-``r`` grouped matmuls, no
  ``[E, in, out]`` update); the capacity path and the dense reference add ``scaling A B`` to the
  matrices.  Leading axes (scanned layers) are stacked as in ``LoRA``.
  Attached by ``apply_lora`` as ``<name>_lora`` on the MoE; ``merged`` means it is in ``W``.
  """

  def __init__(self, kernel: nnx.Param, *, rank: int = 8, alpha: float = 8.0,
               use_rslora: bool = False, rngs: nnx.Rngs, param_dtype=jnp.float32):
    if hasattr(kernel, "dequantize"):   # frozen MXFP4 experts (MoE.quantize_experts): QLoRA
      shape, axes = tuple(kernel.shape), kernel.logical_axes
    else:
      shape, axes = tuple(kernel[...].shape), kernel.get_metadata().get("logical_axes")
    if len(shape) < 3:
      raise ValueError(f"an expert kernel must be [..., E, in, out], got shape {shape}.")
    axes = tuple(axes) if axes is not None else (None,) * len(shape)
    self.scaling = lora_ops.lora_scaling(rank, alpha, use_rslora=use_rslora)
    self.rank, self.alpha, self.use_rslora = rank, alpha, use_rslora
    bound = lora_ops.kaiming_uniform_bound(shape[-2])
    a = jax.random.uniform(rngs.params(), shape[:-1] + (rank,), param_dtype, -bound, bound)
    self.lora_a = LoRAParam(a, logical_axes=axes[:-1] + (None,))
    self.lora_b = LoRAParam(jnp.zeros(shape[:-2] + (rank, shape[-1]), param_dtype),
                            logical_axes=axes[:-2] + (None, axes[-1]))
    self.merged = False

  def delta(self) -> jax.Array:
    """``scaling * A_e B_e`` for every expert (and stacked layer): fp32, the kernel's shape."""
    a = self.lora_a[...].astype(jnp.float32)
    b = self.lora_b[...].astype(jnp.float32)
    return self.scaling * jnp.einsum("...ir,...ro->...io", a, b)



def _moe_type():
  from jaxattn.nn.moe import MoE  # noqa: PLC0415  (moe imports nothing from here)
  return MoE


def _expert_targets(model, regexes=None):
  """``[(path, moe, name)]`` of routed-expert weights (``.../<moe>/w_gate`` etc.) whose path one
  of ``regexes`` matches (all of them without ``regexes``)."""
  out = []
  for path, moe in _find(model, _moe_type()):
    for name in EXPERT_KERNELS:
      p = f"{_path_str(path)}/{name}"
      if regexes is None or any(r.search(p) for r in regexes):
        out.append((p, moe, name))
  return out


def expert_lora_layers(model: nnx.Module) -> list[tuple[str, ExpertLoRA]]:
  """``[(path of the expert weight, ExpertLoRA)]`` in ``model``."""
  return [(p, getattr(moe, f"{name}_lora")) for p, moe, name in _expert_targets(model)
          if getattr(moe, f"{name}_lora", None) is not None]


def _check_mergeable_experts(model, merged: bool) -> None:
  """Refuses (before anything moves) to merge an adapter into, or out of, MXFP4 experts."""
  frozen = [p for p, moe, name in _expert_targets(model)
            if getattr(moe, f"{name}_lora", None) is not None
            and getattr(moe, f"{name}_lora").merged != merged
            and hasattr(getattr(moe, name), "dequantize")]
  if frozen:
    raise ValueError(f"{frozen[0]} is held in MXFP4: an adapter cannot be merged into its codes "
                     "(keep it unmerged, as QLoRA does; unload_lora(model, merge=False) drops "
                     "it).")


def _merge_experts(model, sign: float, merged: bool) -> None:
  _check_mergeable_experts(model, merged)
  for _, moe, name in _expert_targets(model):
    adapter = getattr(moe, f"{name}_lora", None)
    if adapter is None or adapter.merged == merged:
      continue
    k = getattr(moe, name)
    k[...] = (k[...].astype(jnp.float32) + sign * adapter.delta()).astype(k[...].dtype)
    adapter.merged = merged


# ---------------------------------------------------------------------------------------------
# Transforms over a whole model
# ---------------------------------------------------------------------------------------------


_TARGET_TYPES = (Einsum, nnx.Linear, NF4Einsum)


def _path_str(path) -> str:
  return "/".join(str(p) for p in path)


def _get_child(node, key):
  return node[key] if isinstance(key, int) else getattr(node, key)


def _set_child(node, key, value):
  if isinstance(key, int):
    node[key] = value
  else:
    setattr(node, key, value)


def _find(model, cls, predicate=lambda path: True):
  """``[(path, module)]`` of modules of type ``cls`` under ``model`` (not the LoRA bases)."""
  found = []
  for path, node in nnx.iter_graph(model):
    if not isinstance(node, cls) or not path:
      continue
    parent = model
    for key in path[:-1]:
      parent = _get_child(parent, key)
    if isinstance(parent, LoRA):
      continue
    if predicate(_path_str(path)):
      found.append((tuple(path), node))
  return found


def _replace(model, path, new):
  parent = model
  for key in path[:-1]:
    parent = _get_child(parent, key)
  _set_child(parent, path[-1], new)


def apply_lora(
    model: nnx.Module,
    targets: str | Sequence[str],
    *,
    rank: int = 8,
    alpha: float = 8.0,
    use_rslora: bool = False,
    dropout: float = 0.0,
    quantize_base: bool = False,
    block_size: int = 64,
    double_quant: bool = True,
    rngs: nnx.Rngs,
    param_dtype=jnp.float32,
) -> list[str]:
  """Wraps the ``Einsum`` / ``nnx.Linear`` layers of ``model`` selected by ``targets`` in ``LoRA`` (in place).

  ``targets``: a regular expression (or several) searched in each layer's path, the attribute names
  and list indices joined by ``/`` (``"blocks/3/attn/q_proj"``): ``r"attn/(q|v)_proj$"``,
  ``r"mlp/(up|gate|down)$"``, ``".*"``.  A MoE's routed-expert weights are targets too, by the path
  of the weight (``r"ffn/w_(gate|up|down)$"``): each gets per-expert adapters (``ExpertLoRA``).
  ``quantize_base=True`` stores the selected base kernels in NF4 (QLoRA; ``block_size``,
  ``double_quant``); expert weights take neither NF4 nor ``dropout``.  Returns the adapted paths;
  raises ``ValueError`` when nothing matches.
  """
  try:
    patterns = [targets] if isinstance(targets, str) else list(targets)
  except TypeError:  # not iterable: None, a number, a compiled pattern
    patterns = []
  if not patterns or not all(isinstance(p, str) for p in patterns):
    raise ValueError(f"`targets` must be a regular expression (str) or a non-empty sequence of "
                     f"them, got {targets!r}.")
  try:
    regexes = [re.compile(p) for p in patterns]
  except re.error as e:
    raise ValueError(f"`targets` {patterns!r} is not a valid regular expression: {e}") from None
  found = _find(model, _TARGET_TYPES, lambda s: any(r.search(s) for r in regexes))
  experts = [(p, moe, name) for p, moe, name in _expert_targets(model, regexes)
             if getattr(moe, f"{name}_lora", None) is None]
  if not found and not experts:
    candidates = ([_path_str(p) for p, _ in _find(model, _TARGET_TYPES)]
                  + [p for p, _, _ in _expert_targets(model)])
    raise ValueError(f"`targets` {patterns!r} match no Einsum / nnx.Linear layer or expert "
                     f"weight; layers: {candidates[:20]}{' ...' if len(candidates) > 20 else ''}.")
  # Every argument is checked before the model changes (a refusal must not leave it half adapted).
  lora_ops.lora_scaling(rank, alpha, use_rslora=use_rslora)   # rank, alpha, use_rslora
  _check_dropout(dropout)
  check_bool("quantize_base", quantize_base)
  check_bool("double_quant", double_quant)
  if quantize_base:
    check_int("block_size", block_size)
  if not isinstance(rngs, nnx.Rngs):
    raise ValueError(f"`rngs` must be an nnx.Rngs (the adapters' A is drawn from it), got "
                     f"{type(rngs).__name__}.")
  if experts and (quantize_base or dropout > 0):
    raise ValueError(f"`targets` {patterns!r} select routed-expert weights "
                     f"({experts[0][0]}, ...), which take no NF4 base (`quantize_base`) and no "
                     "`dropout`; target them in a separate apply_lora call without those.")
  # Built first, attached after: a failure while building leaves the model as it was.
  expert_adapters = [(moe, name, ExpertLoRA(getattr(moe, name), rank=rank, alpha=alpha,
                                            use_rslora=use_rslora, rngs=rngs,
                                            param_dtype=param_dtype))
                     for _, moe, name in experts]
  layers = []
  for path, layer in found:
    base = (NF4Einsum.from_module(layer, block_size=block_size, double_quant=double_quant)
            if quantize_base else layer)
    layers.append((path, LoRA(base, rank=rank, alpha=alpha, use_rslora=use_rslora,
                              dropout=dropout, rngs=rngs, param_dtype=param_dtype)))
  for moe, name, adapter in expert_adapters:
    setattr(moe, f"{name}_lora", adapter)
  for path, adapter in layers:
    _replace(model, path, adapter)
  return [_path_str(p) for p, _ in found] + [p for p, _, _ in experts]


def lora_layers(model: nnx.Module) -> list[tuple[str, LoRA]]:
  """``[(path, LoRA)]`` in ``model``."""
  return [(_path_str(p), m) for p, m in _find(model, LoRA)]


def merge_lora(model: nnx.Module) -> None:
  """Merges every adapter into its base kernel (in place), expert adapters included.  Refused
  (before anything is merged) when an unmerged adapter sits on an NF4 base."""
  layers = lora_layers(model)
  _check_mergeable_experts(model, True)
  nf4 = [p for p, m in layers if isinstance(m.base, NF4Einsum) and not m.merged]
  if nf4:
    raise ValueError(f"cannot merge into an NF4 kernel exactly ({nf4[0]}"
                     f"{' ...' if len(nf4) > 1 else ''}; re-quantizing would change it): use "
                     "unload_lora(model, merge=True) for dense merged layers.")
  for _, m in layers:
    m.merge()
  _merge_experts(model, 1.0, True)


def unmerge_lora(model: nnx.Module) -> None:
  """Undoes ``merge_lora`` (in place)."""
  for _, m in lora_layers(model):
    m.unmerge()
  _merge_experts(model, -1.0, False)


def _dense_like(base: NF4Einsum, kernel: jax.Array):
  """An ``Einsum`` / ``nnx.Linear`` holding ``kernel`` (built abstractly, then filled)."""
  bias = None if base.bias is None else base.bias[...]
  n = len(base.stack_shape)   # stacked layers: build one layer's module, then store the stack
  if base.source == "linear":
    din, dout = base.kernel_shape
    layer = nnx.eval_shape(lambda: nnx.Linear(din, dout, use_bias=bias is not None, dtype=base.dtype,
                                              rngs=nnx.Rngs(0)))
    layer.kernel = nnx.Param(kernel)
  else:
    layer = nnx.eval_shape(lambda: Einsum(base.spec, base.kernel_shape, base.kernel_axes[n:],
                                          rngs=nnx.Rngs(0), use_bias=bias is not None,
                                          dtype=base.dtype))
    layer.kernel = nnx.Param(kernel, logical_axes=base.kernel_axes)
  if bias is not None:
    axes = base.bias.get_metadata().get("logical_axes")
    layer.bias = nnx.Param(bias) if axes is None else nnx.Param(bias, logical_axes=axes)
  return layer


def unload_lora(model: nnx.Module, *, merge: bool = True) -> None:
  """Replaces every ``LoRA`` wrapper by a plain layer (in place), merged unless ``merge=False``.

  An NF4 base becomes a dense layer holding ``dequantize(W0) + scaling * A B`` (``merge=True``) or
  ``dequantize(W0)``: the same function as the adapted layer, at full-precision cost.  Expert
  adapters are merged into (or removed from) their MoE's weights and dropped.
  """
  if merge:
    _merge_experts(model, 1.0, True)
  else:
    _merge_experts(model, -1.0, False)
  for _, moe, name in _expert_targets(model):
    if getattr(moe, f"{name}_lora", None) is not None:
      setattr(moe, f"{name}_lora", None)
  for path, m in _find(model, LoRA):
    if isinstance(m.base, NF4Einsum):
      w = m.base.dequantized_kernel(jnp.float32)
      if merge and not m.merged:
        w = w + m.delta()
      new = _dense_like(m.base, w.astype(m.base.param_dtype))
    else:
      if merge:
        m.merge()
      else:
        m.unmerge()
      new = m.base
    _replace(model, path, new)


# ---------------------------------------------------------------------------------------------
# Training only the adapters
# ---------------------------------------------------------------------------------------------


def lora_optimizer(model: nnx.Module, tx: optax.GradientTransformation, *,
                   wrt: Any = LoRAParam) -> nnx.Optimizer:
  """``nnx.Optimizer(model, tx, wrt=LoRAParam)``: optimizer state for the adapters only."""
  return nnx.Optimizer(model, tx, wrt=wrt)


def make_train_step(loss_fn: Callable[..., jax.Array], *, wrt: Any = LoRAParam):
  """A jitted ``step(model, optimizer, *batch) -> loss`` that differentiates only ``wrt`` variables.

  ``loss_fn(model, *batch)`` returns a scalar.  With the default ``wrt=LoRAParam`` the frozen base
  gets no gradient (none is computed or stored); pass ``wrt=nnx.Param`` for full fine-tuning.
  """
  @nnx.jit
  def step(model, optimizer, *batch):
    loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, wrt))(model, *batch)
    optimizer.update(model, grads)
    return loss
  return step


@dataclasses.dataclass(frozen=True)
class ParameterCounts:
  """Trainable vs frozen parameter counts (NF4 kernels count their weights) and their bytes."""
  trainable: int
  frozen: int
  trainable_bytes: int
  frozen_bytes: int

  @property
  def total(self) -> int:
    return self.trainable + self.frozen

  @property
  def trainable_fraction(self) -> float:
    return self.trainable / max(self.total, 1)

  def __str__(self):
    mib = lambda b: b / 2**20
    return (f"trainable {self.trainable:,} ({100 * self.trainable_fraction:.3f}%, "
            f"{mib(self.trainable_bytes):.2f} MiB) | frozen {self.frozen:,} "
            f"({mib(self.frozen_bytes):.2f} MiB) | total {self.total:,}")


def count_parameters(model: nnx.Module, *, trainable: Any = LoRAParam) -> ParameterCounts:
  """Counts ``trainable`` variables (default ``LoRAParam``) against the frozen rest.

  Frozen: every other ``nnx.Param`` plus NF4 storage, counted as the number of weights it encodes
  (bytes: what it occupies).  RNG state and other non-parameter variables are not counted.
  """
  is_trainable = nnx.filterlib.to_predicate(trainable)
  counts = dict(trainable=0, frozen=0, trainable_bytes=0, frozen_bytes=0)
  for path, v in nnx.to_flat_state(nnx.state(model)):
    if isinstance(v, nnx.RngState):   # dropout keys and counters (typed keys have no itemsize)
      continue
    value = v.get_value() if hasattr(v, "get_value") else v.value
    nbytes = int(math.prod(value.shape)) * jnp.dtype(value.dtype).itemsize
    if is_trainable(path, v):
      counts["trainable"] += int(math.prod(value.shape))
      counts["trainable_bytes"] += nbytes
    elif isinstance(v, NF4Weight):
      counts["frozen"] += int(v.get_metadata().get("num_elements", 0))
      counts["frozen_bytes"] += nbytes
    elif isinstance(v, nnx.Param):
      counts["frozen"] += int(math.prod(value.shape))
      counts["frozen_bytes"] += nbytes
  return ParameterCounts(**counts)
