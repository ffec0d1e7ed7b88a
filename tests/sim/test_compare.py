"""``prefixroute compare``: the ranking and recommendation rule, the suite's verdicts, the command end to end."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixroute import policy_names
from prefixroute.cli import main
from prefixroute.errors import ConfigurationError
from prefixroute.router import Router
from prefixroute.sim import compare, suite
from prefixroute.sim.baselines import BASELINES
from prefixroute.sim.compare import (
    THROUGHPUT_TOLERANCE,
    compared_policies,
    default_policy_name,
    markdown_table,
    policy_kind,
    rank,
    recommendation,
    rich_table,
    run_grid,
    table_rows,
    write_plot,
)
from prefixroute.sim.metrics import PolicyResult
from prefixroute.sim.runner import SimSpec, build_policy, run_policy
from prefixroute.sim.suite import SuiteWorkload, judge, render, run_suite, suite_workloads, write_suite_plot
from prefixroute.sim.traces import read_mooncake, read_splitwise
from prefixroute.sim.workloads import make_workload, scenario_names

from ..conftest import wait_until

TINY = ["--requests", "24", "--users", "4", "--jobs", "1"]


def result(
    policy: str,
    *,
    p99: float,
    rps: float,
    p50: float = 10.0,
    hit: float = 0.5,
    requests: int = 100,
    rejected: int = 0,
    share: float = 1.0,
) -> PolicyResult:
    """A hand-built result: only the figures the ranking, the tables and the verdicts read."""
    return PolicyResult(
        policy=policy,
        requests=requests,
        rejected=rejected,
        hit_rate=hit,
        predicted_hit_rate=hit,
        ttft_ms={"p50": p50, "p95": p99, "p99": p99},
        e2e_ms={"p50": p50, "p99": p99},
        throughput_rps=rps,
        prompt_tokens_per_s=0.0,
        backend_share={"gpu0": 1.0},
        peak_in_flight={"gpu0": 1},
        max_backend_share=share,
        recompute_gpu_seconds=0.0,
        recompute_usd_per_month=0.0,
        preemptions=0,
        duration_s=1.0,
    )


def unserved(policy: str) -> PolicyResult:
    """A run that served no request: NaN latencies, as :func:`~prefixroute.sim.metrics.summarize` reports one."""
    return result(policy, p99=math.nan, p50=math.nan, rps=0.0, hit=0.0, requests=0, share=0.0)


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
    empty = unserved("empty")
    ranking = rank([empty, result("slow", p99=5000, rps=0.5)])
    assert [r.policy for r in ranking.results] == ["slow", "empty"]
    # Last means after the served policies that missed the throughput floor too.
    ranking = rank([unserved("a-empty"), result("fast-tail", p99=50, rps=1.0), result("rate", p99=400, rps=10.0)])
    assert [r.policy for r in ranking.results] == ["rate", "fast-tail", "a-empty"]
    alone = rank([empty])
    assert not alone.eligible(alone.recommended)
    assert recommendation(alone) == "No recommendation: no policy served a request."
    # With nothing served there is no best throughput and no best P99 to compare with.
    assert alone.best_throughput == 0.0 and math.isnan(alone.best_p99_ms)
    assert table_rows(alone) == [["(1)", "empty", "user", "–", "–", "0.00", "0.0 %", "0 %", "–", "–"]]
    assert "**" not in markdown_table(alone)  # no recommendation to set in bold


def test_one_served_request_is_served() -> None:
    ranking = rank([unserved("idle"), result("one", p99=80, rps=0.1, requests=1)])
    assert ranking.recommended.policy == "one" and ranking.eligible(ranking.recommended)


def test_the_throughput_floor_is_inclusive() -> None:
    # "at least 1 - tolerance of the best throughput": a policy exactly at the floor is eligible and ranks by P99.
    at_floor = result("at-floor", p99=300, rps=5.0)
    ranking = rank([result("rate", p99=400, rps=10.0), result("below", p99=100, rps=4.99), at_floor], tolerance=0.5)
    assert [r.policy for r in ranking.results] == ["at-floor", "rate", "below"]
    assert ranking.eligible(at_floor) and not ranking.eligible(ranking.results[2])
    # The default tolerance: 9.7 req/s is exactly 97 % of 10.
    ranking = rank([result("rate", p99=400, rps=10.0), result("at-floor", p99=300, rps=9.7)])
    assert ranking.recommended.policy == "at-floor" and ranking.eligible(ranking.recommended)


def test_tolerance_zero_admits_only_the_best_throughput() -> None:
    ranking = rank([result("fast-tail", p99=100, rps=9.99), result("rate", p99=400, rps=10.0)], tolerance=0)
    assert ranking.tolerance == 0.0
    assert ranking.recommended.policy == "rate" and ranking.eligible(ranking.recommended)
    assert not ranking.eligible(ranking.results[1])


@pytest.mark.parametrize(
    ("names", "tolerance", "message"),
    [
        ([], THROUGHPUT_TOLERANCE, "nothing to rank: compare at least one policy"),
        (["a", "a"], THROUGHPUT_TOLERANCE, "each policy may be compared once; repeated: a"),
        (["c", "a", "b", "a", "c"], THROUGHPUT_TOLERANCE, "each policy may be compared once; repeated: a, c"),
        (["a"], 1.0, "tolerance must be in [0, 1), not 1.0"),
        (["a"], -0.1, "tolerance must be in [0, 1), not -0.1"),
    ],
)
def test_rank_rejects_bad_input(names: list[str], tolerance: float, message: str) -> None:
    with pytest.raises(ConfigurationError, match=f"^{re.escape(message)}$"):
        rank([result(name, p99=1, rps=1) for name in names], tolerance=tolerance)


def _mixed_ranking() -> compare.Ranking:
    """A built-in, two baselines (one under the floor), a user policy that served nothing."""
    return rank(
        [
            result("round-robin", p99=1500, rps=10.0, p50=1234, hit=0.5, share=0.8),
            result("dynamo", p99=1000, rps=9.8, p50=600, hit=0.25, share=0.5),
            result("sglang", p99=300, rps=5.0, p50=100, hit=0.125, share=0.25),
            unserved("mypkg:Mine"),
        ]
    )


TABLE_COLUMNS = [
    "rank",
    "policy",
    "kind",
    "TTFT p50 ms",
    "TTFT p99 ms",
    "req/s",
    "KV hit",
    "max share",
    "P99 ÷ best",
    "req/s ÷ best",
]


def test_table_rows_show_each_policy_s_figures_and_its_ratios_to_the_best() -> None:
    # "P99 ÷ best" divides by the lowest P99 any policy served (sglang's, though it is under the floor), "req/s ÷
    # best" by the highest throughput; an ineligible policy's rank is in parentheses, figures it lacks are "–".
    assert table_rows(_mixed_ranking(), default="round-robin") == [
        ["1", "dynamo", "baseline", "600", "1,000", "9.80", "25.0 %", "50 %", "3.33×", "0.98×"],
        ["2", "round-robin", "built-in, default", "1,234", "1,500", "10.00", "50.0 %", "80 %", "5.00×", "1.00×"],
        ["(3)", "sglang", "baseline", "100", "300", "5.00", "12.5 %", "25 %", "1.00×", "0.50×"],
        ["(4)", "mypkg:Mine", "user", "–", "–", "0.00", "0.0 %", "0 %", "–", "0.00×"],
    ]


def _table_cells(lines: list[str]) -> list[list[str]]:
    """The cells of a Markdown table's lines, checking that each is one row of the same width."""
    rows = []
    for line in lines:
        assert line.startswith("|") and line.endswith("|"), line
        rows.append([cell.strip() for cell in line[1:-1].split("|")])
    header, rule, *body = rows
    assert all(re.fullmatch(r":?-{3,}:?", cell) for cell in rule), rule
    assert all(len(row) == len(header) for row in (rule, *body)), rows
    return [header, *body]


