"""A data-parallel vLLM server: one backend, one KV-event stream per rank (each on its own real ZMQ socket), merged
so the backend's index holds a block while any rank holds it; the endpoints' checks; RankMerge on its own."""

from __future__ import annotations

import errno
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from prefixroute import BlockHasher, ConfigurationError, InvalidEventError, InvalidTypeError, Router
from prefixroute.testing import FakeVLLM
from prefixroute.vllm import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    Fleet,
    KVEventSubscriber,
    RankMerge,
    encode_batch,
    rank_endpoint,
)

from ..conftest import wait_until
from .conftest import events_router, settle

TOKENS = [random.Random(7).randrange(30_000) for _ in range(48)]  # 3 blocks of 16
H = BlockHasher(16).hash(TOKENS)  # their own hashes: what the index holds


@pytest.fixture
def ranks() -> Iterator[tuple[FakeVLLM, FakeVLLM]]:
    with FakeVLLM(num_blocks=64, seed=1) as rank0, FakeVLLM(num_blocks=64, seed=2) as rank1:
        yield rank0, rank1


def publish(engine: FakeVLLM, sub: KVEventSubscriber, *events: BlockStored | BlockRemoved | AllBlocksCleared) -> None:
    """Publish ``events`` as the engine's next batch and wait until ``sub`` has applied it."""
    seq = engine.seq
    engine.publish_payload(encode_batch(EventBatch(time.time(), list(events))))
    wait_until(lambda: sub.last_seq >= seq, what=f"batch {seq} applied")


def stored(vllm_hashes: list[int | bytes], blocks: int) -> BlockStored:
    return BlockStored(vllm_hashes, None, TOKENS[: blocks * 16], 16, medium="GPU")


def test_a_block_stays_while_any_rank_holds_it(ranks: tuple[FakeVLLM, FakeVLLM]) -> None:
    rank0, rank1 = ranks
    router = events_router()
    with Fleet(router) as fleet:
        fleet.add_backend(
            "dp", kv_events=[rank0.endpoint, rank1.endpoint], replay=[rank0.replay_endpoint, rank1.replay_endpoint]
        )
        sub0, sub1 = fleet.subscribers("dp")
        assert fleet.subscriber("dp") is sub0 and (sub0.endpoint, sub1.endpoint) == (rank0.endpoint, rank1.endpoint)
        settle(rank0, sub0)
        settle(rank1, sub1)

        def held() -> list[bool]:
            return [router.index.holds(h, "dp") for h in H]

        # Overlapping stores: rank 0 holds blocks 0-2, rank 1 blocks 0-1 (its own vLLM hashes, the same tokens).
        publish(rank0, sub0, stored([101, 102, 103], 3))
        publish(rank1, sub1, stored([201, 202], 2))
        assert held() == [True, True, True]
        # Rank 0 evicts blocks 1 and 2: block 2 goes, block 1 stays (rank 1 holds it).
        publish(rank0, sub0, BlockRemoved([103, 102], medium="GPU"))
        assert held() == [True, True, False]
        # Rank 1 evicts block 1 too: no rank holds it any more.
        publish(rank1, sub1, BlockRemoved([202], medium="GPU"))
        assert held() == [True, False, False]
        # Rank 0 stores block 1 again, then clears its cache: only what rank 1 holds is left (block 0).
        publish(rank0, sub0, BlockStored([104], 101, TOKENS[16:32], 16, medium="GPU"))
        assert held() == [True, True, False]
        publish(rank0, sub0, AllBlocksCleared())
        assert held() == [True, False, False]
        assert not sub0.held() & set(H) and sub1.held() & set(H) == {H[0]}
        router._check()
        router.index._check(chains=[H])

        stats = fleet.stats()["dp"]
        events, per_rank = stats.events, stats.ranks
        assert events is not None and len(per_rank) == 2 and events.backend == "dp"
        assert events.batches == per_rank[0].batches + per_rank[1].batches >= 7
        assert events.tracker.clears == 1 and events.tracker.blocks_removed == 3
        assert events.last_seq == min(r.last_seq for r in per_rank)
        lags = [r.last_lag_s for r in per_rank if r.last_lag_s is not None]
        assert len(lags) == 2 and events.last_lag_s == max(lags)  # the latest rank's
        assert events.blocks_held == len(sub0.held() | sub1.held()) == router.index.blocks("dp")  # distinct ones


