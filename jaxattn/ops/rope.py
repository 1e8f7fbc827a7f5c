"""Rotary positional embedding (RoPE) and its context-extension scalings.

RoPE rotates each pair of query/key coordinates by an angle proportional to the token position,
``m * theta_i`` with ``theta_i = base ** (-2i / R)``, so that the score of rotated vectors depends on
the positions only through ``n - m``.  Values are never rotated.

Shape letters: ``B`` batch (any number of leading dims), ``T`` sequence, ``N`` heads, ``H`` head
size, ``R`` rotary size (the leading ``R <= H`` coordinates are rotated, the rest pass through:
partial RoPE).

Two pairings of the ``R`` rotated coordinates are in use and give different results for the same
weights:

* ``interleaved=True``: consecutive pairs ``(x0, x1), (x2, x3), ...`` -- the RoFormer paper, the
  DeepSeek reference code and the formula in the seed documents;
* ``interleaved=False``: the half split ``(x_i, x_{i + R/2})`` -- Llama in Hugging Face transformers
  (``rotate_half``).  A permutation of the weights converts one to the other.

The scalings (``RopeScaling``) reproduce transformers' ``ROPE_INIT_FUNCTIONS``: ``linear``
(position interpolation), ``dynamic`` (NTK-aware base rescaling once the sequence is longer than the
trained length), ``yarn`` (per-frequency blend of interpolation and extrapolation, plus an attention
factor) and ``llama3`` (smooth per-wavelength interpolation).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Literal, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxattn.checks import check_int_array, check_positive, is_int, is_number

ScalingType = Literal["linear", "dynamic", "yarn", "llama3"]
SCALING_TYPES: tuple[str, ...] = ("linear", "dynamic", "yarn", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """How RoPE frequencies are stretched beyond the trained context (frozen: a static jit argument).

  Attributes:
    type: ``"linear"``, ``"dynamic"``, ``"yarn"`` or ``"llama3"``.
    factor: context-extension factor (new length / trained length).
    original_max_position_embeddings: trained context length.  Required by ``dynamic`` (where
      transformers reads it from ``max_position_embeddings``), ``yarn`` and ``llama3``.
    beta_fast, beta_slow: yarn's rotation counts bounding the interpolation ramp.
    mscale, mscale_all_dim: yarn attention factor ``get_mscale(factor, mscale) /
      get_mscale(factor, mscale_all_dim)`` when both are set (DeepSeek); otherwise
      ``get_mscale(factor)``.
    attention_factor: yarn attention factor given explicitly (overrides the two above).
    truncate: yarn rounds the correction range to whole dimensions (floor/ceil).
    low_freq_factor, high_freq_factor: llama3 keeps wavelengths below ``original /
      high_freq_factor``, divides frequencies with wavelengths above ``original /
      low_freq_factor`` by ``factor``, and blends the band between.
  """

  type: ScalingType
  factor: float
  original_max_position_embeddings: int | None = None
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  mscale: float | None = None
  mscale_all_dim: float | None = None
  attention_factor: float | None = None
  truncate: bool = True
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0

  def __post_init__(self):
    if self.type not in SCALING_TYPES:
      raise ValueError(f"RopeScaling `type`={self.type!r} is not supported; allowed: {SCALING_TYPES}.")
    def finite(name, minimum=0.0, strict=True, allow_none=False):
      v = getattr(self, name)
      if v is None and allow_none:
        return
      if not is_number(v) or not math.isfinite(v) or (v <= minimum if strict else v < minimum):
        what = f"a finite number {'>' if strict else '>='} {minimum:g}"
        raise ValueError(f"RopeScaling `{name}`={v!r} must be {what}.")

    finite("factor")            # (inf: yarn's attention factor inf, dynamic's frequencies NaN)
    finite("attention_factor", allow_none=True)   # (NaN outputs, a negative one flipped signs)
    for name in ("mscale", "mscale_all_dim"):
      finite(name, strict=False, allow_none=True)
    length = self.original_max_position_embeddings
    if length is not None and (not is_int(length) or length < 1):
      raise ValueError(f"RopeScaling `original_max_position_embeddings`={length!r} must be an "
                       f"int >= 1 (the trained context length).")
    if self.type != "linear" and length is None:
      raise ValueError(f"RopeScaling type {self.type!r} needs `original_max_position_embeddings` "
                       f">= 1 (the trained context length), got None.")
    if self.type == "yarn":     # (0 was a ZeroDivisionError, a negative one a math domain error)
      finite("beta_fast")
      finite("beta_slow")
    if self.type == "llama3":   # (a low factor of 0 was a ZeroDivisionError)
      finite("low_freq_factor")
      finite("high_freq_factor")
      if not self.high_freq_factor > self.low_freq_factor:
        raise ValueError(f"llama3 RopeScaling needs `high_freq_factor` > `low_freq_factor`, got "
                         f"{self.high_freq_factor} and {self.low_freq_factor}.")

  @classmethod
  def from_hf(cls, rope_parameters: Mapping[str, Any], *,
              max_position_embeddings: int | None = None) -> RopeScaling | None:
    """Builds a scaling from a transformers ``rope_parameters`` / ``rope_scaling`` dict.

    Returns None for ``"default"`` RoPE.  ``max_position_embeddings`` is the config's field of that
    name: ``dynamic`` uses it as the trained length, and yarn/llama3 fall back to it when the dict
    has no ``original_max_position_embeddings`` (as transformers does).  ``rope_theta`` and
    ``partial_rotary_factor`` are not part of the scaling (pass ``base`` and ``rotary_dim``).
    """
    kind = rope_parameters.get("rope_type", rope_parameters.get("type", "default"))
    if kind == "default":
      return None
    original = rope_parameters.get("original_max_position_embeddings") or max_position_embeddings
    if kind == "dynamic":
      original = max_position_embeddings or original
    kwargs = {k: rope_parameters[k] for k in ("mscale", "mscale_all_dim", "attention_factor",
                                               "truncate", "low_freq_factor", "high_freq_factor")
              if rope_parameters.get(k) is not None}
    # transformers treats a missing or zero beta as its default (`get("beta_fast") or 32`).
    for k in ("beta_fast", "beta_slow"):
      if rope_parameters.get(k):
        kwargs[k] = rope_parameters[k]
    factor = rope_parameters.get("factor")
    if factor is None and kind == "yarn" and max_position_embeddings and original:
      factor = max_position_embeddings / original  # transformers' fallback (DeepSeek-V3 configs)
    return cls(type=kind, factor=factor, original_max_position_embeddings=original, **kwargs)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
  """YaRN's magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``).

  transformers' yarn ``attention_factor`` is built from it; DeepSeek-V2/V3 also multiply the softmax
  scale by ``yarn_mscale(factor, mscale_all_dim) ** 2``.
  """
  if scale <= 1:
    return 1.0
  return 0.1 * mscale * math.log(scale) + 1.0


def _check_rotary_dim(rotary_dim, head_dim=None, *, given=True):
  """``given=False``: ``rotary_dim`` defaulted to the head size, so the message names ``H``."""
  if not is_int(rotary_dim) or rotary_dim <= 0 or rotary_dim % 2:
    if not given:
      raise ValueError(f"the head size H={rotary_dim!r} (x.shape[-1]) must be even to rotate "
                       "all of it (coordinates rotate in pairs); pass an even `rotary_dim` < H "
                       "for partial RoPE.")
    raise ValueError(f"`rotary_dim`={rotary_dim!r} must be a positive even integer (coordinates are "
                     "rotated in pairs).")
  if head_dim is not None and rotary_dim > head_dim:
    raise ValueError(f"`rotary_dim`={rotary_dim} exceeds the head size H={head_dim}; allowed: "
                     f"an even number in [2, {head_dim}].")


def check_rope_base(base, scaling: RopeScaling | None = None, *, name: str = "base") -> None:
  """``base`` is a finite number > 0 (and != 1 for yarn, whose ramp divides by ``log(base)``).

  ``name`` is the argument named in the error (``"rope_base"`` for the modules).
  """
  if isinstance(base, (jax.Array, np.ndarray)) and base.ndim == 0 and not isinstance(
      base, jax.core.Tracer):
    base = base.item()  # a concrete scalar array (a traced base is not supported: float(base))
  check_positive(name, base)  # the RoPE base (rope_theta): frequencies base ** (-2i / R)
  if isinstance(scaling, RopeScaling) and scaling.type == "yarn" and base == 1:
    raise ValueError(f"`{name}`={base!r} must not be 1 with yarn RoPE scaling (its correction "
                     "range divides by log(base)); allowed: a finite number > 0 other than 1.")


def check_rope_scaling(scaling, *, name: str = "scaling") -> None:
  """``scaling`` is None or a ``RopeScaling``; ``name`` is the argument named in the error
  (``"rope_scaling"`` for the modules)."""
  if scaling is not None and not isinstance(scaling, RopeScaling):
    raise ValueError(f"`{name}` must be None or a RopeScaling (types {SCALING_TYPES}), got "
                     f"{scaling!r}; a transformers dict converts with RopeScaling.from_hf.")


def _wavelength_powers(rotary_dim: int, base, xp=np):
  """``base ** (2i / R)`` in fp32 (NumPy, or ``jnp`` when ``base`` is traced)."""
  # The exponent 2i/R is formed in fp32 and the power taken in fp32, as transformers does.  NumPy's
  # fp32 power agrees with PyTorch's to ~2e-7 relative, XLA's CPU power only to ~1e-6, so static
  # configurations (all but a traced dynamic-NTK length) are computed with NumPy at trace time.
  return base ** (xp.arange(0, rotary_dim, 2, dtype=xp.float32) / rotary_dim)


def _base_inv_freq(rotary_dim: int, base, xp=np):
  """``base ** (-2i / R)`` in fp32."""
  return 1.0 / _wavelength_powers(rotary_dim, base, xp)


def _attention_factor(scaling: RopeScaling | None) -> float:
  """The factor transformers multiplies cos and sin by (only yarn has one other than 1)."""
  if scaling is None or scaling.type != "yarn":
    return 1.0
  if scaling.attention_factor is not None:
    return float(scaling.attention_factor)
  if scaling.mscale and scaling.mscale_all_dim:
    return float(yarn_mscale(scaling.factor, scaling.mscale)
                 / yarn_mscale(scaling.factor, scaling.mscale_all_dim))
  return float(yarn_mscale(scaling.factor))


def _yarn_inv_freq(rotary_dim: int, base: float, s: RopeScaling) -> np.ndarray:
  # Dimension index whose frequency turns `num_rotations` times over the trained length.
  def correction_dim(num_rotations):
    length = s.original_max_position_embeddings
    return (rotary_dim * math.log(length / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

  low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
  if s.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, rotary_dim - 1)
  if low == high:
    high += 0.001  # transformers' guard against a zero-width ramp

  pos_freqs = _wavelength_powers(rotary_dim, base)
  extrapolated = 1.0 / pos_freqs               # high frequencies: kept as trained
  interpolated = 1.0 / (s.factor * pos_freqs)  # low frequencies: positions divided by factor
  ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
  keep = 1 - ramp  # 1 where the frequency is extrapolated
  return interpolated * (1 - keep) + extrapolated * keep


def _llama3_inv_freq(rotary_dim: int, base: float, s: RopeScaling) -> np.ndarray:
  inv_freq = _base_inv_freq(rotary_dim, base)
  length = s.original_max_position_embeddings
  low_freq_wavelen = length / s.low_freq_factor
  high_freq_wavelen = length / s.high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  # Long wavelengths are interpolated by `factor`, short ones kept, the band between blended.
  scaled = np.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
  smooth = (length / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
  smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
  is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
  return np.where(is_medium, smoothed, scaled)


def _dynamic_inv_freq(rotary_dim: int, base: float, s: RopeScaling, seq_len):
  if rotary_dim < 4:
    raise ValueError(f"dynamic RoPE scaling needs `rotary_dim` >= 4 (its exponent is R / (R - 2)), "
                     f"got {rotary_dim}.")
  if seq_len is None:
    return _base_inv_freq(rotary_dim, base)
  length = s.original_max_position_embeddings
  try:  # a known length: Python floats (fp64), as transformers at init
    seq_len, xp = max(int(seq_len), length), np
  except jax.errors.ConcretizationTypeError:  # traced: fp32, as transformers' forward pass
    seq_len, xp = jnp.maximum(seq_len, length).astype(jnp.float32), jnp
  stretch = (s.factor * seq_len / length) - (s.factor - 1)
  return _base_inv_freq(rotary_dim, base * stretch ** (rotary_dim / (rotary_dim - 2)), xp)


def rope_frequencies(
    rotary_dim: int,
    *,
    base: float = 10000.0,
    scaling: RopeScaling | None = None,
    seq_len: int | Int[Array, ""] | None = None,
) -> tuple[Float[Array, "R/2"], float]:
  """The RoPE inverse frequencies ``theta_i`` (fp32 ``[R/2]``) and the attention factor.

  Without ``scaling``, ``theta_i = base ** (-2i / R)`` and the factor is 1.  With it, the result
  equals transformers' ``ROPE_INIT_FUNCTIONS[scaling.type]`` for a head of ``rotary_dim`` rotated
  coordinates.  ``seq_len`` is used by ``dynamic`` only: the current sequence length (an int, or a
  traced scalar under ``jit``); once it exceeds the trained length ``L`` the base becomes
  ``base * (factor * seq_len / L - (factor - 1)) ** (R / (R - 2))``.  The attention factor is a
  Python float (transformers multiplies cos and sin by it).
  """
  _check_rotary_dim(rotary_dim)
  check_rope_scaling(scaling)
  check_rope_base(base, scaling)
  base = float(base)
  kind = None if scaling is None else scaling.type
  if kind is None:
    inv_freq = _base_inv_freq(rotary_dim, base)
  elif kind == "linear":
    # Dividing the frequencies by `factor` is dividing the positions by it (interpolation).
    inv_freq = _base_inv_freq(rotary_dim, base) / scaling.factor
  elif kind == "yarn":
    inv_freq = _yarn_inv_freq(rotary_dim, base, scaling)
  elif kind == "llama3":
    inv_freq = _llama3_inv_freq(rotary_dim, base, scaling)
  else:
    inv_freq = _dynamic_inv_freq(rotary_dim, base, scaling, seq_len)
  return jnp.asarray(inv_freq, jnp.float32), _attention_factor(scaling)


def apply_rope(
    x: Float[Array, "*B T N H"],
    positions: Int[Array, "*#B T"],
    *,
    base: float = 10000.0,
    rotary_dim: int | None = None,
    interleaved: bool = False,
    scaling: RopeScaling | None = None,
    inv_freq: Float[Array, "R/2"] | None = None,
    apply_attention_factor: bool = True,
    seq_len: int | Int[Array, ""] | None = None,
) -> Float[Array, "*B T N H"]:
  """Rotates the first ``R`` coordinates of each head of ``x`` by its position; same shape and dtype.

  Pair ``i`` at position ``m`` turns by ``m * theta_i`` (``theta`` from ``rope_frequencies``):
  ``(a, b) -> (a cos - b sin, a sin + b cos)``; coordinates ``>= R`` are returned unchanged.

  Args:
    x: queries or keys ``[*B, T, N, H]``.
    positions: integer positions ``[*B, T]`` or anything that broadcasts to it (e.g. ``[T]``).
    base: the RoPE base (``rope_theta``).
    rotary_dim: ``R``, an even number ``<= H`` (default ``H``, or ``2 * len(inv_freq)``).
    interleaved: pair consecutive coordinates (RoFormer, DeepSeek) instead of the half split
      (Llama in transformers).
    scaling: a ``RopeScaling`` for context extension.
    inv_freq: precomputed ``[R/2]`` frequencies used instead of those from ``base``/``scaling``
      (``scaling`` still supplies the attention factor).
    apply_attention_factor: multiply cos and sin by the scaling's attention factor (only yarn has
      one other than 1), as transformers does.  Turn off when the factor goes into the softmax scale.
    seq_len: for ``dynamic`` scaling, the sequence length that sets the base; defaults to
      ``max(positions) + 1``, what transformers uses on a module's first call.
  """
  x = jnp.asarray(x)
  positions = jnp.asarray(positions)
  if x.ndim < 3:
    raise ValueError(f"`x` must be [*B, T, N, H] (at least 3 dims), got shape {x.shape}.")
  head_dim = x.shape[-1]
  given = rotary_dim is not None or inv_freq is not None
  if inv_freq is not None:
    inv_freq = jnp.asarray(inv_freq, jnp.float32)
    if rotary_dim is None:
      rotary_dim = 2 * inv_freq.shape[-1]
    if inv_freq.shape != (rotary_dim // 2,):
      raise ValueError(f"`inv_freq` has shape {inv_freq.shape}; for rotary_dim={rotary_dim} it must "
                       f"be ({rotary_dim // 2},).")
  rotary_dim = head_dim if rotary_dim is None else rotary_dim
  _check_rotary_dim(rotary_dim, head_dim, given=given)
  check_rope_scaling(scaling)
  check_rope_base(base, scaling)
  check_int_array("positions", positions)
  batch_shape = x.shape[:-2]
  try:
    ok = positions.ndim >= 1 and jnp.broadcast_shapes(positions.shape, batch_shape) == batch_shape
  except ValueError:
    ok = False
  if not ok:
    raise ValueError(f"`positions` of shape {positions.shape} must broadcast to x's [*B, T] = "
                     f"{batch_shape}.")

  if inv_freq is None:
    if scaling is not None and scaling.type == "dynamic" and seq_len is None:
      seq_len = jnp.max(positions) + 1
    inv_freq, _ = rope_frequencies(rotary_dim, base=base, scaling=scaling, seq_len=seq_len)
  factor = _attention_factor(scaling) if apply_attention_factor else 1.0

  return _rotate(x, positions, inv_freq, factor=factor, interleaved=interleaved)


# One compiled computation per shape, so eager callers do not dispatch (and compile) op by op.
@functools.partial(jax.jit, static_argnames=("factor", "interleaved"))
def _rotate(x, positions, inv_freq, *, factor: float, interleaved: bool):
  """``x`` with its first ``R = 2 * len(inv_freq)`` coordinates rotated by ``positions * inv_freq``."""
  rotary_dim = 2 * inv_freq.shape[0]
  # Angles, cos and sin in fp32 even for bf16 inputs: bf16 keeps 8 significant bits, so a position
  # such as 257 would round to 256 and m * theta would be off by whole radians.
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [*B, T, R/2]
  angles = angles[..., None, :]                                 # [*B, T, 1, R/2]: same for all heads
  cos = jnp.cos(angles)
  sin = jnp.sin(angles)
  if factor != 1.0:
    cos, sin = cos * factor, sin * factor

  x_rot = x[..., :rotary_dim].astype(jnp.float32)  # [*B, T, N, R]
  if interleaved:
    a, b = x_rot[..., 0::2], x_rot[..., 1::2]     # pairs (x0, x1), (x2, x3), ...
  else:
    a, b = jnp.split(x_rot, 2, axis=-1)           # pairs (x_i, x_{i + R/2})
  first = a * cos - b * sin
  second = a * sin + b * cos
  if interleaved:
    rotated = jnp.stack([first, second], axis=-1).reshape(x_rot.shape)
  else:
    rotated = jnp.concatenate([first, second], axis=-1)
  rotated = rotated.astype(x.dtype)
  if rotary_dim == x.shape[-1]:
    return rotated
  return jnp.concatenate([rotated, x[..., rotary_dim:]], axis=-1)  # partial RoPE: rest untouched
