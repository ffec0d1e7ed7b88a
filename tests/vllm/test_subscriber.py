"""A real KVEventSubscriber against a FakeVLLM on loopback: the index converges to the engine's true cache."""

from __future__ import annotations

import contextlib
import json
import logging
import random
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable

import httpx
import msgspec
import pytest
import zmq

from prefixroute import BlockHasher, Router
from prefixroute.errors import ConfigurationError
from prefixroute.index import IndexUpdate
from prefixroute.testing import FakeVLLM
from prefixroute.vllm import EventIndex, Fleet, KVEventSubscriber, lora_namespace
from prefixroute.vllm import subscriber as subscriber_module

from ..conftest import DEADLINE_S, wait_until
from .conftest import events_router, fresh, settle

STEMS = [[random.Random(stem).randrange(30_000) for _ in range(160)] for stem in range(4)]


def workload(engine: FakeVLLM, rng: random.Random, steps: int, *, loss: float = 0.0, clears: float = 0.0) -> None:
    """Shared-stem prompts, some scheduled as concurrent twins (duplicate hashes), some messages lost, some clears."""
    for _ in range(steps):
        if rng.random() < clears:
            if rng.random() < loss:
                engine.drop_next()
            engine.clear_cache()
        stem = STEMS[rng.randrange(len(STEMS))][: rng.randrange(0, 160)]
        prompt = stem + [rng.randrange(50) for _ in range(rng.randrange(0, 48))]
        if rng.random() < loss:
            engine.drop_next()
        engine.complete(prompt, share=rng.random() > 0.2, lora_name=rng.choice([None, None, None, "sql"]))


@pytest.mark.parametrize(
    ("encoding", "hash_format", "extra_group"),
    [("array", "int", False), ("map", "bytes", True), ("alternate", "int", True)],
)
def test_index_equals_true_cache_despite_loss_duplicates_and_eviction(
    encoding: str, hash_format: str, extra_group: bool
) -> None:
    rng = random.Random(f"{encoding}-{hash_format}")  # a str seed: the same workload in every process
    router = events_router()
    index = router.index
    with (
        FakeVLLM(num_blocks=48, encoding=encoding, hash_format=hash_format, extra_group=extra_group) as engine,  # type: ignore[arg-type]
        KVEventSubscriber(router, "gpu0", engine.endpoint, replay_endpoint=engine.replay_endpoint) as sub,
    ):
        workload(engine, rng, 250, loss=0.1, clears=0.02)
        settle(engine, sub)
        assert index.hashes("gpu0") == engine.own_hashes()
        stats = sub.stats()
    assert stats.gaps > 0 and stats.replayed_batches > 0 and stats.unrecovered_gaps == 0
    assert stats.tracker.blocks_removed > 0 and stats.tracker.clears > 0 and stats.tracker.orphan_blocks == 0


def test_engine_restart_drops_the_old_blocks_and_follows_the_new_stream() -> None:
    rng = random.Random(3)
    router = events_router()
    index = router.index
    with (
        FakeVLLM(num_blocks=64) as engine,
        KVEventSubscriber(router, "gpu0", engine.endpoint, replay_endpoint=engine.replay_endpoint) as sub,
    ):
        workload(engine, rng, 80)
        settle(engine, sub)
        before = engine.own_hashes()
        engine.restart()
        workload(engine, rng, 5)
        settle(engine, sub)
        assert sub.stats().restarts == 1
        assert index.hashes("gpu0") == engine.own_hashes()
        assert before - engine.own_hashes(), "the restart should have dropped some old blocks"


@pytest.mark.parametrize("backoff", [(0.05, 0.2), (0.05, 1e9)], ids=["short", "a-high-end-of-years"])
def test_a_new_engine_process_on_the_same_ports_is_reconnected_to_and_seen_as_a_restart(
    backoff: tuple[float, float],
) -> None:
    """The first reconnect comes after the backoff's low end, however high its high end is."""
    rng = random.Random(8)
    router = events_router()
    index = router.index
    first = FakeVLLM(num_blocks=64, seed=1).start()
    endpoint, replay = first.endpoint, first.replay_endpoint
    with KVEventSubscriber(router, "gpu0", endpoint, replay_endpoint=replay, reconnect_backoff=backoff) as sub:
        try:
            workload(first, rng, 40)
            settle(first, sub)
        finally:
            first.stop()
        ports = int(endpoint.rsplit(":", 1)[1]), int(replay.rsplit(":", 1)[1])
        with FakeVLLM(num_blocks=64, seed=2, port=ports[0], replay_port=ports[1]) as second:
            workload(second, rng, 3)
            settle(second, sub)
            assert sub.stats().restarts == 1
            assert index.hashes("gpu0") == second.own_hashes()


def test_a_late_subscriber_replays_from_the_start() -> None:
    rng = random.Random(4)
    router = events_router()
    index = router.index
    with FakeVLLM(num_blocks=64, encoding="map") as engine:
        workload(engine, rng, 60)
        engine.flush()  # on the wire before the subscriber connects: it can only replay them
        published = engine.seq
        with KVEventSubscriber(router, "gpu0", engine.endpoint, replay_endpoint=engine.replay_endpoint) as sub:
            settle(engine, sub)
            assert index.hashes("gpu0") == engine.own_hashes()
            assert sub.stats().replayed_batches >= published > 40


@pytest.mark.parametrize("replay_topic", [True, False], ids=["vllm-0.26-topic-framed", "older-vllm"])
def test_replay_replies_are_read_with_or_without_the_topic_frame(replay_topic: bool) -> None:
    """vLLM >= 0.26 (vllm#45177) answers a replay with [topic, seq, payload], older vLLM with [seq, payload]."""
    router = events_router()
    with FakeVLLM(topic="kv@gpu0@llama", replay_topic=replay_topic) as engine:
        for stem in STEMS:
            engine.complete(stem)
        engine.flush()  # sent before the subscriber connects: only a replay can bring them
        with KVEventSubscriber(
            router, "gpu0", engine.endpoint, replay_endpoint=engine.replay_endpoint, topic="kv@gpu0"
        ) as sub:
            settle(engine, sub)
            engine.drop_next()
            engine.complete(STEMS[0] + [1] * 16)  # lost live: the gap is filled by a replay
            settle(engine, sub)
            stats = sub.stats()
            assert router.index.hashes("gpu0") == engine.own_hashes()
            assert stats.replayed_batches >= len(STEMS) + 1
            assert stats.failed_replays == 0 and stats.unrecovered_gaps == 0