def test_the_index_is_the_union_of_what_the_ranks_cache(ranks: tuple[FakeVLLM, FakeVLLM]) -> None:
    """Real caches that evict: after every step the backend's index is exactly what rank 0 or rank 1 holds."""
    rank0, rank1 = ranks
    router = events_router()
    rng = random.Random(3)
    prefixes = [[rng.randrange(30_000) for _ in range(64)] for _ in range(6)]
    with Fleet(router) as fleet:
        fleet.add_backend(
            "dp", kv_events=(rank0.endpoint, rank1.endpoint), replay=(rank0.replay_endpoint, rank1.replay_endpoint)
        )
        sub0, sub1 = fleet.subscribers("dp")
        for step in range(40):  # 64 blocks per rank: the ranks evict, each its own blocks
            engine = (rank0, rank1)[rng.randrange(2)]
            engine.complete(rng.choice(prefixes) + [rng.randrange(30_000) for _ in range(rng.randrange(16, 64))])
            if step == 19:
                rank0.clear_cache()
            if step % 10 == 9:
                settle(rank0, sub0)
                settle(rank1, sub1)
                assert router.index.hashes("dp") == rank0.own_hashes() | rank1.own_hashes()
                router._check()
        stats = fleet.stats()["dp"]
        assert stats.events is not None and stats.events.blocks_held == router.index.blocks("dp")
        assert stats.events.tracker.blocks_removed > 0  # evictions happened


def test_data_parallel_size_derives_the_ranks_endpoints_as_vllm_does() -> None:
    with Fleet(events_router()) as fleet:
        fleet.add_backend("dp", kv_events="tcp://127.0.0.1:5557", replay="tcp://127.0.0.1:6557", data_parallel_size=3)
        assert [(s.endpoint, s.replay_endpoint) for s in fleet.subscribers("dp")] == [
            ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:6557"),
            ("tcp://127.0.0.1:5558", "tcp://127.0.0.1:6558"),
            ("tcp://127.0.0.1:5559", "tcp://127.0.0.1:6559"),
        ]
        fleet.add_backend("one", kv_events="inproc://kv", data_parallel_size=1)
        assert [s.endpoint for s in fleet.subscribers("one")] == ["inproc://kv"]
        stats = fleet.stats()
        assert len(stats["dp"].ranks) == 3 and stats["one"].ranks == (stats["one"].events,)
        fleet.remove_backend("dp")
        assert fleet.subscribers("dp") == [] and fleet.subscriber("dp") is None
    assert rank_endpoint("inproc://kv", 2) == "inproc://kv_dp2"
    # As vLLM's offset_endpoint_port: the port is after the last colon (an IPv6 host has colons of its own), the
    # last port there is 65535, and an inproc:// name is any text after the scheme, "://" in it included.
    assert rank_endpoint("tcp://[::1]:5557", 2) == "tcp://[::1]:5559"
    assert rank_endpoint("tcp://gpu0:65534", 1) == "tcp://gpu0:65535"
    assert rank_endpoint("inproc://kv://a", 1) == "inproc://kv://a_dp1"
    with pytest.raises(ConfigurationError, match=r"rank 2 is past port 65535: configure vLLM with a lower port"):
        rank_endpoint("tcp://gpu0:65534", 2)
    with pytest.raises(
        ConfigurationError, match=r"^endpoint must be a ZMQ address to connect to, like 'tcp://gpu0:5557'"
    ):
        rank_endpoint("gpu0:5557", 1)
    assert rank_endpoint("inproc://kv", 1023) == "inproc://kv_dp1023"
    for rank in (-1, 1024, 60000):  # a rank of at most 1024 ranks
        with pytest.raises(ConfigurationError, match=rf"rank must be an int in \[0, 1023\] .*, not {rank}$"):
            rank_endpoint("inproc://kv", rank)


