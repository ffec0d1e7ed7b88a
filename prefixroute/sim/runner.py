"""Run one policy on one described setup: the glue between a :class:`SimSpec` and the engine."""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from types import MappingProxyType

from prefixroute._numbers import as_float, as_int, check_flag, shown
from prefixroute.errors import ConfigurationError, InvalidTypeError, PrefixRouteError
from prefixroute.index import PrefixIndex
from prefixroute.policies import (
    _REGISTRY,
    LoadPolicy,
    _failure,
    _import_module,
    _import_policy,
    policy_from_name,
    policy_names,
)
from prefixroute.router import Router
from prefixroute.sim.backend import BackendConfig
from prefixroute.sim.baselines import BASELINES
from prefixroute.sim.costmodel import Profile
from prefixroute.sim.engine import (
    MAX_BACKENDS,
    MAX_REQUESTS,
    MAX_USERS,
    Arrivals,
    ClosedLoop,
    OpenLoop,
    Simulation,
    TraceTimes,
    Workload,
)
from prefixroute.sim.index import EventsOnlyIndex
from prefixroute.sim.metrics import PolicyResult, summarize
from prefixroute.sim.profiles import load_profile
from prefixroute.sim.traces import TraceWorkload, check_speedup, load_trace
from prefixroute.sim.workloads import make_workload, scenario_names

__all__ = ["SimSpec", "backend_config", "build_policy", "check_polls", "run_policy", "vllm_defaults"]

_GIB = 2**30


@dataclass(frozen=True, kw_only=True)
class SimSpec:
    """Everything that defines a run except the policy. ``None`` fields take the scenario's or vLLM's default.

    Arrivals: ``rate`` (Poisson, req/s) if given; else trace timestamps (``trace`` given, ``users`` None); else
    ``users`` closed-loop users. Stop after ``requests`` arrivals and/or ``duration`` simulated seconds.
    ``index_source``: ``"predictions"`` (the router records where it sent each prompt, its index capped at each
    backend's KV capacity) or ``"events"`` (the simulated engines' KV events keep the index exact).
    ``metrics_interval``: poll engine queue lengths and KV usage into the router every so many seconds.
    ``first_token``: call :meth:`Router.first_token` when a request's first token is produced, as a streaming proxy
    does; False simulates a gateway that reports none (LiteLLM's Router, Ray Serve), where a request's uncached
    tokens count as pending prefill until it finishes.
    ``gateways``: gateway replicas, each with its own Router, index and policy and no shared state (as several
    ``prefixroute proxy`` processes behind one load balancer); each request goes to one drawn at random.

    Raises:
        ConfigurationError: a count that is not a positive int or is absurdly large (``--backends`` over 4,096,
            ``--gateways`` over 256, ``--requests`` over :data:`MAX_REQUESTS`, ``--rate`` × ``--duration`` over
            that, ``--duration`` or ``--think-time`` over 10^7 s, ``--requests`` ÷ ``--rate`` over that,
            ``--metrics-interval`` under 1 ms or polling more than 10^8 times over the span the spec gives), a
            number that is NaN, infinite, negative or (where it makes no sense) zero, a fraction outside its range,
            None for a field whose type has no None, an unknown ``index_source``, scenario, model or GPU, a ``tp``
            the model has no profile for on that GPU, a ``trace``, ``scenario``, ``model`` or ``gpu`` that is not a
            str, a ``first_token`` that is not a bool, a scenario with neither ``users`` nor ``rate``, or arrivals
            with no stop (a scenario or ``rate`` with neither ``requests`` nor ``duration``). Checked when the spec
            is made.
    """

    scenario: str = "seed"
    trace: str | None = None
    backends: int = 8
    users: int | None = 30
    rate: float | None = None
    speedup: float = 1.0
    think_time: float | None = None
    model: str = "codellama-13b"
    gpu: str = "a100-40gb"
    tp: int | None = None
    requests: int | None = 1500
    duration: float | None = None
    seed: int = 0
    sharing_ratio: float | None = None
    output_tokens: int | None = None
    gpu_hour_usd: float = 2.0
    gpu_memory_utilization: float = 0.9
    capacity_blocks: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    index_source: str = "predictions"
    metrics_interval: float | None = None
    first_token: bool = True
    gateways: int = 1

    def __post_init__(self) -> None:
        _check_spec(self)

    def with_(self, **changes: object) -> SimSpec:
        """A copy with some fields changed, each checked as when the spec is made.

        Raises:
            ConfigurationError: a name is no field of SimSpec, or a value is one the field cannot use.
        """
        unknown = sorted(set(changes) - {f.name for f in fields(self)})
        if unknown:
            raise ConfigurationError(
                f"SimSpec has no field {', '.join(map(repr, unknown))}: its fields are "
                f"{', '.join(f.name for f in fields(self))}"
            )
        return replace(self, **changes)  # type: ignore[arg-type]


