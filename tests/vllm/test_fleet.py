"""Fleet: KV events and /metrics of real loopback engines driving a Router; removal, faults, health, options."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from prefixroute import BlockHasher, ConfigurationError, InvalidTypeError, LeastLoaded, Router
from prefixroute.testing import FakeVLLM
from prefixroute.vllm import BackendStats, EventIndex, Fleet, KVEventSubscriber, RankMerge
from prefixroute.vllm.fleet import _Gate

from ..conftest import FakeClock, returns, wait_until
from .conftest import SMALL_BODY, answer, events_router, fresh, http_server, settle

PROMPT = [random.Random(1).randrange(30_000) for _ in range(96)]  # 6 blocks


@pytest.fixture
def engine() -> Iterator[FakeVLLM]:
    with FakeVLLM(num_blocks=64) as fake:
        yield fake


def seen(router: Router, backend: str) -> tuple[int | None, float | None]:
    """(queue_len, kv_usage) the policy sees for ``backend``."""
    candidate = next(c for c in router.decide(PROMPT, [backend, "other"]).candidates if c.backend == backend)
    return candidate.queue_len, candidate.kv_usage


def finished(stats: BackendStats) -> int:
    """The scrapes of a backend that have ended, well or not."""
    return stats.scrapes + stats.failed_scrapes


def next_scrape(fleet: Fleet, backend: str) -> None:
    """Wait for a scrape of ``backend`` that ends after this call (well or not)."""
    before = finished(fleet.stats()[backend])
    wait_until(lambda: finished(fleet.stats()[backend]) > before, what=f"a scrape of {backend}")


def threads_of(backend: str) -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.endswith(f"[{backend}]")]


def test_metrics_feed_engine_load_capacity_and_health(engine: FakeVLLM) -> None:
    router = Router(policy=LeastLoaded())
    with Fleet(router, interval=0.05) as fleet:
        engine.set_load(running=2, waiting=3)
        fleet.add_backend("gpu0", metrics_url=engine.url)
        wait_until(lambda: router.index.capacity("gpu0") == 64, what="capacity from vllm:cache_config_info")
        wait_until(lambda: seen(router, "gpu0") == (3, 0.0), what="the engine's waiting queue in the candidates")
        assert router.route(PROMPT, ["gpu0", "gpu1"]).backend == "gpu1"  # 3 waiting there, none here
        assert fleet.healthy_backends() == ["gpu0"]
        assert fleet.healthy_backends(["gpu0", "gpu1"]) == ["gpu0", "gpu1"]  # gpu1 is not the fleet's: passes
        stats = fleet.stats()["gpu0"]
        assert stats.healthy and stats.scrapes >= 1 and stats.failed_scrapes == 0
        assert (stats.queue_len, stats.engine_block_size, stats.num_gpu_blocks) == (3, 16, 64)
        # Daemon threads: a fleet that is never closed does not keep the process from exiting.
        assert all(t.daemon for t in threading.enumerate() if t.name.endswith("[gpu0]"))
    assert seen(router, "gpu0") == (None, None)  # close() drops figures that would only go stale
    assert router.index.capacity("gpu0") == 64 and threads_of("gpu0") == []


def test_behind_a_gateway_without_first_tokens_the_polled_queue_takes_requests_out_of_prefill(
    engine: FakeVLLM,
) -> None:
    router = Router()
    done = router.route(PROMPT, ["gpu0"])
    router.start(done)
    router.finish(done)  # no first token: this gateway reports none
    requests = [router.route([i] * 40, ["gpu0"]) for i in range(1, 4)]
    for decision in requests:
        router.start(decision)

    def in_prefill() -> int:
        return router.decide(PROMPT, ["gpu0"]).candidates[0].in_prefill

    assert in_prefill() == 3
    with Fleet(router, interval=0.05) as fleet:
        engine.set_load(running=3, waiting=0)
        fleet.add_backend("gpu0", metrics_url=engine.url)
        # From the second scrape on, all but the newest started before the previous one are past their prefill.
        wait_until(lambda: in_prefill() == 1, what="the two older requests out of prefill")
        next_scrape(fleet, "gpu0")
        assert in_prefill() == 1  # the newest admitted stays: its prefill may be under way
    for decision in requests:
        router.finish(decision)
    router._check()


def test_an_event_index_gets_no_capacity_from_metrics(engine: FakeVLLM) -> None:
    router = events_router()
    with Fleet(router, interval=0.05) as fleet:
        fleet.add_backend("gpu0", kv_events=engine.endpoint, metrics_url=engine.url)
        wait_until(lambda: fleet.stats()["gpu0"].scrapes >= 2, what="two scrapes")
        assert router.index.capacity("gpu0") is None  # the events carry the evictions


def test_a_block_size_it_cannot_use_is_warned_about_once_not_guessed(caplog: pytest.LogCaptureFixture) -> None:
    with FakeVLLM(block_size=24, num_blocks=32) as odd, Fleet(Router(block_size=16), interval=0.02) as fleet:
        fleet.add_backend("gpu0", metrics_url=odd.url)
        wait_until(lambda: "block_size is 24" in caplog.text, what="a warning about vLLM's block size")
        wait_until(lambda: fleet.stats()["gpu0"].scrapes >= 5, what="more scrapes of the same cache config")
        assert fleet.router.index.capacity("gpu0") is None
    warnings = [r.getMessage() for r in caplog.records if "block_size is 24" in r.getMessage()]
    assert warnings == [  # once per config, naming the engine and saying what to fix
        "gpu0: vLLM block_size is 24 but the router uses 16: prefix matches will be wrong; set Router(block_size=24) "
        "or vLLM's --block-size"
    ]


def test_remove_backend_stops_its_subscriber_and_poller_and_nothing_is_written_back(engine: FakeVLLM) -> None:
    router = events_router(policy=LeastLoaded())
    with Fleet(router, interval=0.02) as fleet:
        fleet.add_backend("gpu0", kv_events=engine.endpoint, replay=engine.replay_endpoint, metrics_url=engine.url)
        subscriber = fleet.subscriber("gpu0")
        assert subscriber is not None
        engine.set_load(waiting=5)
        engine.complete(PROMPT)
        settle(engine, subscriber)
        wait_until(lambda: seen(router, "gpu0")[0] == 5, what="the first figures")
        assert router.index.blocks("gpu0") > 0 and len(threads_of("gpu0")) == 2
        fleet.remove_backend("gpu0")
        assert not subscriber.running and threads_of("gpu0") == []
        assert seen(router, "gpu0") == (None, None) and router.index.blocks("gpu0") == 0
        engine.set_load(waiting=9)
        for _ in range(5):  # events and figures keep coming from the engine: none may reach the router
            engine.complete(fresh())
        time.sleep(0.3)  # fifteen poll intervals
        assert seen(router, "gpu0") == (None, None) and router.index.blocks("gpu0") == 0
        assert fleet.backends() == [] and fleet.healthy_backends() == []
        fleet.add_backend("gpu0", metrics_url=engine.url)  # and it can come back
        wait_until(lambda: seen(router, "gpu0")[0] == 9, what="figures after re-adding")


def test_remove_backend_forgets_the_capacity_the_fleet_learned_and_keeps_one_given(engine: FakeVLLM) -> None:
    """Was: the capacity a poller set from num_gpu_blocks outlived the backend: with pods that come and go, one
    entry a pod for good, and a later engine under the same id inherited it."""
    router = Router(capacity_blocks={"given": 50})
    with Fleet(router, interval=0.02) as fleet:
        fleet.add_backend("gpu0", metrics_url=engine.url)
        fleet.add_backend("given")
        wait_until(lambda: router.index.capacity("gpu0") == 64, what="the capacity from the engine's metrics")
        fleet.remove_backend("gpu0")
        fleet.remove_backend("given")
        assert router.index.capacity("gpu0") is None  # learned from the engine: gone with it
        assert router.index.capacity("given") == 50  # given to the router: a setting, it stays


def test_remove_backend_waits_for_a_stuck_poller_at_most_about_timeout(engine: FakeVLLM) -> None:
    entered, release = threading.Event(), threading.Event()

    def stuck(backend: str, healthy: bool) -> None:
        entered.set()
        release.wait()

    fleet = Fleet(Router(), interval=0.02, timeout=0.2, stale_after=1.0, on_health=stuck)
    try:
        fleet.add_backend("gpu0", metrics_url=engine.url)
        wait_until(entered.is_set, what="the poller in on_health")
        returns(lambda: fleet.remove_backend("gpu0"), what="remove_backend() with its poller stuck in on_health")
        assert fleet.backends() == []
    finally:
        release.set()
        fleet.close()


def test_a_backend_cannot_be_added_again_until_its_removal_returns(engine: FakeVLLM) -> None:
    """Was: remove_backend() took the backend out of the fleet, stopped its threads, then removed it from the router;
    an add_backend() of the same id in between was taken, and the router's removal wiped the blocks its events had
    just written (the subscriber held them, the index had none, and nothing wrote them back)."""
    entered, release = threading.Event(), threading.Event()

    class SlowRemoval(Router):
        def remove_backend(self, backend: str) -> None:
            entered.set()
            release.wait()
            super().remove_backend(backend)

    router = SlowRemoval(block_size=16, index=EventIndex(16))
    with Fleet(router) as fleet:
        fleet.add_backend("gpu0", kv_events=engine.endpoint, replay=engine.replay_endpoint)
        remover = threading.Thread(target=fleet.remove_backend, args=("gpu0",))
        remover.start()
        try:
            wait_until(entered.is_set, what="remove_backend() in the router's removal")
            with pytest.raises(ConfigurationError, match="'gpu0' is being removed from the fleet: add it again once"):
                fleet.add_backend("gpu0", kv_events=engine.endpoint, replay=engine.replay_endpoint)
        finally:
            release.set()
            remover.join()
        engine.complete(PROMPT)
        fleet.add_backend("gpu0", kv_events=engine.endpoint, replay=engine.replay_endpoint)  # free again
        wait_until(lambda: router.index.blocks("gpu0") > 0, what="the engine's blocks in the index")
        assert router.route(PROMPT, ["gpu0", "gpu1"]).backend == "gpu0"


def test_an_unknown_backend_is_still_removed_from_the_router() -> None:
    router = Router()
    router.route(PROMPT, ["gpu0"])
    with Fleet(router) as fleet:
        fleet.remove_backend("gpu0")
    assert router.index.blocks("gpu0") == 0


@contextmanager
def good_and_bad(router: Router, events: list[tuple[str, bool]]) -> Iterator[tuple[FakeVLLM, FakeVLLM, Fleet]]:
    """Engines "good" (1 waiting) and "bad" (2 waiting) polled every 20 ms, health changes appended to ``events``."""
    with (
        FakeVLLM() as good,
        FakeVLLM() as bad,
        Fleet(router, interval=0.02, on_health=lambda b, ok: events.append((b, ok))) as fleet,
    ):
        good.set_load(waiting=1)
        bad.set_load(waiting=2)
        fleet.add_backend("good", metrics_url=good.url)
        fleet.add_backend("bad", metrics_url=bad.url)
        yield good, bad, fleet


def test_nonsense_metrics_mark_only_that_engine_bad_and_polling_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    events: list[tuple[str, bool]] = []
    router = Router()
    with good_and_bad(router, events) as (good, bad, fleet):
        wait_until(lambda: len(fleet.healthy_backends()) == 2 and seen(router, "bad")[0] == 2, what="first figures")
        for nonsense in ("nan", "+Inf", "-4"):
            bad.set_metrics_fault(text=f'vllm:num_requests_waiting{{engine="0"}} {nonsense}\n')
            wait_until(lambda: fleet.healthy_backends() == ["good"], what=f"the bad engine marked bad ({nonsense})")
            assert seen(router, "bad") == (None, None) and seen(router, "good")[0] == 1
            bad.set_metrics_fault()
            wait_until(lambda: len(fleet.healthy_backends()) == 2, what="the bad engine back")
        bad.set_metrics_fault(text=good.metrics_text().replace('block_size="16"', 'block_size="0"'))
        wait_until(lambda: fleet.healthy_backends() == ["good"], what="a zero block size marked bad")
        stats = fleet.stats()
    assert stats["bad"].failed_scrapes >= 4 and "block_size" in (stats["bad"].last_error or "")
    assert stats["good"].failed_scrapes == 0
    assert ("bad", False) in events and events.count(("bad", True)) >= 3 and ("good", False) not in events
    assert "metrics of bad" in caplog.text


def test_a_slow_engine_never_makes_the_others_stale() -> None:
    router = Router()
    with FakeVLLM() as slow, FakeVLLM() as fast, Fleet(router, interval=0.05, timeout=0.5, stale_after=1.0) as fleet:
        slow.set_metrics_fault(trickle=0.05)
        fleet.add_backend("slow", metrics_url=slow.url)
        fleet.add_backend("fast", metrics_url=fast.url)
        assert fleet.healthy_backends() == ["slow", "fast"]  # nothing scraped yet: unknown counts as healthy
        wait_until(lambda: fleet.stats()["fast"].scrapes >= 5, what="the fast engine's scrapes")
        assert fleet.stats()["slow"].failed_scrapes == 0  # still waiting on its first answer
        wait_until(lambda: fleet.stats()["slow"].failed_scrapes >= 1, what="the slow engine's timeout")
        stats = fleet.stats()
        assert stats["slow"].scrapes == 0 and "within 0.5s" in (stats["slow"].last_error or "")
        assert stats["fast"].scrapes >= 8 and stats["fast"].failed_scrapes == 0  # not held up by the slow one
        assert fleet.healthy_backends() == ["fast"]
        # It waits for the scrape in flight, which only the fleet's timeout ends: the body trickles for minutes, so
        # the hang guard fails a remove that waits for the engine, whatever the machine's speed.
        returns(lambda: fleet.remove_backend("slow"), what="remove_backend() with a scrape in flight")


def test_unknown_is_healthy_until_the_stale_window_passes() -> None:
    clock = FakeClock()
    # No scrape ends during the test: the first one's answer comes after 5 s and it waits 2 s for it (a real 0.5 s
    # timeout could pass on a loaded machine before the asserts, and a failed scrape is rightly unhealthy). The
    # window is the default stale_after, 5 s (Fleet.__init__'s keyword default).
    with FakeVLLM() as engine, Fleet(Router(), interval=0.05, timeout=2.0, clock=clock) as fleet:
        engine.set_metrics_fault(delay=5.0)
        fleet.add_backend("gpu0", metrics_url=engine.url)
        fleet.add_backend("events-only")
        clock.tick(4.9)
        assert fleet.healthy_backends() == ["gpu0", "events-only"]
        clock.tick(0.2)
        assert fleet.healthy_backends() == ["events-only"]  # a backend without metrics is always healthy


def test_figures_older_than_stale_after_are_not_trusted() -> None:
    clock = FakeClock()
    with FakeVLLM() as engine, Fleet(Router(), interval=0.05, stale_after=5.0, clock=clock) as fleet:
        fleet.add_backend("gpu0", metrics_url=engine.url)
        wait_until(lambda: fleet.stats()["gpu0"].scrapes >= 1, what="a scrape")
        engine.stop()  # every later scrape fails
        wait_until(lambda: fleet.stats()["gpu0"].failed_scrapes >= 1, what="a failed scrape")
        assert fleet.healthy_backends() == []
        assert fleet.stats()["gpu0"].queue_len is None


def test_every_successful_scrape_renews_the_stale_window_and_on_health_hears_only_of_changes() -> None:
    clock = FakeClock()
    reports: list[tuple[str, bool]] = []

    def on_health(backend: str, healthy: bool) -> None:
        reports.append((backend, healthy))

    with (
        FakeVLLM() as engine,
        Fleet(Router(), interval=0.02, timeout=4.0, stale_after=5.0, clock=clock, on_health=on_health) as fleet,
    ):
        fleet.add_backend("gpu0", metrics_url=engine.url)
        for _ in range(3):  # 12 s after add_backend(), each scrape fresh
            clock.tick(4.0)
            next_scrape(fleet, "gpu0")
            assert fleet.healthy_backends() == ["gpu0"]
    assert reports == [("gpu0", True)]  # its first scrape, then no change


def test_figures_are_shown_while_the_latest_scrape_is_at_most_stale_after_old_then_dropped() -> None:
    body = b'vllm:num_requests_waiting{engine="0"} 3\nvllm:kv_cache_usage_perc{engine="0"} 0.25\n'
    clock = FakeClock()
    # One scrape: the next is 30 s away, so only the test moves the figures' age.
    with (
        http_server(lambda _: answer(body)) as (url, _),
        Fleet(Router(), interval=30.0, stale_after=60.0, clock=clock) as fleet,
    ):
        fleet.add_backend("gpu0", metrics_url=url)
        wait_until(lambda: fleet.stats()["gpu0"].scrapes >= 1, what="the first scrape")
        clock.tick(60.0)
        stats = fleet.stats()["gpu0"]
        assert stats.healthy and (stats.metrics_url, stats.queue_len, stats.kv_usage) == (url, 3, 0.25)
        clock.tick(0.5)
        stats = fleet.stats()["gpu0"]
        assert not stats.healthy and (stats.queue_len, stats.kv_usage) == (None, None)
        assert (stats.scrapes, stats.failed_scrapes, stats.last_error) == (1, 0, None)  # stale, not failed
        assert fleet.healthy_backends() == []
        time.sleep(0.3)  # many scrapes' time: still one, the poller waits for its interval
        assert fleet.stats()["gpu0"].scrapes == 1


def test_each_failed_scrape_is_counted_once_and_logged_with_why(caplog: pytest.LogCaptureFixture) -> None:
    reports: list[tuple[str, bool]] = []

    def on_health(backend: str, healthy: bool) -> None:
        reports.append((backend, healthy))

    with Fleet(Router(), interval=30.0, stale_after=60.0, on_health=on_health) as fleet:
        fleet.add_backend("gpu0", metrics_url="http://127.0.0.1:1")  # nothing listens: refused at once
        wait_until(lambda: bool(reports), what="the first scrape failing")  # reported after it is counted
        stats = fleet.stats()["gpu0"]
        assert (stats.healthy, stats.scrapes, stats.failed_scrapes) == (False, 0, 1)
        assert reports == [("gpu0", False)]
    assert stats.last_error and any(
        r.levelno == logging.WARNING and "gpu0" in r.getMessage() and stats.last_error in r.getMessage()
        for r in caplog.records
    )


def test_a_run_of_failed_scrapes_is_warned_about_once_and_again_after_a_recovery(
    engine: FakeVLLM, caplog: pytest.LogCaptureFixture
) -> None:
    """An engine down for minutes fails a scrape every interval: one warning per run of failures, not one a second
    (the later ones are logged at debug level)."""

    def warnings() -> int:
        return sum(r.levelno == logging.WARNING and "metrics of gpu0" in r.getMessage() for r in caplog.records)

    with Fleet(Router(), interval=0.02) as fleet:
        fleet.add_backend("gpu0", metrics_url=engine.url)
        for run in (1, 2):
            engine.set_metrics_fault(text='vllm:num_requests_waiting{engine="0"} nan\n')
            next_scrape(fleet, "gpu0")  # one may have been under way
            for _ in range(3):
                next_scrape(fleet, "gpu0")
            assert fleet.healthy_backends() == [] and warnings() == run
            engine.set_metrics_fault()
            wait_until(lambda: fleet.healthy_backends() == ["gpu0"], what="the engine back")


def test_a_backend_without_metrics_url_is_always_healthy_and_never_scraped() -> None:
    with Fleet(Router()) as fleet:
        fleet.add_backend("events-only")
        stats = fleet.stats()["events-only"]
        assert stats.healthy is True and (stats.metrics_url, stats.last_error) == (None, None)
        assert (stats.scrapes, stats.failed_scrapes, stats.queue_len) == (0, 0, None)


def test_a_fleet_iterates_over_its_backends_and_its_stats_name_a_backend_it_lacks() -> None:
    with Fleet(Router()) as fleet:
        assert repr(fleet) == "Fleet(backends=[], interval=1, timeout=2)"  # the documented defaults
        fleet.add_backend("gpu0")
        fleet.add_backend("gpu1")
        assert list(fleet) == ["gpu0", "gpu1"]
        with pytest.raises(KeyError) as missing:
            fleet.stats()["gpu9"]
        assert missing.value.args == ("gpu9",)


@pytest.mark.parametrize(
    ("waiting", "queue_len"),
    [("0", 0), (str(2**62), 2**62), (str(2**63), None), ("1e19", None)],
    ids=["idle", "2**62", "2**63", "1e19"],
)
def test_waiting_figures_reach_the_router_as_queue_lengths_or_as_unknown_past_what_it_takes(
    waiting: str, queue_len: int | None
) -> None:
    """An idle engine's 0 is known, not unknown; a finite figure past what set_engine_load() takes (2**63) is no
    error of the engine's: the scrape succeeds and the queue length is unknown."""
    body = f'vllm:num_requests_waiting{{engine="0"}} {waiting}\nvllm:kv_cache_usage_perc{{engine="0"}} 0.5\n'
    router = Router()
    with http_server(lambda _: answer(body.encode())) as (url, _), Fleet(router, interval=0.02) as fleet:
        fleet.add_backend("gpu0", metrics_url=url)
        wait_until(lambda: finished(fleet.stats()["gpu0"]) >= 2, what="two scrapes finished")
        stats = fleet.stats()["gpu0"]
        assert stats.healthy and stats.failed_scrapes == 0 and stats.queue_len == queue_len
        assert seen(router, "gpu0") == (queue_len, 0.5)


