"""The sidecar's HTTP contract, in process (ASGI) and as the ``prefixroute serve`` command."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, MutableMapping
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from prefixroute import LoadPolicy, Router
from prefixroute.adapters.serve import BadRequest, PromptEncoder, Sidecar, release_ids, upstream_of
from prefixroute.adapters.serve.contract import MAX_REQUEST_BACKENDS, is_refusal
from prefixroute.adapters.serve.loopback import free_port, start_sidecar
from prefixroute.adapters.serve.release import ReleaseProtocol, refused
from prefixroute.errors import ConfigurationError, InvalidPromptError, InvalidTypeError, PrefixRouteError, StateError

from ..conftest import DEADLINE_S, BuggyPolicy, StrangerPolicy, returns, wait_until
from .conftest import CORPUS, request_during_close

BACKENDS = ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"]


def call(sidecar: Sidecar, method: str, path: str, payload: Any = None, raw: bytes | None = None) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=sidecar)
        async with httpx.AsyncClient(transport=transport, base_url="http://sidecar") as client:
            content = raw if raw is not None else (json.dumps(payload).encode() if payload is not None else None)
            return await client.request(method, path, content=content)

    return asyncio.run(go())


def ids(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_route_answers_the_contract_and_counts_in_flight() -> None:
    sidecar = Sidecar(Router(block_size=16), backends=BACKENDS)
    first = call(sidecar, "POST", "/route", {"prompt_token_ids": ids(64)})
    assert first.status_code == 200
    answer = first.json()
    assert set(answer) == {"id", "backend", "matched_tokens", "prompt_tokens", "reason"}
    assert answer["backend"] in BACKENDS and answer["reason"] == "miss" and answer["prompt_tokens"] == 64
    # Its prefill is done: the default policy then follows the cached prefix (while it prefills, it may spread).
    assert call(sidecar, "POST", "/first_token", {"id": answer["id"]}).status_code == 200
    again = call(sidecar, "POST", "/route", {"prompt_token_ids": ids(80)}).json()
    assert (again["backend"], again["reason"], again["matched_tokens"]) == (answer["backend"], "prefix", 64)
    assert sidecar.router.in_flight(answer["backend"]) == 2
    for decision_id in (answer["id"], answer["id"], again["id"], "never-issued"):
        reply = call(sidecar, "POST", "/finish", {"id": decision_id})
        assert reply.status_code == 200 and reply.json() == {"id": decision_id}
    assert sidecar.router.in_flight(answer["backend"]) == 0
    assert call(sidecar, "POST", "/first_token", {"id": "never-issued"}).status_code == 200
    stats = call(sidecar, "GET", "/stats").json()
    assert stats["unknown_finishes"] == 3 and stats["in_flight_total"] == 0


def test_backends_lease_and_model_per_request() -> None:
    clock = [0.0]
    router = Router(block_size=4, clock=lambda: clock[0])
    sidecar = Sidecar(router, models=["llama", "qwen"])
    assert call(sidecar, "POST", "/route", {"prompt_token_ids": ids(8)}).status_code == 400  # no backends at all
    one = call(sidecar, "POST", "/route", {"prompt_token_ids": ids(8), "backends": ["a", "b"], "lease": 5}).json()
    assert router.in_flight(one["backend"]) == 1
    clock[0] = 6.0
    other = call(sidecar, "POST", "/route", {"prompt_token_ids": ids(8), "backends": ["a", "b"], "model": "qwen"})
    assert other.json()["reason"] == "miss"  # another model: another namespace, nothing cached
    assert router.in_flight(one["backend"]) + router.in_flight("a" if one["backend"] == "b" else "b") == 1
    assert router.stats().leases_expired == 1
    default = call(sidecar, "POST", "/route", {"prompt_token_ids": ids(8), "backends": ["a", "b"], "model": "llama"})
    assert default.json()["reason"] == "prefix"  # the first model is the default namespace
    unknown = call(sidecar, "POST", "/route", {"prompt_token_ids": ids(8), "backends": ["a"], "model": "gpt"})
    assert unknown.status_code == 404 and "qwen" in unknown.json()["error"]


def test_a_requests_own_lease_is_cut_to_the_sidecars() -> None:
    """Any finite lease was taken, so one client could pin a decision in flight for years (or 1000 times too long,
    sending milliseconds for seconds). The sidecar's lease (--lease) now bounds a body's own: a longer one is cut to
    it, still answered 200 as the contract says; a shorter one is kept."""
    clock = [0.0]
    router = Router(block_size=4, clock=lambda: clock[0])
    sidecar = Sidecar(router, backends=BACKENDS, lease=600.0)
    routed = [call(sidecar, "POST", "/route", {"prompt_token_ids": ids(8), "lease": lease}) for lease in (1e9, 5)]
    assert [reply.status_code for reply in routed] == [200, 200]
    clock[0] = 6.0
    assert router.expire() == 1  # the 5 s lease
    clock[0] = 600.5
    assert router.expire() == 1 and router.stats().in_flight == 0  # the 1e9 s lease, cut to 600 s
    unbounded = Sidecar(Router(block_size=4, clock=lambda: clock[0]), backends=BACKENDS, lease=None)
    assert call(unbounded, "POST", "/route", {"prompt_token_ids": ids(8), "lease": 1e9}).status_code == 200
    clock[0] = 1e6
    assert unbounded.router.expire() == 0  # no lease of its own: the body's is kept


BAD_BODIES: list[tuple[bytes, str]] = [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "object"),
    (b"{}", "exactly one of"),
    (b"{}", "not none of them"),
    (b'{"prompt_token_ids": [1, 2], "prompt": "x"}', "not prompt_token_ids and prompt"),
    (b'{"prompt": "x", "messages": []}', "not prompt and messages"),
    (b'{"prompt_token_ids": []}', "'prompt_token_ids' is empty"),
    (b'{"prompt": ""}', "'prompt' is empty"),
    (b'{"messages": []}', "'messages' is empty"),
    (b'{"prompt_token_ids": [1, "2"]}', "$.prompt_token_ids[1]"),
    (b'{"prompt_token_ids": [1, true]}', "$.prompt_token_ids[1]"),
    (b'{"prompt_token_ids": [1, -1]}', "position 1"),
    (b'{"prompt_token_ids": [4294967296]}', "position 0"),
    (b'{"prompt_token_ids": [1], "lease": 0}', "$.lease"),
    (b'{"prompt_token_ids": [1], "lease": "long"}', "$.lease"),
    (b'{"prompt_token_ids": [1], "backends": []}', "'backends' is empty"),
    (b'{"prompt_token_ids": [1], "backends": ["a", "a"]}', "more than once"),
    (b'{"prompt_token_ids": [1], "backends": ["a", ""]}', "a backend id is an empty str"),
    (b'{"prompt_token_ids": [1], "backends": "a"}', "$.backends"),
    (b'{"prompt_token_ids": [1], "model": 3}', "$.model"),
    (b'{"prompt": "hello"}', "--tokenizer"),
]


@pytest.mark.parametrize(("raw", "message"), BAD_BODIES)
def test_bad_input_is_a_400_with_a_message_and_changes_no_count(raw: bytes, message: str) -> None:
    sidecar = Sidecar(Router(), backends=BACKENDS)
    reply = call(sidecar, "POST", "/route", raw=raw)
    assert reply.status_code == 400
    assert message in reply.json()["error"]
    stats = sidecar.router.stats()
    assert (stats.decisions, stats.in_flight) == (0, 0)


def test_a_route_body_may_list_4096_backends_and_one_more_is_a_400_naming_both_counts() -> None:
    sidecar = Sidecar(Router(block_size=4))
    many = [f"http://10.{i // 256}.{i % 256}.1:8000" for i in range(MAX_REQUEST_BACKENDS + 1)]
    body = {"prompt_token_ids": ids(8), "backends": many[:MAX_REQUEST_BACKENDS]}
    assert call(sidecar, "POST", "/route", body).json()["backend"] in many
    reply = call(sidecar, "POST", "/route", {"prompt_token_ids": ids(8), "backends": many})
    assert reply.status_code == 400
    assert f"lists {MAX_REQUEST_BACKENDS + 1} backends: list at most {MAX_REQUEST_BACKENDS}" in reply.json()["error"]
    assert sidecar.router.stats().decisions == 1 and sidecar.stats()["bad_requests"] == {"400": 1}


USER = {"role": "user", "content": "hi"}
BAD_MESSAGES: list[tuple[list[Any], str]] = [
    ([{"content": "x"}], "$.messages[0].role must be a string, not null (or missing)"),
    ([USER, {"role": 3, "content": "x"}], "$.messages[1].role must be a string, not a number"),
    ([{"role": True, "content": "x"}], "$.messages[0].role must be a string, not a boolean"),
    (
        [USER, {"role": "user", "content": 3}],
        "$.messages[1].content must be a string, a list of content parts or null, not a number",
    ),
    (
        [{"role": "user", "content": {"type": "text"}}],
        "$.messages[0].content must be a string, a list of content parts or null, not an object",
    ),
    (
        [{"role": "user", "content": [{"type": "text", "text": "a"}, ["x"]]}],
        '$.messages[0].content[1] must be a content part like {"type": "text", "text": "..."} or a string, not an '
        "array",
    ),
    (
        [{"role": "user", "content": ["a", 7]}],
        '$.messages[0].content[1] must be a content part like {"type": "text", "text": "..."} or a string, not a '
        "number",
    ),
    (
        [{"role": "user", "content": [{"type": None, "text": "x"}]}],
        '$.messages[0].content[0].type must be a string such as "text", not null',
    ),
    (
        [{"role": "user", "content": [{"type": 5, "text": "x"}]}],
        '$.messages[0].content[0].type must be a string such as "text", not a number',
    ),
    ([{"role": "user", "content": [{"text": 1.5}]}], "$.messages[0].content[0].text must be a string, not a number"),
    (
        [{"role": "user", "content": [{"type": "image_url"}, {"text": ["x"]}]}],
        "$.messages[0].content[1].text must be a string, not an array",
    ),
]


@pytest.mark.parametrize("path", ["/route", "/v1/chat/completions"])
@pytest.mark.parametrize(("messages", "message"), BAD_MESSAGES)
def test_a_chat_message_openai_would_refuse_is_a_400_naming_its_first_wrong_field_and_what_was_sent(
    path: str, messages: list[Any], message: str
) -> None:
    sidecar = Sidecar(Router(), backends=BACKENDS)
    reply = call(sidecar, "POST", path, {"messages": messages})
    assert reply.status_code == 400
    assert message in reply.json()["error"]
    assert sidecar.router.stats().decisions == 0 and sidecar.stats()["bad_requests"] == {"400": 1}


def test_a_content_parts_type_sent_as_null_is_named_null_not_missing_as_a_missing_type_is_text() -> None:
    sidecar = Sidecar(Router(), backends=BACKENDS)
    reply = call(sidecar, "POST", "/route", {"messages": [{"role": "user", "content": [{"type": None, "text": "x"}]}]})
    assert reply.status_code == 400
    assert reply.json()["error"].endswith(", not null") and "missing" not in reply.json()["error"]


@pytest.mark.parametrize("path", ["/route", "/v1/chat/completions"])
def test_every_content_vllm_takes_is_routed_in_process(path: str, model_dir: Path) -> None:
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS, encoder=PromptEncoder(model_dir))
    contents: list[Any] = [
        "count the rows",
        None,
        [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "x"}}],
        [{"text": "a part without a type is text"}],
        ["vLLM takes a plain string as a text part", {"type": "text", "text": "and"}],
        [{"type": "text", "text": None}, {"type": "text"}, {}, {"type": "text", "text": "leaves out null texts"}],
        [{"type": "image_url", "image_url": {"url": "x"}, "text": 5}],  # only a text part's text is read
    ]
    for content in contents:
        reply = call(sidecar, "POST", path, {"messages": [USER, {"role": "assistant", "content": content}]})
        assert reply.status_code == 200, (content, reply.text)
    reply = call(sidecar, "POST", path, {"messages": [USER, {"role": "assistant", "tool_calls": []}]})
    assert reply.status_code == 200, reply.text
    assert sidecar.router.stats().decisions == len(contents) + 1


def test_a_plain_string_part_routes_as_its_text_part_and_a_null_text_as_no_part(model_dir: Path) -> None:
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS, encoder=PromptEncoder(model_dir))

    def tokens(content: list[Any]) -> int:
        reply = call(sidecar, "POST", "/route", {"messages": [{"role": "user", "content": content}]})
        assert reply.status_code == 200, reply.text
        return int(reply.json()["prompt_tokens"])

    parts = [{"type": "text", "text": "count the rows"}, {"type": "text", "text": "of the table"}]
    assert tokens(["count the rows", "of the table"]) == tokens(parts)
    assert tokens([{"type": "text", "text": None}, *parts, {"text": None}]) == tokens(parts)
    assert tokens(parts) != tokens(parts[:1])


@pytest.mark.parametrize(
    "options",
    [
        {"truncate_prompt_tokens": 3},
        {"truncate_prompt_tokens": 3, "truncation_side": "right"},
        {"add_special_tokens": False},
        {"add_special_tokens": True, "truncate_prompt_tokens": 100},
        {"truncate_prompt_tokens": None, "truncation_side": None},
    ],
)
def test_route_tokenizes_and_cuts_a_prompt_as_the_pick_mode_and_vllm_do(
    options: dict[str, Any], model_dir: Path
) -> None:
    """``/route`` read vLLM's ``add_special_tokens``, ``truncate_prompt_tokens`` and ``truncation_side`` not at all
    (they were unknown fields), so it routed on other tokens than the engine computes, and than the pick mode routes
    on for the same request."""
    encoder = PromptEncoder(model_dir)
    text = "count the rows of the table where the name is long"
    for prompt in ({"prompt": text}, {"prompt_token_ids": encoder.encode(text)}):
        sidecar = Sidecar(Router(block_size=4), backends=BACKENDS, encoder=encoder)
        routed = call(sidecar, "POST", "/route", {**prompt, **options})
        assert call(sidecar, "POST", "/finish", {"id": routed.json()["id"]}).status_code == 200
        picked = call(sidecar, "POST", "/v1/completions", {"prompt": next(iter(prompt.values())), **options})
        assert routed.status_code == picked.status_code == 200, routed.text
        assert routed.json()["prompt_tokens"] == picked.json()["prompt_tokens"]
        assert picked.json()["matched_tokens"] == routed.json()["prompt_tokens"] // 4 * 4  # the same tokens, cached
        if options.get("truncate_prompt_tokens") == 3:
            assert routed.json()["prompt_tokens"] == 3


def test_route_refuses_a_tokenizing_field_of_the_wrong_type() -> None:
    sidecar = Sidecar(Router(), backends=BACKENDS)
    for field, value in (("add_special_tokens", "no"), ("truncate_prompt_tokens", 1.5), ("truncation_side", "middle")):
        reply = call(sidecar, "POST", "/route", {"prompt_token_ids": [1, 2, 3], field: value})
        assert reply.status_code == 400 and f"$.{field}" in reply.json()["error"], (field, reply.text)
    assert sidecar.router.stats().decisions == 0


def test_lifecycle_and_endpoint_errors() -> None:
    sidecar = Sidecar(Router(), backends=BACKENDS)
    assert call(sidecar, "POST", "/finish", raw=b'{"id": 7}').status_code == 400
    assert call(sidecar, "POST", "/finish", raw=b"{}").status_code == 400
    assert call(sidecar, "POST", "/nope", {}).status_code == 404
    assert call(sidecar, "PUT", "/nope", {}).status_code == 404
    wrong_methods = (("GET", "/route", "POST"), ("PUT", "/route", "POST"), ("POST", "/metrics", "GET, HEAD"))
    for method, path, allowed in wrong_methods:
        refused = call(sidecar, method, path, {} if method != "GET" else None)
        assert (refused.status_code, refused.headers["allow"]) == (405, allowed)
        assert allowed in refused.json()["error"]
    assert call(sidecar, "GET", "/healthz").json()["status"] == "ok"
    metrics = call(sidecar, "GET", "/metrics").text
    assert 'prefixroute_bad_requests_total{status="400"} 2' in metrics
    assert sidecar.router.stats().ignored == 0


def test_the_python_api_refuses_what_http_cannot_send_with_the_librarys_errors_and_loses_nothing() -> None:
    # Was: a body that is no bytes, or a path that is no str, raised AttributeError ('startswith'); a junk 'via'
    # ended the request, then raised TypeError while counting it; BadRequest was outside PrefixRouteError's tree.
    sidecar = Sidecar(Router(), backends=BACKENDS)
    body = json.dumps({"prompt_token_ids": ids(32)}).encode()
    for junk in (None, "text", 5, {"prompt_token_ids": [1]}):
        for call_with in (sidecar.route, lambda b: sidecar.pick("/v1/completions", b)):
            with pytest.raises(InvalidTypeError, match="a request body must be bytes"):
                call_with(junk)  # type: ignore[arg-type]
        with pytest.raises(InvalidTypeError, match="a request body must be bytes"):
            asyncio.run(sidecar.route_async(junk))  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="path must be"):
        sidecar.pick(None, body)  # type: ignore[arg-type]
    assert sidecar.route(bytearray(b"\xef\xbb\xbf" + body)).prompt_tokens == 32  # type: ignore[arg-type]  # a BOM
    decision = sidecar.route(memoryview(body))  # type: ignore[arg-type]  # any bytes-like body is read
    for via in ("HTTP", "", None, ["http"]):
        for report in (sidecar.first_token, sidecar.finish):
            with pytest.raises(ConfigurationError, match="via must be one of http, udp, ext_proc"):
                report(decision.id, via=via)  # type: ignore[arg-type]
    assert sidecar.router.in_flight(decision.backend) == 2 and sidecar.metrics.releases == {}
    sidecar.finish(decision.id, via="udp")
    assert sidecar.router.in_flight(decision.backend) == 1 and sidecar.metrics.releases == {"udp": 1}
    with pytest.raises(PrefixRouteError) as refused:
        sidecar.route(b'{"prompt_token_ids": []}')
    assert isinstance(refused.value, BadRequest) and refused.value.status == 400


def test_metrics_expose_every_figure() -> None:
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS)
    first = sidecar.route(b'{"prompt_token_ids": [1, 2, 3, 4, 5]}')
    sidecar.finish(first.id)
    sidecar.finish(first.id)
    decision = sidecar.route(b'{"prompt_token_ids": [1, 2, 3, 4, 6]}')
    text = call(sidecar, "GET", "/metrics").text
    for line in ('prefixroute_decisions_total{reason="miss"} 1', 'prefixroute_decisions_total{reason="prefix"} 1',
                 "prefixroute_hit_tokens_total 4", "prefixroute_prompt_tokens_total 10",
                 f'prefixroute_in_flight{{backend="{decision.backend}"}} 1', "prefixroute_leases_expired_total 0",
                 "prefixroute_unknown_finishes_total 1", "prefixroute_decision_seconds_count 2"):  # fmt: skip
        assert line in text.splitlines(), line


@pytest.mark.parametrize("location", ["@up", "/internal/upstream?via=prefixroute"])  # a named location or a URI
def test_pick_mode_answers_in_headers_for_nginx_and_haproxy(location: str) -> None:
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS, accel_redirect=location)
    reply = call(sidecar, "POST", "/v1/completions", {"model": "m", "prompt": ids(12), "stream": True})
    assert reply.status_code == 200 and reply.headers["x-accel-redirect"] == location
    assert reply.headers["x-prefixroute-backend"] == reply.json()["backend"]
    assert reply.headers["x-prefixroute-upstream"] == upstream_of(reply.json()["backend"])
    assert sidecar.router.in_flight(reply.json()["backend"]) == 1
    batch = call(sidecar, "POST", "/v1/completions", {"model": "m", "prompt": [ids(12), ids(4)]})
    assert batch.json()["backend"] == reply.json()["backend"]  # a batch goes where its first prompt goes
    assert call(sidecar, "POST", "/v1/chat/completions", {"messages": "hi"}).status_code == 400
    assert call(sidecar, "POST", "/v1/completions", {"prompt": [1, -2]}).status_code == 400


def test_pick_mode_reads_token_ids_as_vllm_does() -> None:
    """vLLM's request model (pydantic, lax) reads ``true``, ``2.0`` and ``"3"`` in a list of ids as ints, and
    ``["1", 2]`` as the ids [1, 2] (no batch: not every item is a text); the pick mode refused the first with 400
    (so the proxy fell back to its plain balancer) and routed the second on the text "1"."""
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS)
    plain = call(sidecar, "POST", "/v1/completions", {"prompt": [1, 2, 3, 4, 5, 6, 7, 8]}).json()
    sidecar.finish(plain["id"])  # no load: the prefix alone decides
    lax = call(sidecar, "POST", "/v1/completions", {"prompt": [True, 2.0, "3", 4, 5, 6, 7, 8, 9]})
    assert lax.status_code == 200, lax.json()
    assert (lax.json()["backend"], lax.json()["matched_tokens"], lax.json()["prompt_tokens"]) == (
        plain["backend"], 8, 9,
    )  # fmt: skip
    sidecar.finish(lax.json()["id"])
    mixed = call(sidecar, "POST", "/v1/completions", {"prompt": ["1", 2, 3, 4]}).json()
    assert (mixed["backend"], mixed["matched_tokens"], mixed["prompt_tokens"]) == (plain["backend"], 4, 4)
    with pytest.raises(BadRequest, match="text prompts need a tokenizer"):  # a batch of texts: its first decides
        sidecar.pick("/v1/completions", json.dumps({"prompt": ["1", "2"]}).encode())


BAD_OPENAI_BODIES: list[tuple[str, bytes, str]] = [
    ("/v1/completions", b"null", "an OpenAI request body is a JSON object"),
    ("/v1/chat/completions", b"[]", "an OpenAI request body is a JSON object"),
    ("/v1/completions", b'{"model": 3, "prompt": "x"}', "'model' must be a string"),
    (
        "/v1/chat/completions",
        b'{"model": ["m"], "messages": [{"role": "user", "content": "x"}]}',
        "'model' must be a string",
    ),
    ("/v1/chat/completions", b'{"prompt": "no messages"}', "a chat completion needs 'messages'"),
    ("/v1/chat/completions", b'{"messages": []}', "a chat completion needs 'messages'"),
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x"}, null]}',
        "a chat completion needs 'messages'",
    ),
    ("/v1/completions", b"{}", "a completion needs 'prompt'"),
    ("/v1/completions", b'{"prompt": ""}', "a completion needs 'prompt'"),
    ("/v1/completions", b'{"prompt": 5}', "a completion needs 'prompt'"),
    ("/v1/completions", b'{"prompt": {"text": "x"}}', "a completion needs 'prompt'"),
    ("/v1/completions", b'{"prompt": []}', "a completion needs 'prompt'"),
    ("/v1/completions", b'{"prompt": [[]]}', "a completion needs 'prompt'"),
    ("/v1/completions", b'{"prompt": [1, null]}', "a completion needs 'prompt'"),  # [1, true] is [1, 1] to vLLM
    ("/v1/completions", b'{"prompt": [1, -1]}', "a completion needs 'prompt'"),
    ("/v1/completions", b'{"prompt": [1, 1.5]}', "a completion needs 'prompt'"),  # 1.0 is 1 to vLLM
    ("/v1/completions", b'{"prompt": [1, 4294967296]}', "a completion needs 'prompt'"),
]


@pytest.mark.parametrize(("path", "raw", "message"), BAD_OPENAI_BODIES)
def test_a_body_that_is_no_openai_request_is_a_400_in_pick_mode(path: str, raw: bytes, message: str) -> None:
    sidecar = Sidecar(Router(), backends=BACKENDS)
    reply = call(sidecar, "POST", path, raw=raw)
    assert reply.status_code == 400
    assert message in reply.json()["error"]
    assert sidecar.router.stats().decisions == 0 and sidecar.stats()["bad_requests"] == {"400": 1}


def test_pick_mode_routes_every_token_id_below_2_to_the_32_and_checks_the_requests_model() -> None:
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS, models=["m", "lora"])
    for prompt in ([0, 1000, 2**31, 2**32 - 1], [[2**32 - 1, 7], [1]], ["a text batch", "is routed by its first"]):
        reply = call(sidecar, "POST", "/v1/completions", {"model": "lora", "prompt": prompt})
        expected = 400 if isinstance(prompt[0], str) else 200  # text, and this sidecar has no tokenizer
        assert reply.status_code == expected, (prompt, reply.text)
    assert "text prompts need a tokenizer" in reply.json()["error"]
    for path, body in (("/v1/completions", {"prompt": [1, 2]}), ("/v1/chat/completions", {"messages": [USER]})):
        unknown = call(sidecar, "POST", path, {"model": "other", **body})
        assert unknown.status_code == 404 and "unknown model 'other'" in unknown.json()["error"], path


@pytest.mark.parametrize("policy", [BuggyPolicy(), StrangerPolicy()])
@pytest.mark.parametrize(
    ("path", "body"), [("/route", {"prompt_token_ids": [1, 2]}), ("/v1/completions", {"prompt": [1]})]
)
def test_a_failing_policy_is_a_500_in_json_not_the_clients_fault(policy: LoadPolicy, path: str, body: Any) -> None:
    sidecar = Sidecar(Router(policy=policy), backends=BACKENDS)
    reply = call(sidecar, "POST", path, body)
    assert reply.status_code == 500 and "routing policy failed" in reply.json()["error"]
    assert sidecar.stats()["bad_requests"] == {"500": 1} and sidecar.router.stats().in_flight == 0


def test_text_and_chat_prompts_use_the_model_tokenizer_and_template(model_dir: Path) -> None:
    encoder = PromptEncoder(model_dir)
    assert encoder.has_chat_template
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS, encoder=encoder)
    system = {"role": "system", "content": " ".join(CORPUS[:2])}
    first = call(sidecar, "POST", "/route", {"messages": [system, {"role": "user", "content": "count rows"}]}).json()
    sidecar.finish(first["id"])  # no load: the prefix alone decides
    second = call(sidecar, "POST", "/route", {"messages": [system, {"role": "user", "content": "an index?"}]}).json()
    assert second["backend"] == first["backend"] and second["reason"] == "prefix" and second["matched_tokens"] >= 8
    expected = encoder.encode_chat([system, {"role": "user", "content": "count rows"}])
    assert first["prompt_tokens"] == len(expected) and expected[0] == Tokenizer.from_file(
        str(model_dir / "tokenizer.json")
    ).token_to_id("<s>")
    text = call(sidecar, "POST", "/route", {"prompt": CORPUS[0]}).json()
    assert text["prompt_tokens"] == len(encoder.encode(CORPUS[0]))
    out_of_range = call(sidecar, "POST", "/route", {"prompt_token_ids": [1, encoder.vocab_size]})
    assert out_of_range.status_code == 400 and "out of vocabulary" in out_of_range.json()["error"]


def test_token_ids_of_a_padded_vocabulary_are_routed_as_vllm_serves_them(model_dir: Path, tmp_path: Path) -> None:
    """A model's vocabulary may be padded past its tokenizer's (Qwen's is) and vLLM serves the ids in between: the
    sidecar refused every id past the tokenizer's; it now takes the engine's limit, PromptEncoder.max_token_id."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((model_dir / name).read_bytes())
    tokenizer_size = PromptEncoder(tmp_path).vocab_size
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": tokenizer_size + 64}))
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS, encoder=PromptEncoder(tmp_path))
    padded = call(sidecar, "POST", "/route", {"prompt_token_ids": [1, tokenizer_size + 63]})
    assert padded.status_code == 200, padded.json()
    past = call(sidecar, "POST", "/route", {"prompt_token_ids": [1, tokenizer_size + 64]})
    assert past.status_code == 400 and f"Token id {tokenizer_size + 64} is out of vocabulary" in past.json()["error"]


