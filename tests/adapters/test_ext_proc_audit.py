"""The Envoy ext_proc endpoint picker against the Gateway API Inference Extension endpoint-picker contract, as an
independent client reads it (found by an audit; the message-by-message rules are in test_ext_proc.py)."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Iterator
from typing import Any

import pytest
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from google.protobuf import json_format

from prefixroute import Router
from prefixroute.adapters.serve import Sidecar
from prefixroute.adapters.serve.ext_proc import DESTINATION_HEADER, start_ext_proc
from prefixroute.adapters.serve.loopback import start_envoy
from prefixroute.errors import ConfigurationError, InvalidTypeError

from .test_ext_proc import BACKENDS, PROMPT, body, headers, request_trailers, response_body, response_headers, run
from .test_serve_scenarios import (
    Stack,
    check_release_after_error_and_abort,
    check_same_prefix_same_upstream,
    check_sse_is_not_buffered,
    make_stack,
    need_binary,
)


@pytest.mark.parametrize("backend", ["http://localhost:8000", "http://gpu0:8000", "https://vllm.example.com"])
def test_a_backend_named_by_host_name_is_refused_as_envoy_connects_to_an_ip_port(backend: str) -> None:
    """The contract names the endpoint ``<ip:port>``, and the example's ORIGINAL_DST cluster connects to an address,
    not a name: with ``http://localhost:8001``, every routed request got Envoy's 503 "no healthy upstream" (tested on
    Envoy 1.40), not even the fail-open pool. The picker refuses such a backend at start, naming it."""
    sidecar = Sidecar(Router(), backends=["http://10.0.0.1:8000", backend])
    with pytest.raises(
        ConfigurationError, match=f"^the endpoint picker names each engine to Envoy as ip:port .*{backend!r}"
    ):
        asyncio.run(start_ext_proc(sidecar, "127.0.0.1", 0))


def test_backends_named_by_ipv4_or_ipv6_address_are_served() -> None:
    sidecar = Sidecar(Router(), backends=["http://10.0.0.1:8000", "http://[::1]:8000", "http://127.0.0.1"])

    async def go() -> None:
        server, _ = await start_ext_proc(sidecar, "127.0.0.1", 0)
        await server.stop(None)

    asyncio.run(go())


DUPLEX = ProcessingMode.FULL_DUPLEX_STREAMED


def duplex_headers(path: str = "/v1/completions", *, end: bool = False) -> Any:
    """The first message of an Envoy whose request and response body modes are FULL_DUPLEX_STREAMED (the Gateway
    API Inference Extension's own Envoy set-up): it says so in ``protocol_config``."""
    message = headers(path, end=end, body_mode=DUPLEX)
    message.protocol_config.response_body_mode = DUPLEX
    return message


def streamed(answer: Any, phase: str) -> tuple[bytes, bool]:
    """The body a full-duplex body answer sends on, and its end_of_stream."""
    assert answer.WhichOneof("response") == phase
    sent = getattr(answer, phase).response.body_mutation.streamed_response
    return sent.body, sent.end_of_stream


def test_a_full_duplex_request_is_answered_headers_first_with_the_destination_and_its_body_sent_back() -> None:
    """In FULL_DUPLEX_STREAMED mode Envoy sends the body without waiting for the headers' answer and takes each body
    answer as the body to send on (``streamed_response``): the picker answered each message as in the other modes, so
    Envoy 1.40 failed every request with a 500 ("Spurious response message"), even with failure_mode_allow. Now the
    headers' answer waits for the body and carries the destination, then the body goes back whole, and each response
    chunk is sent back as it came."""
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS)
    chunks = [PROMPT[:10], PROMPT[10:30], PROMPT[30:]]
    messages = [duplex_headers(), *(body(c, end=i == 2) for i, c in enumerate(chunks))]
    answers = run(sidecar, *messages, response_headers("200"), response_body(end=False), response_body(end=True))
    assert [answer.WhichOneof("response") for answer in answers] == [
        "request_headers", "request_body", "response_headers", "response_body", "response_body"
    ]  # fmt: skip
    first = answers[0]
    mutation = first.request_headers.response.header_mutation
    endpoint = {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}[DESTINATION_HEADER]
    assert endpoint in ("10.0.0.1:8000", "10.0.0.2:8000") and first.request_headers.response.clear_route_cache
    assert json_format.MessageToDict(first.dynamic_metadata) == {"envoy.lb": {DESTINATION_HEADER: endpoint}}
    assert streamed(answers[1], "request_body") == (PROMPT, True)
    assert streamed(answers[3], "response_body") == (b"data: {}\n\n", False)
    assert streamed(answers[4], "response_body") == (b"data: {}\n\n", True)
    stats = sidecar.router.stats()
    assert (stats.decisions, stats.in_flight, stats.ignored) == (1, 0, 0)
    assert sidecar.stats()["releases"] == {"ext_proc": 2}


