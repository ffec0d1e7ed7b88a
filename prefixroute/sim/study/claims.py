"""The published claims the study checks: each published figure once, and the rule that judges it.

One place: :data:`PUBLISHED` holds every published number, as published; :data:`CLAIMS` says, for each claim, which
simulated figure answers it and by which rule (:class:`Rule`). :func:`judge` computes every verdict from the
figures; nothing else in the study decides whether a claim holds.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType

from prefixroute.sim.study.runs import HOT_MODES, Pair, StudyRuns

__all__ = ["CLAIMS", "PUBLISHED", "Check", "Claim", "Judged", "Rule", "judge", "verdict_of"]

# Every published figure (the reported 8× A100 CodeLlama-13B deployment and its write-up), as published.
PUBLISHED = MappingProxyType(
    {
        "round-robin hit rate": 0.125,
        "round-robin P99 TTFT ms": 6800.0,
        "round-robin req/s": 36.3,
        "prefix-aware hit rate": 0.975,
        "prefix-aware P99 TTFT ms": 1000.0,
        "prefix-aware req/s": 44.4,
        "8K miss ms": 638.0,
        "8K hit ms": 448.0,
        "16K miss ms": 817.0,
        "16K hit ms": 461.0,
        "hit rate at 50 % sharing": 0.91,
        "hot prefix share under affinity": 0.80,
        "hit rate cost of the 2× fallback, points": 5.0,
        "P95 improvement of the 2× fallback": 0.36,
        "P99 improvement of the 2× fallback": 0.45,
        "P99/P50 threshold": 5.0,
    }
)

# How far a simulated figure may be from the published one and still reproduce it. Unit-free and the same for every
# claim: the simulator is calibrated to other measurements than the published deployment, so agreement within a
# factor of 1.5 (or 5 points of a rate) is what it can be expected to show; a figure on the right side of "no
# effect" but farther away reproduces the direction only.
FACTOR = 1.5
POINTS = 5.0


class Rule(Enum):
    """How a check's simulated figure is compared with its published one."""

    FACTOR = "within a factor of 1.5 of the published figure (direction alone: on the same side of no effect)"
    POINTS = "within 5 points of the published rate"
    AT_LEAST = "at least the published figure (direction alone: better than no effect)"
    AT_MOST = "at most the published figure"


@dataclass(frozen=True)
class Check:
    """One figure of a claim: the published value, how the simulated one is computed, and the rule."""

    figure: str
    published: float
    simulated: Callable[[StudyRuns], float]
    rule: Rule
    unit: str  # how both values are written: "×", "ms", "req/s", "%", "points", "count"
    no_effect: float | None = None  # the value meaning "no effect", for direction-only verdicts


@dataclass(frozen=True)
class Claim:
    """A published claim: its section of the study, the statement as published, and its checks."""

    section: int
    statement: str
    checks: tuple[Check, ...]


@dataclass(frozen=True)
class Judged:
    """A check with its simulated figure and verdict: ``"reproduced"``, ``"direction only"``, ``"not reproduced"``."""

    claim: Claim
    check: Check
    simulated: float
    verdict: str


def judge(claims: Sequence[Claim], runs: StudyRuns) -> list[Judged]:
    """Every check of every claim, judged on ``runs``. O(checks)."""
    judged = []
    for claim in claims:
        for check in claim.checks:
            value = check.simulated(runs)
            judged.append(Judged(claim, check, value, _verdict(check, value)))
    return judged


def verdict_of(judged: Sequence[Judged], claim: Claim) -> str:
    """A claim's verdict: the worst of its checks'."""
    order = ("not reproduced", "direction only", "reproduced")
    return min((j.verdict for j in judged if j.claim is claim), key=order.index)


def _verdict(check: Check, value: float) -> str:
    published = check.published
    if math.isnan(value):
        return "not reproduced"
    if check.rule is Rule.FACTOR:
        # Both quotients, not |log(value / published)|: that misses a figure exactly 1.5x below by one ulp.
        if published != 0 and value / published > 0 and max(value / published, published / value) <= FACTOR:
            return "reproduced"
    elif check.rule is Rule.POINTS:
        if abs(value - published) <= POINTS:
            return "reproduced"
    elif check.rule is Rule.AT_LEAST:
        if value >= published:
            return "reproduced"
    elif value <= published:
        return "reproduced"
    no_effect = check.no_effect
    if no_effect is not None and (value - no_effect) * (published - no_effect) > 0:
        return "direction only"
    return "not reproduced"


# -- the simulated figures -------------------------------------------------------------------------------------


def _seed_ratio(policy: str, figure: str) -> Callable[[StudyRuns], float]:
    def compute(runs: StudyRuns) -> float:
        chosen, base = runs.seed[policy], runs.seed["round-robin"]
        if figure == "p99":
            return _quotient(chosen.ttft_ms["p99"], base.ttft_ms["p99"])
        return _quotient(chosen.throughput_rps, base.throughput_rps)

    return compute


