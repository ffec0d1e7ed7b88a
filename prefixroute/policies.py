"""Load policies: given the candidates for one request, choose one. Subclass :class:`LoadPolicy` for your own.

Every policy sees the same :class:`Candidate` list: one per backend, in the request's deterministic placement
order (rendezvous hashing of the prompt's first blocks), so "the first of equals" means the same backend on every
router replica. Policies run under the router's lock: they must be quick, must not block and must not call back into
the router (that raises :class:`~prefixroute.errors.PolicyError`; the candidates carry what a policy needs).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import numbers
import os
import random
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter
from types import MappingProxyType
from typing import Any, ClassVar, NamedTuple, TypeVar

from prefixroute._numbers import as_float, as_int, check_flag, shown
from prefixroute.errors import ConfigurationError, InvalidTypeError, NoBackendError, PolicyError, PrefixRouteError

__all__ = [
    "BoundedLoad",
    "Candidate",
    "CostAware",
    "LeastLoaded",
    "LinearTTFT",
    "LoadPolicy",
    "PowerOfTwo",
    "PredictedTTFT",
    "PrefixAffinity",
    "Random",
    "RoundRobin",
    "kv_fraction",
    "policy_from_name",
    "policy_names",
]


class Candidate(NamedTuple):
    """One backend as a policy sees it for one request (immutable).

    ``matched_tokens`` of the ``prompt_tokens`` are (predicted to be) in its prefix cache; ``in_flight`` counts
    this router's requests there that have not finished. ``queue_len`` (requests waiting in the engine) and
    ``kv_usage`` (KV cache fraction in use, 0–1) come from engine metrics when a poller supplies them, else None.

    The router's own work accounting, from the request lifecycle (:meth:`Router.start`,
    :meth:`~Router.first_token`, :meth:`~Router.finish`): ``pending_prefill_tokens`` is the uncached prompt tokens
    of its requests there still in prefill, ``held_blocks`` the KV blocks of its prompts in flight there (each
    prompt counted whole), ``capacity_blocks`` its KV capacity in blocks when known, and ``prefill_tokens_per_s``
    the prefill speed observed from first-token times (None until a first token was reported there).
    ``active_blocks`` is the distinct KV blocks of its requests in flight there, a prefix they share counted once
    (an estimate, see docs/policies.md: what their memory use is, where ``held_blocks`` is what their attention
    reads); ``in_prefill`` how many of its requests there have no first token yet; ``block_size`` the router's
    tokens per block, the unit of the block figures. Where the gateway reports no first tokens, the engine's
    waiting queue (:meth:`Router.set_engine_load`) tells which requests are past their prefill instead.
    ``pending_prefill_context`` is the attention of that pending prefill work: for each of those requests, its
    uncached tokens times the context each token attends to (``u × m + u × (u + 1) / 2`` for ``u`` uncached tokens
    after ``m`` cached ones, the token × context pairs its prefill computes). ``attention_tokens`` is the context
    length at which a prefill token's attention costs as much as the rest of its compute, fitted over the fleet from
    first-token times (:meth:`Router.first_token`; how the default counts it: :attr:`Candidate.prefill_work`);
    None until the fit holds (no first tokens reported, or waits that do not grow with context), and the same for
    every candidate of a choice. ``memory_wait_s`` is how long this request would wait there for KV memory: 0 while
    its uncached blocks fit beside ``active_blocks`` in ``capacity_blocks`` (or the capacity is unknown), else the
    seconds until enough blocks are predicted free, walking the router's requests in flight there oldest first, each
    freeing its prompt's blocks once it has been in flight as long as requests live on average (the mean time from
    :meth:`Router.start` to :meth:`~Router.finish`, learned over the fleet; 0 until a request finished). An
    estimate, closest where requests live about alike; it says which full backend frees its memory first, which
    ``kv_usage`` and ``active_blocks`` cannot.

    A ``NamedTuple``: built once per backend per request, it costs a quarter of a frozen dataclass. Its fields are
    not checked when it is built; a built-in policy whose rule fails on one of the wrong type or an impossible value
    raises an :class:`~prefixroute.errors.InvalidTypeError` or a :class:`~prefixroute.errors.ConfigurationError`
    naming the candidate and the field.
    """

    backend: str
    matched_tokens: int
    prompt_tokens: int
    in_flight: int
    queue_len: int | None = None
    kv_usage: float | None = None
    pending_prefill_tokens: int = 0
    held_blocks: int = 0
    capacity_blocks: int | None = None
    prefill_tokens_per_s: float | None = None
    active_blocks: int = 0
    in_prefill: int = 0
    block_size: int = 16
    pending_prefill_context: int = 0
    attention_tokens: float | None = None
    memory_wait_s: float = 0.0

    @property
    def load(self) -> int:
        """Requests this candidate is busy with: in flight from this router plus the engine's waiting queue."""
        return self.in_flight + (self.queue_len or 0)

    @property
    def uncached_tokens(self) -> int:
        """This request's prompt tokens that this backend would have to prefill."""
        return self.prompt_tokens - self.matched_tokens

    @property
    def prefill_work(self) -> float:
        """The prefill queued here plus this request's own, in tokens of prefill work: ``pending_prefill_tokens +
        uncached_tokens``, and, once ``attention_tokens`` is known, their token × context pairs over it (a token
        late in a long prompt costs more than one early in a short one)."""
        uncached = self.prompt_tokens - self.matched_tokens
        work: float = self.pending_prefill_tokens + uncached
        if self.attention_tokens:
            pairs = uncached * self.matched_tokens + uncached * (uncached + 1) / 2
            work += (self.pending_prefill_context + pairs) / self.attention_tokens
        return work