# Each count's largest value: far above any real fleet or run, low enough that a typo (an extra zero, 10**13) is an
# error, not a run that fills the memory or never ends.
_POSITIVE_INTS: Mapping[str, int] = MappingProxyType(
    {
        "backends": MAX_BACKENDS,
        "users": MAX_USERS,
        "tp": 1024,
        "requests": MAX_REQUESTS,
        "output_tokens": 10_000_000,
        "capacity_blocks": 2**40,
        "max_num_seqs": 1_000_000,
        "max_num_batched_tokens": 100_000_000,
        "gateways": 256,  # gateway replicas, each a Router of its own
    }
)
_MIN_METRICS_INTERVAL = 0.001  # seconds of simulated time between polls: below that the run is all polling
_MAX_DURATION = 10_000_000.0  # simulated seconds (16 weeks)
_MAX_GPU_HOUR_USD = 1_000_000.0  # a price past any GPU's; far above it the monthly recompute cost overflows to inf
_POSITIVE_NUMBERS = ("rate", "speedup", "duration", "metrics_interval")
_NON_NEGATIVE_NUMBERS = ("think_time", "gpu_hour_usd")
# Options the CLI has: their messages name the flag.
_FLAGS = frozenset(
    {"backends", "users", "tp", "requests", "rate", "speedup", "duration", "metrics_interval", "think_time"}
    | {"gpu_hour_usd", "sharing_ratio", "seed", "index_source", "gateways"}
)


def _name(field: str) -> str:
    return "--" + field.replace("_", "-") if field in _FLAGS else field


_MAX_POLLS = 1e8  # engine-metrics polls in one run: ~15 minutes of polling alone


def _stop_after(spec: SimSpec, source: Workload) -> int | None:
    """The requests a run stops after: ``--requests``, or for a trace sent at ``--rate`` with no limit, the whole
    trace (open-loop arrivals need a stop; a trace's prompts end)."""
    if spec.requests is None and spec.duration is None and spec.rate is not None and isinstance(source, TraceWorkload):
        return max(1, len(source))
    return spec.requests


def check_polls(spec: SimSpec, span: float) -> None:
    """Refuse a ``--metrics-interval`` that polls over :data:`_MAX_POLLS` times in ``span`` simulated seconds.

    Raises:
        ConfigurationError: it does.
    """
    if spec.metrics_interval is not None and span / spec.metrics_interval > _MAX_POLLS:
        raise ConfigurationError(
            f"--metrics-interval {shown(spec.metrics_interval)} s over about {span:,.3g} simulated seconds is "
            f"over {_MAX_POLLS:,.0f} polls (each costs real time): poll less often, or simulate a shorter span"
        )


def _span(spec: SimSpec) -> float:
    """The simulated seconds the arrivals take, as far as the spec says (0 when only the run will tell)."""
    if spec.duration is not None:
        return float(spec.duration)
    if spec.requests is not None and spec.rate is not None:
        return spec.requests / spec.rate
    if spec.requests is not None and spec.users and spec.think_time:
        return spec.requests * spec.think_time / spec.users
    return 0.0


