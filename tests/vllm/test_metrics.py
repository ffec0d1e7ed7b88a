"""Parsing vLLM /metrics and polling engines: load figures, cache config, staleness, health hook."""

from __future__ import annotations

import math
import socket

import pytest

from prefixroute.errors import ConfigurationError, MetricsError
from prefixroute.testing import FakeVLLM
from prefixroute.vllm.metrics import MetricsPoller, parse_metrics

from .conftest import FakeClock


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("legacy", [False, True])
def test_parse_reads_load_cache_config_counters_and_histogram(legacy: bool) -> None:
    with FakeVLLM(num_blocks=333, legacy_metric_names=legacy) as engine:
        engine.complete(list(range(64)))
        engine.complete(list(range(64)), hold=True)
        engine.set_load(running=2, waiting=5)
        metrics = parse_metrics(engine.metrics_text())
    assert (metrics.running, metrics.waiting) == (3, 5)
    assert metrics.kv_usage == pytest.approx(4 / 333)
    assert (metrics.prefix_queries, metrics.prefix_hits, metrics.hit_rate) == (128, 64, 0.5)
    assert (metrics.block_size, metrics.num_gpu_blocks) == (16, 333)
    assert metrics.ttft_count == 2 and metrics.ttft_buckets[-1] == (math.inf, 2.0)
    assert [b for b, _ in metrics.ttft_buckets] == sorted(b for b, _ in metrics.ttft_buckets)


def test_parse_sums_engines_and_averages_kv_usage() -> None:
    text = """
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2
vllm:num_requests_waiting{engine="1",model_name="m"} 3
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.2
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.6
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1"} 1
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf"} 2
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.1"} 3
vllm:time_to_first_token_seconds_bucket{engine="1",le="+Inf"} 3
vllm:time_to_first_token_seconds_count{engine="0"} 2
vllm:time_to_first_token_seconds_count{engine="1"} 3
"""
    metrics = parse_metrics(text)
    assert metrics.waiting == 5 and metrics.kv_usage == pytest.approx(0.4) and metrics.running is None
    assert metrics.ttft_buckets == ((0.1, 4.0), (math.inf, 5.0)) and metrics.ttft_count == 5
    assert metrics.hit_rate is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("this is { not prometheus\n", "not Prometheus text"),
        ('vllm:num_requests_waiting{engine="0"} lots\n', "not Prometheus text"),
        ("# TYPE http_requests_total counter\nhttp_requests_total 3\n", "no vLLM metrics"),
        ("", "no vLLM metrics"),
    ],
)
def test_unreadable_text_raises_metrics_error(text: str, message: str) -> None:
    with pytest.raises(MetricsError, match=message):
        parse_metrics(text)


def test_poller_serves_load_then_marks_it_stale_and_reports_health() -> None:
    clock = FakeClock()
    events: list[tuple[str, bool]] = []
    dead = f"http://127.0.0.1:{closed_port()}"
    with FakeVLLM(num_blocks=100) as engine:
        engine.set_load(running=1, waiting=4)
        poller = MetricsPoller(
            {"gpu0": engine.url, "gpu1": dead}, stale_after=5, timeout=1, clock=clock,
            on_health=lambda b, ok: events.append((b, ok)),
        )  # fmt: skip
        try:
            assert poller.load("gpu0") == (None, None) and poller.is_stale("gpu0")
            poller.poll_once()
            assert poller.load("gpu0") == (4, 0.0)
            assert poller.cache_config("gpu0") == (16, 100) and poller.capacities() == {"gpu0": 100}
            assert poller.load("gpu1") == (None, None) and "cannot read" in (poller.scrape("gpu1").error or "")
            assert poller.healthy_backends(["gpu0", "gpu1", "unknown"]) == ["gpu0", "unknown"]
            assert sorted(events) == [("gpu0", True), ("gpu1", False)]
            clock.tick(6)
            assert poller.load("gpu0") == (None, None)  # too old to trust
            poller.poll_once()
            assert poller.load("gpu0") == (4, 0.0)
        finally:
            poller.stop()
        engine.stop()
        poller = MetricsPoller({"gpu0": engine.url}, clock=clock, timeout=1)
    assert poller.load("gpu0") == (None, None)


def test_cache_config_mismatches_are_warned_not_guessed(caplog: pytest.LogCaptureFixture) -> None:
    with FakeVLLM(block_size=32, num_blocks=50) as engine, MetricsPoller([engine.url], timeout=1) as poller:
        poller.poll_once()
        warnings = poller.check_cache_config(block_size=16, capacity_blocks=80)
    assert len(warnings) == 2
    assert "Router(block_size=32)" in warnings[0] and "50 GPU blocks" in warnings[1]
    assert "Router(block_size=32)" in caplog.text


def test_on_load_pushes_figures_into_a_router_after_every_scrape() -> None:
    from prefixroute import Router

    router = Router(block_size=16)
    dead = f"http://127.0.0.1:{closed_port()}"
    with FakeVLLM() as engine:
        engine.set_load(waiting=6)
        poller = MetricsPoller(
            {"gpu0": engine.url, "gpu1": dead}, timeout=1,
            on_load=lambda b, q, k: router.set_engine_load(b, queue_len=q, kv_usage=k),
        )  # fmt: skip
        with poller:
            poller.poll_once()
    candidates = {c.backend: c for c in router.route(list(range(32)), ["gpu0", "gpu1"]).candidates}
    assert (candidates["gpu0"].queue_len, candidates["gpu0"].kv_usage) == (6, 0.0)
    assert (candidates["gpu1"].queue_len, candidates["gpu1"].kv_usage) == (None, None)


def test_background_polling_and_bad_options() -> None:
    with FakeVLLM() as engine:
        engine.set_load(waiting=7)
        with MetricsPoller({"gpu0": engine.url + "/metrics"}, interval=0.05, timeout=1) as poller:
            from .conftest import wait_until

            wait_until(lambda: poller.load("gpu0")[0] == 7, what="a background scrape")
    with pytest.raises(ConfigurationError, match="interval"):
        MetricsPoller(["http://x"], interval=0)
    with pytest.raises(TypeError, match="not a str"):
        MetricsPoller("http://x")
