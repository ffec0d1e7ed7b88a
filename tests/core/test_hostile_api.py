"""The public core API as a hostile caller uses it: odd prompt containers, broken clocks, hooks and policies, huge
numbers and every call from many threads at once. Each case below failed (or crashed from deep inside) before."""

from __future__ import annotations

import array
import copy
import functools
import math
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from prefixroute import (
    BlockHasher,
    BoundedLoad,
    Candidate,
    ConfigurationError,
    DecisionError,
    InvalidPromptError,
    LinearTTFT,
    LoadPolicy,
    PolicyError,
    PrefixIndex,
    PrefixRouteError,
    Router,
    encode_tokens,
    kv_fraction,
    policy_from_name,
)
from prefixroute.index import LRUStore

from ..conftest import FakeClock, TickingClock, run_together

TOKENS = [1, 2, 3, 40_000, 5, 6, 7, 8]


@pytest.mark.parametrize("typecode", list("bhHiIlLqQ"))  # "B" is bytes: raw uint32 ids
def test_a_memoryview_of_integers_is_read_by_item_not_as_raw_bytes(typecode: str) -> None:
    view = memoryview(array.array(typecode, [t % 100 for t in TOKENS]))
    assert encode_tokens(view) == encode_tokens([t % 100 for t in TOKENS])


def test_memoryviews_that_are_not_one_prompt_of_integers_are_refused_or_read_right() -> None:
    with pytest.raises(InvalidPromptError, match="position 0 is -1"):
        encode_tokens(memoryview(array.array("i", [-1, 2])))
    with pytest.raises(InvalidPromptError, match="position 1 is 4294967296"):
        encode_tokens(memoryview(array.array("Q", [1, 2**32])))
    with pytest.raises(InvalidPromptError, match="float"):
        encode_tokens(memoryview(array.array("d", [1.0])))
    with pytest.raises(InvalidPromptError, match="1-D"):
        encode_tokens(np.arange(4, dtype="<u4").reshape(2, 2).data)
    with pytest.raises(InvalidPromptError, match="format '>I'"):
        encode_tokens(np.arange(4, dtype=">u4").data)
    strided = np.arange(16, dtype="<u4")[::2]
    assert encode_tokens(strided.data) == encode_tokens(strided.tolist())
    raw = encode_tokens(list(range(8)))
    assert encode_tokens(memoryview(raw + raw)[::2]) == (raw + raw)[::2]  # a strided view of bytes: its bytes


def test_numpy_scalars_and_arrays_that_are_not_one_prompt_are_refused() -> None:
    for scalar in (np.int64(5), np.array(5, dtype=np.uint32)):
        with pytest.raises(TypeError, match="0-d"):
            encode_tokens(scalar)
    for batch in (np.arange(6).reshape(2, 3), np.arange(3).reshape(1, 3)):
        with pytest.raises(InvalidPromptError, match="1-D"):
            encode_tokens(batch)
    router = Router(block_size=4)
    with pytest.raises(InvalidPromptError):
        router.route(np.arange(8).reshape(2, 4), ["a"])
    assert router.stats().decisions == 0


@pytest.mark.parametrize(
    "dtype", ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", ">u4", ">i8"]
)
def test_numpy_arrays_of_every_integer_dtype_hash_like_the_list(dtype: str) -> None:
    tokens = [t % 100 for t in TOKENS]
    array_ = np.repeat(np.array(tokens, dtype=dtype), 2)[::2]  # non-contiguous too
    assert BlockHasher(4).hash(array_) == BlockHasher(4).hash(tokens)


def test_an_array_of_a_non_integer_typecode_is_refused_even_when_empty() -> None:
    for typecode in "fd":  # (and "u", deprecated from Python 3.13)
        with pytest.raises(InvalidPromptError, match="integer typecode"):
            encode_tokens(array.array(typecode))


def test_lifecycle_calls_ignore_a_decision_whose_id_is_not_a_str() -> None:
    router = Router(block_size=4)
    decision = router.route(TOKENS, ["a"])
    router.start(decision)
    unhashable = replace(decision, id=[decision.id])  # type: ignore[arg-type]
    router.first_token(unhashable)
    router.finish(unhashable)
    assert router.in_flight("a") == 1
    assert router.stats().ignored == 2
    router.finish(decision)
    assert router.in_flight("a") == 0