def _check_spec(spec: SimSpec) -> None:
    may_be_none = {f.name for f in fields(spec) if "None" in str(f.type)}  # its annotation says `... | None`
    for field, most in _POSITIVE_INTS.items():
        value = getattr(spec, field)
        if value is None and field in may_be_none:
            continue
        count = as_int(value)
        if count is None or not 1 <= count <= most:
            raise ConfigurationError(f"{_name(field)} must be an int in [1, {most:,}], not {shown(value)}")
        object.__setattr__(spec, field, count)  # a numpy int kept as the Python int it stands for (frozen spec)
    for field, low in [(f, "> 0") for f in _POSITIVE_NUMBERS] + [(f, ">= 0") for f in _NON_NEGATIVE_NUMBERS]:
        value = getattr(spec, field)
        if value is None and field in may_be_none:
            continue
        number = as_float(value)
        if number is None or not (number > 0 if low == "> 0" else number >= 0):
            raise ConfigurationError(f"{_name(field)} must be a finite number {low}, not {shown(value)}")
        object.__setattr__(spec, field, number)  # a numpy float kept as the Python float it stands for
    if spec.sharing_ratio is not None:
        ratio = as_float(spec.sharing_ratio)
        if ratio is None or not 0 <= ratio <= 1:
            raise ConfigurationError(f"--sharing-ratio must be between 0 and 1, not {shown(spec.sharing_ratio)}")
        object.__setattr__(spec, "sharing_ratio", ratio)
    utilization = as_float(spec.gpu_memory_utilization)
    if utilization is None or not 0 < utilization <= 1:
        raise ConfigurationError(f"gpu_memory_utilization must be in (0, 1], not {shown(spec.gpu_memory_utilization)}")
    object.__setattr__(spec, "gpu_memory_utilization", utilization)
    seed = as_int(spec.seed)
    if seed is None:
        raise ConfigurationError(f"--seed must be an int, not {shown(spec.seed)}")
    object.__setattr__(spec, "seed", seed)
    check_flag(spec.first_token, "first_token")
    # A str first: an array's == answers elementwise, and `in` would raise numpy's own ValueError.
    if not isinstance(spec.index_source, str) or spec.index_source not in ("predictions", "events"):
        raise ConfigurationError(f"--index-source must be 'predictions' or 'events', not {shown(spec.index_source)}")
    if spec.trace is not None and not isinstance(spec.trace, str):
        raise ConfigurationError(f"--trace must be FORMAT:PATH, a str, not {type(spec.trace).__name__}")
    if not isinstance(spec.scenario, str):
        raise ConfigurationError(f"--scenario must be a scenario name, a str, not {type(spec.scenario).__name__}")
    for flag, name in (("--model", spec.model), ("--gpu", spec.gpu)):
        if not isinstance(name, str):
            raise ConfigurationError(f"{flag} must be a profile's name, a str, not {type(name).__name__}")
    load_profile(spec.model, spec.gpu, tp=spec.tp)  # an unknown model or GPU, or a tp it has no profile for
    if spec.trace is None and spec.rate is None and spec.users is None:
        raise ConfigurationError("give --users or --rate (only a trace brings its own arrival times)")
    if spec.trace is None and spec.rate is None and spec.requests is None and spec.duration is None:
        raise ConfigurationError(
            "closed-loop users of a scenario never stop by themselves: give --requests or --duration"
        )
    if spec.trace is None and spec.scenario not in scenario_names():
        raise ConfigurationError(f"unknown scenario {spec.scenario!r}; choose one of {', '.join(scenario_names())}")
    if spec.trace is not None and spec.sharing_ratio is not None:
        raise ConfigurationError("--sharing-ratio shapes a scenario's prompts; a --trace brings its own: leave it out")
    if spec.think_time is not None and (spec.users is None or spec.rate is not None):
        raise ConfigurationError(
            "--think-time is the pause of closed-loop users: give --users (and no --rate), or leave it out"
        )
    if spec.rate is not None and spec.requests is None and spec.duration is None and spec.trace is None:
        raise ConfigurationError("open-loop arrivals (--rate) never stop by themselves: give --requests or --duration")
    if spec.speedup != 1 and (spec.trace is None or spec.users is not None or spec.rate is not None):
        raise ConfigurationError(
            "--speedup divides a trace's timestamps: it applies to a --trace replayed at them (no --users or --rate); "
            "leave it out"
        )
    if spec.metrics_interval is not None and spec.metrics_interval < _MIN_METRICS_INTERVAL:
        raise ConfigurationError(
            f"--metrics-interval must be at least {_MIN_METRICS_INTERVAL} s, not {shown(spec.metrics_interval)}"
        )
    if spec.duration is not None and spec.duration > _MAX_DURATION:
        raise ConfigurationError(f"--duration must be at most {_MAX_DURATION:,.0f} s, not {shown(spec.duration)}")
    # Simulated times far past the longest duration lose the float precision a millisecond needs (1e300 s + 1 ms is
    # 1e300 s): so requests arrive within it, as --duration's do.
    if spec.think_time is not None and spec.think_time > _MAX_DURATION:
        raise ConfigurationError(f"--think-time must be at most {_MAX_DURATION:,.0f} s, not {shown(spec.think_time)}")
    if spec.gpu_hour_usd > _MAX_GPU_HOUR_USD:
        raise ConfigurationError(
            f"--gpu-hour-usd must be at most {_MAX_GPU_HOUR_USD:,.0f} ($ per GPU-hour), not {shown(spec.gpu_hour_usd)}"
        )
    if spec.rate is not None and spec.requests is not None and spec.requests / spec.rate > _MAX_DURATION:
        raise ConfigurationError(
            f"--rate {shown(spec.rate)} takes {spec.requests / spec.rate:,.3g} s to send --requests "
            f"{spec.requests:,}, more than {_MAX_DURATION:,.0f} s: raise the rate, or send fewer requests"
        )
    check_polls(spec, _span(spec))
    arrivals = (spec.rate or 0) * (spec.duration or 0) if spec.requests is None else 0
    if arrivals > MAX_REQUESTS:
        raise ConfigurationError(
            f"--rate {shown(spec.rate)} for --duration {shown(spec.duration)} s makes more than "
            f"{MAX_REQUESTS:,} requests: lower one, or give --requests"
        )


