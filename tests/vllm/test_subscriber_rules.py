"""The subscriber's documented rules, each pinned at its edge (found by mutation testing of vllm/subscriber.py).

docs/vllm.md, "Lost messages, restarts, late start", and the KVEventSubscriber docstring say what these check.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import pytest
import zmq

from prefixroute import Router
from prefixroute.errors import StateError
from prefixroute.index import IndexUpdate
from prefixroute.vllm import KVEventSubscriber

from ..conftest import DEADLINE_S, returns, wait_until
from .test_subscriber import BlockingWriter, ResettingWriter
from .test_vllm_blackbox import (
    Publisher,
    applied,
    batch_array,
    events_router,
    join,
    own,
    publisher,
    seq_bytes,
    sound,
    stored_batch,
    subscribed,
    tokens,
)


def test_a_repeated_0_is_held_back_not_skipped_and_the_next_batch_makes_it_a_restart() -> None:
    """0 is where a restarted engine begins: a 0 after a 0 is the new stream's first batch once 1 follows it."""
    with publisher() as pub, subscribed(pub) as (router, sub):
        pub.buffer.clear()  # first: the reset's replay would apply the batches it holds again
        sub.reset()  # the next batch starts a new stream: 0 is then the last number seen
        first = pub.publish(stored_batch(100, 1, first_hash=1), seq=0)
        wait_until(applied(sub, first))
        before = sub.stats()
        pub.publish(stored_batch(200, 1, first_hash=2), seq=0)  # the engine restarted after one batch
        last = pub.publish(stored_batch(300, 1, first_hash=3), seq=1)
        wait_until(applied(sub, last))
        after = sub.stats()
        assert (after.restarts - before.restarts, after.bad_sequences - before.bad_sequences) == (1, 0)
        assert router.index.hashes("gpu0") == own(tokens(200, 1)) | own(tokens(300, 1))
        sound(router, sub)


def test_a_repeated_0_that_the_next_batch_does_not_continue_costs_only_itself() -> None:
    """Held back, a corrupt 0 is skipped when the next number does not follow it: the blocks stay, no restart."""
    with publisher() as pub, subscribed(pub) as (router, sub):
        pub.buffer.clear()
        sub.reset()
        first = pub.publish(stored_batch(100, 1, first_hash=1), seq=0)
        wait_until(applied(sub, first))
        before = sub.stats()
        pub.publish(stored_batch(200, 1, first_hash=2), seq=0)
        pub.publish(batch_array([]), seq=1, send=False)  # lost live: the replay brings it
        last = pub.publish(stored_batch(300, 1, first_hash=3), seq=2)
        wait_until(applied(sub, last))
        after = sub.stats()
        assert (after.restarts - before.restarts, after.bad_sequences - before.bad_sequences) == (0, 1)
        assert router.index.hashes("gpu0") == own(tokens(100, 1)) | own(tokens(300, 1))
        sound(router, sub)


def test_a_jump_of_max_sequence_jump_is_believed_at_once_and_one_more_is_held_back() -> None:
    """``max_sequence_jump`` counts the numbers skipped: that many missing batches are a gap, replayed at once; one
    more and the number waits for the next message to continue it (here none does: it is skipped)."""
    with publisher() as pub, subscribed(pub, max_sequence_jump=2) as (router, sub):
        base = sub.last_seq
        before = sub.stats()
        for seq in (base + 1, base + 2):
            pub.publish(batch_array([]), seq=seq, send=False)  # lost live, in the replay buffer
        jump = pub.publish(stored_batch(100, 1, first_hash=1), seq=base + 3)  # two skipped: a gap
        wait_until(applied(sub, jump), what="the jump of max_sequence_jump applied without waiting")
        pub.publish(stored_batch(200, 1, first_hash=2), seq=base + 7)  # three skipped: held back
        last = pub.publish(stored_batch(300, 1, first_hash=3), seq=base + 4)  # does not continue it
        wait_until(lambda: sub.last_seq == last, what="the batch after the one held back")
        after = sub.stats()
        assert (after.gaps - before.gaps, after.bad_sequences - before.bad_sequences) == (1, 1)
        assert (after.restarts, after.unrecovered_gaps) == (before.restarts, before.unrecovered_gaps)
        assert router.index.hashes("gpu0") == own(tokens(100, 1)) | own(tokens(300, 1))
        sound(router, sub)


