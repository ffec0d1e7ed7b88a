"""The Envoy ext_proc endpoint picker's stream handling, message by message (the real Envoy runs in test_gateways)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from prefixroute import Router
from prefixroute.adapters.serve import Sidecar
from prefixroute.adapters.serve.ext_proc import DESTINATION_HEADER, EndpointPicker

BACKENDS = ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]


def headers(path: str) -> Any:
    header = base_pb2.HeaderValue(key=":path", raw_value=path.encode())
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[header])))


def body(data: bytes, *, end: bool) -> Any:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=end))


def response_body(*, end: bool) -> Any:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: {}\n\n", end_of_stream=end))


def run(sidecar: Sidecar, *messages: Any) -> list[Any]:
    """Feed ``messages`` to one Process stream; return its answers."""

    async def requests() -> AsyncIterator[Any]:
        for message in messages:
            yield message

    async def go() -> list[Any]:
        return [answer async for answer in EndpointPicker(sidecar).Process(requests(), None)]

    return asyncio.run(go())


def destination(answer: Any) -> str | None:
    mutation = answer.request_body.response.header_mutation
    return next((h.header.raw_value.decode() for h in mutation.set_headers if h.header.key == DESTINATION_HEADER), None)


PROMPT = json.dumps({"prompt": list(range(40))}).encode()


def test_a_body_in_chunks_is_routed_once_and_released_at_the_last_response_chunk() -> None:
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS)
    first, second = body(PROMPT[:10], end=False), body(PROMPT[10:], end=True)
    answers = run(sidecar, headers("/v1/completions"), first, second, response_body(end=False))
    assert destination(answers[1]) is None and destination(answers[2]) in ("10.0.0.1:8000", "10.0.0.2:8000")
    assert sidecar.router.stats().in_flight == 0  # the stream ended before its last response chunk: released
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS)
    run(sidecar, headers("/v1/completions"), body(PROMPT, end=True), response_body(end=False), response_body(end=True))
    stats = sidecar.router.stats()
    assert (stats.decisions, stats.in_flight, stats.ignored) == (1, 0, 0)


def test_a_body_sent_again_after_its_end_is_ignored_and_nothing_stays_in_flight() -> None:
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS)
    answers = run(
        sidecar,
        headers("/v1/completions"),
        body(PROMPT, end=True),
        body(PROMPT, end=True),  # a second end of the same body: not a second request
        response_body(end=True),
    )
    assert destination(answers[1]) is not None and destination(answers[2]) is None
    stats = sidecar.router.stats()
    assert (stats.decisions, stats.in_flight, stats.ignored) == (1, 0, 0)


def response_headers(status: str) -> Any:
    header = base_pb2.HeaderValue(key=":status", raw_value=status.encode())
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[header])))


def test_a_4xx_response_finishes_the_request_refused_and_its_prediction_is_forgotten() -> None:
    hashes = Router(block_size=4).hasher.hash(list(range(40)))
    cases = (
        ("200", 10, True),
        ("400", 0, True),
        ("400", 0, False),
        ("500", 10, True),
        ("", 10, True),
        ("4²", 10, True),
    )
    for status, held, end in cases:
        sidecar = Sidecar(Router(block_size=4), backends=BACKENDS)
        run(sidecar, headers("/v1/completions"), body(PROMPT, end=True), response_headers(status),
            *([response_body(end=True)] if end else []))  # fmt: skip
        router = sidecar.router
        assert router.stats().in_flight == 0
        assert max(router.index.match(hashes, sidecar.backends).values()) == held, (status, end)
