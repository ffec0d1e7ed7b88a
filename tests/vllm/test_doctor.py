"""``prefixroute doctor`` on saved /metrics texts from healthy and miss-heavy fake engines, and on bad input."""

from __future__ import annotations

import argparse
import io
import json
import math
import random
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixroute._numbers import shown
from prefixroute.errors import ConfigurationError, InvalidTypeError, MetricsError
from prefixroute.testing import FakeVLLM
from prefixroute.vllm import EngineMetrics, doctor
from prefixroute.vllm.doctor import MISS_ADVICE, histogram_quantile
from prefixroute.vllm.metrics import MAX_METRICS_BYTES, fetch_metrics

from ..conftest import DEADLINE_S, returns

BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


def cli(*args: str) -> int:
    parser = argparse.ArgumentParser(prog="prefixroute")
    doctor.register(parser.add_subparsers())
    parsed = parser.parse_args(["doctor", *args])
    status: int = parsed.func(parsed)
    return status


def healthy_text() -> str:
    """Many requests sharing a long system prompt: nearly every prefill is a cache hit."""
    rng = random.Random(1)
    system = [rng.randrange(30_000) for _ in range(1024)]
    with FakeVLLM(num_blocks=2048) as engine:
        for _ in range(300):
            engine.complete(system + [rng.randrange(30_000) for _ in range(rng.randrange(16, 64))])
        return engine.metrics_text()


def miss_heavy_text() -> str:
    """Unique long prompts and bursts of queueing: every prefill is a miss, and the tail is long."""
    rng = random.Random(2)
    with FakeVLLM(num_blocks=256) as engine:
        for _ in range(300):
            engine.set_load(running=8, waiting=0 if rng.random() < 0.9 else rng.randrange(20, 40))
            engine.complete([rng.randrange(30_000) for _ in range(rng.randrange(256, 2048))])
        return engine.metrics_text()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("metrics")
    files = {"healthy": folder / "healthy.txt", "miss": folder / "miss.txt"}
    files["healthy"].write_text(healthy_text())
    files["miss"].write_text(miss_heavy_text())
    return files


