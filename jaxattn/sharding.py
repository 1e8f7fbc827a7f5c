"""Logical axis names, the one rules table that maps them to mesh axes, and activation constraints.

Parameters carry logical axis names in their ``logical_axes`` metadata (``jaxattn.nn.param`` puts
them there); activations are constrained at block edges with ``shard(x, ("batch", "length",
"embed"))``.  The mesh axes are ``data``, ``fsdp``, ``context`` (the sequence, for context
parallelism: ``jaxattn.ops.context_parallel``), ``tensor`` and ``expert``.  Everything here is a
no-op without a mesh, so the same model code runs on one CPU and on a TPU pod.

We keep our own ``logical_axes`` metadata rather than Flax's eager ``sharding_names``: the eager
form needs a mesh at construction time and its semantics differ between Flax releases, while a
plain table applied after construction works the same everywhere (and under ``nnx.eval_shape``).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "context", "tensor", "expert")

# logical name -> mesh axis (or tuple of mesh axes, or None for replicated).
DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),   # activations: data parallel over data and fsdp
    ("length", "context"),         # activations: sequence split over context (context parallelism)
    ("embed", "fsdp"),             # parameters: ZeRO-3 style over fsdp
    ("heads", "tensor"),           # Megatron: heads split over tensor
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("expert", "expert"),
    ("norm", None),
    ("position", None),
    ("relpos_buckets", None),
    ("latent", None),              # MLA compressed (LoRA-rank) axis: small, shared by all heads
    ("act_embed", None),           # activation feature axis stays whole between blocks
    ("act_heads", "tensor"),
    ("layers", None),              # the leading axis of scanned (stacked) layer parameters
)


def _active_mesh():
  """The mesh set by ``jax.set_mesh``, or None (the older ``with mesh:`` context is not seen:
  under it every ``shard`` is a no-op)."""
  try:
    abstract = jax.sharding.get_abstract_mesh()
    if abstract is not None and not abstract.empty:
      return abstract
  except AttributeError:  # pragma: no cover - older jax
    pass
  return None


def logical_to_spec(logical_axes: Sequence[str | None], *, rules=DEFAULT_RULES, mesh=None,
                    shape: Sequence[int] | None = None) -> P:
  """Maps logical names to a ``PartitionSpec``.

  Mesh axes not present in ``mesh`` (or of size 1) are dropped; a mesh axis already used by an
  earlier dimension is not reused; when ``shape`` is given, a dimension not divisible by its mesh
  axes keeps the longest prefix of them that divides it (a batch of 4 on ``data=2, fsdp=4``: over
  ``data``), or is replicated (e.g. 2 KV heads on a 4-way tensor axis).
  """
  table = dict(rules)
  unknown = [a for a in logical_axes if a is not None and a not in table]
  if unknown:
    raise ValueError(f"unknown logical axis name(s) {unknown}; known: {sorted(table)}.")
  sizes = dict(mesh.shape) if mesh is not None else None
  used: set[str] = set()
  out = []
  for i, name in enumerate(logical_axes):
    target = table.get(name) if name is not None else None
    axes = (target,) if isinstance(target, str) else tuple(target or ())
    if sizes is not None:
      axes = tuple(a for a in axes if a in sizes and sizes[a] > 1)
    axes = tuple(a for a in axes if a not in used)
    if shape is not None and sizes is not None:  # the longest prefix of the axes that divides
      while axes and shape[i] % int(np.prod([sizes[a] for a in axes])) != 0:
        axes = axes[:-1]
    used.update(axes)
    out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return P(*out)


def shard(x, logical_axes: Sequence[str | None], *, rules=DEFAULT_RULES):
  """Constrains an activation's sharding by logical names; a no-op without an active mesh."""
  mesh = _active_mesh()
  if mesh is None:
    return x
  if len(logical_axes) != x.ndim:
    raise ValueError(f"`logical_axes` {tuple(logical_axes)} must name each of x's {x.ndim} dims.")
  return constrain(x, mesh, logical_to_spec(logical_axes, rules=rules, mesh=mesh, shape=x.shape))


def split_axis(x, axis: int | None, name: str | None = None, count: int | None = None, *,
               rules=DEFAULT_RULES):
  """``x`` on the active mesh (a no-op without one) with dimension ``axis`` split over the mesh
  axes of the logical ``name`` and every other dimension replicated (``axis=None``: all
  replicated).  ``count`` is the number of units that dimension holds (default its size): a merged
  ``[..., K * H]`` row split by its ``K`` heads (K-major) keeps every head whole when the mesh
  axes divide ``K``, and stays replicated when they do not.  Eagerly it places ``x``; under jit it
  constrains it (as ``shard``)."""
  mesh = _active_mesh()
  if mesh is None:
    return x
  dims = [None] * x.ndim
  if axis is not None:
    axis = axis % x.ndim
    count = x.shape[axis] if count is None else int(count)
    if x.shape[axis] % count:
      raise ValueError(f"`count` {count} must divide dimension {axis} of x {tuple(x.shape)}.")
    dims[axis] = logical_to_spec((name,), rules=rules, mesh=mesh, shape=(count,))[0]
  return constrain(x, mesh, P(*dims))


