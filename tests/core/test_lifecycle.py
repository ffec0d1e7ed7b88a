"""Request identity, the lifecycle (start / first_token / finish, leases), route-then-commit and the write path."""

from __future__ import annotations

import functools
import logging
import math
import random
from collections.abc import Sequence
from dataclasses import replace

import pytest

from prefixroute import (
    Candidate,
    ConfigurationError,
    Decision,
    DecisionError,
    LoadPolicy,
    PolicyError,
    PrefixIndex,
    Router,
    RouterStats,
)
from prefixroute.hashing import BlockHasher

from ..conftest import FakeClock, TickingClock, run_together


def counters(router: Router, backend: str) -> tuple[int, int, int]:
    """(in flight, pending prefill tokens, held blocks) as a policy sees them."""
    candidate = router.decide([1], [backend]).candidates[0]
    return candidate.in_flight, candidate.pending_prefill_tokens, candidate.held_blocks


def test_every_decision_has_its_own_id_and_ids_differ_across_routers() -> None:
    one, two = Router(rng=random.Random(1)), Router(rng=random.Random(2))
    ids = {one.route([i], ["a"]).id for i in range(100)} | {two.route([i], ["a"]).id for i in range(100)}
    assert len(ids) == 200
    # Same rng seed, same ids: reproducible.
    assert Router(rng=random.Random(1)).route([0], ["a"]).id == Router(rng=random.Random(1)).route([0], ["a"]).id


def test_finish_is_idempotent_and_never_uncounts_another_request() -> None:
    router = Router(block_size=4)
    first = router.route(list(range(8)), ["a"])
    second = router.route(list(range(8)), ["a"])
    router.start(first)
    router.start(second)
    router.start(second)  # a second start of the same id: ignored
    assert router.in_flight("a") == 2
    router.finish(first)
    router.finish(first)
    router.finish(first.id)
    assert router.in_flight("a") == 1  # the second request still counts
    router.finish("no-such-id")
    router.finish(second.id)
    assert router.in_flight("a") == 0
    assert router.stats() == RouterStats(decisions=2, commits=2, in_flight=0, ignored=4, leases_expired=0)


def test_a_finish_after_the_backend_was_removed_is_ignored_and_counts_stay_exact() -> None:
    router = Router(block_size=4)
    old = router.route(list(range(8)), ["a", "b"])
    router.start(old)
    router.remove_backend(old.backend)
    assert router.in_flight(old.backend) == 0
    new = router.route(list(range(8)), [old.backend])
    router.start(new)
    router.finish(old)  # made before the removal: must not un-count the new request
    assert router.in_flight(old.backend) == 1
    router.finish(new)
    assert counters(router, old.backend) == (0, 0, 0)
    assert router.stats().ignored == 1


def test_a_decision_of_another_router_is_refused_by_start_and_commit_and_ignored_by_finish() -> None:
    mine, theirs = Router(), Router()
    foreign = theirs.route([1, 2, 3], ["a"])
    with pytest.raises(ValueError, match="another router"):
        mine.start(foreign)
    with pytest.raises(ValueError, match="another router"):
        mine.commit(foreign)
    mine.finish(foreign)
    mine.first_token(foreign)
    assert mine.stats().ignored == 2 and mine.in_flight("a") == 0


def test_first_token_moves_work_out_of_pending_prefill_and_learns_the_prefill_speed() -> None:
    clock = FakeClock()
    router = Router(block_size=4, clock=clock)
    warm = router.route(list(range(16)), ["a"])
    decision = router.route(list(range(16)) + list(range(100, 110)), ["a"])  # 16 cached, 10 new
    assert decision.matched_tokens == 16
    router.start(decision)
    assert counters(router, "a") == (1, 10, 7)  # ceil(26 / 4) blocks
    clock.tick(0.5)
    router.first_token(decision)
    router.first_token(decision)  # idempotent
    assert counters(router, "a") == (1, 0, 7)
    speed = router.decide([1], ["a"]).candidates[0].prefill_tokens_per_s
    assert speed == pytest.approx(10 / 0.5)
    router.finish(decision)
    assert counters(router, "a") == (0, 0, 0)
    router.first_token(warm)  # never started: ignored
    assert router.stats().ignored == 1