def test_token_ids_are_checked_against_the_vocabulary_on_every_path_of_a_route_body(model_dir: Path) -> None:
    """The ids of a /route body are bounded while decoded (in C); a body that fails that decode is read again as
    before, so each error keeps its own message, status and order, and ``route()`` and the ASGI path agree."""
    encoder = PromptEncoder(model_dir)
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS, encoder=encoder, models=["m"])
    largest = encoder.max_token_id
    bodies: list[tuple[dict[str, Any], int, str]] = [
        ({"prompt_token_ids": [1, largest], "model": "m"}, 200, ""),
        ({"prompt_token_ids": [1, largest + 1]}, 400, f"Token id {largest + 1} is out of vocabulary"),
        ({"prompt_token_ids": [largest + 1, 1], "truncate_prompt_tokens": 1}, 200, ""),  # vLLM keeps the last one
        ({"prompt_token_ids": [1, largest + 1], "truncate_prompt_tokens": 1}, 400, "out of vocabulary"),
        ({"prompt_token_ids": [1, largest + 1], "lease": -1}, 400, "Expected `float` > 0.0 - at `$.lease`"),
        ({"prompt_token_ids": [1, largest + 1], "model": "other"}, 404, "unknown model 'other'"),
        ({"prompt_token_ids": [-1, 2]}, 400, "token id at position 0 is -1"),
        ({"prompt_token_ids": [1, True]}, 400, "Expected `int`, got `bool` - at `$.prompt_token_ids[1]`"),
    ]
    for body, status, error in bodies:
        answer = call(sidecar, "POST", "/route", body)
        assert answer.status_code == status and error in answer.json().get("error", ""), (body, answer.json())
        if status == 200:
            sidecar.finish(answer.json()["id"])
            direct = sidecar.route(json.dumps(body).encode())
            assert direct.prompt_tokens == answer.json()["prompt_tokens"]
            sidecar.finish(direct.id)
        else:
            with pytest.raises(BadRequest) as refused:
                sidecar.route(json.dumps(body).encode())
            assert refused.value.status == status and error in refused.value.message
    assert sidecar.router.stats().in_flight == 0


