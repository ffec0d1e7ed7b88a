"""Router index sources (predictions, events, hybrid) and engine load, against a real FakeVLLM on loopback."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from prefixroute import ConfigurationError, LeastLoaded, Router
from prefixroute.testing import FakeVLLM

from .conftest import FakeClock, settle, wait_until

PROMPT = [random.Random(1).randrange(30_000) for _ in range(96)]  # 6 blocks


@pytest.fixture
def engine() -> Iterator[FakeVLLM]:
    with FakeVLLM(num_blocks=64) as fake:
        yield fake


def test_hybrid_trusts_a_fresh_prediction_until_events_confirm_it(engine: FakeVLLM) -> None:
    clock = FakeClock()
    router = Router(clock=clock, speculative_ttl=3.0)
    subscriber = router.subscribe("gpu0", engine.endpoint, replay_endpoint=engine.replay_endpoint)
    try:
        assert router.index_source == "hybrid"
        settle(engine, subscriber)
        first = router.route(PROMPT, ["gpu0"])
        again = router.route(PROMPT, ["gpu0"])
        assert (first.matched_tokens, first.confirmed_tokens) == (0, 0)
        assert (again.matched_tokens, again.confirmed_tokens) == (96, 0)  # predicted, not yet confirmed
        engine.complete(PROMPT)
        settle(engine, subscriber)
        clock.tick(10.0)  # the speculative entry is long gone: the events alone say 96
        confirmed = router.route(PROMPT, ["gpu0"])
        assert (confirmed.matched_tokens, confirmed.confirmed_tokens) == (96, 96)
    finally:
        router.close()


def test_speculative_entries_expire_between_one_and_two_ttls() -> None:
    clock = FakeClock()
    router = Router(index_source="hybrid", clock=clock, speculative_ttl=2.0)
    router.route(PROMPT, ["gpu0"])
    clock.tick(1.0)
    assert router.route(PROMPT, ["gpu0"]).matched_tokens == 96
    clock.tick(4.1)  # nothing refreshed it for more than two TTLs
    decision = router.route(PROMPT, ["gpu0"])
    assert (decision.matched_tokens, decision.confirmed_tokens) == (0, 0)
    assert len(router.index) == 0  # hybrid never writes predictions into the confirmed index


def test_an_eviction_event_overrides_the_speculative_entry() -> None:
    small = FakeVLLM(num_blocks=8).start()
    router = Router(clock=FakeClock())
    subscriber = router.subscribe("gpu0", small.endpoint, replay_endpoint=small.replay_endpoint)
    try:
        settle(small, subscriber)
        decision = router.route(PROMPT, ["gpu0"])
        small.complete(PROMPT)  # stored: 6 blocks
        for stem in range(3):  # other prompts fill the 8-block cache and evict PROMPT's blocks
            small.complete([random.Random(stem + 10).randrange(30_000) for _ in range(64)])
        settle(small, subscriber)
        after = router.route(PROMPT, ["gpu0"])
        assert decision.backend == "gpu0"
        assert after.confirmed_tokens == 0
        assert after.matched_tokens < 96  # the removal took the speculative blocks with it
        assert small.complete(PROMPT).cached_tokens == after.matched_tokens
    finally:
        router.close()
        small.stop()


def test_events_mode_never_records_predictions(engine: FakeVLLM) -> None:
    router = Router(index_source="events")
    subscriber = router.subscribe("gpu0", engine.endpoint, replay_endpoint=engine.replay_endpoint)
    try:
        settle(engine, subscriber)
        router.route(PROMPT, ["gpu0"])
        assert router.route(PROMPT, ["gpu0"]).matched_tokens == 0
        engine.complete(PROMPT)
        settle(engine, subscriber)
        decision = router.route(PROMPT, ["gpu0"])
        assert (decision.matched_tokens, decision.confirmed_tokens) == (96, 96)
        assert router.index.hashes("gpu0") == engine.own_hashes()
    finally:
        router.close()


def test_remove_backend_stops_its_subscriber(engine: FakeVLLM) -> None:
    router = Router()
    subscriber = router.subscribe("gpu0", engine.endpoint, replay_endpoint=engine.replay_endpoint)
    with pytest.raises(ValueError, match="already has"):
        router.subscribe("gpu0", engine.endpoint)
    router.remove_backend("gpu0")
    assert not subscriber.running
    router.close()


def test_predictions_mode_reports_no_confirmation() -> None:
    decision = Router().route(PROMPT, ["gpu0"])
    assert decision.confirmed_tokens is None


def test_engine_load_reaches_the_policy() -> None:
    router = Router(policy=LeastLoaded())
    router.set_engine_load("gpu0", queue_len=7, kv_usage=0.5)
    decision = router.route(PROMPT, ["gpu0", "gpu1"])
    seen = {c.backend: (c.queue_len, c.kv_usage) for c in decision.candidates}
    assert seen == {"gpu0": (7, 0.5), "gpu1": (None, None)}
    assert decision.backend == "gpu1"
    router.set_engine_load("gpu0", queue_len=None, kv_usage=None)  # stale: forget it
    assert all(c.queue_len is None for c in router.route(PROMPT, ["gpu0"]).candidates)


@pytest.mark.parametrize(
    ("option", "value"), [("index_source", "exact"), ("speculative_ttl", 0), ("speculative_ttl", "3")]
)
def test_bad_source_options_are_configuration_errors(option: str, value: object) -> None:
    with pytest.raises(ConfigurationError, match=option):
        Router(**{option: value})  # type: ignore[arg-type]


def test_subscribe_hashes_with_the_routers_namespace(engine: FakeVLLM) -> None:
    router = Router(namespace="llama", index_source="events")
    subscriber = router.subscribe("gpu0", engine.endpoint, replay_endpoint=engine.replay_endpoint)
    try:
        engine.complete(PROMPT)
        settle(engine, subscriber)
        assert router.route(PROMPT, ["gpu0"]).matched_tokens == 96
        assert router.route(PROMPT, ["gpu0"], namespace="other-model").matched_tokens == 0
    finally:
        router.close()


def test_watch_metrics_feeds_engine_load_and_capacity(engine: FakeVLLM) -> None:
    router = Router(policy=LeastLoaded())
    poller = router.watch_metrics({"gpu0": engine.url}, interval=0.05)
    try:
        engine.set_load(running=2, waiting=3)
        wait_until(lambda: router.index.capacity("gpu0") == 64, what="capacity from vllm:cache_config_info")

        def seen() -> int | None:
            return next(c.queue_len for c in router.route(PROMPT, ["gpu0", "gpu1"]).candidates if c.backend == "gpu0")

        wait_until(lambda: seen() == 3, what="the engine's waiting queue in the candidates")
        assert router.route(PROMPT, ["gpu0", "gpu1"]).backend == "gpu1"  # 3 waiting there, none here
        assert poller.healthy_backends(["gpu0", "gpu1"]) == ["gpu0", "gpu1"]
    finally:
        router.close()
    assert router.index.capacity("gpu0") == 64


def test_watch_metrics_warns_about_a_block_size_it_cannot_use(caplog: pytest.LogCaptureFixture) -> None:
    with FakeVLLM(block_size=24, num_blocks=32) as odd:
        router = Router(block_size=16)
        router.watch_metrics({"gpu0": odd.url}, interval=0.05)
        try:
            wait_until(lambda: "block_size is 24" in caplog.text, what="a warning about vLLM's block size")
        finally:
            router.close()
        assert router.index.capacity("gpu0") is None  # nothing guessed
