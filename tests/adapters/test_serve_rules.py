"""The decision sidecar's documented rules (``prefixroute/adapters/serve/app.py``'s and ``ext_proc.py``'s docstrings
and the ``prefixroute serve`` section of docs/adapters.md), each pinned in process: the ASGI messages it sends
(lowercase header names, as the ASGI spec requires, and the exact headers of each answer), how it reads a body,
lifespan, the constructor's refusals, the Python API (route, pick), the helpers the proxies rely on (upstream_of),
and the ext_proc endpoint picker's answers and gRPC server."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Sequence
from typing import Any

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import json_format
from google.protobuf.message import DecodeError

from prefixroute import Decision, Router
from prefixroute.adapters.proxy.prompts import ByteEncoder
from prefixroute.adapters.serve import CLIENT_LEFT, BadRequest, Sidecar, upstream_of
from prefixroute.adapters.serve.ext_proc import DESTINATION_HEADER, EndpointPicker, _milliseconds, start_ext_proc
from prefixroute.errors import ConfigurationError, InvalidTypeError

from ..conftest import BuggyPolicy, TickingClock
from .conftest import metric_samples
from .test_ext_proc import PROMPT, destination, headers, request_trailers, response_body, response_headers, run
from .test_ext_proc import body as body_message
from .test_serve import BACKENDS, call, ids

JSON = (b"content-type", b"application/json")


def asgi(
    sidecar: Sidecar,
    method: str,
    path: str,
    chunks: Sequence[dict[str, Any]] = (),
    headers: Sequence[tuple[bytes, bytes]] = (),
    *,
    leaves: bool = False,
) -> list[dict[str, Any]]:
    """What ``sidecar`` sends for one raw ASGI request with ``headers`` whose ``receive()`` gives ``chunks``, then
    waits for the answer, or (``leaves``) a disconnect: a client that leaves as soon as its body is sent, which the
    scope's ``CLIENT_LEFT`` extension, as ``prefixroute serve`` gives it, reports."""
    sent: list[dict[str, Any]] = []
    waiting = list(chunks)

    async def receive() -> dict[str, Any]:
        if waiting:
            return waiting.pop(0)
        if not leaves:
            await asyncio.Event().wait()  # until the sidecar stops listening (it answers, then cancels)
        return {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        sent.append(dict(message))

    scope: dict[str, Any] = {"type": "http", "method": method, "path": path, "headers": list(headers)}
    scope["extensions"] = {CLIENT_LEFT: lambda: leaves and not waiting}
    asyncio.run(asyncio.wait_for(sidecar(scope, receive, send), 10))
    return sent


def body(raw: bytes, *, more: bool = False) -> dict[str, Any]:
    return {"type": "http.request", "body": raw, "more_body": more}


def answer(sent: list[dict[str, Any]]) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """The status, headers and body of the one answer in ``sent``."""
    assert [message["type"] for message in sent] == ["http.response.start", "http.response.body"], sent
    return sent[0]["status"], list(sent[0]["headers"]), sent[1]["body"]


def length(raw: bytes) -> tuple[bytes, bytes]:
    return (b"content-length", str(len(raw)).encode())


# -- the ASGI answers --------------------------------------------------------------------------------------------------


def test_a_pick_answer_sends_the_decision_in_exactly_the_documented_lowercase_headers() -> None:
    """The pick mode's answer: the JSON decision, and in headers (names lowercase, as ASGI requires) the nginx
    redirect to the default @prefixroute_upstream location, the backend, its host:port, the id, the reason and the
    matched tokens."""
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS)
    for expected_reason, matched in (("miss", 0), ("prefix", 8)):
        raw = json.dumps({"model": "m", "prompt": ids(8)}).encode()
        status, headers, answered = answer(asgi(sidecar, "POST", "/v1/completions", [body(raw)]))
        decision = json.loads(answered)
        assert (status, decision["reason"], decision["matched_tokens"]) == (200, expected_reason, matched)
        backend = decision["backend"]
        assert headers == [
            JSON,
            (b"x-accel-redirect", b"@prefixroute_upstream"),
            (b"x-prefixroute-backend", backend.encode()),
            (b"x-prefixroute-upstream", upstream_of(backend).encode()),
            (b"x-prefixroute-id", decision["id"].encode()),
            (b"x-prefixroute-reason", expected_reason.encode()),
            (b"x-prefixroute-matched-tokens", str(matched).encode()),
            length(answered),
        ]
        sidecar.first_token(decision["id"])  # prefilled: the next request follows its cached prefix


def test_lifecycle_and_get_answers_are_exactly_the_documented_bodies_and_headers() -> None:
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS)
    for path in ("/first_token", "/finish"):
        status, headers, answered = answer(asgi(sidecar, "POST", path, [body(b'{"id": "abc"}')]))
        assert (status, json.loads(answered), headers) == (200, {"id": "abc"}, [JSON, length(answered)]), path
    status, headers, answered = answer(asgi(sidecar, "GET", "/healthz"))
    assert (status, json.loads(answered), headers) == (
        200,
        {"status": "ok", "backends": BACKENDS},
        [JSON, length(answered)],
    )
    status, headers, answered = answer(asgi(sidecar, "GET", "/stats"))
    assert (status, headers) == (200, [JSON, length(answered)])
    assert set(json.loads(answered)) == {"decisions", "in_flight", "in_flight_total", "leases_expired",
                                         "unknown_finishes", "releases", "release_datagrams_unread",
                                         "bad_requests"}  # fmt: skip
    status, headers, answered = answer(asgi(sidecar, "GET", "/metrics"))
    assert status == 200 and answered.startswith(b"# HELP ")
    assert headers == [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8"), length(answered)]


def test_head_is_served_on_every_get_path() -> None:
    """A 405 names ``GET, HEAD`` for the GET paths: HEAD is served there (health checks may use it)."""
    sidecar = Sidecar(Router(), backends=BACKENDS)
    for path in ("/metrics", "/healthz", "/stats"):
        assert answer(asgi(sidecar, "HEAD", path))[0] == 200, path
    assert sidecar.stats()["bad_requests"] == {}


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [("GET", "/route", b"POST"), ("PUT", "/v1/completions", b"POST"), ("POST", "/healthz", b"GET, HEAD"),
     ("DELETE", "/stats", b"GET, HEAD")],
)  # fmt: skip
def test_a_wrong_method_is_a_405_naming_the_methods_in_its_allow_header_and_its_message(
    method: str, path: str, allowed: bytes
) -> None:
    sidecar = Sidecar(Router(), backends=BACKENDS)
    status, headers, answered = answer(asgi(sidecar, method, path, [body(b"{}")]))
    assert (status, headers) == (405, [JSON, (b"allow", allowed), length(answered)])
    assert json.loads(answered) == {"error": f"{method} {path} is not served: use {allowed.decode()}"}
    assert sidecar.stats()["bad_requests"] == {"405": 1}