def constrain(x, mesh, spec: P):
  """``x`` laid out as ``NamedSharding(mesh, spec)``: placed when it is concrete (an eager
  call), resharded on Explicit axes (where a sharding constraint only asserts), else
  constrained."""
  placed = place_if_concrete(x, mesh, spec)
  if placed is not None:
    return placed
  if is_explicit(mesh):
    return jax.sharding.reshard(x, NamedSharding(mesh, spec))
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def is_explicit(mesh) -> bool:
  """Whether any axis of ``mesh`` is Explicit (``jax.make_mesh``'s default): arrays there carry
  their sharding in their type and are never resharded implicitly."""
  explicit = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)
  return explicit is not None and any(t == explicit for t in getattr(mesh, "axis_types", ()))


def check_auto_mesh(mesh, where: str) -> None:
  """Refuses a mesh with Explicit axes for the modules: their einsums contract sharded
  dimensions and leave the output sharding to XLA, which Explicit axes refuse (a
  ``ShardingTypeError`` deep in a layer)."""
  if mesh is not None and is_explicit(mesh):
    raise ValueError(
        f"{where}: the mesh has Explicit axes {tuple(mesh.axis_types)} (jax.make_mesh's "
        "default); jaxattn's modules shard with Auto axes. Build it with "
        "jaxattn.sharding.make_mesh, or jax.make_mesh(..., axis_types=(jax.sharding.AxisType."
        "Auto,) * n). (The ops -- dot_product_attention, the decode and MoE ops -- take either.)")


def context_mesh():
  """The concrete mesh ``jax.set_mesh`` holds, or None when none is set.  Raises ``ValueError``
  inside ``jit`` (where only the abstract mesh can be read: ``_active_mesh``)."""
  mesh = getattr(jax.sharding, "get_mesh", lambda: None)()
  return None if mesh is None or mesh.empty else mesh


def place_if_concrete(x, mesh, spec: P):
  """``x`` put on ``NamedSharding(mesh, spec)`` when it is a concrete array (a layer called
  eagerly, outside ``jit``), else None (traced: constrain it instead).

  A sharding constraint or reshard of a concrete array needs the array on the mesh already, so an
  eager call under ``jax.set_mesh`` with a single-device input would raise; placing it is what the
  constraint means there.  An abstract ``mesh`` is replaced by the concrete one ``jax.set_mesh``
  holds."""
  if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
    return None
  try:  # A concrete array inside jit (a closed-over constant) is constrained like a tracer.
    concrete = context_mesh()
  except ValueError:    # "get_mesh can only be used outside of jax.jit"
    return None
  if not isinstance(mesh, Mesh):
    mesh = concrete
    if mesh is None:
      return None
  return jax.device_put(x, NamedSharding(mesh, spec))


def _is_var(x):
  return isinstance(x, nnx.Variable)


def param_specs(state, *, mesh: Mesh | None = None, rules=DEFAULT_RULES):
  """A pytree of ``PartitionSpec`` for an ``nnx.State`` (variables without names: replicated)."""
  def spec(v):
    if not _is_var(v):
      return P()
    axes = v.get_metadata().get("logical_axes")
    value = v.get_value() if hasattr(v, "get_value") else v.value
    if axes is None:
      return P()
    if len(axes) != np.ndim(value):
      raise ValueError(f"variable of shape {np.shape(value)} has logical_axes {axes} of another rank.")
    return logical_to_spec(axes, rules=rules, mesh=mesh, shape=np.shape(value))
  return jax.tree.map(spec, state, is_leaf=_is_var)


def param_shardings(state, mesh: Mesh, *, rules=DEFAULT_RULES):
  """A pytree of ``NamedSharding`` for an ``nnx.State`` on ``mesh``."""
  specs = param_specs(state, mesh=mesh, rules=rules)
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def shard_module(module: nnx.Module, mesh: Mesh, *, rules=DEFAULT_RULES) -> nnx.Module:
  """Places every variable of ``module`` on its shards (in place) and returns the module
  (``mesh`` with Auto axes: ``make_mesh``)."""
  check_auto_mesh(mesh, "shard_module")
  state = nnx.state(module)
  shardings = param_shardings(state, mesh, rules=rules)
  nnx.update(module, jax.device_put(state, shardings))
  return module


def make_mesh(shape: Mapping[str, int] | None = None, *, devices=None) -> Mesh:
  """A mesh over all (or the given) devices with axes ``data, fsdp, context, tensor, expert``.

  ``shape`` gives the size of some axes (e.g. ``{"fsdp": 2, "tensor": 4}``); ``data`` takes the rest.
  """
  devices = np.asarray(jax.devices() if devices is None else devices)
  shape = dict(shape or {})
  bad = [a for a in shape if a not in MESH_AXES]
  if bad:
    raise ValueError(f"mesh `shape` names unknown axes {bad}; allowed: {MESH_AXES}.")
  small = {a: v for a, v in shape.items()
           if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1}
  if small:
    raise ValueError(f"mesh `shape` sizes must be ints >= 1, got {small}.")
  fixed = int(np.prod([shape.get(a, 1) for a in MESH_AXES if a != "data"]))
  if "data" not in shape:
    if devices.size % fixed:
      raise ValueError(f"{devices.size} devices do not divide into mesh shape {shape}.")
    shape["data"] = devices.size // fixed
  dims = tuple(shape.get(a, 1) for a in MESH_AXES)
  if int(np.prod(dims)) != devices.size:
    raise ValueError(f"mesh shape {dict(zip(MESH_AXES, dims))} needs {int(np.prod(dims))} devices, "
                     f"have {devices.size}.")
  return Mesh(devices.reshape(dims), MESH_AXES)