def test_a_single_endpoint_has_one_subscriber_and_no_merge(ranks: tuple[FakeVLLM, FakeVLLM]) -> None:
    rank0, rank1 = ranks
    router = events_router()
    with Fleet(router) as fleet:
        fleet.add_backend("gpu0", kv_events=rank0.endpoint, replay=rank0.replay_endpoint, metrics_url=rank0.url)
        fleet.add_backend("listed", kv_events=[rank1.endpoint])  # a list of one is the same
        sub = fleet.subscriber("gpu0")
        assert sub is not None and fleet.subscribers("gpu0") == [sub] and sub.writer is not None
        assert type(sub.writer).__name__ == "_Gate" and type(fleet.subscribers("listed")[0].writer).__name__ == "_Gate"
        rank0.complete(TOKENS)
        settle(rank0, sub)
        stats = fleet.stats()["gpu0"]
        assert stats.ranks == (stats.events,) and stats.events is not None
        assert stats.events.blocks_held == len(sub.held())


def test_numpy_integers_are_taken_for_the_vllm_layers_int_options() -> None:
    """numpy's ints were refused for a size, a rank, a count or a block hash: kept now as the int they stand for."""
    import numpy as np
    from prometheus_client import CollectorRegistry

    from prefixroute.vllm.export import RouterMetrics

    npa: Any = np  # numpy's ints typed loosely: stubs differ on whether they are ints
    assert rank_endpoint("tcp://gpu0:5557", npa.int64(2)) == "tcp://gpu0:5559"
    router = events_router()
    with Fleet(router) as fleet:
        fleet.add_backend("dp", kv_events="tcp://127.0.0.1:5557", data_parallel_size=npa.int32(2))
        assert [s.endpoint for s in fleet.subscribers("dp")] == ["tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"]
    subscriber = KVEventSubscriber(router, "x", "tcp://127.0.0.1:1", max_batches_per_apply=npa.int64(8))
    assert type(subscriber._max_batches) is int
    assert RankMerge(router).holders("dp", npa.uint64(H[0])) == 0
    metrics = RouterMetrics(CollectorRegistry())
    metrics.observe_served(npa.int64(16))
    assert metrics._matched.labels("served")._value.get() == 16
    bads: list[Any] = [True, npa.bool_(True), 2.0]
    for bad in bads:
        with pytest.raises(ConfigurationError, match="rank must be"):
            rank_endpoint("tcp://gpu0:5557", bad)
        with pytest.raises(ConfigurationError, match="data_parallel_size"):
            Fleet(router).add_backend("dp", kv_events="tcp://127.0.0.1:5557", data_parallel_size=bad)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"kv_events": []}, r"^kv_events is an empty list: give at least one endpoint \(one per data-parallel rank\)$"),
        (
            {"kv_events": ["tcp://h:1", 5]},
            r"^kv_events\[1\] must be a ZMQ address to connect to, like 'tcp://gpu0:5557', not 5$",
        ),
        ({"kv_events": ["tcp://h:1", "tcp://*:2"]}, r"kv_events\[1\] must be a ZMQ address"),
        ({"kv_events": {"tcp://h:1"}}, r"or a list of them \(one per data-parallel rank\), not \{'tcp://h:1'\}$"),
        (
            {"kv_events": ["tcp://h:1", "tcp://h:2"], "replay": ["tcp://h:3"]},
            r"a list of 2 endpoints, .*, not \['tcp://h:3'\]$",
        ),
        ({"kv_events": ["tcp://h:1", "tcp://h:2"], "replay": "tcp://h:3"}, "a list of 2 endpoints"),
        (
            {"kv_events": ["tcp://h:1", "tcp://h:2"], "replay": ["tcp://h:3", None]},
            r"^replay\[1\] must be a ZMQ address to connect to, like 'tcp://gpu0:5558', not None$",
        ),
        ({"kv_events": ["tcp://h:1", "tcp://h:1"]}, "kv_events lists an endpoint twice"),
        ({"kv_events": ["tcp://h:1", "tcp://h:2"], "replay": ["tcp://h:3"] * 2}, "replay lists an endpoint twice"),
        ({"kv_events": "tcp://h:1", "replay": ["tcp://h:3"]}, r"^replay must be one endpoint .*, not \['tcp://h:3'\]$"),
        # One rank's publisher that is another's replay endpoint (the docs' 5557/5558 slip) was taken: vLLM cannot
        # bind both, and that rank's subscriber would have talked to a replay socket.
        (
            {"kv_events": "tcp://h:5557", "replay": "tcp://h:5558", "data_parallel_size": 2},
            r"^with data_parallel_size=2, rank 1 publishes on 'tcp://h:5558', rank 0's replay endpoint: keep the "
            r"replay port at least 2 from the publisher's \(say 5557 and 6557\)$",
        ),
        (
            {"kv_events": "tcp://h:5557", "replay": "tcp://h:5555", "data_parallel_size": 3},
            r"^with data_parallel_size=3, rank 0 publishes on 'tcp://h:5557', rank 2's replay endpoint",
        ),
        (
            {"kv_events": ["tcp://h:1", "tcp://h:2"], "replay": ["tcp://h:2", "tcp://h:3"]},
            r"^kv_events\[1\] 'tcp://h:2' is also replay\[0\]: each rank publishes and replays on addresses of its "
            r"own$",
        ),
        (
            {"kv_events": ["tcp://h:1", "tcp://h:2"], "data_parallel_size": 3},
            r"^data_parallel_size=3 but kv_events lists 2 endpoints: give one endpoint per rank, or one endpoint with "
            r"data_parallel_size$",
        ),
        ({"kv_events": "tcp://h:1", "data_parallel_size": 0}, r"data_parallel_size must be an int in \[1, 1024\]"),
        ({"kv_events": "tcp://h:1", "data_parallel_size": True}, r"data_parallel_size must be an int in \[1, 1024\]"),
        # 60000 started 60000 subscriber threads; a list as long did too
        ({"kv_events": "tcp://h:1", "data_parallel_size": 60000}, r"data_parallel_size must be an int in \[1, 1024\]"),
        ({"kv_events": "tcp://h:1", "data_parallel_size": 1025}, r"in \[1, 1024\], not 1025"),
        ({"kv_events": [f"tcp://h:{p}" for p in range(1, 1026)]}, "lists 1025 endpoints.*at most 1024 ranks"),
        ({"data_parallel_size": 2}, "without kv_events"),
        ({"kv_events": "ipc:///tmp/kv", "data_parallel_size": 2}, "pass each rank's endpoint in a list"),
        ({"kv_events": "tcp://h:65535", "data_parallel_size": 2}, "past port 65535"),
        # Named as add_backend() names them: a bad replay was "endpoint must be ..., like 'tcp://gpu0:5557'" with
        # data_parallel_size (rank_endpoint()'s words), and "replay_endpoint" without (the subscriber's).
        (
            {"kv_events": "gpu0:5557", "data_parallel_size": 2},
            r"^kv_events must be a ZMQ address to connect to, like 'tcp://gpu0:5557', not 'gpu0:5557'$",
        ),
        (
            {"kv_events": "tcp://h:1", "replay": "gpu0:5558", "data_parallel_size": 2},
            r"^replay must be a ZMQ address to connect to, like 'tcp://gpu0:5558', not 'gpu0:5558'$",
        ),
        ({"kv_events": "gpu0:5557"}, r"^kv_events must be a ZMQ address"),
        ({"kv_events": "tcp://h:1", "replay": "gpu0:5558"}, r"^replay must be a ZMQ address"),
    ],
)
def test_bad_endpoints_are_refused_before_anything_starts(options: dict[str, object], message: str) -> None:
    with Fleet(events_router()) as fleet:
        with pytest.raises(ConfigurationError, match=message):
            fleet.add_backend("dp", **options)  # type: ignore[arg-type]
        assert fleet.backends() == [] and fleet.subscribers("dp") == []


