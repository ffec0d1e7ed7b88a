"""The simulated engine against vLLM V1's scheduler and block pool, rule by rule, on requests small enough to follow."""

from __future__ import annotations

from typing import cast

from prefixroute.hashing import BlockHasher
from prefixroute.router import Decision
from prefixroute.sim.backend import Active, BackendConfig, SimBackend
from prefixroute.sim.request import RequestRecord, token_bytes

from .conftest import LinearCost

HASHER = BlockHasher(16)


def _active(request_id: int, tokens: bytes, output: int = 1) -> Active:
    record = RequestRecord(
        request_id=request_id, user=0, tag="", arrival=0.0, prompt_tokens=len(tokens) // 4, output_tokens=output
    )
    return Active(record, list(HASHER.hash(tokens)), cast(Decision, None))  # the backend only hands it back


def _backend(capacity: int | None = None, budget: int = 256) -> SimBackend:
    config = BackendConfig(capacity_blocks=capacity, max_num_batched_tokens=budget)
    return SimBackend("gpu0", config=config, cost=LinearCost())


def _drain(backend: SimBackend) -> float:
    now = 0.0
    while (seconds := backend.schedule(now)) is not None:
        now += seconds
        backend.complete(now)
    return now


def test_a_request_admitted_in_the_same_step_hits_the_blocks_that_step_computes() -> None:
    # vLLM caches a block when the step computing it is scheduled (allocate_slots), so an identical prompt admitted
    # right behind it in the same step reuses every block but the last token's.
    prompt = token_bytes(0, 64)
    first, second = _active(0, prompt), _active(1, prompt)
    backend = _backend()
    backend.enqueue(first)
    backend.enqueue(second)
    _drain(backend)
    assert first.record.cached_tokens == 0
    assert second.record.cached_tokens == 48


def test_a_chunked_prefill_s_current_chunk_is_hit_by_a_request_admitted_beside_it() -> None:
    # 96 tokens at 64 a step: step 1 computes 64, step 2 the last 32 and admits the second request, which hits all
    # five blocks the limit of prompt - 1 tokens allows (80 tokens), not only the four the first step finished.
    prompt = token_bytes(0, 96)
    first, second = _active(0, prompt), _active(1, prompt)
    backend = _backend(budget=64)
    backend.enqueue(first)
    backend.enqueue(second)
    _drain(backend)
    assert second.record.cached_tokens == 80
