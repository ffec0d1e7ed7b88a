from __future__ import annotations

import functools
import inspect
import math
import os
import random
import re
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixroute import (
    BoundedLoad,
    Candidate,
    ConfigurationError,
    CostAware,
    InvalidTypeError,
    LeastLoaded,
    LinearTTFT,
    LoadPolicy,
    NoBackendError,
    PowerOfTwo,
    PrefixAffinity,
    Random,
    RoundRobin,
    Router,
    policy_from_name,
    policy_names,
)
from prefixroute.policies import PredictedTTFT, kv_fraction
from prefixroute.router import Decision
from prefixroute.sim.baselines import BASELINES

from ..conftest import FakeClock

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
# The contract holds for every policy the project ships: the built-ins and the published baselines. Those that draw
# (their source breaks a tie at random) are seeded, as random and power-of-two above: same seed, same choice.
CONTRACT: dict[str, Callable[[], LoadPolicy]] = {
    **POLICIES,
    **{
        name: functools.partial(cls, seed=1) if "seed" in inspect.signature(cls).parameters else cls  # type: ignore[call-arg]
        for name, cls in BASELINES.items()
    },
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
        pending_prefill_tokens=st.integers(0, 100_000),
        held_blocks=st.integers(0, 5000),
        capacity_blocks=st.none() | st.integers(1, 4000),
        prefill_tokens_per_s=st.none() | st.floats(1.0, 1e5),
        active_blocks=st.integers(0, 5000),
        in_prefill=st.integers(0, 50),
        block_size=st.integers(1, 256),  # the router's block size: never below 1
        pending_prefill_context=st.integers(0, 10**10),
        attention_tokens=st.none() | st.floats(1.0, 1e6),
        memory_wait_s=st.just(0.0) | st.floats(0.0, 1e4),
    ),
    min_size=1,
    max_size=12,
    unique_by=lambda c: c.backend,
)


def test_registry_lists_every_builtin() -> None:
    assert policy_names() == sorted(POLICIES)


@pytest.mark.parametrize("name", sorted(CONTRACT))
@given(candidates=candidate_lists)
def test_contract_returns_one_of_the_candidates_unchanged(name: str, candidates: list[Candidate]) -> None:
    policy = CONTRACT[name]()
    snapshot = list(candidates)
    for _ in range(3):
        chosen = policy.choose(candidates)
        assert any(chosen is c for c in candidates)
    assert candidates == snapshot


@pytest.mark.parametrize("name", sorted(CONTRACT))
def test_contract_no_candidates_is_a_clear_error(name: str) -> None:
    with pytest.raises(NoBackendError, match="at least one Candidate"):
        CONTRACT[name]().choose([])


@pytest.mark.parametrize("name", sorted(CONTRACT))
def test_contract_single_candidate(name: str) -> None:
    only = Candidate("only", 0, 100, 7)
    assert CONTRACT[name]().choose([only]) is only


# A value of each kind a hand-built Candidate may wrongly carry, and the fields a well-formed one takes them in.
MALFORMED = [None, "7", b"7", 1.5, math.nan, math.inf, [], object(), True, -1, -(2**70)]


@pytest.mark.parametrize("name", sorted(CONTRACT))
@settings(max_examples=60, deadline=None)
@given(
    faults=st.lists(
        st.tuples(st.integers(0, 3), st.sampled_from(Candidate._fields), st.sampled_from(MALFORMED)), max_size=3
    ),
    seed=st.integers(0, 2**32),
)
def test_contract_a_malformed_candidate_is_a_clear_error_or_a_choice_and_harms_no_later_choice(
    name: str, faults: list[tuple[int, str, object]], seed: int
) -> None:
    """A hand-built Candidate with a field of the wrong type or an impossible value: the policy either chooses (it
    does not read that field) or raises the library's error naming the candidate and the field, never a bare
    TypeError from its arithmetic; and a stateful policy (Ray Serve's tree sizes) keeps choosing well after it."""
    rng = random.Random(seed)
    policy = CONTRACT[name]()
    well_formed = [Candidate(f"b{i}", rng.randrange(0, 65), 64, rng.randrange(4), block_size=16) for i in range(4)]
    candidates = list(well_formed)
    for position, field, value in faults:
        candidates[position] = candidates[position]._replace(**{field: value})  # type: ignore[arg-type]
    try:
        chosen = policy.choose(candidates)
    except (InvalidTypeError, ConfigurationError) as error:
        assert re.match(r"Candidate .*: \w+ must be ", str(error)), error
        assert any(f": {field} must be " in str(error) for _, field, _ in faults)
    else:
        assert any(chosen is c for c in candidates)
    for _ in range(3):
        assert policy.choose(well_formed) in well_formed


def test_a_malformed_candidate_names_the_candidate_the_field_and_what_it_takes() -> None:
    good = Candidate("good", 0, 64, 0)
    with pytest.raises(InvalidTypeError, match=r"^Candidate 'bad': in_flight must be an int, not None$"):
        LeastLoaded().choose([good, Candidate("bad", 0, 64, None)])  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match=r"^Candidate 'bad': matched_tokens must be an int, not 'x'$"):
        PredictedTTFT().choose([good, Candidate("bad", "x", 64, 0)])  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match=r"kv_usage must be a real number or None, not '0.5'$"):
        BASELINES["llm-d"]().choose([Candidate("bad", 0, 64, 0, kv_usage="0.5"), good])  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match=r"^Candidate 'bad': in_flight must be an int, not nan$"):
        BASELINES["aibrix"]().choose([Candidate("bad", 16, 64, math.nan), good])  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"^Candidate 'bad': block_size must be at least 1, not 0$"):
        BASELINES["ray-serve"]().choose([Candidate("bad", 0, 64, 0, block_size=0)])
    with pytest.raises(InvalidTypeError, match=r"^Candidate None: backend must be a str, not None$"):
        RoundRobin().choose([good, Candidate(None, 0, 64, 0)])  # type: ignore[arg-type]
    # Ray Serve's tree would keep a NaN size for this backend, and choose from nothing ever after.
    ray = BASELINES["ray-serve"]()
    with pytest.raises(InvalidTypeError, match=r"^Candidate 'bad': matched_tokens must be an int, not nan$"):
        ray.choose([Candidate("bad", math.nan, 64, 0)])  # type: ignore[arg-type]
    assert ray.choose([good, Candidate("bad", 0, 64, 0)]) is good


