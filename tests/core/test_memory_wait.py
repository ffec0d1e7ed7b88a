"""Candidate.memory_wait_s: how long a request would wait for KV memory on a full backend, from the ages of the
router's requests in flight there and the mean time requests live; and how the default policy weighs it."""

from __future__ import annotations

import math
from typing import Any

import pytest

from prefixroute import Candidate, ConfigurationError, InvalidTypeError, PredictedTTFT, Router
from prefixroute.policies import _field_fault

from ..conftest import FakeClock

# Block size 4, 10 blocks a backend: a prompt of 24 tokens takes 6 blocks, so one fits and a second does not.
PROMPT = 24


def prompt(k: int) -> list[int]:
    """A prompt of 6 blocks that shares no block with prompt(j) for j != k."""
    return list(range(k * 1000, k * 1000 + PROMPT))


def router() -> tuple[Router, FakeClock]:
    clock = FakeClock(0.0)
    return Router(block_size=4, capacity_blocks=10, clock=clock), clock


def waits(r: Router, k: int, backends: list[str]) -> dict[str, float]:
    return {c.backend: c.memory_wait_s for c in r.decide(prompt(k), backends).candidates}


def run(r: Router, k: int, backend: str) -> str:
    """Start prompt(k) on ``backend``; its decision id."""
    decision = r.route(prompt(k), [backend])
    r.start(decision)
    return decision.id


def test_no_wait_is_predicted_before_a_request_finished() -> None:
    r, clock = router()
    run(r, 0, "a")
    clock.tick(1.0)
    assert waits(r, 1, ["a", "b"]) == {"a": 0.0, "b": 0.0}  # "a" is full, but how long requests live is unknown
    r._check()


def test_a_full_backend_waits_until_its_oldest_request_has_lived_the_mean_lifetime() -> None:
    r, clock = router()
    r.finish(run(r, 0, "a"))  # at once: a lifetime of 0 s
    first = run(r, 1, "a")
    clock.tick(4.0)
    r.finish(first)  # 4 s: the mean of the first finishes is their plain mean, 2 s
    clock.tick(1.0)  # t = 5
    run(r, 2, "a")
    clock.tick(0.5)  # t = 5.5
    run(r, 3, "b")
    clock.tick(1.0)  # t = 6.5: "a"'s request has lived 1.5 s of 2, "b"'s 1 s
    assert waits(r, 4, ["a", "b", "c"]) == {"a": pytest.approx(0.5), "b": pytest.approx(1.0), "c": 0.0}
    clock.tick(1.0)  # past the mean: "a"'s request is due to end any moment, so no wait is predicted
    assert waits(r, 4, ["a", "b"]) == {"a": 0.0, "b": pytest.approx(0.0)}
    r._check()


def test_the_walk_frees_requests_oldest_first_until_enough_blocks_are_free() -> None:
    r = Router(block_size=4, capacity_blocks=20, clock=(clock := FakeClock(0.0)))
    r.finish(run(r, 0, "a"))
    second = run(r, 1, "a")
    clock.tick(10.0)
    r.finish(second)  # lifetimes 0 and 10 s: a mean of 5
    clock.tick(10.0)  # t = 20
    run(r, 2, "a")  # 6 blocks, started at 20
    clock.tick(1.0)
    run(r, 3, "a")  # 6 more, at 21: 12 of 20 blocks, 8 free
    clock.tick(1.0)
    run(r, 4, "a")  # 18 of 20 at 22
    clock.tick(1.0)  # t = 23; a new prompt's 6 blocks need 4 more free: the oldest request's end frees them
    assert waits(r, 5, ["a"]) == {"a": pytest.approx(20.0 + 5.0 - 23.0)}
    long = list(range(9000, 9000 + 3 * PROMPT))  # 18 blocks: 16 must be free, the three requests' ends
    assert r.decide(long, ["a"]).candidates[0].memory_wait_s == pytest.approx(22.0 + 5.0 - 23.0)
    r._check()


def test_refused_and_expired_requests_teach_no_lifetime() -> None:
    r, clock = router()
    refused = run(r, 0, "a")
    clock.tick(3.0)
    r.finish(refused, refused=True)  # the engine computed nothing: not a request's life
    r.start(r.route(prompt(1), ["a"]), lease=1.0)
    clock.tick(2.0)
    assert r.expire() == 1
    run(r, 2, "a")
    assert waits(r, 3, ["a"]) == {"a": 0.0}  # still nothing learned
    r._check()


