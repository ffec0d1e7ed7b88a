"""Hostile input at the core's entry points that an independent audit found mishandled: each case failed before."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

import numpy as np
import pytest

from prefixroute import (
    BlockHasher,
    BoundedLoad,
    ConfigurationError,
    CostAware,
    DecisionError,
    InvalidEventError,
    InvalidPromptError,
    InvalidTraceError,
    InvalidTypeError,
    LinearTTFT,
    LoadPolicy,
    MetricsError,
    NoBackendError,
    PolicyError,
    PowerOfTwo,
    PrefixIndex,
    PrefixRouteError,
    Random,
    Router,
    kv_fraction,
    policy_from_name,
)

from ..conftest import FakeClock

HUGE = 10**400  # an int no float can hold


def test_store_and_write_read_an_iterator_of_hashes_once() -> None:
    router = Router(block_size=4)
    router.store("a", (h for h in [1, 2, 3]))  # type: ignore[arg-type]
    router.write("b", [(True, (h for h in [1, 2, 3]), None)])  # type: ignore[list-item]
    assert router.index.blocks("a") == router.index.blocks("b") == 3
    router._check()


def test_hashes_of_other_int_types_are_stored_as_python_ints() -> None:
    router = Router(block_size=4)
    router.store("n", np.array([1, 2], dtype=np.uint64))  # type: ignore[arg-type]
    index = PrefixIndex(4)
    index.insert(np.array([5, 6], dtype=np.uint64), "n")  # type: ignore[arg-type]
    router._check()
    index._check()
    assert router.index.match([1, 2], ["n"]) == {"n": 2}


def test_out_of_range_hashes_are_the_same_error_on_every_write_path() -> None:
    index = PrefixIndex(4)
    for bad in ([-1], [2**64]):
        with pytest.raises(InvalidEventError):
            index.insert(bad, "a")
        with pytest.raises(InvalidEventError):
            index.remove(bad, "a")
        with pytest.raises(InvalidEventError):
            Router(block_size=4).store("a", bad)
    with pytest.raises(InvalidEventError):
        index.insert([1], "a", parent=-1)
    with pytest.raises(InvalidEventError, match="removal has no parent"):
        Router(block_size=4).write("a", [(False, [1], 7)])


def test_a_namespace_of_the_wrong_type_says_so() -> None:
    router = Router(block_size=4)
    bads: tuple[object, ...] = (bytearray(b"x"), ["x"], {}, 5)
    for bad in bads:
        with pytest.raises(TypeError, match="namespace must be a str, bytes or None"):
            router.route([1, 2, 3, 4], ["a"], namespace=bad)  # type: ignore[arg-type]


def test_a_lease_too_large_for_a_float_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="lease"):
        Router(lease=HUGE)
    router = Router(block_size=4)
    with pytest.raises(ConfigurationError, match="lease"):
        router.start(router.route([1, 2, 3, 4], ["a"]), lease=HUGE)
    assert router.in_flight("a") == 0


def test_misused_decisions_and_arguments_raise_errors_of_the_tree() -> None:
    router, other = Router(block_size=4), Router(block_size=4)
    decision = other.decide([1, 2, 3, 4], ["a", "b"])
    with pytest.raises(DecisionError, match="another router"):
        router.commit(decision)
    with pytest.raises(DecisionError, match="another router"):
        router.start(decision)
    with pytest.raises(DecisionError, match="another router"):
        router.commit(replace(decision, id=5))  # type: ignore[arg-type]
    with pytest.raises(DecisionError, match="not a candidate"):
        other.commit(decision, "c")
    with pytest.raises(ConfigurationError, match="more than once"):
        router.route([1, 2, 3, 4], ["a", "a"])
    with pytest.raises(InvalidPromptError, match="parent"):
        BlockHasher(4).hash([1, 2, 3, 4], parent=-1)
    for error in (DecisionError, ConfigurationError, InvalidPromptError, InvalidEventError, InvalidTraceError,
                  MetricsError):  # fmt: skip
        assert issubclass(error, PrefixRouteError) and issubclass(error, ValueError)
    assert issubclass(NoBackendError, LookupError) and issubclass(PolicyError, TypeError)
    assert issubclass(InvalidTypeError, PrefixRouteError) and issubclass(InvalidTypeError, TypeError)


def test_a_wrong_type_is_an_error_of_the_tree_and_a_type_error() -> None:
    """One exception tree: ``except PrefixRouteError`` catches a wrong argument type too, as ``except TypeError``
    does."""
    router = Router(block_size=4)
    calls: list[Callable[[], object]] = [
        lambda: router.route("some text", ["a"]),  # type: ignore[arg-type]
        lambda: router.route([1, 2, 3, 4], "a"),
        lambda: router.route([1, 2, 3, 4], [1]),  # type: ignore[list-item]
        lambda: router.start(None),  # type: ignore[arg-type]
        lambda: router.in_flight(["a"]),  # type: ignore[arg-type]
        lambda: Router(policy="bounded-load"),  # type: ignore[arg-type]
        lambda: PrefixIndex(4).match([1], "a"),
        lambda: kv_fraction(None),  # type: ignore[arg-type]
        lambda: BoundedLoad().choose([None]),  # type: ignore[list-item]
    ]
    for call in calls:
        with pytest.raises(InvalidTypeError) as caught:
            call()
        assert isinstance(caught.value, TypeError) and isinstance(caught.value, PrefixRouteError)
    router._check()


def test_in_flight_and_stats_end_expired_leases_without_a_new_route() -> None:
    clock = FakeClock()
    router = Router(block_size=4, clock=clock, lease=1.0)
    for prompt in ([1, 2, 3, 4], [5, 6, 7, 8]):
        router.start(router.route(prompt, ["a"]))
    assert router.in_flight("a") == 2
    clock.tick(1.5)
    assert router.in_flight("a") == 0
    stats = router.stats()
    assert (stats.in_flight, stats.leases_expired) == (0, 2)


def test_in_flight_of_a_backend_id_that_is_not_a_str_says_so() -> None:
    router = Router(block_size=4)
    router.start(router.route([1, 2, 3, 4], ["5"]))
    with pytest.raises(TypeError, match="backend ids must be str, not int"):
        router.in_flight(5)  # type: ignore[arg-type]
    assert router.in_flight("5") == 1


def test_a_block_size_beyond_the_hashers_limit_is_refused_by_the_index_too() -> None:
    for bad in (65537, 10**9, 0, True, 1.5):
        with pytest.raises(ConfigurationError, match="block_size"):
            PrefixIndex(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("build", "error"),
    [
        (lambda: Random(rng=5), TypeError),  # type: ignore[arg-type]
        (lambda: PowerOfTwo(rng="x"), TypeError),  # type: ignore[arg-type]
        (lambda: Random(seed=[1]), TypeError),  # type: ignore[arg-type]
        (lambda: CostAware(cost=5), TypeError),  # type: ignore[arg-type]
        (lambda: LinearTTFT(per_token_s=math.nan), ConfigurationError),
        (lambda: LinearTTFT(per_request_s=-1), ConfigurationError),
        (lambda: LinearTTFT(per_token_pair_s="x"), ConfigurationError),  # type: ignore[arg-type]
        (lambda: BoundedLoad(factor=HUGE), ConfigurationError),
    ],
)
def test_policy_options_are_checked_when_given(build: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        build()  # type: ignore[operator]


class _FarRng(random.Random):
    """Draws past the end: randrange(3) is 7, sample(range(3), 2) is [5, 9]."""

    def randrange(self, *args: object, **kwargs: object) -> int:
        return 7

    def sample(self, *args: object, **kwargs: object) -> list[int]:  # type: ignore[override]
        return [5, 9]


class _FloatRng(random.Random):
    def randrange(self, *args: object, **kwargs: object) -> float:  # type: ignore[override]
        return 0.5

    def sample(self, *args: object, **kwargs: object) -> list[int]:  # type: ignore[override]
        return [0]


class _BrokenRng(random.Random):
    def randrange(self, *args: object, **kwargs: object) -> int:
        raise RuntimeError("entropy gone")

    def sample(self, *args: object, **kwargs: object) -> list[int]:  # type: ignore[override]
        raise RuntimeError("entropy gone")


@pytest.mark.parametrize(
    ("policy", "message"),
    [(Random(rng=_FarRng()), r"Random's rng \(_FarRng\) returned 7 from randrange\(3\), not an int in \[0, 3\)"),
     (Random(rng=_FloatRng()), r"Random's rng \(_FloatRng\) returned 0.5 from randrange\(3\), not an int in \[0, 3\)"),
     (Random(rng=_BrokenRng()), r"Random's rng \(_BrokenRng\) raised RuntimeError: entropy gone in randrange\(3\)"),
     (PowerOfTwo(rng=_FarRng()),
      r"PowerOfTwo's rng \(_FarRng\) returned \[5, 9\] from sample\(range\(3\), 2\), not two ints in \[0, 3\)"),
     (PowerOfTwo(rng=_FloatRng()),
      r"PowerOfTwo's rng \(_FloatRng\) returned \[0\] from sample\(range\(3\), 2\), not two ints in \[0, 3\)"),
     (PowerOfTwo(rng=_BrokenRng()),
      r"PowerOfTwo's rng \(_BrokenRng\) raised RuntimeError: entropy gone in sample\(range\(3\), 2\)")],
)  # fmt: skip
def test_an_injected_rng_that_draws_out_of_range_or_raises_is_named(policy: LoadPolicy, message: str) -> None:
    """Was: an IndexError (or TypeError, ValueError, the rng's own error) inside choose(), which the router wrapped
    as 'policy Random() raised IndexError: tuple index out of range (...; fix the policy)': the policy is right,
    the rng given to it is at fault."""
    router = Router(policy=policy)
    with pytest.raises(PolicyError, match=message) as caught:
        router.route(list(range(40)), ["a", "b", "c"])
    assert "fix the rng" in str(caught.value) and "fix the policy" not in str(caught.value)
    assert router.stats().commits == 0


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        (":", {}, "must name a module and a class"),
        (":X", {}, "must name a module and a class"),
        (".relative:X", {}, "cannot import policy"),
        ("random", {"seed": [1]}, "seed must be"),
        ("random", {"bogus": 1}, "does not accept options"),
        ("prefixroute:LoadPolicy", {}, "abstract"),
        ("cost-aware", {"cost": 5}, "callable"),
    ],
)
def test_policy_from_name_says_what_is_wrong(name: str, options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        policy_from_name(name, **options)


@pytest.mark.parametrize("values", [[True], [1, False], (2, True)])
@pytest.mark.parametrize("as_iterator", [False, True])
def test_a_bool_is_no_block_hash_on_any_write_path(values: Sequence[int], as_iterator: bool) -> None:
    """array("Q") takes True for 1: a flag passed by mistake must not be stored as a block."""

    def hashes() -> Iterable[int]:
        return iter(values) if as_iterator else values

    router = Router(block_size=4)
    with pytest.raises(InvalidEventError, match=f"not bools: {values[-1]} at position {len(values) - 1}"):
        router.store("b", hashes())  # type: ignore[arg-type]
    index = PrefixIndex(4)
    for write in (index.insert, index.remove):
        with pytest.raises(InvalidTypeError, match="not bools"):
            write(hashes(), "b")  # type: ignore[arg-type]
    assert router.index.blocks("b") == 0 and index.blocks("b") == 0
    router._check()
    index._check()