@pytest.mark.parametrize("reading", [math.nan, math.inf, None, "12:00"])
def test_a_clock_without_finite_seconds_is_refused_by_a_lease_and_leases_keep_expiring(reading: object) -> None:
    clock = FakeClock()
    router = Router(block_size=4, clock=clock)
    router.start(router.route(TOKENS, ["a"]), lease=1.0)
    late = router.route([9, 9, 9, 9], ["a"])
    before = router.stats()
    clock.now = reading  # type: ignore[assignment]
    with pytest.raises(ConfigurationError, match="clock"):
        router.start(late, lease=1.0)
    clock.now = 100.0
    assert router.stats() == before
    clock.tick(5.0)
    assert router.in_flight("a") == 0
    assert router.stats().leases_expired == 1


def test_a_clock_that_goes_backwards_keeps_counts_exact() -> None:
    clock = FakeClock()
    router = Router(block_size=4, clock=clock, lease=1.0)
    decision = router.route(TOKENS, ["a"])
    router.start(decision)
    clock.tick(-50.0)
    router.first_token(decision)
    assert router.in_flight("a") == 1
    clock.tick(51.5)
    assert router.in_flight("a") == 0
    assert router.stats().leases_expired == 1


def test_a_first_token_a_subnormal_time_after_start_learns_no_infinite_speed() -> None:
    clock = FakeClock(0.0)
    router = Router(block_size=4, clock=clock)
    for prompt in (list(range(64)), list(range(100, 164))):
        clock.now = 0.0
        decision = router.route(prompt, ["a"])
        router.start(decision)
        clock.now = 1e-320
        router.first_token(decision)
        router.finish(decision)
        speed = router.decide([1], ["a"]).candidates[0].prefill_tokens_per_s
        assert speed is None or math.isfinite(speed)


class RaisingHook(PrefixIndex):
    def evict(self, backend: str, store: LRUStore, excess: int) -> int:
        raise RuntimeError("hook failed")


def test_an_eviction_hook_that_raises_still_leaves_the_index_within_capacity() -> None:
    index = RaisingHook(4, capacity_blocks=8)
    router = Router(block_size=4, index=index)
    for root in range(2):  # two prompts of 4 blocks fill the capacity
        router.route(list(range(100 * root, 100 * root + 16)), ["a"])
    for root in range(2, 5):
        with pytest.raises(RuntimeError, match="hook failed"):
            router.route(list(range(100 * root, 100 * root + 16)), ["a"])
        assert index.blocks("a") <= 8
        index._check()


class AsksTheRouter(LoadPolicy):
    """Reads load from the router instead of its candidates: a call back into the router that is calling it."""

    def __init__(self) -> None:
        self.router: Router | None = None

    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        assert self.router is not None
        return min(candidates, key=lambda c: self.router.in_flight(c.backend))  # type: ignore[union-attr]


class HookAsksTheRouter(PrefixIndex):
    router: Router | None = None

    def evict(self, backend: str, store: LRUStore, excess: int) -> int:
        assert self.router is not None
        self.router.stats()
        return super().evict(backend, store, excess)


def test_a_policy_or_hook_calling_back_into_the_router_is_a_policy_error_not_a_deadlock() -> None:
    policy = AsksTheRouter()
    router = policy.router = Router(block_size=4, policy=policy)
    for _ in range(2):  # the lock is released after the error: the second call fails the same way, not hangs
        with pytest.raises(PolicyError, match="called back into the Router"):
            router.route(TOKENS, ["a", "b"])
    assert router.stats().decisions == router.stats().commits == 0 and router.index.blocks("a") == 0
    index = HookAsksTheRouter(4, capacity_blocks=2)
    router = index.router = Router(block_size=4, index=index)
    router.route(TOKENS, ["a"])  # two blocks: within capacity, no eviction
    with pytest.raises(PolicyError, match="called back"):
        router.route([9, *TOKENS], ["a"])
    assert index.blocks("a") <= 2
    index._check()
    assert router.stats().decisions == 1  # the lock was released: the router answers, and counted one decision


def test_index_match_refuses_a_single_str_of_backends() -> None:
    index = PrefixIndex(4)
    with pytest.raises(TypeError, match="single str"):
        index.match([1, 2], "gpu0")