def test_requests_that_move_or_leave_are_walked_where_they_are() -> None:
    r, clock = router()
    r.finish(run(r, 0, "a"))
    second = run(r, 1, "a")
    clock.tick(4.0)
    r.finish(second)  # mean lifetime 2 s
    decision = r.decide(prompt(2), ["a", "b"])
    r.start(r.commit(decision, "a"))
    clock.tick(1.0)
    r.start(r.commit(decision, "b"))  # committed elsewhere: it moves, and counts as started there now
    assert waits(r, 3, ["a", "b"]) == {"a": 0.0, "b": pytest.approx(2.0)}
    r.remove_backend("b")
    assert waits(r, 3, ["a", "b"]) == {"a": 0.0, "b": 0.0}
    r._check()


def test_a_clock_that_goes_back_teaches_nothing() -> None:
    r, clock = router()
    decision = run(r, 0, "a")
    clock.now = -5.0
    r.finish(decision)
    run(r, 1, "a")
    assert waits(r, 2, ["a"]) == {"a": 0.0}
    r._check()


FULL = Candidate("a", 0, 4096, 3, pending_prefill_tokens=0, active_blocks=400, capacity_blocks=300)


def test_the_default_sends_a_request_to_the_full_backend_whose_memory_frees_first() -> None:
    late = FULL._replace(backend="late", prefill_tokens_per_s=8000.0, memory_wait_s=3.0)
    soon = FULL._replace(backend="soon", prefill_tokens_per_s=8000.0, memory_wait_s=0.5)
    assert PredictedTTFT().choose([late, soon]).backend == "soon"
    # cost() counts the wait as prefill work at the backend's speed: 2.5 s more at 8,000 tokens/s
    assert PredictedTTFT().cost(late) - PredictedTTFT().cost(soon) == pytest.approx(2.5 * 8000 / (1 - 0.95))


def test_without_a_prefill_speed_the_wait_counts_nothing() -> None:
    late = FULL._replace(backend="late", memory_wait_s=3.0)
    soon = FULL._replace(backend="soon", memory_wait_s=0.5)
    assert PredictedTTFT().cost(late) == PredictedTTFT().cost(soon)
    assert PredictedTTFT().choose([late, soon]).backend == "late"  # a tie: the first in placement order


@pytest.mark.parametrize("use_speed", [False, True])
def test_the_full_backend_whose_memory_frees_first_wins_whatever_the_speed_estimates(use_speed: bool) -> None:
    # Was: each wait counted at its backend's own speed estimate, so on equal GPUs the one that had last served
    # short prompts (a tenth of the other's estimate) looked cheaper with 11 s to wait than the other with 3 s; and a
    # backend without an estimate yet (new, or re-added) counted no wait at all, and took every request (789 in a
    # row) until a first token there taught it one. The choice counts every wait at one speed, the median known.
    noisy = FULL._replace(backend="noisy", prefill_tokens_per_s=903.0, memory_wait_s=11.0)
    steady = FULL._replace(backend="steady", prefill_tokens_per_s=9360.0, memory_wait_s=3.0)
    new = FULL._replace(backend="new", memory_wait_s=11.9)
    policy = PredictedTTFT(use_speed=use_speed)
    assert policy.choose([noisy, steady]) is steady
    assert policy.choose([new, steady]) is steady
    later = steady._replace(memory_wait_s=12.0)
    assert policy.choose([new, later]) is new  # the candidate given, not the one scored at another speed

    class Logged(PredictedTTFT):  # a subclass's own cost(), calling the default's: the same waits, the same choice
        def cost(self, candidate: Candidate, *, speed: float = 1.0, **cap: Any) -> float:
            return super().cost(candidate, speed=speed, **cap)

    assert Logged(use_speed=use_speed).choose([noisy, steady]) is steady
    assert Logged(use_speed=use_speed).choose([new, steady]) is steady
    assert PredictedTTFT.wait_speed([noisy, steady, new]) == 9360.0 and PredictedTTFT.wait_speed([new]) is None


