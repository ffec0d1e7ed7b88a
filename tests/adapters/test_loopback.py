"""The loopback helpers that the gateway tests and ``bench_sidecar.py`` run the published examples with."""

from __future__ import annotations

import shutil
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from prefixroute.adapters.serve.loopback import EXAMPLE_PORTS, Process, find_binary, free_port, render, wait_for_port
from prefixroute.errors import ConfigurationError

# A child that burns CPU_S of its own CPU time (and, with "fork", a grandchild that burns as much), says so on stdout,
# then waits for its stdin to close: the figures are CPU time, so a loaded machine changes nothing but the wall time.
CPU_S = 0.3
BURNER = f"""
import os, sys, time
def burn():
    while time.process_time() < {CPU_S}:
        pass
if sys.argv[1] == "fork" and os.fork() == 0:
    burn()
    print("burnt", flush=True)
    sys.stdin.read()
    os._exit(0)
burn()
print("burnt", flush=True)
sys.stdin.read()
"""


def test_render_swaps_each_example_port_for_its_role_at_once_and_only_whole_numbers() -> None:
    text = "listen 8080; server 127.0.0.1:8001; server 127.0.0.1:8002; 18080 80801 8100.5 /etc/haproxy/a.map"
    ports = {"proxy": 9000, "engine0": 8002, "engine1": 8001}  # two swapped: one pass, not one after the other
    assert render(text, ports, {"/etc/haproxy/": "/tmp/work/"}) == (
        "listen 9000; server 127.0.0.1:8002; server 127.0.0.1:8001; 18080 80801 8100.5 /tmp/work/a.map"
    )


def test_render_without_ports_changes_only_the_paths() -> None:
    # Was: a KeyError (the empty alternation matched everywhere).
    text = "listen 8080; include /etc/haproxy/x;"
    assert render(text, {}) == text
    assert render(text, {}, {"/etc/haproxy/": "/w/"}) == "listen 8080; include /w/x;"


def test_render_refuses_a_role_no_example_names_and_lists_them() -> None:
    # Was: a bare KeyError('gateway').
    with pytest.raises(ConfigurationError, match="'gateway'") as caught:
        render("listen 8080;", {"gateway": 9000})
    assert all(role in str(caught.value) for role in EXAMPLE_PORTS)


@pytest.mark.parametrize("kind", [socket.SOCK_STREAM, socket.SOCK_DGRAM])
def test_free_port_is_free_on_loopback_for_its_kind(kind: int) -> None:
    port = free_port(kind)
    with socket.socket(socket.AF_INET, kind) as sock:
        sock.bind(("127.0.0.1", port))  # without SO_REUSEADDR: nothing holds it


def test_free_ports_are_drawn_below_the_ephemeral_range_that_outgoing_connections_take() -> None:
    # Was a port from bind(0), inside that range: bench_proxy's proxy once lost its port, between the draw and its
    # bind, to an outgoing connection (CI at 32d1744).
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(10_000 <= port < low for port in ports) and len(ports) > 1


def test_find_binary_looks_on_path_then_beside_the_interpreter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    beside = tmp_path / "bin" / "prefixroute-test-tool"
    beside.parent.mkdir()
    beside.write_text("#!/bin/sh\n")
    beside.chmod(beside.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(sys, "executable", str(beside.parent / "python"))
    assert find_binary("prefixroute-test-tool") == str(beside)
    assert find_binary("sh") == shutil.which("sh") is not None  # on PATH
    assert find_binary("prefixroute-no-such-tool") is None


def test_find_binary_looks_in_sbin_when_path_lacks_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """nginx and HAProxy live in /usr/sbin, which a user's PATH often lacks."""
    found = [name for name in ("nginx", "haproxy") if Path("/usr/sbin", name).is_file()]
    if not found:  # pragma: no cover - neither gateway installed here
        pytest.skip("neither nginx nor haproxy is in /usr/sbin")
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert find_binary(found[0]) == f"/usr/sbin/{found[0]}"


def _start(code: str, *, log: Path) -> Process:
    with log.open("wb") as out:
        popen = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=out,
                                 stderr=subprocess.STDOUT)  # fmt: skip
    return Process(popen, "child", log)


