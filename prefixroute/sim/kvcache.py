"""A vLLM-like KV block pool with an automatic prefix cache, counted in blocks (no tensors).

vLLM's semantics, which this class keeps:

- memory is a fixed number of blocks of ``block_size`` tokens, shared by running requests and the prefix cache;
- only a **full** block is cached, under its chained hash (one hash names the whole prefix up to it);
- a request reuses only the contiguous leading blocks of its prompt that are cached;
- a block referenced by a running request is pinned; a cached block nobody references is *free but cached*;
- free blocks, cached or not, wait in one queue in the order they were freed (blocks never used come first), and
  an allocation takes the blocks at its head, evicting those that were cached: a block freed long ago is evicted
  even when blocks freed since, holding nothing anyone can hit (a request's partial last block), are free;
- a request frees its blocks in reverse order, so a prompt's tail is evicted before its head.

A request's blocks are either *hashed* (in the cache, possibly shared with other requests) or *private* (a partial
block, a block being filled, or a full block whose hash another block already holds). Private blocks are counted,
not named.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from typing import Protocol

from prefixroute._numbers import as_int, shown
from prefixroute.errors import ConfigurationError, InvalidTypeError
from prefixroute.index import _not_a_sequence, leading_run

__all__ = ["BlockCache", "CacheListener"]


class _Empty:
    """A freed private block in the free queue: reusing it evicts nothing."""

    __slots__ = ()


class CacheListener(Protocol):
    """Receives what vLLM publishes as KV events: block hashes newly cached, and cached blocks evicted."""

    def stored(self, hashes: list[int], parent: int | None) -> None:
        """``hashes`` (consecutive blocks of one prompt, in order) are now cached, continuing block ``parent``.

        ``parent`` is the hash of the block before the first of them (None: they start at block 0), as in vLLM's
        ``BlockStored`` event.
        """

    def removed(self, hashes: list[int]) -> None:
        """``hashes`` were evicted."""


class BlockCache:
    """Count KV blocks in use, free, and free-but-cached, evicting cached blocks nobody references, oldest freed first.

    ``capacity_blocks=None`` makes the pool unbounded (nothing is ever evicted). Every method is O(blocks it
    touches). ``_check()`` asserts the invariants; tests call it after every simulator step. A method given what it
    cannot use (a hash that is no int, a block it does not hold, more blocks than the request has) raises
    :class:`~prefixroute.InvalidTypeError` or :class:`~prefixroute.ConfigurationError` and changes nothing; the
    simulated engine, whose calls keep those rules, calls each O(n) method's unchecked twin (``_commit``, ...).

    >>> cache = BlockCache(capacity_blocks=4)
    >>> cache.allocate(2)                  # a new request's two private blocks
    True
    >>> held = []
    >>> cache.commit([11, 12], held)       # both became full: cache them under their hashes
    2
    >>> cache.release(held, private=0)  # the request finished: blocks stay cached, unreferenced
    >>> cache.match([11, 12, 13])
    2
    >>> cache.allocate(3)                  # needs one more block than is empty: evicts the tail (12) first
    True
    >>> cache.match([11, 12])
    1
    """

    __slots__ = ("_capacity", "_free_private", "_free_queue", "_private", "_refs", "evictions", "listener")

    def __init__(self, capacity_blocks: int | None) -> None:
        if capacity_blocks is not None:
            count = as_int(capacity_blocks)
            if count is None or count < 1:
                raise ConfigurationError(
                    f"capacity_blocks must be a positive int or None, not {shown(capacity_blocks)}"
                )
            capacity_blocks = count
        self._capacity = capacity_blocks
        self._refs: dict[int, int] = {}  # every cached block hash -> requests referencing it (0: free, in _free_queue)
        # vLLM's free block queue, least recently freed first: unreferenced cached blocks (their hash) and freed
        # private blocks (an _Empty each); blocks never used are not listed and are taken before any of them
        self._free_queue: OrderedDict[int | _Empty, None] = OrderedDict()
        self._free_private = 0  # _Empty entries in _free_queue
        self._private = 0  # blocks owned by one request each, not in the cache
        self.evictions = 0
        self.listener: CacheListener | None = None  # told of blocks cached and evicted, as vLLM's KV events do

    @property
    def capacity(self) -> int | None:
        """Blocks in the pool, or None when unbounded."""
        return self._capacity

    @property
    def used_blocks(self) -> int:
        """Blocks referenced by running requests (pinned). O(1)."""
        return len(self._refs) - (len(self._free_queue) - self._free_private) + self._private

    @property
    def cached_blocks(self) -> int:
        """Blocks that hold a cached prefix, referenced or not. O(1)."""
        return len(self._refs)

    @property
    def occupied_blocks(self) -> int:
        """Blocks holding anything: pinned plus free-but-cached. Never above the capacity. O(1)."""
        return len(self._refs) + self._private

    def available(self) -> int | None:
        """Blocks an allocation could get now (empty plus evictable), or None when unbounded. O(1)."""
        if self._capacity is None:
            return None
        return self._capacity - self.used_blocks

    def holds(self, block_hash: int) -> bool:
        """Whether ``block_hash`` is cached. O(1)."""
        if type(block_hash) is not int:
            _check_hash(block_hash)
        return block_hash in self._refs

    def match(self, hashes: Sequence[int], *, limit: int | None = None) -> int:
        """Return how many leading blocks of ``hashes`` (at most ``limit``) are cached. O(log n).

        A binary search: the cache is *prefix-closed* (a cached block's parent is cached: requests hold whole
        prefixes and free them tail first, so eviction takes children before parents), which makes "block k is
        cached" true for a leading run of k and false after it. ``_check()`` and the tests verify the property.
        """
        if type(hashes) is not list and _not_a_sequence(hashes):
            raise InvalidTypeError(f"hashes must be a sequence of block hashes, not {type(hashes).__name__}")
        if limit is not None and (type(limit) is not int or limit < 0):
            count = as_int(limit)
            if count is None or count < 0:
                raise ConfigurationError(f"limit must be None or a count of blocks >= 0, not {shown(limit)}")
            limit = count
        return leading_run(self._refs, hashes, limit)

    def unreferenced(self, hashes: Sequence[int]) -> int:
        """Return how many of ``hashes`` (all cached) are free-but-cached: taking them uses up that many. O(n)."""
        _check_cached(self._refs, hashes, "unreferenced")
        return self._unreferenced(hashes)

    def _unreferenced(self, hashes: Sequence[int]) -> int:
        """:meth:`unreferenced` unchecked: the simulated engine's own calls."""
        refs = self._refs
        return sum(1 for h in hashes if refs[h] == 0)

    def acquire(self, hashes: Sequence[int]) -> None:
        """Reference cached blocks (a request's prefix hit); unreferenced ones leave the free queue. O(n)."""
        _check_cached(self._refs, hashes, "acquire")
        self._acquire(hashes)

    def _acquire(self, hashes: Sequence[int]) -> None:
        """:meth:`acquire` unchecked: the simulated engine's own calls."""
        refs, free_queue = self._refs, self._free_queue
        for h in hashes:
            count = refs[h]
            if count == 0:
                del free_queue[h]
            refs[h] = count + 1

    def allocate(self, blocks: int) -> bool:
        """Give a request ``blocks`` new private blocks, evicting the least recently freed cached blocks if needed.

        Returns False, changing nothing, when fewer than ``blocks`` are available. O(evicted).
        """
        if type(blocks) is not int:
            count = as_int(blocks)
            if count is None:
                raise ConfigurationError(f"blocks must be a count of blocks (an int), not {shown(blocks)}")
            blocks = count
        if blocks <= 0:
            return True
        capacity = self._capacity
        if capacity is not None:
            if capacity - self.used_blocks < blocks:
                return False
            taken = len(self._refs) + self._private + self._free_private + blocks - capacity  # beyond unused ones
            if taken > 0:
                refs, free_queue = self._refs, self._free_queue
                victims: list[int] = []
                for _ in range(taken):
                    block = free_queue.popitem(last=False)[0]
                    if isinstance(block, _Empty):
                        self._free_private -= 1
                    else:
                        del refs[block]
                        victims.append(block)
                if victims:
                    self.evictions += len(victims)
                    if self.listener is not None:
                        self.listener.removed(victims)
        self._private += blocks
        return True

    def commit(self, hashes: Sequence[int], held: list[int]) -> int:
        """A request's next private blocks became full: cache them under ``hashes``, appending each to ``held``.

        A block whose hash is already cached (another request computed the same prefix meanwhile) stays a private
        duplicate, as in vLLM, but the request also references the cached copy, which is what vLLM's hash table
        finds for that prefix while the duplicate lives. So a request always holds a whole prefix. Returns how
        many private blocks became cached. O(n).
        """
        refs = self._refs
        if not isinstance(held, list):
            raise InvalidTypeError(f"held must be the request's list of hashed blocks, not {type(held).__name__}")
        new = _uncached(refs, hashes, "commit")
        for h in new:
            if type(h) is not int:
                _check_hash(h)
        if len(new) > self._private:
            raise ConfigurationError(
                f"commit() caches a request's private blocks: {len(new)} new hashes, but only {self._private} "
                "private blocks are allocated (allocate() them first)"
            )
        return self._commit(hashes, held)

    def _commit(self, hashes: Sequence[int], held: list[int]) -> int:
        """:meth:`commit` unchecked: the simulated engine's own calls."""
        refs, free_queue = self._refs, self._free_queue
        committed = 0
        listener = self.listener
        stored: list[int] = []
        parent = held[-1] if held else None  # the block the chain continues: ``held`` is a whole prefix
        run_parent: int | None = None
        for h in hashes:
            count = refs.get(h)
            if count is None:
                refs[h] = 1
                committed += 1
                if listener is not None:
                    if not stored:
                        run_parent = parent
                    stored.append(h)
            else:
                if count == 0:
                    del free_queue[h]
                refs[h] = count + 1
                if stored and listener is not None:
                    listener.stored(stored, run_parent)  # one event per run of newly cached blocks, as vLLM
                    stored = []
            held.append(h)
            parent = h
        self._private -= committed
        if stored and listener is not None:
            listener.stored(stored, run_parent)
        return committed

    def release(self, hashed: Sequence[int], *, private: int) -> None:
        """Drop a request's references: its hashed blocks (in prompt order) and ``private`` private blocks.

        Blocks are freed tail first, so the queue evicts a prompt's last blocks before its first; the private ones
        (the partial last block, blocks being filled, output blocks) come last in a request's block table, so they
        are freed first. O(n).
        """
        refs = self._refs
        count = as_int(private)
        if count is None or not 0 <= count <= self._private:
            raise ConfigurationError(
                f"private must be a count of the request's private blocks, 0 to the {self._private} allocated, "
                f"not {shown(private)}"
            )
        private = count
        if _not_a_sequence(hashed):
            raise InvalidTypeError(f"hashed must be a sequence of block hashes, not {type(hashed).__name__}")
        try:
            counts = list(map(refs.get, hashed))  # None: not cached; 0: cached, held by no request
            listed_twice = len(set(hashed)) != len(counts)  # never for a request's own blocks (a chain)
        except TypeError:
            raise InvalidTypeError("hashed must hold block hashes (ints)") from None
        if None in counts or 0 in counts or listed_twice:
            needed = Counter(hashed)
            unheld = next((h for h, n in needed.items() if refs.get(h, 0) < n), None)
            if unheld is not None:
                raise ConfigurationError(f"release() of block {shown(unheld)}, which no request holds that often")
        self._release(hashed, private)

    def _release(self, hashed: Sequence[int], private: int) -> None:
        """:meth:`release` unchecked: the simulated engine's own calls."""
        refs, free_queue = self._refs, self._free_queue
        if self._capacity is not None and private > 0:
            for _ in range(private):
                free_queue[_Empty()] = None
            self._free_private += private
        for h in reversed(hashed):
            count = refs[h]
            if count == 1:
                refs[h] = 0
                free_queue[h] = None
            else:
                refs[h] = count - 1
        self._private -= private

    def _check(self) -> None:
        """Assert the invariants: capacity respected, free queue == unreferenced cached blocks, counts non-negative."""
        assert self._private >= 0, f"negative private block count {self._private}"
        assert all(count >= 0 for count in self._refs.values()), "negative reference count"
        free = {h for h, count in self._refs.items() if count == 0}
        assert free == {h for h in self._free_queue if not isinstance(h, _Empty)}, (
            "free queue differs from the unreferenced cached blocks"
        )
        freed_private = sum(isinstance(h, _Empty) for h in self._free_queue)
        assert self._free_private == freed_private, "miscounted freed private blocks"
        if self._capacity is not None:
            assert self.occupied_blocks + self._free_private <= self._capacity, (
                f"{self.occupied_blocks} blocks occupied and {self._free_private} freed, capacity {self._capacity}"
            )

    def __repr__(self) -> str:
        return (
            f"BlockCache(capacity_blocks={self._capacity}, used={self.used_blocks}, "
            f"cached={self.cached_blocks}, free_cached={len(self._free_queue) - self._free_private})"
        )


def _check_hash(block_hash: object) -> None:
    count = as_int(block_hash)
    if count is None or not 0 <= count < 2**64:
        raise InvalidTypeError(f"a block hash is an int in [0, 2**64), not {shown(block_hash)}")


def _uncached(refs: dict[int, int], hashes: Iterable[int], method: str) -> set[int]:
    """The distinct ``hashes`` not cached, checking that ``hashes`` is a sequence of hashable values. O(n)."""
    if _not_a_sequence(hashes):
        raise InvalidTypeError(f"{method}() takes a sequence of block hashes, not {type(hashes).__name__}")
    try:
        return {h for h in hashes if h not in refs}
    except TypeError:
        raise InvalidTypeError(f"{method}() takes block hashes (ints)") from None


def _check_cached(refs: dict[int, int], hashes: Iterable[int], method: str) -> None:
    uncached = _uncached(refs, hashes, method)
    if uncached:
        raise ConfigurationError(
            f"{method}() takes cached blocks only: {shown(next(iter(uncached)))} is not cached (see match())"
        )
