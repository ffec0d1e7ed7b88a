"""Number and flag checks shared by every layer's option checks (a nonsense value is refused when it is given)."""

from __future__ import annotations

import math
import numbers
import operator

from prefixroute.errors import ConfigurationError

__all__ = ["as_float", "as_int", "check_flag", "shown"]


def as_int(value: object) -> int | None:
    """``value`` as a Python int if it is an integer that is not a bool; else None. O(1).

    Every int option and argument of the public API is read through this, so numpy's integers (and any other
    :class:`numbers.Integral`, an ``IntEnum`` too) are taken where an int is and kept as the plain int they stand
    for; a bool (numpy's too), a float (even ``2.0``), a str or anything else is None, for the caller to refuse.
    :func:`as_float` is its counterpart for numbers of seconds, fractions and factors.
    """
    if type(value) is int:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    try:
        return operator.index(value)
    except Exception:  # noqa: BLE001 - an Integral whose __index__ raises is not an int, whatever it raised
        return None


def as_float(value: object, *, infinite: bool = False) -> float | None:
    """``value`` as a Python float if it is a finite real number that is not a bool; else None. O(1).

    Every option and argument in seconds, a fraction or a factor is read through this, so any
    :class:`numbers.Real` is taken (an int, numpy's floats and ints, :class:`fractions.Fraction`) and kept as the
    plain float it stands for: no numpy scalar is stored. None, for the caller to refuse: a bool (numpy's too), NaN,
    an infinity (unless ``infinite``, for an option where ``math.inf`` means "never"), a number too large for a
    float (``10**400``, whose conversion raises OverflowError), a real whose ``__float__`` raises, and anything that
    is not a :class:`numbers.Real`: a str, a complex, a :class:`decimal.Decimal` (the numeric tower leaves it out
    because it does not mix with float arithmetic; ``float(d)`` says where its rounding is wanted).

    A plain float or int takes a fast path (about 75 and 105 ns), no slower than the ``isinstance`` checks it
    replaced: per-request calls (``Router.start(lease=)``, ``first_token()``) read their figures here too.
    """
    if type(value) is float:
        number = value
    elif type(value) is int or (not isinstance(value, bool) and isinstance(value, numbers.Real)):
        try:
            number = float(value)
        except Exception:  # noqa: BLE001 - a Real that is no float (too large, a __float__ that raises) is none
            return None
    else:
        return None
    return number if math.isfinite(number) or (infinite and not math.isnan(number)) else None


def check_flag(value: object, name: str) -> bool:
    """``value`` if it is True or False; else a ConfigurationError naming the option ``name``. O(1).

    Every flag option of the public API is read through this: a value a flag cannot use, whatever its type, is an
    option's error, as a float for a count is (not an InvalidTypeError), and a truthy value such as ``"no"`` or ``1``
    never switches a flag on.
    """
    if value is True or value is False:
        return value
    raise ConfigurationError(f"{name} must be True or False, not {shown(value)}")


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
