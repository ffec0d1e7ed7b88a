"""Hostile input at every public entry point of the core: a clear error of the tree (or a builtin a caller would
catch), never a crash from deep inside, and a failed call changes nothing."""

from __future__ import annotations

import array
import math
import os
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixroute import (
    BlockHasher,
    Candidate,
    LoadPolicy,
    PrefixIndex,
    PrefixRouteError,
    Router,
    encode_tokens,
    policy_from_name,
    policy_names,
)

# What a caller may catch: the tree, and the builtins each error of the tree also is.
CLEAR = (PrefixRouteError, TypeError, ValueError, LookupError)

weird_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.binary(max_size=9),
    st.just(object()),
    st.just(math.nan),
    st.just(-math.inf),
)
hostile = st.recursive(
    weird_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6),
        st.tuples(inner, inner),
        st.dictionaries(st.text(max_size=3), inner, max_size=3),
        st.sets(st.integers(-3, 3), max_size=3),
    ),
    max_leaves=12,
)
token_lists = st.lists(st.integers(min_value=-5, max_value=2**33), max_size=80)
prompts = st.one_of(
    hostile,
    token_lists,
    token_lists.map(tuple),
    st.lists(st.integers(0, 2**32 - 1), max_size=80).map(lambda t: array.array("I", t)),
    st.lists(st.integers(-(2**40), 2**40), max_size=40).map(lambda t: np.array(t, dtype=np.int64)),
    st.lists(st.floats(allow_nan=True), max_size=10).map(np.array),
    st.binary(max_size=64),
)
backend_lists = st.one_of(
    hostile,
    st.lists(st.text(min_size=0, max_size=6), max_size=5),
    st.lists(st.sampled_from(["a", "b", "c", "\ud800", ""]), max_size=5),
)

# PREFIXROUTE_FAULT_EXAMPLES=20000 runs the long campaign; CI runs the default.
EXAMPLES = int(os.environ.get("PREFIXROUTE_FAULT_EXAMPLES", "150"))
FAST = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def snapshot(router: Router) -> tuple[Any, ...]:
    index = router.index
    return (
        router.stats(),
        len(index),
        {b: index.hashes(b) for b in ("a", "b", "c")},
        [router.in_flight(b) for b in ("a", "b", "c")],
    )


def warm_router() -> Router:
    router = Router(block_size=4, capacity_blocks=64, lease=30.0)
    for i in range(5):
        router.start(router.route(list(range(i, i + 20)), ["a", "b", "c"]))
    return router


def tolerate(*calls: Callable[[], object]) -> None:
    """Run each call; a failure must be a clear one."""
    for call in calls:
        try:
            call()
        except CLEAR:
            continue


def attempt(router: Router, call: Callable[[], object]) -> None:
    """Run ``call``; if it fails, it fails clearly and leaves the router as it was."""
    before = snapshot(router)
    try:
        call()
    except CLEAR:
        assert snapshot(router) == before
    router.index._check()


@FAST
@given(prompt=prompts, backends=backend_lists, namespace=st.one_of(st.none(), hostile))
def test_route_and_decide(prompt: Any, backends: Any, namespace: Any) -> None:
    router = warm_router()
    attempt(router, lambda: router.route(prompt, backends, namespace=namespace))
    attempt(router, lambda: router.decide(prompt, backends, namespace=namespace))


@FAST
@given(thing=hostile, backend=st.one_of(hostile, st.sampled_from(["a", "b", "z"])))
def test_lifecycle_calls_take_anything_without_raising_from_deep_inside(thing: Any, backend: Any) -> None:
    router = warm_router()
    decision = router.decide(list(range(8)), ["a", "b"])
    attempt(router, lambda: router.finish(thing))
    attempt(router, lambda: router.first_token(thing))
    attempt(router, lambda: router.start(thing))
    attempt(router, lambda: router.start(decision, lease=thing))
    attempt(router, lambda: router.commit(thing))
    attempt(router, lambda: router.commit(decision, backend))
    attempt(router, lambda: router.in_flight(thing))


@FAST
@given(backend=hostile, queue_len=hostile, kv_usage=hostile, capacity=hostile)
def test_engine_figures_and_capacities(backend: Any, queue_len: Any, kv_usage: Any, capacity: Any) -> None:
    router = warm_router()
    attempt(router, lambda: router.set_engine_load(backend, queue_len=queue_len, kv_usage=kv_usage))
    attempt(router, lambda: router.set_engine_load("a", queue_len=queue_len, kv_usage=kv_usage))
    attempt(router, lambda: router.set_capacity("a", capacity))
    attempt(router, lambda: router.set_capacity(backend, 10))
    attempt(router, lambda: router.remove_backend(backend))
    attempt(router, lambda: router.clear_backend(backend))


