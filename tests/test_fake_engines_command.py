"""``prefixroute fake-engines`` serves what its options say, announces each engine, and stops cleanly on Ctrl-C."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading

import httpx

from .conftest import DEADLINE_S


def _two_free_ports() -> int:
    """A port P such that P and P + 1 are both free on 127.0.0.1 now."""
    while True:
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            base = int(first.getsockname()[1])
            if base < 65535:
                with socket.socket() as second:
                    try:
                        second.bind(("127.0.0.1", base + 1))
                    except OSError:
                        continue
                    return base


def test_fake_engines_serve_the_models_and_limits_given_and_stop_on_ctrl_c() -> None:
    base = _two_free_ports()
    command = [sys.executable, "-m", "prefixroute", "fake-engines", "--count", "2", "--base-port", str(base),
               "--model", "llama", "--lora-adapters", "sql", "--max-tokens", "3"]  # fmt: skip
    # Ctrl-C's SIGINT as a terminal delivers it: a shell starting this run in the background ignored it, and a
    # child inherits that.
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    guard = threading.Timer(60, process.kill)  # a safety net, not a timing: it announces or exits
    guard.start()
    try:
        assert process.stdout is not None
        lines = [process.stdout.readline() for _ in range(2)]
        urls = [f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"]
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