def test_chat_without_a_template_uses_the_documented_serialisation(model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    encoder = PromptEncoder(tmp_path / "tokenizer.json")
    assert not encoder.has_chat_template
    messages = [{"role": "user", "content": [{"type": "text", "text": "SELECT name"}]}]
    plain = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert encoder.encode_chat(messages) == plain.encode("<|user|>\nSELECT name\n<|assistant|>\n").ids
    for role, had in ((None, "no 'role'"), (7, "a 'role' of type int"), (["user"], "a 'role' of type list")):
        with pytest.raises(InvalidPromptError) as refused:
            encoder.encode_chat([{"role": "user", "content": "hi"}, {"role": role, "content": "no role"}])
        assert str(refused.value) == (
            f"chat message 1 has {had}: each chat message must be an object with a string 'role' and a 'content'"
        )


def test_construction_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"not an http\(s\):// URL"):
        Sidecar(Router(), backends=["gpu0"])
    with pytest.raises(ConfigurationError, match="twice"):
        Sidecar(Router(), backends=[BACKENDS[0], BACKENDS[0]])
    with pytest.raises(ConfigurationError, match="models names 'qwen' twice: name each model once"):
        Sidecar(Router(), backends=BACKENDS, models=["llama", "qwen", "qwen"])
    with pytest.raises(ConfigurationError, match="never downloads"):
        PromptEncoder(tmp_path)
    with pytest.raises(TypeError):
        Sidecar("router", backends=BACKENDS)  # type: ignore[arg-type]
    for bad in ("llama", [3]):
        with pytest.raises(ConfigurationError, match="base_models"):
            Sidecar(Router(), backends=BACKENDS, base_models=bad)  # type: ignore[arg-type]


def test_without_models_the_base_models_route_in_the_routers_own_namespace() -> None:
    router = Router(block_size=4)
    sidecar = Sidecar(router, backends=BACKENDS[:2], base_models=["llama"])
    router.store(BACKENDS[1], router.hasher.hash(ids(8)))  # as the base model's KV events write it
    for model, reason in [(None, "prefix"), ("llama", "prefix"), ("llama-lora", "miss")]:
        body = {"prompt_token_ids": ids(8), **({} if model is None else {"model": model})}
        answer = call(sidecar, "POST", "/route", body).json()
        assert answer["reason"] == reason, model
        sidecar.finish(answer["id"])
    sidecar.base_models = frozenset()  # learned later, or never: every named model is its own namespace
    assert call(sidecar, "POST", "/route", {"prompt_token_ids": ids(8), "model": "llama"}).json()["reason"] == "miss"


@pytest.mark.parametrize("models", [None, ["llama", "qwen"]])
@pytest.mark.parametrize(("path", "prompt"), [("/route", "prompt_token_ids"), ("/v1/completions", "prompt")])
def test_an_empty_model_routes_as_the_base_model_as_vllm_serves_it(models: list[str] | None, path: str,
                                                                    prompt: str) -> None:  # fmt: skip
    """vLLM serves a request whose model is "" with its base model (its _is_model_supported: no name), whose KV
    events land in the router's own namespace. The sidecar routed it in a namespace "" of its own, where nothing is
    ever cached (a miss each time), and with --models refused it (404, so the gateway sent it unrouted)."""
    router = Router(block_size=4)
    sidecar = Sidecar(router, backends=BACKENDS[:2], models=models, base_models=["llama"])
    router.store(BACKENDS[1], router.hasher.hash(ids(8)))  # as the base model's KV events write it
    reply = call(sidecar, "POST", path, {prompt: ids(8), "model": ""})
    assert reply.status_code == 200, reply.text
    assert (reply.json()["backend"], reply.json()["reason"]) == (BACKENDS[1], "prefix")


def test_the_base_model_learner_reads_cards_without_a_parent_and_skips_bad_backends(
    refused_port: Callable[[], int],
) -> None:
    from prefixroute.adapters.serve.cli import BaseModelLearner
    from prefixroute.testing.openai_engine import OpenAIEngine

    engine = OpenAIEngine(model="llama", lora_adapters=["sql-lora"]).start()
    dead = f"http://127.0.0.1:{refused_port()}"
    try:
        learned: list[frozenset[str]] = []
        learner = BaseModelLearner([dead, engine.url], learned.append, timeout=1.0)
        assert learner.ask() == frozenset({"llama"})
        learner.start()
        deadline = time.monotonic() + 10
        while not learned and time.monotonic() < deadline:
            time.sleep(0.01)
        assert learned == [frozenset({"llama"})]
        assert BaseModelLearner([dead], learned.append, timeout=1.0).ask() is None
    finally:
        engine.stop()


def test_a_base_model_learner_runs_once_and_says_so_when_started_again(refused_port: Callable[[], int]) -> None:
    """Was: a second start() raised Python's own RuntimeError, and a start() after stop() started a thread that ended
    at once, so nothing was ever learned, silently."""
    from prefixroute.adapters.serve.cli import BaseModelLearner

    dead = f"http://127.0.0.1:{refused_port()}"
    running = BaseModelLearner([dead], lambda names: None, interval=60.0, timeout=1.0)
    running.start()
    stopped = BaseModelLearner([dead], lambda names: None, timeout=1.0)
    stopped.stop()
    try:
        for learner in (running, stopped):
            with pytest.raises(StateError, match=r"a BaseModelLearner starts once, and not after stop\(\)"):
                learner.start()
    finally:
        running.stop()


def test_the_base_model_learner_asks_again_until_a_backend_answers_and_skips_a_silent_one() -> None:
    """A backend down at start is asked again every ``interval`` s (10, as ``prefixroute serve`` documents), and one
    that accepts but never answers costs ``timeout`` s, not a learner stuck for good."""
    from prefixroute.adapters.serve.cli import BaseModelLearner
    from prefixroute.testing.openai_engine import OpenAIEngine

    assert inspect.signature(BaseModelLearner).parameters["interval"].default == 10.0
    engine = OpenAIEngine(model="llama").start()
    engine.refuse()
    asked, learned = threading.Event(), threading.Event()

    class Watched(BaseModelLearner):
        def ask(self) -> frozenset[str] | None:
            names = super().ask()
            asked.set()
            return names

    with socket.socket() as silent:  # listens, so a connection is taken (in the backlog), and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        learner = Watched([f"http://127.0.0.1:{silent.getsockname()[1]}", engine.url], lambda _: learned.set(),
                          interval=0.01, timeout=0.2)  # fmt: skip
        try:
            learner.start()
            assert asked.wait(DEADLINE_S), "the first ask never ended: the silent backend held it"
            assert not learned.is_set()
            engine.accept()
            assert learned.wait(DEADLINE_S), "the learner did not ask again"
        finally:
            learner.stop()
            engine.stop()


