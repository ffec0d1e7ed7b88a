"""Which backend (probably) holds which KV blocks: one store of block hashes per backend.

Because a block hash names its whole prefix (see :mod:`prefixroute.hashing`), a flat set of hashes per backend *is*
that backend's prefix trie: a backend holds the first *k* blocks of a prompt exactly when it holds hashes 0..k-1.
Each backend's blocks live in a store of one of two kinds, chosen by its capacity:

* :class:`UnboundedStore` (no capacity): one ``set``;
* :class:`LRUStore` (a capacity in blocks, as vLLM's ``num_gpu_blocks``): the same blocks split into generations
  of plain sets, newest last; a touched block moves to the newest one and eviction drops the oldest whole.

:class:`PrefixIndex` owns the stores and the accounting, and calls one hook, :meth:`PrefixIndex.evict`, when a
store is over its capacity (as cachetools' ``Cache`` calls ``popitem``). Internals and invariants:
``docs/internals.md``.
"""

from __future__ import annotations

import copy
import sys
from array import array
from collections.abc import Collection, Container, Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from itertools import chain, islice, takewhile

from prefixroute._arguments import check_backend_id
from prefixroute._numbers import as_int, shown
from prefixroute.errors import ConfigurationError, InvalidEventError, InvalidTypeError, PrefixRouteError
from prefixroute.hashing import check_block_size

__all__ = [
    "DEFAULT_BOUND_BLOCKS", "IndexUpdate", "LRUStore", "PrefixIndex", "UnboundedStore", "apply_updates", "check_update",
    "leading_run",
]  # fmt: skip

DEFAULT_BOUND_BLOCKS = 2**17
"""The ``bound_blocks`` of the index a :class:`~prefixroute.Router` builds: a backend whose KV capacity is not known
keeps at most 131,072 blocks of predictions (2,097,152 tokens at 16 a block, more than one GPU's KV cache holds;
~10-17 MB of index), so a gateway that never learns capacities does not grow without end."""

IndexUpdate = tuple[bool, Sequence[int], "int | None"]
"""One index update: ``(True, hashes, parent)`` stores a chain continuing block ``parent`` (None: from block 0),
``(False, hashes, None)`` removes blocks."""


class UnboundedStore:
    """One backend's blocks without a capacity: a ``set`` of block hashes, and the subset that are roots (block 0).

    Prefix-closed (a held block's parent is held) unless :meth:`discard` punched a hole; while it may hold such
    orphans, :meth:`match` walks block by block instead of binary-searching. Not thread-safe.
    """

    __slots__ = ("blocks", "roots", "_open")

    def __init__(self, blocks: Iterable[int] = (), *, roots: set[int] | None = None, open: bool = False) -> None:
        self.blocks: set[int] = set(blocks)
        self.roots: set[int] = set() if roots is None else roots  # block-0 hashes held: match()'s first probe
        self._open = open and bool(self.blocks)

    @property
    def size(self) -> int:
        """Blocks held. O(1)."""
        return len(self.blocks)

    @property
    def open(self) -> bool:
        """Whether the store may hold a block whose parent it lacks (after :meth:`discard`)."""
        return self._open

    def __len__(self) -> int:
        return len(self.blocks)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self.blocks

    def __iter__(self) -> Iterator[int]:
        return iter(self.blocks)

    def match(self, hashes: Sequence[int], guess: int = 0) -> int:
        """How many leading ``hashes`` the store holds. O(log n), or O(matched) while :attr:`open`.

        ``guess``: a likely answer (another backend's), tried first: two probes when right; when wrong, the search
        goes on in what they left.
        """
        if self._open:
            return _leading(self.blocks, hashes)
        blocks = self.blocks
        return len(hashes) if hashes[-1] in blocks else leading_run(blocks, hashes, guess=guess)

    def put(self, hashes: Sequence[int], parent: int | None, held: int = 0, *, checked: bool = False) -> bool:
        """Hold the chain ``hashes`` continuing block ``parent``; False (nothing stored) when ``parent`` is not held.

        ``held`` is a hint: how many leading blocks the caller believes are held; a wrong one costs one probe.
        O(len(hashes) - held). ``checked``: a chain that holds a block the store holds under another parent (see
        :meth:`LRUStore.put`) makes the store walk block by block from then on, as after a hole. O(n) more.
        """
        blocks = self.blocks
        if parent is not None and parent not in blocks:
            return False
        if checked and not self._open and not blocks.isdisjoint(hashes[_leading(blocks, hashes) :]):
            self._open = True
        if parent is not None:
            held = 0
        else:
            self.roots.add(hashes[0])
            if self._open or not 0 < held <= len(hashes) or hashes[held - 1] not in blocks or hashes[0] not in blocks:
                held = 0
        blocks.update(hashes[held:] if held else hashes)
        return True

    def discard(self, hashes: Collection[int]) -> int:
        """Forget ``hashes`` (those not held are ignored); return how many were held. O(len(hashes))."""
        before = len(self.blocks)
        self.blocks.difference_update(hashes)
        self.roots.difference_update(hashes)
        removed = before - len(self.blocks)
        self._open = bool(self.blocks) and (self._open or removed > 0)
        return removed

    def _check(self, capacity: int | None = None) -> None:
        assert capacity is None, capacity
        assert self.roots <= self.blocks, "a root that is not held"
        assert self.blocks or not self._open


