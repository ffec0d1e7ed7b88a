from __future__ import annotations

import tracemalloc

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from prefixroute import BlockHasher, ConfigurationError, PrefixIndex

BACKENDS = ["a", "b", "c"]


def chain(*tokens: int, block_size: int = 1) -> list[int]:
    return list(BlockHasher(block_size).hash(list(tokens)))


def test_match_counts_contiguous_leading_blocks() -> None:
    index = PrefixIndex(block_size=1)
    hashes = chain(1, 2, 3, 4)
    index.insert(hashes[:3], "a")
    index.insert(hashes[:1], "b")
    assert index.match(hashes, ["a", "b", "c"]) == {"a": 3, "b": 1, "c": 0}
    index.remove([hashes[1]], "a")  # a hole: only block 0 is usable
    assert index.match(hashes, ["a"]) == {"a": 1}
    assert index.match([], ["a"]) == {"a": 0}


def test_capacity_evicts_least_recent_leaves_first_and_keeps_whole_prefixes() -> None:
    index = PrefixIndex(block_size=1, capacity_blocks=6)
    old, new = chain(1, 2, 3, 4), chain(9, 8, 7)
    index.insert(old, "a")
    index.insert(new, "a")  # 7 blocks: the oldest leaf (old's block 3) goes
    assert index.blocks("a") == 6
    assert index.match(old, ["a"]) == {"a": 3}
    assert index.match(new, ["a"]) == {"a": 3}
    index.insert(old[:3], "a")  # old becomes most recent again
    index.insert(chain(5, 6), "a")  # so new's leaves are evicted, not old's
    assert index.match(old, ["a"]) == {"a": 3}
    assert index.match(new, ["a"]) == {"a": 1}
    index._check()


def test_capacity_per_backend_mapping_and_set_capacity() -> None:
    index = PrefixIndex(block_size=1, capacity_blocks={"a": 2})
    index.insert(chain(1, 2, 3, 4), "a")
    index.insert(chain(1, 2, 3, 4), "b")
    assert (index.blocks("a"), index.blocks("b")) == (2, 4)
    assert index.capacity("b") is None
    index.set_capacity("b", 1)  # b's blocks sat in an unordered set: which one stays is arbitrary
    assert index.blocks("b") == 1
    assert index.match(chain(1, 2), ["b"]) == {"b": int(chain(1)[0] in index.hashes("b"))}
    index.insert(chain(1, 2), "b")  # from now on b keeps LRU order, and its root block is the most recent
    assert index.match(chain(1, 2), ["b"]) == {"b": 1}
    index.set_capacity("b", None)
    assert index.capacity("b") is None


@pytest.mark.parametrize("capacity", [-1, 1.5, "10", True])
def test_bad_capacity_is_a_configuration_error(capacity: object) -> None:
    with pytest.raises(ConfigurationError, match="capacity"):
        PrefixIndex(capacity_blocks=capacity)  # type: ignore[arg-type]


def test_remove_backend_clear_len_and_backends() -> None:
    index = PrefixIndex(block_size=1)
    index.insert(chain(1, 2), "a")
    index.insert(chain(1, 2, 3), "b")
    assert len(index) == 5 and index.backends() == ["a", "b"]
    assert index.holds(chain(1)[0], "a") and not index.holds(chain(3)[0], "a")
    index.remove_backend("a")
    assert index.backends() == ["b"] and index.blocks("a") == 0 and index.hashes("a") == set()
    index.remove(chain(1, 2, 3), "b")
    assert index.backends() == [] and len(index) == 0
    index.insert(chain(1), "c")
    index.clear()
    assert len(index) == 0
    index.insert(chain(4, 5), "d")  # what the Router frees outside its lock
    assert set(index._detach("d")) == set(chain(4, 5)) and index.blocks("d") == 0 and index._detach("d") == ()


def test_zero_capacity_holds_nothing() -> None:
    index = PrefixIndex(block_size=1, capacity_blocks=0)
    index.insert(chain(1, 2), "a")
    assert len(index) == 0
    index._check()


