"""The policy benchmark suite: every policy on every workload, the default judged, ``docs/policies-benchmark.md``.

``prefixroute compare --suite`` (``make policies``) runs :func:`compared_policies` on each of :func:`suite_workloads`
(the six scenarios and the repository's two real traces, each without engine metrics and with them polled every
0.1 s), ranks each workload as ``prefixroute compare`` does, and judges the default policy against issue 9's
acceptance rule (:func:`judge`). Every verdict on the page is computed by :func:`judge`; nothing is written by hand.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from prefixroute.errors import ConfigurationError
from prefixroute.sim.compare import (
    Ranking,
    compared_policies,
    default_policy_name,
    markdown_table,
    ms_cell,
    rank,
    recommendation,
    run_grid,
)
from prefixroute.sim.metrics import PolicyResult
from prefixroute.sim.runner import SimSpec
from prefixroute.sim.workloads import scenario_names

__all__ = [
    "METRICS_INTERVAL",
    "Check",
    "SuiteWorkload",
    "WorkloadVerdict",
    "judge",
    "render",
    "run_suite",
    "suite_workloads",
]

METRICS_INTERVAL = 0.1
"""Seconds between engine-metric polls in the suite's "with metrics" runs."""

MOONCAKE_TRACE = "data/mooncake-fast25/synthetic_trace.jsonl"
SPLITWISE_TRACE = "data/vidur-profiling/processed_traces/splitwise_code.csv"

# Acceptance 1 of issue 9: the default against round-robin and against the best policy on each figure.
P99_VS_BEST = 1.2
THROUGHPUT_VS_BEST = 0.97
HIT_POINTS_BELOW_BEST = 5.0


@dataclass(frozen=True)
class SuiteWorkload:
    """One workload of the suite: a name, how it is set up (a sentence for the page), and its spec."""

    name: str
    setup: str
    spec: SimSpec

    @property
    def metrics(self) -> bool:
        """Whether engine metrics are polled into the router in this workload's runs."""
        return self.spec.metrics_interval is not None

    @property
    def label(self) -> str:
        """The name plus the metrics mode, e.g. ``rag, metrics 0.1 s``."""
        return f"{self.name}, metrics {self.spec.metrics_interval:g} s" if self.metrics else self.name


def suite_workloads(*, seed: int = 0, root: Path = Path()) -> list[SuiteWorkload]:
    """The suite: every scenario (simulate's defaults) and both real traces, each without and with engine metrics.

    Scenarios run as ``prefixroute simulate --scenario S`` does (8 × codellama-13b on a100-40gb, 30 closed-loop
    users, 1,500 requests). The Mooncake trace runs at its own timestamps on 8 × llama-3-8b on h100-80gb (its prompts
    reach 191K tokens, more than a 40 GB A100's KV cache holds); the Splitwise code trace (the readable one of the
    two Splitwise files: both have arrivals and lengths only) runs at its own timestamps on the default setup.

    Raises:
        ConfigurationError: a trace file is missing under ``root`` (run from the repository root).
    """
    for trace in (MOONCAKE_TRACE, SPLITWISE_TRACE):
        if not (root / trace).is_file():
            raise ConfigurationError(f"the suite needs {trace}: run it from the repository root")
    base: list[SuiteWorkload] = [
        SuiteWorkload(
            scenario,
            "8 × codellama-13b on a100-40gb, 30 closed-loop users, 1,500 requests",
            SimSpec(scenario=scenario, seed=seed),
        )
        for scenario in scenario_names()
    ]
    base.append(
        SuiteWorkload(
            "mooncake trace",
            "Mooncake FAST'25 synthetic trace (3,993 requests) at its own timestamps, 8 × llama-3-8b on h100-80gb",
            SimSpec(
                trace=f"mooncake:{root / MOONCAKE_TRACE}",
                users=None,
                requests=None,
                model="llama-3-8b",
                gpu="h100-80gb",
                seed=seed,
            ),
        )
    )
    base.append(
        SuiteWorkload(
            "splitwise code trace",
            "Splitwise code trace (8,819 requests, no shared prefixes) at its own timestamps, "
            "8 × codellama-13b on a100-40gb",
            SimSpec(trace=f"splitwise:{root / SPLITWISE_TRACE}", users=None, requests=None, seed=seed),
        )
    )
    with_metrics = [SuiteWorkload(w.name, w.setup, w.spec.with_(metrics_interval=METRICS_INTERVAL)) for w in base]
    return [*base, *with_metrics]


