"""How fast is Router.route(), and how much memory does the index take per entry?

For prompts of 1K, 8K and 32K tokens (Python lists) and fleets of 8 and 64 backends, with a warm index of at least
1M (block, backend) entries, prints the median and P99 microseconds per route(), routes per second, and the ratio of
route() to a floor measured in the same run: converting the list to bytes plus one xxh3_64 over the whole prompt
(the least any design that hashes the prompt must do). Also prints bytes per index entry, measured by tracemalloc
while the warm index is built. Each prompt is one of 8 shared prefixes the index holds followed by a part that is
new to it (--new-fraction, half by default), made fresh for every pass. Method: one warm-up pass, then the median
of --runs timed passes.

``--steps`` prints, instead, where route()'s time goes at 8K tokens, from public pieces timed alone on fresh prompts:
encoding, hashing, PrefixIndex.match over the fleet, the rest of Router.decide (placement, candidates, policy: decide
minus the first three), recording (PrefixIndex.predict), their sum, then Router.decide, Router.commit and route() whole,
and the floor.

``--shared-match`` prints, instead, PrefixIndex.match() when every backend holds the prompt's 256-block system prompt
(as behind one shared instruction), against matching each backend's store alone without the previous backend's
answer as a guess (interleaved, fresh prompts), unbounded and bounded.

``--full-fleet`` prints, instead, decide() on 1K-token prompts when this router has requests in flight on every
backend and has seen others finish, with room in every backend's KV memory and with none (a capacity of 64 blocks, one
such prompt), so that every candidate walks the backend's requests for ``Candidate.memory_wait_s``: the ratio of the
two is what that walk costs.

``--lifecycle`` prints, instead, what one request costs from route() to finish() on a fleet (2K-token prompts, each one
of 8 system prompts plus a new half): median microseconds of route(), start() and finish(), with no other request in
flight and with ``--in-flight`` requests kept in flight (each finished that many requests later), as a gateway that
routes every request through one router sees them.

``--bounded`` also prints the hit rate of the bounded store (generations of sets) against an exact LRU on a Zipf
prefix workload, at several capacities: the cost of its approximation, in percentage points.

Run: ``python benchmarks/bench_route.py`` (a few minutes), ``--quick`` for a smoke run.
"""

from __future__ import annotations

import argparse
import array
import random
import statistics
import time
import tracemalloc
from collections import OrderedDict, deque
from collections.abc import Callable

import xxhash
from _args import Parser, positive_int, unit_fraction

from prefixroute import Decision, PrefixIndex, Router
from prefixroute.hashing import encode_tokens

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
    router = Router(index=PrefixIndex(16, capacity_blocks=capacity))
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


STEPS = ("encode", "hash", "match", "choose", "record")
WHOLE = ("decide()", "commit()")


