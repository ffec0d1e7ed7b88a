from __future__ import annotations

import sys
import tracemalloc
from array import array

import pytest

from prefixroute import BlockHasher, ConfigurationError, InvalidEventError, PrefixIndex, Router
from prefixroute.index import (
    DEFAULT_BOUND_BLOCKS,
    LRUStore,
    UnboundedStore,
    _room,
    apply_updates,
    check_update,
    leading_run,
)


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
    index._check(chains=[hashes])


def test_a_guess_never_changes_a_leading_run() -> None:
    hashes = list(range(100, 120))
    for held_count in range(len(hashes) + 1):
        held = set(hashes[:held_count])
        assert leading_run(held, hashes) == held_count  # from block 0 by default, however few are held
        for limit in (None, 7, 20):
            for low in range(min(held_count, 5) + 1):
                expected = leading_run(held, hashes, limit, low=low)
                assert expected == min(held_count, len(hashes) if limit is None else limit)
                for guess in range(-1, len(hashes) + 2):
                    assert leading_run(held, hashes, limit, low=low, guess=guess) == expected, (held_count, guess)


def test_backends_that_hold_different_runs_of_one_prompt_each_match_theirs() -> None:
    # match() tries each backend's answer as the next one's guess: right, too long and too short.
    hashes = chain(*range(40))
    for capacity in (None, 1000):
        index = PrefixIndex(block_size=1, capacity_blocks=capacity)
        lengths = {"a": 30, "b": 30, "c": 12, "d": 35, "e": 40, "f": 1, "g": 30}
        for backend, length in lengths.items():
            index.insert(hashes[:length], backend)
        assert index.match(hashes, list(lengths)) == lengths
        assert index.match(hashes, list(reversed(lengths))) == lengths
        index._check(chains=[hashes])


def test_each_backend_kind_has_its_store() -> None:
    index = PrefixIndex(block_size=1, capacity_blocks={"a": 10})
    index.insert(chain(1, 2), "a")
    index.insert(chain(1, 2), "b")
    assert isinstance(index.store("a"), LRUStore) and isinstance(index.store("b"), UnboundedStore)
    assert index.store("c") is None


def test_capacity_keeps_the_recent_prompts_and_whole_prefixes() -> None:
    index = PrefixIndex(block_size=1, capacity_blocks=64)
    prompts = [chain(p, *range(7)) for p in range(40)]  # 8 blocks each, 320 in all
    for hashes in prompts:
        index.insert(hashes, "a")
        assert index.match(hashes, ["a"]) == {"a": 8}  # the prompt just inserted is always held
        assert index.blocks("a") <= 64
    held = [index.match(hashes, ["a"])["a"] for hashes in prompts]
    assert held[-6:] == [8] * 6 and held[:20] == [0] * 20  # recent ones stay, old ones went, whole
    index.insert(prompts[-7], "a")  # touching an old-ish prompt keeps it over newer ones
    for hashes in prompts[:4]:
        index.insert(hashes, "a")
    assert index.match(prompts[-7], ["a"]) == {"a": 8}
    index._check(chains=prompts)


def test_a_continuation_joins_its_parent_and_never_outlives_it() -> None:
    """The defect of issue 8: a chain continuing a parent could stay after the parent was evicted."""
    index = PrefixIndex(block_size=1, capacity_blocks=32)
    stem = chain(*range(100, 104))
    index.insert(stem, "a")
    for p in range(3):  # the stem ages
        index.insert(chain(p, *range(6)), "a")
    tail = chain(*range(100, 110))[4:]
    index.insert(tail, "a", parent=stem[-1])  # what a KV event sends: the blocks after stem[-1]
    full = stem + tail
    assert index.match(full, ["a"]) == {"a": 10}
    for p in range(3, 12):  # the stem's generation is evicted, with its continuation
        index.insert(chain(p, *range(6)), "a")
        index._check(chains=[full])
        matched = index.match(full, ["a"])["a"]
        assert all(index.holds(h, "a") for h in full[:matched])
    assert index.match(full, ["a"]) == {"a": 0} and not any(index.holds(h, "a") for h in full)


