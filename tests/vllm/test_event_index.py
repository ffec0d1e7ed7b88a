"""EventIndex: confirmed blocks from KV events plus speculative entries that expire, through a Router."""

from __future__ import annotations

import datetime
import math
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixroute import BlockHasher, ConfigurationError, InvalidTypeError, Router
from prefixroute.testing import FakeVLLM
from prefixroute.vllm import EventIndex, Fleet

from ..conftest import FakeClock
from .conftest import settle

PROMPT = [random.Random(1).randrange(30_000) for _ in range(96)]  # 6 blocks
HASHES = BlockHasher(16).hash(PROMPT)


def hybrid(clock: FakeClock, ttl: float = 3.0) -> Router:
    return Router(index=EventIndex(16, speculative_ttl=ttl, clock=clock), clock=clock)


def test_a_fresh_prediction_is_trusted_until_events_confirm_it() -> None:
    clock = FakeClock()
    router = hybrid(clock)
    with FakeVLLM(num_blocks=64) as engine, Fleet(router) as fleet:
        fleet.add_backend("gpu0", kv_events=engine.endpoint, replay=engine.replay_endpoint)
        subscriber = fleet.subscriber("gpu0")
        assert subscriber is not None
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


def test_a_prompt_longer_than_the_backend_keeps_is_not_predicted_as_prefix_index_does_not() -> None:
    # Was: trusted for up to two TTLs, though its engine refuses a prompt of more blocks than its KV cache holds.
    clock = FakeClock()
    router = hybrid(clock)
    router.set_capacity("gpu0", len(HASHES) - 1)
    router.set_capacity("gpu1", len(HASHES))
    router.route(PROMPT, ["gpu0"])
    router.route(PROMPT, ["gpu1"])
    assert router.index.match(HASHES, ["gpu0", "gpu1"]) == {"gpu0": 0, "gpu1": len(HASHES)}


def test_speculative_entries_expire_between_one_and_two_ttls() -> None:
    clock = FakeClock()
    router = hybrid(clock, ttl=2.0)
    router.route(PROMPT, ["gpu0"])
    clock.tick(1.0)
    assert router.route(PROMPT, ["gpu0"]).matched_tokens == 96
    clock.tick(4.1)  # nothing refreshed it for more than two TTLs
    decision = router.route(PROMPT, ["gpu0"])
    assert (decision.matched_tokens, decision.confirmed_tokens) == (0, 0)
    assert len(router.index) == 0  # predictions never reach the confirmed part


def test_a_prediction_is_trusted_for_at_least_one_ttl_and_dropped_at_the_end_of_the_next_period() -> None:
    """Generations turn every ``speculative_ttl`` seconds from the index's making, however late a call comes: an
    entry made in one period is still matched through the next (so it lives at least one ttl) and dropped as that
    one ends (so it lives at most two)."""
    clock = FakeClock(0.0)
    index = EventIndex(16, speculative_ttl=2.0, clock=clock)
    index.predict(HASHES, "gpu0", 0)  # made as the first period [0, 2) begins
    clock.tick(1.5)
    index.predict(HASHES[:2], "gpu1", 0)  # made late in it
    clock.tick(1.5)  # t=3, in the second period: the first call since the generations turned
    assert index.match(HASHES, ["gpu0", "gpu1"]) == {"gpu0": 6, "gpu1": 2}
    assert index.speculative_blocks("gpu0") == 6
    clock.tick(1.0)  # t=4: the second period ends, both go (gpu0's lived 2 ttls, gpu1's 1.25)
    assert index.match(HASHES, ["gpu0", "gpu1"]) == {"gpu0": 0, "gpu1": 0}
    assert index.speculative_blocks("gpu0") == 0
    index._check()


def test_an_eviction_event_overrides_the_speculative_entry() -> None:
    router = hybrid(FakeClock())
    with FakeVLLM(num_blocks=8) as small, Fleet(router) as fleet:
        fleet.add_backend("gpu0", kv_events=small.endpoint, replay=small.replay_endpoint)
        subscriber = fleet.subscriber("gpu0")
        assert subscriber is not None
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


def test_ttl_zero_means_events_only() -> None:
    router = Router(index=EventIndex(16, speculative_ttl=0))
    router.route(PROMPT, ["gpu0"])
    decision = router.route(PROMPT, ["gpu0"])
    assert (decision.matched_tokens, decision.confirmed_tokens) == (0, 0)
    router.store("gpu0", HASHES[:4])
    assert router.route(PROMPT, ["gpu0"]).confirmed_tokens == 64
    router.write("gpu0", [(False, HASHES[2:3], None)])  # an eviction event
    assert router.route(PROMPT, ["gpu0"]).confirmed_tokens == 32
    router.index._check()


