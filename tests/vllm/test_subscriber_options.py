"""What a KVEventSubscriber says of each option it refuses, what a new one reports, and a documented default (found by
mutation testing of vllm/subscriber.py: __init__, stats).

Each refusal names the option, what it must be and what it was given, so that the message alone says what to fix.
"""

from __future__ import annotations

from typing import Any

import pytest

from prefixroute import BlockHasher, Router
from prefixroute.errors import ConfigurationError, InvalidTypeError
from prefixroute.vllm import EventIndex, KVEventSubscriber
from prefixroute.vllm._checks import MAX_SECONDS

from ..conftest import wait_until
from .test_vllm_blackbox import applied, events_router, own, publisher, sound, stored_batch, subscribed, tokens

SECONDS = f"a finite positive number of seconds (at most {MAX_SECONDS:.0f})"

REFUSALS: dict[str, tuple[dict[str, Any], type[Exception], str]] = {
    "backend": ({"backend": 5}, InvalidTypeError, "backend must be a str id, not int"),
    "backend-empty": (
        {"backend": ""},
        ConfigurationError,
        "a backend id is an empty str: give each backend a non-empty id, such as its URL",
    ),
    "endpoint": (
        {"endpoint": "localhost:5557"},
        ConfigurationError,
        "endpoint must be a ZMQ address to connect to, like 'tcp://gpu0:5557', not 'localhost:5557'",
    ),
    "replay_endpoint": (
        {"replay_endpoint": "localhost"},
        ConfigurationError,
        "replay_endpoint must be a ZMQ address to connect to, like 'tcp://gpu0:5558', not 'localhost'",
    ),
    "topic-type": ({"topic": 5}, InvalidTypeError, "topic must be a str, not int"),
    "topic-surrogate": (
        {"topic": "kv\ud800"},
        ConfigurationError,
        "topic must be text that UTF-8 can encode, as vLLM's is, not 'kv\\ud800' (a lone surrogate)",
    ),
    "replay_timeout": ({"replay_timeout": 0}, ConfigurationError, f"replay_timeout must be {SECONDS}, not 0"),
    "max_batches_per_apply": (
        {"max_batches_per_apply": 0},
        ConfigurationError,
        "max_batches_per_apply must be a positive int, not 0",
    ),
    "max_sequence_jump": (
        {"max_sequence_jump": -3},
        ConfigurationError,
        "max_sequence_jump must be a positive int, not -3",
    ),
    "reconnect_backoff-pair": (
        {"reconnect_backoff": 5},
        ConfigurationError,
        "reconnect_backoff must be a pair (low, high) of seconds, not 5",
    ),
    "reconnect_backoff-low": (
        {"reconnect_backoff": (0, 1)},
        ConfigurationError,
        f"reconnect_backoff's low must be {SECONDS}, not 0",
    ),
    "reconnect_backoff-high": (
        {"reconnect_backoff": (1, float("inf"))},
        ConfigurationError,
        f"reconnect_backoff's high must be {SECONDS}, not inf",
    ),
    "reconnect_backoff-order": (
        {"reconnect_backoff": (2.0, 1.0)},
        ConfigurationError,
        "reconnect_backoff must be (low, high) with low <= high, not (2.0, 1.0)",
    ),
    "lag_observer": (
        {"lag_observer": 5},
        InvalidTypeError,
        "lag_observer must be a callable taking a lag in seconds or None, not int",
    ),
    "clock": (
        {"clock": None},
        InvalidTypeError,
        "clock must be a callable returning seconds since the epoch, not NoneType",
    ),
}


@pytest.mark.parametrize("refusal", list(REFUSALS))
def test_each_refused_option_is_named_with_what_it_must_be_and_what_it_was(refusal: str) -> None:
    given, error, message = REFUSALS[refusal]
    options: dict[str, Any] = {"backend": "gpu0", "endpoint": "tcp://127.0.0.1:1", **given}
    with pytest.raises(error) as raised:
        KVEventSubscriber(events_router(), options.pop("backend"), options.pop("endpoint"), **options)
    assert str(raised.value) == message


def test_a_new_subscriber_reports_nothing_applied_yet() -> None:
    """Before its thread has received anything: no batch applied (last_seq -1), every count 0, no lag measured."""
    sub = KVEventSubscriber(events_router(), "gpu0", "tcp://127.0.0.1:1")
    stats = sub.stats()
    assert (stats.backend, stats.last_seq, stats.last_lag_s, stats.blocks_held) == ("gpu0", -1, None, 0)
    counts = {
        name: getattr(stats, name)
        for name in (
            "batches", "events", "gaps", "replayed_batches", "unrecovered_gaps", "failed_replays", "restarts",
            "invalid_batches", "bad_sequences", "write_errors", "observer_errors", "reconnects", "handshake_failures",
        )
    }  # fmt: skip
    assert counts == dict.fromkeys(counts, 0)
    assert sub.last_seq == -1 and not sub.running and sub.held() == set()


def test_the_default_max_sequence_jump_is_the_documented_100_000() -> None:
    """100,000 numbers skipped are a gap, acted on at once; 100,001 are held back until the next message continues
    them (here none does: the jump is skipped)."""
    with publisher() as pub, subscribed(pub) as (router, sub):
        base = sub.last_seq
        before = sub.stats()
        gap = pub.publish(stored_batch(100, 1, first_hash=1), seq=base + 1 + 100_000)
        wait_until(applied(sub, gap), what="a jump of 100,000 applied without waiting")
        pub.publish(stored_batch(200, 1, first_hash=2), seq=gap + 1 + 100_001)  # held back
        last = pub.publish(stored_batch(300, 1, first_hash=3), seq=gap + 1)  # does not continue it
        wait_until(lambda: sub.last_seq == last, what="the batch after the one held back")
        after = sub.stats()
        moved = {
            name: getattr(after, name) - getattr(before, name) for name in ("gaps", "unrecovered_gaps", "bad_sequences")
        }
        assert moved == {"gaps": 1, "unrecovered_gaps": 1, "bad_sequences": 1}
        assert router.index.hashes("gpu0") == own(tokens(100, 1)) | own(tokens(300, 1))
        sound(router, sub)


def test_events_are_hashed_in_the_writers_block_size() -> None:
    """A router of 8-token blocks under a vLLM of 16-token blocks: each vLLM block is two of the router's, hashed as
    route() hashes them (the subscriber takes its block size from its writer, not a default of 16)."""
    router = Router(block_size=8, index=EventIndex(8, speculative_ttl=0))
    with publisher() as pub, subscribed(pub, router=router) as (router, sub):
        last = pub.publish(stored_batch(100, 2, first_hash=1))
        wait_until(applied(sub, last))
        assert router.index.hashes("gpu0") == set(BlockHasher(8).hash(tokens(100, 2)))
        assert sub.stats().blocks_held == 4
        sound(router, sub)