@dataclass(frozen=True)
class Check:
    """One acceptance check: what it compares, the figure, the target, and whether the figure meets it."""

    name: str
    value: float
    target: float
    passed: bool


@dataclass(frozen=True)
class WorkloadVerdict:
    """The default policy on one workload: its result, the figures it is judged against, and the four checks."""

    workload: SuiteWorkload
    ranking: Ranking
    default: PolicyResult
    round_robin: PolicyResult
    best_p99: PolicyResult
    best_throughput: PolicyResult
    best_hit: PolicyResult
    checks: tuple[Check, ...]

    @property
    def passed(self) -> bool:
        """Whether the default meets every check on this workload."""
        return all(c.passed for c in self.checks)


def judge(workload: SuiteWorkload, results: Sequence[PolicyResult], *, default: str) -> WorkloadVerdict:
    """Judge ``default`` on one workload's results against issue 9's acceptance 1.

    The four checks: P99 TTFT ≤ round-robin's; P99 TTFT ≤ 1.2 × the lowest P99 of all policies; throughput ≥ 0.97 ×
    the highest; KV hit rate ≥ the highest − 5 points. "All policies" are the ``results`` given, the default
    included. A run that served nothing (NaN) fails every check it enters. O(len(results)).

    Raises:
        ConfigurationError: ``default`` or ``round-robin`` is not among ``results``.
    """
    by_name = {r.policy: r for r in results}
    for needed in (default, "round-robin"):
        if needed not in by_name:
            raise ConfigurationError(f"cannot judge {workload.label}: no result for {needed!r}")
    mine, rr = by_name[default], by_name["round-robin"]
    best_p99 = min(results, key=lambda r: _or_inf(r.ttft_ms["p99"]))
    best_rate = max(results, key=lambda r: r.throughput_rps)
    best_hit = max(results, key=lambda r: r.hit_rate)
    p99 = mine.ttft_ms["p99"]
    vs_rr = p99 / rr.ttft_ms["p99"]
    vs_best = p99 / best_p99.ttft_ms["p99"]
    rate = mine.throughput_rps / best_rate.throughput_rps if best_rate.throughput_rps else math.nan
    hit_points = 100 * (mine.hit_rate - best_hit.hit_rate)
    checks = (
        Check("P99 ≤ round-robin", vs_rr, 1.0, vs_rr <= 1.0),
        Check(f"P99 ≤ {P99_VS_BEST:g}× best", vs_best, P99_VS_BEST, vs_best <= P99_VS_BEST),
        Check(f"req/s ≥ {THROUGHPUT_VS_BEST:g}× best", rate, THROUGHPUT_VS_BEST, rate >= THROUGHPUT_VS_BEST),
        Check(
            f"hit ≥ best − {HIT_POINTS_BELOW_BEST:g} points",
            hit_points,
            -HIT_POINTS_BELOW_BEST,
            hit_points >= -HIT_POINTS_BELOW_BEST,
        ),
    )
    return WorkloadVerdict(
        workload=workload,
        ranking=rank(results),
        default=mine,
        round_robin=rr,
        best_p99=best_p99,
        best_throughput=best_rate,
        best_hit=best_hit,
        checks=checks,
    )


def _or_inf(value: float) -> float:
    return math.inf if math.isnan(value) else value


