"""What a simulated request is (:class:`SimRequest`) and what happened to it (:class:`RequestRecord`)."""

from __future__ import annotations

import array
from dataclasses import dataclass

from prefixroute._numbers import as_float, as_int, shown
from prefixroute.errors import ConfigurationError, InvalidPromptError, InvalidTypeError, StateError

__all__ = ["RequestRecord", "SimRequest", "token_bytes"]

_UINT32 = "I" if array.array("I").itemsize == 4 else "L"


def token_bytes(start: int, count: int) -> bytes:
    """Return ``count`` consecutive token ids from ``start`` as little-endian uint32 bytes. O(count).

    Simulated prompts are built from such runs: the content does not matter, only which requests share it.

    Raises:
        InvalidTypeError: ``start`` or ``count`` is not an int.
        InvalidPromptError: either is negative, or the run passes the largest uint32 id (``start + count > 2**32``).
    """
    first, length = as_int(start), as_int(count)
    if first is None or length is None:
        raise InvalidTypeError(f"token_bytes() takes ints, not {type(start).__name__} and {type(count).__name__}")
    if length < 0 or first < 0 or first + length > 2**32:
        raise InvalidPromptError(f"token run [{first}, {first + length}) is outside the uint32 token id range")
    return array.array(_UINT32, range(first, first + length)).tobytes()


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
        """Raises InvalidTypeError for a field of the wrong type (``prompt`` and ``output`` are bytes, ``tag`` a
        str), InvalidPromptError for an empty prompt or one that is not whole uint32 ids, ConfigurationError for
        ``output_tokens`` below 1, an ``output`` of another length or an ``arrival`` that is not a finite number of
        seconds, 0 or more."""
        for name in ("prompt", "output"):
            value = getattr(self, name)
            if not isinstance(value, bytes) and (name == "prompt" or value is not None):
                raise InvalidTypeError(
                    f"SimRequest {name} must be bytes (uint32 token ids), not {type(value).__name__}"
                )
        if len(self.prompt) % 4 or not self.prompt:
            raise InvalidPromptError("prompt must be non-empty little-endian uint32 token ids (a multiple of 4 bytes)")
        count = as_int(self.output_tokens)
        if count is None or count < 1:
            raise ConfigurationError(f"output_tokens must be an int >= 1, not {shown(self.output_tokens)}")
        object.__setattr__(self, "output_tokens", count)  # frozen: a numpy int kept as the int it stands for
        if self.output is not None and len(self.output) != 4 * count:
            raise ConfigurationError(f"output must hold exactly output_tokens ({count}) token ids")
        if self.arrival is not None:
            arrival = as_float(self.arrival)
            if arrival is None or arrival < 0:
                raise ConfigurationError(
                    f"arrival must be a finite number of seconds >= 0 or None, not {shown(self.arrival)}"
                )
            object.__setattr__(self, "arrival", arrival)
        if not isinstance(self.tag, str):
            raise InvalidTypeError(f"SimRequest tag must be a str, not {type(self.tag).__name__}")

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
        """Time to first token (seconds); raises :class:`~prefixroute.StateError` if the request produced none."""
        if self.first_token is None:
            raise StateError(f"request {self.request_id} produced no token: it has no time to first token")
        return self.first_token - self.arrival

    @property
    def e2e(self) -> float:
        """End-to-end latency (seconds); raises :class:`~prefixroute.StateError` if the request did not finish."""
        if self.finished is None:
            raise StateError(f"request {self.request_id} did not finish: it has no end-to-end latency")
        return self.finished - self.arrival
