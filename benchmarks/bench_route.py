"""How fast is Router.route(), and how much memory does the index take per entry?

For prompts of 1K, 8K and 32K tokens (Python lists) and fleets of 8 and 64 backends, with a warm index of at least
1M (block, backend) entries, prints the median and P99 microseconds per route(), routes per second, and the ratio of
route() to a floor measured in the same run: converting the list to bytes plus one xxh3_64 over the whole prompt
(the least any design that hashes the prompt must do). Also prints bytes per index entry, measured by tracemalloc
while the warm index is built. Each prompt is one of 8 shared prefixes the index holds followed by a part that is
new to it (--new-fraction, half by default), made fresh for every pass. Method: one warm-up pass, then the median
of --runs timed passes.

``--steps`` prints, instead, where route()'s time goes at 8K tokens: each of its steps timed alone on fresh prompts
(encode, hash, place, match, candidates, policy, record), beside route() and the floor.

Run: ``python benchmarks/bench_route.py`` (a few minutes), ``--quick`` for a smoke run.
"""

from __future__ import annotations

import argparse
import array
import random
import statistics
import time
import tracemalloc
from collections.abc import Callable

import xxhash

from prefixroute import Router
from prefixroute.hashing import encode_tokens
from prefixroute.router import _placement_key, _placement_order

VOCAB = 32_000


def floor_cost(prompt: list[int]) -> int:
    return xxhash.xxh3_64_intdigest(array.array("I", prompt).tobytes())


def warm_router(
    backends: list[str], entries: int, rng: random.Random, *, bounded: bool = False
) -> tuple[Router, float]:
    """A router whose index holds ``entries`` (block, backend) pairs; returns it and index bytes per entry.

    Bounded: each backend's capacity is 5/4 of its share of ``entries``, and routing goes on until the index has
    recorded three times its total capacity, so every LRU has turned over and its hash tables have reached the size
    they keep under eviction (measured just full, they are a fifth smaller).
    """
    # Realistic sharing: 2K-token prefixes (made before measuring) extended by 2K-token unique suffixes. Each prompt
    # is freed after its route(), so what tracemalloc still counts at the end is the index.
    prefixes = [[rng.randrange(VOCAB) for _ in range(2048)] for _ in range(64)]
    capacity = entries * 5 // (4 * len(backends)) if bounded else None
    router = Router(capacity_blocks=capacity)
    routes = 2 * entries // 128 if capacity is None else 3 * capacity * len(backends) // 128  # 128 new blocks each
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for _ in range(routes):
        router.route(rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(2048)], backends)
        if capacity is None and len(router.index) >= entries:
            break
    per_entry = (tracemalloc.get_traced_memory()[0] - before) / len(router.index)
    tracemalloc.stop()
    return router, per_entry


def measure(
    router: Router, make_prompts: Callable[[], list[list[int]]], backends: list[str], runs: int
) -> tuple[float, float, float]:
    """Median and P99 seconds per route(), and the median floor, each the median over ``runs`` passes.

    Every pass routes prompts it has just made, so their new part really is new to the index. The floor is timed
    first, on the same prompts, so neither side finds them already in the CPU cache from the other.
    """
    medians, p99s, floors = [], [], []
    for _ in range(runs):
        prompts = make_prompts()
        floor_samples = time_calls(floor_cost, prompts)
        samples = time_calls(lambda prompt: router.route(prompt, backends), prompts)
        medians.append(statistics.median(samples))
        p99s.append(statistics.quantiles(samples, n=100)[98])
        floors.append(statistics.median(floor_samples))
    return statistics.median(medians), statistics.median(p99s), statistics.median(floors)


STEPS = ("encode", "hash", "place", "match", "candidates", "policy", "record")


