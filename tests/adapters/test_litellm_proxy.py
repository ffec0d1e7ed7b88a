"""The real LiteLLM Proxy server (``litellm --config``) under examples/litellm/config.yaml, over fake vLLM engines.

The proxy runs in a process of its own on loopback, with a copy of the example configuration whose ``api_base``
ports point at three fake engines in this process, and a copy of the example's hook file, to which the test appends
a few lines that serve the hook's counters on a port of their own, so the test sees them return to 0.

``litellm[proxy]`` pins ``litellm-proxy``, which some package indexes lack; the ``test`` extra lists the packages
the proxy server imports instead. Under CI=true a missing one fails the test; elsewhere it skips.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from prefixroute.adapters.serve.loopback import EXAMPLES, Process, free_port
from prefixroute.testing.openai_engine import OpenAIEngine

from ..conftest import running_engines, wait_until

SYSTEM = "You are a careful assistant. " * 20
STARTUP_S = 120.0  # the proxy imports for about 10 s on a quiet machine
REQUEST_S = 10.0
EXAMPLE_PORTS = (8100, 8101, 8102)  # the engines' ports in examples/litellm/config.yaml, gpu0 to gpu2

# Appended to the copy of prefixroute_hook.py: LiteLLM loads that file into the proxy's process, where only the
# hook's own module can reach the hook; it writes the port it serves on to the file PREFIXROUTE_COUNTERS_FILE names.
COUNTERS = """

import json as _json
import os as _os
import threading as _threading
from http.server import BaseHTTPRequestHandler as _Handler
from http.server import ThreadingHTTPServer as _Server


