"""Decoding vLLM's EventBatch payloads in both encodings, and rejecting malformed ones clearly."""

from __future__ import annotations

import re
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixroute.errors import ConfigurationError, InvalidEventError
from prefixroute.vllm.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventDecoder,
    encode_batch,
)

hashes = st.one_of(st.integers(0, 2**64 - 1), st.binary(min_size=1, max_size=32))
maybe_text = st.one_of(st.none(), st.text(max_size=8))


@st.composite
def stored(draw: Any) -> BlockStored:
    block_size = draw(st.sampled_from([1, 4, 16]))
    count = draw(st.integers(0, 4))
    return BlockStored(
        draw(st.lists(hashes, min_size=count, max_size=count)),
        draw(st.one_of(st.none(), hashes)),
        draw(st.lists(st.integers(0, 2**32 - 1), min_size=count * block_size, max_size=count * block_size)),
        block_size,
        lora_id=draw(st.one_of(st.none(), st.integers(0, 10))),
        medium=draw(maybe_text),
        lora_name=draw(maybe_text),
        group_idx=draw(st.one_of(st.none(), st.integers(0, 3))),
        kv_cache_spec_kind=draw(st.one_of(st.none(), st.sampled_from(["full_attention", "sliding_window"]))),
    )


events = st.one_of(
    stored(),
    st.builds(BlockRemoved, st.lists(hashes, max_size=4), medium=maybe_text, group_idx=st.none() | st.integers(0, 3)),
    st.just(AllBlocksCleared()),
)


def fields(event: object) -> tuple[str, dict[str, Any]]:
    base = next(c for c in type(event).__mro__ if c in (BlockStored, BlockRemoved, AllBlocksCleared))
    return base.__name__, msgspec.structs.asdict(event)  # type: ignore[arg-type]


@given(st.lists(events, max_size=6), st.sampled_from(["array", "map"]), st.none() | st.integers(0, 7))
def test_round_trip_in_both_encodings(batch_events: list[Any], encoding: str, rank: int | None) -> None:
    batch = EventBatch(1234.5, batch_events, rank)
    decoded = EventDecoder().decode(encode_batch(batch, encoding=encoding))  # type: ignore[arg-type]
    assert decoded.ts == 1234.5
    assert decoded.data_parallel_rank == rank
    assert [fields(e) for e in decoded.events] == [fields(e) for e in batch_events]


def test_one_decoder_follows_a_change_of_encoding() -> None:
    decoder = EventDecoder()
    batch = EventBatch(1.0, [BlockRemoved([1, 2])])
    for encoding in ["array", "map", "map", "array"]:
        assert fields(decoder.decode(encode_batch(batch, encoding=encoding)).events[0])[1]["block_hashes"] == [1, 2]  # type: ignore[arg-type]


def test_map_encoding_omits_defaults_and_tags_with_type() -> None:
    payload = encode_batch(EventBatch(1.0, [BlockRemoved([5])]), encoding="map")
    raw = msgspec.msgpack.decode(payload)
    assert raw[1] == [{"type": "BlockRemoved", "block_hashes": [5]}]


def test_array_encoding_puts_the_tag_first_and_fields_in_order() -> None:
    payload = encode_batch(EventBatch(1.0, [BlockStored([7], None, [1, 2], 2, lora_id=3)]), encoding="array")
    raw = msgspec.msgpack.decode(payload)
    assert raw[1][0][:6] == ["BlockStored", [7], None, [1, 2], 2, 3]


def test_events_decoded_in_one_encoding_are_written_in_the_one_asked_for() -> None:
    batch = EventBatch(1.0, [BlockStored([7], None, [1, 2], 2, lora_id=3), BlockRemoved([5]), AllBlocksCleared()])
    from_maps = EventDecoder().decode(encode_batch(batch, encoding="map"))
    raw = msgspec.msgpack.decode(encode_batch(from_maps, encoding="array"))
    stored, removed, cleared = raw[1]
    assert (stored[:6], removed[:2], cleared) == (["BlockStored", [7], None, [1, 2], 2, 3], ["BlockRemoved", [5]],
                                                  ["AllBlocksCleared"])  # fmt: skip
    from_arrays = EventDecoder().decode(encode_batch(batch, encoding="array"))
    raw = msgspec.msgpack.decode(encode_batch(from_arrays, encoding="map"))
    assert raw[1][1:] == [{"type": "BlockRemoved", "block_hashes": [5]}, {"type": "AllBlocksCleared"}]


