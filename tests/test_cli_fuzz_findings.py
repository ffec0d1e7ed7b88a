"""What a sweep of hostile values over every CLI option found: each is exit status 2 and one line on stderr, found
before anything runs, never a traceback, a hang or a memory blow-up."""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

from prefixroute.cli import main
from prefixroute.sim import costfit

DATA = Path(__file__).resolve().parents[1] / "data"
TINY = ["--requests", "5", "--policy", "round-robin"]


def _one_line(err: str, expected: str) -> None:
    assert err.endswith("\n") and err.count("\n") == 1, f"not one line: {err!r}"
    assert "Traceback" not in err and expected in err, err


@pytest.mark.parametrize("command", [["simulate"], ["compare", "--jobs", "1"]])
def test_plot_in_a_format_matplotlib_cannot_write_fails_before_the_run(
    command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Was: the whole run, then a ValueError traceback from savefig (exit status 1).
    plot = tmp_path / "results.txt"
    assert main([*command, *TINY, "--plot", str(plot)]) == 2
    out, err = capsys.readouterr()
    _one_line(err, "--plot")
    assert "'txt'" in err and "png" in err, err
    assert out == "" and not plot.exists()


def test_costfit_plot_in_a_format_matplotlib_cannot_write_fails_before_the_fit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Was: the refit written to --out, then a ValueError traceback (exit status 1).
    out_folder = tmp_path / "out"
    assert costfit.main(["--data", str(DATA), "--out", str(out_folder), "--plot", str(tmp_path / "plot.5")]) == 2
    out, err = capsys.readouterr()
    _one_line(err, "--plot")
    assert out == "" and not list(out_folder.glob("*"))  # nothing fitted or written (the folder may be made)


@pytest.mark.parametrize(
    "argv",
    [
        ["-m", "prefixroute", "simulate", *TINY, "--plot", "PLOT"],
        ["-m", "prefixroute.sim.costfit", "--data", str(DATA), "--check", "--plot", "PLOT"],
    ],
)
def test_a_garbage_mplbackend_is_one_line_before_the_run(argv: list[str], tmp_path: Path) -> None:
    # matplotlib refuses the MPLBACKEND it is given when it is imported; the plots use Agg whatever it says.
    plot = tmp_path / "plot.png"
    argv = [str(plot) if a == "PLOT" else a for a in argv]
    env = {**os.environ, "MPLBACKEND": "no-such-backend"}
    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2, done.stderr
    _one_line(done.stderr, "MPLBACKEND")
    assert done.stdout == "" and not plot.exists()


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="needs /dev/zero")
def test_costplot_update_that_is_not_a_regular_file(tmp_path: Path) -> None:
    # Was: read_text() on /dev/zero, filling the memory until killed.
    png = tmp_path / "plot.png"
    code = "import sys; from prefixroute.sim.costplot import main; sys.exit(main(sys.argv[1:]))"
    done = subprocess.run(
        [sys.executable, "-c", code, str(png), "--update", "/dev/zero"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done.stderr[-2000:]
    _one_line(done.stderr, "/dev/zero")
    assert not png.exists()


@pytest.mark.parametrize("command", [["proxy", "--backends", "http://127.0.0.1:9"], ["fake-engines"], ["serve"]])
@pytest.mark.parametrize("host", ["a" * 64, "gpu0..cluster", ".gpu0"])
def test_a_host_name_no_resolver_takes_is_refused_by_its_option(
    command: list[str], host: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Was, for proxy and fake-engines: a UnicodeError traceback from getaddrinfo (a label over 63 or empty), exit 1.
    assert main([*command, "--port" if command[0] != "fake-engines" else "--base-port", "1", "--host", host]) == 2
    out, err = capsys.readouterr()
    _one_line(err, "argument --host")
    assert out == ""


@pytest.mark.parametrize(
    "run",
    [
        lambda folder: main(["study", "--requests", "5", "--output", folder]),
        lambda folder: costfit.main(["--data", str(DATA), "--out", folder]),
    ],
    ids=["study --output", "costfit --out"],
)
@pytest.mark.parametrize("folder", ["", " "])
def test_an_empty_output_folder_is_refused_not_the_current_one(
    run: Callable[[str], int], folder: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    # Was: Path("") is ".", so an unset "$OUT" wrote study.md and its plots (or the refit) into the current folder.
    monkeypatch.chdir(tmp_path)
    assert run(folder) == 2
    out, err = capsys.readouterr()
    _one_line(err, "empty")
    assert out == "" and not list(tmp_path.iterdir())


@pytest.mark.parametrize("command", ["simulate", "compare"])
def test_a_duration_too_short_for_any_request_is_one_line_not_a_table_of_nans(command: str) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "prefixroute",
            command,
            "--scenario",
            "seed",
            "--duration",
            "0.001",
            "--policy",
            "round-robin",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=120,  # fmt: skip
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "nan" not in result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "no request was sent within --duration 0.001 s" in lines[0], result.stderr


def test_a_plot_name_without_an_extension_is_written_and_reported_as_png(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Was: matplotlib wrote plot.png while the command checked and reported "plot".
    assert main(["simulate", *TINY, "--plot", str(tmp_path / "plot")]) == 0
    out, _ = capsys.readouterr()
    assert (tmp_path / "plot.png").is_file() and not (tmp_path / "plot").exists()
    assert f"wrote {tmp_path / 'plot.png'}" in out


@pytest.mark.parametrize(
    ("option", "value"),
    [("--token-delay-ms", "1e300"), ("--prefill-us-per-token", "1e9"), ("--max-tokens", str(10**20)), ("--model", " ")],
)
def test_fake_engines_refuse_values_that_would_hang_or_name_nothing(
    option: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Was: --token-delay-ms 1e300 started engines whose every request slept forever; --model ' ' served a blank name.
    assert main(["fake-engines", "--base-port", "39100", option, value]) == 2
    _one_line(capsys.readouterr().err, option)


def _free_port_then_bound_one() -> tuple[int, socket.socket]:
    """A loopback port P that was free a moment ago, and a socket bound to P + 1 (tried again where another process
    holds P + 1: a fresh-clone CI run once found it taken)."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = int(probe.getsockname()[1])
        if base >= 65535:
            continue
        busy = socket.socket()
        try:
            busy.bind(("127.0.0.1", base + 1))
        except OSError:
            busy.close()
            continue
        return base, busy


def test_fake_engines_whose_later_port_is_busy_close_the_earlier_and_announce_none(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Was: the first engine announced on stdout, then the one line for the busy second port, and the first engine's
    # listening socket left open (ResourceWarning; its port held) in a process that goes on.
    base, busy = _free_port_then_bound_one()
    with busy:
        busy.listen()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            assert main(["fake-engines", "--count", "2", "--base-port", str(base)]) == 2
            gc.collect()
    out, err = capsys.readouterr()
    _one_line(err, f"cannot listen on 127.0.0.1:{base}+")
    assert out == ""
    assert [str(warning.message) for warning in caught if warning.category is ResourceWarning] == []


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--lora-adapters", ""], "--lora-adapters must name a model"),
        (["--lora-adapters", " "], "--lora-adapters must name a model"),
        (["--lora-adapters", "sql", "sql"], "--lora-adapters lists 'sql' twice"),
        (["--lora-adapters", "fake-model"], "--lora-adapters names the base model 'fake-model'"),
        (["--model", "m", "--lora-adapters", "a", "m"], "--lora-adapters names the base model 'm'"),
        (["--model", ""], "--model must name a model"),
        (["--model", "\udcff"], "--model must name a model"),  # a lone surrogate, as argv undecodable bytes give
        (["--model", "a\nb"], "--model must name a model"),
    ],
)
def test_fake_engines_refuse_served_names_that_are_blank_repeated_or_unsendable(
    options: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Was: '' and duplicate adapters served, an adapter named as the base model shadowed it, a lone surrogate
    # served (and failed in every /v1/models answer).
    assert main(["fake-engines", "--base-port", "39100", *options]) == 2
    out, err = capsys.readouterr()
    _one_line(err, message)
    assert out == ""


@pytest.mark.parametrize(
    "command",
    [
        ["proxy", "--backends", "http://127.0.0.1:9", "--kv-events", "tcp://127.0.0.1:5557"],
        ["serve", "--backends", "http://127.0.0.1:9", "--kv-events", "http://127.0.0.1:9=tcp://127.0.0.1:5557"],
    ],
    ids=["proxy", "serve"],
)
@pytest.mark.parametrize("size", ["60000", "1025", str(10**30)])
def test_a_data_parallel_size_past_1024_is_one_line_not_thousands_of_threads(
    command: list[str], size: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Was: --data-parallel-size 60000 started 60000 subscriber threads (and sockets) per backend.
    assert main([*command, "--port", "1", "--data-parallel-size", size]) == 2
    out, err = capsys.readouterr()
    _one_line(err, "--data-parallel-size must be an int in [1, 1024]")
    assert out == ""


@pytest.mark.parametrize("retries", ["99999999999999999999999", "17", "-1"])
def test_proxy_retries_outside_0_to_16_are_one_line(retries: str, capsys: pytest.CaptureFixture[str]) -> None:
    # Was: --retries 99999999999999999999999 accepted, and a request resent while the fleet was down.
    assert main(["proxy", "--backends", "http://127.0.0.1:9", "--port", "1", "--retries", retries]) == 2
    out, err = capsys.readouterr()
    _one_line(err, "--retries must be an int in [0, 16]")
    assert out == ""


@pytest.mark.parametrize(
    ("names", "message"),
    [([""], "base_models must name models"), (["llama", " "], "base_models must name models"),
     (["llama", "llama"], "base_models names 'llama' twice")],
)  # fmt: skip
def test_a_blank_or_repeated_proxy_base_model_is_one_line(
    names: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Was: --base-model "$UNSET" accepted: the models were no longer learned and no request's model matched ''. A
    # name given twice (a typo for another, or "$MODEL $MODEL") was taken silently, as serve --models refuses it.
    with socket.socket() as taken:  # a port the proxy cannot bind: were the names taken, it would fail there
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        assert main(["proxy", "--backends", "http://127.0.0.1:9", "--port", port, "--base-model", *names]) == 2
    out, err = capsys.readouterr()
    _one_line(err, message)
    assert out == ""