def test_a_full_duplex_body_ended_by_trailers_is_routed_there_and_sent_back_before_the_trailers() -> None:
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS)
    answers = run(sidecar, duplex_headers(), body(PROMPT[:10], end=False), body(PROMPT[10:], end=False),
                  request_trailers(), response_body(end=True))  # fmt: skip
    assert [answer.WhichOneof("response") for answer in answers] == [
        "request_headers", "request_body", "request_trailers", "response_body"
    ]  # fmt: skip
    assert answers[0].request_headers.response.header_mutation.set_headers[0].header.key == DESTINATION_HEADER
    assert streamed(answers[1], "request_body") == (PROMPT, False)
    assert sidecar.router.stats().in_flight == 0 and sidecar.router.stats().decisions == 1


def test_a_full_duplex_body_the_picker_does_not_route_still_goes_back_whole_unrouted() -> None:
    """Over the limit, not JSON, or on a path the picker does not route: the headers are answered without a
    destination (Envoy's pool serves it), and every byte of the body is sent back, in order."""
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS, max_body_bytes=len(PROMPT) // 2)
    third = len(PROMPT) // 3 + 1
    chunks = [PROMPT[:third], PROMPT[third : 2 * third], PROMPT[2 * third :]]
    over = run(sidecar, duplex_headers(), *(body(c, end=i == 2) for i, c in enumerate(chunks)))
    assert [a.WhichOneof("response") for a in over] == ["request_headers", "request_body", "request_body"]
    assert not over[0].request_headers.response.header_mutation.set_headers
    assert streamed(over[1], "request_body") == (PROMPT[: 2 * third], False)
    assert streamed(over[2], "request_body") == (chunks[2], True)
    not_json = run(sidecar, duplex_headers(), body(b"{not", end=False), body(b" json", end=True))
    assert [a.WhichOneof("response") for a in not_json] == ["request_headers", "request_body"]
    assert streamed(not_json[1], "request_body") == (b"{not json", True)
    models = run(sidecar, duplex_headers("/v1/models"), body(b"{}", end=True))
    assert [a.WhichOneof("response") for a in models] == ["request_headers", "request_body"]
    assert streamed(models[1], "request_body") == (b"{}", True)
    assert sidecar.stats()["bad_requests"] == {"413": 1, "400": 1} and sidecar.router.stats().decisions == 0


def full_duplex(config: str) -> str:
    """The example's Envoy configuration with the Gateway API Inference Extension's body modes."""
    for old, new in (
        ("request_body_mode: BUFFERED", "request_body_mode: FULL_DUPLEX_STREAMED"),
        ("response_body_mode: STREAMED", "response_body_mode: FULL_DUPLEX_STREAMED"),
        ("request_trailer_mode: SKIP", "request_trailer_mode: SEND"),  # Envoy requires it for full duplex
        ("response_trailer_mode: SKIP", "response_trailer_mode: SEND"),
    ):
        assert config.count(old + "\n") == 1, old  # the setting's line, not a comment naming it
        config = config.replace(old + "\n", new + "\n")
    return config


@pytest.fixture(scope="module")
def duplex_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    need_binary("envoy")
    start = functools.partial(start_envoy, edit=full_duplex)
    yield from make_stack(tmp_path_factory.mktemp("envoy-duplex"), start, "ext_proc")


@pytest.mark.parametrize(
    "check", [check_same_prefix_same_upstream, check_release_after_error_and_abort, check_sse_is_not_buffered],
    ids=lambda check: check.__name__.removeprefix("check_"),
)  # fmt: skip
def test_envoy_in_full_duplex_mode_routes_streams_and_releases(duplex_stack: Stack, check: Any) -> None:
    """On the real Envoy: before, every request through a full-duplex Envoy failed with a 500."""
    check(duplex_stack)


