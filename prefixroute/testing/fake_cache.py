"""The block store of a fake vLLM engine: 16-token blocks, chained hashes of its own, LRU eviction of free blocks.

It behaves as vLLM's prefix cache does where the KV events are concerned: a request hits the longest cached prefix
of full blocks short of its last token (vLLM computes that token, so a prompt cached whole recomputes its last full
block), computes and caches the rest (one ``BlockStored`` event naming the new blocks and their parent),
and when it finishes frees its blocks tail first into an LRU queue of evictable blocks. Making room evicts from the
head of that queue (one ``BlockRemoved`` per physical block). A request scheduled concurrently with an identical
one (``share=False``) computes its own physical copies, so one hash can be stored, and removed, twice.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal

import xxhash

from prefixroute._numbers import as_int, check_flag, shown
from prefixroute.errors import ConfigurationError, InvalidTypeError, StateError
from prefixroute.hashing import BlockHasher, _decode_tokens, check_block_size, encode_tokens, namespace_seed
from prefixroute.vllm.events import AllBlocksCleared, BlockRemoved, BlockStored, Event, ExternalBlockHash
from prefixroute.vllm.tracker import lora_namespace

__all__ = ["CachedChain", "FakeBlockCache", "FakeRequest"]


def _check_lora_name(lora_name: object) -> None:
    """Raise ConfigurationError unless ``lora_name`` is None (the base model) or a non-empty str. O(1)."""
    if lora_name is not None and (not isinstance(lora_name, str) or not lora_name):
        raise ConfigurationError(
            f"lora_name must be None or an adapter's name (a str, not empty), not {shown(lora_name)}"
        )


@dataclass(frozen=True)
class CachedChain:
    """A cached block as the prompt prefix it ends: every token from the prompt's start through this block."""

    tokens: tuple[int, ...]
    lora_name: str | None = None


@dataclass
class FakeRequest:
    """A request holding blocks (until :meth:`FakeBlockCache.free`)."""

    prompt_tokens: int
    cached_tokens: int
    block_ids: list[int] = field(default_factory=list)
    # The cache that allocated it: block ids count from 0 in every cache, so they alone cannot tell another's.
    _cache: FakeBlockCache | None = field(default=None, init=False, repr=False, compare=False)


@dataclass
class _Block:
    block_hash: ExternalBlockHash
    chain: CachedChain
    refs: int = 1


