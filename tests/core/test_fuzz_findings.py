"""Defects the public-API fuzz harness (test_fuzz_public.py) found: each case failed before its fix."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from prefixroute import (
    BoundedLoad,
    Candidate,
    ConfigurationError,
    CostAware,
    DecisionError,
    InvalidPromptError,
    LeastLoaded,
    LinearTTFT,
    LoadPolicy,
    PowerOfTwo,
    PredictedTTFT,
    PrefixAffinity,
    PrefixIndex,
    PrefixRouteError,
    Random,
    RoundRobin,
    Router,
    encode_tokens,
    kv_fraction,
    policy_from_name,
)
from prefixroute.cli import main

_ONE = Candidate("a", 0, 16, 0)


class _RaisingEq(str):
    """A backend id or namespace whose own ``__eq__`` raises, as a hostile str subclass can."""

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("__eq__ called")

    __hash__ = str.__hash__


class _RaisingEqBytes(bytes):
    def __eq__(self, other: object) -> bool:
        raise RuntimeError("__eq__ called")

    __hash__ = bytes.__hash__


@pytest.mark.parametrize("capacity", [None, 8])
@pytest.mark.parametrize(
    ("hashes", "held"), [(True, 0), ("ab", 0), (2**70, 0), ([1, 2], None), ([1, 2], 1.5), ([[1], 2], 0)]
)
def test_a_refused_predict_leaves_no_empty_store(capacity: int | None, hashes: object, held: object) -> None:
    index = PrefixIndex(4, capacity_blocks=capacity)
    index.insert([7, 8], "kept")
    with pytest.raises(TypeError):
        index.predict(hashes, "a", held)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        index.predict(hashes, "kept", held)  # type: ignore[arg-type]
    index._check()
    assert index.backends() == ["kept"]
    assert index.hashes("kept") == {7, 8}


@pytest.mark.parametrize("bad", [-1, 2**64, "x", None, 1.5, float("nan"), True, [1]])
def test_predict_checks_each_hash_as_insert_does(bad: object) -> None:
    # Was: predict() stored any item of a sequence unchecked (the router's hot path calls it), and the index's own
    # invariants then failed (a str, a negative or a float block). Only the hashes a Router computes are trusted.
    index = PrefixIndex(4, capacity_blocks=8)
    index.insert([7, 8], "kept")
    with pytest.raises(PrefixRouteError, match="block hashes must be ints"):
        index.predict([1, bad, 3], "kept", 0)  # type: ignore[list-item]
    index._check()
    assert index.hashes("kept") == {7, 8}
    index.predict([1, 2, 3], "kept", 0)  # the same call with ints records
    assert index.hashes("kept") == {1, 2, 3, 7, 8}


@pytest.mark.parametrize("backend", [None, 5, ["a"], {"a": 1}])
def test_index_reads_refuse_a_backend_that_is_not_a_str_with_a_clear_type_error(backend: object) -> None:
    index = PrefixIndex(4)
    index.insert([1], "a")
    for read in (index.hashes, index.blocks, index.store, index.capacity, index.remove_backend):
        with pytest.raises(TypeError, match="backend id is a str"):
            read(backend)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="backend id is a str"):
        index.holds(1, backend)  # type: ignore[arg-type]
    index._check()


def test_index_holds_and_match_say_what_is_wrong_with_their_arguments() -> None:
    index = PrefixIndex(4)
    index.insert([5, 6], "a")
    block: Any = np.uint64(5)  # typed loosely: older numpy stubs do not make it an int
    assert index.holds(block, "a")  # numpy's ints still name a block
    with pytest.raises(TypeError, match="block_hash must be an int"):
        index.holds([5], "a")  # type: ignore[arg-type]
    for hashes in (True, 5, 1.5, "ab"):
        with pytest.raises(TypeError, match="hashes must be a sequence"):
            index.match(hashes, ["a"])  # type: ignore[arg-type]
    for backends in (None, 5, [["a"]]):
        with pytest.raises(TypeError, match="backends must be an iterable"):
            index.match([5], backends)  # type: ignore[arg-type]
    assert index.match((5, 6), ["a"]) == {"a": 2}


def test_a_str_subclass_backend_or_namespace_does_not_poison_later_calls() -> None:
    router = Router(block_size=4)
    prompt = list(range(8))
    decision = router.route(prompt, [_RaisingEq("a"), "b"])
    assert type(decision.backend) is str
    router.route(prompt, ["a", "b"])  # the placement cache held the subclass and called its __eq__
    router.set_capacity(_RaisingEq("a"), 5)
    router.set_engine_load(_RaisingEq("b"), queue_len=1, kv_usage=None)
    router.store(_RaisingEq("a"), [1, 2])
    router.route(prompt, ["a", "b"], namespace=_RaisingEq("m"))
    router.route(prompt, ["a", "b"], namespace="m")
    router.route(prompt, ["a", "b"], namespace=_RaisingEqBytes(b"m"))
    router.route(prompt, ["a", "b"], namespace=b"m")
    committed = router.commit(router.decide(prompt, ["a", "b"]), _RaisingEq("b"))
    assert type(committed.backend) is str
    with router.track(committed):
        assert router.in_flight("b") == 1
    assert router.index.capacity("a") == 5
    router._check()
    index = PrefixIndex(4, capacity_blocks={_RaisingEq("a"): 3})
    index.insert([1], _RaisingEq("b"))
    index.insert([1], "b")
    assert index.match([1], ["a", "b"]) == {"a": 0, "b": 1}
    index._check()


@pytest.mark.parametrize("policy", [Random, PowerOfTwo])
def test_a_str_seed_with_a_lone_surrogate_seeds_and_a_valid_one_seeds_as_random_does(
    policy: type[Random | PowerOfTwo],
) -> None:
    policy(seed="\ud800")  # type: ignore[arg-type]  # str and bytes seeds are accepted, as random.Random takes them
    assert policy(seed="abcé")._rng.random() == random.Random("abcé").random()  # type: ignore[arg-type]


_POLICIES = [BoundedLoad, CostAware, LeastLoaded, PowerOfTwo, PredictedTTFT, PrefixAffinity, Random, RoundRobin]


@pytest.mark.parametrize("policy", [*(cls() for cls in _POLICIES), PredictedTTFT(use_speed=True)], ids=repr)
@pytest.mark.parametrize("candidates", [5, 1.5, True, "ab", b"ab", {"a": 1}, [None], (1,), [_ONE, None]], ids=repr)
def test_choose_given_something_other_than_candidates_says_so(policy: LoadPolicy, candidates: object) -> None:
    with pytest.raises(TypeError, match="takes (a sequence of )?Candidates"):  # an AttributeError or unpacking before
        policy.choose(candidates)  # type: ignore[arg-type]


@pytest.mark.parametrize("candidate", [None, 5, "a", (1, 2)])
def test_the_cost_models_given_something_other_than_a_candidate_say_so(candidate: object) -> None:
    for cost in (LinearTTFT(), PredictedTTFT().cost, kv_fraction):
        with pytest.raises(TypeError, match="takes a Candidate"):
            cost(candidate)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="takes (a sequence of )?Candidates"):
        PredictedTTFT.cap_terms([candidate])  # type: ignore[list-item]


_USER_POLICIES = """
from prefixroute import LoadPolicy