def speed_of(router: Router, backend: str) -> float | None:
    return router.decide([1], [backend]).candidates[0].prefill_tokens_per_s


def test_the_prefill_speed_moves_a_fifth_of_the_way_to_each_new_observation() -> None:
    clock = FakeClock()
    router = Router(block_size=4, clock=clock)
    for prompt, seconds in ((list(range(20)), 1.0), (list(range(100, 140)), 0.1)):  # 20, then 400 tokens/s
        with router.track(router.route(prompt, ["a"])) as decision:
            clock.tick(seconds)
            router.first_token(decision)
    assert speed_of(router, "a") == pytest.approx(20 + 0.2 * (400 - 20))
    with router.track(router.route([7], ["b"])) as slow:  # one token in two seconds: slow, but a speed
        clock.tick(2.0)
        router.first_token(slow)
    assert speed_of(router, "b") == pytest.approx(0.5) and speed_of(router, "a") == pytest.approx(96.0)


def test_a_clock_that_stops_returning_numbers_teaches_no_speed_and_raises_nothing() -> None:
    clock = FakeClock()
    router = Router(block_size=4, clock=clock)  # no lease: the router needs no time to count requests
    decision = router.route(list(range(8)), ["a"])
    router.start(decision)
    clock.now = None  # type: ignore[assignment]
    router.first_token(decision)
    assert counters(router, "a") == (1, 0, 2) and speed_of(router, "a") is None
    router.finish(decision)


def test_finish_without_first_token_takes_back_the_pending_prefill_too() -> None:
    router = Router(block_size=4)
    decision = router.route(list(range(40)), ["a"])
    with router.track(decision):
        assert counters(router, "a") == (1, 40, 10)
    assert counters(router, "a") == (0, 0, 0)


def prefill_counts(router: Router, backend: str) -> tuple[int, int]:
    """(pending prefill tokens, requests in prefill) as a policy sees them."""
    candidate = router.decide([1], [backend]).candidates[0]
    return candidate.pending_prefill_tokens, candidate.in_prefill


def unreporting(clock: FakeClock) -> Router:
    """A router (no lease) whose gateway reports no first tokens: a request has finished without one."""
    router = Router(block_size=4, clock=clock)
    done = router.route([1], ["a"])
    router.start(done)
    router.finish(done)
    return router


def started(router: Router, clock: FakeClock, prompts: Sequence[int], backend: str = "a") -> list[str]:
    """Start one request of each length in ``prompts`` (distinct tokens: nothing cached) a second apart; their ids."""
    ids = []
    for length in prompts:
        decision = router.route([int(clock.now) * 1000 + t for t in range(length)], [backend])
        router.start(decision)
        ids.append(decision.id)
        clock.tick(1.0)
    return ids


def test_without_first_tokens_the_engines_waiting_queue_tells_which_requests_are_past_their_prefill() -> None:
    clock = FakeClock()
    router = unreporting(clock)
    old = started(router, clock, [10, 20, 30, 40, 50])
    router.set_engine_load("a", queue_len=1, kv_usage=0.5)  # the first figures: nothing known to be older yet
    assert prefill_counts(router, "a") == (150, 5)
    new = started(router, clock, [60])
    router.set_engine_load("a", queue_len=1, kv_usage=0.5)
    # Of the five started before the previous figures, the newest is waiting and the one before it may be part-way
    # through a chunked prefill; the three older are past it. The request started since is left in prefill and not
    # taken for the waiting one (the figure may predate it).
    assert prefill_counts(router, "a") == (40 + 50 + 60, 3)
    newer = started(router, clock, [70])
    router.set_engine_load("a", queue_len=2, kv_usage=0.5)  # as many waiting as started before the previous figures
    assert prefill_counts(router, "a") == (40 + 50 + 60 + 70, 4)
    router.set_engine_load("a", queue_len=0, kv_usage=0.5)
    assert prefill_counts(router, "a") == (70, 1)  # the newest admitted stays, in case its prefill is not done
    router.first_token(old[4])  # already taken out: nothing moves twice, and no speed is learned from a guess
    assert prefill_counts(router, "a") == (70, 1) and speed_of(router, "a") is None
    for decision_id in old + new + newer:
        router.finish(decision_id)
    assert counters(router, "a") == (0, 0, 0)
    router._check()