def test_stopping_the_base_model_learner_cuts_its_request_short_and_nothing_is_learned_after() -> None:
    """``stop()`` only set a flag: the thread went on waiting for a slow backend's ``/v1/models`` (up to ``timeout``
    s per backend, after ``prefixroute serve`` had returned) and then called ``learned`` anyway. It cuts the request
    short, the thread has ended when it returns, and the answer that comes later is never learned."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from prefixroute.adapters.serve.cli import BaseModelLearner

    asked, release = threading.Event(), threading.Event()
    answering: list[threading.Thread] = []  # the server's own

    class SlowModels(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            answering.append(threading.current_thread())
            asked.set()
            release.wait(60)  # far past the test's deadline: only stop() can end the learner's wait for it
            body = json.dumps({"object": "list", "data": [{"id": "llama", "object": "model"}]}).encode()
            with contextlib.suppress(OSError):  # the learner hung up
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), SlowModels)
    serving = threading.Thread(target=server.serve_forever, name="test-slow-models", daemon=True)
    serving.start()
    learned: list[frozenset[str]] = []
    try:
        before = set(threading.enumerate())
        learner = BaseModelLearner([f"http://127.0.0.1:{server.server_port}"], learned.append, timeout=60)
        learner.start()
        assert asked.wait(DEADLINE_S), "the learner never asked"
        returns(learner.stop, what="stop() with a request in flight")
        assert [t.name for t in threading.enumerate() if t not in before and t not in answering] == []
    finally:
        release.set()
        server.shutdown()
        server.server_close()
        serving.join(DEADLINE_S)
    assert learned == []  # the slow answer came after stop(): the thread that would have learned it has ended


BAD_URLS: list[tuple[str, str]] = [
    ("http://a\n:1", "control character"),
    ("http://a:1\r", "control character"),
    ("http://user:pw@b:2", "credentials"),
    ("http://c:3?x=1", "query or fragment"),
    ("http://c:3#top", "query or fragment"),
    ("http://gpü0:8000", "non-ASCII"),
]


@pytest.mark.parametrize(("url", "message"), BAD_URLS)
def test_a_backend_url_that_would_break_a_header_or_leak_is_refused(url: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        Sidecar(Router(), backends=[BACKENDS[0], url])


def deep(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


# Deeper than any Python's limit: msgspec recurses to sys.getrecursionlimit() (1,000) up to Python 3.11, to the C
# recursion limit (~10,000) from 3.12 on.
DEEP_BODIES: list[tuple[str, bytes]] = [
    ("/finish", b'{"id": "a", "x": ' + deep(100_000) + b"}"),  # 200 KB, an ignored field
    ("/first_token", b'{"id": "a", "x": ' + deep(100_000) + b"}"),
    ("/route", b'{"prompt_token_ids": [1], "x": ' + deep(200_000) + b"}"),
    ("/route", b'{"x": ' + b'{"a":' * 100_000 + b"1" + b"}" * 100_000 + b', "prompt_token_ids": [1]}'),
    ("/v1/completions", b'{"prompt": ' + deep(100_000) + b"}"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": ' + deep(100_000) + b"}]}"),
]


def test_json_nested_too_deep_is_a_400_saying_so_and_counted() -> None:
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS)
    for path, raw in DEEP_BODIES:
        reply = call(sidecar, "POST", path, raw=raw)
        assert reply.status_code == 400, (path, reply.text)
        assert reply.headers["content-type"] == "application/json"
        assert "nests arrays or objects deeper than" in reply.json()["error"], path
    stats = call(sidecar, "GET", "/stats").json()
    assert stats["bad_requests"] == {"400": len(DEEP_BODIES)} and stats["in_flight_total"] == 0
    assert sidecar.router.stats().decisions == 0 and stats["unknown_finishes"] == 0


@pytest.mark.parametrize(
    ("path", "raw"),
    [
        ("/route", b'{"prompt": "SELECT \\ud800 name"}'),
        ("/finish", b'{"id": "\\udc00"}'),
        ("/v1/completions", b'{"prompt": "a\\ud83d"}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}'),
    ],
)
def test_a_lone_surrogate_escape_is_named_in_the_error(path: str, raw: bytes) -> None:
    reply = call(Sidecar(Router(), backends=BACKENDS), "POST", path, raw=raw)
    assert reply.status_code == 400
    assert "lone UTF-16 surrogate escape" in reply.json()["error"]
    assert "truncated" not in reply.json()["error"]


def test_a_surrogate_pair_is_text_and_other_bad_json_keeps_its_message(model_dir: Path) -> None:
    sidecar = Sidecar(Router(), backends=BACKENDS, encoder=PromptEncoder(model_dir))
    assert call(sidecar, "POST", "/route", raw=b'{"prompt": "SELECT \\ud83d\\ude00"}').status_code == 200
    for raw in (b'{"prompt": "\\ud800", }', b'{"prompt": "\\ud800", "x": NaN}', b'{"prompt": "\\ud800'):
        reply = call(sidecar, "POST", "/route", raw=raw)
        assert reply.status_code == 400 and "not valid JSON" in reply.json()["error"], raw


def test_expired_leases_stop_counting_in_metrics_and_stats_without_new_requests() -> None:
    clock = [0.0]
    sidecar = Sidecar(Router(block_size=4, clock=lambda: clock[0]), backends=BACKENDS, lease=5.0)
    for start in (0, 100):
        assert call(sidecar, "POST", "/route", {"prompt_token_ids": ids(8, start)}).status_code == 200
    assert call(sidecar, "GET", "/stats").json()["in_flight_total"] == 2
    clock[0] = 6.0  # both leases are over; nothing else arrives
    lines = call(sidecar, "GET", "/metrics").text.splitlines()
    assert [line for line in lines if line.startswith("prefixroute_in_flight{")] == [
        f'prefixroute_in_flight{{backend="{backend}"}} 0' for backend in BACKENDS
    ]
    assert "prefixroute_leases_expired_total 2" in lines
    stats = call(sidecar, "GET", "/stats").json()
    assert (stats["in_flight_total"], stats["leases_expired"]) == (0, 2)
    assert set(stats["in_flight"].values()) == {0}


def test_metrics_list_per_request_backends_only_once_routed_and_the_4096_latest() -> None:
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS)
    for body in ({"prompt_token_ids": [1], "backends": ["http://dup:1", "http://dup:1"]},
                 {"prompt_token_ids": [1, -5], "backends": ["http://bad-tokens:1"]},
                 {"prompt_token_ids": [1], "backends": ["http://not-routed:1"], "model": 3}):  # fmt: skip
        assert call(sidecar, "POST", "/route", body).status_code == 400
    text = call(sidecar, "GET", "/metrics").text
    assert "dup" not in text and "bad-tokens" not in text and "not-routed" not in text
    assert set(call(sidecar, "GET", "/stats").json()["in_flight"]) == set(BACKENDS)
    many = [f"http://junk-{i}:1" for i in range(5000)]  # in two requests: one may list at most 4096
    chosen = [call(sidecar, "POST", "/route", {"prompt_token_ids": [1], "backends": half}).json()["backend"]
              for half in (many[:2500], many[2500:])]  # fmt: skip
    assert call(sidecar, "POST", "/route", {"prompt_token_ids": [2], "backends": ["http://late:1"]}).status_code == 200
    text = call(sidecar, "GET", "/metrics").text
    assert text.count("prefixroute_in_flight{") == 3 + 4096 and "late:1" in text and all(c in text for c in chosen)
    listed = call(sidecar, "GET", "/stats").json()["in_flight"]
    assert len(listed) == 3 + 4096 and [listed[c] for c in chosen] == [1, 1]  # in flight: kept; idle: forgotten
    assert sidecar.router.stats().in_flight == 3


def test_only_a_long_text_prompt_is_tokenized_on_a_worker_thread(model_dir: Path, thread_hops: list[int]) -> None:
    hops = thread_hops
    encoder = PromptEncoder(model_dir)
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS, encoder=encoder)
    short, long = CORPUS[0], CORPUS[0] * 1000  # 70 KB: over the 64 KiB inline limit
    for payload in ({"prompt": short}, {"messages": [{"role": "user", "content": short}]},
                    {"prompt_token_ids": [i % 100 for i in range(20_000)]}):  # fmt: skip
        assert call(sidecar, "POST", "/route", payload).status_code == 200
    assert hops == []
    assert call(sidecar, "POST", "/route", {"prompt": long}).json()["prompt_tokens"] == len(encoder.encode(long))
    assert call(sidecar, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": long}]}).json()[
        "prompt_tokens"
    ] == len(encoder.encode_chat([{"role": "user", "content": long}]))
    assert hops == [len(long), 1]  # the text, then the one message
    assert call(sidecar, "POST", "/route", {"prompt": long, "model": "x"}).status_code == 200


@pytest.mark.parametrize("path", ["/route", "/v1/completions"])
@pytest.mark.parametrize("leaves", ["while tokenizing", "once decided", "seen as decided"])
def test_a_client_that_leaves_before_its_answer_leaves_nothing_in_flight(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, path: str, leaves: str
) -> None:
    """Once the whole body is read, the sidecar notices a client that leaves while a long text is tokenized: it
    decides nothing, or finishes (refused) what it decided, instead of counting it until the lease (600 s).

    "seen as decided": the server sees the client leave in the loop turn that ends the decision, its wake-up queued
    behind the decision's own, as uvicorn does when the tokenizer held the GIL (the loop then handles the client's FIN
    and the thread's result together); uvicorn drops an answer sent then, unseen."""
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS, encoder=PromptEncoder(model_dir))
    body = json.dumps({"prompt": CORPUS[0] * 1000}).encode()  # over the 64 KiB inline limit: a worker thread
    sent: list[dict[str, Any]] = []

    async def go() -> None:
        gone = asyncio.Event()
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop()
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: MutableMapping[str, Any]) -> None:
            sent.append(dict(message))

        async def to_thread(function: Any, *args: Any) -> Any:
            if leaves == "while tokenizing":
                gone.set()
                await asyncio.sleep(3600)  # cancelled when the sidecar sees the client leave
            result = function(*args)
            if leaves == "once decided":
                gone.set()  # the client leaves as the decision is made, before it can read the answer
                await asyncio.sleep(0)
            else:  # seen a few callbacks later, after the decision's task has ended and woken the sidecar
                loop = asyncio.get_running_loop()
                loop.call_soon(loop.call_soon, gone.set)
            return result

        monkeypatch.setattr("prefixroute.adapters.serve.app.asyncio.to_thread", to_thread)
        scope = {"type": "http", "method": "POST", "path": path, "headers": []}
        await asyncio.wait_for(sidecar(scope, receive, send), 10)

    asyncio.run(go())
    assert sent == []  # no one to answer
    stats = sidecar.router.stats()
    assert stats.in_flight == 0
    assert stats.decisions == (0 if leaves == "while tokenizing" else 1)


def test_a_long_prompt_whose_client_stays_is_answered(model_dir: Path) -> None:
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS, encoder=PromptEncoder(model_dir))
    reply = call(sidecar, "POST", "/route", {"prompt": CORPUS[0] * 1000})
    assert reply.status_code == 200 and sidecar.router.stats().in_flight == 1


@given(st.lists(st.sampled_from(["route", "finish", "first_token", "finish_unknown", "bad"]), max_size=30))
@settings(max_examples=60, deadline=None)
def test_any_sequence_of_calls_leaves_in_flight_equal_to_unfinished_routes(calls: list[str]) -> None:
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS)
    open_ids: list[str] = []
    for i, what in enumerate(calls):
        if what == "route":
            open_ids.append(sidecar.route(json.dumps({"prompt_token_ids": ids(8, i)}).encode()).id)
        elif what in ("finish", "first_token") and open_ids:
            decision_id = open_ids[-1]
            (sidecar.finish if what == "finish" else sidecar.first_token)(decision_id)
            if what == "finish":
                open_ids.pop()
        elif what == "finish_unknown":
            sidecar.finish(f"unknown-{i}")
        else:
            with pytest.raises(Exception, match="exactly one"):
                sidecar.route(b"{}")
    assert sidecar.router.stats().in_flight == len(open_ids)
    assert sum(sidecar.router.in_flight(b) for b in BACKENDS) == len(open_ids)


def test_a_refused_finish_forgets_the_prediction_and_a_plain_one_keeps_it() -> None:
    sidecar = Sidecar(Router(block_size=16), backends=BACKENDS)
    kept, forgotten = ids(64), ids(64, start=1000)
    for prompt, body in ((kept, {}), (forgotten, {"refused": True})):
        answer = call(sidecar, "POST", "/route", {"prompt_token_ids": prompt}).json()
        assert call(sidecar, "POST", "/finish", {"id": answer["id"], **body}).json() == {"id": answer["id"]}
    for prompt, expected in ((kept, 64), (forgotten, 0)):
        again = call(sidecar, "POST", "/route", {"prompt_token_ids": prompt}).json()
        assert again["matched_tokens"] == expected
        call(sidecar, "POST", "/finish", {"id": again["id"]})
    for bad in (b'{"id": "a", "refused": 1}', b'{"id": "a", "refused": "yes"}', b'{"id": "a", "refused": null}'):
        reply = call(sidecar, "POST", "/finish", raw=bad)
        assert reply.status_code == 400 and "refused" in reply.json()["error"]
    assert sidecar.router.stats().in_flight == 0


def test_a_release_line_with_a_4xx_status_finishes_the_request_refused() -> None:
    assert [refused(line) for line in (b"status=400", b"x status=429 y", b"status=499", b"status=500")] == [
        True, True, False, False]  # fmt: skip
    assert not any(map(refused, (b"status=4000", b"upstream_status=400", b"prefixroute_finish=a", b"status=40")))
    for status in ("400", True, 400.0, None):
        with pytest.raises(TypeError, match="an HTTP status is an int"):
            is_refusal(status)  # type: ignore[arg-type]
    for line, kind in (("status=400", "str"), (None, "NoneType")):  # was: Python's own TypeError from the regex
        with pytest.raises(InvalidTypeError, match=f"line must be bytes, not {kind}"):
            refused(line)  # type: ignore[arg-type]
    assert refused(bytearray(b"status=404")) and refused(memoryview(b"status=404"))  # type: ignore[arg-type]
    sidecar = Sidecar(Router(block_size=16), backends=BACKENDS)
    decisions = [call(sidecar, "POST", "/route", {"prompt_token_ids": ids(64, start=s)}).json() for s in (0, 500)]
    # Two log lines in one datagram, each with its own status: only the refused one forgets its blocks.
    statuses = zip(decisions, (200, 400), strict=True)
    lines = [f"<190>nginx: prefixroute_finish={d['id']} status={status}".encode() for d, status in statuses]
    ReleaseProtocol(sidecar).datagram_received(b"\n".join(lines), ("127.0.0.1", 1))
    assert sidecar.router.stats().in_flight == 0
    matched = [call(sidecar, "POST", "/route", {"prompt_token_ids": ids(64, start=s)}).json() for s in (0, 500)]
    assert [m["matched_tokens"] for m in matched] == [64, 0]


