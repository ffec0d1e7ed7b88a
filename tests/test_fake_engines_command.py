"""``prefixroute fake-engines`` serves what its options say, announces each engine, and stops cleanly on Ctrl-C."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading

import httpx
import pytest

from prefixroute.cli import main
from prefixroute.testing import openai_engine

from .conftest import DEADLINE_S


def _two_free_ports(host: str) -> int:
    """A port P such that P and P + 1 are both free on ``host`` now."""
    while True:
        with socket.socket() as first:
            first.bind((host, 0))
            base = int(first.getsockname()[1])
            if base < 65535:
                with socket.socket() as second:
                    try:
                        second.bind((host, base + 1))
                    except OSError:
                        continue
                    return base


def test_fake_engines_serve_the_models_and_limits_given_and_stop_on_ctrl_c() -> None:
    host = "127.0.0.2"  # loopback too, but not the default: the engines listen where they are told
    base = _two_free_ports(host)
    command = [sys.executable, "-m", "prefixroute", "fake-engines", "--count", "2", "--base-port", str(base),
               "--host", host, "--model", "llama", "--lora-adapters", "sql", "--max-tokens", "3"]  # fmt: skip
    # Ctrl-C's SIGINT as a terminal delivers it: a shell starting this run in the background ignored it, and a
    # child inherits that.
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    guard = threading.Timer(60, process.kill)  # a safety net, not a timing: it announces or exits
    guard.start()
    try:
        assert process.stdout is not None
        lines = [process.stdout.readline() for _ in range(2)]
        urls = [f"http://{host}:{base}", f"http://{host}:{base + 1}"]
        assert lines == [f"fake vLLM engine serving 'llama' at {url}\n" for url in urls], lines
        for url in urls:
            cards = httpx.get(f"{url}/v1/models", timeout=DEADLINE_S).json()["data"]
            assert [(card["id"], card.get("parent")) for card in cards] == [("llama", None), ("sql", "llama")]
            reply = httpx.post(f"{url}/v1/completions", json={"model": "sql", "prompt": [1, 2, 3]}, timeout=DEADLINE_S)
            assert reply.json()["usage"]["completion_tokens"] == 3  # --max-tokens, for a request that names none
        process.send_signal(signal.SIGINT)
        out, err = process.communicate()
    finally:
        guard.cancel()
        process.kill()
        process.wait()
    assert process.returncode == 0 and out == "" and err == "", err


def test_fake_engines_stop_on_sigterm_freeing_their_ports() -> None:
    # Was: SIGTERM (systemd, Docker, Kubernetes, a test harness's terminate()) killed the process by its default
    # action, exit status -15, the engines never closed; Ctrl-C alone stopped it cleanly.
    host = "127.0.0.1"
    base = _two_free_ports(host)
    command = [sys.executable, "-m", "prefixroute", "fake-engines", "--count", "2", "--base-port", str(base)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    guard = threading.Timer(60, process.kill)  # a safety net, not a timing: it announces or exits
    guard.start()
    try:
        assert process.stdout is not None
        lines = [process.stdout.readline() for _ in range(2)]  # announced once every engine listens
        assert lines == [f"fake vLLM engine serving 'fake-model' at http://{host}:{base + i}\n" for i in range(2)]
        process.terminate()
        out, err = process.communicate()
    finally:
        guard.cancel()
        process.kill()
        process.wait()
    assert process.returncode == 0 and out == "" and err == "", (process.returncode, err)
    for port in (base, base + 1):
        with socket.socket() as again:  # no SO_REUSEADDR: a listener left open would refuse it
            again.bind((host, port))
            again.listen()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--count", "0"], "--count must be a whole number in 1..256, not 0"),
        (["--count", "257"], "--count must be a whole number in 1..256, not 257"),  # one process's sockets, not ports
        (["--count", "256", "--base-port", "65281"], "room for --count"),  # 65281 + 255 = 65536
        (["--count", "256", "--base-port", "65280", "--max-tokens", "0"], "--max-tokens"),  # the bounds taken
        (["--count", "2", "--base-port", "65535"], "room for --count"),  # the second would be on 65536
        (["--count", "1", "--base-port", "0"], "room for --count"),
        (["--count", "1", "--base-port", "65535", "--max-tokens", "0"], "--max-tokens"),  # 65535 fits one: next check
        (["--count", "1", "--base-port", "1", "--max-tokens", "0"], "--max-tokens"),  # so does 1
        (["--max-tokens", "1000001"], "--max-tokens must be in 1..1000000, not 1000001"),
        (["--max-tokens", "1", "--model", ""], "--model"),  # the bounds taken: the next check speaks
        (["--max-tokens", "1000000", "--model", ""], "--model"),
        (["--prefill-us-per-token", "1000001"], "--prefill-us-per-token must be a number in [0, 1e+06], not 1000001.0"),
        (["--prefill-us-per-token", "0", "--token-delay-ms", "-1"], "--token-delay-ms"),
        (["--prefill-us-per-token", "1e6", "--token-delay-ms", "-1"], "--token-delay-ms"),
        (["--token-delay-ms", "60001"], "--token-delay-ms must be a number in [0, 60000], not 60001.0"),
    ],
)
def test_fake_engines_check_count_and_ports_to_the_bound(
    options: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as busy:  # where a value wrongly taken would serve: "cannot listen", not a hang
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        if "--base-port" not in options:
            options = [*options, "--base-port", str(busy.getsockname()[1])]
        if "--count" not in options:
            options = [*options, "--count", "1"]
        assert main(["fake-engines", *options]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("delay", ["0", "60000"])
def test_fake_engines_take_the_bounds_of_token_delay(delay: str, capsys: pytest.CaptureFixture[str]) -> None:
    # Taken: the command goes on to listen, where a busy port stops it.
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["fake-engines", "--count", "1", "--base-port", str(port), "--token-delay-ms", delay]) == 2
    assert f"cannot listen on 127.0.0.1:{port}+" in capsys.readouterr().err


def test_the_module_entry_point_is_the_fake_engines_command(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python -m prefixroute.testing.openai_engine ARGS`` is ``prefixroute fake-engines ARGS``."""
    monkeypatch.setattr(sys, "argv", ["openai_engine.py", "--count", "0"])
    assert openai_engine.main() == 2
    assert openai_engine.main(["--max-tokens", "0"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "prefixroute fake-engines: error: --count must be a whole number in 1..256, not 0",
        "prefixroute fake-engines: error: --max-tokens must be in 1..1000000, not 0",
    ]


def test_each_default_of_fake_engines_is_the_one_its_help_states(capsys: pytest.CaptureFixture[str]) -> None:
    from prefixroute.cli import build_parser

    args, _ = build_parser().parse_known_args(["fake-engines"])
    taken = (args.count, args.base_port, args.host, args.model, tuple(args.lora_adapters))
    assert taken == (3, 8100, "127.0.0.1", "fake-model", ())
    assert (args.prefill_us_per_token, args.token_delay_ms, args.max_tokens) == (50.0, 5.0, 16)
    with pytest.raises(SystemExit):
        main(["fake-engines", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    for stated in ("(default 3)", "(default 8100)", "(default fake-model)", "(default 50)", "(default 5 ms)", "(16)"):
        assert stated in shown, stated
