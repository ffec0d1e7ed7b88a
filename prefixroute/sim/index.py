"""The simulator's index for exact mode: written only by the simulated engines' KV events."""

from __future__ import annotations

from collections.abc import Sequence

from prefixroute.index import PrefixIndex, _check_prediction, _check_retraction

__all__ = ["EventsOnlyIndex"]


class EventsOnlyIndex(PrefixIndex):
    """A :class:`~prefixroute.PrefixIndex` that routing never writes: only :meth:`Router.store` and
    :meth:`Router.evict` (the engines' KV events) change it, so it holds exactly what the engines cache.

    Every block it holds is confirmed by an event, so :meth:`match_confirmed` is the match itself. Defined here
    rather than taken from :mod:`prefixroute.vllm`, so the simulator needs neither the ``vllm`` extra nor pyzmq.

    >>> index = EventsOnlyIndex(4)
    >>> index.predict([11, 12], "gpu0", 0)          # a routing decision records nothing
    >>> index.match([11, 12], ["gpu0"])
    {'gpu0': 0}
    >>> index.insert([11, 12], "gpu0")              # an event: the engine cached both blocks
    >>> index.match([11, 12], ["gpu0"]), index.match_confirmed([11, 12], "gpu0")
    ({'gpu0': 2}, 2)
    """

    __slots__ = ()

    def predict(self, hashes: Sequence[int], backend: str, held: int) -> None:
        """Record nothing: only the engines' events say what a backend holds. O(1) for a router's own hashes.

        Raises as :meth:`PrefixIndex.predict` does.
        """
        _check_prediction(hashes, backend, held)

    def retract(self, hashes: Sequence[int], backend: str, start: int) -> None:
        """Forget nothing: routing recorded nothing, and every block held is the events'. O(len(hashes)) to check
        them (rare: a refusal).

        Raises as :meth:`PrefixIndex.retract` does.
        """
        _check_retraction(hashes, backend, start)

    def match_confirmed(self, hashes: Sequence[int], backend: str) -> int | None:
        """The leading blocks of ``hashes`` that ``backend`` holds: all of them are confirmed by events.

        Same cost as :meth:`PrefixIndex.match` for one backend.
        """
        return self.match(hashes, (backend,))[backend]