def test_the_most_ranks_1024_are_taken_as_a_list_or_as_data_parallel_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cap refuses more than 1024 ranks, not 1024 (vLLM's largest data-parallel servers are far below it)."""
    monkeypatch.setattr(KVEventSubscriber, "start", lambda self: self)  # the count is the point, not 1024 threads
    with Fleet(events_router()) as fleet:
        fleet.add_backend("listed", kv_events=[f"inproc://kv{rank}" for rank in range(1024)])
        fleet.add_backend("sized", kv_events="tcp://h:5557", data_parallel_size=1024)
        assert [len(fleet.subscribers(backend)) for backend in ("listed", "sized")] == [1024, 1024]
        assert fleet.subscribers("sized")[-1].endpoint == "tcp://h:6580"


def test_a_prediction_router_refuses_a_list_too() -> None:
    with Fleet(Router()) as fleet, pytest.raises(ConfigurationError, match="EventIndex"):
        fleet.add_backend("dp", kv_events=["tcp://h:1", "tcp://h:2"])


def test_rank_merge_counts_the_ranks_holding_each_block() -> None:
    router = events_router()
    merge = RankMerge(router)
    assert merge.block_size == 16
    merge.write("dp", [(True, H, None)])  # rank 0: blocks 0-2
    merge.write("dp", [(True, H[:2], None)])  # rank 1: blocks 0-1
    assert [merge.holders("dp", h) for h in H] == [2, 2, 1] and merge.blocks("dp") == 3
    merge.write("dp", [(False, H[1:], None)])  # rank 0 evicts 1 and 2
    assert router.index.hashes("dp") == set(H[:2])
    merge.write("dp", [(False, H[:2], None)])  # rank 1 resets
    assert router.index.hashes("dp") == {H[0]} and merge.holders("dp", H[1]) == 0
    merge.write("dp", [(False, [H[0]], None)])  # rank 0 resets: nothing held, nothing kept
    assert router.index.blocks("dp") == 0 and merge.blocks("dp") == 0 and repr(merge) == "RankMerge(blocks={})"
    merge.write("dp", [(False, [12345], None)])  # never stored here: passes through, harmless
    router._check()
    with pytest.raises(TypeError, match="IndexWriter"):
        RankMerge(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="backend must be a str id, not int"):
        merge.write(7, [])  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="block_hash must be an int, not str"):
        merge.holders("dp", "12345")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"tuple \(stored, hashes, parent\)"):
        merge.write("dp", [[True, H, None]])  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("updates", "error"),
    [
        ([(True, [1, [2]], None)], InvalidEventError),  # an unhashable "hash"
        ([(True, [1, -2], None)], InvalidEventError),
        ([(True, [1, 2**64], None)], InvalidEventError),
        ([(True, "ab", None)], TypeError),
        ([(True, None, None)], TypeError),
        ([(1, [1], None)], TypeError),  # stored must be a bool, as Router.write() says
        ([(False, [H[0]], 5)], InvalidEventError),  # a removal has no parent
        ([(True, [1], None), (False, [H[0], "x"], None)], InvalidEventError),  # the second update of a batch
        (None, TypeError),
        ("ab", TypeError),  # a str is iterable, but no iterable of updates
    ],
)
def test_rank_merge_refuses_a_malformed_batch_before_counting_any_of_it(
    updates: object, error: type[Exception]
) -> None:
    router = events_router()
    merge = RankMerge(router)
    merge.write("dp", [(True, H, None)])
    with pytest.raises(error) as raised:
        merge.write("dp", updates)  # type: ignore[arg-type]
    assert isinstance(raised.value, (InvalidTypeError, InvalidEventError))  # the library's errors, not Python's
    if not isinstance(updates, list):
        assert str(raised.value) == f"updates must be an iterable of index updates, not {type(updates).__name__}"
    assert [merge.holders("dp", h) for h in H] == [1, 1, 1] and merge.blocks("dp") == 3
    assert router.index.hashes("dp") == set(H)
    router._check()