def test_a_prediction_index_reports_no_confirmation() -> None:
    assert Router().route(PROMPT, ["gpu0"]).confirmed_tokens is None


def test_removing_a_backend_drops_its_confirmed_and_speculative_blocks() -> None:
    clock = FakeClock()
    index = EventIndex(16, clock=clock)
    router = Router(index=index, clock=clock)
    router.store("gpu0", HASHES[:2])
    router.route(PROMPT, ["gpu0"])
    assert index.speculative_blocks("gpu0") == 6 and index.blocks("gpu0") == 2
    router.remove_backend("gpu0")
    assert index.speculative_blocks("gpu0") == 0 and index.blocks("gpu0") == 0
    assert index.match(HASHES, ["gpu0"]) == {"gpu0": 0}
    index._check()


def test_clear_drops_both_parts_and_a_backwards_clock_starts_over() -> None:
    clock = FakeClock()
    index = EventIndex(16, speculative_ttl=5.0, clock=clock)
    index.insert(HASHES[:1], "gpu0")
    index.predict(HASHES, "gpu1", 0)
    assert index.match(HASHES, ["gpu0", "gpu1"]) == {"gpu0": 1, "gpu1": 6}
    clock.tick(-100.0)  # a clock that jumps back must not keep entries forever
    assert index.match(HASHES, ["gpu1"]) == {"gpu1": 0}
    index.predict(HASHES, "gpu1", 0)
    assert index.match(HASHES, ["gpu1"]) == {"gpu1": 6}  # trusted again from the new reading on
    clock.tick(4.0)
    assert index.match(HASHES, ["gpu1"]) == {"gpu1": 6}  # and kept for at least a ttl
    index.clear()
    assert index.match(HASHES, ["gpu0", "gpu1"]) == {"gpu0": 0, "gpu1": 0}


@pytest.mark.parametrize(
    ("ttl", "shown"), [(-1.0, "-1.0"), (float("nan"), "nan"), (float("inf"), "inf"), ("3", "'3'"), (True, "True")]
)
def test_nonsense_ttls_are_configuration_errors(ttl: object, shown: str) -> None:
    message = f"speculative_ttl must be a finite number of seconds >= 0 (0: events only), not {shown}"
    with pytest.raises(ConfigurationError, match=re.escape(message)):
        EventIndex(16, speculative_ttl=ttl)  # type: ignore[arg-type]


def test_a_clock_that_is_not_callable_is_a_type_error() -> None:
    with pytest.raises(InvalidTypeError, match="clock must be a callable returning seconds, not float"):
        EventIndex(16, clock=1.5)  # type: ignore[arg-type]


def test_the_defaults_are_vllms_block_size_and_three_seconds_of_trust() -> None:
    index = EventIndex()
    assert (index.block_size, index.speculative_ttl) == (16, 3.0)


def test_the_repr_counts_confirmed_and_speculative_entries() -> None:
    clock = FakeClock()
    index = EventIndex(16, speculative_ttl=2.0, clock=clock)
    index.insert(HASHES[:1], "gpu0")
    index.predict(HASHES[:2], "gpu0", 0)
    clock.tick(2.0)
    index.predict(HASHES[:3], "gpu1", 0)  # the first prediction is now the previous generation's
    assert repr(index) == "EventIndex(block_size=16, speculative_ttl=2, entries=1, speculative=5)"


def test_the_router_checks_the_index_block_size() -> None:
    with pytest.raises(ConfigurationError, match="block_size"):
        Router(block_size=32, index=EventIndex(16))


ops = st.lists(
    st.tuples(
        st.sampled_from(["insert", "predict", "remove", "remove_backend", "tick", "clear"]),
        st.sampled_from(["gpu0", "gpu1"]),
        st.integers(1, 6),
        st.floats(0.0, 4.0),
    ),
    max_size=40,
)