def test_markdown_table_is_one_table_with_the_recommendation_in_bold() -> None:
    ranking = _mixed_ranking()
    header, *body = _table_cells(markdown_table(ranking, default="round-robin").splitlines())
    assert header == TABLE_COLUMNS
    rows = table_rows(ranking, default="round-robin")
    assert body == [[f"**{cell}**" for cell in rows[0]], *rows[1:]]
    assert body[1][2] == "built-in, default"


def test_the_terminal_table_has_the_markdown_table_s_columns_and_cells() -> None:
    ranking = _mixed_ranking()
    table = rich_table(ranking, default="round-robin", title="seed: policies ranked")
    assert table.title == "seed: policies ranked"
    assert [column.header for column in table.columns] == TABLE_COLUMNS
    rows = table_rows(ranking, default="round-robin")
    assert [list(column.cells) for column in table.columns] == [list(cells) for cells in zip(*rows, strict=True)]
    assert rich_table(ranking).title is None


def test_the_recommendation_names_the_default_s_rank_and_its_ratios() -> None:
    ranking = rank(
        [
            result("fast-tail-slow-rate", p99=100, rps=9.6),
            result("best-rate", p99=400, rps=10.0),
            result("good", p99=300, rps=9.75),
            result("worse", p99=350, rps=9.9),
        ]
    )
    rule = (
        "Recommended: good — the lowest P99 TTFT (300 ms) among the policies that keep 97 % of the best throughput "
        "(10.00 req/s)."
    )
    assert recommendation(ranking, default="worse") == (
        f"{rule} The default, worse, ranks 2: P99 350 ms (1.17× the recommendation's), 0.99× the best throughput."
    )
    assert recommendation(ranking, default="good") == f"{rule} It is the default policy."
    assert recommendation(ranking, default="not-compared") == rule
    assert recommendation(ranking) == rule
    looser = rank(ranking.results, tolerance=0.1)
    assert "keep 90 % of the best throughput" in recommendation(looser)


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