@pytest.mark.parametrize("replay_topic", [True, False], ids=["vllm-0.26-topic-framed", "older-vllm"])
def test_replay_frames_are_vllms(replay_topic: bool) -> None:
    """The frames themselves, as vLLM's ZmqEventPublisher._service_replay sends them to a DEALER: each batch
    ``[b"", topic, seq, payload]`` (``[b"", seq, payload]`` before vllm#45177), the same bytes as published live, then
    ``[b"", b"", -1, b""]`` (``[b"", -1, b""]``); a request that is not three frames gets no answer. A subscriber
    reads either form, so only the frames show which one the fake sends."""
    end = (-1).to_bytes(8, "big", signed=True)
    with FakeVLLM(topic="kv@gpu0", replay_topic=replay_topic) as engine, zmq.Context() as context:
        engine.complete(STEMS[0][:32])
        engine.publish_payload(b"\x00corrupt")  # numbered and kept for replay as a real batch
        engine.complete(STEMS[1][:32])
        assert engine.seq == 3
        engine.flush()
        payload = engine._buffer[2][1]
        with context.socket(zmq.DEALER) as dealer:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.RCVTIMEO, int(DEADLINE_S * 1000))  # a hang guard: the answer comes at once
            dealer.connect(engine.replay_endpoint)
            dealer.send_multipart([(0).to_bytes(8, "big")])  # no empty delimiter: two frames, unanswered
            dealer.send_multipart([b"", b"\x01"])  # from batch 1 (vLLM reads any length of big-endian bytes)
            topic = [b"kv@gpu0"] if replay_topic else []
            assert dealer.recv_multipart() == [b"", *topic, (1).to_bytes(8, "big"), b"\x00corrupt"]
            assert dealer.recv_multipart() == [b"", *topic, (2).to_bytes(8, "big"), payload]
            assert dealer.recv_multipart() == [b"", *([b""] if replay_topic else []), end, b""]


def test_without_replay_a_loss_is_counted_as_unrecovered() -> None:
    router = events_router()
    index = router.index
    with (
        FakeVLLM(replay=False) as engine,
        KVEventSubscriber(router, "gpu0", engine.endpoint, replay_endpoint=engine.replay_endpoint) as sub,
    ):
        settle(engine, sub)
        before = sub.stats().unrecovered_gaps  # batches sent while the SUB socket was connecting count too
        engine.drop_next()
        engine.complete(STEMS[1][:32])  # lost, and the engine cannot replay it
        settle(engine, sub)
        assert sub.stats().unrecovered_gaps == before + 1
        assert not index.hashes("gpu0") >= engine.own_hashes()


def test_clear_cache_empties_the_backends_index_and_topic_filters() -> None:
    router = events_router()
    index = router.index
    with (
        FakeVLLM(topic="kv@gpu0@m") as engine,
        KVEventSubscriber(
            router, "gpu0", engine.endpoint, replay_endpoint=engine.replay_endpoint, topic="kv@gpu0"
        ) as sub,
        KVEventSubscriber(router, "other", engine.endpoint, topic="kv@gpu9") as other,
    ):
        workload(engine, random.Random(5), 20)
        settle(engine, sub)
        assert index.blocks("gpu0") > 0
        engine.clear_cache()
        settle(engine, sub)
        assert index.hashes("gpu0") == engine.own_hashes()
        assert sub.stats().tracker.clears == 1
        assert other.last_seq == -1 and index.blocks("other") == 0


def test_malformed_messages_are_counted_and_the_stream_goes_on() -> None:
    router = events_router()
    index = router.index
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    seq = iter(range(1000))
    clear = msgspec.msgpack.encode([1.0, [["AllBlocksCleared"]]])
    try:
        with KVEventSubscriber(router, "gpu0", f"tcp://127.0.0.1:{port}") as sub:
            state = {"at": 0.0, "last": -1}

            def heard() -> bool:  # a PUB socket drops what it sends before the SUB connects: resend, numbered
                if sub.last_seq >= 0:
                    return True
                if time.monotonic() - state["at"] > 0.1:
                    state["last"] = next(seq)
                    pub.send_multipart([b"", int(state["last"]).to_bytes(8, "big"), clear])
                    state["at"] = time.monotonic()
                return False

            wait_until(heard, what="the subscriber to connect")
            wait_until(lambda: sub.last_seq == state["last"], what="the warm-up drained")
            base = sub.stats()
            good = msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, list(range(16)), 16]]])
            pub.send_multipart([b"", next(seq).to_bytes(8, "big"), good])
            pub.send_multipart([b"", next(seq).to_bytes(8, "big"), b"\xc1 not msgpack"])
            pub.send_multipart([b"only two frames", b"x"])
            last = next(seq)
            pub.send_multipart([b"", last.to_bytes(8, "big"), good])
            wait_until(lambda: sub.last_seq == last, what=f"sequence {last}")
            stats = sub.stats()
            assert stats.invalid_batches - base.invalid_batches == 2
            assert stats.gaps == base.gaps and stats.restarts == base.restarts
            assert stats.tracker.blocks_stored - base.tracker.blocks_stored == 2
            assert index.hashes("gpu0") == set(BlockHasher(16).hash(list(range(16))))
    finally:
        context.destroy(linger=0)


@pytest.mark.parametrize("fault", ["lag_observer", "clock"])
def test_a_raising_lag_observer_or_clock_costs_no_batch_and_no_reconnect(fault: str) -> None:
    """The callbacks run after the round's write: their failure is counted, not a socket error (which lost batches)."""

    def broken(*_: object) -> float:
        raise RuntimeError("a bug in the callback")

    router = events_router()
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    options: dict[str, object] = {fault: broken}
    try:
        with KVEventSubscriber(router, "gpu0", f"tcp://127.0.0.1:{port}", **options) as sub:  # type: ignore[arg-type]
            sent = {"at": 0.0}
            warm_up = iter(range(1000))

            def heard() -> bool:  # a PUB drops what it sends before the SUB connects: resend, numbered
                if sub.last_seq >= 0:
                    return True
                if time.monotonic() - sent["at"] > 0.1:
                    pub.send_multipart([b"", numbered(next(warm_up)), STORED])
                    sent["at"] = time.monotonic()
                return False

            wait_until(heard, what="the subscriber to connect")
            first = sub.last_seq + 1
            for seq in range(first, first + 30):
                tokens = [seq * 100 + i for i in range(16)]
                payload = msgspec.msgpack.encode([time.time(), [["BlockStored", [seq + 10], None, tokens, 16]]])
                pub.send_multipart([b"", numbered(seq), payload])
                time.sleep(0.01)
            wait_until(lambda: sub.last_seq == first + 29, what="every batch applied")
            stats = sub.stats()
            assert stats.reconnects == 0 and stats.gaps == 0 and stats.observer_errors >= 1
            assert all(
                set(BlockHasher(16).hash([seq * 100 + i for i in range(16)])) <= router.index.hashes("gpu0")
                for seq in range(first, first + 30)
            )
    finally:
        context.destroy(linger=0)