def test_an_unknown_path_is_a_404_listing_every_endpoint() -> None:
    status, headers, answered = answer(asgi(Sidecar(Router(), backends=BACKENDS), "GET", "/v1/models"))
    assert (status, headers) == (404, [JSON, length(answered)])
    assert json.loads(answered) == {
        "error": "no such endpoint '/v1/models': POST /route, /first_token, /finish, /v1/completions, "
        "/v1/chat/completions; GET /metrics, /healthz, /stats"
    }


def test_lifespan_is_acknowledged_and_other_scopes_are_left_alone() -> None:
    """``lifespan`` is acknowledged: startup, then shutdown, after which the call returns; a scope that is neither
    lifespan nor http (a websocket) gets nothing."""
    sidecar = Sidecar(Router(), backends=BACKENDS)
    sent: list[Any] = []
    messages = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    async def send(message: Any) -> None:
        sent.append(message)

    asyncio.run(asyncio.wait_for(sidecar({"type": "lifespan"}, receive, send), 10))
    assert sent == [{"type": "lifespan.startup.complete"}, {"type": "lifespan.shutdown.complete"}]
    sent.clear()
    asyncio.run(asyncio.wait_for(sidecar({"type": "websocket", "path": "/route"}, receive, send), 10))
    assert sent == []


def test_a_fault_of_the_sidecar_itself_is_a_500_in_json_logged_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    def broken(backends: Sequence[str]) -> list[str]:
        raise RuntimeError("health table gone")

    sidecar = Sidecar(Router(), backends=BACKENDS, healthy=broken)
    raw = json.dumps({"prompt": ids(4)}).encode()
    with caplog.at_level(logging.ERROR, logger="prefixroute.serve"):
        status, headers, answered = answer(asgi(sidecar, "POST", "/v1/completions", [body(raw)]))
    assert (status, headers) == (500, [JSON, length(answered)])
    assert json.loads(answered) == {"error": "the sidecar failed: health table gone"}
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.ERROR, "serving POST /v1/completions failed")
    ]
    assert caplog.records[0].exc_info is not None and caplog.records[0].exc_info[0] is RuntimeError
    assert sidecar.stats()["bad_requests"] == {"500": 1} and sidecar.router.stats().in_flight == 0


def test_a_failing_policy_is_logged_with_its_own_error(caplog: pytest.LogCaptureFixture) -> None:
    sidecar = Sidecar(Router(policy=BuggyPolicy()), backends=BACKENDS)
    with caplog.at_level(logging.ERROR, logger="prefixroute.serve"):
        assert call(sidecar, "POST", "/route", {"prompt_token_ids": ids(4)}).status_code == 500
    [record] = caplog.records
    assert record.levelno == logging.ERROR and record.getMessage().startswith("the routing policy failed: ")
    assert "a bug in the policy" in record.getMessage()
    assert record.exc_info is not None and str(record.exc_info[1]) == "a bug in the policy"


# -- reading the body --------------------------------------------------------------------------------------------------


def test_a_body_of_exactly_max_body_bytes_is_read_across_chunks_and_one_byte_more_is_a_413() -> None:
    """``max_body_bytes`` is the largest body read, counted over all its chunks: past it, a 413 naming the limit and
    no decision. A chunk may leave out ``body`` and ``more_body`` (ASGI's defaults: empty, and the last one)."""
    raw = json.dumps({"prompt_token_ids": ids(8)}).encode()
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS, max_body_bytes=len(raw))
    halves = [body(raw[:10], more=True), body(raw[10:], more=True), {"type": "http.request"}]
    status, _, answered = answer(asgi(sidecar, "POST", "/route", halves))
    assert status == 200 and json.loads(answered)["prompt_tokens"] == 8
    longer = raw[:-1] + b" }"  # one byte more, still valid JSON
    status, headers, answered = answer(
        asgi(sidecar, "POST", "/route", [body(longer[:10], more=True), body(longer[10:])])
    )
    assert (status, headers) == (413, [JSON, (b"connection", b"close"), length(answered)])  # the rest is not read
    assert json.loads(answered) == {"error": f"the request body is over {len(raw)} bytes"}
    assert sidecar.router.stats().decisions == 1 and sidecar.stats()["bad_requests"] == {"413": 1}


