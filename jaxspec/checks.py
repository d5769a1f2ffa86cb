"""The one integer check every layer uses (a leaf module: it imports nothing of jaxspec).

An integer is a Python int or a numpy integer scalar, never a bool: `True` is an int to Python,
but `k=True` is a mistake, not 1. Fields that are written to JSON or hashed beside Python ints
(configs saved with a checkpoint) take `numpy=False`, so a numpy scalar fails where it is passed
rather than later, where it is serialised.

The error names the argument, the allowed range and the value it got, plus `why` (what the
number means or how to choose it) where the range alone does not say how to fix it:

  ValueError: batch_size must be an integer >= 1, got 0
  ValueError: top_k must be an integer in [0, 2**31) (0 disables it), got -1
"""

from __future__ import annotations

from typing import Any

import numpy as np


def is_int(value: Any, *, numpy: bool = True) -> bool:
  """Whether `value` is an integer: an int, or with `numpy` a numpy integer scalar; never a bool."""
  return isinstance(value, (int, np.integer) if numpy else int) and not isinstance(value, bool)


def _power_of_two(n: int) -> int | None:
  """e with n == 2**e, for the large powers (e >= 16) that read better as powers; else None."""
  e = n.bit_length() - 1
  return e if n > 0 and e >= 16 and n == 1 << e else None


def int_range(lo: int | None = None, hi: int | None = None) -> str:
  """The words for an integer in [lo, hi] (either bound may be None: unbounded). A bound next
  to a large power of two is written as one: [0, 2**31) rather than [0, 2147483647]."""
  low = None if lo is None else (f"-2**{_power_of_two(-lo)}" if lo < 0 and _power_of_two(-lo)
                                 else str(lo))
  top = hi is not None and _power_of_two(hi + 1)
  if lo is not None and hi is not None:
    return f"an integer in [{low}, 2**{top})" if top else f"an integer in [{low}, {hi}]"
  if lo is not None:
    return f"an integer >= {low}"
  if hi is not None:
    return f"an integer < 2**{top}" if top else f"an integer <= {hi}"
  return "an integer"


def check_int(name: str, value: Any, lo: int | None = None, hi: int | None = None, *,
              why: str = "", numpy: bool = True, error: type[Exception] = ValueError) -> None:
  """Raises `error` unless `value` is an integer (see `is_int`) in [lo, hi] (bounds inclusive;
  None: unbounded).

  Args:
    name: the argument as the caller knows it ("batch_size", "TrainConfig.steps", "--top-k").
    value: what was passed.
    lo, hi: the inclusive bounds, or None.
    why: what the number means or how to choose it, added in parentheses.
    numpy: accept numpy integer scalars (False: only a Python int).
    error: the exception class to raise (ValueError, or a ValueError subclass of the caller's).
  Raises:
    `error`: "{name} must be an integer in [lo, hi] ({why}), got {value!r}".
  """
  if is_int(value, numpy=numpy) and (lo is None or value >= lo) and (hi is None or value <= hi):
    return
  because = f" ({why})" if why else ""
  raise error(f"{name} must be {int_range(lo, hi)}{because}, got {value!r}")


def parse_int(text: str, lo: int | None = None, hi: int | None = None, *,
              error: type[Exception] = ValueError) -> int:
  """`text` (a command-line value) as an integer in [lo, hi].

  Raises:
    `error`: "expected an integer in [lo, hi], got {text!r}" (argparse puts the option's name
      in front of an `argparse.ArgumentTypeError`'s message).
  """
  try:
    n = int(text)
  except ValueError:
    raise error(f"expected {int_range(lo, hi)}, got {text!r}") from None
  if (lo is not None and n < lo) or (hi is not None and n > hi):
    raise error(f"expected {int_range(lo, hi)}, got {n}")
  return n


__all__ = ["check_int", "int_range", "is_int", "parse_int"]
