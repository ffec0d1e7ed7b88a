from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixroute import (
    BoundedLoad,
    Candidate,
    ConfigurationError,
    CostAware,
    LeastLoaded,
    LinearTTFT,
    LoadPolicy,
    PowerOfTwo,
    PrefixAffinity,
    Random,
    RoundRobin,
    policy_from_name,
    policy_names,
)
from prefixroute.policies import PredictedTTFT

# One line per policy: a new built-in is covered by the whole contract suite by adding it here.
POLICIES: dict[str, Callable[[], LoadPolicy]] = {
    "round-robin": RoundRobin,
    "random": lambda: Random(seed=1),
    "least-loaded": LeastLoaded,
    "power-of-two": lambda: PowerOfTwo(seed=1),
    "prefix-affinity": PrefixAffinity,
    "bounded-load": BoundedLoad,
    "cost-aware": CostAware,
    "predicted-ttft": PredictedTTFT,
}

candidate_lists = st.lists(
    st.builds(
        Candidate,
        backend=st.text(min_size=1, max_size=5),
        matched_tokens=st.integers(0, 4096),
        prompt_tokens=st.just(4096),
        in_flight=st.integers(0, 50),
        queue_len=st.none() | st.integers(0, 20),
        kv_usage=st.none() | st.floats(0, 1),
    ),
    min_size=1,
    max_size=12,
    unique_by=lambda c: c.backend,
)


def test_registry_lists_every_builtin() -> None:
    assert policy_names() == sorted(POLICIES)


@pytest.mark.parametrize("name", sorted(POLICIES))
@given(candidates=candidate_lists)
def test_contract_returns_one_of_the_candidates_unchanged(name: str, candidates: list[Candidate]) -> None:
    policy = policy_from_name(name)
    snapshot = list(candidates)
    for _ in range(3):
        chosen = policy.choose(candidates)
        assert any(chosen is c for c in candidates)
    assert candidates == snapshot


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_contract_single_candidate(name: str) -> None:
    only = Candidate("only", 0, 100, 7)
    assert POLICIES[name]().choose([only]) is only


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_contract_same_input_same_choice_for_fresh_instances(name: str) -> None:
    rng = random.Random(5)
    candidates = [Candidate(f"b{i}", rng.randrange(0, 512, 16), 512, rng.randrange(5)) for i in range(8)]
    assert POLICIES[name]().choose(candidates) == POLICIES[name]().choose(candidates)


def test_round_robin_cycles_in_backend_order_whatever_the_candidate_order() -> None:
    policy = RoundRobin()
    picks = [policy.choose([Candidate(b, 0, 1, 0) for b in random.sample("abc", 3)]).backend for _ in range(6)]
    assert picks == list("abcabc")


def test_least_loaded_counts_the_engine_queue() -> None:
    a, b = Candidate("a", 0, 1, 1, queue_len=5), Candidate("b", 0, 1, 3)
    assert LeastLoaded().choose([a, b]) is b


def test_power_of_two_picks_the_less_loaded_of_its_sample() -> None:
    busy, idle = Candidate("busy", 0, 1, 9), Candidate("idle", 0, 1, 0)
    assert {PowerOfTwo(seed=s).choose([busy, idle]).backend for s in range(20)} == {"idle"}


def test_prefix_affinity_ignores_load_and_breaks_ties_by_load() -> None:
    hot = Candidate("hot", 512, 512, 100)
    assert PrefixAffinity().choose([Candidate("cold", 0, 512, 0), hot]) is hot
    a, b = Candidate("a", 256, 512, 3), Candidate("b", 256, 512, 1)
    assert PrefixAffinity().choose([a, b]) is b


def test_bounded_load_diverts_above_the_bound_to_the_next_best_match() -> None:
    # 8 candidates, 10 in flight: bound = ceil(2 * 11 / 8) = 3, so "hot" (3 in flight) cannot take a fourth.
    candidates = [Candidate("hot", 512, 512, 3), Candidate("warm", 256, 512, 2)]
    candidates += [Candidate(f"c{i}", 0, 512, 5 if i == 0 else 0) for i in range(6)]
    assert BoundedLoad(2.0).choose(candidates).backend == "warm"
    assert BoundedLoad(4.0).choose(candidates).backend == "hot"


def test_bounded_load_keeps_affinity_when_requests_do_not_overlap() -> None:
    candidates = [Candidate("cold", 0, 512, 0), Candidate("hot", 512, 512, 0)]
    assert BoundedLoad().choose(candidates).backend == "hot"


def test_bounded_load_places_a_miss_by_placement_order_among_backends_at_most_averagely_loaded() -> None:
    idle = [Candidate("first", 0, 512, 0), Candidate("second", 0, 512, 0), Candidate("third", 0, 512, 0)]
    assert BoundedLoad().choose(idle).backend == "first"  # nothing in flight: the rendezvous choice
    # 5 in flight + this one over 3 backends: a mean of 2, so "first" (2 already) would go above it.
    busy_first = [Candidate("first", 0, 512, 2), Candidate("second", 0, 512, 0), Candidate("third", 0, 512, 3)]
    assert BoundedLoad().choose(busy_first).backend == "second"


@given(candidates=candidate_lists, factor=st.floats(1.0, 4.0))
def test_bounded_load_respects_the_bound_whenever_someone_can(candidates: list[Candidate], factor: float) -> None:
    import math

    bound = math.ceil(factor * (sum(c.in_flight for c in candidates) + 1) / len(candidates))
    chosen = BoundedLoad(factor).choose(candidates)
    qualifying = [c for c in candidates if c.in_flight + 1 <= bound]
    if qualifying:
        assert chosen.in_flight + 1 <= bound
        assert chosen.matched_tokens == max(c.matched_tokens for c in qualifying)
    else:
        assert chosen.in_flight == min(c.in_flight for c in candidates)


def test_cost_aware_trades_cache_against_queue() -> None:
    cost = LinearTTFT(per_request_s=0.1, per_token_s=0.001, per_token_pair_s=0.0)
    cached_but_busy = Candidate("cached", 1000, 1000, 3)  # 0.3 s of queue, no prefill
    idle_cold = Candidate("cold", 0, 1000, 0)  # 1.0 s of prefill
    assert CostAware(cost=cost).choose([idle_cold, cached_but_busy]) is cached_but_busy
    very_busy = Candidate("cached", 1000, 1000, 20)  # 2.0 s of queue
    assert CostAware(cost=cost).choose([idle_cold, very_busy]) is idle_cold


def test_policy_from_name_options_and_errors() -> None:
    policy = policy_from_name("bounded-load", factor=1.5)
    assert isinstance(policy, BoundedLoad) and policy.factor == 1.5
    with pytest.raises(ConfigurationError, match="round-robin"):
        policy_from_name("nearest")
    with pytest.raises(ConfigurationError, match="does not accept"):
        policy_from_name("round-robin", factor=2)
    with pytest.raises(ConfigurationError, match="factor"):
        BoundedLoad(0.5)
    with pytest.raises(ConfigurationError, match="cannot import"):
        policy_from_name("no_such_module:Policy")
    with pytest.raises(ConfigurationError, match="not a LoadPolicy"):
        policy_from_name("random:Random")


def test_policy_from_name_imports_a_user_subclass() -> None:
    policy = policy_from_name("prefixroute.policies:LeastLoaded")
    assert isinstance(policy, LeastLoaded)
