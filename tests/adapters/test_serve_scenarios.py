"""The checks every proxy set-up must pass (imported by test_gateways.py and test_haproxy.py).

A :class:`Stack` is real processes on loopback: two fake vLLM engines (OpenAI-compatible, streaming SSE), the
sidecar (``prefixroute serve`` in its own process) and the proxy under its example configuration. Under CI=true a
missing proxy binary fails the test; elsewhere it skips.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from prefixroute.adapters.serve.loopback import Process, find_binary, free_port, start_sidecar
from prefixroute.testing.openai_engine import OpenAIEngine

from ..conftest import wait_until

SHARED = list(range(1000, 1256))  # a 256-token system prompt
DEADLINE_S = 10.0


def need_binary(name: str) -> str:
    """The binary's path; skip without it, except under CI=true, where its absence is a failure."""
    path = find_binary(name)
    if path is None:
        message = f"{name} is not installed (.ci/run installs it)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path


class Stack:
    """Engines, the sidecar and one proxy, all on free loopback ports."""

    def __init__(self, workdir: Path, start_proxy: Callable[[Path, dict[str, int]], Process], mode: str) -> None:
        self.workdir = workdir
        self.mode = mode
        self._exit = ExitStack()
        self.engines = [
            self._exit.enter_context(OpenAIEngine(token_delay_s=0.002, max_tokens=8, seed=i)) for i in range(2)
        ]
        self.ports = {
            "proxy": free_port(),
            "engine0": int(self.engines[0].url.rsplit(":", 1)[1]),
            "engine1": int(self.engines[1].url.rsplit(":", 1)[1]),
            "sidecar": free_port(),
            "release": free_port(),
            "ext_proc": free_port(),
        }
        self.sidecar: Process | None = None
        self.proxy: Process | None = None
        try:
            self.start_sidecar()
            self.proxy = start_proxy(workdir, self.ports)
        except BaseException:  # a proxy that would not start: what started before it stops too
            self.close()
            raise
        self.url = f"http://127.0.0.1:{self.ports['proxy']}"

    def start_sidecar(self) -> None:
        options = [
            "--lease",
            "60",
            "--policy",
            "bounded-load",
            "--policy-option",
            "factor=1.0",
            "--release-port",
            str(self.ports["release"]),
            "--metrics-from-backends",  # as the examples' commands: an engine it cannot scrape is not chosen
        ]
        if self.mode == "ext_proc":
            options += ["--ext-proc", str(self.ports["ext_proc"])]
        self.sidecar = start_sidecar(
            self.workdir, [engine.url for engine in self.engines], port=self.ports["sidecar"], options=options
        )

    def stop_sidecar(self) -> None:
        assert self.sidecar is not None
        self.sidecar.stop()
        self.sidecar = None

    def stats(self) -> dict[str, object]:
        reply = httpx.get(f"http://127.0.0.1:{self.ports['sidecar']}/stats", timeout=5)
        assert reply.status_code == 200
        stats: dict[str, object] = reply.json()
        return stats

    def decisions(self) -> int:
        """Decisions made so far, whatever their reason."""
        decisions = self.stats()["decisions"]
        assert isinstance(decisions, dict)
        return sum(decisions.values())

    def in_flight(self) -> int:
        count = self.stats()["in_flight_total"]
        assert isinstance(count, int)
        return count

    def served(self) -> list[int]:
        return [engine.stats().requests for engine in self.engines]

    def close(self) -> None:
        for process in (self.proxy, self.sidecar):
            if process is not None:
                process.stop()
        self._exit.close()


def make_stack(tmp: Path, start_proxy: Callable[[Path, dict[str, int]], Process], mode: str) -> Iterator[Stack]:
    stack = Stack(tmp, start_proxy, mode)
    try:
        yield stack
    finally:
        stack.close()


def body(suffix: int, *, stream: bool = True, chat: bool = False) -> dict[str, object]:
    if chat:
        return {"model": "fake-model", "messages": [{"role": "user", "content": f"question {suffix}"}],
                "stream": stream, "max_tokens": 8}  # fmt: skip
    return {"model": "fake-model", "prompt": [*SHARED, suffix, suffix + 1], "stream": stream, "max_tokens": 8}