@pytest.mark.parametrize("callback", ["lag_observer", "clock"])
def test_a_callback_that_calls_back_into_its_subscriber_does_not_deadlock_the_thread(callback: str) -> None:
    """lag_observer and clock run in the subscriber's thread while it holds its state lock. Was: a callback calling
    held() or reset() (say, to resync when the lag grows too large) waited for that lock for good: no batch applied
    again, and stop() could not end the thread."""
    router = events_router()
    calls = {"held": 0, "resets": 0}
    box: dict[str, KVEventSubscriber] = {}

    def reentrant(*_: object) -> float:
        sub = box["sub"]
        sub.held()
        calls["held"] += 1
        if not calls["resets"]:
            calls["resets"] += 1
            sub.reset()  # the next batch starts a new stream, replayed from the engine's buffer
        return time.time()

    options: dict[str, object] = {callback: reentrant}
    with FakeVLLM(num_blocks=64) as engine:
        sub = box["sub"] = KVEventSubscriber(
            router,
            "gpu0",
            engine.endpoint,
            replay_endpoint=engine.replay_endpoint,
            **options,  # type: ignore[arg-type]
        )
        with sub:
            settle(engine, sub)
            settle(engine, sub)  # batches after the reset are applied too
            assert calls["resets"] == 1 and calls["held"] >= 2
            assert router.index.hashes("gpu0") == engine.own_hashes()
            assert sub.stats().observer_errors == 0
        assert not sub.running


def test_the_fake_engine_stamps_its_batches_with_its_clock_so_a_lag_can_be_set_up() -> None:
    """Was: FakeVLLM stamped batches with time.time() itself, so no test could say how late a batch arrives."""
    lags: list[float] = []
    with (
        FakeVLLM(clock=lambda: 1_000.0) as engine,
        KVEventSubscriber(
            events_router(), "gpu0", engine.endpoint, replay_endpoint=engine.replay_endpoint,
            clock=lambda: 1_012.5, lag_observer=lags.append,
        ) as sub,
    ):  # fmt: skip
        settle(engine, sub)
        assert sub.stats().last_lag_s == 12.5 and lags and set(lags) == {12.5}


@pytest.mark.parametrize(
    ("stamp", "error"),
    [("now", TypeError), (None, TypeError), (True, TypeError), (10**400, TypeError),
     (RuntimeError("no clock"), RuntimeError)],
    ids=["str", "None", "bool", "huge-int", "raises"],
)  # fmt: skip
def test_a_fake_engine_clock_that_fails_loses_no_event(stamp: object, error: type[Exception]) -> None:
    """The clock is read before the events are taken: the next batch carries them."""
    stamps: list[object] = [stamp]

    def clock() -> object:
        value = stamps.pop() if stamps else 1_000.0
        if isinstance(value, Exception):
            raise value
        return value

    engine = FakeVLLM(block_size=4, num_blocks=16, clock=clock)  # type: ignore[arg-type]  # not started
    with pytest.raises(error, match="clock|no clock"):
        engine.complete(list(range(8)))
    assert engine.seq == 0 and len(engine.chains()) == 2
    engine.complete(list(range(100, 108)))
    assert engine.seq == 1 and len(engine.chains()) == 4  # one batch with both prompts' blocks
    with pytest.raises(TypeError, match="clock must be a callable"):
        FakeVLLM(clock=1_000.0)  # type: ignore[arg-type]


class ResettingWriter:
    """A writer that, in its first write that stores blocks, resets its subscriber before passing the updates on (say,
    on finding the backend's index out of step). Writes made inside that write pass straight through."""

    block_size = 16

    def __init__(self, router: Router) -> None:
        self.router = router
        self.subscriber: KVEventSubscriber | None = None
        self.resets = 0

    def write(self, backend: str, updates: Iterable[IndexUpdate]) -> None:
        updates = list(updates)
        if not self.resets and self.subscriber is not None and any(stored for stored, _, _ in updates):
            self.resets += 1
            self.subscriber.reset()
        self.router.write(backend, updates)


def test_a_reset_by_the_writer_during_its_write_takes_effect_after_that_write() -> None:
    """Was: reset() (reentrant since the state lock is an RLock) wrote the tracker's removals and forgot its blocks
    inside the write, whose stores then reached the index: blocks the tracker no longer knew, which no removal would
    ever take out again (the engine's eviction of one is an unknown removal)."""
    router = events_router()
    writer = ResettingWriter(router)
    with FakeVLLM(num_blocks=64) as engine:  # no replay: what the reset forgot does not come back by one
        sub = writer.subscriber = KVEventSubscriber(writer, "gpu0", engine.endpoint)
        with sub:
            settle(engine, sub)  # a batch whose write resets, then one after it
            assert writer.resets == 1 and sub.stats().write_errors == 0
            assert router.index.hashes("gpu0") == sub.held() != set()
            engine.complete(fresh())
            settle(engine, sub)
            assert router.index.hashes("gpu0") == sub.held()


def test_event_index_is_right_where_the_prediction_is_wrong_after_eviction() -> None:
    """Acceptance 3: the router predicts a hit on a backend whose engine evicted the prefix; events know better."""
    router = Router(block_size=16)
    exact = events_router()
    hot = STEMS[2][:64]
    with (
        FakeVLLM(num_blocks=8) as engine,
        KVEventSubscriber(exact, "gpu0", engine.endpoint, replay_endpoint=engine.replay_endpoint) as sub,
    ):
        first = router.route(hot, ["gpu0"])
        engine.complete(hot)
        settle(engine, sub)
        assert exact.index.match(BlockHasher(16).hash(hot), ["gpu0"]) == {"gpu0": 4}  # stored, then evicted:
        for stem in (STEMS[0], STEMS[1], STEMS[3]):  # other traffic fills the 8-block cache: `hot` is evicted
            engine.complete(stem[:64])
        settle(engine, sub)
        predicted = router.route(hot, ["gpu0"])
        hashes = BlockHasher(16).hash(hot)
        assert first.matched_tokens == 0 and predicted.matched_tokens == 64  # approximate mode: a (wrong) hit
        assert exact.index.match(hashes, ["gpu0"]) == {"gpu0": 0}  # event mode: a miss
        assert engine.complete(hot).cached_tokens == 0  # ... and the engine agrees


class FlakyWriter:
    """A writer that fails every other write, recording the ones it took."""

    block_size = 16

    def __init__(self) -> None:
        self.calls = 0
        self.taken: list[IndexUpdate] = []

    def write(self, backend: str, updates: Iterable[IndexUpdate]) -> None:
        self.calls += 1
        if self.calls % 2:
            raise RuntimeError("the index is having a bad day")
        self.taken.extend(updates)


