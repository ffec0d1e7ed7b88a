"""``prefixroute proxy`` and ``prefixroute serve`` against hostile clients and backends found by a black-box audit of
their HTTP contracts (each test failed before its fix)."""

from __future__ import annotations

import gzip
import socketserver
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import pytest
from aiohttp import web

from prefixroute import Router
from prefixroute.adapters.proxy import Proxy

from ..conftest import wait_until
from .conftest import backend_serving

JSON_BODY = {"Content-Type": "application/json"}


def test_headers_the_connection_header_names_are_of_one_connection_and_not_relayed_either_way() -> None:
    seen: list[web.Request] = []

    async def naming(request: web.Request) -> web.StreamResponse:
        seen.append(request)
        headers = {"Connection": "keep-alive, X-Hop", "X-Hop": "the engine's", "X-Kept": "1",
                   "Proxy-Authenticate": "Basic"}  # fmt: skip
        return web.json_response({"choices": [{"text": "hi"}]}, headers=headers)

    with backend_serving(naming) as url, Proxy(Router(), [url], base_models=[]) as proxy:
        headers = {**JSON_BODY, "Connection": "keep-alive, X-Internal,x-other", "X-Internal": "the client's",
                   "X-Other": "2", "X-Request-Id": "r1", "Proxy-Authorization": "Basic c2VjcmV0"}  # fmt: skip
        reply = httpx.post(proxy.url + "/v1/completions", json={"prompt": "x"}, headers=headers)
        assert reply.status_code == 200 and reply.json() == {"choices": [{"text": "hi"}]}
        # RFC 9110 7.6.1: a proxy removes the fields its Connection header names, both ways; the others go on.
        assert "x-hop" not in reply.headers and reply.headers["x-kept"] == "1"
        assert "X-Internal" not in seen[0].headers and "X-Other" not in seen[0].headers
        # the fixed hop-by-hop fields stay dropped beside those the Connection header names
        assert "Proxy-Authenticate" not in reply.headers and "Proxy-Authorization" not in seen[0].headers
        assert seen[0].headers["X-Request-Id"] == "r1"
        wait_until(lambda: proxy.router.stats().in_flight == 0, what="no request in flight")


def test_every_connection_header_of_a_message_names_fields_not_relayed() -> None:
    seen: list[web.Request] = []

    async def ok(request: web.Request) -> web.StreamResponse:
        seen.append(request)
        return web.json_response({"choices": [{"text": "hi"}]})

    with backend_serving(ok) as url, Proxy(Router(), [url], base_models=[]) as proxy:
        headers = [("Content-Type", "application/json"), ("Connection", "keep-alive"), ("Connection", "X-Second"),
                   ("X-Second", "the client's")]  # fmt: skip
        reply = httpx.post(proxy.url + "/v1/completions", content=b'{"prompt": "x"}', headers=headers)
        assert reply.status_code == 200 and "X-Second" not in seen[0].headers
        wait_until(lambda: proxy.router.stats().in_flight == 0, what="no request in flight")


def test_a_compressed_request_body_goes_on_decoded_without_its_content_encoding() -> None:
    seen: list[tuple[str | None, bytes]] = []

    async def ok(request: web.Request) -> web.StreamResponse:
        seen.append((request.headers.get("Content-Encoding"), await request.read()))
        return web.json_response({"choices": [{"text": "hi"}]})

    with backend_serving(ok) as url, Proxy(Router(), [url], base_models=[]) as proxy:
        body = gzip.compress(b'{"prompt": "x"}')
        headers = {**JSON_BODY, "Content-Encoding": "gzip"}
        reply = httpx.post(proxy.url + "/v1/completions", content=body, headers=headers)
        assert reply.status_code == 200, reply.text
        assert seen == [(None, b'{"prompt": "x"}')]
        wait_until(lambda: proxy.router.stats().in_flight == 0, what="no request in flight")


def test_a_599_is_relayed_as_the_backends_5xx() -> None:
    raw = b"HTTP/1.1 599 Custom\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
    with answering(raw) as url, Proxy(Router(), [url], base_models=[], max_failures=1) as proxy:
        reply = httpx.post(proxy.url + "/v1/completions", json={"prompt": "x"}, timeout=10)
        assert reply.status_code == 599 and reply.json() == {}
        wait_until(lambda: proxy.router.stats().in_flight == 0, what="no request in flight")
        assert proxy.stats().backend_error == 1


