"""The argument checks every module shares, so that they agree on what an int or a number is.

* An **int** is a Python or NumPy integer, never a bool (``True`` is an ``int`` subclass, and
  ``np.int64(4)`` from a sweep over ``np.arange`` is as good as ``4``).
* A **number** is a Python or NumPy real (int or float), never a bool, a string or None; ``NaN``
  fails every range test (the comparisons are written ``not (lo <= v)``).

Each check raises ``ValueError`` naming the argument, its value and what is allowed.
"""

from __future__ import annotations

import math
import numbers

import jax.numpy as jnp
import numpy as np


def is_int(v) -> bool:
  """A Python or NumPy integer that is not a bool."""
  return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def is_number(v) -> bool:
  """A Python or NumPy real number that is not a bool."""
  return isinstance(v, (numbers.Real, np.integer, np.floating)) and not isinstance(
      v, (bool, np.bool_))


def check_bool(name: str, v) -> None:
  """``v`` is a Python or NumPy bool (a string such as ``"no"`` is truthy: it would mean True)."""
  if not isinstance(v, (bool, np.bool_)):
    raise ValueError(f"`{name}` must be a bool, got {v!r}.")


def check_int(name: str, v, *, minimum: int = 1, allow_none: bool = False) -> None:
  """``v`` is an int >= ``minimum`` (or None, when ``allow_none``)."""
  if v is None and allow_none:
    return
  if not is_int(v) or v < minimum:
    none = "None or " if allow_none else ""
    raise ValueError(f"`{name}` must be {none}an int >= {minimum}, got {v!r}.")


def check_nonnegative(name: str, v, *, what: str = "a number >= 0") -> None:
  """``v`` is a finite number >= 0 (an epsilon, a loss coefficient, a rate)."""
  if not is_number(v) or not (0 <= v) or not math.isfinite(v):
    raise ValueError(f"`{name}` must be {what}, got {v!r}.")


def check_int_array(name: str, x) -> None:
  """``x`` is an array of an integer dtype (positions, token ids, indices: a float array would be
  truncated where it is cast, a bool one read as 0 / 1)."""
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise ValueError(f"`{name}` must be an integer array, got dtype {x.dtype}.")


def check_float_array(name: str, x) -> None:
  """``x`` is an array of a floating dtype (queries, keys, cached values: an integer one would
  give integer, truncated results; a bool or int8 pool would be read as raw numbers)."""
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"`{name}` must be a floating-point array, got dtype {x.dtype}.")


def check_positive(name: str, v) -> None:
  """``v`` is a finite number > 0."""
  if not is_number(v) or not (0 < v) or not math.isfinite(v):
    raise ValueError(f"`{name}` must be a finite number > 0, got {v!r}.")