class CtorRaises(LoadPolicy):
    def __init__(self):
        raise RuntimeError("ctor boom")

    def choose(self, candidates):
        return candidates[0]
"""


@pytest.mark.parametrize(
    ("module", "source", "message"),
    [
        (
            "fuzz_policy_ctor",
            _USER_POLICIES,
            "cannot build policy 'fuzz_policy_ctor:CtorRaises': RuntimeError: ctor boom",
        ),
        ("fuzz_policy_import", "raise RuntimeError('import boom')", "cannot import policy .*RuntimeError: import boom"),
        ("fuzz_policy_exit", "import sys; sys.exit(3)", r"cannot import policy .*sys.exit\(3\)"),
    ],
)
def test_policy_from_name_wraps_whatever_a_users_module_or_class_raises(
    module: str, source: str, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigurationError, match=message) as caught:  # a RuntimeError or SystemExit escaped before
        policy_from_name(f"{module}:CtorRaises")
    assert caught.value.__cause__ is not None


@pytest.mark.parametrize("command", ["serve", "proxy"])
def test_serve_and_proxy_answer_a_policy_whose_constructor_raises_with_one_line(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "fuzz_policy_cli.py").write_text(_USER_POLICIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = [command, "--backends", "http://127.0.0.1:9", "--port", "0", "--policy", "fuzz_policy_cli:CtorRaises"]
    assert main(argv) == 2  # was a RuntimeError traceback, exit status 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot build policy" in err and "ctor boom" in err, err


@pytest.mark.parametrize("raw", [bytearray(b"abcd"), bytearray(8)])
def test_a_bytearray_is_not_taken_for_block_hashes(raw: bytearray) -> None:
    # Was: a ValueError from array("Q", ...) (length not a multiple of 8), or its bytes stored as one uint64 hash.
    index = PrefixIndex(4)
    router = Router(block_size=4)
    writes: list[Callable[[], None]] = [
        lambda: index.insert(raw, "a"),
        lambda: index.remove(raw, "a"),
        lambda: index.retract(raw, "a", 0),
        lambda: router.store("a", raw),
        lambda: router.write("a", [(True, raw, None)]),
    ]
    for write in writes:
        with pytest.raises(TypeError, match="sequence of"):
            write()
    assert index.backends() == [] and router.index.backends() == []


def test_a_memoryview_of_bytes_that_is_not_1d_is_refused_as_the_docstring_says() -> None:
    # Was: a (2, 4) view of format 'B' flattened into two token ids, where encode_tokens documents the refusal.
    with pytest.raises(InvalidPromptError, match="1-D"):
        encode_tokens(memoryview(b"abcdabcd").cast("B", shape=[2, 4]))
    assert encode_tokens(memoryview(b"abcdabcd")) == b"abcdabcd"


def test_numpy_arrays_and_2d_views_where_one_id_or_hash_belongs_get_clear_errors() -> None:
    router = Router(block_size=4)
    decision = router.decide(list(range(8)), ["a", "b"])
    with pytest.raises(DecisionError, match="not a candidate"):  # was numpy's "truth value ... is ambiguous"
        router.commit(decision, np.array([1, 2]))  # type: ignore[arg-type]
    with pytest.raises(InvalidPromptError, match="position 1"):  # was numpy's TypeError from int()
        encode_tokens([1, np.array([1, 2])])  # type: ignore[list-item]
    index = PrefixIndex(4)
    index.insert([1], "a")
    with pytest.raises(TypeError, match="block hashes must be ints"):  # was "unhashable type: 'list'"
        index.match([[1]], ["a"])  # type: ignore[list-item]
    grid = memoryview(b"abcdabcd").cast("B", shape=[2, 4])  # iterating it raised NotImplementedError
    with pytest.raises(TypeError):
        router.route(list(range(8)), grid)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        router.write("a", grid)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        index.insert(grid, "a")
    with pytest.raises(TypeError):
        LeastLoaded().choose(grid)  # type: ignore[arg-type]
    router._check()