def test_a_release_datagram_reports_first_tokens_and_finishes_via_udp_skipping_nginxs_empty_ids() -> None:
    """ReleaseProtocol: every release token of a line is applied to the sidecar, on the "udp" path; a ``-`` id
    (nginx's empty value) is skipped, and the tokens after it still count."""
    sidecar = Sidecar(Router(block_size=16), backends=BACKENDS)
    decision = call(sidecar, "POST", "/route", {"prompt_token_ids": ids(64)}).json()
    first = f"<190>nginx: prefixroute_first_token=- prefixroute_first_token={decision['id']}".encode()
    ReleaseProtocol(sidecar).datagram_received(first, ("127.0.0.1", 1))
    # A first token ends nothing.
    assert sidecar.router.stats().in_flight == 1 and sidecar.metrics.releases == {"udp": 1}
    last = f"<190>nginx: prefixroute_finish=- prefixroute_finish={decision['id']} status=200".encode()
    ReleaseProtocol(sidecar).datagram_received(last, ("127.0.0.1", 1))
    stats = sidecar.router.stats()
    assert (stats.in_flight, stats.ignored) == (0, 0)  # the "-" ids never reached the router
    assert sidecar.metrics.releases == {"udp": 2}
    assert sidecar.stats()["release_datagrams_unread"] == 0  # each datagram held a token
    for junk in (b"", b"\xff\xfe", b"<190>nginx: status=200", b"prefixroute_finish= status=200", b"\n\n"):
        ReleaseProtocol(sidecar).datagram_received(junk, ("127.0.0.1", 1))
    assert sidecar.stats()["release_datagrams_unread"] == 5 and sidecar.metrics.releases == {"udp": 2}
    assert "prefixroute_release_datagrams_unread_total 5\n" in call(sidecar, "GET", "/metrics").text


def test_a_release_line_of_thousands_of_tokens_reads_its_status_once_and_its_first_tokens_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Anyone who reaches the release port can send a 64 KB line of 2,800 tokens: the line's status was searched once
    per token (3.4 s of the sidecar's loop for one datagram, no decision made meanwhile). It is read once a line, and
    a line's first 16 tokens only (a gateway's carries one or two)."""
    from prefixroute.adapters.serve import release

    searches: list[bytes] = []

    def searched(line: bytes) -> bool:
        searches.append(line)
        return False

    monkeypatch.setattr(release, "refused", searched)
    sidecar = Sidecar(Router(block_size=16), backends=BACKENDS)
    decisions = [
        call(sidecar, "POST", "/route", {"prompt_token_ids": ids(64, start=100 * i)}).json() for i in range(20)
    ]
    line = b"<190>nginx: " + b" ".join(f"prefixroute_finish={d['id']}".encode() for d in decisions) + b" status=200"
    ReleaseProtocol(sidecar).datagram_received(line, ("127.0.0.1", 1))
    assert len(searches) == 1 and sidecar.router.stats().in_flight == 4  # 16 of the 20 finished
    assert sidecar.metrics.releases == {"udp": 16}


def test_the_release_listener_logs_an_icmp_error_at_debug_and_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="prefixroute.adapters.serve.release"):
        ReleaseProtocol(Sidecar(Router(), backends=BACKENDS)).error_received(ConnectionRefusedError("port closed"))
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.DEBUG, "release listener: port closed")]


def test_a_release_listener_for_something_else_than_a_sidecar_is_refused_when_made() -> None:
    """Not in the event loop at each datagram (logged there, and every request released over UDP left in flight)."""
    with pytest.raises(InvalidTypeError, match="^ReleaseProtocol takes a Sidecar, not Router$"):
        ReleaseProtocol(Router())  # type: ignore[arg-type]


def test_release_lines_are_parsed_from_any_syslog_format() -> None:
    line = b"<190>Dec  1 08:13:13 haproxy[1]: prefixroute_finish=ab-1 status=200 prefixroute_first_token=cd-2"
    assert release_ids(line) == [("finish", "ab-1"), ("first_token", "cd-2")]
    assert release_ids(b"prefixroute_finish=- status=400") == [("finish", "-")]
    assert release_ids(b"nothing here") == []


# -- the command ------------------------------------------------------------------------------------------------------


def serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "prefixroute", "serve", *args], capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tokenizer", "/no/such/tokenizer.json"], "not found"),
        (["--backends", "gpu0"], "not an http(s):// URL"),
        (["--backends", "http://gpu0:8000/v1"], "has a path: give each engine's scheme, host and port only"),
        (["--port", "65536"], "argument --port: expected a port number 0-65535, not '65536'"),
        (["--port", "http"], "argument --port: expected a port number 0-65535, not 'http'"),
        (["--host", ""], "--host"),
        (["--host", "local host"], "--host"),
        (["--lease", "0"], "argument --lease: expected a positive number of seconds, not '0'"),
        (["--lease", "inf"], "argument --lease: expected a positive number of seconds, not 'inf'"),
        (["--lease", "ten"], "argument --lease: expected a positive number of seconds, not 'ten'"),
        (["--policy", "nope"], "nope"),
        (["--policy-option", "factor"], "--policy-option takes KEY=VALUE, like factor=1.5, not 'factor'"),
        (["--policy-option", "1x=2"], "--policy-option takes KEY=VALUE, like factor=1.5, not '1x=2'"),
        (["--models", " "], "models must name models, not [' ']: a name is blank"),  # was accepted
        (["--models", "llama", ""], "not ['llama', '']: a name is blank"),  # an unset "$MODEL": was "non-empty list"
        # Was served, the repeated name dropped without a word: a typo for another model (or "$MODEL $MODEL").
        (["--port", "0", "--models", "llama", "qwen", "llama"], "models names 'llama' twice: name each model once"),
        (["--policy-option", "kv_cap=0.5", "--policy-option", "kv_cap=0.6"], "--policy-option kv_cap is given twice"),
        (  # the one given twice is named, not the first one given
            ["--policy-option", "use_speed=true", "--policy-option", "kv_cap=0.5", "--policy-option", "kv_cap=0.6"],
            "--policy-option kv_cap is given twice",
        ),
        (
            [
                "--backends",
                "http://a:1",
                "http://b:1",
                "--kv-events",
                "http://a:1=tcp://a:5557",
                "http://b:1=tcp://b:5557",
                "http://b:1/=tcp://b:5558",
            ],
            "--kv-events names backend 'http://b:1' twice",
        ),  # fmt: skip
        (["--backends", "http://a:1", "--kv-events", "http://b:1=tcp://b:5557"], "not one of --backends"),
        (["--backends", "http://a:1", "--data-parallel-size", "2"], "needs --kv-events"),
        (
            ["--backends", "http://a:1", "--kv-events", "http://a:1=tcp://a:5557", "--data-parallel-size", "0"],
            "--data-parallel-size: expected a whole number >= 1, not '0'",  # the benchmarks' check (prefixroute.cli)
        ),  # fmt: skip
        (["--block-size", "16.0"], "--block-size: expected a whole number >= 1, not '16.0'"),
        (["--max-body-mib", "0"], "--max-body-mib: expected a whole number >= 1, not '0'"),
        (["--max-body-mib", "1.5"], "--max-body-mib: expected a whole number >= 1"),
        (["--max-body-mib", "4097"], "--max-body-mib: expected a whole number of MiB from 1 to 4096, not '4097'"),
    ],
)
def test_bad_command_lines_exit_2_with_one_line(args: list[str], message: str) -> None:
    done = serve(*args)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and message in done.stderr
    assert done.stderr.startswith("prefixroute serve")


def test_the_body_limit_is_the_operators_to_set(tmp_path: Path) -> None:
    """``--max-body-mib`` sets the sidecar's limit (32 MiB without it, the constructor's default): a body past it is
    a 413 that routes nothing, as a gateway whose own limit was raised for long contexts needs it raised too."""
    assert inspect.signature(Sidecar).parameters["max_body_bytes"].default == 32 * 2**20
    port = free_port()
    prompt = {"prompt_token_ids": list(range(1000, 1000 + 200_000))}  # about 1.4 MB of JSON
    body = json.dumps(prompt).encode()
    assert 2**20 < len(body) < 2 * 2**20
    for mib, status in ((1, 413), (2, 200)):
        with start_sidecar(tmp_path, BACKENDS, port=port, options=["--max-body-mib", str(mib)]):
            reply = httpx.post(f"http://127.0.0.1:{port}/route", content=body, timeout=30)
            assert reply.status_code == status, reply.text[:200]
            decisions = httpx.get(f"http://127.0.0.1:{port}/stats").json()["decisions"]
            assert sum(decisions.values()) == (status == 200)


def test_requests_whose_gateway_gave_up_on_a_stalled_sidecar_are_not_left_in_flight(tmp_path: Path) -> None:
    """Was: each stayed in flight until its lease (600 s by default), load that skewed routing for the whole lease.
    While the sidecar is stopped (a pause, a starved CPU) a gateway sends requests and gives up on them (nginx's
    proxy_read_timeout, HAProxy's Lua socket timeout: it closes the connection); resumed, the sidecar read each one
    and its close together, decided them, and answered no one. Real loopback sockets, as a gateway's."""
    port = free_port()
    raw = json.dumps({"prompt_token_ids": ids(64)}).encode()
    head = b"POST /route HTTP/1.1\r\nhost: sidecar\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
    with start_sidecar(tmp_path, BACKENDS, port=port, options=["--lease", "60"]) as process:
        os.kill(process.pid, signal.SIGSTOP)
        try:
            clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
            for client in clients:
                client.sendall(head % len(raw) + raw)
            clients[0].shutdown(socket.SHUT_WR)  # its FIN alone: the sidecar could not answer it either
            for client in clients[1:]:
                client.close()
        finally:
            os.kill(process.pid, signal.SIGCONT)
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: sum(httpx.get(f"{url}/stats").json()["decisions"].values()) == 4)
        assert httpx.get(f"{url}/stats").json()["in_flight_total"] == 0
        clients[0].close()
        answer = httpx.post(f"{url}/route", content=raw).json()  # a client that waits is answered, as a first
        assert (answer["reason"], httpx.get(f"{url}/stats").json()["in_flight_total"]) == ("miss", 1)


@pytest.mark.parametrize("level", ["info", "error"])
def test_the_log_level_says_what_is_logged(level: str, tmp_path: Path) -> None:
    """``--log-level`` sets prefixroute's level: at ``info`` the base model learned from the backends is logged, one
    line that says whose it is; at ``error``, the default, it is not."""
    from prefixroute.testing.openai_engine import OpenAIEngine

    engine = OpenAIEngine(model="llama").start()
    port = free_port()
    try:
        with start_sidecar(tmp_path, [engine.url], port=port, options=["--log-level", level]) as process:
            url = f"http://127.0.0.1:{port}/route"
            httpx.post(url, json={"prompt_token_ids": ids(32)})  # in the base namespace
            deadline = time.monotonic() + DEADLINE_S
            # Learned once "llama" routes in the base namespace too (its prompt matches there): logged by then. Each
            # probe is finished refused, so the router forgets what it predicted for it: it cannot match itself.
            while True:
                probe = httpx.post(url, json={"prompt_token_ids": ids(32), "model": "llama"}).json()
                httpx.post(f"http://127.0.0.1:{port}/finish", json={"id": probe["id"], "refused": True})
                if probe["matched_tokens"]:
                    break
                assert time.monotonic() < deadline, "the base model was never learned"
                time.sleep(0.02)
            line = "prefixroute serve: INFO base models of the backends: ['llama']"
            assert (line in process.output().splitlines()) == (level == "info"), process.output()  # a line of its own
    finally:
        engine.stop()


@pytest.mark.parametrize("level", ["warning", "error"])
def test_uvicorns_lines_follow_the_log_level_and_say_whose_they_are(level: str, tmp_path: Path) -> None:
    """uvicorn's loggers were set to ``warning`` whatever ``--log-level`` said: at the default, ``error``, any client
    could write a ``WARNING:  Invalid HTTP request received.`` line per malformed request, without the sidecar's
    prefix. They follow ``--log-level`` now, in the sidecar's format."""
    port = free_port()
    with start_sidecar(tmp_path, BACKENDS, port=port, options=["--log-level", level]) as process:
        with socket.create_connection(("127.0.0.1", port)) as client:
            client.sendall(b"POST /route HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")
            assert client.recv(65536).startswith(b"HTTP/1.1 400 ")
        # A request answered after the bad one: its warning, if any, was written before.
        assert httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200
        line = "prefixroute serve: WARNING Invalid HTTP request received."
        if level == "warning":
            wait_until(lambda: line in process.output().splitlines(), what="the warning")
        else:
            assert "Invalid HTTP request" not in process.output(), process.output()


def test_policy_options_reach_the_policy_as_numbers_and_flags(tmp_path: Path) -> None:
    """``--policy-option`` values are ints, floats, ``true``/``false`` (a flag, such as PredictedTTFT's
    ``use_speed``: before, no value reached it as True) or else text; the announcement shows the policy built."""
    port = free_port()
    options = ["--policy-option", "use_speed=true", "--policy-option", "kv_cap=0.5"]
    with start_sidecar(tmp_path, BACKENDS, port=port, options=options) as process:
        assert "policy PredictedTTFT(kv_cap=0.5, use_speed=True)" in process.output(), process.output()