@pytest.mark.parametrize("label", ['block_size="16"', 'num_gpu_blocks="64"'])
def test_a_cache_config_missing_one_figure_sets_no_capacity_and_is_no_error(label: str) -> None:
    body = f"vllm:cache_config_info{{{label}}} 1\n".encode() + SMALL_BODY
    router = Router()
    with http_server(lambda _: answer(body)) as (url, _), Fleet(router, interval=0.02) as fleet:
        fleet.add_backend("gpu0", metrics_url=url)
        wait_until(lambda: finished(fleet.stats()["gpu0"]) >= 2, what="two scrapes finished")
        stats = fleet.stats()["gpu0"]
        assert stats.healthy and stats.failed_scrapes == 0 and stats.queue_len == 3
        assert router.index.capacity("gpu0") is None


@contextmanager
def following(engine: FakeVLLM) -> Iterator[tuple[Router, KVEventSubscriber]]:
    """A router whose Fleet follows ``engine``'s KV events (with replay) as "gpu0", one prompt settled in its index."""
    router = events_router()
    with Fleet(router) as fleet:
        fleet.add_backend("gpu0", kv_events=engine.endpoint, replay=engine.replay_endpoint)
        sub = fleet.subscriber("gpu0")
        assert sub is not None
        engine.complete(PROMPT)
        settle(engine, sub)
        yield router, sub