def test_a_failing_writer_is_counted_logged_and_the_thread_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    writer = FlakyWriter()
    with (
        FakeVLLM() as engine,
        KVEventSubscriber(writer, "gpu0", engine.endpoint, replay_endpoint=engine.replay_endpoint) as sub,
    ):
        settle(engine, sub)
        for stem in STEMS:
            engine.complete(stem[:64])
            settle(engine, sub)
        assert sub.running
        stats = sub.stats()
    assert stats.write_errors >= 1 and writer.taken  # some writes failed, later ones still arrived
    assert stats.write_errors == (writer.calls + 1) // 2
    # Each failure is logged with the backend, what failed, and the writer's own error (its traceback).
    failures = [r for r in caplog.records if r.levelno == logging.ERROR and "index updates failed" in r.getMessage()]
    assert len(failures) == stats.write_errors
    for record in failures:
        assert re.search(r"\bgpu0: writing \d+ index updates failed$", record.getMessage())
        assert record.exc_info is not None and str(record.exc_info[1]) == "the index is having a bad day"


def test_configuration_errors_are_clear() -> None:
    router = events_router()
    with pytest.raises(ConfigurationError, match="ZMQ address"):
        KVEventSubscriber(router, "gpu0", "localhost:5557")
    with pytest.raises(ConfigurationError, match="replay_endpoint must be a ZMQ address"):
        KVEventSubscriber(router, "gpu0", "tcp://127.0.0.1:1", replay_endpoint="localhost")


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("replay_timeout", 0),
        ("replay_timeout", float("nan")),
        ("replay_timeout", float("inf")),
        ("replay_timeout", -1.0),
        ("max_batches_per_apply", 0),
        ("max_batches_per_apply", 2.5),
        ("max_sequence_jump", -3),
        ("reconnect_backoff", (0.0, 1.0)),
        ("reconnect_backoff", (2.0, 1.0)),
        ("reconnect_backoff", (0.1, float("inf"))),
        ("reconnect_backoff", 5),
        ("topic", "kv@gpu0\ud800"),  # a lone surrogate: was accepted, then the thread failed on it for good
        # The publisher's own address: was accepted, then every replay timed out (a DEALER cannot talk to a PUB).
        ("replay_endpoint", "tcp://127.0.0.1:1"),
    ],
)
def test_nonsense_options_are_rejected_when_given(option: str, value: object) -> None:
    with pytest.raises(ConfigurationError, match=option.split("_")[0]):
        KVEventSubscriber(events_router(), "gpu0", "tcp://127.0.0.1:1", **{option: value})  # type: ignore[arg-type]


def test_completions_over_http_publish_events_and_report_cached_tokens() -> None:
    router = events_router()
    index = router.index
    prompt = STEMS[0][:100]
    with (
        FakeVLLM() as engine,
        KVEventSubscriber(router, "gpu0", engine.endpoint, replay_endpoint=engine.replay_endpoint) as sub,
        httpx.Client(base_url=engine.url, timeout=5) as client,
    ):
        first = client.post("/v1/completions", json={"model": "fake-model", "prompt": prompt, "max_tokens": 4})
        second = client.post("/v1/completions", json={"prompt": [prompt, STEMS[1][:40]]})
        assert first.status_code == second.status_code == 200
        assert first.json()["usage"]["prompt_tokens_details"] is None  # nothing cached: null, as vLLM reports it
        assert second.json()["usage"]["prompt_tokens"] == 140
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 96  # six full blocks
        settle(engine, sub)
        assert index.match(BlockHasher(16).hash(prompt), ["gpu0"]) == {"gpu0": 6}
        assert index.hashes("gpu0") == engine.own_hashes()
        bad_prompts: list[object] = ["text, not token ids", [1, -2], []]
        for bad_prompt in bad_prompts:
            reply = client.post("/v1/completions", json={"prompt": bad_prompt})
            assert reply.status_code == 400, reply.text
            assert "token ids" in reply.json()["error"]["message"] and reply.json()["error"]["param"] is None
        for bad_max in ["Infinity", "0", "true", '"four"', "1.5"]:  # Infinity once raised OverflowError: no answer
            raw = f'{{"prompt": [1, 2, 3], "max_tokens": {bad_max}}}'
            reply = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
            assert reply.status_code == 400, (bad_max, reply.text)
            assert "max_tokens" in reply.json()["error"]["message"]
        assert client.get("/nothing").status_code == 404


def test_the_http_answers_are_vllms() -> None:
    # vLLM's CompletionResponse (created, each choice's logprobs, stop_reason and prompt_logprobs, the text it
    # generated) and its /v1/models card (created, max_model_len, a ModelPermission). Was: no created, a choice of
    # index, empty text and finish_reason only, a card without created, max_model_len or permission.
    with FakeVLLM(clock=lambda: 1_700_000_000.5) as engine, httpx.Client(base_url=engine.url, timeout=5) as client:
        answer = client.post("/v1/completions", json={"prompt": [[0, 1], [2**32 - 1]], "max_tokens": 2}).json()
        assert answer["created"] == 1_700_000_000 and answer["object"] == "text_completion"
        choice = {"text": " t0 t1", "logprobs": None, "finish_reason": "length", "stop_reason": None,
                  "prompt_logprobs": None}  # fmt: skip
        assert answer["choices"] == [{"index": 0, **choice}, {"index": 1, **choice}]
        for bad in ([2**32], [-1]):  # token ids are in [0, 2**32)
            refused = client.post("/v1/completions", json={"prompt": bad})
            assert refused.status_code == 400 and "token ids" in refused.json()["error"]["message"]
        (card,) = client.get("/v1/models").json()["data"]
    (permission,) = card.pop("permission")
    assert permission["object"] == "model_permission" and permission["id"].startswith("modelperm-")
    assert card == {"id": "fake-model", "object": "model", "created": 1_700_000_000, "owned_by": "vllm",
                    "root": "fake-model", "parent": None, "max_model_len": 1 << 20}  # fmt: skip


