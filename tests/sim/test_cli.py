"""``prefixroute simulate``: the table, --json in the issue's schema, --plot, determinism, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prefixroute.cli import main


def _simulate(tmp_path: Path, name: str, *extra: str) -> dict[str, object]:
    out = tmp_path / f"{name}.json"
    status = main(["simulate", "--requests", "120", "--users", "12", "--json", str(out), *extra])
    assert status == 0
    document = json.loads(out.read_text())
    assert isinstance(document, dict)
    return document


def test_json_schema_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plot = tmp_path / "seed.png"
    document = _simulate(tmp_path, "a", "--plot", str(plot))
    assert set(document) == {"scenario", "backends", "model", "gpu", "results"}
    assert (document["scenario"], document["backends"], document["model"], document["gpu"]) == (
        "seed",
        8,
        "codellama-13b",
        "a100-40gb",
    )
    results = document["results"]
    assert isinstance(results, list)
    assert [r["policy"] for r in results] == ["round-robin", "prefix-affinity", "bounded-load", "predicted-ttft"]
    for result in results:
        assert {
            "policy",
            "requests",
            "hit_rate",
            "predicted_hit_rate",
            "ttft_ms",
            "e2e_ms",
            "throughput_rps",
            "max_backend_share",
        } == set(result)
        assert set(result["ttft_ms"]) == {"p50", "p95", "p99"} and set(result["e2e_ms"]) == {"p50", "p99"}
        assert result["requests"] == 120 and 0 <= result["hit_rate"] <= 1
        assert result["ttft_ms"]["p50"] <= result["ttft_ms"]["p95"] <= result["ttft_ms"]["p99"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "round-robin" in printed and "bounded-load" in printed and "1.00×" in printed


def test_a_policy_named_twice_runs_once(tmp_path: Path) -> None:
    """As in ``compare``: before, it ran twice, two rows and two JSON results of one name (a consumer keyed by name
    kept one), for twice the time."""
    document = _simulate(tmp_path, "a", "--requests", "5", "--policy", "round-robin", "--policy", "bounded-load",
                         "--policy", "round-robin")  # fmt: skip
    results = document["results"]
    assert isinstance(results, list)
    assert [r["policy"] for r in results] == ["round-robin", "bounded-load"]


def test_same_seed_same_json(tmp_path: Path) -> None:
    first = _simulate(tmp_path, "a", "--policy", "power-of-two", "--policy", "bounded-load", "--seed", "5")
    second = _simulate(tmp_path, "b", "--policy", "power-of-two", "--policy", "bounded-load", "--seed", "5")
    assert first == second
    third = _simulate(tmp_path, "c", "--policy", "power-of-two", "--policy", "bounded-load", "--seed", "6")
    assert third != first


def test_no_first_token_changes_only_what_the_router_is_told(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    told = _simulate(tmp_path, "a", "--policy", "bounded-load", "--policy", "predicted-ttft")
    untold = _simulate(tmp_path, "b", "--policy", "bounded-load", "--policy", "predicted-ttft", "--no-first-token")
    assert "no first tokens reported" in capsys.readouterr().out
    told_results, untold_results = told["results"], untold["results"]
    assert isinstance(told_results, list) and isinstance(untold_results, list)
    assert told_results[0] == untold_results[0]  # bounded-load does not read pending prefill work
    assert told_results[1] != untold_results[1]  # the default does


@pytest.mark.parametrize("command", ["simulate", "compare"])
@pytest.mark.parametrize("tty_columns", [None, 80])
def test_the_table_elides_no_figure_when_it_is_wider_than_the_console(
    command: str, tty_columns: int | None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A long policy name (module:Class), or a terminal narrower than the table (80 columns), made rich shrink every
    column to fit: figures came out as "83.…" and "1.…". The table is printed at its own width instead."""
    if tty_columns is not None:
        monkeypatch.setenv("COLUMNS", str(tty_columns))
        monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    policy = "prefixroute.sim.baselines:SGLangCacheAware"
    extra = ["--jobs", "1"] if command == "compare" else []
    argv = [command, "--requests", "10", "--users", "4", "--policy", "round-robin", "--policy", policy, *extra]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "…" not in printed and policy in printed


def test_gateways_run_replicas_and_say_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    one = _simulate(tmp_path, "a", "--policy", "predicted-ttft")
    assert "gateway replicas" not in capsys.readouterr().out
    four = _simulate(tmp_path, "b", "--policy", "predicted-ttft", "--gateways", "4")
    assert "4 gateway replicas" in capsys.readouterr().out
    assert one["results"] != four["results"]  # each replica sees a quarter of the traffic


def test_user_policy_class_and_trace_replay(tmp_path: Path, data_dir: Path) -> None:
    trace = f"splitwise:{data_dir / 'vidur-profiling' / 'processed_traces' / 'splitwise_conv.csv'}"
    status = main(
        [
            "simulate",
            "--trace",
            trace,
            "--requests",
            "80",
            "--speedup",
            "20",
            "--model",
            "llama-3-8b",
            "--gpu",
            "h100-80gb",
            "--policy",
            "prefixroute.policies:LeastLoaded",
            "--json",
            str(tmp_path / "t.json"),
        ]
    )
    assert status == 0
    document = json.loads((tmp_path / "t.json").read_text())
    assert document["results"][0]["policy"] == "prefixroute.policies:LeastLoaded"
    assert document["results"][0]["requests"] == 80


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--policy", "nope"], "unknown policy"),
        (["--model", "gpt-5"], ""),
        (["--trace", "mooncake:/nonexistent.jsonl"], "cannot read trace"),
        (["--sharing-ratio", "2"], "between 0 and 1"),
    ],
)
def test_errors_exit_2_with_a_message(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--requests", "10", *argv]) == 2
    assert message in capsys.readouterr().err


def test_rejections_are_reported(tmp_path: Path, data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = f"mooncake:{data_dir / 'mooncake-fast25' / 'synthetic_trace.jsonl'}"
    out = tmp_path / "nested" / "m.json"
    assert main(["simulate", "--trace", trace, "--requests", "30", "--policy", "round-robin", "--json", str(out)]) == 0
    assert "requests rejected, longer than one engine's whole KV cache" in capsys.readouterr().out
    assert json.loads(out.read_text())["results"][0]["requests"] < 30


def test_same_seed_same_json_across_processes(tmp_path: Path) -> None:
    # Different PYTHONHASHSEEDs: nothing in a run may depend on set or str-hash iteration order.
    outputs = []
    for hash_seed in ("1", "2"):
        out = tmp_path / f"p{hash_seed}.json"
        argv = ["simulate", "--requests", "150", "--scenario", "multi-turn", "--policy", "power-of-two"]
        argv += [
            "--policy",
            "bounded-load",
            "--index-source",
            "events",
            "--metrics-interval",
            "0.5",
            "--json",
            str(out),
        ]
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        subprocess.run([sys.executable, "-m", "prefixroute", *argv], check=True, env=env, capture_output=True)
        outputs.append(out.read_text())
    assert outputs[0] == outputs[1]