def test_a_body_declared_over_max_body_bytes_is_refused_before_a_byte_of_it_is_read() -> None:
    """A ``Content-Length`` over the limit is a 413 from the head alone: no ``receive()``, so with ``Expect:
    100-continue`` (curl's, before a large body) the server sends no ``100`` and the client no body; the connection
    closes after it, its body unread. Before, the sidecar read up to the limit (32 MiB by default) first."""
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS, max_body_bytes=100)
    read: list[str] = []
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        read.append("a chunk")
        return {"type": "http.request", "body": b"{}"}  # read: a 400 for its missing prompt

    async def send(message: Any) -> None:
        sent.append(dict(message))

    continuing = (b"expect", b"100-continue")
    for declared, expect in ((b"101", 413), (b"100", 200)):
        read.clear()
        sent.clear()
        headers = [(b"content-length", declared), continuing]
        scope = {"type": "http", "method": "POST", "path": "/route", "headers": headers}
        asyncio.run(asyncio.wait_for(sidecar(scope, receive, send), 10))
        assert sent[0]["status"] == (413 if expect == 413 else 400) and bool(read) == (expect != 413), sent
    assert sidecar.stats()["bad_requests"]["413"] == 1
    # Without Expect the client is sending its body: what it sends is read and dropped, then the 413 (a connection
    # closed with its body unread is reset, and a client still writing loses the answer).
    read.clear()
    sent.clear()
    scope = {"type": "http", "method": "POST", "path": "/route", "headers": [(b"content-length", b"101")]}
    asyncio.run(asyncio.wait_for(sidecar(scope, receive, send), 10))
    assert sent[0]["status"] == 413 and read == ["a chunk"], sent


def test_a_client_that_leaves_mid_body_gets_no_decision_and_no_answer() -> None:
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS)
    whole_json = json.dumps({"prompt_token_ids": ids(8)}).encode()  # valid JSON, but more was announced
    assert asgi(sidecar, "POST", "/route", [body(whole_json, more=True)], leaves=True) == []
    assert (sidecar.router.stats().decisions, sidecar.stats()["bad_requests"]) == (0, {})


# -- the constructor ---------------------------------------------------------------------------------------------------


class VocabularyBytes(ByteEncoder):
    """A byte encoder with a vocabulary of 256 ids and no ``max_token_id``: the sidecar takes ``vocab_size - 1``."""

    vocab_size = 256


class NoEncode:
    vocab_size = 256

    def encode_chat(self, messages: Any) -> list[int]:
        return [1]


class NoEncodeChat:
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return [1]


class NoVocabulary(ByteEncoder):
    vocab_size = "256"


CONSTRUCTION_ERRORS: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"router": "router"}, InvalidTypeError, "router must be a prefixroute.Router, not str"),
    ({"backends": BACKENDS[0]}, InvalidTypeError, "backends must be a list of backend URLs, not str"),
    ({"backends": 5}, InvalidTypeError, "backends must be a list of backend URLs, not int"),
    ({"backends": ["http://gpu0:8000/v1"]}, ConfigurationError, "backend 'http://gpu0:8000/v1' has a path"),
    ({"backends": ["http://a:1", "http://b:2", "http://B:2/"]}, ConfigurationError,
     "backends list 'http://b:2' and 'http://B:2', one engine (b:2): list each backend once"),
    ({"backends": ["http://a:1", "http://a:1"]}, ConfigurationError, "backends list 'http://a:1' twice: list each"),
    ({"models": "llama"}, ConfigurationError, "models must be a non-empty list of model names (or None to accept any)"),
    ({"models": []}, ConfigurationError, "models must be a non-empty list"),
    ({"models": 5}, ConfigurationError, "models must be a non-empty list"),
    ({"models": ["llama", ""]}, ConfigurationError, "models must name models, not ['llama', '']: a name is blank"),
    ({"models": ["llama", " "]}, ConfigurationError, "models must name models, not ['llama', ' ']: a name is blank"),
    ({"models": ["llama", 3]}, ConfigurationError, "models must be a non-empty list"),
    ({"encoder": NoEncode()}, InvalidTypeError, "encoder must be a PromptEncoder or None, not NoEncode"),
    ({"encoder": NoEncodeChat()}, InvalidTypeError, "encoder must be a PromptEncoder or None, not NoEncodeChat"),
    ({"encoder": NoVocabulary()}, InvalidTypeError, "encoder must be a PromptEncoder or None, not NoVocabulary"),
    ({"healthy": 5}, InvalidTypeError, "healthy must be a callable, not int"),
    ({"clock": 5}, InvalidTypeError, "clock must be a callable, not int"),
    ({"clock": None}, InvalidTypeError, "clock must be a callable, not NoneType"),
    ({"max_body_bytes": 0}, ConfigurationError, "max_body_bytes must be a positive int, not 0"),
    ({"max_body_bytes": 1.5}, ConfigurationError, "max_body_bytes must be a positive int, not 1.5"),
    ({"accel_redirect": "@up\nX-Injected: 1"}, ConfigurationError,
     "accel_redirect must be an nginx named location like @prefixroute_upstream or a URI like /upstream (printable "
     "ASCII without spaces, it is sent as a header value), not '@up\\nX-Injected: 1'"),
    ({"accel_redirect": "foo bar"}, ConfigurationError, "accel_redirect must be an nginx named location"),
    ({"accel_redirect": "@упстрим"}, ConfigurationError, "accel_redirect must be an nginx named location"),
    ({"accel_redirect": " "}, ConfigurationError, "accel_redirect must be an nginx named location"),
]  # fmt: skip


@pytest.mark.parametrize(("options", "error", "message"), CONSTRUCTION_ERRORS)
def test_the_constructor_refuses_what_its_docstring_names_with_a_message_naming_it(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    given = {"backends": BACKENDS, **options}
    with pytest.raises(error) as refused:
        Sidecar(given.pop("router", Router()), **given)
    assert str(refused.value).startswith(message)


def test_the_smallest_body_limit_is_one_byte() -> None:
    sidecar = Sidecar(Router(), backends=BACKENDS, max_body_bytes=1)
    assert sidecar.max_body_bytes == 1
    assert answer(asgi(sidecar, "POST", "/route", [body(b"{}")]))[0] == 413


def test_without_max_token_id_the_largest_token_id_is_the_vocabulary_size_less_one() -> None:
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS, encoder=VocabularyBytes())  # type: ignore[arg-type]
    assert call(sidecar, "POST", "/route", {"prompt_token_ids": [1, 255]}).status_code == 200
    past = call(sidecar, "POST", "/route", {"prompt_token_ids": [1, 256]})
    assert past.status_code == 400
    assert past.json() == {"error": "Token id 256 is out of vocabulary (the model's largest is 255)"}


