"""Every option in seconds, a fraction or a factor takes any real number but a bool (numpy's floats, a Fraction),
as an int option takes numpy's ints, and keeps the plain float it stands for; what it refused before (a bool, NaN,
an infinity, a str, numpy's bool, a Decimal) it refuses with the same error."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from decimal import Decimal
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from prefixroute import BoundedLoad, ConfigurationError, LinearTTFT, PredictedTTFT, Router
from prefixroute._numbers import shown
from prefixroute.adapters.proxy import Proxy
from prefixroute.sim.backend import BackendConfig
from prefixroute.sim.baselines import DynamoKvRouter, RayServePrefixAware
from prefixroute.sim.compare import rank
from prefixroute.sim.engine import ClosedLoop, OpenLoop, Simulation, TraceTimes
from prefixroute.sim.profiles import load_profile
from prefixroute.sim.runner import SimSpec
from prefixroute.sim.workloads import make_workload
from prefixroute.testing.openai_engine import OpenAIEngine
from prefixroute.vllm import EventIndex, Fleet, KVEventSubscriber, parse_metrics
from prefixroute.vllm.doctor import diagnose, histogram_quantile
from prefixroute.vllm.export import RouterMetrics

from .conftest import FakeClock
from .sim.conftest import LinearCost
from .sim.test_compare import result

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
    _subscriber().stop(timeout=timeout)


_BUCKETS = [(1.0, 0.0), (2.0, 10.0), (math.inf, 10.0)]


def _quantile(q: Any) -> None:
    quantile = histogram_quantile(q, _BUCKETS)
    assert type(quantile) is float and quantile == histogram_quantile(float(q), _BUCKETS)


def _observed(seconds: Any) -> None:
    RouterMetrics(CollectorRegistry()).observe(Router().route([1, 2, 3], ["a"]), seconds)


def _simulation(**options: Any) -> Simulation:
    return Simulation(
        router=Router(), workload=make_workload("seed"), arrivals=ClosedLoop(2), cost=LinearCost(),
        config=BackendConfig(capacity_blocks=100), backends=2, max_requests=4, **options,
    )  # fmt: skip


def _ranked(tolerance: Any) -> None:
    assert rank([result("a", p99=10.0, rps=1.0)], tolerance=tolerance).recommended.policy == "a"


def _proxy(**options: Any) -> Proxy:
    return Proxy(Router(), ["http://127.0.0.1:1"], base_models=[], **options)


def _sidecar(lease: Any) -> Any:
    from prefixroute.adapters.serve.app import Sidecar  # the serve extra

    return Sidecar(Router(), backends=[], lease=lease)


_COEFFICIENTS = load_profile("codellama-13b", "a100-40gb").coefficients
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
    "SimSpec(rate=)": Option(lambda v: SimSpec(rate=v), lambda s: s.rate, 0.5, "--rate must be a finite number > 0"),
    "SimSpec(think_time=)": Option(
        lambda v: SimSpec(think_time=v), lambda s: s.think_time, 0.5, "--think-time must be a finite number >= 0"),
    "SimSpec(sharing_ratio=)": Option(
        lambda v: SimSpec(sharing_ratio=v), lambda s: s.sharing_ratio, 0.25, "--sharing-ratio must be between 0 and 1"),
    "SimSpec(gpu_memory_utilization=)": Option(
        lambda v: SimSpec(gpu_memory_utilization=v), lambda s: s.gpu_memory_utilization, 0.5,
        "gpu_memory_utilization must be in (0, 1]"),
    "ClosedLoop(think_time=)": Option(
        lambda v: ClosedLoop(2, think_time=v), lambda a: a.think_time, 0.5,
        "think_time must be a finite number of seconds >= 0"),
    "OpenLoop(rate=)": Option(
        lambda v: OpenLoop(v), lambda a: a.rate, 2.0, "rate must be a finite number > 0 of requests a second"),
    "TraceTimes(speedup=)": Option(
        lambda v: TraceTimes(speedup=v), lambda a: a.speedup, 2.0, "speedup must be a finite number > 0"),
    "Simulation(duration=)": Option(
        lambda v: _simulation(duration=v), lambda s: s.duration, 8.0,
        "duration must be a finite number > 0 of seconds"),
    "Simulation(metrics_interval=)": Option(
        lambda v: _simulation(metrics_interval=v), lambda s: s.metrics_interval, 0.5,
        "metrics_interval must be a finite number > 0 of seconds"),
    "make_workload(sharing_ratio=)": Option(
        lambda v: make_workload("seed", sharing_ratio=v), lambda w: w.sharing_ratio, 0.5,
        "sharing ratio must be a number between 0 and 1"),
    "CostCoefficients(per_sequence_s=)": Option(
        lambda v: replace(_COEFFICIENTS, per_sequence_s=v), lambda c: c.per_sequence_s, 0.25,
        "CostCoefficients per_sequence_s must be a finite number >= 0"),
    "DynamoKvRouter(temperature=)": Option(
        lambda v: DynamoKvRouter(temperature=v), lambda p: p.temperature, 0.5,
        "temperature must be a finite number >= 0"),
    "RayServePrefixAware(imbalanced_threshold=)": Option(
        lambda v: RayServePrefixAware(imbalanced_threshold=v), lambda p: p.imbalanced_threshold, 8.0,
        "imbalanced_threshold must be a number >= 0 or math.inf", infinite=True),
    "rank(tolerance=)": Option(_ranked, None, 0.25, "tolerance must be in [0, 1)"),
    "diagnose(ratio_threshold=)": Option(
        lambda v: diagnose(_METRICS, ratio_threshold=v), None, 1.5, "ratio_threshold must be a finite number >= 1"),
    "diagnose(low_hit_rate=)": Option(
        lambda v: diagnose(_METRICS, low_hit_rate=v), None, 0.25, "low_hit_rate must be a fraction in [0, 1]"),
    "Proxy(cooldown=)": Option(
        lambda v: _proxy(cooldown=v), lambda p: p._cooldown, 0.5,
        "cooldown must be a positive, finite number of seconds"),
    "Proxy(connect_timeout=)": Option(
        lambda v: _proxy(connect_timeout=v), lambda p: p._connect_timeout, 0.5,
        "connect_timeout must be a positive, finite number of seconds"),
    "Sidecar(lease=)": Option(_sidecar, lambda s: s._lease, 30.0, _LEASE),
    "OpenAIEngine(prefill_s=)": Option(
        lambda v: OpenAIEngine(prefill_s=v), lambda e: e.prefill_s, 0.25,
        "prefill_s must be a finite, non-negative number of seconds"),
    "OpenAIEngine(token_delay_s=)": Option(
        lambda v: OpenAIEngine(token_delay_s=v), lambda e: e.token_delay_s, 0.25,
        "token_delay_s must be a finite, non-negative number of seconds"),
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
    if option.infinite:
        assert option.read is not None
        for value in (math.inf, npa.float32("inf"), npa.float64("inf")):
            stored = option.read(option.make(value))
            assert type(stored) is float and stored == math.inf, (value, stored)


@pytest.mark.parametrize("name", OPTIONS)
def test_what_is_no_finite_real_number_is_refused_with_the_same_error(name: str) -> None:
    option = OPTIONS[name]
    bads: list[Any] = [True, npa.bool_(True), math.nan, npa.float32("nan"), "0.5", Decimal("0.5"), 1j, 10**400]
    if not option.infinite:
        bads += [math.inf, npa.float32("inf"), -math.inf]
    for bad in bads:
        with pytest.raises(option.error) as refused:
            option.make(bad)
        message = str(refused.value)
        assert message.startswith(option.message) and (shown(bad) in message or repr(bad) in message), message
