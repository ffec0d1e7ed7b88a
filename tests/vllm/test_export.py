"""RouterMetrics: decisions, tokens, fallbacks, latency, and index / event-stream state read at scrape time."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from prefixroute import BlockHasher, BoundedLoad, ConfigurationError, Router
from prefixroute.testing import FakeVLLM
from prefixroute.vllm import EventIndex, Fleet, KVEventSubscriber
from prefixroute.vllm.export import RouterMetrics

from .conftest import settle


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def test_decisions_tokens_fallbacks_and_latency_are_counted() -> None:
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry)
    router = Router(block_size=16, policy=BoundedLoad(factor=1.0))
    prompt = list(range(64))
    backends = ["gpu0", "gpu1"]
    first = router.route(prompt, backends)
    metrics.observe(first, 0.00003)
    second = router.route(prompt, backends)
    metrics.observe(second, 0.0002)
    metrics.observe_served(48)
    assert value(registry, "prefixroute_decisions_total", backend=first.backend, reason="miss") == 1
    assert value(registry, "prefixroute_decisions_total", backend=second.backend, reason=second.reason) == 1
    assert value(registry, "prefixroute_matched_tokens_total", source="predicted") == second.matched_tokens == 64
    assert value(registry, "prefixroute_matched_tokens_total", source="served") == 48
    assert value(registry, "prefixroute_matched_tokens_total", source="confirmed") is None  # no events here
    assert value(registry, "prefixroute_prompt_tokens_total") == 128
    assert value(registry, "prefixroute_route_seconds_count") == 2
    assert value(registry, "prefixroute_route_seconds_bucket", le="5e-05") == 1
    with router.track(second):  # gpu0 is busy: bounded load with factor 1 diverts the next request
        third = router.route(prompt, backends)
    metrics.observe(third, 0.0001)
    assert third.reason == "load-fallback"
    assert value(registry, "prefixroute_load_fallbacks_total", backend=third.backend) == 1
    with pytest.raises(ValueError, match=">= 0"):
        metrics.observe_served(-1)


def test_confirmed_and_served_tokens_are_counted_once_each() -> None:
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry)
    router = Router(index=EventIndex(16, speculative_ttl=0))
    prompt = list(range(64))
    router.store("gpu0", BlockHasher(16).hash(prompt)[:2])
    decision = router.route(prompt, ["gpu0"])
    metrics.observe(decision, 0.0)
    metrics.observe_served(32)  # what the engine then reported for the same request
    assert decision.confirmed_tokens == 32
    assert value(registry, "prefixroute_matched_tokens_total", source="confirmed") == 32
    assert value(registry, "prefixroute_matched_tokens_total", source="served") == 32


def test_index_and_event_stream_state_is_read_at_scrape_time() -> None:
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry, prefix="pr")
    router = Router(index=EventIndex(16))
    index = router.index
    with FakeVLLM() as engine, Fleet(router) as fleet:
        fleet.add_backend("gpu0", kv_events=engine.endpoint, replay=engine.replay_endpoint)
        sub = fleet.subscriber("gpu0")
        assert sub is not None
        metrics.watch_index(index)
        metrics.watch_fleet(fleet)
        engine.drop_next()
        engine.complete(list(range(64)))
        settle(engine, sub)
        text = generate_latest(registry).decode()
        assert value(registry, "pr_index_blocks", backend="gpu0") == index.blocks("gpu0") > 0
        assert value(registry, "pr_event_batches_total", backend="gpu0") == sub.stats().batches
        assert value(registry, "pr_event_gaps_total", backend="gpu0") == sub.stats().gaps
        assert value(registry, "pr_event_failed_replays_total", backend="gpu0") == sub.stats().failed_replays == 0
        assert (value(registry, "pr_event_lag_seconds", backend="gpu0") or -1) >= 0
        stats = sub.stats()
        assert value(registry, "pr_event_unrecovered_gaps_total", backend="gpu0") == stats.unrecovered_gaps
        assert value(registry, "pr_engine_restarts_total", backend="gpu0") == stats.restarts
        assert value(registry, "pr_event_handshake_failures_total", backend="gpu0") == stats.handshake_failures
    names = {family.name for family in text_string_to_metric_families(text)}
    assert {"pr_decisions", "pr_route_seconds", "pr_index_blocks", "pr_engine_restarts"} <= names


def test_two_exporters_keep_their_registries_apart() -> None:
    first, second = CollectorRegistry(), CollectorRegistry()
    RouterMetrics(first).observe(Router().route(list(range(16)), ["a"]), 0.0)
    RouterMetrics(second)
    assert value(first, "prefixroute_decisions_total", backend="a", reason="miss") == 1
    assert value(second, "prefixroute_decisions_total", backend="a", reason="miss") is None
    with pytest.raises(TypeError, match="CollectorRegistry"):
        RouterMetrics(None)  # type: ignore[arg-type]


def test_a_watched_subscriber_is_exported_beside_a_watched_fleet() -> None:
    """Each watch adds its streams: a subscriber watched on its own and a fleet's backends are all exported."""
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry)
    standalone = KVEventSubscriber(Router(index=EventIndex(16)), "gpu1", "tcp://127.0.0.1:2")
    with Fleet(Router(index=EventIndex(16))) as fleet:
        fleet.add_backend("gpu0", kv_events="tcp://127.0.0.1:1")
        metrics.watch_subscriber(standalone)
        metrics.watch_fleet(fleet)
        for backend in ("gpu0", "gpu1"):
            for name in ("batches", "gaps", "unrecovered_gaps", "failed_replays"):
                assert value(registry, f"prefixroute_event_{name}_total", backend=backend) == 0, (name, backend)
            assert value(registry, "prefixroute_engine_restarts_total", backend=backend) == 0
            assert value(registry, "prefixroute_event_lag_seconds", backend=backend) is None  # no batch yet
        with pytest.raises(TypeError, match="subscriber must be a KVEventSubscriber, not Fleet"):
            metrics.watch_subscriber(fleet)  # type: ignore[arg-type]


