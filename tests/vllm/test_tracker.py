"""Events → own hashes: re-hashing, reference counts, filters, and convergence with a fake engine's true cache."""

from __future__ import annotations

import itertools
import logging
import random
import re
from collections.abc import Sequence

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixroute import BlockHasher, PrefixIndex
from prefixroute.errors import ConfigurationError, InvalidEventError, StateError
from prefixroute.index import apply_updates
from prefixroute.testing import FakeBlockCache
from prefixroute.vllm import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    BlockTracker,
    KVCacheEvent,
    TrackerStats,
    lora_namespace,
)
from prefixroute.vllm.events import ExternalBlockHash

TOKENS = list(range(100, 164))  # four 16-token blocks


def own(tokens: list[int], namespace: str | None = None, block_size: int = 16) -> list[int]:
    return list(BlockHasher(block_size, namespace=namespace).hash(tokens))


def test_stored_blocks_are_rehashed_with_prefixroutes_hasher_continuing_from_the_parent() -> None:
    tracker = BlockTracker()
    tracker.apply([BlockStored([11, 12], None, TOKENS[:32], 16)])
    tracker.apply([BlockStored([13, 14], 12, TOKENS[32:], 16)])
    assert tracker.held() == set(own(TOKENS))


def test_a_hash_stored_twice_is_held_until_removed_twice() -> None:
    tracker = BlockTracker()
    ops = tracker.apply([BlockStored([11], None, TOKENS[:16], 16), BlockStored([11], None, TOKENS[:16], 16)])
    assert ops == [(True, own(TOKENS[:16]), None)]  # the index hears of it once
    assert tracker.apply([BlockRemoved([11])]) == []
    assert tracker.held() == set(own(TOKENS[:16]))
    assert tracker.apply([BlockRemoved([11])]) == [(False, own(TOKENS[:16]), None)]
    assert tracker.held() == set()
    assert tracker.apply([BlockRemoved([11])]) == [] and tracker.stats.unknown_removals == 1


def test_a_removal_naming_blocks_never_held_still_removes_the_ones_held() -> None:
    """vLLM removes blocks the tracker never indexed (multimodal ones, ones stored before it started) in the same
    event as indexed ones: those must go all the same."""
    tracker = BlockTracker()
    tracker.apply([BlockStored([11, 12, 13], None, TOKENS[:48], 16)])
    ((stored, dead, parent),) = tracker.apply([BlockRemoved([99, 13, 98, 12])])
    assert (stored, set(dead), parent) == (False, set(own(TOKENS[:48])[1:]), None)
    assert tracker.held() == set(own(TOKENS[:16])) and tracker.stats.unknown_removals == 2


def test_stats_count_every_event_and_block_exactly_across_applies() -> None:
    """Each stored block is counted once, as stored, skipped or orphaned (an operator adds them up to see where the
    engine's blocks went); each removed block once, as removed, unknown or skipped."""
    tracker = BlockTracker()
    for _ in range(2):
        tracker.apply(
            [
                BlockStored([11, 12], None, TOKENS[:32], 16, extra_keys=[None, ["mm"]]),  # block 12 is skipped
                BlockStored([13], 12, TOKENS[32:48], 16),  # an orphan: its parent was not indexed
                BlockStored([14, 15], 99, TOKENS[:32], 16, extra_keys=[None, ["mm"]]),  # an orphan, then skipped
                BlockStored([21], None, TOKENS[:16], 16, medium="CPU"),  # skipped
                BlockRemoved([11, 12, 13]),  # 12 and 13 unknown
                BlockRemoved([21], medium="CPU"),  # skipped
                AllBlocksCleared(),
            ]
        )
    assert tracker.stats == TrackerStats(
        blocks_stored=2, blocks_removed=2, clears=2, orphan_blocks=4, unknown_removals=4, skipped_blocks=8
    )


def test_stores_carry_the_own_hash_of_the_block_they_continue() -> None:
    tracker = BlockTracker()
    hashes = own(TOKENS)
    assert tracker.apply([BlockStored([11, 12], None, TOKENS[:32], 16)]) == [(True, hashes[:2], None)]
    assert tracker.apply([BlockStored([13, 14], 12, TOKENS[32:], 16)]) == [(True, hashes[2:], hashes[1])]


def test_a_chain_with_a_block_already_held_is_stored_as_runs_each_with_its_parent() -> None:
    tracker = BlockTracker()
    hashes = own(TOKENS)
    tracker.apply([BlockStored([11], None, TOKENS[:16], 16), BlockStored([13], 12, TOKENS[32:48], 16)])  # 13 orphan
    tracker.apply([BlockStored([11, 12], None, TOKENS[:32], 16)])
    tracker.apply([BlockRemoved([11])])  # block 0's first copy goes; the second (from the last store) stays
    ops = tracker.apply([BlockStored([21, 22, 23], None, TOKENS[:48], 16)])
    assert ops == [(True, hashes[2:3], hashes[1])]  # blocks 0 and 1 are still held: only block 2 is new
    tracker.apply([BlockRemoved([12]), BlockRemoved([22])])  # block 1 is gone, blocks 0 and 2 stay
    assert tracker.held() == {hashes[0], hashes[2]}
    ops = tracker.apply([BlockStored([31, 32, 33, 34], None, TOKENS, 16)])
    assert ops == [(True, hashes[1:2], hashes[0]), (True, hashes[3:4], hashes[2])]