@pytest.mark.parametrize("parent", [None, 900])
def test_a_chain_holding_a_block_under_another_parent_keeps_the_store_exact(parent: int | None) -> None:
    """Found by the long fault campaign: a KV event whose chain reaches a held block after blocks the store lacks
    (a block under two parents: no consistent hashing makes one) put that block in two generations."""
    for capacity in (None, 64):
        index = PrefixIndex(block_size=1, capacity_blocks=capacity)
        index.insert([900], "a")
        index.insert([1, 2, 3], "a")
        index.insert([50, 51], "a")
        index.insert([0, 1, 51], "a", parent=parent)  # 1 and 51 are held, each under another parent
        index._check(chains=[[1, 2, 3], [50, 51]])
        store = index.store("a")
        assert store is not None and store.open  # walked from now on: such a store can fool a binary search
        probe = [*([900] if parent else []), 0, 7777, 51]  # its last block is held, its third is not
        assert index.match(probe, ["a"]) == {"a": len(probe) - 2}
        assert index.match([1, 2, 3], ["a"]) == {"a": 3} and index.match([50, 51], ["a"]) == {"a": 2}
        full = [0, 1, 51] if parent is None else [900, 0, 1, 51]
        assert index.match(full, ["a"]) == {"a": len(full)}
        for p in range(200):  # every generation turns over: the store is exact again, and closed
            index.insert([10_000 + 10 * p + k for k in range(4)], "a")
            index._check()
        assert index.store("a") is store and (capacity is None or not store.open)


def test_an_insert_whose_parent_is_not_held_is_skipped_and_counted() -> None:
    for capacity in (None, 100):
        index = PrefixIndex(block_size=1, capacity_blocks=capacity)
        hashes = chain(1, 2, 3, 4)
        index.insert(hashes[2:], "a", parent=hashes[1])  # nothing held yet
        index.insert(hashes[:1], "a")
        index.insert(hashes[2:], "a", parent=hashes[1])  # block 1 still missing
        assert index.orphan_inserts == 2 and index.hashes("a") == {hashes[0]}
        index.insert(hashes[1:2], "a", parent=hashes[0])
        index.insert(hashes[2:], "a", parent=hashes[1])
        assert index.match(hashes, ["a"]) == {"a": 4} and index.orphan_inserts == 2
        index._check(chains=[hashes])


def test_predict_is_robust_to_a_stale_held_count() -> None:
    for capacity in (None, 100):
        index = PrefixIndex(block_size=1, capacity_blocks=capacity)
        hashes = chain(*range(10))
        index.insert(hashes[:1], "a")
        index.predict(hashes, "a", 2)  # says 2 are held, 1 is
        assert index.match(hashes, ["a"]) == {"a": 10} and index.blocks("a") == 10
        index.remove_backend("a")
        index.insert(hashes[:6], "a")
        index.predict(hashes, "a", 9)  # says 9 are held, 6 are
        assert index.match(hashes, ["a"]) == {"a": 10} and index.blocks("a") == 10
        index.remove(hashes[4:], "a")
        index.predict(hashes, "a", 1)  # says 1, 4 are
        assert index.match(hashes, ["a"]) == {"a": 10} and index.blocks("a") == 10
        index._check(chains=[hashes])


def test_predict_does_not_trust_a_held_count_that_points_into_another_chain() -> None:
    """predict() does not validate its hashes: a count whose last block is held under another root must not let
    the store skip this chain's root (it would list a root it does not hold)."""
    for capacity in (None, 100):
        index = PrefixIndex(block_size=1, capacity_blocks=capacity)
        index.insert([1, 2], "a")
        index.predict([9, 2, 3], "a", 2)
        assert index.hashes("a") == {1, 2, 3, 9}
        index._check()


def test_an_unbounded_stores_discard_counts_what_it_held_and_opens_only_on_a_removal() -> None:
    store = UnboundedStore([1, 2, 3], roots={1})
    assert not store.open  # blocks given without open=True are prefix-closed
    assert store.discard([99]) == 0 and not store.open
    assert store.discard([3, 99]) == 1 and store.open and store.size == 2  # it cannot tell a leaf from a hole
    store._check()
    assert store.discard([1, 2]) == 2 and not store.open and not store.roots  # empty: nothing to walk
    store._check()