WAITS = "import time; print('up', flush=True); time.sleep(3600)"


def test_stop_ends_a_running_process_with_sigterm_and_is_idempotent(tmp_path: Path) -> None:
    with _start(WAITS, log=tmp_path / "child.log") as process:
        assert process.popen.poll() is None
        process.stop()
        assert process.popen.returncode == -signal.SIGTERM
        process.stop()  # again: nothing to stop
    assert process.popen.returncode == -signal.SIGTERM


def test_output_is_the_end_of_the_log_readable_whatever_its_bytes(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    process = Process(subprocess.Popen([sys.executable, "-c", "pass"]), "child", log)
    process.popen.wait()
    assert process.output() == ""  # no log written yet
    log.write_bytes(b"\xff" + b"a" * 3999 + b"end")
    assert process.output() == "a" * 3997 + "end"  # the last 4000 characters
    log.write_bytes(b"\xffok")
    assert process.output() == "\ufffdok"
    assert Process(process.popen, "child").output() == ""  # no log at all


@pytest.mark.parametrize("mode", ["alone", "fork"])
def test_cpu_seconds_counts_the_process_and_its_children(mode: str, tmp_path: Path) -> None:
    # Run under a name with ")" and a blank, as /proc/PID/stat shows it: its fields are read after the last ")".
    python = tmp_path / "burn) er"
    python.symlink_to(sys.executable)
    popen = subprocess.Popen([python, "-c", BURNER, mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert popen.stdin is not None and popen.stdout is not None
    process = Process(popen, "burner")
    try:
        burners = 2 if mode == "fork" else 1
        assert [popen.stdout.readline() for _ in range(burners)] == [b"burnt\n"] * burners
        # Each burnt CPU_S of its CPU time and idles since (user and system time each tick at 1/CLK_TCK s).
        assert burners * CPU_S - 0.05 <= process.cpu_seconds() < burners * CPU_S + 0.5
    finally:
        popen.stdin.close()  # both read stdin to its end: the grandchild ends too
        process.stop()
        popen.stdout.close()


def test_wait_for_port_returns_once_the_process_listens_and_raises_when_it_exits(tmp_path: Path) -> None:
    port = free_port()
    listens = f"import socket, time; s = socket.create_server(('127.0.0.1', {port})); time.sleep(3600)"
    with _start(listens, log=tmp_path / "listens.log") as server:
        wait_for_port(port, server, timeout=60)
        socket.create_connection(("127.0.0.1", port), timeout=10).close()
    quits = _start("import sys; print('no luck'); sys.exit(3)", log=tmp_path / "quits.log")
    with quits, pytest.raises(RuntimeError, match="child exited with 3:\nno luck"):
        wait_for_port(port, quits, timeout=60)


def test_wait_for_port_is_not_satisfied_by_another_process_on_the_port(tmp_path: Path) -> None:
    """Was: any listener on the port would do, so a gateway that could not bind its port (taken after free_port())
    was handed back as started, about to exit, and the test talked to whatever held the port."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        idle = _start(WAITS, log=tmp_path / "idle.log")
        with idle, pytest.raises(RuntimeError, match=f"child did not listen on {port} in 0.5s"):
            wait_for_port(port, idle, timeout=0.5)


def test_wait_for_port_stops_a_process_that_never_listens(tmp_path: Path) -> None:
    port = free_port()
    with _start(WAITS, log=tmp_path / "idle.log") as idle:
        with pytest.raises(RuntimeError, match=f"child did not listen on {port} in 0.3s:\nup"):
            wait_for_port(port, idle, timeout=0.3)
        assert idle.popen.poll() is not None  # stopped, not left running