def test_max_tokens_and_the_refusals_are_vllms() -> None:
    # vLLM's CompletionRequest (max_tokens: int | None = 16, read as pydantic's lax int) and SamplingParams (at least
    # 1: a VLLMValidationError naming the parameter, which its str() appends) and the context it serves. Was: "4"
    # and 2.0 refused, 0 refused with no param, and a max_tokens past the context generated until memory ran out.
    with FakeVLLM() as engine, httpx.Client(base_url=engine.url, timeout=5) as client:
        for given, generated in ((None, 16), ("4", 4), (2.0, 2), (1, 1)):
            body = {"prompt": [[1, 2, 3], [4, 5]]} | ({} if given is None else {"max_tokens": given})
            answer = client.post("/v1/completions", json=body).json()
            assert answer["choices"][0]["text"] == "".join(f" t{i}" for i in range(generated)), given
            assert answer["usage"]["completion_tokens"] == 2 * generated, given
        too_few = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 0})
        assert too_few.status_code == 400 and too_few.headers["content-type"] == "application/json"
        assert too_few.json() == {"error": {
            "message": "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
            "type": "BadRequestError", "param": "max_tokens", "code": 400}}  # fmt: skip
        too_many = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 10**12})
        assert too_many.status_code == 400
        assert "maximum context length is 1048576 tokens" in too_many.json()["error"]["message"]
        empty = client.post("/v1/completions", json={"prompt": []})
        assert empty.status_code == 400 and empty.headers["content-type"] == "application/json"
        assert empty.json() == {"error": {
            "message": "prompt must be a non-empty list of token ids or a list of such lists",
            "type": "BadRequestError", "param": None, "code": 400}}  # fmt: skip


def test_an_answer_is_named_and_counted_as_vllm_names_and_counts_it() -> None:
    # vLLM's id is "cmpl-" and _base_request_id: the X-Request-Id header, else the body's request_id (a str, or
    # 400), else a random uuid4 hex, so no two answers share one. Was: "cmpl-" and the engine's sequence number, the
    # same for every answer that stored no new block, and the client's ids ignored.
    with FakeVLLM() as engine, httpx.Client(base_url=engine.url, timeout=5) as client:
        body = {"prompt": [1, 2, 3], "max_tokens": 2}
        first, second = (client.post("/v1/completions", json=body).json() for _ in range(2))
        assert first["id"] != second["id"]
        for answer in (first, second):
            assert re.fullmatch("cmpl-[0-9a-f]{32}", answer["id"]) and answer["model"] == "fake-model"
            usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5, "prompt_tokens_details": None}
            assert answer["usage"] == usage  # no full block: nothing cached
        named = client.post("/v1/completions", json=body | {"request_id": "in-body"}).json()
        header = client.post("/v1/completions", json=body | {"request_id": "x"}, headers={"X-Request-Id": "trace-7"})
        assert (named["id"], header.json()["id"]) == ("cmpl-in-body", "cmpl-trace-7")
        refused = client.post("/v1/completions", json=body | {"request_id": 5})
        assert refused.status_code == 400
        assert refused.json()["error"]["message"] == "request_id: Input should be a valid string, not 5"


def test_a_model_is_checked_as_vllms_check_model_checks_it() -> None:
    # vLLM's _check_model: a model it does not serve is a 404 NotFoundError with param "model", and no model, null
    # or "" is the base model's; a model that is no str is pydantic's 400 (model: str | None). Was: any model
    # served, as if it were the engine's.
    with FakeVLLM(model="base") as engine, httpx.Client(base_url=engine.url, timeout=5) as client:
        body = {"prompt": [1, 2, 3], "max_tokens": 1}
        missing = client.post("/v1/completions", json=body | {"model": "fake-model"})
        assert missing.status_code == 404 and missing.headers["content-type"] == "application/json"
        assert missing.json() == {"error": {"message": "The model `fake-model` does not exist.",
                                            "type": "NotFoundError", "param": "model", "code": 404}}  # fmt: skip
        for model in ("base", "", None):
            served = client.post("/v1/completions", json=body | {"model": model})
            assert served.status_code == 200 and served.json()["model"] == "base", model
        no_str = client.post("/v1/completions", json=body | {"model": 5})
        assert no_str.status_code == 400 and no_str.json()["error"]["message"] == "'model' must be a string, not int"
    assert engine.cache.queries == 3 * 3  # the refused requests touched no cache


def test_a_chunked_body_is_read_as_vllms_server_reads_it() -> None:
    # uvicorn reads a body sent Transfer-Encoding: chunked (no Content-Length) as any other. Was: a 400, the fake
    # reading Content-Length 0 bytes of it.
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 2}).encode()
    with FakeVLLM() as engine, httpx.Client(base_url=engine.url, timeout=5) as client:
        streamed = client.post("/v1/completions", content=iter([body[:7], body[7:]]),
                               headers={"Content-Type": "application/json"})  # fmt: skip
        assert "content-length" not in streamed.request.headers
        assert streamed.request.headers["transfer-encoding"] == "chunked"
        assert streamed.status_code == 200 and streamed.json()["usage"]["prompt_tokens"] == 3
        host, port = engine.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=5) as raw:  # a chunk extension and a trailer
            chunks = b"%x;note=1\r\n%s\r\n0\r\nX-Checksum: 1\r\n\r\n" % (len(body), body)
            raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks)
            answer = b"".join(iter(lambda: raw.recv(65536), b""))
        assert answer.split(b" ", 2)[1] == b"200" and json.loads(answer.split(b"\r\n\r\n", 1)[1])["choices"]
        assert engine.cache.queries == 2 * 3


def test_the_routes_answer_as_vllms_fastapi_app_does() -> None:
    # vLLM routes by path alone (a query string is ignored), serves its Prometheus app under every /metrics path
    # and method, answers a path it does not serve with FastAPI's 404 and a path it serves with another method with
    # a 405 naming the method. Was: a query string on a POST, /metrics/ or POST /metrics was a 404, every refusal
    # a text/plain "not found" and a wrong method a 404 too.
    with FakeVLLM() as engine, httpx.Client(base_url=engine.url, timeout=5) as client:
        for models in (client.get("/v1/models"), client.get("/v1/models?limit=1")):
            assert models.status_code == 200 and models.headers["content-type"] == "application/json"
            assert models.headers["content-length"] == str(len(models.content))
            assert models.json()["data"][0]["id"] == "fake-model"
        done = client.post("/v1/completions?trace=1", json={"prompt": [1, 2, 3], "max_tokens": 1})
        assert done.status_code == 200 and done.headers["content-type"] == "application/json"
        assert done.json()["usage"]["prompt_tokens"] == 3
        for metrics in (client.get("/metrics?name[]=x"), client.get("/metrics/"), client.post("/metrics")):
            assert metrics.status_code == 200, metrics.request.url
            assert metrics.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
            assert "vllm:prefix_cache_queries_total" in metrics.text
        for unknown in (client.get("/nothing"), client.get("/v1/nothing/"), client.post("/v1/chat/nothing")):
            assert unknown.status_code == 404, unknown.request.url
            assert unknown.headers["content-type"] == "application/json"
            assert unknown.json() == {"detail": "Not Found"}
        slashed = client.get("/v1/models/")  # a served path with a trailing slash: Starlette redirects it
        assert slashed.status_code == 307 and slashed.headers["location"].endswith("/v1/models"), slashed.headers
        for wrong, allowed in ((client.get("/v1/completions"), "POST"), (client.post("/v1/models?x=1"), "GET")):
            assert wrong.status_code == 405 and wrong.headers["allow"] == allowed, wrong.request.url
            assert wrong.headers["content-type"] == "application/json"
            assert wrong.json() == {"detail": "Method Not Allowed"}