def test_events_are_hashed_in_the_namespace_route_uses_the_routers_or_the_one_given() -> None:
    """A router built for one model (its namespace) must find what its engines' events report; a backend added with
    ``namespace=`` (another model behind the same router) is found by requests naming that namespace."""
    router = events_router(namespace="llama")
    with FakeVLLM() as engine, FakeVLLM() as other, Fleet(router) as fleet:
        fleet.add_backend("default", kv_events=engine.endpoint, replay=engine.replay_endpoint)
        fleet.add_backend("given", kv_events=other.endpoint, replay=other.replay_endpoint, namespace="qwen")
        for backend, each in (("default", engine), ("given", other)):
            each.complete(PROMPT)
            sub = fleet.subscriber(backend)
            assert sub is not None
            settle(each, sub)
        llama, qwen = (set(BlockHasher(16, namespace=name).hash(PROMPT)) for name in ("llama", "qwen"))
        assert llama <= router.index.hashes("default") and not qwen & router.index.hashes("default")
        assert qwen <= router.index.hashes("given") and not llama & router.index.hashes("given")
        decision = router.route(PROMPT, ["given", "default"])
        assert (decision.backend, decision.matched_tokens) == ("default", 96)
        decision = router.route(PROMPT, ["default", "given"], namespace="qwen")
        assert (decision.backend, decision.matched_tokens) == ("given", 96)


