"""One simulated vLLM engine: continuous batching with chunked prefill over a :class:`BlockCache`.

The scheduler follows vLLM V1's: each step it first continues the running requests in admission order (a decode
costs one token of the step's budget, a prefill chunk as many as fit), preempting the newest running request by
recomputation when a running one needs a block and none is free; then, if nothing was preempted, it admits waiting
requests first come first served while ``max_num_seqs`` and the token budget allow and their blocks fit. A request
is admitted with its longest cached prefix (contiguous leading full blocks, at most ``tokens - 1`` tokens, because
vLLM always computes the last prompt token). The step's duration comes from a :class:`CostModel`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Protocol

from prefixroute._numbers import as_int, check_flag, shown
from prefixroute.errors import ConfigurationError, InvalidTypeError
from prefixroute.router import Decision
from prefixroute.sim.kvcache import BlockCache
from prefixroute.sim.request import RequestRecord

__all__ = ["Active", "BackendConfig", "CostModel", "SimBackend"]


class CostModel(Protocol):
    """The part of a GPU profile (:class:`prefixroute.sim.Profile`) the simulator uses."""

    def step_seconds(self, prefill: Sequence[tuple[int, int]], decode_contexts: Sequence[int]) -> float:
        """Seconds one engine step takes: ``prefill`` is (new tokens, tokens already in KV) per chunk."""
        ...

    def prefill_seconds(self, new_tokens: int, cached_tokens: int) -> float:
        """Seconds to prefill ``new_tokens`` after ``cached_tokens`` already in KV, alone."""
        ...


@dataclass(frozen=True, slots=True)
class BackendConfig:
    """vLLM engine settings that shape scheduling: KV blocks, block size, batch limits (vLLM's names)."""

    capacity_blocks: int | None
    _: KW_ONLY
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    reserve_full_isl: bool = True
    """vLLM's ``scheduler_reserve_full_isl`` (on by default): a waiting request is admitted only when the blocks of
    its whole sequence so far (its prompt, and the output it had generated before a preemption) fit beside the
    cached ones it reuses, not only its first chunk's (``allocate_slots(full_sequence_must_fit=...)``)."""
    async_scheduling: bool = True
    """vLLM's async scheduling (on by default, ``--no-async-scheduling`` turns it off): step k+1 is planned as step
    k starts, before step k's output is processed, so a request that arrives while the engine is busy waits one
    step more, and the blocks of the requests that finish in step k are free for step k+2's plan. An engine with
    nothing to plan waits for the step in flight and plans again, as vLLM's batch queue does."""

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            count = as_int(getattr(self, name))
            if count is None or count < 1:
                raise ConfigurationError("block_size, max_num_seqs and max_num_batched_tokens must be ints >= 1")
            object.__setattr__(self, name, count)  # a numpy int kept as the Python int it stands for (frozen)
        for name in ("reserve_full_isl", "async_scheduling"):
            check_flag(getattr(self, name), name)
        if self.capacity_blocks is not None:
            capacity = as_int(self.capacity_blocks)
            if capacity is None or capacity < 1:
                raise ConfigurationError(
                    f"capacity_blocks is {shown(self.capacity_blocks)}: the model does not fit on this GPU; "
                    "choose a larger GPU or more tensor parallelism"
                )
            object.__setattr__(self, "capacity_blocks", capacity)


class Active:
    """A request inside one backend: its record, block hashes, and progress."""

    __slots__ = (
        "blocks",
        "computed",
        "decision",
        "hashes",
        "held",
        "next_commit",
        "private",
        "record",
        "tokens",
    )

    def __init__(self, record: RequestRecord, hashes: list[int], decision: Decision) -> None:
        self.record = record
        self.hashes = hashes  # chained hashes of every full block of prompt (+ output, when known)
        self.decision = decision  # the router's Decision, handed back when the request finishes
        self.tokens = record.prompt_tokens  # tokens known so far: prompt + generated
        self.computed = 0  # tokens whose KV is in memory
        self.held: list[int] = []  # hashed (cached) blocks this request references, in order
        self.blocks = 0  # KV blocks covering its tokens: its cached prefix plus blocks allocated to it
        self.private = 0  # blocks allocated to it that are not in the cache (partial, filling, duplicates)
        self.next_commit = 0  # index of the next block to cache when it becomes full


FleetMatch = Callable[["SimBackend", Sequence[int], int], int]


class SimBackend:
    """A vLLM-like engine: waiting and running queues, a block cache, and one step at a time.

    Drive it with :meth:`enqueue`, :meth:`schedule` (plan a step; returns its duration or None when idle) and
    :meth:`complete` (apply the planned step at its end time; returns the requests that finished).
    ``on_first_token(active)`` is called in :meth:`complete` when a request's first token is sampled.

    Raises:
        TypeError: ``name`` is not a str, ``config`` not a :class:`BackendConfig`, ``cost`` not a :class:`CostModel`,
            or ``fleet_match`` or ``on_first_token`` not a callable or None.
    """

    __slots__ = (
        "_deferred",
        "_plan",
        "_started",
        "block_size",
        "cache",
        "config",
        "cost",
        "fleet_match",
        "name",
        "on_first_token",
        "prefill_tokens",
        "running",
        "steps",
        "waiting",
    )

    def __init__(
        self,
        name: str,
        *,
        config: BackendConfig,
        cost: CostModel,
        fleet_match: FleetMatch | None = None,
        on_first_token: Callable[[Active], None] | None = None,
    ) -> None:
        _check_parts(name, config, cost, fleet_match, on_first_token)
        self.name = name
        self.on_first_token = on_first_token
        self.config = config
        self.cost = cost
        self.block_size = config.block_size
        self.cache = BlockCache(config.capacity_blocks)
        self.fleet_match = fleet_match
        self.waiting: deque[Active] = deque()
        self.running: list[Active] = []
        self._plan: list[tuple[Active, int]] = []
        self._started: float | None = None  # start of the step in flight (async: when the next one was planned)
        self._deferred: list[Active] = []  # finished, blocks not yet freed (async scheduling)
        self.steps = 0
        self.prefill_tokens = 0  # prompt tokens computed, summed over steps (conservation checks)

    @property
    def busy(self) -> bool:
        """Whether a step is planned and not yet completed."""
        return bool(self._plan)

    @property
    def load(self) -> int:
        """Requests in the engine: running plus waiting."""
        return len(self.running) + len(self.waiting)

    def fits(self, prompt_tokens: int, output_tokens: int) -> bool:
        """Whether a request could ever run here: its whole sequence's blocks within the KV capacity."""
        capacity = self.config.capacity_blocks
        return capacity is None or -(-(prompt_tokens + output_tokens) // self.block_size) <= capacity

    def enqueue(self, active: Active) -> None:
        """Add a request to the waiting queue."""
        self.waiting.append(active)

    def schedule(self, now: float) -> float | None:
        """Plan the step starting at ``now``; return its duration in seconds, or None if there is nothing to run."""
        assert not self._plan, "schedule() called while a step is in progress"
        budget = self.config.max_num_batched_tokens
        size = self.block_size
        cache = self.cache
        plan = self._plan
        prefill: list[tuple[int, int]] = []
        decode: list[int] = []
        preempted = False
        index = 0
        running = self.running
        while index < len(running) and budget > 0:
            active = running[index]
            n = min(active.tokens - active.computed, budget)
            need = -(-(active.computed + n) // size) - active.blocks
            while not cache.allocate(need):
                victim = running.pop()
                self._preempt(victim)
                preempted = True
                if victim is active:
                    break
            else:
                if need > 0:
                    active.blocks += need
                    active.private += need
                plan.append((active, n))
                self._commit(active, n)
                budget -= n
                _price(active, n, prefill, decode)
                index += 1
        # async scheduling: this step was planned when the previous one started, so only what had arrived by then
        cutoff = self._started if self.config.async_scheduling else None
        if not preempted:
            self._admit(now, budget, plan, prefill, decode, cutoff)
        if not plan and (self._deferred or cutoff is not None):
            # vLLM plans an empty step, blocks on the one in flight, frees its finished requests and plans again; also
            # when this plan preempted every running request (the blocks it lacked may be a finished request's, freed
            # now): vLLM's loop steps on while a request waits, where returning None here left the engine idle
            self._release_deferred()
            self._admit(now, budget, plan, prefill, decode, None)
        self._release_deferred()  # finished in the step that just ended: free for the next plan
        self._started = now if plan else None
        if not plan:
            return None
        self.steps += 1
        return self.cost.step_seconds(prefill, decode)

    def _release_deferred(self) -> None:
        for active in self._deferred:
            self.cache._release(active.held, active.private)
        self._deferred.clear()

    def _admit(
        self,
        now: float,
        budget: int,
        plan: list[tuple[Active, int]],
        prefill: list[tuple[int, int]],
        decode: list[int],
        cutoff: float | None = None,
    ) -> None:
        size = self.block_size
        cache = self.cache
        waiting = self.waiting
        running = self.running
        while waiting and budget > 0 and len(running) < self.config.max_num_seqs:
            active = waiting[0]
            if cutoff is not None and active.record.arrival > cutoff:
                break  # arrived after this step was planned (async scheduling)
            hashes = active.hashes
            hit = cache.match(hashes, limit=(active.tokens - 1) // size)
            n = min(active.tokens - hit * size, budget)
            need = -(-(hit * size + n) // size) - hit
            # vLLM's admission gate (allocate_slots(full_sequence_must_fit=scheduler_reserve_full_isl)): the blocks
            # of the whole sequence known so far (prompt, plus output generated before a preemption), not the chunk's
            gate = -(-active.tokens // size) - hit if self.config.reserve_full_isl else need
            available = cache.available()
            if available is not None and available - cache._unreferenced(hashes[:hit]) < gate:
                break  # first come first served: the head of the queue waits for memory
            held = hashes[:hit]
            cache._acquire(held)
            allocated = cache.allocate(need)
            assert allocated, "admission checked the blocks were available"
            waiting.popleft()
            running.append(active)
            active.held = held
            active.blocks = hit + need
            active.private = need
            active.computed = hit * size
            active.next_commit = hit
            record = active.record
            if record.scheduled is None:  # first admission: what the prefix cache supplied (vLLM's hit counter)
                record.cached_tokens = hit * size
                fleet = self.fleet_match(self, hashes, (active.tokens - 1) // size) if self.fleet_match else 0
                record.fleet_cached_tokens = max(fleet, hit) * size
                record.scheduled = now
            plan.append((active, n))
            _price(active, n, prefill, decode)
            self._commit(active, n)
            budget -= n

    def _commit(self, active: Active, n: int) -> None:
        """Cache the request's blocks that the ``n`` tokens just scheduled fill, as vLLM's ``allocate_slots`` does.

        vLLM puts a block in its prefix cache when the step that computes it is *scheduled*, so a request admitted
        later in the same step (or the next) already hits it: the step writes each layer's KV before that layer's
        attention reads it.
        """
        full = min((active.computed + n) // self.block_size, len(active.hashes))
        if full > active.next_commit:
            active.private -= self.cache._commit(active.hashes[active.next_commit : full], active.held)
            active.next_commit = full

    def _preempt(self, active: Active) -> None:
        """Free a running request's blocks and put it back at the head of the queue to recompute (vLLM V1)."""
        self.cache._release(active.held, active.private)
        active.held = []
        active.blocks = 0
        active.private = 0
        active.computed = 0
        active.next_commit = 0
        active.record.preemptions += 1
        self.waiting.appendleft(active)

    def complete(self, now: float) -> list[Active]:
        """Apply the planned step, ending at ``now``; return the requests that finished in it."""
        cache = self.cache
        finished: list[Active] = []
        for active, n in self._plan:
            record = active.record
            if not _decodes(active, n):  # as the step was priced
                record.computed_prompt_tokens += n
                self.prefill_tokens += n
            active.computed += n
            if active.computed == active.tokens:  # the step sampled a token
                record.generated_tokens += 1
                active.tokens += 1
                if record.first_token is None:
                    record.first_token = now
                    if self.on_first_token is not None:
                        self.on_first_token(active)
                if record.generated_tokens == record.output_tokens:
                    record.finished = now
                    finished.append(active)
        self._plan.clear()
        if finished:
            done = set(map(id, finished))
            self.running = [a for a in self.running if id(a) not in done]
            if self.config.async_scheduling:
                self._deferred.extend(finished)  # freed once the next step is planned
            else:
                for active in finished:
                    cache._release(active.held, active.private)
        return finished

    def _check(self) -> None:
        """Assert the cache invariants and that every running request's blocks are pinned and accounted."""
        cache = self.cache
        cache._check()
        refs: dict[int, int] = {}
        private = 0
        for active in self.running + self._deferred:
            for h in active.held:
                refs[h] = refs.get(h, 0) + 1
            private += active.private
            assert active.blocks * self.block_size >= active.computed, "KV tokens beyond allocated blocks"
            assert active.held == active.hashes[: len(active.held)], "a request holds a gap in its prefix"
        for h, count in refs.items():
            assert cache.holds(h), f"block {h:#x} held by a running request was evicted"
            assert cache._refs[h] == count, f"block {h:#x}: {cache._refs[h]} references, {count} holders"
        assert all(count == 0 or h in refs for h, count in cache._refs.items()), "reference without a holder"
        assert private == cache._private, f"{cache._private} private blocks, requests hold {private}"
        for active in self.waiting:
            assert active.blocks == 0 and not active.held, "a waiting request holds blocks"

    def __repr__(self) -> str:
        return f"SimBackend({self.name!r}, running={len(self.running)}, waiting={len(self.waiting)}, {self.cache!r})"


def _decodes(active: Active, n: int) -> bool:
    """Whether computing ``n`` tokens of ``active`` is a decode: the one token it sampled last, nothing else left.

    A request readmitted after a preemption with all but that token cached decodes too (its chunk is that token)."""
    return n == 1 and active.tokens - active.computed == 1 and active.record.generated_tokens > 0


def _price(active: Active, n: int, prefill: list[tuple[int, int]], decode: list[int]) -> None:
    """Add ``active``'s ``n`` scheduled tokens to the step's decodes or its prefill chunks, for the cost model."""
    if _decodes(active, n):
        decode.append(active.computed + 1)
    else:
        prefill.append((n, active.computed))


def _check_parts(name: object, config: object, cost: object, fleet_match: object, on_first_token: object) -> None:
    """Raise InvalidTypeError for a :class:`SimBackend` part of the wrong type (when given, not at the first step)."""
    if not isinstance(name, str):
        raise InvalidTypeError(f"SimBackend name must be a str, not {type(name).__name__}")
    if not isinstance(config, BackendConfig):
        raise InvalidTypeError(f"SimBackend config must be a BackendConfig, not {type(config).__name__}")
    if not (callable(getattr(cost, "step_seconds", None)) and callable(getattr(cost, "prefill_seconds", None))):
        raise InvalidTypeError(
            f"SimBackend cost must be a CostModel (step_seconds, prefill_seconds), not {type(cost).__name__}"
        )
    for option, hook in (("fleet_match", fleet_match), ("on_first_token", on_first_token)):
        if hook is not None and not callable(hook):
            raise InvalidTypeError(f"SimBackend {option} must be a callable or None, not {type(hook).__name__}")
