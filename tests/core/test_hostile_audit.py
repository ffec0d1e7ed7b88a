"""Hostile inputs an independent audit found, each failing before its fix: the core API's invariants, counts and
errors under inputs the earlier hostile suites did not generate."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

from prefixroute import (
    BlockHasher,
    BoundedLoad,
    Candidate,
    ConfigurationError,
    CostAware,
    InvalidTypeError,
    LinearTTFT,
    LoadPolicy,
    PredictedTTFT,
    PrefixIndex,
    RoundRobin,
    Router,
    kv_fraction,
)

from ..conftest import FakeClock


@pytest.mark.parametrize("capacity", [None, 5])
def test_predict_of_a_chain_that_contradicts_the_store_keeps_its_count_exact(capacity: int | None) -> None:
    # Was: predict() of a caller's hashes skipped the check insert() makes for a block held under another parent,
    # so block 0 was stored in two generations and blocks() counted it twice (4 blocks for 3 hashes).
    index = PrefixIndex(4, capacity_blocks=capacity)
    index.insert([10, 12], "a")
    index.predict([11, 10], "a", 0)  # 10 is held as a root, and now comes as block 1 of another chain
    index._check()
    assert index.blocks("a") == len(index.hashes("a")) == 3
    assert index.match([11, 10], ["a"]) == {"a": 2}
    index.remove([10], "a")  # a hole: the store walks, and finds exactly what it holds
    index._check()
    assert index.match([11, 10], ["a"]) == {"a": 1}
    assert index.match([10, 12], ["a"]) == {"a": 0}


_HUGE = 2**1100  # an int too large for a float


_FAILS_ON = {  # the fields each policy's arithmetic overflowed on
    BoundedLoad(): ("in_flight", "queue_len"),
    CostAware(): ("in_flight", "queue_len"),
    PredictedTTFT(): (
        "in_flight",
        "queue_len",
        "pending_prefill_tokens",
        "in_prefill",
        "pending_prefill_context",
        "active_blocks",
    ),  # fmt: skip
    PredictedTTFT(use_speed=True): (
        "in_flight",
        "queue_len",
        "pending_prefill_tokens",
        "in_prefill",
        "pending_prefill_context",
    ),  # fmt: skip
}


@pytest.mark.parametrize(
    ("policy", "field"), [(policy, field) for policy, fields in _FAILS_ON.items() for field in fields], ids=repr
)
def test_a_hand_built_candidate_with_an_int_too_large_for_a_float_is_named(policy: LoadPolicy, field: str) -> None:
    # Was: the policies' float arithmetic raised a bare OverflowError ("int too large to convert to float"), and the
    # field check behind it found nothing wrong with an int >= 0, so the error left the exception tree.
    extra: dict[str, Any] = {"capacity_blocks": 5} if field == "active_blocks" else {"attention_tokens": 1.0}
    candidate = Candidate("a", 0, 64, 0, **extra)._replace(**{field: _HUGE})  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=rf"^Candidate 'a': {field} must be below 2\*\*63, not an int of 1101"):
        policy.choose([candidate, Candidate("b", 0, 64, 0)])
    largest = candidate._replace(**{field: 2**63 - 1})  # type: ignore[arg-type]
    assert policy.choose([largest]).backend == "a"  # well formed


@pytest.mark.parametrize(
    ("model", "candidate"),
    [
        (LinearTTFT(), Candidate("a", 0, 64, _HUGE)),
        (LinearTTFT(), Candidate("a", 0, _HUGE, 0)),
        (kv_fraction, Candidate("a", 0, 64, 0, active_blocks=_HUGE, capacity_blocks=5)),
    ],
)
def test_the_cost_models_name_a_field_too_large_for_a_float(
    model: Callable[[Candidate], float], candidate: Candidate
) -> None:
    with pytest.raises(ConfigurationError, match=r"must be below 2\*\*63, not an int of 1101 bits"):
        model(candidate)


@pytest.mark.parametrize("reading", [None, "12:00", math.nan])
def test_a_clock_that_stops_returning_numbers_while_a_lease_runs_fails_no_call(reading: object) -> None:
    # Was: with a lease running, a reading that is no number (None, a str) made route(), start(), in_flight(),
    # stats() and expire() raise a bare TypeError ("'<=' not supported") from the lease check, where a NaN reading
    # only keeps the leases waiting: every call of the router failed until the clock recovered.
    clock = FakeClock()
    router = Router(block_size=4, clock=clock)
    router.start(router.route([1, 2, 3, 4], ["a"]), lease=1.0)
    clock.now = reading  # type: ignore[assignment]
    decision = router.route([5, 6, 7, 8], ["a"])
    router.start(decision)
    assert router.in_flight("a") == 2
    assert router.expire() == 0
    assert router.stats().in_flight == 2
    router.finish(decision)
    clock.now = 200.0  # the clock recovers: the lease ends
    assert router.in_flight("a") == 0
    assert router.stats().leases_expired == 1
    router._check()


@pytest.mark.parametrize("reading", [None, "12:00", math.nan])
def test_an_event_index_whose_clock_returns_no_number_routes_and_trusts_no_prediction(reading: object) -> None:
    # Was: EventIndex's clock returning None or a str made every route() through it raise a bare TypeError (from
    # the speculative generations' rotation); a NaN reading already started the speculative part over. Now any
    # reading that is no number does that, and nothing fails. At construction, where the clock is given, such a
    # reading is refused (taken, it distrusted every prediction from the start, unsaid).
    from prefixroute.vllm import EventIndex

    clock = FakeClock()
    router = Router(block_size=4, index=EventIndex(4, speculative_ttl=3.0, clock=clock))
    router.route([1, 2, 3, 4, 5, 6, 7, 8], ["a", "b"])
    clock.now = reading  # type: ignore[assignment]
    decision = router.route([1, 2, 3, 4, 5, 6, 7, 8], ["a", "b"])
    assert decision.matched_tokens == 0  # the prediction is no longer trusted
    clock.now = 100.0  # the clock recovers: predictions are trusted again
    first = router.route([1, 2, 3, 4, 5, 6, 7, 8], ["a", "b"])
    again = router.route([1, 2, 3, 4, 5, 6, 7, 8], ["a", "b"])
    assert (again.backend, again.matched_tokens) == (first.backend, 8)
    router._check()
    with pytest.raises(ConfigurationError, match="clock returned .*: it must return a finite number of seconds"):
        EventIndex(4, clock=lambda: reading)  # type: ignore[arg-type, return-value]


def test_a_policy_whose_prefix_aware_fails_is_refused_when_the_router_takes_it_not_after_a_route_recorded() -> None:
    class Broken(RoundRobin):
        @property
        def prefix_aware(self) -> bool:  # type: ignore[override]
            raise RuntimeError("no")

    with pytest.raises(ConfigurationError, match=r"prefix_aware raised RuntimeError: no; make it a bool"):
        Router(policy=Broken())

    class Truthy(RoundRobin):
        prefix_aware = 1  # type: ignore[assignment]

    router = Router(block_size=4, policy=Truthy())
    router.route(list(range(8)), ["a", "b"])
    assert router.route(list(range(8)), ["a", "b"]).reason in ("prefix", "load-fallback")


def test_a_policy_whose_prefix_aware_has_no_truth_is_refused_when_the_router_takes_it() -> None:
    class NoTruth:
        def __bool__(self) -> bool:
            raise ValueError("ambiguous")

    class Broken(RoundRobin):
        prefix_aware = NoTruth()  # type: ignore[assignment]

    with pytest.raises(ConfigurationError, match=r"prefix_aware raised ValueError: ambiguous"):
        Router(policy=Broken())


def test_a_commit_elsewhere_under_a_policy_that_ignores_prefixes_says_policy() -> None:
    router = Router(block_size=4, policy=RoundRobin())
    router.commit(router.route(list(range(8)), ["a", "b"]))
    decision = router.route(list(range(8)), ["a", "b"])
    other = next(c.backend for c in decision.candidates if c.backend != decision.backend)
    assert router.commit(decision, other).reason == "policy"


def test_a_lease_ends_at_its_deadline_exactly() -> None:
    clock = FakeClock()
    router = Router(block_size=4, clock=clock)
    router.start(router.route([1, 2, 3, 4], ["a"]), lease=1.0)
    clock.now = 101.0
    assert router.in_flight("a") == 0


def test_a_set_is_refused_as_a_chain_to_store_and_taken_as_blocks_to_remove() -> None:
    # Was: Router.store()/write() and PrefixIndex.insert() took a set, filing its first item (in set order) as the
    # chain's root, so none of the blocks stored ever matched; predict() refused the same set.
    router = Router(block_size=4)
    prompt = list(range(16))
    chain = router.hasher.hash(prompt)
    stores: list[Callable[[], object]] = [
        lambda: router.store("gpu0", set(chain)),  # type: ignore[arg-type]
        lambda: router.write("gpu0", [(True, frozenset(chain), None)]),  # type: ignore[list-item]
        lambda: router.index.insert(set(chain), "gpu0"),  # type: ignore[arg-type]
    ]
    for store in stores:
        with pytest.raises(InvalidTypeError, match="^a chain of block hashes to store must be ordered as the prompt"):
            store()
    assert router.index.blocks("gpu0") == 0
    router.store("gpu0", tuple(chain))
    assert router.decide(prompt, ["gpu0"]).matched_tokens == 16
    router.evict("gpu0", set(chain[2:]))  # removals have no order
    router.write("gpu0", [(False, frozenset(chain[1:2]), None)])  # type: ignore[list-item]
    router._check()
    assert router.decide(prompt, ["gpu0"]).matched_tokens == 4


def test_an_empty_backend_id_is_refused_by_the_index_as_by_the_router() -> None:
    # Was: PrefixIndex filed blocks and capacities under "" (Router.set_capacity("") refused it).
    index = PrefixIndex(4)
    calls: list[Callable[[], object]] = [
        lambda: index.insert([1, 2], ""),
        lambda: index.set_capacity("", 8),
        lambda: PrefixIndex(4, capacity_blocks={"": 8}),
        lambda: Router(capacity_blocks={"gpu0": 4, "": 8}),
    ]
    for call in calls:
        with pytest.raises(ConfigurationError, match="^a backend id is an empty str: give each backend a non-empty id"):
            call()
    assert index.backends() == [] and len(index) == 0


def _gone() -> float:
    raise OSError("clock source gone")


@pytest.mark.parametrize("clock", [lambda: None, lambda: math.nan, _gone], ids=["none", "nan", "raises"])
def test_a_router_with_leases_reads_its_clock_when_given(clock: Callable[[], float]) -> None:
    # Was accepted, then every start() refused (or raised the clock's own OSError) for the router's whole life.
    with pytest.raises(ConfigurationError, match="^clock (returned|raised) .*as time.monotonic$"):
        Router(clock=clock, lease=30.0)
    Router(clock=clock)  # without leases the clock need not return seconds


def test_a_lease_that_ends_past_the_largest_float_names_the_lease_not_the_clock() -> None:
    with pytest.raises(ConfigurationError, match="^a lease of 1e\\+308 s from the clock's reading 1e\\+308 ends past"):
        Router(clock=lambda: 1e308, lease=1e308)


def test_a_clock_that_raises_in_first_token_costs_only_the_speed_it_would_teach(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Was the clock's own OSError out of first_token(), which a streaming proxy calls mid-stream.
    broken = False

    def clock() -> float:
        if broken:
            raise OSError("clock source gone")
        return 0.0

    router = Router(block_size=4, clock=clock)
    decision = router.route(list(range(16)), ["gpu0", "gpu1"])
    router.start(decision)
    broken = True
    router.first_token(decision)
    broken = False
    assert "clock raised in first_token()" in caplog.text
    candidate = next(c for c in router.decide([9] * 8, ["gpu0", "gpu1"]).candidates if c.backend == decision.backend)
    assert candidate.in_prefill == 0 and candidate.pending_prefill_tokens == 0
    assert candidate.in_flight == 1 and candidate.prefill_tokens_per_s is None
    router.finish(decision)
    router._check()
    assert router.stats().in_flight == 0


def test_a_prompt_that_fits_the_capacity_is_kept_whole_not_evicted_with_the_rest() -> None:
    # Was: the prompt joined a newest generation holding a few blocks, the store went past its capacity, and evicting
    # whole generations, oldest first, dropped the newest too: every block gone, the prompt's included.
    capacity = 1600  # 16 generations of 100 blocks
    for blocks in (capacity, capacity - 39, 1561):
        router = Router(block_size=4, capacity_blocks=capacity)
        for i in range(40):
            router.route([10_000 + i] * 4, ["gpu0"])
        prompt = list(range(4 * blocks))
        router.route(prompt, ["gpu0"])
        router._check()
        assert router.index.blocks("gpu0") >= blocks
        assert router.decide(prompt, ["gpu0"]).matched_tokens == 4 * blocks


def test_a_chain_whose_first_block_is_held_under_another_parent_makes_the_store_walk() -> None:
    # Was: only blocks after the chain's leading held run were looked at, so a root chain of a block held as a child
    # (or a continuation of one held under another parent) moved it to a newer generation than its parent, left the
    # store on its binary search, and match() counted blocks it did not hold.
    h0, h1, h2, h3 = BlockHasher(1).hash([1, 2, 3, 4])
    (p,) = BlockHasher(1).hash([7])
    for contradiction in ([h2], None), ([h2], p):
        index = PrefixIndex(1, capacity_blocks=5)
        index.insert([h0, h1, h2, h3], "a")
        index.insert([p], "a")
        index.insert(contradiction[0], "a", parent=contradiction[1])
        index._check(chains=[[h0, h1, h2, h3]])
        store = index.store("a")
        assert store is not None and store.open
        index.remove([h1], "a")  # a hole under h2: the match ends at it whatever the generations say
        assert index.match([h0, h1, h2, h3], ["a"]) == {"a": 1}
        index._check()