def test_a_backend_follows_only_the_events_of_its_topic() -> None:
    router = events_router()
    with FakeVLLM(topic="kv@gpu0") as engine, Fleet(router) as fleet:
        fleet.add_backend("gpu0", kv_events=engine.endpoint, replay=engine.replay_endpoint, topic="kv@gpu0")
        fleet.add_backend("gpu1", kv_events=engine.endpoint, topic="kv@gpu1")  # a topic this publisher never sends
        sub, other = fleet.subscriber("gpu0"), fleet.subscriber("gpu1")
        assert sub is not None and other is not None and (sub.topic, other.topic) == ("kv@gpu0", "kv@gpu1")
        engine.complete(PROMPT)
        settle(engine, sub)
        assert set(BlockHasher(16).hash(PROMPT)) <= router.index.hashes("gpu0")
        assert router.index.blocks("gpu1") == 0 and other.stats().batches == 0


def test_garbage_kv_event_messages_cost_only_their_batch(engine: FakeVLLM) -> None:
    with following(engine) as (router, sub):
        before = sub.stats()
        stored = msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, list(range(16)), 16]]])
        for payload in (  # corrupt batches: each costs its own sequence number, as a real one would
            b"\xc1 not msgpack",
            stored[: len(stored) // 2],  # truncated
            msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, list(range(16)), 0]]]),  # block size 0
        ):
            engine.publish_payload(payload)
        for frames in (  # malformed messages: they take no sequence number
            [b"", engine.seq.to_bytes(8, "big")],  # a frame missing
            [b"", b"\x00\x01", stored],  # a 2-byte sequence number
            [b"", (-5).to_bytes(8, "big", signed=True), stored],  # negative
            [b"", (2**62).to_bytes(8, "big"), stored],  # absurd, and the next one does not continue it
        ):
            engine.publish_raw(frames)
        engine.complete(fresh())  # the real stream goes on
        settle(engine, sub)
        after = sub.stats()
        assert sub.running and after.restarts == before.restarts and after.gaps == before.gaps
        assert after.bad_sequences - before.bad_sequences == 2
        assert after.invalid_batches - before.invalid_batches == 4  # two payloads, two messages
        assert after.tracker.invalid_events - before.tracker.invalid_events == 1  # the zero block size
        assert router.index.hashes("gpu0") == engine.own_hashes()


