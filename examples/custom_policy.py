"""Write your own load policy: subclass LoadPolicy, override choose(), and plug it into the Router.

This one prefers the longest cached prefix but never sends a request to a backend whose KV cache is nearly full
(``kv_usage`` from engine metrics, when known), nor to one with more than ``max_in_flight`` requests open.

Run: ``python examples/custom_policy.py``
"""

from __future__ import annotations

from collections.abc import Sequence

from prefixroute import Candidate, LoadPolicy, Router


class CacheAwareCapped(LoadPolicy):
    """Longest cached prefix among backends under ``max_in_flight`` and ``max_kv_usage``; else least loaded."""

    name = "cache-aware-capped"
    prefix_aware = True  # label passed-over longer matches as "load-fallback"

    def __init__(self, *, max_in_flight: int = 8, max_kv_usage: float = 0.95) -> None:
        self.max_in_flight = max_in_flight
        self.max_kv_usage = max_kv_usage

    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        allowed = [
            c
            for c in candidates
            if c.in_flight < self.max_in_flight and (c.kv_usage is None or c.kv_usage < self.max_kv_usage)
        ]
        if not allowed:
            return min(candidates, key=lambda c: c.load)
        # Candidates come in deterministic placement order, so max() keeps replicas in agreement on ties.
        return max(allowed, key=lambda c: (c.matched_tokens, -c.load))


def main() -> None:
    router = Router(block_size=16, policy=CacheAwareCapped(max_in_flight=2))
    backends = ["gpu0", "gpu1", "gpu2"]
    system_prompt = list(range(1000, 1512))
    for question in range(5):
        decision = router.route(system_prompt + [question] * 20, backends)
        router.start(decision)  # keep every request open to show the cap at work
        print(f"request {question}: {decision.backend} ({decision.reason}, {decision.matched_tokens} cached tokens)")


if __name__ == "__main__":
    main()
