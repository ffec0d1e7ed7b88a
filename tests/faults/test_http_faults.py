"""Hostile clients, broken backends and bad command lines against ``prefixroute serve`` and ``prefixroute proxy``.

Each service runs on loopback (the sidecar on uvicorn, the proxy on aiohttp, in front of fake engines or a raw
socket that breaks the HTTP it answers). Whatever comes in, the answer is a 4xx/502 with the documented JSON error
shape, never a 500 page or a hang, and afterwards nothing counts in flight.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import astuple
from typing import Any

import httpx
import pytest
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixroute import Router
from prefixroute.adapters.proxy import Proxy
from prefixroute.adapters.serve import Sidecar
from prefixroute.errors import ConfigurationError
from prefixroute.testing.openai_engine import OpenAIEngine

from ..conftest import running_engines, wait_until

BACKENDS = ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]


def assert_idle(router: Router, backends: list[str]) -> None:
    """Every count the lifecycle moves is back to exactly 0, on every backend."""
    wait_until(lambda: router.stats().in_flight == 0)
    for candidate in router.decide([7] * 64, backends).candidates:
        assert (candidate.in_flight, candidate.pending_prefill_tokens, candidate.held_blocks) == (0, 0, 0)


def assert_openai_error(reply: httpx.Response, status: int) -> None:
    assert reply.status_code == status, reply.text
    assert reply.headers["content-type"].startswith("application/json")
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status and error["message"]


@contextmanager
def serving(sidecar: Sidecar) -> Iterator[int]:
    """The sidecar on uvicorn (as ``prefixroute serve`` runs it) on a thread; yields its port."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    config = uvicorn.Config(sidecar, http="httptools", lifespan="off", log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    wait_until(lambda: server.started)
    try:
        yield listener.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)
        listener.close()