def test_hostile_batches_cost_only_themselves_and_the_index_stays_consistent(engine: FakeVLLM) -> None:
    """Events naming unknown parents, removals of unknown hashes, a block size the router cannot use, extra
    frames, a sequence going backwards once, and batches as the newest vLLM sends them (maps): each is counted, the
    thread lives, and the index equals the engine's true cache and passes its own consistency check."""
    with following(engine) as (router, sub):
        before = sub.stats()

        def stored(hashes: list[object], parent: object, block_size: int = 16) -> dict[str, object]:
            tokens = list(range(len(hashes) * block_size))
            return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
                    "block_size": block_size, "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0,
                    "kv_cache_spec_kind": "full_attention"}  # fmt: skip

        hostile = [
            stored([2**64 - 1, 5], 123456789),  # its parent was never stored: orphans
            {"type": "BlockRemoved", "block_hashes": [987654321, b"\x00" * 32], "medium": "GPU", "group_idx": 0},
            stored([77], None, block_size=8),  # vLLM block size 8, the router's 16: invalid
        ]
        for batch in ({"ts": time.time(), "events": hostile, "data_parallel_rank": 0}, [time.time(), hostile, 0]):
            engine.publish_payload(msgspec.msgpack.encode(batch))
        engine.publish_raw([b"", engine.seq.to_bytes(8, "big"), b"\x90", b"extra"])  # four frames on the PUB socket
        engine.publish_raw([b"", (engine.seq - 2).to_bytes(8, "big"), msgspec.msgpack.encode([1.0, []])])  # goes back
        engine.complete(fresh())
        settle(engine, sub)
        after = sub.stats()
        assert sub.running and after.restarts == before.restarts
        assert after.batches - before.batches >= 3 and after.invalid_batches - before.invalid_batches == 1
        assert after.bad_sequences - before.bad_sequences == 1
        tracker = after.tracker
        assert tracker.orphan_blocks - before.tracker.orphan_blocks == 4
        assert tracker.unknown_removals - before.tracker.unknown_removals == 4
        assert tracker.invalid_events - before.tracker.invalid_events == 2
        assert router.index.hashes("gpu0") == engine.own_hashes()
        router.index._check()


def test_a_jump_that_the_next_message_continues_is_believed(engine: FakeVLLM) -> None:
    router = events_router()
    with Fleet(router) as fleet:
        fleet.add_backend("gpu0", kv_events=engine.endpoint)  # no replay: the jump is an unrecovered gap
        sub = fleet.subscriber("gpu0")
        assert sub is not None
        settle(engine, sub)
        far = engine.seq + 10**9
        for seq in (far, far + 1):
            engine.publish_raw([b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode([1.0, []])])
        wait_until(lambda: sub.last_seq == far + 1, what="the jump believed")
        assert sub.stats().bad_sequences == 0 and sub.stats().unrecovered_gaps >= 1


def test_a_repeat_of_the_last_sequence_number_is_skipped_not_taken_for_a_restart(engine: FakeVLLM) -> None:
    with following(engine) as (router, sub):
        before = sub.stats()
        held = router.index.hashes("gpu0")
        engine.publish_raw([b"", (engine.seq - 1).to_bytes(8, "big"), msgspec.msgpack.encode([1.0, []])])
        engine.complete(fresh())  # the next number continues the repeated one: still no restart
        settle(engine, sub)
        after = sub.stats()
        assert (after.restarts, after.bad_sequences - before.bad_sequences) == (before.restarts, 1)
        assert held <= router.index.hashes("gpu0") == engine.own_hashes()


def test_reset_forgets_the_sequence_so_a_restart_whose_first_batches_were_missed_is_replayed(
    engine: FakeVLLM,
) -> None:
    with following(engine) as (router, sub):
        for _ in range(9):
            engine.complete(fresh())
        settle(engine, sub)
        engine.restart()  # numbers from 0 again; the subscriber misses them, so it cannot see the restart itself
        engine.drop_next(15)
        for _ in range(15):
            engine.complete(fresh())
        engine.flush()
        sub.reset()  # a health check saw the restart
        engine.complete(fresh())
        settle(engine, sub)
        assert router.index.hashes("gpu0") == engine.own_hashes() and sub.stats().tracker.orphan_blocks == 0