def test_run_grid_builds_every_run_from_the_workload_given() -> None:
    spec = SimSpec(requests=20, users=4)  # the seed scenario, unless the workload replaces it
    rag = functools.partial(make_workload, "rag")
    expected = run_policy(spec, "round-robin", workload=rag).to_json()
    assert expected != run_policy(spec, "round-robin").to_json()
    for jobs in (1, 2):
        results = run_grid([(spec, "least-loaded"), (spec, "round-robin")], jobs=jobs, workload=rag)
        assert results[1].to_json() == expected


def test_run_grid_runs_in_this_process_unless_several_jobs_have_several_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    pools: list[tuple[int | None, str | None]] = []

    class RecordingPool(ProcessPoolExecutor):
        def __init__(self, max_workers: int | None = None, mp_context: Any = None, **options: Any) -> None:
            pools.append((max_workers, mp_context.get_start_method() if mp_context is not None else None))
            super().__init__(max_workers=max_workers, mp_context=mp_context, **options)

    monkeypatch.setattr(compare, "ProcessPoolExecutor", RecordingPool)
    run = (SimSpec(requests=12, users=3), "round-robin")
    done: list[tuple[int, str]] = []
    run_grid([run, run, run], on_done=lambda i, r: done.append((i, r.policy)))  # jobs=1 by default
    assert done == [(0, "round-robin"), (1, "round-robin"), (2, "round-robin")]  # in order, in this process
    run_grid([run], jobs=4)
    assert pools == []
    # A pool of spawned processes (nothing of this one's state shared), no more of them than runs.
    run_grid([run, run], jobs=2)
    run_grid([run, run, run], jobs=8)
    assert pools == [(2, "spawn"), (3, "spawn")]
    with pytest.raises(ConfigurationError, match="^--jobs must be a positive int, not 0$"):
        run_grid([run], jobs=0)


