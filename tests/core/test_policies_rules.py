"""The built-in policies' rules, checks and messages at their edges, each as a docstring or docs/policies.md states it
(each test was written against a mutant of prefixroute/policies.py that the rest of the suite let through)."""

from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence

import pytest

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
    PolicyError,
    PowerOfTwo,
    PredictedTTFT,
    Random,
    RoundRobin,
    policy_from_name,
    policy_names,
)
from prefixroute.policies import _field_fault, kv_fraction

# -- the fields' checks (_field_fault's docstring: kv_usage a finite real >= 0, prefill_tokens_per_s one > 0) --------

# PredictedTTFT.cost() fails on this candidate's in_prefill (after every field these tests replace), so it checks
# every field before it, in order, and names the first that is not as Candidate documents it.
FAILS_LATE = Candidate("a", 0, 64, 1, in_prefill="x")  # type: ignore[arg-type]


def _first_fault(**fields: object) -> str:
    """The message of the error cost() raises for FAILS_LATE with ``fields`` replaced."""
    with pytest.raises((InvalidTypeError, ConfigurationError)) as info:
        PredictedTTFT().cost(FAILS_LATE._replace(**fields))  # type: ignore[arg-type]
    return str(info.value)


IN_PREFILL_FAULT = "Candidate 'a': in_prefill must be an int, not 'x'"


@pytest.mark.parametrize("usage", [0, 0.0, 0.5, 1, 1.0])
def test_a_kv_usage_from_zero_up_is_well_formed_int_or_float(usage: float) -> None:
    assert _first_fault(kv_usage=usage) == IN_PREFILL_FAULT
    fraction = kv_fraction(Candidate("a", 0, 1, 0, kv_usage=usage))
    assert fraction == usage and type(fraction) is float  # the plain float it stands for


@pytest.mark.parametrize("usage", [-0.5, -1, math.nan, math.inf])
def test_a_kv_usage_below_zero_or_not_finite_is_named(usage: float) -> None:
    assert _first_fault(kv_usage=usage) == f"Candidate 'a': kv_usage must be finite and at least 0, not {usage!r}"


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"kv_usage": -0.5}, "kv_usage must be finite and at least 0, not -0.5"),
        ({"kv_usage": math.nan}, "kv_usage must be finite and at least 0, not nan"),
        ({"capacity_blocks": -2, "active_blocks": 3}, "capacity_blocks must be at least 0, not -2"),
        ({"capacity_blocks": 4, "active_blocks": -3}, "active_blocks must be at least 0, not -3"),
    ],
)
def test_kv_fraction_names_a_negative_or_nan_figure_instead_of_returning_it(
    fields: dict[str, float], named: str
) -> None:
    # Was: a float kv_usage skipped the check an int got (-0.5 and NaN came back as "fractions"), and a negative
    # capacity gave a negative fraction.
    with pytest.raises(ConfigurationError, match=f"^Candidate 'a': {re.escape(named)}$"):
        kv_fraction(Candidate("a", 0, 16, 0, **fields))  # type: ignore[arg-type]


@pytest.mark.parametrize("speed", [0.5, 1, 1.0, 8000.0])
def test_a_prefill_speed_above_zero_is_well_formed_int_or_float(speed: float) -> None:
    assert _first_fault(prefill_tokens_per_s=speed) == IN_PREFILL_FAULT


@pytest.mark.parametrize("speed", [0, 0.0, -1.0, math.nan, math.inf])
def test_a_prefill_speed_of_zero_or_less_or_not_finite_is_named(speed: float) -> None:
    expected = f"Candidate 'a': prefill_tokens_per_s must be finite and above 0, not {speed!r}"
    assert _first_fault(prefill_tokens_per_s=speed) == expected


@pytest.mark.parametrize("attention", [None, 1, 2000, 2000.0])
def test_attention_tokens_above_zero_or_none_are_well_formed(attention: float | None) -> None:
    assert _field_fault("attention_tokens", attention) is None