def test_a_subscriber_later_than_the_replay_buffer_holds_only_true_blocks() -> None:
    rng = random.Random(9)
    router = events_router()
    index = router.index
    # A cache large enough that nothing is evicted: later prompts extend blocks stored in the lost batches, so
    # their new blocks are orphans whatever the timing.
    with FakeVLLM(num_blocks=4096, replay_buffer=10) as engine:
        workload(engine, rng, 80)
        engine.flush()
        with KVEventSubscriber(router, "gpu0", engine.endpoint, replay_endpoint=engine.replay_endpoint) as sub:
            settle(engine, sub)
            workload(engine, rng, 40)
            settle(engine, sub)
            stats = sub.stats()
            # Batches older than the buffer are lost for good: the index misses blocks, but holds no false ones.
            assert stats.unrecovered_gaps >= 1 and stats.tracker.orphan_blocks > 0
            assert index.hashes("gpu0") <= engine.own_hashes()
            assert index.hashes("gpu0") != engine.own_hashes()


def test_a_router_routes_by_what_the_events_say_including_lora_namespaces() -> None:
    router = Router(block_size=16, namespace="llama", index=EventIndex(16, speculative_ttl=0))
    base, adapter = STEMS[0][:96], STEMS[1][:64]
    with (
        FakeVLLM() as engine,
        KVEventSubscriber(
            router, "gpu1", engine.endpoint, replay_endpoint=engine.replay_endpoint, namespace="llama"
        ) as sub,
    ):
        engine.complete(base)  # served without the router: only the events tell it
        engine.complete(adapter, lora_name="sql")
        settle(engine, sub)
        decision = router.route(base + [1, 2, 3], ["gpu0", "gpu1", "gpu2"])
        assert (decision.backend, decision.matched_tokens, decision.reason) == ("gpu1", 96, "prefix")
        lora = router.route(adapter, ["gpu0", "gpu1", "gpu2"], namespace=lora_namespace("llama", "sql"))
        assert (lora.backend, lora.matched_tokens) == ("gpu1", 64)
        assert router.route(adapter, ["gpu0", "gpu1", "gpu2"]).matched_tokens == 0  # not under the base model


def test_router_in_events_mode_forgets_what_the_engine_evicted_and_predictions_do_not() -> None:
    """Acceptance 3 through a Fleet: after an eviction only the event-fed router predicts the miss."""
    hot = STEMS[2][:64]
    predicting = Router(block_size=16)
    exact = Router(block_size=16, index=EventIndex(16, speculative_ttl=0))
    with FakeVLLM(num_blocks=8) as engine, Fleet(exact) as fleet:
        fleet.add_backend("gpu0", kv_events=engine.endpoint, replay=engine.replay_endpoint)
        sub = fleet.subscriber("gpu0")
        assert sub is not None
        predicting.route(hot, ["gpu0"])
        engine.complete(hot)
        settle(engine, sub)
        assert exact.route(hot, ["gpu0"]).matched_tokens == 64  # the engine holds it: both agree
        for stem in (STEMS[0], STEMS[1], STEMS[3]):  # other traffic fills the 8-block cache
            engine.complete(stem[:64])
        settle(engine, sub)
        assert predicting.route(hot, ["gpu0"]).matched_tokens == 64  # still predicts a hit: wrong
        decision = exact.route(hot, ["gpu0"])
        assert decision.matched_tokens == decision.confirmed_tokens == 0  # right
        assert engine.complete(hot).cached_tokens == 0


def test_batches_published_before_the_subscription_took_effect_are_fetched_without_waiting_for_the_next() -> None:
    """ZMQ's slow joiner: an idle engine's last batches would otherwise only show up at its next batch."""
    router = events_router()
    with FakeVLLM(num_blocks=64) as engine:
        engine.complete(list(range(64)))
        engine.flush()
        with KVEventSubscriber(router, "gpu0", engine.endpoint, replay_endpoint=engine.replay_endpoint):
            # Nothing more is published: only the catch-up on a quiet subscription can bring these blocks.
            wait_until(lambda: router.index.hashes("gpu0") == engine.own_hashes(), what="the catch-up replay")
            assert router.index.blocks("gpu0") == 4


class EndlessReplay:
    """A replay ROUTER on loopback that never sends the end of a replay: after each request it keeps answering its
    latest requester, every ``every`` seconds, with ``reply(n)`` for n = 0, 1, 2..."""

    def __init__(self, reply: Callable[[int], list[bytes]], every: float) -> None:
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self.endpoint = f"tcp://127.0.0.1:{self._socket.bind_to_random_port('tcp://127.0.0.1')}"
        self._reply = reply
        self._every = every
        self.requests = 0
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> EndlessReplay:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self._context.destroy(linger=0)

    def _serve(self) -> None:
        ident = None
        n = 0
        while not self._stop.is_set():
            if self._socket.poll(0 if ident is not None else 20):
                ident = self._socket.recv_multipart()[0]
                self.requests += 1
                n = 0
            if ident is not None:
                try:
                    self._socket.send_multipart([ident, b"", *self._reply(n)], zmq.NOBLOCK)
                    self.sent += 1
                except zmq.Again:
                    pass
                n += 1
                time.sleep(self._every)


def numbered(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


STORED = msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, list(range(16)), 16]]])


def test_a_replay_that_never_ends_is_cut_at_replay_timeout_and_live_events_go_on() -> None:
    """The timeout bounds the whole replay, not each frame: an endpoint answering forever cannot hold the thread."""
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    seq = iter(range(10, 1000))  # the first batch heard comes after a gap: it needs a replay of 0..9
    try:
        with (
            EndlessReplay(lambda n: [numbered(1), b"\xc1"], every=0.02) as replay,
            KVEventSubscriber(
                events_router(), "gpu0", f"tcp://127.0.0.1:{port}", replay_endpoint=replay.endpoint,
                replay_timeout=0.3,
            ) as sub,
        ):  # fmt: skip
            state = {"at": 0.0}

            def applied_live() -> bool:  # keep publishing (a PUB drops what it sends before the SUB connects)
                if sub.stats().batches >= 3:
                    return True
                if time.monotonic() - state["at"] > 0.05:
                    pub.send_multipart([b"", numbered(next(seq)), STORED])
                    state["at"] = time.monotonic()
                return False

            # The replay never ends, so only replay_timeout cutting it lets live batches through: wait_until is a
            # hang guard, not a measure (the 5 s bound on it was a speed assertion).
            wait_until(applied_live, what="live batches applied despite the endless replay")
            stats = sub.stats()
            assert replay.requests >= 1 and replay.sent > 1  # the endpoint did keep answering
            assert stats.failed_replays >= 1 and stats.last_seq >= 0
            assert sub.held()  # the state lock is free again: live events were applied
            sub.stop(timeout=DEADLINE_S)  # ends the thread, replay and all: running is False once it has ended
            assert not sub.running
    finally:
        context.destroy(linger=0)


