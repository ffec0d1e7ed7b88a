"""BlockCache: vLLM block-pool semantics, and its invariants under random operation sequences."""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixroute.errors import ConfigurationError, InvalidTypeError
from prefixroute.sim.kvcache import BlockCache


def test_unreferenced_blocks_stay_cached_until_space_is_needed() -> None:
    cache = BlockCache(capacity_blocks=4)
    held: list[int] = []
    assert cache.allocate(3)
    assert cache.commit([1, 2, 3], held) == 3
    cache.release(held, private=0)
    assert cache.match([1, 2, 3, 4]) == 3
    assert cache.used_blocks == 0 and cache.cached_blocks == 3
    assert cache.allocate(2)  # one empty block plus one eviction: the prompt's tail goes first
    assert cache.match([1, 2, 3]) == 2
    assert cache.evictions == 1


def test_pinned_blocks_are_never_evicted_and_allocation_fails_instead() -> None:
    cache = BlockCache(capacity_blocks=3)
    held: list[int] = []
    assert cache.allocate(2)
    cache.commit([7, 8], held)
    assert not cache.allocate(2)  # only one block is free; the two pinned ones cannot be evicted
    assert cache.match([7, 8]) == 2
    assert cache.allocate(1)
    cache._check()


def test_acquire_reuses_a_cached_prefix_and_pins_it() -> None:
    cache = BlockCache(capacity_blocks=4)
    held: list[int] = []
    cache.allocate(2)
    cache.commit([5, 6], held)
    cache.release(held, private=0)
    assert cache.available() == 4
    cache.acquire([5, 6])
    assert cache.available() == 2
    assert cache.unreferenced([5, 6]) == 0
    assert not cache.allocate(3)
    cache._check()


def test_duplicate_commit_keeps_a_private_copy_and_references_the_cached_one() -> None:
    cache = BlockCache(capacity_blocks=8)
    first: list[int] = []
    second: list[int] = []
    cache.allocate(1)
    cache.allocate(1)
    assert cache.commit([42], first) == 1
    assert cache.commit([42], second) == 0  # computed twice concurrently: the second copy stays private
    assert second == [42] and cache.occupied_blocks == 2
    cache.release(first, private=0)
    cache.release(second, private=1)
    assert cache.occupied_blocks == 1 and cache.match([42]) == 1
    cache._check()


def test_bad_capacity_is_rejected() -> None:
    with pytest.raises(ValueError, match="capacity_blocks"):
        BlockCache(capacity_blocks=0)


# A random request mix driven straight against the cache, as the backend drives it: each request holds a prefix
# of its own chain of hashes, grows block by block, and finishes.
chains = st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=12)


@settings(max_examples=150, deadline=None)
@given(
    capacity=st.integers(min_value=4, max_value=40),
    ops=st.lists(st.tuples(st.sampled_from(["start", "grow", "finish"]), chains, st.integers(0, 5)), max_size=60),
)
def test_random_operations_keep_invariants(capacity: int, ops: list[tuple[str, list[int], int]]) -> None:
    cache = BlockCache(capacity_blocks=capacity)
    running: list[dict[str, object]] = []
    for op, path, pick in ops:
        hashes = [hash(tuple(path[: i + 1])) & (2**64 - 1) for i in range(len(path))]
        if op == "start":
            hit = cache.match(hashes)
            assert hit == _linear_match(cache, hashes)
            need = 1
            available = cache.available()
            if available is not None and available - cache.unreferenced(hashes[:hit]) < need:
                continue
            cache.acquire(hashes[:hit])
            assert cache.allocate(need)
            running.append({"hashes": hashes, "held": list(hashes[:hit]), "private": need})
        elif op == "grow" and running:
            request = running[pick % len(running)]
            held, private, own = request["held"], request["private"], request["hashes"]
            assert isinstance(held, list) and isinstance(private, int) and isinstance(own, list)
            if len(held) < len(own) and private > 0:
                request["private"] = private - cache.commit(own[len(held) : len(held) + 1], held)
            elif cache.allocate(1):
                request["private"] = private + 1
        elif op == "finish" and running:
            request = running.pop(pick % len(running))
            held, private = request["held"], request["private"]
            assert isinstance(held, list) and isinstance(private, int)
            cache.release(held, private=private)
        cache._check()
        for request in running:
            held = request["held"]
            assert isinstance(held, list)
            assert all(cache.holds(h) for h in held), "a running request's block was evicted"


def _linear_match(cache: BlockCache, hashes: list[int]) -> int:
    matched = 0
    while matched < len(hashes) and cache.holds(hashes[matched]):
        matched += 1
    return matched


def test_a_block_freed_earlier_is_evicted_before_a_partial_block_freed_later() -> None:
    # vLLM keeps one free queue, cached or not, least recently freed first: after the unused blocks, an allocation
    # takes what was freed first, so request A's cached tail goes although B's freed partial block holds nothing.
    cache = BlockCache(capacity_blocks=6)
    a: list[int] = []
    assert cache.allocate(3)  # A: two full blocks and a partial one
    cache.commit([1, 2], a)
    cache.release(a, private=1)
    b: list[int] = []
    assert cache.allocate(3)  # B takes the three never-used blocks
    cache.commit([11, 12], b)
    cache.release(b, private=1)
    assert cache.allocate(2)  # A's partial block, then A's tail
    assert cache.match([1, 2]) == 1 and cache.match([11, 12]) == 2
    assert cache.evictions == 1
    cache._check()


