"""A KV-event subscriber's ``context=``: a ZMQ context it shares, never terminates, and stops with."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import zmq
import zmq.asyncio

from prefixroute import ConfigurationError, InvalidTypeError, StateError
from prefixroute.testing import FakeVLLM
from prefixroute.vllm import KVEventSubscriber

from ..conftest import returns, wait_until
from .conftest import events_router, settle


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
