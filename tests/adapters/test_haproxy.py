"""examples/haproxy on Debian's HAProxy beyond the checks every gateway passes (test_gateways.py): a hung sidecar."""

from __future__ import annotations

import signal
import statistics
import time
from collections.abc import Iterator

import pytest

from prefixroute.adapters.serve.loopback import start_haproxy

from ..conftest import wait_until
from .test_serve_scenarios import (
    FAIL_OPEN_SLACK_S,
    Stack,
    body,
    make_stack,
    need_binary,
    timed_stream,
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    need_binary("haproxy")
    yield from make_stack(tmp_path_factory.mktemp("haproxy"), start_haproxy, "udp")


def test_a_hung_sidecar_is_skipped_once_its_health_check_fails(stack: Stack) -> None:
    """A sidecar that accepts but never answers costs at most the Lua timeout until HAProxy's check marks it down."""
    assert stack.sidecar is not None
    direct = statistics.median(timed_stream(stack.engines[0].url, body(8500 + i)) for i in range(3))
    process = stack.sidecar.popen
    process.send_signal(signal.SIGSTOP)
    try:
        time.sleep(1.5)  # the check runs every 500 ms and gives up after 200 ms: down after one failure
        took = [timed_stream(stack.url, body(8600 + i)) for i in range(4)]
        assert max(took) - direct < FAIL_OPEN_SLACK_S, f"a hung sidecar still delays requests: {took} vs {direct}"
    finally:
        process.send_signal(signal.SIGCONT)
    wait_until(lambda: routed(stack), what="HAProxy to route through the sidecar again")


def routed(stack: Stack) -> bool:
    """Whether a request sent now is decided by the sidecar (rather than the plain balancer)."""
    before = stack.stats()["decisions"]
    timed_stream(stack.url, body(8700))
    return stack.stats()["decisions"] != before
