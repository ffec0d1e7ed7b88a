"""The benchmarks still run and print their tables (smoke sizes; their figures are never asserted here)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from prefixroute import Candidate, PredictedTTFT, policy_from_name

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def run(script: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_bench_route_prints_every_case_with_a_ratio() -> None:
    rows = [line.split() for line in run("bench_route.py", "--quick", "--bounded").splitlines()]
    cases = {(row[0], row[1]): float(row[-1]) for row in rows if len(row) == 9 and row[0].isdigit()}
    assert set(cases) == {(tokens, backends) for tokens in ("1024", "8192", "32768") for backends in ("8", "64")}
    assert all(ratio > 0 for ratio in cases.values())


def test_bench_route_steps_prints_each_step_for_both_fleets() -> None:
    rows = [line.split() for line in run("bench_route.py", "--quick", "--steps").splitlines()]
    assert [row[0] for row in rows if len(row) == 11 and row[0].isdigit()] == ["8", "64"]


def test_bench_route_full_fleet_prints_room_full_and_their_ratio_per_fleet() -> None:
    rows = [line.split() for line in run("bench_route.py", "--quick", "--full-fleet").splitlines()]
    figures = [row for row in rows if row and row[0].isdigit()]
    assert [row[0] for row in figures] == ["8", "64"]
    for _, room, full, ratio in figures:
        assert float(room) > 0 and float(full) > 0
        assert float(ratio) == pytest.approx(float(full) / float(room), abs=0.01)


def test_bench_route_lifecycle_prints_each_call_and_their_sum_per_fleet_and_load() -> None:
    rows = [line.split() for line in run("bench_route.py", "--quick", "--lifecycle").splitlines()]
    figures = [row for row in rows if len(row) == 6 and row[0].isdigit()]
    assert [row[:2] for row in figures] == [["8", "0"], ["8", "50"], ["64", "0"], ["64", "50"]]
    for *_, route, start, finish, total in figures:
        assert float(route) > 0 and float(start) > 0 and float(finish) > 0
        assert float(total) == pytest.approx(float(route) + float(start) + float(finish), abs=0.2)


def test_bench_route_shared_match_prints_both_stores_per_fleet() -> None:
    rows = [line.split() for line in run("bench_route.py", "--quick", "--shared-match").splitlines()]
    assert [row[:2] for row in rows if len(row) == 5 and row[0].isdigit()] == [
        ["8", "unbounded"], ["8", "bounded"], ["64", "unbounded"], ["64", "bounded"]]  # fmt: skip


def test_bench_sim_and_bench_events_run() -> None:
    assert "bounded-load" in run("bench_sim.py", "--quick")
    assert "block events/s" in run("bench_events.py", "--runs", "1", "--requests", "20")


def test_bench_proxy_prints_latency_and_rate_rows() -> None:
    rows = [line.split() for line in run("bench_proxy.py", "--quick").splitlines()]
    kinds = ("ids", "text", "chat")
    latency = [[kind, metric] for kind in kinds for metric in ("TTFT", "total")]
    assert [row[:2] for row in rows if len(row) == 8] == latency
    assert [row[:2] for row in rows if len(row) == 5 and row[1] in ("relay", "proxy")] == [
        ["ids", "relay"], ["ids", "proxy"], ["text", "proxy"], ["chat", "proxy"]]  # fmt: skip


def test_bench_tokenize_prints_both_prompt_kinds_per_tokenizer() -> None:
    rows = [line.split() for line in run("bench_tokenize.py", "--quick").splitlines()]
    kinds = [(row[0], row[1]) for row in rows if len(row) == 13 and row[1] in ("shared", "unique")]
    assert kinds == [
        (name, kind) for name in ("anthropic_tokenizer", "deepseek_tokenizer") for kind in ("shared", "unique")
    ]


def test_default_variants_prints_a_row_per_variant() -> None:
    rows = [line for line in run("default_variants.py", "--quick", "--jobs", "1").splitlines() if line[-1:].isdigit()]
    assert len(rows) == 21 and rows[0].startswith("predicted-ttft (the default)")  # the default and 20 variants
    quick = ("--quick", "--jobs", "1", "--metrics", "--only", "EngineUsageFloor")
    rows = [line for line in run("default_variants.py", *quick).splitlines() if line[-1:].isdigit()]
    assert len(rows) == 2 and rows[1].startswith("engine kv_usage as a floor")  # judged on the runs with metrics


def test_default_variants_classes_are_policies_the_simulator_can_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # as from benchmarks/, where the docs run them
    learned = policy_from_name("default_variants:LearnedSpeeds")
    assert isinstance(learned, PredictedTTFT) and learned.use_speed
    previous = policy_from_name("default_variants:InFlightOnly")
    assert isinstance(previous, PredictedTTFT)
    busy = Candidate("a", 0, 100, 3, in_prefill=2)
    assert previous.cost(busy) == 100 * 4 and PredictedTTFT().cost(busy) == 100 * 6  # (1 + in flight [+ in prefill])
    # The default before its cap: a long prompt's every uncached token counts for each request it holds up.
    uncapped = policy_from_name("default_variants:WithoutCap")
    long = Candidate("a", 0, 100_000, 3, in_prefill=2, held_blocks=3 * 512)  # typical prompt in flight: 8,192
    assert isinstance(uncapped, PredictedTTFT)
    assert uncapped.cost(long, common_tokens=100_000, typical_prompt=8192.0) == 100_000 * 6
    assert PredictedTTFT().cost(long, common_tokens=100_000, typical_prompt=8192.0) == 100_000 + 8192 * 3 + 100_000 * 2
    # Other memory stretches: a quarter of the memory in use where the request fits, and a backend it does not fit.
    roomy = Candidate("a", 0, 160, 0, active_blocks=5, capacity_blocks=20)
    full = roomy._replace(active_blocks=15)
    square, step = policy_from_name("default_variants:SquareStretch"), policy_from_name("default_variants:StepStretch")
    assert isinstance(square, PredictedTTFT) and isinstance(step, PredictedTTFT)
    assert PredictedTTFT().cost(roomy) == pytest.approx(160 / 0.75)
    assert square.cost(roomy) == pytest.approx(160 / (1 - 0.25**2)) and step.cost(roomy) == pytest.approx(160)
    assert square.cost(full) == pytest.approx(160 / (1 - 0.95**2)) and step.cost(full) == pytest.approx(160 / 0.05)
    # Memory overcommitted: 12 blocks active and 10 more needed in a capacity of 10, 2.2 times over.
    over = Candidate("a", 0, 160, 3, pending_prefill_tokens=40, active_blocks=12, capacity_blocks=10)
    wait = policy_from_name("default_variants:OvercommitWait")
    assert isinstance(wait, PredictedTTFT)
    default = PredictedTTFT().cost(over)  # (40 + 160 + 160 x 3 x 10/12) / 0.05
    assert default == pytest.approx((40 + 160 + 400) / 0.05)
    assert wait.cost(over) == pytest.approx(default + (40 + 160) * 1.2 / 0.05)
    assert wait.cost(over._replace(active_blocks=0)) == PredictedTTFT().cost(over._replace(active_blocks=0))
    # The engine's usage as a floor under the router's 10 %: stretched by 1 / 0.5 instead of 1 / 0.9.
    floor = policy_from_name("default_variants:EngineUsageFloor")
    assert isinstance(floor, PredictedTTFT)
    light = Candidate("a", 0, 160, 1, active_blocks=100, capacity_blocks=1000, kv_usage=0.5)
    assert floor.cost(light) == pytest.approx(320 / 0.5) and PredictedTTFT().cost(light) == pytest.approx(320 / 0.9)
    assert floor.cost(light._replace(kv_usage=0.05)) == PredictedTTFT().cost(light)


@pytest.mark.parametrize(
    ("script", "args"),
    [
        ("bench_events.py", ["--runs", "0"]),
        ("bench_events.py", ["--rate", "nan"]),
        ("bench_proxy.py", ["--answer-tokens", "-1"]),
        ("bench_proxy.py", ["--token-delay-ms", "inf"]),
        ("bench_proxy.py", ["--token-delay-ms", "70000"]),  # was: the engines it starts refused it, a traceback
        ("bench_proxy.py", ["--answer-tokens", "2000000"]),
        ("bench_proxy.py", ["--bare-relay", "abc"]),  # was: a ValueError traceback
        ("bench_route.py", ["--new-fraction", "2"]),
        ("bench_sidecar.py", ["--seconds", "0"]),
        ("bench_sim.py", ["--trace", "no/such/trace.jsonl"]),
        ("bench_tokenize.py", ["--tokenizer", "no/such/tokenizer.json"]),
        ("default_variants.py", ["--jobs", "0"]),
        ("default_variants.py", ["--quick", "--only", "NoSuchVariant"]),  # was: the default alone, judged on none
        ("default_variants.py", ["--quick", "--only", "EngineUsageFloor"]),  # judged only with --metrics
        ("bench_route.py", ["--no-such-option"]),
    ],
)
def test_a_benchmark_answers_a_bad_option_with_one_line_and_status_2(script: str, args: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "error:" in done.stderr, done.stderr
    assert done.stdout == ""


@pytest.mark.parametrize(
    ("script", "option", "content", "expected"),
    [
        ("bench_sim.py", "--trace", b"", "no requests in the trace"),
        ("bench_sim.py", "--trace", b'{"timestamp": 0}\n', "missing field(s)"),
        ("bench_tokenize.py", "--tokenizer", b"", "is not a tokenizer.json"),
        ("bench_tokenize.py", "--tokenizer", b"\xff\xfe\x00binary", "is not a tokenizer.json"),
        ("default_variants.py", "--cache", b"not a pickle", "is not a cache this script wrote"),
    ],
)
def test_a_benchmark_refuses_a_malformed_input_file_before_it_runs(
    script: str, option: str, content: bytes, expected: str, tmp_path: Path
) -> None:
    # Was: a traceback (exit status 1), for bench_sim.py after a minute of scenario runs, for bench_tokenize.py
    # after its header.
    path = tmp_path / "input"
    path.write_bytes(content)
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), option, str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and expected in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert done.stdout == "" and path.read_bytes() == content


@pytest.mark.parametrize(
    ("script", "args", "expected"),
    [
        ("bench_sim.py", ["--trace", "{fifo}"], "is not a regular file"),  # was: "no such file", and it is there
        ("bench_tokenize.py", ["--tokenizer", "{folder}"], "is not a regular file"),
        ("bench_sim.py", ["--trace", "{long}"], "cannot look up"),  # was: an OSError traceback
        ("default_variants.py", ["--cache", "{folder}"], "is not a regular file"),  # was: the runs, then a traceback
        ("default_variants.py", ["--cache", "{fifo}"], "is not a regular file"),  # a FIFO: not opened, no hang
        ("default_variants.py", ["--cache", "{file}/cache.pickle"], "cannot create its folder"),  # was: the same
        ("bench_proxy.py", ["--profile", "{file}/proxy.svg"], "cannot create its folder"),  # was: py-spy failed, late
        ("bench_proxy.py", ["--profile", ""], "give a file name"),
        ("bench_proxy.py", ["--profile", "{folder}"], "is a folder: give a file path"),  # was: wrote beside it
    ],
)
def test_a_benchmark_refuses_a_path_it_cannot_use_before_it_runs(
    script: str, args: list[str], expected: str, tmp_path: Path
) -> None:
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "file").write_text("")
    paths = {"fifo": tmp_path / "fifo", "folder": tmp_path, "long": tmp_path / ("x" * 300), "file": tmp_path / "file"}
    argv = [arg.format(**paths) for arg in args]
    done = subprocess.run([sys.executable, str(BENCHMARKS / script), *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and expected in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert done.stdout == ""


def test_bench_proxy_names_each_profile_after_the_one_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from bench_proxy import profile_outputs

    assert profile_outputs("out/proxy.svg")["ids"] == Path("out/proxy-ids.svg")
    assert profile_outputs("out/stacks.txt")["chat"] == Path("out/stacks-chat.txt")
    assert profile_outputs("prof")["text"] == Path("prof-text")  # was: "-text.prof", in the current folder
    assert profile_outputs(None) == {}
