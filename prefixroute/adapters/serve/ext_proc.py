"""An Envoy external processor that is a Gateway API Inference Extension endpoint picker.

Envoy's ``ext_proc`` filter opens one gRPC stream per HTTP request and sends it the request headers, the buffered
request body, the response headers and each response body chunk. The picker reads the OpenAI body, routes it
(:meth:`Sidecar.pick`), and answers the body message that ends the body with the destination in the
``x-gateway-destination-endpoint`` header (which an ``ORIGINAL_DST`` cluster with ``use_http_header`` connects to)
and in the ``envoy.lb`` dynamic metadata, as the endpoint-picker contract says. A request whose body ends with
trailers (HTTP/2) comes as one body message without ``end_of_stream``: it is routed on that message when Envoy says
its request body mode is ``BUFFERED`` (``protocol_config`` in its first message; newer Envoys, 1.40 included, send
it), as that answer is the last one that can change the request headers (a ``TrailersResponse`` mutates only the
trailers). From an Envoy that does not say its mode, such a body looks like the first chunk of a stream: it is not
routed, and falls back to Envoy's pool. In ``FULL_DUPLEX_STREAMED`` mode (the Gateway API Inference Extension's own
Envoy set-up; said in ``protocol_config``) Envoy sends the body without waiting for the headers' answer and sends on
only the body the answers carry: the picker answers the request headers once the body has ended (or its trailers
came), with the destination, then sends the body back whole, and sends each response chunk back as it came (when
the response body mode is full duplex too). The first response body chunk reports the first token (of a 200 answer, or
one whose ``:status`` the picker is not sent: an error's body is no first token); the last one, or the stream's end
for any other reason (upstream error, client abort: Envoy resets the stream), finishes the request, exactly once;
refused when the response headers' ``:status`` is a 4xx (the engine computed nothing). A body the picker cannot route
gets no header, so Envoy's route falls back to its plain balancer cluster (a request with no body too, or an empty
one ended by trailers, counted as a 400 as HTTP's empty body is). A message that is not a ``ProcessingRequest``, or
one that sets no phase (no answer fits it), ends the stream with ``INVALID_ARGUMENT`` (counted as a 400); a body over
the sidecar's ``max_body_bytes`` (streamed chunk by chunk, or buffered) is not kept nor routed (counted as a 413).

Needs the ``prefixroute[serve]`` extra (grpcio and the generated Envoy protos of ``xds-protos``).
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from google.protobuf.message import DecodeError

from prefixroute._numbers import as_float, shown
from prefixroute.adapters.serve.app import PICK_PATHS, Sidecar
from prefixroute.adapters.serve.contract import BadRequest, is_refusal
from prefixroute.adapters.urls import host_port
from prefixroute.errors import ConfigurationError

__all__ = ["DESTINATION_HEADER", "EndpointPicker", "start_ext_proc"]

_log = logging.getLogger(__name__)

DESTINATION_HEADER = "x-gateway-destination-endpoint"
"""Where the picked endpoint (``host:port``) goes: a request header and a key of the ``envoy.lb`` metadata."""
# Where a proxy lists the endpoints (ip:port) the picker may choose from: a key of the request's filter metadata under
# this namespace; none of the sidecar's backends among them is an ImmediateResponse 503 (the protocol's answer).
_SUBSET_NAMESPACE = "envoy.lb.subset_hint"
_SUBSET_KEY = "x-gateway-destination-endpoint-subset"


class EndpointPicker(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """The ``envoy.service.ext_proc.v3.ExternalProcessor`` service over a :class:`Sidecar` (grpc.aio)."""

    def __init__(self, sidecar: Sidecar) -> None:
        self._sidecar = sidecar

    async def Process(  # noqa: N802 - the gRPC method's name
        self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        """Handle one HTTP request's processing stream; release its decision when the stream ends, however."""
        path = ""
        body: list[bytes] = []
        size = 0
        decision_id: str | None = None
        picked = False
        answered_first = False
        status = ""  # the response's :status ("": not seen, the response headers not sent to the picker)
        refused = False
        whole = False  # Envoy said its request body mode is BUFFERED: its one body message is the whole body
        duplex = False  # FULL_DUPLEX_STREAMED: Envoy sends the body on as the picker's body answers carry it
        duplex_response = False  # the same, for the response body
        held = False  # duplex: the request headers' answer waits for the body, which the picker then sends back
        subset: frozenset[str] | None = None  # the endpoints the proxy lets the picker choose from (None: all)
        try:
            async for request in requests:
                if subset is None and request.HasField("metadata_context"):
                    subset = _subset_hint(request.metadata_context)
                if request.HasField("protocol_config"):  # newer Envoys (1.40 is tested) say it in the first message
                    whole = request.protocol_config.request_body_mode == ProcessingMode.BUFFERED
                    duplex = request.protocol_config.request_body_mode == ProcessingMode.FULL_DUPLEX_STREAMED
                    duplex_response = request.protocol_config.response_body_mode == ProcessingMode.FULL_DUPLEX_STREAMED
                kind = request.WhichOneof("request")
                if kind == "request_headers":
                    path = _header(request.request_headers.headers, ":path").split("?", 1)[0]
                    if request.request_headers.end_of_stream and path in PICK_PATHS and not picked:
                        picked = True  # no body will come: HTTP's empty body, a 400 (Envoy's pool serves it)
                        self._sidecar.metrics.refused(400)
                    if duplex and path in PICK_PATHS and not (picked or held):
                        held = True  # only the headers' answer can set the destination, and the body comes first
                        continue
                    yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())
                elif kind == "request_body" and held:  # duplex: keep the body, answer once it ends
                    body.append(request.request_body.body)
                    size += len(request.request_body.body)
                    ended = request.request_body.end_of_stream
                    if size > self._sidecar.max_body_bytes:  # as the other modes: 413, not routed
                        held, picked = False, True
                        self._sidecar.metrics.refused(413)
                        yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())
                        yield _sent_on("request_body", b"".join(body), ended)
                        body.clear()
                    elif ended:
                        held, picked = False, True
                        decision_id, response = await self._pick(path, b"".join(body), subset)
                        if response.HasField("immediate_response"):
                            yield response
                            return
                        yield _as_headers_answer(response)
                        yield _sent_on("request_body", b"".join(body), True)
                        body.clear()
                elif kind == "request_body" and duplex:  # the headers were answered: each chunk goes on as it came
                    yield _sent_on("request_body", request.request_body.body, request.request_body.end_of_stream)
                elif kind == "request_body":
                    if not picked:
                        size += len(request.request_body.body)
                        if size > self._sidecar.max_body_bytes:  # as the HTTP endpoints: 413, and no decision
                            picked = True  # the rest of the body is ignored: not kept, never routed
                            body.clear()
                            self._sidecar.metrics.refused(413)
                            _log.debug("ext_proc: not routed (the body is over %d bytes)", self._sidecar.max_body_bytes)
                        else:
                            body.append(request.request_body.body)
                    # A BUFFERED body whose request ends with trailers comes whole without end_of_stream, and only
                    # this answer can still change the request headers (a TrailersResponse mutates the trailers).
                    ended = request.request_body.end_of_stream or whole
                    if picked or not ended:  # a chunk of a streamed body, or body sent past its end: ignored
                        yield pb.ProcessingResponse(request_body=pb.BodyResponse())
                        continue
                    picked = True  # one pick a stream: a second decision would leave the first in flight
                    decision_id, response = await self._pick(path, b"".join(body), subset)
                    yield response
                    if response.HasField("immediate_response"):
                        return
                elif kind == "response_headers":
                    status = _header(request.response_headers.headers, ":status")
                    refused = status.isascii() and status.isdigit() and is_refusal(int(status))  # "²": not a digit
                    yield pb.ProcessingResponse(response_headers=pb.HeadersResponse())
                elif kind == "response_body":
                    chunk = request.response_body
                    if decision_id is not None:
                        if not answered_first:
                            answered_first = True
                            if status in ("", "200"):  # an error's body is no first token: it would teach a speed
                                self._sidecar.first_token(decision_id, via="ext_proc")
                        if chunk.end_of_stream:
                            self._sidecar.finish(decision_id, via="ext_proc", refused=refused)
                            decision_id = None
                    if duplex_response:
                        yield _sent_on("response_body", chunk.body, chunk.end_of_stream)
                    else:
                        yield pb.ProcessingResponse(response_body=pb.BodyResponse())
                elif kind == "request_trailers" and held:  # duplex: a body ended by trailers, routed now
                    held, picked = False, True
                    decision_id, response = await self._pick(path, b"".join(body), subset)
                    if response.HasField("immediate_response"):
                        yield response
                        return
                    yield _as_headers_answer(response)
                    if body:
                        yield _sent_on("request_body", b"".join(body), False)
                        body.clear()
                    yield pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
                elif kind == "request_trailers":
                    if not picked and path in PICK_PATHS:  # too late: Envoy no longer holds the request headers
                        picked = True
                        if not size:  # no body came before the trailers: HTTP's empty body, a 400 as above
                            self._sidecar.metrics.refused(400)
                        _log.debug("ext_proc: not routed (the trailers came before a body message that could be)")
                    yield pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
                elif kind == "response_trailers":
                    yield pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
                else:  # no phase set (or one a newer proto added): no answer fits, and the peer waits for one
                    self._sidecar.metrics.refused(400)
                    _log.debug("ext_proc: a ProcessingRequest sets no phase")
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _NO_PHASE)
        except DecodeError as exc:  # grpc raises it from the read: bad input, not a fault of the picker
            self._sidecar.metrics.refused(400)
            _log.debug("ext_proc: a message is not a ProcessingRequest (%s)", exc)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"a message is not a ProcessingRequest: {exc}")
        finally:
            if decision_id is not None:  # the stream ended before the response did: error, reset or abort
                self._sidecar.finish(decision_id, via="ext_proc", refused=refused)

    async def _pick(self, path: str, body: bytes, subset: frozenset[str] | None) -> tuple[str | None, Any]:
        """The decision for a request body and the answer that names its endpoint; no decision and an answer that
        leaves the request to Envoy's own route for a body not routed, or an ``ImmediateResponse`` 503 when the
        ``subset`` hint names none of the sidecar's backends (the protocol's answer then)."""
        if path not in PICK_PATHS:
            return None, pb.ProcessingResponse(request_body=pb.BodyResponse())
        try:  # a long prompt is tokenized off the event loop
            decision = await self._sidecar.pick_async(path, body, within=subset)
        except BadRequest as exc:  # not routable: no header, so Envoy's route falls back to its plain balancer
            self._sidecar.metrics.refused(exc.status)
            _log.debug("ext_proc: not routed (%s)", exc.message)
            if subset is not None and exc.status == 503:
                unavailable = pb.ImmediateResponse(
                    status=http_status_pb2.HttpStatus(code=http_status_pb2.ServiceUnavailable),
                    body=exc.message.encode(),
                    details="prefixroute: no endpoint of the subset hint",
                )
                return None, pb.ProcessingResponse(immediate_response=unavailable)
            return None, pb.ProcessingResponse(request_body=pb.BodyResponse())
        endpoint = self._sidecar.upstream(decision.backend)
        # Each replaces a client's own header of that name, whatever an Envoy makes of an unset append action.
        mutation = pb.HeaderMutation(
            set_headers=[
                base_pb2.HeaderValueOption(
                    header=base_pb2.HeaderValue(key=key, raw_value=value), append_action=_REPLACE
                )
                for key, value in ((DESTINATION_HEADER, endpoint), ("x-prefixroute-id", decision.id.encode()))
            ]
        )
        metadata = struct_pb2.Struct()
        metadata.update({"envoy.lb": {DESTINATION_HEADER: endpoint.decode("latin-1")}})
        response = pb.ProcessingResponse(
            request_body=pb.BodyResponse(response=pb.CommonResponse(header_mutation=mutation, clear_route_cache=True)),
            dynamic_metadata=metadata,
        )
        return decision.id, response