@FAST
@given(
    updates=st.one_of(
        hostile,
        st.lists(st.tuples(st.booleans(), st.one_of(hostile, st.lists(st.integers(-2, 2**65))), hostile)),
    ),
    hashes=st.one_of(hostile, st.lists(st.integers(-(2**65), 2**65), max_size=5)),
    parent=hostile,
)
def test_the_write_path_validates_a_whole_batch_before_writing(updates: Any, hashes: Any, parent: Any) -> None:
    router = warm_router()
    attempt(router, lambda: router.write("a", updates))
    attempt(router, lambda: router.store("a", hashes, parent=parent))
    attempt(router, lambda: router.evict("a", hashes))


@FAST
@given(
    block_size=hostile,
    capacity=hostile,
    placement=hostile,
    lease=hostile,
    namespace=hostile,
    policy=hostile,
    clock=hostile,
    rng=hostile,
)
def test_router_options_are_checked_when_given(
    block_size: Any, capacity: Any, placement: Any, lease: Any, namespace: Any, policy: Any, clock: Any, rng: Any
) -> None:
    for options in (
        {"block_size": block_size},
        {"capacity_blocks": capacity},
        {"placement_blocks": placement},
        {"lease": lease},
        {"namespace": namespace},
        {"policy": policy},
        {"clock": clock},
        {"rng": rng},
    ):
        try:
            router = Router(**options)
        except CLEAR:
            continue
        # Accepted options must work: a route, a start and a finish.
        decision = router.route(list(range(40)), ["a", "b"])
        router.start(decision)
        router.finish(decision)


@FAST
@given(block_size=hostile, namespace=hostile, tokens=prompts, parent=hostile)
def test_hasher_and_encoder(block_size: Any, namespace: Any, tokens: Any, parent: Any) -> None:
    tolerate(
        lambda: BlockHasher(block_size),
        lambda: BlockHasher(4, namespace=namespace),
        lambda: BlockHasher(4).hash(tokens),
        lambda: BlockHasher(4).hash([1, 2, 3, 4], parent=parent),
        lambda: encode_tokens(tokens),
    )


@FAST
@given(capacity=hostile, backend=hostile, hashes=hostile)
def test_index_methods(capacity: Any, backend: Any, hashes: Any) -> None:
    tolerate(
        lambda: PrefixIndex(4, capacity_blocks=capacity),
        lambda: PrefixIndex(capacity),
    )
    index = PrefixIndex(4, capacity_blocks=8)
    index.insert([1, 2, 3], "a")
    tolerate(
        lambda: index.set_capacity(backend, capacity),
        lambda: index.match(hashes, ["a"]),
        lambda: index.match([1, 2], backend),
        lambda: index.insert(hashes, "a"),
        lambda: index.remove(hashes, "a"),
    )
    index._check()


@FAST
@given(name=st.one_of(hostile, st.sampled_from(policy_names()), st.sampled_from([":", "a:", ":b", "os:getcwd"])))
def test_policy_from_name(name: Any) -> None:
    try:
        policy = policy_from_name(name)
    except CLEAR:
        return
    assert isinstance(policy, LoadPolicy)


@FAST
@given(returned=hostile)
def test_a_policy_returning_garbage_is_a_policy_error_and_nothing_is_recorded(returned: Any) -> None:
    class Garbage(LoadPolicy):
        def choose(self, candidates: Any) -> Candidate:
            return returned  # type: ignore[no-any-return]

    router = Router(policy=Garbage())
    with pytest.raises(PrefixRouteError, match="not one of the candidates"):
        router.route(list(range(64)), ["a", "b"])
    assert len(router.index) == 0 and router.stats().decisions == 0


@pytest.mark.parametrize("option", ["factor"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0, 0.5, "2", None])
def test_nonsense_policy_options_are_refused_when_given(option: str, value: object) -> None:
    with pytest.raises(CLEAR):
        policy_from_name("bounded-load", **{option: value})


