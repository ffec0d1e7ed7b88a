"""How the subscriber recovers a gap in the sequence, and what its stats and log say of what could not be recovered
(found by mutation testing of vllm/subscriber.py: _recover, _replay, _apply_payload).

docs/vllm.md, "Lost messages, restarts, late start", says what these check.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from prefixroute.testing import FakeVLLM
from prefixroute.vllm import KVEventSubscriber
from prefixroute.vllm import subscriber as subscriber_module

from ..conftest import DEADLINE_S, wait_until
from .conftest import fresh
from .test_subscriber import NotZMQ
from .test_vllm_blackbox import (
    Publisher,
    applied,
    batch_array,
    events_router,
    join,
    own,
    publisher,
    removed_array,
    seq_bytes,
    sound,
    stored_batch,
    subscribed,
    tokens,
)

LOGGER = "prefixroute.vllm.subscriber"


def said(caplog: pytest.LogCaptureFixture, part: str) -> list[str]:
    """The subscriber's log messages that contain ``part``, in order."""
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and part in r.getMessage()]


def test_a_gap_whose_first_batch_the_replay_buffer_lost_applies_the_rest_once_and_is_one_unrecovered_gap(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The replay starts after the gap's start (the buffer no longer holds it): what it has is applied in order, a
    garbage batch among them is counted and logged by its number, and the gap is one unrecovered gap, logged with
    the batches it spans. Every count moves by exactly what happened."""
    with publisher() as pub, subscribed(pub) as (router, sub):
        base = sub.last_seq
        before = sub.stats()
        caplog.set_level(logging.DEBUG, logger=LOGGER)
        pub.publish(stored_batch(100, 1, first_hash=1), keep=False, send=False)  # lost live and from the buffer
        pub.publish(b"\xc1 not msgpack", send=False)  # lost live; garbage in the buffer
        pub.publish(stored_batch(200, 1, first_hash=3), send=False)
        pub.publish(stored_batch(216, 1, parent=3, first_hash=4), send=False)
        last = pub.publish(stored_batch(232, 1, parent=4, first_hash=5))
        wait_until(applied(sub, last))
        after = sub.stats()
        assert pub.requests[-1] == base + 1
        moved = {
            name: getattr(after, name) - getattr(before, name)
            for name in ("gaps", "unrecovered_gaps", "replayed_batches", "invalid_batches", "batches", "events")
        }
        assert moved == {
            "gaps": 1, "unrecovered_gaps": 1, "replayed_batches": 3, "invalid_batches": 1, "batches": 3, "events": 3,
        }  # fmt: skip
        assert (after.failed_replays, after.bad_sequences, after.restarts) == (
            before.failed_replays, before.bad_sequences, before.restarts,
        )  # fmt: skip
        assert router.index.hashes("gpu0") == own(tokens(200, 3))
        assert (after.backend, after.last_seq, after.blocks_held) == ("gpu0", last, 3)
        (skipped,) = said(caplog, "skipping batch")
        assert skipped.startswith(
            f"KV events from gpu0: skipping batch {base + 2} (1 invalid so far): KV event payload is not valid msgpack"
        )
        assert said(caplog, "are lost") == [
            f"KV events from gpu0: some of batches {base + 1}..{base + 4} are lost (replay could not supply them "
            "all); the index may miss updates"
        ]
        sound(router, sub)


def test_without_a_replay_endpoint_a_gap_is_one_unrecovered_gap_logged_as_replay_not_configured(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with publisher() as pub:
        router = events_router()
        with KVEventSubscriber(router, "gpu0", pub.endpoint, topic=pub.topic.decode()) as sub:
            join(pub, sub)
            base = sub.last_seq
            before = sub.stats()
            caplog.clear()
            pub.publish(stored_batch(100, 1, first_hash=1), send=False)
            pub.publish(stored_batch(116, 1, parent=1, first_hash=2), send=False)
            last = pub.publish(stored_batch(200, 1, first_hash=3))
            wait_until(applied(sub, last))
            after = sub.stats()
            assert pub.requests == []
            assert (after.gaps - before.gaps, after.unrecovered_gaps - before.unrecovered_gaps) == (1, 1)
            assert (after.replayed_batches, after.failed_replays) == (before.replayed_batches, before.failed_replays)
            assert router.index.hashes("gpu0") == own(tokens(200, 1))
            assert said(caplog, "are lost") == [
                f"KV events from gpu0: some of batches {base + 1}..{base + 2} are lost (replay not configured); the "
                "index may miss updates"
            ]
            sound(router, sub)
        assert not sub.running


def test_a_replay_that_goes_silent_after_a_batch_keeps_it_and_is_a_failed_replay_logged_with_what_it_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No end-of-replay frame within ``replay_timeout``: the batch it did send is applied, the rest of the gap is
    lost, and the warning says which replay failed, where, why and how many batches it kept (the timeout leaves
    room for that batch to arrive on a loaded machine). Each such replay is counted: two of them, two failed
    replays."""

    def first_only(pub: Publisher, client: bytes, start: int) -> None:
        pub.reply([client, b"", pub.topic, seq_bytes(start), pub.buffer[start]])

    with publisher() as pub, subscribed(pub, replay_timeout=0.5) as (router, sub):
        before = sub.stats()
        caplog.clear()
        pub.replay_mode = first_only
        starts = []
        for start in (100, 300):
            starts.append(pub.publish(stored_batch(start, 1, first_hash=start), send=False))
            pub.publish(stored_batch(start + 16, 1, parent=start, first_hash=start + 1), send=False)
            last = pub.publish(stored_batch(start + 100, 1, first_hash=start + 2))
            wait_until(applied(sub, last))
        after = sub.stats()
        moved = {
            name: getattr(after, name) - getattr(before, name)
            for name in ("gaps", "failed_replays", "unrecovered_gaps", "replayed_batches", "batches")
        }
        assert moved == {"gaps": 2, "failed_replays": 2, "unrecovered_gaps": 2, "replayed_batches": 2, "batches": 4}
        assert router.index.hashes("gpu0") == own(tokens(100, 1)) | own(tokens(200, 1)) | own(tokens(300, 1)) | own(
            tokens(400, 1)
        )
        assert said(caplog, "replay of batches") == [
            f"KV events from gpu0: the replay of batches from {start} from {pub.replay_endpoint} failed (no end of "
            "replay within 0.5s); 1 batches kept, live events go on"
            for start in starts
        ]
        sound(router, sub)


def test_stop_ends_a_replay_in_progress_without_waiting_for_its_timeout(caplog: pytest.LogCaptureFixture) -> None:
    """A replay waits for its answer in short polls that look whether stop() was called: a stop during a replay
    that would last far longer than stop's own timeout still ends the thread, and is neither a failed replay nor an
    error. The batches it did not bring are missing from the index, so they count as lost, but a stop is no fault:
    said at info level, with why (was: warned about as a replay that could not supply them)."""
    with publisher() as pub, subscribed(pub, replay_timeout=30 * DEADLINE_S) as (router, sub):
        base = sub.last_seq
        before = sub.stats()
        caplog.clear()
        caplog.set_level(logging.INFO, logger="prefixroute")
        pub.replay_mode = "silent"
        pub.publish(stored_batch(100, 1, first_hash=1), send=False)
        pub.publish(stored_batch(116, 1, parent=1, first_hash=2))
        wait_until(lambda: base + 1 in pub.requests, what="the gap's replay asked for")
        sub.stop(timeout=DEADLINE_S)
        assert not sub.running
        after = sub.stats()
        assert (after.failed_replays, after.invalid_batches) == (before.failed_replays, before.invalid_batches)
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
        assert after.unrecovered_gaps == before.unrecovered_gaps + 1
        assert any(
            r.levelno == logging.INFO
            and r.getMessage().endswith("(replay cut short by stop()); the index may miss updates")
            for r in caplog.records
        )
        router._check()


def test_garbage_in_a_replay_costs_only_itself_and_the_batches_after_it_fill_the_gap() -> None:
    """Replies of the wrong shape, one numbered before the gap or negative (but -1, the end), and a duplicate are
    dropped, and the replay reads on: the gap is filled, each batch applied once, nothing counted as lost or
    invalid."""
    with publisher() as pub, subscribed(pub) as (router, sub):
        base = sub.last_seq
        before = sub.stats()
        gap = {base + n: stored_batch(84 + 16 * n, 1, parent=n - 1 or None, first_hash=n) for n in (1, 2, 3)}

        def interleaved(pub: Publisher, client: bytes, start: int) -> None:
            def send(seq: int, payload: bytes) -> None:
                pub.reply([client, b"", pub.topic, seq_bytes(seq), payload])

            send(start, gap[start])
            pub.reply([client, b"", b"one frame"])
            pub.reply([client, b"", pub.topic, b"\x00\x01", stored_batch(900, 1, first_hash=9)])  # a 2-byte number
            send(start - 1, stored_batch(900, 1, first_hash=9))  # before what was asked for
            send(-7, stored_batch(900, 1, first_hash=9))  # negative, and not the end of the replay (-1)
            send(start, gap[start])  # a duplicate
            send(start + 1, gap[start + 1])
            send(start + 2, gap[start + 2])
            pub.reply([client, b"", b"", seq_bytes(-1), b""])

        pub.replay_mode = interleaved
        for seq, payload in gap.items():
            pub.publish(payload, seq=seq, send=False)
        last = pub.publish(stored_batch(148, 1, parent=3, first_hash=4))
        wait_until(applied(sub, last))
        after = sub.stats()
        moved = {
            name: getattr(after, name) - getattr(before, name)
            for name in ("gaps", "replayed_batches", "batches", "unrecovered_gaps", "failed_replays", "invalid_batches")
        }
        assert moved == {
            "gaps": 1, "replayed_batches": 3, "batches": 4, "unrecovered_gaps": 0, "failed_replays": 0,
            "invalid_batches": 0,
        }  # fmt: skip
        assert router.index.hashes("gpu0") == own(tokens(100, 4))
        sound(router, sub)


def test_a_replay_that_passes_the_gaps_last_batch_ends_there_and_the_live_batch_still_applies() -> None:
    """The engine's buffer lacks the gap's last batch and answers the next: the replay ends at once with what came
    before, the missing batch is one unrecovered gap, and the live batch that revealed the gap is applied."""
    with publisher() as pub, subscribed(pub) as (router, sub):
        base = sub.last_seq
        before = sub.stats()
        pub.publish(stored_batch(100, 1, first_hash=1), send=False)
        pub.publish(stored_batch(116, 1, parent=1, first_hash=2), keep=False, send=False)  # lost for good
        last = pub.publish(stored_batch(200, 1, first_hash=3))
        wait_until(applied(sub, last))
        after = sub.stats()
        moved = {
            name: getattr(after, name) - getattr(before, name)
            for name in ("gaps", "replayed_batches", "unrecovered_gaps", "failed_replays", "invalid_batches")
        }
        assert moved == {"gaps": 1, "replayed_batches": 1, "unrecovered_gaps": 1, "failed_replays": 0,
                         "invalid_batches": 0}  # fmt: skip
        assert pub.requests[-1] == base + 1
        assert router.index.hashes("gpu0") == own(tokens(100, 1)) | own(tokens(200, 1))
        sound(router, sub)


def test_a_removal_in_a_batch_the_replay_cannot_supply_is_lost_too_and_reset_drops_what_it_left() -> None:
    """An unrecovered gap can leave blocks the engine has evicted in the index (their removal was in a lost batch),
    as docs/vllm.md says; the subscriber counts the gap, and reset() is how a health check drops what it left. Its
    replay then brings back what the engine's buffer still holds (was: nothing until the engine published again)."""
    with publisher() as pub, subscribed(pub) as (router, sub):
        before = sub.stats()
        stored = pub.publish(stored_batch(100, 1, first_hash=1))
        wait_until(applied(sub, stored))
        pub.publish(batch_array([removed_array([1])], rank=0), keep=False, send=False)  # evicted; the news lost
        last = pub.publish(stored_batch(200, 1, first_hash=2))
        wait_until(applied(sub, last))
        assert sub.stats().unrecovered_gaps == before.unrecovered_gaps + 1
        assert router.index.hashes("gpu0") == own(tokens(100, 1)) | own(tokens(200, 1))  # 100's block is stale
        for seq in [seq for seq in pub.buffer if seq <= stored]:  # vLLM's buffer loses its oldest batches first:
            del pub.buffer[seq]  # one that lost the removal has lost the store before it too
        sub.reset()
        assert router.index.hashes("gpu0") == set()
        wait_until(lambda: router.index.hashes("gpu0") == own(tokens(200, 1)), what="the reset's replay, no batch sent")
        assert sub.last_seq == last
        sound(router, sub)


@contextlib.contextmanager
def _replay_endpoint(kind: str) -> Iterator[str]:
    """An endpoint that is no replay socket: an HTTP server, a PUB socket (another engine's publisher), or a port
    nothing listens on."""
    if kind == "http":
        server = NotZMQ()
        try:
            yield f"tcp://127.0.0.1:{server.port}"
        finally:
            server.close()
        return
    context: zmq.Context[Any] = zmq.Context()
    try:
        socket_ = context.socket(zmq.PUB)
        endpoint = f"tcp://127.0.0.1:{socket_.bind_to_random_port('tcp://127.0.0.1')}"
        if kind == "nothing":
            socket_.unbind(endpoint)
        yield endpoint
    finally:
        context.destroy(linger=0)


@pytest.mark.parametrize(
    ("kind", "why"),
    [
        ("http", "{endpoint} does not answer as a ZMQ replay socket: is it vLLM's replay_endpoint?"),
        ("pub", "{endpoint} does not answer as a ZMQ replay socket: is it vLLM's replay_endpoint?"),
        ("nothing", "no connection could be made to it"),
    ],
)
def test_a_replay_endpoint_that_is_no_replay_socket_is_named_as_the_failure(
    kind: str, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Was: each gap's replay ended in "no end of replay within 0.5s", the same words as an engine slow to answer,
    though the endpoint was vLLM's HTTP port, a publisher, or nothing at all."""
    router = events_router()
    with publisher() as pub, _replay_endpoint(kind) as endpoint:
        sub = KVEventSubscriber(
            router, "gpu0", pub.endpoint, replay_endpoint=endpoint, topic=pub.topic.decode(), replay_timeout=0.5
        )
        with sub:
            join(pub, sub)  # a late start's replay from 0 fails the same way first
            failed = sub.stats().failed_replays
            start = pub.publish(stored_batch(100, 1, first_hash=1), send=False)
            last = pub.publish(stored_batch(200, 1, first_hash=2))
            wait_until(applied(sub, last))
            assert sub.stats().failed_replays == failed + 1
            sound(router, sub)
    assert said(caplog, f"replay of batches from {start} ") == [
        f"KV events from gpu0: the replay of batches from {start} from {endpoint} failed (no end of replay within "
        f"0.5s: {why.format(endpoint=endpoint)}); 0 batches kept, live events go on"
    ]


def test_a_replay_whose_connection_is_dropped_for_an_oversized_frame_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """libzmq drops the replay socket's connection, unread, at a frame over the cap, and never reconnects it: the
    replay gets no end, and the warning says the connection was dropped, not that the engine was slow."""
    monkeypatch.setattr(subscriber_module, "MAX_MESSAGE_BYTES", 2**16)  # read when the sockets are made

    def oversized(pub: Publisher, client: bytes, start: int) -> None:
        pub.reply([client, b"", pub.topic, seq_bytes(start), b"\x00" * 2**17])

    with publisher() as pub, subscribed(pub, replay_timeout=0.5) as (router, sub):
        pub.replay_mode = oversized
        failed = sub.stats().failed_replays
        start = pub.publish(stored_batch(100, 1, first_hash=1), send=False)
        last = pub.publish(stored_batch(200, 1, first_hash=2))
        wait_until(applied(sub, last))
        assert sub.stats().failed_replays == failed + 1 and sub.stats().invalid_batches == 0  # never decoded
        sound(router, sub)
    assert said(caplog, f"replay of batches from {start} ") == [
        f"KV events from gpu0: the replay of batches from {start} from {pub.replay_endpoint} failed (no end of "
        "replay within 0.5s: the connection was dropped, by a frame over MAX_MESSAGE_BYTES or an engine gone); 0 "
        "batches kept, live events go on"
    ]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_subscriber_started_before_its_engine_replays_the_engines_first_batches_once_it_connects() -> None:
    """Was: the catch-up replay ran at the first quiet poll after connect(), with no engine there yet: it failed
    (a failed replay, a warning) and was not tried again, so the batches the engine published before the subscription
    took effect were missing until it published once more."""
    port, replay_port = _free_port(), _free_port()
    router = events_router()
    with KVEventSubscriber(
        router, "gpu0", f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        replay_timeout=0.2,
    ) as sub:  # fmt: skip
        time.sleep(0.5)  # the engine is not there yet: longer than a replay would wait for it
        engine = FakeVLLM(num_blocks=64, port=port, replay_port=replay_port)
        engine.drop_next(2)  # published before anyone subscribed: only its replay buffer has them
        engine.complete(fresh())
        engine.complete(fresh())
        with engine:  # and then it goes quiet
            wait_until(lambda: router.index.hashes("gpu0") == engine.own_hashes() != set(), what="the catch-up")
            stats = sub.stats()
            assert (stats.last_seq, stats.replayed_batches, stats.failed_replays) == (1, 2, 0)
            sound(router, sub)


def _bound(pub_socket: zmq.Socket[Any], endpoint: str) -> bool:
    """Bind ``pub_socket`` to ``endpoint``; False while the socket closed there still holds it (libzmq closes later)."""
    try:
        pub_socket.bind(endpoint)
    except zmq.ZMQError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        return False
    return True


def test_the_batches_published_while_the_connection_was_down_are_replayed_as_it_comes_back() -> None:
    """Was: libzmq reconnected the SUB socket by itself, and what the engine published meanwhile was replayed only
    when its next batch showed the gap; now the new session's handshake asks for a catch-up."""
    with publisher() as pub, subscribed(pub) as (router, sub):
        first = pub.publish(stored_batch(100, 1, first_hash=1))
        wait_until(applied(sub, first))
        before = sub.stats()
        pub.pub.close(0)  # the publisher's socket goes away: the subscriber's connection drops
        lost = [pub.publish(stored_batch(200 + 16 * i, 1, first_hash=2 + i), send=False) for i in range(3)]
        with pub._lock:
            pub.pub = pub.ctx.socket(zmq.PUB)
            pub.pub.setsockopt(zmq.LINGER, 0)
            wait_until(lambda: _bound(pub.pub, pub.endpoint), what="the address free again")  # libzmq reconnects
        wait_until(applied(sub, lost[-1]), what="the batches published while down, with no batch after them")
        assert router.index.hashes("gpu0") == own(tokens(100, 1)).union(
            *(own(tokens(200 + 16 * i, 1)) for i in range(3))
        )
        after = sub.stats()
        assert (after.replayed_batches - before.replayed_batches, after.failed_replays) == (3, before.failed_replays)
        sound(router, sub)