def test_a_writer_that_makes_another_rank_write_from_inside_a_write_does_not_deadlock() -> None:
    """A writer under the merge may reset another rank's subscriber, which writes that rank's removals through the
    merge from inside the merge's own write (the lock was not reentrant: the thread waited on itself for good)."""
    router = events_router()

    class ResettingWriter:
        block_size = router.block_size

        def __init__(self) -> None:
            self.calls = 0

        def write(self, backend: str, updates: Any) -> None:
            self.calls += 1
            if self.calls == 2:  # rank 0's store of H reached the index: rank 1 resets, dropping H[0]
                merge.write(backend, [(False, H[:1], None)])
            router.write(backend, updates)

    merge = RankMerge(ResettingWriter())
    merge.write("dp", [(True, H[:1], None)])  # rank 1 holds H[0]
    done = threading.Thread(target=merge.write, args=("dp", [(True, H, None)]), daemon=True)  # rank 0 stores H
    done.start()
    done.join(timeout=30)
    assert not done.is_alive(), "the merge's write waited on its own lock"
    assert [merge.holders("dp", h) for h in H] == [1, 1, 1] and router.index.hashes("dp") == set(H)
    router._check()


def test_rank_merge_reads_an_iterator_of_hashes_once_and_stores_what_it_counts() -> None:
    router = events_router()
    merge = RankMerge(router)
    merge.write("dp", [(True, iter(H), None)])  # type: ignore[list-item]
    assert merge.blocks("dp") == 3 and router.index.hashes("dp") == set(H)


