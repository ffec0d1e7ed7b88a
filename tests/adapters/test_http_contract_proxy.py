"""Issue 11's contract driven as an independent client written from its text would drive it: ``prefixroute proxy``
on loopback before fake vLLM engines, plain HTTP, hostile bodies, methods and connections; after each scenario the
invariants the contract promises are checked over HTTP alone: an OpenAI-style error (``{"error": {"message",
"type", "param", "code"}}``) with the right status, nothing routed for a bad request, no request left in flight in
``/metrics``, and the proxy still serves a good request. (test_proxy.py, test_proxy_hostile.py and
test_proxy_openai_client.py check the common refusals' messages, relaying and retries: not repeated here.)"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from aiohttp import ClientConnectionResetError, web

from prefixroute import Router
from prefixroute.adapters.proxy import Proxy
from prefixroute.adapters.serve.text import PromptEncoder
from prefixroute.testing.openai_engine import OpenAIEngine

from ..conftest import running_engines, wait_until
from .conftest import CORPUS, metric_samples


class Client:
    """What a client written from the contract holds: the proxy's base URL."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.port = int(url.rsplit(":", 1)[1])
        self.http = httpx.Client(base_url=url, timeout=20)

    def samples(self) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
        return metric_samples(self.http.get("/metrics"))

    def in_flight(self) -> float:
        return sum(self.samples()["prefixroute_router_in_flight"].values())

    def decisions(self) -> float:
        return sum(self.samples()["prefixroute_router_decisions_total"].values())

    def outcomes(self) -> dict[str, float]:
        return {dict(k)["outcome"]: v for k, v in self.samples()["prefixroute_proxy_requests_total"].items()}

    def still_serves(self) -> None:
        """A good request is answered, and nothing stays in flight after it."""
        reply = self.http.post("/v1/completions", json={"prompt": [5, 6, 7, 8], "max_tokens": 2})
        assert reply.status_code == 200, reply.text
        assert self.in_flight() == 0


@pytest.fixture(scope="module")
def engines() -> Iterator[list[OpenAIEngine]]:
    yield from running_engines(2, token_delay_s=0.002, max_tokens=8)


@pytest.fixture(scope="module")
def client(engines: list[OpenAIEngine], model_dir: Path) -> Iterator[Client]:
    """The proxy with the model's tokenizer and chat template, as ``prefixroute proxy --tokenizer`` runs it."""
    proxy = Proxy(Router(), [engine.url for engine in engines], encoder=PromptEncoder(model_dir))
    with proxy:
        client = Client(proxy.url)
        with client.http:
            yield client


def assert_openai_error(reply: httpx.Response, status: int) -> None:
    """An OpenAI-style error answer with ``status``: the four fields, a message that is no traceback."""
    assert reply.status_code == status, (reply.status_code, reply.text)
    assert reply.headers["content-type"].startswith("application/json")
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"] and "Traceback" not in error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert error["code"] == status


COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
HOSTILE: list[tuple[str, bytes]] = [
    # bodies that are not a JSON object
    (COMPLETIONS, b""), (COMPLETIONS, b"null"), (COMPLETIONS, b"3.5"), (COMPLETIONS, b'"a prompt"'), (CHAT, b"[]"),
    (CHAT, b"true"), (COMPLETIONS, b"\xff\xfe{}"), (COMPLETIONS, b'{"prompt": "a"} trailing'),
    # JSON that Python's json does not read either (vLLM's server decodes with it), out-of-range numbers, lone
    # surrogates, nesting
    (COMPLETIONS, b'{"prompt": "a", "temperature": nan}'), (COMPLETIONS, b'{"prompt": "a", "top_p": -inf}'),
    (COMPLETIONS, b'{"prompt": [1' + b"0" * 400 + b"]}"), (COMPLETIONS, b'{"prompt": [18446744073709551616]}'),
    (CHAT, b'{"messages": [{"role": "user", "content": "\\ud83d"}]}'),
    (CHAT, b'{"messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"),
    # prompts that are no prompt
    (COMPLETIONS, b"{}"), (COMPLETIONS, b'{"prompt": null}'), (COMPLETIONS, b'{"prompt": []}'),
    (COMPLETIONS, b'{"prompt": [[]]}'), (COMPLETIONS, b'{"prompt": {"text": "a"}}'), (COMPLETIONS, b'{"prompt": 7}'),
    (COMPLETIONS, b'{"prompt": [1.5, 2]}'), (COMPLETIONS, b'{"prompt": [null]}'), (COMPLETIONS, b'{"prompt": [-3]}'),
    (COMPLETIONS, b'{"prompt": [4294967296]}'), (COMPLETIONS, b'{"prompt": [1, "2x"]}'),
    (COMPLETIONS, b'{"prompt": [5, 6, 100000]}'), (COMPLETIONS, b'{"prompt": [[5, 6], [7, 100000]]}'),  # past the vocab
    (COMPLETIONS, b'{"prompt": [[1, null]]}'), (COMPLETIONS, b'{"prompt": [{"a": 1}]}'),
    # chat messages that are no conversation
    (CHAT, b"{}"), (CHAT, b'{"messages": []}'), (CHAT, b'{"messages": "hi"}'), (CHAT, b'{"messages": {"a": 1}}'),
    (CHAT, b'{"messages": [1]}'), (CHAT, b'{"messages": [null]}'), (CHAT, b'{"messages": [["user", "hi"]]}'),
    (CHAT, b'{"messages": [{"content": "no role"}]}'), (CHAT, b'{"messages": [{"role": 3, "content": "x"}]}'),
    (CHAT, b'{"prompt": "a completion sent to chat"}'),
    # a model that is no name
    (COMPLETIONS, b'{"prompt": "a", "model": 3}'),
    (CHAT, b'{"messages": [{"role": "user", "content": "a"}], "model": {}}'),
]  # fmt: skip


@pytest.mark.parametrize(("path", "raw"), HOSTILE, ids=[f"{p}:{r[:40]!r}" for p, r in HOSTILE])
def test_a_hostile_body_is_an_openai_400_that_routes_nothing(client: Client, path: str, raw: bytes) -> None:
    decisions = client.decisions()
    reply = client.http.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert_openai_error(reply, 400)
    assert client.decisions() == decisions and client.in_flight() == 0
    client.still_serves()


# vLLM cuts the header at the first ";" and compares what is left as it is, so a blank before the ";" is refused.
NOT_JSON: list[str | None] = [
    None, "", "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
    "application/vnd.api+json", "application/jsonl", "text/json", "application/json ; charset=utf-8",
]  # fmt: skip
JSON: list[str | None] = ["application/json", "application/json; charset=utf-8", "Application/JSON",
                          "application/json;charset=UTF-8"]  # fmt: skip


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("content_type", NOT_JSON + JSON)
def test_a_body_is_json_only_under_vllms_content_type(client: Client, path: str, content_type: str | None) -> None:
    """vLLM's completion routes depend on ``validate_json_request``: a media type (lowercased, parameters cut at the
    first ``;``) other than ``application/json``, none included, is a 400 before the body is read, where the proxy
    routed any JSON body whatever it was labelled."""
    body = (
        {"prompt": [5, 6, 7], "max_tokens": 2}
        if path == COMPLETIONS
        else {"messages": [{"role": "user", "content": "a"}]}
    )
    headers = {} if content_type is None else {"Content-Type": content_type}
    decisions = client.decisions()
    reply = client.http.post(path, content=json.dumps(body).encode(), headers=headers)
    if content_type in JSON:
        assert reply.status_code == 200, reply.text
        return
    assert_openai_error(reply, 400)
    assert reply.json()["error"]["message"] == "Unsupported Media Type: Only 'application/json' is allowed"
    assert client.decisions() == decisions and client.in_flight() == 0


@pytest.mark.parametrize(
    ("method", "path", "status", "allow"),
    [("HEAD", COMPLETIONS, 405, "POST"), ("OPTIONS", CHAT, 405, "POST"), ("PUT", COMPLETIONS, 405, "POST"),
     ("DELETE", CHAT, 405, "POST"), ("POST", "/v1/models", 405, "GET"), ("POST", "/healthz", 405, "GET"),
     ("POST", "/metrics", 405, "GET"), ("POST", "/v1/embeddings", 404, None), ("GET", "/", 404, None),
     ("HEAD", "/v1/nowhere", 404, None), ("POST", "/v1/nowhere/", 404, None), ("POST", "//", 404, None)],
)  # fmt: skip
def test_wrong_methods_and_unknown_paths_are_openai_errors(
    client: Client, method: str, path: str, status: int, allow: str | None
) -> None:
    reply = client.http.request(method, path, json=None if method == "HEAD" else {"prompt": "a"})
    assert reply.status_code == status
    if method != "HEAD":
        assert_openai_error(reply, status)
    if allow is not None:
        assert allow in reply.headers["allow"]
    client.still_serves()


@pytest.mark.parametrize(
    ("method", "target", "host", "location"),
    [("POST", "/v1/completions/", None, "/v1/completions"),
     ("POST", "/v1/chat/completions//?a=b&c=%20d", None, "/v1/chat/completions?a=b&c=%20d"),
     ("GET", "/v1/completions/", None, "/v1/completions"),  # a method the route does not take: redirected too
     ("GET", "/v1/models/", "gateway.example:9", "http://gateway.example:9/v1/models"),
     ("HEAD", "/health/", "bad host", "/health"),  # an invalid Host: the address the proxy listens at
     ("POST", "/v1/completions/", "gateway.example:65536", "/v1/completions"),
     ("POST", "/v1/completions/", "[1:2:3]:80", "/v1/completions"),
     ("POST", "/v1/completions%2F", "[::1]:8000", "http://[::1]:8000/v1/completions")],
)  # fmt: skip
def test_a_trailing_slash_is_redirected_as_vllm_redirects_it(
    client: Client, method: str, target: str, host: str | None, location: str
) -> None:
    """vLLM's FastAPI app (Starlette's ``redirect_slashes``) answers a path that one of its routes serves without
    its trailing slashes with a 307 to that path, any method, the query string kept, at the request's Host (else
    the address it listens at); the proxy answered 404."""
    headers = {} if host is None else {"Host": host}
    decisions = client.decisions()
    reply = client.http.request(method, target, json=None if method == "HEAD" else {"prompt": "a"}, headers=headers)
    assert reply.status_code == 307, reply.text
    assert reply.headers["location"] == (client.url + location if location.startswith("/") else location)
    assert reply.content == b"" and client.decisions() == decisions
    followed = client.http.post("/v1/completions/?x=1", json={"prompt": [5, 6, 7], "max_tokens": 2},
                                follow_redirects=True)  # fmt: skip
    assert followed.status_code == 200 and [r.status_code for r in followed.history] == [307]
    assert followed.url == client.url + "/v1/completions?x=1" and client.decisions() == decisions + 1
    client.still_serves()


def test_a_browser_s_cors_preflight_and_requests_are_allowed_as_vllm_allows_them(client: Client) -> None:
    # vLLM's server allows any origin by default; the proxy answered a preflight 405, so a browser client that
    # called vLLM directly failed behind it.
    asked = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type"}  # fmt: skip
    preflight = client.http.options(CHAT, headers=asked)
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "*"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert preflight.headers["access-control-allow-headers"] == "authorization,content-type"
    origin = {"Origin": "http://ui.example"}
    streamed = client.http.post(COMPLETIONS, json={"prompt": [1, 2, 3], "stream": True}, headers=origin)
    models = client.http.get("/v1/models", headers=origin)
    refused = client.http.post(COMPLETIONS, json={"prompt": []}, headers=origin)
    for reply in (streamed, models, refused):
        assert reply.headers["access-control-allow-origin"] == "*", reply.request.url
    assert streamed.text.endswith("data: [DONE]\n\n") and refused.status_code == 400
    plain = client.http.post(COMPLETIONS, json={"prompt": [1, 2, 3]})  # no Origin: no CORS header
    assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers
    assert client.in_flight() == 0


def test_clients_that_leave_at_any_moment_under_concurrency_leave_nothing_in_flight(
    client: Client, engines: list[OpenAIEngine]
) -> None:
    """Concurrent clients over raw sockets, streamed and not, completions and chat: some read their whole answer,
    some leave mid-body, some as soon as the request is sent, some after the first streamed bytes. Every served one
    is whole, and once all are gone nothing is counted in flight and every request has one outcome."""
    rng = random.Random(11)
    before = client.outcomes()
    served: list[bytes] = []
    errors: list[BaseException] = []

    def request(kind: str, i: int) -> None:
        stream = i % 2 == 0
        text = CORPUS[i % 2] + f" turn {i}"
        path, body = (
            (CHAT, {"messages": [{"role": "user", "content": text}]}) if i % 3 == 0 else (COMPLETIONS, {"prompt": text})
        )
        data = json.dumps({**body, "stream": stream, "max_tokens": 8}).encode()
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}"
        request_bytes = head.encode() + b"\r\n\r\n" + data
        try:
            with socket.create_connection(("127.0.0.1", client.port), timeout=20) as raw:
                if kind == "mid-body":
                    raw.sendall(request_bytes[: len(request_bytes) - 1 - rng.randrange(len(data) // 2)])
                    time.sleep(0.05)
                    return
                raw.sendall(request_bytes)
                if kind == "sent":
                    time.sleep(rng.random() * 0.01)
                    return
                answer = raw.recv(65536)
                if kind == "first-bytes":
                    return
                while not (answer.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n") if stream else answer.endswith(b"}")):
                    chunk = raw.recv(65536)
                    if not chunk:
                        break
                    answer += chunk
                served.append(answer)
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    kinds = ["whole", "mid-body", "sent", "first-bytes"] * 10
    threads = [threading.Thread(target=request, args=(kind, i)) for i, kind in enumerate(kinds)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(served) == 10 and all(answer.startswith(b"HTTP/1.1 200 ") for answer in served)
    wait_until(lambda: client.in_flight() == 0, what="every request released")
    wait_until(lambda: sum(engine.stats().running for engine in engines) == 0, what="the engines stopped")
    after = client.outcomes()
    counted = {outcome: after[outcome] - before.get(outcome, 0) for outcome in after}
    assert counted["ok"] >= 10 and counted["bad_request"] == counted["internal_error"] == 0
    assert counted["backend_error"] == counted["unreachable"] == 0
    assert sum(counted.values()) <= len(kinds)  # a client gone before its handler ran is not a request
    client.still_serves()


@pytest.mark.parametrize("leaves_at", ["prepare", "write_eof"])
def test_a_client_gone_as_its_stream_starts_or_ends_is_counted_not_logged_as_an_error(
    client: Client, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, leaves_at: str
) -> None:
    """A client that leaves closes the proxy's side of its connection at once, but aiohttp cancels the handler one
    loop turn later: a stream whose answer starts (or ends) in between wrote to a closing transport, and the
    ConnectionResetError escaped the handler, logged by aiohttp as an error with a traceback (seen under the
    concurrent test above). Logged as nothing; counted as a client gone when it left as the stream started, and as
    served when it left at the end, its whole answer written (as OpenAI's client leaves at ``[DONE]``)."""
    original = getattr(web.StreamResponse, leaves_at)

    async def client_gone(self: web.StreamResponse, *args: object) -> object:
        if "X-Prefixroute-Backend" in self.headers:  # the proxy's answer, not the fake engine's
            raise ClientConnectionResetError("Cannot write to closing transport")
        return await original(self, *args)

    monkeypatch.setattr(web.StreamResponse, leaves_at, client_gone)
    before = client.outcomes()
    with caplog.at_level(logging.INFO), contextlib.suppress(httpx.HTTPError):  # what the client sees is moot
        client.http.post(COMPLETIONS, json={"prompt": "a b c", "stream": True, "max_tokens": 2})
    outcome = "client_disconnect" if leaves_at == "prepare" else "ok"
    wait_until(lambda: client.outcomes()[outcome] == before[outcome] + 1)
    monkeypatch.undo()
    assert not [record for record in caplog.records if record.levelno >= logging.ERROR], caplog.text
    assert client.in_flight() == 0
    client.still_serves()
