"""A state machine over every PrefixIndex operation, checked against a simple model after each step."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefixroute import BlockHasher, PrefixIndex
from prefixroute.index import LRUStore, UnboundedStore

BACKENDS = ["a", "b", "c"]
HASHER = BlockHasher(1)
CAPACITIES = st.none() | st.integers(0, 24)


def leading(held: set[int], hashes: list[int]) -> int:
    count = 0
    while count < len(hashes) and hashes[count] in held:
        count += 1
    return count


class IndexMachine(RuleBasedStateMachine):
    """Every operation the index offers, in any order.

    The model: per backend, every block it was told it holds and not told it lost (``model``), which the index
    holds exactly while the backend never had a capacity (``exact``) and holds a subset of otherwise (eviction is
    the index's to choose). Whatever it holds, match() must equal the leading run of it, continuation inserts must
    be skipped exactly when the parent is not held, a prompt just predicted must be held whole when it fits, and
    _check() (prefix-closedness included, on every chain seen) must hold.
    """

    def __init__(self) -> None:
        super().__init__()
        self.index = PrefixIndex(block_size=1)
        self.model: dict[str, set[int]] = {b: set() for b in BACKENDS}
        self.exact = dict.fromkeys(BACKENDS, True)
        self.chains: list[list[int]] = []
        self.orphans = 0
        self.fresh = 4  # hashes of contradicting chains' fresh blocks count down from 2**64 - 1

    @initialize(
        default=CAPACITIES, own=st.dictionaries(st.sampled_from(BACKENDS), st.integers(0, 24)), bound=CAPACITIES
    )
    def build(self, default: int | None, own: dict[str, int], bound: int | None) -> None:
        capacities: int | dict[str, int] | None = own if own else default
        self.index = PrefixIndex(block_size=1, capacity_blocks=capacities, bound_blocks=bound)
        assert self.index.bound_blocks == bound
        for backend in BACKENDS:
            self.exact[backend] = self._limit(backend) is None

    def _limit(self, backend: str) -> int | None:
        """The most blocks the backend keeps: its capacity, else the index's bound (which is not a capacity)."""
        capacity = self.index.capacity(backend)
        return self.index.bound_blocks if capacity is None else capacity

    def _bounded(self, backend: str) -> None:
        if self._limit(backend) is not None:
            self.exact[backend] = False

    def _forget(self, backend: str) -> None:
        self.model[backend] = set()
        self.exact[backend] = self._limit(backend) is None

    def _sync(self, backend: str) -> None:
        """Eviction is the index's to choose: after it, the model keeps only what the index still holds."""
        if not self.exact[backend]:
            self.model[backend] &= self.index.hashes(backend)

    @rule(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=10), backend=st.sampled_from(BACKENDS))
    def insert_root(self, tokens: list[int], backend: str) -> None:
        hashes: list[int] = list(HASHER.hash(tokens))
        self.chains.append(hashes)
        self.index.insert(hashes, backend)
        self.model[backend].update(hashes)
        self._sync(backend)
        self._recent_is_held(hashes, backend)

    @precondition(lambda self: self.chains)
    @rule(data=st.data(), backend=st.sampled_from(BACKENDS))
    def insert_continuation(self, data: st.DataObject, backend: str) -> None:
        """A KV event's chain: the blocks after ``parent``; the parent may or may not be held."""
        hashes = data.draw(st.sampled_from([c for c in self.chains if len(c) > 1]) if self._long() else st.nothing())
        start = data.draw(st.integers(1, len(hashes) - 1))
        parent = hashes[start - 1]
        held_before = self.index.holds(parent, backend)
        before, blocks = self.index.orphan_inserts, self.index.hashes(backend)
        self.index.insert(hashes[start:], backend, parent=parent)
        if held_before:
            assert self.index.orphan_inserts == before
            self.model[backend].update(hashes[start:])
        else:
            assert self.index.orphan_inserts == before + 1
            assert self.index.hashes(backend) == blocks, "an orphan insert changed what the backend holds"
        self._sync(backend)

    @precondition(lambda self: any(self.index.blocks(b) for b in BACKENDS))
    @rule(data=st.data(), fresh=st.integers(1, 3), continuation=st.booleans())
    def insert_contradicting(self, data: st.DataObject, fresh: int, continuation: bool) -> None:
        """A chain no consistent hashing makes, as a hostile or broken KV-event source may send: fresh blocks, then
        blocks the backend holds, each now under another parent. The store sees the contradiction, walks block by
        block until every generation of that time is evicted, and stays exact."""
        backend = data.draw(st.sampled_from([b for b in BACKENDS if self.index.blocks(b)]))
        held = sorted(self.index.hashes(backend))
        borrowed = data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=4, unique=True))
        self.fresh += fresh
        hashes = [2**64 - self.fresh + k for k in range(fresh)] + borrowed
        parent = data.draw(st.sampled_from(held)) if continuation else None
        if parent is not None and parent in borrowed:
            parent = None
        self.index.insert(hashes, backend, parent=parent)
        self.model[backend].update(hashes)
        self._sync(backend)

    def _long(self) -> bool:
        return any(len(c) > 1 for c in self.chains)

    @precondition(lambda self: self.chains)
    @rule(data=st.data(), backend=st.sampled_from(BACKENDS), stale=st.booleans())
    def predict(self, data: st.DataObject, backend: str, stale: bool) -> None:
        hashes = data.draw(st.sampled_from(self.chains))
        held = self.index.match(hashes, [backend])[backend]
        if stale:
            held = data.draw(st.integers(0, len(hashes) + 1))
        self.index.predict(hashes, backend, held)
        self.model[backend].update(hashes)
        self._sync(backend)
        self._recent_is_held(hashes, backend)

    def _recent_is_held(self, hashes: list[int], backend: str) -> None:
        """A prompt just routed is held whole unless it is too big for the newest generation's room."""
        capacity = self._limit(backend)
        room = None if capacity is None else capacity - 2 * (capacity // PrefixIndex.generations)
        if room is None or len(set(hashes)) <= room // 2:
            assert self.index.match(hashes, [backend])[backend] == len(hashes)

    @precondition(lambda self: self.chains)
    @rule(data=st.data(), backend=st.sampled_from(BACKENDS))
    def remove(self, data: st.DataObject, backend: str) -> None:
        """Any slice of a chain, so holes too (a block removed while its children stay)."""
        hashes = data.draw(st.sampled_from(self.chains))
        start = data.draw(st.integers(0, len(hashes) - 1))
        end = data.draw(st.integers(start + 1, len(hashes)))
        gone = hashes[start:end]
        self.index.remove(iter(gone) if data.draw(st.booleans()) else gone, backend)
        self.model[backend].difference_update(gone)

    @precondition(lambda self: self.chains)
    @rule(data=st.data(), backend=st.sampled_from(BACKENDS))
    def retract(self, data: st.DataObject, backend: str) -> None:
        """A refused prompt's prediction undone from any block on (past its end too): those blocks go, others stay."""
        hashes = data.draw(st.sampled_from(self.chains))
        start = data.draw(st.integers(0, len(hashes)))
        before = self.index.hashes(backend)
        self.index.retract(hashes, backend, start)
        assert self.index.hashes(backend) == before - set(hashes[start:])
        self.model[backend].difference_update(hashes[start:])

    @rule(backend=st.sampled_from(BACKENDS))
    def remove_backend(self, backend: str) -> None:
        expected = self.index.hashes(backend)
        assert set(self.index.remove_backend(backend)) == expected
        self._forget(backend)

    @rule()
    def clear(self) -> None:
        self.index.clear()
        for backend in BACKENDS:
            self._forget(backend)

    @rule(backend=st.sampled_from(BACKENDS), capacity=CAPACITIES)
    def set_capacity(self, backend: str, capacity: int | None) -> None:
        self.index.set_capacity(backend, capacity)
        self._bounded(backend)
        self._sync(backend)
        if capacity is not None:
            assert self.index.capacity(backend) == capacity
        limit = self._limit(backend)
        assert limit is None or self.index.blocks(backend) <= limit

    @precondition(lambda self: self.chains)
    @rule(data=st.data())
    def match(self, data: st.DataObject) -> None:
        hashes = data.draw(st.sampled_from(self.chains))
        expected = {b: leading(self.index.hashes(b), hashes) for b in BACKENDS}
        assert self.index.match(hashes, BACKENDS) == expected

    @invariant()
    def consistent(self) -> None:
        index = self.index
        index._check(chains=self.chains)
        for backend in BACKENDS:
            held = index.hashes(backend)
            limit = self._limit(backend)
            kind = UnboundedStore if limit is None else LRUStore
            store = index.store(backend)
            assert store is None or isinstance(store, kind)
            assert index.blocks(backend) == len(held)
            if self.exact[backend]:
                assert held == self.model[backend]
            else:
                assert held <= self.model[backend]
            assert limit is None or len(held) <= limit
            for hashes in self.chains:
                assert index.match(hashes, [backend])[backend] == leading(held, hashes)
        assert len(index) == sum(index.blocks(b) for b in BACKENDS)


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