@settings(max_examples=300, deadline=None)
@given(
    field=st.sampled_from(Candidate._fields),
    value=st.sampled_from(MALFORMED),
    model=st.sampled_from(["kv_fraction", "LinearTTFT", "cost", "cap_terms"]),
)
def test_the_public_cost_helpers_name_a_malformed_field_or_answer_a_float(
    field: str, value: object, model: str
) -> None:
    candidate = Candidate("bad", 16, 64, 1, held_blocks=4, capacity_blocks=100, active_blocks=4)._replace(
        **{field: value}  # type: ignore[arg-type]
    )
    helpers: dict[str, Callable[[Candidate], object]] = {
        "kv_fraction": kv_fraction,
        "LinearTTFT": LinearTTFT(),
        "cost": lambda c: PredictedTTFT().cost(c, speed=2.0, common_tokens=8, typical_prompt=32.0),
        "cap_terms": lambda c: PredictedTTFT.cap_terms([c]),
    }
    try:
        answer = helpers[model](candidate)
    except (InvalidTypeError, ConfigurationError) as error:
        assert str(error).startswith(f"Candidate 'bad': {field} must be "), error
    else:
        assert type(answer) in (float, int, tuple)
        if model == "kv_fraction":
            assert type(answer) is float


def test_cost_refuses_a_speed_it_cannot_divide_by_and_names_bad_terms() -> None:
    candidate = Candidate("a", 16, 64, 1)
    for speed in (0, -1.0, math.nan, math.inf, "fast", None, True):
        with pytest.raises(ConfigurationError, match="^cost\\(\\) speed must be a finite number above 0, not "):
            PredictedTTFT().cost(candidate, speed=speed)  # type: ignore[arg-type]
    assert PredictedTTFT().cost(candidate, speed=2) == PredictedTTFT().cost(candidate, speed=2.0)
    with pytest.raises(ConfigurationError, match="common_tokens must be an int >= 0, not 'x'"):
        PredictedTTFT().cost(candidate, common_tokens="x")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="typical_prompt must be a number above 0 or math.inf, not None"):
        PredictedTTFT().cost(candidate, common_tokens=8, typical_prompt=None)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(CONTRACT))
def test_contract_same_input_same_choice_for_fresh_instances(name: str) -> None:
    rng = random.Random(5)
    candidates = [
        Candidate(f"b{i}", rng.randrange(0, 512, 16), 512, rng.randrange(5), pending_prefill_tokens=rng.randrange(900))
        for i in range(8)
    ]
    assert CONTRACT[name]().choose(candidates) == CONTRACT[name]().choose(candidates)


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
    assert BoundedLoad(factor=2.0).choose(candidates).backend == "warm"
    assert BoundedLoad(factor=4.0).choose(candidates).backend == "hot"


def test_bounded_load_keeps_affinity_when_requests_do_not_overlap() -> None:
    candidates = [Candidate("cold", 0, 512, 0), Candidate("hot", 512, 512, 0)]
    assert BoundedLoad().choose(candidates).backend == "hot"


def test_bounded_load_places_a_miss_by_placement_order_among_backends_at_most_averagely_loaded() -> None:
    idle = [Candidate("first", 0, 512, 0), Candidate("second", 0, 512, 0), Candidate("third", 0, 512, 0)]
    assert BoundedLoad().choose(idle).backend == "first"  # nothing in flight: the rendezvous choice
    # 5 in flight + this one over 3 backends: a mean of 2, so "first" (2 already) would go above it.
    busy_first = [Candidate("first", 0, 512, 2), Candidate("second", 0, 512, 0), Candidate("third", 0, 512, 3)]
    assert BoundedLoad().choose(busy_first).backend == "second"
    # The first within the mean, not the least loaded: 6 in flight + this one over 3 is a mean of 7/3, and "first"
    # (1, so 2 after) stays within it before "second" (0) is looked at.
    light_first = [Candidate("first", 0, 512, 1), Candidate("second", 0, 512, 0), Candidate("third", 0, 512, 5)]
    assert BoundedLoad().choose(light_first).backend == "first"


def test_bounded_load_bound_is_exact_and_its_factor_two_by_default() -> None:
    # factor 1.5, 3 in flight + this one over 2 backends: ceil(1.5 x 4 / 2) = 3, so "hot" (3, 4 after) is over it
    # and the request goes to "cold"; at factor 2 the bound is 4, which "hot" reaches and does not exceed.
    hot, cold = Candidate("hot", 512, 512, 3), Candidate("cold", 0, 512, 0)
    assert BoundedLoad(factor=1.5).choose([hot, cold]) is cold
    assert BoundedLoad(factor=2.0).choose([hot, cold]) is hot
    # The default factor is 2 (docs/policies.md): 2 in flight + 1 over 3 backends gives ceil(2 x 3 / 3) = 2, which
    # "hot" (2, 3 after) would exceed; a factor of 3 (bound 3) would keep it.
    three = [Candidate("hot", 512, 512, 2), Candidate("a", 0, 512, 0), Candidate("b", 0, 512, 0)]
    assert BoundedLoad().choose(three).backend == "a"
    assert BoundedLoad(factor=3.0).choose(three).backend == "hot"