@settings(max_examples=80, deadline=None)
@given(ops)
def test_match_is_the_larger_of_confirmed_and_unexpired_speculative(steps: list[tuple[str, str, int, float]]) -> None:
    """A model: confirmed sets, and per speculative entry the time it was made; entries live [ttl, 2 ttl)."""
    clock = FakeClock()
    ttl = 1.0
    index = EventIndex(16, speculative_ttl=ttl, clock=clock)
    confirmed: dict[str, set[int]] = {"gpu0": set(), "gpu1": set()}
    predicted: dict[str, dict[int, float]] = {"gpu0": {}, "gpu1": {}}  # hash -> when it was last predicted
    for op, backend, length, seconds in steps:
        chain = list(HASHES[:length])
        if op == "insert":
            index.insert(chain, backend)
            confirmed[backend].update(chain)
        elif op == "predict":
            index.predict(chain, backend, 0)
            predicted[backend].update(dict.fromkeys(chain, clock.now))
        elif op == "remove":
            index.remove(chain[-1:], backend)
            confirmed[backend].discard(chain[-1])
            predicted[backend].pop(chain[-1], None)
        elif op == "remove_backend":
            index.remove_backend(backend)
            confirmed[backend].clear()
            predicted[backend].clear()
        elif op == "tick":
            clock.tick(seconds)
        else:
            index.clear()
            confirmed = {"gpu0": set(), "gpu1": set()}
            predicted = {"gpu0": {}, "gpu1": {}}
        index._check()
        for name, held in confirmed.items():
            alive = {h for h, at in predicted[name].items() if clock.now - at < 2 * ttl}
            exact = next((i for i, h in enumerate(HASHES) if h not in held), len(HASHES))
            at_most = next((i for i, h in enumerate(HASHES) if h not in held | alive), len(HASHES))
            assert index.match_confirmed(HASHES, name) == exact
            assert exact <= index.match(HASHES, [name])[name] <= at_most


@pytest.mark.parametrize("reading", [None, "12:00", math.nan, math.inf, datetime.datetime(2026, 1, 1)])
def test_a_clock_that_returns_no_seconds_when_given_is_refused_then(reading: object) -> None:
    """Was: taken, and every prediction then distrusted (no match for a prompt routed a moment before), unsaid."""
    with pytest.raises(ConfigurationError, match="clock returned .*: it must return a finite number of seconds"):
        EventIndex(16, clock=lambda: reading)  # type: ignore[arg-type, return-value]
    EventIndex(16, speculative_ttl=0, clock=lambda: reading)  # type: ignore[arg-type, return-value]  # never read


def test_a_clock_that_raises_when_given_is_a_configuration_error_that_keeps_what_it_raised() -> None:
    def gone() -> float:
        raise OSError("clock source gone")

    with pytest.raises(ConfigurationError, match=r"^clock raised OSError \(clock source gone\) when read") as refused:
        EventIndex(16, clock=gone)
    assert isinstance(refused.value.__cause__, OSError)


@pytest.mark.parametrize(("ttl", "jump"), [(0.5, 1e308), (1e-320, 0.01)])
def test_a_jump_too_far_to_count_in_periods_starts_over_instead_of_failing_every_route(ttl: float, jump: float) -> None:
    # Was: a finite clock jump whose number of periods of ttl is infinite (1e308 s against 0.5 s, or 10 ms against a
    # ttl of 1e-320 s, which the index takes) raised OverflowError from route(), and from every later one.
    clock = FakeClock()
    router = hybrid(clock, ttl)
    router.route(PROMPT, ["gpu0", "gpu1"])
    clock.now += jump
    assert router.route(PROMPT, ["gpu0", "gpu1"]).matched_tokens == 0  # what it predicted before has expired
    assert router.route(PROMPT, ["gpu0", "gpu1"]).matched_tokens == len(PROMPT)  # and it predicts again from there
    router.index._check()


@pytest.mark.parametrize("reading", [float("inf"), float("nan"), -float("inf")])
def test_a_clock_reading_that_is_not_finite_expires_the_speculation_instead_of_raising_or_keeping_it(
    reading: float,
) -> None:
    # Was: inf raised OverflowError (math.floor of an infinite number of periods) into route(); NaN compared false
    # with everything, so the speculative entries were never expired.
    clock = FakeClock()
    router = hybrid(clock)
    router.route(PROMPT, ["gpu0", "gpu1"])
    clock.now = reading
    decision = router.route(PROMPT, ["gpu0", "gpu1"])
    assert decision.matched_tokens == 0
    router.index._check()
    clock.now = 200.0  # a sane clock again: predictions are trusted again
    backend = router.route(PROMPT, ["gpu0", "gpu1"]).backend
    assert router.route(PROMPT, ["gpu0", "gpu1"]).backend == backend
    assert router.index.match(HASHES, [backend])[backend] == len(HASHES)
