"""Findings of a live audit of the ``proxy``, ``serve`` and ``fake-engines`` command lines: each bad option is exit
status 2 and one line on stderr, found before anything runs."""

from __future__ import annotations

import errno
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from prefixroute.adapters.proxy.cli import _try_listen
from prefixroute.cli import main


def _one_line(err: str, expected: str) -> None:
    assert err.endswith("\n") and err.count("\n") == 1, f"not one line: {err!r}"
    assert "Traceback" not in err and expected in err, err


THREE_ENDPOINTS = "tcp://127.0.0.1:5557,tcp://127.0.0.1:5558,tcp://127.0.0.1:5559"


def test_proxy_refuses_a_kv_events_spec_of_three_endpoints(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Was: the replay endpoint 'tcp://127.0.0.1:5558,tcp://127.0.0.1:5559' taken, the proxy started, and its KV-event
    # thread warned "Invalid argument; reconnecting" for ever.
    argv = ["proxy", "--backends", "http://127.0.0.1:1", "--port", "1", "--tokenizer", str(model_dir),
            "--kv-events", THREE_ENDPOINTS]  # fmt: skip
    assert main(argv) == 2
    out, err = capsys.readouterr()
    _one_line(err, "replay must be a ZMQ address to connect to")
    assert out == ""


def test_serve_refuses_a_kv_events_spec_of_three_endpoints(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["serve", "--backends", "http://127.0.0.1:1", "--port", "0",
            "--kv-events", f"http://127.0.0.1:1={THREE_ENDPOINTS}"]  # fmt: skip
    assert main(argv) == 2
    out, err = capsys.readouterr()
    _one_line(err, "replay must be a ZMQ address to connect to")
    assert out == ""


def test_proxy_on_a_busy_port_says_so_in_one_line_before_polling_any_backend() -> None:
    # Was: with --metrics-from-backends the fleet polled the backends before the port was bound, so a backend that
    # was down added a warning line ("metrics of ...: cannot read ...") before the error.
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        argv = [sys.executable, "-m", "prefixroute", "proxy", "--backends", "http://127.0.0.1:1", "--port", str(port),
                "--metrics-from-backends"]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    _one_line(done.stderr, f"cannot listen on 127.0.0.1:{port}")
    assert done.stdout == ""


def test_the_port_check_binds_ipv6_apart_as_asyncio_does() -> None:
    """An IPv4 listener on the port does not make ``--host ::`` fail the check: the server binds IPv6 only there."""
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    with socket.create_server(("0.0.0.0", 0)) as v4:
        _try_listen("::", v4.getsockname()[1])


def test_the_port_check_refuses_an_address_that_is_not_this_machines() -> None:
    # Was: it skipped EADDRNOTAVAIL for every address, so the fleet polled (a warning line) before the server failed.
    with pytest.raises(OSError) as raised:
        _try_listen("192.0.2.1", 8000)  # TEST-NET-1: no machine's own address
    assert raised.value.errno == errno.EADDRNOTAVAIL