def test_a_replay_far_ahead_is_believed_only_when_it_continues() -> None:
    router = events_router()
    sub = KVEventSubscriber(router, "gpu0", "tcp://127.0.0.1:1", replay_endpoint="tcp://127.0.0.1:2")
    empty = msgspec.msgpack.encode([1.0, []])
    context = zmq.Context()
    try:
        sub._handle([[b"", seq.to_bytes(8, "big"), empty] for seq in range(5)], context)
        far = 2**62
        sub._replay = lambda *_: [(far, empty)]  # type: ignore[method-assign]  # an endpoint answering nonsense
        sub._catch_up(context)
        assert (sub.last_seq, sub.stats().bad_sequences) == (4, 1)
        sub._replay = lambda *_: [(far, empty), (far + 1, empty)]  # type: ignore[method-assign]
        sub._catch_up(context)
        assert (sub.last_seq, sub.stats().bad_sequences) == (far + 1, 1)
    finally:
        context.destroy(linger=0)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"interval": 0}, "interval"),
        ({"interval": float("nan")}, "interval"),
        ({"timeout": float("inf")}, "timeout"),
        ({"timeout": -1}, "timeout"),
        ({"stale_after": "5"}, "stale_after"),
        (
            {"stale_after": 1.0, "interval": 2.0},
            r"^stale_after \(1.0\) must be longer than interval \(2.0\) and timeout \(2.0\): otherwise every "
            r"engine's figures turn stale between two scrapes$",
        ),
        ({"stale_after": 1.0, "timeout": 1.0, "interval": 0.5}, "longer than interval"),
    ],
)
def test_nonsense_options_are_rejected_when_given(options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        Fleet(Router(), **options)  # type: ignore[arg-type]


def test_bad_backends_and_endpoints_are_clear_errors() -> None:
    with Fleet(Router()) as fleet:
        with pytest.raises(
            ConfigurationError,
            match=r"^kv_events needs a router that reads the events: build it with "
            r"Router\(index=prefixroute\.vllm\.EventIndex\(block_size\)\), not a prediction index$",
        ):
            fleet.add_backend("gpu0", kv_events="tcp://127.0.0.1:1")
        with pytest.raises(ConfigurationError, match="http"):
            fleet.add_backend("gpu0", metrics_url="gpu0:8000")
        # Was taken: httpx connects to a port past 65535 modulo 65536, another engine's, whose figures it then fed
        with pytest.raises(ConfigurationError, match="^metrics_url 'http://gpu0:99999' is not a URL that can be reac"):
            fleet.add_backend("gpu0", metrics_url="http://gpu0:99999")
        fleet.add_backend("upper", metrics_url="HTTP://127.0.0.1:1")  # a scheme in any case, as URLs allow
        fleet.remove_backend("upper")
        fleet.add_backend("tls", metrics_url="https://127.0.0.1:1")  # an engine behind TLS is polled too
        assert fleet.stats()["tls"].metrics_url == "https://127.0.0.1:1/metrics"
        fleet.remove_backend("tls")
        with pytest.raises(
            ConfigurationError,
            match=r"^replay='tcp://127.0.0.1:2' without kv_events: pass the engine's publisher endpoint too$",
        ):
            fleet.add_backend("gpu0", replay="tcp://127.0.0.1:2")
        with pytest.raises(TypeError, match="^backend must be a str id, not int$"):
            fleet.add_backend(7)  # type: ignore[arg-type]
        fleet.add_backend("gpu0")
        with pytest.raises(ConfigurationError, match="already in the fleet"):
            fleet.add_backend("gpu0")
    with pytest.raises(ConfigurationError, match="^this Fleet is closed: make a new one$"):
        fleet.add_backend("gpu1")
    with Fleet(Router(index=EventIndex(16))) as fleet, pytest.raises(ConfigurationError, match="ZMQ address"):
        fleet.add_backend("gpu0", kv_events="gpu0:5557")
    with pytest.raises(TypeError, match="^router must be a prefixroute.Router, not object$"):
        Fleet(object())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("first", "second", "taken"),
    [
        ({"kv_events": "tcp://127.0.0.1:5557"}, {"kv_events": "tcp://127.0.0.1:5557"}, "tcp://127.0.0.1:5557"),
        # a publisher given as another backend's replay endpoint, and a replay endpoint given twice
        ({"kv_events": "tcp://127.0.0.1:5557", "replay": "tcp://127.0.0.1:5558"},
         {"kv_events": "tcp://127.0.0.1:5558"}, "tcp://127.0.0.1:5558"),
        ({"kv_events": "tcp://127.0.0.1:5557", "replay": "tcp://127.0.0.1:5558"},
         {"kv_events": "tcp://127.0.0.1:6557", "replay": "tcp://127.0.0.1:5558"}, "tcp://127.0.0.1:5558"),
        # one data-parallel rank's endpoint (port + rank) that another backend follows
        ({"kv_events": "tcp://127.0.0.1:5558"}, {"kv_events": "tcp://127.0.0.1:5557", "data_parallel_size": 2},
         "tcp://127.0.0.1:5558"),
        # one publisher under topics that overlap (ZMQ matches a prefix: "kv@gpu0" takes "kv@gpu01"'s messages too)
        ({"kv_events": "tcp://127.0.0.1:5557", "topic": "kv@gpu0"},
         {"kv_events": "tcp://127.0.0.1:5557", "topic": "kv@gpu01"}, "tcp://127.0.0.1:5557"),
        ({"kv_events": "tcp://127.0.0.1:5557", "topic": "kv@gpu0"}, {"kv_events": "tcp://127.0.0.1:5557"},
         "tcp://127.0.0.1:5557"),
    ],
)  # fmt: skip
def test_an_endpoint_another_backend_follows_is_refused(
    first: dict[str, Any], second: dict[str, Any], taken: str
) -> None:
    """Was accepted: both backends were then credited with one engine's blocks (a copied config line)."""
    with Fleet(events_router()) as fleet:
        fleet.add_backend("gpu0", **first)
        with pytest.raises(ConfigurationError) as refused:
            fleet.add_backend("gpu1", **second)
        assert str(refused.value) == (
            f"endpoint {taken!r} is already backend 'gpu0''s: each engine publishes its events (and replays them) on "
            "addresses of its own, or under a topic of its own"
        )
        assert fleet.backends() == ["gpu0"]
        fleet.remove_backend("gpu0")
        fleet.add_backend("gpu1", **second)  # free again once its backend is gone


def test_one_publisher_may_carry_several_engines_under_topics_of_their_own() -> None:
    # A ZMQ proxy in front of several engines: each backend follows its own topic there (llm-d's "kv@<pod>@<model>").
    with Fleet(events_router()) as fleet:
        fleet.add_backend("gpu0", kv_events="tcp://127.0.0.1:5557", topic="kv@gpu0@")
        fleet.add_backend("gpu1", kv_events="tcp://127.0.0.1:5557", topic="kv@gpu1@")
        assert fleet.backends() == ["gpu0", "gpu1"]


def test_a_refused_add_closes_the_http_client_it_made(monkeypatch: pytest.MonkeyPatch) -> None:
    clients: list[httpx.Client] = []

    class Recorded(httpx.Client):
        def __init__(self, **options: Any) -> None:
            super().__init__(**options)
            clients.append(self)

    monkeypatch.setattr("prefixroute.vllm.fleet.httpx.Client", Recorded)
    with Fleet(Router()) as fleet:
        fleet.add_backend("gpu0")
        with pytest.raises(ConfigurationError, match="already in the fleet"):
            fleet.add_backend("gpu0", metrics_url="http://127.0.0.1:1")
    with pytest.raises(ConfigurationError, match="closed"):
        fleet.add_backend("gpu1", metrics_url="http://127.0.0.1:1")
    assert len(clients) == 2
    assert all(client.is_closed for client in clients)


def test_a_failing_health_callback_is_counted_and_polling_goes_on(
    engine: FakeVLLM, caplog: pytest.LogCaptureFixture
) -> None:
    def explode(backend: str, healthy: bool) -> None:
        raise RuntimeError("callback bug")

    caplog.set_level(logging.ERROR)
    with Fleet(Router(), interval=0.02, on_health=explode) as fleet:
        fleet.add_backend("gpu0", metrics_url=engine.url)
        fleet.add_backend("gpu1", metrics_url=engine.url)
        wait_until(lambda: fleet.stats().callback_errors >= 2, what="each backend's first health report counted")
        wait_until(lambda: all(b.scrapes >= 3 for b in fleet.stats().backends), what="polling going on")
        assert fleet.stats().callback_errors == 2  # each call that raised counted once: no change since
    assert "callback bug" in caplog.text
    logged = [r.getMessage() for r in caplog.records if r.exc_info]
    assert any("on_health" in m and "'gpu0'" in m and "True" in m for m in logged)  # which call raised


