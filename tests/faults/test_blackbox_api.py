"""A black-box audit of the core's public API, written from the docs alone: subclasses of the builtins with hostile
``__hash__``/``__eq__``/``__iter__``, containers that change between passes, exceptions (BaseException too) and
re-entrant calls from a user's policy, copying and pickling, and every lifecycle call from many threads. Each test
checks the documented promise: an error of the tree (also the builtin a caller catches), and a refused call changes
nothing a later call could see."""

from __future__ import annotations

import array
import copy
import dataclasses
import pickle
import random
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest

from prefixroute import (
    BlockHasher,
    BoundedLoad,
    Candidate,
    ConfigurationError,
    Decision,
    DecisionError,
    InvalidTypeError,
    LoadPolicy,
    NoBackendError,
    PolicyError,
    PredictedTTFT,
    PrefixIndex,
    PrefixRouteError,
    Random,
    Router,
    RouterStats,
    kv_fraction,
    policy_from_name,
    policy_names,
)

BACKENDS = ["gpu0", "gpu1", "gpu2"]


class Boom(Exception):
    """What a hostile dunder raises."""


class UnhashableStr(str):
    """A str whose own ``__hash__`` and ``__eq__`` raise."""

    def __hash__(self) -> int:
        raise Boom("__hash__")

    def __eq__(self, other: object) -> bool:
        raise Boom("__eq__")


class CollidingStr(str):
    """A str equal to the plain one, but hashed elsewhere: a dict keyed by it and by the plain str splits in two."""

    def __hash__(self) -> int:
        return 1

    __eq__ = str.__eq__


class HostileInt(int):
    """An int whose own comparisons, hash and conversions raise."""

    def __hash__(self) -> int:
        raise Boom("__hash__")

    def __eq__(self, other: object) -> bool:
        raise Boom("__eq__")

    def __ne__(self, other: object) -> bool:
        raise Boom("__ne__")

    def __index__(self) -> int:
        raise Boom("__index__")


class SecondPassList(list):  # type: ignore[type-arg]
    """A list that yields its items on odd passes and ``other`` on even ones."""

    def __init__(self, items: Sequence[str], other: Sequence[str]) -> None:
        super().__init__(items)
        self.other = list(other)
        self.passes = 0

    def __iter__(self) -> Iterator[str]:
        self.passes += 1
        return iter(self.other) if self.passes % 2 == 0 else list.__iter__(self)


class Scripted(LoadPolicy):
    """A user policy whose choice is a function, swapped per test."""

    prefix_aware = True

    def __init__(self) -> None:
        self.act: Callable[[Sequence[Candidate]], Any] = lambda candidates: candidates[0]

    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        return self.act(candidates)  # type: ignore[no-any-return]


def prompt(seed: int, blocks: int = 6, block_size: int = 4) -> list[int]:
    return [seed * 1000 + i for i in range(blocks * block_size)]


def busy_router(policy: LoadPolicy | None = None) -> tuple[Router, Decision]:
    """A router with state to lose: a request in flight on one backend, blocks of two prompts on others."""
    router = Router(block_size=4, policy=policy)
    router.route(prompt(1), BACKENDS)
    router.route(prompt(2), BACKENDS)
    decision = router.route(prompt(3), BACKENDS)
    router.start(decision)
    return router, decision


def state(router: Router) -> tuple[object, ...]:
    """Everything a later call could see (``ignored`` counts refused lifecycle calls by design, so it is left out)."""
    stats = router.stats()
    return (
        dataclasses.replace(stats, ignored=0),
        {b: router.in_flight(b) for b in BACKENDS},
        {b: sorted(router.index.hashes(b)) for b in BACKENDS},
    )


def lock_is_free(router: Router) -> bool:
    """Whether another thread can use the router within a second (its lock was released)."""
    done = threading.Event()

    def use() -> None:
        router.stats()
        done.set()

    threading.Thread(target=use, daemon=True).start()
    return done.wait(1.0)


# -- the backend list --------------------------------------------------------------------------------------------