def time_steps(router: Router, prompts: list[list[int]], backends: list[str]) -> dict[str, float]:
    """Median seconds of each step of route(), timed alone, over ``prompts`` (with the default index source).

    The steps call the router's private helpers as Router.route does: when route() changes, change this with it
    (tests/test_benchmarks.py runs it).
    """
    hasher, index, policy, clock = router.hasher, router.index, router.policy, time.perf_counter
    samples: dict[str, list[float]] = {name: [] for name in STEPS}
    for prompt in prompts:
        marks = [clock()]
        data = encode_tokens(prompt)
        marks.append(clock())
        hashes = hasher.hash_encoded(data, hasher.seed)
        marks.append(clock())
        order = _placement_order(backends, _placement_key(hashes, data, hasher.seed, 4))
        marks.append(clock())
        matched = index.match(hashes, order)
        marks.append(clock())
        candidates = router._candidates(order, matched, len(data) // 4)
        marks.append(clock())
        chosen = policy.choose(candidates)
        marks.append(clock())
        index._insert(hashes, chosen.backend, matched[chosen.backend])
        marks.append(clock())
        for name, begin, end in zip(STEPS, marks[:-1], marks[1:], strict=True):
            samples[name].append(end - begin)
    return {name: statistics.median(values) for name, values in samples.items()}


def time_calls(call: Callable[[list[int]], object], prompts: list[list[int]]) -> list[float]:
    """Seconds per call, one call per prompt."""
    samples = []
    clock = time.perf_counter
    for prompt in prompts:
        start = clock()
        call(prompt)
        samples.append(clock() - start)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="timed passes per case (median reported)")
    parser.add_argument("--calls", type=int, default=200, help="route() calls per pass")
    parser.add_argument("--entries", type=int, default=1_000_000, help="warm index size in (block, backend) entries")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    parser.add_argument(
        "--new-fraction",
        type=float,
        default=0.5,
        help="fraction of each prompt that is new to the index (the rest is a prefix it holds); default 0.5",
    )
    parser.add_argument(
        "--bounded",
        action="store_true",
        help="give every backend an LRU capacity (5/4 of its share of the warm index) and warm it until it has "
        "turned over, so routes also evict and bytes per entry is the steady state",
    )
    parser.add_argument(
        "--steps", action="store_true", help="time each step of route() alone at 8K tokens instead of the table"
    )
    args = parser.parse_args()
    if args.quick:
        args.runs, args.calls, args.entries = 2, 20, 20_000

    rng = random.Random(0)
    bounds = "LRU capacity per backend (5/4 of its share)" if args.bounded else "unbounded backends"
    print(
        f"route() benchmark: median of {args.runs} passes x {args.calls} calls, "
        f"warm index of {args.entries:,} entries, {bounds}, {args.new_fraction:.0%} of each prompt new"
    )
    if args.steps:
        columns = (*STEPS, "sum", "route()", "floor")
        print(f"8K tokens, median us per step\n{'backends':>8} " + " ".join(f"{name:>10}" for name in columns))
    else:
        print(
            f"{'tokens':>7} {'backends':>8} {'entries':>10} {'B/entry':>8} {'median us':>10} {'p99 us':>8} "
            f"{'routes/s':>9} {'floor us':>9} {'ratio':>6}"
        )
    for backend_count in (8, 64):
        backends = [f"http://gpu{i}:8000" for i in range(backend_count)]
        router, per_entry = warm_router(backends, args.entries, rng, bounded=args.bounded)
        for length in (8192,) if args.steps else (1024, 8192, 32768):
            # Each prompt: one of 8 shared prefixes the index already holds, then a part new to it.
            new = int(length * args.new_fraction)
            shared = [[rng.randrange(VOCAB) for _ in range(length - new)] for _ in range(8)]

            def make_prompts(shared: list[list[int]] = shared, new: int = new) -> list[list[int]]:
                return [rng.choice(shared) + [rng.randrange(VOCAB) for _ in range(new)] for _ in range(args.calls)]

            for prompt in make_prompts():  # warm-up pass: the shared prefixes get a home
                router.route(prompt, backends)
            median, p99, floor = measure(router, make_prompts, backends, args.runs)
            if args.steps:
                passes = [time_steps(router, make_prompts(), backends) for _ in range(args.runs)]
                steps = {name: statistics.median(p[name] for p in passes) * 1e6 for name in STEPS}
                figures = (*steps.values(), sum(steps.values()), median * 1e6, floor * 1e6)
                print(f"{backend_count:>8} " + " ".join(f"{figure:>10.1f}" for figure in figures))
                continue
            print(
                f"{length:>7} {backend_count:>8} {len(router.index):>10,} {per_entry:>8.0f} {median * 1e6:>10.1f} "
                f"{p99 * 1e6:>8.1f} {1 / median:>9,.0f} {floor * 1e6:>9.1f} {median / floor:>6.2f}"
            )


if __name__ == "__main__":
    main()
