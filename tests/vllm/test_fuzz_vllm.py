"""Hostile values at every public callable of ``prefixroute.vllm.__all__`` (and ``RouterMetrics``): a call either
works or raises an error of the library's tree (a wrong type is its :class:`InvalidTypeError`), and hostile wire
payloads make the decoder raise :class:`InvalidEventError`, nothing else.

Bounded (a few hundred examples per test, no sockets) so the file runs in seconds; the defects it found are pinned
one by one in test_fuzz_vllm_findings.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

import prefixroute.vllm
from prefixroute import Router
from prefixroute.errors import InvalidEventError
from prefixroute.vllm import (
    BlockRemoved,
    BlockStored,
    BlockTracker,
    EventBatch,
    EventDecoder,
    EventIndex,
    Fleet,
    KVEventSubscriber,
    RankMerge,
    encode_batch,
    lora_namespace,
    parse_metrics,
    rank_endpoint,
)
from prefixroute.vllm.export import RouterMetrics

from ..conftest import StrSubclass, call_or_refuse, hostile_values

_ATOMS: list[object] = [
    None, True, False, 0, -1, 1, 16, 2**64, 10**400, 0.0, 1.5, math.nan, math.inf, -math.inf, "", "gpu0", "\ud800",
    "x" * 5000, StrSubclass("gpu0"), b"", b"\x90", bytearray(b"\x90"), [], (), {}, [None], [[1]], ["gpu0", "gpu0"],
    {"gpu0": 1}, object(), np.int64(3), np.float64(2.0), np.array([1, 2]), "tcp://127.0.0.1:1", "http://127.0.0.1:1",
    (0.1, 1.0), (1.0, 0.1), [(True, [1], None)], [(False, [2**64], None)],
]  # fmt: skip

hostile = hostile_values(_ATOMS)


_FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _router() -> Router:
    return Router(block_size=4)


def _fleet_option(option: str) -> Callable[[Any], object]:
    return lambda value: Fleet(_router(), **{option: value}).close()


def _subscriber_option(option: str) -> Callable[[Any], object]:
    return lambda value: KVEventSubscriber(_router(), "gpu0", "tcp://127.0.0.1:1", **{option: value})


_CONSTRUCTORS: dict[str, Callable[[Any], object]] = {
    "EventIndex block_size": lambda v: EventIndex(v),
    "EventIndex speculative_ttl": lambda v: EventIndex(4, speculative_ttl=v),
    "EventIndex clock": lambda v: EventIndex(4, clock=v),
    "Fleet router": lambda v: Fleet(v).close(),
    **{f"Fleet {o}": _fleet_option(o) for o in ("interval", "timeout", "stale_after", "on_health", "clock")},
    "RankMerge": lambda v: RankMerge(v),
    "BlockTracker block_size": lambda v: BlockTracker(block_size=v),
    "BlockTracker namespace": lambda v: BlockTracker(namespace=v),
    "KVEventSubscriber writer": lambda v: KVEventSubscriber(v, "gpu0", "tcp://127.0.0.1:1"),
    "KVEventSubscriber backend": lambda v: KVEventSubscriber(_router(), v, "tcp://127.0.0.1:1"),
    "KVEventSubscriber endpoint": lambda v: KVEventSubscriber(_router(), "gpu0", v),
    **{f"KVEventSubscriber {o}": _subscriber_option(o)
       for o in ("replay_endpoint", "topic", "namespace", "replay_timeout", "max_batches_per_apply",
                 "max_sequence_jump", "reconnect_backoff", "lag_observer", "clock", "context")},
    "RouterMetrics registry": lambda v: RouterMetrics(v),
    "RouterMetrics prefix": lambda v: RouterMetrics(CollectorRegistry(), prefix=v),
    "EventDecoder.decode": lambda v: EventDecoder().decode(v),
    "encode_batch batch": lambda v: encode_batch(v),
    "encode_batch ts": lambda v: encode_batch(EventBatch(v, [])),
    "encode_batch events": lambda v: encode_batch(EventBatch(1.0, v)),
    "encode_batch rank": lambda v: encode_batch(EventBatch(1.0, [], v)),
    "encode_batch encoding": lambda v: encode_batch(EventBatch(1.0, []), encoding=v),
    "parse_metrics": lambda v: parse_metrics(v),
    "parse_metrics deadline": lambda v: parse_metrics("", deadline=v),
    "rank_endpoint endpoint": lambda v: rank_endpoint(v, 1),
    "rank_endpoint rank": lambda v: rank_endpoint("tcp://127.0.0.1:5557", v),
    "lora_namespace namespace": lambda v: lora_namespace(v, "sql"),
    "lora_namespace lora_name": lambda v: lora_namespace("m", v),
}  # fmt: skip


@_FAST
@given(name=st.sampled_from(sorted(_CONSTRUCTORS)), value=hostile)
def test_constructors_and_functions_refuse_hostile_values_with_the_library_s_errors(name: str, value: object) -> None:
    call_or_refuse(_CONSTRUCTORS[name], value)


_STORED_FIELDS = ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                  "extra_keys", "group_idx", "kv_cache_spec_kind"]  # fmt: skip


@_FAST
@given(field=st.sampled_from(_STORED_FIELDS), value=hostile, strict=st.booleans())
def test_the_tracker_refuses_hand_built_events_with_hostile_fields_and_changes_nothing(
    field: str, value: object, strict: bool
) -> None:
    tracker = BlockTracker(block_size=4)
    tracker.apply([BlockStored([1], None, [1, 2, 3, 4], 4)])
    before = tracker.held()
    fields: dict[str, Any] = {"block_hashes": [2], "parent_block_hash": 1, "token_ids": [5, 6, 7, 8], "block_size": 4}
    fields[field] = value
    event = BlockStored(**fields)
    if not call_or_refuse(tracker.apply_strict if strict else tracker.apply, [event]):
        assert tracker.held() == before
    call_or_refuse(tracker.apply, [BlockRemoved(value)])  # type: ignore[arg-type]
    call_or_refuse(tracker.apply, value)


_FLEET_CALLS: dict[str, Callable[[Fleet, Any], object]] = {
    "add_backend backend": lambda f, v: f.add_backend(v),
    "add_backend metrics_url": lambda f, v: f.add_backend("gpu9", metrics_url=v),
    "add_backend kv_events": lambda f, v: f.add_backend("gpu9", kv_events=v),
    "add_backend replay": lambda f, v: f.add_backend("gpu9", kv_events="tcp://127.0.0.1:1", replay=v),
    # A valid size starts that many subscriber threads (up to 65535 on port 1): only small ones, to stay fast.
    "add_backend data_parallel_size": lambda f, v: None if isinstance(v, int) and 8 < v < 2**16 else f.add_backend(
        "gpu9", kv_events="tcp://127.0.0.1:1", data_parallel_size=v),
    "remove_backend": lambda f, v: f.remove_backend(v),
    "healthy_backends": lambda f, v: f.healthy_backends(v),
    "subscriber": lambda f, v: f.subscriber(v),
    "subscribers": lambda f, v: f.subscribers(v),
}  # fmt: skip


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(_FLEET_CALLS)), value=hostile)
def test_fleet_calls_refuse_hostile_values(name: str, value: object) -> None:
    with Fleet(Router(block_size=4, index=EventIndex(4)), timeout=0.01, stale_after=2.0) as fleet:
        before = fleet.backends()
        if not call_or_refuse(_FLEET_CALLS[name], fleet, value):
            assert fleet.backends() == before


_MERGE_CALLS: dict[str, Callable[[RankMerge, Any], object]] = {
    "write backend": lambda m, v: m.write(v, [(True, [1], None)]),
    "write updates": lambda m, v: m.write("gpu0", v),
    "write one": lambda m, v: m.write("gpu0", [v]),
    "write hashes": lambda m, v: m.write("gpu0", [(True, v, None)]),
    "holders backend": lambda m, v: m.holders(v, 1),
    "holders block_hash": lambda m, v: m.holders("gpu0", v),
    "blocks": lambda m, v: m.blocks(v),
}


@_FAST
@given(calls=st.lists(st.tuples(st.sampled_from(sorted(_MERGE_CALLS)), hostile), min_size=1, max_size=4))
def test_rank_merge_refuses_hostile_values_and_changes_nothing(calls: list[tuple[str, object]]) -> None:
    router = _router()
    merge = RankMerge(router)
    merge.write("gpu0", [(True, [1, 2], None)])
    for name, value in calls:
        before = (merge.blocks("gpu0"), router.index.hashes("gpu0") if "gpu0" in router.index.backends() else None)
        if not call_or_refuse(_MERGE_CALLS[name], merge, value):
            after = (merge.blocks("gpu0"), router.index.hashes("gpu0") if "gpu0" in router.index.backends() else None)
            assert after == before, (name, value)
        router._check()


_METRICS_CALLS: dict[str, Callable[[RouterMetrics, Any], object]] = {
    "observe decision": lambda m, v: m.observe(v, 0.001),
    "observe seconds": lambda m, v: m.observe(_router().route(list(range(8)), ["gpu0"]), v),
    "observe_served": lambda m, v: m.observe_served(v),
    "watch_index": lambda m, v: m.watch_index(v),
    "watch_index lock": lambda m, v: m.watch_index(_router().index, lock=v),
    "watch_subscriber": lambda m, v: m.watch_subscriber(v),
    "watch_fleet": lambda m, v: m.watch_fleet(v),
}


@_FAST
@given(name=st.sampled_from(sorted(_METRICS_CALLS)), value=hostile)
def test_router_metrics_refuse_hostile_values_and_still_scrape(name: str, value: object) -> None:
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry)
    call_or_refuse(_METRICS_CALLS[name], metrics, value)
    generate_latest(registry)  # an accepted value never breaks a later scrape


_EVENTS = st.one_of(
    st.builds(lambda h: ["BlockStored", h, None, [1, 2, 3, 4], 4], st.lists(st.integers(0, 2**64 - 1), max_size=2)),
    st.builds(lambda h: {"type": "BlockRemoved", "block_hashes": h}, st.lists(st.integers(0, 2**64 - 1), max_size=2)),
    st.just(["AllBlocksCleared"]),
)
_WIRE = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=4),
              st.binary(max_size=4), st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type"]),
              _EVENTS),
    lambda children: st.one_of(st.lists(children, max_size=4),
                               st.dictionaries(st.one_of(st.text(max_size=4), st.sampled_from(["type", "ts", "events",
                                               "block_hashes"])), children, max_size=3)),
    max_leaves=12,
)  # fmt: skip


@_FAST
@given(events=st.lists(_WIRE, max_size=4), ts=_WIRE, rank=_WIRE, as_map=st.booleans(), cut=st.integers(0, 64))
def test_hostile_wire_payloads_decode_or_raise_invalid_event_error(
    events: list[object], ts: object, rank: object, as_map: bool, cut: int
) -> None:
    batch: object = {"ts": ts, "events": events, "data_parallel_rank": rank} if as_map else [ts, events, rank]
    payload = msgspec.msgpack.encode(batch)
    decoder = EventDecoder()
    for candidate in (payload, payload[:cut], payload[cut:], msgspec.msgpack.encode(events)):
        try:
            decoded = decoder.decode(candidate)
        except InvalidEventError:
            continue
        BlockTracker(block_size=4).apply(decoded.events)  # whatever decodes, the subscriber's tracker takes


def test_deep_nesting_is_an_invalid_event_error() -> None:
    with pytest.raises(InvalidEventError):
        EventDecoder().decode(b"\x93\xcb" + b"\0" * 8 + b"\x91" * 200_000)


def test_every_public_name_is_exercised_here() -> None:
    exercised = {
        "BlockRemoved", "BlockStored", "BlockTracker", "EventBatch", "EventDecoder", "EventIndex", "Fleet",
        "KVEventSubscriber", "RankMerge", "encode_batch", "lora_namespace", "parse_metrics", "rank_endpoint",
    }  # fmt: skip
    # fetch_metrics reaches the network (covered by test_metrics.py); the rest are data or protocols.
    not_fuzzed = {"AllBlocksCleared", "BackendStats", "EngineMetrics", "FleetStats", "IndexWriter", "KVCacheEvent",
                  "SubscriberStats", "TrackerStats", "fetch_metrics"}  # fmt: skip
    assert set(prefixroute.vllm.__all__) == exercised | not_fuzzed