def test_healthy_engine(saved: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(str(saved["healthy"])) == 0
    out = capsys.readouterr().out
    assert "HEALTHY" in out and "prefix hit rate 9" in out and MISS_ADVICE not in out


def test_miss_heavy_engine(saved: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(str(saved["miss"])) == 1
    out = capsys.readouterr().out
    assert "SUSPECT" in out and MISS_ADVICE in out and "hit rate of 0.0%" in out


def test_json_output_and_worst_status_over_sources(saved: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli("--json", str(saved["healthy"]), str(saved["miss"])) == 1
    report = json.loads(capsys.readouterr().out)
    healthy, miss = report["targets"]
    assert report["exit_code"] == 1 and (healthy["verdict"], miss["verdict"]) == ("healthy", "suspect")
    assert miss["p99_p50_ratio"] > 5 > healthy["p99_p50_ratio"]
    assert miss["prefix_hit_rate"] == 0 and healthy["prefix_hit_rate"] > 0.9
    assert miss["ttft_p50_s"] <= miss["ttft_p95_s"] <= miss["ttft_p99_s"]


def test_a_long_tail_with_a_high_hit_rate_is_suspect_for_another_reason(capsys: pytest.CaptureFixture[str]) -> None:
    with FakeVLLM() as engine:
        engine.complete(list(range(64)))
        for i in range(200):
            engine.complete(list(range(64)))
            engine.observe_ttft(0.02 if i % 20 else 1.5)
        engine.set_load(running=4, waiting=9)
        assert cli(engine.url) == 1  # read over HTTP this time
    out = capsys.readouterr().out
    assert "not explained by cache misses" in out and "\n  queue           4 running, 9 waiting\n" in out


def test_an_idle_engine_is_healthy_with_nothing_to_judge(capsys: pytest.CaptureFixture[str]) -> None:
    with FakeVLLM() as engine:
        assert cli(engine.url + "/metrics") == 0
    assert "no TTFT samples yet" in capsys.readouterr().out


def test_unreadable_inputs_exit_2_with_a_clear_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    garbage = tmp_path / "garbage.txt"
    garbage.write_text("<html>502 Bad Gateway</html>\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    assert cli(str(garbage), str(tmp_path / "missing.txt"), dead) == 2
    out = capsys.readouterr().out
    assert out.count("UNREADABLE") == 3
    assert "not Prometheus text" in out and "cannot read" in out and "Traceback" not in out


def test_the_installed_command_prints_no_traceback_on_malformed_text(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.txt"
    garbage.write_text('vllm:num_requests_waiting{engine="0"} many\n')
    done = subprocess.run(
        [sys.executable, "-m", "prefixroute", "doctor", str(garbage)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done.stderr
    assert "UNREADABLE" in done.stdout and "not Prometheus text" in done.stdout
    assert "Traceback" not in done.stderr + done.stdout


@given(st.lists(st.floats(0.001, 10.0), min_size=1, max_size=200), st.floats(0.0, 1.0))
def test_quantile_falls_in_the_bucket_that_holds_the_true_quantile(samples: list[float], q: float) -> None:
    bounds = [*BUCKETS, math.inf]
    buckets = [(b, float(sum(1 for s in samples if s <= b))) for b in bounds]
    estimate = histogram_quantile(q, buckets)
    assert estimate is not None
    ordered = sorted(samples)
    true = ordered[max(0, math.ceil(q * len(ordered)) - 1)]
    upper = next(b for b in bounds if true <= b)
    lower = max([0.0, *(b for b in bounds if b < upper)])
    assert lower <= estimate <= (upper if not math.isinf(upper) else BUCKETS[-1])
    assert histogram_quantile(min(1.0, q + 0.1), buckets) >= estimate  # type: ignore[operator]


def test_quantile_edge_cases() -> None:
    assert histogram_quantile(0.5, []) is None
    assert histogram_quantile(0.5, [(1.0, 0.0), (math.inf, 0.0)]) is None
    assert histogram_quantile(0.99, [(1.0, 1.0), (math.inf, 10.0)]) == 1.0  # in +Inf: the highest finite bound
    with pytest.raises(ValueError, match="q must be"):
        histogram_quantile(1.5, [(1.0, 1.0)])


@pytest.mark.parametrize("q", [1.5, -0.1, float("nan"), "0.5", None, 10**400, True])
def test_quantile_refuses_a_q_that_is_no_fraction_with_a_configuration_error(q: object) -> None:
    # Was a bare ValueError (out of range) or TypeError (a str, None) rather than the library's error.
    with pytest.raises(ConfigurationError, match="q must be a number in") as raised:
        histogram_quantile(q, [(1.0, 1.0)])  # type: ignore[arg-type]
    assert str(raised.value).endswith(f", not {shown(q)}")


@pytest.mark.parametrize("buckets", [5, "1", [1.0], [(1.0,)], [("1", 2)], [(1.0, None)], [{1.0, 2.0}]])
def test_quantile_refuses_buckets_that_are_no_pairs_of_numbers_with_a_type_error(buckets: object) -> None:
    with pytest.raises(InvalidTypeError, match="buckets must be") as raised:
        histogram_quantile(0.5, buckets)  # type: ignore[arg-type]
    assert str(raised.value).endswith(f", not {shown(buckets)}")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--timeout", "nan", "x.txt"], "--timeout must be a finite positive number"),
        (["--timeout", "inf", "x.txt"], "--timeout must be a finite positive number"),
        (["--timeout", "-1", "x.txt"], "--timeout must be a finite positive number"),
        (["--timeout", "0", "x.txt"], "--timeout must be a finite positive number"),
        (["--timeout", "soon", "x.txt"], "--timeout must be a number"),
        (["--ratio-threshold", "0.5", "x.txt"], "--ratio-threshold must be a finite number >= 1"),
        (["--ratio-threshold", "nan", "x.txt"], "--ratio-threshold"),
        (["--low-hit-rate", "1.5", "x.txt"], "--low-hit-rate must be a fraction"),
        (["--low-hit-rate", "nan", "x.txt"], "--low-hit-rate"),
        (["--ratio-threshold", "high", "x.txt"], "--ratio-threshold must be a number, not 'high'"),
        (["--low-hit-rate", "low", "x.txt"], "--low-hit-rate must be a number, not 'low'"),
        ([], "give at least one source"),
    ],
)
def test_bad_options_exit_2_with_one_line(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(*args) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and message in captured.err


def test_the_installed_command_answers_a_bad_option_with_one_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "prefixroute", "doctor", "--timeout", "nan", "x"], capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().count("\n") == 0 and "--timeout" in done.stderr and "Traceback" not in done.stderr


def test_the_timeout_bounds_the_whole_run_over_slow_and_trickling_engines(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """One timeout for the run, not one per engine nor per read: the engines are read at once (each read waits at a
    barrier of three, which reads one after another never fill), and each read ends at its own timeout, as no answer
    ever comes complete (ten minutes late, or a megabyte trickled a byte every 0.05 s, each read well in time)."""
    together = threading.Barrier(3, timeout=DEADLINE_S)

    def read_together(url: str, *, timeout: float) -> EngineMetrics:
        together.wait()
        return fetch_metrics(url, timeout=timeout)

    monkeypatch.setattr(doctor, "fetch_metrics", read_together)
    with FakeVLLM() as slow, FakeVLLM() as trickling, FakeVLLM() as slower:
        slow.set_metrics_fault(delay=600.0)
        trickling.set_metrics_fault(text="#" * 2**20, trickle=0.05)
        slower.set_metrics_fault(delay=900.0)
        urls = (slow.url, trickling.url, slower.url)
        assert returns(lambda: cli("--timeout", "0.5", *urls), what="doctor --timeout 0.5") == 2
    out = capsys.readouterr().out
    assert out.count("UNREADABLE") == 3 and out.count("no complete answer within 0.5s") == 3


def test_many_urls_are_read_by_a_bounded_pool_and_every_one_is_reported(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Was: one thread per URL (and one more inside each fetch), however many URLs were named."""
    pools: list[int] = []

    class Recorded(ThreadPoolExecutor):
        def __init__(self, max_workers: int, **options: Any) -> None:
            pools.append(max_workers)
            super().__init__(max_workers, **options)

    def unreachable(url: str, *, timeout: float) -> EngineMetrics:
        raise MetricsError(f"cannot read {url}: refused")

    monkeypatch.setattr(doctor, "ThreadPoolExecutor", Recorded)
    monkeypatch.setattr(doctor, "fetch_metrics", unreachable)
    urls = [f"http://gpu{i}:8000" for i in range(3 * doctor.CONCURRENT_READS + 1)]
    assert cli(*urls) == 2
    assert pools == [doctor.CONCURRENT_READS]
    out = capsys.readouterr().out
    assert [line.removesuffix(": UNREADABLE") for line in out.splitlines() if "UNREADABLE" in line] == urls
    assert cli("http://gpu0:8000", "http://gpu1:8000") == 2
    assert pools[-1] == 2  # no idle workers for a few URLs


@pytest.mark.parametrize("nonsense", ["NaN", "-2", "+Inf"])
def test_nonsense_figures_are_unreadable_not_judged(
    nonsense: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = tmp_path / "metrics.txt"
    saved.write_text(f'vllm:num_requests_waiting{{engine="0"}} {nonsense}\n')
    assert cli(str(saved)) == 2
    out = capsys.readouterr().out
    assert "UNREADABLE" in out and "vllm:num_requests_waiting is" in out


def test_an_http_error_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with FakeVLLM() as engine:
        assert cli(engine.url + "/nothing") == 2
    reason = capsys.readouterr().out.splitlines()[1]
    assert "HTTP 404" in reason


def test_diagnose_rejects_nonsense_thresholds() -> None:
    with pytest.raises(ConfigurationError, match="ratio_threshold"):
        doctor.diagnose(EngineMetrics(), ratio_threshold=float("nan"))
    with pytest.raises(ConfigurationError, match="low_hit_rate"):
        doctor.diagnose(EngineMetrics(), low_hit_rate=-0.1)


def test_diagnose_refuses_arguments_of_the_wrong_type_with_the_library_s_errors() -> None:
    # Were an AttributeError (metrics None), a TypeError (a str threshold) and an OverflowError (a huge int one).
    with pytest.raises(InvalidTypeError, match="metrics must be an EngineMetrics .*, not None$"):
        doctor.diagnose(None)  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="metrics must be an EngineMetrics .*, not 5$"):
        doctor.diagnose(5)  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="source must be a str naming where the figures came from, not 5$"):
        doctor.diagnose(EngineMetrics(), source=5)  # type: ignore[arg-type]
    for value in ("5", None, 10**400):
        with pytest.raises(ConfigurationError, match="ratio_threshold must be a finite number >= 1") as raised:
            doctor.diagnose(EngineMetrics(), ratio_threshold=value)  # type: ignore[arg-type]
        assert str(raised.value).endswith(f", not {shown(value)}")
        with pytest.raises(ConfigurationError, match=r"low_hit_rate must be a fraction in \[0, 1\]") as raised:
            doctor.diagnose(EngineMetrics(), low_hit_rate=value)  # type: ignore[arg-type]
        assert str(raised.value).endswith(f", not {shown(value)}")


def test_a_file_over_the_size_cap_is_unreadable_not_read_whole(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    huge = tmp_path / "huge.txt"
    with huge.open("wb") as file:
        file.truncate(MAX_METRICS_BYTES + 1)  # sparse: no disk used; /dev/zero and real huge files go the same way
    assert cli(str(huge)) == 2
    out = capsys.readouterr().out
    assert "UNREADABLE" in out and f"over {MAX_METRICS_BYTES} bytes" in out and out.count("\n") == 2


def test_a_url_with_a_query_gets_metrics_in_its_path(capsys: pytest.CaptureFixture[str]) -> None:
    with FakeVLLM() as engine:
        assert cli(engine.url + "/?token=abc") == 0
    assert "HEALTHY" in capsys.readouterr().out


TTFT = "vllm:time_to_first_token_seconds"


def histogram(*buckets: tuple[str, int], count: int | None = None) -> str:
    lines = [f"# TYPE {TTFT} histogram"]
    lines += [f'{TTFT}_bucket{{le="{bound}"}} {n}' for bound, n in buckets]
    if count is not None:
        lines.append(f"{TTFT}_count {count}")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (histogram(("-5", 50), ("-1", 100), ("+Inf", 100), count=100), "not negative"),
        (histogram(("1e-320", 60), ("1e300", 100), ("+Inf", 100), count=100), "P99/P50 overflows"),
        (
            histogram(("1", 100), ("+Inf", 100), count=100)
            + "vllm:prefix_cache_queries_total 10\nvllm:prefix_cache_hits_total 50\n",
            "hits (50 tokens) exceed queries (10)",
        ),
    ],
)
def test_contradictory_figures_are_unreadable_also_in_valid_json(
    text: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = tmp_path / "metrics.txt"
    saved.write_text(text)
    assert cli(str(saved)) == 2
    out = capsys.readouterr().out
    assert "UNREADABLE" in out and message in out

    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    assert cli("--json", str(saved)) == 2
    report = json.loads(capsys.readouterr().out, parse_constant=refuse)
    assert report["targets"][0]["verdict"] == "unreadable"


def test_huge_figures_are_printed_in_exponent_form(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved = tmp_path / "metrics.txt"
    saved.write_text(histogram(("1", 60), ("1e300", 100), ("+Inf", 100), count=100))
    assert cli(str(saved)) == 1
    out = capsys.readouterr().out
    assert "P99 9.75e+299s" in out and "0" * 20 not in out  # not 300 digits


@pytest.mark.parametrize("buckets", [(("0", 100), ("+Inf", 100)), (("+Inf", 100),)])
def test_samples_with_a_p50_of_0_are_not_no_samples(
    buckets: tuple[tuple[str, int], ...], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = tmp_path / "metrics.txt"
    saved.write_text(histogram(*buckets, count=100))
    assert cli(str(saved)) == 0
    out = capsys.readouterr().out
    assert "  TTFT            P50 0.000s  P95 0.000s  P99 0.000s  (100 requests)" in out
    assert "TTFT P50 is 0s by the histogram" in out and "P99/P50 cannot be judged" in out
    assert "no TTFT samples" not in out


def test_without_a_count_the_requests_are_those_of_the_last_bucket(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = tmp_path / "metrics.txt"
    saved.write_text(histogram(("0.1", 50), ("0.2", 100), ("+Inf", 100)))
    assert cli(str(saved)) == 0
    assert "  TTFT            P50 0.100s  P95 0.190s  P99 0.198s  (100 requests)" in capsys.readouterr().out


def tail_of(p99: float, **figures: Any) -> EngineMetrics:
    """An engine whose TTFT P50 is 1 s and whose P99 is ``p99`` (it falls on a bucket's bound, so exactly)."""
    buckets = ((1.0, 50.0), (p99, 99.0), (math.inf, 100.0))
    return EngineMetrics(ttft_buckets=buckets, ttft_count=100.0, **figures)


def test_diagnose_judges_by_its_documented_defaults_and_boundaries() -> None:
    """Suspect when P99/P50 is *above* ratio_threshold (5 by default); a hit rate is low *under* low_hit_rate (0.5 by
    default); the KV cache is nearly full from 95% on."""
    queue = {"running": 4.0, "waiting": 9.0}
    long = tail_of(5.5, prefix_queries=100.0, prefix_hits=50.0, **queue)  # P99/P50 = 5.5, hit rate 50%
    suspect = doctor.diagnose(long, source="gpu0")
    assert (suspect.source, suspect.verdict, suspect.exit_code, suspect.p99_p50_ratio) == ("gpu0", "suspect", 1, 5.5)
    assert suspect.reasons == [
        "long TTFT tail not explained by cache misses: TTFT P99/P50 = 5.5 (P50 1.000s, P99 5.500s) > 5, prefix cache "
        "hit rate 50.0% (4 running, 9 waiting); look at queueing and prompt lengths"
    ]
    healthy = doctor.diagnose(long, ratio_threshold=5.5)  # not above its threshold
    assert healthy.verdict == "healthy" and healthy.reasons == [
        "TTFT P99/P50 = 5.5 (P50 1.000s, P99 5.500s) <= 5.5; prefix cache hit rate 50.0%; 4 running, 9 waiting"
    ]
    low = doctor.diagnose(tail_of(5.5, prefix_queries=100.0, prefix_hits=49.0, **queue))
    assert low.verdict == "suspect" and low.reasons[0].startswith(f"{MISS_ADVICE}: TTFT P99/P50 = 5.5")
    assert "hit rate of 49.0% (4 running, 9 waiting)" in low.reasons[0]
    unknown = doctor.diagnose(tail_of(2.0))
    assert unknown.verdict == "healthy" and unknown.reasons[0].endswith(
        "prefix cache hit rate unknown; ? running, ? waiting"
    )
    # The thresholds' own bounds are taken.
    assert doctor.diagnose(tail_of(1.5), ratio_threshold=1).verdict == "suspect"
    assert doctor.diagnose(tail_of(1.5), ratio_threshold=1.5).verdict == "healthy"
    for rate in (0, 1):
        assert doctor.diagnose(long, low_hit_rate=rate).verdict == "suspect"
    assert doctor.diagnose(long, low_hit_rate=1).reasons[0].startswith(MISS_ADVICE)  # 50% is under 1
    with pytest.raises(ConfigurationError, match=r"low_hit_rate must be a fraction in \[0, 1\], not 1.5$"):
        doctor.diagnose(long, low_hit_rate=1.5)
    full = doctor.diagnose(tail_of(2.0, kv_usage=0.95))
    assert (full.verdict, full.exit_code) == ("suspect", 1)
    assert full.reasons[1] == "KV cache 95% full: cached prefixes are evicted quickly"
    assert doctor.diagnose(tail_of(2.0, kv_usage=0.94)).verdict == "healthy"


def test_a_diagnosis_carries_the_engine_s_figures_and_its_source() -> None:
    metrics = tail_of(2.0, running=3.0, waiting=1.0, kv_usage=0.5, prefix_queries=80.0, prefix_hits=20.0,
                      block_size=16, num_gpu_blocks=4096)  # fmt: skip
    d = doctor.diagnose(metrics, source="gpu0")
    figures = (d.source, d.running, d.waiting, d.kv_usage, d.prefix_queries_tokens, d.prefix_hit_rate)
    assert figures == ("gpu0", 3.0, 1.0, 0.5, 80.0, 0.25)
    assert (d.block_size, d.num_gpu_blocks, d.ttft_samples, d.ttft_p50_s, d.ttft_p99_s) == (16, 4096, 100.0, 1.0, 2.0)
    assert doctor.diagnose(metrics).source == ""  # no source named: none made up
    contradictions = [
        EngineMetrics(prefix_queries=1.0, prefix_hits=2.0),
        EngineMetrics(ttft_buckets=((1e-320, 60.0), (1e300, 100.0), (math.inf, 100.0)), ttft_count=100.0),
    ]
    for contradiction in contradictions:
        unreadable = doctor.diagnose(contradiction, source="gpu0")
        assert (unreadable.source, unreadable.verdict) == ("gpu0", "unreadable")


def test_stdin_is_read_as_a_source_and_refused_over_the_cap_without_reading_it_whole(
    saved: dict[str, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    class Zeros:
        """/dev/zero: as many bytes as asked for; asked for all of them, it never ends."""

        def read(self, size: int | None = -1) -> bytes:
            if size is None or size < 0:
                raise MemoryError("read /dev/zero whole")
            return bytes(size)

        def __enter__(self) -> Zeros:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

    class Stdin:
        def __init__(self, buffer: object) -> None:
            self.buffer = buffer

    monkeypatch.setattr(sys, "stdin", Stdin(io.BytesIO(saved["healthy"].read_bytes())))
    assert cli("-") == 0
    assert capsys.readouterr().out.startswith("-: HEALTHY\n")
    monkeypatch.setattr(sys, "stdin", Stdin(Zeros()))
    assert cli("-") == 2
    assert f"-: UNREADABLE\n  - cannot read -: it is over {MAX_METRICS_BYTES} bytes" in capsys.readouterr().out

    class DevZero:
        def __init__(self, source: str) -> None:
            pass

        def open(self, mode: str) -> Zeros:
            return Zeros()

    monkeypatch.setattr(doctor, "Path", DevZero)
    assert cli("/dev/zero") == 2
    assert f"cannot read /dev/zero: it is over {MAX_METRICS_BYTES} bytes" in capsys.readouterr().out


def test_a_file_of_exactly_the_cap_is_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Refused *over* 32 MiB: a file of 32 MiB is read and parsed (here it is no Prometheus text)."""
    exact = tmp_path / "exact.txt"
    exact.write_bytes(b"<html>\n".ljust(MAX_METRICS_BYTES, b"\n"))
    assert cli(str(exact)) == 2
    out = capsys.readouterr().out
    assert "not Prometheus text" in out and "bytes" not in out


def test_unreadable_files_say_why(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("vllm:num_requests_running 1 # caf\xe9\n".encode("latin-1"))
    missing = tmp_path / "missing.txt"
    assert cli(str(latin), str(missing)) == 2
    out = capsys.readouterr().out
    assert f"  - cannot read {latin}: 'utf-8' codec can't decode" in out
    assert f"  - cannot read {missing}: [Errno 2] No such file or directory" in out


def test_the_thresholds_given_on_the_command_line_are_the_ones_judged_by(
    saved: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    miss = str(saved["miss"])
    assert cli("--ratio-threshold", "1000", miss) == 0  # its P99/P50 is above 5, far under 1000
    assert capsys.readouterr().out.startswith(f"{miss}: HEALTHY\n")
    assert cli("--low-hit-rate", "0", miss) == 1  # a hit rate of 0% is not under 0
    out = capsys.readouterr().out
    assert out.startswith(f"{miss}: SUSPECT\n") and "not explained by cache misses" in out and MISS_ADVICE not in out
    assert cli("--ratio-threshold", "1", "--low-hit-rate", "1", miss) == 1  # both bounds are taken
    assert MISS_ADVICE in capsys.readouterr().out


@pytest.mark.parametrize("source", ["", " ", "ftp://gpu0/metrics", "gpu0\0.txt"])
def test_a_source_that_is_no_url_file_or_stdin_is_a_bad_option(source: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(source) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == (
        "prefixroute doctor: a source must be an http:// or https:// URL, a saved /metrics file or - for stdin, "
        f"not {source!r}\n"
    )


def test_https_urls_in_any_case_are_read_as_urls(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    read: list[str] = []

    def unreachable(url: str, *, timeout: float) -> EngineMetrics:
        read.append(url)
        raise MetricsError(f"cannot read {url}: refused")

    monkeypatch.setattr(doctor, "fetch_metrics", unreachable)
    assert cli("https://gpu0:8000", "HTTPS://gpu1:8000") == 2
    assert sorted(read) == ["HTTPS://gpu1:8000/metrics", "https://gpu0:8000/metrics"]
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out.count("UNREADABLE") == 2


def test_the_text_report_shows_each_figure_or_what_is_unknown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = tmp_path / "metrics.txt"
    saved.write_text('vllm:num_requests_running{engine="0"} 4\n')  # no TTFT, no prefix cache figures, no waiting
    assert cli(str(saved)) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:4] == [
        f"{saved}: HEALTHY",
        "  TTFT            n/a  (0 requests)",
        "  prefix hit rate n/a",
        "  queue           4 running, ? waiting",
    ]
    # A million seconds is in exponent form, as everything from a million up ("_fixed").
    saved.write_text(histogram(("1", 98), ("1e6", 99), ("+Inf", 100), count=100))
    assert cli(str(saved)) == 1
    assert "  TTFT            P50 0.510s  P95 0.969s  P99 1e+06s  (100 requests)" in capsys.readouterr().out


def test_help_describes_the_command_and_each_option(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # each option's help on one line, whatever the terminal
    parser = argparse.ArgumentParser(prog="prefixroute")
    doctor.register(parser.add_subparsers())
    assert "doctor" in parser.format_help() and "diagnose vLLM TTFT" in parser.format_help()
    with pytest.raises(SystemExit):
        parser.parse_args(["doctor", "--help"])
    out = capsys.readouterr().out
    assert "[URL|FILE ...]" in out
    assert (
        doctor.__doc__ is not None and doctor.__doc__.splitlines()[0] in out.splitlines()
    )  # as written, not rewrapped
    for option, words in [
        ("URL|FILE", "saved file or -"),
        ("--json", "as JSON"),
        ("--timeout", "(default 5)"),
        ("--ratio-threshold", "(default 5)"),
        ("--low-hit-rate", "(default 0.5)"),
    ]:
        listed = out[out.index(f"  {option}") :]
        assert words in listed.split("\n  -")[0], option