def test_blocks_whose_parent_is_unknown_are_skipped() -> None:
    tracker = BlockTracker()
    assert tracker.apply([BlockStored([13], 12, TOKENS[16:32], 16)]) == []
    assert tracker.stats.orphan_blocks == 1 and tracker.held() == set()


def test_only_gpu_full_attention_groups_are_indexed() -> None:
    tracker = BlockTracker()
    tracker.apply(
        [
            BlockStored([11], None, TOKENS[:16], 16, group_idx=0, kv_cache_spec_kind="full_attention"),
            BlockStored([11], None, TOKENS[:16], 16, group_idx=1, kv_cache_spec_kind="sliding_window"),
            BlockStored([21], None, TOKENS[16:32], 16, medium="CPU"),
        ]
    )
    assert tracker.held() == set(own(TOKENS[:16]))
    assert tracker.apply([BlockRemoved([11], group_idx=1), BlockRemoved([11], medium="CPU")]) == []
    assert tracker.held() == set(own(TOKENS[:16]))
    assert tracker.apply([BlockRemoved([11], group_idx=0)]) == [(False, own(TOKENS[:16]), None)]


def test_groups_and_media_that_are_not_indexed_are_skipped_whatever_their_block_size() -> None:
    """A hybrid model's Mamba or sliding-window group, or an offloading connector's CPU tier, may use a block size
    the router's does not divide: those blocks are not indexed anyway, so they are skipped, not invalid."""
    tracker = BlockTracker(block_size=16)
    ops = tracker.apply(
        [
            BlockStored([41], None, list(range(24)), 24, group_idx=1, kv_cache_spec_kind="mamba"),
            BlockStored([42], None, list(range(200)), 200, medium="CPU"),
            BlockStored([43], None, list(range(10)), 24, group_idx=1, kv_cache_spec_kind="sliding_window"),
            BlockStored([11], None, TOKENS[:16], 16, group_idx=0, kv_cache_spec_kind="full_attention"),
        ]
    )
    assert ops == [(True, own(TOKENS[:16]), None)]
    assert tracker.stats.invalid_events == 0 and tracker.stats.skipped_blocks == 3
    assert tracker.apply([BlockRemoved([41], group_idx=1), BlockRemoved([42], medium="CPU")]) == []
    assert tracker.stats.unknown_removals == 0


def test_a_lora_block_named_only_by_its_id_does_not_stop_removals_in_its_group() -> None:
    """Was: such a block (not indexed: no adapter name to hash it under) in the full-attention group marked that group
    as one not indexed, so every later removal in it was ignored and the index kept evicted blocks for good."""
    tracker = BlockTracker()
    tracker.apply([BlockStored([11], None, TOKENS[:16], 16, group_idx=0, kv_cache_spec_kind="full_attention")])
    unnamed = BlockStored([21], None, TOKENS[16:32], 16, lora_id=3, group_idx=0, kv_cache_spec_kind="full_attention")
    assert tracker.apply([unnamed]) == [] and tracker.stats.skipped_blocks == 1
    assert tracker.apply([BlockRemoved([11], group_idx=0)]) == [(False, own(TOKENS[:16]), None)]
    assert tracker.apply([BlockRemoved([21], group_idx=0)]) == [] and tracker.held() == set()


def test_blocks_with_extra_keys_end_the_indexed_chain() -> None:
    tracker = BlockTracker()
    tracker.apply([BlockStored([11, 12, 13], None, TOKENS[:48], 16, extra_keys=[None, ["mm-hash"], None])])
    assert tracker.held() == set(own(TOKENS[:16]))


def test_a_lora_adapter_goes_into_the_namespace() -> None:
    tracker = BlockTracker(namespace="llama")
    tracker.apply([BlockStored([11], None, TOKENS[:16], 16, lora_name="sql")])
    assert lora_namespace("llama", "sql") == "llama:sql" and lora_namespace(None, "sql") == "sql"
    assert tracker.held() == set(own(TOKENS[:16], namespace="llama:sql"))
    assert tracker.held().isdisjoint(own(TOKENS[:16], namespace="llama"))


@pytest.mark.parametrize("strict", [False, True])
def test_an_adapter_name_with_a_lone_surrogate_hashes_under_a_bytes_namespace_as_under_a_str_one(strict: bool) -> None:
    # Was a bare UnicodeEncodeError from the middle of apply(): the events before it were in the tracker, and the
    # updates that would have given them to the index were lost (apply_strict is documented all-or-nothing).
    odd = "sql\ud800"
    tracker = BlockTracker(namespace=b"llama")
    apply = tracker.apply_strict if strict else tracker.apply
    ops = apply([BlockStored([11], None, TOKENS[:16], 16), BlockStored([12], None, TOKENS[16:32], 16, lora_name=odd)])
    assert lora_namespace(b"llama", odd) == b"llama:sql\xed\xa0\x80"
    assert ops == [
        (True, own(TOKENS[:16], namespace="llama"), None),
        (True, own(TOKENS[16:32], namespace=f"llama:{odd}"), None),
    ]
    assert tracker.held() == {h for _, hashes, _ in ops for h in hashes} and tracker.stats.invalid_events == 0