@pytest.mark.parametrize("attention", [0, 0.0, -1.0, math.nan, math.inf])
def test_attention_tokens_of_zero_or_less_or_not_finite_are_faults(attention: float) -> None:
    assert _field_fault("attention_tokens", attention) == (ConfigurationError, "finite and above 0")


def test_the_attention_figures_of_a_wrong_type_are_named_where_the_cost_fails_on_them() -> None:
    with pytest.raises(InvalidTypeError, match=r"^Candidate 'a': attention_tokens must be a real number or None, not"):
        PredictedTTFT().choose([Candidate("a", 0, 64, 1, attention_tokens="x")])  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match=r"^Candidate 'a': pending_prefill_context must be an int, not None"):
        PredictedTTFT().cost(Candidate("a", 0, 64, 1, pending_prefill_context=None, attention_tokens=2e3))  # type: ignore[arg-type]


def test_a_whole_prompt_matched_is_well_formed_and_more_than_the_prompt_is_named() -> None:
    # cost() fails on common_tokens; the candidate is checked first, and matched_tokens may equal prompt_tokens.
    with pytest.raises(ConfigurationError, match=r"^cost\(\) common_tokens must be an int >= 0, not 'x'$"):
        PredictedTTFT().cost(Candidate("a", 64, 64, 1), common_tokens="x")  # type: ignore[arg-type]
    with pytest.raises(
        ConfigurationError, match=r"^Candidate 'a': matched_tokens \(80\) must be at most prompt_tokens \(64\)$"
    ):
        PredictedTTFT().cost(Candidate("a", 80, 64, 1), common_tokens="x")  # type: ignore[arg-type]


def test_a_named_field_error_keeps_the_arithmetic_error_as_its_cause() -> None:
    bad = Candidate("a", 0, 64, None)  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="in_flight must be an int, not None") as linear:
        LinearTTFT()(bad)
    with pytest.raises(InvalidTypeError, match="in_flight must be an int, not None") as cost:
        PredictedTTFT().cost(bad)
    with pytest.raises(InvalidTypeError, match="capacity_blocks must be an int or None, not 'x'") as fraction:
        kv_fraction(Candidate("a", 0, 64, 0, capacity_blocks="x"))  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="in_flight must be an int, not None") as terms:
        PredictedTTFT.cap_terms([Candidate("a", 0, 64, None, held_blocks=4)])  # type: ignore[arg-type]
    for info in (linear, cost, fraction, terms):
        assert isinstance(info.value.__cause__, TypeError)


# -- cost()'s own arguments -------------------------------------------------------------------------------------------


def test_cost_takes_any_speed_above_zero_and_refuses_zero_whatever_its_type() -> None:
    candidate = Candidate("a", 16, 64, 1)
    policy = PredictedTTFT()
    assert policy.cost(candidate, speed=1) == policy.cost(candidate) == 48 * 2
    assert policy.cost(candidate, speed=0.5) == 48 * 2 / 0.5
    for speed in (0.0, -0.0, -2.0):
        with pytest.raises(ConfigurationError, match=rf"^cost\(\) speed must be a finite number above 0, not {speed}"):
            policy.cost(candidate, speed=speed)


def test_cost_blames_its_cap_terms_only_where_they_are_wrong() -> None:
    """cost() names common_tokens or typical_prompt only when the arithmetic failed and they are not what its
    docstring takes (an int >= 0; a number above 0 or math.inf); else the arithmetic's own error stands."""
    policy = PredictedTTFT()
    with pytest.raises(ConfigurationError, match=r"typical_prompt must be a number above 0 or math.inf, not 'x'$"):
        policy.cost(Candidate("a", 16, 64, 1), common_tokens=0, typical_prompt="x")  # type: ignore[arg-type]
    # A count too large for a float is the candidate's fault (Candidate's ints are below 2**63), named before a term.
    overflowing = Candidate("a", 0, 64, 10**400)
    for typical in (math.inf, 1, 0.5, 0):
        with pytest.raises(ConfigurationError, match=r"^Candidate 'a': in_flight must be below 2\*\*63, not an int"):
            policy.cost(overflowing, typical_prompt=typical)


