"""Variants of the default policy's cost, judged on the policy suite as the default is (docs/policies.md).

Each variant is a :class:`~prefixroute.PredictedTTFT` subclass that overrides :meth:`~prefixroute.PredictedTTFT.cost`
(the public extension point), so everything else (the KV-memory stretch, ties) stays the default's. Every variant,
the default and every built-in and baseline policy run on the suite's workloads without engine metrics (the six
scenarios and the two real traces, seed 0, as ``make policies`` runs them; ``--metrics``: the same with metrics every
0.1 s); each variant is then judged as if it
were the default, against all the other policies, by the suite's own rule (:func:`prefixroute.sim.suite.judge`).
Prints the P99 TTFT per workload (a throughput below 0.97x the best in brackets, a KV hit rate more than 5 points
under the best in brackets as a percentage; r and b mark a P99 above round-robin's or above 1.2x the best) and how
many workloads pass.

Run from the repository root: ``python benchmarks/default_variants.py`` (about 5 minutes on two cores;
``--quick`` for one short workload; ``--only CLASS ...`` for some variants; ``--cache FILE`` keeps the built-in and
baseline policies' results for the next run, which then takes seconds per variant). Each class here is also a
policy for the simulator, run from this folder:
``prefixroute simulate --scenario seed --policy predicted-ttft --policy default_variants:InFlightOnly``.
"""

from __future__ import annotations

import math
import pickle
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from _args import Parser, check_output, positive_int

from prefixroute import Candidate, PredictedTTFT, kv_fraction
from prefixroute.policies import _overflows
from prefixroute.sim.compare import compared_policies, default_policy_name, run_grid
from prefixroute.sim.metrics import PolicyResult
from prefixroute.sim.suite import judge, suite_workloads

ROOT = Path(__file__).resolve().parents[1]


class _Variant(PredictedTTFT):
    """The default's cost with another work term, ``work(candidate) / (1 - kv_fraction)``, and without its fit rule
    (a backend that cannot take the request's uncached blocks counts as full) or its reading of engine queues."""

    label = ""

    def work(self, c: Candidate) -> float:
        raise NotImplementedError

    def cost(self, candidate: Candidate, *, speed: float = 1.0, **cap_terms: float) -> float:
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


