"""Number checks shared by every layer's option checks (a nonsense number is refused when it is given)."""

from __future__ import annotations

import math
from typing import TypeGuard

__all__ = ["is_finite_number", "shown"]


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
