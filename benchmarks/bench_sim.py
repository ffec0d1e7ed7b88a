"""How fast does the simulator run? Simulated requests per wall-clock second, for two workloads.

1. the ``seed`` scenario (8 × codellama-13b on a100-40gb, 30 closed-loop users, 1,500 requests) under each default
   policy;
2. the whole Mooncake FAST'25 synthetic trace (3,993 requests, mean 15K prompt tokens, replayed at its timestamps)
   under ``bounded-load``, on 8 × llama-3-8b on h100-80gb (a codellama-13b on a 40 GB A100 holds ~13.6K tokens of
   KV, less than the trace's mean prompt, so most requests would be rejected there).

Every request goes through the real Router (hashing, index, policy) and the simulated vLLM engines. Method: one
warm-up run, then the median wall time of --runs timed runs (time.perf_counter). The simulator is single-threaded.

Run: ``python benchmarks/bench_sim.py`` (about a minute), ``--quick`` for one short run of each.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from _args import Parser, existing_file, positive_int

from prefixroute.errors import PrefixRouteError
from prefixroute.sim.runner import SimSpec, run_policy
from prefixroute.sim.traces import load_trace

MOONCAKE = Path(__file__).resolve().parents[1] / "data" / "mooncake-fast25" / "synthetic_trace.jsonl"


def measure(spec: SimSpec, policy: str, runs: int) -> tuple[float, int]:
    """Median wall seconds of ``runs`` runs after one warm-up, and the requests each run served."""
    result = run_policy(spec, policy)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        result = run_policy(spec, policy)
        times.append(time.perf_counter() - start)
    return statistics.median(times), result.requests + result.rejected


def main() -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=positive_int, default=3, help="timed runs per measurement (3)")
    parser.add_argument("--quick", action="store_true", help="one short run of each (a smoke test)")
    parser.add_argument("--trace", type=existing_file, default=MOONCAKE, help="the Mooncake synthetic trace")
    args = parser.parse_args()
    try:  # read once now: a malformed trace fails before the scenario runs, not a minute later
        load_trace(f"mooncake:{args.trace}")
    except PrefixRouteError as exc:
        parser.error(f"argument --trace: {exc}")
    runs = 1 if args.quick else args.runs
    seed = SimSpec(requests=300 if args.quick else 1500)
    print(f"method: median of {runs} timed run(s) after one warm-up; single process")
    print(f"{'workload':<60} {'requests':>8} {'wall s':>8} {'req/wall-s':>11}")
    for policy in ("round-robin", "prefix-affinity", "bounded-load"):
        seconds, requests = measure(seed, policy, runs)
        label = f"seed, {policy} ({seed.model}@{seed.gpu} x{seed.backends})"
        print(f"{label:<60} {requests:>8} {seconds:>8.2f} {requests / seconds:>11.0f}")
    trace = SimSpec(
        trace=f"mooncake:{args.trace}",
        users=None,
        requests=500 if args.quick else None,
        model="llama-3-8b",
        gpu="h100-80gb",
    )
    seconds, requests = measure(trace, "bounded-load", runs)
    label = "mooncake synthetic, bounded-load (llama-3-8b@h100-80gb x8)"
    print(f"{label:<60} {requests:>8} {seconds:>8.2f} {requests / seconds:>11.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