def test_pick_refuses_a_batch_that_vllm_refuses_whole_not_only_for_its_first_prompt() -> None:
    # Was: a batch was checked by its first prompt alone, so one whose later prompt held an id past the vocabulary,
    # or that mixed texts and lists, was routed and counted in flight (the proxy refused both, as vLLM does).
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS, encoder=VocabularyBytes())  # type: ignore[arg-type]
    refused = [
        ({"prompt": [[1, 2], [3, 256]]}, "Token id 256 is out of vocabulary (the model's largest is 255)"),
        ({"prompt": [[1, 2], [256, 3]], "truncate_prompt_tokens": 1, "truncation_side": "right"}, "Token id 256"),
        ({"prompt": [[1, 2], "a"]}, "a batch 'prompt' holds strings or lists of token ids, nothing else"),
        ({"prompt": ["a", [1, 2]]}, "a batch 'prompt' holds strings or lists of token ids, nothing else"),
    ]
    for request, message in refused:
        answered = call(sidecar, "POST", "/v1/completions", request)
        assert answered.status_code == 400 and answered.json()["error"].startswith(message), (request, answered.text)
    assert sidecar.router.stats().decisions == 0
    kept = {"prompt": [[1, 2], [256, 3]], "truncate_prompt_tokens": 1}  # vLLM checks the ids it keeps: [3]
    assert call(sidecar, "POST", "/v1/completions", kept).status_code == 200


def test_pick_reads_a_client_s_body_as_vllm_does_nan_and_utf16_included() -> None:
    # Was 400 "not valid JSON" where vLLM (Python's json.loads) and the proxy take them: such requests fell back to
    # the plain pool in the nginx, HAProxy and Envoy set-ups, never prefix-routed.
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS)
    text = '{"prompt": [1, 2, 3, 4, 5], "temperature": NaN, "logit_bias": {"7": -Infinity}}'
    for raw in (text.encode(), text.encode("utf-16"), text.encode("utf-32")):
        assert call(sidecar, "POST", "/v1/completions", raw=raw).status_code == 200, raw[:8]
    assert sidecar.router.stats().decisions == 3
    for raw in (b'{"prompt": [1, 2], "temperature": nan}', b'{"prompt": "\\ud800"}', b"\xff\xfe{"):
        assert call(sidecar, "POST", "/v1/completions", raw=raw).status_code == 400, raw
    refused = call(sidecar, "POST", "/route", raw=b'{"prompt_token_ids": [1, 2], "lease": NaN}')
    assert refused.status_code == 400  # /route is the sidecar's own contract: strict JSON


def test_the_default_lease_is_600_seconds_and_bounds_a_route_bodys_own() -> None:
    clock = [0.0]
    sidecar = Sidecar(Router(block_size=4, clock=lambda: clock[0]), backends=BACKENDS)
    for lease in (None, 1e9):
        extra = {} if lease is None else {"lease": lease}
        assert call(sidecar, "POST", "/route", {"prompt_token_ids": ids(8), **extra}).status_code == 200
    clock[0] = 599.5
    assert sidecar.router.expire() == 0
    clock[0] = 600.5
    assert sidecar.router.expire() == 2


# -- routing -----------------------------------------------------------------------------------------------------------


def test_healthy_filters_the_fixed_backends_and_failing_open_uses_all_when_it_leaves_none() -> None:
    asked: list[tuple[str, ...]] = []
    healthy_now = [BACKENDS[2]]

    def healthy(backends: Sequence[str]) -> list[str]:
        asked.append(tuple(backends))
        return list(healthy_now)

    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS, healthy=healthy)
    chosen = {call(sidecar, "POST", "/v1/completions", {"prompt": ids(8, 100 * i)}).json()["backend"] for i in range(6)}
    assert chosen == {BACKENDS[2]} and asked == [tuple(BACKENDS)] * 6
    healthy_now.clear()  # none healthy: all are used
    chosen = {
        call(sidecar, "POST", "/route", {"prompt_token_ids": ids(8, 100 * i)}).json()["backend"] for i in range(9)
    }
    assert chosen == set(BACKENDS)


def test_healthz_and_metrics_say_which_fixed_backends_are_healthy() -> None:
    """With a health filter (``--metrics-from-backends``), /healthz listed every backend and /metrics nothing of
    their health; /healthz stays 200 (the sidecar's liveness, which gateways check) and says which are healthy."""
    healthy_now = [BACKENDS[1]]
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS, healthy=lambda backends: list(healthy_now))
    reply = call(sidecar, "GET", "/healthz")
    assert (reply.status_code, reply.json()) == (
        200,
        {"status": "ok", "backends": BACKENDS, "healthy_backends": [BACKENDS[1]]},
    )
    up = metric_samples(call(sidecar, "GET", "/metrics"))["prefixroute_backend_up"]
    assert up == {(("backend", backend),): float(backend == BACKENDS[1]) for backend in BACKENDS}
    assert "healthy_backends" not in call(Sidecar(Router(), backends=BACKENDS), "GET", "/healthz").json()


def test_without_fixed_backends_the_pick_mode_is_a_400_saying_how_to_give_them() -> None:
    reply = call(Sidecar(Router()), "POST", "/v1/completions", {"prompt": ids(4)})
    assert reply.status_code == 400
    assert reply.json() == {
        "error": "no backends: start the sidecar with --backends URL ... (or in a /route body's 'backends')"
    }


def test_an_empty_backend_list_given_to_decide_is_a_400() -> None:
    with pytest.raises(BadRequest) as refused:
        Sidecar(Router(), backends=BACKENDS).decide(ids(4), model=None, backends=[], lease=None)
    assert (refused.value.status, refused.value.message) == (
        400,
        "route() needs at least one backend, but the backend list is empty",
    )