def with_subset(message: Any, endpoints: Any) -> Any:
    """``message`` with the Inference Extension's subset hint: the endpoints the picker may choose from."""
    message.metadata_context.filter_metadata["envoy.lb.subset_hint"].update(
        {"x-gateway-destination-endpoint-subset": endpoints}
    )
    return message


@pytest.mark.parametrize("mode", [None, ProcessingMode.BUFFERED, DUPLEX])
def test_the_picker_chooses_only_among_the_endpoints_of_the_subset_hint(mode: int | None) -> None:
    """The protocol: a proxy may list the endpoints the picker MUST choose from in the request's filter metadata
    (``envoy.lb.subset_hint``, key ``x-gateway-destination-endpoint-subset``); before, the hint was not read and a
    request went to any backend. Every request of one prompt, whose affinity would keep it on one backend, goes to
    the one endpoint its hint allows."""
    sidecar = Sidecar(Router(block_size=4), backends=["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://[::1]:9"])
    first = duplex_headers() if mode == DUPLEX else headers("/v1/completions", body_mode=mode)
    chosen = set()
    for allowed in ("10.0.0.2:8000", "10.0.0.1:8000", "[::1]:9", "10.0.0.2:8000"):
        start = type(first)()
        start.CopyFrom(first)
        answers = run(sidecar, with_subset(start, [allowed, "10.9.9.9:1"]), body(PROMPT, end=True))
        answer = answers[0] if mode == DUPLEX else answers[1]
        phase = "request_headers" if mode == DUPLEX else "request_body"
        mutation = getattr(answer, phase).response.header_mutation
        (endpoint,) = [h.header.raw_value.decode() for h in mutation.set_headers if h.header.key == DESTINATION_HEADER]
        assert (
            endpoint
            == allowed
            == answer.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DESTINATION_HEADER].string_value
        )
        chosen.add(endpoint)
    assert len(chosen) == 3
    assert sidecar.router.stats().in_flight == 0  # each stream ended: released


@pytest.mark.parametrize("endpoints", [[], ["10.9.9.9:1"], "10.0.0.1:8000", [1, None]])
@pytest.mark.parametrize("mode", [None, DUPLEX])
def test_a_subset_hint_that_names_none_of_the_backends_is_an_immediate_503(endpoints: Any, mode: int | None) -> None:
    """The protocol: none of the listed endpoints eligible, or an empty list, is an ImmediateResponse 503; no
    decision is made, so nothing stays in flight (a value that is no list of strings lists none)."""
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS)
    first = duplex_headers() if mode == DUPLEX else headers("/v1/completions")
    answers = run(sidecar, with_subset(first, endpoints), body(PROMPT, end=True), response_body(end=True))
    immediate = [a for a in answers if a.WhichOneof("response") == "immediate_response"]
    assert len(immediate) == 1 and answers[-1] is immediate[0]  # the last answer: Envoy ends the request there
    assert immediate[0].immediate_response.status.code == 503
    stats = sidecar.router.stats()
    assert (stats.decisions, stats.in_flight) == (0, 0)


def test_without_a_subset_key_the_hint_namespace_leaves_every_backend() -> None:
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS)
    first = headers("/v1/completions")
    first.metadata_context.filter_metadata["envoy.lb.subset_hint"].update({"other": ["10.9.9.9:1"]})
    answers = run(sidecar, first, body(PROMPT, end=True))
    mutation = answers[1].request_body.response.header_mutation
    assert [h.header.raw_value.decode() for h in mutation.set_headers if h.header.key == DESTINATION_HEADER]


def test_a_later_message_without_the_hint_keeps_the_first_messages_subset() -> None:
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS)
    for allowed in ("10.0.0.1:8000", "10.0.0.2:8000"):
        later = body(PROMPT, end=True)
        later.metadata_context.filter_metadata["other"].update({"key": "value"})
        answers = run(sidecar, with_subset(headers("/v1/completions"), [allowed]), later)
        mutation = answers[1].request_body.response.header_mutation
        assert [h.header.raw_value.decode() for h in mutation.set_headers if h.header.key == DESTINATION_HEADER] == [
            allowed
        ]


