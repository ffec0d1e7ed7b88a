"""The study's figures and verdicts on hand-made runs: every figure and verdict worked out by hand."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from prefixroute.sim.metrics import PolicyResult
from prefixroute.sim.study.claims import CLAIMS, Check, Claim, Judged, Rule, judge, verdict_of
from prefixroute.sim.study.render import _value, render
from prefixroute.sim.study.runs import StudyRuns


def result(
    policy: str = "p",
    *,
    hit: float = 0.5,
    p50: float = 100.0,
    p95: float = 200.0,
    p99: float = 300.0,
    rps: float = 10.0,
    share: float = 0.125,
    tags: dict[str, tuple[int, int]] | None = None,
) -> PolicyResult:
    return PolicyResult(
        policy=policy,
        requests=100,
        rejected=0,
        hit_rate=hit,
        predicted_hit_rate=hit,
        ttft_ms={"p50": p50, "p95": p95, "p99": p99},
        e2e_ms={"p50": p50, "p95": p95, "p99": p99},
        throughput_rps=rps,
        prompt_tokens_per_s=1000.0,
        backend_share={"gpu0": share},
        peak_in_flight={"gpu0": 1},
        max_backend_share=share,
        recompute_gpu_seconds=1.0,
        recompute_usd_per_month=2.0,
        preemptions=0,
        duration_s=10.0,
        tag_tokens=tags or {},
    )


def hand_made_runs() -> StudyRuns:
    runs = StudyRuns(requests=10)
    runs.seed = {
        "round-robin": result("round-robin", hit=0.10, p99=6000.0, rps=30.0),
        "prefix-affinity": result("prefix-affinity", hit=0.90, p99=1200.0, rps=40.0),
        "bounded-load": result("bounded-load", hit=0.85, p99=3000.0, rps=36.0),
    }
    runs.prefill_ms = {8192: (600.0, 450.0), 16384: (1000.0, 300.0)}
    # p50 gains (RR - BL) by length: 100, 200, 150, 300 -> one step where the gain shrinks (200 -> 150).
    # BL/RR p99 by length: 0.9, 0.8, 0.85, 0.5 -> one step where the ratio rises (0.8 -> 0.85).
    runs.lengths = {
        n: (result(p50=1000.0, p99=1000.0), result(p50=1000.0 - gain, p99=1000.0 * ratio))
        for n, gain, ratio in ((2048, 100, 0.9), (4096, 200, 0.8), (8192, 150, 0.85), (16384, 300, 0.5))
    }
    # By model, in run order (not sorted by name): p50 gains 50, 40, 40, 60 -> one shrinking step (a tie is none);
    # BL/RR p99 0.95, 0.9, 0.5, 0.4 -> none rising. The smallest model's P99 gain: 1000 - 950 = 50 ms.
    runs.models = {
        model: (result(p50=500.0, p99=1000.0), result(p50=500.0 - gain, p99=1000.0 * ratio))
        for model, gain, ratio in (("m8", 50, 0.95), ("m13", 40, 0.9), ("m34", 40, 0.5), ("m70", 60, 0.4))
    }
    runs.route_ms = 0.5  # 1 % of that 50 ms gain
    runs.sharing = {
        0.1: (result(hit=0.05), result(hit=0.1)),
        0.5: (result(hit=0.3), result(hit=0.88, tags={"shared": (95, 100), "unique": (0, 900)})),
    }
    runs.hot_affinity = {
        "closed loop": result(hit=0.95, p95=1000.0, p99=2000.0, share=0.78),
        "open loop 3 req/s": result(hit=0.90, p95=800.0, p99=1000.0, share=0.5),
    }
    runs.hot_bounded = {
        mode: {
            1.25: result(hit=0.0, p95=1.0, p99=1.0),  # the other factors must not count
            2.0: result(hit=affinity.hit_rate - drop, p95=p95, p99=p99),
        }
        for (mode, affinity), drop, p95, p99 in zip(
            runs.hot_affinity.items(), (0.07, 0.2), (600.0, 900.0), (1000.0, 1100.0), strict=True
        )
    }
    # P99/P50 above 5: hits 0.2 and 0.4 (mean 0.3); at most 5 (5 itself included) or no p50: 0.5, 0.8, 1.0.
    runs.all = [
        ("a", result(hit=0.2, p50=100.0, p99=600.0)),
        ("a", result(hit=0.4, p50=10.0, p99=51.0)),
        ("b", result(hit=0.5, p50=100.0, p99=500.0)),
        ("b", result(hit=0.8, p50=100.0, p99=100.0)),
        ("c", result(hit=1.0, p50=0.0, p99=100.0)),
    ]
    return runs


EXPECTED = {
    "P99 TTFT, prefix-affinity / round-robin": (0.2, "reproduced"),  # published 1000 / 6800 = 0.147
    "throughput, prefix-affinity / round-robin": (40 / 30, "reproduced"),  # published 1.223
    "hit rate gain, prefix-affinity (points)": (80.0, "reproduced"),  # published 85
    "P99 TTFT, bounded-load / round-robin": (0.5, "direction only"),  # 3.4x the published, below 1
    "throughput, bounded-load / round-robin": (1.2, "reproduced"),
    "hit rate gain, bounded-load (points)": (75.0, "reproduced"),
    "round-robin throughput": (30.0, "reproduced"),  # published 36.3
    "round-robin P99 TTFT": (6000.0, "reproduced"),  # published 6800
    "8K miss ms (alone, no queueing)": (600.0, "reproduced"),
    "8K hit ms (alone, no queueing)": (450.0, "reproduced"),
    "16K miss ms (alone, no queueing)": (1000.0, "reproduced"),  # published 817
    "16K hit ms (alone, no queueing)": (300.0, "not reproduced"),  # published 461: 1.54x, just outside
    "steps along 2K → 16K where bounded-load's p50 TTFT gain over round-robin shrinks": (1.0, "not reproduced"),
    "steps along 2K → 16K where bounded-load / round-robin P99 TTFT rises": (1.0, "not reproduced"),
    "steps along 8B → 70B where bounded-load's p50 TTFT gain over round-robin shrinks": (1.0, "not reproduced"),
    "steps along 8B → 70B where bounded-load / round-robin P99 TTFT rises": (0.0, "reproduced"),
    "route() time in % of llama-3-8b's P99 TTFT gain (the overhead cancels the gain at ≥ 100 %)": (
        1.0,
        "not reproduced",
    ),
    "bounded-load KV hit rate at 50 % sharing, all requests": (88.0, "reproduced"),  # published 91
    "bounded-load KV hit rate at 50 % sharing, shared-prefix requests": (95.0, "reproduced"),
    "closed loop: prefix-affinity's busiest GPU share": (78.0, "reproduced"),  # published 80
    "closed loop: hit rate the 2× fallback costs (points)": (7.0, "reproduced"),  # published 5
    "closed loop: P95 TTFT improvement of the 2× fallback": (40.0, "reproduced"),  # at least 36
    "closed loop: P99 TTFT improvement of the 2× fallback": (50.0, "reproduced"),  # at least 45
    "open loop 3 req/s: prefix-affinity's busiest GPU share": (50.0, "not reproduced"),
    "open loop 3 req/s: hit rate the 2× fallback costs (points)": (20.0, "not reproduced"),
    "open loop 3 req/s: P95 TTFT improvement of the 2× fallback": (-12.5, "not reproduced"),
    "open loop 3 req/s: P99 TTFT improvement of the 2× fallback": (-10.0, "not reproduced"),
    "mean KV hit rate of runs with P99/P50 > 5 minus that of the others (points; the claim: below 0)": (
        100 * (0.3 - 2.3 / 3),
        "reproduced",
    ),
}


def test_every_figure_and_verdict_worked_out_by_hand() -> None:
    judged = judge(CLAIMS, hand_made_runs())
    got = {j.check.figure: (j.simulated, j.verdict) for j in judged}
    assert got.keys() == EXPECTED.keys()
    for figure, (value, verdict) in EXPECTED.items():
        assert got[figure][0] == pytest.approx(value, rel=1e-9), figure
        assert got[figure][1] == verdict, figure
    assert [verdict_of(judged, claim) for claim in CLAIMS] == [
        "direction only",
        "not reproduced",
        "not reproduced",
        "not reproduced",
        "reproduced",
        "not reproduced",
        "reproduced",
    ]


def test_degenerate_runs_give_no_false_verdict() -> None:
    runs = hand_made_runs()
    rr, _bl = runs.models["m8"]
    runs.models["m8"] = (rr, result(p50=rr.ttft_ms["p50"], p99=rr.ttft_ms["p99"] + 1))  # no P99 gain at all
    runs.all = [("a", result(p50=100.0, p99=100.0))]  # no run above the P99/P50 threshold: nothing to compare
    got = {j.check.figure: (j.simulated, j.verdict) for j in judge(CLAIMS, runs)}
    share = got["route() time in % of llama-3-8b's P99 TTFT gain (the overhead cancels the gain at ≥ 100 %)"]
    assert share == (math.inf, "reproduced")
    runs.models["m8"] = (rr, result(p50=rr.ttft_ms["p50"], p99=rr.ttft_ms["p99"] - 0.25))  # a gain under 1 ms
    share_figure = "route() time in % of llama-3-8b's P99 TTFT gain (the overhead cancels the gain at ≥ 100 %)"
    assert next(j for j in judge(CLAIMS, runs) if j.check.figure == share_figure).simulated == 200.0
    gap = got["mean KV hit rate of runs with P99/P50 > 5 minus that of the others (points; the claim: below 0)"]
    assert math.isnan(gap[0]) and gap[1] == "not reproduced"
    runs.all = [("a", result(p50=100.0, p99=600.0))]  # and none at or below it
    gap_figure = "mean KV hit rate of runs with P99/P50 > 5 minus that of the others (points; the claim: below 0)"
    only_high = next(j for j in judge(CLAIMS, runs) if j.check.figure == gap_figure)
    assert math.isnan(only_high.simulated) and only_high.verdict == "not reproduced"


def test_a_ratio_to_zero_or_no_number_is_no_number_on_the_page_and_not_reproduced(tmp_path: Path) -> None:
    # Was: ZeroDivisionError out of judge() (and render()) for a run with a zero P99 or throughput, and a NaN ratio
    # in a sweep counted as "no step", a false "reproduced".
    runs = hand_made_runs()
    runs.tp = dict.fromkeys(runs.models, 1)
    runs.kv_tokens = dict.fromkeys(runs.models, 1000)
    runs.seed["round-robin"] = result("round-robin", hit=0.10, p99=0.0, rps=0.0)  # no request served
    rr, bl = runs.lengths[4096]
    runs.lengths[4096] = (result(p50=rr.ttft_ms["p50"], p99=0.0), bl)
    rr, bl = runs.models["m8"]
    runs.models["m8"] = (result(p50=rr.ttft_ms["p50"], p99=math.nan), bl)
    runs.hot_affinity["closed loop"] = result(hit=0.95, p95=0.0, p99=math.nan, share=0.78)
    judged = judge(CLAIMS, runs)
    got = {j.check.figure: (j.simulated, j.verdict) for j in judged}
    for figure in [
        "P99 TTFT, prefix-affinity / round-robin",
        "throughput, bounded-load / round-robin",
        "steps along 2K → 16K where bounded-load / round-robin P99 TTFT rises",
        "steps along 8B → 70B where bounded-load / round-robin P99 TTFT rises",
        "route() time in % of llama-3-8b's P99 TTFT gain (the overhead cancels the gain at ≥ 100 %)",
        "closed loop: P95 TTFT improvement of the 2× fallback",
        "closed loop: P99 TTFT improvement of the 2× fallback",
    ]:
        value, verdict = got[figure]
        assert math.isnan(value) and verdict == "not reproduced", figure
    # The figures that need no such ratio are as before.
    assert got["steps along 2K → 16K where bounded-load's p50 TTFT gain over round-robin shrinks"] == (
        1.0,
        "not reproduced",
    )
    page = render(runs, judged, tmp_path)
    assert "| P99 TTFT, prefix-affinity / round-robin | 0.15× | – | not reproduced |" in page
    assert "| 4,096 | 50.0 % | 50.0 % | 1,000 | 800 | 200 | – | 1.00× |" in page
    assert "| bounded-load 2× | 88.0 % | 600 | 1,000 | 10.00 | 12 % | – | – |" in page
    assert "| round-robin | 0.00 | – | 1 | $2 |" in page


def _verdict(rule: Rule, published: float, simulated: float, no_effect: float | None = None) -> str:
    check = Check("x", published, lambda _runs: simulated, rule, "×", no_effect)
    return judge([Claim(0, "claim", (check,))], StudyRuns(requests=1))[0].verdict


@pytest.mark.parametrize(
    ("rule", "published", "simulated", "no_effect", "verdict"),
    [
        (Rule.FACTOR, 2.0, 3.0, None, "reproduced"),  # exactly 1.5x above
        # Was "not reproduced": log(2 / 3) is one ulp past -log(1.5), so "within a factor of 1.5" held one way only.
        (Rule.FACTOR, 3.0, 2.0, None, "reproduced"),  # exactly 1.5x below
        (Rule.FACTOR, 150.0, 100.0, None, "reproduced"),
        (Rule.FACTOR, 2.0, 3.0001, None, "not reproduced"),
        (Rule.FACTOR, 0.0, 0.0, None, "not reproduced"),  # no ratio to a published zero
        (Rule.FACTOR, 0.0, 1.0, -1.0, "direction only"),
        (Rule.FACTOR, -2.0, -2.5, None, "reproduced"),  # a published fall, simulated a little larger
        (Rule.FACTOR, 0.5, 1.0, 1.0, "not reproduced"),  # at "no effect" is no direction
        (Rule.FACTOR, 0.5, math.inf, 1.0, "not reproduced"),
        (Rule.FACTOR, 1.0, 3.0, 1.0, "not reproduced"),  # a published "no effect" has no direction
        (Rule.POINTS, 91.0, 86.0, None, "reproduced"),  # exactly 5 points
        (Rule.POINTS, 91.0, 96.0, None, "reproduced"),
        (Rule.POINTS, 91.0, 96.5, None, "not reproduced"),
        (Rule.POINTS, 91.0, 50.0, 0.0, "direction only"),
        (Rule.AT_LEAST, 36.0, 36.0, 0.0, "reproduced"),
        (Rule.AT_LEAST, 36.0, 35.9, None, "not reproduced"),
        (Rule.AT_LEAST, 36.0, math.nan, 0.0, "not reproduced"),
        (Rule.AT_MOST, 5.0, 5.0, None, "reproduced"),
        (Rule.AT_MOST, 5.0, 4.0, None, "reproduced"),
        (Rule.AT_MOST, 5.0, 6.0, 10.0, "direction only"),
        (Rule.AT_MOST, 5.0, -math.inf, None, "reproduced"),
    ],
)
def test_rule_boundaries(rule: Rule, published: float, simulated: float, no_effect: float | None, verdict: str) -> None:
    assert _verdict(rule, published, simulated, no_effect) == verdict


def test_a_claim_takes_its_worst_verdict_and_only_its_own() -> None:
    def check(value: float) -> Check:
        return Check("x", 1.0, lambda _runs: value, Rule.FACTOR, "×", 0.0)

    mixed = Claim(1, "mixed", (check(1.0), check(3.0)))  # reproduced, direction only
    bad = Claim(2, "bad", (check(3.0), check(-1.0), check(1.0)))  # direction only, not reproduced, reproduced
    good = Claim(3, "good", (check(1.1),))
    judged: list[Judged] = judge([mixed, bad, good], StudyRuns(requests=1))
    assert [verdict_of(judged, c) for c in (mixed, bad, good)] == ["direction only", "not reproduced", "reproduced"]


def test_the_page_writes_each_figure_as_worked_out_by_hand(tmp_path: Path) -> None:
    runs = hand_made_runs()
    runs.decode_step_ms = 31.0
    runs.tp = {"m8": 1, "m13": 1, "m34": 2, "m70": 4}
    runs.kv_tokens = {"m8": 123_456, "m13": 80_000, "m34": 60_000, "m70": 40_000}
    runs.kv_bytes_ratio_13b_8b = 1.625
    runs.route_ms = 0.25  # 0.5 % of m8's 50 ms P99 gain
    page = render(runs, judge(CLAIMS, runs), tmp_path)
    assert page.endswith("| $2 |\n") and not page.endswith("\n\n")  # one newline at the end, no blank line
    lines = set(page.splitlines())
    expected_lines = [
        # The verdict of each claim, and of each figure in every unit the checks use.
        "| 1 | " + CLAIMS[0].statement + " | **direction only** |",
        "| 7 | " + CLAIMS[6].statement + " | **reproduced** |",
        "| P99 TTFT, prefix-affinity / round-robin | 0.15× | 0.20× | reproduced |",
        "| hit rate gain, bounded-load (points) | +85.0 | +75.0 | reproduced |",
        "| round-robin throughput | 36.30 req/s | 30.00 req/s | reproduced |",
        "| round-robin P99 TTFT | 6,800 ms | 6,000 ms | reproduced |",
        "| 16K hit ms (alone, no queueing) | 461 ms | 300 ms | not reproduced |",
        "| steps along 8B → 70B where bounded-load's p50 TTFT gain over round-robin shrinks | 0 | 1 | not reproduced |",
        "| route() time in % of llama-3-8b's P99 TTFT gain (the overhead cancels the gain at ≥ 100 %) "
        "| 100.0 % | 0.5 % | not reproduced |",
        "| open loop 3 req/s: P95 TTFT improvement of the 2× fallback | 36.0 % | -12.5 % | not reproduced |",
        # §1: published and simulated side by side.
        "| prefix-affinity | 97.5 % | 90.0 % | 1,000 | 1,200 | 44.4 | 40.00 |",
        "| bounded-load | 97.5 % | 85.0 % | 1,000 | 3,000 | 44.4 | 36.00 |",
        # §2: hit / miss.
        "| 16,384 | 1,000 | 300 | 0.30× |",
        # §3 and §4: gains and ratios per prefix length and per model.
        "| 8,192 | 50.0 % | 50.0 % | 1,000 | 850 | 150 | 0.85× | 1.00× |",
        "| m34 (tp2) | 60K | 50.0 % | 50.0 % | 40 | 0.50× | 1.00× |",
        # §5: the shared-prefix hit rate counts the "shared" tag only: 95 of 100 tokens.
        "| 50 % | 30.0 % | 88.0 % | 95.0 % | 1.00× | 1.00× |",
        # §6: improvements over prefix-affinity: 1 - 600 / 1000 and 1 - 1100 / 1000.
        "| prefix-affinity | 95.0 % | 1,000 | 2,000 | 10.00 | 78 % |  |  |",
        "| bounded-load 2× | 88.0 % | 600 | 1,000 | 10.00 | 12 % | +40 % | +50 % |",
        "| bounded-load 2× | 70.0 % | 900 | 1,100 | 10.00 | 12 % | -12 % | -10 % |",
        # §7: hits 0.2 and 0.4 above the threshold, 0.5, 0.8 and 1.0 (a zero p50 included) at or below it.
        "| P99/P50 > 5 | 2 | 30.0 % | 12.5 % |",
        "| P99/P50 ≤ 5 | 3 | 76.7 % | 12.5 % |",
        # §8: 8 GPUs at $2 an hour over 30 req/s is $148 per million requests.
        "| round-robin | 30.00 | $148 | 1 | $2 |",
        "| prefix-affinity | 40.00 | $111 | 1 | $2 |",
    ]
    for line in expected_lines:
        assert line in lines, line
    for sentence in [
        "(seed 0, 10 requests per run, 5 runs)",
        "Simulated round-robin throughput is 0.83× the published one.",
        "takes 31 ms in the calibrated model, while 36.3 req/s from 30 closed-loop users means 0.83 s per request",
        "KV residency under round-robin is 10.0 % here.",
        "The published hits cost 70% (8K) and 56% (16K) of a miss; the model's full-prefix hits cost 75% and 30%.",
        "From 8K to 16K the model's miss grows 1.67× (published 1.28×;",
        "CodeLlama-13B's KV takes 1.6× the bytes per token of m8's, so a m8 engine holds 123K tokens, and "
        "round-robin already reaches 50.0 % hits there.",
        "measured in this run at 0.25 ms (median;",
        "Over every run of this study (5):",
    ]:
        assert sentence in page, sentence
    for image in ("study-seed.png", "study-sweeps.png"):
        assert (tmp_path / image).read_bytes()[:4] == b"\x89PNG"


def test_the_page_writes_figures_that_are_no_number_as_such(tmp_path: Path) -> None:
    runs = hand_made_runs()
    runs.tp = dict.fromkeys(runs.models, 1)
    runs.kv_tokens = dict.fromkeys(runs.models, 1000)
    rr, _bl = runs.models["m8"]
    runs.models["m8"] = (rr, result(p50=rr.ttft_ms["p50"], p99=rr.ttft_ms["p99"]))  # no P99 gain: overhead share ∞
    runs.all = [("a", result(p50=100.0, p99=100.0))]  # one side of the P99/P50 split empty: no gap
    runs.lengths[2048] = (result(p99=math.nan, rps=0.0), result(p99=50.0, rps=1.0))  # ratios to no number and zero
    runs.seed["bounded-load"] = result("bounded-load", hit=0.85, p99=math.nan, rps=36.0)  # no request finished
    page = render(runs, judge(CLAIMS, runs), tmp_path)
    # Was: "nan %" and "nan" in the tables, where the checks' table already wrote "–".
    assert "| bounded-load | 97.5 % | 85.0 % | 1,000 | – | 44.4 | 36.00 |" in page
    assert "the overhead cancels the gain at ≥ 100 %) | 100.0 % | ∞ | reproduced |" in page
    assert "(points; the claim: below 0) | +0.0 | – | not reproduced |" in page
    assert "| P99/P50 > 5 | 0 | – | – |" in page
    assert "| 2,048 | 50.0 % | 50.0 % | 100 | 100 | 0 | – | – |" in page


def test_the_page_ends_with_the_hot_prefix_the_rule_and_the_dollars_as_worked_out(tmp_path: Path) -> None:
    # §6 to §8 whole: each section's checks table lists its own figures only, every table has its header row (in
    # the order of its columns), its separator and one blank line before it (Markdown renders no table glued to a
    # paragraph), and the page ends in one newline.
    runs = hand_made_runs()
    runs.tp = dict.fromkeys(runs.models, 1)
    runs.kv_tokens = dict.fromkeys(runs.models, 1000)
    runs.seed["bounded-load"] = result("bounded-load", rps=0.01)  # $16 an hour for 36 requests: $444,444 a million
    page = render(runs, judge(CLAIMS, runs), tmp_path)
    hot_header = "| policy | KV hit | P95 ms | P99 ms | req/s | max share | P95 improvement | P99 improvement |\n"
    assert page[page.index("## 6. ") :] == (
        "## 6. Hot prefix, with and without the load fallback\n"
        "\n"
        "`hot-prefix` (80 % of traffic on one 4K-token system prompt), closed loop (30 users) and open loop "
        "(Poisson, 3 req/s):\n"
        "\n"
        "**closed loop**\n"
        "\n" + hot_header + "|---|---|---|---|---|---|---|---|\n"
        "| prefix-affinity | 95.0 % | 1,000 | 2,000 | 10.00 | 78 % |  |  |\n"
        "| bounded-load 1.25× | 0.0 % | 1 | 1 | 10.00 | 12 % | +100 % | +100 % |\n"
        "| bounded-load 2× | 88.0 % | 600 | 1,000 | 10.00 | 12 % | +40 % | +50 % |\n"
        "\n"
        "**open loop 3 req/s**\n"
        "\n" + hot_header + "|---|---|---|---|---|---|---|---|\n"
        "| prefix-affinity | 90.0 % | 800 | 1,000 | 10.00 | 50 % |  |  |\n"
        "| bounded-load 1.25× | 0.0 % | 1 | 1 | 10.00 | 12 % | +100 % | +100 % |\n"
        "| bounded-load 2× | 70.0 % | 900 | 1,100 | 10.00 | 12 % | -12 % | -10 % |\n"
        "\n"
        "| figure | published | simulated | verdict |\n"
        "|---|---|---|---|\n"
        "| closed loop: prefix-affinity's busiest GPU share | 80.0 % | 78.0 % | reproduced |\n"
        "| closed loop: hit rate the 2× fallback costs (points) | +5.0 | +7.0 | reproduced |\n"
        "| closed loop: P95 TTFT improvement of the 2× fallback | 36.0 % | 40.0 % | reproduced |\n"
        "| closed loop: P99 TTFT improvement of the 2× fallback | 45.0 % | 50.0 % | reproduced |\n"
        "| open loop 3 req/s: prefix-affinity's busiest GPU share | 80.0 % | 50.0 % | not reproduced |\n"
        "| open loop 3 req/s: hit rate the 2× fallback costs (points) | +5.0 | +20.0 | not reproduced |\n"
        "| open loop 3 req/s: P95 TTFT improvement of the 2× fallback | 36.0 % | -12.5 % | not reproduced |\n"
        "| open loop 3 req/s: P99 TTFT improvement of the 2× fallback | 45.0 % | -10.0 % | not reproduced |\n"
        "\n"
        "![sweeps](study-sweeps.png)\n"
        "\n"
        "## 7. The P99/P50 > 5 rule\n"
        "\n"
        "Over every run of this study (5):\n"
        "\n"
        "| runs | count | mean KV hit rate | mean max backend share |\n"
        "|---|---|---|---|\n"
        "| P99/P50 > 5 | 2 | 30.0 % | 12.5 % |\n"
        "| P99/P50 ≤ 5 | 3 | 76.7 % | 12.5 % |\n"
        "\n"
        "| figure | published | simulated | verdict |\n"
        "|---|---|---|---|\n"
        "| mean KV hit rate of runs with P99/P50 > 5 minus that of the others (points; the claim: below 0) "
        "| +0.0 | -46.7 | reproduced |\n"
        "\n"
        "## 8. Dollars per month\n"
        "\n"
        "`seed` at $2 per GPU-hour: what a million requests cost on the 8-GPU fleet at each policy's throughput, "
        "and the GPU time spent prefilling prefixes another GPU held at the time, scaled to a 30-day month of the "
        "same traffic.\n"
        "\n"
        "| policy | req/s | $ per million requests | recompute GPU-s in run | recompute $/month |\n"
        "|---|---|---|---|---|\n"
        "| round-robin | 30.00 | $148 | 1 | $2 |\n"
        "| prefix-affinity | 40.00 | $111 | 1 | $2 |\n"
        "| bounded-load | 0.01 | $444,444 | 1 | $2 |\n"
    )


@pytest.mark.parametrize(
    ("value", "unit", "shown"),
    [
        (0.25, "%", "0.25 %"),  # under 1 %: two significant digits, so a small share is not "0.2 %" or "0.0 %"
        (0.0, "%", "0.0 %"),
        (1.0, "%", "1.0 %"),
        (-0.5, "%", "-0.5 %"),
        (12.345, "%", "12.3 %"),
        (0.147, "×", "0.15×"),
        (6800.4, "ms", "6,800 ms"),
        (36.3, "req/s", "36.30 req/s"),
        (-46.66, "points", "-46.7"),
        (3.0, "count", "3"),
        (math.nan, "%", "–"),
        (math.inf, "%", "∞"),
    ],
)
def test_each_unit_is_written_as_the_page_states_it(value: float, unit: str, shown: str) -> None:
    assert _value(value, unit) == shown


def test_every_table_and_heading_of_the_page_stands_in_its_own_block(tmp_path: Path) -> None:
    # Markdown (Python-Markdown, which the docs use) renders a table or a heading glued to the line above as text.
    runs = hand_made_runs()
    runs.tp = dict.fromkeys(runs.models, 1)
    runs.kv_tokens = dict.fromkeys(runs.models, 1000)
    lines = render(runs, judge(CLAIMS, runs), tmp_path).split("\n")
    tables = [i for i in range(1, len(lines)) if lines[i].startswith("|---")]
    headings = [i for i, line in enumerate(lines) if line.startswith("#")]
    assert len(tables) == 17 and len(headings) == 9
    for i in tables:
        assert lines[i - 2] == "" and lines[i - 1].startswith("| "), lines[i - 1]
    for i in headings[1:]:
        assert lines[i - 1] == "" and lines[i + 1] == "", lines[i]
    assert lines[1] == ""
    images = [i for i, line in enumerate(lines) if line.startswith("![")]
    assert [lines[i] for i in images] == [
        "![seed TTFT CDF and per-backend load](study-seed.png)",
        "![sweeps](study-sweeps.png)",
    ]
    assert all(lines[i - 1] == "" and lines[i + 1] == "" for i in images)


def test_each_sections_checks_table_is_in_that_section(tmp_path: Path) -> None:
    runs = hand_made_runs()
    runs.tp = dict.fromkeys(runs.models, 1)
    runs.kv_tokens = dict.fromkeys(runs.models, 1000)
    judged = judge(CLAIMS, runs)
    page = render(runs, judged, tmp_path)
    sections = page.split("\n## ")[1:]  # "1. The 8-GPU table ...", ..., "8. Dollars per month ..."
    assert [s.split(".", 1)[0] for s in sections] == [str(n) for n in range(1, 9)]
    for j in judged:
        row = f"| {j.check.figure} | "
        assert [n for n, s in enumerate(sections, 1) if row in s] == [j.claim.section], j.check.figure
