"""``prefixroute proxy`` against clients and backends that an independent audit found mishandled (each failed before).

The backends here are small aiohttp apps or raw sockets on loopback, each misbehaving in one way a real server can.
"""

from __future__ import annotations

import gzip
import inspect
import json
import logging
import os
import random
import resource
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from prefixroute import ConfigurationError, InvalidTypeError, LoadPolicy, RoundRobin, Router
from prefixroute.adapters.proxy import Proxy
from prefixroute.adapters.proxy.cli import build
from prefixroute.adapters.proxy.models import UnreadableModels, model_cards
from prefixroute.adapters.threaded import ServerThread
from prefixroute.cli import build_parser
from prefixroute.testing.openai_engine import OpenAIEngine

from ..conftest import DEADLINE_S, BuggyPolicy, StrangerPolicy, returns, running_engines, wait_until
from .conftest import metric_samples

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Backend = tuple[Callable[[Handler], str], list[web.Request]]


JSON_BODY = {"Content-Type": "application/json"}
"""The header every body sent here carries: vLLM (and the proxy) read a body only when it is labelled JSON."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def error_answer(proxy: Proxy, sent: bytes) -> bytes:
    """The proxy's whole answer, an error in JSON, to ``sent`` on a connection of its own."""
    host, port = proxy.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=DEADLINE_S) as client:
        client.sendall(sent)
        answer = b""
        while b"}}" not in answer:
            chunk = client.recv(65536)
            assert chunk, answer
            answer += chunk
    return answer


@pytest.fixture
def backend() -> Iterator[Backend]:
    """Start an aiohttp backend whose POST /v1/completions and GET /v1/models are the given handler; return its URL.

    Also yields the requests it saw."""
    seen: list[web.Request] = []
    threads: list[ServerThread] = []

    def start(handler: Handler) -> str:
        port = free_port()
        runner: list[web.AppRunner] = []

        async def recording(request: web.Request) -> web.StreamResponse:
            seen.append(request)
            return await handler(request)

        async def serve() -> None:
            app = web.Application()
            app.router.add_post("/v1/completions", recording)
            app.router.add_get("/v1/models", recording)
            runner.append(web.AppRunner(app))
            await runner[0].setup()
            await web.TCPSite(runner[0], "127.0.0.1", port).start()

        async def close() -> None:
            await runner[0].cleanup()

        thread = ServerThread(serve, close, name="test-backend")
        thread.start()
        threads.append(thread)
        return f"http://127.0.0.1:{port}"

    yield start, seen
    for thread in threads:
        thread.stop()


@pytest.fixture(scope="module")
def good() -> Iterator[OpenAIEngine]:
    for engines in running_engines(1):
        yield engines[0]


def idle(proxy: Proxy) -> bool:
    wait_until(lambda: proxy.router.stats().in_flight == 0, what="no request in flight")
    return True


def test_a_compressing_backend_is_asked_for_identity_and_its_encoding_relayed(backend: Backend) -> None:
    start, seen = backend

    async def compressing(request: web.Request) -> web.StreamResponse:
        if (await request.json()).get("stream"):
            stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            stream.enable_compression()
            await stream.prepare(request)
            await stream.write(b'data: {"x": 1}\n\ndata: [DONE]\n\n')
            await stream.write_eof()
            return stream
        answer = web.json_response({"choices": [{"text": "hello"}]})
        answer.enable_compression()  # compresses only when the request accepts it
        return answer

    with Proxy(Router(), [start(compressing)], base_models=[]) as proxy:
        plain = httpx.post(proxy.url + "/v1/completions", json={"prompt": "x"}, headers={"Accept-Encoding": "identity"})
        streamed = httpx.post(proxy.url + "/v1/completions", json={"prompt": "x", "stream": True},
                              headers={"Accept-Encoding": "identity"})  # fmt: skip
        gzipped = httpx.post(proxy.url + "/v1/completions", json={"prompt": "x"}, headers={"Accept-Encoding": "gzip"})
        assert plain.json() == {"choices": [{"text": "hello"}]}
        assert streamed.text == 'data: {"x": 1}\n\ndata: [DONE]\n\n'
        assert gzipped.headers["content-encoding"] == "gzip" and gzipped.json() == {"choices": [{"text": "hello"}]}
        assert [r.headers["Accept-Encoding"] for r in seen] == ["identity", "identity", "gzip"]
        assert idle(proxy)


def test_client_headers_query_and_answer_headers_go_through(backend: Backend) -> None:
    start, seen = backend

    async def strict(request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization") != "Bearer k":
            return web.json_response({"error": {"message": "no key"}}, status=401)
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": "m", "object": "model", "parent": None}]})
        return web.json_response({"ok": True}, status=201, headers={"X-Request-Id": "abc", "Retry-After": "3"})

    headers = {"Authorization": "Bearer k", "X-Request-Id": "client-1", "traceparent": "00-1-2-01"}
    with Proxy(Router(), [start(strict)]) as proxy:
        reply = httpx.post(proxy.url + "/v1/completions?api-version=1", json={"prompt": "x"}, headers=headers)
        assert (reply.status_code, reply.headers["x-request-id"], reply.headers["retry-after"]) == (201, "abc", "3")
        completion = next(r for r in seen if r.path == "/v1/completions")
        assert completion.path_qs == "/v1/completions?api-version=1"
        assert completion.headers["X-Request-Id"] == "client-1" and completion.headers["traceparent"] == "00-1-2-01"
        models = httpx.get(proxy.url + "/v1/models", headers={"Authorization": "Bearer k"})
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "m"
        assert proxy.base_models == frozenset({"m"})  # learned once a client's key opened /v1/models


def test_a_stream_the_backend_breaks_off_reaches_the_client_broken(backend: Backend) -> None:
    start, _ = backend

    async def breaking(request: web.Request) -> web.StreamResponse:
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await stream.prepare(request)
        await stream.write(b'data: {"x": 1}\n\n')
        assert request.transport is not None
        request.transport.abort()  # the engine dies mid-answer
        return stream

    with Proxy(Router(), [start(breaking)], base_models=[]) as proxy:
        with pytest.raises(httpx.RemoteProtocolError):  # an incomplete answer, not a complete 200
            httpx.post(proxy.url + "/v1/completions", json={"prompt": "x", "stream": True})
        assert idle(proxy) and proxy.stats().backend_error == 1


def test_a_request_that_reached_a_backend_is_not_sent_again(good: OpenAIEngine) -> None:
    received = []

    class TakesAndCloses(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            received.append(self.request.recv(65536))
            self.request.close()

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), TakesAndCloses)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        closer = f"http://127.0.0.1:{server.server_address[1]}"
        before = good.stats().requests
        # Round robin, so the closer surely takes one: the default policy may place six short prompts all on the other.
        with Proxy(Router(policy=RoundRobin()), [closer, good.url], base_models=[]) as proxy:
            replies = [httpx.post(proxy.url + "/v1/completions", json={"prompt": f"x{i}"}) for i in range(6)]
            taken = sum(1 for reply in replies if reply.status_code == 502)
            assert taken == len(received) > 0  # each request the closer took was answered 502, not resent
            assert good.stats().requests - before == len(replies) - taken and proxy.stats().retries == 0
            assert idle(proxy)
    finally:
        server.shutdown()
        server.server_close()


