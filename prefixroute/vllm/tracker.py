"""One backend's KV events → exact :class:`~prefixroute.PrefixIndex` updates, by re-hashing the events' tokens.

vLLM names blocks with its own hashes (seeded per process, so they change when the engine restarts). The tracker
re-hashes every stored block's ``token_ids`` with prefixroute's :class:`~prefixroute.BlockHasher`, continuing the
chain from the parent block's *own* hash, so the index holds exactly the hashes :meth:`Router.route` computes for a
prompt. It keeps the map vLLM hash → own hashes for removals and reference-counts both (vLLM may hold two physical
copies of one block and then removes the same hash twice).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, TypeAlias

import cachetools

from prefixroute._numbers import as_int, shown
from prefixroute.errors import InvalidEventError, InvalidPromptError, InvalidTypeError
from prefixroute.hashing import BlockHasher, encode_tokens
from prefixroute.index import IndexUpdate
from prefixroute.vllm._checks import sparse_level
from prefixroute.vllm.events import (
    FULL_ATTENTION_KINDS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVCacheEvent,
)

__all__ = ["BlockTracker", "IndexOps", "IndexUpdate", "IndexWriter", "TrackerStats", "lora_namespace"]

_log = logging.getLogger(__name__)

IndexOps: TypeAlias = list[IndexUpdate]
"""Index updates in the order they must be applied."""


def lora_namespace(namespace: str | bytes | None, lora_name: str | None) -> str | bytes | None:
    """Return the hashing namespace of a request under LoRA adapter ``lora_name`` (None: the base model).

    ``"model:adapter"`` when both are set (bytes when ``namespace`` is bytes). Route a LoRA request with
    ``router.route(..., namespace=...)`` set to this value so its hashes agree with the ones the subscriber indexes.

    >>> lora_namespace("llama", "sql"), lora_namespace(None, "sql"), lora_namespace(b"llama", "sql")
    ('llama:sql', 'sql', b'llama:sql')

    Raises:
        TypeError: ``namespace`` is not a str, bytes or None, or ``lora_name`` not a str or None.
    """
    if namespace is not None and not isinstance(namespace, (str, bytes)):
        raise InvalidTypeError(f"namespace must be a str, bytes or None, not {type(namespace).__name__}")
    if lora_name is not None and not isinstance(lora_name, str):
        raise InvalidTypeError(f"lora_name must be the adapter's name (a str) or None, not {type(lora_name).__name__}")
    if lora_name is None:
        return namespace
    if namespace is None:
        return lora_name
    if isinstance(namespace, bytes):  # as a str namespace is hashed (any str, a lone surrogate too)
        return namespace + b":" + lora_name.encode("utf-8", "surrogatepass")
    return f"{namespace}:{lora_name}"


@dataclass
class TrackerStats:
    """Counters of what a :class:`BlockTracker` did with the events it saw.

    Each block of a valid ``BlockStored`` is counted once: stored, orphaned or skipped; each block of a valid
    ``BlockRemoved`` once: removed, unknown or skipped.
    """

    blocks_stored: int = 0
    """Stored blocks indexed (a second copy of a block held counts again)."""
    blocks_removed: int = 0
    """Removed blocks the tracker held (one copy each)."""
    clears: int = 0
    """``AllBlocksCleared`` events."""
    orphan_blocks: int = 0
    """Stored blocks not indexed because their parent is unknown (stored before the tracker started, lost, or not
    indexed itself)."""
    unknown_removals: int = 0
    """Removed blocks the tracker did not hold (orphans, blocks not indexed, or ones it never heard of)."""
    skipped_blocks: int = 0
    """Blocks of other media, of groups not indexed, of an adapter named only by id, and stored blocks from the
    first one with extra keys on (stored and removed both count)."""
    invalid_events: int = 0
    """Events :meth:`BlockTracker.apply` skipped as invalid."""


class BlockTracker:
    """Turn one backend's KV events into index updates (pure logic: no sockets, no threads, no locks).

    ``block_size`` is prefixroute's block size; vLLM's must be a multiple of it (each vLLM block then maps to
    ``vllm_block_size // block_size`` own blocks). ``namespace`` seeds the chains of requests without a LoRA adapter.

    Kept: blocks on the GPU (``medium`` None or ``"GPU"``) in full-attention groups (``kv_cache_spec_kind`` None or
    a full-attention kind). Skipped: other media and groups, LoRA blocks whose adapter has no ``lora_name`` (older
    vLLM sends only its ``lora_id``), blocks carrying ``extra_keys`` (multimodal inputs or a cache salt, which token
    ids alone do not name; extra keys that only name the block's LoRA adapter, as vLLM sends for every LoRA block,
    are covered by the adapter's namespace) and every block whose parent is unknown (stored before this tracker
    started and never replayed): a prompt could not reach them through a contiguous prefix anyway.

    >>> tracker = BlockTracker(block_size=2)
    >>> ops = tracker.apply([BlockStored([0xA, 0xB], None, [1, 2, 3, 4], 2)])
    >>> [(stored, len(hashes), parent) for stored, hashes, parent in ops]
    [(True, 2, None)]
    >>> tracker.held() == set(BlockHasher(2).hash([1, 2, 3, 4]))
    True
    """

    __slots__ = ("_block_size", "_hashers", "_namespace", "_own", "_refs", "_skipped_groups", "stats")

    def __init__(self, *, block_size: int = 16, namespace: str | bytes | None = None) -> None:
        # Both validated here, not at the first BlockStored (which would fail in a subscriber's thread).
        self._block_size = BlockHasher(block_size, namespace=namespace).block_size
        self._namespace = namespace
        # One hasher per LoRA name, the most recent 256: an engine sends a name per adapter it serves, and a stream
        # naming ever new ones must not grow this without bound (a hasher is cheap to make again).
        self._hashers: cachetools.LRUCache[str | None, BlockHasher] = cachetools.LRUCache(maxsize=256)
        self._own: dict[ExternalBlockHash, _Entry] = {}
        self._refs: dict[int, int] = {}  # own hash -> live vLLM blocks naming it
        self._skipped_groups: set[int] = set()
        self.stats = TrackerStats()

    @property
    def block_size(self) -> int:
        """prefixroute's block size (the hasher's)."""
        return self._block_size

    def held(self) -> set[int]:
        """Return the own hashes the backend holds according to the events seen. O(blocks)."""
        return set(self._refs)

    def __len__(self) -> int:
        """Return the number of distinct own hashes held. O(1)."""
        return len(self._refs)

    def apply(self, events: Iterable[KVCacheEvent]) -> IndexOps:
        """Update the tracker with ``events`` and return the index updates they imply, in order.

        O(tokens stored + blocks removed). An invalid event (one that breaks vLLM's rules, or whose fields have the
        wrong types) is logged, counted in ``stats.invalid_events`` and skipped; the others still apply. Use
        :meth:`apply_strict` to raise instead.

        Raises:
            TypeError: ``events`` is not an iterable of :class:`BlockStored`, :class:`BlockRemoved` and
                :class:`AllBlocksCleared` (checked before any applies).
        """
        ops: IndexOps = []
        for event in _events(events):
            try:
                self._apply_one(event, _prepared(event, self._block_size), ops)
            except InvalidEventError as exc:
                self.stats.invalid_events += 1
                count = self.stats.invalid_events
                _log.log(sparse_level(count), "skipping a KV event (%d invalid so far): %s", count, exc)
        return ops

    def apply_strict(self, events: Iterable[KVCacheEvent]) -> IndexOps:
        """As :meth:`apply`, but raise :class:`InvalidEventError` if any event is invalid, before any applies.

        All or nothing: every event is checked first (a block whose parent the tracker does not know is not an error:
        such blocks are skipped, as by :meth:`apply`), so an error never leaves the tracker ahead of the index.

        Raises:
            InvalidEventError: an event breaks vLLM's rules or has a field of the wrong type (nothing applied).
            TypeError: as :meth:`apply`.
        """
        items = _events(events)
        prepared = [_prepared(event, self._block_size) for event in items]  # raises before anything changes
        ops: IndexOps = []
        for event, ready in zip(items, prepared, strict=True):
            self._apply_one(event, ready, ops)
        return ops

    def reset(self) -> IndexOps:
        """Forget every block (the engine restarted or cleared its cache); return the removals for the index."""
        held = list(self._refs)
        self._own.clear()
        self._refs.clear()
        self._skipped_groups.clear()
        return [(False, held, None)] if held else []

    def _apply_one(self, event: KVCacheEvent, ready: _Ready | None, ops: IndexOps) -> None:
        """Apply one event that :func:`_prepared` checked (``ready``: what it computed for an indexed store)."""
        if isinstance(event, BlockStored):
            self._store(event, ready, ops)
        elif isinstance(event, BlockRemoved):
            dead = self._remove(event)
            if dead:
                ops.append((False, dead, None))
        elif isinstance(event, AllBlocksCleared):
            self.stats.clears += 1
            ops.extend(self.reset())

    def _hasher(self, lora_name: str | None) -> BlockHasher:
        hasher = self._hashers.get(lora_name)
        if hasher is None:
            namespace = lora_namespace(self._namespace, lora_name)
            hasher = self._hashers[lora_name] = BlockHasher(self._block_size, namespace=namespace)
        return hasher

    def _store(self, event: BlockStored, ready: _Ready | None, ops: IndexOps) -> None:
        """Append the stores ``event`` implies: one per run of own hashes the backend did not hold yet, each with
        the own hash of the block it continues (a block held twice is stored once, so runs can have holes).
        ``ready`` is what :func:`_prepared` computed, None for blocks that are not indexed."""
        vllm_hashes = event.block_hashes
        if ready is None:
            # Only a group whose kind is not indexed: a block skipped for its adapter (a LoRA block named by its
            # lora_id alone) may share the full-attention group, whose removals must still apply.
            group_skipped = _is_gpu(event.medium) and not _full_attention(event.kv_cache_spec_kind)
            if event.group_idx is not None and group_skipped and len(self._skipped_groups) < _MAX_GROUPS:
                self._skipped_groups.add(event.group_idx)
            self.stats.skipped_blocks += len(vllm_hashes)
            return
        per_block, count, data = ready
        self.stats.skipped_blocks += len(vllm_hashes) - count
        own = self._own
        parent = event.parent_block_hash
        hasher = self._hasher(event.lora_name)
        if parent is None:
            seed = hasher.seed
            parent_own: int | None = None
        else:
            entry = own.get(parent)
            if entry is None:
                self.stats.orphan_blocks += count  # the rest were counted as skipped, each block once
                return
            seed = parent_own = entry.own[-1]
        chain = hasher.hash_encoded(data, seed)
        refs = self._refs
        born: list[int] = []  # the current run of newly held own hashes
        before = run_parent = parent_own  # the own hash just before the current position; the run's parent
        for i in range(count):
            vllm_hash = vllm_hashes[i]
            entry = own.get(vllm_hash)
            if entry is None:
                mine: tuple[int, ...] = tuple(chain[i * per_block : (i + 1) * per_block])
                own[vllm_hash] = _Entry(mine)
            else:
                mine = entry.own
                entry.copies += 1
            for h in mine:
                held = refs.get(h, 0)
                refs[h] = held + 1
                if not held:
                    if not born:
                        run_parent = before
                    born.append(h)
                elif born:
                    ops.append((True, born, run_parent))
                    born = []
                before = h
        if born:
            ops.append((True, born, run_parent))
        self.stats.blocks_stored += count

    def _remove(self, event: BlockRemoved) -> list[int]:
        if not _is_gpu(event.medium) or event.group_idx in self._skipped_groups:
            self.stats.skipped_blocks += len(event.block_hashes)
            return []
        own, refs = self._own, self._refs
        dead: list[int] = []
        for vllm_hash in event.block_hashes:
            entry = own.get(vllm_hash)
            if entry is None:
                self.stats.unknown_removals += 1
                continue
            entry.copies -= 1
            if not entry.copies:
                del own[vllm_hash]
            for h in entry.own:
                held = refs[h] - 1
                if held:
                    refs[h] = held
                else:
                    del refs[h]
                    dead.append(h)
            self.stats.blocks_removed += 1
        return dead


class _Entry:
    """What one vLLM hash stands for: its own hashes (one per prefixroute block) and its physical copies."""

    __slots__ = ("copies", "own")

    def __init__(self, own: tuple[int, ...]) -> None:
        self.own = own
        self.copies = 1


class IndexWriter(Protocol):
    """What a :class:`~prefixroute.vllm.KVEventSubscriber` writes to: a :class:`~prefixroute.Router` (its public,
    locked write path), or anything with these two members."""

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        ...

    def write(self, backend: str, updates: Iterable[IndexUpdate]) -> None:
        """Apply ``updates`` for ``backend`` in order, atomically for concurrent readers."""
        ...


def check_writer(writer: object) -> None:
    """Raise InvalidTypeError unless ``writer`` is an :class:`IndexWriter`: a callable ``write`` and an int
    ``block_size`` (checked when a subscriber or a rank merge is made, not at its first event)."""
    block_size = getattr(writer, "block_size", None)
    if not callable(getattr(writer, "write", None)) or as_int(block_size) is None:
        raise InvalidTypeError(
            f"writer must be an IndexWriter (a Router, a RankMerge, or anything with write(backend, updates) and an "
            f"int block_size), not {type(writer).__name__}"
        )


_Ready: TypeAlias = tuple[int, int, bytes]
"""What :func:`_prepared` computes for an indexed store: own blocks per vLLM block, vLLM blocks re-hashed, tokens."""


def _prepared(event: KVCacheEvent, block_size: int) -> _Ready | None:
    """Check ``event`` as the tracker reads it, changing nothing; for an indexed store, what storing it needs.

    Blocks that are not indexed are passed over before their block size is looked at (a Mamba group's, a CPU tier's
    may be one the router's does not divide, which only matters for blocks that are re-hashed).

    Raises:
        InvalidEventError: the event breaks vLLM's rules or has a field of the wrong type.
    """
    if isinstance(event, BlockRemoved):
        _check_removed(event)
    if not isinstance(event, BlockStored):
        return None
    _check_stored(event)
    if not _indexed(event):
        return None
    per_block = _sub_blocks(event.block_size, block_size)
    _check_token_count(event)
    count = _plain_prefix(event.extra_keys, len(event.block_hashes), event.lora_name, event.lora_id)
    return per_block, count, _encoded(event, count)


def _events(events: Iterable[KVCacheEvent]) -> list[KVCacheEvent]:
    """``events`` as a list, every item a known event; else TypeError (before any event applies)."""
    if isinstance(events, (str, bytes)):
        raise InvalidTypeError(f"events must be an iterable of KV events, not {type(events).__name__}")
    try:
        items = list(events)
    except TypeError:
        raise InvalidTypeError(f"events must be an iterable of KV events, not {type(events).__name__}") from None
    for position, event in enumerate(items):
        if not isinstance(event, (BlockStored, BlockRemoved, AllBlocksCleared)):
            raise InvalidTypeError(
                f"event {position} is of type {type(event).__name__}, not a BlockStored, BlockRemoved or "
                "AllBlocksCleared (EventDecoder.decode() gives those)"
            )
    return items


def _malformed(event: KVCacheEvent, field: str, expected: str, value: object) -> InvalidEventError:
    return InvalidEventError(
        f"{_kind(event)}.{field} must be {expected}, not {shown(value)}: build events with vLLM's field types, or "
        "decode them with EventDecoder, which checks them"
    )


def _kind(event: KVCacheEvent) -> str:
    return next(c.__name__ for c in type(event).__mro__ if c in (BlockStored, BlockRemoved, AllBlocksCleared))


def _is_hash(value: object) -> bool:
    kind = type(value)
    return kind is int or kind is bytes or (isinstance(value, (int, bytes)) and not isinstance(value, bool))


def _check_hashes(event: BlockStored | BlockRemoved, hashes: object) -> None:
    """A list of int or bytes hashes (what msgspec decodes always is: the check matters for hand-built events)."""
    if not isinstance(hashes, (list, tuple)):
        raise _malformed(event, "block_hashes", "a list of int or bytes hashes", hashes)
    if not _HASH_TYPES.issuperset(map(type, hashes)):  # at C speed; the loop only finds the culprit
        for value in hashes:
            if not _is_hash(value):
                raise _malformed(event, "block_hashes", "a list of int or bytes hashes", value)


_MAX_GROUPS = 1024
"""The KV cache groups not indexed that a tracker keeps (a model has a few; a hostile engine could name millions).
A removal in a group past these reads as one of blocks the tracker never held (``unknown_removals``), nothing worse."""
_HASH_TYPES = frozenset({int, bytes})
_OPTIONAL_STR = (str, type(None))


def _check_optional(event: KVCacheEvent, field: str, kind: type | tuple[type, ...], expected: str) -> None:
    value = getattr(event, field, None)
    if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
        raise _malformed(event, field, f"{expected} or None", value)


def _check_stored(event: BlockStored) -> None:
    """Raise InvalidEventError unless every field the tracker reads has vLLM's type (before anything changes)."""
    parent = event.parent_block_hash
    if (  # the fast path, taken by every decoded event: one expression, no calls per field
        type(event.block_hashes) is list
        and _HASH_TYPES.issuperset(map(type, event.block_hashes))
        and (parent is None or type(parent) is int or type(parent) is bytes)
        and type(event.token_ids) is list
        and type(event.block_size) is int
        and isinstance(event.medium, _OPTIONAL_STR)
        and isinstance(event.lora_name, _OPTIONAL_STR)
        and isinstance(event.kv_cache_spec_kind, _OPTIONAL_STR)
        and (event.lora_id is None or type(event.lora_id) is int)
        and (event.group_idx is None or type(event.group_idx) is int)
        and (event.extra_keys is None or type(event.extra_keys) is list)
    ):
        return
    _check_hashes(event, event.block_hashes)
    if parent is not None and not _is_hash(parent):
        raise _malformed(event, "parent_block_hash", "an int or bytes hash or None", parent)
    if not isinstance(event.token_ids, (list, tuple)):
        raise _malformed(event, "token_ids", "a list of token ids", event.token_ids)
    if not isinstance(event.block_size, int) or isinstance(event.block_size, bool):
        raise _malformed(event, "block_size", "an int", event.block_size)
    for field in ("medium", "lora_name", "kv_cache_spec_kind"):
        _check_optional(event, field, str, "a str")
    _check_optional(event, "lora_id", int, "an int")
    _check_optional(event, "group_idx", int, "an int")
    _check_optional(event, "extra_keys", (list, tuple), "a list")


def _check_removed(event: BlockRemoved) -> None:
    _check_hashes(event, event.block_hashes)
    _check_optional(event, "medium", str, "a str")
    _check_optional(event, "group_idx", int, "an int")


def _indexed(event: BlockStored) -> bool:
    """Whether the event's blocks are indexed: on the GPU, in a full-attention group, under a known adapter (vLLM
    before ``lora_name`` names a LoRA block's adapter by its ``lora_id`` alone, which gives no namespace to hash it
    in: hashed as the base model's, it would claim a cache the base model's prompts do not have). Others are skipped
    before their block size is looked at (a Mamba group's, a CPU tier's may be one the router's does not divide)."""
    named = event.lora_id is None or event.lora_name is not None
    return named and _is_gpu(event.medium) and _full_attention(event.kv_cache_spec_kind)


def _full_attention(kind: str | None) -> bool:
    """Whether a KV cache group of ``kind`` is indexed (None: vLLM before groups had kinds)."""
    return kind is None or kind in FULL_ATTENTION_KINDS


def _check_token_count(event: BlockStored) -> None:
    if len(event.token_ids) != len(event.block_hashes) * event.block_size:
        raise InvalidEventError(
            f"BlockStored carries {len(event.token_ids)} token ids for {len(event.block_hashes)} blocks of "
            f"{shown(event.block_size)} tokens; vLLM sends exactly the stored blocks' tokens"
        )


def _encoded(event: BlockStored, count: int) -> bytes:
    """The token ids of the event's first ``count`` blocks as the hasher reads them."""
    try:
        return encode_tokens(event.token_ids[: count * event.block_size])
    except InvalidPromptError as exc:
        raise InvalidEventError(f"BlockStored token ids must be ints in [0, 2**32): {exc}") from exc


def _is_gpu(medium: str | None) -> bool:
    return medium is None or medium.upper() == "GPU"


def _sub_blocks(vllm_block_size: int, block_size: int) -> int:
    if vllm_block_size <= 0:  # no engine has such blocks: the event is corrupt, no router setting would take it
        raise InvalidEventError(f"vLLM's block size {shown(vllm_block_size)} is not positive: the event is corrupt")
    if vllm_block_size % block_size:
        raise InvalidEventError(
            f"vLLM's block size {shown(vllm_block_size)} is not a positive multiple of prefixroute's block size "
            f"{block_size}: configure the router with block_size={vllm_block_size} (vLLM's --block-size)"
        )
    return vllm_block_size // block_size


def _plain_prefix(extra_keys: list[object] | None, count: int, lora_name: str | None, lora_id: int | None) -> int:
    """Return how many leading blocks carry no extra keys but the LoRA adapter's (the chain stops at the first that
    does: multimodal inputs, a cache salt, prompt embeddings). vLLM names a LoRA request's adapter in every block's
    extra keys; the hashing namespace already carries it."""
    if not extra_keys:
        return count
    adapter = {key for key in (lora_name, lora_id) if key is not None and not isinstance(key, bool)}
    for i, keys in enumerate(extra_keys[:count]):
        if keys is None or (isinstance(keys, (list, tuple)) and not keys):  # no truth test: an array has none
            continue
        if not (adapter and isinstance(keys, (list, tuple)) and len(keys) == 1 and _in(keys[0], adapter)):
            return i
    return count


def _in(key: object, adapter: set[str | int]) -> bool:
    """Whether ``key`` names the adapter: its name or id, or (newer vLLM's typed extra keys) a ``LoRAKey`` struct,
    ``{"type": "lora", "name": ...}``. Another unhashable key, such as a list, never does."""
    if type(key) is dict:
        name = key.get("name")
        return len(key) == 2 and key.get("type") == "lora" and type(name) is str and name in adapter
    try:
        return key in adapter and not isinstance(key, bool)
    except TypeError:
        return False
