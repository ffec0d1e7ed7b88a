"""Benchmark the KV-event path: block events applied per second on one core, and publish→index lag at a rate.

Method: a fake engine (:class:`prefixroute.testing.FakeBlockCache`, 16-token blocks, LRU eviction) serves a
shared-prefix workload; its events are grouped into batches as a vLLM scheduler step would publish them and
encoded once (msgpack, both encodings). **Throughput** times decode + re-hash + index update of the whole stream
(``EventDecoder`` → ``BlockTracker`` → ``Router.write``, the router's public locked write path, into an
``EventIndex``) in this process: median of ``--runs`` runs after a warm-up. A *block event* is one block stored or
removed. **Lag** runs a real :class:`KVEventSubscriber` writing into a router against a ZMQ PUB socket fed by a
separate process at ``--rate`` block events/s (publish time stamped into each batch as it is sent), and reports the
delay from publish to index update (P50/P99), median of the runs.

Run: ``python benchmarks/bench_events.py [--runs 5] [--rate 200000]``.
"""

from __future__ import annotations

import multiprocessing
import random
import statistics
import struct
import time
from typing import Any, Literal

import zmq
from _args import Parser, positive_float, positive_int

from prefixroute import PrefixIndex, Router
from prefixroute.index import apply_updates
from prefixroute.testing import FakeBlockCache
from prefixroute.vllm import (
    BlockTracker,
    EventBatch,
    EventDecoder,
    EventIndex,
    KVEventSubscriber,
    encode_batch,
)
from prefixroute.vllm.events import BlockRemoved, BlockStored


def make_stream(
    *, requests: int, per_batch: int, encoding: Literal["array", "map"], seed: int = 0
) -> tuple[list[bytes], list[int]]:
    """Return encoded batches and the block events each carries."""
    rng = random.Random(seed)
    cache = FakeBlockCache(block_size=16, num_blocks=8192, rng=rng)
    stems = [[rng.randrange(32_000) for _ in range(2048)] for _ in range(16)]
    payloads: list[bytes] = []
    sizes: list[int] = []
    for start in range(0, requests, per_batch):
        for _ in range(min(per_batch, requests - start)):
            stem = stems[rng.randrange(len(stems))][: rng.randrange(256, 2048)]
            prompt = stem + [rng.randrange(32_000) for _ in range(rng.randrange(64, 1024))]
            cache.free(cache.allocate(prompt))
        events = cache.take_events()
        blocks = sum(len(e.block_hashes) for e in events if isinstance(e, (BlockStored, BlockRemoved)))
        payloads.append(encode_batch(EventBatch(0.0, events, 0), encoding=encoding))
        sizes.append(blocks)
    return payloads, sizes


def apply_stream(payloads: list[bytes], *, bare: bool = False) -> float:
    """Decode, re-hash and index a stream once; return the seconds it took.

    ``bare``: into a bare ``PrefixIndex`` with ``apply_updates`` (no router, no lock): the baseline of the write path.
    """
    decoder, tracker, router = EventDecoder(), BlockTracker(block_size=16), events_router()
    index = PrefixIndex(16)
    begin = time.perf_counter()
    if bare:
        for payload in payloads:
            apply_updates(index, "gpu0", tracker.apply(decoder.decode(payload).events))
    else:
        for payload in payloads:
            router.write("gpu0", tracker.apply(decoder.decode(payload).events))
    return time.perf_counter() - begin


def events_router() -> Router:
    """A router whose index only KV events write."""
    return Router(block_size=16, index=EventIndex(16, speculative_ttl=0))


def throughput(payloads: list[bytes], blocks: int, runs: int) -> tuple[list[float], list[float]]:
    """Block events/s through the router and into a bare index, runs interleaved so both see the same machine."""
    apply_stream(payloads)  # warm-up
    routed, bare = [], []
    for _ in range(runs):
        routed.append(blocks / apply_stream(payloads))
        bare.append(blocks / apply_stream(payloads, bare=True))
    return routed, bare


