"""RouterMetrics: decisions, tokens, fallbacks, latency, and index / event-stream state read at scrape time."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from prefixroute import BlockHasher, BoundedLoad, Router
from prefixroute.testing import FakeVLLM
from prefixroute.vllm import EventIndex, Fleet
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