@pytest.mark.parametrize("how", ["remove_backend", "close"])
def test_a_backends_rank_subscribers_are_all_told_to_stop_before_any_is_waited_for(
    how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Was: each rank's subscriber was told to stop and waited for in turn, each thread noticing within its 50 ms
    poll, so removing or closing a backend took about 30 ms a rank (64 ranks: 1.9 s; remove_backend() promises about
    its ``timeout``). Now every thread is told first and they end together: at the first wait, all have been told."""
    told_at_each_wait: list[list[bool]] = []
    real_stop = KVEventSubscriber.stop

    def recording_stop(self: KVEventSubscriber, *, timeout: float = 5.0) -> None:
        told_at_each_wait.append([s._stop.is_set() for s in subscribers])
        real_stop(self, timeout=timeout)

    monkeypatch.setattr(KVEventSubscriber, "stop", recording_stop)
    with Fleet(events_router()) as fleet:
        fleet.add_backend("dp", kv_events="tcp://127.0.0.1:41000", data_parallel_size=8)  # nothing listens: idle
        subscribers = fleet.subscribers("dp")
        assert all(s.running for s in subscribers)
        if how == "close":
            fleet.close()
        else:
            fleet.remove_backend("dp")
        assert told_at_each_wait == [[True] * 8] * 8
    assert not any(s.running for s in subscribers)


def test_a_rank_whose_subscriber_cannot_start_undoes_the_add_and_says_what_to_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Was: a process out of file descriptors failed add_backend() with a bare ZMQError after the backend had joined
    the fleet: its first ranks' subscribers ran for good, the rest never started, and its id could not be added
    again. The subscribers share the fleet's context now: what can fail as a rank starts is its thread."""
    started = {"threads": 0}
    real_start = threading.Thread.start

    def start_until_out_of_threads(thread: threading.Thread) -> None:
        if thread.name == "prefixroute-kv-events[dp]":
            started["threads"] += 1
            if started["threads"] == 3:
                raise RuntimeError("can't start new thread")
        real_start(thread)

    with Fleet(events_router()) as fleet:
        monkeypatch.setattr(threading.Thread, "start", start_until_out_of_threads)
        with pytest.raises(ConfigurationError, match=r"could not start its thread \(can't start new thread\)"):
            fleet.add_backend("dp", kv_events="tcp://127.0.0.1:41100", data_parallel_size=4)
        monkeypatch.undo()
        assert fleet.backends() == [] and fleet.subscribers("dp") == []
        assert not [t for t in threading.enumerate() if t.name == "prefixroute-kv-events[dp]"]
        fleet.add_backend("dp", kv_events="tcp://127.0.0.1:41100", data_parallel_size=4)  # once fixed, as new
        assert [s.running for s in fleet.subscribers("dp")] == [True] * 4


def test_a_fleet_whose_zmq_context_cannot_be_made_refuses_the_backend_and_says_what_to_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def out_of_descriptors() -> zmq.Context[Any]:
        raise zmq.ZMQError(errno.EMFILE)

    with Fleet(events_router()) as fleet:
        monkeypatch.setattr(zmq, "Context", out_of_descriptors)
        with pytest.raises(ConfigurationError, match=r"ZMQ context could not be made \(Too many open files\).*ulimit"):
            fleet.add_backend("dp", kv_events="tcp://127.0.0.1:41150", data_parallel_size=2)
        monkeypatch.undo()
        assert fleet.backends() == []
        fleet.add_backend("dp", kv_events="tcp://127.0.0.1:41150", data_parallel_size=2)  # once fixed, as new
        assert [s.running for s in fleet.subscribers("dp")] == [True] * 2
