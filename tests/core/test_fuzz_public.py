"""Hostile values at every public callable of ``prefixroute.__all__``: a call either works or raises an error of the
library's tree (a wrong argument type is its :class:`InvalidTypeError`, a TypeError too), and a refused call leaves
the router and the index as they were and consistent (``_check()``).

Bounded (a few hundred examples per test) so the file runs in seconds; the defects it found are pinned one by one in
test_fuzz_findings.py.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import prefixroute
from prefixroute import (
    BlockHasher,
    BoundedLoad,
    Candidate,
    CostAware,
    LeastLoaded,
    LinearTTFT,
    LoadPolicy,
    PowerOfTwo,
    PredictedTTFT,
    PrefixAffinity,
    PrefixIndex,
    Random,
    RoundRobin,
    Router,
    encode_tokens,
    kv_fraction,
    policy_from_name,
)

from ..conftest import StrSubclass, call_or_refuse

BACKENDS = ["gpu0", "gpu1", "gpu2"]
PROMPT = list(range(40))


_ATOMS: list[object] = [
    None, True, False, 0, -1, 1, 3, 2**32, 2**64, 2**70, -(2**70), 10**400, 0.0, -0.0, 1.5, math.nan, math.inf,
    -math.inf, "", "gpu0", "x" * 5000, "\ud800", StrSubclass("gpu1"), b"", b"abcd", bytearray(b"abcd"), [], (), {},
    set(), frozenset({"gpu0"}), [[1]], [None], [1.0, 2.0], ["gpu0", "gpu0"], ["gpu0", ""], {"gpu0": 1}, object(),
    np.int64(3), np.uint64(2**63), np.float64(2.0), np.array([1, 2]), np.array([[1, 2]]), range(20),
    Candidate("gpu0", 0, 16, 0), memoryview(b"abcdabcd").cast("B", shape=[2, 4]),
]  # fmt: skip

hostile = st.one_of(
    st.sampled_from(_ATOMS),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.lists(st.sampled_from(_ATOMS), max_size=4),
    st.lists(st.integers(min_value=-5, max_value=2**33), max_size=40),
    st.dictionaries(st.text(max_size=3), st.sampled_from(_ATOMS), max_size=2),
    st.builds(iter, st.lists(st.integers(0, 50), max_size=5)),
)


_FAST = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_FAST
@given(option=st.sampled_from(["block_size", "capacity_blocks", "namespace", "placement_blocks", "lease", "clock",
                               "rng", "index", "policy"]), value=hostile)  # fmt: skip
def test_router_options_are_checked_when_given(option: str, value: object) -> None:
    options: dict[str, Any] = {option: value}
    if call_or_refuse(Router, **options) and option != "clock":
        Router(**options).route(PROMPT, BACKENDS)  # an accepted option works at first use


_ROUTER_CALLS: dict[str, Callable[[Router, Any, Any], object]] = {
    "route prompt": lambda r, d, v: r.route(v, BACKENDS),
    "route backends": lambda r, d, v: r.route(PROMPT, v),
    "route namespace": lambda r, d, v: r.route(PROMPT, BACKENDS, namespace=v),
    "decide prompt": lambda r, d, v: r.decide(v, BACKENDS),
    "commit decision": lambda r, d, v: r.commit(v),
    "commit backend": lambda r, d, v: r.commit(d, v),
    "start decision": lambda r, d, v: r.start(v),
    "start lease": lambda r, d, v: r.start(d, lease=v),
    "first_token": lambda r, d, v: r.first_token(v),
    "finish": lambda r, d, v: r.finish(v),
    "finish refused": lambda r, d, v: r.finish(d, refused=v),
    "set_capacity backend": lambda r, d, v: r.set_capacity(v, 4),
    "set_capacity blocks": lambda r, d, v: r.set_capacity("gpu0", v),
    "set_engine_load queue": lambda r, d, v: r.set_engine_load("gpu0", queue_len=v, kv_usage=None),
    "set_engine_load kv": lambda r, d, v: r.set_engine_load("gpu0", queue_len=None, kv_usage=v),
    "remove_backend": lambda r, d, v: r.remove_backend(v),
    "clear_backend": lambda r, d, v: r.clear_backend(v),
    "in_flight": lambda r, d, v: r.in_flight(v),
    "store hashes": lambda r, d, v: r.store("gpu0", v),
    "store parent": lambda r, d, v: r.store("gpu0", [1, 2], parent=v),
    "evict": lambda r, d, v: r.evict("gpu0", v),
    "write": lambda r, d, v: r.write("gpu0", v),
    "write one": lambda r, d, v: r.write("gpu0", [v]),
    "write stored": lambda r, d, v: r.write("gpu0", [(True, v, None)]),
}


@_FAST
@given(calls=st.lists(st.tuples(st.sampled_from(sorted(_ROUTER_CALLS)), hostile), min_size=1, max_size=6))
def test_router_calls_refuse_hostile_values_and_change_nothing(calls: list[tuple[str, object]]) -> None:
    router = Router(block_size=4, lease=60.0)
    decision = router.route(PROMPT, BACKENDS)
    router.start(decision)
    for name, value in calls:
        before = (router.stats(), {b: router.in_flight(b) for b in BACKENDS}, len(router.index))
        worked = call_or_refuse(_ROUTER_CALLS[name], router, decision, value)
        router._check()
        if not worked:
            after = (router.stats(), {b: router.in_flight(b) for b in BACKENDS}, len(router.index))
            assert after == before, (name, value)
    router.route(PROMPT, BACKENDS)  # still routes
    router._check()


_INDEX_CALLS: dict[str, Callable[[PrefixIndex, Any], object]] = {
    "match hashes": lambda i, v: i.match(v, BACKENDS),
    "match backends": lambda i, v: i.match([1, 2], v),
    "insert hashes": lambda i, v: i.insert(v, "gpu0"),
    "insert backend": lambda i, v: i.insert([1, 2], v),
    "insert parent": lambda i, v: i.insert([3], "gpu0", parent=v),
    "remove hashes": lambda i, v: i.remove(v, "gpu0"),
    "remove backend": lambda i, v: i.remove([1], v),
    "remove_backend": lambda i, v: i.remove_backend(v),
    "holds hash": lambda i, v: i.holds(v, "gpu0"),
    "holds backend": lambda i, v: i.holds(1, v),
    "hashes": lambda i, v: i.hashes(v),
    "blocks": lambda i, v: i.blocks(v),
    "store": lambda i, v: i.store(v),
    "capacity": lambda i, v: i.capacity(v),
    "set_capacity backend": lambda i, v: i.set_capacity(v, 3),
    "set_capacity blocks": lambda i, v: i.set_capacity("gpu0", v),
    "predict hashes": lambda i, v: i.predict(v, "gpu0", 0),
    "predict one hash": lambda i, v: i.predict([1, v], "gpu0", 1),
    "predict held": lambda i, v: i.predict([1, 2, 9], "gpu0", v),
    "retract hashes": lambda i, v: i.retract(v, "gpu0", 0),
    "retract start": lambda i, v: i.retract([1, 2], "gpu0", v),
    "match_confirmed": lambda i, v: i.match_confirmed(v, "gpu0"),
}


@_FAST
@given(
    capacity=st.sampled_from([None, 4, {"gpu0": 2}]),
    calls=st.lists(st.tuples(st.sampled_from(sorted(_INDEX_CALLS)), hostile), min_size=1, max_size=6),
)
def test_index_calls_refuse_hostile_values_and_stay_consistent(
    capacity: int | dict[str, int] | None, calls: list[tuple[str, object]]
) -> None:
    index = PrefixIndex(4, capacity_blocks=capacity)
    index.insert([1, 2], "gpu0")
    for name, value in calls:
        before = {b: index.hashes(b) for b in index.backends()}
        if not call_or_refuse(_INDEX_CALLS[name], index, value):
            assert {b: index.hashes(b) for b in index.backends()} == before, (name, value)
        index._check()  # not chains=: a hostile insert may root a block that [1, 2] names as a child


_POLICIES = [BoundedLoad, CostAware, LeastLoaded, PowerOfTwo, PredictedTTFT, PrefixAffinity, Random, RoundRobin]


@_FAST
@given(policy=st.sampled_from(_POLICIES), option=st.sampled_from(["factor", "cost", "kv_cap", "use_speed", "seed",
       "rng", "nope"]), value=hostile, candidates=hostile)  # fmt: skip
def test_policies_and_their_options_refuse_hostile_values(
    policy: type[LoadPolicy], option: str, value: object, candidates: object
) -> None:
    if option in inspect.signature(policy).parameters:  # a keyword a class does not take is Python's own TypeError
        call_or_refuse(policy, **{option: value})
    call_or_refuse(policy_from_name, policy.name, **{option: value})  # a ConfigurationError listing the options, if not
    built = policy()
    call_or_refuse(built.choose, candidates)
    if isinstance(built, PredictedTTFT):
        call_or_refuse(built.cost, candidates)
        call_or_refuse(built.cap_terms, candidates)
    call_or_refuse(LinearTTFT(), candidates)
    call_or_refuse(kv_fraction, candidates)
    call_or_refuse(policy_from_name, value)


@_FAST
@given(tokens=hostile, block_size=hostile, namespace=hostile, parent=hostile)
def test_hashing_refuses_hostile_values(tokens: object, block_size: object, namespace: object, parent: object) -> None:
    call_or_refuse(encode_tokens, tokens)
    call_or_refuse(BlockHasher, block_size)
    call_or_refuse(BlockHasher, 4, namespace=namespace)
    call_or_refuse(BlockHasher(4).hash, PROMPT, parent=parent)
    call_or_refuse(BlockHasher(4).hash, tokens)


@_FAST
@given(ids=st.lists(st.integers(0, 2**32 - 1), max_size=64), dtype=st.sampled_from(["int32", "int64", "uint32"]))
def test_numpy_token_ids_route_as_the_list_does(ids: list[int], dtype: str) -> None:
    # docs: 1-D numpy integer arrays and numpy ints in a list are accepted token ids.
    values = [i for i in ids if i < 2**31] if dtype == "int32" else ids
    assert encode_tokens(np.array(values, dtype=dtype)) == encode_tokens(values)
    numpy_ints: list[Any] = [np.int64(v) for v in values]  # typed loosely: older numpy stubs do not make it an int
    assert encode_tokens(numpy_ints) == encode_tokens(values)


def test_every_public_name_is_exercised_here() -> None:
    exercised = {
        "BlockHasher", "BoundedLoad", "Candidate", "CostAware", "LeastLoaded", "LinearTTFT", "PowerOfTwo",
        "PredictedTTFT", "PrefixAffinity", "PrefixIndex", "Random", "RoundRobin", "Router", "encode_tokens",
        "kv_fraction", "policy_from_name",
    }  # fmt: skip
    not_callables = {"BlockHash", "Decision", "Reason", "RouterStats", "LoadPolicy", "__version__", "policy_names"}
    errors = {name for name in prefixroute.__all__ if name.endswith("Error")}
    assert set(prefixroute.__all__) == exercised | not_callables | errors
