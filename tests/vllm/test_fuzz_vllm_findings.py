"""Defects the vLLM-layer fuzz harness (test_fuzz_vllm.py) found: each case failed before its fix."""

from __future__ import annotations

import threading

import msgspec
import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from prefixroute import ConfigurationError, InvalidTypeError, Router
from prefixroute.errors import InvalidEventError
from prefixroute.vllm import EventBatch, EventDecoder, EventIndex, Fleet, KVEventSubscriber, RankMerge, encode_batch
from prefixroute.vllm.export import RouterMetrics


@pytest.mark.parametrize("tag", [[1], {"a": 1}, [[]]])
@pytest.mark.parametrize("as_map", [False, True])
def test_an_event_whose_type_tag_is_a_list_or_map_is_an_invalid_event_not_an_unhashable_type_error(
    tag: object, as_map: bool
) -> None:
    event = {"type": tag} if as_map else [tag, 1]
    payload = msgspec.msgpack.encode([1.0, [event], None])
    with pytest.raises(InvalidEventError, match="no event type tag"):
        EventDecoder().decode(payload)


@pytest.mark.parametrize("as_map", [False, True])
def test_a_truncated_payload_whose_first_event_is_malformed_is_an_invalid_event_not_a_decode_error(
    as_map: bool,
) -> None:
    # The typed decoders stop at the malformed event (a ValidationError); the raw one then reads to the cut.
    batch: object = {"ts": 0, "events": [None], "data_parallel_rank": None} if as_map else [0, [None, 1], None]
    payload = msgspec.msgpack.encode(batch)[:-1]
    with pytest.raises(InvalidEventError, match="not valid msgpack"):
        EventDecoder().decode(payload)


@pytest.mark.parametrize("payload", [None, "\x90", 5, np.int64(3), [b"\x90"]])
def test_a_payload_that_is_not_bytes_is_a_type_error_of_the_tree(payload: object) -> None:
    with pytest.raises(InvalidTypeError, match="payload must be bytes"):
        EventDecoder().decode(payload)  # type: ignore[arg-type]


def test_bytearray_and_memoryview_payloads_still_decode() -> None:
    payload = msgspec.msgpack.encode([1.0, [["AllBlocksCleared"]], None])
    for each in (bytearray(payload), memoryview(payload)):
        assert len(EventDecoder().decode(each).events) == 1  # type: ignore[arg-type]


@pytest.mark.parametrize("encoding", [np.array([1, 2]), None, ["array"]])
def test_encode_batch_refuses_an_encoding_that_is_no_str_with_a_configuration_error(encoding: object) -> None:
    with pytest.raises(ConfigurationError, match="encoding must be"):
        encode_batch(EventBatch(1.0, []), encoding=encoding)  # type: ignore[arg-type]


class _NoBlockSize:
    def write(self, backend: str, updates: object) -> None: ...


@pytest.mark.parametrize("writer", [None, object(), "router", _NoBlockSize()])
def test_a_subscriber_writer_without_write_or_block_size_is_a_type_error_not_an_attribute_error(
    writer: object,
) -> None:
    with pytest.raises(InvalidTypeError, match=f"^writer must be an IndexWriter .*, not {type(writer).__name__}$"):
        KVEventSubscriber(writer, "gpu0", "tcp://127.0.0.1:5557")  # type: ignore[arg-type]


@pytest.mark.parametrize("backends", [True, 5, object()])
def test_fleet_healthy_backends_refuses_a_non_iterable_with_a_type_error_of_the_tree(backends: object) -> None:
    with Fleet(Router(index=EventIndex(16))) as fleet, pytest.raises(InvalidTypeError, match="iterable of str"):
        fleet.healthy_backends(backends)  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", [[], {}, None, 5])
def test_fleet_subscriber_lookups_refuse_a_backend_that_is_not_a_str(backend: object) -> None:
    with Fleet(Router(index=EventIndex(16))) as fleet:
        for lookup in (fleet.subscriber, fleet.subscribers):
            with pytest.raises(InvalidTypeError, match="backend must be a str"):
                lookup(backend)  # type: ignore[arg-type]


@pytest.mark.parametrize(("backend", "block_hash"), [([], 1), ("gpu0", []), ("gpu0", bytearray(b"x")), ("gpu0", True)])
def test_rank_merge_reads_refuse_unhashable_or_mistyped_arguments(backend: object, block_hash: object) -> None:
    merge = RankMerge(Router(block_size=4))
    merge.write("gpu0", [(True, [1], None)])
    with pytest.raises(InvalidTypeError):
        merge.holders(backend, block_hash)  # type: ignore[arg-type]
    if not isinstance(backend, str):
        with pytest.raises(InvalidTypeError):
            merge.blocks(backend)  # type: ignore[arg-type]
    assert merge.holders("gpu0", 1) == 1