def test_ever_new_lora_names_keep_a_bounded_set_of_hashers_and_hash_alike() -> None:
    tracker = BlockTracker(namespace="llama")
    for n in range(2000):
        tracker.apply([BlockStored([n], None, TOKENS[:16], 16, lora_name=f"adapter-{n}")])
    assert len(tracker._hashers) <= 256
    again = tracker.apply([BlockStored([5000], None, TOKENS[16:32], 16, lora_name="adapter-0")])  # made again
    assert [hashes for _, hashes, _ in again] == [own(TOKENS[16:32], "llama:adapter-0")]


def test_a_lora_blocks_extra_keys_naming_only_its_adapter_do_not_stop_the_chain() -> None:
    """vLLM puts a LoRA request's adapter name in every block's extra keys; the namespace already covers it."""
    tracker = BlockTracker(namespace="llama")
    ops = tracker.apply(
        [
            BlockStored([11, 12], None, TOKENS[:32], 16, lora_id=1, lora_name="sql", extra_keys=[["sql"], ["sql"]]),
            BlockStored([13], 12, TOKENS[32:48], 16, lora_id=1, lora_name="sql", extra_keys=[["sql", ["mm", 0]]]),
            BlockStored([21], None, TOKENS[:16], 16, lora_id=2, lora_name="sql", extra_keys=[["other"]]),
            BlockStored([31], None, TOKENS[:16], 16, extra_keys=[["sql"]]),  # no adapter: a salt
        ]
    )
    assert ops == [(True, own(TOKENS[:32], namespace="llama:sql"), None)]
    assert tracker.stats.skipped_blocks == 3


@pytest.mark.parametrize(
    ("keys", "lora_id", "indexed"),
    [
        (None, 7, True),
        ([], 7, True),
        (["sql"], 7, True),  # the adapter's name
        ([7], 7, True),  # its id, as older vLLM sends it
        ([{"type": "lora", "name": "sql"}], 7, True),  # newer vLLM's typed LoRAKey
        (["other"], 7, False),
        ([8], 7, False),  # another adapter's id
        ([None], None, False),
        ([["sql"]], 7, False),  # a list holding the name is not the name
        (["sql", "mm-hash"], 7, False),  # the adapter and a multimodal input
        ([{"type": "lora", "name": "other"}], 7, False),
        ([{"type": "mm", "name": "sql"}], 7, False),
        ([{"name": "sql"}], 7, False),
        ([{"type": "lora", "name": "sql", "salt": "x"}], 7, False),
    ],
)
def test_only_extra_keys_that_name_just_the_blocks_adapter_keep_its_chain_indexed(
    keys: list[object] | None, lora_id: int | None, indexed: bool
) -> None:
    """Any other extra key (a multimodal input, a salt, another adapter) changes what the block caches, which its
    token ids do not say: indexing it would claim a cache a plain prompt cannot reuse."""
    tracker = BlockTracker(namespace="llama")
    ops = tracker.apply([BlockStored([11, 12], None, TOKENS[:32], 16, lora_id=lora_id, lora_name="sql",
                                     extra_keys=[keys, keys])])  # fmt: skip
    assert ops == ([(True, own(TOKENS[:32], namespace="llama:sql"), None)] if indexed else [])
    assert tracker.stats.skipped_blocks == (0 if indexed else 2) and tracker.stats.invalid_events == 0


def test_a_lora_block_under_a_bytes_namespace_hashes_as_lora_namespace_says() -> None:
    tracker = BlockTracker(namespace=b"llama")
    tracker.apply([BlockStored([11], None, TOKENS[:16], 16, lora_name="sql")])
    assert lora_namespace(b"llama", "sql") == b"llama:sql"
    assert tracker.held() == set(own(TOKENS[:16], namespace="llama:sql"))


@pytest.mark.parametrize("vllm_block_size", [0, -16])
def test_a_vllm_block_size_that_is_not_positive_is_an_invalid_event(vllm_block_size: int) -> None:
    # Was: "... configure the router with block_size=0", a setting that does not exist.
    with pytest.raises(InvalidEventError) as refused:
        BlockTracker().apply_strict([BlockStored([], None, [], vllm_block_size)])
    assert str(refused.value) == f"vLLM's block size {vllm_block_size} is not positive: the event is corrupt"


def test_one_token_blocks_are_blocks_like_any_other() -> None:
    tracker = BlockTracker(block_size=1)
    assert tracker.apply_strict([BlockStored([11, 12], None, [5, 6], 1)]) == [(True, own([5, 6], block_size=1), None)]


def test_a_larger_vllm_block_maps_to_several_own_blocks() -> None:
    tracker = BlockTracker(block_size=16)
    tracker.apply([BlockStored([11], None, TOKENS[:32], 32), BlockStored([12], 11, TOKENS[32:], 32)])
    assert tracker.held() == set(own(TOKENS))
    assert tracker.apply([BlockRemoved([12])]) == [(False, own(TOKENS)[2:], None)]


