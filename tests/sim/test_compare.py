"""``prefixroute compare``: the ranking and recommendation rule, the suite's verdicts, the command end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixroute import policy_names
from prefixroute.cli import main
from prefixroute.errors import ConfigurationError
from prefixroute.router import Router
from prefixroute.sim.baselines import BASELINES
from prefixroute.sim.compare import (
    THROUGHPUT_TOLERANCE,
    compared_policies,
    default_policy_name,
    markdown_table,
    policy_kind,
    rank,
    recommendation,
    run_grid,
)
from prefixroute.sim.metrics import PolicyResult
from prefixroute.sim.runner import SimSpec, build_policy, run_policy
from prefixroute.sim.suite import judge, render, suite_workloads

TINY = ["--requests", "24", "--users", "4", "--jobs", "1"]


def result(
    policy: str, *, p99: float, rps: float, p50: float = 10.0, hit: float = 0.5, requests: int = 100
) -> PolicyResult:
    """A hand-built result: only the figures the ranking and the verdicts read."""
    return PolicyResult(
        policy=policy,
        requests=requests,
        rejected=0,
        hit_rate=hit,
        predicted_hit_rate=hit,
        ttft_ms={"p50": p50, "p95": p99, "p99": p99},
        e2e_ms={"p50": p50, "p99": p99},
        throughput_rps=rps,
        prompt_tokens_per_s=0.0,
        backend_share={"gpu0": 1.0},
        peak_in_flight={"gpu0": 1},
        max_backend_share=1.0,
        recompute_gpu_seconds=0.0,
        recompute_usd_per_month=0.0,
        preemptions=0,
        duration_s=1.0,
    )


def test_the_recommendation_is_the_lowest_p99_within_three_percent_of_the_best_throughput() -> None:
    results = [
        result("fast-tail-slow-rate", p99=100, rps=9.6),  # 4 % below the best throughput: not eligible
        result("best-rate", p99=400, rps=10.0),
        result("good", p99=300, rps=9.75),  # 2.5 % below: eligible, and the lowest eligible P99
        result("worse", p99=350, rps=9.9),
    ]
    ranking = rank(results)
    assert [r.policy for r in ranking.results] == ["good", "worse", "best-rate", "fast-tail-slow-rate"]
    assert ranking.recommended.policy == "good"
    assert ranking.best_throughput == 10.0 and ranking.best_p99_ms == 100
    assert not ranking.eligible(ranking.of("fast-tail-slow-rate"))  # type: ignore[arg-type]
    assert ranking.position("best-rate") == 3 and ranking.position("absent") is None
    # With a looser floor the fast tail wins.
    assert rank(results, tolerance=0.05).recommended.policy == "fast-tail-slow-rate"


def test_ties_break_on_p50_then_hit_rate_then_name() -> None:
    ranking = rank(
        [
            result("b", p99=100, rps=1.0, p50=20, hit=0.9),
            result("c", p99=100, rps=1.0, p50=10, hit=0.1),
            result("a", p99=100, rps=1.0, p50=20, hit=0.9),
            result("d", p99=100, rps=1.0, p50=20, hit=0.95),
        ]
    )
    assert [r.policy for r in ranking.results] == ["c", "d", "a", "b"]


def test_a_policy_that_served_nothing_ranks_last_and_is_never_recommended() -> None:
    empty = result("empty", p99=math.nan, rps=0.0, p50=math.nan, requests=0)
    ranking = rank([empty, result("slow", p99=5000, rps=0.5)])
    assert [r.policy for r in ranking.results] == ["slow", "empty"]
    alone = rank([empty])
    assert not alone.eligible(alone.recommended)
    assert recommendation(alone).startswith("No recommendation")


@pytest.mark.parametrize(
    ("results", "tolerance", "message"),
    [
        ([], THROUGHPUT_TOLERANCE, "nothing to rank"),
        ([result("a", p99=1, rps=1), result("a", p99=2, rps=1)], THROUGHPUT_TOLERANCE, "repeated: a"),
        ([result("a", p99=1, rps=1)], 1.0, "tolerance must be in [0, 1)"),
        ([result("a", p99=1, rps=1)], -0.1, "tolerance must be in [0, 1)"),
    ],
)
def test_rank_rejects_bad_input(results: list[PolicyResult], tolerance: float, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        rank(results, tolerance=tolerance)


figures = st.tuples(
    st.floats(min_value=1, max_value=1e6), st.floats(min_value=0.01, max_value=100), st.floats(min_value=0, max_value=1)
)


@settings(max_examples=200, deadline=None)
@given(st.lists(figures, min_size=1, max_size=12))
def test_ranking_properties(rows: list[tuple[float, float, float]]) -> None:
    results = [result(f"p{i}", p99=p99, rps=rps, hit=hit) for i, (p99, rps, hit) in enumerate(rows)]
    ranking = rank(results)
    assert sorted(r.policy for r in ranking.results) == sorted(r.policy for r in results)
    best = ranking.recommended
    assert ranking.eligible(best)  # the best-throughput policy is always eligible, so one always is
    assert best.throughput_rps >= (1 - THROUGHPUT_TOLERANCE) * max(rps for _, rps, _ in rows)
    assert all(best.ttft_ms["p99"] <= r.ttft_ms["p99"] for r in results if ranking.eligible(r))
    flags = [ranking.eligible(r) for r in ranking.results]
    assert flags == sorted(flags, reverse=True)  # every eligible policy before every other
    rows_md = markdown_table(ranking).splitlines()[2:]
    assert len(rows_md) == len(results) and rows_md[0].startswith("| **1**")


def test_every_built_in_and_baseline_is_compared_and_the_default_is_the_routers() -> None:
    names = compared_policies()
    assert names[: len(policy_names())] == policy_names()
    assert names[len(policy_names()) :] == list(BASELINES)
    assert default_policy_name() == Router().policy.name
    assert default_policy_name() in names
    assert {policy_kind(n) for n in names} == {"built-in", "baseline"}
    assert policy_kind("mypkg:Mine") == "user"


@pytest.mark.parametrize("name", list(BASELINES))
def test_baselines_are_selectable_by_name_and_seeded(name: str) -> None:
    assert isinstance(build_policy(name, seed=1), BASELINES[name])
    spec = SimSpec(requests=40, users=6)
    assert run_policy(spec, name).to_json() == run_policy(spec, name).to_json()


def test_a_process_pool_gives_the_results_of_one_process() -> None:
    runs = [(SimSpec(requests=30, users=5), name) for name in ("round-robin", "sglang", "predicted-ttft")]
    seen: list[int] = []
    pooled = run_grid(runs, jobs=2, on_done=lambda i, _r: seen.append(i))
    serial = run_grid(runs, jobs=1)
    assert [r.to_json() for r in pooled] == [r.to_json() for r in serial]
    assert [r.policy for r in pooled] == ["round-robin", "sglang", "predicted-ttft"]
    assert sorted(seen) == [0, 1, 2]
    with pytest.raises(ConfigurationError, match="--jobs must be a positive int"):
        run_grid(runs, jobs=0)


def test_compare_command_ranks_recommends_and_writes_json_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json, out_png = tmp_path / "c.json", tmp_path / "c.png"
    argv = ["compare", *TINY, "--policy", "round-robin", "--policy", "dynamo", "--policy", "prefix-affinity"]
    assert main([*argv, "--json", str(out_json), "--plot", str(out_png)]) == 0
    out = capsys.readouterr().out
    document = json.loads(out_json.read_text())
    ranked = [r["policy"] for r in document["results"]]
    assert sorted(ranked) == ["dynamo", "prefix-affinity", "round-robin"]
    assert document["recommended"] == ranked[0]
    assert document["default"] == default_policy_name()
    assert f"Recommended: {ranked[0]}" in " ".join(out.split())
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The recommendation follows the rule on the figures the command wrote.
    best = max(r["throughput_rps"] for r in document["results"])
    eligible = [r for r in document["results"] if r["throughput_rps"] >= (1 - THROUGHPUT_TOLERANCE) * best]
    assert document["recommended"] == min(eligible, key=lambda r: r["ttft_ms"]["p99"])["policy"]


def test_compare_runs_every_policy_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", "--requests", "12", "--users", "3", "--jobs", "2"]) == 0
    out = capsys.readouterr().out
    for name in compared_policies():
        assert f" {name} " in out


def _fails_with_one_line(argv: list[str], capsys: pytest.CaptureFixture[str], expected: str) -> None:
    status = main(argv)
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.endswith("\n") and err.count("\n") == 1, f"not one line: {err!r}"
    assert err.startswith("prefixroute compare: "), err
    assert expected in err, err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--policy", "nope"], "unknown policy 'nope'"),
        (["--policy", "all", "--policy", "nope"], "unknown policy 'nope'"),
        (["--jobs", "0"], "--jobs must be a positive int, not 0"),
        (["--jobs", "many"], "invalid int value"),
        (["--output", "x.md"], "--output goes with --suite"),
        (["--suite", "--scenario", "rag"], "not allowed with argument"),
        (["--suite", "--users", "5"], "--suite fixes each workload's settings: drop --users"),
        (["--suite", "--policy", "dynamo"], "drop --policy"),
        (["--suite", "--metrics-interval", "0.5"], "drop --metrics-interval"),
        (["--suite", "--no-first-token"], "drop --no-first-token"),
        (["--scenario", "nope"], "invalid choice: 'nope'"),
        (["--metrics-interval", "0"], "--metrics-interval must be a finite number > 0"),
        (["--trace", "mooncake:/nonexistent/trace.jsonl"], "cannot read trace /nonexistent/trace.jsonl"),
        (["--model", "gpt-5"], "unknown model 'gpt-5'"),
    ],
)
def test_compare_bad_input(argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    base = [] if "--suite" in argv else TINY  # the suite rejects --users and --requests first
    _fails_with_one_line(["compare", *base, *argv], capsys, expected)
    assert "Recommended" not in capsys.readouterr().out  # nothing ran


def test_compare_malformed_trace_fails_before_any_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 10}\n')
    _fails_with_one_line(["compare", "--trace", f"mooncake:{path}", "--jobs", "2"], capsys, "bad.jsonl:1")


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_compare_output_paths_checked_before_the_run(
    option: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _fails_with_one_line(["compare", *TINY, option, str(tmp_path)], capsys, "is a folder")


def test_suite_output_that_is_a_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fails_with_one_line(["compare", "--suite", "--output", str(tmp_path)], capsys, "is a folder")


def test_the_suite_covers_every_scenario_and_both_traces_with_and_without_metrics(data_dir: Path) -> None:
    workloads = suite_workloads(root=data_dir.parent)
    names = [w.name for w in workloads]
    assert names[:8] == names[8:]
    assert names[:6] == ["seed", "hot-prefix", "shared-prefix", "multi-turn", "rag", "system-prompt"]
    assert names[6:8] == ["mooncake trace", "splitwise code trace"]
    assert [w.spec.metrics_interval for w in workloads] == [None] * 8 + [0.1] * 8
    assert all(w.spec.seed == 0 for w in workloads)
    with pytest.raises(ConfigurationError, match="run it from the repository root"):
        suite_workloads(root=data_dir / "nowhere")


@pytest.mark.parametrize(
    ("mine", "verdicts"),
    [
        # P99 vs round-robin 1000/1000 (=), vs best 1000/850 = 1.18, rate 9.7/10 = 0.97, hit 0.80 vs 0.85: −5 points.
        (result("mine", p99=1000, rps=9.7, hit=0.80), ("PASS", "PASS", "PASS", "PASS")),
        (result("mine", p99=1001, rps=9.7, hit=0.80), ("MISS", "PASS", "PASS", "PASS")),
        (result("mine", p99=1000, rps=9.69, hit=0.80), ("PASS", "PASS", "MISS", "PASS")),
        (result("mine", p99=1000, rps=9.7, hit=0.7999), ("PASS", "PASS", "PASS", "MISS")),
        (result("mine", p99=900, rps=10, hit=0.9), ("PASS", "PASS", "PASS", "PASS")),
    ],
)
def test_judge_applies_issue_9_acceptance_at_its_boundaries(
    mine: PolicyResult, verdicts: tuple[str, ...], data_dir: Path
) -> None:
    others = [
        result("round-robin", p99=1000, rps=8.0, hit=0.4),
        result("tail", p99=850, rps=9.0, hit=0.6),
        result("rate", p99=2000, rps=10.0, hit=0.6),
        result("hits", p99=3000, rps=5.0, hit=0.85),
    ]
    workload = suite_workloads(root=data_dir.parent)[0]
    verdict = judge(workload, [*others, mine], default="mine")
    assert tuple("PASS" if c.passed else "MISS" for c in verdict.checks) == verdicts
    assert verdict.passed == (verdicts == ("PASS",) * 4)
    page = render([verdict], default="mine", plot=None, wall_s=1.0, runs=5, jobs=1)
    summary = next(line for line in page.splitlines() if line.startswith(f"| {workload.name} |"))
    cells = [c.strip() for c in summary.strip("|").split("|")]
    assert tuple(cells[7:11]) == verdicts  # the page shows the computed verdicts
    assert cells[11] == ("**PASS**" if verdict.passed else "**MISS**")
    assert cells[12] == verdict.ranking.recommended.policy
    assert f"**{int(verdict.passed)} of 1**" in page
    across = page[page.index("### Across the suite") :].splitlines()
    best_row = next(line for line in across if line.startswith(f"| {verdict.ranking.recommended.policy}"))
    assert "| 1 |" in best_row  # recommended on the one workload


def test_judge_needs_the_default_and_round_robin(data_dir: Path) -> None:
    workload = suite_workloads(root=data_dir.parent)[0]
    with pytest.raises(ConfigurationError, match="no result for 'round-robin'"):
        judge(workload, [result("mine", p99=1, rps=1)], default="mine")
    with pytest.raises(ConfigurationError, match="no result for 'mine'"):
        judge(workload, [result("round-robin", p99=1, rps=1)], default="mine")