def time_steps(
    router: Router, prompts: list[list[int]], others: list[list[int]], backends: list[str]
) -> dict[str, float]:
    """Median seconds of each public piece of route(), timed alone, over ``prompts``.

    "choose" is Router.decide minus encoding, hashing and matching (placement, candidates and the policy); "record"
    is PrefixIndex.predict for the chosen backend. Router.commit is timed on ``others``, as fresh as ``prompts``.
    """
    hasher, index, clock = router.hasher, router.index, time.perf_counter
    samples: dict[str, list[float]] = {name: [] for name in (*STEPS, *WHOLE)}
    for prompt, other in zip(prompts, others, strict=True):
        marks = [clock()]
        data = encode_tokens(prompt)
        marks.append(clock())
        hashes = hasher.hash_encoded(data, hasher.seed)
        marks.append(clock())
        matched = index.match(hashes, backends)
        marks.append(clock())
        decision = router.decide(prompt, backends)
        marks.append(clock())
        index.predict(hashes, decision.backend, matched[decision.backend])
        marks.append(clock())
        spans = [end - begin for begin, end in zip(marks[:-1], marks[1:], strict=True)]
        encode, hashing, matching, decide, record = spans
        samples["encode"].append(encode)
        samples["hash"].append(hashing)
        samples["match"].append(matching)
        samples["choose"].append(max(0.0, decide - encode - hashing - matching))
        samples["record"].append(record)
        samples["decide()"].append(decide)
        decision = router.decide(other, backends)
        start = clock()
        router.commit(decision)
        samples["commit()"].append(clock() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


class ExactLRU:
    """The reference for the hit-rate comparison: one backend's blocks in an exact LRU (an ``OrderedDict``) that
    touches a prompt's blocks leaf first, so a parent is always more recent than its children (the index's design
    before generations)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def match(self, hashes: list[int]) -> int:
        count = 0
        for h in hashes:
            if h not in self.blocks:
                break
            count += 1
        return count

    def insert(self, hashes: list[int]) -> None:
        blocks = self.blocks
        for h in reversed(hashes):
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)


def zipf_hit_rates(
    rng: random.Random, *, requests: int, fractions: tuple[float, ...]
) -> list[tuple[float, int, float, float]]:
    """Hit rate (cached blocks / prompt blocks) of one backend's PrefixIndex store and of an exact LRU on the same
    Zipf prefix workload, per capacity (a fraction of the blocks the workload touches).

    Workload: 40 system prompts (4-16 blocks) x 50 documents (4-60 blocks) each, documents drawn Zipf(1.0), each
    request the system prompt, the document and a 1-8-block question of its own.
    """
    stems = [[rng.getrandbits(64) for _ in range(rng.randint(4, 16))] for _ in range(40)]
    documents = [stem + [rng.getrandbits(64) for _ in range(rng.randint(4, 60))] for stem in stems for _ in range(50)]
    rng.shuffle(documents)
    weights = [1 / rank for rank in range(1, len(documents) + 1)]
    picks = rng.choices(range(len(documents)), weights, k=requests)
    prompts = [documents[i] + [rng.getrandbits(64) for _ in range(rng.randint(1, 8))] for i in picks]
    touched = len({h for prompt in prompts for h in prompt})
    rows = []
    for fraction in fractions:
        capacity = int(touched * fraction)
        index, exact = PrefixIndex(16, capacity_blocks=capacity), ExactLRU(capacity)
        total = hits = exact_hits = 0
        for prompt in prompts:
            held = index.match(prompt, ("b",))["b"]
            index.predict(prompt, "b", held)
            exact_held = exact.match(prompt)
            exact.insert(prompt)
            total += len(prompt)
            hits += held
            exact_hits += exact_held
        rows.append((fraction, capacity, exact_hits / total, hits / total))
    return rows


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
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=positive_int, default=5, help="timed passes per case (median reported)")
    parser.add_argument("--calls", type=positive_int, default=200, help="route() calls per pass")
    parser.add_argument(
        "--entries", type=positive_int, default=1_000_000, help="warm index size in (block, backend) entries"
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    parser.add_argument(
        "--new-fraction",
        type=unit_fraction,
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
    parser.add_argument(
        "--backends", type=positive_int, nargs="+", default=[8, 64], help="fleet sizes to measure (default: 8 64)"
    )
    parser.add_argument(
        "--shared-match",
        action="store_true",
        help="time match() when every backend holds one system prompt, with and without the guess",
    )
    parser.add_argument(
        "--full-fleet",
        action="store_true",
        help="time decide() with every backend's KV memory full (memory_wait_s walked) against one with room",
    )
    parser.add_argument(
        "--lifecycle", action="store_true", help="time route(), start() and finish() of one request on each fleet"
    )
    parser.add_argument(
        "--in-flight", type=positive_int, default=2000, help="requests kept in flight by --lifecycle (2000)"
    )
    parser.add_argument(
        "--zipf-only", action="store_true", help="print only the hit-rate comparison with an exact LRU (Zipf workload)"
    )
    parser.add_argument(
        "--zipf-requests", type=positive_int, default=100_000, help="requests of the Zipf hit-rate workload"
    )
    args = parser.parse_args()
    if args.quick:
        args.runs, args.calls, args.entries, args.zipf_requests = 2, 20, 20_000, 3_000
        args.in_flight = min(args.in_flight, 50)
    if args.zipf_only:
        print_hit_rates(args.zipf_requests)
        return
    if args.shared_match:
        print_shared_match(args.backends, args.calls * args.runs)
        return
    if args.full_fleet:
        print_full_fleet(args.backends, args.calls, args.runs)
        return
    if args.lifecycle:
        print_lifecycle(args.backends, args.calls * 10, args.runs, args.in_flight)
        return

    rng = random.Random(0)
    bounds = "LRU capacity per backend (5/4 of its share)" if args.bounded else "unbounded backends"
    print(
        f"route() benchmark: median of {args.runs} passes x {args.calls} calls, "
        f"warm index of {args.entries:,} entries, {bounds}, {args.new_fraction:.0%} of each prompt new"
    )
    if args.steps:
        columns = (*STEPS, "sum", *WHOLE, "route()", "floor")
        print(f"8K tokens, median us per step\n{'backends':>8} " + " ".join(f"{name:>10}" for name in columns))
    else:
        print(
            f"{'tokens':>7} {'backends':>8} {'entries':>10} {'B/entry':>8} {'median us':>10} {'p99 us':>8} "
            f"{'routes/s':>9} {'floor us':>9} {'ratio':>6}"
        )
    for backend_count in args.backends:
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
                passes = [time_steps(router, make_prompts(), make_prompts(), backends) for _ in range(args.runs)]
                steps = {name: statistics.median(p[name] for p in passes) * 1e6 for name in (*STEPS, *WHOLE)}
                parts = [steps[name] for name in STEPS]
                figures = (*parts, sum(parts), *(steps[name] for name in WHOLE), median * 1e6, floor * 1e6)
                print(f"{backend_count:>8} " + " ".join(f"{figure:>10.1f}" for figure in figures))
                continue
            print(
                f"{length:>7} {backend_count:>8} {len(router.index):>10,} {per_entry:>8.0f} {median * 1e6:>10.1f} "
                f"{p99 * 1e6:>8.1f} {1 / median:>9,.0f} {floor * 1e6:>9.1f} {median / floor:>6.2f}"
            )
    if args.bounded and not args.steps:
        print_hit_rates(args.zipf_requests)


class _ManualClock:
    """A router clock this benchmark moves by hand, so requests have ages and lifetimes without waiting."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def print_full_fleet(fleets: list[int], calls: int, runs: int) -> None:
    """decide() with every backend full of this router's requests in flight against the same with room, interleaved
    passes of fresh 1K-token prompts; 8 requests started per backend, every other one finished (a lifetime learned)."""
    rng = random.Random(3)
    print(f"decide(), 1K-token prompts, median us of {runs} interleaved passes x {calls} calls")
    print(f"{'backends':>8} {'room us':>9} {'full us':>9} {'ratio':>6}")
    for count in fleets:
        backends = [f"http://gpu{i}:8000" for i in range(count)]
        routers = {}
        for label, capacity in (("room", 1 << 20), ("full", 64)):  # 64 blocks of 16 tokens: one 1K-token prompt
            clock = _ManualClock()
            router = Router(block_size=16, capacity_blocks=capacity, clock=clock)
            for k in range(8 * count):
                decision = router.route([rng.randrange(VOCAB) for _ in range(1024)], backends)
                router.start(decision)
                clock.now += 0.01
                if k % 2:
                    router.finish(decision)
            routers[label] = router
        passes: dict[str, list[float]] = {"room": [], "full": []}
        for _ in range(runs):
            for label, router in routers.items():
                prompts = [[rng.randrange(VOCAB) for _ in range(1024)] for _ in range(calls)]
                start = time.perf_counter()
                for prompt in prompts:
                    router.decide(prompt, backends)
                passes[label].append((time.perf_counter() - start) / calls)
        room, full = (statistics.median(passes[label]) * 1e6 for label in ("room", "full"))
        print(f"{count:>8} {room:>9.1f} {full:>9.1f} {full / room:>6.2f}")


def print_lifecycle(fleets: list[int], calls: int, runs: int, in_flight: int) -> None:
    """route(), start() and finish() of each request timed apart, passes of ``calls`` requests on one router per
    case: with none other in flight (each finished at once) and with ``in_flight`` kept in flight."""
    rng = random.Random(4)
    shared = [[rng.randrange(VOCAB) for _ in range(1024)] for _ in range(8)]
    prompts = [shared[i % 8] + [rng.randrange(VOCAB) for _ in range(1024)] for i in range(64)]
    print(f"2K-token prompts (8 system prompts), median us of {runs} passes x {calls} requests")
    print(f"{'backends':>8} {'in flight':>9} {'route us':>9} {'start us':>9} {'finish us':>10} {'sum us':>8}")
    clock = time.perf_counter
    for count in fleets:
        backends = [f"http://gpu{i}:8000" for i in range(count)]
        for kept in (0, in_flight):
            router = Router()
            waiting: deque[Decision] = deque()
            passes: list[tuple[float, float, float]] = []
            for run in range(runs + 1):  # the first pass warms the index and fills the requests in flight
                spent = [0.0, 0.0, 0.0]
                for k in range(calls):
                    t0 = clock()
                    decision = router.route(prompts[k % 64], backends)
                    t1 = clock()
                    router.start(decision)
                    t2 = clock()
                    waiting.append(decision)
                    if len(waiting) > kept:
                        router.finish(waiting.popleft())
                    t3 = clock()
                    spent[0] += t1 - t0
                    spent[1] += t2 - t1
                    spent[2] += t3 - t2
                if run:
                    passes.append((spent[0] / calls, spent[1] / calls, spent[2] / calls))
            route, start, finish = (statistics.median(p[i] for p in passes) * 1e6 for i in range(3))
            print(f"{count:>8} {kept:>9} {route:>9.1f} {start:>9.1f} {finish:>10.1f} {route + start + finish:>8.1f}")


def print_shared_match(fleets: list[int], calls: int) -> None:
    """PrefixIndex.match() against each store's own match() without a guess, every backend holding the prompt's
    256-block system prompt and 40 conversations of its own on it; prompts: the system prompt and 256 new blocks."""
    rng = random.Random(2)
    print(f"match() with every backend holding a 256-block system prompt, median us of {calls} interleaved calls")
    print(f"{'backends':>8} {'store':>10} {'no guess':>9} {'match()':>8} {'ratio':>6}")
    clock = time.perf_counter
    for count in fleets:
        backends = [f"http://gpu{i}:8000" for i in range(count)]
        for capacity in (None, 20_000):
            index = PrefixIndex(16, capacity_blocks=capacity)
            system = [rng.getrandbits(64) for _ in range(256)]
            for backend in backends:
                for _ in range(40):
                    index.predict(system + [rng.getrandbits(64) for _ in range(200)], backend, 0)
            stores = [index.store(backend) for backend in backends]
            alone: list[float] = []
            guessed: list[float] = []
            for call in range(calls):
                prompts = [system + [rng.getrandbits(64) for _ in range(256)] for _ in range(2)]
                for kind in (0, 1) if call % 2 else (1, 0):
                    hashes = prompts[kind]
                    start = clock()
                    if kind:
                        index.match(hashes, backends)
                    else:
                        [store.match(hashes) for store in stores if store is not None]
                    (guessed if kind else alone).append(clock() - start)
            no_guess, with_guess = statistics.median(alone) * 1e6, statistics.median(guessed) * 1e6
            label = "unbounded" if capacity is None else "bounded"
            print(f"{count:>8} {label:>10} {no_guess:>9.1f} {with_guess:>8.1f} {with_guess / no_guess:>6.2f}")


def print_hit_rates(requests: int) -> None:
    print(f"\nhit rate on a Zipf prefix workload ({requests:,} requests), one backend: exact LRU vs PrefixIndex")
    print(f"{'capacity':>9} {'blocks':>9} {'exact LRU':>10} {'index':>8} {'loss':>12}")
    for fraction, capacity, exact, ours in zipf_hit_rates(
        random.Random(1), requests=requests, fractions=(0.05, 0.1, 0.2, 0.4)
    ):
        print(f"{fraction:>8.0%} {capacity:>9,} {exact:>10.2%} {ours:>8.2%} {(exact - ours) * 100:>+7.2f} points")


if __name__ == "__main__":
    main()