def test_a_backend_list_that_changes_between_passes_cannot_steer_later_routes() -> None:
    router = Router(block_size=4)
    shifty = SecondPassList(["gpu0", "gpu1"], ["evil0", "evil1"])
    decision = router.route(prompt(7), shifty)
    assert {c.backend for c in decision.candidates} == {"gpu0", "gpu1"}  # one pass decides: the list as it was
    assert decision.backend in ("gpu0", "gpu1")
    # The same prompt and backends afterwards: only the backends given may come back.
    for _ in range(3):
        again = router.route(prompt(7), ["gpu0", "gpu1"])
        assert again.backend in ("gpu0", "gpu1")
        assert {c.backend for c in again.candidates} == {"gpu0", "gpu1"}
    router._check()


def test_backends_in_one_shot_iterables_are_read_once_and_str_subclasses_kept_as_plain_str() -> None:
    router = Router(block_size=4)
    for backends in (iter(BACKENDS), (b for b in BACKENDS), dict.fromkeys(BACKENDS), tuple(BACKENDS)):
        decision = router.route(prompt(4), backends)  # type: ignore[arg-type]
        assert sorted(c.backend for c in decision.candidates) == BACKENDS
    decision = router.route(prompt(4), [UnhashableStr("gpu0"), CollidingStr("gpu1")])
    assert {type(c.backend) for c in decision.candidates} == {str}
    router.start(decision)
    assert router.in_flight(decision.backend) == router.in_flight(CollidingStr(decision.backend)) == 1
    router.finish(decision)
    router._check()


def test_a_backend_iterable_that_raises_midway_changes_nothing() -> None:
    router, _ = busy_router()
    before = state(router)

    def backends() -> Iterator[str]:
        yield "gpu0"
        raise Boom("midway")

    with pytest.raises(Boom):
        router.route(prompt(9), backends())  # type: ignore[arg-type]
    assert state(router) == before
    router._check()


# -- decisions given back ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["id", "backend"])
@pytest.mark.parametrize("kind", [CollidingStr, UnhashableStr])
def test_a_decision_whose_id_or_backend_became_a_str_subclass_is_refused(field: str, kind: type[str]) -> None:
    router = Router(block_size=4)
    decision = router.route(prompt(5), BACKENDS)
    altered = dataclasses.replace(decision, **{field: kind(getattr(decision, field))})  # type: ignore[arg-type]
    for call in (router.start, router.commit):
        with pytest.raises(DecisionError, match="altered|another router"):
            call(altered)
    assert router.stats().in_flight == 0
    router.start(decision)  # the real one still counts, once, where it says
    assert router.in_flight(decision.backend) == 1
    router.finish(decision)
    assert router.stats().in_flight == 0
    router._check()


class RaisingId:
    @property
    def id(self) -> str:
        raise Boom("id")


@pytest.mark.parametrize(
    "bad",
    [UnhashableStr("x"), RaisingId(), HostileInt(3), None, np.array(["a", "b"]), b"id"],
    ids=["unhashable-str", "raising-id-property", "hostile-int", "none", "ndarray", "bytes"],
)
def test_finish_and_first_token_never_raise_for_an_id(bad: object) -> None:
    router, decision = busy_router()
    before = state(router)
    router.first_token(bad)  # type: ignore[arg-type]
    router.finish(bad)  # type: ignore[arg-type]
    router.finish(bad, refused=True)  # type: ignore[arg-type]
    assert state(router) == before
    assert router.stats().ignored == 3  # a first token for no request in flight is counted too
    router._check()


def test_finish_by_a_str_subclass_of_the_id_ends_the_request() -> None:
    router, decision = busy_router()
    router.first_token(CollidingStr(decision.id))
    router.finish(UnhashableStr(decision.id))
    assert router.stats().in_flight == 0
    router._check()


# -- ints and strs that stand for plain ones -----------------------------------------------------------------------


def test_an_int_subclass_block_size_is_the_plain_int_even_beside_an_index() -> None:
    for index in (None, PrefixIndex(4)):
        router = Router(block_size=HostileInt(4), index=index)
        assert type(router.block_size) is int and router.block_size == 4
        assert router.route(prompt(1), BACKENDS).prompt_tokens == 24
    with pytest.raises(PrefixRouteError, match="must agree"):
        Router(block_size=HostileInt(8), index=PrefixIndex(4))


def test_policy_from_name_takes_a_str_subclass_name() -> None:
    assert isinstance(policy_from_name(UnhashableStr("bounded-load"), factor=1.5), BoundedLoad)
    with pytest.raises(PrefixRouteError, match="unknown policy"):
        policy_from_name(UnhashableStr("no-such-policy"))