def test_an_engine_that_keeps_sending_garbage_is_logged_sparsely_and_counted_exactly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tracker = BlockTracker()
    with caplog.at_level(logging.DEBUG, logger="prefixroute"):
        for _ in range(100):  # a block size the router's does not divide, on every event
            tracker.apply([BlockStored([11], None, TOKENS[:8], 8)])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 7  # the 1st, 2nd, 4th, ... 64th
    assert warnings[-1].startswith("skipping a KV event (64 invalid so far): vLLM's block size 8 is not a positive")
    assert tracker.stats.invalid_events == 100


def test_the_groups_not_indexed_that_a_tracker_keeps_are_bounded() -> None:
    """An engine naming a new KV cache group in every event cannot grow the tracker without end."""
    tracker = BlockTracker(block_size=16)
    tracker.apply([BlockStored([i], None, TOKENS[:16], 16, group_idx=i, kv_cache_spec_kind="mamba")
                   for i in range(5000)])  # fmt: skip
    assert len(tracker._skipped_groups) == 1024 and tracker.stats.skipped_blocks == 5000
    assert tracker.apply([BlockRemoved([1], group_idx=1), BlockRemoved([4999], group_idx=4999)]) == []
    assert tracker.stats.skipped_blocks == 5001 and tracker.stats.unknown_removals == 1


def test_invalid_events_are_counted_and_skipped_or_raised_in_strict_mode() -> None:
    tracker = BlockTracker()
    bad_count = BlockStored([11, 12], None, TOKENS[:16], 16)
    bad_size = BlockStored([11], None, TOKENS[:8], 8)
    bad_token = BlockStored([11], None, [-1] * 16, 16)
    good = BlockStored([31], None, TOKENS[:16], 16)
    tracker.apply([bad_count, bad_size, bad_token, good])
    assert tracker.stats.invalid_events == 3 and tracker.held() == set(own(TOKENS[:16]))
    with pytest.raises(InvalidEventError, match="carries 16 token ids for 2 blocks of 16 tokens; vLLM sends exactly"):
        BlockTracker().apply_strict([bad_count])
    with pytest.raises(InvalidEventError, match="block_size=8"):
        BlockTracker().apply_strict([bad_size])
    with pytest.raises(InvalidEventError, match=r"\[0, 2\*\*32\)"):
        BlockTracker().apply_strict([bad_token])


_HOW_TO_FIX = ": build events with vLLM's field types, or decode them with EventDecoder, which checks them"


@pytest.mark.parametrize(
    ("event", "message"),
    [
        (
            BlockStored([[1]], None, TOKENS[:16], 16),  # type: ignore[list-item]
            "BlockStored.block_hashes must be a list of int or bytes hashes, not [1]",
        ),
        (
            BlockStored([True], None, TOKENS[:16], 16),
            "BlockStored.block_hashes must be a list of int or bytes hashes, not True",
        ),
        (
            BlockStored(11, None, TOKENS[:16], 16),  # type: ignore[arg-type]
            "BlockStored.block_hashes must be a list of int or bytes hashes, not 11",
        ),
        (
            BlockStored([1], [2], TOKENS[:16], 16),  # type: ignore[arg-type]
            "BlockStored.parent_block_hash must be an int or bytes hash or None, not [2]",
        ),
        (
            BlockStored([1], None, "x" * 16, 16),  # type: ignore[arg-type]
            "BlockStored.token_ids must be a list of token ids, not 'xxxxxxxxxxxxxxxx'",
        ),
        (
            BlockStored([1], None, TOKENS[:16], "16"),  # type: ignore[arg-type]
            "BlockStored.block_size must be an int, not '16'",
        ),
        (
            BlockStored([1], None, TOKENS[:16], 16, medium=5),  # type: ignore[arg-type]
            "BlockStored.medium must be a str or None, not 5",
        ),
        (
            BlockStored([1], None, TOKENS[:16], 16, lora_name=3),  # type: ignore[arg-type]
            "BlockStored.lora_name must be a str or None, not 3",
        ),
        (
            BlockStored([1], None, TOKENS[:16], 16, lora_id="3"),  # type: ignore[arg-type]
            "BlockStored.lora_id must be an int or None, not '3'",
        ),
        (
            BlockStored([1], None, TOKENS[:16], 16, extra_keys="k"),  # type: ignore[arg-type]
            "BlockStored.extra_keys must be a list or None, not 'k'",
        ),
        (
            BlockStored([1], None, TOKENS[:16], 16, group_idx=[0]),  # type: ignore[arg-type]
            "BlockStored.group_idx must be an int or None, not [0]",
        ),
        (
            BlockStored([1], None, TOKENS[:16], 16, kv_cache_spec_kind=5),  # type: ignore[arg-type]
            "BlockStored.kv_cache_spec_kind must be a str or None, not 5",
        ),
        (
            BlockRemoved([[1]]),  # type: ignore[list-item]
            "BlockRemoved.block_hashes must be a list of int or bytes hashes, not [1]",
        ),
        (
            BlockRemoved([1], medium=5),  # type: ignore[arg-type]
            "BlockRemoved.medium must be a str or None, not 5",
        ),
        (
            BlockRemoved([1], group_idx="0"),  # type: ignore[arg-type]
            "BlockRemoved.group_idx must be an int or None, not '0'",
        ),
    ],
)
def test_hand_built_events_with_mistyped_fields_are_invalid_events_and_change_nothing(
    event: BlockStored | BlockRemoved, message: str
) -> None:
    """msgspec checks decoded events; an event built by hand is checked by the tracker, before it changes anything,
    and the error names the field, the type it must have, the value refused and how to build it right."""
    tracker = BlockTracker()
    tracker.apply([BlockStored([1], None, TOKENS[:16], 16)])
    with pytest.raises(InvalidEventError) as refused:
        tracker.apply_strict([event])
    assert str(refused.value) == message + _HOW_TO_FIX
    assert tracker.apply([event]) == [] and tracker.stats.invalid_events == 1
    assert tracker.held() == set(own(TOKENS[:16]))
    assert tracker.apply([BlockRemoved([1])]) == [(False, own(TOKENS[:16]), None)]


