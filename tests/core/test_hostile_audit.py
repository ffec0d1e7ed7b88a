"""Hostile inputs an independent audit found, each failing before its fix: the core API's invariants, counts and
errors under inputs the earlier hostile suites did not generate."""

from __future__ import annotations

import pytest

from prefixroute import PrefixIndex


@pytest.mark.parametrize("capacity", [None, 5])
def test_predict_of_a_chain_that_contradicts_the_store_keeps_its_count_exact(capacity: int | None) -> None:
    # Was: predict() of a caller's hashes skipped the check insert() makes for a block held under another parent,
    # so block 0 was stored in two generations and blocks() counted it twice (4 blocks for 3 hashes).
    index = PrefixIndex(4, capacity_blocks=capacity)
    index.insert([10, 12], "a")
    index.predict([11, 10], "a", 0)  # 10 is held as a root, and now comes as block 1 of another chain
    index._check()
    assert index.blocks("a") == len(index.hashes("a")) == 3
    assert index.match([11, 10], ["a"]) == {"a": 2}
    index.remove([10], "a")  # a hole: the store walks, and finds exactly what it holds
    index._check()
    assert index.match([11, 10], ["a"]) == {"a": 1}
    assert index.match([10, 12], ["a"]) == {"a": 0}
