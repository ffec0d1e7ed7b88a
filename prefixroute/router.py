"""The Router: the pure decision core. Hash once, match, ask the policy, record, and follow each request's life."""

from __future__ import annotations

import heapq
import logging
import math
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Literal, NoReturn, SupportsIndex, TypeAlias

import cachetools
import xxhash

from prefixroute._accounting import AttentionFit, Footprint, StartedRequest
from prefixroute._arguments import (
    check_backend_id,
    check_backends,
    check_lease,
    id_of,
    iterable_of,
    lease_deadline,
    read_clock,
)
from prefixroute._numbers import as_float, as_int, shown
from prefixroute.errors import (
    ConfigurationError,
    DecisionError,
    InvalidTypeError,
    PolicyError,
    PrefixRouteError,
)
from prefixroute.hashing import BlockHasher, Tokens, encode_tokens, namespace_seed
from prefixroute.index import (
    DEFAULT_BOUND_BLOCKS,
    IndexUpdate,
    PrefixIndex,
    _RoutedHashes,
    apply_updates,
    check_update,
)
from prefixroute.policies import Candidate, LoadPolicy, PredictedTTFT

__all__ = ["Decision", "Reason", "Router", "RouterStats"]

_log = logging.getLogger("prefixroute")
_EXPIRY_WARNING_SECONDS = 60.0
# Lease heap entries beyond twice the requests in flight before finish() drops those of finished requests.
_LEASE_SLACK = 1024
_ENDED_KEPT = 4096  # ids of the latest requests that ended (finish, lease, removal), so a late start() is not a new one

Reason = Literal["prefix", "load-fallback", "miss", "policy"]
"""Why a backend was chosen: it held the longest prefix (``"prefix"``); a prefix-aware policy passed over a longer
match because of load (``"load-fallback"``); no backend held any of the prompt (``"miss"``); or a policy that
ignores prefixes chose (``"policy"``)."""

# The largest engine queue length set_engine_load() takes, plus one: policies multiply loads by floats.
_QUEUE_LIMIT = 2**63

# A prefill-speed estimate follows observed first tokens with this weight per observation (unit-free).
_SPEED_WEIGHT = 0.2

# The mean lifetime of a request (start() to finish(), Candidate.memory_wait_s) is the plain mean of the first
# finishes, then follows later ones with this weight each (unit-free: about the last 50 count).
_LIFETIME_WEIGHT = 0.02

_Figures: TypeAlias = "tuple[int, int | None, float | None, int, int, int | None, float | None, int, int, int, int]"
"""A backend's :class:`Candidate` fields from ``in_flight`` to ``pending_prefill_context``, in field order."""


@dataclass(frozen=True, slots=True)
class Decision:
    """Where one request goes and why; its ``id`` names it in :meth:`Router.start`, ``first_token`` and ``finish``.

    ``matched_tokens`` of ``prompt_tokens`` are (predicted) cached on ``backend``; ``candidates`` are every backend
    as the policy saw them. ``confirmed_tokens`` is the part of ``matched_tokens`` that vLLM's KV events confirm
    (None when the index has no confirmed part, e.g. a plain :class:`~prefixroute.PrefixIndex`).
    """

    id: str
    backend: str
    matched_tokens: int
    prompt_tokens: int
    reason: Reason
    candidates: tuple[Candidate, ...]
    decided_at: float = 0.0
    confirmed_tokens: int | None = None
    _hashes: Sequence[int] = field(default=(), repr=False, compare=False)
    # Blocks the backend held when the decision was committed (its prediction added the rest); -1: not committed.
    _held: int = field(default=-1, repr=False, compare=False)
    # The router's hash of the fields start() and commit() count by: one changed since (dataclasses.replace) is seen.
    _seal: int = field(default=0, repr=False, compare=False)

    @property
    def hit_ratio(self) -> float:
        """Predicted fraction of the prompt served from the chosen backend's prefix cache."""
        return self.matched_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True)
class RouterStats:
    """Counters of a :class:`Router`'s decisions and request lifecycle (a snapshot)."""

    decisions: int
    """Decisions made (:meth:`Router.decide` and :meth:`Router.route`)."""
    commits: int
    """Decisions recorded in the index (:meth:`Router.commit`, and every :meth:`Router.route`)."""
    in_flight: int
    """Requests started and neither finished nor expired."""
    ignored: int
    """Lifecycle calls ignored: a second start, a finish or first token of a request that is not in flight (a
    second finish, an expired or removed one, or a decision of another router)."""
    leases_expired: int
    """Requests that stopped counting because their lease ran out before :meth:`Router.finish`."""