def stream_request(
    url: str, payload: dict[str, object], *, chat: bool = False, timeout: float = DEADLINE_S
) -> tuple[int, list[str]]:
    """POST a streaming completion; return the status and the SSE data lines. ``timeout``: the longest silence
    waited for, a guard against a hang."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    with httpx.Client(timeout=timeout) as client, client.stream("POST", url + path, json=payload) as reply:
        lines = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
        return reply.status_code, lines


# -- the checks ------------------------------------------------------------------------------------------------------


def check_same_prefix_same_upstream(stack: Stack) -> None:
    before = stack.served()
    for i in range(6):
        status, lines = stream_request(stack.url, body(i * 7))
        assert status == 200 and lines[-1] == "[DONE]" and len(lines) >= 8
        wait_until(lambda: stack.in_flight() == 0, what="the stream's release")
    added = [after - start for after, start in zip(stack.served(), before, strict=True)]
    assert sorted(added) == [0, 6], f"a shared prefix was split across engines: {added}"
    decisions = stack.stats()["decisions"]
    assert isinstance(decisions, dict) and decisions.get("prefix", 0) >= 5


def check_sse_is_not_buffered(stack: Stack) -> None:
    for engine in stack.engines:
        engine.stall(after_tokens=1)
    try:
        with (
            httpx.Client(timeout=DEADLINE_S) as client,
            client.stream("POST", stack.url + "/v1/completions", json=body(99)) as reply,
        ):
            assert reply.status_code == 200
            lines = reply.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            # The engine is stalled after one token: that token got here before the stream could end.
            assert json.loads(first[6:])["choices"]
            for engine in stack.engines:
                engine.resume()
            rest = [line for line in lines if line.startswith("data: ")]
            assert rest[-1] == "data: [DONE]"
    finally:
        for engine in stack.engines:
            engine.resume()
    wait_until(lambda: stack.in_flight() == 0, what="the release after a stream")


def check_load_fallback(stack: Stack) -> None:
    """Concurrent streams with one prefix: past the policy's bound they spill to the other engine."""
    stream_request(stack.url, body(5000))  # the prefix is cached somewhere
    wait_until(lambda: stack.in_flight() == 0, what="the release of the warm-up")
    for engine in stack.engines:
        engine.stall(after_tokens=1)
    started = threading.Barrier(5)
    results: list[int] = []

    def one(i: int) -> None:
        with (
            httpx.Client(timeout=DEADLINE_S) as client,
            client.stream("POST", stack.url + "/v1/completions", json=body(6000 + i)) as reply,
        ):
            lines = reply.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            started.wait()
            results.append(sum(1 for line in lines if line == "data: [DONE]"))

    before = stack.served()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    try:
        for thread in threads:
            thread.start()
        started.wait(timeout=DEADLINE_S)
        assert stack.in_flight() == 4
        added = [after - start for after, start in zip(stack.served(), before, strict=True)]
        assert min(added) >= 1, f"four concurrent streams of one prefix never spilled: {added}"
        decisions = stack.stats()["decisions"]
        assert isinstance(decisions, dict) and decisions.get("load-fallback", 0) >= 1
    finally:
        for engine in stack.engines:
            engine.resume()
        for thread in threads:
            thread.join(DEADLINE_S)
    assert results == [1, 1, 1, 1]
    wait_until(lambda: stack.in_flight() == 0, what="every release after the concurrent streams")


def check_release_after_error_and_abort(stack: Stack) -> None:
    # A backend error: both engines fail their next request.
    for engine in stack.engines:
        engine.fail_next(1)
    status, _ = stream_request(stack.url, body(7000))
    assert status == 500
    wait_until(lambda: stack.in_flight() == 0, what="the release after an engine error")
    for engine in stack.engines:
        engine.fail_next(0)
    # A client abort mid-stream: a stream that would run for minutes, dropped after two tokens.
    disconnected = sum(engine.stats().disconnected for engine in stack.engines)
    endless = {**body(7100), "max_tokens": 100_000}
    with (
        httpx.Client(timeout=DEADLINE_S) as client,
        client.stream("POST", stack.url + "/v1/completions", json=endless) as reply,
    ):
        lines = reply.iter_lines()  # held: dropping the iterator would close the connection already
        for _ in range(2):
            next(line for line in lines if line.startswith("data: "))
        assert stack.in_flight() == 1
    # leaving the block closed the connection mid-stream: the proxy ends the engine's stream and releases
    wait_until(lambda: stack.in_flight() == 0, what="the release after a client abort")
    wait_until(
        lambda: sum(engine.stats().disconnected for engine in stack.engines) == disconnected + 1,
        what="the engine's stream to be cut",
    )
    stats = stack.stats()
    assert stats["in_flight_total"] == 0 and stats["leases_expired"] == 0