def test_unknown_fields_and_unknown_event_types_are_ignored() -> None:
    payload = msgspec.msgpack.encode(
        [
            2.0,
            [
                ["BlockStored", [1], None, [9, 9], 2, None, "GPU", None, None, 0, "full_attention", None, "x", "y", 4],
                {"type": "BlockRemoved", "block_hashes": [b"\x01\x02"], "locality": "LOCAL", "future": {"a": 1}},
                {"type": "BlockMigrated", "block_hashes": [1]},
                ["BlockMigrated", [1]],
                ["AllBlocksCleared", "extra"],
            ],
            3,
        ]
    )
    batch = EventDecoder().decode(payload)
    assert [fields(e)[0] for e in batch.events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert batch.events[1].block_hashes == [b"\x01\x02"]  # type: ignore[union-attr]
    assert (batch.ts, batch.data_parallel_rank) == (2.0, 3)  # decoded event by event, the batch's figures kept


def test_a_batch_without_rank_decodes() -> None:
    batch = EventDecoder().decode(msgspec.msgpack.encode([1.0, [["AllBlocksCleared"]]]))
    assert batch.data_parallel_rank is None and isinstance(batch.events[0], AllBlocksCleared)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"\xc1", "not valid msgpack"),
        (msgspec.msgpack.encode({"ts": 1.0}), "not an EventBatch"),
        (msgspec.msgpack.encode([1.0, [["BlockStored", [1]]]]), "KV event 0 (BlockStored) is malformed"),
        (msgspec.msgpack.encode([1.0, [["BlockRemoved", "nope"]]]), "KV event 0 (BlockRemoved) is malformed"),
        (msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved"}]]), "block_hashes"),
        (msgspec.msgpack.encode([1.0, [5]]), "not a tagged array or a map"),
        (msgspec.msgpack.encode([1.0, [[3, 4]]]), "no event type tag"),
        (msgspec.msgpack.encode([1.0, [["BlockRemoved", [1.5]]]]), "malformed"),
        (b"\x93\xcb" + msgspec.msgpack.encode(1.0)[1:] + b"\x91" * 50_000 + b"\x00\xc0", "nests arrays or maps"),
    ],
)
def test_malformed_payloads_raise_invalid_event_error(payload: bytes, message: str) -> None:
    with pytest.raises(InvalidEventError, match=re.escape(message)):
        EventDecoder().decode(payload)


def test_encode_rejects_an_unknown_encoding() -> None:
    with pytest.raises(ConfigurationError, match="encoding must be 'array' or 'map'"):
        encode_batch(EventBatch(1.0, []), encoding="json")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("batch", "error", "message"),
    [
        ("not a batch", TypeError, "batch must be an EventBatch, not str"),
        (EventBatch(1.0, ["x"]), TypeError, "event 0 is of type str"),  # type: ignore[list-item]
        (EventBatch(1.0, [AllBlocksCleared(), 5]), TypeError, "event 1 is of type int"),  # type: ignore[list-item]
        (EventBatch(1.0, [BlockRemoved([2**70])]), InvalidEventError, "cannot be encoded"),
    ],
)
@pytest.mark.parametrize("encoding", ["array", "map"])
def test_encode_refuses_what_is_not_a_batch_of_events(
    batch: Any, error: type[Exception], message: str, encoding: str
) -> None:
    with pytest.raises(error, match=re.escape(message)):
        encode_batch(batch, encoding=encoding)  # type: ignore[arg-type]