@contextmanager
def answering(raw: bytes) -> Iterator[str]:
    """A backend that reads a request and answers the bytes ``raw``, then closes; yields its URL."""

    class Answer(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            self.request.recv(65536)
            self.request.sendall(raw)

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Answer)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    "status_line",
    [b"101 Switching Protocols", b"600 Beyond", b"999 Library Error"],
)
@pytest.mark.parametrize("stream", [False, True])
def test_a_status_that_is_no_final_http_answer_is_a_502_and_a_failure_not_relayed(
    status_line: bytes, stream: bool
) -> None:
    """A 101 relayed without an upgrade left the client waiting for ever; a code past 599 is invalid HTTP, which RFC
    9110 15 has a client treat as a 5xx."""
    raw = b"HTTP/1.1 " + status_line + b"\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
    with answering(raw) as url, Proxy(Router(), [url], base_models=[], max_failures=1) as proxy:
        reply = httpx.post(proxy.url + "/v1/completions", json={"prompt": "x", "stream": stream}, timeout=10)
        assert reply.status_code == 502, reply.text
        error = reply.json()["error"]
        assert error["type"] == "BadGatewayError" and status_line.split()[0].decode() in error["message"]
        wait_until(lambda: proxy.router.stats().in_flight == 0, what="no request in flight")
        stats = proxy.stats()
        assert (stats.ok, stats.backend_error, stats.unhealthy) == (0, 1, (url,))


def test_a_completion_of_prompt_embeds_alone_is_routed_and_relayed() -> None:
    """vLLM run with --enable-prompt-embeds serves ``prompt_embeds`` without a ``prompt``; the proxy refused it 400
    with vLLM's message for a body with neither."""
    seen: list[bytes] = []

    async def ok(request: web.Request) -> web.StreamResponse:
        seen.append(await request.read())
        return web.json_response({"choices": [{"text": "hi"}]})

    with backend_serving(ok) as url, Proxy(Router(), [url], base_models=[]) as proxy:
        body = b'{"model": "m", "prompt_embeds": "UEsDBAAAAAAAAA==", "max_tokens": 2}'
        reply = httpx.post(proxy.url + "/v1/completions", content=body, headers=JSON_BODY)
        assert reply.status_code == 200, reply.text
        assert reply.headers["X-Prefixroute-Matched-Tokens"] == "0"
        assert seen == [body]
        wait_until(lambda: proxy.router.stats().in_flight == 0, what="no request in flight")
        assert (proxy.stats().ok, proxy.stats().bad_request) == (1, 0)


@pytest.mark.parametrize("ids", ["[1.0, 2.0, 3.0]", '[1, true, "3"]', "[[1.0, 2.0], [3]]"])
def test_token_ids_that_vllm_reads_as_ints_are_routed_on_them_and_sent_on_as_sent(ids: str) -> None:
    """vLLM's request model (pydantic, lax) serves a prompt of 2.0, true or "3" as token ids 2, 1 and 3 (a client
    whose ids come from a float array sends 2.0); the proxy answered such a prompt 400."""
    seen: list[bytes] = []

    async def ok(request: web.Request) -> web.StreamResponse:
        seen.append(await request.read())
        return web.json_response({"choices": [{"text": "hi"}]})

    with backend_serving(ok) as url, Proxy(Router(block_size=2), [url], base_models=[]) as proxy:
        body = b'{"prompt": %s, "max_tokens": 2}' % ids.encode()
        for _ in range(2):
            reply = httpx.post(proxy.url + "/v1/completions", content=body, headers=JSON_BODY)
            assert reply.status_code == 200, reply.text
        assert reply.headers["X-Prefixroute-Matched-Tokens"] == "2"  # the second matched the first's whole block
        assert seen == [body, body]
        wait_until(lambda: proxy.router.stats().in_flight == 0, what="no request in flight")
        assert (proxy.stats().ok, proxy.stats().bad_request) == (2, 0)