async def _asgi(app: Sidecar, messages: list[dict[str, Any]]) -> tuple[int, bytes]:
    """One POST /route through the raw ASGI app, the body arriving as ``messages``."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        sent.append(message)

    await app({"type": "http", "method": "POST", "path": "/route", "headers": []}, receive, send)
    return sent[0]["status"], sent[1]["body"]


# -- the sidecar ------------------------------------------------------------------------------------------------------


def test_a_client_that_leaves_mid_body_gets_no_decision() -> None:
    """A body cut short by a disconnect is not the client's request: deciding on it would count a request in flight
    (until its lease) that nobody can finish, as the answer with its id never arrives."""
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS)
    with serving(sidecar) as port, socket.create_connection(("127.0.0.1", port)) as client:
        head = b"POST /route HTTP/1.1\r\nHost: sidecar\r\nContent-Length: 4096\r\n\r\n"
        client.sendall(head + b'{"prompt_token_ids": [1, 2, 3, 4, 5]}')  # valid JSON, shorter than announced
        time.sleep(0.3)  # the app has the first chunk and waits for more
        client.close()
        time.sleep(0.3)
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    assert (sidecar.router.stats().decisions, sidecar.router.stats().in_flight) == (0, 0)
    assert [line for line in metrics.splitlines() if line.startswith("prefixroute_in_flight{")] == [
        f'prefixroute_in_flight{{backend="{backend}"}} 0' for backend in BACKENDS
    ]


def test_a_body_over_the_limit_is_refused_even_in_one_chunk() -> None:
    """The server may hand the whole body over at once (it had all arrived): the limit still holds."""
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS, max_body_bytes=1000)
    body = json.dumps({"prompt_token_ids": list(range(400))}).encode()
    status, answer = asyncio.run(_asgi(sidecar, [{"type": "http.request", "body": body, "more_body": False}]))
    assert status == 413 and "over 1000 bytes" in json.loads(answer)["error"]
    assert (sidecar.router.stats().decisions, sidecar.router.stats().in_flight) == (0, 0)


@pytest.mark.parametrize(
    "location", ["@up\nX-Injected: 1", "@упстрим", "", " ", "foo bar", "@foo bar", "upstream", "@", "/", " @up"]
)
def test_the_accel_redirect_location_must_be_a_header_value(location: str) -> None:
    with pytest.raises(ConfigurationError, match="accel_redirect"):
        Sidecar(Router(), backends=BACKENDS, accel_redirect=location)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**65), 2**65) | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
route_bodies = st.fixed_dictionaries(
    {},
    optional={
        "prompt_token_ids": json_values | st.lists(st.integers(-3, 2**33), max_size=4),
        "prompt": json_values,
        "messages": json_values | st.lists(st.dictionaries(st.sampled_from(["role", "content"]), json_values)),
        "model": json_values,
        "lease": json_values,
        "backends": json_values | st.lists(st.sampled_from(["a", "b"]), max_size=3),
    },
)


@given(route_bodies, st.sampled_from(["/route", "/v1/completions", "/v1/chat/completions", "/finish"]))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_any_json_body_is_answered_4xx_json_or_decided_and_nothing_else_counts(body: Any, path: str) -> None:
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS, models=["m", "n"])
    reply = httpx.Response(200)

    async def post() -> None:
        nonlocal reply
        transport = httpx.ASGITransport(app=sidecar)
        async with httpx.AsyncClient(transport=transport, base_url="http://sidecar") as client:
            reply = await client.post(path, content=json.dumps(body).encode())

    asyncio.run(post())
    answer = reply.json()
    if reply.status_code != 200:
        assert 400 <= reply.status_code < 500 and set(answer) == {"error"} and isinstance(answer["error"], str)
        assert sidecar.router.stats().decisions == 0
    elif path != "/finish":
        sidecar.finish(answer["id"])
    assert sidecar.router.stats().in_flight == 0


# -- the proxy --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engines() -> Iterator[list[OpenAIEngine]]:
    yield from running_engines(2, max_tokens=3)


@pytest.fixture
def proxy(engines: list[OpenAIEngine]) -> Iterator[Proxy]:
    with Proxy(Router(), [engine.url for engine in engines], base_models=["fake-model"]) as running:
        yield running
    for engine in engines:
        engine.resume()


openai_bodies = st.fixed_dictionaries(
    {},
    optional={
        "prompt": json_values | st.lists(st.integers(-3, 2**33), max_size=4) | st.lists(st.lists(st.integers(0, 9))),
        "messages": json_values | st.lists(st.dictionaries(st.sampled_from(["role", "content"]), json_values)),
        "model": json_values | st.sampled_from(["fake-model", "other"]),
        "stream": json_values,
        "n": json_values,
    },
)


@pytest.fixture(scope="module")
def fuzzed_proxy(engines: list[OpenAIEngine]) -> Iterator[Proxy]:
    with Proxy(Router(), [engine.url for engine in engines], base_models=["fake-model"]) as running:
        yield running


@given(st.one_of(openai_bodies, json_values), st.booleans())
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_any_json_body_gets_an_answer_or_an_openai_error_and_leaves_nothing_in_flight(
    fuzzed_proxy: Proxy, body: Any, chat: bool
) -> None:
    """Whatever JSON a client posts, the proxy or the engine answers it (never a 5xx), an error in OpenAI's shape,
    and every request it routed is finished once its answer is over."""
    proxy = fuzzed_proxy
    before = proxy.stats()
    path = "/v1/chat/completions" if chat else "/v1/completions"
    labelled = {"Content-Type": "application/json"}  # vLLM (and so the proxy) reads only a body labelled JSON
    reply = httpx.post(proxy.url + path, content=json.dumps(body).encode(), headers=labelled, timeout=10)
    if reply.status_code != 200:
        assert_openai_error(reply, reply.status_code)
        assert 400 <= reply.status_code < 500
    wait_until(lambda: sum(astuple(proxy.stats())[:5]) == sum(astuple(before)[:5]) + 1, what="one outcome counted")
    after = proxy.stats()
    assert (after.backend_error, after.unreachable, after.client_disconnect) == (0, 0, 0)
    assert_idle(proxy.router, list(proxy.backends))


@contextmanager
def broken_backend(answer: bytes) -> Iterator[str]:
    """A backend that reads a request, writes ``answer`` (broken HTTP) and hangs up; yields its URL."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    stop = asyncio.Event()
    port: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                       if line.startswith(b"content-length:")), 0)  # fmt: skip
        await reader.readexactly(length)
        writer.write(answer)
        await writer.drain()
        writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port.append(server.sockets[0].getsockname()[1])
        ready.set()
        async with server:
            await stop.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    ready.wait(5)
    try:
        yield f"http://127.0.0.1:{port[0]}"
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(5)
        loop.close()


