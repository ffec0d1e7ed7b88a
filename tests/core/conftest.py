"""Shared helpers for the core tests."""

from __future__ import annotations


class FakeClock:
    """A clock the test moves by hand (``Router(clock=...)``)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def tick(self, seconds: float) -> None:
        self.now += seconds
