"""as_float(): the one reading of every option in seconds, fractions and factors; shown(): a value in a message."""

from __future__ import annotations

import math
from decimal import Decimal
from fractions import Fraction
from typing import Any

import numpy as np
import pytest

from prefixroute._numbers import as_float, shown

npa: Any = np  # numpy's scalars typed loosely: stubs differ on which of them are floats


class FloatRaises(float):
    """A real number whose conversion to a plain float raises (a broken third-party number type)."""

    def __float__(self) -> float:
        raise RuntimeError("no float")


FINITE: list[tuple[Any, float]] = [
    (0.5, 0.5), (3, 3.0), (-2, -2.0), (npa.float32(0.5), 0.5), (npa.float16(0.25), 0.25), (npa.float64(2.0), 2.0),
    (npa.longdouble(0.5), 0.5), (npa.int64(3), 3.0), (npa.uint8(7), 7.0), (Fraction(1, 4), 0.25),
    (Fraction(10**400, 10**399), 10.0), (npa.float32(0.1), float(npa.float32(0.1))), (2**53 + 1, float(2**53)),
]  # fmt: skip


@pytest.mark.parametrize(("value", "expected"), FINITE, ids=repr)
def test_a_finite_real_is_the_plain_float_it_stands_for(value: object, expected: float) -> None:
    number = as_float(value)
    assert type(number) is float and number == expected
    assert as_float(value, infinite=True) == expected


REFUSED: list[Any] = [
    True, False, npa.bool_(True), math.nan, -math.nan, npa.float32("nan"), math.inf, -math.inf, npa.float16("inf"),
    npa.longdouble("1e4000"), 10**400, -(10**400), Fraction(10**400), Decimal("0.5"), "0.5", b"1", 1j,
    npa.complex64(1), None, [0.5], npa.array([0.5]), FloatRaises(0.5),
]  # fmt: skip


@pytest.mark.parametrize("value", REFUSED, ids=repr)
def test_anything_else_is_none(value: object) -> None:
    assert as_float(value) is None


def test_infinite_takes_an_infinity_of_any_real_but_not_nan_or_a_number_too_large_for_a_float() -> None:
    for value in (math.inf, -math.inf, npa.float32("inf"), npa.longdouble("1e4000")):
        number = as_float(value, infinite=True)
        assert type(number) is float and math.isinf(number) and (number > 0) == (value > 0)
    bads: list[Any] = [math.nan, npa.float32("nan"), 10**400, Fraction(10**400), True, "inf", Decimal("Infinity")]
    assert [as_float(bad, infinite=True) for bad in bads] == [None] * len(bads)


class ReprRaises:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


def test_shown_is_the_repr_of_a_value_cut_to_80_characters_and_never_raises() -> None:
    assert shown(2**64 - 1) == "18446744073709551615"  # a block hash is shown whole
    assert shown(2**64) == "an int of 65 bits" and shown(-(10**400)) == "an int of 1329 bits"
    assert shown("a" * 78) == repr("a" * 78)  # 80 characters: kept
    assert shown("a" * 79) == "'" + "a" * 76 + "..."  # 81: cut to 80
    assert shown(ReprRaises()) == "a ReprRaises whose repr() raised"
