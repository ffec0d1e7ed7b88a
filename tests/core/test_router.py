from __future__ import annotations

import asyncio
import random
import re
import statistics
from collections import Counter

import pytest

from prefixroute import (
    BoundedLoad,
    Candidate,
    ConfigurationError,
    InvalidPromptError,
    InvalidTypeError,
    LoadPolicy,
    NoBackendError,
    PolicyError,
    PrefixAffinity,
    RoundRobin,
    Router,
)
from prefixroute._accounting import ANCHORS

BACKENDS = [f"http://gpu{i}:8000" for i in range(8)]


def prompt(rng: random.Random, prefix: list[int], length: int) -> list[int]:
    return prefix + [rng.randrange(32000) for _ in range(length)]


def test_same_prefix_lands_on_the_same_backend() -> None:
    rng = random.Random(0)
    router = Router()
    system = [rng.randrange(32000) for _ in range(512)]
    first = router.route(prompt(rng, system, 40), BACKENDS)
    assert first.reason == "miss" and first.matched_tokens == 0
    for _ in range(20):
        decision = router.route(prompt(rng, system, rng.randrange(1, 200)), BACKENDS)
        assert (decision.backend, decision.reason, decision.matched_tokens) == (first.backend, "prefix", 512)


def test_decision_describes_every_candidate() -> None:
    router = Router(block_size=4)
    router.route([1, 2, 3, 4, 5, 6, 7, 8], ["a"])
    decision = router.route([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], ["a", "b"])
    assert decision.prompt_tokens == 10 and decision.hit_ratio == 0.8
    assert {c.backend: c.matched_tokens for c in decision.candidates} == {"a": 8, "b": 0}
    assert all(c.prompt_tokens == 10 for c in decision.candidates)


def test_hot_prefix_with_bounded_load_never_exceeds_twice_the_mean_plus_one() -> None:
    rng = random.Random(1)
    router = Router(policy=BoundedLoad(factor=2.0))
    hot = [rng.randrange(32000) for _ in range(1024)]
    others = [[rng.randrange(32000) for _ in range(1024)] for _ in range(20)]
    open_requests = []
    peak_ratio = 0.0
    for step in range(4000):
        prefix = hot if rng.random() < 0.8 else rng.choice(others)
        decision = router.route(prompt(rng, prefix, 32), BACKENDS)
        router.start(decision)
        open_requests.append(decision)
        if len(open_requests) > 40 or (open_requests and rng.random() < 0.45):
            router.finish(open_requests.pop(rng.randrange(len(open_requests))))
        loads = [router.in_flight(b) for b in BACKENDS]
        mean = statistics.mean(loads)
        assert max(loads) <= 2 * mean + 1, (step, loads)
        peak_ratio = max(peak_ratio, max(loads) / max(mean, 1e-9))
    hits = Counter(router.route(prompt(rng, hot, 8), BACKENDS).reason for _ in range(1))
    assert hits  # the router still answers after the run
    assert peak_ratio > 1.5  # the hot prefix really did push against the bound


def test_pure_affinity_makes_the_hot_spot_that_bounded_load_avoids() -> None:
    def peak(policy: LoadPolicy) -> int:
        rng = random.Random(2)
        router = Router(policy=policy)
        hot = [rng.randrange(32000) for _ in range(256)]
        for _ in range(40):
            router.start(router.route(prompt(rng, hot, 16), BACKENDS))
        return max(router.in_flight(b) for b in BACKENDS)

    assert peak(PrefixAffinity()) == 40
    assert peak(BoundedLoad(factor=2.0)) <= 11


def test_removed_backend_is_never_returned_again() -> None:
    rng = random.Random(3)
    router = Router()
    system = [rng.randrange(32000) for _ in range(256)]
    home = router.route(system, BACKENDS).backend
    router.start(router.route(system, BACKENDS))
    router.remove_backend(home)
    remaining = [b for b in BACKENDS if b != home]
    assert router.index.blocks(home) == 0 and router.in_flight(home) == 0
    for _ in range(200):
        assert router.route(prompt(rng, system, 8), remaining).backend != home


