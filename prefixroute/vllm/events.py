"""vLLM's KV-cache event wire format: decode (and encode) msgpack ``EventBatch`` payloads.

vLLM publishes, per scheduler step, ``EventBatch = [ts, events, data_parallel_rank]``: a msgpack array, or in newer
vLLM, whose ``EventBatch`` is no longer ``array_like``, a map ``{"ts": …, "events": […], "data_parallel_rank": …}``
(the rank omitted when None). Each event is one of
:class:`BlockStored`, :class:`BlockRemoved` or :class:`AllBlocksCleared`, in one of two encodings:

* **array** (older vLLM): ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, …]``, the tag
  first and the fields in declaration order; trailing fields may be missing (they take their defaults) and extra
  trailing fields are ignored;
* **map** (newer vLLM): ``{"type": "BlockStored", "block_hashes": […], …}``, omitting fields equal to their default;
  unknown keys are ignored.

Block hashes arrive as unsigned 64-bit ints or as ``bytes``; they are opaque here (only compared for equality).
Events of a type this module does not know are skipped, so a newer vLLM does not break an older prefixroute.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Literal, TypeAlias

import msgspec

from prefixroute._numbers import shown
from prefixroute.errors import ConfigurationError, InvalidEventError, InvalidTypeError

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "EventDecoder",
    "ExternalBlockHash",
    "KVCacheEvent",
    "encode_batch",
]

ExternalBlockHash: TypeAlias = int | bytes
"""vLLM's name for a block: an unsigned 64-bit int, or bytes (newer vLLM with a wider hash)."""

# Kinds of KV-cache group whose blocks hold a full prefix's attention state, so a prefix hit on them is a real
# prefill saving. Sliding-window, Mamba and other groups keep only part of the prefix and are not indexed.
FULL_ATTENTION_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class of the KV-cache events (the array encoding; ``Map*`` subclasses decode the map encoding)."""


class BlockStored(KVCacheEvent):
    """Full blocks entered the cache: ``token_ids`` holds ``len(block_hashes) * block_size`` tokens.

    ``parent_block_hash`` names the block before the first one (None when the first block starts the prompt).
    """

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks left the cache (one entry per physical block, so a hash stored twice is removed twice)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    """The engine dropped its whole prefix cache (``reset_prefix_cache``)."""


class _MapBlockStored(BlockStored, array_like=False, tag_field="type", tag="BlockStored"):
    """BlockStored in the map encoding."""


class _MapBlockRemoved(BlockRemoved, array_like=False, tag_field="type", tag="BlockRemoved"):
    """BlockRemoved in the map encoding."""


class _MapAllBlocksCleared(AllBlocksCleared, array_like=False, tag_field="type", tag="AllBlocksCleared"):
    """AllBlocksCleared in the map encoding."""


Event: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    """One published message: publish time (``time.time()`` on the engine), events, data-parallel rank."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


class _ArrayBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class _MapBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_MapBlockStored | _MapBlockRemoved | _MapAllBlocksCleared]
    data_parallel_rank: int | None = None


class _RawBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _MapMapBatch(msgspec.Struct, gc=False):
    """The batch itself as a map (newer vLLM), its events as maps."""

    ts: float
    events: list[_MapBlockStored | _MapBlockRemoved | _MapAllBlocksCleared]
    data_parallel_rank: int | None = None


class _RawMapBatch(msgspec.Struct, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_ArrayEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared
_MapEvent: TypeAlias = "_MapBlockStored | _MapBlockRemoved | _MapAllBlocksCleared"
_KNOWN_TAGS = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})


