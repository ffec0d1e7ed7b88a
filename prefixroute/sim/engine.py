"""The discrete-event loop: requests arrive, go through the real :class:`~prefixroute.Router`, run on backends.

Time is simulated (no wall clock anywhere); events sit in one heap ordered by (time, sequence number), and every
random draw comes from one seeded ``random.Random``, so a seed reproduces a run exactly. An engine plans its next
step after every other event of the same instant (an engine drains its input queue before it steps, so requests that
arrive together are planned together).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Protocol

from prefixroute._numbers import as_float, as_int, check_flag, shown
from prefixroute.errors import ConfigurationError, InvalidTypeError, StateError
from prefixroute.router import Decision, Router
from prefixroute.sim.backend import Active, BackendConfig, CostModel, SimBackend
from prefixroute.sim.request import RequestRecord, SimRequest
from prefixroute.sim.workloads import Scenario

__all__ = ["Arrivals", "ClosedLoop", "OpenLoop", "SimOutcome", "Simulation", "TraceTimes", "Workload"]

_ARRIVAL, _STEP_END, _WAKE, _POLL, _PLAN = 0, 1, 2, 3, 4


class Workload(Protocol):
    """A source of requests: ``next_request(user)`` returns the user's next request, or None when exhausted."""

    def next_request(self, user: int) -> SimRequest | None:
        """Return the next request (``user`` is the closed-loop user or the open-loop arrival's index)."""
        ...


MAX_BACKENDS = 4096
"""The most backends one simulation may have: far above any real fleet, low enough that a typo is an error."""
MAX_USERS = 1_000_000
"""The most users of one arrival process."""
MAX_REQUESTS = 100_000_000
"""The most requests one simulated run may have (``--requests``, or ``--rate`` × ``--duration``)."""


def _check_count(value: object, name: str, most: int) -> int:
    count = as_int(value)
    if count is None or not 1 <= count <= most:
        raise ConfigurationError(f"{name} must be an int in [1, {most:,}], not {shown(value)}")
    return count


@dataclass(frozen=True, slots=True)
class ClosedLoop:
    """``users`` users, each sending a request, waiting for its last token, thinking, and sending the next.

    Think times are exponential with mean ``think_time`` seconds (0: send at once). Users start at uniformly random
    times within the first ``ramp`` seconds so they do not all arrive in the same instant.

    Raises:
        ConfigurationError: ``users`` is not an int in [1, :data:`MAX_USERS`], ``think_time`` or ``ramp`` not a
            finite number >= 0.
    """

    users: int
    _: KW_ONLY
    think_time: float = 0.0
    ramp: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "users", _check_count(self.users, "users", MAX_USERS))  # frozen: set on entry
        for name, seconds in (("think_time", self.think_time), ("ramp", self.ramp)):
            number = as_float(seconds)
            if number is None or number < 0:
                raise ConfigurationError(f"{name} must be a finite number of seconds >= 0, not {shown(seconds)}")
            object.__setattr__(self, name, number)


@dataclass(frozen=True, slots=True)
class OpenLoop:
    """Poisson arrivals at ``rate`` requests per second, independent of how fast they are served.

    Arrival *i* is sent on behalf of user ``i % users``, so per-user state (a multi-turn chat session) continues.
    """

    rate: float
    _: KW_ONLY
    users: int = 64

    def __post_init__(self) -> None:
        rate = as_float(self.rate)
        if rate is None or rate <= 0:
            raise ConfigurationError(f"rate must be a finite number > 0 of requests a second, not {shown(self.rate)}")
        object.__setattr__(self, "rate", rate)
        object.__setattr__(self, "users", _check_count(self.users, "users", MAX_USERS))  # frozen: set on entry


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceTimes:
    """Arrivals at each request's own ``arrival`` time (a trace's timestamps), divided by ``speedup``."""

    speedup: float = 1.0

    def __post_init__(self) -> None:
        speedup = as_float(self.speedup)
        if speedup is None or speedup <= 0:
            raise ConfigurationError(f"speedup must be a finite number > 0, not {shown(self.speedup)}")
        object.__setattr__(self, "speedup", speedup)


Arrivals = ClosedLoop | OpenLoop | TraceTimes