def test_a_reconnect_backoff_whose_low_equals_its_high_is_a_constant_backoff() -> None:
    sub = KVEventSubscriber(events_router(), "gpu0", "tcp://127.0.0.1:1", reconnect_backoff=(0.5, 0.5))
    assert not sub.running


@pytest.mark.parametrize("backoff", [(1e-6, 1e-6), (0.1, 1e9)], ids=["under-a-millisecond", "years"])
def test_a_reconnect_backoff_beyond_what_a_zmq_socket_takes_is_clamped_not_a_socket_error(
    backoff: tuple[float, float],
) -> None:
    """libzmq takes its reconnect intervals as C ints of milliseconds: the subscriber clamps them into that range."""
    with publisher() as pub, subscribed(pub, reconnect_backoff=backoff) as (router, sub):
        last = pub.publish(stored_batch(100, 1, first_hash=1))
        wait_until(applied(sub, last))
        assert sub.stats().reconnects == 0
        assert router.index.hashes("gpu0") == own(tokens(100, 1))
        sound(router, sub)


def test_reset_drops_the_backends_blocks_from_the_index_at_once_and_forgets_the_sequence() -> None:
    with publisher() as pub, subscribed(pub) as (router, sub):
        last = pub.publish(stored_batch(100, 2, first_hash=1))
        wait_until(applied(sub, last))
        assert router.index.hashes("gpu0") == own(tokens(100, 2))
        sub.reset()
        assert router.index.hashes("gpu0") == sub.held() == set()
        assert sub.last_seq == -1


def test_a_reset_the_writer_makes_inside_its_write_drops_that_writes_blocks_as_it_returns() -> None:
    """docs/vllm.md: such a reset "takes effect as that write returns, after the updates it was writing"."""
    router = events_router()
    writer = ResettingWriter(router)
    with publisher() as pub:
        sub = KVEventSubscriber(writer, "gpu0", pub.endpoint, replay_endpoint=pub.replay_endpoint)
        with sub:
            join(pub, sub)  # empty batches: no write stores a block, none resets
            writer.subscriber = sub
            pub.publish(stored_batch(100, 2, first_hash=1), keep=False)  # its write resets; no replay brings it back
            wait_until(lambda: writer.resets == 1, what="the write that resets")
            last = pub.publish(stored_batch(300, 1, first_hash=3))  # a new stream's first batch to the subscriber
            wait_until(applied(sub, last))
            assert router.index.hashes("gpu0") == sub.held() == own(tokens(300, 1))
            assert sub.stats().write_errors == 0
            sound(router, sub)


class FailingContext(zmq.Context):  # type: ignore[type-arg]
    """A ZMQ context whose first ``failures`` sockets cannot be made (a process out of file descriptors)."""

    failures = 0

    def socket(self, *args: Any, **kwargs: Any) -> Any:
        if FailingContext.failures:
            FailingContext.failures -= 1
            raise zmq.ZMQError(errno.EMFILE)
        return super().socket(*args, **kwargs)