@pytest.mark.parametrize("factor", [2.0, 1.25])
def test_bounded_load_lets_a_shared_first_block_starve_all_but_one_factorth_of_the_fleet(factor: float) -> None:
    # docs/policies.md: every prompt begins with one block (a system prompt) that some backends hold and the others
    # dropped. The bound is relative to the mean, idle backends included: hot backends at equal loads L are within
    # factor x the mean as long as they are at least 1/factor of the fleet, so the idle ones (no match) never get a
    # request, however long the hot queues grow. At factor 2 that is half of 8 backends; at 1.25, 7 of them.
    hot = math.ceil(8 / factor)
    for load in (10, 1_000):
        fleet = [Candidate(f"hot{i}", 512, 12_000, load) for i in range(hot)]
        fleet += [Candidate(f"idle{i}", 0, 12_000, 0) for i in range(8 - hot)]
        assert BoundedLoad(factor=factor).choose(fleet).backend.startswith("hot")
        fewer = fleet[1:] + [Candidate("idle", 0, 12_000, 0)]  # one hot backend fewer: now over the bound
        assert BoundedLoad(factor=factor).choose(fewer).backend.startswith("idle")


def test_bounded_load_gives_equally_matched_candidates_to_the_least_loaded() -> None:
    busier, calmer = Candidate("a", 256, 512, 2), Candidate("b", 256, 512, 1)  # bound ceil(2 x 4 / 2) = 4: both
    assert BoundedLoad().choose([busier, calmer]) is calmer


@given(candidates=candidate_lists, factor=st.floats(1.0, 4.0))
def test_bounded_load_respects_the_bound_which_someone_always_can(candidates: list[Candidate], factor: float) -> None:
    import math

    bound = math.ceil(factor * (sum(c.load for c in candidates) + 1) / len(candidates))
    chosen = BoundedLoad(factor=factor).choose(candidates)
    qualifying = [c for c in candidates if c.load + 1 <= bound]
    assert qualifying  # the least loaded is at most the mean: someone always can
    assert chosen.load + 1 <= bound
    assert chosen.matched_tokens == max(c.matched_tokens for c in qualifying)


def test_bounded_load_qualifies_the_least_loaded_exactly_even_past_float_precision() -> None:
    # Loads past 2**53: the float bound (2 * 2**60 + 1) / 2 rounds to 2**60, which no load is below. The least
    # loaded still qualifies (within the mean, compared in ints): a miss goes to the first, a hit keeps its prefix.
    huge = 2**60
    misses = [Candidate("a", 0, 32, huge), Candidate("b", 0, 32, huge)]
    assert BoundedLoad(factor=1.0).choose(misses).backend == "a"
    assert BoundedLoad(factor=2.0).choose(misses).backend == "a"
    hit = [Candidate("cold", 0, 32, huge), Candidate("hot", 16, 32, huge)]
    assert BoundedLoad(factor=1.0).choose(hit).backend == "hot"
    uneven = [Candidate("busy", 16, 32, huge + 2), Candidate("calm", 0, 32, huge)]
    assert BoundedLoad(factor=1.0).choose(uneven).backend == "calm"


def test_bounded_load_bounds_the_load_it_documents_engine_queue_included() -> None:
    # Two in flight each; "hot" also has 6 waiting in its engine: load 8 of 10 + 1, bound ceil(2 * 11 / 2) = 11,
    # so it still qualifies; with 12 waiting (load 14 of 16 + 1, bound 17) it qualifies too, but a factor of 1
    # (bound ceil(17 / 2) = 9) sends the request to the other backend, which the in-flight count alone would not.
    hot = Candidate("hot", 512, 512, 2, queue_len=12)
    cold = Candidate("cold", 0, 512, 2)
    assert BoundedLoad(factor=2.0).choose([hot, cold]) is hot
    assert BoundedLoad(factor=1.0).choose([hot, cold]) is cold
    assert BoundedLoad(factor=1.0).choose([hot._replace(queue_len=None), cold]).backend == "hot"


def test_cost_aware_trades_cache_against_queue() -> None:
    cost = LinearTTFT(per_request_s=0.1, per_token_s=0.001, per_token_pair_s=0.0)
    cached_but_busy = Candidate("cached", 1000, 1000, 3)  # 0.3 s of queue, no prefill
    idle_cold = Candidate("cold", 0, 1000, 0)  # 1.0 s of prefill
    assert CostAware(cost=cost).choose([idle_cold, cached_but_busy]) is cached_but_busy
    very_busy = Candidate("cached", 1000, 1000, 20)  # 2.0 s of queue
    assert CostAware(cost=cost).choose([idle_cold, very_busy]) is idle_cold
    # The default cost is LinearTTFT() (docs/policies.md): 1000 uncached tokens at 1.2e-4 s, 0.12 s, against one
    # request queued at 0.05 s.
    warm = Candidate("warm", 1000, 1000, 1)
    assert CostAware().choose([idle_cold, warm]) is warm