class LoadPolicy(ABC):
    """Choose one candidate for a request. Override :meth:`choose`; that is the whole contract.

    ``prefix_aware`` says whether the policy means to follow cached prefixes: the router then labels a choice that
    is not the best-matching candidate a ``"load-fallback"``; other policies' choices are labelled ``"policy"``.

    >>> class FewestCachedMisses(LoadPolicy):
    ...     name = "fewest-uncached"
    ...     prefix_aware = True
    ...     def choose(self, candidates):
    ...         return min(candidates, key=lambda c: (c.prompt_tokens - c.matched_tokens, c.load))
    >>> FewestCachedMisses().choose([Candidate("a", 0, 64, 0), Candidate("b", 48, 64, 3)]).backend
    'b'
    """

    name: ClassVar[str] = ""
    prefix_aware: ClassVar[bool] = False

    @abstractmethod
    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        """Return one of ``candidates`` for this request (the router never passes an empty list; the built-in
        policies raise :class:`~prefixroute.NoBackendError` for one)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _require_candidates(candidates: Sequence[Candidate]) -> None:
    """Raise a clear error for an empty candidate list or one of something else than Candidates (the router never
    passes one; a direct caller might). O(len(candidates)), in C for the router's tuple of Candidates."""
    if type(candidates) is not tuple and (
        isinstance(candidates, _NOT_CANDIDATES) or not isinstance(candidates, Sequence)
    ):
        raise InvalidTypeError(f"choose() takes a sequence of Candidates, not {type(candidates).__name__}")
    if not candidates:
        raise NoBackendError("choose() was given no candidates: pass at least one Candidate")
    if not set(map(type, candidates)) <= _CANDIDATE:
        for candidate in candidates:
            if not isinstance(candidate, Candidate):
                raise InvalidTypeError(
                    f"choose() takes Candidates, not {type(candidate).__name__} ({shown(candidate)})"
                )


_CANDIDATE = frozenset({Candidate})
_NOT_CANDIDATES = (str, bytes, bytearray, memoryview)
_OPTIONAL_REALS = frozenset({"kv_usage", "prefill_tokens_per_s", "attention_tokens"})
_OPTIONAL = _OPTIONAL_REALS | {"queue_len", "capacity_blocks"}
_REALS = _OPTIONAL_REALS | {"memory_wait_s"}
_AT_LEAST_0 = frozenset({"kv_usage", "memory_wait_s"})

_Policy = TypeVar("_Policy", bound=LoadPolicy)


def _names_bad_fields(
    choose: Callable[[_Policy, Sequence[Candidate]], Candidate],
) -> Callable[[_Policy, Sequence[Candidate]], Candidate]:
    """Wrap a built-in ``choose()``: when its rule fails on a hand-built :class:`Candidate` whose field has the wrong
    type or an impossible value (None or NaN for a count, more tokens matched than the prompt has), raise an
    :class:`~prefixroute.errors.InvalidTypeError` or a :class:`~prefixroute.errors.ConfigurationError` that names the
    candidate and the field, instead of whatever the arithmetic inside the rule raised. Costs nothing until the rule
    raises (the router's own candidates are always well formed)."""

    @functools.wraps(choose)
    def checked(policy: _Policy, candidates: Sequence[Candidate]) -> Candidate:
        try:
            return choose(policy, candidates)
        except PrefixRouteError:
            raise
        except Exception as error:
            _check_fields(candidates, error)
            raise

    return checked


def _check_fields(candidates: Sequence[Candidate], error: Exception | None) -> None:
    """Raise, from ``error``, for the first field of ``candidates`` that is not as :class:`Candidate` documents it (a
    wrong type an InvalidTypeError, a wrong value a ConfigurationError); returns if every field is well formed."""
    for candidate in candidates:
        if not isinstance(candidate, Candidate):
            return  # choose() raised on something else than a Candidate's field
        for name, value in zip(Candidate._fields, candidate, strict=True):
            fault = _field_fault(name, value)
            if fault is not None:
                kind, due = fault
                raise kind(f"Candidate {shown(candidate[0])}: {name} must be {due}, not {shown(value)}") from error
        if candidate.matched_tokens > candidate.prompt_tokens:
            raise ConfigurationError(
                f"Candidate {shown(candidate[0])}: matched_tokens ({candidate.matched_tokens}) must be at most "
                f"prompt_tokens ({candidate.prompt_tokens})"
            ) from error


def _field_fault(name: str, value: object) -> tuple[type[PrefixRouteError], str] | None:
    """What is wrong with the value of a :class:`Candidate`'s field ``name``: the error to raise and what the value
    must be; None if nothing. ``backend`` a str; ``kv_usage`` and ``memory_wait_s`` finite reals ≥ 0,
    ``prefill_tokens_per_s`` and ``attention_tokens`` ones > 0; ``block_size`` an int ≥ 1, every other field an int
    ≥ 0, each int below 2**63 (the rules do float arithmetic); ``queue_len``, ``capacity_blocks``, ``kv_usage``,
    ``prefill_tokens_per_s`` and ``attention_tokens`` may be None."""
    if name == "backend":
        return None if isinstance(value, str) else (InvalidTypeError, "a str")
    if value is None and name in _OPTIONAL:
        return None
    either = " or None" if name in _OPTIONAL else ""
    if name in _REALS:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return InvalidTypeError, f"a real number{either}"
        number = as_float(value)
        if name not in _AT_LEAST_0:
            return None if number is not None and number > 0 else (ConfigurationError, "finite and above 0")
        return None if number is not None and number >= 0 else (ConfigurationError, "finite and at least 0")
    integer = as_int(value)
    low = 1 if name == "block_size" else 0
    if integer is None:
        return InvalidTypeError, f"an int{either}"
    if integer >= _INT_LIMIT:  # too large for a float (the router refuses such an engine queue too)
        return ConfigurationError, "below 2**63"
    return None if integer >= low else (ConfigurationError, f"at least {low}")