class RecordingStop(threading.Event):
    """A stop event that records how long the thread asks to wait between reconnects, and does not wait."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        assert timeout is not None
        self.waits.append(timeout)
        return self.is_set()


def test_socket_errors_reconnect_with_exponential_backoff_from_low_capped_at_high(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """docs/vllm.md: "socket errors rebuild the socket with the same backoff" (``reconnect_backoff=(low, high)``)."""
    with publisher() as pub:
        sub = KVEventSubscriber(events_router(), "gpu0", pub.endpoint, reconnect_backoff=(1.0, 3.0))
        stop = sub._stop = RecordingStop()
        FailingContext.failures = 5
        with monkeypatch.context() as patch:
            patch.setattr(zmq, "Context", FailingContext)
            sub.start()  # only the subscriber's context fails
        try:
            join(pub, sub)  # the sixth socket is made: events flow
            assert stop.waits == [1.0, 2.0, 3.0, 3.0, 3.0]
            assert (sub.stats().reconnects, FailingContext.failures) == (5, 0)
        finally:
            sub.stop()
        assert not sub.running


class BreakingSocket(zmq.Socket):  # type: ignore[type-arg]
    """A socket whose next receive raises ``BreakingSocket.fault`` once it is set (a socket gone bad mid-stream)."""

    fault: Exception | None = None

    def recv_multipart(self, flags: int = 0, copy: bool = True, track: bool = False) -> Any:
        fault, BreakingSocket.fault = BreakingSocket.fault, None
        if fault is not None:
            raise fault
        return super().recv_multipart(flags, copy=copy, track=track)


class BreakingContext(FailingContext):
    """A :class:`FailingContext` whose sockets are :class:`BreakingSocket` s."""

    _socket_class = BreakingSocket


def test_a_session_that_worked_before_it_failed_reconnects_after_the_low_backoff_and_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The backoff grows over failures in a row, and starts again from ``low`` once a session has applied events.
    Was: it never started again (only a session that returned reset it, and one returns only when stopped), so a
    subscriber that had failed a few times at start waited ``high`` after any later error, however long it had run."""
    with publisher() as pub:
        sub = KVEventSubscriber(
            events_router(), "gpu0", pub.endpoint, replay_endpoint=pub.replay_endpoint, topic=pub.topic.decode(),
            reconnect_backoff=(1.0, 8.0),
        )  # fmt: skip
        stop = sub._stop = RecordingStop()
        FailingContext.failures = 2  # two sockets in a row cannot be made: waits of 1 s, then 2 s
        with monkeypatch.context() as patch:
            patch.setattr(zmq, "Context", BreakingContext)
            sub.start()
        try:
            join(pub, sub)  # the third session works
            assert stop.waits == [1.0, 2.0]
            BreakingSocket.fault = RuntimeError("a bug in the receive path")  # then breaks
            join(pub, sub)  # a fourth session follows the stream
            assert stop.waits == [1.0, 2.0, 1.0]
            assert sub.stats().reconnects == 3
        finally:
            BreakingSocket.fault = None
            sub.stop()
        assert not sub.running
    logged = [r for r in caplog.records if "reconnecting in" in r.getMessage()]
    assert [r.levelno for r in logged] == [logging.WARNING, logging.WARNING, logging.ERROR]
    for record, wait in zip(logged, stop.waits, strict=True):  # which engine, why, and how long until the next try
        assert record.getMessage().startswith(f"KV events from {pub.endpoint}: "), record.getMessage()
        assert record.getMessage().endswith(f"; reconnecting in {wait:.1f}s"), record.getMessage()
    assert str(zmq.ZMQError(errno.EMFILE)) in logged[0].getMessage()
    assert "unexpected error" in logged[2].getMessage() and logged[2].exc_info is not None
    assert str(logged[2].exc_info[1]) == "a bug in the receive path"