def test_a_seeded_hostile_campaign_over_every_router_call() -> None:
    """Random interleavings of valid and invalid calls: counters stay exact and every invariant holds."""
    rng = random.Random(7)
    router = Router(block_size=4, capacity_blocks=50, lease=1.0, clock=lambda: rng.random() * 100)
    live = []
    junk: list[object] = [None, -1, math.nan, "x", [1, -2], (), {}, b"\x00", 2**80, object()]
    for _ in range(3000):
        action = rng.randrange(8)
        try:
            if action == 0:
                live.append(router.route([rng.randrange(50) for _ in range(rng.randrange(30))], ["a", "b", "c"]))
            elif action == 1 and live:
                router.start(rng.choice(live), lease=rng.choice([None, 0.5, rng.choice(junk)]))  # type: ignore[arg-type]
            elif action == 2 and live:
                router.finish(rng.choice(live + junk))  # type: ignore[arg-type]
            elif action == 3 and live:
                router.first_token(rng.choice(live + junk))  # type: ignore[arg-type]
            elif action == 4:
                router.set_capacity(rng.choice("abc"), rng.choice([None, 0, 10, rng.choice(junk)]))  # type: ignore[arg-type]
            elif action == 5:
                router.write(rng.choice("abc"), [(rng.random() < 0.5, [rng.randrange(2**64)], None), rng.choice(junk)])  # type: ignore[list-item]
            elif action == 6:
                router.remove_backend(rng.choice("abc"))
            else:
                router.route(rng.choice(junk), rng.choice([["a"], junk]))  # type: ignore[arg-type,list-item]
        except CLEAR:
            pass
        router.index._check()
    for decision in live:
        router.finish(decision)
    assert router.stats().in_flight == 0
    assert all(router.in_flight(b) == 0 for b in "abc")


HUGE = 10**5000  # past Python's int-to-str limit: a message that shows it with repr() raises ValueError instead


def _huge_int_calls() -> list[tuple[str, Callable[[], object]]]:
    from prefixroute import BoundedLoad, LinearTTFT, PredictedTTFT
    from prefixroute.vllm import EventIndex, RankMerge, rank_endpoint

    router = Router(block_size=4)
    decision = router.route([1] * 8, ["a"])
    return [
        ("Router(block_size=)", lambda: Router(block_size=HUGE)),
        ("Router(placement_blocks=)", lambda: Router(placement_blocks=-HUGE)),
        ("Router(capacity_blocks=)", lambda: Router(capacity_blocks=-HUGE)),
        ("set_capacity", lambda: router.set_capacity("a", -HUGE)),
        ("set_engine_load(kv_usage=)", lambda: router.set_engine_load("a", queue_len=None, kv_usage=HUGE)),
        ("store(parent=)", lambda: router.store("a", [1], parent=HUGE)),
        ("index.insert(parent=)", lambda: router.index.insert([1], "a", parent=HUGE)),
        ("index.retract(start=)", lambda: router.index.retract([1], "a", -HUGE)),
        ("hash(parent=)", lambda: BlockHasher(4).hash([1] * 4, parent=HUGE)),
        ("route(token)", lambda: router.route([HUGE], ["a"])),
        ("route(backend)", lambda: router.route([1], [HUGE])),  # type: ignore[list-item]
        ("commit(backend)", lambda: router.commit(decision, HUGE)),  # type: ignore[arg-type]
        ("BoundedLoad(factor=)", lambda: BoundedLoad(factor=HUGE)),
        ("PredictedTTFT(kv_cap=)", lambda: PredictedTTFT(kv_cap=HUGE)),
        ("LinearTTFT(per_token_s=)", lambda: LinearTTFT(per_token_s=HUGE)),
        ("EventIndex(speculative_ttl=)", lambda: EventIndex(4, speculative_ttl=HUGE)),
        ("RankMerge.write(parent)", lambda: RankMerge(router).write("a", [(True, [1], HUGE)])),
        ("rank_endpoint(rank=)", lambda: rank_endpoint("tcp://gpu0:5557", HUGE)),
    ]


@pytest.mark.parametrize(("call", "action"), _huge_int_calls(), ids=[name for name, _ in _huge_int_calls()])
def test_an_int_too_long_to_print_is_refused_with_the_documented_error_naming_its_size(
    call: str, action: Callable[[], object]
) -> None:
    with pytest.raises((PrefixRouteError, TypeError)) as caught:
        action()
    assert "bits" in str(caught.value) and len(str(caught.value)) < 400, (call, str(caught.value))