def test_memory_per_entry_is_bounded() -> None:
    """Not a timing: a structural bound, so a design that stores much more per entry fails here."""
    index = PrefixIndex(block_size=1)
    hashes = chain(*range(20_000))
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for backend in ("a", "b"):
        index.insert(hashes, backend)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert used / len(index) < 200


class IndexAgainstReference(RuleBasedStateMachine):
    """Random insert/remove/evict/re-capacity sequences; match() must equal a brute-force model, _check() must hold."""

    def __init__(self) -> None:
        super().__init__()
        # "a" is bounded from the start, "b" unbounded until set_capacity(), "c" follows the rule below.
        self.capacity: dict[str, int | None] = {"a": 12, "b": None, "c": None}
        self.index = PrefixIndex(block_size=1, capacity_blocks={"a": 12})
        # Reference: per backend, held hashes in eviction order (least recent first).
        self.model: dict[str, list[int]] = {b: [] for b in BACKENDS}
        self.prompts: list[list[int]] = []

    @rule(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=8), backend=st.sampled_from(BACKENDS))
    def insert(self, tokens: list[int], backend: str) -> None:
        hashes = chain(*tokens)
        self.prompts.append(hashes)
        self.index.insert(hashes, backend)
        held = self.model[backend]
        leading = 0
        while leading < len(hashes) and hashes[leading] in held:
            leading += 1
        for h in reversed(hashes[leading:]):  # new tail leaf first; held later blocks keep their place
            if h not in held:
                held.append(h)
        capacity = self.capacity[backend]
        if capacity is not None:  # only bounded backends track recency
            for h in reversed(hashes[:leading]):
                held.remove(h)
                held.append(h)
            del held[: max(0, len(held) - capacity)]

    @rule(backend=st.sampled_from(["b", "c"]), capacity=st.none() | st.integers(0, 16))
    def set_capacity(self, backend: str, capacity: int | None) -> None:
        if self.capacity[backend] is None:  # an unbounded backend's blocks are a set: its order becomes the LRU's
            self.model[backend] = list(self.index._blocks.get(backend, ()))
        self.index.set_capacity(backend, capacity)
        self.capacity[backend] = capacity
        if capacity is not None:
            del self.model[backend][: max(0, len(self.model[backend]) - capacity)]

    @precondition(lambda self: self.prompts)
    @rule(data=st.data(), backend=st.sampled_from(BACKENDS))
    def remove(self, data: st.DataObject, backend: str) -> None:
        hashes = data.draw(st.sampled_from(self.prompts))
        start = data.draw(st.integers(0, len(hashes) - 1))
        self.index.remove(hashes[start:], backend)
        self.model[backend] = [h for h in self.model[backend] if h not in hashes[start:]]

    @rule(backend=st.sampled_from(BACKENDS))
    def remove_backend(self, backend: str) -> None:
        self.index.remove_backend(backend)
        self.model[backend] = []

    @precondition(lambda self: self.prompts)
    @rule(data=st.data())
    def match(self, data: st.DataObject) -> None:
        hashes = data.draw(st.sampled_from(self.prompts))
        expected = {}
        for backend, held in self.model.items():
            count = 0
            while count < len(hashes) and hashes[count] in held:
                count += 1
            expected[backend] = count
        assert self.index.match(hashes, BACKENDS) == expected

    @invariant()
    def closed_backends_hold_whole_prefixes(self) -> None:
        """What lets match() binary-search: on a backend without holes, a held block's ancestors are all held."""
        for backend in BACKENDS:
            if backend in self.index._open:
                continue
            for hashes in self.prompts:
                held = [self.index.holds(h, backend) for h in hashes]
                assert held == sorted(held, reverse=True), (backend, held)

    @invariant()
    def consistent(self) -> None:
        self.index._check()
        for backend, held in self.model.items():
            assert self.index.hashes(backend) == set(held)
            capacity = self.capacity[backend]
            assert capacity is None or self.index.blocks(backend) <= capacity


TestIndexAgainstReference = IndexAgainstReference.TestCase
TestIndexAgainstReference.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