class CountingWriter(BlockingWriter):
    """A writer whose writes wait for ``release`` (so messages queue up behind the first) and are recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[list[IndexUpdate]] = []

    def write(self, backend: str, updates: Iterable[IndexUpdate]) -> None:
        self.writes.append(list(updates))
        super().write(backend, updates)


def test_each_write_carries_at_most_max_batches_per_apply_batches() -> None:
    writer = CountingWriter()
    with publisher() as pub:
        sub = KVEventSubscriber(writer, "gpu0", pub.endpoint, topic=pub.topic.decode(), max_batches_per_apply=3)
        with sub:
            join(pub, sub)  # empty batches: nothing to write
            pub.publish(stored_batch(0, 1, first_hash=1))
            wait_until(writer.entered.is_set, what="the first write")
            last = 0
            for n in range(1, 11):  # ten batches of one stored block each, queued behind the stuck write
                last = pub.publish(stored_batch(n * 16, 1, first_hash=n + 1))
            time.sleep(0.2)  # time to reach the subscriber's socket (a shorter wait only lets fewer queue up)
            writer.release.set()
            wait_until(applied(sub, last))
        stored = [sum(1 for update in updates if update[0]) for updates in writer.writes]
        assert sum(stored) == 11 and max(stored[1:]) <= 3, stored


def test_start_is_idempotent_while_the_thread_runs() -> None:
    with publisher() as pub, subscribed(pub) as (router, sub):
        assert sub.start() is sub
        assert [t.name for t in threading.enumerate()].count("prefixroute-kv-events[gpu0]") == 1
        last = pub.publish(stored_batch(100, 1, first_hash=1))
        wait_until(applied(sub, last))
        sound(router, sub)


def test_start_after_a_stop_that_timed_out_waits_for_the_old_thread_then_starts_a_new_one() -> None:
    writer = CountingWriter()
    with publisher() as pub:
        sub = KVEventSubscriber(writer, "gpu0", pub.endpoint, topic=pub.topic.decode())
        try:
            sub.start()
            join(pub, sub)
            pub.publish(stored_batch(0, 1, first_hash=1))
            wait_until(writer.entered.is_set, what="a write that blocks")
            sub.stop(timeout=0)
            assert sub.running  # the old thread is still in the writer
            old = [t for t in threading.enumerate() if t.name == "prefixroute-kv-events[gpu0]"]
            threading.Timer(0.1, writer.release.set).start()  # the writer returns while start() waits
            assert sub.start() is sub
            assert not any(t.is_alive() for t in old)
            join(pub, sub)  # the new thread follows the stream
            assert sub.running
        finally:
            writer.release.set()
            sub.stop()
        assert not sub.running


class StuckWriter(BlockingWriter):
    """A writer whose writes wait for ``release`` far longer than any test waits for them."""

    def write(self, backend: str, updates: Iterable[IndexUpdate]) -> None:
        self.entered.set()
        self.release.wait(60)


def test_start_after_a_stop_that_timed_out_raises_a_state_error_while_the_old_thread_stays_stuck() -> None:
    """start() waits for the old thread a bounded time (5 s), then says so rather than start a second thread
    beside it or wait for good."""
    writer = StuckWriter()
    with publisher() as pub:
        sub = KVEventSubscriber(writer, "gpu0", pub.endpoint, topic=pub.topic.decode())
        try:
            sub.start()
            join(pub, sub)  # empty batches: nothing to write
            pub.publish(stored_batch(0, 1, first_hash=1))
            wait_until(writer.entered.is_set, what="a write that blocks")
            sub.stop(timeout=0)

            def restart() -> None:
                with pytest.raises(StateError, match=r"^the KV-event thread of gpu0 has not ended since stop\(\)"):
                    sub.start()

            returns(restart, what="start() beside a stuck thread")  # a hang guard: start() waits 5 s, then raises
            assert sub.running
            assert [t.name for t in threading.enumerate()].count("prefixroute-kv-events[gpu0]") == 1
        finally:
            writer.release.set()
            sub.stop()
        assert not sub.running


@pytest.mark.parametrize("fault", ["lag_observer", "clock"])
def test_a_callback_that_raises_once_is_one_observer_error_and_the_lag_is_measured_again_after(fault: str) -> None:
    """``observer_errors`` counts the rounds whose ``clock`` or ``lag_observer`` raised: exactly one here."""
    calls = {"n": 0}

    def once(*_: object) -> float:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("a bug that shows once")
        return 1_000.0

    lags: list[float] = []
    options: dict[str, Any] = (
        {"clock": once, "lag_observer": lags.append} if fault == "clock" else {"lag_observer": once}
    )
    with publisher() as pub, subscribed(pub, **options) as (router, sub):
        last = pub.publish(batch_array([], ts=990.0))
        wait_until(applied(sub, last))
        stats = sub.stats()
        assert stats.observer_errors == 1
        if fault == "clock":
            assert stats.last_lag_s == 10.0 and lags[-1] == 10.0
        sound(router, sub)


@pytest.mark.parametrize("timeout", [0, threading.TIMEOUT_MAX], ids=["zero", "the-largest"])
def test_stop_takes_any_timeout_from_zero_to_the_largest_a_thread_can_wait(timeout: float) -> None:
    with publisher() as pub, subscribed(pub) as (router, sub):
        sub.stop(timeout=timeout)
        wait_until(lambda: not sub.running, what="the thread to end")


def test_every_gap_and_every_restart_is_counted_once_including_a_gap_right_after_batch_0() -> None:
    with publisher() as pub, subscribed(pub) as (router, sub):
        pub.buffer.clear()  # first: the reset's replay would apply the batches it holds again
        sub.reset()  # a new stream from 0
        before = sub.stats()
        pub.publish(stored_batch(100, 1, first_hash=1), seq=0)
        for lost, last in ((1, 2), (3, 4)):  # a gap after 0, another after 2: each filled from the replay
            pub.publish(stored_batch(100 + lost * 16, 1, parent=lost, first_hash=lost + 1), seq=lost, send=False)
            pub.publish(stored_batch(100 + last * 16, 1, parent=last, first_hash=last + 1), seq=last)
            wait_until(applied(sub, last))
        assert router.index.hashes("gpu0") == own(tokens(100, 5))
        for restart in (1, 2):  # a new engine process each time: numbers from 0 again
            pub.buffer.clear()
            pub.publish(stored_batch(1000 * restart, 1, first_hash=10 * restart), seq=0)
            pub.publish(batch_array([]), seq=1)
            wait_until(lambda: sub.stats().restarts - before.restarts == restart, what=f"restart {restart}")  # noqa: B023
            wait_until(lambda: sub.last_seq == 1, what="the new stream's second batch")
        after = sub.stats()
        assert (after.gaps - before.gaps, after.restarts - before.restarts) == (2, 2)
        assert (after.unrecovered_gaps, after.bad_sequences) == (before.unrecovered_gaps, before.bad_sequences)
        assert router.index.hashes("gpu0") == own(tokens(2000, 1))
        sound(router, sub)


def test_negative_sequence_numbers_are_skipped_even_when_one_continues_the_other() -> None:
    """Negative numbers are read as signed and never believed: -2 after -3 is no stream moving on."""
    with publisher() as pub, subscribed(pub) as (router, sub):
        before = sub.stats()
        for seq in (-3, -2):
            pub.raw([pub.topic, seq_bytes(seq), stored_batch(500, 1, first_hash=5)])
        last = pub.publish(stored_batch(100, 1, first_hash=1))
        wait_until(applied(sub, last))
        after = sub.stats()
        assert after.bad_sequences - before.bad_sequences == 2
        assert (after.gaps, after.restarts, after.unrecovered_gaps) == (
            before.gaps,
            before.restarts,
            before.unrecovered_gaps,
        )
        assert sub.last_seq == last and router.index.hashes("gpu0") == own(tokens(100, 1))
        sound(router, sub)


def test_a_repeat_of_1_is_skipped_and_counted_not_held_back_for_a_restart() -> None:
    """Only 0 is exempt from the repeat rule: a repeated 1 that 2 then follows is no new stream."""
    with publisher() as pub, subscribed(pub) as (router, sub):
        pub.buffer.clear()
        sub.reset()
        pub.publish(stored_batch(100, 1, first_hash=1), seq=0)
        first = pub.publish(stored_batch(116, 1, parent=1, first_hash=2), seq=1)
        wait_until(applied(sub, first))
        before = sub.stats()
        pub.publish(stored_batch(900, 1, first_hash=9), seq=1)  # a repeat
        last = pub.publish(stored_batch(132, 1, parent=2, first_hash=3), seq=2)
        wait_until(applied(sub, last))
        after = sub.stats()
        assert (after.bad_sequences - before.bad_sequences, after.restarts - before.restarts) == (1, 0)
        assert after.invalid_batches == before.invalid_batches
        assert router.index.hashes("gpu0") == own(tokens(100, 3))
        sound(router, sub)


def test_a_jump_beyond_max_sequence_jump_that_the_next_batch_continues_is_a_long_loss_filled_from_the_replay() -> None:
    with publisher() as pub, subscribed(pub, max_sequence_jump=2) as (router, sub):
        base = sub.last_seq
        before = sub.stats()
        for n in range(1, 5):  # four batches lost live, still in the replay buffer
            pub.publish(
                stored_batch(n * 16, 1, parent=n - 1 if n > 1 else None, first_hash=n), seq=base + n, send=False
            )
        pub.publish(stored_batch(80, 1, parent=4, first_hash=5), seq=base + 5)  # held back: four skipped
        last = pub.publish(stored_batch(96, 1, parent=5, first_hash=6), seq=base + 6)  # continues it: believed
        wait_until(applied(sub, last))
        after = sub.stats()
        assert (after.gaps - before.gaps, after.bad_sequences, after.invalid_batches) == (
            1, before.bad_sequences, before.invalid_batches,
        )  # fmt: skip
        assert (after.restarts, after.unrecovered_gaps) == (before.restarts, before.unrecovered_gaps)
        assert router.index.hashes("gpu0") == own(tokens(16, 6))
        sound(router, sub)


@contextlib.contextmanager
def _quiet_engine() -> Iterator[tuple[zmq.Socket[Any], zmq.Socket[Any], bytes, Router, KVEventSubscriber]]:
    """An engine that has published nothing (its PUB an XPUB, which hears the subscription, so a test knows that
    live batches will arrive) and a subscriber started on it, once the subscriber has asked for its catch-up replay
    from 0: ``(engine, replay socket, the replay client's id, router, subscriber)``."""
    context: zmq.Context[Any] = zmq.Context()
    engine = context.socket(zmq.XPUB)
    engine.bind("tcp://127.0.0.1:*")
    replay = context.socket(zmq.ROUTER)
    replay.bind("tcp://127.0.0.1:*")
    router = events_router()
    sub = KVEventSubscriber(
        router,
        "gpu0",
        engine.getsockopt_string(zmq.LAST_ENDPOINT),
        replay_endpoint=replay.getsockopt_string(zmq.LAST_ENDPOINT),
    )
    try:
        sub.start()
        assert engine.poll(DEADLINE_S * 1000) and engine.recv() == b"\x01"  # subscribed to every topic
        assert replay.poll(DEADLINE_S * 1000), "a quiet subscription should ask for a catch-up replay"
        client, _, start = replay.recv_multipart()
        assert int.from_bytes(start, "big") == 0
        yield engine, replay, client, router, sub
    finally:
        sub.stop()
        context.destroy(linger=0)


def test_batches_heard_live_after_the_catch_up_replay_applied_them_are_duplicates_not_a_restart() -> None:
    """A subscriber that connects to a quiet engine replays its buffer; batches published while that replay runs
    reach it again, live, after it: the same number with the same bytes is skipped, not taken for a restart (which
    counted a restart that never happened and dropped the backend's blocks until the stream re-applied them)."""
    batches = [stored_batch(100 + 16 * i, 1, parent=i or None, first_hash=i + 1) for i in range(3)]
    with _quiet_engine() as (engine, replay, client, router, sub):
        for seq, payload in enumerate(batches):  # published while the replay runs: queued on the SUB socket
            engine.send_multipart([b"kv", seq_bytes(seq), payload])
        for seq, payload in enumerate(batches):
            replay.send_multipart([client, b"", b"kv", seq_bytes(seq), payload])
        replay.send_multipart([client, b"", b"", seq_bytes(-1), b""])
        engine.send_multipart([b"kv", seq_bytes(3), batch_array([])])
        wait_until(applied(sub, 3))
        stats = sub.stats()
        assert (stats.restarts, stats.bad_sequences, stats.replayed_batches, stats.batches) == (0, 0, 3, 4)
        assert router.index.hashes("gpu0") == own(tokens(100, 3))
        # A real restart right after: its 0 and 1 are not the replayed batches' bytes.
        engine.send_multipart([b"kv", seq_bytes(0), stored_batch(500, 1, first_hash=9)])
        engine.send_multipart([b"kv", seq_bytes(1), batch_array([])])
        wait_until(lambda: sub.last_seq == 1, what="the restarted stream's second batch")
        assert sub.stats().restarts == 1
        assert router.index.hashes("gpu0") == own(tokens(500, 1))
        sound(router, sub)


def test_a_quiet_engine_is_asked_for_one_catch_up_replay_per_connection_not_one_per_quiet_moment() -> None:
    """The catch-up replay of a new connection is one request: neither the quiet after it nor the quiet after live
    batches asks the engine's replay socket again."""
    with _quiet_engine() as (engine, replay, client, router, sub):
        replay.send_multipart([client, b"", b"kv", seq_bytes(0), stored_batch(100, 1, first_hash=1)])
        replay.send_multipart([client, b"", b"", seq_bytes(-1), b""])
        wait_until(applied(sub, 0), what="the catch-up replay applied")
        for seq in (1, 2):  # quiet after the catch-up, then quiet after a live batch
            time.sleep(0.5)  # ten quiet polls' time: the one way to show that none of them asks again
            assert not replay.poll(0), f"the engine was asked for another replay before batch {seq}"
            engine.send_multipart(
                [b"kv", seq_bytes(seq), stored_batch(100 + 16 * seq, 1, parent=seq, first_hash=seq + 1)]
            )
            wait_until(applied(sub, seq))
        time.sleep(0.5)
        assert not replay.poll(0), "the engine was asked for another replay after the live batches"
        stats = sub.stats()
        assert (stats.replayed_batches, stats.failed_replays, stats.reconnects) == (1, 0, 0)
        assert router.index.hashes("gpu0") == own(tokens(100, 3))
        sound(router, sub)


def test_a_process_that_never_stops_its_subscriber_still_exits() -> None:
    """The subscriber's thread does not hold the interpreter up: a script that forgets stop() still ends."""
    code = (
        "from prefixroute import Router\n"
        "from prefixroute.vllm import EventIndex, KVEventSubscriber\n"
        "sub = KVEventSubscriber(Router(index=EventIndex(16)), 'gpu0', 'tcp://127.0.0.1:1').start()\n"
        "assert sub.running\n"
    )
    # A hang guard, not a measure: the script ends in a second or two; a thread that held it up would never end.
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert (done.returncode, done.stderr) == (0, "")


def test_the_catch_up_after_a_reconnect_skips_a_jump_no_batch_continues_and_believes_one_that_is_continued(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A new session replays what came after the last batch seen; in that replay, as live, a number more than
    ``max_sequence_jump`` ahead is believed only when the next batch continues from it (a long loss, counted as
    unrecovered), and is otherwise skipped (one corrupt number costs one batch)."""
    lags: list[float] = []
    with publisher() as pub:
        router = events_router()
        sub = KVEventSubscriber(
            router, "gpu0", pub.endpoint, replay_endpoint=pub.replay_endpoint, topic=pub.topic.decode(),
            max_sequence_jump=2, reconnect_backoff=(0.02, 0.2), lag_observer=lags.append,
        )  # fmt: skip
        with monkeypatch.context() as patch:
            patch.setattr(zmq, "Context", BreakingContext)
            sub.start()
        try:
            join(pub, sub)
            base = sub.last_seq
            before = sub.stats()
            heard = len(lags)
            plan = {  # max_sequence_jump=2: up to two numbers skipped are a gap, three or more a jump
                base + 1: stored_batch(100, 1, first_hash=1),
                base + 5: stored_batch(200, 1, first_hash=2),  # three skipped, and base + 8 does not follow: skipped
                base + 8: stored_batch(300, 1, first_hash=3),  # six skipped, but base + 9 follows: believed
                base + 9: stored_batch(316, 1, parent=3, first_hash=4),
                base + 11: stored_batch(400, 1, first_hash=5),  # one skipped: a gap
                base + 14: stored_batch(500, 1, first_hash=6),  # two skipped: believed without a follower
                base + 30: stored_batch(600, 1, first_hash=7),  # fifteen skipped, the last: nothing continues it
            }

            def replay(pub: Publisher, client: bytes, start: int) -> None:
                for seq, payload in sorted(plan.items()):
                    if seq >= start:
                        pub.reply([client, b"", pub.topic, seq_bytes(seq), payload])
                pub.reply([client, b"", b"", seq_bytes(-1), b""])

            pub.replay_mode = replay
            caplog.set_level(logging.DEBUG, logger="prefixroute.vllm.subscriber")
            BreakingSocket.fault = RuntimeError("a socket gone bad")  # the next receive fails: a new session
            pub.publish(plan[base + 1], seq=base + 1)  # not received live: the new session's catch-up brings it
            wait_until(applied(sub, base + 14), what="the catch-up of the new session")
            wait_until(lambda: len(lags) == heard + 5, what="the lag of each batch the catch-up applied observed")
            after = sub.stats()
            assert pub.requests[-1] == base + 1 and after.reconnects == before.reconnects + 1
            assert (after.bad_sequences - before.bad_sequences, after.unrecovered_gaps - before.unrecovered_gaps) == (
                2, 3,
            )  # fmt: skip
            assert (after.replayed_batches - before.replayed_batches, after.restarts) == (5, before.restarts)
            assert router.index.hashes("gpu0") == own(tokens(100, 1)) | own(tokens(300, 2)) | own(tokens(400, 1)) | own(
                tokens(500, 1)
            )
            said = [r.getMessage() for r in caplog.records if r.levelno >= logging.DEBUG]
            assert [m for m in said if "skipping the batch numbered" in m] == [
                f"KV events from gpu0: skipping the batch numbered {base + 5}: 4 ahead of {base + 1} in the replay",
                f"KV events from gpu0: skipping the batch numbered {base + 30}: 16 ahead of {base + 14} in the replay",
            ]
            assert [m for m in said if "no longer in the replay buffer" in m] == [
                f"KV events from gpu0: batches {first}..{last} are no longer in the replay buffer; the index may miss "
                "updates"
                for first, last in ((base + 2, base + 7), (base + 10, base + 10), (base + 12, base + 13))
            ]
            sound(router, sub)
        finally:
            BreakingSocket.fault = None
            sub.stop()
        assert not sub.running


def test_a_message_whose_replay_socket_cannot_be_made_is_counted_logged_and_recovered_by_the_next(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A batch that reveals a gap asks for a replay on a new socket; when that socket cannot be made (a process out of
    file descriptors), the batch is skipped (counted in invalid_batches, logged with why), the session goes on, and
    the next batch's gap replays both."""
    with publisher() as pub:
        router = events_router()
        sub = KVEventSubscriber(
            router, "gpu0", pub.endpoint, replay_endpoint=pub.replay_endpoint, topic=pub.topic.decode(),
            reconnect_backoff=(0.02, 0.2),
        )  # fmt: skip
        with monkeypatch.context() as patch:
            patch.setattr(zmq, "Context", BreakingContext)
            sub.start()
        try:
            join(pub, sub)
            pub.raw([pub.topic])  # one message of the wrong shape first: the count goes on from there
            wait_until(lambda: sub.stats().invalid_batches == 1, what="the message of the wrong shape counted")
            before = sub.stats()
            pub.publish(stored_batch(100, 1, first_hash=1), send=False)  # lost live
            FailingContext.failures = 1  # the replay's socket, the next one made, cannot be
            skipped = pub.publish(stored_batch(116, 1, parent=1, first_hash=2))
            wait_until(lambda: sub.stats().invalid_batches > before.invalid_batches, what="the batch skipped")
            assert FailingContext.failures == 0 and sub.last_seq < skipped
            last = pub.publish(stored_batch(132, 1, parent=2, first_hash=3))
            wait_until(applied(sub, last))
            after = sub.stats()
            assert after.invalid_batches - before.invalid_batches == 1
            assert (after.reconnects, after.unrecovered_gaps) == (before.reconnects, before.unrecovered_gaps)
            assert router.index.hashes("gpu0") == own(tokens(100, 3))
            sound(router, sub)
        finally:
            FailingContext.failures = 0
            sub.stop()
        assert not sub.running
    (record,) = [r for r in caplog.records if "could not be handled" in r.getMessage()]
    assert record.levelno == logging.ERROR
    assert record.getMessage() == "KV events from gpu0: skipping a message that could not be handled"
    assert record.exc_info is not None
    error = record.exc_info[1]
    assert isinstance(error, zmq.ZMQError) and error.errno == errno.EMFILE