def test_text_without_a_tokenizer_is_a_400_saying_what_to_send_instead() -> None:
    reply = call(Sidecar(Router(), backends=BACKENDS), "POST", "/route", {"prompt": "SELECT 1"})
    assert reply.status_code == 400
    assert reply.json() == {
        "error": "text prompts need a tokenizer: send 'prompt_token_ids', or start with --tokenizer"
    }


def test_a_prompt_the_tokenizer_refuses_is_a_400_with_its_message() -> None:
    class Refusing(VocabularyBytes):
        def encode(self, text: str) -> list[int]:
            raise ValueError(f"cannot encode {text!r}")

    sidecar = Sidecar(Router(), backends=BACKENDS, encoder=Refusing())  # type: ignore[arg-type]
    for path, payload in (("/route", {"prompt": "x"}), ("/v1/chat/completions", {"messages": [{"role": "user"}]})):
        reply = call(sidecar, "POST", path, payload)
        assert reply.status_code == 400, path
        assert reply.json()["error"].startswith("cannot encode "), path
    assert sidecar.router.stats().decisions == 0


def test_the_python_route_and_pick_apply_the_bodys_model_backends_and_lease() -> None:
    """:meth:`Sidecar.route` and :meth:`Sidecar.pick`, called directly (as ext_proc does), decide as over HTTP: the
    body's model is checked and is the namespace, a ``/route`` body's backends and lease are used."""
    clock = [0.0]
    sidecar = Sidecar(Router(block_size=4, clock=lambda: clock[0]), backends=BACKENDS, models=["base", "lora"])
    own = sidecar.route(json.dumps({"prompt_token_ids": ids(8), "backends": ["http://own:1"], "lease": 5}).encode())
    assert own.backend == "http://own:1" and sidecar.router.in_flight("http://own:1") == 1
    clock[0] = 6.0
    assert sidecar.router.expire() == 1  # its own 5 s lease, not the sidecar's 600 s
    pick = functools.partial(sidecar.pick, "/v1/completions")
    for decide, payload in ((sidecar.route, {"prompt_token_ids": ids(8)}), (pick, {"prompt": ids(8)})):
        with pytest.raises(BadRequest) as unknown:
            decide(json.dumps({**payload, "model": "gpt"}).encode())
        assert unknown.value.status == 404 and "unknown model 'gpt'" in unknown.value.message
    picked = sidecar.pick("/v1/completions", json.dumps({"prompt": ids(8), "model": "lora"}).encode())
    assert picked.reason == "miss" and sidecar.router.in_flight(picked.backend) == 1  # lora: its own namespace
    sidecar.first_token(picked.id)
    again = sidecar.pick("/v1/completions", json.dumps({"prompt": ids(8), "model": "lora"}).encode())
    assert (again.backend, again.reason, again.matched_tokens) == (picked.backend, "prefix", 8)
    assert sidecar.stats()["decisions"] == {"miss": 2, "prefix": 1}
    sidecar.finish(picked.id)
    assert sidecar.stats()["releases"] == {"http": 2}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_the_pick_mode_routes_a_salted_request_apart_as_vllm_caches_it(path: str) -> None:
    """vLLM hashes a request's ``cache_salt`` into its first block: its blocks are hit only by the same salt's
    requests. The pick mode routed a salted request in its model's namespace, predicting hits the engine lacks."""
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS, encoder=VocabularyBytes())  # type: ignore[arg-type]
    chat = path.endswith("chat/completions")
    body = {"messages": [{"role": "user", "content": "a shared question"}]} if chat else {"prompt": ids(8)}

    def pick(**salt: object) -> Decision:
        decision = sidecar.pick(path, json.dumps({**body, **salt}).encode())
        sidecar.first_token(decision.id)
        sidecar.finish(decision.id)
        return decision

    whole = pick().prompt_tokens // 4 * 4  # the blocks an identical unsalted request now finds
    assert whole > 0
    assert pick(cache_salt="tenant-a").matched_tokens == 0  # the unsalted blocks are no hit for it
    assert pick(cache_salt="tenant-a").matched_tokens == whole  # its own salt's are
    assert pick(cache_salt="tenant-b").matched_tokens == 0
    assert pick().matched_tokens == whole and pick(cache_salt="").matched_tokens == whole  # "": no salt (vLLM refuses)
    assert pick(cache_salt=5).matched_tokens == whole  # nor a number: the engine answers it


def test_each_decision_is_timed_by_the_sidecars_clock_in_the_histogram() -> None:
    """``clock`` times each decision, HTTP or Python, route or pick: here 0.25 s between its two readings."""
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS, clock=TickingClock(0.25))
    sidecar.route(json.dumps({"prompt_token_ids": ids(8)}).encode())
    sidecar.pick("/v1/completions", json.dumps({"prompt": ids(8)}).encode())
    assert call(sidecar, "POST", "/route", {"prompt_token_ids": ids(8)}).status_code == 200
    assert call(sidecar, "POST", "/v1/completions", {"prompt": ids(8)}).status_code == 200
    samples = metric_samples(call(sidecar, "GET", "/metrics"))
    assert samples["prefixroute_decision_seconds_count"][()] == 4
    assert samples["prefixroute_decision_seconds_sum"][()] == 1.0


def test_a_via_out_of_the_list_is_named_in_the_error() -> None:
    with pytest.raises(ConfigurationError, match=r"^via must be one of http, udp, ext_proc, not 'HTTP'$"):
        Sidecar(Router(), backends=BACKENDS).finish("a", via="HTTP")