class _Hash(int):
    """A hash type of the user's own (an int subclass), which hand-built events may use as vLLM's ints."""


def test_hand_built_events_may_use_tuples_and_int_subclasses_as_vllms_lists_and_ints() -> None:
    tracker = BlockTracker()
    ops = tracker.apply_strict(
        [
            BlockStored((_Hash(11),), None, tuple(TOKENS[:16]), 16, extra_keys=(None,)),  # type: ignore[arg-type]
            BlockStored((b"\x0c",), _Hash(11), tuple(TOKENS[16:32]), 16),  # type: ignore[arg-type]
        ]
    )
    assert ops == [(True, own(TOKENS[:16]), None), (True, own(TOKENS[:32])[1:], own(TOKENS[:16])[0])]
    assert tracker.apply_strict([BlockRemoved((b"\x0c", _Hash(11)))]) and tracker.held() == set()  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("events", "message"),
    [
        ("abc", "events must be an iterable of KV events, not str"),
        (None, "events must be an iterable of KV events, not NoneType"),
        (5, "events must be an iterable of KV events, not int"),
        ([1], "event 0 is of type int, not a BlockStored, BlockRemoved or AllBlocksCleared (EventDecoder.decode() "),
        ([AllBlocksCleared(), "x"], "event 1 is of type str, not a BlockStored"),
    ],
)
def test_what_is_not_an_iterable_of_events_is_a_type_error_before_any_applies(events: object, message: str) -> None:
    tracker = BlockTracker()
    tracker.apply([BlockStored([1], None, TOKENS[:16], 16)])
    for apply in (tracker.apply, tracker.apply_strict):
        with pytest.raises(TypeError, match=re.escape(message)):
            apply(events)  # type: ignore[arg-type]
    assert tracker.held() == set(own(TOKENS[:16])) and tracker.stats.clears == 0


def test_lora_namespace_refuses_what_is_not_a_name() -> None:
    with pytest.raises(TypeError, match="namespace must be a str, bytes or None, not int"):
        lora_namespace(5, "sql")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=re.escape("lora_name must be the adapter's name (a str) or None, not int")):
        lora_namespace("llama", 5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "bad",
    [
        BlockStored([21], None, [-1] * 16, 16),  # a token id out of range
        BlockStored([21, 22], None, TOKENS[:16], 16),  # too few token ids
        BlockStored([21], None, TOKENS[:8], 8),  # a block size the router's does not divide
        BlockRemoved(["x"]),  # type: ignore[list-item]
    ],
)
def test_strict_mode_is_all_or_nothing(bad: BlockStored | BlockRemoved) -> None:
    """The events before the invalid one used to change the tracker while their updates were lost with the error."""
    tracker = BlockTracker()
    with pytest.raises(InvalidEventError):
        tracker.apply_strict([BlockStored([11, 12], None, TOKENS[:32], 16), AllBlocksCleared(), bad])
    assert tracker.held() == set() and tracker.stats.clears == 0 and tracker.stats.blocks_stored == 0
    ops = tracker.apply_strict([BlockStored([11, 12], None, TOKENS[:32], 16)])
    assert ops == [(True, own(TOKENS[:32]), None)]


def test_all_blocks_cleared_removes_everything() -> None:
    tracker = BlockTracker()
    tracker.apply([BlockStored([11, 12], None, TOKENS[:32], 16)])
    assert tracker.apply([AllBlocksCleared()]) == [(False, own(TOKENS[:32]), None)]
    assert tracker.held() == set() and tracker.stats.clears == 1
    assert tracker.apply([AllBlocksCleared()]) == []  # nothing held: nothing for the index to do