def test_an_absurd_engine_queue_is_refused_and_a_huge_bounded_load_factor_routes() -> None:
    router = Router(block_size=4, policy=BoundedLoad())
    for bad in (10**400, 2**63):
        with pytest.raises(ConfigurationError, match="queue_len"):
            router.set_engine_load("a", queue_len=bad, kv_usage=None)
    router.set_engine_load("a", queue_len=2**63 - 1, kv_usage=None)
    assert router.route(TOKENS, ["a", "b"]).backend == "b"
    candidates = [Candidate("a", 0, 8, 1), Candidate("b", 8, 8, 5)]
    assert BoundedLoad(factor=1e308).choose(candidates).backend == "b"  # was OverflowError: ceil(inf)
    assert LinearTTFT()(Candidate("a", 0, 8, 0, queue_len=2**63 - 1)) > 0


def test_backends_in_any_iterable_and_ten_thousand_of_them() -> None:
    router = Router(block_size=4)
    fleet = [f"gpu{i}" for i in range(10_000)]
    first = router.route(TOKENS, fleet)
    for backends in (set(fleet), dict.fromkeys(fleet), (b for b in fleet), tuple(fleet)):
        again = router.route(TOKENS, backends)  # type: ignore[arg-type]
        assert (again.backend, again.matched_tokens, len(again.candidates)) == (first.backend, 8, 10_000)
    with router.track(first):
        assert router.in_flight(first.backend) == 1
    router._check()


def test_a_decision_reused_after_its_backend_left_and_came_back_counts_once() -> None:
    router = Router(block_size=4)
    decision = router.route(TOKENS, ["a", "b"])
    router.start(decision)
    router.remove_backend(decision.backend)
    router.finish(decision)  # ignored: the removal ended it
    assert router.in_flight(decision.backend) == 0
    committed = router.commit(decision)  # the backend is back in the fleet
    router.start(committed)
    router.start(committed)  # a second start is ignored
    assert router.in_flight(decision.backend) == 1
    router.finish(committed)
    assert router.in_flight(decision.backend) == 0
    assert router.stats().ignored == 2
    assert router.index.match(decision._hashes, [decision.backend])[decision.backend] == 2


@pytest.mark.parametrize("first_tokens", [True, False], ids=["first tokens", "no first token: queues inferred"])
def test_every_call_from_many_threads_leaves_exact_counts_and_a_valid_index(switchy: None, first_tokens: bool) -> None:
    """Without a first_token() call, the engines' queue lengths take requests out of prefill (the inference a
    gateway without first tokens relies on), so that path runs under the same concurrent calls."""
    clock = TickingClock()
    router = Router(block_size=4, capacity_blocks=200, clock=clock, lease=5.0)
    backends = ["a", "b", "c", "d"]
    namespaces: list[str | bytes] = ["", "m", b"\xff"]
    prefixes = [list(range(i * 50, i * 50 + 16)) for i in range(6)]

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(600):
            tokens = rng.choice(prefixes) + [rng.randrange(100) for _ in range(rng.randrange(8))]
            action = rng.randrange(12)
            if action < 4:
                decision = router.route(tokens, backends)
                router.start(decision, lease=rng.choice([None, 1.0]))
                if first_tokens and rng.random() < 0.5:
                    router.first_token(decision.id)
                if rng.random() < 0.8:
                    router.finish(decision, refused=rng.random() < 0.1)
            elif action == 4:
                decision = router.decide(tokens, backends, namespace=rng.choice(namespaces))
                router.commit(decision, rng.choice(backends))
            elif action == 5:
                hashes = router.hasher.hash(tokens)
                router.store(rng.choice(backends), hashes)
                router.evict(rng.choice(backends), hashes[rng.randrange(len(hashes)) :])
            elif action == 6:
                hashes = router.hasher.hash(tokens)
                router.write(rng.choice(backends), [(True, hashes[:2], None), (True, hashes[2:], hashes[1])])
            elif action == 7:
                router.set_capacity(rng.choice(backends), rng.choice([None, 0, 10, 200]))
            elif action == 8:
                router.set_engine_load(rng.choice(backends), queue_len=rng.randrange(3), kv_usage=None)
            elif action == 9:
                rng.choice([router.remove_backend, router.clear_backend])(rng.choice(backends))
            elif action == 10:
                router.expire()
                router.stats()
            else:
                router.in_flight(rng.choice(backends))

    run_together(*(functools.partial(worker, seed) for seed in range(6)))
    if not first_tokens:  # the inference was on throughout
        assert router._first_tokens_missing and not router._first_tokens_reported
    router._check()
    router.index._check(chains=[router.hasher.hash(prefix) for prefix in prefixes])
    clock.now += 10.0
    router.expire()
    for backend in backends:
        router.remove_backend(backend)  # ends what never expires (no lease)
    stats = router.stats()
    assert stats.in_flight == 0
    candidates = router.decide([1], backends).candidates
    assert [(c.in_flight, c.pending_prefill_tokens, c.held_blocks, c.active_blocks) for c in candidates] == [
        (0, 0, 0, 0)
    ] * 4