def test_linear_ttft_is_queueing_plus_prefill_plus_attention_over_the_cached_context() -> None:
    cost = LinearTTFT(per_request_s=0.5, per_token_s=0.01, per_token_pair_s=0.001)
    # load x per_request_s + uncached x per_token_s + uncached x matched x per_token_pair_s: 1.5 + 0.7 + 2.1
    assert cost(Candidate("a", 30, 100, 2, queue_len=1)) == pytest.approx(4.3)


def test_policy_from_name_options_and_errors() -> None:
    policy = policy_from_name("bounded-load", factor=1.5)
    assert isinstance(policy, BoundedLoad) and policy.factor == 1.5
    with pytest.raises(ConfigurationError, match="round-robin"):
        policy_from_name("nearest")
    with pytest.raises(ConfigurationError, match="does not accept"):
        policy_from_name("round-robin", factor=2)
    with pytest.raises(ConfigurationError, match="factor"):
        BoundedLoad(factor=0.5)
    with pytest.raises(ConfigurationError, match="cannot import"):
        policy_from_name("no_such_module:Policy")
    with pytest.raises(ConfigurationError, match="not a LoadPolicy"):
        policy_from_name("random:Random")


def test_policy_from_name_imports_a_user_subclass() -> None:
    policy = policy_from_name("prefixroute.policies:LeastLoaded")
    assert isinstance(policy, LeastLoaded)


def test_policy_from_name_appends_the_current_directory_only_for_a_package_found_nowhere_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # _import_module's docstring: the current directory is appended to sys.path (which pool workers spawned later
    # inherit) when the named module's top-level package is found nowhere else, and the import retried.
    here = tmp_path / "here"
    package = f"pr_here_{uuid.uuid4().hex}"  # not one a run before in this process imported (mutmut runs twice)
    (here / package / "sub").mkdir(parents=True)
    (here / package / "__init__.py").write_text("")
    (here / package / "sub" / "__init__.py").write_text("")
    (here / package / "sub" / "mine.py").write_text("from prefixroute import LeastLoaded as Mine\n")
    monkeypatch.chdir(here)
    # Whatever an import appends goes with the test; "" (python -m pytest's first entry) would find it from here.
    monkeypatch.setattr(sys, "path", [entry for entry in sys.path if entry not in ("", os.curdir)])
    assert isinstance(policy_from_name(f"{package}.sub.mine:Mine"), LeastLoaded)
    assert sys.path.count(str(here)) == 1
    # Already there, it is not appended again for a module found nowhere.
    with pytest.raises(ConfigurationError, match="pr_nowhere"):
        policy_from_name("pr_nowhere:Policy")
    assert sys.path.count(str(here)) == 1
    # A module found elsewhere that imports a missing package is the user's to fix: the directory plays no part.
    lib, elsewhere = tmp_path / "lib", tmp_path / "elsewhere"
    lib.mkdir()
    elsewhere.mkdir()
    (lib / f"{package}_needs.py").write_text("import pr_no_such_dependency\n")
    monkeypatch.syspath_prepend(str(lib))
    monkeypatch.chdir(elsewhere)
    with pytest.raises(ConfigurationError, match="pr_no_such_dependency"):
        policy_from_name(f"{package}_needs:Policy")
    assert str(elsewhere) not in sys.path


# -- PredictedTTFT, the default: its choices in situations built by hand --------------------------------------------


def test_predicted_ttft_prefers_a_decode_heavy_backend_to_a_prefill_heavy_one() -> None:
    # "prefill" has 2 requests in flight, both still prefilling 8K uncached tokens; "decode" has 10 in flight that
    # are past their first token (no pending prefill), holding some KV. A request count says "prefill" is idle-er;
    # the work ahead of a new 1K-token prompt says the opposite: 16384 + 1024 x 3 against 1024 x 11.
    prefill_heavy = Candidate("prefill", 0, 1024, 2, pending_prefill_tokens=16_384, held_blocks=1024,
                              capacity_blocks=4000)  # fmt: skip
    decode_heavy = Candidate("decode", 0, 1024, 10, pending_prefill_tokens=0, held_blocks=640, capacity_blocks=4000)
    assert PredictedTTFT().choose([prefill_heavy, decode_heavy]) is decode_heavy
    assert LeastLoaded().choose([prefill_heavy, decode_heavy]) is prefill_heavy


def test_predicted_ttft_leaves_a_nearly_full_kv_cache_even_when_it_holds_the_prefix() -> None:
    cached = Candidate("cached", 2048, 2240, 4, kv_usage=0.5)
    cold = Candidate("cold", 0, 2240, 0, kv_usage=0.0)
    assert PredictedTTFT().choose([cached, cold]) is cached  # 192 tokens, stretched 2x, against 2240
    nearly_full = cached._replace(kv_usage=0.99)
    assert PredictedTTFT().choose([nearly_full, cold]) is cold  # stretched 20x: 3840 > 2240
    # Without engine metrics the router's own figures say the same: 990 of 1000 distinct blocks in flight.
    by_router = cached._replace(kv_usage=None, active_blocks=990, capacity_blocks=1000)
    assert PredictedTTFT().choose([by_router, cold._replace(kv_usage=None, capacity_blocks=1000)]).backend == "cold"
    # Many requests holding one shared prefix are not a full cache: 4 x 300 blocks held, 400 of them distinct.
    shared = cached._replace(kv_usage=None, held_blocks=1200, active_blocks=400, capacity_blocks=1000)
    assert PredictedTTFT().choose([shared, cold._replace(kv_usage=None, capacity_blocks=1000)]) is shared