# -- choices ----------------------------------------------------------------------------------------------------------


def test_predicted_ttft_returns_a_candidate_when_no_cost_is_a_number() -> None:
    # A hand-built kv_usage of NaN makes every cost NaN, which is below nothing: the first candidate stands.
    candidates = [Candidate(name, 0, 64, 1, kv_usage=math.nan) for name in ("first", "second")]
    assert PredictedTTFT().choose(candidates) is candidates[0]


def test_predicted_ttft_reads_an_engine_queue_only_when_longer_than_its_requests_in_prefill() -> None:
    # The docstring: queue_len stands in for in_prefill "when it is longer", and only then is in_flight at least
    # that. A queue as long as in_prefill changes nothing, here where in_flight (1) is below both: 100 x (1 + 1 + 3).
    queue_as_long = Candidate("queue", 0, 100, 1, queue_len=3, in_prefill=3)
    no_queue = Candidate("none", 0, 100, 1, in_prefill=3)
    policy = PredictedTTFT()
    assert policy.cost(queue_as_long) == policy.cost(no_queue) == 100 * (1 + 1 + 3)
    assert policy.choose([queue_as_long, no_queue]) is queue_as_long  # equal: placement order
    longer = queue_as_long._replace(queue_len=4)  # 100 x (1 + 4 + 4): in_flight at least the queue
    assert policy.cost(longer) == 100 * (1 + 4 + 4)
    assert policy.choose([longer, no_queue]) is no_queue


# -- options and messages ---------------------------------------------------------------------------------------------


def test_a_policy_repr_names_its_class() -> None:
    class Mine(LoadPolicy):
        def choose(self, candidates):  # type: ignore[no-untyped-def]
            return candidates[0]

    assert repr(Mine()) == "Mine()"
    assert [repr(p) for p in (RoundRobin(), LeastLoaded())] == ["RoundRobin()", "LeastLoaded()"]


@pytest.mark.parametrize("policy", [Random, PowerOfTwo])
def test_a_seeded_policy_names_itself_and_the_option_it_refuses(policy: type[Random] | type[PowerOfTwo]) -> None:
    name = policy.__name__
    with pytest.raises(InvalidTypeError, match=rf"^{name} seed must be an int, str, bytes or None, not float$"):
        policy(seed=1.5)  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match=rf"^{name} rng must be a random.Random, not int$"):
        policy(rng=7)  # type: ignore[arg-type]
    assert policy(rng=random.Random(3))._rng.random() == random.Random(3).random()


def test_option_errors_show_the_value_given() -> None:
    with pytest.raises(ConfigurationError, match=r"^BoundedLoad factor must be a finite number >= 1.0, not 0.5$"):
        BoundedLoad(factor=0.5)
    with pytest.raises(
        ConfigurationError, match=r"^LinearTTFT per_token_s must be a finite number of seconds >= 0, not -1$"
    ):
        LinearTTFT(per_token_s=-1)
    with pytest.raises(
        InvalidTypeError, match=r"^CostAware cost must be a callable from a Candidate to seconds, not 'linear'$"
    ):
        CostAware(cost="linear")  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match=r"^kv_fraction\(\) takes a Candidate, not str$"):
        kv_fraction("a")  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match=r"^the cost model takes a Candidate, not str$"):
        PredictedTTFT().cost("a")  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match=r"^the cost model takes a Candidate, not tuple$"):
        LinearTTFT()(("a", 0, 64, 1))  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"^PredictedTTFT kv_cap must be a fraction in \[0, 1\), not 1.0$"):
        PredictedTTFT(kv_cap=1.0)
    with pytest.raises(ConfigurationError, match=r"^PredictedTTFT use_speed must be True or False, not 'yes'$"):
        PredictedTTFT(use_speed="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ("abc", r"^choose\(\) takes a sequence of Candidates, not str$"),
        (b"abc", r"^choose\(\) takes a sequence of Candidates, not bytes$"),
        ({Candidate("a", 0, 64, 0)}, r"^choose\(\) takes a sequence of Candidates, not set$"),
        ([Candidate("a", 0, 64, 0), 7], r"^choose\(\) takes Candidates, not int \(7\)$"),
        (
            (Candidate("a", 0, 64, 0), ("b", 0, 64, 0)),
            r"^choose\(\) takes Candidates, not tuple \(\('b', 0, 64, 0\)\)$",
        ),
    ],
)
def test_choose_names_what_it_was_given_instead_of_candidates(given: object, message: str) -> None:
    for policy in (LeastLoaded(), PredictedTTFT()):
        with pytest.raises(InvalidTypeError, match=message):
            policy.choose(given)  # type: ignore[arg-type]