def test_index_and_kv_fraction_refuse_wrong_types_with_type_errors() -> None:
    index = PrefixIndex(4)
    index.insert([1, 2], "a")
    with pytest.raises(TypeError, match="not None"):
        index.match(None, ["a"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="backend id is a str"):
        index.remove([1], 5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="takes a Candidate"):
        kv_fraction(None)  # type: ignore[arg-type]
    assert index.match([1, 2], ["a"]) == {"a": 2}
    index._check()


@pytest.mark.parametrize(
    "altered",
    [
        {"backend": "elsewhere"},  # not one of its candidates: commit(decision, backend) moves a decision
        {"backend": 5},
        {"prompt_tokens": math.nan},
        {"prompt_tokens": -5},
        {"matched_tokens": 10**30},
        {"matched_tokens": 2.5},
        {"candidates": (5,)},
        {"candidates": None},
    ],
)
def test_a_decision_altered_after_the_router_made_it_is_refused_and_nothing_is_counted(
    altered: dict[str, object],
) -> None:
    router = Router(block_size=4)
    decision = router.route(TOKENS, ["a", "b"])
    forged = replace(decision, **altered)  # type: ignore[arg-type]
    before = (router.stats(), router.index.hashes("a"), router.index.hashes("b"))
    for call in (router.start, router.commit):
        with pytest.raises(DecisionError, match="altered"):
            call(forged)
        router._check()
    assert (router.stats(), router.index.hashes("a"), router.index.hashes("b")) == before
    assert router.in_flight("a") == router.in_flight("b") == 0


@pytest.mark.parametrize("field", ["backend", "matched_tokens", "prompt_tokens", "_hashes"])
def test_a_decision_altered_into_another_consistent_one_is_refused_too(field: str) -> None:
    """Was: only a change that left the fields inconsistent was seen; another candidate's backend, another match or
    prompt length within bounds, other block hashes were counted as given (800 prompt tokens: 200 blocks held)."""
    router = Router(block_size=4)
    decision = router.route(TOKENS, ["a", "b"])
    other = next(c.backend for c in decision.candidates if c.backend != decision.backend)
    value = {
        "backend": other,
        "matched_tokens": (decision.matched_tokens + 4) % (decision.prompt_tokens + 1),
        "prompt_tokens": decision.prompt_tokens * 100,
        "_hashes": list(decision._hashes)[:-1],
    }[field]
    forged = replace(decision, **{field: value})  # type: ignore[arg-type]
    for call in (router.start, router.commit):
        with pytest.raises(DecisionError, match="altered"):
            call(forged)
    assert router.in_flight("a") == router.in_flight("b") == 0
    router.start(copy.deepcopy(decision))  # a copy is the router's still (frameworks copy what requests carry)
    router.finish(decision.id)
    moved = router.commit(decision, other)  # the way to send it elsewhere
    router.start(moved)
    assert router.in_flight(other) == 1
    router._check()


@pytest.mark.parametrize(
    ("hashes", "named"),
    [
        ([1, 2, -3], "-3 at position 2"),
        ([1, 2**64], "an int of 65 bits at position 1"),
        ([7, "x"], "'x' at position 1"),
    ],
)
def test_a_bad_block_hash_is_named_with_its_position(hashes: list[Any], named: str) -> None:
    """Was: the message was array()'s own ("can't convert negative int to unsigned"), with no position, where
    docs/index.md says a bad token id or block hash names its position."""
    router = Router(block_size=4)
    calls: list[Callable[[], object]] = [
        lambda: router.store("a", hashes),
        lambda: router.evict("a", hashes),
        lambda: router.write("a", [(True, hashes, None)]),
        lambda: PrefixIndex(4).insert(hashes, "a"),
    ]
    for call in calls:
        with pytest.raises(PrefixRouteError, match=f"block hashes must be ints.*: {re.escape(named)}$"):
            call()
    router._check()


class _RaisingRepr:
    def __repr__(self) -> str:
        raise RuntimeError("repr failed")


@pytest.mark.parametrize("returned", [_RaisingRepr(), list(range(100_000))])
def test_a_policy_error_is_raised_and_short_whatever_the_returned_object_repr_does(returned: object) -> None:
    class Odd(LoadPolicy):
        def choose(self, candidates: Sequence[Candidate]) -> Candidate:
            return returned  # type: ignore[return-value]

    router = Router(block_size=4, policy=Odd())
    with pytest.raises(PolicyError, match="not one of the candidates") as caught:
        router.route(TOKENS, ["a", "b"])
    assert len(str(caught.value)) < 500
    assert router.stats().decisions == 0


def test_a_policy_whose_repr_raises_still_gets_a_policy_error() -> None:
    class Unprintable(LoadPolicy):
        def __repr__(self) -> str:
            raise RuntimeError("repr failed")

        def choose(self, candidates: Sequence[Candidate]) -> Candidate:
            raise ValueError("bug")

    router = Router(block_size=4, policy=Unprintable())
    with pytest.raises(PolicyError, match="raised ValueError"):
        router.route(TOKENS, ["a", "b"])


def test_a_policy_raising_an_exception_whose_str_raises_still_gets_a_policy_error() -> None:
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("str failed")

    class Broken(LoadPolicy):
        def choose(self, candidates: Sequence[Candidate]) -> Candidate:
            raise Unprintable

    with pytest.raises(PolicyError, match="raised Unprintable"):
        Router(block_size=4, policy=Broken()).route(TOKENS, ["a", "b"])


@pytest.mark.parametrize("reading", [None, "noon"])
def test_first_token_with_a_clock_that_returns_no_number_learns_no_speed_and_raises_nothing(reading: object) -> None:
    router = Router(block_size=4, clock=lambda: reading)  # type: ignore[arg-type,return-value]
    decision = router.route(TOKENS, ["a"])
    router.start(decision)
    router.first_token(decision)
    router._check()
    assert router.decide(TOKENS, ["a"]).candidates[0].prefill_tokens_per_s is None
    router.finish(decision)
    assert router.stats().in_flight == 0


def test_numpy_integers_are_taken_wherever_an_int_option_is_and_kept_as_python_ints() -> None:
    """Every int option and argument takes any integer but a bool (numpy's were refused outside token ids)."""
    npa: Any = np  # numpy's ints typed loosely: stubs differ on whether they are ints
    router = Router(block_size=npa.int64(4), placement_blocks=npa.uint8(2), capacity_blocks=npa.int32(64))
    assert type(router.hasher.block_size) is int and router.hasher.block_size == 4
    assert type(router._placement_blocks) is int
    router.set_capacity("a", npa.uint16(32))
    assert type(router.index.capacity("a")) is int and router.index.capacity("a") == 32
    router.set_engine_load("a", queue_len=npa.int64(3), kv_usage=0.5)
    assert type(router._queue_len["a"]) is int
    hashes = router.hasher.hash(TOKENS)
    assert router.hasher.hash(TOKENS[4:], parent=npa.uint64(hashes[0])) == hashes[1:]
    index = PrefixIndex(4, capacity_blocks={"a": npa.int64(10)}, bound_blocks=npa.int16(100))
    index.insert(hashes[:1], "a")
    index.insert(hashes[1:], "a", parent=npa.uint64(hashes[0]))
    assert index.holds(npa.uint64(hashes[1]), "a")
    index.predict(hashes, "b", held=npa.int64(0))
    index.retract(hashes, "b", npa.int8(1))
    assert type(LRUStore(npa.int64(64), generations=npa.int64(4))._generations) is int
    seeded: Any = policy_from_name("random", seed=npa.int64(7))
    assert seeded._rng.random() == random.Random(7).random()
    bads: list[Any] = [True, npa.bool_(True), 4.0, npa.float64(4.0), "4"]
    for bad in bads:
        with pytest.raises(ConfigurationError, match="block_size"):
            Router(block_size=bad)
        with pytest.raises(ConfigurationError, match="placement_blocks"):
            Router(placement_blocks=bad)
        with pytest.raises(ConfigurationError, match="queue_len"):
            router.set_engine_load("a", queue_len=bad, kv_usage=None)
        with pytest.raises(TypeError, match="block_hash"):
            index.holds(bad, "a")
    router._check()