@pytest.mark.parametrize(
    "tokens",
    [
        range(24),
        tuple(range(24)),
        np.arange(24, dtype=np.uint16),
        np.arange(24, dtype=">i8"),
        np.arange(48)[::2] // 2,
        array.array("Q", range(24)),
        memoryview(array.array("i", range(24))),
        bytes(array.array("I", range(24))),
        bytearray(array.array("I", range(24))),
        [np.int64(i) for i in range(24)],
    ],
    ids=lambda t: type(t).__name__,
)
def test_every_documented_token_container_routes_like_the_list(tokens: object) -> None:
    router = Router(block_size=4)
    first = router.route(list(range(24)), BACKENDS)
    again = router.route(tokens, BACKENDS)  # type: ignore[arg-type]
    assert (again.backend, again.matched_tokens, again.prompt_tokens) == (first.backend, 24, 24)


@pytest.mark.parametrize(
    "tokens",
    [iter(range(8)), (i for i in range(8)), {1: 2}, {1, 2}, "12345678", 7, np.int64(7), None],
    ids=["iterator", "generator", "dict", "set", "str", "int", "np-scalar", "none"],
)
def test_what_is_no_token_sequence_is_a_type_error_and_changes_nothing(tokens: object) -> None:
    router, _ = busy_router()
    before = state(router)
    with pytest.raises(InvalidTypeError):
        router.route(tokens, BACKENDS)  # type: ignore[arg-type]
    assert state(router) == before


# -- a user's policy -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "exc",
    [KeyboardInterrupt(), SystemExit(3), GeneratorExit(), NoBackendError("none fits"), ConfigurationError("x")],
    ids=type,
)
def test_a_base_exception_or_an_error_of_the_tree_from_choose_reaches_the_caller_unchanged(
    exc: BaseException,
) -> None:
    """Not wrapped in a PolicyError (a policy may raise the tree's errors on purpose; KeyboardInterrupt is the
    user's), and nothing recorded: the router's state, its lock and its next route as if the call never happened."""
    policy = Scripted()
    router, _ = busy_router(policy)
    before = state(router)

    def act(candidates: Sequence[Candidate]) -> Candidate:
        raise exc

    policy.act = act
    for call in (router.route, router.decide):
        with pytest.raises(type(exc)) as info:
            call(prompt(8), BACKENDS)
        assert info.value is exc
    assert state(router) == before
    assert lock_is_free(router)
    # An InvalidTypeError is the exception: a helper given something else than a Candidate is the policy's bug.
    policy.act = lambda candidates: (kv_fraction(candidates), candidates[0])[1]  # type: ignore[arg-type]
    with pytest.raises(PolicyError) as wrapped:
        router.route(prompt(8), BACKENDS)
    assert isinstance(wrapped.value.__cause__, InvalidTypeError)
    assert state(router) == before
    policy.act = lambda candidates: candidates[0]
    assert router.route(prompt(8), BACKENDS).backend in BACKENDS
    router._check()


@pytest.mark.parametrize(
    "act",
    [
        lambda cs: cs[0]._replace(),  # an equal copy
        lambda cs: tuple(cs[0]),
        lambda cs: cs[0].backend,
        lambda cs: None,
        lambda cs: Candidate(cs[0].backend, 0, 0, 0),
        lambda cs: 1 / 0,
        lambda cs: cs.append(cs[0]),  # the candidates are immutable
    ],
    ids=["copy", "tuple", "backend-id", "none", "new-candidate", "zero-division", "mutation"],
)
def test_a_policy_that_returns_no_candidate_of_its_own_or_fails_is_a_policy_error(act: Callable[..., Any]) -> None:
    policy = Scripted()
    router, _ = busy_router(policy)
    before = state(router)
    policy.act = act
    with pytest.raises(PolicyError) as info:
        router.route(prompt(8), BACKENDS)
    assert isinstance(info.value, TypeError)
    assert state(router) == before
    assert lock_is_free(router)