_INT_LIMIT = 2**63


class RoundRobin(LoadPolicy):
    """Each request to the next candidate in turn, ignoring caches: the baseline prefix routing beats."""

    name = "round-robin"

    def __init__(self) -> None:
        self._turn = 0

    @_names_bad_fields
    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        _require_candidates(candidates)
        # Candidates arrive in per-prompt placement order; rotate over a fixed order (by backend id) instead.
        ordered = sorted(candidates, key=lambda c: c.backend)
        chosen = ordered[self._turn % len(ordered)]
        self._turn += 1
        return chosen


class Random(LoadPolicy):
    """A uniformly random candidate from a seeded ``random.Random`` (pass ``seed`` or ``rng``)."""

    name = "random"

    def __init__(self, *, seed: int | None = None, rng: random.Random | None = None) -> None:
        self._rng = _rng(seed, rng, "Random")

    @_names_bad_fields
    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        _require_candidates(candidates)
        count = len(candidates)
        drawn: object = _NOT_DRAWN
        try:
            drawn = self._rng.randrange(count)
            return candidates[drawn]  # its own bounds check: a draw past the end raises
        except Exception as exc:
            if type(drawn) is int and 0 <= drawn < count:
                raise  # not the rng's fault: a Sequence of candidates whose indexing raised
            raise _rng_fault(self, self._rng, f"randrange({count})", drawn, f"an int in [0, {count})", exc) from exc


class LeastLoaded(LoadPolicy):
    """The candidate with the lowest :attr:`Candidate.load`; ties go to the first in placement order."""

    name = "least-loaded"

    @_names_bad_fields
    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        _require_candidates(candidates)
        return min(candidates, key=_load)


class PowerOfTwo(LoadPolicy):
    """The less loaded of two candidates sampled at random: near least-loaded balance with little state."""

    name = "power-of-two"

    def __init__(self, *, seed: int | None = None, rng: random.Random | None = None) -> None:
        self._rng = _rng(seed, rng, "PowerOfTwo")

    @_names_bad_fields
    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        _require_candidates(candidates)
        if len(candidates) == 1:
            return candidates[0]
        count = len(candidates)
        drawn: object = _NOT_DRAWN
        try:
            drawn = self._rng.sample(range(count), 2)
            first, second = drawn
            pair = candidates[min(first, second)], candidates[max(first, second)]  # a draw past the end raises
        except Exception as exc:
            if type(drawn) is list and len(drawn) == 2 and all(type(i) is int and 0 <= i < count for i in drawn):
                raise  # not the rng's fault: a Sequence of candidates whose indexing raised
            raise _rng_fault(
                self, self._rng, f"sample(range({count}), 2)", drawn, f"two ints in [0, {count})", exc
            ) from exc
        return min(pair, key=_load)


class PrefixAffinity(LoadPolicy):
    """The longest cached prefix, whatever the load; ties to the least loaded. Pure affinity makes hot spots."""

    name = "prefix-affinity"
    prefix_aware = True

    @_names_bad_fields
    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        _require_candidates(candidates)
        return min(candidates, key=lambda c: (-c.matched_tokens, c.load))


class BoundedLoad(LoadPolicy):
    """The longest cached prefix among candidates that stay within ``factor`` × the mean load.

    Consistent hashing with bounded loads, on :attr:`Candidate.load` (this router's requests in flight plus the
    engine's waiting queue when metrics supply it; without metrics, the requests in flight): a candidate qualifies
    if its load after taking this request stays within ``ceil(factor × (total load + 1) / len(candidates))``, so no
    backend ever exceeds ``factor`` × the mean + 1. At ``factor=2`` this is the "divert above 2× the mean" rule.
    When requests do not overlap (nothing in flight) every candidate qualifies and affinity always holds; under
    load, a hot prefix spills to the next-best match, and among equally matched candidates the least loaded wins.
    The bound is relative to the mean, idle backends included: backends holding a prefix that every request shares
    keep all of the traffic, however long their queues, while they are at least 1/``factor`` of the candidates
    (half of them at the default factor 2; docs/policies.md measures it on a real trace).
    A miss has no cached prefix to protect, so it gets the tightest bound (factor 1): the first backend in
    placement order whose load after placing stays within the mean. With nothing in flight that is the rendezvous
    choice, so router replicas agree where a new prefix lives; under load, new prefixes avoid busy backends (the
    simulator's ``seed`` scenario shows the difference: see docs/simulator.md). One candidate always qualifies: the
    least loaded is at most the mean, below ``(total load + 1) / len(candidates)`` (compared in integers, so
    also for loads past 2**53). O(len(candidates)).
    """

    name = "bounded-load"
    prefix_aware = True

    def __init__(self, *, factor: float = 2.0) -> None:
        value = as_float(factor)
        if value is None or value < 1.0:
            raise ConfigurationError(f"BoundedLoad factor must be a finite number >= 1.0, not {shown(factor)}")
        self.factor = value

    @_names_bad_fields
    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        _require_candidates(candidates)
        loads = [c.load for c in candidates]
        total = sum(loads)
        n = len(candidates)
        # An int load is below ceil(x) exactly when it is below x: no ceil, so a huge factor's infinite x works too.
        bound = self.factor * (total + 1) / n
        # A load within the mean (load * n <= total, exact in ints) always qualifies, whatever the rounding of bound
        # for loads past 2**53: so eligible always holds the least loaded.
        eligible = [c for c, load in zip(candidates, loads, strict=True) if load < bound or load * n <= total]
        longest = max(map(_matched, eligible))
        if longest == 0:
            # A miss has no cached prefix to protect, so it gets the tightest bound (factor 1): the first backend in
            # placement order that is at most averagely loaded. One always qualifies, and when nothing is in flight
            # it is the rendezvous choice, so replicas still agree where a new prefix lives.
            return next(c for c, load in zip(candidates, loads, strict=True) if load * n <= total)
        return min((c for c in eligible if c.matched_tokens == longest), key=_load)

    def __repr__(self) -> str:
        return f"BoundedLoad(factor={self.factor})"


