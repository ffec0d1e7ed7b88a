"""Number checks shared by every layer's option checks (a nonsense number is refused when it is given)."""

from __future__ import annotations

import math
import numbers
import operator
from typing import TypeGuard

__all__ = ["as_int", "is_finite_number", "shown"]


def as_int(value: object) -> int | None:
    """``value`` as a Python int if it is an integer that is not a bool; else None. O(1).

    Every int option and argument of the public API is read through this, so numpy's integers (and any other
    :class:`numbers.Integral`, an ``IntEnum`` too) are taken where an int is and kept as the plain int they stand
    for; a bool (numpy's too), a float (even ``2.0``), a str or anything else is None, for the caller to refuse.
    """
    if type(value) is int:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    try:
        return operator.index(value)
    except Exception:  # noqa: BLE001 - an Integral whose __index__ raises is not an int, whatever it raised
        return None


def is_finite_number(value: object) -> TypeGuard[int | float]:
    """Whether ``value`` is an int or float (not a bool) that is finite as a float.

    NaN, infinities and ints too large for a float (``10**400``, which ``math.isfinite`` would raise OverflowError
    on) are not.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def shown(value: object) -> str:
    """``repr(value)`` for an error message, short even for a huge int (its repr can be thousands of digits, or
    refused past Python's int string conversion limit) or a long value, and never raising (a repr() that raises
    is named by its type)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an int of {value.bit_length()} bits"
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a message about a value must not fail on the value's own repr()
        return f"a {type(value).__name__} whose repr() raised"
    return text if len(text) <= 80 else text[:77] + "..."
