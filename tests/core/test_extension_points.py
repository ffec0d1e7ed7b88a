"""Each override point the docs advertise takes effect through the public path that uses it: a subclass's hook is
called by the router (no private shortcut past it), with the arguments the docs give."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prefixroute import Candidate, CostAware, PredictedTTFT, PrefixIndex, Router
from prefixroute.index import LRUStore

BACKENDS = ["gpu0", "gpu1", "gpu2"]
PROMPT = list(range(64))  # 4 blocks of 16


class Recording(PrefixIndex):
    """Every hook of docs/internals.md, recording its calls and then doing the default."""

    def __init__(self, block_size: int = 16, *, capacity_blocks: int | None = None) -> None:
        super().__init__(block_size, capacity_blocks=capacity_blocks)
        self.calls: list[tuple[str, str]] = []

    def match(self, hashes: Sequence[int], backends: Iterable[str]) -> dict[str, int]:
        self.calls.append(("match", ""))
        return super().match(hashes, backends)

    def predict(self, hashes: Sequence[int], backend: str, held: int) -> None:
        self.calls.append(("predict", backend))
        super().predict(hashes, backend, held)

    def retract(self, hashes: Sequence[int], backend: str, start: int) -> None:
        self.calls.append(("retract", backend))
        super().retract(hashes, backend, start)

    def match_confirmed(self, hashes: Sequence[int], backend: str) -> int | None:
        self.calls.append(("match_confirmed", backend))
        return 1

    def evict(self, backend: str, store: LRUStore, excess: int) -> int:
        self.calls.append(("evict", backend))
        return super().evict(backend, store, excess)

    def insert(self, hashes: Sequence[int], backend: str, *, parent: int | None = None) -> None:
        self.calls.append(("insert", backend))
        super().insert(hashes, backend, parent=parent)

    def remove(self, hashes: Iterable[int], backend: str) -> None:
        self.calls.append(("remove", backend))
        super().remove(hashes, backend)


def test_the_router_calls_every_index_hook_of_a_subclass() -> None:
    index = Recording(capacity_blocks=8)
    router = Router(index=index)
    decision = router.route(PROMPT, BACKENDS)
    assert index.calls == [("match", ""), ("match_confirmed", decision.backend), ("predict", decision.backend)]
    assert decision.confirmed_tokens == 16  # the override's 1 block
    index.calls.clear()
    decided = router.decide(PROMPT, BACKENDS)
    other = next(b for b in BACKENDS if b != decided.backend)
    committed = router.commit(decided, other)
    assert ("predict", other) in index.calls and ("predict", decided.backend) not in index.calls
    router.start(committed)
    index.calls.clear()
    router.finish(committed, refused=True)
    assert index.calls == [("retract", other)]
    index.calls.clear()
    router.store("gpu0", [1, 2, 3])
    router.evict("gpu0", [3])
    router.write("gpu0", [(True, [4], 2), (False, [4], None)])
    assert index.calls == [("insert", "gpu0"), ("remove", "gpu0"), ("insert", "gpu0"), ("remove", "gpu0")]
    index.calls.clear()
    for document in range(3):  # 12 blocks on a capacity of 8
        router.route([1000 + document] * 64, ["gpu1"])
    assert ("evict", "gpu1") in index.calls


def test_a_match_override_steers_routing() -> None:
    class Pinned(PrefixIndex):
        def match(self, hashes: Sequence[int], backends: Iterable[str]) -> dict[str, int]:
            return {backend: (len(hashes) if backend == "gpu2" else 0) for backend in backends}

    decision = Router(index=Pinned()).route(PROMPT, BACKENDS)
    assert (decision.backend, decision.reason, decision.matched_tokens) == ("gpu2", "prefix", 64)


def test_a_predicted_ttft_subclass_cost_and_cap_terms_are_used() -> None:
    """``choose()`` has an inlined fast path for the built-in cost: a subclass's own ``cost()`` must bypass it."""
    seen: list[tuple[int, float]] = []

    class LastIsCheapest(PredictedTTFT):
        def cost(
            self, candidate: Candidate, *, speed: float = 1.0, common_tokens: int = 0, typical_prompt: float = 0.0
        ) -> float:
            seen.append((common_tokens, typical_prompt))
            return -float(candidate.backend[-1])

        @staticmethod
        def cap_terms(candidates: Sequence[Candidate]) -> tuple[int, float]:
            return 7, 11.0

    candidates = [Candidate(b, 0, 64, 0) for b in BACKENDS]
    assert PredictedTTFT().choose(candidates).backend == "gpu0"  # all equal: the first in placement order
    assert LastIsCheapest().choose(candidates).backend == "gpu2"
    assert seen == [(7, 11.0)] * 3
    router = Router(policy=LastIsCheapest())
    assert router.route(PROMPT, BACKENDS).backend == "gpu2"


def test_a_cost_aware_cost_function_is_used() -> None:
    chosen = Router(policy=CostAware(cost=lambda c: -c.backend.count("1"))).route(PROMPT, BACKENDS)
    assert chosen.backend == "gpu1"


def test_a_cost_aware_subclass_cost_method_is_used() -> None:
    """A subclass that defines ``cost()`` as a method, as :class:`PredictedTTFT`'s subclasses do, is choosing by it:
    the default cost function must not shadow it; a ``cost=`` given to the constructor still wins."""

    class LastIsCheapest(CostAware):
        def cost(self, candidate: Candidate) -> float:
            return -float(candidate.backend[-1])

    candidates = [Candidate(b, 0, 64, 0) for b in BACKENDS]
    assert CostAware().choose(candidates).backend == "gpu0"  # all equal under LinearTTFT: the first
    assert LastIsCheapest().choose(candidates).backend == "gpu2"
    assert Router(policy=LastIsCheapest()).route(PROMPT, BACKENDS).backend == "gpu2"
    assert LastIsCheapest(cost=lambda c: -c.backend.count("1")).choose(candidates).backend == "gpu1"