def test_run_grid_interrupted_stops_its_workers_at_once() -> None:
    """Was: an exception in this process (Ctrl-C's KeyboardInterrupt, here from on_done) waited, in the pool's
    shutdown, for every run already handed to a worker to end, the queued ones too: minutes for long runs."""
    short, long = SimSpec(requests=10, users=3), SimSpec(requests=50_000, users=30)
    runs = [(short, "round-robin"), (long, "round-robin"), (long, "random"), (long, "least-loaded")]

    def interrupt(_index: int, _result: PolicyResult) -> None:
        raise KeyboardInterrupt

    before = set(multiprocessing.active_children())  # another test's pool may still be winding down
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        run_grid(runs, jobs=2, on_done=interrupt)
    assert time.monotonic() - started < 30, "the interrupted runs went on"
    # Every worker gone within seconds (a run of 50,000 requests takes minutes): twice in CI under load a worker was
    # still being reaped as run_grid returned, so its end is waited for, not expected at that very instant.
    deadline = time.monotonic() + 10
    while not set(multiprocessing.active_children()) <= before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(multiprocessing.active_children()) <= before


def _descendants_left(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("signal_to", ["group", "parent"])
def test_compare_stopped_by_ctrl_c_or_sigterm_leaves_no_worker_running(signal_to: str) -> None:
    """Ctrl-C (SIGINT to the whole process group) ended nothing for a minute and more: each worker took its
    KeyboardInterrupt as its run's result and went on with the next run queued for it, while the parent waited for
    them. SIGTERM to the parent alone (a supervisor, ``timeout``) ended it and left its workers simulating, orphans."""
    command = [sys.executable, "-m", "prefixroute", "compare", "--requests", "100000", "--jobs", "2"]
    pipes: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    faulthandler = {**os.environ, "PYTHONFAULTHANDLER": "1"}  # SIGABRT dumps every thread's stack to stderr
    # Ctrl-C's default disposition in the command: a shell that started this suite in the background (``make test
    # &``, ``nohup``) passes SIGINT on ignored, and Python then installs no KeyboardInterrupt handler at all.
    default_sigint = functools.partial(signal.signal, signal.SIGINT, signal.SIG_DFL)
    with subprocess.Popen(
        command, start_new_session=True, env=faulthandler, preexec_fn=default_sigint, **pipes
    ) as process:
        try:
            assert process.stdout is not None
            for line in process.stdout:
                if "at a time" in line:
                    break
            time.sleep(2)  # the workers are simulating
            if signal_to == "group":
                os.killpg(process.pid, signal.SIGINT)
            else:
                process.send_signal(signal.SIGTERM)
            try:  # it ends within a second
                _, err = process.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                process.send_signal(signal.SIGABRT)
                _, err = process.communicate(timeout=20)
                pytest.fail(f"compare did not end within 20 s of the signal; where it was:\n{err}")
            if signal_to == "group":
                assert process.returncode == 130 and err == "prefixroute compare: interrupted\n", err
            wait_until(lambda: not _descendants_left(process.pid), what="the workers' end", timeout=20)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)


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
        (["--suite", "--gateways", "2"], "drop --gateways"),
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


def test_each_suite_workload_runs_as_its_setup_sentence_says(data_dir: Path) -> None:
    workloads = suite_workloads(seed=3, root=data_dir.parent)
    base, with_metrics = workloads[:8], workloads[8:]
    assert all(w.spec.seed == 3 for w in workloads)
    scenarios, (mooncake, splitwise) = base[:6], base[6:]
    assert [w.spec.scenario for w in scenarios] == scenario_names()
    for w in scenarios:  # as `prefixroute simulate --scenario S` runs them
        spec = w.spec
        assert spec.trace is None and spec.with_(scenario="seed", seed=0) == SimSpec()
        assert w.setup == f"{spec.backends} × {spec.model} on {spec.gpu}, {spec.users} closed-loop users, " + (
            f"{spec.requests:,} requests"
        )
    # The traces run at their own timestamps (no closed-loop users), every request of the file.
    trace = data_dir / "mooncake-fast25" / "synthetic_trace.jsonl"
    assert mooncake.spec.trace == f"mooncake:{trace}"
    assert (mooncake.spec.users, mooncake.spec.requests) == (None, None)
    assert (mooncake.spec.model, mooncake.spec.gpu) == ("llama-3-8b", "h100-80gb")
    assert mooncake.setup.startswith(f"Mooncake FAST'25 synthetic trace ({len(read_mooncake(trace)):,} requests)")
    trace = data_dir / "vidur-profiling" / "processed_traces" / "splitwise_code.csv"
    assert splitwise.spec.trace == f"splitwise:{trace}"
    assert splitwise.spec.with_(trace=None, users=30, requests=1500, seed=0) == SimSpec()
    assert (splitwise.spec.users, splitwise.spec.requests) == (None, None)
    assert splitwise.setup.startswith(f"Splitwise code trace ({len(read_splitwise(trace)):,} requests, no shared")
    for w in (mooncake, splitwise):
        assert w.setup.endswith(f"at its own timestamps, {w.spec.backends} × {w.spec.model} on {w.spec.gpu}")
    # The same workloads again, with engine metrics.
    assert [(w.name, w.setup) for w in with_metrics] == [(w.name, w.setup) for w in base]
    assert [w.spec for w in with_metrics] == [w.spec.with_(metrics_interval=0.1) for w in base]


