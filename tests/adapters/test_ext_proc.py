"""The Envoy ext_proc endpoint picker's stream handling, message by message (the real Envoy runs in test_gateways)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import grpc
import httpx
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from prefixroute import Candidate, ConfigurationError, LoadPolicy, Router
from prefixroute.adapters.serve import Sidecar
from prefixroute.adapters.serve.ext_proc import DESTINATION_HEADER, EndpointPicker, start_ext_proc
from prefixroute.adapters.serve.loopback import Process, free_port, start_sidecar

from ..conftest import TickingClock, wait_until

BACKENDS = ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]


def headers(path: str, *, end: bool = False, body_mode: int | None = None) -> Any:
    """The request headers; ``body_mode``: the ``protocol_config`` newer Envoys add to their first message."""
    header = base_pb2.HeaderValue(key=":path", raw_value=path.encode())
    message = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[header]), end_of_stream=end)
    )
    if body_mode is not None:
        message.protocol_config.request_body_mode = body_mode
    return message


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
    # Each header the picker sets replaces a client's own of that name, never appends to it.
    assert all(h.append_action == base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD for h in mutation.set_headers)
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


def request_trailers() -> Any:
    trailer = base_pb2.HeaderValue(key="x-checksum", raw_value=b"0")
    return pb.ProcessingRequest(request_trailers=pb.HttpTrailers(trailers=base_pb2.HeaderMap(headers=[trailer])))


def test_a_buffered_body_that_ends_with_trailers_is_routed_on_its_one_body_message() -> None:
    """Envoy sends a BUFFERED body whose request has trailers as one message without end_of_stream (the trailers
    follow, if sent at all); the trailers' answer cannot change the request headers (TrailersResponse mutates only
    trailers), so the body's answer carries the destination, which Envoy applies in BUFFERED mode."""
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS)
    buffered = headers("/v1/completions", body_mode=ProcessingMode.BUFFERED)
    answers = run(sidecar, buffered, body(PROMPT, end=False), request_trailers(), response_body(end=True))
    assert destination(answers[1]) in ("10.0.0.1:8000", "10.0.0.2:8000")
    assert answers[2].WhichOneof("response") == "request_trailers"
    stats = sidecar.router.stats()
    assert (stats.decisions, stats.in_flight, stats.ignored) == (1, 0, 0)
    # Without the body mode (an older Envoy) or in another mode, a body message without end_of_stream may be one
    # chunk of several: the picker waits for the one that ends the body.
    for mode in (None, ProcessingMode.STREAMED, ProcessingMode.BUFFERED_PARTIAL):
        sidecar = Sidecar(Router(block_size=4), backends=BACKENDS)
        first, second = body(PROMPT[:10], end=False), body(PROMPT[10:], end=True)
        answers = run(sidecar, headers("/v1/completions", body_mode=mode), first, second, response_body(end=True))
        assert destination(answers[1]) is None and destination(answers[2]) is not None, mode
        assert sidecar.router.stats().in_flight == 0


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


def test_a_body_exactly_at_the_limit_is_routed_and_one_byte_over_is_not() -> None:
    for limit, routed in ((len(PROMPT), True), (len(PROMPT) - 1, False)):
        sidecar = Sidecar(Router(block_size=4), backends=BACKENDS, max_body_bytes=limit)
        answers = run(sidecar, headers("/v1/completions"), body(PROMPT[:10], end=False), body(PROMPT[10:], end=True))
        assert (destination(answers[2]) is not None) is routed
        assert (sidecar.router.stats().decisions, sidecar.metrics.bad_requests.get(413, 0)) == (routed, not routed)


def test_a_request_without_a_body_is_counted_as_a_bad_request_as_over_http() -> None:
    """Headers that end the stream, or trailers before any body: no body to route on (HTTP's sidecar answers an
    empty body 400, counted)."""
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS)
    answers = run(sidecar, headers("/v1/completions", end=True), response_headers("200"), response_body(end=True))
    assert len(answers) == 3 and destination(answers[0]) is None
    assert (sidecar.router.stats().decisions, sidecar.metrics.bad_requests.get(400, 0)) == (0, 1)
    run(sidecar, headers("/healthz", end=True))  # not an OpenAI path: not the picker's to count
    assert sidecar.metrics.bad_requests.get(400, 0) == 1
    # An HTTP/2 request whose empty body is ended by trailers: Envoy sends the trailers and no body message.
    run(sidecar, headers("/v1/completions"), request_trailers(), body(PROMPT, end=True), response_body(end=True))
    assert (sidecar.router.stats().decisions, sidecar.metrics.bad_requests.get(400, 0)) == (0, 2)


class Noting(LoadPolicy):
    """The least loaded backend; notes the candidates of each decision."""

    def __init__(self) -> None:
        self.seen: list[Sequence[Candidate]] = []

    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        self.seen.append(candidates)
        return min(candidates, key=lambda candidate: candidate.in_flight)