def vllm_defaults(gpu_memory_bytes: int, *, gpu: str = "") -> tuple[int, int]:
    """vLLM V1's online-serving defaults for (max_num_seqs, max_num_batched_tokens) on a GPU of that memory and name.

    As vLLM's ``EngineArgs.get_batch_defaults`` chooses them: (1024, 8192) from 70 GiB up, except on an A100 (any
    name containing ``a100``: vLLM found the large budget slows them, PR #17885), else (256, 2048).

    Raises:
        InvalidTypeError: ``gpu`` is not a str.
    """
    if not isinstance(gpu, str):
        raise InvalidTypeError(f"gpu must be a GPU's name, a str, not {type(gpu).__name__}")
    large = gpu_memory_bytes >= 70 * _GIB and "a100" not in gpu.lower()
    return (1024, 8192) if large else (256, 2048)


def backend_config(spec: SimSpec) -> tuple[BackendConfig, Profile]:
    """The engine settings and cost profile ``spec`` describes (KV capacity sized as vLLM sizes it)."""
    profile = load_profile(spec.model, spec.gpu, tp=spec.tp)
    seqs, tokens = vllm_defaults(profile.gpu.memory_bytes, gpu=profile.gpu.name)
    seqs = spec.max_num_seqs or seqs
    tokens = spec.max_num_batched_tokens or tokens
    capacity = spec.capacity_blocks
    if capacity is None:
        capacity = profile.kv_capacity_blocks(
            16,
            gpu_memory_utilization=spec.gpu_memory_utilization,
            max_num_batched_tokens=tokens,
            max_num_seqs=seqs,
        )
    config = BackendConfig(capacity_blocks=capacity, max_num_seqs=seqs, max_num_batched_tokens=tokens)
    return config, profile