def test_predicted_ttft_sends_a_long_prompt_where_it_fits_in_the_kv_memory_left() -> None:
    # 8K uncached tokens are 512 blocks of 16. "busy" has fewer requests but 600 of its 1,000 blocks active: the
    # prompt would wait there for memory (or be preempted). "roomy" has more requests and room for it.
    busy = Candidate("busy", 0, 8192, 1, active_blocks=600, capacity_blocks=1000)
    roomy = Candidate("roomy", 0, 8192, 3, active_blocks=400, capacity_blocks=1000)
    assert PredictedTTFT().choose([busy, roomy]) is roomy  # 8192 x 2 / 0.05 against 8192 x 4 / 0.6
    assert PredictedTTFT().cost(busy) == PredictedTTFT().cost(busy._replace(active_blocks=1000))
    # The same backends for a short prompt: it fits on both, and the fewer requests win.
    short = [c._replace(prompt_tokens=256) for c in (busy, roomy)]
    assert PredictedTTFT().choose(short).backend == "busy"  # 256 x 2 / 0.4 against 256 x 4 / 0.6
    # A capacity that is not known, or a nonsensical block size, never counts as full (that choose() agrees with
    # cost() everywhere is test_predicted_ttft_chooses_a_lowest_cost_candidate's).
    for unknown in (busy._replace(capacity_blocks=None), busy._replace(block_size=0)):
        assert PredictedTTFT().cost(unknown) < PredictedTTFT().cost(busy)
        assert PredictedTTFT().choose([unknown, roomy]) is unknown  # 8192 x 2 / 0.4 against 8192 x 4 / 0.6


def test_predicted_ttft_counts_a_backend_full_only_where_the_prompt_does_not_fit() -> None:
    # A prompt that fills the memory left exactly fits: 512 blocks beside 488 of 1,000 active, 8192 x 2 / 0.512
    # (32,000) against 8192 x 4 (32,768) on an empty backend; one block more and it is full, 8192 x 2 / 0.05.
    exact = Candidate("exact", 0, 8192, 1, active_blocks=488, capacity_blocks=1000)
    empty = Candidate("empty", 0, 8192, 3, capacity_blocks=1000)
    policy = PredictedTTFT()
    assert policy.cost(exact) == pytest.approx(8192 * 2 / 0.512)
    assert policy.choose([exact, empty]) is exact
    over = exact._replace(active_blocks=489)
    assert policy.cost(over) == pytest.approx(8192 * 2 / 0.05)
    assert policy.choose([over, empty]) is empty
    # Blocks of one token: 100 of them do not fit beside 901 of 1,000, so 100 / 0.05 (2,000) against 100 x 15.
    tight = Candidate("tight", 0, 100, 0, active_blocks=901, capacity_blocks=1000, block_size=1)
    crowded = Candidate("crowded", 0, 100, 14, capacity_blocks=1000, block_size=1)
    assert policy.cost(tight) == pytest.approx(100 / 0.05)
    assert policy.choose([tight, crowded]) is crowded


def test_predicted_ttft_keeps_affinity_while_queued_work_is_less_than_the_prefill_it_saves() -> None:
    cold = Candidate("cold", 0, 4224, 0)
    # The cached backend costs its queued work plus 128 uncached tokens, once for this request and once for the
    # request in flight there that they hold up: 4224 - 256 = 3968 queued tokens is where affinity stops paying.
    for pending, expected in ((0, "cached"), (3960, "cached"), (3970, "cold")):
        cached = Candidate("cached", 4096, 4224, 1, pending_prefill_tokens=pending)
        assert PredictedTTFT().choose([cold, cached]).backend == expected, pending


def test_predicted_ttft_breaks_ties_by_placement_order() -> None:
    equal = [Candidate(name, 256, 512, 3, pending_prefill_tokens=100) for name in ("second", "first", "third")]
    assert PredictedTTFT().choose(equal).backend == "second"
    assert PredictedTTFT().choose(equal[::-1]).backend == "third"


def test_predicted_ttft_shared_system_prompt_spreads_concurrent_traffic_and_keeps_idle_traffic() -> None:
    system = list(range(1024))  # one long system prompt in front of every request: the placement blocks agree
    backends = ["gpu0", "gpu1", "gpu2", "gpu3"]
    router = Router(block_size=16, policy=PredictedTTFT())
    chosen = []
    for user in range(40):  # concurrent: every request stays in flight
        decision = router.route(system + [100_000 + user * 64 + i for i in range(64)], backends)
        router.start(decision)
        chosen.append(decision)
    shares = {b: sum(d.backend == b for d in chosen) for b in backends}
    assert min(shares.values()) >= 8, shares  # one shared first block does not pull the traffic to one backend
    assert sum(d.matched_tokens >= 1024 for d in chosen) >= 40 - len(backends)  # each backend pays it once
    for decision in chosen:
        router.finish(decision)
    idle = Router(block_size=16, policy=PredictedTTFT())
    sequential = []
    for user in range(10):  # one at a time: nothing queued, so the cached prompt always pays
        decision = idle.route(system + [200_000 + user * 64 + i for i in range(64)], backends)
        with idle.track(decision):
            sequential.append(decision.backend)
    assert len(set(sequential)) == 1


