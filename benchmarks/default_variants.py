"""Variants of the default policy's cost, judged on the policy suite as the default is (docs/policies.md).

Each variant is a :class:`~prefixroute.PredictedTTFT` subclass that overrides :meth:`~prefixroute.PredictedTTFT.cost`
(the public extension point), so everything else (the KV-memory stretch, ties) stays the default's. Every variant,
the default and every built-in and baseline policy run on the suite's workloads without engine metrics (the six
scenarios and the two real traces, seed 0, as ``make policies`` runs them); each variant is then judged as if it
were the default, against all the other policies, by the suite's own rule (:func:`prefixroute.sim.suite.judge`).
Prints the P99 TTFT per workload (a throughput below 0.97x the best in brackets) and how many workloads pass.

Run from the repository root: ``python benchmarks/default_variants.py`` (about 5 minutes on two cores;
``--quick`` for one short workload). Each class here is also a policy for the simulator, run from this folder:
``prefixroute simulate --scenario seed --policy predicted-ttft --policy default_variants:InFlightOnly``.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

from _args import Parser, positive_int

from prefixroute import Candidate, PredictedTTFT, kv_fraction
from prefixroute.sim.compare import compared_policies, default_policy_name, run_grid
from prefixroute.sim.suite import judge, suite_workloads

ROOT = Path(__file__).resolve().parents[1]


class _Variant(PredictedTTFT):
    """The default's cost with another work term, ``work(candidate) / (1 - kv_fraction)``, and without its fit rule
    (a backend that cannot take the request's uncached blocks counts as full) or its reading of engine queues."""

    label = ""

    def work(self, c: Candidate) -> float:
        raise NotImplementedError

    def cost(self, candidate: Candidate, *, speed: float = 1.0) -> float:
        return self.work(candidate) / speed / (1.0 - min(kv_fraction(candidate), self.kv_cap))


class HalfInFlight(_Variant):
    label = "× (1 + in flight / 2)"

    def work(self, c: Candidate) -> float:
        return c.pending_prefill_tokens + c.uncached_tokens * (1 + c.in_flight / 2)


class QuarterInFlight(_Variant):
    label = "× (1 + in flight / 4)"

    def work(self, c: Candidate) -> float:
        return c.pending_prefill_tokens + c.uncached_tokens * (1 + c.in_flight / 4)


class NoFactor(_Variant):
    label = "no factor (queued + own prefill)"

    def work(self, c: Candidate) -> float:
        return c.pending_prefill_tokens + c.uncached_tokens


class PastPrefillOnly(_Variant):
    label = "× (1 + requests past prefill only)"

    def work(self, c: Candidate) -> float:
        return c.pending_prefill_tokens + c.uncached_tokens * (1 + c.in_flight - c.in_prefill)


class QueuedTimesFactor(_Variant):
    label = "(queued + own prefill) × (1 + in flight)"

    def work(self, c: Candidate) -> float:
        return (c.pending_prefill_tokens + c.uncached_tokens) * (1 + c.in_flight)


class InFlightOnly(_Variant):
    label = "× (1 + in flight), the default before"

    def work(self, c: Candidate) -> float:
        return c.pending_prefill_tokens + c.uncached_tokens * (1 + c.in_flight)


class InPrefillOnly(_Variant):
    label = "× (1 + requests in prefill only)"

    def work(self, c: Candidate) -> float:
        return c.pending_prefill_tokens + c.uncached_tokens * (1 + c.in_prefill)


class WithoutFitRule(_Variant):
    label = "the default without the fit rule"

    def work(self, c: Candidate) -> float:
        return c.pending_prefill_tokens + c.uncached_tokens * (1 + c.in_flight + c.in_prefill)


class LearnedSpeeds(PredictedTTFT):
    """The default with ``use_speed=True``, by name for ``prefixroute simulate --policy default_variants:LearnedSpeeds``
    (run from this folder); not one of the variants judged below."""

    def __init__(self) -> None:
        super().__init__(use_speed=True)


VARIANTS = (
    HalfInFlight,
    QuarterInFlight,
    NoFactor,
    PastPrefillOnly,
    InPrefillOnly,
    QueuedTimesFactor,
    InFlightOnly,
    WithoutFitRule,
)


def main() -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=positive_int, default=2, help="simulation processes (2)")
    parser.add_argument("--quick", action="store_true", help="one short workload (seed, 100 requests), a smoke run")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the pool's workers import this file by name
    workloads = [w for w in suite_workloads(root=ROOT) if not w.metrics]
    default = default_policy_name()
    policies = compared_policies()
    if args.quick:
        workloads = [replace(workloads[0], spec=workloads[0].spec.with_(requests=100))]
        policies = ["round-robin", default]
    variants = [f"default_variants:{cls.__name__}" for cls in VARIANTS]
    names = [*policies, *variants]
    results = run_grid([(w.spec, name) for w in workloads for name in names], jobs=args.jobs)
    rows: dict[str, list[str]] = {}
    passes = dict.fromkeys([default, *variants], 0)
    for k, workload in enumerate(workloads):
        chunk = results[k * len(names) : (k + 1) * len(names)]
        others = chunk[: len(policies)]
        for result in [chunk[policies.index(default)], *chunk[len(policies) :]]:
            field = [r for r in others if r.policy != default] + [result]
            verdict = judge(workload, field, default=result.policy)
            passes[result.policy] += verdict.passed
            rate = verdict.checks[2]
            cell = f"{result.ttft_ms['p99']:,.0f}" + ("" if rate.passed else f" (tput {rate.value:.3f})")
            rows.setdefault(result.policy, []).append(cell)
    labels = {default: f"{default} (the default)"} | {f"default_variants:{cls.__name__}": cls.label for cls in VARIANTS}
    print("P99 TTFT ms per workload (no engine metrics, seed 0); pass = workloads meeting every check")
    print(f"{'variant':<42}" + "".join(f"{w.name:>22}" for w in workloads) + f"{'pass':>6}")
    for name, cells in rows.items():
        print(f"{labels[name]:<42}" + "".join(f"{c:>22}" for c in cells) + f"{passes[name]:>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