def test_figures_that_were_dropped_or_came_with_no_queue_infer_nothing() -> None:
    clock = FakeClock()
    router = unreporting(clock)
    started(router, clock, [10, 20, 30])
    router.set_engine_load("a", queue_len=0, kv_usage=None)
    router.set_engine_load("a", queue_len=None, kv_usage=None)  # a failed scrape: the figures, and when, dropped
    router.set_engine_load("a", queue_len=0, kv_usage=None)  # again the first figures
    router.set_engine_load("a", queue_len=None, kv_usage=0.3)  # no queue: nothing to infer from
    assert prefill_counts(router, "a") == (60, 3)
    router.set_engine_load("a", queue_len=0, kv_usage=None)
    assert prefill_counts(router, "a") == (30, 1)
    for _ in range(2):  # a backend that never had a request: nothing to infer, nothing raised
        router.set_engine_load("b", queue_len=0, kv_usage=None)
    assert prefill_counts(router, "b") == (0, 0)


def test_a_clock_that_returns_no_number_infers_nothing_and_raises_nothing() -> None:
    clock = FakeClock()
    router = unreporting(clock)
    started(router, clock, [10, 20])
    router.set_engine_load("a", queue_len=0, kv_usage=None)
    clock.now = None  # type: ignore[assignment]
    router.set_engine_load("a", queue_len=0, kv_usage=None)
    assert prefill_counts(router, "a") == (30, 2)
    router._check()


@pytest.mark.parametrize(
    "reported", ["a first token", "a first token after a finish without one", "no finish yet", "only a refusal"]
)
def test_the_queue_infers_nothing_while_first_tokens_may_come(reported: str) -> None:
    clock = FakeClock()
    router = Router(block_size=4, clock=clock)
    early, failed = router.route([1], ["a"]), router.route([2], ["a"])
    router.start(early)
    router.start(failed)
    if reported == "a first token":
        router.first_token(early)
        router.finish(failed)  # a failure before its first token: no sign that the gateway reports none
    elif reported == "a first token after a finish without one":
        router.finish(failed)
        router.first_token(early)  # it does report them: the inference stops
    elif reported == "only a refusal":
        router.finish(failed, refused=True)  # refused by the engine: no first token was to come
    started(router, clock, [10, 20, 30])
    for _ in range(3):
        router.set_engine_load("a", queue_len=0, kv_usage=None)
        clock.tick(1.0)
    in_prefill = {"no finish yet": 2, "only a refusal": 1}.get(reported, 0)  # early and failed, if in prefill
    assert prefill_counts(router, "a") == (60 + in_prefill, 3 + in_prefill)
    router._check()


def test_a_request_that_moved_backend_is_inferred_on_its_new_one_only() -> None:
    clock = FakeClock()
    router = unreporting(clock)
    decision = router.route(list(range(10)), ["a", "b"])
    router.start(decision)
    other = "b" if decision.backend == "a" else "a"
    router.set_engine_load(other, queue_len=0, kv_usage=None)
    clock.tick(1.0)
    router.start(router.commit(decision, other))  # Ray and LiteLLM retries move a request
    clock.tick(1.0)
    later = router.route(list(range(100, 120)), [other])
    router.start(later)
    clock.tick(1.0)
    for _ in range(2):
        router.set_engine_load(decision.backend, queue_len=0, kv_usage=None)
    assert prefill_counts(router, decision.backend) == (0, 0)
    router.set_engine_load(other, queue_len=0, kv_usage=None)  # both started after the previous figures there
    assert prefill_counts(router, other) == (10 + 20, 2)
    clock.tick(1.0)
    router.set_engine_load(other, queue_len=0, kv_usage=None)
    assert prefill_counts(router, other) == (20, 1)  # the newest admitted stays
    router._check()