@dataclass
class SimOutcome:
    """Everything one run produced: a record per request, the simulated makespan, and per-backend counters."""

    records: list[RequestRecord]
    duration: float
    steps: dict[str, int]
    peak_in_flight: dict[str, int]
    prefill_tokens: dict[str, int]
    evictions: dict[str, int]


class Simulation:
    """One run of one policy: ``backends`` simulated engines behind ``router``, fed by ``workload``.

    ``router`` may be a sequence of routers: gateway replicas that share no state, as several proxy or sidecar
    processes behind one load balancer. Each request goes to one of them drawn at random (from its own seeded
    generator, so one router draws nothing and runs as before), which routes it and follows its life; engine
    metrics and KV events reach every one of them. They must hash alike (the same block size and namespace).

    ``max_requests`` and/or ``duration`` (simulated seconds) stop new arrivals; requests already in the system run
    to completion. Without either, only a workload that runs out (a trace) ends the run: open-loop arrivals and a
    synthetic scenario (:class:`~prefixroute.sim.workloads.Scenario`, endless) are refused when the simulation is
    made, and so are trace-time arrivals over a scenario (its requests have no arrival times).
    ``check`` runs every backend's invariant check after each step (slow; for tests).
    ``on_progress(done, total)`` is called as requests finish (``total`` is ``max_requests`` or 0).
    ``gpus_per_backend`` scales recomputation GPU-seconds (tensor parallelism).

    ``kv_events=True`` writes every backend's cache changes through :meth:`Router.store` and :meth:`Router.evict`
    as a KV-event subscriber does, delivered the instant they happen (exact mode: build the router with an index
    that records nothing on routing, such as :class:`~prefixroute.sim.EventsOnlyIndex`).
    When a request's first token is produced the simulation calls :meth:`Router.first_token`, as a streaming
    gateway does (``first_token=False``: never, as a gateway that sees no first token).
    ``metrics_interval`` polls each engine's waiting-queue length and KV usage into ``router.set_engine_load``
    every that many simulated seconds, as a ``/metrics`` poller does; policies see them in their candidates.
    """

    def __init__(
        self,
        *,
        router: Router | Sequence[Router],
        workload: Workload,
        arrivals: Arrivals,
        cost: CostModel,
        config: BackendConfig,
        backends: int | Sequence[str] = 8,
        max_requests: int | None = None,
        duration: float | None = None,
        seed: int = 0,
        gpus_per_backend: int = 1,
        check: bool = False,
        on_progress: Callable[[int, int], None] | None = None,
        kv_events: bool = False,
        metrics_interval: float | None = None,
        first_token: bool = True,
    ) -> None:
        routers = _check_routers(router)
        _check_parts(workload, arrivals, cost, config, on_progress)
        if as_int(backends) is not None:
            names = [f"gpu{i}" for i in range(_check_count(backends, "backends", MAX_BACKENDS))]
        elif isinstance(backends, Sequence) and not isinstance(backends, (str, bytes)):
            names = list(backends)
        else:
            raise InvalidTypeError(f"backends must be a count or a list of names, not {type(backends).__name__}")
        if not all(isinstance(name, str) and name for name in names):
            raise ConfigurationError("backends must be a positive count or distinct, non-empty backend names")
        if not names or len(set(names)) != len(names):
            raise ConfigurationError("backends must be a positive count or distinct backend names")
        if max_requests is not None:
            max_requests = _check_count(max_requests, "max_requests", MAX_REQUESTS)
        if duration is not None:
            seconds = as_float(duration)
            if seconds is None or seconds <= 0:
                raise ConfigurationError(f"duration must be a finite number > 0 of seconds, not {shown(duration)}")
            duration = seconds
        seed_int = as_int(seed)
        if seed_int is None:
            raise InvalidTypeError(f"seed must be an int, not {type(seed).__name__}")
        gpus_per_backend = _check_count(gpus_per_backend, "gpus_per_backend", MAX_BACKENDS)
        for name, flag in (("check", check), ("kv_events", kv_events), ("first_token", first_token)):
            check_flag(flag, name)
        if max_requests is None and duration is None and not isinstance(arrivals, (ClosedLoop, TraceTimes)):
            raise ConfigurationError("give max_requests or duration: open-loop arrivals never stop by themselves")
        endless = isinstance(workload, Scenario)  # a synthetic scenario draws requests for ever
        if endless and isinstance(arrivals, TraceTimes):
            raise ConfigurationError(
                "trace-time arrivals need a trace's arrival times, and a synthetic scenario has none: use "
                "ClosedLoop or OpenLoop arrivals"
            )
        if endless and max_requests is None and duration is None:
            raise ConfigurationError(
                f"a synthetic scenario ({type(workload).__name__}) never runs out of requests: set max_requests or "
                "duration, or the simulation never ends"
            )
        self.routers = routers
        self.router = routers[0]
        self.workload = workload
        self.arrivals = arrivals
        self.cost = cost
        self.names = names
        self.backends = [
            SimBackend(
                name,
                config=config,
                cost=cost,
                fleet_match=self._fleet_match,
                on_first_token=self._first_token if first_token else None,
            )
            for name in names
        ]
        self._by_name = {b.name: i for i, b in enumerate(self.backends)}
        self.max_requests = max_requests
        self.duration = duration
        self.rng = random.Random(seed_int)
        self._gateway_rng = random.Random(f"gateways:{seed_int}")
        # id() of a Decision in flight -> the replica that made it (decision ids of routers built with equal rngs
        # would collide; the object lives until its finish)
        self._gateway_of: dict[int, Router] = {}
        self.gpus = gpus_per_backend
        self.check = check
        self.on_progress = on_progress
        self.now = 0.0
        self._events: list[tuple[float, bool, int, int, object]] = []  # (time, is a plan, seq, kind, payload)
        self._seq = 0
        self._issued = 0
        self._done = 0
        self.records: list[RequestRecord] = []
        self._in_flight = [0] * len(names)
        self._planning = [False] * len(names)  # a _PLAN event is on the heap for that backend
        self._peak = [0] * len(names)
        self._hasher = self.router.hasher
        if metrics_interval is not None:
            interval = as_float(metrics_interval)
            if interval is None or interval <= 0:
                raise ConfigurationError(
                    f"metrics_interval must be a finite number > 0 of seconds, not {shown(metrics_interval)}"
                )
            metrics_interval = interval
        self.metrics_interval = metrics_interval
        if kv_events:
            for backend in self.backends:
                backend.cache.listener = _IndexFeed(routers, backend.name)

    def _push(self, time: float, kind: int, payload: object) -> None:
        self._seq += 1
        heapq.heappush(self._events, (time, kind == _PLAN, self._seq, kind, payload))

    def _may_issue(self, at: float) -> bool:
        if self.max_requests is not None and self._issued >= self.max_requests:
            return False
        return self.duration is None or at < self.duration

    def run(self) -> SimOutcome:
        """Run to completion and return the outcome. A Simulation runs once: a second call raises
        :class:`~prefixroute.StateError`."""
        if self._seq:
            raise StateError("a Simulation runs once; build a new one")
        self._start_arrivals()
        if self.metrics_interval is not None:
            self._push(0.0, _POLL, None)
        events = self._events
        while events:
            time, _late, _seq, kind, payload = heapq.heappop(events)
            self.now = time
            if kind == _PLAN:
                self._plan(payload)  # type: ignore[arg-type]
            elif kind == _STEP_END:
                self._step_end(payload)  # type: ignore[arg-type]
            elif kind == _ARRIVAL:
                assert isinstance(payload, tuple)
                self._dispatch(payload[0], payload[1])
                if not isinstance(self.arrivals, ClosedLoop):
                    self._next_open_arrival()
            elif kind == _WAKE:
                self._wake(payload)  # type: ignore[arg-type]
            else:
                self._poll()
        names = self.names
        end = max((r.finished for r in self.records if r.finished is not None), default=self.now)
        return SimOutcome(
            records=self.records,
            duration=end,
            steps={b.name: b.steps for b in self.backends},
            peak_in_flight=dict(zip(names, self._peak, strict=True)),
            prefill_tokens={b.name: b.prefill_tokens for b in self.backends},
            evictions={b.name: b.cache.evictions for b in self.backends},
        )

    def _start_arrivals(self) -> None:
        arrivals = self.arrivals
        if isinstance(arrivals, ClosedLoop):
            if arrivals.users < 1:
                raise ConfigurationError(f"users must be >= 1, not {arrivals.users}")
            for user in range(arrivals.users):
                self._push(self.rng.uniform(0.0, arrivals.ramp), _WAKE, user)
        else:
            self._next_open_arrival()

    def _next_open_arrival(self) -> None:
        arrivals = self.arrivals
        if not self._may_issue(self.now):
            return
        user = self._issued % arrivals.users if isinstance(arrivals, OpenLoop) else self._issued
        request = self.workload.next_request(user)
        if request is None:
            return
        if isinstance(arrivals, OpenLoop):
            at = self.now + self.rng.expovariate(arrivals.rate)
        else:
            assert isinstance(arrivals, TraceTimes)
            if request.arrival is None:
                raise ConfigurationError("trace-time arrivals need requests with an arrival time")
            at = max(self.now, request.arrival / arrivals.speedup)
        if not self._may_issue(at):
            return
        self._issued += 1
        self._push(at, _ARRIVAL, (user, request))

    def _wake(self, user: int) -> None:
        if not self._may_issue(self.now):
            return
        request = self.workload.next_request(user)
        if request is None:
            return
        self._issued += 1
        self._dispatch(user, request)

    def _dispatch(self, user: int, request: SimRequest) -> None:
        """Route one request through the real Router, as a gateway would, and queue it on its backend."""
        record = RequestRecord(
            request_id=len(self.records),
            user=user,
            tag=request.tag,
            arrival=self.now,
            prompt_tokens=request.prompt_tokens,
            output_tokens=request.output_tokens,
        )
        self.records.append(record)
        routers = self.routers
        router = routers[self._gateway_rng.randrange(len(routers))] if len(routers) > 1 else routers[0]
        decision = router.route(request.prompt, self.names)
        router.start(decision)
        self._gateway_of[id(decision)] = router
        record.backend = decision.backend
        record.predicted_tokens = decision.matched_tokens
        index = self._by_name[decision.backend]
        backend = self.backends[index]
        self._in_flight[index] += 1
        self._peak[index] = max(self._peak[index], self._in_flight[index])
        if not backend.fits(request.prompt_tokens, request.output_tokens):
            record.rejected = True  # vLLM refuses a sequence longer than its whole KV cache
            self._finish(index, decision, record, refused=True)  # it cached nothing the router predicted
            return
        data = request.prompt if request.output is None else request.prompt + request.output
        hashes: list[int] = list(self._hasher.hash(data))
        backend.enqueue(Active(record, hashes, decision))
        if not backend.busy:
            self._plan_later(index)

    def _plan_later(self, index: int) -> None:
        """Plan the backend's next step at this instant, once every other event of it has happened."""
        if not self._planning[index]:
            self._planning[index] = True
            self._push(self.now, _PLAN, index)

    def _plan(self, index: int) -> None:
        self._planning[index] = False
        backend = self.backends[index]
        seconds = backend.schedule(self.now)
        if seconds is not None:
            self._push(self.now + seconds, _STEP_END, index)

    def _step_end(self, index: int) -> None:
        backend = self.backends[index]
        for active in backend.complete(self.now):
            record = active.record
            if record.cached_tokens < record.fleet_cached_tokens:
                own, fleet, total = record.cached_tokens, record.fleet_cached_tokens, record.prompt_tokens
                extra = self.cost.prefill_seconds(total - own, own) - self.cost.prefill_seconds(total - fleet, fleet)
                record.recompute_seconds = max(0.0, extra) * self.gpus
            self._finish(index, active.decision, record)
        if self.check:
            backend._check()
        self._plan_later(index)

    def _first_token(self, active: Active) -> None:
        self._gateway_of[id(active.decision)].first_token(active.decision)

    def _finish(self, index: int, decision: Decision, record: RequestRecord, *, refused: bool = False) -> None:
        if record.finished is None:
            record.finished = self.now
        self._gateway_of.pop(id(decision)).finish(decision, refused=refused)
        self._in_flight[index] -= 1
        self._done += 1
        if self.on_progress is not None:
            self.on_progress(self._done, self.max_requests or 0)
        arrivals = self.arrivals
        if isinstance(arrivals, ClosedLoop):
            think = self.rng.expovariate(1.0 / arrivals.think_time) if arrivals.think_time > 0 else 0.0
            self._push(self.now + think, _WAKE, record.user)

    def _poll(self) -> None:
        """Hand every engine's queue length and KV usage to every router, then poll again while work remains.

        Polls at 0, interval, 2 × interval, ... (each the one before plus the interval, as a poller's timer). Of the
        polls before the next event, only the last is made: nothing changes between events, so the skipped ones
        would hand over the same figures, and what the last one does with them (a router taking requests out of
        prefill on the queue it sees) is what the skipped ones would have done by then. A trace's idle hours cost
        the additions alone, not a poll each (a week at 0.1 s was 6 million polls, over a minute a policy)."""
        for backend in self.backends:
            capacity = backend.cache.capacity
            usage = backend.cache.used_blocks / capacity if capacity else None
            for router in self.routers:
                router.set_engine_load(backend.name, queue_len=len(backend.waiting), kv_usage=usage)
        events, interval = self._events, self.metrics_interval
        if events and interval is not None:
            upcoming = self.now + interval
            horizon = events[0][0]  # the next event (this poll is off the heap)
            while upcoming + interval < horizon:  # the poll after it still comes first: skip this one
                upcoming += interval
            self._push(upcoming, _POLL, None)

    def _fleet_match(self, backend: SimBackend, hashes: Sequence[int], limit: int) -> int:
        """Longest leading run of ``hashes`` that any other backend holds (what routing could have reused)."""
        best = 0
        for other in self.backends:
            if other is not backend:
                cache = other.cache
                if cache.holds(hashes[best]) if best < limit else False:
                    best = max(best, cache.match(hashes, limit=limit))
        return best