# vLLM's own KV-event structs as vLLM >= 0.21 declares them (vllm/distributed/kv_events.py after vllm#42892): no
# array_like, so events travel as maps tagged under "type"; lora_id, medium and lora_name have no default, so they are
# always on the wire. The outer EventBatch is positional in the releases that switched the events (v0.26) and a map
# in vLLM's main branch since: both are what an engine sends.
class _VllmEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class _VllmBlockStored(_VllmEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _VllmBlockRemoved(_VllmEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class _VllmAllBlocksCleared(_VllmEvent, tag="AllBlocksCleared"):
    pass


class _VllmMapBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _VllmArrayBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


_SHA = bytes(range(32))  # a sha256 / sha256_cbor prefix-caching hash travels as 32 bytes


@pytest.mark.parametrize("batch_type", [_VllmMapBatch, _VllmArrayBatch])
@pytest.mark.parametrize("rank", [0, 3, None])
def test_the_bytes_current_vllm_publishes_decode(batch_type: type, rank: int | None) -> None:
    events = [
        _VllmBlockStored(
            [15760518052499183552, _SHA],
            None,
            list(range(32)),
            16,
            None,
            "GPU",
            None,
            extra_keys=[None, None],
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        ),  # fmt: skip
        _VllmBlockStored(
            [7],
            _SHA,
            list(range(16)),
            16,
            2,
            "GPU",
            "sql",
            group_idx=1,
            kv_cache_spec_kind="sliding_window",
            kv_cache_spec_sliding_window=4096,
        ),  # fmt: skip
        _VllmBlockRemoved([15760518052499183552], "GPU", group_idx=0),
        _VllmAllBlocksCleared(),
    ]
    payload = msgspec.msgpack.Encoder().encode(batch_type(1789095808.8378847, events, rank))
    decoder = EventDecoder()
    for _ in range(2):  # the decoder's fast path, once it has seen the encoding, reads the same
        batch = decoder.decode(payload)
        assert batch.ts == 1789095808.8378847 and batch.data_parallel_rank == rank
        assert [fields(e)[0] for e in batch.events] == ["BlockStored", "BlockStored", "BlockRemoved",
                                                         "AllBlocksCleared"]  # fmt: skip
        first, second, removed = batch.events[:3]
        assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
        assert first.block_hashes == [15760518052499183552, _SHA] and first.medium == "GPU"
        assert first.extra_keys == [None, None] and first.group_idx == 0
        assert second.parent_block_hash == _SHA and second.lora_name == "sql" and second.lora_id == 2
        assert second.kv_cache_spec_kind == "sliding_window" and second.kv_cache_spec_sliding_window == 4096
        assert isinstance(removed, BlockRemoved) and removed.block_hashes == [15760518052499183552]


def test_a_map_batch_with_an_unknown_event_type_skips_only_that_event() -> None:
    payload = msgspec.msgpack.encode(
        {"ts": 1.0, "events": [{"type": "BlockMigrated", "x": 1}, {"type": "BlockRemoved", "block_hashes": [4],
                                                                  "medium": None}], "extra": 5}
    )  # fmt: skip
    batch = EventDecoder().decode(payload)
    assert [fields(e)[0] for e in batch.events] == ["BlockRemoved"] and batch.data_parallel_rank is None
    # Keys a later vLLM may add are ignored however many there are: 15 in all is msgpack's largest fixmap, 16 a map16.
    for extra in (12, 13):
        keys = {"ts": 1.0, "events": [{"type": "BlockMigrated"}], "data_parallel_rank": 2}
        wide = msgspec.msgpack.encode(keys | {f"future{i}": i for i in range(extra)})
        assert wide[0] == (0x8F if extra == 12 else 0xDE)
        assert EventDecoder().decode(wide) == EventBatch(1.0, [], 2)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (msgspec.msgpack.encode({"events": []}), "not an EventBatch"),
        (msgspec.msgpack.encode({"ts": "x", "events": []}), "not an EventBatch"),
        (msgspec.msgpack.encode({"ts": 1.0, "events": [{"type": "BlockRemoved"}]}), "block_hashes"),
    ],
)
def test_malformed_map_batches_raise_invalid_event_error(payload: bytes, message: str) -> None:
    with pytest.raises(InvalidEventError, match=re.escape(message)):
        EventDecoder().decode(payload)
