"""Which backend (probably) holds which KV blocks: one set (or LRU) of block hashes per backend.

Because a block hash names its whole prefix (see :mod:`prefixroute.hashing`), a flat set of hashes per backend *is*
that backend's prefix trie: a backend holds the first *k* blocks of a prompt exactly when it holds hashes 0..k-1.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Collection, Container, Iterable, Mapping, Sequence
from itertools import repeat, starmap, takewhile

from prefixroute.errors import ConfigurationError

__all__ = ["IndexUpdate", "PrefixIndex"]

IndexUpdate = tuple[bool, Sequence[int], "int | None"]
"""One index update: ``(True, hashes, parent)`` stores a chain continuing block ``parent`` (None: from block 0),
``(False, hashes, None)`` removes blocks."""


class PrefixIndex:
    """Block hashes held per backend, with an LRU capacity in blocks that mirrors vLLM's ``num_gpu_blocks``.

    ``capacity_blocks`` is an int (the same for every backend), a mapping backend → int (backends not in it are
    unbounded), or None (unbounded). When a backend exceeds its capacity its least recently used blocks are evicted.
    :meth:`insert` touches a prompt's blocks leaf first, so a parent is always more recent than its children and
    eviction removes leaves first: what remains is still a set of whole prefixes, as in vLLM, which frees a
    request's blocks in reverse order. Recency is kept (in an ``OrderedDict``) only for backends with a capacity;
    an unbounded backend's blocks sit in a ``set``, half as costly to insert into, and a backend that gets a
    capacity later starts from an arbitrary order (and is walked block by block in :meth:`match` from then on).

    Not thread-safe by itself: :class:`~prefixroute.Router` serialises access with its lock.

    >>> index = PrefixIndex(capacity_blocks=3)
    >>> index.insert([11, 12, 13], "gpu0")
    >>> index.match([11, 12, 99], ["gpu0", "gpu1"])
    {'gpu0': 2, 'gpu1': 0}
    >>> index.insert([21, 22], "gpu0")          # over capacity: the oldest leaves, 13 then 12, go
    >>> sorted(index.hashes("gpu0"))
    [11, 21, 22]
    """

    __slots__ = ("_blocks", "_block_size", "_capacity", "_default_capacity", "_open")

    def __init__(self, block_size: int = 16, *, capacity_blocks: int | Mapping[str, int] | None = None) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ConfigurationError(f"block_size must be a positive int (vLLM's default is 16), not {block_size!r}")
        self._block_size = block_size
        self._blocks: dict[str, set[int] | OrderedDict[int, None]] = {}  # an LRU where a capacity applies
        self._capacity: dict[str, int] = {}
        self._default_capacity: int | None = None
        # Backends whose blocks may no longer be whole prefixes (after remove(), or after an LRU order was made
        # up), so match() walks them block by block instead of binary-searching.
        self._open: set[str] = set()
        if isinstance(capacity_blocks, Mapping):
            for backend, capacity in capacity_blocks.items():
                self.set_capacity(backend, capacity)
        elif capacity_blocks is not None:
            self._default_capacity = _check_capacity(capacity_blocks, "capacity_blocks")

    @property
    def block_size(self) -> int:
        """Tokens per block (the hasher's block size must agree)."""
        return self._block_size

    def capacity(self, backend: str) -> int | None:
        """Return ``backend``'s capacity in blocks, or None when unbounded. O(1)."""
        return self._capacity.get(backend, self._default_capacity)

    def set_capacity(self, backend: str, capacity_blocks: int | None) -> None:
        """Set one backend's capacity in blocks (None: unbounded), evicting its LRU blocks if it is over. O(evicted)."""
        if capacity_blocks is None:
            self._capacity.pop(backend, None)
            blocks = self._blocks.get(backend)
            if blocks is not None and self.capacity(backend) is None:
                self._blocks[backend] = set(blocks)  # unbounded: recency no longer kept
            return
        self._capacity[backend] = _check_capacity(capacity_blocks, f"capacity of {backend!r}")
        blocks = self._blocks.get(backend)
        if blocks is not None:
            if not isinstance(blocks, OrderedDict):
                # A set has no order, let alone "every parent more recent than its children": eviction may leave
                # holes.
                blocks = self._blocks[backend] = OrderedDict.fromkeys(blocks)
                self._open.add(backend)
            self._shrink(backend, blocks)
            if not blocks:
                del self._blocks[backend]
                self._open.discard(backend)

    def match(self, hashes: Sequence[int], backends: Iterable[str]) -> dict[str, int]:
        """Return, for each backend, how many leading blocks of ``hashes`` it holds, contiguous from block 0.

        O(B + H log n) for B backends, H of them holding block 0, and n blocks: a backend's blocks are whole
        prefixes (holding block *i* means holding blocks 0..i-1), so a binary search finds where its match ends.
        After :meth:`remove` has punched holes, that backend is walked block by block, O(matched blocks).
        Does not change recency.
        """
        result = dict.fromkeys(backends, 0)
        if not hashes:
            return result
        first = hashes[0]
        get = self._blocks.get
        walk = self._open
        for backend in result:
            blocks = get(backend)
            if blocks is not None and first in blocks:
                result[backend] = _leading(blocks, hashes) if backend in walk else _boundary(blocks, hashes)
        return result

    def predict(self, hashes: Sequence[int], backend: str, held: int) -> None:
        """Record a routing decision: the router sent a prompt with ``hashes`` to ``backend``, which held ``held``.

        The hook that decides what routing writes: this class inserts the prompt's blocks. O(len(hashes)).
        """
        blocks = self._blocks.get(backend)
        self._insert(hashes, backend, 0 if blocks is None else _leading(blocks, hashes))

    def match_confirmed(self, hashes: Sequence[int], backend: str) -> int | None:
        """How many leading blocks of ``hashes`` an exact source (KV events) confirms ``backend`` holds; None here."""
        return None

    def insert(self, hashes: Sequence[int], backend: str, *, parent: int | None = None) -> None:
        """Record that ``backend`` holds ``hashes`` and make them its most recent blocks.

        ``hashes`` is a chain from block 0, or one that continues a block the backend holds (as a KV event's stored
        blocks do): what a backend holds must stay whole prefixes.

        Touches the chain leaf first, so its root ends up most recent, then evicts down to capacity. Blocks after
        the first one the backend lacked that it already held keep their recency. O(len(hashes) + evicted).
        """
        blocks = self._blocks.get(backend)
        self._insert(hashes, backend, 0 if blocks is None else _leading(blocks, hashes))

    def _insert(self, hashes: Sequence[int], backend: str, held: int) -> None:
        """:meth:`insert` for a caller that knows the backend holds the first ``held`` blocks (the router does)."""
        blocks = self._blocks.get(backend)
        if blocks is None:
            blocks = self._blocks[backend] = set() if self.capacity(backend) is None else OrderedDict()
        if isinstance(blocks, set):
            blocks.update(hashes[held:])
        else:
            # C-level loops: append the new tail leaf first, then move the held prefix to the end, leaf first.
            blocks.update(zip(reversed(hashes[held:]), repeat(None)))
            deque(map(blocks.move_to_end, reversed(hashes[:held])), maxlen=0)
            self._shrink(backend, blocks)
            if not blocks:
                del self._blocks[backend]
                self._open.discard(backend)

    def remove(self, hashes: Iterable[int], backend: str) -> None:
        """Forget that ``backend`` holds ``hashes``; hashes it does not hold are ignored. O(len(hashes)).

        Removing a block but not its descendants leaves a hole; from then on :meth:`match` walks this backend.
        """
        blocks = self._blocks.get(backend)
        if blocks is None:
            return
        if isinstance(blocks, set):
            blocks.difference_update(hashes)
        else:
            for h in hashes:
                blocks.pop(h, None)
        self._open.add(backend)
        if not blocks:
            del self._blocks[backend]
            self._open.discard(backend)

    def remove_backend(self, backend: str) -> Collection[int]:
        """Forget every block of ``backend`` (its capacity, a setting, stays) and return them to be freed. O(1)."""
        return self._detach(backend)

    def _detach(self, backend: str) -> Collection[int]:
        """Forget ``backend``'s blocks and return them, for a caller that frees them outside its lock. O(1).

        Freeing a million blocks takes ~40 ms, which the :class:`~prefixroute.Router` keeps out of its lock.
        """
        self._open.discard(backend)
        return self._blocks.pop(backend, ())

    def holds(self, block_hash: int, backend: str) -> bool:
        """Return whether ``backend`` holds the block ``block_hash``. O(1)."""
        blocks = self._blocks.get(backend)
        return blocks is not None and block_hash in blocks

    def hashes(self, backend: str) -> set[int]:
        """Return every block hash ``backend`` holds. O(blocks of backend)."""
        return set(self._blocks.get(backend, ()))

    def blocks(self, backend: str) -> int:
        """Return how many blocks ``backend`` holds. O(1)."""
        blocks = self._blocks.get(backend)
        return 0 if blocks is None else len(blocks)

    def backends(self) -> list[str]:
        """Return the backends that hold at least one block, in first-insert order. O(B)."""
        return list(self._blocks)

    def clear(self) -> None:
        """Forget every block of every backend (capacities stay). O(entries), the time to free them."""
        self._blocks.clear()
        self._open.clear()

    def __len__(self) -> int:
        """Return the number of (block, backend) entries. O(B)."""
        return sum(map(len, self._blocks.values()))

    def __repr__(self) -> str:
        return f"PrefixIndex(block_size={self._block_size}, backends={len(self._blocks)}, entries={len(self)})"

    def _evict(self, backend: str, blocks: OrderedDict[int, None], count: int) -> None:
        """Evict ``count`` blocks from an over-capacity backend: its least recently used ones. O(count).

        The one hook subclasses override to change the eviction order (as cachetools' ``popitem``); ``blocks`` is
        the backend's LRU, least recent first.
        """
        deque(starmap(blocks.popitem, repeat((False,), count)), maxlen=0)

    def _shrink(self, backend: str, blocks: OrderedDict[int, None]) -> None:
        capacity = self._capacity.get(backend, self._default_capacity)
        if capacity is not None and len(blocks) > capacity:
            self._evict(backend, blocks, len(blocks) - capacity)

    def _check(self) -> None:
        """Assert every invariant of the index (for tests; O(entries))."""
        for backend, blocks in self._blocks.items():
            assert isinstance(backend, str), backend
            assert blocks, f"empty block set kept for {backend!r}"
            capacity = self.capacity(backend)
            assert capacity is None or len(blocks) <= capacity, (backend, len(blocks), capacity)
            assert isinstance(blocks, set if capacity is None else OrderedDict), (backend, type(blocks), capacity)
            for h in blocks:
                assert isinstance(h, int) and 0 <= h < 2**64, h
        for backend, capacity in self._capacity.items():
            assert isinstance(capacity, int) and capacity >= 0, (backend, capacity)


def _leading(blocks: Container[int], hashes: Sequence[int]) -> int:
    """How many leading ``hashes`` are in ``blocks``: takewhile over the C-level ``__contains__``, no Python loop."""
    return len(list(takewhile(blocks.__contains__, hashes)))


def _boundary(blocks: Container[int], hashes: Sequence[int]) -> int:
    """How many leading ``hashes`` are in ``blocks``, for a backend whose blocks are whole prefixes. O(log n)."""
    return len(hashes) if hashes[-1] in blocks else leading_run(blocks, hashes)


def leading_run(held: Container[int], hashes: Sequence[int], limit: int | None = None) -> int:
    """How many leading ``hashes`` (at most ``limit``) are in ``held``, by binary search. O(log n).

    Valid only when ``held`` is prefix-closed (holding a block means holding its parent), so that "block k is held"
    is true for a leading run and false after it. The simulator's vLLM cache uses it too.
    """
    low, high = 0, len(hashes) if limit is None else min(limit, len(hashes))
    while low < high:  # invariant: hashes[:low] held, hashes[high:] not
        middle = (low + high) // 2
        if hashes[middle] in held:
            low = middle + 1
        else:
            high = middle
    return low


def _check_capacity(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigurationError(f"{name} must be a non-negative int number of blocks or None, not {value!r}")
    return value
