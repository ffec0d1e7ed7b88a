"""Every option in seconds, a fraction or a factor takes any real number but a bool (numpy's floats, a Fraction),
as an int option takes numpy's ints, and keeps the plain float it stands for; what it refused before (a bool, NaN,
an infinity, a str, numpy's bool, a Decimal) it refuses with the same error."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from typing import Any

import numpy as np
import pytest

from prefixroute import BoundedLoad, ConfigurationError, LinearTTFT, PredictedTTFT, Router
from prefixroute._numbers import shown

from .conftest import FakeClock

npa: Any = np  # numpy's scalars typed loosely: stubs differ on which of them are floats


@dataclass(frozen=True)
class Option:
    """One option: ``make(value)`` gives the thing that took it, ``read`` what it stored (None: nothing stored),
    ``good`` a value in range that float16 holds exactly, and a refused value's error starts with ``message``."""

    make: Callable[[Any], Any]
    read: Callable[[Any], object] | None
    good: float
    message: str
    error: type[Exception] = ConfigurationError
    infinite: bool = False  # math.inf is a value it takes ("never")


def _started(lease: Any) -> Router:
    router = Router(clock=FakeClock(0.0))
    router.start(router.route([1, 2, 3], ["a"]), lease=lease)
    return router


def _engine_load(kv_usage: Any) -> Router:
    router = Router()
    router.set_engine_load("a", queue_len=None, kv_usage=kv_usage)
    return router


_LEASE = "lease must be a positive, finite number of seconds"
OPTIONS = {
    "Router(lease=)": Option(lambda v: Router(lease=v), lambda r: r._lease, 30.0, _LEASE),
    "Router.start(lease=)": Option(_started, lambda r: r._leases[0][0], 30.0, _LEASE),
    "Router.set_engine_load(kv_usage=)": Option(
        _engine_load, lambda r: r._kv_usage["a"], 0.5, "kv_usage must be a fraction in [0, 1] or None"),
    "BoundedLoad(factor=)": Option(
        lambda v: BoundedLoad(factor=v), lambda p: p.factor, 1.5, "BoundedLoad factor must be a finite number >= 1.0"),
    "LinearTTFT(per_token_s=)": Option(
        lambda v: LinearTTFT(per_token_s=v), lambda c: c.per_token_s, 0.25,
        "LinearTTFT per_token_s must be a finite number of seconds >= 0"),
    "PredictedTTFT(kv_cap=)": Option(
        lambda v: PredictedTTFT(kv_cap=v), lambda p: p.kv_cap, 0.5,
        "PredictedTTFT kv_cap must be a fraction in [0, 1)"),
}  # fmt: skip


def _takes(good: float) -> list[Any]:
    return [npa.float32(good), npa.float16(good), npa.float64(good), npa.longdouble(good), Fraction(good)]


@pytest.mark.parametrize("name", OPTIONS)
def test_a_real_number_is_taken_and_kept_as_a_plain_float(name: str) -> None:
    option = OPTIONS[name]
    for value in _takes(option.good):
        made = option.make(value)
        if option.read is not None:
            stored = option.read(made)
            assert type(stored) is float and stored == option.good, (value, stored)


@pytest.mark.parametrize("name", OPTIONS)
def test_what_is_no_finite_real_number_is_refused_with_the_same_error(name: str) -> None:
    option = OPTIONS[name]
    bads: list[Any] = [True, npa.bool_(True), math.nan, npa.float32("nan"), "0.5", Decimal("0.5"), 1j, 10**400]
    if not option.infinite:
        bads += [math.inf, npa.float32("inf"), -math.inf]
    for bad in bads:
        with pytest.raises(option.error) as refused:
            option.make(bad)
        assert str(refused.value).startswith(option.message) and shown(bad) in str(refused.value), refused.value