_REPLACE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_NO_PHASE = (
    "a ProcessingRequest sets no phase: send one of request_headers, request_body, request_trailers, "
    "response_headers, response_body or response_trailers"
)


def _subset_hint(metadata: Any) -> frozenset[str] | None:
    """The endpoints (``ip:port``) a request's ``envoy.lb.subset_hint`` filter metadata lets the picker choose from,
    None when it sets no ``x-gateway-destination-endpoint-subset``; a value that is not a list of strings names
    none (the protocol's 503)."""
    hint = metadata.filter_metadata.get(_SUBSET_NAMESPACE)
    if hint is None or _SUBSET_KEY not in hint.fields:
        return None
    value = hint.fields[_SUBSET_KEY]
    if value.WhichOneof("kind") != "list_value":
        return frozenset()
    return frozenset(item.string_value for item in value.list_value.values if item.WhichOneof("kind") == "string_value")


def _as_headers_answer(body_answer: Any) -> Any:
    """The request headers' answer that carries what ``body_answer`` (from :meth:`EndpointPicker._pick`) says."""
    answer = pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=body_answer.request_body.response))
    if body_answer.HasField("dynamic_metadata"):
        answer.dynamic_metadata.CopyFrom(body_answer.dynamic_metadata)
    return answer


def _sent_on(phase: str, data: bytes, end: bool) -> Any:
    """A full-duplex body answer: Envoy sends ``data`` on (``end``: the body's last part)."""
    sent = pb.StreamedBodyResponse(body=data, end_of_stream=end)
    answer = pb.BodyResponse(response=pb.CommonResponse(body_mutation=pb.BodyMutation(streamed_response=sent)))
    return pb.ProcessingResponse(**{phase: answer})


