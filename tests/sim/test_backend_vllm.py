"""The simulated engine against vLLM V1's scheduler and block pool, rule by rule, on requests small enough to follow."""

from __future__ import annotations

from typing import cast

import pytest

from prefixroute.errors import ConfigurationError, InvalidTypeError
from prefixroute.hashing import BlockHasher
from prefixroute.router import Decision
from prefixroute.sim.backend import Active, BackendConfig, SimBackend
from prefixroute.sim.request import RequestRecord, token_bytes

from .conftest import LinearCost, StepLog

HASHER = BlockHasher(16)


def _active(request_id: int, tokens: bytes, output: int = 1, answer: bytes = b"", arrival: float = 0.0) -> Active:
    """A request of prompt ``tokens``; ``answer``: the output token ids when known (hashed with the prompt)."""
    record = RequestRecord(
        request_id=request_id, user=0, tag="", arrival=arrival, prompt_tokens=len(tokens) // 4, output_tokens=output
    )
    return Active(record, list(HASHER.hash(tokens + answer)), cast(Decision, None))  # the backend only hands it back


def _backend(
    capacity: int | None = None,
    budget: int = 256,
    seqs: int = 256,
    cost: LinearCost | None = None,
    **options: bool,
) -> SimBackend:
    config = BackendConfig(capacity_blocks=capacity, max_num_batched_tokens=budget, max_num_seqs=seqs, **options)
    return SimBackend("gpu0", config=config, cost=cost or LinearCost())


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


def test_every_running_request_advances_each_step_and_a_decode_costs_one_token() -> None:
    # Two one-token prompts and a two-token budget: each step has room for both, so both are prefilled in step 1
    # and decode side by side after it, each decode priced with its context (its KV tokens, the new one included).
    log = StepLog()
    backend = _backend(budget=2, cost=log)
    first, second = _active(0, token_bytes(0, 1), output=3), _active(1, token_bytes(100, 1), output=3)
    backend.enqueue(first)
    backend.enqueue(second)
    end = _drain(backend)
    assert log.steps == [([(1, 0), (1, 0)], []), ([], [2, 2]), ([], [3, 3])]
    assert backend.steps == 3
    assert first.record.finished == second.record.finished == end
    assert first.record.computed_prompt_tokens == second.record.computed_prompt_tokens == 1


def test_a_prompt_s_last_token_in_a_chunk_of_its_own_is_a_prefill_not_a_decode() -> None:
    # 65 prompt tokens at 64 a step: the second step computes one prompt token, which is still prefill (it samples
    # the first token); only then does the request decode.
    log = StepLog()
    backend = _backend(budget=64, cost=log)
    active = _active(0, token_bytes(0, 65), output=2)
    backend.enqueue(active)
    _drain(backend)
    assert log.steps == [([(64, 0)], []), ([(1, 64)], []), ([], [66])]
    assert active.record.computed_prompt_tokens == backend.prefill_tokens == 65


def test_admission_uses_the_budget_to_its_last_token_and_stops_at_max_num_seqs() -> None:
    log = StepLog()
    backend = _backend(budget=33, seqs=2, cost=log)
    requests = [_active(i, token_bytes(1000 * i, 32), output=2) for i in range(3)]
    for active in requests:
        backend.enqueue(active)
    _drain(backend)
    # step 1: the first prompt whole and one token of the second (the budget's last); the third waits for a seat
    assert log.steps[0] == ([(32, 0), (1, 0)], [])
    assert log.steps[1] == ([(31, 1)], [33])
    assert max(len(prefill) + len(decode) for prefill, decode in log.steps) == 2
    assert requests[2].record.scheduled == requests[0].record.finished


def test_a_prefix_hit_stops_one_token_short_of_the_prompt() -> None:
    # 33 tokens: two full blocks and one token; the second identical prompt reuses both blocks (32 tokens), as
    # vLLM computes only the last prompt token.
    prompt = token_bytes(0, 33)
    first, second = _active(0, prompt), _active(1, prompt)
    backend = _backend()
    backend.enqueue(first)
    backend.enqueue(second)
    _drain(backend)
    assert second.record.cached_tokens == 32
    assert second.record.computed_prompt_tokens == 1
    # an engine with no fleet around it: what any engine held is what this one held
    assert (first.record.fleet_cached_tokens, second.record.fleet_cached_tokens) == (0, 32)


