"""Try a routing policy offline: run it through the simulator against the built-in ones.

The simulator drives the real ``Router`` against simulated vLLM engines (calibrated cost model, block-level prefix
cache, continuous batching), so the numbers below are what this policy would do to a fleet's KV hit rate, time to
first token and throughput. Needs the ``prefixroute[sim]`` extra; runs in a few seconds.

Run: ``python examples/simulate_policy.py``
"""

from __future__ import annotations

from collections.abc import Sequence

from prefixroute import Candidate, LoadPolicy
from prefixroute.sim import SimSpec, run_policy


class AffinityWithinQueue(LoadPolicy):
    """The longest cached prefix among backends with at most ``max_in_flight`` open requests; else least loaded."""

    prefix_aware = True

    def __init__(self, *, max_in_flight: int = 6) -> None:
        self.max_in_flight = max_in_flight

    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        open_ = [c for c in candidates if c.in_flight < self.max_in_flight]
        if not open_:
            return min(candidates, key=lambda c: c.in_flight)
        return max(open_, key=lambda c: (c.matched_tokens, -c.in_flight))


def main() -> None:
    spec = SimSpec(scenario="hot-prefix", requests=600, seed=1)  # 80 % of traffic on one system prompt
    results = [run_policy(spec, name) for name in ("round-robin", "bounded-load")]
    results.append(run_policy(spec, AffinityWithinQueue, label="affinity-within-queue"))
    print(f"{'policy':<24} {'KV hit':>7} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'req/s':>6} {'max share':>10}")
    for result in results:
        print(
            f"{result.policy:<24} {result.hit_rate:>7.1%} {result.ttft_ms['p50']:>12.0f} "
            f"{result.ttft_ms['p99']:>12.0f} {result.throughput_rps:>6.2f} {result.max_backend_share:>10.0%}"
        )


if __name__ == "__main__":
    main()