def test_a_clients_expect_100_continue_is_answered_by_the_proxy_not_sent_on() -> None:
    """curl sends ``Expect: 100-continue`` with a large body (a long prompt). The proxy answers it (aiohttp sends 100
    and reads the body) and then holds the whole body, yet it sent the expectation on, and aiohttp's client waits for
    the backend's 100 before sending the body: a backend that does not send one (it need not) never got the body,
    and with no read timeout the client waited for ever."""
    heads: list[bytes] = []

    class NoContinue(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            head = b""
            while not head.endswith(b"\r\n\r\n"):
                head += self.rfile.read(1) or b"\r\n\r\n"
            heads.append(head)
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            answer = json.dumps({"choices": [{"text": "ok"}], "read": len(self.rfile.read(length))}).encode()
            self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                             % (len(answer), answer))  # fmt: skip

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), NoContinue)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    body = json.dumps({"prompt": "a long prompt " * 1000}).encode()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nExpect: 100-continue\r\n"
    try:
        with Proxy(Router(), [f"http://127.0.0.1:{server.server_address[1]}"], base_models=[]) as proxy:
            host, port = proxy.url.removeprefix("http://").split(":")
            with socket.create_connection((host, int(port)), timeout=10) as client:
                client.sendall(head + b"Content-Length: %d\r\n\r\n" % len(body))
                assert client.recv(1024) == b"HTTP/1.1 100 Continue\r\n\r\n"
                client.sendall(body)
                answer = client.recv(65536)
                while not answer.endswith(b"}"):  # the head and the body may come apart (aiohttp 3.10 sends them so)
                    chunk = client.recv(65536)
                    assert chunk, answer
                    answer += chunk
            assert answer.startswith(b"HTTP/1.1 200 OK") and answer.endswith(b'"read": %d}' % len(body)), answer
            assert b"expect" not in heads[0].lower()
            assert idle(proxy)
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("expect", [True, False])
def test_a_body_declared_over_the_limit_is_refused_before_it_is_sent(
    refused_port: Callable[[], int], expect: bool
) -> None:
    """A Content-Length over ``max_body_bytes`` is answered 413 from the head alone: with ``Expect: 100-continue``
    instead of a 100 (the client never sends the body), without it before the body is read. The answer says that
    the connection closes: the body the client declared is never read, so it cannot carry another request (was kept
    alive, unsaid: a client's next request on it was read as that body's bytes, and unanswered for ~10 s)."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 2000\r\n"
    with Proxy(Router(), [f"http://127.0.0.1:{refused_port()}"], base_models=[], max_body_bytes=1000) as proxy:
        answer = error_answer(proxy, head + (b"Expect: 100-continue\r\n" if expect else b"") + b"\r\n")
        assert answer.startswith(b"HTTP/1.1 413 "), answer
        assert b"\r\nconnection: close\r\n" in answer.split(b"\r\n\r\n", 1)[0].lower() + b"\r\n"
        error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
        assert error["type"] == "RequestEntityTooLargeError" and "1000 bytes" in error["message"]
        assert proxy.stats().bad_request == 1 and idle(proxy)


def test_a_body_not_labelled_json_is_refused_before_the_client_sends_it(refused_port: Callable[[], int]) -> None:
    """A body that is not labelled JSON is refused from the head (as vLLM's validate_json_request): with ``Expect:
    100-continue`` the answer is the 400, not a 100 after which the client uploaded its whole body to be refused
    (curl labels ``--data-binary`` form-encoded)."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-www-form-urlencoded\r\n"
    with Proxy(Router(), [f"http://127.0.0.1:{refused_port()}"], base_models=[]) as proxy:
        answer = error_answer(proxy, head + b"Content-Length: 2000\r\nExpect: 100-continue\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 400 "), answer
        assert b"\r\nconnection: close\r\n" in answer.split(b"\r\n\r\n", 1)[0].lower() + b"\r\n"
        error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
        assert "application/json" in error["message"], error
        assert proxy.stats().bad_request == 1 and idle(proxy)


def test_an_unknown_expectation_is_a_417_in_error_json(refused_port: Callable[[], int]) -> None:
    """Every refusal of the proxy is OpenAI's error JSON; an ``Expect`` other than ``100-continue`` was aiohttp's
    text/plain "Unknown Expect", uncounted."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
    with Proxy(Router(), [f"http://127.0.0.1:{refused_port()}"], base_models=[]) as proxy:
        answer = error_answer(proxy, head + b"Expect: foo\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 417 "), answer
        error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
        assert error["type"] == "ExpectationFailedError" and "100-continue" in error["message"], error
        assert proxy.stats().bad_request == 1 and idle(proxy)


def test_a_model_list_gzipped_by_a_hop_between_is_read(backend: Backend) -> None:
    """The proxy relays answers as the engines send them, so it does not decompress; it asked for /v1/models with
    aiohttp's default ``Accept-Encoding: gzip, deflate``, and a hop between that compresses JSON (an ingress) gave it
    a list it could not read: 502 "no backend answered", the base models never learned. It asks for identity."""

    async def gzipping(request: web.Request) -> web.StreamResponse:
        body = json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]}).encode()
        if "gzip" in request.headers.get("Accept-Encoding", ""):
            return web.Response(body=gzip.compress(body), headers={"Content-Encoding": "gzip"},
                                content_type="application/json")  # fmt: skip
        return web.Response(body=body, content_type="application/json")

    url, _ = backend
    with Proxy(Router(), [url(gzipping)]) as proxy:
        reply = httpx.get(proxy.url + "/v1/models")
        assert reply.status_code == 200 and [card["id"] for card in reply.json()["data"]] == ["m"], reply.text
        assert proxy.base_models == frozenset({"m"})


def test_a_request_no_backend_could_take_is_finished_once(refused_port: Callable[[], int]) -> None:
    dead = [f"http://127.0.0.1:{refused_port()}" for _ in range(2)]
    with Proxy(Router(), dead, base_models=[]) as proxy:
        for i in range(3):
            assert httpx.post(proxy.url + "/v1/completions", json={"prompt": f"p{i}"}).status_code == 502
        assert idle(proxy) and proxy.stats().retries == 3
        assert proxy.router.stats().ignored == 0  # no second finish of the request the failed retry had finished


def test_metrics_group_each_family_and_health_follows_the_fleet(refused_port: Callable[[], int]) -> None:
    dead = [f"http://127.0.0.1:{refused_port()}" for _ in range(2)]
    proxy, fleet = build(build_parser().parse_args(["proxy", "--backends", *dead, "--metrics-from-backends"]))
    try:
        with proxy:
            wait_until(lambda: fleet.healthy_backends() == [], what="both scrapes failed")
            health = httpx.get(proxy.url + "/healthz")
            assert health.status_code == 503 and health.json()["healthy_backends"] == []
            families = {f.name: f for f in text_string_to_metric_families(httpx.get(proxy.url + "/metrics").text)}
            assert families["prefixroute_router_in_flight"].type == "gauge"
            assert len(families["prefixroute_router_in_flight"].samples) == 2
            assert [s.value for s in families["prefixroute_proxy_backend_up"].samples] == [0, 0]
    finally:
        fleet.close()


def test_refusals_say_what_to_fix(refused_port: Callable[[], int]) -> None:
    with Proxy(Router(), [f"http://127.0.0.1:{refused_port()}"], base_models=[]) as proxy:
        deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"  # past 3.12+'s C recursion limit too
        reply = httpx.post(proxy.url + "/v1/completions", content=deep, headers=JSON_BODY)
        assert reply.status_code == 400 and "nests arrays or objects deeper" in reply.json()["error"]["message"]
        reply = httpx.post(proxy.url + "/v1/completions", content=b'{"prompt": "\\ud800 hi"}', headers=JSON_BODY)
        assert reply.status_code == 400 and "surrogate" in reply.json()["error"]["message"]
        wrong = httpx.get(proxy.url + "/v1/completions")
        assert wrong.status_code == 405 and "POST" in wrong.headers["allow"]
        assert wrong.json()["error"]["type"] == "MethodNotAllowedError"
        assert httpx.get(proxy.url + "/nowhere").json()["error"]["type"] == "NotFoundError"
        assert proxy.stats().bad_request == 2


@pytest.mark.parametrize(
    "url",
    ["http://user:secret@127.0.0.1:8000", "http://a\n:1", "http://a:1\r", "http://\u4f8b.jp:8000", "http://c:3?x=1"]
    + ["http://c:3#f", "http://c:99999", "http://c:0", "ftp://c:1"],
)
def test_backend_urls_that_cannot_go_in_a_request_line_are_refused(url: str) -> None:
    with pytest.raises(ConfigurationError):
        Proxy(Router(), [url])


@pytest.mark.parametrize("url", ["http://gpu0:8000/v1", "http://gpu0:8000/v1/", "https://gw/engine0/V1"])
def test_an_openai_base_url_is_refused_with_the_engines_own(url: str) -> None:
    """Requests go to the backend's /v1/... paths: a base URL ending in /v1 made every one a 404 from /v1/v1/..."""
    with pytest.raises(ConfigurationError) as refused:
        Proxy(Router(), [url])
    own = url.rstrip("/")[:-3]
    assert str(refused.value) == (
        f"backend URL {url!r} ends in /v1: give the engine's own URL, {own!r}; requests go to its /v1/completions "
        "and /v1/chat/completions"
    )
    Proxy(Router(), [own, f"{own}/v1x"])


@pytest.mark.parametrize(
    "twice",
    [
        ["http://gpu0", "http://gpu0:80"],
        ["http://gpu0:8000/", "http://GPU0:08000"],
        ["https://g:443/engine", "https://g/engine/"],
    ],
)
def test_one_engine_named_twice_however_it_is_spelt_is_refused(twice: list[str]) -> None:
    """Two spellings of one engine would count as two backends: its load and cache split, its share doubled."""
    with pytest.raises(ConfigurationError) as refused:
        Proxy(Router(), ["http://other:1", *twice])
    assert str(refused.value).startswith(
        f"backends list {twice[0].rstrip('/')!r} and {twice[1].rstrip('/')!r}, one engine ("
    )
    Proxy(Router(), ["http://gpu0:8000", "http://gpu0:8001", "https://gpu0:8000", "http://gpu0:8000/v2"])


def test_models_a_backend_refuses_relay_its_refusal_not_a_502(backend: Backend, good: OpenAIEngine) -> None:
    start, _ = backend

    async def keyed(request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization") != "Bearer k":
            return web.json_response({"error": "Unauthorized"}, status=401)
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    with Proxy(Router(), [start(keyed), start(keyed)], base_models=[]) as proxy:
        refused = httpx.get(proxy.url + "/v1/models")  # a wrong key is the client's to fix: 401, as the engine says
        assert (refused.status_code, refused.json()) == (401, {"error": "Unauthorized"})
        assert httpx.get(proxy.url + "/v1/models", headers={"Authorization": "Bearer k"}).json()["data"][0]["id"] == "m"
    with Proxy(Router(), [start(keyed), good.url], base_models=[]) as proxy:
        merged = httpx.get(proxy.url + "/v1/models")  # one backend answered: its models, not the other's refusal
        assert merged.status_code == 200 and [card["id"] for card in merged.json()["data"]] == ["fake-model"]


NO_MODELS: list[Any] = [{"id": 5}, {"object": "model"}, {"id": ""}, {"id": " "}, {"id": None}, {"id": ["m"]},
                        {"id": "a\nb"}, {"id": "x", "object": "file"}, "m", None, 7, []]  # fmt: skip
KEPT = [{"id": "kept", "object": "model", "owned_by": "vllm"}, {"id": "kept", "object": "model", "owned_by": "again"}]
MODEL_LISTS: list[tuple[str, bytes]] = [
    ("entries-that-are-no-model", json.dumps({"object": "list", "data": NO_MODELS + KEPT}).encode()),
    ("data-not-a-list", b'{"object": "list", "data": {"id": "m", "object": "model"}}'),
    ("data-null", b'{"object": "list", "data": null}'),
    ("no-data", b'{"object": "list"}'),
    ("a-list-not-an-object", b'[{"id": "m", "object": "model"}]'),
    ("not-json", b"<html>502 Bad Gateway</html>"),
    ("cut-short", b'{"object": "list", "data": [{"id": "m"'),
    ("nested-too-deep", b'{"data": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    ("over-16-MiB", b'{"data": [' + b'{"id": "m"},' * (2**24 // 12) + b'{"id": "m"}]}'),
    ("a-server-error", b""),
]


@pytest.mark.parametrize(("answer", "raw"), MODEL_LISTS, ids=[name for name, _ in MODEL_LISTS])
def test_a_backends_malformed_model_list_never_reaches_the_merged_one(
    backend: Backend, good: OpenAIEngine, answer: str, raw: bytes
) -> None:
    """Only model objects (a JSON object with a non-empty string ``id``) are merged, once per id: a backend's
    entries that are none were relayed as they came (``{"id": 5}``, ``{"object": "model"}``), so a client reading
    ``data[i]["id"]`` as a string broke. A backend whose list is unreadable is skipped, logged and counted; the
    others' models are still listed."""
    start, _ = backend

    async def hostile(request: web.Request) -> web.StreamResponse:
        status = 500 if answer == "a-server-error" else 200
        return web.Response(status=status, body=raw, content_type="application/json")

    bad = start(hostile)
    with Proxy(Router(), [bad, good.url]) as proxy:
        reply = httpx.get(proxy.url + "/v1/models")
        assert reply.status_code == 200, reply.text
        listing = reply.json()
        assert set(listing) == {"object", "data"} and listing["object"] == "list"
        ids = [card["id"] for card in listing["data"]]
        assert ids == (["kept", "fake-model"] if answer == "entries-that-are-no-model" else ["fake-model"])
        assert all(isinstance(card, dict) and card["object"] == "model" for card in listing["data"])
        if answer == "entries-that-are-no-model":
            assert listing["data"][0]["owned_by"] == "vllm"  # the first backend's card for an id
        with openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0) as client:
            assert [model.id for model in client.models.list()] == ids
        skipped = metric_samples(httpx.get(proxy.url + "/metrics"))["prefixroute_proxy_models_skipped_total"]
        counted = {dict(labels)["backend"]: value for labels, value in skipped.items()}
        listed_nothing = answer != "entries-that-are-no-model"
        assert counted == {bad: 3.0 * listed_nothing, good.url: 0.0}  # at start, and for each client's listing
        assert proxy.base_models == frozenset({"kept", "fake-model"} if not listed_nothing else {"fake-model"})


UNREADABLE_REASONS = {
    "data-not-a-list": "its 'data' is dict, not a list",
    "data-null": "its 'data' is NoneType, not a list",
    "no-data": "its 'data' is NoneType, not a list",
    "a-list-not-an-object": "a JSON list, not an object",
    "not-json": "not JSON (JSONDecodeError)",
    "cut-short": "not JSON (JSONDecodeError)",
    "nested-too-deep": "not JSON (RecursionError)",
}
UNREADABLE = [
    pytest.param(raw, UNREADABLE_REASONS[name], id=name) for name, raw in MODEL_LISTS if name in UNREADABLE_REASONS
]


@pytest.mark.parametrize(
    ("raw", "why"), [*UNREADABLE, pytest.param(b'{"data": ["\xff"]}', "not JSON (UnicodeDecodeError)", id="not-utf-8")]
)
def test_an_unreadable_model_list_says_why_in_the_log_line_it_is_skipped_with(raw: bytes, why: str) -> None:
    """UnreadableModels: "the message says why" (the proxy logs "its answer is no model list: <why>")."""
    with pytest.raises(UnreadableModels) as unreadable:
        model_cards(raw)
    assert str(unreadable.value) == why


def test_a_card_without_an_object_field_is_a_model_one_naming_another_object_is_not() -> None:
    """model_cards' docstring: a model object's ``object``, *when it has one*, is "model"."""
    raw = json.dumps({"data": [{"id": "bare"}, {"id": "file", "object": "file"}, {"id": "m", "object": "model"}]})
    assert model_cards(raw.encode()) == [{"id": "bare"}, {"id": "m", "object": "model"}]


def test_a_backend_that_never_answers_models_is_skipped_within_the_bound_and_generations_have_none(
    good: OpenAIEngine, caplog: pytest.LogCaptureFixture
) -> None:
    """A backend that takes the connection and never answers held ``/v1/models`` (and the proxy's start) for 5 s.
    Now it is skipped after ``models_timeout``; a completion, however long, is not bounded by it."""
    with socket.socket() as silent, OpenAIEngine(max_tokens=4, token_delay_s=0.3) as slow:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # accepts (the kernel does), never answers
        mute = f"http://127.0.0.1:{silent.getsockname()[1]}"
        # The mute backend never answers and the client waits ten minutes, so only models_timeout ends a listing:
        # returns() guards the start and each listing against a hang, it measures no speed (each was held to 3 s).
        with caplog.at_level(logging.WARNING, "prefixroute.proxy"):
            proxy = returns(Proxy(Router(), [mute, slow.url], models_timeout=0.3).start, what="the proxy's start")
            try:
                for _ in range(3):
                    reply = returns(lambda: httpx.get(proxy.url + "/v1/models", timeout=600), what="a listing")
                    assert reply.status_code == 200 and [c["id"] for c in reply.json()["data"]] == ["fake-model"]
            finally:
                proxy.stop()
        with Proxy(Router(), [slow.url], models_timeout=0.3) as proxy:
            for stream in (False, True):  # 0.9 s of tokens: three times the models bound
                body = {"prompt": "hello", "model": "fake-model", "stream": stream}
                answer = httpx.post(proxy.url + "/v1/completions", json=body, timeout=30)
                assert answer.status_code == 200 and answer.text.count(" t3") == 1, answer.text
        skipped = [r for r in caplog.records if mute in r.getMessage()]
        assert len(skipped) == 1 and skipped[0].levelno == logging.WARNING  # once, not at every listing
        assert "within 0.3 s" in skipped[0].getMessage()


@pytest.mark.parametrize("seconds", [0, -1, float("nan"), float("inf"), "2"])
def test_the_models_bound_is_a_positive_number_of_seconds(seconds: object) -> None:
    with pytest.raises(ConfigurationError, match="models_timeout"):
        Proxy(Router(), ["http://127.0.0.1:1"], models_timeout=seconds)  # type: ignore[arg-type]


def test_a_compressed_request_body_goes_on_decoded_and_a_corrupt_one_is_a_bad_request(good: OpenAIEngine) -> None:
    plain = json.dumps({"prompt": [1, 2, 3], "max_tokens": 2}).encode()
    with Proxy(Router(), [good.url], base_models=[]) as proxy:
        for encoding, body in [("gzip", gzip.compress(plain)), ("deflate", zlib.compress(plain))]:
            headers = {"Content-Type": "application/json", "Content-Encoding": encoding}
            for _ in range(4):  # more than max_failures: a client's encoding must never take a backend out
                reply = httpx.post(proxy.url + "/v1/completions", content=body, headers=headers)
                assert reply.status_code == 200, reply.text
                assert reply.json()["usage"]["prompt_tokens"] == 3
        corrupt = httpx.post(
            proxy.url + "/v1/completions", content=plain, headers={**JSON_BODY, "Content-Encoding": "gzip"}
        )
        assert corrupt.status_code == 400 and corrupt.json()["error"]["type"] == "BadRequestError"
        stats = proxy.stats()
        assert (stats.ok, stats.bad_request, stats.backend_error, stats.unhealthy) == (8, 1, 0, ())
        assert idle(proxy)


def test_a_body_over_the_limit_is_a_counted_bad_request(refused_port: Callable[[], int]) -> None:
    with Proxy(Router(), [f"http://127.0.0.1:{refused_port()}"], base_models=[]) as proxy:
        reply = httpx.post(proxy.url + "/v1/completions", content=b" " * ((64 << 20) + 1), headers=JSON_BODY)
        assert reply.status_code == 413 and reply.json()["error"]["code"] == 413
        assert "67108864 bytes" in reply.json()["error"]["message"]  # the limit, and how to raise it
        assert "max_body_bytes" in reply.json()["error"]["message"]
        assert proxy.stats().bad_request == 1


def test_the_body_limit_is_the_operators_to_set(good: OpenAIEngine) -> None:
    """A model with a context of millions of tokens takes prompts of tens of MB as token ids (vLLM reads any size),
    and a chat carries images inline: the 64 MiB limit was fixed. ``max_body_bytes`` (``--max-body-mib``) sets it."""
    prompt = list(range(1000, 1000 + 150_000))  # 150,000 ids: about 1 MB of JSON
    body = json.dumps({"prompt": prompt, "max_tokens": 1}).encode()
    with Proxy(Router(), [good.url], base_models=[], max_body_bytes=len(body) - 1) as proxy:
        reply = httpx.post(proxy.url + "/v1/completions", content=body, headers=JSON_BODY, timeout=30)
        assert reply.status_code == 413 and f"{len(body) - 1} bytes" in reply.json()["error"]["message"]
        assert proxy.stats().bad_request == 1 and proxy.router.stats().decisions == 0
    with Proxy(Router(), [good.url], base_models=[], max_body_bytes=len(body)) as proxy:
        reply = httpx.post(proxy.url + "/v1/completions", content=body, headers=JSON_BODY, timeout=30)
        assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens"] == len(prompt)
    for bad in (0, -1, 1.5, True, "64"):
        with pytest.raises(ConfigurationError, match="max_body_bytes"):
            Proxy(Router(), [good.url], max_body_bytes=bad)  # type: ignore[arg-type]
    for argv, limit in ((["--max-body-mib", "256"], 256 * 2**20), ([], 64 * 2**20)):
        proxy, _ = build(build_parser().parse_args(["proxy", "--backends", good.url, *argv]))
        assert proxy.max_body_bytes == limit


def test_the_failure_and_timeout_options_are_the_operators_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--max-failures``, ``--cooldown``, ``--connect-timeout`` and ``--models-timeout`` reach the proxy's options
    of those names, and without them the command serves with the constructor's own defaults."""
    import prefixroute.adapters.proxy.cli as proxy_cli

    given: list[dict[str, Any]] = []
    monkeypatch.setattr(proxy_cli, "Proxy", lambda router, backends, **options: given.append(options))
    names = ("max_failures", "cooldown", "connect_timeout", "models_timeout")
    flags = ["--max-failures", "7", "--cooldown", "0.5", "--connect-timeout", "0.25", "--models-timeout", "30"]
    for argv in ([], flags):
        build(build_parser().parse_args(["proxy", "--backends", "http://127.0.0.1:9", *argv]))
    defaults = {name: inspect.signature(Proxy).parameters[name].default for name in names}
    assert {name: given[0][name] for name in names} == defaults
    assert {name: given[1][name] for name in names} == dict(zip(names, (7, 0.5, 0.25, 30.0), strict=True))


def test_a_long_context_prompt_goes_through_where_warnings_are_errors(good: OpenAIEngine) -> None:
    """A 100,000-token prompt as text (~4 MB here) or as ids (~0.7 MB) goes through. A body over 1 MiB was sent on as
    bytes, for which aiohttp warns (ResourceWarning: "might lock the event loop"): where warnings are errors (this
    suite, a user's pytest with filterwarnings = error, ``python -W error``) each such prompt was a 502."""
    text = " ".join(f"w{i % 5000:04d}" * 8 for i in range(100_000))  # 100,000 words of 40 characters
    ids = list(range(100_000, 200_000))
    with Proxy(Router(), [good.url], base_models=[]) as proxy:
        for prompt in (text, ids):
            body = {"prompt": prompt, "max_tokens": 1}
            reply = httpx.post(proxy.url + "/v1/completions", json=body, timeout=60)
            assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens"] == 100_000, reply.text[:200]


@pytest.mark.parametrize("model", [5, 1.5, True, ["m"], {"id": "m"}])
def test_a_model_that_is_not_a_string_is_a_bad_request_routed_nowhere(
    model: object, refused_port: Callable[[], int]
) -> None:
    """An OpenAI ``model`` is a string (the sidecar's pick mode refused others already): a number or a list is the
    client's to fix, a 400 before routing, not whatever a backend makes of it (the fake engines answered 404)."""
    with Proxy(Router(), [f"http://127.0.0.1:{refused_port()}"], base_models=[]) as proxy:
        bodies: list[tuple[str, dict[str, Any]]] = [
            ("/v1/completions", {"prompt": "a"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]}),
        ]
        for path, body in bodies:
            reply = httpx.post(proxy.url + path, json={"model": model, **body})
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert (error["type"], error["code"], error["param"]) == ("BadRequestError", 400, None)
            assert "'model' must be a string" in error["message"]
        assert proxy.stats().bad_request == 2 and proxy.router.stats().decisions == 0
        assert httpx.post(proxy.url + "/v1/completions", json={"model": None, "prompt": "a"}).status_code == 502


def test_token_ids_that_are_no_ints_as_vllm_reads_them_are_refused(refused_port: Callable[[], int]) -> None:
    with Proxy(Router(), [f"http://127.0.0.1:{refused_port()}"], base_models=[]) as proxy:
        refused: list[list[Any]] = [[5, 1.5, 7], [[None, 1]], [5, "1e2"]]
        for prompt in refused:
            reply = httpx.post(proxy.url + "/v1/completions", json={"prompt": prompt})
            assert reply.status_code == 400 and "position" in reply.json()["error"]["message"], reply.text
        assert proxy.stats().bad_request == 3 and proxy.router.stats().decisions == 0
        # vLLM reads JSON's true as 1 and 2.0 as 2 (pydantic, lax): routed, here to a backend that is down
        lax: list[list[Any]] = [[5, True, 7], [[False, 1]], [2.0]]
        for prompt in lax:
            assert httpx.post(proxy.url + "/v1/completions", json={"prompt": prompt}).status_code == 502
        assert proxy.router.stats().decisions == 3


@pytest.mark.parametrize("policy", [BuggyPolicy(), StrangerPolicy()])
def test_a_failing_policy_is_the_proxys_fault_not_the_clients(policy: LoadPolicy, good: OpenAIEngine) -> None:
    with Proxy(Router(policy=policy), [good.url], base_models=[]) as proxy:
        reply = httpx.post(proxy.url + "/v1/completions", json={"prompt": "hello"})
        assert reply.status_code == 500 and reply.json()["error"]["type"] == "InternalServerError"
        assert "policy" in reply.json()["error"]["message"]
        stats = proxy.stats()
        assert (stats.internal_error, stats.bad_request) == (1, 0)
        assert 'prefixroute_proxy_requests_total{outcome="internal_error"} 1' in proxy.metrics_text()
        assert idle(proxy)


def test_a_client_that_leaves_before_its_whole_body_came_is_one_client_disconnect(
    refused_port: Callable[[], int],
) -> None:
    with Proxy(Router(), [f"http://127.0.0.1:{refused_port()}"], base_models=[]) as proxy:
        host, port = proxy.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as client:
            head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000"
            client.sendall(head + b'\r\n\r\n{"prompt": ')
            time.sleep(0.2)  # the handler waits for the rest of the body
        wait_until(lambda: proxy.stats().client_disconnect == 1, what="the disconnect counted")
        stats = proxy.stats()
        assert (stats.internal_error, stats.bad_request, proxy.router.stats().decisions) == (0, 0, 0)


def test_a_json_body_with_a_byte_order_mark_is_routed_as_vllm_reads_it(good: OpenAIEngine) -> None:
    """RFC 8259 lets a parser ignore a UTF-8 BOM and vLLM's does: a client that works against vLLM works through the
    proxy (it answered 400 "not valid JSON")."""
    body = b"\xef\xbb\xbf" + json.dumps({"prompt": [1, 2, 3], "max_tokens": 2}).encode()
    with Proxy(Router(), [good.url], base_models=[]) as proxy:
        reply = httpx.post(proxy.url + "/v1/completions", content=body, headers={"Content-Type": "application/json"})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["prompt_tokens"] == 3 and reply.headers["X-Prefixroute-Backend"] == good.url
        assert idle(proxy)


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Bad: a\x01b\r\nContent-Length: 2\r\n\r\n{}",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 9000 + b"\r\nContent-Length: 2\r\n\r\n{}",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: two\r\n\r\n{}",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Encoding: deflate\r\nContent-Length: 2000\r\n\r\n"
        + b"x" * 2000,
        b"POST /v1/completions HTTP/1.1\nHost: x\nAuthorization: Bearer sk-SECRET\nContent-Length: 24\n\n"
        + b'{"prompt": "SSN 123-45"}',
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-SECRET\r\nX-Bad : 1\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n18\n"
        + b'{"prompt": "SSN 123-45"}\r\n0\r\n\r\n',
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    ],
    ids=[
        "control-character",
        "header-too-long",
        "bad-content-length",
        "body-that-does-not-decompress",
        "bare-lf-after-a-key",
        "bad-header-after-a-key",
        "bad-chunk-of-a-prompt",
        "http2-preface",
    ],
)
def test_a_malformed_request_is_a_warning_line_not_a_traceback(
    request_bytes: bytes, caplog: pytest.LogCaptureFixture, refused_port: Callable[[], int]
) -> None:
    """Any client can send broken HTTP or a body that does not decode: aiohttp logged each as an error with a
    traceback (a log anyone could flood); now one warning line, and the client still gets its 400. The line says what
    was wrong and never quotes the request (it quoted its bytes: the client's API key, its prompt), and it is
    prefixroute's, at prefixroute's level (it was aiohttp's logger, which the proxy's --log-level did not reach)."""
    with Proxy(Router(), [f"http://127.0.0.1:{refused_port()}"], base_models=[]) as proxy:
        host, port = proxy.url.removeprefix("http://").split(":")
        with caplog.at_level(logging.DEBUG), socket.create_connection((host, int(port))) as client:
            client.sendall(request_bytes)
            client.settimeout(5)
            answer = client.recv(65536)
            assert answer.startswith(b"HTTP/1.1 400") or answer.startswith(b"HTTP/1.0 400"), answer
            wait_until(lambda: any(r.levelno >= logging.WARNING for r in caplog.records), what="a log record")
        assert proxy.router.stats().decisions == 0
    server = [r for r in caplog.records if r.name.startswith("prefixroute.") and r.levelno >= logging.WARNING]
    assert server and all(r.levelno == logging.WARNING and r.exc_info is None for r in server), server
    assert all("\n" not in r.getMessage() for r in server)
    assert not [r for r in caplog.records if b"SECRET" in request_bytes and "SECRET" in r.getMessage()]
    assert not [r for r in caplog.records if b"SSN" in request_bytes and "SSN" in r.getMessage()]
    assert all(len(r.getMessage()) < 300 for r in server), server


