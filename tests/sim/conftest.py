"""Fixtures for the simulator tests: the repository's data folder and a simple, exact cost model."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
DATA = REPO_ROOT / "data"


class LinearCost:
    """A cost model simple enough to reason about: fixed step overhead plus per-token and per-sequence terms."""

    def __init__(self, *, overhead: float = 0.01, per_token: float = 1e-4, per_sequence: float = 1e-3) -> None:
        self.overhead = overhead
        self.per_token = per_token
        self.per_sequence = per_sequence

    def step_seconds(self, prefill: Sequence[tuple[int, int]], decode_contexts: Sequence[int]) -> float:
        tokens = sum(new for new, _cached in prefill)
        return self.overhead + self.per_token * tokens + self.per_sequence * len(decode_contexts)

    def prefill_seconds(self, new_tokens: int, cached_tokens: int) -> float:
        return self.overhead + self.per_token * new_tokens


class StepLog(LinearCost):
    """LinearCost that keeps every step it was asked to price: (prefill chunks, decode contexts)."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[tuple[list[tuple[int, int]], list[int]]] = []

    def step_seconds(self, prefill: Sequence[tuple[int, int]], decode_contexts: Sequence[int]) -> float:
        self.steps.append((list(prefill), list(decode_contexts)))
        return super().step_seconds(prefill, decode_contexts)


@pytest.fixture
def cost() -> LinearCost:
    return LinearCost()


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The repository's ``data/`` folder (real traces and profiles, each with its licence and SOURCE.md)."""
    assert DATA.is_dir(), f"{DATA} is missing: it is part of the repository"
    return DATA