@pytest.mark.parametrize(
    "answer",
    [
        b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"id": "cmpl-',
        b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{"id\r\n',
    ],
    ids=["short-content-length", "unterminated-chunks"],
)
def test_a_backend_that_breaks_off_a_plain_answer_gets_a_502_json_error(answer: bytes) -> None:
    with broken_backend(answer) as url, Proxy(Router(), [url], base_models=["m"], max_failures=1) as proxy:
        reply = httpx.post(proxy.url + "/v1/completions", json={"prompt": "a b c"}, timeout=10)
        assert_openai_error(reply, 502)
        assert "broke off" in reply.json()["error"]["message"]
        wait_until(lambda: proxy.stats().backend_error == 1)
        stats = proxy.stats()
        assert (stats.ok, stats.client_disconnect, stats.unhealthy) == (0, 0, (url,))
        assert_idle(proxy.router, [url])


@pytest.mark.parametrize("flag", ["yes", 1, "true"])
def test_what_the_engine_streams_is_relayed_as_a_stream(
    proxy: Proxy, engines: list[OpenAIEngine], flag: object
) -> None:
    """vLLM reads ``stream`` as pydantic's lax bool ("yes", 1, "true" are true): the proxy relays whatever the engine
    streams chunk by chunk, and the first chunk reports the first token."""
    for engine in engines:
        engine.stall(after_tokens=1)
    body = {"prompt": list(range(200, 264)), "stream": flag}
    with (
        httpx.Client(timeout=httpx.Timeout(10, read=2)) as client,
        client.stream("POST", proxy.url + "/v1/completions", json=body) as reply,
    ):
        assert reply.headers["content-type"].startswith("text/event-stream")
        chunks = reply.iter_raw()
        assert b" t0" in next(chunks)  # relayed while the engine still holds the rest
        backend = reply.headers["x-prefixroute-backend"]
        [candidate] = [c for c in proxy.router.decide([7] * 64, proxy.backends).candidates if c.backend == backend]
        assert (candidate.in_flight, candidate.pending_prefill_tokens) == (1, 0)  # first_token() reported
        for engine in engines:
            engine.resume()
        assert b"".join(chunks).endswith(b"data: [DONE]\n\n")
    wait_until(lambda: proxy.stats().ok == 1)
    assert_idle(proxy.router, list(proxy.backends))


@pytest.mark.parametrize(("flag", "status"), [("false", 200), ("maybe", 400), ([True], 400), (2, 400)])
def test_the_fake_engine_reads_stream_as_vllm_does(proxy: Proxy, flag: object, status: int) -> None:
    reply = httpx.post(proxy.url + "/v1/completions", json={"prompt": "a b", "stream": flag}, timeout=10)
    if status == 200:
        assert reply.status_code == 200 and reply.json()["object"] == "text_completion"
    else:
        assert_openai_error(reply, status)
    assert_idle(proxy.router, list(proxy.backends))


@contextmanager
def blackhole() -> Iterator[str]:
    """A port whose listen queue is full: connections to it neither open nor fail, they time out."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(4):
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex(("127.0.0.1", port))
        fillers.append(filler)
    with socket.socket() as probe:
        probe.settimeout(0.2)
        try:
            probe.connect(("127.0.0.1", port))
        except TimeoutError:
            pass
        else:
            pytest.skip("this kernel does not drop connections to a full listen queue")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        for filler in fillers:
            filler.close()
        listener.close()


def test_a_connect_timeout_is_retried_on_another_backend(engines: list[OpenAIEngine]) -> None:
    """A connection that never opened never reached the engine: like a refused one, it goes to the next backend."""
    with blackhole() as dead:
        urls = [dead, engines[0].url]
        with Proxy(Router(), urls, base_models=["fake-model"], connect_timeout=0.3) as proxy:
            prompts = ([i] * 32 for i in range(100))
            prompt = next(p for p in prompts if proxy.router.decide(p, urls).backend == dead)
            reply = httpx.post(proxy.url + "/v1/completions", json={"prompt": prompt}, timeout=10)
            assert reply.status_code == 200 and reply.headers["x-prefixroute-backend"] == engines[0].url
            wait_until(lambda: proxy.stats().ok == 1)
            assert (proxy.stats().retries, proxy.stats().backend_error, proxy.stats().unreachable) == (1, 0, 0)
            assert_idle(proxy.router, urls)


@pytest.mark.parametrize("url", ["http://gpu0:99999", "http://[::1", "http://gpu 0:8000", "http://:8000"])
def test_a_backend_url_that_cannot_be_connected_to_is_refused_up_front(url: str) -> None:
    with pytest.raises(ConfigurationError, match="backend"):
        Proxy(Router(), [url])


# -- the commands -----------------------------------------------------------------------------------------------------


def test_bad_command_lines_exit_2_with_one_line() -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = str(taken.getsockname()[1])
    cases = [
        (["serve", "--accel-redirect", "@upstréam€"], "accel_redirect"),
        (["proxy", "--backends", "http://gpu0:99999"], "not a valid URL"),
        (["proxy", "--backends", "http://127.0.0.1:9", "--port", port], "cannot listen"),
        (["fake-engines", "--max-tokens", "0"], "--max-tokens"),
        (["fake-engines", "--token-delay-ms", "nan"], "--token-delay-ms"),
        (["fake-engines", "--prefill-us-per-token", "inf"], "--prefill-us-per-token"),
        (["fake-engines", "--count", "2", "--base-port", "65535"], "room for --count"),
        (["fake-engines", "--count", "1", "--base-port", "65535", "--max-tokens", "0"], "--max-tokens"),  # port fits
        (["fake-engines", "--host", ""], "--host"),  # empty: every interface, unannounced
        (["proxy", "--backends", "http://127.0.0.1:9", "--host", ""], "--host"),
    ]
    try:
        command = [sys.executable, "-m", "prefixroute"]
        running = [
            (
                args,
                message,
                subprocess.Popen([*command, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True),
            )
            for args, message in cases
        ]
        failures = []
        for args, message, process in running:
            try:
                # A guard against a command that took the bad option and serves, not a measure of speed: ten
                # interpreters importing aiohttp at once took over 30 s at a load average of 5.
                _, err = process.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                process.kill()
                process.communicate()
                failures.append((args, "still running: it took the bad option"))
                continue
            if process.returncode != 2 or len(err.strip().splitlines()) != 1 or message not in err:
                failures.append((args, f"exit {process.returncode}: {err[-300:]}"))
    finally:
        taken.close()
    assert failures == []