class EventDecoder:
    """Decode ``EventBatch`` payloads in either encoding, fastest for the encoding seen last.

    A whole batch is decoded by one typed msgspec decoder (C speed); only a batch that mixes encodings or holds an
    unknown event type falls back to decoding event by event. Not thread-safe: use one decoder per thread.

    >>> payload = encode_batch(EventBatch(1.0, [BlockRemoved([7])]), encoding="map")
    >>> [(type(e).__name__, e.block_hashes) for e in EventDecoder().decode(payload).events]
    [('_MapBlockRemoved', [7])]
    """

    __slots__ = ("_array_event", "_generic", "_map_event", "_raw", "_raw_map", "_typed")

    def __init__(self) -> None:
        # One typed decoder per whole-batch encoding, the one that last succeeded first.
        self._typed: list[msgspec.msgpack.Decoder[Any]] = [
            msgspec.msgpack.Decoder(_ArrayBatch),
            msgspec.msgpack.Decoder(_MapBatch),
            msgspec.msgpack.Decoder(_MapMapBatch),
        ]
        self._raw = msgspec.msgpack.Decoder(_RawBatch)
        self._raw_map = msgspec.msgpack.Decoder(_RawMapBatch)
        self._array_event = msgspec.msgpack.Decoder(BlockStored | BlockRemoved | AllBlocksCleared)
        self._map_event = msgspec.msgpack.Decoder(_MapBlockStored | _MapBlockRemoved | _MapAllBlocksCleared)
        self._generic = msgspec.msgpack.Decoder()

    def decode(self, payload: bytes) -> EventBatch:
        """Return the batch in ``payload``; O(size of payload).

        Raises:
            InvalidEventError: the payload is not msgpack, not an ``[ts, events, rank]`` array (or a map with those
                keys), nests arrays or maps too deeply to decode, holds an event whose type tag is not a str, or
                holds a known event with a missing or mistyped field (the message says which).
            InvalidTypeError: ``payload`` is not bytes, a bytearray or a memoryview.
        """
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise InvalidTypeError(f"payload must be bytes, not {type(payload).__name__}")
        try:
            return self._decode(payload)
        except RecursionError:
            raise InvalidEventError("KV event payload nests arrays or maps too deeply to be an event batch") from None

    def _decode(self, payload: bytes) -> EventBatch:
        typed = self._typed
        for position, decoder in enumerate(typed):
            try:
                batch: Any = decoder.decode(payload)
            except msgspec.ValidationError:  # a subclass of DecodeError: another encoding, or a mixed batch
                continue
            except msgspec.DecodeError as exc:
                raise InvalidEventError(f"KV event payload is not valid msgpack: {exc}") from exc
            if position:
                typed.insert(0, typed.pop(position))
            return EventBatch(batch.ts, batch.events, batch.data_parallel_rank)
        return self._decode_mixed(payload)

    def _decode_mixed(self, payload: bytes) -> EventBatch:
        raw: _RawBatch | _RawMapBatch
        try:
            raw = (
                self._raw_map.decode(payload)
                if payload[:1] and _is_msgpack_map(payload[0])
                else self._raw.decode(payload)
            )
        except msgspec.ValidationError as exc:
            raise InvalidEventError(
                f"KV event payload is not an EventBatch [ts, events, data_parallel_rank]: {exc}"
            ) from exc
        except msgspec.DecodeError as exc:  # truncated after what made the typed decoders give up
            raise InvalidEventError(f"KV event payload is not valid msgpack: {exc}") from exc
        events: list[Event] = []
        for position, item in enumerate(raw.events):
            event = self._decode_event(item, position)
            if event is not None:
                events.append(event)
        return EventBatch(raw.ts, events, raw.data_parallel_rank)

    def _decode_event(self, item: msgspec.Raw, position: int) -> Event | None:
        generic = self._generic.decode(item)
        if isinstance(generic, dict):
            tag, decoder = generic.get("type"), self._map_event
        elif isinstance(generic, list) and generic:
            tag, decoder = generic[0], self._array_event
        else:
            raise InvalidEventError(
                f"KV event {position} is {type(generic).__name__}, not a tagged array or a map with a 'type' key"
            )
        if not isinstance(tag, str):  # checked first: a list or map tag is unhashable, no set member
            raise InvalidEventError(f"KV event {position} has no event type tag (got {shown(tag)})")
        if tag not in _KNOWN_TAGS:
            return None  # an event type from a newer vLLM: skipped, as documented
        try:
            event: Event = decoder.decode(item)
        except msgspec.ValidationError as exc:
            raise InvalidEventError(f"KV event {position} ({tag}) is malformed: {exc}") from exc
        return event


def _is_msgpack_map(first_byte: int) -> bool:
    """Whether a msgpack value starting with ``first_byte`` is a map (fixmap, map16 or map32)."""
    return 0x80 <= first_byte <= 0x8F or first_byte in (0xDE, 0xDF)


def encode_batch(batch: EventBatch, *, encoding: Literal["array", "map"] = "array") -> bytes:
    """Encode ``batch`` as vLLM does: events as tagged arrays (older vLLM) or as maps with a ``"type"`` key.

    The map encoding omits fields equal to their default, as newer vLLM does. The batch itself is an array
    ``[ts, events, data_parallel_rank]`` in both, as vLLM sends it.

    Raises:
        ConfigurationError: ``encoding`` is neither ``"array"`` nor ``"map"``.
        TypeError: ``batch`` is not an :class:`EventBatch`, or one of its events is not a :class:`BlockStored`,
            :class:`BlockRemoved` or :class:`AllBlocksCleared`.
        InvalidEventError: a field cannot be encoded, such as an int outside msgpack's ``[-2**63, 2**64)``.
    """
    if not isinstance(batch, EventBatch):
        raise InvalidTypeError(f"batch must be an EventBatch, not {type(batch).__name__}")
    if not isinstance(encoding, str) or encoding not in ("array", "map"):  # an array's == is no bool
        raise ConfigurationError(f"encoding must be 'array' or 'map', not {shown(encoding)}")
    if not isinstance(batch.events, (list, tuple)):
        raise InvalidTypeError(f"EventBatch.events must be a list of events, not {type(batch.events).__name__}")
    for position, event in enumerate(batch.events):
        if not isinstance(event, (BlockStored, BlockRemoved, AllBlocksCleared)):
            raise InvalidTypeError(
                f"event {position} is of type {type(event).__name__}, not a BlockStored, BlockRemoved or "
                "AllBlocksCleared"
            )
    convert = _as_array if encoding == "array" else _as_map
    events: list[Any] = [convert(event) for event in batch.events]
    try:
        return msgspec.msgpack.encode([batch.ts, events, batch.data_parallel_rank])
    except (OverflowError, TypeError, ValueError) as exc:
        raise InvalidEventError(f"the batch cannot be encoded as vLLM's msgpack: {exc}") from exc


def _as_array(event: Event) -> Event:
    if type(event) in (_MapBlockStored, _MapBlockRemoved, _MapAllBlocksCleared):
        return _convert(event, _MAP_TO_ARRAY)
    return event


def _as_map(event: Event) -> Event:
    if type(event) in (BlockStored, BlockRemoved, AllBlocksCleared):
        return _convert(event, _ARRAY_TO_MAP)
    return event


def _convert(event: Event, table: Mapping[type, type]) -> Event:
    target = table[type(event)]
    result: Event = target(**{name: getattr(event, name) for name in event.__struct_fields__})
    return result


_ARRAY_TO_MAP: Mapping[type, type] = MappingProxyType(
    {
        BlockStored: _MapBlockStored,
        BlockRemoved: _MapBlockRemoved,
        AllBlocksCleared: _MapAllBlocksCleared,
    }
)
_MAP_TO_ARRAY: Mapping[type, type] = MappingProxyType({value: key for key, value in _ARRAY_TO_MAP.items()})
