"""Number checks shared by the simulator's option checks (a nonsense number is refused when it is given)."""

from __future__ import annotations

import math
from typing import TypeGuard

__all__ = ["is_finite_number", "shown"]

_MAX_DIGITS_SHOWN = 30


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
    """``repr(value)`` for an error message, with a huge int shortened (its repr can be thousands of digits, or
    refused past Python's int string conversion limit)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 3 * _MAX_DIGITS_SHOWN:
        return f"an int of {value.bit_length()} bits"
    return repr(value)