def test_only_a_200_answer_reports_a_first_token_so_an_error_teaches_no_prefill_speed() -> None:
    # A refusal or an error (Envoy's own 503 when the engine is down, too) comes back in milliseconds: read as a first
    # token it would teach the backend a prefill speed of the prompt's tokens over those milliseconds.
    for status, learned in (("200", True), ("", True), ("400", False), ("503", False)):
        policy = Noting()
        sidecar = Sidecar(Router(block_size=4, policy=policy, clock=TickingClock()), backends=BACKENDS[:1])
        phases = [response_headers(status)] if status else []  # "": response headers not sent (mode SKIP)
        run(sidecar, headers("/v1/completions"), body(PROMPT, end=True), *phases, response_body(end=False),
            response_body(end=True))  # fmt: skip
        assert sidecar.router.stats().in_flight == 0
        sidecar.route(b'{"prompt_token_ids": [1, 2, 3, 4, 5]}')
        assert (policy.seen[-1][0].prefill_tokens_per_s is not None) is learned, status


# -- against the real gRPC server of `prefixroute serve --ext-proc` --------------------------------------------------


@pytest.fixture(scope="module")
def picker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Process, int, httpx.Client]]:
    """A `prefixroute serve` process with its ext_proc port, and an HTTP client of its /stats."""
    port, grpc_port = free_port(), free_port()
    workdir = tmp_path_factory.mktemp("ext_proc")
    with (
        start_sidecar(workdir, BACKENDS, port=port, options=["--ext-proc", str(grpc_port)]) as process,
        httpx.Client(base_url=f"http://127.0.0.1:{port}") as client,
    ):
        yield process, grpc_port, client


def stream(
    grpc_port: int, messages: list[bytes], *, held: bool = False, timeout: float = 20.0
) -> tuple[list[Any], grpc.RpcError | None]:
    """Send raw (serialized) messages on one Process stream of a real gRPC channel; its answers and its error. With
    ``held`` the request side stays open after ``messages``, as Envoy's does mid-request: an answer the picker owes
    and never sends shows as DEADLINE_EXCEEDED, not as a clean end of the stream."""
    sent = threading.Event()

    def requests() -> Iterator[bytes]:
        yield from messages
        if held:
            sent.wait(timeout)

    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        process = channel.stream_stream(
            "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
            request_serializer=lambda raw: raw,
            response_deserializer=pb.ProcessingResponse.FromString,
        )
        answers: list[Any] = []
        try:
            answers.extend(process(requests(), timeout=timeout))
        except grpc.RpcError as exc:
            return answers, exc
        finally:
            sent.set()
        return answers, None


def a_good_request_is_routed_and_released(grpc_port: int, client: httpx.Client) -> None:
    request = [headers("/v1/completions"), body(PROMPT, end=True), response_body(end=True)]
    answers, error = stream(grpc_port, [message.SerializeToString() for message in request])
    assert error is None and destination(answers[1]) in ("10.0.0.1:8000", "10.0.0.2:8000")
    wait_until(lambda: client.get("/stats").json()["in_flight_total"] == 0, what="the release")


def test_a_corrupt_message_ends_the_stream_invalid_argument_releases_its_decision_and_logs_no_traceback(
    picker: tuple[Process, int, httpx.Client],
) -> None:
    process, grpc_port, client = picker
    before = client.get("/stats").json()["bad_requests"].get("400", 0)
    picked = [headers("/v1/completions").SerializeToString(), body(PROMPT, end=True).SerializeToString()]
    for garbage in (b"\x08\x01garbage\xff", b"\xff" * 40, b"\x1a\x05ab"):  # a wrong wire type, junk, a cut field
        answers, error = stream(grpc_port, [*picked, garbage])
        assert destination(answers[1]) is not None  # routed, then the garbage came
        assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        assert "not a ProcessingRequest" in (error.details() or "")
        wait_until(lambda: client.get("/stats").json()["in_flight_total"] == 0, what="the release of the decision")
    assert client.get("/stats").json()["bad_requests"]["400"] - before == 3
    a_good_request_is_routed_and_released(grpc_port, client)
    assert "Traceback" not in process.output()


def test_a_message_with_no_phase_ends_the_stream_invalid_argument_and_releases_its_decision(
    picker: tuple[Process, int, httpx.Client],
) -> None:
    """A ProcessingRequest that sets no phase (no request_headers, request_body, ... response_trailers) has no answer
    that fits: it was left unanswered, and the peer, which waits for one, hung until its own timeout."""
    process, grpc_port, client = picker
    before = client.get("/stats").json()["bad_requests"].get("400", 0)
    picked = [headers("/v1/completions").SerializeToString(), body(PROMPT, end=True).SerializeToString()]
    no_phase = [
        b"",  # an empty message: every field unset
        pb.ProcessingRequest(observability_mode=True).SerializeToString(),
        pb.ProcessingRequest(metadata_context=base_pb2.Metadata()).SerializeToString(),  # context, but no phase
        b"\xf0\x01\x01",  # field 30, which this proto does not know (a newer Envoy's phase): no phase set either
    ]
    for message in no_phase:
        answers, error = stream(grpc_port, [*picked, message], held=True, timeout=5.0)
        assert destination(answers[1]) is not None  # routed, then the message without a phase came
        assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        assert "sets no phase" in (error.details() or "")
        wait_until(lambda: client.get("/stats").json()["in_flight_total"] == 0, what="the release of the decision")
    answers, error = stream(grpc_port, [b""], held=True, timeout=5.0)  # first thing on the stream
    assert answers == [] and error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert client.get("/stats").json()["bad_requests"]["400"] - before == len(no_phase) + 1
    a_good_request_is_routed_and_released(grpc_port, client)
    assert "Traceback" not in process.output()


