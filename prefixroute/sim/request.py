"""What a simulated request is (:class:`SimRequest`) and what happened to it (:class:`RequestRecord`)."""

from __future__ import annotations

import array
from dataclasses import dataclass

__all__ = ["RequestRecord", "SimRequest", "token_bytes"]

_UINT32 = "I" if array.array("I").itemsize == 4 else "L"


def token_bytes(start: int, count: int) -> bytes:
    """Return ``count`` consecutive token ids from ``start`` as little-endian uint32 bytes. O(count).

    Simulated prompts are built from such runs: the content does not matter, only which requests share it.
    ``start + count`` must stay below ``2**32``.
    """
    if count < 0 or start < 0 or start + count > 2**32:
        raise ValueError(f"token run [{start}, {start + count}) is outside the uint32 token id range")
    return array.array(_UINT32, range(start, start + count)).tobytes()


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request a workload issues: its prompt, how many tokens it generates, and when it arrives.

    ``prompt`` holds little-endian uint32 token ids (what :class:`~prefixroute.Router` and the hasher accept
    without copying). ``output`` optionally holds the token ids the model will generate, when the workload knows
    them (multi-turn chat, whose next prompt contains this answer): the simulated backend then caches full output
    blocks, as vLLM does. ``arrival`` is the trace's arrival time in seconds (open-loop replay), else None.
    ``tag`` names the request's class (its shared prefix, document, session) for reports.
    """

    prompt: bytes
    output_tokens: int
    output: bytes | None = None
    arrival: float | None = None
    tag: str = ""

    def __post_init__(self) -> None:
        if len(self.prompt) % 4 or not self.prompt:
            raise ValueError("prompt must be non-empty little-endian uint32 token ids (a multiple of 4 bytes)")
        if self.output_tokens < 1:
            raise ValueError(f"output_tokens must be >= 1, not {self.output_tokens}")
        if self.output is not None and len(self.output) != 4 * self.output_tokens:
            raise ValueError("output must hold exactly output_tokens token ids")

    @property
    def prompt_tokens(self) -> int:
        """Number of prompt tokens."""
        return len(self.prompt) // 4


@dataclass(slots=True)
class RequestRecord:
    """The simulator's account of one request, filled in as it runs; times are simulated seconds.

    ``cached_tokens`` is what the backend's prefix cache actually supplied when the request was first scheduled
    (vLLM's ``prefix_cache_hits``); ``predicted_tokens`` is what the router expected (``decision.matched_tokens``);
    ``fleet_cached_tokens`` is the longest prefix any backend held at that moment, so ``fleet - cached`` tokens
    were recomputed although cached elsewhere. ``computed_prompt_tokens`` counts prompt tokens the backend
    prefilled, including recomputation after a preemption.
    """

    request_id: int
    user: int
    tag: str
    arrival: float
    prompt_tokens: int
    output_tokens: int
    backend: str = ""
    predicted_tokens: int = 0
    cached_tokens: int = 0
    fleet_cached_tokens: int = 0
    computed_prompt_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    rejected: bool = False
    recompute_seconds: float = 0.0

    @property
    def ttft(self) -> float:
        """Time to first token (seconds); raises ValueError if the request produced none."""
        if self.first_token is None:
            raise ValueError(f"request {self.request_id} produced no token")
        return self.first_token - self.arrival

    @property
    def e2e(self) -> float:
        """End-to-end latency (seconds); raises ValueError if the request did not finish."""
        if self.finished is None:
            raise ValueError(f"request {self.request_id} did not finish")
        return self.finished - self.arrival