def test_an_lru_store_walks_until_every_generation_alive_at_a_hole_is_evicted_and_no_longer() -> None:
    store = LRUStore(100, blocks=[1, 2, 3], roots={1})  # generation 0; new blocks go to generation 1
    store.put([7, 8], None)
    assert store.generation_sizes() == [3, 2] and not store.open
    assert store.discard([99]) == 0 and not store.open  # nothing removed: no hole
    assert store.discard([2, 99]) == 1 and store.open  # 3 is an orphan now
    assert store.match([555, 1]) == 0 and store.match([1, 2, 3]) == 1  # walked from block 0
    assert store.drop_oldest(1) == 2 and store.open  # generation 1 existed at the hole too
    assert store.generation_sizes() == [2]
    store._check()
    assert store.drop_oldest(1) == 2 and not store.open and len(store) == 0 and not store.roots
    assert store.generation_sizes() == [0]  # one generation to put into, and only one
    store._check()
    store.put([10, 11], None)  # an emptied store keeps a generation to put into
    assert store.match([10, 11]) == 2 and store.generation_sizes()[-1] == 2
    store._check()
    assert store.discard([10, 11]) == 2 and not store.open  # empty: nothing to walk
    store._check()


def test_a_prompt_whose_blocks_span_generations_matches_its_whole_run() -> None:
    index = PrefixIndex(block_size=1)
    hashes = chain(*range(20))
    index.insert(hashes[:7], "a")
    index.set_capacity("a", 100)  # the 7 blocks become one generation, without recency
    index.insert(hashes[:5], "a")  # a shorter prompt: its blocks move to the newest generation, 5 and 6 stay
    store = index.store("a")
    assert isinstance(store, LRUStore) and store.generation_sizes()[0] == 2 and not store.open
    assert index.match(hashes, ["a"]) == {"a": 7}
    index._check(chains=[hashes])


def test_predict_keeps_to_the_backends_own_capacity() -> None:
    index = PrefixIndex(block_size=1, capacity_blocks={"a": 4})
    index.insert([1, 2], "a")
    index.predict(chain(*range(6)), "a", 0)  # more blocks than "a" keeps: its engine would refuse the prompt
    assert index.hashes("a") == {1, 2}


def test_a_one_dimensional_memoryview_of_hashes_is_a_sequence_and_a_two_dimensional_one_is_not() -> None:
    index = PrefixIndex(block_size=1)
    hashes = chain(*range(4))
    packed = memoryview(array("Q", hashes))
    index.predict(packed, "a", 0)
    assert index.match(packed, ["a"]) == {"a": 4}
    batch = packed.cast("B").cast("Q", [2, 2])  # two prompts' hashes, not one's
    with pytest.raises(TypeError, match="sequence"):
        index.match(batch, ["a"])
    with pytest.raises(TypeError, match="sequence"):
        index.predict(batch, "a", 0)


def test_set_capacity_none_returns_to_the_default() -> None:
    index = PrefixIndex(block_size=1, capacity_blocks=20)
    index.set_capacity("a", 100)
    for p in range(10):
        index.insert(chain(p, *range(7)), "a")
    assert index.blocks("a") == 80
    index.set_capacity("a", None)  # back to the default of 20, not unbounded
    assert index.capacity("a") == 20 and index.blocks("a") <= 20
    index._check()
    unbounded = PrefixIndex(block_size=1, capacity_blocks={"a": 5})
    unbounded.insert(chain(*range(4)), "a")
    unbounded.set_capacity("a", None)  # no default: unbounded
    assert unbounded.capacity("a") is None and isinstance(unbounded.store("a"), UnboundedStore)
    unbounded.insert(chain(*range(40)), "a")
    assert unbounded.blocks("a") == 40
    unbounded._check()


def test_a_capacity_set_after_blocks_exist_keeps_the_fast_path() -> None:
    """What a metrics poller does on its first scrape; it used to switch binary search off for good."""
    index = PrefixIndex(block_size=1)
    prompts = [chain(p, *range(7)) for p in range(4)]
    for hashes in prompts:
        index.insert(hashes, "a")
    index.set_capacity("a", 1000)
    store = index.store("a")
    assert isinstance(store, LRUStore) and not store.open
    assert all(index.match(hashes, ["a"]) == {"a": 8} for hashes in prompts)
    index.set_capacity("a", 12)  # fewer than held: the store evicts whole generations, still without holes
    assert index.blocks("a") <= 12 and not store.open
    index._check(chains=prompts)