@pytest.mark.parametrize(
    ("backend", "upstream"),
    [("http://gpu0:8000", "gpu0:8000"), ("http://gpu0", "gpu0:80"), ("https://gpu0", "gpu0:443"),
     ("https://gpu0:8443/", "gpu0:8443"), ("http://GPU0:08000", "gpu0:8000"), ("http://[::1]:8000", "[::1]:8000"),
     ("http://[fe80::1]", "[fe80::1]:80"), ("http://gpu0:8000/v1", "http://gpu0:8000/v1"), ("gpu0", "gpu0"),
     ("ftp://gpu0:21", "ftp://gpu0:21"), ("http://:8000", "http://:8000"), ("http://gpu0:99999", "http://gpu0:99999"),
     ("busy", "busy")],
)  # fmt: skip
def test_upstream_of_is_the_host_and_port_a_proxy_connects_to(backend: str, upstream: str) -> None:
    """``host:port`` of a backend URL, its scheme's port when it has none, an IPv6 host in brackets; anything that is
    not an http(s) URL of a host without a path is kept as it is."""
    assert upstream_of(backend) == upstream


def test_upstream_of_a_non_str_is_a_type_error_naming_its_type() -> None:
    with pytest.raises(InvalidTypeError, match="^a backend is a URL str, not bytes$"):
        upstream_of(b"http://gpu0:8000")  # type: ignore[arg-type]


def test_the_sidecars_upstream_and_answer_refuse_what_is_no_backend_or_decision_with_type_errors() -> None:
    """Was: upstream(["x"]) raised "unhashable type: 'list'" from its cache, answer(None) an AttributeError."""
    sidecar = Sidecar(Router(), backends=["http://gpu0:8000"])
    backends: list[object] = [["x"], None, b"http://gpu0:8000"]
    for backend in backends:
        with pytest.raises(InvalidTypeError, match="a backend is a URL str, not"):
            sidecar.upstream(backend)  # type: ignore[arg-type]
    decisions: list[object] = [None, "d-1", {"id": "d-1"}]
    for decision in decisions:
        with pytest.raises(InvalidTypeError, match="answer\\(\\) takes a Decision, not"):
            sidecar.answer(decision)  # type: ignore[arg-type]

    class Named(str):
        def __hash__(self) -> int:
            raise RuntimeError("a str subclass's own hash")

    assert sidecar.upstream(Named("http://gpu1:8000")) == b"gpu1:8000"  # computed, not cached under its own hash
    assert sidecar.upstream("http://gpu0:8000") == b"gpu0:8000"


# -- long prompts, tokenized on a worker thread ------------------------------------------------------------------------

INLINE_BYTES = 64 * 2**10


def padded(payload: dict[str, Any], size: int) -> bytes:
    """``payload`` as JSON, padded with trailing blanks to ``size`` bytes."""
    raw = json.dumps(payload).encode()
    assert len(raw) <= size
    return raw + b" " * (size - len(raw))


class CountingBytes(VocabularyBytes):
    def __init__(self) -> None:
        self.encoded = 0

    def encode(self, text: str) -> list[int]:
        self.encoded += 1
        return super().encode(text)


def test_a_body_of_64_kib_is_tokenized_inline_and_one_byte_more_on_a_worker_thread(thread_hops: list[int]) -> None:
    hops = thread_hops
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS, encoder=VocabularyBytes())  # type: ignore[arg-type]
    text = "SELECT 1; " * 6000
    for size, expected in ((INLINE_BYTES, []), (INLINE_BYTES + 1, [len(text)])):
        hops.clear()
        assert call(sidecar, "POST", "/route", raw=padded({"prompt": text}, size)).status_code == 200
        assert hops == expected, size


def test_a_long_prompt_routes_with_its_model_backends_and_lease_and_an_unknown_model_costs_no_tokenizing() -> None:
    clock = [0.0]
    encoder = CountingBytes()
    sidecar = Sidecar(Router(block_size=4, clock=lambda: clock[0]), backends=BACKENDS, encoder=encoder,  # type: ignore[arg-type]
                      models=["base", "lora"])  # fmt: skip
    text = "SELECT name FROM orders; " * 3000  # 75 KB
    unknown = call(sidecar, "POST", "/route", {"prompt": text, "model": "gpt"})
    assert unknown.status_code == 404 and encoder.encoded == 0
    own = ["http://own:1", "http://own:2"]
    first = call(sidecar, "POST", "/route", {"prompt": text, "model": "lora", "backends": own, "lease": 5}).json()
    assert first["backend"] in own and encoder.encoded == 1
    sidecar.first_token(first["id"])
    base = call(sidecar, "POST", "/route", {"prompt": text, "model": "base", "backends": own, "lease": 5}).json()
    assert base["reason"] == "miss"  # another model, another namespace
    lora = call(sidecar, "POST", "/route", {"prompt": text, "model": "lora", "backends": own, "lease": 5}).json()
    assert (lora["backend"], lora["reason"]) == (first["backend"], "prefix")
    clock[0] = 6.0
    assert sidecar.router.expire() == 3 and sidecar.router.stats().in_flight == 0


def test_a_decision_made_as_its_client_left_is_finished_refused_forgetting_its_prediction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def to_thread(function: Any, *args: Any) -> Any:
        return function(*args)  # done before the sidecar looks: the client's disconnect is already there

    monkeypatch.setattr("prefixroute.adapters.serve.app.asyncio.to_thread", to_thread)
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS, encoder=VocabularyBytes())  # type: ignore[arg-type]
    raw = json.dumps({"prompt": "SELECT 1; " * 7000}).encode()  # over 64 KiB
    assert asgi(sidecar, "POST", "/route", [body(raw)], leaves=True) == []
    assert (sidecar.router.stats().decisions, sidecar.router.stats().in_flight) == (1, 0)
    again = call(sidecar, "POST", "/route", raw=raw).json()
    assert (again["reason"], again["matched_tokens"]) == ("miss", 0)


