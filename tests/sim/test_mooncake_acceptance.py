"""Acceptance: replaying the Mooncake FAST'25 synthetic trace reproduces an independent hit-rate calculation.

With unbounded caches and no contention (one request at a time), the simulated vLLM caches must give, block for
block, what a plain-Python calculation over the trace's 512-token ``hash_ids`` gives: round-robin over 8
backends ~22.6 % of blocks, and greedy longest-prefix routing the single-infinite-cache ideal ~64.0 %.

The simulator works in vLLM's 16-token blocks; a 512-token trace block counts as hit when every full 16-token block
of it was served from cache. Two vLLM rules make a few requests differ by at most one trace block, and only
those: a trace block shorter than 16 tokens at the end of a prompt has nothing vLLM can cache, and vLLM always
recomputes a prompt's last token, so a prompt that is a multiple of 16 tokens long can never hit its last block.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TypedDict

import pytest

from prefixroute import PrefixIndex, Router
from prefixroute.policies import policy_from_name
from prefixroute.sim.backend import BackendConfig
from prefixroute.sim.engine import ClosedLoop, Simulation
from prefixroute.sim.traces import MOONCAKE_BLOCK_TOKENS, load_trace

from .conftest import LinearCost

BACKENDS = 8


class _Line(TypedDict):
    """The fields of a Mooncake trace line these tests read."""

    input_length: int
    hash_ids: list[int]


def _trace(data_dir: Path) -> list[_Line]:
    path = data_dir / "mooncake-fast25" / "synthetic_trace.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _reference_hits(trace: list[_Line], assign: str) -> list[int]:
    """Leading hash_ids each request finds in its backend's set of every hash id it has seen (no simulator)."""
    seen: list[set[int]] = [set() for _ in range(BACKENDS if assign == "round-robin" else 1)]
    hits = []
    for i, line in enumerate(trace):
        ids = line["hash_ids"]
        cache = seen[i % len(seen)]
        k = 0
        while k < len(ids) and ids[k] in cache:
            k += 1
        hits.append(k)
        cache.update(ids)
    return hits


def _simulated_hits(data_dir: Path, policy: str) -> tuple[list[int], list[int]]:
    spec = f"mooncake:{data_dir / 'mooncake-fast25' / 'synthetic_trace.jsonl'}"
    simulation = Simulation(
        # Infinite caches, as the reference's: an index with no bound either (Router()'s own keeps a backend with no
        # known capacity to DEFAULT_BOUND_BLOCKS, fewer than this trace puts on one).
        router=Router(policy=policy_from_name(policy), index=PrefixIndex(16)),
        workload=load_trace(spec, output_tokens=1),
        arrivals=ClosedLoop(1, ramp=0.0),  # one request at a time: no contention
        cost=LinearCost(),
        config=BackendConfig(capacity_blocks=None, max_num_batched_tokens=1 << 20),
        backends=BACKENDS,
    )
    records = simulation.run().records
    return [r.cached_tokens for r in records], [r.predicted_tokens for r in records]


def _trace_blocks_hit(cached_tokens: int, input_length: int, blocks: int) -> int:
    size = MOONCAKE_BLOCK_TOKENS
    return sum(1 for k in range(blocks) if cached_tokens >= min(size * (k + 1), input_length) // 16 * 16)


@pytest.mark.parametrize(
    ("policy", "assign", "expected"), [("round-robin", "round-robin", 0.226), ("prefix-affinity", "ideal", 0.640)]
)
def test_simulated_hits_match_the_reference(data_dir: Path, policy: str, assign: str, expected: float) -> None:
    trace = _trace(data_dir)
    assert len(trace) == 3993
    reference = _reference_hits(trace, assign)
    cached, predicted = _simulated_hits(data_dir, policy)
    total_blocks = sum(len(line["hash_ids"]) for line in trace)
    assert sum(reference) / total_blocks == pytest.approx(expected, abs=5e-4)

    simulated = []
    boundary = 0
    for line, tokens, ref in zip(trace, cached, reference, strict=True):
        length, blocks = line["input_length"], len(line["hash_ids"])
        hit = _trace_blocks_hit(tokens, length, blocks)
        simulated.append(hit)
        if length % 16 == 0 or length - MOONCAKE_BLOCK_TOKENS * (blocks - 1) < 16:
            boundary += 1
            assert abs(hit - ref) <= 1
        else:
            assert hit == ref
    assert boundary < 0.12 * len(trace)
    assert sum(simulated) / total_blocks == pytest.approx(sum(reference) / total_blocks, abs=1e-3)
    # The router's prediction agrees with what the caches served (unbounded caches never forget), except that
    # the router does not know vLLM recomputes the last token: it may expect one block more.
    assert all(0 <= p - c <= 16 for p, c in zip(predicted, cached, strict=True))