class Router:
    """Route prompts to the backend that holds their prefix, within the policy's load rule.

    ``policy`` defaults to :class:`~prefixroute.PredictedTTFT` (the lowest predicted time to first token). ``index``
    is the prefix index the router reads and writes (default: a :class:`~prefixroute.PrefixIndex` with
    ``capacity_blocks``, which mirrors vLLM's ``num_gpu_blocks``, and a backend whose capacity is not known kept to
    ``prefixroute.index.DEFAULT_BOUND_BLOCKS`` blocks, so memory stays bounded); the index class decides what a
    routing decision writes (:meth:`PrefixIndex.predict`), so the router's mode is fixed at construction.
    ``namespace`` seeds the block hashes (model or adapter name); :meth:`route` can override it per request.
    ``placement_blocks`` is how many leading blocks decide where a never-seen prefix goes (rendezvous hashing), so
    gateway replicas that share no state still agree. ``lease`` is the default lease of :meth:`start` in seconds
    (None: requests count until finished). ``clock`` and ``rng`` (which draws the decision ids) are injectable;
    with a ``lease``, the clock is read once here, and one that raises or returns no finite number of seconds is a
    :class:`ConfigurationError`.

    A request's life: :meth:`route` (or :meth:`decide`, then :meth:`commit` to the backend actually used) →
    :meth:`start` → :meth:`first_token` (optional: without it, engine figures from :meth:`set_engine_load` tell
    which requests are past their prefill) → :meth:`finish`. Lifecycle calls name the decision by its id and are
    idempotent; a finish that matches no request in flight is ignored and counted (:meth:`stats`), never raised.

    Thread-safe: one lock guards the index, the counters and the policy; hashing runs outside it and nothing inside
    it does I/O or sleeps, so calling :meth:`route` from an asyncio coroutine does not stall the loop. Other
    components write the index only through :meth:`store`, :meth:`evict`, :meth:`write` and
    :meth:`clear_backend`, which take the lock. A policy or an index hook that calls back into the router while it
    holds the lock gets a :class:`PolicyError` instead of a deadlock. A router cannot be copied or pickled
    (``TypeError``): make one per process with the same options.

    >>> router = Router(block_size=4)
    >>> first = router.route([1, 2, 3, 4, 5, 6, 7, 8], ["gpu0", "gpu1", "gpu2"])
    >>> first.reason
    'miss'
    >>> again = router.route([1, 2, 3, 4, 5, 6, 7, 8, 9], ["gpu0", "gpu1", "gpu2"])
    >>> (again.backend == first.backend, again.reason, again.matched_tokens)
    (True, 'prefix', 8)
    >>> with router.track(again):
    ...     router.in_flight(again.backend)
    1
    >>> router.finish(again)  # a second finish is ignored, and counted
    >>> router.stats().ignored
    1
    """

    def __init__(
        self,
        *,
        block_size: int = 16,
        policy: LoadPolicy | None = None,
        capacity_blocks: int | Mapping[str, int] | None = None,
        namespace: str | bytes | None = None,
        clock: Callable[[], float] = time.monotonic,
        placement_blocks: int = 4,
        index: PrefixIndex | None = None,
        lease: float | None = None,
        rng: random.Random | None = None,
    ) -> None:
        if policy is not None and not isinstance(policy, LoadPolicy):
            raise InvalidTypeError(f"policy must be a LoadPolicy instance, not {type(policy).__name__}")
        placement = as_int(placement_blocks)
        if placement is None or placement < 1:
            raise ConfigurationError(f"placement_blocks must be a positive int, not {shown(placement_blocks)}")
        if not callable(clock):
            raise InvalidTypeError(f"clock must be a callable returning seconds, not {type(clock).__name__}")
        if rng is not None and not isinstance(rng, random.Random):
            raise InvalidTypeError(f"rng must be a random.Random, not {type(rng).__name__}")
        self._hasher = BlockHasher(block_size, namespace=namespace)
        if index is None:
            index = PrefixIndex(block_size, capacity_blocks=capacity_blocks, bound_blocks=DEFAULT_BOUND_BLOCKS)
        elif not isinstance(index, PrefixIndex):
            raise InvalidTypeError(f"index must be a PrefixIndex (or a subclass), not {type(index).__name__}")
        elif capacity_blocks is not None:
            raise ConfigurationError("pass capacity_blocks to the PrefixIndex you give as index=, not to the Router")
        elif index.block_size != self._hasher.block_size:  # the plain int block_size stands for, checked
            raise ConfigurationError(
                f"index.block_size is {index.block_size} but block_size is {self._hasher.block_size}: they must agree"
            )
        self._index = index
        self._policy: LoadPolicy = policy if policy is not None else PredictedTTFT()
        self._prefix_aware = _prefix_aware(self._policy)
        self._clock = clock
        self._placement_blocks = placement
        self._lease = check_lease(lease)
        if self._lease is not None:  # leases read the clock at every start: one that cannot serve them fails here
            lease_deadline(read_clock(clock), self._lease)
        self._lock = _Lock()
        # Per backend: requests in flight, uncached prompt tokens still in prefill, prompt blocks in flight.
        self._in_flight: dict[str, int] = {}
        self._pending: dict[str, int] = {}
        self._context: dict[str, int] = {}  # the same prefill work's token x context pairs
        self._held: dict[str, int] = {}
        self._prefilling: dict[str, int] = {}  # requests in flight without a first token
        # The same requests per backend, oldest start first (an ordered set), for _infer_prefilled; and what tells
        # that the gateway reports no first tokens: a request finished without one, and first_token() never called.
        self._unprefilled: dict[str, dict[StartedRequest, None]] = {}
        self._flying: dict[str, dict[StartedRequest, None]] = {}  # per backend: its requests in flight, oldest first
        self._lifetime: float | None = None  # mean seconds from start() to finish(), over the fleet
        self._finished = 0  # finishes that taught the lifetime
        self._first_tokens_reported = False
        self._first_tokens_missing = False
        self._polled: dict[str, float] = {}  # per backend: when set_engine_load() last brought its queue (the clock)
        self._footprints: dict[str, Footprint] = {}
        self._active: dict[str, int] = {}  # distinct KV blocks in flight: each footprint's figure, for _candidates
        self._speed: dict[str, float] = {}  # observed prefill tokens/s
        self._attention = AttentionFit()  # fleet-wide, from first tokens: Candidate.attention_tokens
        self._queue_len: dict[str, int | None] = {}  # engine figures from set_engine_load()
        self._kv_usage: dict[str, float | None] = {}
        # Each backend's Candidate fields after the first three but the last (the fleet's attention_tokens, added per
        # route), built when a route needs them and dropped when one changes: with 64 backends, a third less time
        # building candidates than reading the figures anew.
        self._figures: dict[str, _Figures] = {}
        self._capacity_changes = index._capacity_changes
        self._live: dict[str, StartedRequest] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()  # the last _ENDED_KEPT ids that ended, not committed since
        self._leases: list[tuple[float, str]] = []  # a heap of (deadline, id); stale entries are skipped
        self._counts = dict.fromkeys(("decisions", "commits", "ignored", "leases_expired"), 0)
        self._expiries_told: tuple[float, int] | None = None  # the last expiry warning: when, and leases_expired then
        # Decision ids: a random per-router prefix and a counter, so ids of two routers never collide.
        self._id_prefix = f"{(rng if rng is not None else random.Random()).getrandbits(48):012x}-"
        self._next_id = 0
        # Root seeds of per-request namespaces (model or LoRA names): few, reused, so a small LRU serves; cachetools
        # holds its own lock around the cache, so concurrent routes with many namespaces stay consistent.
        self._seed: Callable[[str | bytes], int] = cachetools.cached(
            cachetools.LRUCache(maxsize=1024), lock=threading.Lock()
        )(namespace_seed)
        # Placement orders by (placement key, backends): a prefix that recurs (a system prompt, a conversation)
        # skips sorting the fleet by rendezvous score, a twentieth of route() with 64 backends.
        self._order: Callable[[Sequence[str], int], tuple[str, ...]] = cachetools.cached(
            cachetools.LRUCache(maxsize=1024), key=_order_key, lock=threading.Lock()
        )(_placement_order)

    @property
    def index(self) -> PrefixIndex:
        """The prefix index, for reading (write through :meth:`store`, :meth:`evict`, :meth:`write`)."""
        return self._index

    @property
    def hasher(self) -> BlockHasher:
        """The block hasher (block size and default namespace)."""
        return self._hasher

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._hasher.block_size

    @property
    def policy(self) -> LoadPolicy:
        """The load policy in use."""
        return self._policy

    # -- deciding ------------------------------------------------------------------------------------------------

    def route(
        self, prompt_tokens: Tokens, backends: Sequence[str], *, namespace: str | bytes | None = None
    ) -> Decision:
        """Choose a backend for a prompt and record that it will cache the prompt's blocks (decide + commit).

        O(n/block_size + B log B + H log n + W) for a prompt of n tokens, B backends, H backends holding its first
        block (see :meth:`PrefixIndex.match`) and W requests in flight walked for the backends whose KV memory cannot
        take its blocks (:attr:`Candidate.memory_wait_s`: the oldest few, until enough blocks are free).

        Raises:
            NoBackendError: ``backends`` is empty.
            ConfigurationError: ``backends`` names a backend twice, or one that is an empty str.
            TypeError: a backend id is not a str, or the prompt is not a token sequence.
            InvalidPromptError: a token id is not an int in [0, 2**32) (the message names its position).
            PolicyError: the policy returned something that is not one of its candidates, or raised an exception
                that is not a :class:`PrefixRouteError` or raised an :class:`InvalidTypeError` (the original is the
                cause); nothing is recorded. Its other errors of the tree, and exceptions that are not an
                ``Exception`` (``KeyboardInterrupt``), propagate unchanged, also with nothing recorded.
        """
        return self._decide(prompt_tokens, backends, namespace, commit=True)

    def decide(
        self, prompt_tokens: Tokens, backends: Sequence[str], *, namespace: str | bytes | None = None
    ) -> Decision:
        """Choose a backend like :meth:`route`, but record nothing: :meth:`commit` the backend actually used.

        For frameworks that override or repeat the pick (retries, spill to another replica), so the index only
        learns what really happened. Same cost and errors as :meth:`route`.
        """
        return self._decide(prompt_tokens, backends, namespace, commit=False)

    def commit(self, decision: Decision, backend: str | None = None) -> Decision:
        """Record that ``decision``'s request went to ``backend`` (default: the chosen one); return that decision.

        ``backend`` must be one of the decision's candidates; the returned :class:`Decision` keeps the id and
        describes that backend (its match, reason and confirmed tokens). Committing again only refreshes recency;
        after the request ended, it marks a retry: the next :meth:`start` counts it anew.
        O(n/block_size) for a prompt of n tokens.

        Raises:
            DecisionError: the decision comes from another router, was altered since it was made (its backend,
                token counts, candidates or block hashes changed with ``dataclasses.replace``; a copy is fine), or
                ``backend`` is not one of its candidates.
        """
        self._check_own(decision)
        if backend is None:
            target = decision.backend
        elif type(backend) is not str and isinstance(backend, str):  # a subclass's own __eq__ stays out of the maps
            target = str.__str__(backend)
        else:
            target = backend
        chosen = None
        if isinstance(target, str):  # only a str is a candidate's id (a numpy array's == would not say yes or no)
            chosen = next((c for c in decision.candidates if c.backend == target), None)
        if chosen is None:
            raise DecisionError(
                f"backend {shown(target)} was not a candidate of decision {decision.id!r}: commit one of "
                f"{[c.backend for c in decision.candidates]}"
            )
        hashes = decision._hashes
        with self._lock:
            held = self._index.match(hashes, (target,))[target]
            confirmed = self._index.match_confirmed(hashes, target)
            if hashes:
                self._index.predict(hashes, target, held)
            self._counts["commits"] += 1
            if self._ended:
                self._ended.pop(decision.id, None)  # sent again (a retry): its next start() counts
        if target == decision.backend:
            # Committed there before: its first prediction added the blocks past what the backend held then.
            held = held if decision._held < 0 else min(held, decision._held)
            return replace(decision, confirmed_tokens=_tokens(confirmed, self.block_size), _held=held)
        best = max(c.matched_tokens for c in decision.candidates)
        return replace(
            decision,
            backend=target,
            matched_tokens=chosen.matched_tokens,
            reason=_reason(self._prefix_aware, chosen.matched_tokens, best),
            confirmed_tokens=_tokens(confirmed, self.block_size),
            _held=held,
            _seal=self._seal(decision.id, target, chosen.matched_tokens, decision.prompt_tokens, hashes),
        )

    def _decide(
        self, prompt_tokens: Tokens, backends: Sequence[str], namespace: str | bytes | None, *, commit: bool
    ) -> Decision:
        ids = check_backends(backends)
        data = encode_tokens(prompt_tokens)
        if namespace is None:
            seed = self._hasher.seed
        elif type(namespace) is str or type(namespace) is bytes:
            seed = self._seed(namespace)
        elif isinstance(namespace, (str, bytes)):  # a subclass's own __hash__/__eq__ must not reach the seed cache
            seed = self._seed(str.__str__(namespace) if isinstance(namespace, str) else bytes(memoryview(namespace)))
        else:
            raise InvalidTypeError(f"namespace must be a str, bytes or None, not {type(namespace).__name__}")
        hashes = _RoutedHashes(self._hasher.hash_encoded(data, seed))  # predict() takes its own hasher's unchecked
        prompt_len = len(data) // 4
        order = self._order(ids, _placement_key(hashes, data, seed, self._placement_blocks))
        block_size = self._hasher.block_size
        index = self._index
        with self._lock:
            now = self._clock()
            if self._leases:
                self._expire(now)
            matched = index.match(hashes, order)
            candidates = self._candidates(order, matched, prompt_len, now)
            try:
                chosen = self._policy.choose(candidates)
            except Exception as exc:  # a bug in the policy: one error a gateway can tell from a bad request
                if isinstance(exc, PrefixRouteError) and not isinstance(exc, InvalidTypeError):
                    raise  # the library's own (a call back into the router, a policy's deliberate one)
                # A wrong type inside choose() (a library helper given something else than a Candidate) is the
                # policy's bug too: the candidates are the router's.
                raise PolicyError(
                    f"policy {shown(self._policy)} raised {type(exc).__name__}: {_text(exc)} (in its choose(); "
                    "the original exception is this one's __cause__; fix the policy)"
                ) from exc
            if not _is_one_of(chosen, candidates):
                raise PolicyError(
                    f"policy {shown(self._policy)} returned {shown(chosen)}, which is not one of the candidates it "
                    "was given: choose() must return one of its candidates itself, unchanged"
                )
            backend = chosen.backend
            confirmed = index.match_confirmed(hashes, backend)
            if commit:
                if hashes:
                    index.predict(hashes, backend, matched[backend])
                self._counts["commits"] += 1
            self._counts["decisions"] += 1
            decision_id = f"{self._id_prefix}{self._next_id:x}"
            self._next_id += 1
        best = max(matched.values()) * block_size
        return Decision(
            decision_id,
            backend,
            chosen.matched_tokens,
            prompt_len,
            _reason(self._prefix_aware, chosen.matched_tokens, best),
            candidates,
            now,
            _tokens(confirmed, block_size),
            hashes,
            matched[backend] if commit else -1,
            self._seal(decision_id, backend, chosen.matched_tokens, prompt_len, hashes),
        )

    def _seal(self, decision_id: str, backend: str, matched: int, prompt: int, hashes: Sequence[int]) -> int:
        """The seal of a decision with these fields; of its block hashes, the last (it names the whole chain) and
        their number. By value, so a copy of a decision (``copy.deepcopy``, as some frameworks copy what a request
        carries) is still the router's. O(1)."""
        last = hashes[-1] if len(hashes) else None
        return hash((self._id_prefix, decision_id, backend, matched, prompt, len(hashes), last))

    def _candidates(
        self, order: Sequence[str], matched: dict[str, int], prompt_len: int, now: object
    ) -> tuple[Candidate, ...]:
        """One Candidate per backend, in placement order (call under the lock)."""
        if self._capacity_changes != self._index._capacity_changes:
            self._capacity_changes = self._index._capacity_changes
            self._figures.clear()
        cached = self._figures.get
        build = self._build_figures
        block_size = self._hasher.block_size
        attention = self._attention.tokens
        reading = now if type(now) is float else as_float(now)
        waits = self._lifetime is not None and reading is not None  # else no request finished: no wait predicted
        at = reading or 0.0
        blocks = -(-prompt_len // block_size)
        candidates = []
        for backend in order:
            figures = cached(backend) or build(backend)
            cached_blocks = matched[backend]
            wait = 0.0
            if waits:
                capacity, over = figures[5], figures[7] + blocks - cached_blocks  # active + its uncached blocks
                if capacity and over > capacity:
                    wait = self._memory_wait(backend, over - capacity, at)
            candidates.append(Candidate(backend, cached_blocks * block_size, prompt_len, *figures, attention, wait))
        return tuple(candidates)

    def _build_figures(self, backend: str) -> _Figures:
        figures = self._figures[backend] = (
            self._in_flight.get(backend, 0),
            self._queue_len.get(backend),
            self._kv_usage.get(backend),
            self._pending.get(backend, 0),
            self._held.get(backend, 0),
            self._index.capacity(backend),
            self._speed.get(backend),
            self._active.get(backend, 0),
            self._prefilling.get(backend, 0),
            self._hasher.block_size,
            self._context.get(backend, 0),
        )
        return figures

    # -- the request lifecycle -----------------------------------------------------------------------------------

    def start(self, decision: Decision, *, lease: float | None = None) -> None:
        """Count ``decision``'s request in flight on its backend until :meth:`finish` (or its lease ends).

        O(log L + log n) for L leases and a prompt of n blocks (its anchors in the backend's distinct-block count,
        :attr:`Candidate.active_blocks`).

        ``lease`` (seconds; default the router's ``lease``) bounds how long an unfinished request counts, for
        gateways that may never release (a client that aborts before the gateway acts): an expired request stops
        counting and is counted in :attr:`RouterStats.leases_expired`. A second start of the same id is ignored,
        unless the decision was committed to another backend since: then the request's count moves there (its
        first token, if reported, is forgotten: the new backend has its prefill ahead of it). So is a start that
        comes after the request ended (its :meth:`finish`, its lease or its backend's removal; of the last 4,096), a
        callback that came late: counted in :attr:`RouterStats.ignored`, unless the decision was committed again
        since it ended (a retry, such as the proxy's after a refused connection, on another backend or the same):
        then it counts anew.

        Raises:
            DecisionError: the decision comes from another router, or was altered since it was made (its backend,
                token counts, candidates or block hashes changed; nothing is counted).
            ConfigurationError: ``lease`` is not a positive, finite number of seconds, or the clock returned no
                finite number of seconds to start it from (nothing is recorded).
        """
        self._check_own(decision)
        lease = self._lease if lease is None else check_lease(lease)
        backend = decision.backend
        uncached = decision.prompt_tokens - decision.matched_tokens
        context = uncached * decision.matched_tokens + uncached * (uncached + 1) // 2
        blocks = -(-decision.prompt_tokens // self._hasher.block_size)
        with self._lock:
            now = self._clock()
            deadline = None if lease is None else lease_deadline(now, lease)
            if self._leases:
                self._expire(now)
            live = self._live.get(decision.id)
            if live is not None:
                if live.backend == backend:
                    self._counts["ignored"] += 1
                    return
                del self._live[decision.id]  # committed elsewhere since it started: the count moves with it
                self._release(live)
            elif decision.id in self._ended:  # a start() that came late, or again: the request is over
                self._counts["ignored"] += 1
                return
            pending = self._pending.get(backend, 0)
            queued_context = self._context.get(backend, 0)
            footprint = self._footprints.get(backend)
            if footprint is None:
                footprint = self._footprints[backend] = Footprint()
            taken = footprint.add(decision._hashes, blocks, decision.matched_tokens // self._hasher.block_size)
            self._active[backend] = footprint.blocks
            request = self._live[decision.id] = StartedRequest(
                backend,
                uncached,
                blocks,
                pending,
                now,
                deadline,
                taken,
                decision._hashes,
                decision._held,
                context,
                queued_context,
            )
            self._unprefilled.setdefault(backend, {})[request] = None
            self._flying.setdefault(backend, {})[request] = None
            self._in_flight[backend] = self._in_flight.get(backend, 0) + 1
            self._pending[backend] = pending + uncached
            self._context[backend] = queued_context + context
            self._held[backend] = self._held.get(backend, 0) + blocks
            self._prefilling[backend] = self._prefilling.get(backend, 0) + 1
            self._figures.pop(backend, None)
            if deadline is not None:
                heapq.heappush(self._leases, (deadline, decision.id))

    def first_token(self, decision: Decision | str) -> None:
        """Note that the request's prefill is done (its first token came back); optional, idempotent. O(1).

        Its uncached tokens (and their token × context pairs) leave the backend's pending prefill work, and the time
        since :meth:`start` updates the backend's observed prefill speed and the fleet's fit of what attention costs
        (:attr:`Candidate.attention_tokens`). A request that is not in flight is ignored and counted. Once called, the
        router stops inferring prefills from the engines' queues (see :meth:`set_engine_load`).
        """
        decision_id = id_of(decision)
        with self._lock:
            self._first_tokens_reported = True
            request = self._live.get(decision_id)
            if request is None or not request.prefilling:
                self._counts["ignored"] += request is None
                return
            self._prefilled(request)
            backend = request.backend
            try:
                now, started = as_float(self._clock()), as_float(request.started_at)
            except Exception:  # a user's clock that raises: first_token() runs in a stream's path, as finish()
                _log.exception("the router's clock raised in first_token(); no prefill speed is learned from it")
                return
            # A clock that returns no number (it need not, without leases) teaches no speed rather than raising.
            elapsed = now - started if now is not None and started is not None else 0.0
            work = request.pending_before + request.uncached
            observed = work / elapsed if elapsed > 0 else 0.0
            if 0.0 < observed < math.inf:  # an elapsed time of a few subnormal seconds makes an infinite speed
                previous = self._speed.get(backend)
                self._speed[backend] = (
                    observed if previous is None else previous + _SPEED_WEIGHT * (observed - previous)
                )
                self._attention.add(work, request.context_before + request.context, elapsed)

    def finish(self, decision: Decision | str, *, refused: bool = False) -> None:
        """Stop counting the request (its response ended, or it failed). Idempotent by id; never raises for an id.
        O(log n). Its time since :meth:`start` joins the fleet's mean lifetime of a request, which
        :attr:`Candidate.memory_wait_s` predicts with (not for ``refused=True``).

        A finish that matches no request in flight — a second finish, an expired lease, a request whose backend
        was removed, a decision of another router, an unknown id — is ignored and counted in
        :attr:`RouterStats.ignored`, so it is safe in a ``finally`` block.

        ``refused=True``: the engine refused the request before computing anything (vLLM's 400 for a prompt longer
        than its context or KV cache, any 4xx), so it cached none of the blocks its commit predicted. The request
        ends as above, and the index forgets those predictions on its backend through the index's
        :meth:`~prefixroute.PrefixIndex.retract` hook: the blocks past the prefix the backend held at the commit
        (for :meth:`route`, ``matched_tokens``), except those of another request in flight there whose prompt
        shares them (the engine computes them for it). Blocks the KV events confirm stay (an
        :class:`~prefixroute.vllm.EventIndex` keeps them apart from its predictions; a plain
        :class:`~prefixroute.PrefixIndex` has no confirmed part). The router keeps each started request's block
        hashes, so a bare id serves. Nothing is forgotten for a request that is not in flight (never started,
        already finished or expired: a second refusal must not remove what later requests predicted), nor for
        one never committed (:meth:`decide` alone). Not for a 5xx or a broken connection: the engine may have
        computed part of the prompt. O(n + L + r log n) for a prompt of n blocks, L requests in flight and r of
        them on that backend sharing its first block: a refusal is rare, so nothing is kept for it on the way of
        every request. An index hook that raises is logged, not raised.

        Raises:
            TypeError: ``refused`` is not a bool (checked before anything changes: the only error finish raises).
        """
        if refused is not True and refused is not False:
            raise InvalidTypeError(f"finish(refused=...) takes True or False, not {type(refused).__name__}")
        decision_id = id_of(decision)
        with self._lock:
            request = self._live.pop(decision_id, None)
            if request is None:
                self._counts["ignored"] += 1
                return
            self._ended_on(decision_id)
            if request.prefilling and not refused:
                self._first_tokens_missing = True
            self._release(request)
            if request.deadline is not None and len(self._leases) > 2 * len(self._live) + _LEASE_SLACK:
                self._compact_leases()
            if not refused:
                self._learn_lifetime(request)
            if refused and request.held >= 0:
                self._retract(request)

    def _compact_leases(self) -> None:
        """Drop the lease heap's entries of finished requests (call under the lock). A finish leaves its entry for
        the expiry to skip; at 1,000 requests/s under a 600 s lease that is 600,000 entries, ~90 MB, so once the heap
        holds more than twice the requests in flight (and a slack), it is rebuilt from theirs: O(L), after at least
        L + slack finishes, so O(1) a finish amortized."""
        live = self._live
        self._leases = [
            (deadline, decision_id)
            for deadline, decision_id in self._leases
            if (request := live.get(decision_id)) is not None and request.deadline == deadline
        ]
        heapq.heapify(self._leases)

    def _learn_lifetime(self, request: StartedRequest) -> None:
        """Fold a finished request's time in flight into the fleet's mean lifetime (call under the lock)."""
        try:
            now, started = as_float(self._clock()), as_float(request.started_at)
        except Exception:  # a user's clock that raises: finish() runs in finally blocks and must not raise
            _log.exception("the router's clock raised in finish(); the request's lifetime is not learned")
            return
        if now is None or started is None or not 0.0 <= now - started < math.inf:
            return  # a clock that returns no number, or went back: nothing learned
        self._finished += 1
        lifetime = self._lifetime
        weight = max(_LIFETIME_WEIGHT, 1.0 / self._finished)
        self._lifetime = now - started if lifetime is None else lifetime + weight * (now - started - lifetime)

    def _memory_wait(self, backend: str, over: int, now: float) -> float:
        """Seconds until ``over`` of ``backend``'s KV blocks are predicted free (call under the lock; the mean
        lifetime known): its requests in flight, oldest first, each freeing its blocks once it has been in flight
        as long as requests live on average (see :attr:`Candidate.memory_wait_s`). O(requests walked)."""
        flying = self._flying.get(backend)
        if not flying:  # none in flight: the prompt alone is more than the backend holds, and waiting frees nothing
            return 0.0
        freed = 0
        for request in flying:
            freed += request.blocks
            if freed >= over:
                break
        started = request.started_at if type(request.started_at) is float else as_float(request.started_at)
        lifetime = self._lifetime
        assert lifetime is not None
        wait = (now if started is None else started) + lifetime - now
        return wait if 0.0 < wait < math.inf else 0.0

    def _retract(self, request: StartedRequest) -> None:
        """Forget what a refused request's commit predicted on its backend (call under the lock, after
        :meth:`_release`): the blocks past ``request.held`` that no request in flight there shares."""
        hashes, backend = request.hashes, request.backend
        start = request.held
        if start >= len(hashes):
            return
        first = hashes[0]
        for other in self._live.values():
            if other.backend == backend and other.hashes and other.hashes[0] == first:
                start = max(start, _shared(hashes, other.hashes))
                if start >= len(hashes):
                    return
        try:
            self._index.retract(hashes, request.backend, start)
        except Exception:  # a subclass's hook: finish() runs in finally blocks and must not raise
            _log.exception("the index's retract() hook failed for a refused request on %s", request.backend)

    @contextmanager
    def track(self, decision: Decision, *, lease: float | None = None) -> Iterator[Decision]:
        """Count the request in flight for the duration of the ``with`` block, also when it raises."""
        self.start(decision, lease=lease)
        try:
            yield decision
        finally:
            self.finish(decision)

    def expire(self) -> int:
        """End every request whose lease has run out; return how many. Route and start also do it. O(k log L)."""
        with self._lock:
            return self._expire(self._clock())

    def in_flight(self, backend: str) -> int:
        """Return how many of this router's requests are in flight on ``backend``, after ending those whose lease
        has run out. O(1) when none has.

        Raises:
            TypeError: ``backend`` is not a str.
        """
        backend = check_backend_id(backend)
        with self._lock:
            self._expire_due()
            return self._in_flight.get(backend, 0)

    def stats(self) -> RouterStats:
        """Return a snapshot of the decision and lifecycle counters, after ending the requests whose lease has run
        out. O(1) when none has."""
        with self._lock:
            self._expire_due()
            c = self._counts
            return RouterStats(c["decisions"], c["commits"], len(self._live), c["ignored"], c["leases_expired"])

    def _release(self, request: StartedRequest) -> None:
        backend = request.backend
        self._in_flight[backend] -= 1
        flying = self._flying[backend]
        del flying[request]
        if not flying:
            del self._flying[backend]
        self._held[backend] -= request.blocks
        footprint = self._footprints[backend]
        footprint.remove(request.footprint)
        self._active[backend] = footprint.blocks
        if request.prefilling:
            self._prefilled(request)
        self._figures.pop(backend, None)

    def _prefilled(self, request: StartedRequest) -> None:
        """Take a request out of its backend's prefill counts (call under the lock)."""
        backend = request.backend
        request.prefilling = False
        self._pending[backend] -= request.uncached
        self._context[backend] -= request.context
        self._prefilling[backend] -= 1
        del self._unprefilled[backend][request]
        self._figures.pop(backend, None)

    def _expire_due(self) -> None:
        """End the requests whose lease has run out, if any (call under the lock)."""
        if self._leases:
            self._expire(self._clock())

    def _expire(self, now: object) -> int:
        """End the requests whose lease has run out at the clock reading ``now`` (call under the lock); none at a
        reading that is no number (None, a str, NaN): a broken clock keeps the leases waiting, it fails no call."""
        reading = now if type(now) is float else as_float(now, infinite=True)
        if reading is None:
            return 0
        expired = 0
        backend = ""
        leases = self._leases
        while leases and leases[0][0] <= reading:
            deadline, decision_id = heapq.heappop(leases)
            request = self._live.get(decision_id)
            if request is not None and request.deadline == deadline:
                del self._live[decision_id]
                self._ended_on(decision_id)
                self._release(request)
                expired += 1
                backend = request.backend
                _log.debug("request %s on %s: lease expired before finish()", decision_id, backend)
        if expired:
            self._counts["leases_expired"] += expired
            self._tell_expiries(reading, backend)
        return expired

    def _tell_expiries(self, now: float, backend: str) -> None:
        """Warn that leases expired, at most once a minute of the clock: a gateway whose releases never arrive
        would otherwise log a line per request, thousands a second (each one is logged at DEBUG)."""
        total = self._counts["leases_expired"]
        told = self._expiries_told
        if told is not None and 0 <= now - told[0] < _EXPIRY_WARNING_SECONDS:
            return
        self._expiries_told = (now, total)
        _log.warning(
            "%d request(s) reached their lease before finish() (the latest on %s; %d since the router started): check "
            "that finish() is called (behind a gateway: its release path); this warning repeats at most once a minute",
            total - (told[1] if told is not None else 0), backend, total,
        )  # fmt: skip

    def _ended_on(self, decision_id: str) -> None:
        """Remember that ``decision_id`` ended (the last :data:`_ENDED_KEPT`), until it is committed again. O(1)."""
        ended = self._ended
        ended[decision_id] = None
        if len(ended) > _ENDED_KEPT:
            ended.popitem(last=False)

    def _check_own(self, decision: Decision) -> None:
        """Raise unless ``decision`` is one this router made, as it made it: :meth:`start` and :meth:`commit` count
        and record what its fields say, so a field changed since (``dataclasses.replace``) must not reach them."""
        if not isinstance(decision, Decision):
            raise InvalidTypeError(f"expected a Decision, not {type(decision).__name__}")
        decision_id = decision.id
        if not isinstance(decision_id, str) or not str.startswith(decision_id, self._id_prefix):
            raise DecisionError(f"decision {shown(decision_id)} was made by another router: pass it back to that one")
        backend, prompt, matched = decision.backend, decision.prompt_tokens, decision.matched_tokens
        candidates = decision.candidates
        if (
            # The id and backend become keys of the router's maps: the router made them plain str, and a subclass's
            # own __hash__ would file the request apart from its backend's counts, where finish() and policies miss it.
            type(decision_id) is not str
            or type(backend) is not str
            or type(prompt) is not int
            or type(matched) is not int
            or not 0 <= matched <= prompt
            or type(candidates) is not tuple
            or not any(type(c) is Candidate and c.backend == backend for c in candidates)
            or decision._seal != self._seal(decision_id, backend, matched, prompt, decision._hashes)
        ):
            raise DecisionError(
                f"decision {shown(decision_id)} was altered after the router made it (backend {shown(backend)}, "
                f"{shown(matched)} of {shown(prompt)} prompt tokens matched): pass the Decision that route(), "
                "decide() or commit() returned, unchanged; to send it to another candidate, commit(decision, backend)"
            )

    # -- engine figures and backends -----------------------------------------------------------------------------

    def set_engine_load(self, backend: str, *, queue_len: int | None, kv_usage: float | None) -> None:
        """Record a backend's engine figures (from its ``/metrics``) for policies to see in :class:`Candidate`.

        Pass None for a figure that is unknown or stale; with both None the backend's entry is dropped.

        When the gateway reports no first tokens (a request has finished without :meth:`first_token` and it was
        never called), ``queue_len`` also tells which of this router's requests there are past their prefill. vLLM
        admits requests first come, first served, each step until its token budget runs out, so its ``queue_len``
        waiting requests are the newest, and the newest one admitted may be part-way through a chunked prefill; the
        others are done with it. Of this router's requests still counted in prefill there that started before the
        previous call for this backend (so before this figure was read), all but the newest ``queue_len + 1`` leave
        the prefill counts, as a first token would take them out (without teaching a prefill speed). Requests of
        other gateways in the queue only make the router keep more of its own. O(1); when it infers, O(requests in
        prefill there).

        Raises:
            ConfigurationError: ``queue_len`` is not an int in [0, 2**63) (policies do float arithmetic on loads) or
                ``kv_usage`` is not a number in [0, 1].
        """
        backend = check_backend_id(backend)
        if queue_len is not None:
            queue = as_int(queue_len)
            if queue is None or not 0 <= queue < _QUEUE_LIMIT:
                raise ConfigurationError(f"queue_len must be an int in [0, 2**63) or None, not {shown(queue_len)}")
            queue_len = queue
        if kv_usage is not None:
            usage = as_float(kv_usage)
            if usage is None or not 0.0 <= usage <= 1.0:
                raise ConfigurationError(f"kv_usage must be a fraction in [0, 1] or None, not {shown(kv_usage)}")
            kv_usage = usage
        with self._lock:
            self._figures.pop(backend, None)
            if queue_len is None and kv_usage is None:
                self._queue_len.pop(backend, None)
                self._kv_usage.pop(backend, None)
                self._polled.pop(backend, None)
            else:
                self._queue_len[backend] = queue_len
                self._kv_usage[backend] = kv_usage
                if queue_len is not None and self._first_tokens_missing and not self._first_tokens_reported:
                    self._infer_prefilled(backend, queue_len)

    def _infer_prefilled(self, backend: str, waiting: int) -> None:
        """Take out of the prefill counts the requests on ``backend`` that its engine's waiting queue shows past
        their prefill (call under the lock; see :meth:`set_engine_load`)."""
        now = as_float(self._clock())
        before = self._polled.get(backend)
        if now is None:  # a clock that returns no number (it need not, without leases) infers nothing
            return
        self._polled[backend] = now
        queue = self._unprefilled.get(backend)
        kept = waiting + 1  # and the newest admitted, which a chunked prefill may be part-way through
        if before is None or not queue or len(queue) <= kept:
            return
        older: list[StartedRequest] = []  # oldest start first, up to the first that started since the previous call
        for request in queue:
            started = as_float(request.started_at)
            if started is None or not started < before:
                break
            older.append(request)
        # The waiting ones are the newest of those (the figure may predate the newer ones, which stay counted).
        for request in older[: max(0, len(older) - kept)]:
            self._prefilled(request)

    def set_capacity(self, backend: str, capacity_blocks: int | None) -> None:
        """Set ``backend``'s index capacity in router blocks; None returns it to the index's default capacity.

        See :meth:`PrefixIndex.set_capacity`. O(evicted).
        """
        backend = check_backend_id(backend)
        with self._lock:
            self._index.set_capacity(backend, capacity_blocks)

    def remove_backend(self, backend: str) -> None:
        """Forget a backend (it left the fleet): its blocks, its requests in flight and its figures. Its capacity, a
        setting, stays (``set_capacity(backend, None)`` forgets it too).

        A later :meth:`finish` of one of its requests is ignored, and so is a :meth:`start` but after a
        :meth:`commit` (the backend back in the fleet). O(requests in flight) under the lock; the blocks
        are freed after it is released (a million take ~40 ms).
        """
        backend = check_backend_id(backend)
        with self._lock:
            blocks = self._index.remove_backend(backend)
            for decision_id in [i for i, r in self._live.items() if r.backend == backend]:
                del self._live[decision_id]
                self._ended_on(decision_id)  # a late start() is ignored; one committed again (it came back) counts
            for figures in (
                self._in_flight,
                self._pending,
                self._context,
                self._held,
                self._prefilling,
                self._unprefilled,
                self._flying,
                self._footprints,
                self._active,
                self._speed,
                self._queue_len,
                self._kv_usage,
                self._polled,
                self._figures,
            ):
                figures.pop(backend, None)
        del blocks  # freed here, outside the lock

    # -- the public write path into the index --------------------------------------------------------------------

    def store(self, backend: str, hashes: Sequence[int], *, parent: int | None = None) -> None:
        """Record that ``backend`` holds the chain ``hashes`` (continuing block ``parent``; None: from block 0).

        The write path of KV events and of the simulator. O(len(hashes) + evicted).
        """
        self.write(backend, ((True, hashes, parent),))

    def evict(self, backend: str, hashes: Iterable[int]) -> None:
        """Record that ``backend`` no longer holds ``hashes``. O(len(hashes)).

        Raises:
            TypeError: ``hashes`` is not an iterable of block hashes.
            InvalidEventError: a hash is not an int in [0, 2**64).
        """
        if not isinstance(hashes, Sequence):
            hashes = list(iterable_of(hashes, "evict() hashes", "block hashes"))
        self.write(backend, ((False, hashes, None),))

    def write(self, backend: str, updates: Iterable[IndexUpdate]) -> None:
        """Apply index updates for ``backend`` in order, under one lock acquisition.

        Each update is ``(True, hashes, parent)`` (stored, as :meth:`store`) or ``(False, hashes, None)``
        (removed, as :meth:`evict`). Every update is checked before any is applied. O(total hashes + evicted).

        Raises:
            TypeError: ``updates`` is not iterable, or an update is not such a tuple.
            InvalidEventError: a hash or parent is not an int in [0, 2**64).
        """
        backend = check_backend_id(backend)
        updates = [check_update(update) for update in iterable_of(updates, "write() updates", "index updates")]
        with self._lock:
            apply_updates(self._index, backend, updates)

    def clear_backend(self, backend: str) -> None:
        """Forget every block ``backend`` holds (its engine restarted or cleared its cache); counts stay. O(1)."""
        backend = check_backend_id(backend)
        with self._lock:
            blocks = self._index.remove_backend(backend)
        del blocks  # freed outside the lock

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        """Refuse :func:`copy.copy`, :func:`copy.deepcopy` and :mod:`pickle` (``TypeError``): a copy would share or
        duplicate the lock, the requests in flight and the id counter, and hand out ids that name another request."""
        raise InvalidTypeError(
            "a Router cannot be copied or pickled: it holds a lock, the requests in flight and the counter of their "
            "ids, which a copy would share or duplicate; build another Router with the same options instead"
        )

    def __repr__(self) -> str:
        return f"Router(block_size={self._hasher.block_size}, policy={self._policy!r}, index={self._index!r})"

    def _check(self) -> None:
        """Assert that every per-backend counter is what the requests in flight add up to (their footprints
        included), and the index's own invariants when it has a ``_check``, all under the router's lock, so it may run
        while other threads route. For tests; O(requests + index)."""
        with self._lock:
            expected: dict[str, list[int]] = {}
            requests: dict[str, list[StartedRequest]] = {}
            for request in self._live.values():
                backend = request.backend
                requests.setdefault(backend, []).append(request)
                figures = expected.setdefault(backend, [0, 0, 0, 0, 0])
                figures[0] += 1
                figures[1] += request.blocks
                if request.prefilling:
                    figures[2] += request.uncached
                    figures[3] += 1
                    figures[4] += request.context
            counters = (self._in_flight, self._held, self._pending, self._prefilling, self._context)
            prefilling = {r for r in self._live.values() if r.prefilling}
            assert prefilling == {r for queue in self._unprefilled.values() for r in queue}
            assert all(r.backend == backend for backend, queue in self._unprefilled.items() for r in queue)
            flying = [r for queue in self._flying.values() for r in queue]
            assert len(flying) == len(self._live) and set(flying) == set(self._live.values())
            assert all(r.backend == backend and queue for backend, queue in self._flying.items() for r in queue)
            assert self._lifetime is None or 0.0 <= self._lifetime < math.inf, self._lifetime
            leases = self._leases  # a heap holding every leased request's (deadline, id)
            assert all(leases[(k - 1) // 2] <= leases[k] for k in range(1, len(leases)))
            held = set(leases)
            assert all((r.deadline, i) in held for i, r in self._live.items() if r.deadline is not None)
            for backend in set(expected).union(*counters, self._footprints, self._active):
                got = [counter.get(backend, 0) for counter in counters]
                assert got == expected.get(backend, [0, 0, 0, 0, 0]), (backend, got, expected.get(backend))
                footprint = self._footprints.get(backend) or Footprint()
                footprint._check([(r.hashes, r.blocks, r.footprint) for r in requests.get(backend, ())])
                assert footprint.blocks == self._active.get(backend, 0), backend
            tokens = self._attention.tokens
            assert tokens is None or 0.0 < tokens < math.inf, tokens
            check = getattr(self._index, "_check", None)
            if check is not None:  # under the lock: a route() on another thread may be inserting
                check()


class _Lock:
    """The router's lock, which refuses a call back into the router from the thread holding it (a policy's
    ``choose()`` or an index hook asking the router for figures) with a :class:`PolicyError` instead of a
    deadlock."""

    __slots__ = ("_lock", "_owner")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None

    def __enter__(self) -> None:
        me = threading.get_ident()
        if self._owner == me:
            raise PolicyError(
                "a policy's choose() or an index hook called back into the Router that is calling it, which would "
                "deadlock: read what the policy needs from its candidates (Candidate fields), not from the router"
            )
        self._lock.acquire()
        self._owner = me

    def __exit__(self, *exc_info: object) -> None:
        self._owner = None
        self._lock.release()


def _text(exc: BaseException) -> str:
    """``str(exc)``, short, for a message about a faulty policy (whose exception's ``__str__`` may raise too)."""
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 - the message must not fail on the exception it describes
        return "(its str() raised)"
    return text if len(text) <= 200 else text[:197] + "..."


def _shared(hashes: Sequence[int], other: Sequence[int]) -> int:
    """How many leading blocks two prompts share: a block hash names its whole prefix, so the blocks agree up to
    where they first differ, found by binary search. O(log n)."""
    low, high = 0, min(len(hashes), len(other))
    while low < high:  # invariant: the first ``low`` blocks agree; those from ``high`` on differ
        middle = (low + high) // 2
        if hashes[middle] == other[middle]:
            low = middle + 1
        else:
            high = middle
    return low


def _is_one_of(chosen: object, candidates: tuple[Candidate, ...]) -> bool:
    return any(chosen is candidate for candidate in candidates)


def _tokens(blocks: int | None, block_size: int) -> int | None:
    return None if blocks is None else blocks * block_size


def _placement_key(hashes: Sequence[int], data: bytes, seed: int, placement_blocks: int) -> int:
    """The hash that decides where a prompt's prefix is placed: its ``placement_blocks``-th block, or less."""
    if hashes:
        return hashes[min(len(hashes), placement_blocks) - 1]
    return xxhash.xxh3_64_intdigest(data, seed)


def _placement_order(backends: Sequence[str], key: int) -> tuple[str, ...]:
    """Backends by descending rendezvous score for ``key``: the same order on every replica."""
    digest = xxhash.xxh3_64_intdigest
    return tuple(
        sorted(backends, key=lambda backend: digest(backend.encode("utf-8", "surrogatepass"), key), reverse=True)
    )


def _order_key(backends: Sequence[str], key: int) -> tuple[int, tuple[str, ...]]:
    return key, tuple(backends)


def _prefix_aware(policy: LoadPolicy) -> bool:
    """``policy.prefix_aware``, read once when the router takes the policy (a class attribute, by the contract).

    Raises:
        ConfigurationError: reading it, or its truth, raised (a property of a user's policy that fails).
    """
    try:
        return bool(policy.prefix_aware)
    except Exception as exc:  # noqa: BLE001 - whatever a user's property raised, named with the policy
        raise ConfigurationError(
            f"policy {shown(policy)}'s prefix_aware raised {type(exc).__name__}: {_text(exc)}; make it a bool class "
            "attribute"
        ) from exc


def _reason(prefix_aware: bool, matched_tokens: int, best: int) -> Reason:
    if not prefix_aware:
        return "policy"
    if best == 0:
        return "miss"
    return "prefix" if matched_tokens == best else "load-fallback"