@pytest.mark.parametrize("fleet", [[], ["--metrics-from-backends"]], ids=["alone", "with-a-fleet"])
def test_the_options_given_reach_the_router_and_the_sidecar(fleet: list[str], tmp_path: Path) -> None:
    """``--block-size``, ``--policy`` with its options, ``--lease``, ``--models`` and ``--accel-redirect`` are the
    ones the sidecar routes with, whether alone or with a :class:`~prefixroute.vllm.Fleet`
    (``--metrics-from-backends``, which builds its router apart): 8 tokens are two blocks of 4 that the next prompt
    matches (none with vLLM's 16), another model than those given is refused, a pick redirects to the location
    given, and requests never finished leave the count once their lease ends."""
    from prefixroute.testing.openai_engine import OpenAIEngine

    with OpenAIEngine(model="llama") as engine0, OpenAIEngine(model="llama") as engine1:
        port = free_port()
        options = ["--block-size", "4", "--policy", "bounded-load", "--policy-option", "factor=3", "--lease", "0.5",
                   "--models", "llama", "--accel-redirect", "@elsewhere", *fleet]  # fmt: skip
        with start_sidecar(tmp_path, [engine0.url, engine1.url], port=port, options=options) as process:
            assert "policy BoundedLoad(factor=3.0)" in process.output(), process.output()
            url = f"http://127.0.0.1:{port}"
            first = httpx.post(f"{url}/route", json={"prompt_token_ids": ids(8)}).json()
            again = httpx.post(f"{url}/route", json={"prompt_token_ids": ids(9)}).json()
            assert (again["backend"], again["reason"], again["matched_tokens"]) == (first["backend"], "prefix", 8)
            other = httpx.post(f"{url}/route", json={"prompt_token_ids": ids(8), "model": "qwen"})
            assert other.status_code == 404, other.text
            pick = httpx.post(f"{url}/v1/completions", json={"model": "llama", "prompt": ids(8)})
            assert pick.status_code == 200 and pick.headers["x-accel-redirect"] == "@elsewhere", pick.text
            wait_until(lambda: httpx.get(f"{url}/stats").json()["in_flight_total"] == 0, what="the leases to end")


def test_a_port_in_use_exits_2(tmp_path: Path) -> None:
    port = free_port()
    with start_sidecar(tmp_path, BACKENDS, port=port):
        done = serve("--port", str(port))
    assert done.returncode == 2
    assert done.stderr.endswith(f"cannot listen (HTTP) on 127.0.0.1:{port}: Address already in use\n"), done.stderr


def test_start_sidecar_on_a_port_another_sidecar_serves_raises_rather_than_hand_back_that_one(tmp_path: Path) -> None:
    """``start_sidecar`` returned once something on its port answered ``/healthz``: with another sidecar there (a
    port taken between ``free_port()`` and the start), it handed back a process about to exit with status 2, and the
    caller tested the other sidecar, with its options. It returns once its own sidecar says it listens."""
    port = free_port()
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    with start_sidecar(tmp_path / "first", BACKENDS, port=port) as first:
        with pytest.raises(RuntimeError, match=f"cannot listen \\(HTTP\\) on 127.0.0.1:{port}: Address already in use"):
            start_sidecar(tmp_path / "second", BACKENDS[:1], port=port)
        assert first.popen.poll() is None
        assert httpx.get(f"http://127.0.0.1:{port}/healthz").json()["backends"] == BACKENDS  # the first one still


def test_a_release_port_in_use_exits_2_even_where_its_holder_allows_reuse() -> None:
    """The UDP release port is bound without SO_REUSEADDR: were a holder that allows reuse (another sidecar, a
    syslog daemon) to share it, the kernel would hand each release line to one of them, and the other's requests
    would stay in flight until their lease."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", 0))
        port = holder.getsockname()[1]
        done = serve("--port", "0", "--release-port", str(port))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        f"prefixroute serve: error: cannot listen (UDP) on 127.0.0.1:{port}: Address already in use"
    ]


@pytest.mark.parametrize(("url", "message"), BAD_URLS)
def test_a_bad_backend_url_on_the_command_line_exits_2_with_one_line(url: str, message: str) -> None:
    done = serve("--port", "0", "--backends", BACKENDS[0], url)
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and message in done.stderr


def test_a_busy_ext_proc_port_exits_2_with_one_line_and_announces_nothing() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = serve("--port", "0", "--backends", BACKENDS[0], "--release-port", "0", "--ext-proc", str(port))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        f"prefixroute serve: error: cannot listen (ext_proc) on 127.0.0.1:{port}: Address already in use"
    ]


@pytest.mark.parametrize("spec", [BACKENDS[0], f"{BACKENDS[0]}=", "=tcp://10.0.0.1:5557", "="])
def test_a_kv_events_spec_missing_a_part_is_refused_with_one_line(
    spec: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from prefixroute.cli import main

    assert main(["serve", "--port", "0", "--backends", BACKENDS[0], "--kv-events", spec]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert f"--kv-events takes BACKEND=ENDPOINT[,REPLAY], like http://gpu0:8000=tcp://gpu0:5557, not {spec!r}" in err


@pytest.mark.parametrize("named", ["http://127.0.0.1:80", "HTTP://127.0.0.1/", "http://LOCALHOST:80"])
def test_kv_events_find_their_backend_however_the_url_is_spelt(named: str) -> None:
    # Was refused: "--kv-events names backend 'http://127.0.0.1:80', which is not one of --backends
    # ['http://127.0.0.1']", where --backends itself takes the two for one engine.
    from prefixroute.adapters.serve.cli import _kv_events

    backends = ["http://127.0.0.1", "http://localhost:8001", "http://localhost"]
    expected = "http://localhost" if "LOCALHOST" in named else "http://127.0.0.1"
    assert _kv_events(f"{named}=tcp://127.0.0.1:5557,tcp://127.0.0.1:5558", backends) == (
        expected,
        ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"),
    )
    with pytest.raises(ConfigurationError, match="^--kv-events names backend 'http://127.0.0.1:81', which is not"):
        _kv_events("http://127.0.0.1:81=tcp://127.0.0.1:5557", backends)


@pytest.mark.parametrize("late", ["release-port", "ext-proc", "kv-events"])
def test_a_command_refused_after_binding_leaves_no_socket_open(late: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``main()`` run in a process that goes on (a supervisor, a test): the listeners bound before a busy release or
    ext_proc port, or before a malformed KV-event endpoint was refused, were left open (ResourceWarning, and the
    port held until the garbage collector found them)."""
    from prefixroute.cli import main

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as busy_udp, socket.socket() as busy_tcp:
        busy_udp.bind(("127.0.0.1", 0))
        busy_tcp.bind(("127.0.0.1", 0))
        busy_tcp.listen()
        options = {
            "release-port": ["--release-port", str(busy_udp.getsockname()[1])],
            "ext-proc": ["--release-port", "0", "--ext-proc", str(busy_tcp.getsockname()[1])],
            "kv-events": ["--release-port", "0", "--kv-events", f"{BACKENDS[0]}=nonsense"],
        }[late]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            assert main(["serve", "--port", "0", "--backends", BACKENDS[0], "--models", "m", *options]) == 2
            gc.collect()
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert [str(warning.message) for warning in caught if warning.category is ResourceWarning] == []


@pytest.mark.parametrize(
    ("stop", "listeners"), [(signal.SIGTERM, "http, release, ext_proc"), (signal.SIGINT, "http")], ids=["TERM", "INT"]
)
def test_sigterm_or_sigint_stops_every_listener_and_exits_0(
    stop: signal.Signals, listeners: str, tmp_path: Path
) -> None:
    """Whichever listeners were asked for: the HTTP one alone too, which leaves the others' clean-up nothing to do."""
    port = free_port()
    options = ["--release-port", str(free_port(socket.SOCK_DGRAM)), "--ext-proc", "0"] if "release" in listeners else []
    with start_sidecar(tmp_path, BACKENDS, port=port, options=options) as process:
        assert httpx.post(f"http://127.0.0.1:{port}/route", json={"prompt_token_ids": ids(8)}).status_code == 200
        process.popen.send_signal(stop)
        assert process.popen.wait(20) == 0, process.output()
    assert "Traceback" not in process.output()
    # Each listener announced once.
    assert process.output().count("prefixroute serve: ") == len(listeners.split(", ")), process.output()


@pytest.mark.parametrize("count", [0, 1, 2])
def test_the_http_announcement_counts_the_backends_in_words(count: int, tmp_path: Path) -> None:
    """Was "(1 backends, policy ...)" for one."""
    port = free_port()
    with start_sidecar(tmp_path, BACKENDS[:count], port=port) as process:
        process.popen.send_signal(signal.SIGTERM)
        assert process.popen.wait(20) == 0, process.output()
    said = f"prefixroute serve: http://127.0.0.1:{port} ({count} backend{'' if count == 1 else 's'}, policy "
    assert said in process.output(), process.output()