def test_judge_names_each_check_its_target_and_includes_the_boundary(data_dir: Path) -> None:
    # Issue 9's rule, all four bounds inclusive: here the default sits exactly on each of them.
    results = [
        unserved("stalled"),  # served nothing: not the best P99, though it comes first
        result("round-robin", p99=1200, rps=8.0, hit=0.06),
        result("tail", p99=1000, rps=9.0, hit=0.06),
        result("rate", p99=2000, rps=10.0, hit=0.06),
        result("hits", p99=3000, rps=5.0, hit=0.1),
        result("mine", p99=1200, rps=9.7, hit=0.05),
    ]
    verdict = judge(suite_workloads(root=data_dir.parent)[0], results, default="mine")
    assert [(c.name, c.value, c.target, c.passed) for c in verdict.checks] == [
        ("P99 ≤ round-robin", 1.0, 1.0, True),
        ("P99 ≤ 1.2× best", 1.2, 1.2, True),
        ("req/s ≥ 0.97× best", 0.97, 0.97, True),
        ("hit ≥ best − 5 points", -5.0, -5.0, True),
    ]
    assert verdict.passed
    assert verdict.default.policy == "mine" and verdict.round_robin.policy == "round-robin"
    assert (verdict.best_p99.policy, verdict.best_throughput.policy, verdict.best_hit.policy) == (
        "tail",
        "rate",
        "hits",
    )


def test_judge_a_workload_where_nothing_was_served(data_dir: Path) -> None:
    # "A run that served nothing (NaN) fails every check it enters", even with no best throughput to divide by.
    workload = suite_workloads(root=data_dir.parent)[0]
    verdict = judge(workload, [unserved("round-robin"), unserved("mine")], default="mine")
    assert [c.passed for c in verdict.checks[:3]] == [False, False, False] and not verdict.passed
    page = render([verdict], default="mine", plot=None, wall_s=1.0, runs=2, jobs=1)
    summary = next(line for line in page.splitlines() if line.startswith(f"| {workload.name} |"))
    assert summary.split(" | ")[2] == "–"  # the default's P99
    across = next(line for line in page.splitlines() if line.startswith("| mine (default) |"))
    assert across.endswith("| 0.00× |")  # its lowest req/s ÷ best: no throughput kept


def _page_blocks(page: str) -> None:
    """Check that every heading, paragraph and table of a Markdown page is set off by blank lines."""
    lines = page.splitlines()
    assert page.endswith("\n") and lines[0] and lines[-1]
    for i, line in enumerate(lines):
        table = line.startswith("|")
        before = lines[i - 1] if i else ""
        after = lines[i + 1] if i + 1 < len(lines) else ""
        if line and not (table and before.startswith("|")):
            assert before == "", (before, line)
        if line and not (table and after.startswith("|")):
            assert after == "", (line, after)