@pytest.mark.parametrize("prefix", ["\ud800", "", "2x", "a b", "a-b"])
def test_router_metrics_prefix_that_is_no_metric_name_is_a_configuration_error_when_given(prefix: str) -> None:
    with pytest.raises(ConfigurationError, match="Prometheus metric name"):
        RouterMetrics(CollectorRegistry(), prefix=prefix)
    with pytest.raises(InvalidTypeError):
        RouterMetrics(CollectorRegistry(), prefix=None)  # type: ignore[arg-type]


def test_router_metrics_observe_refuses_what_is_no_decision_or_no_finite_seconds_and_counts_nothing() -> None:
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry)
    decision = Router().route(list(range(32)), ["gpu0"])
    with pytest.raises(InvalidTypeError, match="Decision"):
        metrics.observe(None, 0.1)  # type: ignore[arg-type]
    for seconds in (None, 10**400, float("nan"), -1.0, "0.1"):
        with pytest.raises(ConfigurationError, match="seconds"):
            metrics.observe(decision, seconds)  # type: ignore[arg-type]
    assert registry.get_sample_value("prefixroute_decisions_total", {"backend": "gpu0", "reason": "miss"}) is None


def test_router_metrics_observe_served_says_type_or_range_as_the_tree_does() -> None:
    metrics = RouterMetrics(CollectorRegistry())
    with pytest.raises(InvalidTypeError):
        metrics.observe_served(None)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=">= 0"):
        metrics.observe_served(-1)
    with pytest.raises(ConfigurationError):
        metrics.observe_served(10**400)  # was an OverflowError from prometheus_client


@pytest.mark.parametrize("watch", ["watch_index", "watch_subscriber", "watch_fleet"])
def test_router_metrics_watch_refuses_the_wrong_object_when_given_not_at_every_scrape(watch: str) -> None:
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry)
    with pytest.raises(InvalidTypeError):
        getattr(metrics, watch)(None)
    with pytest.raises(InvalidTypeError, match="lock"):
        metrics.watch_index(Router().index, lock=5)  # type: ignore[arg-type]
    metrics.watch_index(Router().index, lock=threading.Lock())
    assert b"prefixroute_index_blocks" in generate_latest(registry)


def test_a_hand_built_events_array_of_extra_keys_stops_its_chain_instead_of_leaking_numpy_truth_errors() -> None:
    # Was: numpy's "truth value of an array ... is ambiguous" ValueError (found by test_fuzz_vllm in a full run).
    from prefixroute.vllm import BlockStored, BlockTracker

    tracker = BlockTracker(block_size=4)
    tracker.apply([BlockStored([1], None, [1, 2, 3, 4], 4)])
    before = tracker.held()
    event = BlockStored([2], 1, [5, 6, 7, 8], 4, extra_keys=[np.array([1, 2])])
    tracker.apply([event])
    assert tracker.held() == before  # a block with extra keys is not indexed, as a multimodal one


@pytest.mark.parametrize("ttl", [0.0, 3.0])
@pytest.mark.parametrize(
    ("call", "value"),
    [
        ("predict", None), ("predict", ["x"]), ("predict", [-1]), ("retract", None), ("retract", [1.5]),
        ("remove", None), ("remove", [2**64]), ("retract start", None), ("retract start", -1),
    ],
)  # fmt: skip
def test_the_event_index_refuses_what_its_base_refuses_whatever_its_ttl(ttl: float, call: str, value: object) -> None:
    # Was: with a TTL, remove(None) and retract(None, ...) raised Python's bare TypeError; without one, predict()
    # and retract() took anything silently (they record nothing then).
    index = EventIndex(4, speculative_ttl=ttl, clock=lambda: 0.0)
    index.insert([1, 2], "gpu0")
    index.predict([1, 2, 3], "gpu0", 2)
    before = (index.hashes("gpu0"), index.match([1, 2, 3], ["gpu0"]))
    actions = {
        "predict": lambda: index.predict(value, "gpu0", 0),  # type: ignore[arg-type]
        "retract": lambda: index.retract(value, "gpu0", 0),  # type: ignore[arg-type]
        "remove": lambda: index.remove(value, "gpu0"),  # type: ignore[arg-type]
        "retract start": lambda: index.retract([1, 2, 3], "gpu0", value),  # type: ignore[arg-type]
    }
    with pytest.raises((InvalidTypeError, InvalidEventError, ConfigurationError)):
        actions[call]()
    index._check()
    assert (index.hashes("gpu0"), index.match([1, 2, 3], ["gpu0"])) == before