def test_leases_end_requests_that_are_never_finished() -> None:
    clock = FakeClock()
    router = Router(block_size=4, clock=clock, lease=10.0)
    forever = router.route(list(range(8)), ["a"])
    short = router.route(list(range(8)), ["a"])
    router.start(forever, lease=100.0)
    router.start(short)  # the router's default lease, 10 s
    clock.tick(9.9)
    assert router.expire() == 0 and router.in_flight("a") == 2
    clock.tick(0.2)
    router.route([5], ["a"])  # routing expires due leases by itself
    assert router.in_flight("a") == 1 and router.stats().leases_expired == 1
    router.finish(short)  # too late: ignored
    assert router.stats().ignored == 1
    clock.tick(100)
    assert router.expire() == 1 and router.stats().leases_expired == 2
    assert counters(router, "a") == (0, 0, 0)


def test_finished_requests_do_not_keep_their_lease_entries_until_the_deadline() -> None:
    """Was: a finish left its (deadline, id) on the lease heap until the deadline passed: at 1,000 requests/s under
    the sidecar's 600 s lease, 600,000 entries (~90 MB) for requests long finished."""
    clock = FakeClock()
    router = Router(block_size=4, clock=clock, lease=600.0)

    def started() -> Decision:
        decision = router.route(list(range(8)), ["a", "b"])
        router.start(decision)
        return decision

    held = [started() for _ in range(10)]  # ten stay in flight throughout
    for _ in range(20_000):
        router.finish(started())
        clock.tick(0.001)
    assert len(router._leases) <= 2 * 10 + 1024 + 1
    router._check()  # every request in flight still has its lease: they expire as before
    clock.tick(600)
    assert router.expire() == 10 and all(router.in_flight(b) == 0 for b in ("a", "b"))
    for decision in held:
        router.finish(decision)
    assert router.stats().ignored == 10