def _header(headers: Any, name: str) -> str:
    for header in headers.headers:
        if header.key == name:
            return header.raw_value.decode("latin-1") if header.raw_value else str(header.value)
    return ""


async def start_ext_proc(
    sidecar: Sidecar, host: str, port: int, *, keepalive_s: float = 30.0, keepalive_timeout_s: float = 10.0
) -> tuple[grpc.aio.Server, int]:
    """Start the endpoint picker on ``host:port`` (0: any free port); return the server and its port.

    The port is bound without ``SO_REUSEPORT`` (gRPC's default sets it), so a port another process already
    serves is refused rather than shared with it. A message may be as long as the sidecar's ``max_body_bytes`` and
    1 MiB more (a buffered body comes whole in one). The server pings each connection every ``keepalive_s`` seconds
    (idle or not, streams carrying data or not) and closes it when a ping goes unanswered for ``keepalive_timeout_s``:
    the streams of an Envoy that vanished without closing them (a host gone, a silent network partition) end then,
    and so release their decisions, instead of counting them in flight until their lease.

    Each of the sidecar's backends must name its host by IP address: the picker names the engine to Envoy as
    ``ip:port`` (the contract's form), and an ``ORIGINAL_DST`` cluster connects to an address, not a name (a host
    name failed every routed request with Envoy's 503, not even falling back to the pool).

    Raises:
        ConfigurationError: ``keepalive_s`` or ``keepalive_timeout_s`` is not a positive, finite number of seconds, or
            a backend's host is a name, not an IP address.
        OSError: the port cannot be bound.
    """
    named = next((backend for backend in sidecar.backends if not _is_ip(urlsplit(backend).hostname)), None)
    if named is not None:
        raise ConfigurationError(
            f"the endpoint picker names each engine to Envoy as ip:port (its ORIGINAL_DST cluster connects to an "
            f"address, not a name): give the backend {named!r} by its IP address, like http://10.0.0.1:8000"
        )
    time_ms = _milliseconds("keepalive_s", keepalive_s)
    timeout_ms = _milliseconds("keepalive_timeout_s", keepalive_timeout_s)
    # A buffered body comes in one message: let it be as long as the sidecar reads (gRPC's default stops at 4 MiB,
    # which failed the stream, so such a request fell back unrouted), with room for the headers.
    limit = sidecar.max_body_bytes + 2**20
    options = [
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", limit),
        ("grpc.keepalive_time_ms", time_ms),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        # gRPC times a keepalive ping's ack with this one too (default 1 min): with grpcio 1.85 and only
        # keepalive_timeout_ms set, an unanswered ping got a 60 s timer (its http2_ping trace says so).
        ("grpc.http2.ping_timeout_ms", timeout_ms),
        ("grpc.keepalive_permit_without_calls", 1),  # a connection with no stream left: closed too, once dead
        ("grpc.http2.max_pings_without_data", 0),  # no cap: a stream waiting out a long prefill carries no data
    ]
    server = grpc.aio.server(options=options)
    pb_grpc.add_ExternalProcessorServicer_to_server(EndpointPicker(sidecar), server)
    address = host_port(host, port)  # gRPC reads ::1:0 as ::0.1.0.0, port 443
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError:  # grpcio raises this ("Failed to bind to address ...") where it once returned 0
        bound = 0
    if bound == 0:
        raise OSError(f"cannot bind the ext_proc port {address}")
    await server.start()
    return server, bound


def _is_ip(host: str | None) -> bool:
    try:
        ipaddress.ip_address(host or "")
    except ValueError:
        return False
    return True


def _milliseconds(name: str, value: object) -> int:
    """``value`` seconds as whole milliseconds (at least 1), if it is a positive, finite number; else a
    ConfigurationError."""
    seconds = as_float(value)
    if seconds is None or seconds <= 0:
        raise ConfigurationError(f"{name} must be a positive, finite number of seconds, not {shown(value)}")
    return max(1, round(seconds * 1000))
