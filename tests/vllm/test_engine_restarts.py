"""An engine restart seen in /metrics: its process start time changed or a counter went back. The engine's prefix
cache died with its process, so the router forgets the backend's blocks: a predictions index at once, an events index
by resetting the backend's subscribers (which then replay the new engine's batches)."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry

from prefixroute import InvalidTypeError, Router
from prefixroute.testing import FakeVLLM
from prefixroute.vllm import EngineMetrics, Fleet, parse_metrics
from prefixroute.vllm.export import RouterMetrics

from ..conftest import wait_until
from .conftest import events_router, fresh, settle

PROMPT = [random.Random(7).randrange(30_000) for _ in range(96)]  # 6 blocks
RUNNING = 'vllm:num_requests_running{engine="0"} 1\n'


def metrics_text(*, queries: float, ttft: float = 0.0, started: str | None = None) -> str:
    text = RUNNING + f'vllm:prefix_cache_queries_total{{engine="0"}} {queries}\n'
    text += f'vllm:time_to_first_token_seconds_count{{engine="0"}} {ttft}\n'
    return text if started is None else text + f"process_start_time_seconds {started}\n"


def test_parse_reads_the_process_start_time_and_leaves_a_nonsense_one_unused() -> None:
    assert parse_metrics(metrics_text(queries=1, started="1.7e9")).process_start_time == 1.7e9
    assert parse_metrics(metrics_text(queries=1)).process_start_time is None
    for nonsense in ("NaN", "-1", "+Inf"):  # no engine's figure: not used, and no reason to fail the scrape
        assert parse_metrics(metrics_text(queries=1, started=nonsense)).process_start_time is None
    two = metrics_text(queries=1) + 'process_start_time_seconds{pid="1"} 5\nprocess_start_time_seconds{pid="2"} 6\n'
    assert parse_metrics(two).process_start_time is None  # which process is the engine's? neither is trusted


@pytest.mark.parametrize(
    ("before", "after", "restarted"),
    [
        (EngineMetrics(process_start_time=10.0), EngineMetrics(process_start_time=10.0), False),
        (EngineMetrics(process_start_time=10.0), EngineMetrics(process_start_time=11.0), True),
        (EngineMetrics(process_start_time=10.0), EngineMetrics(process_start_time=9.0), True),  # a clock set back
        (EngineMetrics(prefix_queries=100.0), EngineMetrics(prefix_queries=100.0), False),
        (EngineMetrics(prefix_queries=100.0), EngineMetrics(prefix_queries=150.0), False),
        (EngineMetrics(prefix_queries=100.0), EngineMetrics(prefix_queries=5.0), True),
        (EngineMetrics(ttft_count=30.0), EngineMetrics(ttft_count=2.0), True),
        (EngineMetrics(prefix_queries=100.0), EngineMetrics(), False),  # a figure gone is no restart
        (EngineMetrics(), EngineMetrics(prefix_queries=1.0, process_start_time=3.0), False),
        # The start time says it stayed up: a counter that fell is still a restart (a rank of the server restarted)
        (EngineMetrics(prefix_queries=9.0, process_start_time=1.0),
         EngineMetrics(prefix_queries=1.0, process_start_time=1.0), True),
    ],
)  # fmt: skip
def test_restarted_since_is_a_new_start_time_or_a_counter_that_went_back(
    before: EngineMetrics, after: EngineMetrics, restarted: bool
) -> None:
    assert after.restarted_since(before) is restarted


def test_restarted_since_takes_only_engine_metrics() -> None:
    with pytest.raises(InvalidTypeError, match="earlier must be an EngineMetrics, not dict"):
        EngineMetrics().restarted_since({})  # type: ignore[arg-type]


def test_a_fake_engine_restart_is_one_and_its_work_is_none() -> None:
    with FakeVLLM(num_blocks=64) as engine:
        first = parse_metrics(engine.metrics_text())
        engine.complete(PROMPT)
        busy = parse_metrics(engine.metrics_text())
        engine.restart()
        restarted = parse_metrics(engine.metrics_text())
    assert not busy.restarted_since(first) and restarted.restarted_since(busy)
    started, later = first.process_start_time, restarted.process_start_time
    assert started is not None and later is not None
    assert busy.process_start_time == started < later


def predicted_blocks(router: Router, backend: str) -> int:
    return router.index.blocks(backend)


def test_without_events_a_restart_clears_the_backends_predicted_blocks_once() -> None:
    router = Router(block_size=16)
    with FakeVLLM(num_blocks=64) as engine, Fleet(router, interval=0.02, timeout=1.0, stale_after=3.0) as fleet:
        fleet.add_backend("gpu0", metrics_url=engine.url)
        router.route(PROMPT, ["gpu0"])
        engine.complete(PROMPT)  # the engine computes it: its counters grow, no restart
        wait_until(lambda: fleet.stats()["gpu0"].scrapes >= 5, what="scrapes of a live engine")
        assert predicted_blocks(router, "gpu0") == 6 and fleet.stats()["gpu0"].engine_restarts == 0
        engine.restart()
        wait_until(lambda: fleet.stats()["gpu0"].engine_restarts == 1, what="the restart seen in /metrics")
        assert predicted_blocks(router, "gpu0") == 0
        assert router.decide(PROMPT, ["gpu0"]).candidates[0].matched_tokens == 0
        again = router.route(PROMPT, ["gpu0"])  # the router predicts anew, and a later scrape keeps that
        scrapes = fleet.stats()["gpu0"].scrapes
        wait_until(lambda: fleet.stats()["gpu0"].scrapes >= scrapes + 3, what="more scrapes")
        assert predicted_blocks(router, "gpu0") == 6 and fleet.stats()["gpu0"].engine_restarts == 1
        assert again.matched_tokens == 0
    router._check()


def test_a_counter_that_went_back_is_a_restart_where_no_start_time_is_exported() -> None:
    router = Router(block_size=16)
    with FakeVLLM(num_blocks=64) as engine, Fleet(router, interval=0.02, timeout=1.0, stale_after=3.0) as fleet:
        engine.set_metrics_fault(text=metrics_text(queries=500, ttft=40))
        fleet.add_backend("gpu0", metrics_url=engine.url)
        router.route(PROMPT, ["gpu0"])
        wait_until(lambda: fleet.stats()["gpu0"].scrapes >= 3, what="scrapes")
        assert predicted_blocks(router, "gpu0") == 6
        engine.set_metrics_fault(text=metrics_text(queries=96, ttft=1))
        wait_until(lambda: fleet.stats()["gpu0"].engine_restarts == 1, what="the counter reset seen")
        assert predicted_blocks(router, "gpu0") == 0


def test_with_events_a_restart_the_sequence_numbers_hid_is_caught_by_metrics_and_replayed() -> None:
    """The subscriber misses the new engine's first batches, so its numbers look like a gap, not a restart (see
    test_reset_forgets_the_sequence_...): the poller sees the new process and resets it, and the index ends up
    exactly what the new engine holds."""
    router = events_router()
    registry = CollectorRegistry()
    with FakeVLLM(num_blocks=64) as engine, Fleet(router, interval=0.05, timeout=1.0, stale_after=3.0) as fleet:
        fleet.add_backend("gpu0", kv_events=engine.endpoint, replay=engine.replay_endpoint, metrics_url=engine.url)
        RouterMetrics(registry).watch_fleet(fleet)
        sub = fleet.subscriber("gpu0")
        assert sub is not None
        for _ in range(9):
            engine.complete(fresh())
        settle(engine, sub)
        old = engine.own_hashes()
        engine.restart()
        engine.drop_next(15)  # the new engine's batches 0-14 never reach the subscriber live
        for _ in range(15):
            engine.complete(fresh())
        engine.flush()
        wait_until(lambda: fleet.stats()["gpu0"].engine_restarts == 1, what="the restart seen in /metrics")
        engine.complete(fresh())
        settle(engine, sub)
        held = router.index.hashes("gpu0")
        assert held == engine.own_hashes() and not held & old
        assert sub.stats().tracker.orphan_blocks == 0
        # Exported: the subscriber saw no restart in its numbers (the poller's reset came first), the fleet did.
        assert registry.get_sample_value("prefixroute_engine_restarts_total", {"backend": "gpu0"}) == 1


def test_the_restarts_of_a_backend_without_events_are_exported() -> None:
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry)
    router = Router(block_size=16)
    with FakeVLLM(num_blocks=64) as engine, Fleet(router, interval=0.02, timeout=1.0, stale_after=3.0) as fleet:
        fleet.add_backend("gpu0", metrics_url=engine.url)
        fleet.add_backend("gpu1")  # no /metrics: nothing to tell a restart by, nothing exported
        metrics.watch_fleet(fleet)
        wait_until(lambda: fleet.stats()["gpu0"].scrapes >= 2, what="scrapes")
        assert registry.get_sample_value("prefixroute_engine_restarts_total", {"backend": "gpu0"}) == 0
        engine.restart()
        wait_until(lambda: fleet.stats()["gpu0"].engine_restarts == 1, what="the restart seen in /metrics")
        assert registry.get_sample_value("prefixroute_engine_restarts_total", {"backend": "gpu0"}) == 1
        assert registry.get_sample_value("prefixroute_engine_restarts_total", {"backend": "gpu1"}) is None


def test_with_events_a_restart_the_events_followed_first_is_replayed_at_once_when_metrics_reset_them() -> None:
    """Was: the events followed the new engine, then the poller's reset() dropped its blocks and nothing replayed
    them until the engine published again: an idle restarted engine's blocks were missing from the index (and once
    it published, ``batches`` counted the replayed ones a second time)."""
    router = events_router()
    with FakeVLLM(num_blocks=64) as engine, Fleet(router, interval=0.02, timeout=1.0, stale_after=3.0) as fleet:
        engine.set_metrics_fault(text=metrics_text(queries=1, started="100"))  # the restart hidden from /metrics
        fleet.add_backend("gpu0", kv_events=engine.endpoint, replay=engine.replay_endpoint, metrics_url=engine.url)
        sub = fleet.subscriber("gpu0")
        assert sub is not None
        settle(engine, sub)
        engine.restart()
        for _ in range(3):
            engine.complete(fresh())
        settle(engine, sub)  # the events saw the sequence go back and follow the new engine, which then goes quiet
        assert sub.stats().restarts == 1 and router.index.hashes("gpu0") == engine.own_hashes() != set()
        before = sub.stats()
        engine.set_metrics_fault(text=metrics_text(queries=1, started="200"))  # now /metrics shows the new process
        wait_until(lambda: fleet.stats()["gpu0"].engine_restarts == 1, what="the restart seen in /metrics")
        wait_until(
            lambda: sub.stats().replayed_batches - before.replayed_batches == before.last_seq + 1,
            what="the reset's replay of the new engine's batches, with the engine quiet",
        )
        assert router.index.hashes("gpu0") == engine.own_hashes() and sub.last_seq == before.last_seq
        after = sub.stats()
        assert (after.batches, after.events, after.failed_replays, after.restarts) == (
            before.batches, before.events, before.failed_replays, before.restarts,
        )  # fmt: skip
        router._check()