class EventLog:
    """A CacheListener that keeps what it hears, as a KV-event subscriber would."""

    def __init__(self) -> None:
        self.events: list[tuple[str, list[int], int | None]] = []

    def stored(self, hashes: list[int], parent: int | None) -> None:
        self.events.append(("stored", list(hashes), parent))

    def removed(self, hashes: list[int]) -> None:
        self.events.append(("removed", list(hashes), None))


def test_the_listener_hears_each_newly_cached_run_with_its_parent_and_each_eviction() -> None:
    # vLLM's BlockStored names the block a run continues (None: block 0); a block already cached is no event.
    cache = BlockCache(capacity_blocks=6)
    log = EventLog()
    cache.listener = log
    a: list[int] = []
    assert cache.allocate(3)
    cache.commit([1, 2], a)
    cache.commit([3], a)  # the same request's next block, a step later: continues block 2
    b, c = [1], [1]
    cache.acquire(b)  # a second request hits block 1, computes block 2 again and then its own block 7
    assert cache.allocate(2)
    assert cache.commit([2, 7], b) == 1
    cache.acquire(c)  # a third computes block 2 again and nothing new: no event, not even an empty one
    assert cache.allocate(1)
    assert cache.commit([2], c) == 0
    assert log.events == [("stored", [1, 2], None), ("stored", [3], 2), ("stored", [7], 2)]
    cache.release(a, private=0)
    cache.release(b, private=1)
    cache.release(c, private=1)
    log.events.clear()
    # the pool is full (4 cached, 2 freed private): allocations take the least recently freed, a request's tail
    # first, and only the cached ones are evictions
    assert cache.allocate(2)
    assert cache.allocate(2)
    assert cache.allocate(1)
    assert log.events == [("removed", [3], None), ("removed", [7], None), ("removed", [2], None)]
    assert cache.evictions == 3 and cache.match([1, 2]) == 1
    cache._check()


def test_a_one_block_pool_is_valid_and_a_bad_capacity_is_named() -> None:
    cache = BlockCache(capacity_blocks=1)
    assert cache.allocate(1) and not cache.allocate(1)
    with pytest.raises(ValueError, match="capacity_blocks must be a positive int or None, not -3"):
        BlockCache(capacity_blocks=-3)


def test_repr_counts_free_cached_blocks_apart_from_freed_private_ones() -> None:
    cache = BlockCache(capacity_blocks=4)
    held: list[int] = []
    assert cache.allocate(3)
    cache.commit([1, 2], held)
    cache.release(held, private=1)
    assert repr(cache) == "BlockCache(capacity_blocks=4, used=0, cached=2, free_cached=2)"


def _state(cache: BlockCache) -> tuple[object, ...]:
    return (dict(cache._refs), list(cache._free_queue), cache._private, cache._free_private, cache.evictions)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda c, held: c.allocate(None), ConfigurationError, "blocks must be a count"),
        (lambda c, held: c.allocate(math.nan), ConfigurationError, "blocks must be a count"),  # was: a NaN count
        (lambda c, held: c.holds([1]), InvalidTypeError, "a block hash is an int"),
        (lambda c, held: c.match(None), InvalidTypeError, "hashes must be a sequence"),
        (lambda c, held: c.match([1], limit="2"), ConfigurationError, "limit must be None or a count"),
        (lambda c, held: c.unreferenced([1, 99]), ConfigurationError, "takes cached blocks only: 99"),
        (lambda c, held: c.acquire([1, 99]), ConfigurationError, "takes cached blocks only: 99"),  # was: half done
        (lambda c, held: c.acquire([[1]]), InvalidTypeError, "takes block hashes"),
        (lambda c, held: c.commit(None, held), InvalidTypeError, "sequence of block hashes"),
        (lambda c, held: c.commit([5], None), InvalidTypeError, "held must be the request's list"),
        (lambda c, held: c.commit(["x"], held), InvalidTypeError, "a block hash is an int"),
        (lambda c, held: c.commit([5, 6, 7], held), ConfigurationError, "3 new hashes, but only 2 private blocks"),
        (lambda c, held: c.release(held, private=3), ConfigurationError, "0 to the 2 allocated"),
        (lambda c, held: c.release(held, private=None), ConfigurationError, "private must be a count"),
        (lambda c, held: c.release([*held, 99], private=0), ConfigurationError, "release() of block 99"),
        (lambda c, held: c.release([*held, 1], private=0), ConfigurationError, "release() of block 1"),  # twice
        (lambda c, held: c.release(None, private=0), InvalidTypeError, "hashed must be a sequence"),
    ],
)
def test_a_call_the_pool_cannot_follow_is_refused_and_changes_nothing(
    call: Callable[[BlockCache, list[int]], object], error: type[Exception], message: str
) -> None:
    # Was: Python's own KeyError/TypeError/AttributeError, some after part of the change (acquire() of an uncached
    # block referenced those before it), or a silent corruption (a NaN allocation, a release of more private blocks
    # than allocated, a block released twice: negative counts that _check() then found).
    cache = BlockCache(capacity_blocks=8)
    held: list[int] = []
    assert cache.allocate(4) and cache.commit([1, 2], held) == 2  # a request: two cached blocks, two private
    before = _state(cache)
    with pytest.raises(error, match=re.escape(message)):
        call(cache, held)
    assert _state(cache) == before and held == [1, 2]
    cache._check()
    cache.release(held, private=2)  # the request itself still finishes
    assert cache.used_blocks == 0