def test_a_request_needing_every_block_is_admitted() -> None:
    # 31 prompt tokens and one output token: two blocks, the whole cache; admission needs enough, not more.
    backend = _backend(capacity=2)
    assert backend.fits(31, 1) and not backend.fits(32, 1)
    active = _active(0, token_bytes(0, 31))
    backend.enqueue(active)
    _drain(backend)
    assert active.record.finished is not None and backend.cache.used_blocks == 0


def test_a_step_that_preempts_admits_nobody_and_preempts_the_newest_request() -> None:
    # Four blocks for two growing requests: the second is admitted a step later (the first prompt takes the whole
    # budget), so it is the newest; whenever the older one needs a block, or the newer one does, the newer one is
    # preempted, and vLLM admits nothing in a step that preempted, although a small first chunk would fit. With
    # the chunk's blocks as the admission gate (scheduler_reserve_full_isl=False): vLLM's default gate, the whole
    # prompt's blocks, readmits the newer one only once they fit, which leaves it one preemption.
    backend = _backend(capacity=4, budget=8, reserve_full_isl=False)
    older, newer = _active(0, token_bytes(0, 8), output=30), _active(1, token_bytes(1000, 9), output=30)
    backend.enqueue(older)
    backend.enqueue(newer)
    now, preemptions = 0.0, 0
    while True:
        was_waiting = {id(a) for a in backend.waiting}
        newest = backend.running[-1] if backend.running else None
        before = newer.record.preemptions + older.record.preemptions
        seconds = backend.schedule(now)
        if seconds is None:
            break
        if newer.record.preemptions + older.record.preemptions > before:
            preemptions += 1
            assert newest is newer and backend.waiting[0] is newer and newer not in backend.running
            assert not any(id(a) in was_waiting for a in backend.running), "admitted in a step that preempted"
        now += seconds
        backend.complete(now)
        backend._check()
    assert older.record.preemptions == 0 and newer.record.preemptions == preemptions > 1
    assert older.record.finished is not None and newer.record.finished is not None


def test_a_recomputed_request_s_last_two_tokens_are_prefill_counted_as_computed() -> None:
    # Five blocks: the older request (30 prompt tokens) needs its third block in step 4, when the newer one (31,
    # output known, so its output's full blocks are hashed) holds three; the newer one is preempted with 34 tokens,
    # and readmitted with its two cached blocks it recomputes the last two as a prefill chunk.
    log = StepLog()
    backend = _backend(capacity=5, cost=log)
    older = _active(0, token_bytes(0, 30), output=4)
    newer = _active(1, token_bytes(1000, 31), output=4, answer=token_bytes(5000, 4))
    backend.enqueue(older)
    backend.enqueue(newer)
    _drain(backend)
    assert newer.record.preemptions == 1
    assert log.steps[-1] == ([(2, 32)], [])
    assert newer.record.computed_prompt_tokens == 31 + 2
    assert backend.prefill_tokens == sum(new for prefill, _decode in log.steps for new, _cached in prefill)


@pytest.mark.parametrize("reserve_full_isl", [True, False])
def test_admission_waits_for_the_whole_prompt_s_blocks_as_vllm_s_default_gate_does(reserve_full_isl: bool) -> None:
    # Five blocks of 16 tokens, 16 tokens a step: a 32-token prompt decoding 20 tokens (three blocks once it
    # decodes, four at the end), then a 40-token prompt (three blocks). When the first starts decoding, two blocks
    # are free: the second's first chunk fits, its whole prompt does not. vLLM's default (allocate_slots with
    # full_sequence_must_fit) keeps it waiting until the first has finished; the chunk gate admits it at once, and
    # it is preempted when its third block is not there.
    backend = _backend(capacity=5, budget=16, reserve_full_isl=reserve_full_isl, async_scheduling=False)
    first, second = _active(0, token_bytes(0, 32), output=20), _active(1, token_bytes(1000, 40), output=1)
    backend.enqueue(first)
    backend.enqueue(second)
    _drain(backend)
    assert first.record.finished is not None and second.record.scheduled is not None
    if reserve_full_isl:
        assert second.record.scheduled >= first.record.finished and second.record.preemptions == 0
    else:
        assert second.record.scheduled < first.record.finished and second.record.preemptions >= 1