def run_suite(
    output: Path,
    *,
    seed: int = 0,
    jobs: int = 2,
    root: Path = Path(),
    progress: Callable[[str], None] = lambda _m: None,
) -> tuple[Path, list[WorkloadVerdict]]:
    """Run every policy on every suite workload, judge the default, write the page at ``output`` and its plot.

    The plot goes next to the page (``output`` with the suffix ``.png``). Takes a few minutes on two cores (16
    workloads × every policy; ``jobs`` processes).

    Raises:
        ConfigurationError: a trace is missing, ``jobs`` is not a positive int, or ``output`` is a folder.
        OSError: the page or the plot cannot be written.
    """
    workloads = suite_workloads(seed=seed, root=root)
    policies = compared_policies()
    default = default_policy_name()
    runs = [(w.spec, name) for w in workloads for name in policies]
    # The traces take longest: start them first so the pool's last minutes are not one process on one trace.
    order = sorted(range(len(runs)), key=lambda i: runs[i][0].trace is None)
    started = time.perf_counter()
    done = [0]

    def on_done(_index: int, result: PolicyResult) -> None:
        done[0] += 1
        progress(f"[{done[0]}/{len(runs)}] {result.policy}")

    ordered = run_grid([runs[i] for i in order], jobs=jobs, on_done=on_done)
    results: list[PolicyResult | None] = [None] * len(runs)
    for position, index in enumerate(order):
        results[index] = ordered[position]
    wall = time.perf_counter() - started
    verdicts = []
    for k, workload in enumerate(workloads):
        chunk = [r for r in results[k * len(policies) : (k + 1) * len(policies)] if r is not None]
        verdicts.append(judge(workload, chunk, default=default))
    plot = output.with_suffix(".png")
    write_suite_plot(plot, verdicts, default=default)
    page = render(verdicts, default=default, plot=plot.name, wall_s=wall, runs=len(runs), jobs=jobs)
    from prefixroute.sim.report import write_text

    write_text(output, page)
    return output, verdicts


def render(
    verdicts: Sequence[WorkloadVerdict], *, default: str, plot: str | None, wall_s: float, runs: int, jobs: int
) -> str:
    """The Markdown page: the rule, the summary of verdicts, then every workload's ranked table."""
    passed = sum(v.passed for v in verdicts)
    lines = [
        "# Policy benchmark",
        "",
        "<!-- Generated by `make policies` (`prefixroute compare --suite`): edit prefixroute/sim/suite.py, not this "
        "page. -->",
        "",
        f"Every built-in and baseline policy on every workload of the suite, seed 0. The default policy is "
        f"**{default}** (what `Router()` uses). Run the same comparison on your own traffic with "
        "`prefixroute compare --trace mooncake:FILE.jsonl` (or `--scenario`, with every option of "
        "`prefixroute simulate`); see [the simulator](simulator.md).",
        "",
        "**Ranking and recommendation.** A policy is eligible when it keeps at least 97 % of the best throughput on "
        "the workload; the recommendation is the eligible policy with the lowest P99 TTFT (ties: P50, then hit "
        "rate). Tables list eligible policies first, by P99; a rank in parentheses is a policy that lost more than "
        "3 % of throughput.",
        "",
        f"**Acceptance** (issue 9): on every workload, the default's P99 TTFT ≤ round-robin's and ≤ {P99_VS_BEST:g}× "
        f"the best policy's, its throughput ≥ {THROUGHPUT_VS_BEST:g}× the best, its KV hit rate ≥ the best − "
        f"{HIT_POINTS_BELOW_BEST:g} points; with engine metrics, against every policy run with metrics.",
        "",
        "## Summary",
        "",
        f"The default meets every check on **{passed} of {len(verdicts)}** workloads.",
        "",
        "| workload | metrics | default P99 ms | ÷ round-robin | ÷ best (policy) | req/s ÷ best | hit − best "
        "(points) | P99 ≤ RR | P99 ≤ 1.2× best | req/s ≥ 0.97× | hit ≥ best − 5 | verdict | recommended |",
        "|---|---|---:|---:|---:|---:|---:|---|---|---|---|---|---|",
    ]
    for v in verdicts:
        rr, best, rate, hit = v.checks
        lines.append(
            "| "
            + " | ".join(
                [
                    v.workload.name,
                    f"{v.workload.spec.metrics_interval:g} s" if v.workload.metrics else "off",
                    ms_cell(v.default.ttft_ms["p99"]),
                    f"{rr.value:.2f}×",
                    f"{best.value:.2f}× ({v.best_p99.policy})",
                    f"{rate.value:.2f}×",
                    f"{hit.value:+.1f}",
                    *(_mark(c) for c in v.checks),
                    "**PASS**" if v.passed else "**MISS**",
                    v.ranking.recommended.policy,
                ]
            )
            + " |"
        )
    if plot is not None:
        lines += ["", f"![The default's P99 TTFT against round-robin and the best policy]({plot})"]
    lines += ["", *_across_the_suite(verdicts, default=default)]
    for v in verdicts:
        lines += [
            "",
            f"## {v.workload.label}",
            "",
            v.workload.setup
            + (f"; engine metrics polled every {v.workload.spec.metrics_interval:g} s." if v.workload.metrics else "."),
            "",
            markdown_table(v.ranking, default=default),
            "",
            recommendation(v.ranking, default=default),
        ]
        rejected = sorted({r.rejected for r in v.ranking.results} - {0})
        if rejected:
            lines += ["", f"Requests rejected (longer than one engine's KV cache): {', '.join(map(str, rejected))}."]
    lines += [
        "",
        "## How long it takes",
        "",
        f"{runs} simulations in {wall_s:.0f} s wall time on {jobs} processes.",
    ]
    return "\n".join(lines) + "\n"