def test_predicted_ttft_uses_learned_speeds_only_when_asked() -> None:
    slow = Candidate("slow", 0, 1000, 1, pending_prefill_tokens=1000, prefill_tokens_per_s=1000.0)
    fast = Candidate("fast", 0, 1000, 1, pending_prefill_tokens=3000, prefill_tokens_per_s=8000.0)
    assert PredictedTTFT().choose([slow, fast]) is slow  # 2000 tokens of work against 4000
    assert PredictedTTFT(use_speed=True).choose([slow, fast]) is fast  # 2.0 s against 0.5 s
    unknown = Candidate("unknown", 0, 1000, 1, pending_prefill_tokens=4000)  # the median speed, 8000: 0.75 s
    assert PredictedTTFT(use_speed=True).choose([slow, unknown, fast]) is fast
    assert PredictedTTFT(use_speed=True).cost(unknown, speed=8000.0) == pytest.approx(6000 / 8000)
    # Without an estimate a backend takes the median of the others' (of five, the middle one, 4000/s): 2000 tokens
    # of work there take 0.5 s, less than the 0.75 s of the best estimated ones, where 2000/s (1 s) would not be.
    speeds_and_queued = ((1000.0, 0), (2000.0, 0), (4000.0, 1000), (8000.0, 4000), (16_000.0, 10_000))
    estimated = [Candidate(f"s{int(speed)}", 0, 1000, 1, pending_prefill_tokens=pending, prefill_tokens_per_s=speed)
                 for speed, pending in speeds_and_queued]  # fmt: skip
    light = Candidate("light", 0, 1000, 1)
    assert PredictedTTFT(use_speed=True).choose([*estimated[:3], light, *estimated[3:]]) is light
    # With no estimate at all every backend counts tokens, as without use_speed; ties go to placement order.
    unmeasured = [Candidate("a", 0, 1000, 2), Candidate("b", 0, 1000, 1)]
    assert PredictedTTFT(use_speed=True).choose(unmeasured) is unmeasured[1]
    assert PredictedTTFT(use_speed=True).choose([fast, fast._replace(backend="twin")]) is fast
    assert PredictedTTFT(use_speed=True).choose([slow]) is slow


def test_predicted_ttft_reads_a_longer_engine_queue_as_requests_in_prefill() -> None:
    """Another router replica's requests show only in the engine's waiting queue (metrics)."""
    quiet = Candidate("quiet", 0, 1000, 2, in_prefill=1)
    queued = Candidate("queued", 0, 1000, 2, in_prefill=1, queue_len=4)  # 4 waiting: 1000 x (1 + 4 + 4)
    assert PredictedTTFT().cost(quiet) == 4000 and PredictedTTFT().cost(queued) == 9000
    assert PredictedTTFT().choose([queued, quiet]) is quiet
    shorter = queued._replace(queue_len=0)  # a queue shorter than the router's own count changes nothing
    assert PredictedTTFT().cost(shorter) == PredictedTTFT().cost(quiet)
    assert PredictedTTFT().choose([shorter, quiet]) is shorter  # equal: placement order


def test_predicted_ttft_options_and_kv_fraction() -> None:
    for bad in (1.0, -0.1, True, "0.9"):
        with pytest.raises(ConfigurationError, match="kv_cap"):
            PredictedTTFT(kv_cap=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="use_speed"):
        PredictedTTFT(use_speed=1)  # type: ignore[arg-type]
    assert isinstance(policy_from_name("predicted-ttft", kv_cap=0.9), PredictedTTFT)
    assert PredictedTTFT(kv_cap=0.0).kv_cap == 0.0  # a fraction in [0, 1): 0 leaves the KV memory out
    assert kv_fraction(Candidate("a", 0, 1, 0)) == 0.0
    assert kv_fraction(Candidate("a", 0, 1, 0, active_blocks=50, held_blocks=500, capacity_blocks=200)) == 0.25
    assert kv_fraction(Candidate("a", 0, 1, 0, active_blocks=500, capacity_blocks=200)) == 1.0
    assert kv_fraction(Candidate("a", 0, 1, 0, kv_usage=0.4)) == 0.4  # no capacity known: the engine's figure
    # The router's figure comes first: it counts the requests still waiting for memory, which the engine's leaves out.
    assert kv_fraction(Candidate("a", 0, 1, 0, kv_usage=0.4, active_blocks=180, capacity_blocks=200)) == 0.9


def test_predicted_ttft_choose_breaks_an_exact_tie_with_an_overcommitted_backend_by_placement_order() -> None:
    # x: 9 blocks active in 7, so runnable = 7/9; y cannot fit the prompt. Both cost exactly 1280 / 0.05 by cost();
    # choose() computed 7/9 as 1 / (9/7), a bit off, and took x from second place.
    x = Candidate("x", 0, 160, 9, active_blocks=9, capacity_blocks=7, block_size=16)
    y = Candidate("y", 0, 160, 0, pending_prefill_tokens=1120, active_blocks=0, capacity_blocks=1, block_size=16)
    policy = PredictedTTFT()
    assert policy.cost(x, common_tokens=160) == policy.cost(y, common_tokens=160)
    assert policy.choose([y, x]) is y and policy.choose([x, y]) is x


@given(candidates=candidate_lists)
def test_predicted_ttft_chooses_a_lowest_cost_candidate(candidates: list[Candidate]) -> None:
    policy = PredictedTTFT()
    chosen = policy.choose(candidates)
    common, typical = policy.cap_terms(candidates)
    # every candidate's wait for memory counts at the choice's one speed (wait_speed()), as choose() counts it
    at = policy.wait_speed(candidates)
    costs = [
        policy.cost(c._replace(prefill_tokens_per_s=at), common_tokens=common, typical_prompt=typical)
        for c in candidates
    ]
    assert candidates.index(chosen) == costs.index(min(costs))


def test_predicted_ttft_subclass_cost_is_what_choose_minimises() -> None:
    class MostCostly(PredictedTTFT):
        def cost(self, candidate: Candidate, *, speed: float = 1.0, **cap: Any) -> float:
            return -super().cost(candidate, speed=speed, **cap)

    cached, cold = Candidate("a", 4096, 4224, 0), Candidate("b", 0, 4224, 0)
    assert PredictedTTFT().choose([cached, cold]) is cached
    assert MostCostly().choose([cached, cold]) is cold


