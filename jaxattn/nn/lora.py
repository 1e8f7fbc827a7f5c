"""LoRA and QLoRA for any NNX model: adapters on chosen ``Einsum`` / ``nnx.Linear`` kernels.

    model = MyModel(...)                                          # pretrained
    apply_lora(model, r"attn/(q|v)_proj$", rank=8, alpha=16, rngs=nnx.Rngs(0))
    print(count_parameters(model))                                # trainable vs frozen
    optimizer = lora_optimizer(model, optax.adamw(1e-3))          # state for the adapters only
    step = make_train_step(loss_fn)                               # grads w.r.t. LoRAParam only
    loss = step(model, optimizer, batch)
    merge_lora(model)                                             # W0 += s * A B (unmerge_lora undoes)

``apply_lora(..., quantize_base=True)`` is QLoRA: the frozen base kernels are stored as NF4 with
double-quantized scales (``jaxattn.ops.nf4``) and dequantized on the fly in the forward pass; the
adapters stay in ``param_dtype``.

Adapter matrices are ``LoRAParam`` (a subclass of ``nnx.Param``), so ``nnx.state(model, LoRAParam)``,
``nnx.DiffState(0, LoRAParam)`` and ``nnx.Optimizer(model, tx, wrt=LoRAParam)`` select exactly them;
NF4 storage is ``NF4Weight`` (an ``nnx.Variable``, never a parameter).  Formulas: ``jaxattn.ops.lora``.
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

from jaxattn.nn.linear import Einsum
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
  return base.kernel_shape if isinstance(base, NF4Einsum) else tuple(base.kernel[...].shape)


class NF4Einsum(nnx.Module):
  """A frozen linear map whose kernel is stored in NF4 and dequantized on every call (QLoRA's base).

  Built from an ``Einsum`` or ``nnx.Linear`` with ``NF4Einsum.from_module(layer)``; computes
  ``einsum(spec, x, dequantize(kernel)) (+ bias)`` in ``dtype`` (default: the input's).  With
  ``recompute=True`` (``jaxattn.ops.nf4.nf4_einsum``) the backward pass dequantizes again rather than
  keeping the full-precision kernel between the passes.  The
  kernel is flattened row-major for quantization, so it is not shardable by logical axes (it is ~8x
  smaller).
  """

  def __init__(self, spec: str, kernel: jax.Array, bias: jax.Array | None = None, *,
               kernel_axes: Sequence[str | None] | None = None, bias_axes: Sequence[str | None] = (),
               block_size: int = 64, double_quant: bool = True, scale_block_size: int = 256,
               dtype=None, recompute: bool = True, source: str = "einsum"):
    self.spec, self.dtype, self.source, self.recompute = spec, dtype, source, recompute
    self.kernel_shape = tuple(int(s) for s in kernel.shape)
    self.kernel_axes = tuple(kernel_axes) if kernel_axes is not None else (None,) * kernel.ndim
    self.param_dtype = jnp.dtype(kernel.dtype)
    self.block_size, self.scale_block_size = block_size, scale_block_size
    q = nf4_ops.quantize_nf4(kernel, block_size=block_size, double_quant=double_quant,
                             scale_block_size=scale_block_size)
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

  def dequantized_kernel(self, dtype=jnp.float32) -> jax.Array:
    """The kernel rebuilt from NF4 (``kernel_shape``, ``dtype``)."""
    return nf4_ops.dequantize_nf4(self.quantized(), self.kernel_shape, block_size=self.block_size,
                                  scale_block_size=self.scale_block_size, dtype=dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
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


class LoRA(nnx.Module):
  """``base(x) + scaling * B(A(dropout(x)))`` around a frozen ``Einsum``, ``nnx.Linear`` or ``NF4Einsum``.

  ``A`` (``lora_a``: the kernel's input axes + ``[r]``) is Kaiming-uniform as peft initializes it
  (bound ``1 / sqrt(fan_in)``), ``B`` (``lora_b``: ``[r]`` + output axes) is zero, so the wrapped layer
  starts as the base.  ``scaling = alpha / rank`` (``alpha / sqrt(rank)`` with ``use_rslora``).
  ``dropout`` applies to the adapter's input only (active unless ``model.eval()``).
  ``merge()`` adds ``scaling * A B`` to the base kernel and skips the adapter; ``unmerge()`` undoes it.
  """

  def __init__(self, base, *, rank: int = 8, alpha: float = 8.0, use_rslora: bool = False,
               dropout: float = 0.0, rngs: nnx.Rngs, param_dtype=jnp.float32):
    spec = _base_spec(base)
    if not 0.0 <= dropout < 1.0:
      raise ValueError(f"`dropout` must be in [0, 1), got {dropout!r}.")
    self.scaling = lora_ops.lora_scaling(rank, alpha, use_rslora=use_rslora)
    self.rank, self.alpha, self.use_rslora = rank, alpha, use_rslora
    self.specs = lora_ops.lora_einsum_specs(spec)
    self.base = base
    shape, axes = _kernel_shape(base), _kernel_axes(base)
    sp = self.specs
    fan_in = int(np.prod([shape[i] for i in sp.in_axes]))
    bound = lora_ops.kaiming_uniform_bound(fan_in)
    a_axes = tuple(axes[i] for i in sp.shared_axes + sp.in_axes) + (None,)
    b_axes = tuple(axes[i] for i in sp.shared_axes) + (None,) + tuple(axes[i] for i in sp.out_axes)
    self.lora_a = LoRAParam(
        jax.random.uniform(rngs.params(), sp.a_shape(shape, rank), param_dtype, -bound, bound),
        logical_axes=a_axes)
    self.lora_b = LoRAParam(jnp.zeros(sp.b_shape(shape, rank), param_dtype), logical_axes=b_axes)
    self.dropout = nnx.Dropout(dropout, rngs=rngs) if dropout > 0 else None
    self.merged = False

  def delta(self) -> jax.Array:
    """The kernel-shaped update ``scaling * A B`` (fp32)."""
    return lora_ops.lora_delta(self.specs, self.lora_a[...], self.lora_b[...], self.scaling)

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
    """Undoes ``merge`` (``W0 <- W0 - scaling * A B``, exact up to one fp32 rounding)."""
    if not self.merged:
      return
    k = self.base.kernel
    k[...] = (k[...].astype(jnp.float32) - self.delta()).astype(k[...].dtype)
    self.merged = False

  def __call__(self, x: jax.Array) -> jax.Array:
    y = self.base(x)
    if self.merged:
      return y
    h = x if self.dropout is None else self.dropout(x)
    dt = y.dtype
    z = jnp.einsum(self.specs.down, h.astype(dt), self.lora_a[...].astype(dt))      # [..., r]
    return y + (self.scaling * jnp.einsum(self.specs.up, z, self.lora_b[...].astype(dt))).astype(dt)


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
  ``r"mlp/(up|gate|down)$"``, ``".*"``.  ``quantize_base=True`` stores the selected base kernels in NF4
  (QLoRA; ``block_size``, ``double_quant``).  Returns the adapted paths; raises ``ValueError`` when
  nothing matches.
  """
  patterns = [targets] if isinstance(targets, str) else list(targets)
  if not patterns:
    raise ValueError("`targets` must name at least one pattern.")
  try:
    regexes = [re.compile(p) for p in patterns]
  except re.error as e:
    raise ValueError(f"`targets` {patterns!r} is not a valid regular expression: {e}") from None
  found = _find(model, _TARGET_TYPES, lambda s: any(r.search(s) for r in regexes))
  if not found:
    candidates = [_path_str(p) for p, _ in _find(model, _TARGET_TYPES)]
    raise ValueError(f"`targets` {patterns!r} match no Einsum / nnx.Linear layer; layers: "
                     f"{candidates[:20]}{' ...' if len(candidates) > 20 else ''}.")
  for path, layer in found:
    base = (NF4Einsum.from_module(layer, block_size=block_size, double_quant=double_quant)
            if quantize_base else layer)
    _replace(model, path, LoRA(base, rank=rank, alpha=alpha, use_rslora=use_rslora, dropout=dropout,
                               rngs=rngs, param_dtype=param_dtype))
  return [_path_str(p) for p, _ in found]


def lora_layers(model: nnx.Module) -> list[tuple[str, LoRA]]:
  """``[(path, LoRA)]`` in ``model``."""
  return [(_path_str(p), m) for p, m in _find(model, LoRA)]


def merge_lora(model: nnx.Module) -> None:
  """Merges every adapter into its base kernel (in place)."""
  for _, m in lora_layers(model):
    m.merge()


def unmerge_lora(model: nnx.Module) -> None:
  """Undoes ``merge_lora`` (in place)."""
  for _, m in lora_layers(model):
    m.unmerge()


def _dense_like(base: NF4Einsum, kernel: jax.Array):
  """An ``Einsum`` / ``nnx.Linear`` holding ``kernel`` (built abstractly, then filled)."""
  bias = None if base.bias is None else base.bias[...]
  if base.source == "linear":
    din, dout = base.kernel_shape
    layer = nnx.eval_shape(lambda: nnx.Linear(din, dout, use_bias=bias is not None, dtype=base.dtype,
                                              rngs=nnx.Rngs(0)))
    layer.kernel = nnx.Param(kernel)
  else:
    layer = nnx.eval_shape(lambda: Einsum(base.spec, base.kernel_shape, base.kernel_axes,
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
  ``dequantize(W0)``: the same function as the adapted layer, at full-precision cost.
  """
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