@pytest.mark.parametrize("path", ["/route", "/v1/completions"])
def test_a_short_body_whose_client_left_is_decided_inline_then_finished_refused_unanswered(path: str) -> None:
    # Was answered to no one and kept in flight until its lease: a gateway that gave up on a sidecar stalled for a
    # moment (nginx's proxy_read_timeout, HAProxy's Lua socket timeout) has closed the connection of every request
    # queued meanwhile, and the sidecar, resumed, decided them all (only a body over 64 KiB was watched).
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS)
    field = "prompt_token_ids" if path == "/route" else "prompt"
    raw = padded({field: [7] * 20_000}, INLINE_BYTES)
    assert asgi(sidecar, "POST", path, [body(raw)], leaves=True) == []
    assert (sidecar.router.stats().decisions, sidecar.router.stats().in_flight) == (1, 0)
    status, _, answered = answer(asgi(sidecar, "POST", path, [body(raw)]))  # a client that waits is answered
    assert status == 200 and sidecar.router.in_flight(json.loads(answered)["backend"]) == 1
    assert json.loads(answered)["matched_tokens"] == 0  # the refused decision's prediction is forgotten


# -- the ext_proc endpoint picker --------------------------------------------------------------------------------------


def test_a_body_the_picker_cannot_route_gets_no_destination_and_is_counted_under_its_status() -> None:
    """A body the picker cannot route (here an unknown model, 404, and a body that is no JSON, 400) gets a plain body
    answer without the destination header, so Envoy's route falls back to its pool, and is counted as over HTTP; a
    body on a path that is not an OpenAI completion gets a plain body answer too, and counts nothing."""
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS, models=["m"])
    for raw in (json.dumps({"model": "other", "prompt": ids(8)}).encode(), b"{not json"):
        answers = run(sidecar, headers("/v1/completions"), body_message(raw, end=True))
        assert answers[1].WhichOneof("response") == "request_body" and destination(answers[1]) is None
    assert sidecar.stats()["bad_requests"] == {"404": 1, "400": 1}
    answers = run(sidecar, headers("/v1/models"), body_message(json.dumps({"prompt": ids(8)}).encode(), end=True))
    assert answers[1].WhichOneof("response") == "request_body" and destination(answers[1]) is None
    assert sidecar.stats()["bad_requests"] == {"404": 1, "400": 1} and sidecar.router.stats().decisions == 0


PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"


async def exchange(port: int, messages: Sequence[Any]) -> list[Any]:
    """The answers of one Process stream on a real gRPC channel to ``port`` that sends ``messages``."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        process = channel.stream_stream(
            PROCESS, pb.ProcessingRequest.SerializeToString, pb.ProcessingResponse.FromString
        )
        return [answer async for answer in process(iter(messages))]


def test_a_buffered_body_comes_in_one_message_as_long_as_max_body_bytes_and_1_mib_more() -> None:
    """A message may be as long as the sidecar's max_body_bytes and 1 MiB more: a whole body of max_body_bytes (over
    gRPC's default 4 MiB) is routed, a longer one is answered unrouted and counted 413, neither fails the stream."""
    limit = 4 * 2**20
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS, max_body_bytes=limit)
    whole = padded({"prompt": ids(64)}, limit)
    longer = padded({"prompt": ids(64)}, limit + 2**19)

    async def go() -> tuple[list[Any], list[Any]]:
        server, port = await start_ext_proc(sidecar, "127.0.0.1", 0)
        try:
            routed = await exchange(port, [headers("/v1/completions"), body_message(whole, end=True)])
            refused = await exchange(port, [headers("/v1/completions"), body_message(longer, end=True)])
            return routed, refused
        finally:
            await server.stop(None)

    routed, refused = asyncio.run(go())
    assert destination(routed[1]) in {upstream_of(backend) for backend in BACKENDS}
    assert refused[1].WhichOneof("response") == "request_body" and destination(refused[1]) is None
    assert sidecar.stats()["bad_requests"] == {"413": 1} and sidecar.router.stats().in_flight == 0


def test_a_port_another_ext_proc_server_serves_is_refused_not_shared() -> None:
    sidecar = Sidecar(Router(), backends=BACKENDS)

    async def go() -> None:
        server, port = await start_ext_proc(sidecar, "127.0.0.1", 0)
        try:
            with pytest.raises(OSError, match=f"^cannot bind the ext_proc port 127.0.0.1:{port}$"):
                await start_ext_proc(sidecar, "127.0.0.1", port)
        finally:
            await server.stop(None)

    asyncio.run(go())


def test_keepalive_seconds_are_whole_milliseconds_at_least_one_and_a_bad_one_is_named() -> None:
    assert [_milliseconds("keepalive_s", s) for s in (2, 0.25, 0.0001)] == [2000, 250, 1]
    for name in ("keepalive_s", "keepalive_timeout_s"):
        with pytest.raises(ConfigurationError, match=f"^{name} must be a positive, finite number of seconds, not 0$"):
            asyncio.run(start_ext_proc(Sidecar(Router(), backends=BACKENDS), "127.0.0.1", 0, **{name: 0}))


def response_trailers() -> Any:
    return pb.ProcessingRequest(response_trailers=pb.HttpTrailers())


def test_every_ext_proc_message_gets_the_answer_of_its_own_phase() -> None:
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS)
    messages = [headers("/v1/completions"), body_message(PROMPT[:10], end=False), body_message(PROMPT[10:], end=True),
                request_trailers(), response_headers("200"), response_body(end=False), response_body(end=True),
                response_trailers()]  # fmt: skip
    answers = run(sidecar, *messages)
    assert [answer.WhichOneof("response") for answer in answers] == [
        message.WhichOneof("request") for message in messages
    ]
    assert destination(answers[2]) is not None and sidecar.router.stats().in_flight == 0
    assert sidecar.stats()["releases"] == {"ext_proc": 2}  # one first token, one finish, on the ext_proc path


def test_a_query_string_does_not_change_the_path_the_picker_routes() -> None:
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS)
    answers = run(sidecar, headers("/v1/completions?a=1?b=2"), body_message(PROMPT, end=True))
    assert destination(answers[1]) in {upstream_of(backend) for backend in BACKENDS}