@pytest.mark.parametrize("seed", range(3))
def test_the_lease_heap_stays_whole_when_rebuilt_among_restarts_expiries_and_finishes(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rebuilt whenever it holds more than twice the requests in flight (no slack here): every request in flight
    keeps the entry of its current lease, a start again (a retry elsewhere) included, and expires on time."""
    monkeypatch.setattr("prefixroute.router._LEASE_SLACK", 0)
    rng = random.Random(seed)
    clock = FakeClock()
    router = Router(block_size=4, clock=clock)
    live: list[Decision] = []
    for _ in range(600):
        action = rng.random()
        if action < 0.4 or not live:
            decision = router.decide(list(range(rng.randrange(1, 12))), ["a", "b", "c"])
            router.commit(decision)
            router.start(decision, lease=rng.choice([None, 0.5, 2.0, 5.0]))
            live.append(decision)
        elif action < 0.75:
            router.finish(live.pop(rng.randrange(len(live))), refused=rng.random() < 0.2)
        elif action < 0.85:  # a retry: committed elsewhere and started again, under a new lease
            decision = router.commit(rng.choice(live), rng.choice(["a", "b", "c"]))
            router.start(decision, lease=rng.choice([0.5, 3.0]))
        else:
            clock.tick(rng.choice([0.1, 0.6, 2.5]))
            router.expire()
        router._check()
    for decision in live:
        router.finish(decision)
    router._check()
    assert router.stats().in_flight == 0


def test_expired_leases_are_warned_of_at_most_once_a_minute_each_one_at_debug(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock(now=0.0)
    router = Router(block_size=4, clock=clock, lease=1.0)
    caplog.set_level(logging.DEBUG, logger="prefixroute")

    def expire(count: int) -> None:
        for _ in range(count):
            router.start(router.route([1, 2, 3, 4], ["a"]))
        clock.tick(1.0)
        assert router.expire() == count

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]

    expire(3)
    assert warnings() == [
        "3 request(s) reached their lease before finish() (the latest on a; 3 since the router started): check that "
        "finish() is called (behind a gateway: its release path); this warning repeats at most once a minute"
    ]
    for _ in range(59):
        expire(2)  # 59 s more: each expiry at DEBUG only
    assert len(warnings()) == 1
    assert sum(r.levelno == logging.DEBUG and "lease expired" in r.getMessage() for r in caplog.records) == 121
    expire(1)  # a minute after the first warning: the next says how many since
    assert len(warnings()) == 2
    assert warnings()[1].startswith("119 request(s) reached their lease before finish() (the latest on a; 122 since")
    assert router.stats().leases_expired == 122 and router.in_flight("a") == 0


def test_start_ends_due_leases_first_and_a_request_whose_lease_ran_out_is_not_started_again() -> None:
    clock = FakeClock(now=0.0)
    router = Router(clock=clock)
    decision = router.route([1], ["a", "b"])
    router.start(decision, lease=1.0)
    clock.tick(1.0)
    router.start(decision, lease=5.0)  # late: its lease ran out, so the request is over
    assert router.stats() == RouterStats(decisions=1, commits=1, in_flight=0, ignored=1, leases_expired=1)
    retried = router.commit(decision, "b" if decision.backend == "a" else "a")
    router.start(retried, lease=5.0)  # a retry elsewhere: counted anew
    assert router.stats().in_flight == 1 and router.in_flight(retried.backend) == 1
    router.finish(retried)
    router.start(router.commit(retried), lease=5.0)  # sent again to the same backend: counted anew too
    assert router.in_flight(retried.backend) == 1


@pytest.mark.parametrize("end", ["finish", "refused", "lease", "remove_backend"])
def test_a_start_that_comes_after_its_request_ended_is_ignored(end: str) -> None:
    # Was counted again, as a new prefill, and without a lease never left: a start() callback that lands after the
    # finish() of its request (a gateway's racing callbacks) brought 1,000 such requests back into the counts.
    clock = FakeClock(now=0.0)
    router = Router(block_size=4, clock=clock)
    decisions = [router.route(list(range(i, i + 64)), ["a", "b"]) for i in range(0, 3000, 100)]
    for decision in decisions:
        router.start(decision, lease=1.0)
        if end in ("finish", "refused"):
            router.finish(decision, refused=end == "refused")
    if end == "lease":
        clock.tick(1.0)
        router.expire()
    elif end == "remove_backend":
        router.remove_backend("a")
        router.remove_backend("b")
    for decision in decisions:
        router.start(decision)
        router._check()
    stats = router.stats()
    assert (stats.in_flight, stats.ignored) == (0, len(decisions))
    candidates = router.decide([1], ["a", "b"]).candidates
    assert all((c.in_flight, c.pending_prefill_tokens, c.active_blocks) == (0, 0, 0) for c in candidates)


def test_a_lease_has_run_out_once_its_seconds_have_passed() -> None:
    clock = FakeClock(now=0.0)
    router = Router(clock=clock, lease=10.0)
    router.start(router.route([1], ["a"]))
    clock.tick(10.0)
    assert router.in_flight("a") == 0 and router.stats().leases_expired == 1


@pytest.mark.parametrize("lease", [0, -1, math.nan, math.inf, True, "5"])
def test_nonsense_leases_are_refused_when_given(lease: object) -> None:
    with pytest.raises((ConfigurationError, TypeError)):
        Router(lease=lease)  # type: ignore[arg-type]
    router = Router()
    decision = router.route([1], ["a"])
    with pytest.raises((ConfigurationError, TypeError)):
        router.start(decision, lease=lease)  # type: ignore[arg-type]
    assert router.in_flight("a") == 0


class Sly(str):
    """A str whose own hash files it apart from the plain str it equals."""

    def __hash__(self) -> int:
        return 1


def test_a_decision_whose_id_or_backend_became_a_str_subclass_is_refused_but_a_bare_one_finishes() -> None:
    router = Router(block_size=4)
    decision = router.route(list(range(8)), ["a"])
    for field in ("id", "backend"):
        altered = replace(decision, **{field: Sly(getattr(decision, field))})  # type: ignore[arg-type]
        for call in (router.start, router.commit):
            with pytest.raises(DecisionError, match="altered"):
                call(altered)
    router.start(decision)
    router.finish(Sly(decision.id))  # a lifecycle call reads a str subclass's id as the plain str
    second = router.route(list(range(8)), ["a"])
    router.start(second)
    router.finish(replace(second, id=Sly(second.id)))  # also as an object's id
    assert router.stats().in_flight == 0 and router.stats().ignored == 0


def test_decide_records_nothing_and_commit_records_the_backend_actually_used() -> None:
    router = Router(block_size=4)
    tokens = list(range(32))
    decision = router.decide(tokens, ["a", "b", "c"])
    assert len(router.index) == 0 and router.stats().commits == 0
    other = next(c.backend for c in decision.candidates if c.backend != decision.backend)
    committed = router.commit(decision, other)
    assert (committed.id, committed.backend) == (decision.id, other) and router.stats().commits == 1
    assert router.index.hashes(other) and not router.index.hashes(decision.backend)
    again = router.route(tokens, ["a", "b", "c"])
    assert (again.backend, again.matched_tokens) == (other, 32)
    with pytest.raises(ValueError, match="not a candidate"):
        router.commit(decision, "z")


def test_a_commit_elsewhere_describes_that_backends_match_and_reason() -> None:
    router = Router(block_size=4)
    with router.track(router.route(list(range(8)), ["a"])):  # a holds the first two blocks
        pass
    decision = router.decide(list(range(16)), ["a", "b"])
    assert (decision.backend, decision.matched_tokens, decision.reason) == ("a", 8, "prefix")
    on_b = router.commit(decision, "b")
    assert (on_b.backend, on_b.matched_tokens, on_b.reason) == ("b", 0, "load-fallback")
    back = router.commit(on_b, "a")
    assert (back.backend, back.matched_tokens, back.reason) == ("a", 8, "prefix")
    fresh = router.decide(list(range(100, 116)), ["a", "b"])
    elsewhere = next(c.backend for c in fresh.candidates if c.backend != fresh.backend)
    assert router.commit(fresh, elsewhere).reason == "miss"
    assert router.stats().commits == 4  # the route, and each commit


def test_a_start_after_a_commit_elsewhere_moves_the_count_and_a_repeat_is_ignored() -> None:
    router = Router(block_size=4)
    decision = router.route(list(range(32)), ["a", "b"])
    first, other = decision.backend, next(c.backend for c in decision.candidates if c.backend != decision.backend)
    router.start(decision)
    router.first_token(decision)
    router.start(decision)  # the same backend again: ignored
    assert (router.in_flight(first), router.stats().ignored) == (1, 1)
    moved = router.commit(decision, other)
    router.start(moved)  # a retry on the other backend: the count goes with it, prefill ahead again
    assert (router.in_flight(first), router.in_flight(other), router.stats().in_flight) == (0, 1, 1)
    b = router.decide(list(range(500, 504)), [other]).candidates[0]
    assert b.in_prefill == 1 and b.pending_prefill_tokens == moved.prompt_tokens - moved.matched_tokens
    router.finish(moved)
    assert [counters(router, x) for x in (first, other)] == [(0, 0, 0)] * 2 and router.stats().in_flight == 0


def test_commit_of_a_stale_decision_is_safe_when_the_index_changed_meanwhile() -> None:
    router = Router(block_size=4, capacity_blocks=4)
    decision = router.decide(list(range(16)), ["a"])
    router.route(list(range(16)), ["a"])
    router.route(list(range(100, 116)), ["a"])  # evicts the first prompt
    router.commit(decision)
    router._check()
    assert router.route(list(range(16)), ["a"]).matched_tokens == 16


def test_a_policy_returning_an_equal_but_new_candidate_is_an_error_and_nothing_is_recorded() -> None:
    class Copycat(LoadPolicy):
        def choose(self, candidates: Sequence[Candidate]) -> Candidate:
            return candidates[0]._replace()  # equal fields, another object

    router = Router(policy=Copycat())
    with pytest.raises(PolicyError, match="not one of the candidates"):
        router.route(list(range(64)), ["a"])
    assert len(router.index) == 0 and router.stats().decisions == 0


@pytest.mark.parametrize(
    ("queue_len", "kv_usage"), [(-1, None), (None, 1.5), (None, math.nan), (None, -0.1), (1.5, None), (True, None)]
)
def test_engine_figures_are_validated(queue_len: object, kv_usage: object) -> None:
    router = Router()
    with pytest.raises(ConfigurationError):
        router.set_engine_load("a", queue_len=queue_len, kv_usage=kv_usage)  # type: ignore[arg-type]


def test_engine_figures_reach_the_candidates_and_two_nones_drop_them() -> None:
    router = Router()

    def figures() -> tuple[int | None, float | None]:
        candidate = router.decide([1], ["a"]).candidates[0]
        return candidate.queue_len, candidate.kv_usage

    router.set_engine_load("a", queue_len=3, kv_usage=0.5)
    assert figures() == (3, 0.5)
    router.set_engine_load("a", queue_len=None, kv_usage=None)
    assert figures() == (None, None)
    router.set_engine_load("a", queue_len=None, kv_usage=0.25)  # one figure unknown: the other still counts
    assert figures() == (None, 0.25)
    router.set_engine_load("a", queue_len=4, kv_usage=None)
    assert figures() == (4, None)


def test_the_write_path_stores_chains_continuations_and_removals() -> None:
    router = Router(block_size=2)
    hashes = BlockHasher(2).hash([1, 2, 3, 4, 5, 6])
    router.store("a", hashes[:1])
    router.store("a", hashes[1:], parent=hashes[0])
    assert router.route([1, 2, 3, 4, 5, 6], ["a", "b"]).matched_tokens == 6
    router.evict("a", hashes[2:])
    assert router.decide([1, 2, 3, 4, 5, 6], ["a"]).matched_tokens == 4
    router.write("a", [(False, hashes[1:2], None), (True, hashes[1:], hashes[0])])
    assert router.decide([1, 2, 3, 4, 5, 6], ["a"]).matched_tokens == 6
    router.clear_backend("a")
    assert router.decide([1, 2, 3, 4, 5, 6], ["a"]).matched_tokens == 0
    router._check()


def test_commit_describes_the_confirmed_tokens_of_the_backend_it_commits_to() -> None:
    confirmed = {"a": 1, "b": 2}

    class Confirming(PrefixIndex):
        def match_confirmed(self, hashes: Sequence[int], backend: str) -> int | None:
            return min(confirmed[backend], len(hashes))

    router = Router(block_size=4, index=Confirming(4))
    decision = router.decide(list(range(16)), ["a", "b"])
    assert decision.confirmed_tokens == 4 * confirmed[decision.backend]
    for backend in ("b", "a", "b"):
        assert router.commit(decision, backend).confirmed_tokens == 4 * confirmed[backend]


def test_a_user_index_subclass_is_the_one_used() -> None:
    class Recording(PrefixIndex):
        def __init__(self) -> None:
            super().__init__(4)
            self.predicted: list[str] = []

        def predict(self, hashes: Sequence[int], backend: str, held: int) -> None:
            self.predicted.append(backend)
            super().predict(hashes, backend, held)

    index = Recording()
    router = Router(block_size=4, index=index)
    decision = router.route(list(range(8)), ["a"])
    assert index.predicted == [decision.backend] and router.index is index
    with pytest.raises(ConfigurationError, match="block_size"):
        Router(block_size=8, index=Recording())
    with pytest.raises(ConfigurationError, match="capacity_blocks"):
        Router(block_size=4, index=Recording(), capacity_blocks=10)


def test_concurrent_routes_namespaces_removals_capacity_changes_and_clears_leave_exact_counts(switchy: None) -> None:
    clock = TickingClock()
    router = Router(block_size=4, capacity_blocks=500, clock=clock, lease=5.0)
    backends = [f"gpu{i}" for i in range(6)]
    prefixes = [list(range(i * 100, i * 100 + 32)) for i in range(10)]

    def requests(seed: int) -> None:
        rng = random.Random(seed)
        for n in range(1500):
            tokens = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(0, 12))]
            namespace = f"model-{seed}-{n % 300}"  # 8 threads x 300 > the seed cache's 1,024 entries
            decision = router.decide(tokens, backends, namespace=namespace)
            decision = router.commit(decision, rng.choice([c.backend for c in decision.candidates]))
            router.start(decision)
            if rng.random() < 0.5:
                router.first_token(decision)
            if rng.random() < 0.1:  # sent elsewhere after it started (a retry): the count moves
                router.start(router.commit(decision, rng.choice([c.backend for c in decision.candidates])))
            if rng.random() < 0.9:  # the rest are abandoned: their leases end them; some the engine refused
                router.finish(decision, refused=rng.random() < 0.3)
            if rng.random() < 0.05:
                router.finish(decision)  # a duplicate finish

    def churn(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(400):
            backend = rng.choice(backends)
            action = rng.randrange(5)
            if action == 0:
                router.remove_backend(backend)
            elif action == 1:
                router.set_capacity(backend, rng.choice([None, 0, 50, 500]))
            elif action == 2:
                router.clear_backend(backend)
            elif action == 3:
                router.set_engine_load(backend, queue_len=rng.randrange(5), kv_usage=rng.random())
            else:
                router.expire()

    run_together(
        *(functools.partial(requests, seed) for seed in range(6)),
        *(functools.partial(churn, seed) for seed in (100, 101)),
    )
    clock.now += 10.0  # every lease is over
    router.expire()
    assert router.stats().in_flight == 0
    assert [counters(router, b) for b in backends] == [(0, 0, 0)] * len(backends)
    assert [router.decide([1], [b]).candidates[0].pending_prefill_context for b in backends] == [0] * len(backends)
    router._check()  # every counter, the distinct blocks and the attention fit's figure (None or above 0)


def test_many_namespaces_from_many_threads(switchy: None) -> None:
    """More namespaces than the router's seed cache holds, from 8 threads: the cache is shared state too."""
    router = Router(block_size=4)

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(20_000):
            router.decide([], ["a"], namespace=f"model-{rng.randrange(3000)}")

    run_together(*(functools.partial(worker, seed) for seed in range(8)))
    assert router.stats().decisions == 8 * 20_000


def test_decisions_are_immutable_and_their_reasons_are_the_documented_ones() -> None:
    import dataclasses
    import typing

    from prefixroute import BoundedLoad, Decision, Reason, RoundRobin

    seen = set()
    for policy in (BoundedLoad(), RoundRobin()):
        router = Router(block_size=4, policy=policy)
        for i in range(40):
            decision = router.route(list(range(12)) + [i], ["a", "b", "c", "d"])  # one hot prefix
            assert isinstance(decision, Decision)
            router.start(decision)  # in flight: the bound diverts some repeats ("load-fallback")
            seen.add(decision.reason)
    assert seen == set(typing.get_args(Reason))
    with pytest.raises(dataclasses.FrozenInstanceError):
        decision.backend = "b"  # type: ignore[misc]
