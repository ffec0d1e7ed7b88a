"""Shared helpers for the vLLM integration tests: real sockets on 127.0.0.1, waits with a deadline."""

from __future__ import annotations

import random
import time

from prefixroute import Router
from prefixroute.testing import FakeVLLM
from prefixroute.vllm import EventIndex, KVEventSubscriber

from ..conftest import wait_until


def events_router(**options: object) -> Router:
    """A router whose index only KV events write (no speculative entries)."""
    return Router(index=EventIndex(16, speculative_ttl=0), **options)  # type: ignore[arg-type]


def fresh() -> list[int]:
    """A prompt no other prompt shares, so completing it always publishes a batch."""
    return [random.randrange(100_000, 2**31) for _ in range(16)]


def settle(engine: FakeVLLM, sub: KVEventSubscriber) -> None:
    """Publish fresh batches until the subscriber has applied the latest one.

    A fresh batch reveals a trailing loss as a gap, and republishing covers a SUB socket that was still connecting
    (a PUB socket drops what it sends before then) and a pending :meth:`FakeVLLM.drop_next`.
    """
    state = {"published_at": 0.0}

    def caught_up() -> bool:
        if sub.last_seq == engine.seq - 1 and state["published_at"]:
            return True
        if time.monotonic() - state["published_at"] > 0.25:
            engine.complete(fresh())
            state["published_at"] = time.monotonic()
        return False

    wait_until(caught_up, what="the subscriber to apply the engine's latest batch")