def publish(endpoint: str, payloads: list[bytes], sizes: list[int], rate: float, ready: Any) -> None:
    """(In a child process.) Send every payload, paced to ``rate`` block events/s, stamping the publish time."""
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.bind(endpoint)
    ready.wait()
    time.sleep(0.3)  # let the subscriber's connection settle
    begin = time.perf_counter()
    sent_blocks = 0
    for seq, (payload, size) in enumerate(zip(payloads, sizes, strict=True)):
        due = begin + sent_blocks / rate
        while (now := time.perf_counter()) < due:
            time.sleep(min(due - now, 0.0005))
        # The payload is [ts, events, rank] with ts a msgpack float64 at bytes 2..10: stamp it now.
        stamped = payload[:2] + struct.pack(">d", time.time()) + payload[10:]
        pub.send_multipart([b"", seq.to_bytes(8, "big"), stamped])
        sent_blocks += size
    time.sleep(0.5)
    context.destroy(linger=1000)


def lag_run(payloads: list[bytes], sizes: list[int], rate: float) -> tuple[float, float, float]:
    """Return (P50 lag s, P99 lag s, achieved block events/s) for one paced run."""
    with zmq.Context() as probe:
        port = probe.socket(zmq.PUB).bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"
    lags: list[float] = []
    router = events_router()
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    child = ctx.Process(target=publish, args=(endpoint, payloads, sizes, rate, ready))
    child.start()
    sub = KVEventSubscriber(router, "gpu0", endpoint, lag_observer=lags.append)
    with sub:
        ready.set()
        deadline = time.monotonic() + 30 + sum(sizes) / rate
        while sub.last_seq < len(payloads) - 1 and time.monotonic() < deadline:
            time.sleep(0.01)
    child.join(10)
    lags.sort()
    if not lags:
        raise RuntimeError("the subscriber received nothing")
    span = sum(sizes) / rate
    return lags[len(lags) // 2], lags[min(len(lags) - 1, int(len(lags) * 0.99))], sum(sizes) / span


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=positive_int, default=5)
    parser.add_argument("--requests", type=positive_int, default=3000)
    parser.add_argument(
        "--per-batch", type=positive_int, default=8, help="requests per published batch (scheduler step)"
    )
    parser.add_argument("--rate", type=positive_float, default=200_000, help="block events/s for the lag run")
    args = parser.parse_args()
    print(f"bench_events: median of {args.runs} runs after a warm-up, one core")
    for encoding in ("array", "map"):
        payloads, sizes = make_stream(requests=args.requests, per_batch=args.per_batch, encoding=encoding)
        rates, bare = throughput(payloads, sum(sizes), args.runs)
        print(
            f"  apply ({encoding:5} encoding): {statistics.median(rates):>10,.0f} block events/s "
            f"(min {min(rates):,.0f}, max {max(rates):,.0f}; {sum(sizes):,} block events in {len(payloads)} batches)"
        )
        print(
            f"        bare PrefixIndex:  {statistics.median(bare):>10,.0f} block events/s "
            f"(Router.write costs {statistics.median(bare) / statistics.median(rates):.2f}x the bare index's time)"
        )
    payloads, sizes = make_stream(requests=args.requests, per_batch=args.per_batch, encoding="array", seed=1)
    runs = [lag_run(payloads, sizes, args.rate) for _ in range(max(1, args.runs // 2))]
    p50 = statistics.median(r[0] for r in runs)
    p99 = statistics.median(r[1] for r in runs)
    print(
        f"  publish->index lag at {args.rate:,.0f} block events/s over ZMQ: "
        f"P50 {p50 * 1000:.2f} ms, P99 {p99 * 1000:.2f} ms (median of {len(runs)} runs)"
    )


if __name__ == "__main__":
    main()