def build_policy(name: str, *, seed: int) -> LoadPolicy:
    """A policy by registry name, baseline name or ``module:Class``, seeded from ``seed`` when it takes randomness.

    Names are looked up in the core registry (:func:`~prefixroute.policy_names`) first, then among the simulator's
    reference baselines (:data:`~prefixroute.sim.baselines.BASELINES`: ``sglang``, ``dynamo``, ...), which are not
    in the core registry. A policy class whose constructor takes an ``rng`` keyword gets ``random.Random(seed)``;
    otherwise one that takes ``seed`` gets ``seed``: so "same seed, same result" holds for built-in, baseline and
    user policies alike; a constructor that requires ``seed`` gets it too. A ``module:Class`` whose module is a file
    in the current directory is found even when the current directory is not on ``sys.path`` (the installed
    ``prefixroute`` command).

    Raises:
        ConfigurationError: an unknown name (the message lists the built-in and baseline names), a class that is not
            a :class:`LoadPolicy`, and a ``module:Class`` whose import or constructor raises anything (SystemExit
            too).
    """
    if ":" not in name:
        if name in policy_names():
            return _seeded(name, seed)
        baseline = BASELINES.get(name)
        if baseline is None:
            raise ConfigurationError(
                f"unknown policy {name!r}: use a built-in ({', '.join(policy_names())}), a baseline "
                f"({', '.join(BASELINES)}) or 'package.module:ClassName'"
            )
        keyword = _seed_keyword(baseline)
        return baseline() if keyword is None else baseline(**{keyword: _seed_value(keyword, seed)})
    # The user's own module and class: any error in them is the user's to fix, so it becomes a clear message. That
    # includes SystemExit: a script whose top-level code parses its own command line exits when imported.
    try:
        _import_module(name.partition(":")[0])
    except (Exception, SystemExit) as exc:
        raise ConfigurationError(f"cannot import policy {name!r}: {_failure(exc)}") from exc
    try:
        return _seeded(name, seed)
    except PrefixRouteError:
        raise
    except (Exception, SystemExit) as exc:
        raise ConfigurationError(f"cannot build policy {name!r}: {_failure(exc)}") from exc


def _seeded(name: str, seed: int) -> LoadPolicy:
    # The class, not an instance, says how it takes its seed: a constructor requiring ``seed`` is built once, with it.
    keyword = _seed_keyword(_import_policy(name) if ":" in name else _REGISTRY[name])
    if keyword is None:
        return policy_from_name(name)
    return policy_from_name(name, **{keyword: _seed_value(keyword, seed)})


def _seed_value(keyword: str, seed: int) -> object:
    return random.Random(seed) if keyword == "rng" else seed


def _seed_keyword(cls: type) -> str | None:
    """``"rng"`` or ``"seed"``: the keyword ``cls``'s constructor takes its randomness by, if any."""
    try:
        parameters = inspect.signature(cls).parameters
    except (TypeError, ValueError):  # a constructor without a signature (a C extension type)
        return None
    by_keyword = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return next((k for k in ("rng", "seed") if k in parameters and parameters[k].kind in by_keyword), None)


def _workload(spec: SimSpec, build: Callable[[], Workload] | None = None) -> tuple[Workload, Arrivals]:
    if spec.trace is not None:
        workload: Workload = (
            build()
            if build is not None
            else load_trace(spec.trace, seed=spec.seed, output_tokens=spec.output_tokens, limit=spec.requests)
        )
        think = spec.think_time or 0.0
    else:
        scenario = make_workload(spec.scenario, seed=spec.seed, sharing_ratio=spec.sharing_ratio)
        workload = scenario if build is None else build()
        think = scenario.think_time if spec.think_time is None else spec.think_time
    arrivals: Arrivals
    if spec.rate is not None:
        arrivals = OpenLoop(spec.rate, users=spec.users or 64)
    elif spec.users is None:  # a trace (the spec refuses a scenario without users or rate)
        arrivals = TraceTimes(speedup=spec.speedup)
        if isinstance(workload, TraceWorkload):
            check_speedup(workload, spec.speedup)
            check_polls(spec, workload.last_arrival / spec.speedup)
    else:
        arrivals = ClosedLoop(spec.users, think_time=think)
    return workload, arrivals