def test_an_ipv6_host_serves_every_listener_and_announces_it_bracketed() -> None:
    """``--host ::1`` (an example of ``--host``'s own message): before, gRPC took ext_proc's ``::1:0`` for the
    address ::0.1.0.0, port 443, and the command ended with exit status 2 and two lines on stderr. Each listener is
    announced on stdout as soon as all are bound, for a supervisor reading a pipe."""
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:  # pragma: no cover - a host without IPv6 loopback
        pytest.skip("no IPv6 loopback here")
    command = [sys.executable, "-m", "prefixroute", "serve", "--host", "::1", "--port", "0", "--ext-proc", "0",
               "--release-port", "0"]  # fmt: skip
    # Without PYTHONUNBUFFERED, as a supervisor runs it: each announcement reaches the pipe while it serves.
    env = {name: value for name, value in os.environ.items() if name != "PYTHONUNBUFFERED"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    guard = threading.Timer(60, process.kill)  # a safety net, not a timing (as serve()): it announces or exits
    guard.start()
    try:
        assert process.stdout is not None
        lines = [process.stdout.readline() for _ in range(3)]
        assert [line.split(" on ")[0] for line in lines[:2]] == [
            "prefixroute serve: release listener",
            "prefixroute serve: ext_proc endpoint picker",
        ], (lines, process.stderr.read() if process.poll() is not None and process.stderr else "")
        ext_proc_port = int(lines[1].removeprefix("prefixroute serve: ext_proc endpoint picker on [::1]:"))
        http_port = int(lines[2].removeprefix("prefixroute serve: http://[::1]:").split(" ")[0])
        socket.create_connection(("::1", ext_proc_port), timeout=DEADLINE_S).close()
        assert httpx.get(f"http://[::1]:{http_port}/healthz", timeout=DEADLINE_S).status_code == 200  # serving
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate()
    finally:
        guard.cancel()
        process.kill()
        process.wait()
    assert process.returncode == 0 and err == "", err


@pytest.mark.parametrize("turns", [1, 2], ids=["before-its-transport", "before-connection-made"])
def test_shutdown_answers_or_drops_a_connection_accepted_just_before(turns: int) -> None:
    # asyncio gives an accepted connection its transport a loop turn after accepting it, and calls connection_made a
    # turn after that; uvicorn's shutdown closed the server and at once told the connections it knew of to close. One
    # accepted the turn before was lost unseen (CPython gh-109564): open, neither answered nor closed, until the
    # garbage collector found it. One accepted two turns before was never told: answered and kept alive, it held the
    # shutdown until its client left (for ever, for a gateway's pooled connection that sends nothing).
    from prefixroute.adapters.serve.cli import _http_server

    async def scenario() -> None:
        server = _http_server(Sidecar(Router(block_size=16), backends=BACKENDS))
        server.config.load()  # as uvicorn's serve() starts it, so that the test can stop it in a chosen turn
        server.lifespan = server.config.lifespan_class(server.config)
        with socket.create_server(("127.0.0.1", 0)) as listening:
            listening.setblocking(False)
            await server.startup(sockets=[listening])
            closing = None
            try:
                with socket.create_connection(listening.getsockname()) as client:  # the kernel completes it at once
                    client.setblocking(False)
                    for _ in range(turns):  # the loop's next turn accepts it, the one after gives its transport
                        await asyncio.sleep(0)
                    closing = asyncio.ensure_future(server.shutdown(sockets=[listening]))  # runs the turn after
                    await request_during_close(client, closing)  # answered or refused, and closed
            finally:
                if closing is not None:
                    closing.cancel()

    asyncio.run(scenario())


def test_a_request_the_http_parser_refuses_is_a_counted_400_in_json() -> None:
    """Bad framing (a chunk size that is no hex number, a Content-Length beside chunked or given twice, a TLS hello)
    was answered by uvicorn's own 400, a line of text/plain, uncounted; the contract answers bad input in JSON."""

    sidecar = Sidecar(Router(block_size=16), backends=BACKENDS)
    body = b'{"prompt_token_ids": [1, 2, 3]}'
    malformed = [
        b"POST /route HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n" + body + b"\r\n0\r\n\r\n",
        b"POST /route HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n1f\r\n" + body,
        b"POST /route HTTP/1.1\r\nHost: x\r\nContent-Length: 31\r\nContent-Length: 32\r\n\r\n" + body,
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(64),
    ]
    answers: list[bytes] = []

    async def exchange(loop: asyncio.AbstractEventLoop, address: Any, request: bytes) -> bytes:
        with socket.create_connection(address) as client:
            client.setblocking(False)
            await loop.sock_sendall(client, request)
            received = b""
            while chunk := await asyncio.wait_for(loop.sock_recv(client, 65536), 5):  # each is closed after its answer
                received += chunk
            return received

    async def scenario(loop: asyncio.AbstractEventLoop, address: Any) -> None:
        for request in malformed:
            answers.append(await exchange(loop, address, request))
        good = b"POST /route HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(body)
        answers.append(await exchange(loop, address, good + body))

    _serving(sidecar, scenario)
    for answer in answers[:-1]:
        head, _, payload = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400 ") and b"content-type: application/json" in head.lower(), answer
        assert json.loads(payload)["error"].startswith("the request is not valid HTTP/1.1"), payload
    assert answers[-1].startswith(b"HTTP/1.1 200 ") and json.loads(answers[-1].partition(b"\r\n\r\n")[2])["id"]
    assert sidecar.stats()["bad_requests"] == {"400": len(malformed)}


def test_a_request_that_asks_to_upgrade_is_served_as_http_1_1(caplog: pytest.LogCaptureFixture) -> None:
    """``Upgrade: h2c`` (``curl --http2``, Java's HttpClient) or ``websocket`` asks to switch protocols, which RFC
    9110 §7.8 lets a server ignore. httptools ended such a request at its head: uvicorn answered it without its body
    (400, "not valid JSON: Input data was truncated") and logged two warnings. Each is served as HTTP/1.1 now, its
    body whole whether it came with the head, after it, or in chunks, and a request pipelined after it is answered."""

    sidecar = Sidecar(Router(block_size=16), backends=BACKENDS)
    body = b'{"prompt_token_ids": [1, 2, 3]}'
    h2c = b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAoAAAAAIAAAAA\r\n"
    websocket = b"Connection: keep-alive, Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
    head = b"POST /route HTTP/1.1\r\nHost: x\r\n%sContent-Length: %d\r\n\r\n"
    chunked = b"POST /route HTTP/1.1\r\nHost: x\r\n%sTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
    last = b"POST /route HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    # Each connection: the pieces sent one after the other, the last request plain and closing the connection.
    connections = [
        [head % (h2c, len(body)) + body + last],
        [head % (h2c, len(body)), body[:10], body[10:] + last],
        [chunked % (h2c, len(body), body) + last],
        [head % (websocket, len(body)) + body + last],
    ]
    answers: list[bytes] = []

    async def exchange(loop: asyncio.AbstractEventLoop, address: Any, pieces: list[bytes]) -> bytes:
        with socket.create_connection(address) as client:
            client.setblocking(False)
            for piece in pieces:
                await loop.sock_sendall(client, piece)
                await asyncio.sleep(0.05)  # each piece read on its own
            received = b""
            while chunk := await asyncio.wait_for(loop.sock_recv(client, 65536), 5):
                received += chunk
            return received

    async def scenario(loop: asyncio.AbstractEventLoop, address: Any) -> None:
        for pieces in connections:
            answers.append(await exchange(loop, address, pieces))

    with caplog.at_level(logging.WARNING):
        _serving(sidecar, scenario)
    for answer in answers:
        assert answer.count(b"HTTP/1.1 200 ") == 2 and b"HTTP/1.1 101" not in answer, answer
    assert sidecar.stats()["decisions"] == {"miss": 2 * len(connections)}  # shorter than a block: never matched
    assert not [r for r in caplog.records if r.name.startswith("uvicorn")], caplog.text


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_body_over_the_limit_sent_whole_before_reading_gets_its_413(framing: str) -> None:
    """A client that writes its whole body before it reads (Node's http, Java's HttpClient; no ``Expect``) got a
    connection reset instead of the 413: the sidecar closed the connection with the body unread (7 to 11 in 12 such
    requests of 70 MB failed). It reads and drops the rest first, as aiohttp and nginx linger."""

    sidecar = Sidecar(Router(block_size=16), backends=BACKENDS, max_body_bytes=1000)
    body = b'{"prompt_token_ids": [' + b"1, " * (3 << 20) + b"1]}"  # 9 MiB: more than the sockets' buffers hold
    if framing == "chunked":
        head = b"POST /route HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        request = head + b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in _pieces(body, 1 << 16))
        request += b"0\r\n\r\n"
    else:
        request = b"POST /route HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    answers: list[bytes] = []

    async def scenario(loop: asyncio.AbstractEventLoop, address: Any) -> None:
        with socket.create_connection(address) as client:
            client.setblocking(False)
            await asyncio.wait_for(loop.sock_sendall(client, request), DEADLINE_S)  # all of it, then read
            received = b""
            while chunk := await asyncio.wait_for(loop.sock_recv(client, 65536), DEADLINE_S):
                received += chunk
            answers.append(received)

    _serving(sidecar, scenario)
    [answer] = answers
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"] == "the request body is over 1000 bytes"


def _pieces(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


def _serving(sidecar: Sidecar, scenario: Callable[[asyncio.AbstractEventLoop, Any], Any]) -> None:
    """Run ``scenario(loop, address)`` against ``sidecar`` served as ``prefixroute serve`` serves it (uvicorn with
    the sidecar's HTTP protocol) on a loopback socket."""
    from prefixroute.adapters.serve.cli import _http_server

    async def main() -> None:
        server = _http_server(sidecar)
        with socket.create_server(("127.0.0.1", 0)) as listening:
            listening.setblocking(False)
            serving = asyncio.ensure_future(server.serve(sockets=[listening]))
            while not server.started:
                await asyncio.sleep(0.01)
            try:
                await scenario(asyncio.get_running_loop(), listening.getsockname())
            finally:
                server.should_exit = True
                await asyncio.wait_for(serving, 10)

    asyncio.run(main())


def test_a_request_head_over_64_kib_is_a_431_before_it_is_all_read() -> None:
    """httptools takes a head of any size, at a cost that grows faster than it (a 64 MiB header: 2.8 s of CPU, and
    held while the client holds it back); nginx refuses one over 32 KiB. The sidecar answers 431 past 64 KiB."""
    sidecar = Sidecar(Router(block_size=16), backends=BACKENDS)
    answers: list[bytes] = []

    async def scenario(loop: asyncio.AbstractEventLoop, address: Any) -> None:
        with socket.create_connection(address) as client:
            client.setblocking(False)
            await loop.sock_sendall(client, b"POST /route HTTP/1.1\r\nHost: x\r\nX-Big: ")
            received = b""
            for _ in range(64):  # up to 1 MiB, 16 KiB at a time, until the sidecar answers
                with contextlib.suppress(ConnectionError):
                    await loop.sock_sendall(client, b"a" * (16 << 10))
                with contextlib.suppress(asyncio.TimeoutError):
                    received = await asyncio.wait_for(loop.sock_recv(client, 65536), 0.05)
                if received:
                    break
            while chunk := await asyncio.wait_for(loop.sock_recv(client, 65536), DEADLINE_S):
                received += chunk
            answers.append(received)

    async def whole(loop: asyncio.AbstractEventLoop, address: Any) -> None:  # the head in one write: one read
        with socket.create_connection(address) as client:
            client.setblocking(False)
            with contextlib.suppress(ConnectionError):
                await loop.sock_sendall(client, b"POST /route HTTP/1.1\r\nX-Big: " + b"a" * (100 << 10) + b"\r\n")
            received = b""
            while chunk := await asyncio.wait_for(loop.sock_recv(client, 65536), DEADLINE_S):
                received += chunk
            answers.append(received)

    async def pipelined(loop: asyncio.AbstractEventLoop, address: Any) -> None:  # heads small, bodies large
        body = b'{"prompt_token_ids": [' + b"1, " * (16 << 10) + b"1]}"
        one = b"POST /route HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        with socket.create_connection(address) as client:
            client.setblocking(False)
            await loop.sock_sendall(client, one[:20])
            await asyncio.sleep(0.05)  # the first head begun alone, the rest in one write
            await loop.sock_sendall(
                client, one[20:] + one + b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            )
            received = b""
            while chunk := await asyncio.wait_for(loop.sock_recv(client, 65536), DEADLINE_S):
                received += chunk
            answers.append(received)

    for run in (scenario, whole, pipelined):
        _serving(sidecar, run)
    for answer in answers[:2]:
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:100]
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"].startswith("the request's head is over 65536")
    assert answers[2].count(b"HTTP/1.1 200 ") == 3, answers[2][:300]  # the pipelined requests: no head too large
    assert sidecar.stats()["bad_requests"] == {"431": 2}


def test_a_connection_whose_request_stalls_is_closed_after_the_read_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """uvicorn times out only a connection idle after an answer: one that never sent a byte, a head or a body left
    unfinished held its connection (a descriptor) for ever. Each is closed once nothing has come for the read
    timeout (60 s, nginx's client_header_timeout; shortened here); a request answered meanwhile is not."""
    from prefixroute.adapters.serve import cli

    monkeypatch.setattr(cli, "_READ_TIMEOUT_S", 1.0)
    sidecar = Sidecar(Router(block_size=16), backends=BACKENDS)
    body = b'{"prompt_token_ids": [1, 2, 3]}'
    stalls = [
        b"",
        b"POST /route HTTP/1.1\r\nHost: x\r\nContent-Le",
        b"POST /route HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body) + 10, body),
    ]
    closed: list[bytes] = []

    async def scenario(loop: asyncio.AbstractEventLoop, address: Any) -> None:
        for sent in stalls:
            with socket.create_connection(address) as client:
                client.setblocking(False)
                await loop.sock_sendall(client, sent)
                closed.append(await asyncio.wait_for(loop.sock_recv(client, 65536), DEADLINE_S))
        with socket.create_connection(address) as client:  # a slow request that finishes within the timeout
            client.setblocking(False)
            whole = b"POST /route HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
            for piece in (whole[:20], whole[20:60], whole[60:]):
                await loop.sock_sendall(client, piece)
                await asyncio.sleep(0.1)  # well under the timeout between pieces
            closed.append(await asyncio.wait_for(loop.sock_recv(client, 65536), DEADLINE_S))

    _serving(sidecar, scenario)
    assert closed[:3] == [b"", b"", b""]  # closed, unanswered
    assert closed[3].startswith(b"HTTP/1.1 200 "), closed[3]
    assert sidecar.router.stats().decisions == 1


class _WaitsForHealthz:
    """A PromptEncoder whose ``encode`` tells that it started, then does not finish until /healthz has been
    answered (at most DEADLINE_S): run on the event loop, it would hold the loop, so /healthz could never be."""

    def __init__(self, encoder: PromptEncoder) -> None:
        self._encoder = encoder
        self.started = threading.Event()
        self.answered = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._encoder, name)

    def encode(self, text: str) -> list[int]:
        self.started.set()
        if not self.answered.wait(DEADLINE_S):
            raise AssertionError("/healthz was not answered while a long prompt was tokenized")
        return self._encoder.encode(text)


def test_a_long_text_prompt_does_not_hold_up_other_requests(model_dir: Path) -> None:
    """A text body over 64 KiB is tokenized on a worker thread, off the event loop, so other requests (here
    /healthz) are answered meanwhile. The encoder does not finish before /healthz is answered, so tokenizing on the
    loop fails this test whatever the machine's speed; it compared the two requests' wall-clock times (healthz under
    a quarter of the route's), a speed assertion a loaded machine could fail."""
    encoder = _WaitsForHealthz(PromptEncoder(model_dir))
    sidecar = Sidecar(Router(), backends=BACKENDS, encoder=encoder)  # type: ignore[arg-type]
    text = "".join(f"SELECT name, count(*) FROM orders{i} " for i in range(4000))  # 160 KB, over the 64 KiB

    async def go() -> tuple[httpx.Response, httpx.Response]:
        transport = httpx.ASGITransport(app=sidecar)  # the sidecar on this loop, as its server runs it
        async with httpx.AsyncClient(transport=transport, base_url="http://sidecar", timeout=600) as client:
            route = asyncio.create_task(client.post("/route", content=json.dumps({"prompt": text}).encode()))
            assert await asyncio.to_thread(encoder.started.wait, DEADLINE_S), "the prompt was never tokenized"
            health = await client.get("/healthz")
            encoder.answered.set()
            return await route, health

    route, health = asyncio.run(go())
    assert health.status_code == 200
    assert route.status_code == 200 and route.json()["prompt_tokens"] > 10_000, route.text


