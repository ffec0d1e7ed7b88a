"""A vLLM fleet driving a router: per backend a KV-event subscriber and a ``/metrics`` poller, each in its thread.

The :class:`~prefixroute.Router` decides and owns no thread; the :class:`Fleet` owns every thread and writes the
router only through its public write path (:meth:`~prefixroute.Router.write`, :meth:`~prefixroute.Router.
set_engine_load`, :meth:`~prefixroute.Router.set_capacity`). Each backend's threads write through a gate that
:meth:`Fleet.remove_backend` closes first, so once it returns nothing of that backend's is ever written again.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, fields
from types import TracebackType

import httpx
import zmq

from prefixroute._arguments import read_clock
from prefixroute._numbers import shown
from prefixroute.errors import ConfigurationError, InvalidTypeError, MetricsError, StateError
from prefixroute.hashing import namespace_seed
from prefixroute.index import IndexUpdate
from prefixroute.router import Router
from prefixroute.vllm._checks import (
    MAX_DATA_PARALLEL_SIZE,
    check_backend,
    check_data_parallel_size,
    check_endpoint,
    check_seconds,
)
from prefixroute.vllm.index import EventIndex
from prefixroute.vllm.metrics import EngineMetrics, check_metrics_url, fetch_metrics
from prefixroute.vllm.metrics import metrics_url as _metrics_endpoint
from prefixroute.vllm.ranks import RankMerge, rank_endpoint
from prefixroute.vllm.subscriber import KVEventSubscriber, SubscriberStats
from prefixroute.vllm.tracker import IndexWriter, TrackerStats

__all__ = ["BackendStats", "Fleet", "FleetStats"]

_log = logging.getLogger(__name__)
_SUBSCRIBER_STOP_S = 5.0  # how long a backend's removal waits for its subscribers' threads, all together


@dataclass(frozen=True)
class BackendStats:
    """One backend as the fleet sees it (a snapshot; see :meth:`Fleet.stats`)."""

    backend: str
    healthy: bool
    metrics_url: str | None
    scrapes: int
    """Scrapes of ``/metrics`` that returned figures."""
    failed_scrapes: int
    """Scrapes that failed: unreachable, too slow, unreadable or nonsense figures (``last_error`` says which)."""
    last_error: str | None
    """Why the latest scrape failed; None when it succeeded or none has finished yet. A scrape that failed in an
    unexpected way (a bug, or figures the router refused) counts as failed too, its error starting ``unexpected``."""
    queue_len: int | None
    kv_usage: float | None
    engine_block_size: int | None
    num_gpu_blocks: int | None
    events: SubscriberStats | None
    """The KV-event subscriber's counters; None without ``kv_events``. For a data-parallel backend (several
    ``kv_events`` endpoints) the ranks' counters summed (the tracker's too), with ``last_seq`` the lowest rank's,
    ``last_lag_s`` the latest rank's (the largest), and ``blocks_held`` the distinct blocks any rank holds (what the
    backend's index holds); each rank's own are in ``ranks``."""
    ranks: tuple[SubscriberStats, ...] = ()
    """Each KV-event subscriber's counters, one per endpoint in the order given (one per data-parallel rank);
    empty without ``kv_events``."""
    engine_restarts: int = 0
    """Engine restarts seen in ``/metrics`` between two successful scrapes (:meth:`EngineMetrics.restarted_since
    <prefixroute.vllm.EngineMetrics.restarted_since>`): each one drops the backend's blocks from the router's
    index (the engine's prefix cache died with its process), by resetting its KV-event subscribers if it has any."""


@dataclass(frozen=True)
class FleetStats:
    """Every backend of a :class:`Fleet` (in the order they were added) and the fleet's own counters."""

    backends: tuple[BackendStats, ...]
    callback_errors: int
    """Exceptions raised by the ``on_health`` callback (logged and swallowed)."""

    def __getitem__(self, backend: str) -> BackendStats:
        """The stats of ``backend`` (KeyError if the fleet does not have it). O(backends)."""
        for stats in self.backends:
            if stats.backend == backend:
                return stats
        raise KeyError(backend)


class Fleet:
    """Drive ``router`` from a vLLM fleet: KV events keep its index exact, ``/metrics`` feed it engine load.

    :meth:`add_backend` takes a backend id (as passed to ``route()``) and its endpoints: ``kv_events`` (the engine's
    ``--kv-events-config`` publisher, ``tcp://gpu0:5557``) with ``replay`` (its replay endpoint), and ``metrics_url``
    (``http://gpu0:8000``, ``/metrics`` appended); a data-parallel server's ``kv_events`` are one endpoint per rank
    (a list, or ``data_parallel_size``), merged so the backend holds a block while any rank does. KV events need a
    router built on an :class:`~prefixroute.vllm.EventIndex`; the metrics poller sets each backend's index capacity
    from vLLM's ``num_gpu_blocks`` only when the router's index holds predictions (with events, the events carry
    evictions).

    Every ``interval`` seconds each backend's ``/metrics`` is read in that backend's own thread, the whole read
    bounded by ``timeout``, so a slow engine never delays the others. After each scrape the router gets the
    engine's waiting requests and KV usage (:meth:`Router.set_engine_load`), or None for both when it failed.
    Health (:meth:`healthy_backends`): a backend is healthy while its latest scrape succeeded within
    ``stale_after`` seconds (by ``clock``); before its first scrape finishes it counts as healthy for
    ``stale_after`` seconds from :meth:`add_backend`, unless a scrape fails first. A backend without
    ``metrics_url`` is always healthy. ``on_health(backend, healthy)`` is called from the poller thread when a
    backend's health changes (and after its first scrape).

    The KV-event subscribers of all backends share one ZMQ context, made by the first :meth:`add_backend` with
    ``kv_events`` and terminated by :meth:`close` once they have stopped: each subscriber costs its thread and about 4
    file descriptors (its sockets and connection), the context about 5 descriptors and 2 libzmq threads once.

    Nothing stops a thread but :meth:`remove_backend` and :meth:`close`: nonsense ``/metrics`` (NaN, negative or
    zero figures), a slow or trickling endpoint, malformed KV-event messages or sequence numbers mark only that
    backend or batch bad, are logged and counted (:meth:`stats`), and the rest goes on.

    Raises:
        ConfigurationError: an interval or timeout is not a finite positive number of seconds, ``stale_after`` is
            not longer than both ``interval`` and ``timeout`` (figures would turn stale between two scrapes), or
            ``clock``, read once here, raises or returns no finite number of seconds.

    >>> from prefixroute.vllm import EventIndex
    >>> router = Router(index=EventIndex(16))
    >>> with Fleet(router) as fleet:                                                     # doctest: +SKIP
    ...     fleet.add_backend("gpu0", kv_events="tcp://gpu0:5557", replay="tcp://gpu0:5558",
    ...                       metrics_url="http://gpu0:8000")
    ...     decision = router.route(tokens, fleet.healthy_backends())
    """

    def __init__(
        self,
        router: Router,
        *,
        interval: float = 1.0,
        timeout: float = 2.0,
        stale_after: float = 5.0,
        on_health: Callable[[str, bool], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(router, Router):
            raise InvalidTypeError(f"router must be a prefixroute.Router, not {type(router).__name__}")
        self._interval = check_seconds(interval, "interval")
        self._timeout = check_seconds(timeout, "timeout")
        self._stale_after = check_seconds(stale_after, "stale_after")
        if self._stale_after <= max(self._interval, self._timeout):
            raise ConfigurationError(
                f"stale_after ({stale_after}) must be longer than interval ({interval}) and timeout ({timeout}): "
                "otherwise every engine's figures turn stale between two scrapes"
            )
        if on_health is not None and not callable(on_health):
            raise InvalidTypeError(
                f"on_health must be a callable (backend, healthy) or None, not {type(on_health).__name__}"
            )
        if not callable(clock):
            raise InvalidTypeError(f"clock must be a callable returning seconds, not {type(clock).__name__}")
        read_clock(clock)  # read when given: one that returns no seconds would fail every scrape and health check
        self._router = router
        self._on_health = on_health
        self._clock = clock
        self._lock = threading.Lock()  # guards _members, _removing and _closed (never held while calling the router)
        self._members: dict[str, _Member] = {}
        # Backends whose remove_backend() has not returned, and how many calls remove each: until then their name is
        # not free, or a backend added again under it would have its first blocks wiped by the router's removal.
        self._removing: dict[str, int] = {}
        self._closed = False
        self._callback_errors = 0
        # The ZMQ context every subscriber of the fleet makes its sockets in: made by the first add_backend() that
        # needs it, terminated by close() (not before: a backend removed does not end it for the others).
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None
        # Backends removed whose threads may still hold sockets in the context (a remove_backend() under way, or one
        # whose wait for a thread ran out): close() must not block on terminating the context while they run.
        self._leaving: list[_Member] = []

    @property
    def router(self) -> Router:
        """The router this fleet drives."""
        return self._router

    def add_backend(
        self,
        backend: str,
        *,
        kv_events: str | Sequence[str] | None = None,
        replay: str | Sequence[str] | None = None,
        topic: str = "",
        metrics_url: str | None = None,
        namespace: str | bytes | None = None,
        data_parallel_size: int | None = None,
    ) -> None:
        """Start watching ``backend``: its KV events (``kv_events``, ``replay``, ``topic``) and its ``/metrics``.

        ``namespace`` is what the events' tokens are hashed in: the router's by default (it must be what
        ``route()`` uses). Starts one thread per endpoint; returns at once.

        A server run with data parallelism (``--data-parallel-size N`` behind one API server) publishes each rank's
        events on its own endpoint, vLLM offsetting the configured port by the rank. Give them as a list
        (``kv_events=["tcp://gpu0:5557", "tcp://gpu0:5558"]``, ``replay`` then None or a list as long), or give
        the configured endpoints with ``data_parallel_size=N`` and the N are derived as vLLM derives them
        (:func:`~prefixroute.vllm.ranks.rank_endpoint`: ``tcp://`` ports + rank). Each rank gets its own
        subscriber, and the backend's index holds a block while any rank holds it (a
        :class:`~prefixroute.vllm.ranks.RankMerge` counts the ranks holding each block): one rank's eviction,
        ``AllBlocksCleared`` or restart drops only what no other rank holds.

        Raises:
            ConfigurationError: ``backend`` is an empty str, already in the fleet or still being removed (a
                :meth:`remove_backend` that has not returned), the fleet is closed, an endpoint is malformed
                or is one that another backend of the fleet follows (in the other role, or under an overlapping
                topic), ``replay`` comes without ``kv_events``, ``kv_events`` is given to a router whose index is not an
                :class:`~prefixroute.vllm.EventIndex`, a list of endpoints is empty, repeats one, or its
                ``replay`` list differs in length, a list or ``data_parallel_size`` has more than
                :data:`~prefixroute.vllm._checks.MAX_DATA_PARALLEL_SIZE` (1024) ranks, or ``data_parallel_size`` is
                not an int in [1, 1024], differs from the list's length, comes without ``kv_events``, or cannot
                offset the endpoints; or a thread could not be started, or the fleet's ZMQ context made (out of
                file descriptors or threads: the error says which; each KV-event subscriber holds its thread and
                about 4 descriptors): the backend is then not added, and what it had started is stopped.
            TypeError: ``backend`` is not a str, ``namespace`` not a str, bytes or None.
        """
        backend = check_backend(backend)  # a plain str: remove_backend() finds it by the router's id
        namespace_seed(namespace)  # a TypeError here, with or without kv_events, not in a thread later
        if replay is not None and kv_events is None:
            raise ConfigurationError(
                f"replay={shown(replay)} without kv_events: pass the engine's publisher endpoint too"
            )
        if data_parallel_size is not None:
            data_parallel_size = check_data_parallel_size(data_parallel_size)
            if kv_events is None:
                raise ConfigurationError(
                    f"data_parallel_size={data_parallel_size} without kv_events: pass the server's publisher endpoint"
                )
        if kv_events is not None and not isinstance(self._router.index, EventIndex):
            raise ConfigurationError(
                "kv_events needs a router that reads the events: build it with "
                "Router(index=prefixroute.vllm.EventIndex(block_size)), not a prediction index"
            )
        streams = [] if kv_events is None else _rank_streams(kv_events, replay, data_parallel_size)
        if metrics_url is not None:
            check_metrics_url(metrics_url, "metrics_url")
        gate = _Gate(self._router)
        member = _Member(backend, gate)
        writer: IndexWriter = gate
        if len(streams) > 1:
            writer = member.merge = RankMerge(gate)
        context = self._zmq_context() if streams else None
        member.subscribers = [
            KVEventSubscriber(
                writer,
                backend,
                endpoint,
                replay_endpoint=replay_endpoint,
                topic=topic,
                namespace=namespace if namespace is not None else self._router.hasher.namespace,
                context=context,
            )
            for endpoint, replay_endpoint in streams
        ]
        if metrics_url is not None:
            member.poller = _Poller(self, backend, _metrics_endpoint(metrics_url), gate, member.subscribers)
        refusal = None
        with self._lock:
            if self._closed:
                refusal = ConfigurationError("this Fleet is closed: make a new one")
            elif backend in self._members:
                refusal = ConfigurationError(f"backend {backend!r} is already in the fleet: remove_backend() it first")
            elif backend in self._removing:
                refusal = ConfigurationError(
                    f"backend {backend!r} is being removed from the fleet: add it again once remove_backend() returns"
                )
            elif (claimed := self._claimed(streams, topic)) is not None:
                refusal = ConfigurationError(
                    f"endpoint {claimed[0]!r} is already backend {claimed[1]!r}'s: each engine publishes its events "
                    "(and replays them) on addresses of its own, or under a topic of its own"
                )
            else:
                self._members[backend] = member
        if refusal is not None:
            member.stop()  # nothing was started; this closes the poller's HTTP client
            raise refusal
        try:
            for subscriber in member.subscribers:
                subscriber.start()
            if member.poller is not None:
                member.poller.start()
        except BaseException as exc:
            # Undone: a backend left in the fleet with some of its threads running and the others never started
            # would follow some ranks for good, and its id could not be added again once the cause is fixed.
            with self._lock:
                taken = self._members.get(backend) is not member
                if not taken:
                    del self._members[backend]
                closed = self._closed
            member.stop()
            if taken and closed and isinstance(exc, StateError):
                return  # close() took the backend and ended the fleet's ZMQ context before its threads started
            self._router.clear_backend(backend)  # what a rank that did start wrote (its requests in flight stay)
            raise
        with self._lock:
            gone = self._members.get(backend) is not member
        if gone:  # remove_backend() or close() took it before its threads started: they found nothing to stop
            member.stop()

    def _zmq_context(self) -> zmq.Context[zmq.Socket[bytes]]:
        """The fleet's ZMQ context, made the first time a backend needs one.

        Raises:
            ConfigurationError: the fleet is closed, or the process is out of file descriptors.
        """
        with self._lock:
            if self._closed:  # close() terminated it, or will: a new one would never be
                raise ConfigurationError("this Fleet is closed: make a new one")
            if self._context is None:
                try:
                    self._context = zmq.Context()
                except zmq.ZMQError as exc:  # EMFILE
                    raise ConfigurationError(
                        f"the fleet's ZMQ context could not be made ({exc}): raise the open-files limit (ulimit -n) "
                        "or follow fewer endpoints in this process"
                    ) from exc
            return self._context

    def _claimed(self, streams: list[tuple[str, str | None]], topic: str) -> tuple[str, str] | None:
        """An endpoint of ``streams`` that a backend of the fleet already follows, and that backend; the caller
        holds the lock. One publisher may carry several engines' events under topics of their own (a ZMQ proxy in
        front of them): an endpoint followed in the same role under a topic that neither prefixes the other (ZMQ
        matches a subscription as a prefix) is no clash."""
        mine = [(role, endpoint) for stream in streams for role, endpoint in enumerate(stream) if endpoint is not None]
        for other, member in self._members.items():
            for subscriber in member.subscribers:
                disjoint = not (topic.startswith(subscriber.topic) or subscriber.topic.startswith(topic))
                for role, endpoint in enumerate((subscriber.endpoint, subscriber.replay_endpoint)):
                    if endpoint is not None and any(endpoint == e and (r != role or not disjoint) for r, e in mine):
                        return endpoint, other
        return None

    def remove_backend(self, backend: str) -> None:
        """Stop everything ``backend`` had (its subscriber and its poller), then :meth:`Router.remove_backend` it.

        Once this returns, nothing of the backend's is written to the router again (its threads write through a
        gate that is closed first). A backend the fleet does not have is still removed from the router.
        A capacity that the fleet set from the engine's ``num_gpu_blocks`` is forgotten too (one given to the router
        stays, a setting). Waits for the backend's threads to end: its poller at most about ``timeout`` seconds (a
        scrape in flight); its subscribers, all told to stop at once, end within a poll (50 ms), however many ranks,
        and are waited for at most 5 s in all (a writer that blocks: then a warning). Until it returns,
        :meth:`add_backend` of the same id is refused (the router's removal would wipe what its events wrote).

        Raises:
            TypeError: ``backend`` is not a str (nothing is removed).
            ConfigurationError: ``backend`` is an empty str.
        """
        backend = check_backend(backend)  # before the lookup: an unhashable id would be a bare TypeError there
        with self._lock:
            member = self._members.pop(backend, None)
            self._removing[backend] = self._removing.get(backend, 0) + 1
            if member is not None:
                self._leaving.append(member)
        try:
            if member is not None:
                member.stop()  # its sockets closed; the fleet's context stays, the other backends' are in it
            self._router.remove_backend(backend)
            if member is not None and member.poller is not None and member.poller.set_capacity:
                # The capacity it learned from the engine goes too: with pods that come and go it would pile up
                # in the index, and a later engine under the same id would inherit it.
                self._router.set_capacity(backend, None)
        finally:
            with self._lock:
                self._leaving = [m for m in self._leaving if any(s.running for s in m.subscribers)]
                if self._removing[backend] == 1:
                    del self._removing[backend]
                else:
                    self._removing[backend] -= 1

    def close(self) -> None:
        """Stop every thread; each backend's engine figures are dropped from the router (they would only go
        stale), its blocks stay (the router keeps routing on what it knows). Idempotent.

        The subscribers' ZMQ context is terminated once they have stopped (each closed its sockets, with linger 0,
        as it ended). A subscriber thread that has not ended within the 5 s its backend's stop waits for (busy with
        a huge batch, say) does not hold close() up: a warning says so, and the context is terminated in a thread of
        its own, once that subscriber has closed its sockets."""
        with self._lock:
            self._closed = True
            members = list(self._members.values())
            self._members.clear()
            context, self._context = self._context, None
        for member in members:
            member.gate.close()
            member.signal_stop()
        for member in members:
            member.stop()
        if context is not None:
            self._terminate(context, members)
        # Only once every thread has ended: a router that raises here must not leave a backend running unreachable.
        for member in members:
            if member.poller is not None:
                self._router.set_engine_load(member.backend, queue_len=None, kv_usage=None)

    def _terminate(self, context: zmq.Context[zmq.Socket[bytes]], stopped: list[_Member]) -> None:
        """Terminate the subscribers' context once none of them can hold a socket in it: at once when every thread
        has ended (their sockets closed with linger 0, so it returns at once), else in a thread of its own."""
        with self._lock:
            subscribers = [s for m in (*stopped, *self._leaving) for s in m.subscribers]
        running = [s.backend for s in subscribers if s.running]
        if not running:
            context.term()
            return
        _log.warning(
            "Fleet.close(): KV-event threads of %s have not ended; their ZMQ context is terminated once they do",
            sorted(set(running)),
        )
        try:
            threading.Thread(target=context.term, name="prefixroute-zmq-term", daemon=True).start()
        except RuntimeError:  # "can't start new thread": the context is left to the process's end
            _log.exception("Fleet.close(): could not start a thread to terminate the ZMQ context")

    def __enter__(self) -> Fleet:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def backends(self) -> list[str]:
        """The backends in the fleet, in the order they were added. O(B)."""
        with self._lock:
            return list(self._members)

    def healthy_backends(self, backends: Iterable[str] | None = None) -> list[str]:
        """The healthy ones of ``backends`` (default: every backend of the fleet), in their order. O(B).

        Backends the fleet does not have pass through (it knows nothing against them); see the class docstring
        for when a backend is healthy.

        Raises:
            TypeError: ``backends`` is a str or bytes (not a collection of ids), or holds something not a str.
        """
        if isinstance(backends, (str, bytes, bytearray)):
            raise InvalidTypeError(
                f"backends must be an iterable of str ids, not a {type(backends).__name__}: wrap one id in a list"
            )
        with self._lock:
            members = dict(self._members)
        try:
            names = list(members) if backends is None else list(backends)
        except TypeError:
            raise InvalidTypeError(f"backends must be an iterable of str ids, not {type(backends).__name__}") from None
        for name in names:
            if not isinstance(name, str):
                raise InvalidTypeError(f"backends must hold str ids, not {type(name).__name__}")
        now = self._clock()
        return [b for b in names if b not in members or members[b].healthy(now)]

    def subscriber(self, backend: str) -> KVEventSubscriber | None:
        """``backend``'s KV-event subscriber (for :meth:`RouterMetrics.watch_subscriber`), None without one; of a
        data-parallel backend, rank 0's (:meth:`subscribers` gives them all)."""
        subscribers = self.subscribers(backend)
        return subscribers[0] if subscribers else None

    def subscribers(self, backend: str) -> list[KVEventSubscriber]:
        """``backend``'s KV-event subscribers, one per endpoint in the order given (one per data-parallel rank);
        empty without ``kv_events`` or for a backend the fleet does not have.

        Raises:
            TypeError: ``backend`` is not a str.
            ConfigurationError: ``backend`` is an empty str.
        """
        backend = check_backend(backend)
        with self._lock:
            member = self._members.get(backend)
        return [] if member is None else list(member.subscribers)

    def stats(self) -> FleetStats:
        """A snapshot of every backend's health, figures and counters. O(B)."""
        with self._lock:
            members = list(self._members.values())
        now = self._clock()
        return FleetStats(tuple(member.stats(now) for member in members), self._callback_errors)

    def __iter__(self) -> Iterator[str]:
        return iter(self.backends())

    def __repr__(self) -> str:
        return f"Fleet(backends={self.backends()!r}, interval={self._interval:g}, timeout={self._timeout:g})"

    def _health_changed(self, backend: str, healthy: bool) -> None:
        if self._on_health is None:
            return
        try:
            self._on_health(backend, healthy)
        except Exception:  # noqa: BLE001 - a user's callback must not stop the poller
            with self._lock:
                self._callback_errors += 1
            _log.exception("on_health(%r, %r) raised", backend, healthy)


class _Gate:
    """One backend's write path into the router: open until its backend is removed, then a no-op for good.

    Writes happen under the gate's lock, so :meth:`close` waits for a write in progress and none starts after.
    """

    def __init__(self, router: Router) -> None:
        self._router = router
        self._lock = threading.Lock()
        self._open = True
        self.block_size = router.block_size

    def write(self, backend: str, updates: Iterable[IndexUpdate]) -> None:
        with self._lock:
            if self._open:
                self._router.write(backend, updates)

    def run(self, action: Callable[[Router], None]) -> None:
        with self._lock:
            if self._open:
                action(self._router)

    def close(self) -> None:
        with self._lock:
            self._open = False


class _Member:
    """What the fleet runs for one backend."""

    def __init__(self, backend: str, gate: _Gate) -> None:
        self.backend = backend
        self.gate = gate
        self.subscribers: list[KVEventSubscriber] = []  # one per data-parallel rank
        self.merge: RankMerge | None = None  # between the subscribers and the gate, with several ranks
        self.poller: _Poller | None = None

    def healthy(self, now: float) -> bool:
        return self.poller is None or self.poller.healthy(now)

    def signal_stop(self) -> None:
        """Tell every thread to stop, waiting for none: each notices within its poll (50 ms), all at once."""
        for subscriber in self.subscribers:
            subscriber._signal_stop()
        if self.poller is not None:
            self.poller.signal_stop()

    def stop(self) -> None:
        """Stop every thread: all told first, then waited for (one by one, a backend of 64 ranks took 64 polls)."""
        self.gate.close()
        self.signal_stop()
        deadline = time.monotonic() + _SUBSCRIBER_STOP_S  # one wait for them all, not one each
        for subscriber in self.subscribers:
            subscriber.stop(timeout=max(0.0, deadline - time.monotonic()))
        if self.poller is not None:
            self.poller.stop()

    def stats(self, now: float) -> BackendStats:
        ranks = tuple(subscriber.stats() for subscriber in self.subscribers)
        events = _summed(ranks, self.merge.blocks(self.backend)) if self.merge is not None else None
        if events is None and ranks:
            events = ranks[0]
        if self.poller is None:
            return BackendStats(self.backend, True, None, 0, 0, None, None, None, None, None, events, ranks)
        return self.poller.stats(now, events, ranks)


class _Poller:
    """One backend's ``/metrics`` poller thread."""

    def __init__(
        self, fleet: Fleet, backend: str, url: str, gate: _Gate, subscribers: Sequence[KVEventSubscriber]
    ) -> None:
        self._fleet = fleet
        self._subscribers = tuple(subscribers)  # the backend's own, reset when its engine restarts
        self._backend = backend
        self._url = url
        self._gate = gate
        # No connection kept alive between scrapes: fetch_metrics can shut down only a socket it saw opened, so an
        # engine trickling its headers on a kept connection would hold an abandoned scrape's thread for good. The
        # client (its TLS context, the costly part) is still made once; a TCP connect a scrape is cheap.
        self._client = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"prefixroute-metrics[{backend}]", daemon=True)
        self._lock = threading.Lock()  # guards the figures below (read by healthy() and stats())
        self._added_at = fleet._clock()
        self._ok_at: float | None = None
        self._error: str | None = None
        self._metrics: EngineMetrics | None = None
        self._scrapes = 0
        self._failures = 0
        self._reported: bool | None = None  # the health last passed to on_health
        self._configured: tuple[int | None, int | None] = (None, None)  # the cache config last acted on
        self.set_capacity = False  # whether it set the backend's capacity (from num_gpu_blocks), for its removal
        self._restarts = 0
        self._previous: EngineMetrics | None = None  # the scrape before, to tell a restart by

    def start(self) -> None:
        try:
            self._thread.start()
        except RuntimeError as exc:  # "can't start new thread"
            raise ConfigurationError(
                f"the /metrics poller of {self._backend} could not start ({exc}): the process is out of threads"
            ) from exc

    def signal_stop(self) -> None:
        self._stop.set()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(self._fleet._timeout + 1.0)
        self._client.close()

    def healthy(self, now: float) -> bool:
        with self._lock:
            if self._error is not None:
                return False
            since = self._added_at if self._ok_at is None else self._ok_at
        return now - since <= self._fleet._stale_after

    def stats(self, now: float, events: SubscriberStats | None, ranks: tuple[SubscriberStats, ...]) -> BackendStats:
        healthy = self.healthy(now)
        with self._lock:
            metrics = self._metrics if self._error is None else None
            return BackendStats(
                self._backend,
                healthy,
                self._url,
                self._scrapes,
                self._failures,
                self._error,
                _queue_len(metrics) if healthy else None,
                metrics.kv_usage if metrics is not None and healthy else None,
                None if self._metrics is None else self._metrics.block_size,
                None if self._metrics is None else self._metrics.num_gpu_blocks,
                events,
                ranks,
                self._restarts,
            )

    def _run(self) -> None:
        fleet = self._fleet
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                self.scrape_once()
            except Exception as exc:  # noqa: BLE001 - the thread must outlive any one bad moment
                # A bug, not a bad engine, but it costs only this backend: counted and marked like a failed scrape.
                _log.exception("metrics of %s: unexpected error; polling goes on", self._backend)
                try:
                    self._failed(f"unexpected {type(exc).__name__}: {exc}", logged=True)
                    self._report_health()
                except Exception:  # noqa: BLE001
                    _log.exception("metrics of %s: could not mark the backend unhealthy", self._backend)
            self._stop.wait(max(0.0, fleet._interval - (time.monotonic() - began)))

    def scrape_once(self) -> None:
        """Read ``/metrics`` once (within the fleet's timeout) and hand the figures to the router."""
        try:
            metrics = fetch_metrics(self._url, timeout=self._fleet._timeout, client=self._client)
        except MetricsError as exc:
            self._failed(str(exc))
        else:
            previous, self._previous = self._previous, metrics
            if previous is not None and metrics.restarted_since(previous):
                self._engine_restarted()
            # Figures the router refuses raise here, before the scrape counts as a success (see _run).
            self._gate.run(lambda router: self._apply(router, metrics))
            with self._lock:
                self._error = None
                self._metrics = metrics
                self._ok_at = self._fleet._clock()
                self._scrapes += 1
        self._report_health()

    def _engine_restarted(self) -> None:
        """The engine's prefix cache died with its process: its blocks leave the router's index. With KV events each
        subscriber is reset (outside the gate: it writes through it), so a restart its sequence numbers hid (the new
        engine published past the old one's last number) is caught too, and the new engine's batches are replayed."""
        _log.warning("metrics of %s: the engine restarted; its prefix cache is empty", self._backend)
        with self._lock:
            self._restarts += 1
        for subscriber in self._subscribers:
            subscriber.reset()
        if not self._subscribers:
            self._gate.run(lambda router: router.clear_backend(self._backend))

    def _failed(self, error: str, *, logged: bool = False) -> None:
        """Count a failed scrape, keep why, and drop the backend's figures from the router."""
        if self._stop.is_set():
            return
        # The router forgets the figures before the backend reads as unhealthy: whoever sees it unhealthy never
        # sees its old queue length still counted. A router that cannot forget them still sees the failure counted.
        try:
            self._gate.run(lambda router: router.set_engine_load(self._backend, queue_len=None, kv_usage=None))
        except Exception:  # noqa: BLE001 - a bug in the router's write path must not hide the failed scrape
            _log.exception("metrics of %s: the router could not drop the engine figures", self._backend)
        with self._lock:
            first_failure = self._error is None
            self._error = error
            self._failures += 1
        if not logged:
            (_log.warning if first_failure else _log.debug)("metrics of %s: %s", self._backend, error)

    def _report_health(self) -> None:
        healthy = self.healthy(self._fleet._clock())
        if healthy != self._reported and not self._stop.is_set():
            self._reported = healthy
            self._fleet._health_changed(self._backend, healthy)

    def _apply(self, router: Router, metrics: EngineMetrics) -> None:
        """Called through the gate: the backend is still in the fleet."""
        router.set_engine_load(self._backend, queue_len=_queue_len(metrics), kv_usage=metrics.kv_usage)
        config = (metrics.block_size, metrics.num_gpu_blocks)
        if config == self._configured:  # act (and warn) once per change, not every scrape
            return
        engine_block_size, num_gpu_blocks = config
        if engine_block_size is not None and num_gpu_blocks is not None:
            block_size = router.block_size
            if engine_block_size % block_size:
                _log.warning(
                    "%s: vLLM block_size is %d but the router uses %d: prefix matches will be wrong; set "
                    "Router(block_size=%d) or vLLM's --block-size",
                    self._backend, engine_block_size, block_size, engine_block_size,
                )  # fmt: skip
            elif not isinstance(router.index, EventIndex):  # with events, the events carry the evictions
                router.set_capacity(self._backend, num_gpu_blocks * (engine_block_size // block_size))
                self.set_capacity = True
        # Only once acted on: a set_capacity() that raised (counted as a failed scrape by _run) is tried again at
        # the next scrape, not skipped for good as a config already applied.
        self._configured = config


def _queue_len(metrics: EngineMetrics | None) -> int | None:
    """The waiting requests as an int; None when unknown, not a finite number or past what
    :meth:`Router.set_engine_load` takes (2**63; never raises on figures)."""
    waiting = None if metrics is None else metrics.waiting
    if waiting is None or not math.isfinite(waiting) or not 0 <= waiting < 2**63:
        return None
    return int(waiting)


def _rank_streams(
    kv_events: str | Sequence[str], replay: str | Sequence[str] | None, data_parallel_size: int | None
) -> list[tuple[str, str | None]]:
    """``(endpoint, replay endpoint)`` per data-parallel rank, checked; see :meth:`Fleet.add_backend`."""
    if isinstance(kv_events, str):
        if replay is not None and not isinstance(replay, str):
            raise ConfigurationError(
                f"replay must be one endpoint like 'tcp://gpu0:5558' with one kv_events endpoint, not {shown(replay)}"
            )
        # Checked here, so that the error names the option given, not rank_endpoint()'s or the subscriber's.
        check_endpoint(kv_events, "kv_events", "tcp://gpu0:5557")
        if replay is not None:
            check_endpoint(replay, "replay", "tcp://gpu0:5558")
        if data_parallel_size is None:
            return [(kv_events, replay)]
        streams = [
            (rank_endpoint(kv_events, rank), None if replay is None else rank_endpoint(replay, rank))
            for rank in range(data_parallel_size)
        ]
        _check_roles_apart(streams, data_parallel_size)
        return streams
    if not isinstance(kv_events, (list, tuple)):
        raise ConfigurationError(
            f"kv_events must be a ZMQ address like 'tcp://gpu0:5557', or a list of them (one per data-parallel rank), "
            f"not {shown(kv_events)}"
        )
    if not kv_events:
        raise ConfigurationError("kv_events is an empty list: give at least one endpoint (one per data-parallel rank)")
    if len(kv_events) > MAX_DATA_PARALLEL_SIZE:  # a subscriber thread each
        raise ConfigurationError(
            f"kv_events lists {len(kv_events)} endpoints, one per data-parallel rank: at most "
            f"{MAX_DATA_PARALLEL_SIZE} ranks"
        )
    if data_parallel_size is not None and data_parallel_size != len(kv_events):
        raise ConfigurationError(
            f"data_parallel_size={data_parallel_size} but kv_events lists {len(kv_events)} endpoints: give one "
            "endpoint per rank, or one endpoint with data_parallel_size"
        )
    endpoints = [check_endpoint(e, f"kv_events[{i}]", "tcp://gpu0:5557") for i, e in enumerate(kv_events)]
    if replay is None:
        replays: list[str | None] = [None] * len(endpoints)
    elif not isinstance(replay, (list, tuple)) or len(replay) != len(endpoints):
        raise ConfigurationError(
            f"replay must be None or a list of {len(endpoints)} endpoints, one per kv_events endpoint (rank), "
            f"not {shown(replay)}"
        )
    else:
        replays = [check_endpoint(r, f"replay[{i}]", "tcp://gpu0:5558") for i, r in enumerate(replay)]
    for given, name in ((endpoints, "kv_events"), ([r for r in replays if r is not None], "replay")):
        if len(set(given)) != len(given):
            raise ConfigurationError(
                f"{name} lists an endpoint twice ({given!r}): each data-parallel rank publishes on its own"
            )
    streams = list(zip(endpoints, replays, strict=True))
    _check_roles_apart(streams, None)
    return streams


def _check_roles_apart(streams: list[tuple[str, str | None]], derived: int | None) -> None:
    """Refuse an endpoint that is one rank's publisher and another rank's replay endpoint: no engine can bind both
    (vLLM's data-parallel ranks would fail to start), and a subscriber there would take a replay socket for a
    publisher. ``derived``: the data_parallel_size the ranks' endpoints were derived with, None when listed."""
    replays = {replay: rank for rank, (_, replay) in enumerate(streams) if replay is not None}
    for rank, (endpoint, _) in enumerate(streams):
        if endpoint not in replays:
            continue
        if derived is None:
            raise ConfigurationError(
                f"kv_events[{rank}] {endpoint!r} is also replay[{replays[endpoint]}]: each rank publishes and "
                "replays on addresses of its own"
            )
        raise ConfigurationError(
            f"with data_parallel_size={derived}, rank {rank} publishes on {endpoint!r}, rank {replays[endpoint]}'s "
            f"replay endpoint: keep the replay port at least {derived} from the publisher's (say 5557 and 6557)"
        )


def _summed(ranks: tuple[SubscriberStats, ...], blocks_held: int) -> SubscriberStats:
    """The counters of a data-parallel backend's subscribers as one stream's: see :attr:`BackendStats.events`."""
    lags = [r.last_lag_s for r in ranks if r.last_lag_s is not None]
    tracker = TrackerStats(**{f.name: sum(getattr(r.tracker, f.name) for r in ranks) for f in fields(TrackerStats)})
    counters = {
        f.name: sum(getattr(r, f.name) for r in ranks)
        for f in fields(SubscriberStats)
        if f.name not in ("backend", "last_seq", "last_lag_s", "blocks_held", "tracker")
    }
    return SubscriberStats(
        backend=ranks[0].backend,
        last_seq=min(r.last_seq for r in ranks),
        last_lag_s=max(lags) if lags else None,
        blocks_held=blocks_held,
        tracker=tracker,
        **counters,
    )