def run_policy(
    spec: SimSpec,
    policy: str | Callable[[], LoadPolicy],
    *,
    label: str | None = None,
    workload: Callable[[], Workload] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    check: bool = False,
) -> PolicyResult:
    """Simulate ``spec`` with one policy (a name, or a factory returning a fresh policy) and summarize it.

    ``workload`` optionally builds the request source instead of ``spec.scenario``/``spec.trace`` (e.g. a scenario
    with other parameters, or a trace already read); ``spec`` still gives its arrivals. Every run builds a fresh
    Router, workload and backends from ``spec.seed``: same spec, same result.

    Raises:
        TypeError: ``spec`` is not a :class:`SimSpec`, ``policy`` neither a name nor a callable returning a
            :class:`~prefixroute.LoadPolicy`, ``workload`` or ``on_progress`` not a callable (or None).
        ConfigurationError: ``check`` is not a bool.
    """
    if not isinstance(spec, SimSpec):
        raise InvalidTypeError(f"spec must be a SimSpec, not {type(spec).__name__}")
    if not isinstance(policy, str) and not callable(policy):
        raise InvalidTypeError(
            f"policy must be a name or a callable returning a LoadPolicy, not {type(policy).__name__}"
        )
    for name, function in (("workload", workload), ("on_progress", on_progress)):
        if function is not None and not callable(function):
            raise InvalidTypeError(f"{name} must be a callable or None, not {type(function).__name__}")
    check_flag(check, "check")
    config, profile = backend_config(spec)
    source, arrivals = _workload(spec, workload)
    clock = _SimClock()
    events = spec.index_source == "events"
    routers = []
    for gateway in range(spec.gateways):  # replicas share nothing: each its own index, policy and decision ids
        seed = spec.seed + gateway
        load_policy = build_policy(policy, seed=seed) if isinstance(policy, str) else policy()
        if not isinstance(load_policy, LoadPolicy):  # Router() would take None for its default policy
            raise InvalidTypeError(f"policy() must return a LoadPolicy instance, not {type(load_policy).__name__}")
        # Events: the engines' KV events are the only writer (exact). Predictions: the router records where it sent
        # each prompt, its index capped at each engine's KV capacity. Either way the router knows that capacity (as a
        # Fleet reads num_gpu_blocks from /metrics), which its policies read as Candidate.capacity_blocks.
        index_class = EventsOnlyIndex if events else PrefixIndex
        index = index_class(config.block_size, capacity_blocks=config.capacity_blocks)
        ids = random.Random(spec.seed if gateway == 0 else f"{spec.seed}:{gateway}")
        routers.append(Router(block_size=config.block_size, policy=load_policy, clock=clock, index=index, rng=ids))
    simulation = Simulation(
        router=routers,
        workload=source,
        arrivals=arrivals,
        cost=profile,
        config=config,
        backends=spec.backends,
        max_requests=_stop_after(spec, source),
        duration=spec.duration,
        seed=spec.seed,
        gpus_per_backend=profile.tp,
        check=check,
        on_progress=on_progress,
        kv_events=events,
        metrics_interval=spec.metrics_interval,
        first_token=spec.first_token,
    )
    clock.simulation = simulation
    name = label or (policy if isinstance(policy, str) else repr(routers[0].policy))
    try:
        outcome = simulation.run()
    except PrefixRouteError as exc:  # the router's, or one a policy raised: named as the user named the policy
        if type(exc).__module__ != PrefixRouteError.__module__:  # a user's subclass may take other arguments
            raise
        raise type(exc)(f"{name}: {exc}") from (exc.__cause__ or exc)
    return summarize(outcome, policy=name, gpu_hour_usd=spec.gpu_hour_usd)


class _SimClock:
    """The router's clock in a simulation: the simulated time, so decisions carry simulated timestamps."""

    def __init__(self) -> None:
        self.simulation: Simulation | None = None

    def __call__(self) -> float:
        return self.simulation.now if self.simulation is not None else 0.0