def test_capacity_eviction_keeps_the_most_recently_used_prefixes() -> None:
    rng = random.Random(4)
    router = Router(capacity_blocks=64, policy=PrefixAffinity())
    prefixes = [[rng.randrange(32000) for _ in range(16 * 16)] for _ in range(8)]  # 16 blocks each
    for p in prefixes:
        router.route(p, ["only"])  # 8 x 16 blocks through a 64-block cache
    matched = [router.route(p, ["only", "other"]).candidates for p in prefixes]
    held = [next(c.matched_tokens for c in cands if c.backend == "only") for cands in matched]
    assert router.index.blocks("only") <= 64
    assert held[-1] == 256  # the most recent prefix is whole


def test_replicas_place_new_prefixes_identically() -> None:
    rng = random.Random(5)
    one, two = Router(), Router()
    for _ in range(100):
        p = [rng.randrange(32000) for _ in range(rng.randrange(0, 300))]
        assert one.route(p, BACKENDS).backend == two.route(p, list(reversed(BACKENDS))).backend


def test_new_prefixes_spread_over_backends() -> None:
    rng = random.Random(6)
    router = Router()
    counts = Counter(router.route([rng.randrange(32000) for _ in range(128)], BACKENDS).backend for _ in range(800))
    assert set(counts) == set(BACKENDS) and max(counts.values()) < 2 * 800 / 8


def test_namespaces_keep_models_apart() -> None:
    router = Router(block_size=4)
    tokens = list(range(32))
    router.route(tokens, ["a"], namespace="model-x")
    assert router.route(tokens, ["a", "b"], namespace="model-y").matched_tokens == 0
    assert router.route(tokens, ["a", "b"], namespace="model-x").matched_tokens == 32


def test_short_and_empty_prompts_route() -> None:
    router = Router()
    assert router.route([], BACKENDS).reason == "miss"
    assert router.route([1, 2, 3], BACKENDS).reason == "miss"
    assert Router(policy=RoundRobin()).route([], BACKENDS).reason == "policy"
    assert len(router.index) == 0


@pytest.mark.parametrize(
    ("tokens", "backends", "error"),
    [
        ([1, 2], [], NoBackendError),
        ([1, 2], ["a", "b", "a"], ValueError),
        ([1, 2], "a", TypeError),
        ([1, 2], ["a", 3], TypeError),
        ([1, 2], ["a", ["b"]], TypeError),  # unhashable: still the "backend ids must be str" message
        ([1, -2], ["a"], InvalidPromptError),
        ([1, 2**40], ["a"], InvalidPromptError),
        ("text", ["a"], TypeError),
    ],
)
def test_bad_input_raises_and_changes_nothing(tokens: object, backends: object, error: type[Exception]) -> None:
    router = Router(block_size=1)
    router.route([7, 8, 9], ["a"])
    before = (len(router.index), router.index.hashes("a"))
    with pytest.raises(error) as raised:
        router.route(tokens, backends)  # type: ignore[arg-type]
    assert "unhashable" not in str(raised.value)
    assert (len(router.index), router.index.hashes("a")) == before
    router._check()


def test_a_policy_returning_a_foreign_candidate_is_an_error_and_changes_nothing() -> None:
    class Rogue(LoadPolicy):
        def choose(self, candidates: object) -> Candidate:
            return Candidate("elsewhere", 0, 0, 0)

    router = Router(policy=Rogue())
    with pytest.raises(PolicyError, match="not one of the candidates"):
        router.route(list(range(64)), ["a"])
    assert len(router.index) == 0


@pytest.mark.parametrize(
    "error", [KeyError("boom"), ValueError("boom"), TypeError("boom"), InvalidTypeError("boom from kv_fraction()")]
)
def test_an_exception_from_a_policy_is_a_policy_error_with_its_cause_and_changes_nothing(error: Exception) -> None:
    class Buggy(LoadPolicy):
        def choose(self, candidates: object) -> Candidate:
            raise error

    router = Router(policy=Buggy())
    with pytest.raises(PolicyError, match=f"raised {type(error).__name__}: .*boom") as raised:
        router.route(list(range(64)), ["a", "b"])
    assert raised.value.__cause__ is error
    stats = router.stats()  # takes the router's lock: released when choose() raised
    assert (len(router.index), stats.decisions, stats.in_flight) == (0, 0, 0)


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no str")


