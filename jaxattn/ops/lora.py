"""LoRA: a trainable low-rank update beside a frozen weight (LoRA, Hu et al.; seed "LoRA").

    h = W0 x + s * B A x,        s = alpha / r   (rsLoRA: alpha / sqrt(r))

``A`` maps the input features to ``r`` numbers and ``B`` maps them back to the output features; ``B``
starts at zero so the update starts at zero.  For a ``[d_in, d_out]`` kernel ``A`` is ``[d_in, r]`` and
``B`` is ``[r, d_out]``; the update ``s * A @ B`` has rank at most ``r`` and ``r (d_in + d_out)`` entries
(4096 x 4096 with r = 8: 65,536 instead of 16,777,216).  Merging adds ``s * A @ B`` to the kernel
(the merged layer costs one matmul again); unmerging subtracts it.

For ``jaxattn.nn.Einsum`` kernels with several input or output axes (``"BTD,DNH->BTNH"``) the same
holds with the axes grouped: ``A`` has the kernel's input axes plus ``r``, ``B`` has ``r`` plus the output
axes, and kernel axes shared with both the input and the output (a per-expert kernel ``"ETD,EDF->ETF"``)
stay in both, giving one adapter per slice.  ``lora_einsum_specs`` derives the three einsums.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jaxattn.checks import check_bool, check_int, is_number

_ELLIPSIS = "."  # stands for "..." while we work letter by letter


def lora_scaling(rank: int, alpha: float, *, use_rslora: bool = False) -> float:
  """``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA (stable update size as ``r`` grows)."""
  check_int("rank", rank)
  # bool is a numbers.Real too, and True / False as a scale is a mistake, not a number.
  if not is_number(alpha) or not math.isfinite(alpha):   # inf * (B = 0) is NaN from step 0
    raise ValueError(f"`alpha` must be a finite real number, got {alpha!r}.")
  check_bool("use_rslora", use_rslora)
  return alpha / math.sqrt(rank) if use_rslora else alpha / rank


def lora_linear(
    x: Float[Array, "*B I"],
    kernel: Float[Array, "I O"],
    a: Float[Array, "I r"],
    b: Float[Array, "r O"],
    *,
    scaling: float,
    bias: Float[Array, "O"] | None = None,
) -> Float[Array, "*B O"]:
  """``x @ W0 (+ bias) + scaling * (x @ A) @ B`` in fp32 (the reference for the modules)."""
  if a.shape[0] != kernel.shape[0] or b.shape[1] != kernel.shape[1] or a.shape[1] != b.shape[0]:
    raise ValueError(f"LoRA shapes do not fit kernel {kernel.shape}: A {a.shape}, B {b.shape} "
                     "(want A [I, r], B [r, O]).")
  f32 = jnp.float32
  xf = x.astype(f32)
  y = xf @ kernel.astype(f32) + scaling * ((xf @ a.astype(f32)) @ b.astype(f32))
  if bias is not None:
    y = y + bias.astype(f32)
  return y.astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class LoRAEinsumSpecs:
  """The einsums of a LoRA adapter on a kernel used as ``einsum(spec, x, kernel)``.

  ``down``: ``x, A -> z`` (``z`` has the output's non-kernel axes and ``r`` last); ``up``: ``z, B -> y``;
  ``delta``: ``A, B -> kernel`` (the update to merge).  ``in_axes``/``out_axes``/``shared_axes`` index
  the kernel's axes contracted with ``x``, appearing only in the output, and shared by both.
  """
  down: str
  up: str
  delta: str
  in_axes: tuple[int, ...]
  out_axes: tuple[int, ...]
  shared_axes: tuple[int, ...]

  def a_shape(self, kernel_shape, rank):
    return tuple(kernel_shape[i] for i in self.shared_axes + self.in_axes) + (rank,)

  def b_shape(self, kernel_shape, rank):
    return (tuple(kernel_shape[i] for i in self.shared_axes) + (rank,)
            + tuple(kernel_shape[i] for i in self.out_axes))


def _letters(term: str) -> str:
  return term.replace("...", _ELLIPSIS)


def _restore(term: str) -> str:
  return term.replace(_ELLIPSIS, "...")


def lora_einsum_specs(spec: str) -> LoRAEinsumSpecs:
  """Derives the adapter einsums for ``einsum(spec, x, kernel)``, e.g.

  ``"BTD,DNH->BTNH"``: ``down = "BTD,Dr->BTr"``, ``up = "BTr,rNH->BTNH"``, ``delta = "Dr,rNH->DNH"``.
  ``"...i,io->...o"`` (``nnx.Linear``) works too.
  """
  if not isinstance(spec, str) or spec.count("->") != 1 or spec.split("->")[0].count(",") != 1:
    raise ValueError(f"`spec` must be an explicit two-operand einsum 'x,kernel->out', got {spec!r}.")
  lhs, out = spec.replace(" ", "").split("->")
  xs, ks = lhs.split(",")
  xs, ks, out = _letters(xs), _letters(ks), _letters(out)
  if _ELLIPSIS in ks:
    raise ValueError(f"the kernel term of `spec` {spec!r} cannot contain '...'.")
  if len(set(ks)) != len(ks):
    raise ValueError(f"the kernel term of `spec` {spec!r} repeats an axis letter.")
  lonely = [c for c in ks if c not in xs and c not in out]
  if lonely:
    raise ValueError(f"kernel axes {lonely} of `spec` {spec!r} meet neither input nor output.")
  in_axes = tuple(i for i, c in enumerate(ks) if c in xs and c not in out)
  out_axes = tuple(i for i, c in enumerate(ks) if c in out and c not in xs)
  shared_axes = tuple(i for i, c in enumerate(ks) if c in xs and c in out)
  if not in_axes or not out_axes:
    raise ValueError(f"`spec` {spec!r} needs kernel axes contracted with the input and axes of the "
                     "output for a low-rank update.")
  used = set(xs + ks + out)
  r = next(c for c in "rRzZqQ" + "abcdefghijklmnopstuvwxy" if c not in used)
  shared = "".join(ks[i] for i in shared_axes)
  a_term = shared + "".join(ks[i] for i in in_axes) + r
  b_term = shared + r + "".join(ks[i] for i in out_axes)
  z_term = "".join(c for c in out if c not in "".join(ks[i] for i in out_axes)) + r
  down = f"{_restore(xs)},{a_term}->{_restore(z_term)}"
  up = f"{_restore(z_term)},{b_term}->{_restore(out)}"
  delta = f"{a_term},{b_term}->{ks}"
  return LoRAEinsumSpecs(down, up, delta, in_axes, out_axes, shared_axes)


def lora_delta(specs: LoRAEinsumSpecs, a: jax.Array, b: jax.Array, scaling: float) -> jax.Array:
  """The kernel-shaped update ``scaling * A B`` (fp32)."""
  return scaling * jnp.einsum(specs.delta, a.astype(jnp.float32), b.astype(jnp.float32))


def kaiming_uniform_bound(fan_in: int) -> float:
  """peft's ``kaiming_uniform_(A, a=sqrt(5))`` bound: ``gain * sqrt(3 / fan_in)`` with
  ``gain = sqrt(2 / (1 + 5))``, i.e. ``1 / sqrt(fan_in)``."""
  return 1.0 / math.sqrt(fan_in)