def test_an_index_is_read_under_its_lock_and_a_lock_must_be_a_context_manager() -> None:
    class Recording:
        """A lock as watch_index() takes one: any context manager."""

        def __init__(self) -> None:
            self.entered = 0

        def __enter__(self) -> None:
            self.entered += 1

        def __exit__(self, *exc: object) -> None:
            return None

    class EnterOnly:
        def __enter__(self) -> None:
            return None

    registry = CollectorRegistry()
    metrics = RouterMetrics(registry)
    router = Router(block_size=16)
    router.route(list(range(32)), ["gpu0"])
    recording = Recording()
    metrics.watch_index(router.index, lock=recording)  # type: ignore[arg-type]
    metrics.watch_index(Router(block_size=16).index, lock=threading.Lock())
    assert value(registry, "prefixroute_index_blocks", backend="gpu0") == router.index.blocks("gpu0") == 2
    assert recording.entered == 1  # once per scrape
    for lock in (object(), EnterOnly()):
        with pytest.raises(
            TypeError, match=f"lock must be a lock .a context manager. or None, not {type(lock).__name__}"
        ):
            metrics.watch_index(router.index, lock=lock)  # type: ignore[arg-type]


def test_nothing_is_counted_for_a_refused_observation() -> None:
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry)
    decision = Router().route(list(range(16)), ["gpu0"])
    for seconds, shown in ((-1, "-1"), (float("nan"), "nan"), (None, "None")):
        with pytest.raises(ConfigurationError, match=f"seconds must be a finite number >= 0, not {shown}$"):
            metrics.observe(decision, seconds)  # type: ignore[arg-type]
    assert value(registry, "prefixroute_decisions_total", backend="gpu0", reason="miss") is None
    assert value(registry, "prefixroute_route_seconds_count") == 0
    # Served tokens: an int in [0, 2**63), as the message says.
    for count in (0, 200, 2**63 - 1):
        metrics.observe_served(count)
    assert value(registry, "prefixroute_matched_tokens_total", source="served") == float(200 + 2**63 - 1)
    with pytest.raises(ConfigurationError, match=r"below 2\*\*63, not 9223372036854775808$"):
        metrics.observe_served(2**63)
    with pytest.raises(ConfigurationError, match=r"not -1$"):
        metrics.observe_served(-1)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (
            lambda m: RouterMetrics({}),  # type: ignore[arg-type]
            TypeError,
            "registry must be a prometheus_client CollectorRegistry, not dict",
        ),
        (lambda m: RouterMetrics(CollectorRegistry(), prefix=5), TypeError, "prefix must be a str, not int"),  # type: ignore[arg-type]
        (
            lambda m: RouterMetrics(CollectorRegistry(), prefix="9x"),
            ConfigurationError,
            r"prefix must be a Prometheus metric name \(.*\), like 'prefixroute', not '9x'",
        ),
        (lambda m: m.observe("gpu0", 0.0), TypeError, "decision must be a prefixroute.Decision, not str"),
        (lambda m: m.observe_served("16"), TypeError, "cached_tokens must be an int >= 0, not str"),
        (lambda m: m.watch_index({}), TypeError, "index must be a prefixroute.PrefixIndex, not dict"),
        (lambda m: m.watch_fleet(["gpu0"]), TypeError, "fleet must be a prefixroute.vllm.Fleet, not list"),
    ],
)
def test_a_wrong_argument_is_refused_with_a_message_naming_it(
    call: Callable[[RouterMetrics], object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=f"^{message}$"):
        call(RouterMetrics(CollectorRegistry()))