@pytest.mark.parametrize(
    ("error", "shown"),
    [
        (ValueError("x" * 200), "ValueError: " + "x" * 200),  # 200 characters: kept whole
        (ValueError("x" * 201), "ValueError: " + "x" * 197 + "..."),  # 201: cut to 200
        (Unprintable(), "Unprintable: (its str() raised)"),
    ],
    ids=["200", "201", "unprintable"],
)
def test_a_policy_errors_message_is_shown_short_and_never_fails_on_it(error: Exception, shown: str) -> None:
    class Buggy(LoadPolicy):
        def choose(self, candidates: object) -> Candidate:
            raise error

    with pytest.raises(PolicyError, match=re.escape(f"raised {shown} (in its choose()")) as raised:
        Router(policy=Buggy()).route(list(range(64)), ["a"])
    assert raised.value.__cause__ is error


def test_a_library_error_from_a_policy_passes_through() -> None:
    class Refuses(LoadPolicy):
        def choose(self, candidates: object) -> Candidate:
            raise NoBackendError("no acceptable backend")

    with pytest.raises(NoBackendError, match="no acceptable backend"):
        Router(policy=Refuses()).route(list(range(64)), ["a"])


def test_footprint_anchors_are_every_block_up_to_8_then_a_quarter_further_each() -> None:
    """Where a backend's distinct-block count cuts matched prefixes, which bounds its over-count to a quarter."""
    assert ANCHORS[:10] == (0, 1, 2, 3, 4, 5, 6, 7, 8, 10)
    assert (sum(d < 512 for d in ANCHORS), sum(d < 12_000 for d in ANCHORS)) == (28, 42)  # _accounting.py's figures
    assert ANCHORS[-1] >= 1 << 26


def test_active_blocks_count_one_request_exactly_and_a_shared_matched_prefix_once() -> None:
    router = Router(block_size=4)
    shared = list(range(12))  # 3 blocks
    prompts = [shared + list(range(100, 112)), shared + list(range(200, 212))]  # 6 blocks each, parting at 3
    for prompt in prompts:
        with router.track(router.route(prompt, ["a"])):
            pass
    first, second = (router.route(prompt + [9] * 4, ["a"]) for prompt in prompts)  # 6 of 7 blocks matched
    assert first.matched_tokens == second.matched_tokens == 24

    def active() -> int:
        return router.decide([1], ["a"]).candidates[0].active_blocks

    router.start(first)
    assert active() == 7
    router.start(second)
    assert active() == 7 + 7 - 3  # anchors at every one of the first 8 blocks: the 3 shared ones count once
    router.finish(first)
    assert active() == 7
    router.finish(second)
    assert active() == 0
    router._check()


def test_track_counts_until_exit_also_on_exception() -> None:
    router = Router()
    decision = router.route(list(range(32)), ["a"])
    with pytest.raises(RuntimeError), router.track(decision):
        assert router.in_flight("a") == 1
        raise RuntimeError("upstream failed")
    assert router.in_flight("a") == 0
    router.finish(decision)  # a second finish is ignored and counted, never raised
    assert router.stats().ignored == 1


def test_async_gateway_usage() -> None:
    router = Router()

    async def handle(i: int) -> str:
        decision = router.route(list(range(64)) + [i], BACKENDS)
        with router.track(decision):
            await asyncio.sleep(0)
        return decision.backend

    async def main() -> list[str]:
        return await asyncio.gather(*(handle(i) for i in range(50)))

    assert len(set(asyncio.run(main()))) >= 1
    assert all(router.in_flight(b) == 0 for b in BACKENDS)


def test_the_write_path_names_what_is_not_iterable() -> None:
    router = Router()
    with pytest.raises(TypeError, match=r"evict\(\) hashes must be an iterable of block hashes, not NoneType"):
        router.evict("a", None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"write\(\) updates must be an iterable of index updates, not int"):
        router.write("a", 5)  # type: ignore[arg-type]
    router.store("a", [1, 2])
    router.evict("a", iter([2]))  # any iterable of hashes will do
    assert router.index.match([1, 2], ["a"])["a"] == 1


def test_an_empty_backend_id_is_refused_where_it_is_given() -> None:
    """'' is no backend a caller means (an unset variable, a split that left an empty field); it was routed to."""
    router = Router()
    for call in (
        lambda: router.route([1] * 40, ["a", ""]),
        lambda: router.decide([1] * 40, [""]),
        lambda: router.store("", [1] * 16),
        lambda: router.set_capacity("", 10),
        lambda: router.in_flight(""),
    ):
        with pytest.raises(ConfigurationError, match="a backend id is an empty str"):
            call()
    assert router.stats().decisions == 0 and len(router.index) == 0