# -- the router's work accounting as policies see it ------------------------------------------------------------------


def _figures(router: Router, backend: str) -> tuple[int, int, int, int, int]:
    """(in flight, in prefill, pending prefill tokens, held blocks, active blocks) on ``backend``."""
    c = router.decide([1], [backend]).candidates[0]
    return c.in_flight, c.in_prefill, c.pending_prefill_tokens, c.held_blocks, c.active_blocks


def _distinct_blocks(decisions: list[Decision], block_size: int) -> int:
    """The exact figure: distinct full blocks of the prompts in flight, plus each prompt's partial last block."""
    full: set[int] = set()
    partial = 0
    for decision in decisions:
        hashes = decision._hashes
        full.update(hashes)
        partial += -(-decision.prompt_tokens // block_size) - len(hashes)
    return len(full) + partial


def test_active_blocks_count_a_shared_prefix_once_where_held_blocks_count_it_per_request() -> None:
    router = Router(block_size=16)
    system = list(range(4096))  # 256 blocks
    warm = router.route(system, ["a"])
    started = []
    for user in range(5):
        decision = router.route(system + [50_000 + user * 200 + i for i in range(200)], ["a"])  # 12.5 more blocks
        router.start(decision)
        started.append(decision)
    in_flight, in_prefill, pending, held, active = _figures(router, "a")
    assert (in_flight, in_prefill, pending) == (5, 5, 5 * 200)
    assert held == 5 * 269  # each prompt whole: ceil(4296 / 16)
    assert active == 256 + 5 * 13 == _distinct_blocks(started, 16)
    router.first_token(started[0])
    assert _figures(router, "a")[:3] == (5, 4, 4 * 200)
    for decision in started:
        router.finish(decision)
    assert _figures(router, "a") == (0, 0, 0, 0, 0)
    router.finish(warm)  # never started: ignored, nothing goes negative
    assert _figures(router, "a") == (0, 0, 0, 0, 0)


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 300), st.integers(0, 2), st.booleans()), min_size=1, max_size=60
    )
)
def test_active_blocks_stay_near_the_exact_distinct_count_and_return_to_zero(
    steps: list[tuple[int, int, int, bool]],
) -> None:
    clock = FakeClock()
    router = Router(block_size=4, clock=clock, lease=50.0)
    prefixes = [list(range(p * 10_000, p * 10_000 + length)) for p, length in enumerate((0, 64, 400, 1000))]
    live: list[Decision] = []
    for n, (prefix, extra, action, first) in enumerate(steps):
        if action == 2 and live:
            router.finish(live.pop(extra % len(live)))
        else:
            prompt = prefixes[prefix] + [900_000 + n * 1000 + i for i in range(extra)]
            decision = router.route(prompt or [7], ["a"])
            router.start(decision)
            if first:
                router.first_token(decision)
            live.append(decision)
        active = _figures(router, "a")[4]
        exact = _distinct_blocks(live, 4)
        # Never short of the exact count; a segment where two prompts part, or a prefix one request is still
        # computing while another matches it, is counted twice, never more than every prompt's blocks.
        assert exact <= active <= sum(-(-d.prompt_tokens // 4) for d in live)
        assert (active == 0) == (not live)
    clock.tick(100.0)  # every lease is over: the abandoned requests expire
    router.expire()
    assert _figures(router, "a") == (0, 0, 0, 0, 0)
    assert router.stats().in_flight == 0


def test_active_blocks_are_exact_for_requests_that_share_whole_matched_prefixes() -> None:
    rng = random.Random(3)
    router = Router(block_size=16)
    prefixes = [[rng.randrange(30_000) for _ in range(length)] for length in (2048, 4096, 6144, 8192)]
    for prefix in prefixes:
        router.route(prefix, ["a"])  # cached before the traffic starts
    live: list[Decision] = []
    for _ in range(400):
        if live and rng.random() < 0.5:
            router.finish(live.pop(rng.randrange(len(live))))
        else:
            prompt = rng.choice(prefixes) + [rng.randrange(30_000) for _ in range(rng.randint(100, 400))]
            decision = router.route(prompt, ["a"])
            router.start(decision)
            live.append(decision)
        assert _figures(router, "a")[4] == _distinct_blocks(live, 16)
    for decision in live:
        router.finish(decision)
    assert _figures(router, "a") == (0, 0, 0, 0, 0)


def test_removing_a_backend_drops_its_accounting_and_later_finishes_are_ignored() -> None:
    router = Router(block_size=4)
    decision = router.route(list(range(40)), ["a", "b"])
    router.start(decision)
    assert _figures(router, decision.backend)[4] == 10
    router.remove_backend(decision.backend)
    assert _figures(router, decision.backend) == (0, 0, 0, 0, 0)
    router.finish(decision)
    assert router.stats().ignored == 1
    again = router.route(list(range(40)), [decision.backend])
    with router.track(again):
        assert _figures(router, decision.backend)[4] == 10
    assert _figures(router, decision.backend) == (0, 0, 0, 0, 0)


@settings(max_examples=60, deadline=None)
@given(
    operations=st.lists(st.tuples(st.integers(0, 6), st.sampled_from(["a", "b", "c"]), st.integers(0, 40)), max_size=40)
)
def test_candidates_show_every_figure_as_it_is_now(operations: list[tuple[int, str, int]]) -> None:
    """The router caches each backend's figures between routes: every change must reach the next candidates."""
    router = Router(block_size=4, capacity_blocks=64)
    backends = ["a", "b", "c"]
    engine: dict[str, tuple[int | None, float | None]] = {}
    live: list[Decision] = []
    for kind, backend, number in operations:
        if kind == 0:
            decision = router.decide(list(range(number, number + 9)), [backend])
            router.start(router.commit(decision))
            live.append(decision)
        elif kind == 1 and live:
            router.first_token(live[number % len(live)])
        elif kind == 2 and live:
            router.finish(live.pop(number % len(live)))
        elif kind == 3:
            figures = (number, number / 40) if number % 3 else (None, None)
            router.set_engine_load(backend, queue_len=figures[0], kv_usage=figures[1])
            engine[backend] = figures
        elif kind == 4:
            router.set_capacity(backend, number or None)
        elif kind == 5:
            router.index.set_capacity(backend, number)  # straight on the index: the router must still see it
        elif kind == 6:
            router.remove_backend(backend)
            engine.pop(backend, None)
            live = [d for d in live if d.backend != backend]
        for candidate in router.decide([1, 2, 3, 4, 5], backends).candidates:
            name = candidate.backend
            assert candidate.in_flight == router.in_flight(name) == sum(d.backend == name for d in live)
            assert candidate.capacity_blocks == router.index.capacity(name)
            assert (candidate.queue_len, candidate.kv_usage) == engine.get(name, (None, None))
            assert candidate.in_prefill <= candidate.in_flight


def test_predicted_ttft_steers_a_very_long_prompt_by_queued_work_not_by_request_counts() -> None:
    """The prefill every backend must do counts at most the fleet's typical prompt for each request in flight, so a
    100K-token prompt goes where less prefill is queued, not where fewer requests stream answers; what leaving a
    cached prefix adds still counts in full for each."""
    # Requests in flight hold 8K-token prompts on average: 12 x 512 blocks of 16 over 12 requests.
    queued = Candidate("queued", 0, 100_000, 4, pending_prefill_tokens=120_000, in_prefill=2, held_blocks=4 * 512)
    crowded = Candidate("crowded", 0, 100_000, 8, pending_prefill_tokens=15_000, in_prefill=1, held_blocks=8 * 512)
    policy = PredictedTTFT()
    assert policy.cap_terms([queued, crowded]) == (100_000, 8192.0)
    # 120K + 100K + 8192 x 4 + 100K x 2 = 452,768 against 15K + 100K + 8192 x 8 + 100K = 280,536: a request in
    # prefill counts the whole prefill once more (uncapped: 820K against 1,015K, the counts decide).
    assert policy.choose([queued, crowded]) is crowded
    assert policy.cost(queued) < policy.cost(crowded)  # without the cap terms, the counts decide
    # A short prompt is under the cap: the counts weigh as before.
    short = [c._replace(prompt_tokens=2000) for c in (queued, crowded)]
    assert policy.cap_terms(short)[0] == 2000 and policy.choose(short).backend == "crowded"  # 134K against 35K
    # What a cached prefix saves still counts per request held up: 90K cached on the crowded backend.
    cached = crowded._replace(matched_tokens=90_000)
    assert policy.cap_terms([queued, cached]) == (10_000, 8192.0)
    capped = policy.cost(queued, common_tokens=10_000, typical_prompt=8192.0)
    assert capped == 120_000 + 100_000 + (8192 + 90_000) * 4 + 100_000 * 2
    assert policy.choose([queued, cached]) is cached
    # Left out, the cap terms cap nothing: no common tokens, whatever the typical prompt.
    assert policy.cost(queued, typical_prompt=0.0) == policy.cost(queued) == 120_000 + 100_000 * 7
    # A candidate's held blocks are known from the first one: 1 block of 16 tokens over 2 requests in flight.
    assert policy.cap_terms([Candidate("a", 0, 100, 2, held_blocks=1), Candidate("b", 50, 100, 3)]) == (50, 8.0)


def test_predicted_ttft_charges_its_prefill_only_to_the_requests_the_kv_memory_holds() -> None:
    """Requests waiting for KV memory are not held up by a newcomer, which queues behind them: where the requests in
    flight claim more blocks than a backend has, the harm counts only the share its memory holds at once, and the
    queued work ahead decides."""
    # Both backends claim more than their 1,000 blocks (stretched alike, 20x). "queued" has 3x the prefill work
    # ahead; "waiting" has more requests, most of them waiting for memory (it holds a quarter of its 4,000 blocks).
    waiting = Candidate("waiting", 0, 1000, 30, pending_prefill_tokens=10_000, in_prefill=25, held_blocks=4000,
                        active_blocks=4000, capacity_blocks=1000)  # fmt: skip
    queued = Candidate("queued", 0, 1000, 10, pending_prefill_tokens=30_000, in_prefill=5, held_blocks=1100,
                       active_blocks=1100, capacity_blocks=1000)  # fmt: skip
    policy = PredictedTTFT()
    # 10K + 1K + (1K x 30 + 1K x 25) x 1/4 = 24,750 against 30K + 1K + (1K x 10 + 1K x 5) x 1000/1100 = 44,636
    # (all 55 counted in full: 66,000 against 46,000).
    assert policy.cost(waiting) == (11_000 + 55_000 / 4) / (1 - 0.95)
    assert policy.choose([waiting, queued]) is waiting
    # Within its capacity every request in flight counts in full, as before.
    roomy = waiting._replace(active_blocks=1000)
    assert policy.cost(roomy) == policy.cost(roomy._replace(capacity_blocks=None)) / (1 - 0.95)