def _across_the_suite(verdicts: Sequence[WorkloadVerdict], *, default: str) -> list[str]:
    """Each policy over all workloads: how often recommended, its median and worst P99 ÷ best, its lowest req/s."""
    names = [r.policy for r in verdicts[0].ranking.results] if verdicts else []
    rows = []
    for name in names:
        p99_ratios, rate_ratios, recommended = [], [], 0
        for v in verdicts:
            mine = v.ranking.of(name)
            if mine is None:
                continue
            p99_ratios.append(_or_inf(mine.ttft_ms["p99"]) / v.ranking.best_p99_ms)
            rate_ratios.append(mine.throughput_rps / v.ranking.best_throughput if v.ranking.best_throughput else 0.0)
            recommended += v.ranking.recommended.policy == name
        rows.append((max(p99_ratios), statistics.median(p99_ratios), min(rate_ratios), recommended, name))
    lines = [
        "### Across the suite",
        "",
        "Each policy over all workloads, ordered by its worst P99 TTFT ÷ the best policy's (lower is more robust).",
        "",
        "| policy | recommended on | median P99 ÷ best | worst P99 ÷ best | lowest req/s ÷ best |",
        "|---|---:|---:|---:|---:|",
    ]
    for worst, median, lowest_rate, recommended, name in sorted(rows):
        label = f"{name} (default)" if name == default else name
        lines.append(f"| {label} | {recommended} | {median:.2f}× | {worst:.2f}× | {lowest_rate:.2f}× |")
    return lines


def _mark(check: Check) -> str:
    return "PASS" if check.passed else "MISS"


def write_suite_plot(path: Path, verdicts: Sequence[WorkloadVerdict], *, default: str) -> None:
    """Write a PNG: the default's P99 TTFT ÷ round-robin's and ÷ the best policy's, per workload (log scale)."""
    from prefixroute.sim.report import plot_file

    labels = [v.workload.label for v in verdicts]
    ys = range(len(verdicts))
    with plot_file(path, dpi=100, figsize=(10, 1 + 0.4 * len(verdicts))) as (_, axis):
        height = 0.4
        axis.barh([y - height / 2 for y in ys], [v.checks[0].value for v in verdicts], height, label="÷ round-robin")
        axis.barh([y + height / 2 for y in ys], [v.checks[1].value for v in verdicts], height, label="÷ best policy")
        axis.axvline(1.0, color="black", linewidth=1)
        axis.axvline(P99_VS_BEST, color="grey", linestyle="--", linewidth=1, label=f"{P99_VS_BEST:g}× best")
        axis.set_xscale("log")
        axis.set_yticks(list(ys), labels)
        axis.invert_yaxis()
        axis.set_xlabel(f"{default} P99 TTFT ratio (log scale; left of 1 is better)")
        axis.grid(True, axis="x", which="both", alpha=0.3)
        axis.legend(loc="lower right")