REENTRANT: dict[str, Callable[[Router, Decision], object]] = {
    "route": lambda r, d: r.route(prompt(1), BACKENDS),
    "decide": lambda r, d: r.decide(prompt(1), BACKENDS),
    "commit": lambda r, d: r.commit(d),
    "start": lambda r, d: r.start(d),
    "first_token": lambda r, d: r.first_token(d),
    "finish": lambda r, d: r.finish(d),
    "expire": lambda r, d: r.expire(),
    "in_flight": lambda r, d: r.in_flight("gpu0"),
    "stats": lambda r, d: r.stats(),
    "set_engine_load": lambda r, d: r.set_engine_load("gpu0", queue_len=1, kv_usage=0.5),
    "set_capacity": lambda r, d: r.set_capacity("gpu0", 1),
    "remove_backend": lambda r, d: r.remove_backend("gpu0"),
    "store": lambda r, d: r.store("gpu0", [1, 2]),
    "evict": lambda r, d: r.evict("gpu0", [1]),
    "write": lambda r, d: r.write("gpu0", [(True, [5], None)]),
    "clear_backend": lambda r, d: r.clear_backend("gpu0"),
}


@pytest.mark.parametrize("call", REENTRANT.values(), ids=REENTRANT.keys())
def test_a_call_back_into_the_router_from_choose_is_a_policy_error_and_records_nothing(
    call: Callable[[Router, Decision], object],
) -> None:
    policy = Scripted()
    router, decision = busy_router(policy)
    before = state(router)
    policy.act = lambda candidates: (call(router, decision), candidates[0])[1]
    with pytest.raises(PolicyError, match="called back into the Router"):
        router.route(prompt(8), BACKENDS)
    assert state(router) == before
    assert lock_is_free(router)
    router._check()


def test_another_thread_waits_for_choose_instead_of_failing() -> None:
    policy = Scripted()
    router, _ = busy_router(policy)
    results: list[object] = []

    def act(candidates: Sequence[Candidate]) -> Candidate:
        worker = threading.Thread(target=lambda: results.append(router.stats()))
        worker.start()
        worker.join(0.2)
        assert worker.is_alive()  # it waits for the lock, as it should
        policy.act = lambda cs: cs[0]
        return candidates[0]

    policy.act = act
    router.route(prompt(8), BACKENDS)
    deadline = threading.Event()
    for _ in range(100):
        if results:
            break
        deadline.wait(0.01)
    assert len(results) == 1 and isinstance(results[0], RouterStats)


def test_a_documented_subclass_is_unit_testable_offline() -> None:
    class CacheAwareCapped(LoadPolicy):
        name = "cache-aware-capped"
        prefix_aware = True

        def __init__(self, *, max_in_flight: int = 8) -> None:
            self.max_in_flight = max_in_flight

        def choose(self, candidates: Sequence[Candidate]) -> Candidate:
            allowed = [c for c in candidates if c.in_flight < self.max_in_flight]
            if not allowed:
                return min(candidates, key=lambda c: c.load)
            return max(allowed, key=lambda c: (c.matched_tokens, -c.load))

    policy = CacheAwareCapped(max_in_flight=2)
    hot, cold = Candidate("a", 64, 64, 2), Candidate("b", 0, 64, 0)
    assert policy.choose([hot, cold]) is cold
    assert policy.choose((hot._replace(in_flight=1), cold)).backend == "a"
    router = Router(block_size=4, policy=policy)
    first = router.route(prompt(1), BACKENDS)
    assert router.route(prompt(1), BACKENDS).reason == "prefix"
    with router.track(first), router.track(router.route(prompt(1), BACKENDS)):
        assert router.route(prompt(1), BACKENDS).reason == "load-fallback"


# -- copying and pickling ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "how", [copy.copy, copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))], ids=["copy", "deepcopy", "pickle"]
)
def test_a_router_cannot_be_copied_or_pickled_and_says_why(how: Callable[[object], object]) -> None:
    router, _ = busy_router()
    with pytest.raises(TypeError, match="Router cannot be copied or pickled"):
        how(router)
    router._check()


@pytest.mark.parametrize("how", [copy.copy, copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))])
def test_value_objects_copy_and_pickle_to_equals_that_work(how: Callable[[Any], Any]) -> None:
    router, decision = busy_router()
    assert how(decision) == decision
    router.finish(how(decision))  # a pickled decision names the same request
    assert router.stats().in_flight == 0
    assert how(router.stats()) == router.stats()
    assert how(decision.candidates[0]) == decision.candidates[0]
    hasher = BlockHasher(4, namespace="model")
    assert how(hasher).hash(prompt(1)) == hasher.hash(prompt(1))
    for name in policy_names():
        policy = policy_from_name(name)
        twin = how(policy)
        assert type(twin) is type(policy) and repr(twin) == repr(policy)
        assert twin.choose(decision.candidates) in decision.candidates
    seeded, twin = Random(seed=3), how(Random(seed=3))
    assert [seeded.choose(decision.candidates) for _ in range(5)] == [
        twin.choose(decision.candidates) for _ in range(5)
    ]


