"""Rules of vLLM's KV-event wire format that test_events.py leaves open: each pins one documented rule."""

from __future__ import annotations

import re

import msgspec
import pytest

from prefixroute.errors import InvalidEventError
from prefixroute.vllm.events import BlockRemoved, BlockStored, EventBatch, EventDecoder, encode_batch


@pytest.mark.parametrize(("extra_keys", "first_byte"), [(14, 0xDE), (1 << 16, 0xDF)], ids=["map16", "map32"])
def test_a_map_batch_of_many_keys_and_an_unknown_event_still_decodes(extra_keys: int, first_byte: int) -> None:
    # msgpack writes a map of 16 entries or more as map16 (0xde), of 65536 or more as map32 (0xdf): still the map form
    # of a batch, whose unknown keys are ignored, decoded event by event here because of the event type it does not
    # know.
    batch: dict[str, object] = {"ts": 4.0}
    batch["events"] = [{"type": "BlockMigrated"}, {"type": "BlockRemoved", "block_hashes": [7]}]
    batch.update({f"future_{i}": i for i in range(extra_keys)})
    payload = msgspec.msgpack.encode(batch)
    assert payload[0] == first_byte
    decoded = EventDecoder().decode(payload)
    assert (decoded.ts, decoded.data_parallel_rank) == (4.0, None)
    assert [(type(e).__name__, e.block_hashes) for e in decoded.events] == [("_MapBlockRemoved", [7])]  # type: ignore[union-attr]


def test_an_empty_map_is_read_as_a_batch_missing_its_ts() -> None:
    with pytest.raises(InvalidEventError, match=re.escape("not an EventBatch [ts, events, data_parallel_rank]: ")):
        EventDecoder().decode(msgspec.msgpack.encode({}))
    with pytest.raises(InvalidEventError, match="missing required field `ts`"):
        EventDecoder().decode(msgspec.msgpack.encode({}))


@pytest.mark.parametrize(
    ("events", "message"),
    [
        ([["AllBlocksCleared"], []], "KV event 1 is list, not a tagged array or a map with a 'type' key"),
        ([["AllBlocksCleared"], [None, [1]]], "KV event 1 has no event type tag (got None)"),
        ([["AllBlocksCleared"], {"block_hashes": [1]}], "KV event 1 has no event type tag (got None)"),
    ],
)
def test_an_event_without_a_tag_is_refused_naming_its_position(events: list[object], message: str) -> None:
    with pytest.raises(InvalidEventError, match="^" + re.escape(message) + "$"):
        EventDecoder().decode(msgspec.msgpack.encode([1.0, events]))


@pytest.mark.parametrize(("payload", "name"), [("[1.0, []]", "str"), (None, "NoneType"), ([1], "list")])
def test_a_payload_of_the_wrong_type_is_refused_naming_its_type(payload: object, name: str) -> None:
    with pytest.raises(TypeError, match=f"^payload must be bytes, not {name}$"):
        EventDecoder().decode(payload)  # type: ignore[arg-type]


def test_events_given_as_a_tuple_encode_and_anything_else_is_refused_naming_its_type() -> None:
    payload = encode_batch(EventBatch(1.0, (BlockRemoved([7]),)))  # type: ignore[arg-type]
    assert [e.block_hashes for e in EventDecoder().decode(payload).events] == [[7]]  # type: ignore[union-attr]
    with pytest.raises(TypeError, match="^EventBatch.events must be a list of events, not dict$"):
        encode_batch(EventBatch(1.0, {0: BlockRemoved([7])}))  # type: ignore[arg-type]


def test_a_field_msgpack_cannot_write_is_an_invalid_event_error() -> None:
    # A lone surrogate is no UTF-8 (a ValueError), an int past 2**64 no msgpack int (an OverflowError).
    stored = BlockStored([1], None, [1, 2], 2, medium="\ud800")
    with pytest.raises(InvalidEventError, match="the batch cannot be encoded as vLLM's msgpack"):
        encode_batch(EventBatch(1.0, [stored]))
    with pytest.raises(InvalidEventError, match="the batch cannot be encoded as vLLM's msgpack"):
        encode_batch(EventBatch(1.0, [BlockRemoved([2**64])]), encoding="map")