def _step_until(backend: SimBackend, waiting: list[Active], until: float) -> tuple[float, list[float]]:
    """Run ``backend`` step by step, enqueueing each of ``waiting`` once the clock reaches its arrival (as the
    simulator does between steps), until ``until``; return the clock and the steps' start times."""
    now, starts = 0.0, []
    pending = sorted(waiting, key=lambda a: a.record.arrival)
    while now < until:
        while pending and pending[0].record.arrival <= now:
            backend.enqueue(pending.pop(0))
        seconds = backend.schedule(now)
        if seconds is None:
            if not pending:
                break
            now = pending[0].record.arrival
            continue
        starts.append(now)
        now += seconds
        backend.complete(now)
        backend._check()
    return now, starts


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_with_async_scheduling_a_request_arriving_during_a_step_waits_one_step_more(async_scheduling: bool) -> None:
    # A long decode keeps the engine busy in steps of 1 ms; a request arriving in the middle of a step is in the
    # next plan without async scheduling, and in the one after with it (that plan was made as the step began).
    backend = _backend(async_scheduling=async_scheduling)
    busy = _active(0, token_bytes(0, 8), output=100)
    late = _active(1, token_bytes(1000, 8), arrival=0.0105)
    _now, starts = _step_until(backend, [busy, late], until=0.05)
    assert late.record.scheduled is not None
    after = [start for start in starts if start >= late.record.arrival]
    assert late.record.scheduled == after[1 if async_scheduling else 0]


def test_with_async_scheduling_an_idle_engine_admits_an_arrival_at_once() -> None:
    backend = _backend()
    first = _active(0, token_bytes(0, 8))
    later = _active(1, token_bytes(1000, 8), arrival=1.0)  # long after the first has finished: the engine is idle
    _step_until(backend, [first, later], until=2.0)
    assert later.record.scheduled == 1.0


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_with_async_scheduling_a_finished_request_s_blocks_free_one_plan_later(async_scheduling: bool) -> None:
    # Two blocks: a one-block request decoding its last token holds one, a two-block prompt waits. Synchronous,
    # the step after the last decode admits it; async, that step was planned before the blocks came free, so the
    # engine plans an empty step, waits for the one in flight, frees the blocks and admits it then: the same
    # instant here, as nothing else runs.
    backend = _backend(capacity=2, async_scheduling=async_scheduling, reserve_full_isl=True)
    short, big = _active(0, token_bytes(0, 8), output=3), _active(1, token_bytes(1000, 31))
    _now, starts = _step_until(backend, [short, big], until=1.0)
    assert short.record.finished is not None and big.record.scheduled == short.record.finished
    assert big.record.finished is not None and backend.cache.used_blocks == 0


def test_engine_flags_are_true_or_false() -> None:
    for option in ("reserve_full_isl", "async_scheduling"):
        with pytest.raises(ConfigurationError, match=rf"^{option} must be True or False, not 1$"):
            BackendConfig(capacity_blocks=4, **{option: 1})  # type: ignore[arg-type]


def test_engine_settings_allow_a_one_block_cache_and_name_what_does_not_fit() -> None:
    assert BackendConfig(capacity_blocks=1).capacity_blocks == 1
    with pytest.raises(
        ConfigurationError,
        match=r"^capacity_blocks is 0: the model does not fit on this GPU; choose a larger GPU or more tensor "
        r"parallelism$",
    ):
        BackendConfig(capacity_blocks=0)
    with pytest.raises(
        ConfigurationError, match=r"^block_size, max_num_seqs and max_num_batched_tokens must be ints >= 1$"
    ):
        BackendConfig(capacity_blocks=4, block_size=0)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("name", 0),
        ("config", None),
        ("cost", "linear"),
        ("fleet_match", 1),
        ("on_first_token", "print"),
    ],
)
def test_a_part_of_the_wrong_type_is_refused_when_the_backend_is_made(option: str, value: object) -> None:
    """Not when the first step calls it: a ``SimBackend`` made by hand names the option at once."""
    options: dict[str, object] = {"name": "gpu0", "config": BackendConfig(100), "cost": LinearCost()}
    options[option] = value
    with pytest.raises(InvalidTypeError, match=rf"^SimBackend {option} must be "):
        SimBackend(**options)  # type: ignore[arg-type]
