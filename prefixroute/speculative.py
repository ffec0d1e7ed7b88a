"""Predictions that expire, and the path by which vLLM's KV events override them (the router's hybrid mode)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from prefixroute.index import PrefixIndex

__all__ = ["EventSink", "SpeculativeIndex"]


class EventSink:
    """What a KV-event subscriber writes through: the confirmed index, and the speculative entries it overrides.

    Called with the router's lock held (the subscriber shares it).
    """

    def __init__(self, index: PrefixIndex, speculative: SpeculativeIndex) -> None:
        self._index = index
        self._speculative = speculative
        self.block_size = index.block_size

    def insert(self, hashes: Sequence[int], backend: str) -> None:
        self._index.insert(hashes, backend)

    def remove(self, hashes: Sequence[int], backend: str) -> None:
        self._index.remove(hashes, backend)
        self._speculative.remove(hashes, backend)

    def remove_backend(self, backend: str) -> None:
        self._index.remove_backend(backend)
        self._speculative.remove_backend(backend)


class SpeculativeIndex:
    """Blocks of just-routed prompts, trusted until the engine's events catch up, then forgotten.

    Two generations of :class:`PrefixIndex`: entries go into the current one, which becomes the previous one every
    ``ttl`` seconds, when the old previous one is dropped whole. An entry thus lives between ``ttl`` and ``2 × ttl``
    seconds, and expiry costs O(1) instead of a timer per block.
    """

    def __init__(self, block_size: int, *, ttl: float, clock: Callable[[], float]) -> None:
        self._block_size = block_size
        self._ttl = ttl
        self._clock = clock
        self._current = PrefixIndex(block_size)
        self._previous = PrefixIndex(block_size)
        self._rotated_at = clock()

    def _rotate(self) -> None:
        now = self._clock()
        if now - self._rotated_at >= self._ttl:
            # Two periods idle: the current generation has expired too.
            self._previous = self._current if now - self._rotated_at < 2 * self._ttl else PrefixIndex(self._block_size)
            self._current = PrefixIndex(self._block_size)
            self._rotated_at = now

    def match(self, hashes: Sequence[int], backends: Sequence[str], confirmed: dict[str, int]) -> dict[str, int]:
        """Per backend, the longer of its confirmed match and its speculative match."""
        self._rotate()
        current = self._current.match(hashes, backends)
        previous = self._previous.match(hashes, backends)
        return {b: max(confirmed[b], current[b], previous[b]) for b in backends}

    def insert(self, hashes: Sequence[int], backend: str) -> None:
        self._current.insert(hashes, backend)

    def remove(self, hashes: Sequence[int], backend: str) -> None:
        self._current.remove(hashes, backend)
        self._previous.remove(hashes, backend)

    def remove_backend(self, backend: str) -> None:
        self._current.remove_backend(backend)
        self._previous.remove_backend(backend)