def test_a_replay_keeps_at_most_max_replay_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(subscriber_module, "MAX_REPLAY_BATCHES", 5)
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    try:
        # Batches 0, 1, 2... for ever, well within the timeout: only the cap ends this replay.
        with (
            EndlessReplay(lambda n: [numbered(n), STORED], every=0.001) as replay,
            KVEventSubscriber(
                events_router(), "gpu0", f"tcp://127.0.0.1:{port}", replay_endpoint=replay.endpoint,
                replay_timeout=30.0,
            ) as sub,
        ):  # fmt: skip
            # The replay counts its failure before the catch-up applies what it kept: wait for the applied batches.
            wait_until(lambda: sub.last_seq >= 0, timeout=10.0, what="the capped catch-up replay applied")
            stats = sub.stats()
            assert stats.failed_replays >= 1
            assert stats.replayed_batches == 5 and stats.last_seq == 4
    finally:
        context.destroy(linger=0)


class BlockingWriter:
    """A writer whose writes wait until ``release`` is set (a stuck index)."""

    block_size = 16

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()

    def write(self, backend: str, updates: Iterable[IndexUpdate]) -> None:
        self.entered.set()
        self.release.wait(10)


def test_running_stays_true_while_a_stop_that_timed_out_leaves_the_thread_alive(
    caplog: pytest.LogCaptureFixture,
) -> None:
    writer = BlockingWriter()
    with FakeVLLM() as engine:
        sub = KVEventSubscriber(writer, "gpu0", engine.endpoint, replay_endpoint=engine.replay_endpoint).start()
        try:
            state = {"at": 0.0}

            def stuck() -> bool:  # publish until one batch reaches the writer (and blocks there)
                if writer.entered.is_set():
                    return True
                if time.monotonic() - state["at"] > 0.1:
                    engine.complete(fresh())
                    state["at"] = time.monotonic()
                return False

            wait_until(stuck, what="a write that blocks")
            sub.stop(timeout=0.2)
            assert sub.running  # the truth: the thread is still in the writer
            assert [t for t in threading.enumerate() if t.name == "prefixroute-kv-events[gpu0]"]
            warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
            assert [m for m in warned if "not ended" in m] == [
                "KV events from gpu0: the thread has not ended within 0.2s of stop()"
            ]
        finally:
            writer.release.set()
        wait_until(lambda: not sub.running, what="the thread to end once the writer returns")
        sub.stop()  # idempotent, and nothing left to wait for
        assert not sub.running


@pytest.mark.parametrize(
    ("option", "value", "error"),
    [
        ("namespace", 5, "namespace"),
        ("namespace", ["model"], "namespace"),
        ("lag_observer", 5, "lag_observer"),
        ("clock", 5, "clock"),
        ("clock", None, "clock"),
    ],
)
def test_options_of_the_wrong_type_are_type_errors_when_given(option: str, value: object, error: str) -> None:
    with pytest.raises(TypeError, match=error):
        KVEventSubscriber(events_router(), "gpu0", "tcp://127.0.0.1:1", **{option: value})  # type: ignore[arg-type]


def test_a_huge_int_timeout_is_a_configuration_error_not_an_overflow() -> None:
    for value in (10**400, 10**5000, 1e300):
        with pytest.raises(ConfigurationError, match="replay_timeout"):
            KVEventSubscriber(events_router(), "gpu0", "tcp://127.0.0.1:1", replay_timeout=value)
        with pytest.raises(ConfigurationError, match="reconnect_backoff"):
            KVEventSubscriber(events_router(), "gpu0", "tcp://127.0.0.1:1", reconnect_backoff=(0.1, value))


@pytest.mark.parametrize(
    "endpoint",
    [
        "tcp://127.0.0.1:99999",
        "tcp://127.0.0.1:0",
        "tcp://127.0.0.1:x",
        "tcp://:5557",
        "tcp://*:5557",
        "ipc://",
        "udp://127.0.0.1:5557",
        "tcp://127.0.0.1:5557\n",
        "gpu0:5557",
        "",
    ],  # fmt: skip
)
def test_an_endpoint_no_socket_can_connect_to_is_refused_when_given(endpoint: str) -> None:
    with pytest.raises(ConfigurationError, match="ZMQ address"):
        KVEventSubscriber(events_router(), "gpu0", endpoint)
    with pytest.raises(ConfigurationError, match="replay_endpoint"):
        KVEventSubscriber(events_router(), "gpu0", "tcp://127.0.0.1:1", replay_endpoint=endpoint)


@pytest.mark.parametrize(
    ("timeout", "shown"),
    [("1", "'1'"), (None, "None"), (-1, "-1"), (float("nan"), "nan"), (float("inf"), "inf"),
     (10**400, "an int of 1329 bits"), (1e300, "1e+300")],
)  # fmt: skip
def test_stop_refuses_a_nonsense_timeout_before_stopping_anything(timeout: object, shown: str) -> None:
    # Was a TypeError, ValueError or OverflowError from Thread.join() after the stop was signalled (a str left the
    # thread running with the error, a NaN or huge value stopped it anyway), None waited for good and -1 not at all.
    sub = KVEventSubscriber(events_router(), "gpu0", "tcp://127.0.0.1:1").start()
    try:
        with pytest.raises(ConfigurationError, match="timeout must be a finite number of seconds >= 0") as refused:
            sub.stop(timeout=timeout)  # type: ignore[arg-type]
        assert str(refused.value).endswith(f", not {shown}")  # the value given, as the caller can find it
        assert sub.running
    finally:
        sub.stop(timeout=0)
    wait_until(lambda: not sub.running, what="the thread to end after stop(timeout=0)")