def test_a_stream_without_a_decision_reports_no_release() -> None:
    """A stream the picker did not route (not an OpenAI path) releases nothing when its response comes or it ends:
    no first token, no finish, no unknown finish counted."""
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS)
    run(
        sidecar,
        headers("/v1/models"),
        body_message(PROMPT, end=True),
        response_body(end=False),
        response_body(end=True),
    )
    run(sidecar, headers("/v1/models"), body_message(PROMPT, end=True), response_body(end=False))  # cut short
    run(sidecar, headers("/healthz"), request_trailers())  # trailers and no body, on a path that is not the picker's
    assert sidecar.stats()["releases"] == {} and sidecar.router.stats().ignored == 0
    assert sidecar.stats()["bad_requests"] == {}


def test_a_response_whose_headers_the_picker_is_not_sent_is_finished_not_refused() -> None:
    """Without the response headers (Envoy's SKIP mode for them) the status is unknown: the request is finished as
    served, and its prediction kept, as a refusal is only a 4xx the picker saw."""
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS)
    for ends in ([response_body(end=True)], []):  # the last response chunk, or the stream's end
        run(sidecar, headers("/v1/completions"), body_message(PROMPT, end=True), *ends)
        assert sidecar.router.stats().in_flight == 0
        again = sidecar.route(json.dumps({"prompt_token_ids": json.loads(PROMPT)["prompt"]}).encode())
        assert again.matched_tokens == 40
        sidecar.finish(again.id)
        sidecar.router.remove_backend(again.backend)  # forget it for the next case


def test_a_body_after_headers_that_ended_the_request_is_not_routed_nor_counted_twice() -> None:
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS)
    answers = run(sidecar, headers("/v1/completions", end=True), body_message(PROMPT, end=True), request_trailers())
    assert destination(answers[1]) is None
    assert (sidecar.router.stats().decisions, sidecar.stats()["bad_requests"]) == (0, {"400": 1})


def test_a_streamed_body_over_the_limit_is_counted_413_once_and_never_routed() -> None:
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS, max_body_bytes=len(PROMPT) // 2)
    third = len(PROMPT) // 3 + 1
    chunks = [PROMPT[:third], PROMPT[third : 2 * third], PROMPT[2 * third :]]
    answers = run(sidecar, headers("/v1/completions"), *(body_message(c, end=i == 2) for i, c in enumerate(chunks)))
    assert [destination(answer) for answer in answers[1:]] == [None, None, None]
    assert (sidecar.router.stats().decisions, sidecar.stats()["bad_requests"]) == (0, {"413": 1})


def test_a_routed_answer_sets_the_destination_the_id_and_the_envoy_lb_metadata_and_clears_the_route_cache() -> None:
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS)
    path = base_pb2.HeaderValue(key=":path", value="/v1/completions")  # in value, not raw_value: read too
    request_headers = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[path])))
    answers = run(sidecar, request_headers, body_message(PROMPT, end=True))
    common = answers[1].request_body.response
    endpoint = destination(answers[1])
    assert endpoint in {upstream_of(backend) for backend in BACKENDS} and common.clear_route_cache
    set_headers = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
    assert list(set_headers) == [DESTINATION_HEADER, "x-prefixroute-id"]
    decision_id = set_headers["x-prefixroute-id"]
    assert json_format.MessageToDict(answers[1].dynamic_metadata) == {"envoy.lb": {DESTINATION_HEADER: endpoint}}
    assert sidecar.router.stats().in_flight == 0  # the stream ended: released, by that id
    sidecar.finish(decision_id)
    assert sidecar.router.stats().ignored == 1  # already finished: the id was the decision's


class Aborted(Exception):
    """What a gRPC context's abort() raises to end the handler."""


class AbortingContext:
    """A gRPC servicer context that notes each abort() and ends the handler as grpc.aio does."""

    def __init__(self) -> None:
        self.aborted: list[tuple[grpc.StatusCode, str]] = []

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.aborted.append((code, details))
        raise Aborted


def process_until_aborted(sidecar: Sidecar, messages: Sequence[Any], error: Exception | None) -> AbortingContext:
    """Feed ``messages`` to one Process stream, then raise ``error`` from the stream's read (if any)."""
    context = AbortingContext()

    async def requests() -> Any:
        for message in messages:
            yield message
        if error is not None:
            raise error

    async def go() -> None:
        with pytest.raises(Aborted):
            async for _ in EndpointPicker(sidecar).Process(requests(), context):
                pass

    asyncio.run(go())
    return context


@pytest.mark.parametrize("how", ["no phase", "not a ProcessingRequest"])
def test_a_message_the_picker_cannot_answer_ends_the_stream_invalid_argument_counted_and_released(how: str) -> None:
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS)
    routed = [headers("/v1/completions"), body_message(PROMPT, end=True)]
    if how == "no phase":
        context = process_until_aborted(sidecar, [*routed, pb.ProcessingRequest()], None)
        expected = (
            "a ProcessingRequest sets no phase: send one of request_headers, request_body, request_trailers, "
            "response_headers, response_body or response_trailers"
        )
    else:
        context = process_until_aborted(sidecar, routed, DecodeError("truncated"))
        expected = "a message is not a ProcessingRequest: truncated"
    assert context.aborted == [(grpc.StatusCode.INVALID_ARGUMENT, expected)]
    assert sidecar.stats()["bad_requests"] == {"400": 1}
    assert sidecar.router.stats().in_flight == 0 and sidecar.stats()["releases"] == {"ext_proc": 1}


def test_response_headers_without_a_status_let_the_first_chunk_report_the_first_token() -> None:
    """The first response chunk reports the first token of a 200 answer, or of one whose ``:status`` the picker is
    not sent: here response headers that carry no ``:status``."""
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS)
    no_status = pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[])))
    run(sidecar, headers("/v1/completions"), body_message(PROMPT, end=True), no_status, response_body(end=True))
    assert sidecar.stats()["releases"] == {"ext_proc": 2} and sidecar.router.stats().in_flight == 0
