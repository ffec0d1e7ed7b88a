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
from prometheus_client import CollectorRegistry

from prefixroute import BoundedLoad, ConfigurationError, LinearTTFT, PredictedTTFT, Router
from prefixroute._numbers import shown
from prefixroute.vllm import EventIndex, Fleet, KVEventSubscriber, parse_metrics
from prefixroute.vllm.doctor import diagnose, histogram_quantile
from prefixroute.vllm.export import RouterMetrics

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


def _fleet(**options: Any) -> Fleet:
    fleet = Fleet(Router(), **options)
    fleet.close()
    return fleet


def _subscriber(**options: Any) -> KVEventSubscriber:
    return KVEventSubscriber(Router(), "gpu0", "tcp://127.0.0.1:1", **options)


def _stopped(timeout: Any) -> None:
    _subscriber().stop(timeout)


_BUCKETS = [(1.0, 0.0), (2.0, 10.0), (math.inf, 10.0)]


def _quantile(q: Any) -> None:
    quantile = histogram_quantile(q, _BUCKETS)
    assert type(quantile) is float and quantile == histogram_quantile(float(q), _BUCKETS)


def _observed(seconds: Any) -> None:
    RouterMetrics(CollectorRegistry()).observe(Router().route([1, 2, 3], ["a"]), seconds)


_METRICS = parse_metrics("vllm:num_requests_waiting 0\n")
_SECONDS = "must be a finite positive number of seconds (at most "
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
    "EventIndex(speculative_ttl=)": Option(
        lambda v: EventIndex(speculative_ttl=v), lambda i: i.speculative_ttl, 0.5,
        "speculative_ttl must be a finite number of seconds >= 0 (0: events only)"),
    "Fleet(interval=)": Option(lambda v: _fleet(interval=v), lambda f: f._interval, 0.5, "interval " + _SECONDS),
    "Fleet(stale_after=)": Option(
        lambda v: _fleet(stale_after=v), lambda f: f._stale_after, 8.0, "stale_after " + _SECONDS),
    "KVEventSubscriber(replay_timeout=)": Option(
        lambda v: _subscriber(replay_timeout=v), lambda s: s._replay_timeout, 0.5, "replay_timeout " + _SECONDS),
    "KVEventSubscriber(reconnect_backoff=)": Option(
        lambda v: _subscriber(reconnect_backoff=(v, 5.0)), lambda s: s._backoff[0], 0.25,
        "reconnect_backoff's low " + _SECONDS),
    "KVEventSubscriber.stop(timeout=)": Option(
        _stopped, None, 0.5, "timeout must be a finite number of seconds >= 0 (at most "),
    "histogram_quantile(q=)": Option(_quantile, None, 0.5, "q must be a number in [0, 1]"),
    "RouterMetrics.observe(seconds=)": Option(_observed, None, 0.5, "seconds must be a finite number >= 0"),
    "diagnose(ratio_threshold=)": Option(
        lambda v: diagnose(_METRICS, ratio_threshold=v), None, 1.5, "ratio_threshold must be a finite number >= 1"),
    "diagnose(low_hit_rate=)": Option(
        lambda v: diagnose(_METRICS, low_hit_rate=v), None, 0.25, "low_hit_rate must be a fraction in [0, 1]"),
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
