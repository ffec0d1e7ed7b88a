"""The Router: hash once, match, ask the policy, record the prediction, return a Decision."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import repeat
from typing import TYPE_CHECKING, Literal, Protocol

import cachetools
import xxhash

from prefixroute.errors import ConfigurationError, NoBackendError, PrefixRouteError
from prefixroute.hashing import BlockHasher, Tokens, encode_tokens, namespace_seed
from prefixroute.index import PrefixIndex
from prefixroute.policies import BoundedLoad, Candidate, LoadPolicy
from prefixroute.speculative import EventSink, SpeculativeIndex

if TYPE_CHECKING:  # the vllm extra is imported only when subscribe() or watch_metrics() is called
    from prefixroute.vllm.metrics import MetricsPoller
    from prefixroute.vllm.subscriber import KVEventSubscriber

__all__ = ["Decision", "IndexSource", "Reason", "Router"]

IndexSource = Literal["predictions", "events", "hybrid"]
"""What writes the index: the router's own routing decisions (``"predictions"``), only vLLM's KV-cache events
(``"events"``), or events plus short-lived speculative entries for just-routed prompts (``"hybrid"``)."""

_log = logging.getLogger("prefixroute")

Reason = Literal["prefix", "load-fallback", "miss", "policy"]
"""Why a backend was chosen: it held the longest prefix (``"prefix"``); a prefix-aware policy passed over a longer
match because of load (``"load-fallback"``); no backend held any of the prompt (``"miss"``); or a policy that
ignores prefixes chose (``"policy"``)."""


@dataclass(frozen=True, slots=True)
class Decision:
    """Where one request goes and why. Pass it back to :meth:`Router.track` (or start/finish)."""

    backend: str
    matched_tokens: int
    prompt_tokens: int
    reason: Reason
    candidates: tuple[Candidate, ...]
    decided_at: float = 0.0
    confirmed_tokens: int | None = None
    """Of ``matched_tokens``, how many vLLM's KV events confirm are cached (None without an event source)."""

    @property
    def hit_ratio(self) -> float:
        """Predicted fraction of the prompt served from the chosen backend's prefix cache."""
        return self.matched_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class Router:
    """Route prompts to the backend that holds their prefix, within a load bound.

    ``policy`` defaults to :class:`~prefixroute.BoundedLoad` (factor 2). ``capacity_blocks`` bounds each backend's
    predicted cache like vLLM's ``num_gpu_blocks`` (see :class:`~prefixroute.PrefixIndex`). ``namespace`` seeds the
    block hashes (model or adapter name); :meth:`route` can override it per request. ``placement_blocks`` is how many
    leading blocks decide where a never-seen prefix goes (rendezvous hashing), so gateway replicas that share no
    state still agree.

    Thread-safe: one lock guards the index, the in-flight counts and the policy; hashing runs outside it and nothing
    inside it does I/O or sleeps, so calling :meth:`route` from an asyncio coroutine does not stall the loop.

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
        index_source: IndexSource | None = None,
        speculative_ttl: float = 3.0,
    ) -> None:
        if policy is not None and not isinstance(policy, LoadPolicy):
            raise TypeError(f"policy must be a LoadPolicy instance, not {type(policy).__name__}")
        if isinstance(placement_blocks, bool) or not isinstance(placement_blocks, int) or placement_blocks < 1:
            raise ValueError(f"placement_blocks must be a positive int, not {placement_blocks!r}")
        if index_source not in (None, "predictions", "events", "hybrid"):
            raise ConfigurationError(f"index_source must be 'predictions', 'events' or 'hybrid', not {index_source!r}")
        if isinstance(speculative_ttl, bool) or not isinstance(speculative_ttl, (int, float)) or speculative_ttl <= 0:
            raise ConfigurationError(f"speculative_ttl must be a positive number of seconds, not {speculative_ttl!r}")
        self._hasher = BlockHasher(block_size, namespace=namespace)
        self._index = PrefixIndex(block_size, capacity_blocks=capacity_blocks)
        self._policy: LoadPolicy = policy if policy is not None else BoundedLoad()
        self._clock = clock
        self._placement_blocks = placement_blocks
        self._lock = threading.Lock()
        self._in_flight: dict[str, int] = {}
        self._queue_len: dict[str, int | None] = {}  # engine figures from set_engine_load()
        self._kv_usage: dict[str, float | None] = {}
        self._index_source: IndexSource | None = index_source
        self._speculative = SpeculativeIndex(block_size, ttl=float(speculative_ttl), clock=clock)
        self._subscribers: dict[str, _Stoppable] = {}  # KV-event subscribers and metrics pollers, for close()
        # Root seeds of per-request namespaces (model or LoRA names): few, reused, so a small LRU serves.
        self._seeds: cachetools.LRUCache[str | bytes, int] = cachetools.LRUCache(maxsize=1024)

    @property
    def index(self) -> PrefixIndex:
        """The prefix index (hold :attr:`lock` while you change it from another thread)."""
        return self._index

    @property
    def hasher(self) -> BlockHasher:
        """The block hasher (block size and default namespace)."""
        return self._hasher

    @property
    def policy(self) -> LoadPolicy:
        """The load policy in use."""
        return self._policy

    @property
    def index_source(self) -> IndexSource:
        """What writes the index; ``"predictions"`` until :meth:`subscribe` makes an unset source ``"hybrid"``."""
        return self._index_source or "predictions"

    @property
    def lock(self) -> threading.Lock:
        """The lock that guards the index and in-flight counts; event subscribers share it."""
        return self._lock

    def route(
        self, prompt_tokens: Tokens, backends: Sequence[str], *, namespace: str | bytes | None = None
    ) -> Decision:
        """Choose a backend for a prompt and record that it will cache the prompt's blocks.

        O(n/block_size + B log B + H log n) for a prompt of n tokens, B backends and H backends holding its first
        block (see :meth:`PrefixIndex.match`).

        Raises:
            NoBackendError: ``backends`` is empty.
            ValueError: ``backends`` names a backend twice.
            TypeError: a backend id is not a str, or the prompt is not a token sequence.
            InvalidPromptError: a token id is not an int in [0, 2**32) (the message names its position).
        """
        ids = _check_backends(backends)
        data = encode_tokens(prompt_tokens)
        seed = self._hasher.seed if namespace is None else self._seed(namespace)
        hashes = self._hasher.hash_encoded(data, seed)
        prompt_len = len(data) // 4
        order = _placement_order(ids, _placement_key(hashes, data, seed, self._placement_blocks))
        source = self.index_source
        block_size = self._hasher.block_size
        with self._lock:
            matched = self._index.match(hashes, order)
            confirmed = None
            if source == "hybrid":
                confirmed = matched
                matched = self._speculative.match(hashes, order, confirmed)
            candidates = self._candidates(order, matched, prompt_len)
            chosen = self._policy.choose(candidates)
            if not isinstance(chosen, Candidate) or chosen.backend not in matched:
                raise PrefixRouteError(
                    f"policy {self._policy!r} returned {chosen!r}, which is not one of the candidates it was given"
                )
            if hashes:
                if source == "predictions":
                    self._index._insert(hashes, chosen.backend, matched[chosen.backend])
                elif source == "hybrid":
                    self._speculative.insert(hashes, chosen.backend)
        if source == "events":
            confirmed = matched
        best = max(matched.values()) * block_size
        return Decision(
            chosen.backend,
            chosen.matched_tokens,
            prompt_len,
            _reason(self._policy, chosen.matched_tokens, best),
            candidates,
            self._clock(),
            None if confirmed is None else confirmed[chosen.backend] * block_size,
        )

    def _candidates(self, order: list[str], matched: dict[str, int], prompt_len: int) -> tuple[Candidate, ...]:
        """One Candidate per backend, in placement order (call under the lock)."""
        # C-level maps feed the candidates' fields: with 64 backends a generator would cost a fifth more.
        return tuple(
            map(
                _candidate,
                order,
                map(self._hasher.block_size.__mul__, map(matched.__getitem__, order)),
                repeat(prompt_len),
                map(self._in_flight.get, order, repeat(0)),
                map(self._queue_len.get, order),
                map(self._kv_usage.get, order),
            )
        )

    def set_engine_load(self, backend: str, *, queue_len: int | None, kv_usage: float | None) -> None:
        """Record a backend's engine figures (from its ``/metrics``) for policies to see in :class:`Candidate`.

        Pass None for a figure that is unknown or stale; with both None the backend's entry is dropped. O(1).
        """
        with self._lock:
            if queue_len is None and kv_usage is None:
                self._queue_len.pop(backend, None)
                self._kv_usage.pop(backend, None)
            else:
                self._queue_len[backend] = queue_len
                self._kv_usage[backend] = kv_usage

    def start(self, decision: Decision) -> None:
        """Count ``decision``'s request in flight on its backend (callback-style gateways). O(1)."""
        with self._lock:
            self._in_flight[decision.backend] = self._in_flight.get(decision.backend, 0) + 1

    def finish(self, decision: Decision) -> None:
        """Stop counting ``decision``'s request; ignored if its backend was removed meanwhile. O(1).

        Raises:
            ValueError: more finishes than starts for that backend.
        """
        with self._lock:
            count = self._in_flight.get(decision.backend)
            if count is None:
                return
            if count == 0:
                raise ValueError(f"finish() called more often than start() for backend {decision.backend!r}")
            self._in_flight[decision.backend] = count - 1

    @contextmanager
    def track(self, decision: Decision) -> Iterator[Decision]:
        """Count the request in flight for the duration of the ``with`` block, also when it raises."""
        self.start(decision)
        try:
            yield decision
        finally:
            self.finish(decision)

    def in_flight(self, backend: str) -> int:
        """Return how many of this router's requests are in flight on ``backend``. O(1)."""
        with self._lock:
            return self._in_flight.get(backend, 0)

    def remove_backend(self, backend: str) -> None:
        """Forget a backend (it left the fleet): its blocks, in-flight count, engine figures and event subscriber."""
        subscriber = self._subscribers.pop(backend, None)
        if subscriber is not None:
            subscriber.stop()
        with self._lock:
            blocks = self._index._detach(backend)
            self._speculative.remove_backend(backend)
            self._in_flight.pop(backend, None)
            self._queue_len.pop(backend, None)
            self._kv_usage.pop(backend, None)
        del blocks  # freed here, outside the lock: routes wait ~40 ms per million blocks otherwise

    def subscribe(
        self,
        backend: str,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        namespace: str | bytes | None = None,
    ) -> KVEventSubscriber:
        """Start a KV-event subscriber that keeps ``backend``'s index entries exact (needs ``prefixroute[vllm]``).

        ``endpoint`` is the engine's ``--kv-events-config`` publisher endpoint (``tcp://gpu0:5557``),
        ``replay_endpoint`` its replay endpoint. ``namespace`` defaults to the router's (events must hash exactly
        as :meth:`route` does). An unset ``index_source`` becomes ``"hybrid"``. Returns the started
        :class:`prefixroute.vllm.KVEventSubscriber`; :meth:`remove_backend` and :meth:`close` stop it.
        """
        from prefixroute.vllm.subscriber import KVEventSubscriber  # optional extra: imported only when used

        if backend in self._subscribers:
            raise ValueError(f"backend {backend!r} already has a KV-event subscriber; remove_backend() it first")
        if self._index_source is None:
            self._index_source = "hybrid"
        subscriber = KVEventSubscriber(
            EventSink(self._index, self._speculative),
            backend,
            endpoint,
            replay_endpoint=replay_endpoint,
            topic=topic,
            namespace=namespace if namespace is not None else self._hasher.namespace,
            block_size=self._hasher.block_size,
            lock=self._lock,
        )
        self._subscribers[backend] = subscriber
        return subscriber.start()

    def watch_metrics(
        self,
        backends: Mapping[str, str] | Sequence[str],
        *,
        interval: float = 1.0,
        stale_after: float = 5.0,
        on_health: Callable[[str, bool], None] | None = None,
    ) -> MetricsPoller:
        """Poll each backend's vLLM ``/metrics`` and feed the router (needs ``prefixroute[vllm]``).

        ``backends`` maps backend id → base URL (or is a list of URLs used as ids). After every scrape the engine's
        waiting requests and KV usage reach policies as :attr:`Candidate.queue_len` / :attr:`Candidate.kv_usage`
        (None while stale). From ``vllm:cache_config_info``, the index capacity of a backend is set to its
        ``num_gpu_blocks`` (in router blocks) when the index holds predictions; a vLLM block size that is not a
        multiple of the router's is logged as a warning and nothing is guessed. Returns the started
        :class:`prefixroute.vllm.metrics.MetricsPoller` (for :meth:`~MetricsPoller.healthy_backends`);
        :meth:`close` stops it.
        """
        from prefixroute.vllm.metrics import MetricsPoller  # optional extra: imported only when used

        configured: dict[str, tuple[int | None, int | None]] = {}

        def on_load(backend: str, queue_len: int | None, kv_usage: float | None) -> None:
            self.set_engine_load(backend, queue_len=queue_len, kv_usage=kv_usage)
            config = poller.cache_config(backend)
            if configured.get(backend) != config:  # act (and warn) once per change, not every scrape
                configured[backend] = config
                self._apply_cache_config(backend, *config)

        poller = MetricsPoller(
            backends, interval=interval, stale_after=stale_after, on_health=on_health, on_load=on_load
        )
        self._subscribers[f"metrics:{id(poller)}"] = poller
        return poller.start()

    def _apply_cache_config(self, backend: str, engine_block_size: int | None, num_gpu_blocks: int | None) -> None:
        block_size = self._hasher.block_size
        if engine_block_size is None or num_gpu_blocks is None:
            return
        if engine_block_size % block_size:
            _log.warning(
                "%s: vLLM block_size is %d but the router uses %d: prefix matches will be wrong; set "
                "Router(block_size=%d) or vLLM's --block-size",
                backend, engine_block_size, block_size, engine_block_size,
            )  # fmt: skip
            return
        if self.index_source == "predictions":
            with self._lock:
                self._index.set_capacity(backend, num_gpu_blocks * (engine_block_size // block_size))

    def close(self) -> None:
        """Stop every KV-event subscriber and metrics poller (the router keeps routing on what it knows)."""
        while self._subscribers:
            self._subscribers.popitem()[1].stop()

    def _seed(self, namespace: str | bytes) -> int:
        seed = self._seeds.get(namespace)
        if seed is None:
            seed = self._seeds[namespace] = namespace_seed(namespace)
        return seed

    def __repr__(self) -> str:
        return f"Router(block_size={self._hasher.block_size}, policy={self._policy!r}, index={self._index!r})"


class _Stoppable(Protocol):
    def stop(self) -> None: ...


def _candidate(
    backend: str, matched_tokens: int, prompt_tokens: int, in_flight: int, queue_len: int | None, kv_usage: float | None
) -> Candidate:
    """``Candidate(backend, matched_tokens, ...)``, built at twice the speed.

    A frozen dataclass's ``__init__`` sets each field through ``object.__setattr__``; filling ``__dict__`` directly
    gives an identical object (tests compare the two) and matters with 64 backends per request.
    """
    candidate = _new_object(Candidate)
    fields = candidate.__dict__
    fields["backend"] = backend
    fields["matched_tokens"] = matched_tokens
    fields["prompt_tokens"] = prompt_tokens
    fields["in_flight"] = in_flight
    fields["queue_len"] = queue_len
    fields["kv_usage"] = kv_usage
    return candidate


_new_object = object.__new__


def _check_backends(backends: Sequence[str]) -> Sequence[str]:
    if isinstance(backends, str):
        raise TypeError("backends must be a sequence of backend ids, not a single str: wrap it in a list")
    if not backends:
        raise NoBackendError("route() needs at least one backend, but the backend list is empty")
    for backend in backends:  # before the duplicate check, which needs hashable ids
        if not isinstance(backend, str):
            raise TypeError(f"backend ids must be str, not {type(backend).__name__} ({backend!r})")
    if len(set(backends)) != len(backends):
        seen: set[str] = set()
        duplicate = next(b for b in backends if b in seen or seen.add(b))  # type: ignore[func-returns-value]
        raise ValueError(f"backend {duplicate!r} appears more than once in backends; pass each backend once")
    return backends


def _placement_key(hashes: Sequence[int], data: bytes, seed: int, placement_blocks: int) -> int:
    """The hash that decides where a prompt's prefix is placed: its ``placement_blocks``-th block, or less."""
    if hashes:
        return hashes[min(len(hashes), placement_blocks) - 1]
    return xxhash.xxh3_64_intdigest(data, seed)


def _placement_order(backends: Sequence[str], key: int) -> list[str]:
    """Backends by descending rendezvous score for ``key``: the same order on every replica."""
    digest = xxhash.xxh3_64_intdigest
    return sorted(backends, key=lambda backend: digest(backend.encode(), key), reverse=True)


def _reason(policy: LoadPolicy, matched_tokens: int, best: int) -> Reason:
    if not policy.prefix_aware:
        return "policy"
    if best == 0:
        return "miss"
    return "prefix" if matched_tokens == best else "load-fallback"