class FakeBlockCache:
    """An engine's KV block store with capacity ``num_blocks`` and vLLM-like events (see the module docstring).

    ``hash_format`` chooses how block hashes travel: ``"int"`` (uint64) or ``"bytes"`` (32 bytes). The chain seed
    comes from ``rng``, so each engine (and each restart) names blocks differently, as vLLM does.

    Raises:
        ConfigurationError: ``block_size`` or ``num_blocks`` is not a positive int, ``hash_format`` not a format,
            ``extra_group`` not a bool.
        TypeError: ``rng`` is not a ``random.Random``.
    """

    def __init__(
        self,
        *,
        block_size: int = 16,
        num_blocks: int = 1024,
        rng: random.Random,
        hash_format: Literal["int", "bytes"] = "int",
        extra_group: bool = False,
    ) -> None:
        counts = {}
        for name, value in (("block_size", block_size), ("num_blocks", num_blocks)):
            count = as_int(value)
            if count is None or count < 1:
                raise ConfigurationError(f"{name} must be a positive int, not {shown(value)}")
            counts[name] = count
        block_size, num_blocks = counts["block_size"], counts["num_blocks"]
        if not isinstance(rng, random.Random):
            raise InvalidTypeError(f"rng must be a random.Random, not {type(rng).__name__}")
        if not isinstance(hash_format, str) or hash_format not in ("int", "bytes"):
            raise ConfigurationError(f"hash_format must be 'int' or 'bytes', not {shown(hash_format)}")
        check_flag(extra_group, "extra_group")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.hash_format = hash_format
        self.extra_group = extra_group
        self._rng = rng
        self._seed = rng.getrandbits(64)
        self._blocks: dict[int, _Block] = {}
        self._by_hash: dict[ExternalBlockHash, list[int]] = {}
        self._free: OrderedDict[int, None] = OrderedDict()  # evictable blocks, least recently freed first
        self._next_id = 0
        self.events: list[Event] = []
        self.queries = 0  # prompt tokens seen
        self.hits = 0  # prompt tokens served from the cache

    @property
    def used_blocks(self) -> int:
        """Physical blocks allocated (held by requests or cached and free)."""
        return len(self._blocks)

    def usage(self) -> float:
        """Fraction of blocks held by running requests (vLLM's ``kv_cache_usage_perc``)."""
        return (len(self._blocks) - len(self._free)) / self.num_blocks

    def take_events(self) -> list[Event]:
        """Return and forget the events generated since the last call."""
        events, self.events = self.events, []
        return events

    def chains(self) -> list[CachedChain]:
        """Return the cache's true contents: one chain per distinct cached block hash."""
        return [self._blocks[ids[0]].chain for ids in self._by_hash.values()]

    def own_hashes(self, *, block_size: int = 16, namespace: str | bytes | None = None) -> set[int]:
        """Return the true contents as prefixroute hashes (what an exact index must hold).

        Raises:
            ConfigurationError: ``block_size`` is not an int in [1, MAX_BLOCK_SIZE] (an empty cache too).
            TypeError: ``namespace`` is not a str, bytes or None (as :class:`~prefixroute.BlockHasher` refuses it).
        """
        check_block_size(block_size)
        namespace_seed(namespace)  # its type checked, as the hasher checks it, though no block may need a hasher
        result: set[int] = set()
        for chain in self.chains():
            space = lora_namespace(namespace, chain.lora_name)
            hashes = BlockHasher(block_size, namespace=space).hash(list(chain.tokens))
            per_block = self.block_size // block_size
            result.update(hashes[-per_block:])
        return result

    def allocate(self, prompt: list[int], *, lora_name: str | None = None, share: bool = True) -> FakeRequest:
        """Schedule a request: hit the cached prefix, cache its other full blocks (evicting as needed).

        Raises:
            ConfigurationError: ``share`` is not a bool, or ``lora_name`` not None nor an adapter's name (a str that
                is not empty); nothing changes.
            InvalidTypeError, InvalidPromptError: ``prompt`` is not token ids, as :func:`~prefixroute.encode_tokens`
                reads them (a list, tuple, array or numpy array of ints in [0, 2**32)); nothing changes.
        """
        check_flag(share, "share")
        _check_lora_name(lora_name)
        data = encode_tokens(prompt)
        prompt = _decode_tokens(data)
        size = self.block_size
        full = len(prompt) // size
        hashes = self._hashes(data[: 4 * full * size], lora_name)
        request = FakeRequest(prompt_tokens=len(prompt), cached_tokens=0)
        request._cache = self
        hit = 0
        if share:
            # As vLLM's get_computed_blocks: at most all but the last token hit, so a prompt cached whole computes
            # (and caches anew, a second physical copy of one hash) its last full block, whose logits it needs.
            most = (len(prompt) - 1) // size
            while hit < most and hashes[hit] in self._by_hash:
                block_id = self._by_hash[hashes[hit]][0]
                self._blocks[block_id].refs += 1
                self._free.pop(block_id, None)
                request.block_ids.append(block_id)
                hit += 1
        request.cached_tokens = hit * size
        self.queries += len(prompt)
        self.hits += request.cached_tokens
        new = min(full - hit, self._make_room(full - hit))
        if new:
            for i in range(hit, hit + new):
                block_id = self._next_id
                self._next_id += 1
                chain = CachedChain(tuple(prompt[: (i + 1) * size]), lora_name)
                self._blocks[block_id] = _Block(hashes[i], chain)
                self._by_hash.setdefault(hashes[i], []).append(block_id)
                request.block_ids.append(block_id)
            parent = hashes[hit - 1] if hit else None
            tokens = prompt[hit * size : (hit + new) * size]
            self.events.append(
                BlockStored(
                    list(hashes[hit : hit + new]),
                    parent,
                    tokens,
                    size,
                    lora_name=lora_name,
                    medium="GPU",
                    # As vLLM names each block's extra hash keys: a LoRA request's adapter name in every block.
                    extra_keys=[(lora_name,) if lora_name else None for _ in range(new)],
                    group_idx=0,
                    kv_cache_spec_kind="full_attention",
                )
            )
            if self.extra_group:  # a sliding-window group: its events must not reach the index
                self.events.append(
                    BlockStored(
                        list(hashes[hit : hit + new]),
                        parent,
                        tokens,
                        size,
                        medium="GPU",
                        group_idx=1,
                        kv_cache_spec_kind="sliding_window",
                    )
                )
        return request

    def free(self, request: FakeRequest) -> None:
        """Finish a request: release its blocks tail first, so its tail is evicted first. A second free does nothing.

        Raises:
            InvalidTypeError: ``request`` is not a :class:`FakeRequest`.
            ConfigurationError: ``request`` holds blocks this cache did not give it (another cache's; nothing changes).
        """
        if not isinstance(request, FakeRequest):
            raise InvalidTypeError(f"request must be a FakeRequest from allocate(), not {type(request).__name__}")
        held = [self._blocks.get(block_id) for block_id in request.block_ids]
        if held and request._cache is not self or any(block is None or block.refs < 1 for block in held):
            raise ConfigurationError("request holds blocks this cache did not allocate: free it on its own cache")
        for block_id in reversed(request.block_ids):
            block = self._blocks[block_id]
            block.refs -= 1
            if block.refs == 0:
                self._free[block_id] = None
        request.block_ids.clear()

    def clear(self) -> None:
        """Drop every free cached block and announce it as vLLM's ``reset_prefix_cache`` does.

        Raises:
            StateError: requests are running (vLLM only resets an idle prefix cache): free them first.
        """
        if len(self._blocks) != len(self._free):
            raise StateError("clear() with requests running: vLLM only resets an idle prefix cache; free them first")
        for block_id in list(self._free):
            self._drop(block_id, announce=False)
        self.events.append(AllBlocksCleared())

    def reset(self) -> None:
        """Forget everything silently and change the hash seed (the process restarted)."""
        self._seed = self._rng.getrandbits(64)
        self._blocks.clear()
        self._by_hash.clear()
        self._free.clear()
        self.events.clear()
        self.queries = self.hits = 0

    def _make_room(self, wanted: int) -> int:
        """Evict free blocks until ``wanted`` fit (or nothing more can go); return how many fit."""
        while len(self._blocks) + wanted > self.num_blocks and self._free:
            self._drop(next(iter(self._free)), announce=True)
        return max(0, min(wanted, self.num_blocks - len(self._blocks)))

    def _drop(self, block_id: int, *, announce: bool) -> None:
        del self._free[block_id]
        block = self._blocks.pop(block_id)
        holders = self._by_hash[block.block_hash]
        holders.remove(block_id)
        if not holders:
            del self._by_hash[block.block_hash]
        if announce:
            self.events.append(BlockRemoved([block.block_hash], medium="GPU", group_idx=0))
            if self.extra_group:
                self.events.append(BlockRemoved([block.block_hash], medium="GPU", group_idx=1))

    def _hashes(self, data: bytes, lora_name: str | None) -> list[ExternalBlockHash]:
        """The chained block hashes of ``data`` (whole blocks of uint32 token ids, as encode_tokens packs them)."""
        step = 4 * self.block_size
        parent = self._seed ^ (xxhash.xxh3_64_intdigest(lora_name.encode()) if lora_name else 0)
        result: list[ExternalBlockHash] = []
        for start in range(0, len(data), step):
            parent = xxhash.xxh3_64_intdigest(data[start : start + step], seed=parent ^ 0x9E3779B97F4A7C15)
            if self.hash_format == "bytes":
                result.append(xxhash.xxh3_128_digest(parent.to_bytes(8, "big")) * 2)
            else:
                result.append(parent)
        return result