def _seed_gain_points(policy: str) -> Callable[[StudyRuns], float]:
    return lambda runs: 100 * (runs.seed[policy].hit_rate - runs.seed["round-robin"].hit_rate)


def _prefill_ms(length: int, index: int) -> Callable[[StudyRuns], float]:
    return lambda runs: runs.prefill_ms[length][index]


def _quotient(numerator: float, denominator: float) -> float:
    """``numerator / denominator``, NaN (written "–", judged "not reproduced") when the denominator is 0 or NaN."""
    return numerator / denominator if denominator else math.nan  # NaN is truthy: NaN / NaN is NaN


def _shrinking_steps(gains: Sequence[float]) -> float:
    # A NaN compares False either way, so it would count as "no step": the count would claim a trend it never saw.
    if any(math.isnan(g) for g in gains):
        return math.nan
    return float(sum(b < a for a, b in zip(gains, gains[1:], strict=False)))


def _p50_gain_ms(pair: Pair) -> float:
    rr, bl = pair
    return rr.ttft_ms["p50"] - bl.ttft_ms["p50"]


def _p99_ratio(pair: Pair) -> float:
    rr, bl = pair
    return _quotient(bl.ttft_ms["p99"], rr.ttft_ms["p99"])


def _length_gain_shrinks(runs: StudyRuns) -> float:
    return _shrinking_steps([_p50_gain_ms(runs.lengths[n]) for n in sorted(runs.lengths)])


def _length_p99_ratio_rises(runs: StudyRuns) -> float:
    return _shrinking_steps([-_p99_ratio(runs.lengths[n]) for n in sorted(runs.lengths)])


def _model_gain_shrinks(runs: StudyRuns) -> float:
    return _shrinking_steps([_p50_gain_ms(pair) for pair in runs.models.values()])


def _model_p99_ratio_rises(runs: StudyRuns) -> float:
    return _shrinking_steps([-_p99_ratio(pair) for pair in runs.models.values()])


def _route_share_of_small_model_gain(runs: StudyRuns) -> float:
    """route()'s time in % of the smallest model's P99 TTFT gain: the overhead cancels the gain at >= 100 %."""
    rr, bl = next(iter(runs.models.values()))
    gain = rr.ttft_ms["p99"] - bl.ttft_ms["p99"]
    if math.isnan(gain):  # no P99 on one side: no gain to compare with (not "no gain", which is ∞ %)
        return math.nan
    return 100 * runs.route_ms / gain if gain > 0 else math.inf


def _hot(mode: str, figure: str) -> Callable[[StudyRuns], float]:
    def compute(runs: StudyRuns) -> float:
        affinity, fallback = runs.hot_affinity[mode], runs.hot_bounded[mode][2.0]
        if figure == "share":
            return 100 * affinity.max_backend_share
        if figure == "hit":
            return 100 * (affinity.hit_rate - fallback.hit_rate)
        return 100 * (1 - _quotient(fallback.ttft_ms[figure], affinity.ttft_ms[figure]))

    return compute


def _rule_hit_gap_points(runs: StudyRuns) -> float:
    """Mean hit rate of runs with P99/P50 above the threshold minus that of the others, in points."""
    threshold = PUBLISHED["P99/P50 threshold"]
    high: list[float] = []
    low: list[float] = []
    for _section, r in runs.all:
        ratio = r.ttft_ms["p99"] / r.ttft_ms["p50"] if r.ttft_ms["p50"] else math.nan
        (high if ratio > threshold else low).append(r.hit_rate)
    if not high or not low:
        return math.nan
    return 100 * (statistics.fmean(high) - statistics.fmean(low))


def _published_ratio(numerator: str, denominator: str) -> float:
    return PUBLISHED[numerator] / PUBLISHED[denominator]