class _IndexFeed:
    """A backend's cache changes written through each router's public write path, as a KV-event subscriber does."""

    __slots__ = ("backend", "routers")

    def __init__(self, routers: Sequence[Router], backend: str) -> None:
        self.routers = routers
        self.backend = backend

    def stored(self, hashes: list[int], parent: int | None) -> None:
        for router in self.routers:
            router.store(self.backend, hashes, parent=parent)

    def removed(self, hashes: list[int]) -> None:
        for router in self.routers:
            router.evict(self.backend, hashes)


def _check_routers(router: object) -> tuple[Router, ...]:
    """The gateway replicas a :class:`Simulation` drives: one Router, or distinct ones that hash alike."""
    if isinstance(router, Router):
        return (router,)
    if not isinstance(router, Sequence) or isinstance(router, (str, bytes)):
        raise InvalidTypeError(f"router must be a prefixroute.Router or a list of them, not {type(router).__name__}")
    routers = tuple(router)
    for item in routers:
        if not isinstance(item, Router):
            raise InvalidTypeError(
                f"router must be a prefixroute.Router or a list of them, not a list holding {type(item).__name__}"
            )
    if not routers:
        raise ConfigurationError("router must be a prefixroute.Router or a non-empty list of them, not an empty list")
    if len({id(r) for r in routers}) != len(routers):
        raise ConfigurationError("each gateway replica needs its own Router: the list names one Router twice")
    first = routers[0].hasher
    if any(r.hasher.block_size != first.block_size or r.hasher.seed != first.seed for r in routers[1:]):
        raise ConfigurationError(
            "the routers hash prompts differently (block_size or namespace): gateway replicas of one fleet must agree"
        )
    return routers


def _check_parts(workload: object, arrivals: object, cost: object, config: object, on_progress: object) -> None:
    """Raise InvalidTypeError for a :class:`Simulation` part of the wrong type (when given, not mid-run)."""
    if not callable(getattr(workload, "next_request", None)):
        raise InvalidTypeError(f"workload must have next_request(user), not {type(workload).__name__}")
    if not isinstance(arrivals, (ClosedLoop, OpenLoop, TraceTimes)):
        raise InvalidTypeError(f"arrivals must be a ClosedLoop, OpenLoop or TraceTimes, not {type(arrivals).__name__}")
    if not (callable(getattr(cost, "step_seconds", None)) and callable(getattr(cost, "prefill_seconds", None))):
        raise InvalidTypeError(f"cost must be a CostModel (step_seconds, prefill_seconds), not {type(cost).__name__}")
    if not isinstance(config, BackendConfig):
        raise InvalidTypeError(f"config must be a BackendConfig, not {type(config).__name__}")
    if on_progress is not None and not callable(on_progress):
        raise InvalidTypeError(
            f"on_progress must be a callable (done, total) or None, not {type(on_progress).__name__}"
        )