@pytest.mark.parametrize(("stop", "level"), [(signal.SIGTERM, []), (signal.SIGINT, ["--log-level", "error"])])
def test_the_command_stops_gracefully_on_sigterm_as_on_ctrl_c(stop: signal.Signals, level: list[str]) -> None:
    # Was: SIGTERM (what systemd, Docker and Kubernetes send) killed the proxy, status -15, nothing closed.
    port = free_port()
    command = [sys.executable, "-m", "prefixroute", "proxy", "--backends", "http://127.0.0.1:9", "--port", str(port)]
    with subprocess.Popen([*command, *level], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as process:
        try:
            assert process.stdout is not None
            # Was "routing to 1 backends".
            assert process.stdout.readline() == f"prefixroute proxy at http://127.0.0.1:{port}, routing to 1 backend\n"
            assert httpx.get(f"http://127.0.0.1:{port}/metrics").status_code == 200
            process.send_signal(stop)
            _, err = process.communicate(timeout=20)
            assert process.returncode == 0  # and nothing said but that the backend (none at :9) lists no models
            said = (
                "prefixroute proxy: WARNING backend http://127.0.0.1:9 is left out of /v1/models until it lists again"
            )
            lines = err.splitlines()  # with --log-level error, not even that
            assert lines == [] if level else len(lines) == 1 and lines[0].startswith(said + ": "), err
        finally:
            process.kill()


class _HeldEncoder:
    """Encodes text as bytes, but holds a long prompt until released: a tokenizer busy with a huge prompt."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.holding = threading.Event()

    def encode(self, text: str) -> list[int]:
        if len(text) > 2**16:
            self.holding.set()
            assert self.release.wait(30)
        return list(text.encode())

    def encode_chat(self, messages: Any) -> list[int]:
        return self.encode(json.dumps(messages))


def test_a_long_prompt_is_tokenized_off_the_event_loop(good: OpenAIEngine) -> None:
    """An audit found /healthz answering after 1.2 s while a 10 MB text was tokenized: every stream stalled."""
    encoder = _HeldEncoder()
    with Proxy(Router(), [good.url], encoder=encoder, base_models=[]) as proxy:
        long_one: list[httpx.Response] = []
        sender = threading.Thread(
            target=lambda: long_one.append(
                httpx.post(proxy.url + "/v1/completions", json={"prompt": "w " * 2**16, "max_tokens": 2}, timeout=60)
            )
        )
        sender.start()
        assert encoder.holding.wait(30)
        try:  # the loop is free while the long prompt is tokenized: a health check and a short request go through
            assert httpx.get(proxy.url + "/healthz", timeout=10).status_code == 200
            short = httpx.post(proxy.url + "/v1/completions", json={"prompt": "w w", "max_tokens": 2}, timeout=10)
            assert short.status_code == 200
        finally:
            encoder.release.set()
            sender.join(60)
        assert long_one[0].status_code == 200
        assert proxy.router.stats().in_flight == 0


def test_numpy_integers_are_taken_for_the_adapters_and_fakes_int_options() -> None:
    """numpy's ints were refused for a count, a port or a status: kept now as the int they stand for; bools not."""
    import numpy as np

    from prefixroute.adapters.serve.app import Sidecar
    from prefixroute.adapters.serve.contract import is_refusal
    from prefixroute.testing import FakeVLLM
    from prefixroute.testing.fake_cache import FakeBlockCache

    npa: Any = np  # numpy's ints typed loosely: stubs differ on whether they are ints
    proxy = Proxy(Router(), ["http://127.0.0.1:1"], retries=npa.int64(2), max_failures=npa.uint8(3), base_models=[])
    assert type(proxy._retries) is int and type(proxy._max_failures) is int
    assert type(Sidecar(Router(), backends=[], max_body_bytes=npa.int64(1000))._max_body) is int
    assert is_refusal(npa.int16(400)) and not is_refusal(npa.int64(500))
    engine = OpenAIEngine(max_tokens=npa.int64(3), max_running=npa.int32(2), port=npa.int64(0), seed=npa.int64(1))
    assert type(engine.max_tokens) is int and type(engine._max_running) is int
    cache = FakeBlockCache(block_size=npa.int64(4), num_blocks=npa.int64(8), rng=random.Random(0))
    assert type(cache.block_size) is int and type(cache.num_blocks) is int
    fake = FakeVLLM(replay_buffer=npa.int64(10), seed=npa.int64(1), port=npa.int64(0))
    assert fake._buffer.maxlen == 10
    bads: list[Any] = [True, npa.bool_(True), 2.0]
    for bad in bads:
        with pytest.raises(ConfigurationError, match="retries"):
            Proxy(Router(), ["http://127.0.0.1:1"], retries=bad)
        with pytest.raises(ConfigurationError, match="max_tokens"):
            OpenAIEngine(max_tokens=bad)


@pytest.mark.parametrize("body", [None, "model", ["model"], 5])
def test_namespace_refuses_a_body_that_is_no_json_object(body: object, refused_port: Callable[[], int]) -> None:
    # Was: AttributeError ('get'), from the public Proxy.namespace().
    proxy = Proxy(Router(), [f"http://127.0.0.1:{refused_port()}"], base_models=["base"])  # built, never started
    with pytest.raises(InvalidTypeError, match="body must be a request body decoded from JSON"):
        proxy.namespace(body)  # type: ignore[arg-type]
    assert proxy.namespace({"model": "base"}) is None and proxy.namespace({"model": "lora"}) == "lora"


def test_an_idle_client_connection_is_closed_after_the_keepalive(
    good: OpenAIEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """aiohttp kept an idle client's connection an hour (its default), so idle clients could hold every descriptor
    the proxy had; it is closed after the proxy's keep-alive (75 s, as nginx; shortened here)."""
    from prefixroute.adapters.proxy import app

    monkeypatch.setattr(app, "_CLIENT_KEEPALIVE_S", 0.3)
    with Proxy(Router(), [good.url], base_models=[]) as proxy:
        host, port = proxy.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as client:
            client.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            client.settimeout(DEADLINE_S)
            answer = b""
            while b"\r\n\r\n" not in answer:
                answer += client.recv(65536)
            assert answer.startswith(b"HTTP/1.1 200")
            while client.recv(65536):  # the rest of the answer, then the close: b"" (a timeout fails the test)
                pass


def _descriptors_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_proxy_out_of_descriptors_answers_503_and_does_not_blame_the_engine(good: OpenAIEngine) -> None:
    """Out of file descriptors, the proxy cannot open a connection to any engine: it answered 502 "backend ... is
    unreachable: [Too many open files]", counted the engine's failure and took a healthy engine out of rotation. It
    is the proxy's own fault: 503, counted as an internal error, the engine left in rotation."""
    port = free_port()
    limit = 64

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))  # the hard limit too: the command cannot raise it

    command = [sys.executable, "-m", "prefixroute", "proxy", "--backends", good.url, "--port", str(port)]
    clients: list[socket.socket] = []
    # --base-model: no /v1/models learned at start, so no connection to the engine is pooled for the request
    command += ["--max-failures", "1", "--base-model", "m"]
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=low_limit
    ) as process:
        try:
            assert process.stdout is not None and process.stdout.readline().startswith("prefixroute proxy at ")
            first = socket.create_connection(("127.0.0.1", port))
            clients.append(first)
            # Idle clients until the proxy holds every descriptor it may (those past it wait in the backlog).
            while _descriptors_of(process.pid) < limit:
                clients.append(socket.create_connection(("127.0.0.1", port)))
                if len(clients) > 4 * limit:
                    pytest.fail("the proxy never ran out of descriptors")
            body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 2}).encode()
            first.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            first.settimeout(DEADLINE_S)
            answer = first.recv(65536)
            assert answer.startswith(b"HTTP/1.1 503 "), answer
            assert b"out of file descriptors" in answer, answer
            for client in clients[1:]:
                client.close()
            wait_until(lambda: _descriptors_of(process.pid) < limit - 8, what="the idle clients' descriptors freed")
            metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
            assert f'prefixroute_proxy_backend_up{{backend="{good.url}"}} 1' in metrics, metrics
            assert 'outcome="internal_error"} 1' in metrics, metrics
            reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
            assert reply.status_code == 200, reply.text
        finally:
            for client in clients:
                client.close()
            process.kill()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_command_raises_its_soft_limit_of_open_files_as_vllm_does() -> None:
    """A soft limit of 1,024 (systemd's) stopped the proxy at about 500 streams; the command raises it to its hard
    limit (at most 65,536), as vLLM's server does at start. The sidecar's command does the same."""

    def limits(soft: int, hard: int) -> Callable[[], None]:
        return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    hard = min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 4096)
    for name, options in [
        ("proxy", ["--backends", "http://127.0.0.1:9"]),
        ("serve", ["--backends", "http://127.0.0.1:9"]),
    ]:
        port = free_port()
        command = [sys.executable, "-m", "prefixroute", name, *options, "--port", str(port)]
        with subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, preexec_fn=limits(256, hard)
        ) as process:
            try:
                assert process.stdout is not None and process.stdout.readline(), name
                with open(f"/proc/{process.pid}/limits") as file:
                    line = next(row for row in file if row.startswith("Max open files"))
                assert line.split()[3:5] == [str(hard), str(hard)], (name, line)
            finally:
                process.kill()


def test_a_body_that_stops_coming_is_a_408(refused_port: Callable[[], int], monkeypatch: pytest.MonkeyPatch) -> None:
    """A body that stopped coming held its request, and what it had sent (up to 64 MiB), for ever; nginx answers 408
    after client_body_timeout. The proxy does after 60 s without a byte (shortened here); a slow body that keeps
    coming is read whole."""
    from prefixroute.adapters.proxy import app

    monkeypatch.setattr(app, "_BODY_STALL_S", 1.0)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    with Proxy(Router(), [f"http://127.0.0.1:{refused_port()}"], base_models=[]) as proxy:
        answer = error_answer(proxy, head + b'{"prompt": ')
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["type"] == "RequestTimeoutError"
        assert proxy.stats().bad_request == 1 and idle(proxy)
        body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 1}).encode().ljust(100)
        host, port = proxy.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=DEADLINE_S) as client:
            for piece in (head, body[:30], body[30:60], body[60:]):
                client.sendall(piece)
                time.sleep(0.1)  # well under the stall timeout between pieces
            answer = client.recv(65536)
        assert answer.startswith(b"HTTP/1.1 502 "), answer  # read whole and routed (to a backend that is not there)