def test_a_capacity_below_an_unbounded_stores_size_leaves_holes_that_heal() -> None:
    index = PrefixIndex(block_size=1)
    prompts = [chain(p, *range(7)) for p in range(4)]
    for hashes in prompts:
        index.insert(hashes, "a")
    index.set_capacity("a", 20)  # a set has no order: 12 arbitrary blocks go
    store = index.store("a")
    assert isinstance(store, LRUStore) and store.open and index.blocks("a") == 20
    for hashes in prompts:  # match walks: it never counts past a missing block
        matched = index.match(hashes, ["a"])["a"]
        assert all(index.holds(h, "a") for h in hashes[:matched])
        assert matched == len(hashes) or not index.holds(hashes[matched], "a")
    for p in range(10, 20):  # the generation that held the orphans is evicted: binary search again
        index.insert(chain(p, *range(7)), "a")
        index.insert(chain(10, *range(7)), "a")  # a recurring prompt stored again contradicts nothing
    assert not store.open
    index._check(chains=prompts)


def test_holes_in_an_unbounded_store_are_walked() -> None:
    index = PrefixIndex(block_size=1)
    hashes = chain(*range(10))
    index.insert(hashes, "a")
    index.remove(hashes[3:4], "a")
    store = index.store("a")
    assert store is not None and store.open and index.match(hashes, ["a"]) == {"a": 3}
    index.predict(hashes, "a", 3)  # filling the hole makes the whole chain usable again
    assert index.match(hashes, ["a"]) == {"a": 10}


@pytest.mark.skipif(sys.implementation.name != "cpython", reason="CPython's set table")
def test_room_is_how_many_blocks_a_set_takes_before_its_table_grows() -> None:
    """What LRUStore.put() reads to start a generation before the newest one's set would grow its table."""
    blocks: set[int] = set()
    for block in range(20_000):
        room, size = _room(blocks), sys.getsizeof(blocks)
        blocks.add(block)
        assert (sys.getsizeof(blocks) > size) == (room == 0), (block, room)


def test_zero_capacity_holds_nothing() -> None:
    index = PrefixIndex(block_size=1, capacity_blocks=0)
    index.insert(chain(1, 2), "a")
    assert len(index) == 0 and index.backends() == []
    index._check()


@pytest.mark.parametrize("capacity", [-1, 1.5, "10", True])
def test_bad_capacity_is_a_configuration_error(capacity: object) -> None:
    with pytest.raises(ConfigurationError, match="capacity"):
        PrefixIndex(capacity_blocks=capacity)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="capacity"):
        PrefixIndex().set_capacity("a", capacity)  # type: ignore[arg-type]


def test_remove_backend_returns_the_detached_store_clear_len_and_backends() -> None:
    index = PrefixIndex(block_size=1, capacity_blocks={"b": 10})
    index.insert(chain(1, 2), "a")
    index.insert(chain(1, 2, 3), "b")
    assert len(index) == 5 and index.backends() == ["a", "b"]
    assert index.holds(chain(1)[0], "a") and not index.holds(chain(3)[0], "a")
    detached = index.remove_backend("a")
    assert set(detached) == set(chain(1, 2)) and len(detached) == 2  # the caller frees it outside its lock
    assert index.backends() == ["b"] and index.blocks("a") == 0 and index.hashes("a") == set()
    assert set(index.remove_backend("b")) == set(chain(1, 2, 3)) and index.remove_backend("b") == ()
    assert index.capacity("b") == 10  # a setting, kept
    index.insert(chain(1), "c")
    index.clear()
    assert len(index) == 0 and index.backends() == []
    index._check()


def test_apply_updates_stores_and_removes_in_order() -> None:
    index = PrefixIndex(block_size=1)
    hashes = chain(1, 2, 3)
    apply_updates(index, "a", [(True, hashes[:1], None), (True, hashes[1:], hashes[0]), (False, hashes[2:], None)])
    assert index.match(hashes, ["a"]) == {"a": 2}


def test_an_update_may_continue_block_hash_zero_but_no_parent_past_64_bits() -> None:
    assert check_update((True, [5], 0)) == (True, [5], 0)
    index = PrefixIndex(block_size=1)
    index.insert([0], "a")
    index.insert([5], "a", parent=0)
    assert index.match([0, 5], ["a"]) == {"a": 2} and index.orphan_inserts == 0
    for parent in (-1, 2**64, 3**64):
        with pytest.raises(InvalidEventError, match="parent"):
            check_update((True, [5], parent))
        with pytest.raises(InvalidEventError, match="parent"):
            index.insert([6], "a", parent=parent)
    assert index.hashes("a") == {0, 5} and index.orphan_inserts == 0


