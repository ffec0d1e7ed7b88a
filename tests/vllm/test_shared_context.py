"""The ZMQ context a Fleet's KV-event subscribers share, and a subscriber's ``context=``: costs and lifecycle."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
import zmq.asyncio

from prefixroute import ConfigurationError, InvalidTypeError, StateError
from prefixroute.testing import FakeVLLM
from prefixroute.vllm import Fleet, KVEventSubscriber
from prefixroute.vllm import fleet as fleet_module

from ..conftest import returns, wait_until
from .conftest import events_router, fresh, settle

RANKS = 32


def descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def os_threads() -> int:
    """The process's threads as the kernel counts them: libzmq's own too, which ``threading`` does not see."""
    return len(os.listdir("/proc/self/task"))


@pytest.fixture
def xpub() -> Iterator[tuple[zmq.Socket[bytes], list[str]]]:
    """A publisher bound on :data:`RANKS` ports that hands the test each subscription it receives: one per SUB socket
    connected (verbose), which is how the test knows every rank's sockets are made."""
    with zmq.Context() as context:
        socket: zmq.Socket[bytes] = context.socket(zmq.XPUB)
        socket.setsockopt(zmq.XPUB_VERBOSE, 1)
        socket.setsockopt(zmq.LINGER, 0)
        endpoints = [f"tcp://127.0.0.1:{socket.bind_to_random_port('tcp://127.0.0.1')}" for _ in range(RANKS)]
        try:
            yield socket, endpoints
        finally:
            socket.close(linger=0)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts descriptors and threads in /proc")
def test_each_added_rank_costs_its_thread_and_a_few_descriptors_not_a_zmq_context_of_its_own(
    xpub: tuple[zmq.Socket[bytes], list[str]],
) -> None:
    """Was: each subscriber made a ZMQ context of its own, 9 file descriptors and 3 threads a rank (32 ranks: 288
    and 96; a data-parallel server of 256 ranks needed over 2,000 descriptors, past the default limit of 1,024, where
    libzmq may abort the process in one of its own threads). Now the fleet's subscribers share one context: a rank
    costs its thread and about 4 descriptors (its sockets and connection), the context 5 and 2 threads once."""
    publisher, endpoints = xpub
    with Fleet(events_router()) as fleet:
        fds_before, threads_before = descriptors(), os_threads()
        fleet.add_backend("dp", kv_events=endpoints)
        for _ in range(RANKS):  # every rank's SUB socket (and its monitor) made and connected
            assert publisher.poll(10_000), "a rank's subscription never reached the publisher"
            publisher.recv()
        fds, threads = descriptors() - fds_before - RANKS, os_threads() - threads_before  # less the accepted ends
        assert threads <= RANKS + 4, f"{threads} threads for {RANKS} ranks"  # was 3 a rank (96)
        assert fds <= 6 * RANKS, f"{fds} descriptors for {RANKS} ranks"  # was 9 a rank (288); now about 4 (133)
        assert all(s._context is fleet._context for s in fleet.subscribers("dp"))


def test_removing_a_backend_leaves_the_others_on_the_shared_context_and_it_can_be_added_again() -> None:
    router = events_router()
    with FakeVLLM(seed=1) as gpu0, FakeVLLM(seed=2) as gpu1, Fleet(router) as fleet:
        for backend, engine in (("gpu0", gpu0), ("gpu1", gpu1)):
            fleet.add_backend(backend, kv_events=engine.endpoint, replay=engine.replay_endpoint)
        first = fleet.subscriber("gpu0")
        other = fleet.subscriber("gpu1")
        assert first is not None and other is not None
        context = fleet._context
        assert first._context is context and other._context is context
        assert context is not None
        settle(gpu0, first)
        settle(gpu1, other)

        fleet.remove_backend("gpu0")
        assert not first.running and other.running and not context.closed
        before = other.stats().batches
        settle(gpu1, other)  # gpu1's events still arrive through its sockets in the shared context
        assert other.stats().batches > before and router.index.hashes("gpu1") == gpu1.own_hashes()
        assert router.index.hashes("gpu0") == set()

        fleet.add_backend("gpu0", kv_events=gpu0.endpoint, replay=gpu0.replay_endpoint)  # again, as new
        again = fleet.subscriber("gpu0")
        assert again is not None and again is not first
        assert again._context is fleet._context
        settle(gpu0, again)  # its catch-up replay brings back what the engine holds, then live batches follow
        assert router.index.hashes("gpu0") == gpu0.own_hashes()

        fleet.close()
        assert context.closed and fleet._context is None
        assert not again.running and not other.running
        fleet.close()  # idempotent: the context is terminated once
        with pytest.raises(ConfigurationError, match="closed"):
            fleet.add_backend("gpu2", kv_events="tcp://127.0.0.1:1")


