"""How the subscriber recovers a gap in the sequence, and what its stats and log say of what could not be recovered
(found by mutation testing of vllm/subscriber.py: _recover, _replay, _apply_payload).

docs/vllm.md, "Lost messages, restarts, late start", says what these check.
"""

from __future__ import annotations

import logging

import pytest

from prefixroute.vllm import KVEventSubscriber

from ..conftest import wait_until
from .test_vllm_blackbox import (
    applied,
    events_router,
    join,
    own,
    publisher,
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
        (skipped,) = said(caplog, "skipping batch")
        assert skipped.startswith(f"KV events from gpu0: skipping batch {base + 2} (1 invalid so far): ")
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