STEMS = [[random.Random(stem).randrange(1000) for _ in range(128)] for stem in range(3)]
operations = st.lists(
    st.tuples(
        st.sampled_from(["complete", "complete", "complete", "twin", "hold", "finish", "clear", "restart"]),
        st.integers(0, 2**31),
    ),
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(operations, st.sampled_from([16, 32]), st.booleans(), st.booleans(), st.booleans())
def test_tracker_and_index_equal_the_engines_true_cache_after_every_step(
    steps: list[tuple[str, int]], engine_block: int, byte_hashes: bool, extra_group: bool, noisy: bool
) -> None:
    run_and_compare(steps, engine_block, byte_hashes, extra_group, noisy)


@pytest.mark.parametrize("seed", range(6))
def test_seeded_stress_with_duplicates_evictions_and_clears(seed: int) -> None:
    rng = random.Random(seed)
    actions = ["complete", "complete", "twin", "twin", "hold", "finish", "clear", "restart"]
    steps = [(rng.choice(actions), rng.randrange(2**31)) for _ in range(150)]
    run_and_compare(steps, rng.choice([16, 32]), seed % 2 == 0, seed % 3 == 0, seed < 3)


class BusierEngine:
    """Rewrites a fake cache's events as an engine that also offloads to CPU and serves multimodal prompts sends
    them: the removals between two stores in one event per group, a multimodal block (not indexed) stored now and
    then and evicted among later removals, and each event followed by its CPU tier's copy. None of it may change
    the index."""

    def __init__(self) -> None:
        self.made = itertools.count()
        self.multimodal: list[ExternalBlockHash] = []  # stored, not yet evicted

    def send(self, events: Sequence[KVCacheEvent], rng: random.Random) -> list[KVCacheEvent]:
        merged: list[KVCacheEvent] = []
        removals: dict[tuple[str | None, int | None], BlockRemoved] = {}  # the current run's, per medium and group
        for event in events:
            if not isinstance(event, BlockRemoved):
                merged.append(event)
                removals.clear()
            elif (event.medium, event.group_idx) in removals:
                removals[event.medium, event.group_idx].block_hashes.extend(event.block_hashes)
            else:
                removals[event.medium, event.group_idx] = msgspec.structs.replace(
                    event, block_hashes=[*event.block_hashes]
                )
                merged.append(removals[event.medium, event.group_idx])
        out: list[KVCacheEvent] = []
        for event in merged:
            if isinstance(event, BlockStored) and rng.random() < 0.3:
                n = next(self.made)
                vllm_hash = 2**63 + n if isinstance(event.block_hashes[0], int) else b"mm%d" % n
                tokens = TOKENS[: event.block_size]
                out.append(BlockStored([vllm_hash], None, tokens, event.block_size, medium="GPU", extra_keys=[["mm"]],
                                       group_idx=0, kv_cache_spec_kind="full_attention"))  # fmt: skip
                self.multimodal.append(vllm_hash)
            elif isinstance(event, BlockRemoved) and event.group_idx == 0 and self.multimodal:
                event.block_hashes.insert(rng.randrange(len(event.block_hashes) + 1), self.multimodal.pop())
            out.append(event)
            if not isinstance(event, AllBlocksCleared):
                out.append(msgspec.structs.replace(event, medium="CPU"))
        return out


def run_and_compare(
    steps: list[tuple[str, int]], engine_block: int, byte_hashes: bool, extra_group: bool, noisy: bool = False
) -> None:
    """Drive a fake block cache through ``steps``; after each, tracker and index must equal its true contents."""
    cache = FakeBlockCache(
        block_size=engine_block, num_blocks=24, rng=random.Random(7), hash_format="bytes" if byte_hashes else "int",
        extra_group=extra_group,
    )  # fmt: skip
    tracker = BlockTracker(block_size=16, namespace="m")
    index = PrefixIndex(16)
    held = []
    busier = BusierEngine()
    for action, seed in steps:
        rng = random.Random(seed)
        # Shared stems make prefixes collide, hit, get duplicated and get evicted often.
        stem = STEMS[rng.randrange(len(STEMS))][: rng.randrange(0, 4 * engine_block)]
        prompt = stem + [rng.randrange(2) for _ in range(rng.randrange(0, 2 * engine_block))]
        lora = rng.choice([None, None, "sql"])
        if action in ("complete", "twin", "hold"):
            request = cache.allocate(prompt, lora_name=lora, share=action != "twin")
            if action == "hold":
                held.append(request)
            else:
                cache.free(request)
        elif action == "finish":
            for request in held:
                cache.free(request)
            held.clear()
        elif action == "restart":  # the engine restarted, with blocks held: the subscriber resets the tracker
            cache.reset()
            held.clear()
            apply_updates(index, "gpu0", tracker.reset())
        elif not held:
            cache.clear()
        events = cache.take_events()
        apply_updates(index, "gpu0", tracker.apply(busier.send(events, rng) if noisy else events))
        truth = cache.own_hashes(block_size=16, namespace="m")
        assert tracker.held() == truth
        assert index.hashes("gpu0") == truth
        index._check()
    assert tracker.stats.invalid_events == 0 and tracker.stats.orphan_blocks == 0


@pytest.mark.parametrize("namespace", [5, ["model"], 1.5])
def test_a_namespace_of_the_wrong_type_is_a_type_error_when_given_not_at_the_first_event(namespace: object) -> None:
    with pytest.raises(TypeError, match="namespace must be a str, bytes or None"):
        BlockTracker(block_size=4, namespace=namespace)  # type: ignore[arg-type]
    assert BlockTracker(block_size=4, namespace=b"model").apply([BlockStored([1], None, [1, 2, 3, 4], 4)])


def test_the_fake_cache_reports_its_requests_and_chains_as_its_public_types() -> None:
    from prefixroute.testing import CachedChain, Completion, FakeRequest, FakeVLLM

    cache = FakeBlockCache(block_size=4, num_blocks=16, rng=random.Random(0))
    request = cache.allocate(list(range(10)))
    assert request == FakeRequest(prompt_tokens=10, cached_tokens=0, block_ids=request.block_ids)
    assert len(request.block_ids) == 2  # the partial third block is not cached
    assert cache.chains() == [CachedChain((0, 1, 2, 3)), CachedChain((0, 1, 2, 3, 4, 5, 6, 7))]
    engine = FakeVLLM(block_size=4, num_blocks=16)  # not started: complete() works on the cache alone
    first, again = engine.complete(list(range(8))), engine.complete(list(range(8)))
    assert isinstance(first, Completion) and (first.prompt_tokens, first.cached_tokens) == (8, 0)
    assert again.cached_tokens == 4 and again.ttft_s < first.ttft_s  # all but the block of its last token


# The fake block cache on its own: the events, counters and limits its docstrings promise.


def _small_cache(**options: object) -> FakeBlockCache:
    return FakeBlockCache(block_size=4, num_blocks=4, rng=random.Random(0), **options)  # type: ignore[arg-type]


def _stored(cache: FakeBlockCache) -> BlockStored:
    """The first event the cache generated since the last call, a BlockStored (the rest are forgotten)."""
    event = cache.take_events()[0]
    assert isinstance(event, BlockStored)
    return event


def test_the_fake_cache_defaults_to_vllms_16_token_blocks_and_one_kv_cache_group() -> None:
    cache = FakeBlockCache(rng=random.Random(0))
    assert (cache.block_size, cache.num_blocks, cache.hash_format, cache.extra_group) == (16, 1024, "int", False)
    cache.allocate(TOKENS)
    (event,) = cache.take_events()
    assert isinstance(event, BlockStored) and event.group_idx == 0  # no sliding-window group's events
    assert cache.own_hashes() == set(own(TOKENS))  # prefixroute's default 16-token blocks too


def test_one_block_is_a_positive_block_size_and_a_positive_capacity() -> None:
    cache = FakeBlockCache(block_size=1, num_blocks=1, rng=random.Random(0))
    assert cache.allocate([5, 6]).block_ids and cache.used_blocks == 1


def test_the_fake_cache_names_what_it_refuses() -> None:
    with pytest.raises(TypeError, match="rng must be a random.Random, not int"):
        FakeBlockCache(rng=5)  # type: ignore[arg-type]
    cache, other = _small_cache(), _small_cache()
    with pytest.raises(TypeError, match="request must be a FakeRequest from allocate\\(\\), not list"):
        cache.free([1, 2])  # type: ignore[arg-type]
    with pytest.raises(
        ConfigurationError, match="request holds blocks this cache did not allocate: free it on its own cache"
    ):
        other.free(cache.allocate(list(range(8))))
    with pytest.raises(StateError, match=re.escape("clear() with requests running: vLLM only resets an idle")):
        cache.clear()


def test_a_request_freed_on_another_cache_holding_blocks_too_is_refused_and_changes_nothing() -> None:
    """free()'s docstring: a request holding blocks this cache did not give it is a ConfigurationError and nothing
    changes. Block ids count from 0 in every cache, so another cache's request named blocks this one held too: it
    freed them (and emptied the request, whose own blocks stayed held for ever)."""
    cache, other = _small_cache(), _small_cache()
    mine, theirs = cache.allocate(list(range(8))), other.allocate([9] * 8)
    with pytest.raises(ConfigurationError, match="request holds blocks this cache did not allocate"):
        other.free(mine)
    assert (cache.usage(), other.usage()) == (0.5, 0.5) and len(mine.block_ids) == 2
    cache.free(mine)
    other.free(theirs)
    assert (cache.usage(), other.usage()) == (0.0, 0.0)


def test_a_stored_event_names_the_new_blocks_their_parent_and_tokens_as_vllm_does() -> None:
    cache = _small_cache(extra_group=True)
    cache.free(cache.allocate(list(range(4)), lora_name="sql"))
    (first,) = _stored(cache).block_hashes
    cache.allocate(list(range(12)), lora_name="sql")  # hits the first block, stores two
    stored, sliding = cache.take_events()
    assert isinstance(stored, BlockStored)
    new = stored.block_hashes
    assert len(new) == 2 and first not in new
    assert stored == BlockStored(
        new, first, list(range(4, 12)), 4, lora_name="sql", medium="GPU", extra_keys=[("sql",), ("sql",)],
        group_idx=0, kv_cache_spec_kind="full_attention",
    )  # fmt: skip
    assert sliding == BlockStored(
        new, first, list(range(4, 12)), 4, medium="GPU", group_idx=1, kv_cache_spec_kind="sliding_window"
    )
    cache.allocate([9] * 4)
    assert _stored(cache).extra_keys == [None]  # the base model's blocks have no extra keys


@pytest.mark.parametrize("extra_group", [False, True])
def test_making_room_evicts_only_as_many_free_blocks_as_needed_from_the_queues_head(extra_group: bool) -> None:
    cache = _small_cache(extra_group=extra_group)
    cache.free(cache.allocate(list(range(8))))  # two blocks, freed tail first
    cache.free(cache.allocate([7] * 8))  # two more: the cache is full, all four blocks free
    old = {hashes for event in cache.take_events() if isinstance(event, BlockStored) for hashes in event.block_hashes}
    request = cache.allocate(list(range(12)))  # hits two blocks, needs one: one more block fits after one eviction
    assert request.cached_tokens == 8 and len(request.block_ids) == 3
    events = cache.take_events()
    removed = [event for event in events if isinstance(event, BlockRemoved)]
    groups = [0, 1] if extra_group else [0]
    assert removed == [BlockRemoved(removed[0].block_hashes, medium="GPU", group_idx=group) for group in groups]
    assert removed[0].block_hashes[0] in old  # the [7]*8 prompt's tail, the least recently freed block
    assert cache.used_blocks == 4
    cache.free(request)
    again = cache.allocate(list(range(8)))  # cached whole: vLLM computes its last token, so its last block again
    assert again.cached_tokens == 4
    stored = [event for event in cache.take_events() if isinstance(event, BlockStored) and event.group_idx == 0]
    assert len(stored) == 1 and len(stored[0].block_hashes) == 1  # a second physical copy of that block's hash


def test_a_prompt_that_cannot_fit_caches_nothing_beyond_the_capacity() -> None:
    cache = _small_cache()
    held = cache.allocate(list(range(16)))  # all four blocks held by a running request
    cache.take_events()
    request = cache.allocate([9] * 8)
    assert request.block_ids == [] and cache.used_blocks == 4 and cache.take_events() == []
    cache.free(held)


def test_usage_is_the_fraction_of_blocks_held_by_running_requests() -> None:
    cache = _small_cache()
    request = cache.allocate(list(range(8)))
    assert cache.usage() == 0.5
    cache.free(request)
    assert cache.usage() == 0.0 and cache.used_blocks == 2  # freed blocks stay cached, no longer in use


def test_queries_and_hits_count_prompt_tokens_seen_and_served_from_the_cache() -> None:
    cache = _small_cache()
    cache.free(cache.allocate(list(range(10))))
    cache.free(cache.allocate(list(range(9))))
    cache.free(cache.allocate(list(range(12))))
    assert (cache.queries, cache.hits) == (31, 16)  # 10 + 9 + 12 seen; the two 4-token blocks hit twice


def test_clear_drops_the_free_blocks_announcing_only_the_reset() -> None:
    cache = _small_cache()
    cache.free(cache.allocate(list(range(8))))
    cache.take_events()
    cache.clear()
    assert cache.take_events() == [AllBlocksCleared()] and cache.used_blocks == 0 and cache.chains() == []


def test_reset_forgets_everything_silently_and_names_blocks_anew() -> None:
    cache = _small_cache()
    cache.free(cache.allocate(list(range(8))))
    before = _stored(cache).block_hashes
    before_restart = cache.allocate([1] * 4)
    cache.reset()
    assert (cache.used_blocks, cache.events, cache.queries, cache.hits) == (0, [], 0, 0)
    with pytest.raises(ConfigurationError, match="request holds blocks this cache did not allocate"):
        cache.free(before_restart)  # its blocks went with the old process
    request = cache.allocate(list(range(8)))
    assert request.cached_tokens == 0 and (cache.queries, cache.hits) == (8, 0)
    assert _stored(cache).block_hashes != before  # a new seed: the restarted engine's own names


def test_each_engine_names_the_same_blocks_differently() -> None:
    names = []
    for seed in (1, 2):
        cache = FakeBlockCache(block_size=4, rng=random.Random(seed))
        cache.allocate(list(range(8)))
        names.append(_stored(cache).block_hashes)
    assert names[0] != names[1]


def test_a_prefix_hit_needs_only_the_blocks_before_the_first_different_token() -> None:
    cache = _small_cache()
    cache.free(cache.allocate([1, 2, 3, 4, 0x01010101]))
    assert cache.allocate([1, 2, 3, 4, 0x02020202]).cached_tokens == 4


def test_byte_hashes_are_32_bytes_and_int_hashes_uint64() -> None:
    for hash_format, kind, size in (("bytes", bytes, 32), ("int", int, 2**64)):
        cache = _small_cache(hash_format=hash_format)
        cache.allocate(list(range(8)))
        hashes = _stored(cache).block_hashes
        assert all(isinstance(h, kind) for h in hashes) and len(set(hashes)) == 2
        assert all(len(h) == size if isinstance(h, bytes) else 0 <= h < size for h in hashes)


def test_own_hashes_rehashes_at_the_given_block_size_and_checks_the_namespace_of_an_empty_cache() -> None:
    cache = FakeBlockCache(block_size=8, rng=random.Random(0))
    cache.allocate(list(range(16)))
    assert cache.own_hashes(block_size=4) == set(own(list(range(16)), block_size=4))
    with pytest.raises(TypeError, match="namespace must be a str, bytes or None"):
        FakeBlockCache(rng=random.Random(0)).own_hashes(namespace=5)  # type: ignore[arg-type]