SUMMARY_COLUMNS = [
    "workload",
    "metrics",
    "default P99 ms",
    "÷ round-robin",
    "÷ best (policy)",
    "req/s ÷ best",
    "hit − best (points)",
    "P99 ≤ RR",
    "P99 ≤ 1.2× best",
    "req/s ≥ 0.97×",
    "hit ≥ best − 5",
    "verdict",
    "recommended",
]
ACROSS_COLUMNS = ["policy", "recommended on", "median P99 ÷ best", "worst P99 ÷ best", "lowest req/s ÷ best"]


def _tables(page: str) -> list[list[list[str]]]:
    """Every Markdown table of a page, as rows of cells (the header first)."""
    tables: list[list[str]] = []
    previous = ""
    for line in page.splitlines():
        if line.startswith("|"):
            if not previous.startswith("|"):
                tables.append([])
            tables[-1].append(line)
        previous = line
    return [_table_cells(lines) for lines in tables]


def test_the_page_shows_each_workload_s_figures_tables_and_sections(data_dir: Path) -> None:
    workloads = suite_workloads(root=data_dir.parent)
    plain, metered = workloads[0], workloads[8]
    results = [
        result("round-robin", p99=1500, rps=10.0),
        result("mine", p99=1234, rps=9.9, rejected=3),
        result("other", p99=1000, rps=10.0, rejected=1),
    ]
    verdicts = [judge(plain, results, default="mine"), judge(metered, results, default="mine")]
    page = render(verdicts, default="mine", plot="bench.png", wall_s=225.4, runs=6, jobs=2)
    _page_blocks(page)
    lines = page.splitlines()
    assert lines[0] == "# Policy benchmark" and "## Summary" in lines
    assert "![The default's P99 TTFT against round-robin and the best policy](bench.png)" in lines
    summary, across, *ranked = _tables(page)
    assert summary[0] == SUMMARY_COLUMNS
    assert [row[:3] for row in summary[1:]] == [["seed", "off", "1,234"], ["seed", "0.1 s", "1,234"]]
    assert lines[lines.index("### Across the suite") + 4].startswith("| policy |")
    assert across[0] == ACROSS_COLUMNS
    assert [row[0] for row in across[1:]] == ["other", "mine (default)", "round-robin"]
    assert len(ranked) == 2 and all(table[0] == TABLE_COLUMNS for table in ranked)
    assert [row[2] for row in ranked[0][1:]] == ["**user**", "user, default", "built-in"]
    for workload, sentence in ((plain, "."), (metered, "; engine metrics polled every 0.1 s.")):
        section = lines.index(f"## {workload.label}")
        assert lines[section + 2] == workload.setup + sentence
    assert page.count("The default, mine, ranks 2: P99 1,234 ms (1.23× the recommendation's)") == 2
    assert page.count("\nRequests rejected (longer than one engine's KV cache): 1, 3.\n") == 2
    assert page.endswith("\n## How long it takes\n\n6 simulations in 225 s wall time on 2 processes.\n")
    without_plot = render(verdicts, default="mine", plot=None, wall_s=225.4, runs=6, jobs=2)
    assert not [line for line in without_plot.splitlines() if line.startswith("![")]
    assert "**0 of 0**" in render([], default="mine", plot=None, wall_s=0.0, runs=0, jobs=1)


def test_across_the_suite_takes_each_policy_s_median_worst_and_lowest_rate(data_dir: Path) -> None:
    # Per workload, P99 in units of the best policy's (100 ms) and req/s; "gappy" was not run on the second workload.
    p99s: dict[str, list[float | None]] = {
        "best": [100, 100, 100, 100],
        "mine": [120, 120, 120, 120],
        "steady": [110, 130, 160, 120],
        "gappy": [150, None, 300, 200],
        "round-robin": [500, 500, 500, 500],
    }
    rates: dict[str, list[float]] = {"steady": [10.0, 9.0, 8.0, 9.5]}
    workload = suite_workloads(root=data_dir.parent)[0]
    verdicts = []
    for k in range(4):
        results = []
        for name, p99 in p99s.items():
            figure = p99[k]
            if figure is not None:
                results.append(result(name, p99=figure, rps=rates.get(name, [10.0] * 4)[k]))
        verdicts.append(judge(workload, results, default="mine"))
    page = render(verdicts, default="mine", plot=None, wall_s=1.0, runs=19, jobs=1)
    across = _tables(page)[1]
    # Ordered by the worst P99 ÷ best; the median of an even count is the mean of the middle two (1.20, 1.30).
    assert across[1:] == [
        ["best", "4", "1.00×", "1.00×", "1.00×"],
        ["mine (default)", "0", "1.20×", "1.20×", "1.00×"],
        ["steady", "0", "1.25×", "1.60×", "0.80×"],
        ["gappy", "0", "2.00×", "3.00×", "1.00×"],
        ["round-robin", "0", "5.00×", "5.00×", "1.00×"],
    ]