def test_a_stop_from_another_thread_while_start_starts_the_thread_neither_raises_nor_leaves_it_running(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As when Fleet.remove_backend() meets an add_backend() of the same backend. Was: stop() found the thread made
    but not started yet and joined it, a RuntimeError ("cannot join thread before it is started") out of
    remove_backend(), which then left the router's blocks of the backend in place."""
    sub = KVEventSubscriber(events_router(), "gpu0", "tcp://127.0.0.1:1")

    class Interleaved(threading.Thread):
        def start(self) -> None:
            if self.name == "prefixroute-kv-events[gpu0]":
                sub.stop()  # the other thread's call, landing between the thread's creation and its start
            super().start()

    monkeypatch.setattr(threading, "Thread", Interleaved)
    sub.start()
    monkeypatch.undo()
    sub.stop()
    wait_until(lambda: not sub.running, what="the thread to end")


class NotZMQ:
    """A TCP server on loopback that answers whatever connects as an HTTP server would (vLLM's HTTP port given as its
    KV-events endpoint), counting the connections."""

    def __init__(self) -> None:
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):  # closed by close()
            while True:
                peer, _ = self._server.accept()
                self.connections += 1
                with peer, contextlib.suppress(OSError):
                    peer.recv(64)
                    peer.sendall(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")

    def close(self) -> None:
        self._server.close()


def test_an_endpoint_that_does_not_speak_zmq_is_counted_and_logged_not_waited_on_in_silence(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Was: libzmq retried the handshake forever and said nothing; the index silently heard no event.
    server = NotZMQ()
    caplog.set_level(logging.WARNING, logger="prefixroute.vllm.subscriber")
    endpoint = f"tcp://127.0.0.1:{server.port}"
    try:
        with KVEventSubscriber(events_router(), "gpu0", endpoint, reconnect_backoff=(0.01, 0.02)) as sub:
            wait_until(lambda: sub.stats().handshake_failures >= 3, what="three failed handshakes")
            assert sub.running and sub.stats().batches == 0
    finally:
        server.close()
    stats = sub.stats()  # final: the thread has stopped
    assert server.connections >= stats.handshake_failures >= 3
    assert stats.reconnects == 0  # libzmq retries a failed handshake itself: the session goes on
    warnings = [r.getMessage() for r in caplog.records if "does not answer as a ZMQ publisher" in r.getMessage()]
    assert warnings[0] == (
        f"KV events from gpu0: {endpoint} does not answer as a ZMQ publisher (failed handshakes in a row: 2): is it "
        "vLLM's --kv-events-config endpoint?"
    )
    # At the 2nd, 4th, 8th... failure in a row (once is an engine gone during a handshake): no flood.
    assert len(warnings) == stats.handshake_failures.bit_length() - 1


def test_a_zmq_socket_of_another_kind_fails_the_handshake_and_the_publisher_that_replaces_it_is_heard() -> None:
    # vLLM's ROUTER replay socket given as the publisher (the two endpoints swapped): libzmq drops the connection
    # before its handshake is done and never reconnects; was: the subscriber waited on it in silence for good.
    context = zmq.Context()
    replay = context.socket(zmq.ROUTER)
    port = replay.bind_to_random_port("tcp://127.0.0.1")
    router = events_router()
    try:
        with KVEventSubscriber(router, "gpu0", f"tcp://127.0.0.1:{port}", reconnect_backoff=(0.01, 0.02)) as sub:
            # Retried: by a new socket where libzmq gave up (it does when it saw the protocol error itself), by
            # libzmq where the ROUTER closed first (a plain disconnect, which it retries): either may come first.
            wait_until(lambda: sub.stats().handshake_failures >= 2, what="failed handshakes, retried")
            replay.close(linger=0)
            pub = context.socket(zmq.PUB)
            wait_until(lambda: _bound(pub, f"tcp://127.0.0.1:{port}"), what="the port freed by the ROUTER socket")
            seq = iter(range(1000))

            def heard() -> bool:  # what a PUB sends while no SUB is connected is dropped: resend, numbered
                pub.send_multipart([b"", numbered(next(seq)), STORED])
                return sub.stats().batches > 0

            wait_until(heard, what="the publisher now on that port to be heard")
            assert router.index.hashes("gpu0") == set(BlockHasher(16).hash(range(16)))
    finally:
        context.destroy(linger=0)


def _bound(socket_: zmq.Socket[bytes], address: str) -> bool:
    try:
        socket_.bind(address)
    except zmq.ZMQError:  # a closed socket's port is freed by libzmq's I/O thread, a moment later
        return False
    return True


def test_a_publisher_that_restarts_costs_no_new_socket() -> None:
    first = FakeVLLM(seed=1).start()
    with KVEventSubscriber(events_router(), "gpu0", first.endpoint, reconnect_backoff=(0.01, 0.02)) as sub:
        try:
            first.complete(list(range(64)))
            settle(first, sub)
        finally:
            first.stop()  # the connection drops after its handshake: libzmq reconnects, to the next process
        with FakeVLLM(seed=2, port=int(first.endpoint.rsplit(":", 1)[1])) as second:
            second.complete(list(range(64)))
            settle(second, sub)
        stats = sub.stats()
        # settle(): the second process was heard. At most one handshake failed: the old process closing during one.
        assert stats.reconnects == 0 and stats.handshake_failures <= 1


def test_a_frame_over_the_size_cap_is_never_read_and_the_stream_goes_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A peer sending a huge frame (garbage on the port, a hostile one) loses its connection before the frame is read
    into memory; libzmq does not reconnect after that, the subscriber does, and the batches after it are applied."""
    monkeypatch.setattr(subscriber_module, "MAX_MESSAGE_BYTES", 2**16)  # read when the sockets are made
    router = events_router()
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    seq = iter(range(10_000))
    try:
        with KVEventSubscriber(router, "gpu0", f"tcp://127.0.0.1:{port}", reconnect_backoff=(0.01, 0.02)) as sub:

            def heard_after(before: int) -> Callable[[], bool]:
                def heard() -> bool:  # what a PUB sends while no SUB is connected is dropped: resend, numbered
                    if sub.last_seq > before:
                        return True
                    pub.send_multipart([b"", numbered(next(seq)), STORED])
                    time.sleep(0.02)
                    return False

                return heard

            wait_until(heard_after(-1), what="the subscriber to connect")
            base = sub.stats()
            oversized = next(seq)
            pub.send_multipart([b"", numbered(oversized), b"\xc1" * (2**16 + 1)])  # had it been read: invalid
            wait_until(heard_after(oversized), what="a batch after the oversized frame")
            stats = sub.stats()
            assert stats.invalid_batches == base.invalid_batches == 0
            assert stats.reconnects == 1 and stats.handshake_failures == 0
    finally:
        context.destroy(linger=0)
    assert f"frame over {2**16} bytes" in caplog.text


def test_the_size_cap_holds_vllms_largest_batches_ten_times_over() -> None:
    # One step storing the blocks of a million-token prompt: 32-byte block hashes (sha256), ids of a 152K vocabulary.
    tokens = [151_000 + i % 900 for i in range(2**20)]
    hashes = [i.to_bytes(32, "big") for i in range(len(tokens) // 16)]
    batch = msgspec.msgpack.encode([1.0, [["BlockStored", hashes, None, tokens, 16, None, "GPU", None, None]]])
    assert 10 * len(batch) < subscriber_module.MAX_MESSAGE_BYTES and len(batch) < 8 * 2**20