def test_waiting_figures_summing_to_infinity_mark_only_that_engine_bad_and_stats_still_work() -> None:
    router = Router()
    overflow = (
        'vllm:num_requests_waiting{model_name="m"} 1e308\n'
        'vllm:num_requests_waiting{model_name="n"} 1e308\n'
        'vllm:kv_cache_usage_perc{model_name="m"} 0.5\n'
    )  # each sample is finite, their sum is not
    with FakeVLLM() as good, FakeVLLM() as bad, Fleet(router, interval=0.02) as fleet:
        good.set_load(waiting=1)
        bad.set_metrics_fault(text=overflow)
        fleet.add_backend("good", metrics_url=good.url)
        fleet.add_backend("bad", metrics_url=bad.url)
        wait_until(lambda: fleet.stats()["bad"].failed_scrapes >= 2, what="the overflowing engine's failures")
        stats = fleet.stats()  # never raises for one engine's figures
        assert "sums to inf" in (stats["bad"].last_error or "") and not stats["bad"].healthy
        assert stats["bad"].queue_len is None and stats["bad"].scrapes == 0
        assert stats["good"].healthy and stats["good"].queue_len == 1 and stats["good"].failed_scrapes == 0
        assert fleet.healthy_backends() == ["good"]
        assert seen(router, "bad") == (None, None)


class RefusingRouter(Router):
    """A router that refuses the engine figures of one backend (as a bug in the write path would)."""

    def set_engine_load(self, backend: str, *, queue_len: int | None, kv_usage: float | None) -> None:
        if backend == "bad" and queue_len is not None:
            raise OverflowError("figures this router cannot take")
        super().set_engine_load(backend, queue_len=queue_len, kv_usage=kv_usage)


def test_an_unexpected_error_in_a_scrape_counts_as_a_failed_scrape_of_only_that_backend(
    caplog: pytest.LogCaptureFixture,
) -> None:
    events: list[tuple[str, bool]] = []
    router = RefusingRouter()
    with good_and_bad(router, events) as (good, bad, fleet):
        wait_until(lambda: fleet.stats()["bad"].failed_scrapes >= 3, what="the unexpected errors counted")
        stats = fleet.stats()
        assert (stats["bad"].last_error or "").startswith("unexpected OverflowError")
        assert not stats["bad"].healthy and stats["bad"].scrapes == 0 and stats["bad"].queue_len is None
        assert stats["good"].healthy and stats["good"].failed_scrapes == 0 and stats["good"].scrapes >= 1
        assert fleet.healthy_backends() == ["good"]
        assert ("bad", False) in events and ("bad", True) not in events  # no flapping between scrapes
    assert "metrics of bad: unexpected error" in caplog.text
    unexpected = [r for r in caplog.records if "unexpected" in r.getMessage()]
    assert unexpected and all(r.exc_info for r in unexpected)  # logged once, with its traceback


class BrokenRouter(Router):
    """A router whose set_engine_load() raises while ``broken``, even to forget figures."""

    broken = True

    def set_engine_load(self, backend: str, *, queue_len: int | None, kv_usage: float | None) -> None:
        if self.broken:
            raise RuntimeError("the router cannot take engine figures")
        super().set_engine_load(backend, queue_len=queue_len, kv_usage=kv_usage)


def test_a_router_that_cannot_even_forget_figures_never_stops_the_poller(
    engine: FakeVLLM, caplog: pytest.LogCaptureFixture
) -> None:
    """Was: when the router also refused to forget the figures, the failed scrape was not counted at all: the
    backend read healthy, without an error, until it went stale."""
    router = BrokenRouter()
    with Fleet(router, interval=0.02, stale_after=3600.0) as fleet:
        fleet.add_backend("gpu0", metrics_url=engine.url)
        wait_until(
            lambda: caplog.text.count("metrics of gpu0: the router could not drop the engine figures") >= 2,
            what="the poller going on after the router refused twice",
        )
        stats = fleet.stats()["gpu0"]
        assert not stats.healthy and stats.failed_scrapes >= 2 and stats.scrapes == 0
        assert (stats.last_error or "").startswith("unexpected RuntimeError: the router cannot take engine figures")
        assert fleet.healthy_backends() == []
        assert [t for t in threads_of("gpu0") if t.startswith("prefixroute-metrics")]
        router.broken = False  # so that close() can drop the figures


def test_close_stops_every_backend_even_when_the_router_refuses_to_drop_figures(engine: FakeVLLM) -> None:
    """Was: close() dropped each backend's figures right after stopping it, so a router that raised there left the
    subscribers of the backends after the first running, out of the fleet, where nothing could stop them."""
    fleet = Fleet(BrokenRouter(index=EventIndex(16)), interval=0.02)
    with FakeVLLM() as other:
        for backend, each in (("gpu0", engine), ("gpu1", other)):
            fleet.add_backend(backend, kv_events=each.endpoint, metrics_url=each.url)
        with pytest.raises(RuntimeError, match="cannot take engine figures"):
            fleet.close()
    assert threads_of("gpu0") == [] and threads_of("gpu1") == [] and fleet.backends() == []


class CapacityOnceRefused(Router):
    """A router whose first set_capacity() raises (as a bug in an index subclass's eviction hook would)."""

    def __init__(self) -> None:
        super().__init__()
        self.refusals = 0

    def set_capacity(self, backend: str, capacity_blocks: int | None) -> None:
        if not self.refusals:
            self.refusals += 1
            raise RuntimeError("the index could not evict just now")
        super().set_capacity(backend, capacity_blocks)


def test_a_cache_config_the_router_failed_to_take_is_applied_at_a_later_scrape(
    engine: FakeVLLM, caplog: pytest.LogCaptureFixture
) -> None:
    """Was: the poller noted the engine's cache config as acted on before set_capacity() ran, so after that call
    raised once the unchanged config was never applied again: the backend kept no capacity for good."""
    router = CapacityOnceRefused()
    with Fleet(router, interval=0.02) as fleet:
        fleet.add_backend("gpu0", metrics_url=engine.url)
        wait_until(lambda: router.index.capacity("gpu0") == 64, what="the capacity applied at a later scrape")
        stats = fleet.stats()["gpu0"]
        assert router.refusals == 1 and stats.failed_scrapes >= 1 and stats.scrapes >= 1
        assert [t for t in threads_of("gpu0") if t.startswith("prefixroute-metrics")]  # the poller goes on
    assert "metrics of gpu0: unexpected error" in caplog.text and "could not evict" in caplog.text


def test_each_scrape_connects_afresh_so_fetch_metrics_sees_every_socket_it_may_have_to_cut() -> None:
    """Was: the poller's client kept its connection alive between scrapes, and fetch_metrics sees a socket only as it
    is opened: an engine trickling its headers on a kept connection held the abandoned scrape's thread (and the
    connection) for as long as it trickled."""
    with http_server(lambda _: answer(SMALL_BODY)) as (url, accepted), Fleet(Router(), interval=0.02) as fleet:
        fleet.add_backend("gpu0", metrics_url=url)
        wait_until(lambda: fleet.stats()["gpu0"].scrapes >= 3, what="three scrapes")
        scrapes = fleet.stats()["gpu0"].scrapes
        assert len(accepted) >= scrapes  # one connection per scrape (accepted before the scrape counts)