_P = PUBLISHED
CLAIMS: tuple[Claim, ...] = (
    Claim(
        1,
        "On 8 × A100 with CodeLlama-13B, prefix-aware routing against round-robin: KV hit rate 12.5 % → 97.5 %, P99 "
        "TTFT 6,800 → 1,000 ms, throughput 36.3 → 44.4 req/s.",
        tuple(
            check
            for policy in ("prefix-affinity", "bounded-load")
            for check in (
                Check(
                    f"P99 TTFT, {policy} / round-robin",
                    _published_ratio("prefix-aware P99 TTFT ms", "round-robin P99 TTFT ms"),
                    _seed_ratio(policy, "p99"),
                    Rule.FACTOR,
                    "×",
                    1.0,
                ),
                Check(
                    f"throughput, {policy} / round-robin",
                    _published_ratio("prefix-aware req/s", "round-robin req/s"),
                    _seed_ratio(policy, "rps"),
                    Rule.FACTOR,
                    "×",
                    1.0,
                ),
                Check(
                    f"hit rate gain, {policy} (points)",
                    100 * (_P["prefix-aware hit rate"] - _P["round-robin hit rate"]),
                    _seed_gain_points(policy),
                    Rule.FACTOR,
                    "points",
                    0.0,
                ),
            )
        )
        + (
            Check(
                "round-robin throughput",
                _P["round-robin req/s"],
                lambda runs: runs.seed["round-robin"].throughput_rps,
                Rule.FACTOR,
                "req/s",
            ),
            Check(
                "round-robin P99 TTFT",
                _P["round-robin P99 TTFT ms"],
                lambda runs: runs.seed["round-robin"].ttft_ms["p99"],
                Rule.FACTOR,
                "ms",
            ),
        ),
    ),
    Claim(
        2,
        "A 13B prefix hit costs far less TTFT than a miss; 8K tokens: miss 638 / hit 448 ms; 16K: 817 / 461 ms.",
        tuple(
            Check(
                f"{label} {kind} ms (alone, no queueing)",
                _P[f"{label} {kind} ms"],
                _prefill_ms(length, index),
                Rule.FACTOR,
                "ms",
            )
            for label, length in (("8K", 8192), ("16K", 16384))
            for index, kind in enumerate(("miss", "hit"))
        ),
    ),
    Claim(
        3,
        "The gain of prefix-aware routing grows with the prefix length.",
        (
            Check(
                "steps along 2K → 16K where bounded-load's p50 TTFT gain over round-robin shrinks",
                0.0,
                _length_gain_shrinks,
                Rule.AT_MOST,
                "count",
            ),
            Check(
                "steps along 2K → 16K where bounded-load / round-robin P99 TTFT rises",
                0.0,
                _length_p99_ratio_rises,
                Rule.AT_MOST,
                "count",
            ),
        ),
    ),
    Claim(
        4,
        "13B–70B models benefit most; under 8B the routing overhead can cancel the gain.",
        (
            Check(
                "steps along 8B → 70B where bounded-load's p50 TTFT gain over round-robin shrinks",
                0.0,
                _model_gain_shrinks,
                Rule.AT_MOST,
                "count",
            ),
            Check(
                "steps along 8B → 70B where bounded-load / round-robin P99 TTFT rises",
                0.0,
                _model_p99_ratio_rises,
                Rule.AT_MOST,
                "count",
            ),
            Check(
                "route() time in % of llama-3-8b's P99 TTFT gain (the overhead cancels the gain at ≥ 100 %)",
                100.0,
                _route_share_of_small_model_gain,
                Rule.AT_LEAST,
                "%",
            ),
        ),
    ),
    Claim(
        5,
        "At 50 % sharing, prefix-aware routing still reaches 91 % hits.",
        (
            Check(
                "bounded-load KV hit rate at 50 % sharing, all requests",
                100 * _P["hit rate at 50 % sharing"],
                lambda runs: 100 * runs.sharing[0.5][1].hit_rate,
                Rule.POINTS,
                "%",
            ),
            Check(
                "bounded-load KV hit rate at 50 % sharing, shared-prefix requests",
                100 * _P["hit rate at 50 % sharing"],
                lambda runs: 100 * runs.sharing[0.5][1].tag_hit_rate(),
                Rule.POINTS,
                "%",
            ),
        ),
    ),
    Claim(
        6,
        "With one hot prefix, pure affinity puts 80 % of traffic on one GPU; a 2× load fallback costs ~5 points of "
        "hit rate and improves P95 TTFT by 36 % and P99 by 45 %.",
        tuple(
            check
            for mode in HOT_MODES
            for check in (
                Check(
                    f"{mode}: prefix-affinity's busiest GPU share",
                    100 * _P["hot prefix share under affinity"],
                    _hot(mode, "share"),
                    Rule.POINTS,
                    "%",
                ),
                Check(
                    f"{mode}: hit rate the 2× fallback costs (points)",
                    _P["hit rate cost of the 2× fallback, points"],
                    _hot(mode, "hit"),
                    Rule.POINTS,
                    "points",
                ),
                Check(
                    f"{mode}: P95 TTFT improvement of the 2× fallback",
                    100 * _P["P95 improvement of the 2× fallback"],
                    _hot(mode, "p95"),
                    Rule.AT_LEAST,
                    "%",
                    0.0,
                ),
                Check(
                    f"{mode}: P99 TTFT improvement of the 2× fallback",
                    100 * _P["P99 improvement of the 2× fallback"],
                    _hot(mode, "p99"),
                    Rule.AT_LEAST,
                    "%",
                    0.0,
                ),
            )
        ),
    ),
    Claim(
        7,
        "A P99/P50 TTFT ratio above 5 hints at cache misses under load.",
        (
            Check(
                "mean KV hit rate of runs with P99/P50 > 5 minus that of the others (points; the claim: below 0)",
                0.0,
                _rule_hit_gap_points,
                Rule.AT_MOST,
                "points",
            ),
        ),
    ),
)