def test_a_fleet_without_kv_events_makes_no_zmq_context() -> None:
    with Fleet(events_router()) as fleet:
        fleet.add_backend("gpu0", metrics_url="http://127.0.0.1:1")
        assert fleet._context is None


@pytest.mark.parametrize("removed_first", [False, True])
def test_close_does_not_wait_on_a_stuck_subscriber_and_the_context_ends_once_it_does(
    removed_first: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A thread stuck outside ZMQ still holds its sockets: terminating the context then would block close() until
    it came back. close() terminates it in a thread of its own, which ends once the stuck thread has closed them;
    also when the stuck thread's backend was removed before (its remove_backend() gave up waiting for it)."""
    entered, release = threading.Event(), threading.Event()
    real_write = KVEventSubscriber._write

    def stuck_write(self: KVEventSubscriber, ops: Any) -> None:
        entered.set()
        release.wait(30.0)
        real_write(self, ops)

    monkeypatch.setattr(KVEventSubscriber, "_write", stuck_write)
    monkeypatch.setattr(fleet_module, "_SUBSCRIBER_STOP_S", 0.05)  # what close() waits for a backend's threads
    with FakeVLLM() as engine:
        fleet = Fleet(events_router())
        try:
            fleet.add_backend("gpu0", kv_events=engine.endpoint)
            subscriber = fleet.subscriber("gpu0")
            context = fleet._context
            assert subscriber is not None and context is not None

            def publish_until_written() -> bool:
                engine.complete(fresh())  # again and again: the first may go before the SUB socket is connected
                return entered.wait(0.1)

            wait_until(publish_until_written, what="a write under way")
            if removed_first:
                with caplog.at_level(logging.ERROR, logger="prefixroute.vllm.subscriber"):  # its "not ended" warning
                    fleet.remove_backend("gpu0")
                assert fleet.backends() == [] and subscriber.running
            with caplog.at_level(logging.WARNING, logger="prefixroute.vllm.fleet"):
                returns(fleet.close, what="close() with a subscriber stuck in its writer")
            assert "KV-event threads of ['gpu0'] have not ended" in caplog.text
            assert subscriber.running and not context.closed  # its sockets are still open
        finally:
            release.set()
        wait_until(lambda: context.closed, what="the context terminated once the stuck thread closed its sockets")
        wait_until(lambda: not subscriber.running, what="the stuck thread to end")


def test_a_subscriber_never_terminates_a_context_it_was_given() -> None:
    router = events_router()
    with FakeVLLM() as engine, zmq.Context() as context:
        subscriber = KVEventSubscriber(
            router, "gpu0", engine.endpoint, replay_endpoint=engine.replay_endpoint, context=context
        )
        for _ in range(2):  # stopped and started again on the same context
            with subscriber:
                settle(engine, subscriber)
            assert not subscriber.running and not context.closed
        assert router.index.hashes("gpu0") == engine.own_hashes()
        context.socket(zmq.PUB).close(linger=0)  # still usable by its owner


def test_a_subscriber_whose_given_context_is_terminated_stops_and_cannot_start_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    context: zmq.Context[Any] = zmq.Context()
    subscriber = KVEventSubscriber(events_router(), "gpu0", "tcp://127.0.0.1:1", context=context).start()
    assert subscriber.running
    with caplog.at_level(logging.WARNING, logger="prefixroute.vllm.subscriber"):
        returns(context.term, what="term() of a context a running subscriber uses")  # ends its blocking poll
        wait_until(lambda: not subscriber.running, what="the subscriber's thread to end")
    assert "the ZMQ context was terminated" in caplog.text
    with pytest.raises(StateError, match="context given to the KV-event subscriber of gpu0 has been terminated"):
        subscriber.start()
    subscriber.stop()


def test_context_is_checked_when_given() -> None:
    router = events_router()
    with pytest.raises(InvalidTypeError, match="context must be a zmq.Context"):
        KVEventSubscriber(router, "gpu0", "tcp://127.0.0.1:1", context=object())  # type: ignore[arg-type]
    asyncio_context = zmq.asyncio.Context()
    try:
        with pytest.raises(InvalidTypeError, match="not a zmq.asyncio.Context"):
            KVEventSubscriber(router, "gpu0", "tcp://127.0.0.1:1", context=asyncio_context)
    finally:
        asyncio_context.term()
    terminated: zmq.Context[Any] = zmq.Context()
    terminated.term()
    with pytest.raises(ConfigurationError, match="context is a terminated zmq.Context"):
        KVEventSubscriber(router, "gpu0", "tcp://127.0.0.1:1", context=terminated)