@pytest.mark.parametrize(
    "how", [copy.copy, copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))], ids=["copy", "deepcopy", "pickle"]
)
def test_a_copy_of_an_index_is_independent_of_it_and_of_its_router(how: Callable[[PrefixIndex], PrefixIndex]) -> None:
    index = PrefixIndex(4, capacity_blocks=8)
    index.insert([1, 2, 3], "a")
    twin = how(index)
    twin.insert([9, 10], "a")
    twin.remove([3], "a")
    twin.set_capacity("a", 1)
    assert sorted(index.hashes("a")) == [1, 2, 3] and index.capacity("a") == 8
    index._check(chains=[[1, 2, 3]])
    twin._check(chains=[[9, 10]])
    router = Router(block_size=4)
    first = router.route(prompt(1), BACKENDS)
    twin = how(router.index)
    twin.set_capacity(first.backend, 2)
    twin.remove_backend(first.backend)
    again = router.route(prompt(1), BACKENDS)
    assert (again.backend, again.matched_tokens) == (first.backend, 24)
    assert {c.capacity_blocks for c in again.candidates} == {None} and router.index.capacity(first.backend) is None
    router._check()


# -- many threads --------------------------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            self.now += 0.001
            return self.now


def test_eight_threads_doing_every_lifecycle_call_leave_every_counter_at_zero() -> None:
    flaky = Scripted()
    calls = iter(range(10**9))

    def act(candidates: Sequence[Candidate]) -> Candidate:
        n = next(calls)
        if n % 97 == 0:
            raise Boom("policy bug")
        return PredictedTTFT().choose(candidates)

    flaky.act = act
    router = Router(block_size=4, policy=flaky, clock=FakeClock(), capacity_blocks=64)
    errors: list[BaseException] = []
    all_decisions: list[Decision] = []
    guard = threading.Lock()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        mine: list[Decision] = []
        try:
            for _ in range(300):
                op = rng.randrange(10)
                tokens = prompt(rng.randrange(12), blocks=rng.randrange(1, 9))
                try:
                    if op < 3:
                        decision = router.route(tokens, BACKENDS)
                    elif op == 3:
                        decision = router.decide(tokens, BACKENDS)
                        decision = router.commit(decision, rng.choice(BACKENDS))
                    else:
                        decision = None
                except PolicyError as exc:
                    assert isinstance(exc.__cause__, Boom)
                    continue
                if decision is not None:
                    router.start(decision, lease=rng.choice([None, 0.05, 5.0]))
                    mine.append(decision)
                elif op == 4 and mine:
                    router.first_token(rng.choice(mine))
                elif op == 5 and mine:
                    router.finish(mine.pop(rng.randrange(len(mine))), refused=rng.random() < 0.3)
                elif op == 6:
                    router.set_engine_load(rng.choice(BACKENDS), queue_len=rng.randrange(4), kv_usage=rng.random())
                elif op == 7:
                    router.set_capacity(rng.choice(BACKENDS), rng.choice([None, 0, 8, 64]))
                elif op == 8:
                    router.store(rng.choice(BACKENDS), [rng.randrange(2**64) for _ in range(3)])
                else:
                    router.expire()
                    router.in_flight(rng.choice(BACKENDS))
        except BaseException as exc:  # noqa: BLE001 - reported below, with the thread's seed
            errors.append(exc)
        with guard:
            all_decisions.extend(mine)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    router._check()
    for decision in all_decisions:
        router.finish(decision)
    router._check()
    assert router.stats().in_flight == 0
    for backend in BACKENDS:
        assert router.in_flight(backend) == 0
    candidates = router.decide(prompt(1), BACKENDS).candidates
    assert all(
        (c.in_flight, c.pending_prefill_tokens, c.held_blocks, c.active_blocks, c.in_prefill) == (0, 0, 0, 0, 0)
        for c in candidates
    )