def test_with_use_speed_a_full_backend_without_a_speed_estimate_is_routed_to_without_a_policy_error() -> None:
    # Was a PolicyError on every route: choose() returned the candidate it had scored at the median speed, a copy the
    # router did not hand it ("not one of the candidates it was given").
    clock = FakeClock()
    router = Router(policy=PredictedTTFT(use_speed=True), capacity_blocks=8, clock=clock)
    prompts = iter(list(range(1000 * i, 1000 * i + 64)) for i in range(100))
    for backend in ("a", "b"):  # each learns a lifetime; only "a" a prefill speed
        decision = router.commit(router.decide(next(prompts), ["a", "b"]), backend)
        router.start(decision)
        clock.tick(1.0)
        if backend == "a":
            router.first_token(decision)
        clock.tick(20.0)
        router.finish(decision)
    for backend, count in (("b", 3), ("a", 6)):  # both full: "b" waits for memory with no speed estimate
        for _ in range(count):
            decision = router.commit(router.decide(next(prompts), ["a", "b"]), backend)
            router.start(decision)
            if backend == "a":
                clock.tick(0.01)
                router.first_token(decision)
            clock.tick(0.5)
    candidates = router.decide(next(prompts), ["a", "b"]).candidates
    assert all(c.memory_wait_s > 0 for c in candidates) and [c.prefill_tokens_per_s is None for c in candidates] == [
        False,
        True,
    ]
    for _ in range(5):
        router.decide(next(prompts), ["a", "b"])


def test_a_wait_weighs_against_queued_prefill_in_the_same_tokens() -> None:
    # "queued" has 20,000 tokens of prefill ahead (2.5 s at 8,000/s), "full" a 2 s wait for memory: "full" wins
    queued = FULL._replace(backend="queued", pending_prefill_tokens=20000, prefill_tokens_per_s=8000.0, memory_wait_s=0)
    full = FULL._replace(backend="full", prefill_tokens_per_s=8000.0, memory_wait_s=2.0)
    assert PredictedTTFT().choose([queued, full]).backend == "full"
    assert PredictedTTFT().choose([queued, full._replace(memory_wait_s=3.0)]).backend == "queued"


@pytest.mark.parametrize("value", ["1", b"1", [1.0]])
def test_a_memory_wait_of_the_wrong_type_is_named(value: object) -> None:
    bad = FULL._replace(memory_wait_s=value, prefill_tokens_per_s=8000.0)  # type: ignore[arg-type]
    for call in (lambda: PredictedTTFT().choose([FULL, bad]), lambda: PredictedTTFT().cost(bad)):
        with pytest.raises(InvalidTypeError, match=r"Candidate 'a': memory_wait_s must be a real number, not"):
            call()


@pytest.mark.parametrize("value", [-1.0, math.nan, math.inf, -math.inf])
def test_an_impossible_memory_wait_is_a_configuration_error(value: float) -> None:
    # what a rule raises, naming the field, when its arithmetic fails on a hand-built candidate's value
    assert _field_fault("memory_wait_s", value) == (ConfigurationError, "finite and at least 0")
    assert _field_fault("memory_wait_s", 0) is None and _field_fault("memory_wait_s", 2.5) is None
    assert _field_fault("memory_wait_s", None) == (InvalidTypeError, "a real number")


def test_finish_never_raises_for_a_clock_that_raises_and_learns_nothing(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock(0.0)
    broken = False

    def reading() -> float:
        if broken:
            raise RuntimeError("the clock's source is gone")
        return clock()

    r = Router(block_size=4, capacity_blocks=10, clock=reading)
    decision = run(r, 0, "a")
    broken = True
    r.finish(decision)  # counted out, nothing learned, the error logged
    assert "clock raised in finish()" in caplog.text
    broken = False
    assert r.stats().in_flight == 0
    run(r, 1, "a")
    assert waits(r, 2, ["a"]) == {"a": 0.0}
    r._check()


def test_the_mean_lifetime_follows_later_finishes_with_a_weight_of_a_fiftieth() -> None:
    r, clock = router()
    for k in range(60):  # 60 lifetimes of 1 s: the plain mean of the first 50, then a fiftieth each
        decision = run(r, k, "a")
        clock.tick(1.0)
        r.finish(decision)
    slow = run(r, 60, "a")
    clock.tick(51.0)
    r.finish(slow)  # 1 + (51 - 1) / 50 = 2 s
    run(r, 61, "a")  # started now: its wait is the whole mean lifetime
    assert waits(r, 62, ["a"]) == {"a": pytest.approx(2.0)}
    r._check()