class _FitVariant(PredictedTTFT):
    """The default's cost with another work term, ``work(candidate, common, typical) / (1 - kv_fraction)`` (``common``
    and ``typical`` are the choice's :meth:`~prefixroute.PredictedTTFT.cap_terms`), keeping its fit rule (a backend
    that cannot take the request's uncached blocks beside its active ones counts as full); without its reading of
    engine queues (the suite's runs here have no engine metrics)."""

    label = ""

    def work(self, c: Candidate, common: int, typical: float) -> float:
        raise NotImplementedError

    def cost(
        self, candidate: Candidate, *, speed: float = 1.0, common_tokens: int = 0, typical_prompt: float = math.inf
    ) -> float:
        c = candidate
        fits = not c.capacity_blocks or c.active_blocks + -(-c.uncached_tokens // c.block_size) <= c.capacity_blocks
        fraction = kv_fraction(c) if fits else 1.0
        return self.work(c, common_tokens, typical_prompt) / speed / (1.0 - min(fraction, self.kv_cap))


class WithoutCap(_FitVariant):
    """The default before its cap (2026-12-03): every uncached token counts once for each request it holds up,
    however long the prompt. On Mooncake's conversation trace (not in the repository) its P99 TTFT was 28.5 s, 1.25x
    ``dynamo``'s 22.8 s: a prompt of about 100K tokens went to the backend with the fewest requests in flight
    even where several times more prefill was queued there."""

    label = "the default without the cap"

    def work(self, c: Candidate, common: int, typical: float) -> float:
        return c.pending_prefill_tokens + c.uncached_tokens * (1 + c.in_flight + c.in_prefill)


def _mean_context(c: Candidate) -> float:
    """Mean distinct prompt tokens per request in flight on ``c`` (0 when none)."""
    return c.active_blocks * c.block_size / c.in_flight if c.in_flight else 0.0


class HarmCappedByContext(_FitVariant):
    """The delay imposed on each request in flight bounded by that backend's mean distinct prompt tokens per request
    in flight (a shared prefix counted once, so small where requests share one: ``seed`` 2,310 ms)."""

    label = "harm per request ≤ mean context there"

    def work(self, c: Candidate, common: int, typical: float) -> float:
        u = c.uncached_tokens
        return c.pending_prefill_tokens + u + min(u, _mean_context(c)) * (c.in_flight + c.in_prefill)


class HarmHarmonic(_FitVariant):
    label = "harm per request u·m/(u+m), m mean context"

    def work(self, c: Candidate, common: int, typical: float) -> float:
        u, m = c.uncached_tokens, _mean_context(c)
        overlap = u * m / (u + m) if u + m else 0.0
        return c.pending_prefill_tokens + u + overlap * (c.in_flight + c.in_prefill)


class HarmCappedByHeld(_FitVariant):
    label = "harm per request ≤ mean prompt there"

    def work(self, c: Candidate, common: int, typical: float) -> float:
        u = c.uncached_tokens
        mean_prompt = c.held_blocks * c.block_size / c.in_flight if c.in_flight else 0.0
        return c.pending_prefill_tokens + u + min(u, mean_prompt) * (c.in_flight + c.in_prefill)


class HarmCappedByFleetMean(_FitVariant):
    """Every uncached token capped, the saving of a cached prefix too, so prefixes are followed less (Mooncake
    synthetic trace KV hit 28.2 %, 5.7 points under the best)."""

    label = "harm per request ≤ fleet's mean prompt"

    def work(self, c: Candidate, common: int, typical: float) -> float:
        u = c.uncached_tokens
        return c.pending_prefill_tokens + u + min(u, typical) * (c.in_flight + c.in_prefill)


class CapInPrefillToo(_FitVariant):
    """The cap on the second count of a request in prefill too: better on the Mooncake synthetic trace without
    metrics (13,887 ms), worse with them (15,383 ms, KV hit 5.6 points under the best) and on the Splitwise trace
    (10,031 ms), 13 of the suite's 16 workloads; Mooncake's conversation trace 25.3 s."""

    label = "the cap on requests in prefill too"

    def work(self, c: Candidate, common: int, typical: float) -> float:
        u = c.uncached_tokens
        return c.pending_prefill_tokens + u + (min(common, typical) + u - common) * (c.in_flight + c.in_prefill)


class HarmOnAllInFlight(_FitVariant):
    """The default before 2026-12-03 (night): its prefill held up every request in flight, also those waiting for KV
    memory, ahead of it in vLLM's queue. On Mooncake's conversation trace on the default fleet (8 × codellama-13b on
    a100-40gb, not in the repository: 3,591 of its requests longer than one engine's KV cache, the rest an overload),
    P99 TTFT 5,088 s at 0.93 req/s against the default's 4,007 s at 1.08: short requests crowded onto one backend
    whose many requests kept the long prompts away, and the others queued several times more prefill."""

    label = "harm on every request in flight"

    def work(self, c: Candidate, common: int, typical: float) -> float:
        u = c.uncached_tokens
        return c.pending_prefill_tokens + u + (min(common, typical) + u - common) * c.in_flight + u * c.in_prefill


class OvercommitWait(PredictedTTFT):
    """The default, with the request's own wait (queued prefill and its own) multiplied, where a backend's known KV
    capacity cannot take its blocks beside the active ones, by how far over: ``(active_blocks + its blocks) /
    capacity_blocks``, the times the memory ahead of it must turn over before it runs. Tried 2026-12-03 on real
    traces not in the repository (a 1,000-request slice of Mooncake's Kimi trace, the first 3,000 requests of its
    conversation trace, both on 4 × llama-3-8b/h100-80gb, where the default's tail is 1.16-1.83x ``dynamo``'s): the
    tail there came within 1.13x of the best, but the Splitwise code trace went from 9,737 to 11,225 ms and an
    overload of short, decode-heavy requests (ServeGen's m-large distributions at 20 req/s) from 1.01x to 2.23x the
    best: the router counts prompt blocks only, so there the ratio points at the backends with the longest prompts,
    not at the fullest memory. Not adopted (docs/policies.md, "Which policy should I use")."""

    label = "own wait × memory over capacity"

    def cost(
        self, candidate: Candidate, *, speed: float = 1.0, common_tokens: int = 0, typical_prompt: float = math.inf
    ) -> float:
        c = candidate
        cost = super().cost(c, speed=speed, common_tokens=common_tokens, typical_prompt=typical_prompt)
        if not c.capacity_blocks or c.block_size <= 0:
            return cost
        over = (c.active_blocks + -(-c.uncached_tokens // c.block_size)) / c.capacity_blocks
        if over <= 1.0:
            return cost
        # over 1: the request does not fit, so the default already counts the backend as full (kv_cap)
        own = c.pending_prefill_tokens + c.uncached_tokens
        return cost + own * (over - 1.0) / speed / (1.0 - self.kv_cap)


class EngineUsageFloor(PredictedTTFT):
    """The default, with the engine's ``kv_usage`` (from metrics) as a floor under the router's own KV fraction: the
    engine's counts the growing answers' blocks, which the router (prompt blocks only) does not. With metrics, better
    on an overload of short, decode-heavy requests (ServeGen's m-large at 20 req/s: 1.03x the best instead of 1.26x),
    but worse on the suite (``shared-prefix`` 623 ms instead of 592, ``rag`` 1,290 instead of 1,146,
    ``system-prompt`` 505 instead of 421, the Splitwise code trace 10,320 instead of 9,723). Not adopted. Needs
    engine metrics: judged only with ``--metrics`` (the suite's runs with ``--metrics-interval 0.1``)."""

    label = "engine kv_usage as a floor"

    def cost(
        self, candidate: Candidate, *, speed: float = 1.0, common_tokens: int = 0, typical_prompt: float = math.inf
    ) -> float:
        cost = super().cost(candidate, speed=speed, common_tokens=common_tokens, typical_prompt=typical_prompt)
        c = candidate
        usage, own = c.kv_usage, kv_fraction(c)
        full = (
            c.capacity_blocks
            and c.block_size > 0
            and c.active_blocks + -(-c.uncached_tokens // c.block_size) > c.capacity_blocks
        )
        if usage is None or usage <= own or full:  # counted as full already, or the floor is lower
            return cost
        return cost * (1.0 - min(own, self.kv_cap)) / (1.0 - min(usage, self.kv_cap))


class WithoutAttention(PredictedTTFT):
    """The default before 2026-12-07: prefill counted in tokens only, ``attention_tokens`` ignored (as every
    ``_Variant`` and ``_FitVariant`` above, written before it). On the Mooncake synthetic trace at its own rate on 4 ×
    llama-3-8b/h100-80gb, an overload, it serves 1.67 req/s at a P99 TTFT of 1,223 s where the default serves
    2.20 req/s at 722 s: it balanced tokens, and the backends that took the long prompts queued more seconds per
    token (docs/policies.md, "Attention")."""

    label = "tokens only (no attention fit)"

    def cost(self, candidate: Candidate, *, speed: float = 1.0, **cap_terms: Any) -> float:
        return super().cost(candidate._replace(attention_tokens=None), speed=speed, **cap_terms)


class HarmInTokens(PredictedTTFT):
    """Attention counted in the prefill queued and the request's own (:attr:`~prefixroute.Candidate.prefill_work`),
    but the requests its prefill holds up counted as waiting for its tokens only. The first form tried (2026-12-07):
    the same overload gain, but on the suite's Mooncake trace a P99 of 32,426 ms (the default 13,209): the requests
    held up weigh less than the queue, so the backends streaming many answers took the long prefills."""

    label = "attention, harm in tokens"

    def cost(self, candidate: Candidate, *, speed: float = 1.0, **cap_terms: Any) -> float:
        plain = candidate._replace(attention_tokens=None)
        tokens_only = super().cost(plain, speed=speed, **cap_terms)
        fraction = 1.0 if _overflows(candidate) else kv_fraction(candidate)
        added = candidate.prefill_work - plain.prefill_work  # the attention of the queued and the own prefill
        return tokens_only + added / speed / (1.0 - min(fraction, self.kv_cap))


class _Restretched(PredictedTTFT):
    """The default's cost with another KV-memory stretch in place of ``1 / (1 - min(fraction, kv_cap))``."""

    label = ""

    def stretch(self, fraction: float, overflows: bool) -> float:
        raise NotImplementedError

    def cost(self, candidate: Candidate, *, speed: float = 1.0, **cap_terms: Any) -> float:
        overflows = _overflows(candidate)
        fraction = min(1.0 if overflows else kv_fraction(candidate), self.kv_cap)
        unstretched = super().cost(candidate, speed=speed, **cap_terms) * (1.0 - fraction)
        return unstretched * self.stretch(fraction, overflows)


class SquareStretch(_Restretched):
    """Memory stretching the cost as ``1 / (1 - f²)``: flatter while much is free (1.33× at half full, where the
    default's is 2×), as steep near full. Tried 2026-12-07 on the engine that schedules as vLLM does: 6 of 8
    workloads without metrics and 6 with (the default 5 and 5), ``seed`` shorter on 4 of seeds 1-5, but its
    ``shared-prefix`` pass on seed 0 is the draw (seeds 1-5: 1.05-1.34x round-robin's P99): not adopted."""

    label = "stretch 1 / (1 - f²)"

    def stretch(self, fraction: float, overflows: bool) -> float:
        return 1.0 / (1.0 - fraction * fraction)


class StepStretch(_Restretched):
    """Memory stretching the cost only where the request's blocks do not fit (``1 / (1 - kv_cap)``, 20x), not as the
    backend fills: a backend with room costs what its work costs. Tried 2026-12-06 and 2026-12-07: low-load
    open-loop ``rag`` at round-robin's tail, but ``hot-prefix`` throughput 0.918x the best (memory filled to the brim
    preempts)."""

    label = "stretch only where it does not fit"

    def stretch(self, fraction: float, overflows: bool) -> float:
        return 1.0 / (1.0 - fraction) if overflows else 1.0


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
    WithoutCap,
    HarmCappedByContext,
    HarmHarmonic,
    HarmCappedByHeld,
    HarmCappedByFleetMean,
    CapInPrefillToo,
    HarmOnAllInFlight,
    OvercommitWait,
    WithoutAttention,
    HarmInTokens,
    SquareStretch,
    StepStretch,
)


def read_cache(parser: Parser, path: Path, *, metrics: bool) -> list[PolicyResult] | None:
    """The results ``--cache`` holds for this half of the suite (``--metrics`` or not), or None when it holds none:
    no file yet (then it must be writable, checked now rather than after the runs), another half's or an older
    format's. A file that is no cache this script wrote (not a pickle, a folder, a pipe) exits with one line."""
    if not path.exists():
        check_output(parser, path, "--cache")
        return None
    if not path.is_file():  # a folder is no cache, and reading a FIFO or a device would hang or never end
        parser.error(f"argument --cache: {path} is not a regular file: give the cache file's path")
    try:
        cached = pickle.loads(path.read_bytes())
    except Exception as exc:  # noqa: BLE001 - unpickling raises any error its data makes it raise
        parser.error(f"argument --cache: {path} is not a cache this script wrote ({type(exc).__name__}): delete it")
    check_output(parser, path, "--cache")  # rewritten after the runs when it holds another half's results
    # (metrics, results); another half of the suite's runs, or a cache of an older format: run them again
    fits = isinstance(cached, tuple) and len(cached) == 2 and cached[0] == metrics and isinstance(cached[1], list)
    return cached[1] if fits else None


def main() -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=positive_int, default=2, help="simulation processes (2)")
    parser.add_argument("--quick", action="store_true", help="one short workload (seed, 100 requests), a smoke run")
    parser.add_argument("--only", nargs="+", metavar="CLASS", help="judge only these variant classes (by name)")
    parser.add_argument(
        "--metrics",
        action="store_true",
        help="judge on the suite's runs with engine metrics (--metrics-interval 0.1), EngineUsageFloor among them",
    )
    parser.add_argument(
        "--cache",
        type=Path,
        help="a pickle of the built-in and baseline policies' results, read if it exists, else written (they do not"
        " change between runs of this script; delete it after changing the simulator or a policy)",
    )
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the pool's workers import this file by name
    workloads = [w for w in suite_workloads(root=ROOT) if w.metrics == args.metrics]
    default = default_policy_name()
    policies = compared_policies()
    if args.quick:
        workloads = [replace(workloads[0], spec=workloads[0].spec.with_(requests=100))]
        policies = ["round-robin", default]
    judged = (*VARIANTS, EngineUsageFloor) if args.metrics else VARIANTS
    unknown = [name for name in args.only or () if name not in {cls.__name__ for cls in judged}]
    if unknown:  # judged silently on none of them otherwise
        metrics = "" if args.metrics else " (EngineUsageFloor needs --metrics)"
        parser.error(
            f"argument --only: no variant class {', '.join(map(repr, unknown))}{metrics}; "
            f"one of {', '.join(cls.__name__ for cls in judged)}"
        )
    classes = [cls for cls in judged if not args.only or cls.__name__ in args.only]
    variants = [f"default_variants:{cls.__name__}" for cls in classes]
    names = [*policies, *variants]
    fixed: list[PolicyResult] | None = None
    if args.cache is not None and not args.quick:
        fixed = read_cache(parser, args.cache, metrics=args.metrics)
    if fixed is None or len(fixed) != len(workloads) * len(policies):
        fixed = run_grid([(w.spec, name) for w in workloads for name in policies], jobs=args.jobs)
        if args.cache is not None and not args.quick:
            args.cache.write_bytes(pickle.dumps((args.metrics, fixed)))
    mine = run_grid([(w.spec, name) for w in workloads for name in variants], jobs=args.jobs)
    results: list[PolicyResult] = []
    for k in range(len(workloads)):
        results += (
            fixed[k * len(policies) : (k + 1) * len(policies)] + mine[k * len(variants) : (k + 1) * len(variants)]
        )
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
            cell += "" if verdict.checks[3].passed else f" ({100 * result.hit_rate:.1f} %)"
            # the checks missed: r = P99 above round-robin's, b = P99 above 1.2x the best, h = KV hit rate
            cell += "".join(f for f, c in zip("rb h", verdict.checks, strict=True) if f != " " and not c.passed)
            rows.setdefault(result.policy, []).append(cell)
    labels = {default: f"{default} (the default)"} | {f"default_variants:{cls.__name__}": cls.label for cls in classes}
    metrics = "engine metrics every 0.1 s" if args.metrics else "no engine metrics"
    print(f"P99 TTFT ms per workload ({metrics}, seed 0); pass = workloads meeting every check")
    print(f"{'variant':<42}" + "".join(f"{w.name:>22}" for w in workloads) + f"{'pass':>6}")
    for name, cells in rows.items():
        print(f"{labels[name]:<42}" + "".join(f"{c:>22}" for c in cells) + f"{passes[name]:>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
