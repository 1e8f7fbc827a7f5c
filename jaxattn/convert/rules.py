"""Name-and-layout rules between a Hugging Face state dict and a ``DecoderLM``'s parameters.

A ``Rule`` ties some Hugging Face tensors to some of our parameters with a pair of inverse maps, so
the same table serves import (``to_ours``) and export (``to_hf``).  Our parameters are addressed by
their path in ``nnx.state(model)`` (``("groups", 0, "unit", "layers", 3, "mixer", "q_proj",
"kernel")``); their shapes come from an abstract model (``nnx.eval_shape``), so a rule never guesses
a shape.  The expected shapes of the Hugging Face tensors are derived by running ``to_hf`` on those
abstract shapes (``jax.eval_shape``), which is how a wrong-sized checkpoint tensor is caught before
any reshape, with its name.

Layouts.  ``torch.nn.Linear`` stores ``[out, in]``; our ``Einsum`` kernels store the input axes
first and split the head axes (``q_proj [D, N, H]``, ``o_proj [N, h, D]``), so a linear weight
maps by a transpose and a reshape.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

Path = tuple


@dataclasses.dataclass(frozen=True)
class Rule:
  """``hf`` tensor names <-> ``ours`` parameter paths.

  ``to_ours(*hf_arrays, shapes=...)`` returns one array per path in ``ours`` (``shapes``: their
  target shapes); ``to_hf(*our_arrays)`` returns one array per name in ``hf``.  Both use only
  array methods and ``xp(...)`` so that they run on NumPy arrays and on JAX tracers alike.
  """

  hf: tuple[str, ...]
  ours: tuple[Path, ...]
  to_ours: Callable
  to_hf: Callable


def xp(*arrays):
  """The array namespace of ``arrays``: ``jax.numpy`` when any is a JAX array / tracer."""
  return jnp if any(isinstance(a, jax.Array) for a in arrays) else np


def linear(hf: str, path: Path) -> Rule:
  """``torch.nn.Linear.weight [out, in]`` <-> an Einsum kernel ``[in, *out]`` (one input axis
  first: ``q_proj [D, N, H]``, ``up [D, F]``)."""
  def to_ours(w, *, shapes):
    (shape,) = shapes
    return (w.T.reshape(shape),)

  def to_hf(k):
    return (k.reshape(k.shape[0], -1).T,)

  return Rule((hf,), (path,), to_ours, to_hf)


def linear_out(hf: str, path: Path) -> Rule:
  """``Linear.weight [D, N*h]`` <-> an output kernel ``[N, h, D]`` (all but the last axis in)."""
  def to_ours(w, *, shapes):
    (shape,) = shapes
    return (w.T.reshape(shape),)

  def to_hf(k):
    return (k.reshape(-1, k.shape[-1]).T,)

  return Rule((hf,), (path,), to_ours, to_hf)


def bias(hf: str, path: Path) -> Rule:
  """A flat bias ``[N*H]`` <-> ``[N, H]`` (or any shape of the same size)."""
  return Rule((hf,), (path,), lambda b, *, shapes: (b.reshape(shapes[0]),),
              lambda b: (b.reshape(-1),))


def copy(hf: str, path: Path) -> Rule:
  """Same layout on both sides (norm scales, ``A_log``, ``dt_bias``, embeddings)."""
  return Rule((hf,), (path,), lambda a, *, shapes: (a.reshape(shapes[0]),), lambda a: (a,))


def plus_one(hf: str, path: Path) -> Rule:
  """A zero-centred norm weight (``output * (1 + w)``, Qwen3-Next) <-> our plain scale ``1 + w``."""
  return Rule((hf,), (path,), lambda a, *, shapes: ((a + 1.0).reshape(shapes[0]),),
              lambda a: (a - 1.0,))


def experts(prefix: str, num_experts: int, path: Path) -> list[Rule]:
  """Per-expert SwiGLU weights ``{prefix}.{e}.gate_proj/up_proj/down_proj.weight`` <-> our stacked
  ``w_gate, w_up [E, D, F]`` and ``w_down [E, F, D]`` (``path`` is the MoE module's path)."""
  rules = []
  for name, ours in (("gate_proj", "w_gate"), ("up_proj", "w_up"), ("down_proj", "w_down")):
    keys = tuple(f"{prefix}.{e}.{name}.weight" for e in range(num_experts))

    def to_ours(*ws, shapes):
      return (xp(*ws).stack([w.T for w in ws]).reshape(shapes[0]),)

    def to_hf(w):
      return tuple(w[e].T for e in range(w.shape[0]))

    rules.append(Rule(keys, (path + (ours,),), to_ours, to_hf))
  return rules


def split_fused_experts(state: dict, prefix: str) -> None:
  """In-memory transformers models fuse the experts (``experts.gate_up_proj [E, 2F, D]`` = gate rows
  then up rows, ``experts.down_proj [E, D, F]``); checkpoints on disk keep one tensor per expert.
  Rewrites the fused form of ``prefix`` into the per-expert names, in place."""
  fused = f"{prefix}.gate_up_proj"
  if fused not in state:
    return
  gate_up = state.pop(fused)
  down = state.pop(f"{prefix}.down_proj")
  f = gate_up.shape[1] // 2
  for e in range(gate_up.shape[0]):
    state[f"{prefix}.{e}.gate_proj.weight"] = gate_up[e, :f]
    state[f"{prefix}.{e}.up_proj.weight"] = gate_up[e, f:]
    state[f"{prefix}.{e}.down_proj.weight"] = down[e]