def check_refusal_forgets_the_prediction(stack: Stack) -> None:
    """An engine's 400 (vLLM's for a prompt past its context) reaches the sidecar as a refusal (nginx's and HAProxy's
    log line carries ``status=400``; Envoy's response headers ``:status``), so the router forgets the blocks it
    predicted for the prompt: routed again, it is a miss, not a prefix match on a cache that is not there."""
    prompt = list(range(50_000, 50_064))  # 4 blocks no other check routes
    for engine in stack.engines:
        engine.fail_next(1, status=400)
    status, _ = stream_request(stack.url, {"model": "fake-model", "prompt": prompt, "stream": True, "max_tokens": 8})
    assert status == 400
    wait_until(lambda: stack.in_flight() == 0, what="the release after an engine's refusal")
    for engine in stack.engines:
        engine.fail_next(0)
    sidecar = f"http://127.0.0.1:{stack.ports['sidecar']}"
    again = httpx.post(f"{sidecar}/route", json={"prompt_token_ids": prompt}, timeout=DEADLINE_S).json()
    httpx.post(f"{sidecar}/finish", json={"id": again["id"]}, timeout=DEADLINE_S)
    assert (again["reason"], again["matched_tokens"]) == ("miss", 0)


def check_chat_routes_by_prefix(stack: Stack) -> None:
    status, lines = stream_request(stack.url, body(1, chat=True), chat=True)
    assert status == 200 and lines[-1] == "[DONE]"
    wait_until(lambda: stack.in_flight() == 0, what="the release of a chat stream")


def check_a_long_context_prompt_is_routed(stack: Stack) -> None:
    """A prompt of tens of thousands of tokens (~190 KB of token ids) is routed by every proxy: HAProxy's Lua action
    saw only its default 16 KiB buffer of it, a cut body the sidecar refused, so it was served unrouted."""
    decided = stack.decisions()
    prompt = list(range(70_000, 70_000 + 30_000))
    status, lines = stream_request(
        stack.url, {"model": "fake-model", "prompt": prompt, "stream": True, "max_tokens": 8}
    )
    assert status == 200 and lines[-1] == "[DONE]"
    assert stack.decisions() == decided + 1
    wait_until(lambda: stack.in_flight() == 0, what="the release of the long prompt")


def check_a_prompt_of_megabytes_is_served(stack: Stack) -> None:
    """A body of a few MiB (a long context's token ids; vLLM reads any size) is served, routed or failed open to the
    pool, never refused by the proxy: Envoy's default buffer limit (1 MiB) answered it 413. Envoy's picker routes it
    (a gRPC message over gRPC's default limit, 4 MiB, failed the stream: the request fell back unrouted)."""
    decided = stack.decisions()
    prompt = list(range(60_000, 60_000 + 700_000))  # over 5 MiB as JSON
    # Decoding and hashing 700,000 ids in the gateway's sidecar and in the engine takes 1.5-6 s of CPU on a quiet
    # machine and 7-8 s beside two busy processes (it failed once at 10 s in CI): a hang guard of a minute.
    status, lines = stream_request(
        stack.url, {"model": "fake-model", "prompt": prompt, "stream": True, "max_tokens": 8}, timeout=60
    )
    assert status == 200 and lines[-1] == "[DONE]"
    wait_until(lambda: stack.in_flight() == 0, what="the release of the long prompt")
    if stack.mode == "ext_proc":
        assert stack.decisions() == decided + 1


# What failing open may add to a request, the median of four: a functional bound. Waiting on the dead sidecar
# (a connect timeout, or the retries a second apart that Lua's socket makes) adds a second or more to each request;
# the median is robust to one request slowed by other processes on a shared machine (the max of four read 0.22 s).
FAIL_OPEN_SLACK_S = 0.25


def timed_stream(url: str, payload: dict[str, object]) -> float:
    """Seconds a streaming completion takes, end to end; it must succeed."""
    started = time.perf_counter()
    status, lines = stream_request(url, payload)
    assert status == 200 and lines[-1] == "[DONE]"
    return time.perf_counter() - started


def check_a_dead_engine_s_prefix_is_served_elsewhere(stack: Stack) -> None:
    """The engine that holds a prefix refuses connections (it died). nginx and HAProxy serve its requests from the
    other engine at once (a refused connection fails over); Envoy answers 503 until the sidecar's next scrape of the
    engines' /metrics fails and it stops choosing that engine (was: HAProxy answered 503 after 3 s to every request
    of the prefix, and Envoy 503 for as long as the engine was down, as the example commands had no
    --metrics-from-backends). Every decision is released all the same."""
    before = stack.served()
    assert stream_request(stack.url, body(9000))[0] == 200
    wait_until(lambda: sum(stack.served()) == sum(before) + 1 and stack.in_flight() == 0, what="the first request")
    dead = next(i for i, (after, start) in enumerate(zip(stack.served(), before, strict=True)) if after > start)
    stack.engines[dead].refuse()
    try:
        if stack.mode == "ext_proc":
            wait_until(lambda: stream_request(stack.url, body(9001))[0] == 200, what="the dead engine left out")
        statuses = [stream_request(stack.url, body(9002 + i))[0] for i in range(4)]
        assert statuses == [200] * 4
    finally:
        stack.engines[dead].accept()
    wait_until(lambda: stack.in_flight() == 0, what="every release")
    status, _ = stream_request(stack.url, body(9010))
    assert status == 200