def test_the_eviction_hook_is_called_with_the_excess_and_its_result_enforced() -> None:
    calls: list[tuple[str, int]] = []

    class Lazy(PrefixIndex):
        def evict(self, backend: str, store: LRUStore, excess: int) -> int:
            calls.append((backend, excess))
            return 0  # does nothing: the index still keeps the capacity

    index = Lazy(block_size=1, capacity_blocks=10)
    for p in range(5):
        index.insert(chain(p, 1, 2, 3), "a")
    assert calls and all(backend == "a" and excess > 0 for backend, excess in calls)
    assert index.blocks("a") <= 10
    calls.clear()
    index.set_capacity("a", index.blocks("a"))  # exactly full: nothing over
    assert calls == []
    index._check()


@pytest.mark.parametrize("capacity", [None, 400_000])
def test_memory_per_entry_is_bounded(capacity: int | None) -> None:
    """Not a timing: a structural bound, so a design that stores much more per entry fails here."""
    index = PrefixIndex(block_size=1, capacity_blocks=capacity)
    hashes = chain(*range(20_000))
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for backend in ("a", "b"):
        index.insert(hashes, backend)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert used / len(index) < 120


def test_a_bound_keeps_a_backend_without_a_capacity_to_that_many_blocks_and_is_not_a_capacity() -> None:
    index = PrefixIndex(block_size=1, bound_blocks=64)
    for root in range(100):
        index.predict([1000 * root + i for i in range(8)], "gpu0", 0)
    assert 0 < index.blocks("gpu0") <= 64 and index.capacity("gpu0") is None and index.bound_blocks == 64
    newest = [99_000 + i for i in range(8)]
    assert index.match(newest, ["gpu0"]) == {"gpu0": 8}  # least recently used first out
    index.set_capacity("gpu0", 16)  # a known capacity wins
    assert index.blocks("gpu0") <= 16 and index.capacity("gpu0") == 16
    index.set_capacity("gpu0", None)  # back to the bound: still an LRU store, still bounded
    assert isinstance(index.store("gpu0"), LRUStore)
    for root in range(100, 200):
        index.insert([1000 * root + i for i in range(8)], "gpu0")
    assert index.blocks("gpu0") <= 64
    index._check()
    assert PrefixIndex().bound_blocks is None  # the class alone: unbounded, as an index fed by KV events wants
    for bad in (-1, True, 2.5, "64"):
        with pytest.raises(ConfigurationError, match="bound_blocks"):
            PrefixIndex(bound_blocks=bad)  # type: ignore[arg-type]


def test_a_router_that_never_learns_capacities_keeps_its_memory_bounded() -> None:
    """A gateway that routes unique prompts for ever with no capacity known (no metrics, no events): before, its
    index held every block it ever predicted (~100 bytes each), without end."""
    router = Router(block_size=1)
    assert router.index.bound_blocks == DEFAULT_BOUND_BLOCKS
    for n in range(300):
        decision = router.route(list(range(n * 1000, n * 1000 + 1000)), ["gpu0"])
        assert decision.candidates[0].capacity_blocks is None  # policies see no capacity
    assert router.index.blocks("gpu0") <= DEFAULT_BOUND_BLOCKS < 300_000
    assert router.route(list(range(299_000, 300_000)), ["gpu0"]).matched_tokens == 1000  # the newest is held


@pytest.mark.parametrize("generations", [0, -1, 2.5, "16", None, True])
def test_a_subclass_generations_is_checked_when_the_index_is_made(generations: object) -> None:
    """``PrefixIndex.generations`` is a documented option of a subclass: a bad one is refused by the constructor,
    not by the first route that makes a bounded store (which raised from inside Router.route)."""

    class Custom(PrefixIndex):
        pass

    Custom.generations = generations  # type: ignore[assignment]
    with pytest.raises(ConfigurationError, match="generations"):
        Custom(capacity_blocks=100)
    with pytest.raises(ConfigurationError, match="generations"):
        Custom()  # a capacity may come later (set_capacity, a Fleet's num_gpu_blocks)


def test_a_subclass_generations_sets_each_bounded_store() -> None:
    class Fine(PrefixIndex):
        generations = 4

    index = Fine(capacity_blocks=100)
    index.insert([1, 2, 3], "a")
    store = index.store("a")
    assert isinstance(store, LRUStore) and store.generations == 4
    unbounded = Fine()
    unbounded.insert([1, 2, 3], "a")
    unbounded.set_capacity("a", 50)  # its unbounded store becomes a bounded one
    store = unbounded.store("a")
    assert isinstance(store, LRUStore) and store.generations == 4
