"""Shared helpers for the vLLM integration tests: real sockets on 127.0.0.1, waits with a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

DEADLINE_S = 10.0


def wait_until(predicate: Callable[[], bool], *, timeout: float = DEADLINE_S, what: str = "condition") -> None:
    """Poll ``predicate`` every few ms until it holds; fail the test with ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.005)