def test_a_streamed_body_over_the_limit_is_not_routed_nor_kept_and_is_counted_413(
    picker: tuple[Process, int, httpx.Client],
) -> None:
    process, grpc_port, client = picker
    before = client.get("/stats").json()
    limit = 32 * 2**20  # the sidecar's default body limit, which its HTTP endpoints answer 413 past
    huge = json.dumps({"prompt": list(range(40)), "pad": "x" * limit}).encode()  # valid JSON, over the limit
    assert client.post("/v1/completions", content=huge).status_code == 413
    chunk = 2**20  # a streamed body (processing mode STREAMED) arrives chunk by chunk, none over gRPC's 4 MiB
    pieces = [huge[i : i + chunk] for i in range(0, len(huge), chunk)]
    request = [headers("/v1/completions"), *(body(p, end=i == len(pieces) - 1) for i, p in enumerate(pieces))]
    answers, error = stream(grpc_port, [message.SerializeToString() for message in request])
    assert error is None and len(answers) == len(request)
    assert all(destination(answer) is None for answer in answers)  # not routed: Envoy falls back to its pool
    after = client.get("/stats").json()
    assert after["decisions"] == before["decisions"] and after["in_flight_total"] == 0
    assert after["bad_requests"]["413"] - before["bad_requests"].get("413", 0) == 2  # the HTTP one and this one
    a_good_request_is_routed_and_released(grpc_port, client)
    assert "Traceback" not in process.output()


class Partitionable:
    """A TCP relay on loopback between a client and ``port``, which :meth:`partition` turns into a silent network
    partition: bytes either way are dropped from then on, and neither side sees its connection close."""

    def __init__(self, port: int) -> None:
        self._port = port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._cut = threading.Event()
        self._sockets: list[socket.socket] = [self._listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def partition(self) -> None:
        self._cut.set()

    def close(self) -> None:
        for sock in self._sockets:
            sock.close()

    def _accept(self) -> None:
        try:
            while True:
                client, _ = self._listener.accept()
                server = socket.create_connection(("127.0.0.1", self._port))
                self._sockets += [client, server]
                for source, sink in ((client, server), (server, client)):
                    threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()
        except OSError:  # closed
            return

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                if not self._cut.is_set():
                    sink.sendall(data)
        except OSError:  # closed
            return


def test_a_vanished_envoy_is_noticed_by_keepalive_pings_and_its_decision_released() -> None:
    """Envoy silently cut off (a network partition, a host gone) leaves its streams open on the picker: without
    keepalive pings their decisions stayed in flight until their lease. The stream here is idle for many ping
    periods before the cut (a long prefill streams nothing): the pings must go on without data."""
    sidecar = Sidecar(Router(block_size=4), backends=BACKENDS)
    for bad in ({"keepalive_s": 0}, {"keepalive_timeout_s": float("inf")}, {"keepalive_s": "30"}):
        with pytest.raises(ConfigurationError, match=next(iter(bad))):
            asyncio.run(start_ext_proc(sidecar, "127.0.0.1", 0, **bad))

    async def go() -> tuple[int, int, float]:
        server, port = await start_ext_proc(sidecar, "127.0.0.1", 0, keepalive_s=0.2, keepalive_timeout_s=1.0)
        relay = Partitionable(port)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{relay.port}")
        try:
            process = channel.stream_stream(
                "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
                request_serializer=lambda message: message.SerializeToString(),
                response_deserializer=pb.ProcessingResponse.FromString,
            )
            call = process()
            await call.write(headers("/v1/completions"))
            await call.write(body(PROMPT, end=True))
            answers = [await call.read(), await call.read()]
            assert destination(answers[1]) is not None and sidecar.router.stats().in_flight == 1
            await asyncio.sleep(2.0)  # ten ping periods, the stream idle: still alive, still in flight
            in_flight_before_cut = sidecar.router.stats().in_flight
            relay.partition()
            cut = time.monotonic()
            while sidecar.router.stats().in_flight and time.monotonic() - cut < 10:
                await asyncio.sleep(0.02)
            # Read before the server stops: stopping it cancels every stream, which releases the decision anyway.
            return in_flight_before_cut, sidecar.router.stats().in_flight, time.monotonic() - cut
        finally:
            await channel.close()
            await server.stop(None)
            relay.close()

    in_flight_before_cut, in_flight_after_cut, released_after = asyncio.run(go())
    assert in_flight_before_cut == 1
    # A partitioned stream is never closed by its peer: only the keepalive (a ping period and its timeout, 1.2 s)
    # releases it, within the 10 s the loop above waits, a hang guard rather than a measure of how soon.
    assert in_flight_after_cut == 0, f"the decision stayed in flight {released_after:.1f}s after the cut"