def check_a_request_an_engine_took_is_never_run_by_another(stack: Stack) -> None:
    """The engine dies holding a request it has read (a crash mid-prefill): its client gets an error, and no other
    engine runs the request a second time (was: nginx's error_page sent it to the pool, which generated it again:
    a generation duplicated, and a prompt that crashes an engine sent on to the next)."""
    before = stack.served()
    assert stream_request(stack.url, body(9100))[0] == 200
    wait_until(lambda: sum(stack.served()) == sum(before) + 1 and stack.in_flight() == 0, what="the first request")
    chosen = next(i for i, (after, start) in enumerate(zip(stack.served(), before, strict=True)) if after > start)
    engine, taken = stack.engines[chosen], stack.served()
    engine.stall(after_tokens=0)  # a whole answer (not streamed): the engine sends nothing before it is done
    outcome: list[int] = []

    def ask() -> None:
        payload = body(9101, stream=False)
        outcome.append(httpx.post(stack.url + "/v1/completions", json=payload, timeout=DEADLINE_S).status_code)

    client = threading.Thread(target=ask)
    client.start()
    try:
        wait_until(lambda: engine.stats().requests > taken[chosen], what="the engine reading the request")
        engine.refuse()  # drops the connection it holds the request on
        client.join(DEADLINE_S)
    finally:
        engine.resume()
        engine.accept()
    assert outcome and outcome[0] >= 500, outcome
    assert stack.served()[1 - chosen] == taken[1 - chosen], "another engine ran the request again"
    wait_until(lambda: stack.in_flight() == 0, what="the release of the request")


def check_an_http_1_0_client_is_routed_and_answered(stack: Stack) -> None:
    """An HTTP/1.0 client (no keep-alive, no chunked answer) is routed and answered, as vLLM answers it (was, with
    Envoy: its 426 refusal, which reached the client as an empty reply once the picker's stream timed out)."""
    raw = json.dumps(body(9200, stream=False)).encode()
    host, port = stack.url.removeprefix("http://").rsplit(":", 1)
    head = (f"POST /v1/completions HTTP/1.0\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\n\r\n")  # fmt: skip
    decisions = stack.decisions()
    with socket.create_connection((host, int(port)), timeout=DEADLINE_S) as client:
        client.sendall(head.encode() + raw)
        answer = b"".join(iter(lambda: client.recv(65536), b""))  # HTTP/1.0: the answer ends with the connection
    assert answer.split(b" ", 2)[1] == b"200", answer[:200]
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["choices"]
    assert stack.decisions() == decisions + 1
    wait_until(lambda: stack.in_flight() == 0, what="the release of the request")


def check_fail_open(stack: Stack) -> None:
    """With the sidecar down, the proxy still serves every request from its plain balancer, without waiting."""
    direct = statistics.median(timed_stream(stack.engines[0].url, body(7900 + i)) for i in range(3))
    stack.stop_sidecar()
    try:
        before = stack.served()
        took = [timed_stream(stack.url, body(8000 + i)) for i in range(4)]
        assert sum(stack.served()) - sum(before) == 4
        assert statistics.median(took) - direct < FAIL_OPEN_SLACK_S, (
            f"failing open added {statistics.median(took) - direct:.3f}s to a request (median; direct {direct:.3f}s, "
            f"through the proxy with the sidecar down {[round(t, 3) for t in took]})"
        )
    finally:
        stack.start_sidecar()
    status, _ = stream_request(stack.url, body(8100))
    assert status == 200


def test_the_docs_show_every_proxy_example_file_as_it_is() -> None:
    """docs/adapters.md quotes each file of examples/nginx, haproxy and envoy whole, under its path."""
    root = Path(__file__).resolve().parents[2]
    docs = (root / "docs" / "adapters.md").read_text()
    for folder in ("nginx", "haproxy", "envoy"):
        for example in sorted((root / "examples" / folder).iterdir()):
            label = f"# examples/{folder}/{example.name}\n"
            assert label + example.read_text() + "```" in docs, f"docs/adapters.md does not show {example} as it is"