class LRUStore:
    """One backend's blocks under a capacity: generations of plain sets, oldest first, with approximate LRU eviction.

    A routed prompt's blocks all move to the newest generation; a chain that continues a block (a KV event) joins
    its parent's generation; a new generation starts when the newest holds twice ``capacity // generations``
    blocks, or from half that when the next prompt would make its set grow its table (so generations stay densely
    packed: between ``generations / 2`` and ``2 * generations`` of them fill the capacity), or when the next prompt
    would take it past the capacity (so a prompt that fits outlives the blocks evicted for it); and
    :meth:`drop_oldest` evicts the oldest generations whole. The invariant that makes this safe: a held block's
    parent is held and in the same or a newer generation, so dropping the oldest generation never leaves a child
    without its parent, and the blocks of a prompt that one generation holds are a contiguous run, found by binary
    search. Compared with an exact LRU it keeps on average half a generation fewer blocks and orders
    blocks only to the generation; ``benchmarks/bench_route.py --bounded`` measures the hit-rate cost (Zipf prefix
    workload). Not thread-safe.

    Holes (a :meth:`discard` of a block whose children are held, or a capacity set on more blocks than it allows)
    make :meth:`match` walk block by block until every generation that existed then has been evicted.
    """

    __slots__ = ("roots", "size", "_capacity", "_first", "_gens", "_generations", "_open_until", "_span")

    def __init__(
        self,
        capacity: int,
        *,
        generations: int = 16,
        blocks: Iterable[int] = (),
        roots: set[int] | None = None,
        open: bool = False,
    ) -> None:
        generations = _check_generations(generations)
        self._generations = generations
        self._capacity = capacity
        self._span = max(1, capacity // generations)
        self._gens: list[set[int]] = [set(blocks)]  # oldest first; the last one is the newest
        self._first = 0  # the id of _gens[0]; ids only grow
        self.size = len(self._gens[0])
        if self.size:  # blocks without recency: the oldest generation, so new blocks never share its fate
            self._gens.append(set())
        self.roots: set[int] = set() if roots is None else roots
        self._open_until = 0 if open and self.size else -1  # open while a generation with id <= this is alive

    @property
    def open(self) -> bool:
        """Whether the store may hold a block whose parent it lacks (holes): :meth:`match` walks then."""
        return self._open_until >= self._first

    @property
    def generations(self) -> int:
        """How many generations a full store is split into (more: closer to exact LRU, slower misses)."""
        return self._generations

    def resize(self, capacity: int) -> None:
        """Size new generations for ``capacity`` (the caller evicts any excess). O(1)."""
        self._capacity = capacity
        self._span = max(1, capacity // self._generations)

    def __len__(self) -> int:
        return self.size

    def __contains__(self, block_hash: object) -> bool:
        return any(block_hash in gen for gen in self._gens)

    def __iter__(self) -> Iterator[int]:
        return chain.from_iterable(self._gens)

    def match(self, hashes: Sequence[int], guess: int = 0) -> int:
        """How many leading ``hashes`` the store holds. O(G + log n) for G generations; O(G + matched) if open.

        ``guess``: a likely answer (another backend's), tried first: two probes when right; when wrong, the search
        goes on in what they left.
        """
        if self.open:
            return self._segments(hashes, 0, None)
        count = len(hashes)
        position = 0
        for gen in reversed(self._gens):
            if hashes[position] in gen:
                position = _run(gen, hashes, position, guess)
                if position == count:
                    break
        return position

    def _segments(self, hashes: Sequence[int], position: int, into: set[int] | None) -> int:
        """Walk the held run of ``hashes`` from ``position`` in any generation order (a store with holes may hold a
        block in a newer generation than its parent); move what is found into ``into`` if given. O(G * runs + n)."""
        gens = self._gens
        count = len(hashes)
        while position < count:
            block = hashes[position]
            gen = next((gen for gen in reversed(gens) if block in gen), None)
            if gen is None:
                break
            end = _walk_run(gen, hashes, position)
            if into is not None and gen is not into:
                moved = hashes[position:end]
                left = len(gen)
                gen.difference_update(moved)
                into.update(moved)
                self.size -= left - len(gen)  # counted again as they join ``into``
            position = end
        return position

    def put(self, hashes: Sequence[int], parent: int | None, *, checked: bool = False) -> bool:
        """Hold the chain ``hashes`` continuing block ``parent``; False (nothing stored) when ``parent`` is not held.

        A chain from block 0 (``parent`` None) moves to the newest generation, its held blocks included; a
        continuation joins its parent's generation. O(G + len(hashes)) for G generations. ``checked`` first looks
        for a block the store holds under another parent (a chain no consistent hashing makes, so never the
        router's own, but a hostile or broken KV-event source can send one): the store then walks block by block
        (:attr:`open`) until every generation alive now has been evicted, so this chain leaves no block in two
        generations and :meth:`match` exact (docs/internals.md says what no store can see). O(G * len(hashes)) more.
        """
        gens = self._gens
        target = len(gens) - 1
        count = len(hashes)
        if parent is not None:
            while target >= 0 and parent not in gens[target]:
                target -= 1
            if target < 0:
                return False
        contradicts = checked and (self._misplaced_head(hashes[0], parent, target) or self._contradicts(hashes, target))
        if parent is None:
            self.roots.add(hashes[0])
            newest = gens[-1]
            # Start a new generation at twice the target size, or from half of it when this chain could make
            # CPython grow the set's table (x4 below 50K blocks, x2 above): as the window spans a factor of 4, every
            # generation ends near a 3/5-full table, not a 3/20-full one.
            # And whenever the chain would take the newest past the capacity: evicting down to the capacity drops
            # whole generations, oldest first, so a chain that fits must not share one with blocks it could outlive.
            if (
                len(newest) >= 2 * self._span
                or (newest and len(newest) + count > self._capacity)
                or (
                    len(newest) * 2 >= self._span
                    and count - (_run(newest, hashes, 0) if hashes[0] in newest else 0) > _room(newest)
                )
            ):
                gens.append(set())
                target += 1
        if contradicts:  # open (again, or longer) while any generation alive now lives, this chain's included
            self._open_until = self._first + len(gens) - 1
        into = gens[target]
        before = len(into)
        if self.open:
            position = self._segments(hashes, 0, into)
            if position < count:  # orphans of a hole may sit in other generations: this chain reaches them again
                new = hashes[position:]
                for gen in gens:
                    if gen is not into:
                        left = len(gen)
                        gen.difference_update(new)
                        self.size -= left - len(gen)
                into.update(new)
        else:
            position = _run(into, hashes, 0) if hashes[0] in into else 0
            # The held blocks in older generations: by the invariant, contiguous runs, newest generation first.
            for older in reversed(gens[:target]):
                if position == count:
                    break
                if hashes[position] in older:
                    end = _run(older, hashes, position)
                    moved = hashes[position:end]
                    left = len(older)
                    older.difference_update(moved)
                    into.update(moved)
                    self.size -= left - len(older)  # counted again as they join ``into``
                    position = end
            if position < count:
                into.update(hashes[position:])
        self.size += len(into) - before
        return True

    def _misplaced_head(self, head: int, parent: int | None, target: int) -> bool:
        """Whether the chain's first block may be held under another parent, which :meth:`_contradicts` (it trusts a
        leading run) cannot see: a held block that is no root sent as a root, a root sent as a continuation, or a
        continuation's first block held in a generation older than its parent's (``target``). Moved into the chain's
        generation, such a block could end up newer than its own parent, and the binary search of :meth:`match`
        count blocks the store lacks. The last case may be a consistent chain sent again: the store then walks for
        nothing until its generations are evicted, slower but exact (KV events store a block once). O(G)."""
        if parent is None:
            return head not in self.roots and head in self
        return head in self.roots or any(head in gen for gen in self._gens[:target])

    def _contradicts(self, hashes: Sequence[int], target: int) -> bool:
        """Whether a block of ``hashes`` is held but not in the chain's leading run (from generation ``target`` down,
        or anywhere while open), walked block by block since a contradicting store can fool a binary search.
        O(G * len(hashes)), in C."""
        gens = self._gens
        if self.open:  # the held run may be spread over generations in any order
            position = _leading(self, hashes)
        else:
            position = 0
            for gen in reversed(gens[: target + 1]):
                if position < len(hashes) and hashes[position] in gen:
                    position = _walk_run(gen, hashes, position)
        rest = hashes[position:]
        return bool(rest) and any(not gen.isdisjoint(rest) for gen in gens)

    def discard(self, hashes: Collection[int]) -> int:
        """Forget ``hashes`` (those not held are ignored); return how many were held. O(G * len(hashes))."""
        before = self.size
        for gen in self._gens:
            left = len(gen)
            gen.difference_update(hashes)
            self.size -= left - len(gen)
        self.roots.difference_update(hashes)
        removed = before - self.size
        if not self.size:
            self._open_until = -1
        elif removed:
            self._open_until = self._first + len(self._gens) - 1
        return removed

    def drop_oldest(self, count: int) -> int:
        """Evict whole generations, oldest first, until at least ``count`` blocks went; return how many did.

        Never orphans a block (children sit in the same or an older generation than their parent). O(1) per
        generation plus the time to free its blocks.
        """
        gens = self._gens
        roots = self.roots
        dropped = 0
        while dropped < count and self.size:
            oldest = gens.pop(0)
            self._first += 1
            if not gens:
                gens.append(set())
            dropped += len(oldest)
            self.size -= len(oldest)
            if roots:
                roots -= roots & oldest  # iterates the smaller of the two
        if not self.size:
            self._open_until = -1
        return dropped

    def generation_sizes(self) -> list[int]:
        """Blocks per generation, oldest first (for tests and metrics). O(G)."""
        return [len(gen) for gen in self._gens]

    def _check(self, capacity: int | None = None) -> None:
        gens = self._gens
        assert gens, "no current generation"
        assert self.size == sum(map(len, gens)), (self.size, [len(g) for g in gens])
        assert capacity is None or self.size <= capacity, (self.size, capacity)
        seen: set[int] = set()
        for gen in gens:
            assert seen.isdisjoint(gen), "a block in two generations"
            seen |= gen
        assert self.roots <= seen, "a root that is not held"
        assert self.size or not self.open


class PrefixIndex:
    """Block hashes held per backend, with an optional capacity in blocks that mirrors vLLM's ``num_gpu_blocks``.

    ``capacity_blocks`` is an int (the default for every backend), a mapping backend → int (the other backends have
    none), or None. ``bound_blocks`` keeps a backend whose capacity is not known to that many blocks all the same
    (least recently used first out), so an index of predictions cannot grow without end while no capacity is known;
    it is not a capacity (:meth:`capacity` stays None, and policies see none). Backend ids are non-empty str (an
    empty one is a :class:`~prefixroute.ConfigurationError`, as in the router). None (the default) leaves such a
    backend unbounded, as an index fed by KV events wants (the engine's removals bound it); :class:`~prefixroute.Router`
    gives its own index :data:`DEFAULT_BOUND_BLOCKS`. A backend without a capacity or a bound keeps an
    :class:`UnboundedStore`; one with either an :class:`LRUStore`, and when it is over that limit the index calls
    :meth:`evict`, the one hook a subclass overrides to change or observe eviction. A capacity can change at any time
    (:meth:`set_capacity`).

    Every store is *prefix-closed*: a held block's parent is held, as in vLLM, which frees a request's blocks in
    reverse order. :meth:`insert` skips (and counts in :attr:`orphan_inserts`) a chain whose parent block is not
    held, and :meth:`match` binary-searches whole prefixes. Only :meth:`remove` can punch holes; a store then walks
    block by block until the holes are gone (see ``docs/internals.md``).

    Not thread-safe by itself: :class:`~prefixroute.Router` serialises access with its lock. :func:`copy.copy`,
    :func:`copy.deepcopy` and :mod:`pickle` give an independent index.

    >>> index = PrefixIndex(capacity_blocks=1000)
    >>> index.insert([11, 12, 13], "gpu0")
    >>> index.insert([14, 15], "gpu0", parent=13)   # a KV event: a chain that continues block 13
    >>> index.insert([99], "gpu0", parent=98)       # its parent is not held: skipped and counted
    >>> index.match([11, 12, 13, 14, 77], ["gpu0", "gpu1"]), index.orphan_inserts
    ({'gpu0': 4, 'gpu1': 0}, 1)

    A subclass that observes eviction (the hook receives the store and how many blocks it is over):

    >>> class CountingIndex(PrefixIndex):
    ...     evicted = 0
    ...     def evict(self, backend: str, store: LRUStore, excess: int) -> int:
    ...         dropped = super().evict(backend, store, excess)
    ...         CountingIndex.evicted += dropped
    ...         return dropped
    >>> index = CountingIndex(capacity_blocks=32)
    >>> for root in range(8):
    ...     index.insert([1000 * root + i for i in range(8)], "gpu0")
    >>> index.blocks("gpu0") <= 32 < index.blocks("gpu0") + CountingIndex.evicted
    True
    """

    __slots__ = (
        "_block_size", "_bound", "_capacity", "_capacity_changes", "_default_capacity", "_orphans", "_roots", "_stores",
    )  # fmt: skip

    #: Generations of a new :class:`LRUStore` (a subclass may change it; checked when an index is made).
    generations: int = 16

    def __init__(
        self,
        block_size: int = 16,
        *,
        capacity_blocks: int | Mapping[str, int] | None = None,
        bound_blocks: int | None = None,
    ) -> None:
        self._block_size = check_block_size(block_size)
        _check_generations(self.generations)  # a subclass's: refused here, not by the first bounded store
        self._bound = None if bound_blocks is None else _check_capacity(bound_blocks, "bound_blocks")
        self._stores: dict[str, UnboundedStore | LRUStore] = {}
        self._roots: dict[str, set[int]] = {}  # each store's roots, so match() probes one small set per backend
        self._capacity: dict[str, int] = {}
        self._default_capacity: int | None = None
        self._capacity_changes = 0  # a Router caches capacities in its candidates' figures until this moves
        self._orphans = 0
        if isinstance(capacity_blocks, Mapping):
            for backend, capacity in capacity_blocks.items():
                self.set_capacity(backend, capacity)
        elif capacity_blocks is not None:
            self._default_capacity = _check_capacity(capacity_blocks, "capacity_blocks")

    @property
    def block_size(self) -> int:
        """Tokens per block (the hasher's block size must agree)."""
        return self._block_size

    @property
    def orphan_inserts(self) -> int:
        """How many chains :meth:`insert` skipped because the backend did not hold their parent block."""
        return self._orphans

    @property
    def bound_blocks(self) -> int | None:
        """The most blocks a backend without a known capacity keeps (None: no bound)."""
        return self._bound

    def capacity(self, backend: str) -> int | None:
        """Return ``backend``'s capacity in blocks: its own, else the index's default; None when not known. O(1).

        Raises:
            TypeError: ``backend`` is not a str.
        """
        backend = _check_backend(backend)
        return self._capacity.get(backend, self._default_capacity)

    def _limit(self, backend: str) -> int | None:
        """The most blocks ``backend``'s store keeps: its capacity, else the bound; None when unbounded."""
        capacity = self._capacity.get(backend, self._default_capacity)
        return self._bound if capacity is None else capacity

    def set_capacity(self, backend: str, capacity_blocks: int | None) -> None:
        """Set ``backend``'s capacity in blocks; None returns it to the index's default (if none, the bound, if any).

        Evicts down to the new capacity. A store that gains a capacity keeps its blocks as one generation (an
        unbounded store has no recency), so the fast match path stays on unless it held more than the capacity.
        O(1), or O(blocks) when the store changes kind.

        Raises:
            ConfigurationError: ``capacity_blocks`` is not a non-negative int or None.
            TypeError: ``backend`` is not a str.
        """
        backend = _check_backend(backend)
        self._capacity_changes += 1
        if capacity_blocks is None:
            self._capacity.pop(backend, None)
        else:
            self._capacity[backend] = _check_capacity(capacity_blocks, f"capacity of {backend!r}")
        store = self._stores.get(backend)
        if store is None:
            return
        capacity = self._limit(backend)
        if capacity is None:
            if isinstance(store, LRUStore):
                self._stores[backend] = UnboundedStore(store, roots=store.roots, open=store.open)
            return
        if isinstance(store, UnboundedStore):
            over = len(store) > capacity
            store = self._stores[backend] = LRUStore(
                capacity, generations=self.generations, blocks=store.blocks, roots=store.roots, open=store.open
            )
            if over:  # a set has no order: what goes is arbitrary and may leave holes
                store.discard(list(islice(store, len(store) - capacity)))
        store.resize(capacity)
        self._fit(backend, store, capacity)

    def match(self, hashes: Sequence[int], backends: Iterable[str]) -> dict[str, int]:
        """Return, for each backend, how many leading blocks of ``hashes`` (a prompt's, from block 0) it holds.

        O(B + H (G + log n)) for B backends, H of them holding block 0, G generations per bounded store and n
        blocks: a store's blocks are whole prefixes, so a binary search finds where its match ends (a store with
        holes walks, O(matched)). Does not change recency. The hashes and backend ids themselves are not checked (the
        router's hot path passes checked ones): one the index never took (a negative hash, a backend that is not a
        str) simply matches nothing.

        Raises:
            TypeError: ``backends`` is a single str or not an iterable of backend ids, or ``hashes`` is not a
                sequence.
        """
        if isinstance(backends, str):
            raise InvalidTypeError("backends must be an iterable of backend ids, not a single str: wrap it in a list")
        if type(hashes) is not list and _not_a_sequence(hashes):
            raise InvalidTypeError(
                f"hashes must be a sequence of block hashes (a prompt's, from block 0), not {type(hashes).__name__}"
            )
        try:
            result = dict.fromkeys(backends, 0)
        except (TypeError, NotImplementedError):  # not iterable (a 2-D memoryview: NotImplementedError), unhashable
            raise InvalidTypeError(
                f"backends must be an iterable of backend ids (str), not {shown(backends)}"
            ) from None
        if not hashes:
            return result
        first = hashes[0]
        roots = self._roots.get
        stores = self._stores
        guess = 0  # backends that hold a prefix tend to hold the same one (a system prompt): the last match first
        try:
            for backend in result:
                held = roots(backend)
                if held is not None and first in held:
                    result[backend] = guess = stores[backend].match(hashes, guess)
        except TypeError:  # an unhashable "hash" met a set
            raise InvalidTypeError(f"block hashes must be ints, as BlockHasher makes them: {shown(hashes)}") from None
        return result

    def predict(self, hashes: Sequence[int], backend: str, held: int) -> None:
        """Record a routing decision: the router sent a prompt with ``hashes`` to ``backend``, which held ``held``.

        The hook that decides what routing writes; this class inserts the prompt's blocks (from block 0) and makes
        them most recent, unless the prompt has more blocks than the backend keeps (its capacity, else the bound): an
        engine whose KV cache holds that many refuses it, and recording it would evict every block the backend holds,
        its own included.
        ``held`` (from :meth:`match`) saves a search; a stale value costs one. O(len(hashes)). The hashes are
        checked as :meth:`insert` checks them (a chain that contradicts the store included), except those a
        :class:`~prefixroute.Router` computed itself (its hot path, whose hashes come from its own hasher).

        Raises:
            TypeError: ``hashes`` is not a sequence of ints, ``backend`` not a str or ``held`` not an int (nothing
                is recorded).
            InvalidEventError: a hash is outside [0, 2**64) (nothing is recorded).
        """
        routed = type(hashes) is _RoutedHashes  # the router's own chains contradict no store: not looked for
        hashes, backend, held = _check_prediction(hashes, backend, held)
        if hashes:
            capacity = self._limit(backend)
            if capacity is None or len(hashes) <= capacity:
                self._put(hashes, backend, None, held, checked=not routed)

    def retract(self, hashes: Sequence[int], backend: str, start: int) -> None:
        """Undo a routing decision's :meth:`predict`: ``backend`` refused the prompt, so it never cached ``hashes``
        from block ``start`` on (:meth:`Router.finish <prefixroute.Router.finish>` with ``refused=True``).

        The hook that decides what a refusal forgets; this class keeps predictions and inserted blocks in one
        store, so it removes those blocks whichever wrote them (the router passes only blocks that its commit added
        and no request in flight shares). A block with a held child left behind is a hole, as after :meth:`remove`.
        O(G * len(hashes)): rare (a refusal), so its arguments are checked as :meth:`remove` checks them.

        Raises:
            TypeError: a hash is not an int, ``backend`` not a str, or ``start`` not an int (nothing is removed).
            InvalidEventError: a hash is outside [0, 2**64) (nothing is removed).
            ConfigurationError: ``start`` is negative (nothing is removed).
        """
        hashes, backend, start = _check_retraction(hashes, backend, start)
        store = self._stores.get(backend)
        if store is None or start >= len(hashes):
            return
        store.discard(hashes[start:])
        if not store.size:
            self._detach(backend)

    def match_confirmed(self, hashes: Sequence[int], backend: str) -> int | None:
        """How many leading blocks of ``hashes`` an exact source (KV events) confirms ``backend`` holds; None here.

        The hook an index fed by KV events overrides (:class:`prefixroute.vllm.EventIndex`). O(1) here.
        """
        return None

    def insert(self, hashes: Sequence[int], backend: str, *, parent: int | None = None) -> None:
        """Record that ``backend`` holds the chain ``hashes``, continuing block ``parent`` (None: from block 0).

        A chain from block 0 becomes the backend's most recent blocks; a continuation (a KV event's stored blocks)
        joins its parent's recency. A continuation whose parent the backend does not hold is skipped and counted
        (:attr:`orphan_inserts`): the engine could not reuse it through this index. O(len(hashes) + evicted).

        Raises:
            TypeError: a hash or ``parent`` is not an int, or ``backend`` is not a str (nothing is stored).
            InvalidEventError: a hash or ``parent`` is outside [0, 2**64) (nothing is stored).
        """
        _check_chain(hashes)
        hashes = _check_hashes(hashes)
        backend = _check_backend(backend)
        if parent is not None:
            block = as_int(parent)
            if block is None:
                raise InvalidTypeError(
                    f"parent must be a block hash, an int in [0, 2**64), or None, not {shown(parent)}"
                )
            if not 0 <= block < 2**64:
                raise InvalidEventError(
                    f"parent must be a block hash, an int in [0, 2**64), or None, not {shown(parent)}"
                )
            parent = block
        if hashes:
            self._put(hashes, backend, parent, 0, checked=True)

    def _put(
        self, hashes: Sequence[int], backend: str, parent: int | None, held: int, *, checked: bool = False
    ) -> None:
        store = self._stores.get(backend)
        fresh = store is None
        if store is None:
            if parent is not None:
                self._orphans += 1
                return
            capacity = self._limit(backend)
            store = UnboundedStore() if capacity is None else LRUStore(capacity, generations=self.generations)
        if isinstance(store, UnboundedStore):
            stored = store.put(hashes, parent, held, checked=checked)
        else:
            stored = store.put(hashes, parent, checked=checked)
        if fresh:  # kept once the chain is in: hashes that cannot be stored (unhashable) leave no empty store
            self._stores[backend] = store
            self._roots[backend] = store.roots
        if not stored:
            self._orphans += 1
            return
        capacity = self._limit(backend)
        if isinstance(store, LRUStore) and capacity is not None and store.size > capacity:
            self._fit(backend, store, capacity)

    def evict(self, backend: str, store: LRUStore, excess: int) -> int:
        """The eviction hook: ``backend``'s store is ``excess`` blocks over capacity; drop at least that many.

        Called by the index after an insert or a capacity change (cachetools' ``popitem`` pattern); a subclass
        overrides it to observe or change eviction, and must leave ``store`` prefix-closed (evict children before
        parents, as :meth:`LRUStore.drop_oldest` and :meth:`LRUStore.discard` of leaves do). Returns how many blocks
        went. This class drops the oldest generations: O(generations dropped) plus freeing their blocks. Whatever the
        hook does, the index then drops the oldest generations down to the capacity itself, also when it raises (the
        exception then propagates, after the insert that triggered it).
        """
        return store.drop_oldest(excess)

    def _fit(self, backend: str, store: LRUStore, capacity: int) -> None:
        try:
            if store.size > capacity:
                self.evict(backend, store, store.size - capacity)
        finally:  # a hook that did not do its job, or raised: the capacity is the index's to keep
            if store.size > capacity:
                store.drop_oldest(store.size - capacity)
            if not store.size:
                self._detach(backend)

    def remove(self, hashes: Iterable[int], backend: str) -> None:
        """Forget that ``backend`` holds ``hashes``; hashes it does not hold are ignored. O(G * len(hashes)).

        Removing a block but not its held descendants leaves a hole: :meth:`match` stops at it, and walks that
        backend block by block until the orphans are gone (an :class:`LRUStore` evicts them with the generations
        that held them; an :class:`UnboundedStore` stays walked until emptied).

        Raises:
            TypeError: a hash is not an int, or ``backend`` is not a str (nothing is removed).
            InvalidEventError: a hash is outside [0, 2**64) (nothing is removed).
        """
        hashes = _check_hashes(hashes)
        backend = _check_backend(backend)
        store = self._stores.get(backend)
        if store is None:
            return
        store.discard(hashes)
        if not store.size:
            self._detach(backend)

    def remove_backend(self, backend: str) -> Collection[int]:
        """Forget every block of ``backend`` (its capacity, a setting, stays); return its detached store. O(1).

        Freeing a million blocks takes ~40 ms: a caller holding a lock drops the returned store after releasing it.

        Raises:
            TypeError: ``backend`` is not a str.
        """
        return self._detach(_check_backend(backend))

    def _detach(self, backend: str) -> Collection[int]:
        self._roots.pop(backend, None)
        return self._stores.pop(backend, ())

    def holds(self, block_hash: int, backend: str) -> bool:
        """Return whether ``backend`` holds the block ``block_hash``. O(G).

        Raises:
            TypeError: ``block_hash`` is not an int, or ``backend`` is not a str.
        """
        block = as_int(block_hash)  # numpy's ints too
        if block is None:
            raise InvalidTypeError(f"block_hash must be an int, not {type(block_hash).__name__}")
        block_hash = block
        backend = _check_backend(backend)
        store = self._stores.get(backend)
        return store is not None and block_hash in store

    def hashes(self, backend: str) -> set[int]:
        """Return every block hash ``backend`` holds. O(blocks of backend).

        Raises:
            TypeError: ``backend`` is not a str.
        """
        backend = _check_backend(backend)
        return set(self._stores.get(backend, ()))

    def blocks(self, backend: str) -> int:
        """Return how many blocks ``backend`` holds. O(1).

        Raises:
            TypeError: ``backend`` is not a str.
        """
        backend = _check_backend(backend)
        store = self._stores.get(backend)
        return 0 if store is None else store.size

    def store(self, backend: str) -> UnboundedStore | LRUStore | None:
        """Return ``backend``'s store (for inspection: write through the index), None if it holds nothing. O(1).

        Raises:
            TypeError: ``backend`` is not a str.
        """
        backend = _check_backend(backend)
        return self._stores.get(backend)

    def backends(self) -> list[str]:
        """Return the backends that hold at least one block, in first-insert order. O(B)."""
        return list(self._stores)

    def clear(self) -> None:
        """Forget every block of every backend (capacities stay). O(entries), the time to free them."""
        self._stores.clear()
        self._roots.clear()

    def __len__(self) -> int:
        """Return the number of (block, backend) entries. O(B).

        Safe to read while the router that owns the index is used from other threads (a ``repr()`` in a log line, a
        metrics scrape): it sums a copy of the stores, taken in one step.
        """
        return sum(store.size for store in list(self._stores.values()))

    def __repr__(self) -> str:
        return f"PrefixIndex(block_size={self._block_size}, backends={len(self._stores)}, entries={len(self)})"

    def __copy__(self) -> PrefixIndex:
        """An independent copy, as :func:`copy.deepcopy` makes. O(entries).

        A shallow one would share the stores but not the counters kept beside them (the capacity changes a router
        watches, the orphan inserts): writing to it would change this index behind its router's back."""
        return copy.deepcopy(self)

    def _check(self, *, chains: Iterable[Sequence[int]] = ()) -> None:
        """Assert every invariant of the index (for tests). O(entries + chains × backends).

        The stores keep no parent pointers (they would cost ~40 bytes per entry), so prefix-closedness is checked
        on ``chains``, prompts' hashes from block 0 that the caller knows: on a store without holes, the blocks of
        each chain that it holds are a prefix of it, and their generations never grow along the chain.
        """
        assert self._stores.keys() == self._roots.keys(), "roots out of step with stores"
        assert self._orphans >= 0
        for backend, store in self._stores.items():
            assert isinstance(backend, str), backend
            assert store.size, f"empty store kept for {backend!r}"
            assert self._roots[backend] is store.roots, backend
            capacity = self._limit(backend)
            assert isinstance(store, UnboundedStore if capacity is None else LRUStore), (backend, capacity)
            store._check(capacity)
            for h in store:
                assert isinstance(h, int) and 0 <= h < 2**64, h
        for backend, capacity in self._capacity.items():
            assert isinstance(capacity, int) and capacity >= 0, (backend, capacity)
        for hashes in chains:
            for backend, store in self._stores.items():
                if store.open:
                    continue
                held = [h in store for h in hashes]
                assert held == sorted(held, reverse=True), f"{backend!r} holds a block of a chain but not its parent"
                if isinstance(store, LRUStore) and any(held):
                    ages = [_generation(store, h) for h, there in zip(hashes, held, strict=True) if there]
                    assert ages == sorted(ages, reverse=True), f"{backend!r}: a block newer than its parent"


def check_update(update: object) -> IndexUpdate:
    """Return one index update checked (its hashes as Python ints, an iterator read once), before anything is
    written: a bad one must not leave a batch half applied (:meth:`Router.write <prefixroute.Router.write>` and
    :class:`~prefixroute.vllm.RankMerge` check a whole batch first). O(len(hashes)).

    Raises:
        TypeError: ``update`` is not a ``(stored, hashes, parent)`` tuple with a bool ``stored`` and iterable
            ``hashes``.
        InvalidEventError: a hash or ``parent`` is not an int in [0, 2**64), or a removal has a parent.
    """
    if not isinstance(update, tuple) or len(update) != 3:
        raise InvalidTypeError(f"an index update is a tuple (stored, hashes, parent), not {shown(update)}")
    stored, hashes, parent = update
    if not isinstance(stored, bool):
        raise InvalidTypeError(
            f"an index update's first item says stored (True) or removed (False), not {shown(stored)}"
        )
    if stored:
        _check_chain(hashes)
    if isinstance(hashes, _NOT_HASHES) or not isinstance(hashes, Iterable):
        raise InvalidTypeError(
            f"an index update's hashes must be a sequence of block hashes, not {type(hashes).__name__}"
        )
    if not isinstance(hashes, Sequence):
        hashes = list(hashes)  # an iterator, read once
    try:
        packed = array("Q", hashes)  # checks, in C, that every hash is an int in [0, 2**64)
    except (TypeError, OverflowError, NotImplementedError) as exc:  # NotImplementedError: a 2-D memoryview
        raise InvalidEventError(f"block hashes must be ints in [0, 2**64): {_first_bad(hashes) or exc}") from None
    if parent is not None:  # PrefixIndex.insert()'s check, written twice: one helper cost a write 2-4 % (a call)
        block = as_int(parent)
        if block is None or not 0 <= block < 2**64:
            raise InvalidEventError(f"parent must be a block hash, an int in [0, 2**64), or None, not {shown(parent)}")
        parent = block
    if parent is not None and not stored:
        raise InvalidEventError("a removal has no parent: pass (False, hashes, None)")
    return (stored, _python_ints(hashes, packed, InvalidEventError), parent)


def apply_updates(index: PrefixIndex, backend: str, updates: Iterable[IndexUpdate]) -> None:
    """Apply ``updates`` for ``backend`` to ``index`` in order (no lock: a router's index is written through
    :meth:`Router.write <prefixroute.Router.write>`). O(total hashes + evicted)."""
    insert, remove = index.insert, index.remove
    for stored, hashes, parent in updates:
        if stored:
            insert(hashes, backend, parent=parent)
        else:
            remove(hashes, backend)


_SET_BASE = sys.getsizeof(set())  # a set's own size, with its 8-slot small table


def _room(blocks: set[int]) -> int:
    """How many more blocks ``blocks`` takes before CPython grows its table (when 3/5 of its slots are used)."""
    size = sys.getsizeof(blocks)
    slots = 8 if size == _SET_BASE else (size - _SET_BASE) // 16
    return (slots - 1) * 3 // 5 - len(blocks)


def _generation(store: LRUStore, block_hash: int) -> int:
    return next(i for i, gen in enumerate(store._gens) if block_hash in gen)


def _run(gen: Container[int], hashes: Sequence[int], start: int, guess: int = 0) -> int:
    """End of the run of ``hashes`` from ``start`` (held) that ``gen`` holds, by binary search. O(log n)."""
    if hashes[-1] in gen:
        return len(hashes)
    return leading_run(gen, hashes, len(hashes) - 1, low=start + 1, guess=guess)


def _walk_run(gen: Container[int], hashes: Sequence[int], start: int) -> int:
    """End of the run of ``hashes`` from ``start`` that ``gen`` holds, block by block (C-level). O(run)."""
    return start + len(list(takewhile(gen.__contains__, islice(hashes, start, None))))


def _leading(blocks: Container[int], hashes: Sequence[int]) -> int:
    """How many leading ``hashes`` are in ``blocks``: takewhile over the C-level ``__contains__``, no Python loop."""
    return len(list(takewhile(blocks.__contains__, hashes)))


def leading_run(
    held: Container[int], hashes: Sequence[int], limit: int | None = None, *, low: int = 0, guess: int = 0
) -> int:
    """How many leading ``hashes`` (at most ``limit``) are in ``held``, by binary search. O(log n).

    Valid only when ``held`` is prefix-closed (holding a block means holding its parent), so that "block k is held"
    is true for a leading run and false after it. ``low``: a count already known to be held. ``guess``: a likely
    answer, tried first (two probes when it is right, and either way the search goes on in what it left). The
    simulator's vLLM cache uses it too.
    """
    high = len(hashes) if limit is None else min(limit, len(hashes))
    if low < guess < high:
        if hashes[guess - 1] not in held:
            high = guess - 1
        elif hashes[guess] not in held:
            return guess
        else:
            low = guess + 1
    while low < high:  # invariant: hashes[:low] held, hashes[high:] not
        middle = (low + high) // 2
        if hashes[middle] in held:
            low = middle + 1
        else:
            high = middle
    return low


def _check_prediction(hashes: object, backend: object, held: object) -> tuple[Sequence[int], str, int]:
    """:meth:`PrefixIndex.predict`'s arguments, checked (the overrides in this package check them the same way).

    Raises:
        TypeError: ``hashes`` is not a sequence of ints, ``backend`` not a str or ``held`` not an int.
        InvalidEventError: a hash is outside [0, 2**64).
    """
    if type(hashes) is _RoutedHashes:
        checked: Sequence[int] = hashes
    elif _not_a_sequence(hashes):
        raise InvalidTypeError(f"hashes must be a sequence of block hashes, not {type(hashes).__name__}")
    else:
        checked = _check_hashes(hashes)
    count = as_int(held)
    if count is None:
        raise InvalidTypeError(f"held must be a count of blocks (an int), not {type(held).__name__}")
    return checked, _check_backend(backend), count


def _check_retraction(hashes: object, backend: object, start: object) -> tuple[Sequence[int], str, int]:
    """:meth:`PrefixIndex.retract`'s arguments, checked (the overrides in this package check them the same way).

    Raises:
        TypeError: a hash is not an int, ``backend`` not a str, or ``start`` not an int.
        InvalidEventError: a hash is outside [0, 2**64).
        ConfigurationError: ``start`` is negative.
    """
    checked = _check_hashes(hashes)
    position = as_int(start)
    if position is None:
        raise InvalidTypeError(f"start must be a block position (an int), not {type(start).__name__}")
    if position < 0:
        raise ConfigurationError(f"start must be a block position >= 0, not {shown(start)}")
    return checked, _check_backend(backend), position


class _RoutedHashes(list):  # type: ignore[type-arg]  # of ints
    """A prompt's block hashes as a :class:`~prefixroute.Router` computed them with its own hasher, never handed out:
    :meth:`PrefixIndex.predict` takes them unchecked (checking 512 hashes costs ~10 % of an 8K-token route)."""

    __slots__ = ()


# Text and raw bytes are not block hashes: array("Q", bytearray) would read its bytes as uint64s, or fail on a length
# that is not a multiple of 8.
_NOT_HASHES = (str, bytes, bytearray)


def _not_a_sequence(hashes: object) -> bool:
    """Whether ``hashes`` cannot be indexed as one prompt's block hashes (a 2-D memoryview raises on indexing)."""
    return (
        isinstance(hashes, _NOT_HASHES)
        or not isinstance(hashes, Sequence)
        or (isinstance(hashes, memoryview) and hashes.ndim != 1)
    )


def _check_chain(hashes: object) -> None:
    """Refuse a set as a chain to store: its order is not the prompt's, so its first item would be filed as the
    chain's root and none of it would ever match (a set of hashes to remove is fine)."""
    if type(hashes) is not list and isinstance(hashes, AbstractSet):
        raise InvalidTypeError(
            f"a chain of block hashes to store must be ordered as the prompt's blocks (a list or tuple), "
            f"not a {type(hashes).__name__}"
        )


def _check_hashes(hashes: object) -> Sequence[int]:
    """Validate block hashes before anything is written (a bad one must not leave a chain half stored). O(n)."""
    if isinstance(hashes, _NOT_HASHES) or not isinstance(hashes, Iterable):
        raise InvalidTypeError(f"block hashes must be a sequence of ints, not {type(hashes).__name__}")
    if not isinstance(hashes, Sequence):
        hashes = list(hashes)  # an iterator, read once
    try:
        packed = array("Q", hashes)  # checks, in C, that every hash is an int in [0, 2**64)
    except (TypeError, NotImplementedError) as exc:  # NotImplementedError: a 2-D memoryview
        raise InvalidTypeError(
            f"block hashes must be ints (as BlockHasher computes them): {_first_bad(hashes) or exc}"
        ) from None
    except OverflowError as exc:
        raise InvalidEventError(
            f"block hashes must be ints in [0, 2**64), as BlockHasher makes them: {_first_bad(hashes) or exc}"
        ) from None
    return _python_ints(hashes, packed, InvalidTypeError)


def _first_bad(hashes: Iterable[object]) -> str:
    """The first value of ``hashes`` that is no block hash and its position, for an error (called on failure
    only); "" if none is found (a 2-D memoryview, which cannot be walked)."""
    try:
        for position, value in enumerate(hashes):
            number = as_int(value)
            if number is None or not 0 <= number < 2**64:
                return f"{shown(value)} at position {position}"
    except NotImplementedError:
        pass
    return ""


def _python_ints(
    hashes: Sequence[object], packed: array[int], error: type[PrefixRouteError]
) -> list[int] | Sequence[int]:
    """``hashes`` itself when they are Python ints (its int objects are shared, not copied), else the checked
    ``packed`` hashes as Python ints (numpy's ints). A bool among them, which ``array`` takes for 0 or 1, is an
    ``error``: True is a flag passed by mistake, not block hash 1. O(n), in C."""
    types = set(map(type, hashes))
    if types <= {int}:
        return hashes  # type: ignore[return-value]  # checked: ints
    if bool in types:
        position = next(i for i, value in enumerate(hashes) if type(value) is bool)
        raise error(f"block hashes must be ints, not bools: {hashes[position]} at position {position}")
    return packed.tolist()


def _check_backend(backend: object) -> str:
    """``backend`` as a plain str: a str subclass's own ``__hash__`` or ``__eq__`` must not reach the index's maps;
    an empty one is refused, as the router refuses it."""
    if type(backend) is str and backend:
        return backend
    if not isinstance(backend, str):
        raise InvalidTypeError(f"a backend id is a str, not {type(backend).__name__}")
    return check_backend_id(backend)


def _check_generations(value: object) -> int:
    count = as_int(value)
    if count is None or count < 1:
        raise ConfigurationError(f"generations must be a positive int, not {shown(value)}")
    return count


def _check_capacity(value: object, name: str) -> int:
    count = as_int(value)
    if count is None or count < 0:
        raise ConfigurationError(f"{name} must be a non-negative int number of blocks or None, not {shown(value)}")
    return count