def test_choose_given_no_candidates_says_to_pass_one() -> None:
    empties: tuple[list[Candidate], tuple[Candidate, ...]] = ([], ())
    for policy in (RoundRobin(), PredictedTTFT()):
        for empty in empties:
            with pytest.raises(
                NoBackendError, match=r"^choose\(\) was given no candidates: pass at least one Candidate$"
            ):
                policy.choose(empty)


def test_choose_takes_any_sequence_of_candidates_and_their_subclasses() -> None:
    class Tagged(Candidate):
        pass

    a, b = Candidate("a", 0, 64, 2), Tagged("b", 0, 64, 1)
    for given in ([a, b], (a, b), _Seq([a, b])):
        assert LeastLoaded().choose(given) is b, given


class _Seq(Sequence[Candidate]):
    """A Sequence that is neither a list nor a tuple."""

    def __init__(self, items: list[Candidate]) -> None:
        self._items = items

    def __getitem__(self, index):  # type: ignore[no-untyped-def]
        return self._items[index]

    def __len__(self) -> int:
        return len(self._items)


# -- the registry -----------------------------------------------------------------------------------------------------


def test_policy_from_name_messages_list_the_names_and_refuse_what_cannot_be_built() -> None:
    names = ", ".join(policy_names())
    with pytest.raises(ConfigurationError) as unknown:
        policy_from_name("nearest")
    assert str(unknown.value) == f"unknown policy 'nearest': use one of {names} or 'package.module:ClassName'"
    with pytest.raises(InvalidTypeError, match=r"^policy name must be a str, not int$"):
        policy_from_name(7)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"is abstract: name a subclass that implements choose\(\)$"):
        policy_from_name("prefixroute.policies:LoadPolicy")


@pytest.mark.parametrize("bad", [math.nan, "cheap", None, True])
def test_a_cost_aware_cost_that_is_no_number_is_a_policy_error_wherever_its_candidate_stands(bad: object) -> None:
    """Was: min() by cost, so a NaN cost won when its candidate came first and lost otherwise (NaN compares false
    with everything), and costs of any type were compared (all str: the least str)."""
    costs = {"sick": bad, "ok": 1.0}
    policy = CostAware(cost=lambda c: costs[c.backend])  # type: ignore[arg-type, return-value]
    for order in (["sick", "ok"], ["ok", "sick"]):
        with pytest.raises(PolicyError, match=r"CostAware cost returned .* for backend 'sick': a cost must be"):
            policy.choose([Candidate(b, 0, 64, 0) for b in order])
    numbers = {"a": 2, "b": 1.5, "c": math.inf}  # an int, a float, infinity: numbers all
    assert CostAware(cost=lambda c: numbers[c.backend]).choose([Candidate(b, 0, 64, 0) for b in "abc"]).backend == "b"
    assert CostAware(cost=lambda c: 1.0).choose([Candidate(b, 0, 64, 0) for b in "abc"]).backend == "a"  # ties: first