class _Counters(_Handler):
    def do_GET(self):
        stats = hook.router.stats()
        figures = {name: getattr(stats, name) for name in ("decisions", "commits", "in_flight", "leases_expired")}
        body = _json.dumps({**figures, "errors": hook.errors}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


_server = _Server(("127.0.0.1", 0), _Counters)
_threading.Thread(target=_server.serve_forever, daemon=True).start()
with open(_os.environ["PREFIXROUTE_COUNTERS_FILE"] + ".part", "w") as _file:
    _file.write(str(_server.server_address[1]))
_os.replace(_os.environ["PREFIXROUTE_COUNTERS_FILE"] + ".part", _os.environ["PREFIXROUTE_COUNTERS_FILE"])
"""


def missing(what: str) -> None:
    message = f"the LiteLLM Proxy cannot run: {what} (install the `test` extra: pyproject.toml lists what it needs)"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


@dataclass
class Proxy:
    url: str
    headers: dict[str, str]
    engines: list[OpenAIEngine]
    counters_url: str
    process: Process

    def counters(self) -> dict[str, int]:
        figures: dict[str, int] = httpx.get(self.counters_url, timeout=REQUEST_S).json()
        return figures

    def served(self) -> list[int]:
        return [engine.stats().requests for engine in self.engines]

    def settled(self) -> dict[str, int]:
        """The hook's counters once nothing is in flight (LiteLLM runs its callbacks a moment after the answer)."""
        wait_until(lambda: self.counters()["in_flight"] == 0, what="the hook's in-flight count to return to 0")
        figures = self.counters()
        assert (figures["errors"], figures["leases_expired"]) == (0, 0), figures
        return figures

    def ask(self, system: str, question: str) -> str:
        """A chat completion; the deployment that served it, as the proxy reports it and as the engines counted."""
        before = self.served()
        reply = httpx.post(f"{self.url}/v1/chat/completions", json=chat(system, question), headers=self.headers,
                           timeout=REQUEST_S)  # fmt: skip
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"]
        return self.served_by(before, reply.headers["x-litellm-model-id"])

    def served_by(self, before: list[int], deployment: str) -> str:
        added = [after - start for after, start in zip(self.served(), before, strict=True)]
        assert added == [int(deployment == f"gpu{i}") for i in range(len(added))], (deployment, added)
        self.settled()
        return deployment


def chat(system: str, question: str, **options: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return {"model": "fake-model", "max_tokens": 3, "messages": messages, **options}


def start_proxy(workdir: Path, engines: list[OpenAIEngine]) -> Proxy:
    if importlib.util.find_spec("litellm") is None:
        missing("litellm is not installed")
    config = (EXAMPLES / "litellm" / "config.yaml").read_text()
    for example, engine in zip(EXAMPLE_PORTS, engines, strict=True):
        assert config.count(f"127.0.0.1:{example}/") == 1, example  # the example still names its engines so
        config = config.replace(f"127.0.0.1:{example}/", f"{engine.url.removeprefix('http://')}/")
    (workdir / "config.yaml").write_text(config)
    (workdir / "prefixroute_hook.py").write_text((EXAMPLES / "litellm" / "prefixroute_hook.py").read_text() + COUNTERS)
    port = free_port()
    counters_file = workdir / "counters-port"
    key = f"sk-{secrets.token_hex(32)}"  # the proxy refuses to start without a strong master key
    env = {**os.environ, "LITELLM_MASTER_KEY": key, "LITELLM_LOCAL_MODEL_COST_MAP": "True",
           "PREFIXROUTE_COUNTERS_FILE": str(counters_file)}  # fmt: skip
    entry = "import sys; from litellm_cli.main import proxy_server; sys.exit(proxy_server())"  # the `litellm` command
    command = [sys.executable, "-c", entry, "--config", str(workdir / "config.yaml"), "--host", "127.0.0.1",
               "--port", str(port)]  # fmt: skip
    log = workdir / "litellm.log"
    with log.open("wb") as out:
        popen = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 cwd=workdir, env=env)  # fmt: skip
    process = Process(popen, "litellm", log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_S
    while not _ready(url):
        if popen.poll() is not None:
            output = process.output()
            if "ModuleNotFoundError" in output:
                missing(output.strip().splitlines()[-1])
            pytest.fail(f"the LiteLLM Proxy exited with {popen.returncode}:\n{output}")
        if time.monotonic() > deadline:
            process.stop()
            pytest.fail(f"the LiteLLM Proxy did not answer in {STARTUP_S}s:\n{process.output()}")
        time.sleep(0.05)
    assert counters_file.exists(), process.output()  # the hook was loaded before the proxy answered
    counters_url = f"http://127.0.0.1:{counters_file.read_text()}/"
    return Proxy(url, {"Authorization": f"Bearer {key}"}, engines, counters_url, process)


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health/liveliness", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


@pytest.fixture(scope="module")
def engines() -> Iterator[list[OpenAIEngine]]:
    yield from running_engines(3, max_tokens=3)


@pytest.fixture(scope="module")
def proxy(engines: list[OpenAIEngine], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    started = start_proxy(tmp_path_factory.mktemp("litellm-proxy"), engines)
    try:
        yield started
    finally:
        started.process.stop()


def test_the_proxy_refuses_a_request_without_its_key(proxy: Proxy) -> None:
    body: dict[str, Any] = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(f"{proxy.url}/v1/chat/completions", json=body, timeout=REQUEST_S).status_code == 401


def test_the_same_prefix_goes_to_the_same_deployment(proxy: Proxy) -> None:
    before = proxy.settled()
    deployments = {proxy.ask(SYSTEM, f"question {i}") for i in range(4)}
    assert len(deployments) == 1, deployments
    after = proxy.settled()
    assert after["decisions"] - before["decisions"] == after["commits"] - before["commits"] == 4


def test_different_prefixes_spread_and_each_stays_where_it_went(proxy: Proxy) -> None:
    """Rendezvous hashing places a prefix seen nowhere; a prefix seen goes back there. The prompts differ from their
    first KV block on (the hook's default encoder counts bytes, 16 a block, and the chat begins ``<|system|>\\n``)."""
    first = [proxy.ask(f"{tenant:03d}: {SYSTEM}", "hello") for tenant in range(8)]
    assert len(set(first)) >= 2, first
    again = [proxy.ask(f"{tenant:03d}: {SYSTEM}", "and again") for tenant in range(8)]
    assert again == first


def test_a_stream_goes_where_its_prefix_is_and_stops_counting_when_it_ends(proxy: Proxy) -> None:
    system = f"Streams only. {SYSTEM}"
    home = proxy.ask(system, "a plain question first")
    before = proxy.served()
    body = chat(system, "a streamed one", stream=True)
    with (
        httpx.Client(timeout=REQUEST_S) as client,
        client.stream("POST", f"{proxy.url}/v1/chat/completions", json=body, headers=proxy.headers) as reply,
    ):
        assert reply.status_code == 200
        deployment = reply.headers["x-litellm-model-id"]
        lines = [line.removeprefix("data: ") for line in reply.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines
    text = "".join(json.loads(line)["choices"][0]["delta"].get("content") or "" for line in lines[:-1])
    assert len(text.split()) == 3, text
    assert proxy.served_by(before, deployment) == home  # and the hook's counts returned to 0 (settled)