def test_a_body_the_picker_cannot_read_falls_back_to_the_pool_under_a_subset_hint_too() -> None:
    """Only "none of the subset is a backend" is the protocol's 503; a body not routed is left to Envoy's pool."""
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS)
    answers = run(sidecar, with_subset(headers("/v1/completions"), ["10.0.0.1:8000"]), body(b"{not json", end=True))
    assert [a.WhichOneof("response") for a in answers] == ["request_headers", "request_body"]
    assert not answers[1].request_body.response.header_mutation.set_headers
    assert sidecar.stats()["bad_requests"] == {"400": 1}


def test_a_full_duplex_body_ended_by_trailers_under_a_hint_naming_no_backend_is_an_immediate_503() -> None:
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS)
    answers = run(sidecar, with_subset(duplex_headers(), ["10.9.9.9:1"]), body(PROMPT, end=False), request_trailers())
    assert [a.WhichOneof("response") for a in answers] == ["immediate_response"]
    assert answers[0].immediate_response.status.code == 503 and sidecar.router.stats().decisions == 0


def test_a_full_duplex_request_without_a_body_is_answered_at_once_as_a_bad_request() -> None:
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS)
    answers = run(sidecar, duplex_headers(end=True))
    assert [a.WhichOneof("response") for a in answers] == ["request_headers"]
    assert sidecar.stats()["bad_requests"] == {"400": 1}


def test_a_full_duplex_body_the_picker_does_not_route_goes_back_chunk_by_chunk_as_it_came() -> None:
    """Not held (nor counted) on a path the picker does not route; each chunk keeps its end_of_stream."""
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS, max_body_bytes=4)
    chunks = [b'{"a"', b": 1", b"}"]
    answers = run(sidecar, duplex_headers("/v1/models"), *(body(c, end=i == 2) for i, c in enumerate(chunks)))
    assert [a.WhichOneof("response") for a in answers] == ["request_headers", *["request_body"] * 3]
    assert [streamed(a, "request_body") for a in answers[1:]] == [(chunks[0], False), (chunks[1], False), (b"}", True)]
    assert sidecar.stats()["bad_requests"] == {}


@pytest.mark.parametrize(("limit", "routed"), [(len(PROMPT), True), (len(PROMPT) - 1, False)])
def test_a_full_duplex_body_exactly_at_the_limit_is_routed_and_one_byte_over_goes_back_whole(
    limit: int, routed: bool
) -> None:
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS, max_body_bytes=limit)
    answers = run(sidecar, duplex_headers(), body(PROMPT, end=True))
    assert [a.WhichOneof("response") for a in answers] == ["request_headers", "request_body"]
    assert bool(answers[0].request_headers.response.header_mutation.set_headers) is routed
    assert streamed(answers[1], "request_body") == (PROMPT, True)


def test_a_full_duplex_request_with_a_streamed_response_body_mode_answers_the_response_as_streamed() -> None:
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS)
    first = headers("/v1/completions", body_mode=DUPLEX)
    first.protocol_config.response_body_mode = ProcessingMode.STREAMED
    answers = run(sidecar, first, body(PROMPT, end=True), response_body(end=True))
    assert answers[-1].WhichOneof("response") == "response_body"
    assert not answers[-1].response_body.response.HasField("body_mutation")


def test_pick_and_its_health_filter_keep_to_the_subset() -> None:
    down = "http://10.0.0.1:8000"
    sidecar = Sidecar(Router(block_size=4), backends=[*BACKENDS, "http://10.0.0.3:8000"],
                      healthy=lambda backends: [b for b in backends if b != down])  # fmt: skip
    for i in range(8):
        prompt = json.dumps({"prompt": list(range(i * 40, i * 40 + 40))}).encode()
        decision = sidecar.pick("/v1/completions", prompt, within={"10.0.0.1:8000", "10.0.0.2:8000"})
        assert decision.backend == "http://10.0.0.2:8000"
        sidecar.finish(decision.id)


@pytest.mark.parametrize("within", ["10.0.0.1:8000", b"10.0.0.1:8000", 5, iter(["10.0.0.1:8000"])])
def test_pick_refuses_a_within_that_is_no_collection_of_endpoints(within: Any) -> None:
    """A str would be searched for substrings (``"0.1:8000"`` would match); a generator has no ``in`` to trust."""
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS)
    with pytest.raises(InvalidTypeError, match="^within must be a collection of host:port strs, not "):
        sidecar.pick("/v1/completions", PROMPT, within=within)
    assert sidecar.router.stats().decisions == 0
