"""Argparse ``type=`` factories for the experiment scripts' comma-separated flags (``--contexts
4096,8192``, ``--modes none,bias``): each returns a callable that turns ``"a, b,,c"`` into a list
(spaces stripped, empty items dropped), refuses an empty list unless ``allow_empty``, and raises
``argparse.ArgumentTypeError`` naming every bad item and what is allowed, so that a bad value
stops the script at parse time with ``argument --flag: ...`` (exit status 2), before any work.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterable
from typing import Any


class CommaList:
  """Parses a comma-separated string with ``parse`` per item (``ValueError``: a bad item).

  ``what`` says what is allowed ("integers >= 1"); ``bad_word`` starts the message for bad items
  ("invalid", "unknown"); ``name`` is the ``__name__`` / repr argparse and readers see.
  """

  def __init__(self, parse: Callable[[str], Any], what: str, *, name: str,
               allow_empty: bool = False, bad_word: str = "invalid"):
    self.parse, self.what, self.allow_empty, self.bad_word = parse, what, allow_empty, bad_word
    self.__name__ = name

  def __call__(self, text: str) -> list:
    items = [s.strip() for s in str(text).split(",")]
    items = [s for s in items if s]
    if not items and not self.allow_empty:
      raise argparse.ArgumentTypeError(f"empty list {text!r}; expected a comma-separated list of "
                                       f"{self.what}")
    values, bad = [], []
    for s in items:
      try:
        values.append(self.parse(s))
      except (ValueError, TypeError):
        bad.append(s)
    if bad:
      raise argparse.ArgumentTypeError(f"{self.bad_word} {', '.join(map(repr, bad))}; expected a "
                                       f"comma-separated list of {self.what}")
    return values

  def __repr__(self) -> str:
    return self.__name__


def _bounds(minimum, maximum, min_exclusive: bool = False) -> str:
  parts = []
  if minimum is not None:
    parts.append(f"{'>' if min_exclusive else '>='} {minimum}")
  if maximum is not None:
    parts.append(f"<= {maximum}")
  return " and ".join(parts)


def _signature(func: str, **kwargs) -> str:
  args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items() if v is not None and v is not False)
  return f"{func}({args})"


def int_list(minimum: int | None = None, maximum: int | None = None, *,
             allow_empty: bool = False) -> CommaList:
  """Integers in ``[minimum, maximum]`` (either bound optional): ``"1024, 4096"`` -> ``[1024,
  4096]``."""
  def parse(s: str) -> int:
    v = int(s)
    if (minimum is not None and v < minimum) or (maximum is not None and v > maximum):
      raise ValueError(s)
    return v

  bounds = _bounds(minimum, maximum)
  return CommaList(parse, "integers" + (f" {bounds}" if bounds else ""), allow_empty=allow_empty,
                   name=_signature("int_list", minimum=minimum, maximum=maximum,
                                   allow_empty=allow_empty))


def float_list(minimum: float | None = None, maximum: float | None = None, *,
               min_exclusive: bool = False, allow_empty: bool = False) -> CommaList:
  """Finite numbers in ``[minimum, maximum]`` (``(minimum, maximum]`` with ``min_exclusive``);
  ``nan`` and ``inf`` are refused."""
  def parse(s: str) -> float:
    v = float(s)
    if (not math.isfinite(v) or (minimum is not None and (v <= minimum if min_exclusive
                                                           else v < minimum))
        or (maximum is not None and v > maximum)):
      raise ValueError(s)
    return v

  bounds = _bounds(minimum, maximum, min_exclusive)
  return CommaList(parse, "finite numbers" + (f" {bounds}" if bounds else ""),
                   allow_empty=allow_empty,
                   name=_signature("float_list", minimum=minimum, maximum=maximum,
                                   min_exclusive=min_exclusive, allow_empty=allow_empty))


def choice_list(allowed: Iterable[str], *, allow_empty: bool = False) -> CommaList:
  """Names out of ``allowed`` (any iterable of str, e.g. a dict's keys), in the order given."""
  allowed = tuple(allowed)

  def parse(s: str) -> str:
    if s not in allowed:
      raise ValueError(s)
    return s

  return CommaList(parse, f"names out of: {', '.join(allowed)}", allow_empty=allow_empty,
                   bad_word="unknown", name=f"choice_list({', '.join(allowed)})")


def at_least(low: int) -> Callable[[str], int]:
  """A single int flag ``>= low``: ``--steps 0`` stops at parse time with ``argument --steps:
  must be an int >= 1, got 0`` (exit status 2)."""
  def parse(text: str) -> int:
    try:
      v = int(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"must be an int >= {low}, got {text!r}") from None
    if v < low:
      raise argparse.ArgumentTypeError(f"must be an int >= {low}, got {v}")
    return v
  parse.__name__ = f"int >= {low}"
  return parse