@dataclass(frozen=True, kw_only=True)
class LinearTTFT:
    """A small time-to-first-token model: queueing behind ``load`` requests plus prefill of the uncached suffix.

    ``ttft = load × per_request_s + uncached × per_token_s + uncached × matched × per_token_pair_s``; the last term
    is attention of the new tokens over the cached context. Defaults are for a 13B model on one A100.
    """

    per_request_s: float = 0.05
    per_token_s: float = 1.2e-4
    per_token_pair_s: float = 2.0e-9

    def __post_init__(self) -> None:
        for name in ("per_request_s", "per_token_s", "per_token_pair_s"):
            value = as_float(getattr(self, name))
            if value is None or value < 0:
                raise ConfigurationError(f"LinearTTFT {name} must be a finite number of seconds >= 0, not "
                                         f"{shown(getattr(self, name))}")  # fmt: skip
            object.__setattr__(self, name, value)  # frozen: a numpy float kept as the float it stands for

    def __call__(self, candidate: Candidate) -> float:
        """Predicted seconds to first token on ``candidate``. O(1).

        Raises:
            TypeError: ``candidate`` is not a :class:`Candidate`, or one of its fields has the wrong type.
            ConfigurationError: the arithmetic failed on a field with an impossible value (an int of 2**63 or more).
        """
        try:
            uncached = candidate.prompt_tokens - candidate.matched_tokens
            return (
                candidate.load * self.per_request_s
                + uncached * self.per_token_s
                + uncached * candidate.matched_tokens * self.per_token_pair_s
            )
        except (AttributeError, TypeError, OverflowError) as error:
            _require_candidate(candidate)
            _check_fields((candidate,), error)
            raise


class CostAware(LoadPolicy):
    """The candidate with the lowest predicted time to first token, from a pluggable cost function.

    ``cost`` maps a :class:`Candidate` to predicted seconds; the default is :class:`LinearTTFT`, or a subclass's own
    ``cost(candidate)`` method when it defines one (a ``cost`` given to the constructor wins over both). The first of
    equal costs wins (placement order). A cost that is no number, or NaN, is a :class:`PolicyError` naming the
    backend (it would win or lose by where its candidate stands: NaN compares false with everything), or, where a
    field of that candidate is malformed (a NaN count), the error naming the field.
    """

    name = "cost-aware"
    prefix_aware = True
    cost: Callable[[Candidate], float]

    def __init__(self, *, cost: Callable[[Candidate], float] | None = None) -> None:
        if cost is not None and not callable(cost):
            raise InvalidTypeError(f"CostAware cost must be a callable from a Candidate to seconds, not {shown(cost)}")
        if cost is not None:
            self.cost = cost
        elif not callable(getattr(type(self), "cost", None)):  # a subclass's cost() method is not to be shadowed
            self.cost = LinearTTFT()

    @_names_bad_fields
    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        _require_candidates(candidates)
        cost = self.cost
        best = candidates[0]
        lowest = math.inf
        for position, candidate in enumerate(candidates):
            value = cost(candidate)
            if type(value) is not float or value != value:  # an int, a numpy float: a number; NaN or a str: not
                number = as_float(value, infinite=True)
                if number is None:
                    _check_fields((candidate,), None)  # a malformed field (a NaN count) is named as such first
                    raise PolicyError(
                        f"CostAware cost returned {shown(value)} for backend {candidate.backend!r}: a cost must be a "
                        "number of seconds (not NaN)"
                    )
                value = number
            if value < lowest or not position:
                best, lowest = candidate, value
        return best


