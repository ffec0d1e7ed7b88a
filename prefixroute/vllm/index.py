"""An index written by vLLM's KV events, which can also trust just-routed prompts for a few seconds."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Iterable, Sequence

from prefixroute._arguments import read_clock
from prefixroute._numbers import as_float, shown
from prefixroute.errors import ConfigurationError, InvalidTypeError
from prefixroute.index import PrefixIndex, _check_hashes, _check_prediction, _check_retraction

__all__ = ["EventIndex"]


class EventIndex(PrefixIndex):
    """The index of a router fed by KV events: *confirmed* blocks (what the engines' events say they hold) plus
    short-lived *speculative* entries for prompts the router has just sent, until the engines' events catch up.

    Give it to the router (``Router(index=EventIndex(16))``) and add each engine's event endpoint to a
    :class:`~prefixroute.vllm.Fleet`. What each method acts on:

    * :meth:`match` (what routing sees): per backend, the longer of its confirmed and its unexpired speculative
      match; :meth:`match_confirmed`: the confirmed match alone (``Decision.confirmed_tokens``);
    * :meth:`predict` (called for every routing decision): records a speculative entry; with
      ``speculative_ttl=0`` it does nothing and the index holds only what the events say; :meth:`retract` (a
      refused request) forgets speculative entries only;
    * :meth:`insert`, :meth:`set_capacity`, :meth:`hashes`, :meth:`blocks`, ``len()``: the confirmed part;
    * :meth:`remove` (a block the engine evicted): both parts, so an eviction overrides a speculation;
    * :meth:`remove_backend` and :meth:`clear`: both parts.

    A speculative entry lives between ``speculative_ttl`` and twice that (two generations that rotate every
    ``speculative_ttl`` seconds of ``clock``, so expiry is O(1), not a timer per block). Not thread-safe by itself:
    the :class:`~prefixroute.Router` calls it under its lock.

    Raises:
        ConfigurationError: ``speculative_ttl`` is not a finite number of seconds >= 0, or ``clock``, read once here,
            raises or returns no finite number of seconds (later, a reading that is no number only distrusts the
            predictions).

    >>> clock = iter([0.0, 0.0, 1.0, 7.0]).__next__
    >>> index = EventIndex(4, speculative_ttl=3.0, clock=clock)
    >>> index.predict([11, 12], "gpu0", 0)                         # routed there just now
    >>> index.match([11, 12], ["gpu0"]), index.match_confirmed([11, 12], "gpu0")
    ({'gpu0': 2}, 0)
    >>> index.match([11, 12], ["gpu0"])                             # 7 s later, no event confirmed it
    {'gpu0': 0}
    """

    __slots__ = ("_clock", "_current", "_previous", "_rotated_at", "_ttl")

    def __init__(
        self, block_size: int = 16, *, speculative_ttl: float = 3.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__(block_size)
        ttl = as_float(speculative_ttl)
        if ttl is None or ttl < 0:
            raise ConfigurationError(
                "speculative_ttl must be a finite number of seconds >= 0 (0: events only), "
                f"not {shown(speculative_ttl)}"
            )
        if not callable(clock):
            raise InvalidTypeError(f"clock must be a callable returning seconds, not {type(clock).__name__}")
        self._ttl = ttl
        self._clock = clock
        self._current = PrefixIndex(block_size)
        self._previous = PrefixIndex(block_size)
        self._rotated_at = 0.0
        if self._ttl:  # read when given: a clock that never returns seconds would distrust every prediction unsaid
            self._rotated_at = read_clock(clock)

    @property
    def speculative_ttl(self) -> float:
        """Seconds a speculative entry is trusted at least (0: never recorded)."""
        return self._ttl

    def match(self, hashes: Sequence[int], backends: Iterable[str]) -> dict[str, int]:
        """Per backend, the longer of its confirmed match and its speculative match.

        O(cost of :meth:`PrefixIndex.match`) for each of the two generations and the confirmed part.
        """
        confirmed = super().match(hashes, backends)
        if not self._ttl:
            return confirmed
        self._rotate()
        current = self._current.match(hashes, confirmed)
        previous = self._previous.match(hashes, confirmed)
        return {b: max(held, current[b], previous[b]) for b, held in confirmed.items()}

    def match_confirmed(self, hashes: Sequence[int], backend: str) -> int:
        """How many leading blocks of ``hashes`` the events confirm ``backend`` holds. O(log len(hashes))."""
        return super().match(hashes, (backend,))[backend]

    def predict(self, hashes: Sequence[int], backend: str, held: int) -> None:
        """Trust for a while that ``backend`` now holds ``hashes`` (nothing with ``speculative_ttl=0``, nor for a
        prompt of more blocks than the backend keeps, which its engine refuses, as :meth:`PrefixIndex.predict`). O(n).

        Raises as :meth:`PrefixIndex.predict` does, with any ``speculative_ttl``.
        """
        hashes, backend, held = _check_prediction(hashes, backend, held)
        capacity = self._limit(backend)
        if self._ttl and (capacity is None or len(hashes) <= capacity):
            self._rotate()
            self._current.predict(hashes, backend, 0)

    def retract(self, hashes: Sequence[int], backend: str, start: int) -> None:
        """Forget the speculative entries of ``hashes`` from block ``start`` on (the engine refused the prompt);
        the confirmed part, what the events say, stays. O(len(hashes) - start).

        Raises as :meth:`PrefixIndex.retract` does, with any ``speculative_ttl``.
        """
        hashes, backend, start = _check_retraction(hashes, backend, start)
        if self._ttl and start < len(hashes):
            self._current.retract(hashes, backend, start)
            self._previous.retract(hashes, backend, start)

    def remove(self, hashes: Iterable[int], backend: str) -> None:
        """Forget that ``backend`` holds ``hashes``, confirmed or speculative. O(len(hashes))."""
        if not self._ttl:
            super().remove(hashes, backend)
            return
        hashes = _check_hashes(hashes)  # read three times: an iterator once, into a list
        super().remove(hashes, backend)
        self._current.remove(hashes, backend)
        self._previous.remove(hashes, backend)

    def remove_backend(self, backend: str) -> Collection[int]:
        """Forget every block of ``backend``, confirmed or speculative; return the confirmed ones, to be freed
        outside the caller's lock. O(speculative blocks of the backend)."""
        self._current.remove_backend(backend)
        self._previous.remove_backend(backend)
        return super().remove_backend(backend)

    def clear(self) -> None:
        """Forget every block of every backend, confirmed or speculative. O(entries)."""
        super().clear()
        self._current.clear()
        self._previous.clear()

    def speculative_blocks(self, backend: str) -> int:
        """How many distinct blocks of ``backend`` are trusted speculatively now (for tests and metrics). O(n)."""
        self._rotate()
        return len(self._current.hashes(backend) | self._previous.hashes(backend))

    def _rotate(self) -> None:
        if not self._ttl:
            return
        now = self._now()
        periods = (now - self._rotated_at) / self._ttl
        # A clock that went back, or a NaN, infinite or no number's reading, or a jump too far to count in periods
        # of ttl (a huge one, or a ttl of 1e-320 s): start over rather than trust forever (or overflow).
        sane = 0 <= periods < math.inf
        if periods >= 1 or not sane:
            # Generations turn on whole periods from the first, however late this call comes, so an entry made in
            # one period is dropped at the end of the next: it lives at least ttl and less than 2 x ttl.
            whole = math.floor(periods) if sane else 2
            self._previous = self._current if whole == 1 else PrefixIndex(self.block_size)
            self._current = PrefixIndex(self.block_size)
            self._rotated_at = self._rotated_at + whole * self._ttl if sane else now

    def _now(self) -> float:
        """The clock's reading as a float; NaN for one that is no number (None, a str), which _rotate() takes as
        it takes a NaN one: a broken clock makes the index trust no prediction, it fails no route."""
        now = as_float(self._clock(), infinite=True)
        return math.nan if now is None else now

    def _check(self, *, chains: Iterable[Sequence[int]] = ()) -> None:
        """Assert the invariants of both parts (for tests; ``chains`` as :meth:`PrefixIndex._check`, for the
        confirmed part). O(entries + chains × backends)."""
        super()._check(chains=chains)
        self._current._check()
        self._previous._check()

    def __repr__(self) -> str:
        return (
            f"EventIndex(block_size={self.block_size}, speculative_ttl={self._ttl:g}, entries={len(self)}, "
            f"speculative={len(self._current) + len(self._previous)})"
        )