@pytest.fixture
def sidecar_url(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    with start_sidecar(tmp_path, BACKENDS, port=port):
        yield f"http://127.0.0.1:{port}"


def test_the_command_serves_the_contract(sidecar_url: str) -> None:
    with httpx.Client(base_url=sidecar_url) as client:
        decision = client.post("/route", json={"prompt_token_ids": ids(40)}).json()
        assert decision["backend"] in BACKENDS
        assert client.post("/finish", json={"id": decision["id"]}).status_code == 200
        assert client.post("/finish", json={"id": decision["id"]}).status_code == 200
        assert client.post("/route", content=b"{").status_code == 400
        too_deep = client.post("/finish", content=b'{"id": "a", "x": ' + deep(100_000) + b"}")  # under uvicorn too
        assert too_deep.status_code == 400 and "nests" in too_deep.json()["error"]
        assert "prefixroute_unknown_finishes_total 1" in client.get("/metrics").text


def test_two_replicas_following_kv_events_agree(tmp_path: Path) -> None:
    """Two sidecars that share nothing but the engines' KV events route a prefix to the engine that holds it."""
    from prefixroute.testing import FakeVLLM

    with FakeVLLM(block_size=16, seed=1) as engine0, FakeVLLM(block_size=16, seed=2) as engine1:
        engines = [engine0, engine1]
        urls = [engine.url for engine in engines]
        events = [f"{e.url}={e.endpoint},{e.replay_endpoint}" for e in engines]
        ports = [free_port(), free_port()]
        prefixes = [ids(64, 10_000), ids(64, 20_000)]
        with (
            start_sidecar(tmp_path, urls, port=ports[0], options=["--kv-events", *events]) as first,
            start_sidecar(tmp_path, urls, port=ports[1], options=["--kv-events", *events]),
        ):
            assert first.popen.poll() is None
            for engine, prefix in zip(engines, prefixes, strict=True):
                engine.complete(prefix)
            for port in ports:
                for engine, prefix in zip(engines, prefixes, strict=True):
                    url = f"http://127.0.0.1:{port}/route"
                    deadline = 100
                    while True:
                        answer = httpx.post(url, json={"prompt_token_ids": [*prefix, 1, 2, 3]}).json()
                        httpx.post(f"http://127.0.0.1:{port}/finish", json={"id": answer["id"]})
                        if answer["reason"] == "prefix" or deadline == 0:
                            break
                        deadline -= 1
                        time.sleep(0.05)
                    assert (answer["backend"], answer["reason"], answer["matched_tokens"]) == (engine.url, "prefix", 64)


def test_a_sidecar_started_late_replays_what_the_engine_cached_before(tmp_path: Path) -> None:
    """``--kv-events BACKEND=ENDPOINT,REPLAY``: the blocks an engine stored before the sidecar started reach it
    through the replay endpoint (once a live batch shows it missed some), so a sidecar restarted under load does
    not route the engine's cached prefixes as misses."""
    from prefixroute.testing import FakeVLLM

    with FakeVLLM(block_size=16, seed=3) as engine:
        earlier, later = ids(64, 40_000), ids(64, 50_000)
        engine.complete(earlier)  # before the sidecar listens: only a replay can tell it
        port = free_port()
        events = f"{engine.url}={engine.endpoint},{engine.replay_endpoint}"
        with start_sidecar(tmp_path, [engine.url], port=port, options=["--kv-events", events, "--models", "m"]):
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + DEADLINE_S
            answer: dict[str, Any] = {}
            while answer.get("reason") != "prefix":
                assert time.monotonic() < deadline, f"the earlier blocks never arrived: {answer}"
                engine.complete(later)  # a live batch: its sequence number shows the ones missed
                answer = httpx.post(f"{url}/route", json={"prompt_token_ids": [*earlier, 1]}).json()
                # Refused: the router forgets the blocks it predicted for this probe, so the next matches only
                # what the engine's events (the replay) reported.
                httpx.post(f"{url}/finish", json={"id": answer["id"], "refused": True})
            assert (answer["backend"], answer["matched_tokens"]) == (engine.url, 64)


def free_port_pair() -> int:
    """A port free on 127.0.0.1 now whose next port is free too: where a data-parallel server's ranks 0 and 1
    publish (vLLM offsets the configured port by the rank)."""
    while True:
        with socket.socket() as first, socket.socket() as second:
            first.bind(("127.0.0.1", 0))
            port: int = first.getsockname()[1]
            try:
                second.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port


def test_data_parallel_size_follows_the_kv_events_of_every_rank(tmp_path: Path) -> None:
    """``--data-parallel-size N``: each ``--kv-events`` endpoint and its replay are rank 0's, rank r's are their
    ports + r (as vLLM offsets them), and what any rank caches, before the sidecar started too, reaches the router for
    that rank's backend, not another's; a backend without ``--kv-events`` serves beside them."""
    from prefixroute.testing import FakeVLLM

    with contextlib.ExitStack() as stack:
        servers = []  # per backend, its two ranks: rank 1 on the ports after rank 0's
        for seed in (1, 3):
            publisher, replay = free_port_pair(), free_port_pair()
            servers.append(
                [
                    stack.enter_context(
                        FakeVLLM(block_size=16, seed=seed + rank, port=publisher + rank, replay_port=replay + rank)
                    )
                    for rank in range(2)
                ]
            )
        earlier = {}  # a prefix each rank alone cached before the sidecar started: only its replay can tell it
        for number, ranks in enumerate(servers):
            for rank, engine in enumerate(ranks):
                earlier[number, rank] = ids(64, 100_000 * (2 * number + rank + 1))
                engine.complete(earlier[number, rank])
        urls = [ranks[0].url for ranks in servers]
        events = [f"{ranks[0].url}={ranks[0].endpoint},{ranks[0].replay_endpoint}" for ranks in servers]
        port = free_port()

        def routed(prefix: list[int], what: str) -> tuple[str, int]:
            """Where the sidecar routes ``prefix`` once a backend's KV events hold it: (backend, matched tokens)."""
            deadline = time.monotonic() + DEADLINE_S
            answer: dict[str, Any] = {}
            while answer.get("reason") != "prefix":
                assert time.monotonic() < deadline, f"{what} never arrived: {answer}"
                answer = httpx.post(f"http://127.0.0.1:{port}/route", json={"prompt_token_ids": [*prefix, 1]}).json()
                # Refused: the router forgets the blocks it predicted, so a match is the KV events' alone.
                httpx.post(f"http://127.0.0.1:{port}/finish", json={"id": answer["id"], "refused": True})
            return answer["backend"], answer["matched_tokens"]

        options = ["--kv-events", *events, "--data-parallel-size", "2", "--models", "m"]
        with start_sidecar(tmp_path, [*urls, "http://127.0.0.1:9"], port=port, options=options):
            for (number, rank), prefix in earlier.items():
                engine, url = servers[number][rank], urls[number]
                assert routed(prefix, f"rank {rank} of {url}: its replay") == (url, 64)
                later = ids(64, 100_000 * (2 * number + rank + 1) + 50_000)
                engine.complete(later)  # published live, to a subscriber that has caught up
                assert routed(later, f"rank {rank} of {url}: its live batch") == (url, 64)


def test_metrics_from_backends_steer_routes_away_from_an_engine_that_is_down(
    tmp_path: Path, refused_port: Callable[[], int]
) -> None:
    """``--metrics-from-backends``: each engine's /metrics is polled, and one whose scrape fails is skipped; without
    it the load policy spreads the open requests over both, the dead one too."""
    from prefixroute.testing.openai_engine import OpenAIEngine

    engine = OpenAIEngine(model="llama").start()
    dead = f"http://127.0.0.1:{refused_port()}"
    port = free_port()
    try:
        options = ["--metrics-from-backends", "--models", "llama"]
        with start_sidecar(tmp_path, [engine.url, dead], port=port, options=options):
            url = f"http://127.0.0.1:{port}/route"
            deadline = time.monotonic() + DEADLINE_S
            chosen: list[str] = []
            while chosen[-20:] != [engine.url] * 20:  # open requests (never finished) pile up on the live one
                assert time.monotonic() < deadline, f"the dead engine was still chosen: {chosen[-20:]}"
                chosen.append(httpx.post(url, json={"prompt_token_ids": ids(32, 1000 * len(chosen))}).json()["backend"])
    finally:
        engine.stop()


def test_requests_naming_the_base_model_match_its_kv_events(tmp_path: Path) -> None:
    """Without --models, the sidecar learns the engines' base model, so OpenAI requests (which name it) match the
    blocks the engines' KV events report, hashed in the router's own namespace."""
    from prefixroute.testing import FakeVLLM

    with FakeVLLM(block_size=16, seed=1, model="llama") as engine0, FakeVLLM(block_size=16, seed=2) as engine1:
        urls = [engine0.url, engine1.url]
        events = [f"{e.url}={e.endpoint},{e.replay_endpoint}" for e in (engine0, engine1)]
        port = free_port()
        with start_sidecar(tmp_path, urls, port=port, options=["--kv-events", *events]):
            prefix = ids(64, 30_000)
            engine0.complete(prefix)
            answer: dict[str, Any] = {}
            for _ in range(100):
                answer = httpx.post(f"http://127.0.0.1:{port}/route", json={"prompt_token_ids": [*prefix, 1],
                                                                              "model": "llama"}).json()  # fmt: skip
                # Refused: the router forgets the blocks it predicted, so a match is the engine's KV events' alone.
                httpx.post(f"http://127.0.0.1:{port}/finish", json={"id": answer["id"], "refused": True})
                if answer["reason"] == "prefix":
                    break
                time.sleep(0.05)
            assert (answer["backend"], answer["reason"], answer["matched_tokens"]) == (engine0.url, "prefix", 64)
            lora = httpx.post(f"http://127.0.0.1:{port}/route", json={"prompt_token_ids": [*prefix, 1],
                                                                       "model": "llama-lora"}).json()  # fmt: skip
            assert lora["reason"] == "miss"  # an adapter's blocks are its own


def test_the_sidecar_quickstart_routes_shared_prefixes_to_one_engine_and_releases_all() -> None:
    script = Path(__file__).resolve().parents[2] / "examples" / "sidecar_quickstart.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, check=True).stdout
    lines = out.splitlines()
    engine_of: dict[str, set[str]] = {}
    for line in lines[:-1]:
        name, engine = line.split()[0], line.split("-> ")[1].split()[0]
        engine_of.setdefault(name, set()).add(engine)
    assert len(lines) == 10 and all(len(engines) == 1 for engines in engine_of.values())
    assert sum("engine cached 400" in line for line in lines) == 6  # every later turn hit the engine's cache
    assert lines[-1] == "decisions by reason {'miss': 3, 'prefix': 6}, in flight now 0"


def test_backends_busy_at_the_front_neither_slow_routes_nor_push_the_kept_ones_past_the_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Was: each route scanned the least recently routed backends from the front, stepped over those with a request
    in flight and left them there: with pods replaced all the time and some requests abandoned (their lease not
    yet run out), every route rechecked all of them (44 of 59 s of an 80,000-request run), and the idle ones
    behind them were not found, so the kept backends grew past the cap."""
    from prefixroute.adapters.serve import app

    monkeypatch.setattr(app, "_MAX_SEEN_BACKENDS", 200)
    sidecar = Sidecar(Router(), backends=BACKENDS)
    router = sidecar.router
    abandoned = [  # their leases have not run out: these pods stay busy, the least recently routed
        call(sidecar, "POST", "/route", {"prompt_token_ids": ids(32, 100 * i), "backends": [f"old-{i}"]}).json()["id"]
        for i in range(150)
    ]
    checks = 0
    in_flight = router.in_flight

    def counted(backend: str) -> int:
        nonlocal checks
        checks += 1
        return in_flight(backend)

    monkeypatch.setattr(router, "in_flight", counted)
    for i in range(300):  # pods that come and go, each request finished
        answer = call(sidecar, "POST", "/route", {"prompt_token_ids": ids(32, 100 * i), "backends": [f"new-{i}"]})
        call(sidecar, "POST", "/finish", {"id": answer.json()["id"]})
    assert checks < 300 * 5  # a few a route, not every busy one each time
    kept = set(call(sidecar, "GET", "/stats").json()["in_flight"]) - set(BACKENDS)
    assert kept == {*(f"old-{i}" for i in range(150)), *(f"new-{i}" for i in range(250, 300))}  # 200: the cap
    for decision in abandoned:
        call(sidecar, "POST", "/finish", {"id": decision})
    router._check()


def test_per_request_backends_past_the_cap_are_forgotten_when_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Clients that name ever new backends grew the router's per-backend state (blocks, figures) without end."""
    from prefixroute.adapters.serve import app

    monkeypatch.setattr(app, "_MAX_SEEN_BACKENDS", 4)
    sidecar = Sidecar(Router(), backends=BACKENDS)
    router = sidecar.router
    kept = call(sidecar, "POST", "/route", {"prompt_token_ids": ids(32), "backends": ["busy"]}).json()["id"]
    for i in range(10):
        answer = call(sidecar, "POST", "/route", {"prompt_token_ids": ids(32, 100 * i), "backends": [f"b{i}"]})
        call(sidecar, "POST", "/finish", {"id": answer.json()["id"]})
        call(sidecar, "POST", "/route", {"prompt_token_ids": ids(32, 5000), "backends": [BACKENDS[0]]})  # fixed
    held = {b for b in ["busy", *(f"b{i}" for i in range(10))] if router.index.hashes(b)}
    assert held == {"busy", "b7", "b8", "b9"}  # the one in flight, and the three most recently routed idle ones
    assert router.in_flight("busy") == 1 and router.index.hashes(BACKENDS[0])
    # "busy", in use when a scan met it, counts as routed then (the scan does not meet it again at once)
    assert list(call(sidecar, "GET", "/stats").json()["in_flight"]) == [*BACKENDS, "b7", "busy", "b8", "b9"]
    again = call(sidecar, "POST", "/route", {"prompt_token_ids": ids(32, 900), "backends": ["b9", "b1"]}).json()
    assert again["backend"] == "b9" and again["reason"] == "prefix"  # kept: still cached
    call(sidecar, "POST", "/finish", {"id": kept})
    router.index._check()