class PredictedTTFT(LoadPolicy):
    """The candidate where this request adds the least predicted waiting: its own time to first token and the delay
    its prefill imposes on the requests already there, from the router's own work accounting.

    A request's first token waits for the prefill work queued ahead of it (``pending_prefill_tokens``) and for its
    own uncached tokens (:attr:`Candidate.uncached_tokens`). While those tokens are prefilled, every request in flight
    on that backend waits as long (a vLLM step carries the prefill chunk and every decode together), so the request's
    own prefill counts once for itself and once for each request in flight there; a request still in prefill
    (:attr:`Candidate.in_prefill`) counts once more, as it shares the step's token budget with this prefill and has
    its whole decode still ahead of it. With engine metrics, the engine's waiting queue (``queue_len``) stands in for
    ``in_prefill`` when it is longer (requests of other router replicas, which this router does not count), and
    ``in_flight`` is at least that. Of a prompt longer than those in flight, the part every candidate must prefill
    (``common``: the fewest uncached tokens among the candidates) counts for each request in flight as at most a
    typical prompt in flight (``typical``: their mean prompt tokens over the fleet), so a very long prompt is
    steered by the work queued ahead of it and the requests still prefilling, not by how many requests stream
    answers there; what leaving a cached prefix adds (``uncached_tokens - common``) counts in full, and so does the
    once more of a request in prefill. Where the requests in flight claim more KV blocks than a backend has
    (``active_blocks > capacity_blocks``), only the share its memory holds at once (``runnable``) is held up: the
    others wait for memory, ahead of the new request in vLLM's first-come queue, and their prefill is already in
    ``pending_prefill_tokens``. All of it stretches as the KV memory fills (a fuller cache admits fewer requests at
    once, and a request that does not fit waits for others to finish)::

        per_request = min(common, typical) + uncached_tokens - common      # = uncached_tokens, short prompts
        harm = per_request × in_flight + uncached_tokens × in_prefill
        wait = memory_wait_s × wait_speed(candidates)                      # 0 while no speed is known
        cost = (prefill_work + harm × runnable × per_token + wait) / (1 - min(kv_fraction, kv_cap))
        prefill_work = pending_prefill_tokens + uncached_tokens            # until attention_tokens is known, then
                     + (pending_prefill_context + own pairs) / attention_tokens
        per_token = 1 + (matched_tokens + (uncached_tokens + 1) / 2) / attention_tokens   # 1 until it is known
        runnable = min(1, capacity_blocks / active_blocks)                 # 1 when the capacity is unknown

    (``common`` and ``typical`` from :meth:`cap_terms`), where a backend whose known capacity cannot take this
    request's uncached blocks beside its active ones (``active_blocks + ⌈uncached_tokens / block_size⌉ >
    capacity_blocks``) counts as full (``kv_fraction`` 1): the request would wait there for memory, or be preempted
    and computed again (vLLM takes blocks back from the newest request), for as long as the requests there take to
    finish. Which full backend frees its memory first is :attr:`Candidate.memory_wait_s` (from the ages of the
    router's requests in flight there and how long requests live), counted at one prefill speed for every candidate
    (:meth:`wait_speed`) as tokens of the same work (``wait``).

    That is, in tokens of prefill work, the wait the request adds to every request's; no constant depends on the
    model or the GPU: tokens compare the backends of one fleet without knowing their speed, the factors are
    counts, and the cap is read from the requests in flight. The prefill queued ahead and the request's own
    (:attr:`Candidate.prefill_work`) count what attention adds once the router has learned it: a token late in a
    long prompt attends to all before it, so where first-token waits grow with the context queued
    (:attr:`Candidate.attention_tokens`, fitted from first tokens), each token × context pair of that prefill adds
    ``1 / attention_tokens`` of a token, and a backend holding long prompts is not taken for one holding as many
    tokens of short ones; the requests the prefill holds up wait as long as it takes, ``per_token`` for each of its
    tokens (``own pairs`` are ``uncached_tokens × matched_tokens + uncached_tokens × (uncached_tokens + 1) / 2``).
    ``kv_fraction`` (:func:`kv_fraction`) is the router's
    distinct in-flight blocks over the backend's capacity when that is known (a shared prefix counted once; requests
    still waiting for memory included), else the engine's ``kv_usage`` from metrics, else 0. ``kv_cap`` (0.95)
    bounds the stretch at 20×, so a full backend is a poor choice but never an impossible one. With
    ``use_speed=True`` the work is divided by each backend's :attr:`Candidate.prefill_tokens_per_s` (learned online
    from first tokens; a backend without an estimate takes the median of those with one), for fleets of unlike GPUs;
    it is off by default because that estimate includes the time a request waited for memory, so on a fleet of equal
    GPUs it is noise that moves traffic away from whichever backend was last slow (see docs/policies.md).

    Affinity holds while it pays: a cached prefix removes its tokens from the cost, so a request follows its prefix
    until the work queued there, the requests it would hold up and the memory in use outweigh the prefill it saves.
    It spreads when it does not: a long system prompt that every backend holds cancels out, and one that a single
    backend holds costs the others its length once while each request already on the holder multiplies what is
    left, so one shared first block cannot pull all traffic to one backend. Ties go to the first candidate in
    placement order, so a choice is deterministic given the candidates and router replicas agree.
    O(len(candidates)).

    >>> busy_cached = Candidate("a", 4096, 4224, 3, pending_prefill_tokens=3000, in_prefill=1)
    >>> idle_cold = Candidate("b", 0, 4224, 0)
    >>> PredictedTTFT().choose([busy_cached, idle_cold]).backend  # 3000 + 128 × (1 + 3 + 1) = 3640 < 4224
    'a'
    >>> PredictedTTFT().choose([busy_cached._replace(in_flight=12), idle_cold]).backend  # 3000 + 128 × 14 = 4792
    'b'
    """

    name = "predicted-ttft"
    prefix_aware = True

    def __init__(self, *, kv_cap: float = 0.95, use_speed: bool = False) -> None:
        cap = as_float(kv_cap)
        if cap is None or not 0.0 <= cap < 1.0:
            raise ConfigurationError(f"PredictedTTFT kv_cap must be a fraction in [0, 1), not {shown(kv_cap)}")
        self.kv_cap = cap
        self.use_speed = check_flag(use_speed, "PredictedTTFT use_speed")

    def cost(
        self,
        candidate: Candidate,
        *,
        speed: float = 1.0,
        common_tokens: int = 0,
        typical_prompt: float = math.inf,
    ) -> float:
        """Predicted added waiting on ``candidate``, in tokens of prefill work (in seconds given a ``speed``). O(1).

        ``common_tokens`` and ``typical_prompt`` are the choice's :meth:`cap_terms` (what :meth:`choose` passes): of
        the request's uncached tokens, the ``common_tokens`` that every candidate must prefill count at most
        ``typical_prompt`` for each request in flight. Left out, nothing is capped. :attr:`Candidate.memory_wait_s`
        counts as prefill work at the candidate's ``prefill_tokens_per_s`` (none while that is unknown);
        :meth:`choose` counts every candidate's at one speed, :meth:`wait_speed` (with ``use_speed``, each at the
        speed it divides by): it hands ``cost()``, a subclass's too, a candidate with a wait for memory as
        ``candidate._replace(prefill_tokens_per_s=...)`` at that speed, and returns the candidate it was given.

        Raises:
            TypeError: ``candidate`` is not a :class:`Candidate`, or one of its fields has the wrong type.
            ConfigurationError: ``speed`` is not a finite number above 0; or the arithmetic failed on a field of
                ``candidate`` with an impossible value, on ``common_tokens`` that is not an int >= 0 or on
                ``typical_prompt`` that is not a number above 0.
        """
        _require_candidate(candidate)
        if type(speed) is not float or not 0.0 < speed < math.inf:
            number = as_float(speed)
            if number is None or number <= 0:
                raise ConfigurationError(f"cost() speed must be a finite number above 0, not {shown(speed)}")
            speed = number
        try:
            in_flight, in_prefill, queued = candidate.in_flight, candidate.in_prefill, candidate.queue_len or 0
            if queued > in_prefill:  # the engine's waiting queue shows requests this router does not count
                in_prefill, in_flight = queued, max(in_flight, queued)
            uncached = candidate.uncached_tokens
            common = min(common_tokens, uncached)
            per_request = min(common, typical_prompt) + uncached - common
            harm = (per_request * in_flight + uncached * in_prefill) * _runnable(candidate) * _token_work(candidate)
            work = candidate.prefill_work + harm + _memory_wait_work(candidate)
            fraction = 1.0 if _overflows(candidate) else kv_fraction(candidate)
            return work / speed / (1.0 - min(fraction, self.kv_cap))
        except PrefixRouteError:
            raise
        except Exception as error:
            _check_fields((candidate,), error)
            count = as_int(common_tokens)
            if count is None or count < 0:
                raise ConfigurationError(
                    f"cost() common_tokens must be an int >= 0, not {shown(common_tokens)}"
                ) from error
            typical = as_float(typical_prompt, infinite=True)
            if typical is None or typical <= 0:
                raise ConfigurationError(
                    f"cost() typical_prompt must be a number above 0 or math.inf, not {shown(typical_prompt)}"
                ) from error
            raise

    @staticmethod
    def cap_terms(candidates: Sequence[Candidate]) -> tuple[int, float]:
        """``(common_tokens, typical_prompt)`` of a choice among ``candidates``: the fewest uncached tokens among
        them (the prefill the request needs wherever it goes), and the mean prompt tokens of the requests in flight
        on them (``held_blocks × block_size`` over ``in_flight``, of the candidates whose ``held_blocks`` are known;
        infinite when none is, so nothing is capped). O(len(candidates)).

        Raises:
            NoBackendError: ``candidates`` is empty.
        """
        _require_candidates(candidates)
        common = -1
        flying = held = 0
        try:
            for _, matched, prompt, in_flight, _, _, _, blocks, _, _, _, _, size, _, _, _ in candidates:
                if common < 0 or prompt - matched < common:
                    common = prompt - matched
                if blocks > 0:  # a hand-built candidate may count requests in flight without their blocks
                    flying += in_flight
                    held += blocks * size
        except TypeError as error:
            _check_fields(candidates, error)
            raise
        return common, held / flying if flying else math.inf

    @staticmethod
    def wait_speed(candidates: Sequence[Candidate]) -> float | None:
        """The prefill speed at which a choice among ``candidates`` counts each one's
        :attr:`~Candidate.memory_wait_s` as work: the median of their known ``prefill_tokens_per_s`` (the upper one
        of an even count), None when none is known. One speed for all, so the full backend whose memory frees first
        costs least: each backend's own estimate, on a fleet of equal GPUs, is noise (it includes the time requests
        waited for memory, and the prompts' mix), and a backend without one would count no wait at all.
        O(n log n) in the candidates with a speed."""
        known = sorted(c.prefill_tokens_per_s for c in candidates if c.prefill_tokens_per_s)
        return known[len(known) // 2] if known else None

    @_names_bad_fields
    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        common, typical = self.cap_terms(candidates)  # raises for no candidates
        if not self.use_speed and type(self).cost is PredictedTTFT.cost:
            return self._choose_fast(candidates, min(common, typical), common)
        speeds: list[float] = []
        default_speed = 1.0
        waits_at = self.wait_speed(candidates)
        if self.use_speed:
            default_speed = waits_at or 1.0
            speeds = [c.prefill_tokens_per_s or default_speed for c in candidates]
        cost = self.cost
        best = candidates[0]
        best_cost = math.inf
        for position, candidate in enumerate(candidates):  # strict < keeps the first of equals (placement order)
            speed = speeds[position] if speeds else default_speed
            scored = candidate
            wait_speed = speed if self.use_speed else waits_at  # with use_speed, the wait counts as its seconds
            if candidate.memory_wait_s and wait_speed and candidate.prefill_tokens_per_s != wait_speed:
                scored = candidate._replace(prefill_tokens_per_s=wait_speed)  # a subclass's cost() too
            predicted = cost(scored, speed=speed, common_tokens=common, typical_prompt=typical)
            if predicted < best_cost:
                best, best_cost = candidate, predicted
        return best

    def _choose_fast(self, candidates: Sequence[Candidate], capped: float, common: int) -> Candidate:
        """:meth:`choose` with :meth:`cost` inlined and the fields unpacked (half the time with 64 candidates);
        ``capped`` is ``min(common, typical_prompt)``, ``common`` the fewest uncached tokens (every candidate's
        uncached tokens are at least that). The formula is written twice on purpose: through :meth:`cost` route()
        took 1.2x (8 backends) to 1.8x (64) as long, and through one function per candidate 2-3 % longer; the
        property test ``test_predicted_ttft_chooses_a_lowest_cost_candidate`` holds this choice to :meth:`cost`'s."""
        cap = self.kv_cap
        best = candidates[0]
        best_cost = math.inf
        waits_at = -1.0  # wait_speed(), once a candidate has a wait for memory (most choices have none)
        for candidate in candidates:
            (_, matched, prompt, in_flight, queued, usage, pending, _, capacity, _, active, in_prefill, size,
             context, attention, memory_wait) = candidate  # fmt: skip
            uncached = prompt - matched
            per_token = 1.0
            work: float = pending + uncached
            if attention:  # Candidate.prefill_work and _token_work(), inlined
                per_token += (matched + (uncached + 1) / 2) / attention  # as computed there, to the last bit
                work += (context + uncached * matched + uncached * (uncached + 1) / 2) / attention
            runnable = 1.0
            if capacity:
                fraction = active / capacity  # kv_fraction(), _overflows() and _runnable(), inlined
                if fraction > 1.0:
                    runnable = capacity / active  # as _runnable() computes it, to the last bit (ties)
                    fraction = 1.0
                elif size > 0 and active + -(-uncached // size) > capacity:
                    fraction = 1.0
            else:
                fraction = 0.0 if usage is None else usage
            if fraction > cap:
                fraction = cap
            if queued and queued > in_prefill:  # as in cost(): the engine's waiting queue, when longer
                in_prefill = queued
                if in_flight < queued:
                    in_flight = queued
            per_request = capped + uncached - common
            harm = (per_request * in_flight + uncached * in_prefill) * runnable * per_token
            if memory_wait:  # _memory_wait_work(), inlined, at the choice's wait_speed()
                if waits_at < 0:
                    waits_at = self.wait_speed(candidates) or 0.0
                predicted = (work + harm + memory_wait * waits_at) / (1.0 - fraction)
            else:
                predicted = (work + harm) / (1.0 - fraction)
            if predicted < best_cost:
                best, best_cost = candidate, predicted
        return best

    def __repr__(self) -> str:
        return f"PredictedTTFT(kv_cap={self.kv_cap}, use_speed={self.use_speed})"


def kv_fraction(candidate: Candidate) -> float:
    """The fraction of ``candidate``'s KV memory in use or claimed, as well as the router knows it. O(1).

    When the capacity is known: the router's :attr:`~Candidate.active_blocks` (distinct blocks of its requests in
    flight there, a shared prefix counted once, requests still waiting for memory included) over
    ``capacity_blocks``, clamped to 1. Else the engine's ``kv_usage`` from metrics, else 0. The router's figure
    comes first because the engine's leaves out the requests waiting for memory, which are the ones a new request
    would queue behind, and lags by a polling interval; with several router replicas, each counts only its own
    requests (see docs/policies.md).
    """
    _require_candidate(candidate, "kv_fraction()")
    capacity, active = candidate.capacity_blocks, candidate.active_blocks
    try:
        if capacity and (capacity < 0 or active < 0):  # a hand-built candidate's: refused, naming the field
            _check_fields((candidate,), None)
        if capacity:
            return min(1.0, active / capacity)
    except (TypeError, OverflowError) as error:
        _check_fields((candidate,), error)
        raise
    usage = candidate.kv_usage
    if usage is None:
        return 0.0
    if type(usage) is not float or not 0.0 <= usage < math.inf:
        # a hand-built candidate's: a numpy float or an int to take, a negative or NaN usage to refuse
        _check_fields((candidate,), None)
        return float(usage)
    return usage


def _token_work(candidate: Candidate) -> float:
    """What one of the request's uncached tokens costs on ``candidate`` in tokens of prefill work: 1, plus the mean
    context it attends to over :attr:`Candidate.attention_tokens` once that is known."""
    attention = candidate.attention_tokens
    if not attention:
        return 1.0
    return 1.0 + (candidate.matched_tokens + (candidate.uncached_tokens + 1) / 2) / attention


def _memory_wait_work(candidate: Candidate) -> float:
    """The request's wait for KV memory on ``candidate`` in tokens of prefill work: :attr:`Candidate.memory_wait_s`
    at the backend's observed prefill speed (0 until a first token there taught one)."""
    wait, speed = candidate.memory_wait_s, candidate.prefill_tokens_per_s
    return wait * speed if wait and speed else 0.0


def _require_candidate(candidate: object, what: str = "the cost model") -> None:
    if not isinstance(candidate, Candidate):
        raise InvalidTypeError(f"{what} takes a Candidate, not {type(candidate).__name__}")


def _overflows(candidate: Candidate) -> bool:
    """Whether the request's uncached blocks do not fit beside the active ones in ``candidate``'s known capacity."""
    capacity, size = candidate.capacity_blocks, candidate.block_size
    if not capacity or size <= 0:
        return False
    return candidate.active_blocks + -(-candidate.uncached_tokens // size) > capacity


def _runnable(candidate: Candidate) -> float:
    """The share of ``candidate``'s requests in flight that its known KV capacity holds at once: ``capacity_blocks /
    active_blocks`` when they claim more than it has, else 1 (also when the capacity is unknown)."""
    capacity, active = candidate.capacity_blocks, candidate.active_blocks
    return capacity / active if capacity and active > capacity else 1.0


_NOT_DRAWN: Any = object()


def _rng_fault(
    policy: LoadPolicy, rng: random.Random, call: str, drawn: object, due: str, exc: Exception
) -> PolicyError:
    """The error for a draw from a policy's rng that raised, or returned what ``choose()`` could not index
    ``candidates`` with: a ``random.Random`` subclass given as ``rng=`` is at fault, not the policy's rule."""
    what = f"{type(policy).__name__}'s rng ({type(rng).__name__})"
    if drawn is _NOT_DRAWN:
        try:
            said = str(exc)
        except Exception:  # noqa: BLE001 - the message must not fail on the exception it describes
            said = "(its str() raised)"
        fault = f"raised {type(exc).__name__}: {said[:200]} in {call}"
    else:
        fault = f"returned {shown(drawn)} from {call}, not {due}"
    return PolicyError(f"{what} {fault}: fix the rng (the random.Random given as rng=), not the policy")


def _rng(seed: object, rng: object, policy: str) -> random.Random:
    if rng is not None:
        if not isinstance(rng, random.Random):
            raise InvalidTypeError(f"{policy} rng must be a random.Random, not {type(rng).__name__}")
        return rng
    if seed is not None and not isinstance(seed, (str, bytes)):
        number = as_int(seed)  # a numpy int seeds as the int it stands for (random.Random refuses it)
        if number is None:
            raise InvalidTypeError(f"{policy} seed must be an int, str, bytes or None, not {type(seed).__name__}")
        seed = number
    if isinstance(seed, str):  # random seeds a str from its UTF-8 bytes, which a lone surrogate has none of
        seed = seed.encode("utf-8", "surrogatepass")
    return random.Random(seed)


def _load(candidate: Candidate) -> int:
    return candidate.load


_matched = attrgetter("matched_tokens")


_REGISTRY: Mapping[str, type[LoadPolicy]] = MappingProxyType(
    {
        cls.name: cls
        for cls in (RoundRobin, Random, LeastLoaded, PowerOfTwo, PrefixAffinity, BoundedLoad, CostAware, PredictedTTFT)
    }
)


def policy_names() -> list[str]:
    """Return the registry names of the built-in policies."""
    return sorted(_REGISTRY)


def policy_from_name(name: str, **options: Any) -> LoadPolicy:
    """Build a policy from its registry name, or from ``"package.module:ClassName"`` for your own subclass.

    Keyword ``options`` go to the class: ``policy_from_name("bounded-load", factor=1.5)``.

    Raises:
        ConfigurationError: unknown name (the message lists the valid ones), a class that is not a
            :class:`LoadPolicy`, options the class does not take, or a ``module:Class`` whose import or constructor
            raises anything (SystemExit too: the error names it, and the original is its cause).
    """
    if not isinstance(name, str):
        raise InvalidTypeError(f"policy name must be a str, not {type(name).__name__}")
    name = str.__str__(name)  # a subclass's own __hash__ or __contains__ is no part of the name
    if ":" in name:
        cls = _import_policy(name)
    else:
        found = _REGISTRY.get(name)
        if found is None:
            raise ConfigurationError(
                f"unknown policy {name!r}: use one of {', '.join(policy_names())} or 'package.module:ClassName'"
            )
        cls = found
    if inspect.isabstract(cls):
        raise ConfigurationError(f"policy {name!r} is abstract: name a subclass that implements choose()")
    try:
        inspect.signature(cls).bind(**options)
    except TypeError as exc:
        raise ConfigurationError(f"policy {name!r} does not accept options {sorted(options)}: {exc}") from exc
    try:
        return cls(**options)
    except TypeError as exc:  # an option of the wrong type (InvalidTypeError too): the option is what to fix
        raise ConfigurationError(f"policy {name!r}: {exc}") from exc
    except PrefixRouteError:
        raise
    except (Exception, SystemExit) as exc:  # the user's own class: any error in it is theirs to fix
        raise ConfigurationError(f"cannot build policy {name!r}: {_failure(exc)}") from exc


def _import_policy(path: str) -> type[LoadPolicy]:
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ConfigurationError(f"policy {path!r} must name a module and a class, like 'mypackage.policies:MyPolicy'")
    try:
        obj = getattr(_import_module(module_name), attribute)
    except (ImportError, AttributeError, ValueError, TypeError) as exc:  # a relative name ('.x') raises TypeError
        raise ConfigurationError(f"cannot import policy {path!r}: {exc}") from exc
    except (Exception, SystemExit) as exc:  # the module's own top-level code failed, or exited
        raise ConfigurationError(f"cannot import policy {path!r}: {_failure(exc)}") from exc
    if not (isinstance(obj, type) and issubclass(obj, LoadPolicy)):
        raise ConfigurationError(f"{path!r} is not a LoadPolicy subclass")
    return obj


def _failure(exc: BaseException) -> str:
    """What a user's policy module or class raised, for a ConfigurationError's message."""
    if isinstance(exc, SystemExit):
        return f"it called sys.exit({exc.code!r}) (put a script's own code under if __name__ == '__main__':)"
    return f"{type(exc).__name__}: {exc}"


def _import_module(name: str) -> Any:
    """Import the module a ``module:Class`` policy names, looking in the current directory last.

    ``python -m prefixroute`` has the current directory on ``sys.path``; the installed ``prefixroute`` command has its
    own folder there instead, so a policy that is a file next to you (``mine.py``) would not be found. When the
    module's top-level package is found nowhere else, the current directory is appended to ``sys.path`` (so a
    process pool spawned afterwards inherits it) and the import retried.
    """
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        top = name.partition(".")[0]
        here = os.getcwd()
        on_path = {os.path.abspath(entry or os.curdir) for entry in sys.path if isinstance(entry, str)}
        if exc.name != top or here in on_path or not top:
            raise
        sys.path.append(here)
        return importlib.import_module(name)