@contextlib.contextmanager
def _drawn(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """Keep the axes that the plot functions draw on, to read back what they plotted."""
    from prefixroute.sim import report

    axes: list[Any] = []
    real = report.plot_file

    @contextlib.contextmanager
    def keeping(*args: Any, **kwargs: Any) -> Iterator[tuple[Any, Any]]:
        with real(*args, **kwargs) as (figure, drawn):
            axes.append(drawn)
            yield figure, drawn

    monkeypatch.setattr(report, "plot_file", keeping)
    yield axes


def _bars(container: Any) -> list[tuple[float, float]]:
    """(width, vertical centre) of each bar of a horizontal bar chart."""
    return [(bar.get_width(), bar.get_y() + bar.get_height() / 2) for bar in container]


def test_the_compare_plot_draws_each_policy_s_figures_in_rank_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ranking = _mixed_ranking()  # dynamo, round-robin, sglang, then mypkg:Mine, which served nothing
    with _drawn(monkeypatch) as axes:
        write_plot(tmp_path / "c.png", ranking, default="round-robin")
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ((ttft, rate),) = axes
    names = ["dynamo", "round-robin (default)", "sglang", "mypkg:Mine"]
    assert [label.get_text() for label in ttft.get_yticklabels()] == names
    # P99 bars and P50 ticks (none for the policy that served nothing), throughput bars, the throughput floor.
    assert _bars(ttft.containers[0]) == [(1000, 0), (1500, 1), (300, 2), (0, 3)]
    assert ttft.collections[0].get_offsets().tolist() == [[600, 0], [1234, 1], [100, 2], [0, 3]]
    assert _bars(rate.containers[0]) == [(9.8, 0), (10.0, 1), (5.0, 2), (0.0, 3)]
    assert rate.lines[0].get_xdata()[0] == pytest.approx(0.97 * 10.0)
    assert rate.get_ylim() == ttft.get_ylim()  # one y axis: each row of bars is one policy


def test_the_suite_plot_draws_the_default_s_two_p99_ratios_per_workload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data_dir: Path
) -> None:
    workloads = suite_workloads(root=data_dir.parent)
    verdicts = [
        judge(
            workloads[0], [result("round-robin", p99=2000, rps=10), result("mine", p99=1000, rps=10)], default="mine"
        ),
        judge(workloads[8], [result("round-robin", p99=500, rps=10), result("mine", p99=1000, rps=10)], default="mine"),
    ]
    with _drawn(monkeypatch) as axes:
        write_suite_plot(tmp_path / "suite.png", verdicts, default="mine")
    assert (tmp_path / "suite.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (axis,) = axes
    assert [label.get_text() for label in axis.get_yticklabels()] == ["seed", "seed, metrics 0.1 s"]
    series = {container.get_label(): _bars(container) for container in axis.containers}
    vs_rr, vs_best = series["÷ round-robin"], series["÷ best policy"]
    assert [width for width, _ in vs_rr] == [0.5, 2.0] and [width for width, _ in vs_best] == [1.0, 2.0]
    for y, (rr_bar, best_bar) in enumerate(zip(vs_rr, vs_best, strict=True)):  # both next to their workload's name
        assert y - 0.5 < rr_bar[1] < y < best_bar[1] < y + 0.5
    assert sorted(line.get_xdata()[0] for line in axis.lines) == [1.0, 1.2]


def test_run_suite_judges_each_workload_on_its_own_runs_and_writes_the_page_and_plot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two tiny workloads stand in for the suite's sixteen (minutes): a scenario, then a trace, which runs first.
    trace = tmp_path / "tiny.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"timestamp": 50 * i, "input_length": 600, "output_length": 8, "hash_ids": [i % 2, i]}) + "\n"
            for i in range(16)
        )
    )
    tiny = [
        SuiteWorkload("seed", "a few closed-loop users", SimSpec(requests=16, users=3, seed=2)),
        SuiteWorkload("tiny trace", "a trace at its own timestamps", SimSpec(trace=f"mooncake:{trace}", users=None)),
    ]
    asked: list[tuple[int, Path]] = []

    def workloads(*, seed: int, root: Path) -> list[SuiteWorkload]:
        asked.append((seed, root))
        return tiny

    jobs: list[int] = []

    def grid(runs: list[tuple[SimSpec, str]], **options: Any) -> list[PolicyResult]:
        jobs.append(options["jobs"])
        return run_grid(runs, **options)

    policies = ["round-robin", default_policy_name()]
    monkeypatch.setattr(suite, "suite_workloads", workloads)
    monkeypatch.setattr(suite, "compared_policies", lambda: policies)
    monkeypatch.setattr(suite, "run_grid", grid)
    said: list[str] = []
    output = tmp_path / "docs" / "bench.md"
    started = time.perf_counter()
    written, verdicts = run_suite(output, root=tmp_path, progress=said.append)
    elapsed = time.perf_counter() - started
    assert written == output and asked == [(0, tmp_path)]  # seed 0, as the page says
    assert jobs == [2]  # two processes by default
    assert [v.workload for v in verdicts] == tiny
    for v in verdicts:  # each workload judged on its own runs
        assert [r.to_json() for r in v.ranking.results] == [
            run_policy(v.workload.spec, r.policy).to_json() for r in v.ranking.results
        ]
        assert sorted(r.policy for r in v.ranking.results) == sorted(policies)
    # One line as each run finishes, counting up (the pool finishes them in any order).
    assert [line.split("] ")[0] for line in said] == ["[1/4", "[2/4", "[3/4", "[4/4"]
    assert sorted(line.split("] ")[1] for line in said) == sorted(policies * 2)
    page = output.read_text(encoding="utf-8")
    assert page == render(verdicts, default=policies[1], plot="bench.png", wall_s=_wall(page), runs=4, jobs=2)
    assert 0 <= _wall(page) <= math.ceil(elapsed)  # the time the run took, measured around it
    assert output.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _wall(page: str) -> float:
    """The wall time a page reports (it varies from run to run)."""
    found = re.search(r"\n4 simulations in (\d+) s wall time", page)
    assert found is not None, page[-200:]
    return float(found.group(1))


def test_a_trace_no_policy_can_serve_recommends_nothing_in_the_json_either(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Was: the table said "No recommendation: no policy served a request." while --json named one, and --plot
    warned (a log scale of nothing but zeros), which the suite's warnings-as-errors turns into a failure."""
    trace = tmp_path / "huge.jsonl"
    with trace.open("w", encoding="utf-8") as out:
        for i in range(4):  # 40,000 tokens each: past one engine's whole KV cache (854 blocks of 16 tokens)
            out.write(json.dumps({"timestamp": i, "input_length": 40_000, "output_length": 8,
                                  "hash_ids": list(range(i * 100, i * 100 + 79))}) + "\n")  # fmt: skip
    document, plot = tmp_path / "out.json", tmp_path / "out.png"
    argv = ["compare", "--trace", f"mooncake:{trace}", "--policy", "round-robin", "--policy", "llm-d", "--jobs", "1"]
    assert main([*argv, "--json", str(document), "--plot", str(plot)]) == 0
    assert "No recommendation: no policy served a request." in capsys.readouterr().out
    assert json.loads(document.read_text())["recommended"] is None
    assert plot.stat().st_size > 0