def test_a_request_with_a_cache_salt_shares_prefixes_only_with_requests_of_that_salt() -> None:
    """vLLM puts a request's ``cache_salt`` in its first block's hash: salted blocks are hit only by requests of the
    same salt (a tenant's), never by unsalted ones or another salt's. The proxy routed them all in one namespace, so
    it predicted hits (and sent requests after them) that the engine's cache does not have."""

    async def ok(request: web.Request) -> web.StreamResponse:
        return web.json_response({"choices": [{"text": "hi"}]})

    def matched(proxy: Proxy, **salt: str) -> int:
        body = {"model": "m", "prompt": [1, 2, 3, 4, 5, 6], "max_tokens": 1, **salt}
        reply = httpx.post(proxy.url + "/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        wait_until(lambda: proxy.router.stats().in_flight == 0, what="no request in flight")
        return int(reply.headers["X-Prefixroute-Matched-Tokens"])

    with backend_serving(ok) as url, Proxy(Router(block_size=2), [url], base_models=["m"]) as proxy:
        assert matched(proxy) == 0
        assert matched(proxy, cache_salt="tenant-a") == 0  # unsalted blocks are no hit for a salted request
        assert matched(proxy, cache_salt="tenant-a") > 0  # the same salt's are
        assert matched(proxy, cache_salt="tenant-b") == 0
        assert matched(proxy) > 0  # and the unsalted ones are still there for unsalted requests
        assert matched(proxy, cache_salt="") > 0  # an empty salt is no salt (vLLM refuses it: the engine answers)


def test_an_empty_model_routes_in_the_base_models_namespace_as_vllm_serves_it() -> None:
    """vLLM serves a request whose ``model`` is "" with its base model (``_is_model_supported``: no name); the proxy
    routed it in a namespace "" of its own, where no KV event or base-model request ever lands."""
    proxy = Proxy(Router(), ["http://127.0.0.1:8000"], base_models=["llama"])
    assert proxy.namespace({"model": ""}) is None and proxy.namespace({"model": "", "cache_salt": "t"}) == (
        proxy.namespace({"model": "llama", "cache_salt": "t"})
    )


def test_a_connection_idle_for_nearly_vllms_keep_alive_is_not_sent_another_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's server (uvicorn) closes a connection idle for 5 s. The proxy kept its connections to an engine 30 s, so
    a request that came ~5 s after the last was sometimes written just as the engine closed the connection: a 502 for
    the client and a failure of the engine (measured: 4 of 40 such requests through a uvicorn backend). Time in
    aiohttp's pool is moved on here instead of waited."""
    peers: list[object] = []
    idle = [0.0]
    monkeypatch.setattr("aiohttp.connector.monotonic", lambda: time.monotonic() + idle[0])

    async def ok(request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        peers.append(request.transport.get_extra_info("peername"))
        return web.json_response({"choices": [{"text": "hi"}]})

    with backend_serving(ok) as url, Proxy(Router(), [url], base_models=[]) as proxy:
        for _ in range(2):
            assert httpx.post(proxy.url + "/v1/completions", json={"prompt": "x"}).status_code == 200
        assert peers[0] == peers[1]  # a connection just used is used again
        idle[0] = 4.5  # the engine closes it at 5 s: not used again this late
        assert httpx.post(proxy.url + "/v1/completions", json={"prompt": "x"}).status_code == 200
        assert peers[2] != peers[1]
        wait_until(lambda: proxy.router.stats().in_flight == 0, what="no request in flight")


@pytest.mark.parametrize(
    "body",
    [b'{"prompt": "x", "logit_bias": {"50256": -Infinity}, "max_tokens": 1}',
     b'{"prompt": "x", "temperature": NaN, "top_p": Infinity}', '{"prompt": "x"}'.encode("utf-16"),
     '{"prompt": "x"}'.encode("utf-32")],
    ids=["-Infinity", "NaN", "utf-16", "utf-32"],
)  # fmt: skip
def test_a_body_that_vllm_decodes_with_python_s_json_is_routed_and_sent_on_as_sent(body: bytes) -> None:
    """vLLM's server decodes a body with Python's json.loads (FastAPI's request.json()), which reads NaN and
    Infinity (Python's json.dumps and aiohttp's json= write them for a logit_bias of -inf) and UTF-16 or UTF-32; the
    proxy's msgspec reads neither, and it answered such a body 400 'not valid JSON'."""
    seen: list[bytes] = []

    async def ok(request: web.Request) -> web.StreamResponse:
        seen.append(await request.read())
        return web.json_response({"choices": [{"text": "hi"}]})

    with backend_serving(ok) as url, Proxy(Router(block_size=1), [url], base_models=[]) as proxy:
        for _ in range(2):
            reply = httpx.post(proxy.url + "/v1/completions", content=body, headers=JSON_BODY)
            assert reply.status_code == 200, reply.text
        assert reply.headers["X-Prefixroute-Matched-Tokens"] == "1"  # routed on its prompt, "x"
        assert seen == [body, body]
        wait_until(lambda: proxy.router.stats().in_flight == 0, what="no request in flight")


@pytest.mark.parametrize(
    "body", [b'{"prompt": "a\\ud800"}', b'{"prompt": NaN', b'{"prompt": nan}', "{'prompt': 'x'}".encode("utf-16")]
)
def test_a_body_python_s_json_refuses_too_or_with_a_lone_surrogate_is_still_refused(
    body: bytes, refused_port: Callable[[], int]
) -> None:
    with Proxy(Router(), [f"http://127.0.0.1:{refused_port()}"], base_models=[]) as proxy:
        reply = httpx.post(proxy.url + "/v1/completions", content=body, headers=JSON_BODY)
        assert reply.status_code == 400 and reply.json()["error"]["type"] == "BadRequestError", reply.text
        assert proxy.router.stats().decisions == 0