def test_options_of_the_wrong_type_are_type_errors_when_given() -> None:
    with pytest.raises(TypeError, match=r"^on_health must be a callable \(backend, healthy\) or None, not int$"):
        Fleet(Router(), on_health=5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="^clock must be a callable returning seconds, not int$"):
        Fleet(Router(), clock=5)  # type: ignore[arg-type]
    # Read when given: was taken, and then failed every scrape and health check (stats() raised a bare TypeError).
    with pytest.raises(ConfigurationError, match="^clock returned None: it must return a finite number of seconds"):
        Fleet(Router(), clock=lambda: None)  # type: ignore[arg-type, return-value]
    with pytest.raises(ConfigurationError, match=r"^clock raised ZeroDivisionError \(division by zero\) when read"):
        Fleet(Router(), clock=lambda: 1 / 0)
    with Fleet(Router(index=EventIndex(16))) as fleet:
        for namespace in (5, ["model"]):
            with pytest.raises(TypeError, match="namespace"):
                fleet.add_backend("gpu0", kv_events="tcp://127.0.0.1:1", namespace=namespace)  # type: ignore[arg-type]
            with pytest.raises(TypeError, match="namespace"):
                fleet.add_backend("gpu0", namespace=namespace)  # type: ignore[arg-type]
        assert fleet.backends() == []
        fleet.add_backend("ab")
        for backends in ("ab", b"ab", 5):
            with pytest.raises(TypeError, match=f"iterable of str ids, not .*{type(backends).__name__}"):
                fleet.healthy_backends(backends)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="str ids, not int"):
            fleet.healthy_backends(["ab", 5])  # type: ignore[list-item]
        assert fleet.healthy_backends(["ab", "other"]) == ["ab", "other"]


@pytest.mark.parametrize("option", ["interval", "timeout", "stale_after"])
@pytest.mark.parametrize("value", [10**400, 10**5000, 1e300], ids=["10**400", "10**5000", "1e300"])
def test_a_huge_number_of_seconds_is_a_configuration_error_not_an_overflow(option: str, value: object) -> None:
    with pytest.raises(ConfigurationError, match=option):
        Fleet(Router(), **{option: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", [[], {}, None, 5])
def test_remove_backend_refuses_an_id_that_is_not_a_str_while_the_fleet_has_backends(backend: object) -> None:
    # Was a bare "unhashable type" TypeError from the fleet's own lookup once the fleet had a backend (an empty dict
    # answers pop() without hashing the key, so the fuzz harness's empty fleet never saw it).
    with Fleet(Router(index=EventIndex(16))) as fleet:
        fleet.add_backend("gpu0")
        for call in (fleet.remove_backend, fleet.subscribers, fleet.subscriber):
            with pytest.raises(InvalidTypeError, match=f"^backend must be a str id, not {type(backend).__name__}$"):
                call(backend)  # type: ignore[arg-type]
        assert fleet.backends() == ["gpu0"]


@pytest.mark.parametrize("race", ["remove_backend", "close"])
def test_a_backend_removed_or_closed_while_add_backend_starts_its_threads_leaves_none_running(
    race: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """add_backend() registers the backend, then starts its threads outside the fleet's lock: a remove_backend() or
    close() from another thread can land in between. Was: it found nothing started to stop, then the subscriber
    thread started anyway and ran for good, the backend no longer in the fleet."""
    fleet = Fleet(Router(index=EventIndex(16)), interval=0.05, timeout=0.05, stale_after=1.0)
    start = KVEventSubscriber.start

    def interleaved(self: KVEventSubscriber) -> KVEventSubscriber:  # the other thread's call, between the two steps
        getattr(fleet, race)(*(["gpu0"] if race == "remove_backend" else []))
        return start(self)

    monkeypatch.setattr(KVEventSubscriber, "start", interleaved)
    try:
        fleet.add_backend("gpu0", kv_events="tcp://127.0.0.1:1", metrics_url="http://127.0.0.1:1")
        assert fleet.backends() == []
        wait_until(lambda: not threads_of("gpu0"), what="no thread of the removed backend left running")
    finally:
        fleet.close()


def test_a_closed_gate_lets_no_write_through_and_waits_for_the_one_in_progress() -> None:
    router = Router(block_size=4)
    gate = _Gate(router)
    gate.write("gpu0", [(True, [11, 12], None)])
    assert router.index.match([11, 12], ["gpu0"])["gpu0"] == 2
    entered, release = threading.Event(), threading.Event()

    def slow_action(target: Router) -> None:  # a write the engine's thread is in the middle of
        entered.set()
        release.wait(5.0)
        target.store("gpu0", [21])

    writer = threading.Thread(target=gate.run, args=(slow_action,))
    writer.start()
    assert entered.wait(5.0)
    closer = threading.Thread(target=gate.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()  # close() waits for the write in progress
    release.set()
    writer.join(5.0)
    closer.join(5.0)
    assert not closer.is_alive() and router.index.match([21], ["gpu0"])["gpu0"] == 1
    called: list[Router] = []
    gate.write("gpu0", [(True, [31], None)])
    gate.run(called.append)
    assert router.index.match([31], ["gpu0"])["gpu0"] == 0 and called == []  # after close(): nothing goes through


class _OddHash(str):
    """A str subclass equal to its plain text but hashed apart from it."""

    def __hash__(self) -> int:
        return 42


def test_an_id_given_as_a_str_subclass_is_kept_as_the_plain_str_that_removes_it(engine: FakeVLLM) -> None:
    # Was kept as given: remove_backend("gpu0") hashed apart from it, found nothing, and the poller went on writing
    # the router the engine's figures after the removal returned.
    router = Router()
    with Fleet(router, interval=0.02) as fleet:
        engine.set_load(waiting=7)
        fleet.add_backend(_OddHash("gpu0"), metrics_url=engine.url)
        wait_until(lambda: seen(router, "gpu0")[0] == 7, what="the first figures")
        assert [type(b) for b in fleet.backends()] == [str]
        fleet.remove_backend("gpu0")
        assert fleet.backends() == [] and threads_of("gpu0") == []
        assert seen(router, "gpu0") == (None, None)


def test_an_empty_backend_id_is_refused_when_given_not_by_every_scrape_and_close() -> None:
    with Fleet(Router()) as fleet:
        for call in (fleet.add_backend, fleet.remove_backend, fleet.subscribers):
            with pytest.raises(ConfigurationError, match="^a backend id is an empty str: give each backend a non-em"):
                call("")
        assert fleet.backends() == []
    merge = RankMerge(Router(index=EventIndex(16)))
    with pytest.raises(ConfigurationError, match="empty str"):
        merge.write("", [(True, [1], None)])
    assert repr(merge) == "RankMerge(blocks={})"
