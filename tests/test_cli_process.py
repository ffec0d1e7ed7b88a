"""The CLI as a process meets it: stdout closed or its reader gone, a strict UTF-8 stdout and a path that is not
UTF-8, SIGTERM. Each ended in a traceback, or in an error that blamed something else, before its fix."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest


def simulate(requests: int) -> list[str]:
    return [sys.executable, "-m", "prefixroute", "simulate", "--requests", str(requests), "--backends", "2"] + [
        "--policy",
        "round-robin",
    ]


SIMULATE = simulate(3)


def _closed_stdout() -> None:
    os.close(1)


def test_a_command_whose_stdout_is_closed_runs_and_writes_its_files(tmp_path: Path) -> None:
    # Was: exit 1 and a traceback (sys.stdout is None, and the table's console asked it isatty()).
    out = tmp_path / "run.json"
    done = subprocess.run(
        [*SIMULATE, "--json", str(out)], stderr=subprocess.PIPE, text=True, timeout=120, preexec_fn=_closed_stdout
    )
    assert (done.returncode, done.stderr) == (0, "")
    assert out.stat().st_size > 0


def test_a_path_that_is_not_utf8_prints_as_its_bytes_on_a_strict_utf8_stdout(tmp_path: Path) -> None:
    # Was: the run done and its file written, then a UnicodeEncodeError traceback on printing "wrote ...".
    folder = os.fsencode(tmp_path)
    out = folder + b"/run\xff.json"
    done = subprocess.run(
        [*map(os.fsencode, SIMULATE), b"--json", out],
        capture_output=True,
        timeout=120,
        env={**os.environ, "PYTHONIOENCODING": "utf-8:strict"},
    )
    assert done.returncode == 0 and done.stderr == b"", done.stderr
    assert out in done.stdout and os.path.getsize(out) > 0


@pytest.mark.parametrize("command", ["simulate", "study"])
def test_a_reader_that_goes_away_ends_a_command_quietly(command: str, tmp_path: Path) -> None:
    # Was: exit 2 and "error: Broken pipe" for study, silence for simulate (rich's own handling): one rule now.
    study = [sys.executable, "-m", "prefixroute", "study", "--requests", "1", "--output", str(tmp_path)]
    argv = simulate(300) if command == "simulate" else study
    reader = subprocess.Popen(["head", "-c", "1"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    assert reader.stdin is not None
    done = subprocess.run(argv, stdout=reader.stdin, stderr=subprocess.PIPE, text=True, timeout=300)
    reader.stdin.close()
    reader.wait(timeout=10)
    assert done.returncode in (0, 1) and done.stderr == ""  # 0: all was out before the reader left


def test_a_server_s_announcement_to_a_reader_that_has_gone_costs_only_the_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from prefixroute.cli import announce

    # Was: the proxy's announcement raised BrokenPipeError, which its listen error handler took for a port it
    # could not bind ("cannot listen on 127.0.0.1:P: Broken pipe", exit 2), and its session was never closed.
    read, write = os.pipe()
    os.close(read)
    stream = os.fdopen(write, "w")
    monkeypatch.setattr(sys, "stdout", stream)
    announce("prefixroute proxy at http://127.0.0.1:1")
    announce("and again")  # stdout writes to os.devnull now
    stream.close()


def test_sigterm_ends_a_batch_command_as_ctrl_c_does_with_one_line() -> None:
    # Was: killed where it stood (a compare's pool left "leaked semaphore" warnings from Python's resource tracker).
    process = subprocess.Popen(simulate(1_000_000), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout is not None
    assert process.stdout.readline().startswith("scenario ")  # the run has started
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert (process.returncode, err) == (143, "prefixroute simulate: terminated (SIGTERM)\n")
