"""Prometheus metrics of prefixroute itself: decisions, matched tokens, fallbacks, index size, event lag, latency.

Everything goes into the :class:`~prometheus_client.CollectorRegistry` you pass (never the global one), so two
routers in one process, or a test, keep their figures apart. Serve it with ``prometheus_client.make_asgi_app(
registry=...)`` or ``generate_latest(registry)``.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from prefixroute._numbers import as_float, as_int, shown
from prefixroute.errors import ConfigurationError, InvalidTypeError
from prefixroute.index import PrefixIndex
from prefixroute.router import Decision
from prefixroute.vllm.fleet import Fleet
from prefixroute.vllm.subscriber import KVEventSubscriber

__all__ = ["ROUTE_LATENCY_BUCKETS", "RouterMetrics"]

ROUTE_LATENCY_BUCKETS = (5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2, 0.1)
"""``route()`` latency buckets in seconds: route() is a few microseconds to a fraction of a millisecond."""

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


class RouterMetrics:
    """Export a router's behaviour as Prometheus metrics in ``registry``.

    Call :meth:`observe` once per routed request (with the seconds ``route()`` took), :meth:`observe_served`
    when the engine reports how many prompt tokens it actually served from cache (vLLM's
    ``usage.prompt_tokens_details.cached_tokens``), and :meth:`watch_index` / :meth:`watch_fleet` once: their
    figures are read at scrape time. Metric names start with ``prefix`` (default ``prefixroute``):

    ``_decisions_total{backend,reason}``, ``_matched_tokens_total{source}`` where ``source`` is ``"predicted"``
    (the decision's ``matched_tokens``), ``"confirmed"`` (its ``confirmed_tokens``: what the KV events confirmed
    when it was made) or ``"served"`` (what the engine reported serving from cache); each token is counted once
    per source, so ``served / predicted`` is the share of predictions that held.
    ``_prompt_tokens_total``, ``_load_fallbacks_total{backend}``, ``_route_seconds`` (histogram),
    ``_index_blocks{backend}``, ``_event_lag_seconds{backend}``, ``_event_batches_total{backend}``,
    ``_event_gaps_total{backend}``, ``_event_unrecovered_gaps_total{backend}``,
    ``_event_failed_replays_total{backend}``, ``_event_handshake_failures_total{backend}``,
    ``_engine_restarts_total{backend}`` (seen in the KV events' sequence numbers or in a fleet backend's
    ``/metrics``: the larger of the two counts where there are both).

    >>> from prometheus_client import CollectorRegistry
    >>> from prefixroute import Router
    >>> registry = CollectorRegistry()
    >>> metrics = RouterMetrics(registry)
    >>> metrics.observe(Router().route(list(range(32)), ["gpu0"]), 0.00002)
    >>> registry.get_sample_value("prefixroute_decisions_total", {"backend": "gpu0", "reason": "miss"})
    1.0

    Raises:
        TypeError: ``registry`` is not a ``CollectorRegistry``, or ``prefix`` not a str.
        ConfigurationError: ``prefix`` is not a Prometheus metric name (``[a-zA-Z_:][a-zA-Z0-9_:]*``).
    """

    def __init__(self, registry: CollectorRegistry, *, prefix: str = "prefixroute") -> None:
        if not isinstance(registry, CollectorRegistry):
            raise InvalidTypeError(
                f"registry must be a prometheus_client CollectorRegistry, not {type(registry).__name__}"
            )
        if not isinstance(prefix, str):
            raise InvalidTypeError(f"prefix must be a str, not {type(prefix).__name__}")
        if not _METRIC_NAME.fullmatch(prefix):
            raise ConfigurationError(
                f"prefix must be a Prometheus metric name ([a-zA-Z_:][a-zA-Z0-9_:]*), like 'prefixroute', not "
                f"{shown(prefix)}"
            )
        self._prefix = prefix
        self._decisions = Counter(
            f"{prefix}_decisions", "Routing decisions by chosen backend and reason.", ["backend", "reason"],
            registry=registry,
        )  # fmt: skip
        self._matched = Counter(
            f"{prefix}_matched_tokens",
            "Prompt tokens matched in a backend's prefix cache: predicted by the router, or confirmed by the engine.",
            ["source"],
            registry=registry,
        )
        self._prompt = Counter(f"{prefix}_prompt_tokens", "Prompt tokens routed.", registry=registry)
        self._fallbacks = Counter(
            f"{prefix}_load_fallbacks", "Decisions that left the best-cached backend for load.", ["backend"],
            registry=registry,
        )  # fmt: skip
        self._latency = Histogram(
            f"{prefix}_route_seconds", "Time spent in Router.route().", buckets=ROUTE_LATENCY_BUCKETS,
            registry=registry,
        )  # fmt: skip
        self._watch_lock = threading.Lock()
        self._indexes: list[tuple[PrefixIndex, Any]] = []
        self._subscribers: list[KVEventSubscriber] = []
        self._fleets: list[Fleet] = []
        registry.register(_StateCollector(self))

    def observe(self, decision: Decision, seconds: float) -> None:
        """Count one decision and the seconds its ``route()`` call took. O(1).

        Raises:
            TypeError: ``decision`` is not a :class:`~prefixroute.Decision`.
            ConfigurationError: ``seconds`` is not a finite number >= 0 (nothing counted).
        """
        if not isinstance(decision, Decision):
            raise InvalidTypeError(f"decision must be a prefixroute.Decision, not {type(decision).__name__}")
        elapsed = as_float(seconds)
        if elapsed is None or elapsed < 0:
            raise ConfigurationError(f"seconds must be a finite number >= 0, not {shown(seconds)}")
        self._decisions.labels(decision.backend, decision.reason).inc()
        self._matched.labels("predicted").inc(decision.matched_tokens)
        self._prompt.inc(decision.prompt_tokens)
        if decision.reason == "load-fallback":
            self._fallbacks.labels(decision.backend).inc()
        if decision.confirmed_tokens is not None:
            self._matched.labels("confirmed").inc(decision.confirmed_tokens)
        self._latency.observe(elapsed)

    def observe_served(self, cached_tokens: int) -> None:
        """Count prompt tokens the engine reported as served from its prefix cache for one request. O(1).

        Raises:
            TypeError: ``cached_tokens`` is not an int.
            ConfigurationError: ``cached_tokens`` is negative or too large for a float (a ValueError).
        """
        count = as_int(cached_tokens)
        if count is None:
            raise InvalidTypeError(f"cached_tokens must be an int >= 0, not {type(cached_tokens).__name__}")
        if not 0 <= count < 2**63:
            raise ConfigurationError(f"cached_tokens must be an int >= 0 and below 2**63, not {shown(cached_tokens)}")
        self._matched.labels("served").inc(count)

    def watch_index(self, index: PrefixIndex, *, lock: threading.Lock | None = None) -> None:
        """Export ``index``'s blocks per backend at each scrape (read under ``lock`` when given).

        A router's index (``router.index``) needs no lock: the per-backend counts are read as a snapshot.

        Raises:
            TypeError: ``index`` is not a :class:`~prefixroute.PrefixIndex`, or ``lock`` not a lock or None.
        """
        if not isinstance(index, PrefixIndex):
            raise InvalidTypeError(f"index must be a prefixroute.PrefixIndex, not {type(index).__name__}")
        if lock is not None and not (
            callable(getattr(lock, "__enter__", None)) and callable(getattr(lock, "__exit__", None))
        ):
            raise InvalidTypeError(f"lock must be a lock (a context manager) or None, not {type(lock).__name__}")
        with self._watch_lock:
            self._indexes.append((index, lock))

    def watch_subscriber(self, subscriber: KVEventSubscriber) -> None:
        """Export a KV-event subscriber's lag, batches, gaps and restarts at each scrape.

        Raises:
            TypeError: ``subscriber`` is not a :class:`~prefixroute.vllm.KVEventSubscriber`.
        """
        if not isinstance(subscriber, KVEventSubscriber):
            raise InvalidTypeError(f"subscriber must be a KVEventSubscriber, not {type(subscriber).__name__}")
        with self._watch_lock:
            self._subscribers.append(subscriber)

    def watch_fleet(self, fleet: Fleet) -> None:
        """Export the KV-event figures of every backend ``fleet`` has at each scrape (backends come and go).

        Raises:
            TypeError: ``fleet`` is not a :class:`~prefixroute.vllm.Fleet`.
        """
        if not isinstance(fleet, Fleet):
            raise InvalidTypeError(f"fleet must be a prefixroute.vllm.Fleet, not {type(fleet).__name__}")
        with self._watch_lock:
            self._fleets.append(fleet)

    def _collect_state(self) -> Iterator[Metric]:
        p = self._prefix
        blocks = GaugeMetricFamily(f"{p}_index_blocks", "Block hashes the index holds per backend.", labels=["backend"])
        lag = GaugeMetricFamily(
            f"{p}_event_lag_seconds", "Publish-to-index delay of the last KV event batch.", labels=["backend"]
        )
        batches = CounterMetricFamily(f"{p}_event_batches", "KV event batches applied.", labels=["backend"])
        gaps = CounterMetricFamily(f"{p}_event_gaps", "Sequence gaps in KV event streams.", labels=["backend"])
        lost = CounterMetricFamily(
            f"{p}_event_unrecovered_gaps", "Gaps the engine's replay buffer could not fill.", labels=["backend"]
        )
        failed = CounterMetricFamily(
            f"{p}_event_failed_replays", "Replays cut at replay_timeout or the batch cap.", labels=["backend"]
        )
        handshakes = CounterMetricFamily(
            f"{p}_event_handshake_failures",
            "Connections to a KV-events endpoint that did not answer as a ZMQ publisher.",
            labels=["backend"],
        )
        restarts = CounterMetricFamily(f"{p}_engine_restarts", "Engine restarts seen.", labels=["backend"])
        with self._watch_lock:
            indexes, subscribers, fleets = list(self._indexes), list(self._subscribers), list(self._fleets)
        for index, lock in indexes:
            with lock if lock is not None else contextlib.nullcontext():
                counts = [(backend, index.blocks(backend)) for backend in index.backends()]
            for backend, count in counts:
                blocks.add_metric([backend], count)
        streams = [subscriber.stats() for subscriber in subscribers]
        polled = [b for fleet in fleets for b in fleet.stats().backends]
        streams += [b.events for b in polled if b.events is not None]
        # The restarts a fleet's /metrics showed: the only count without events; beside them, the larger of the two
        # (a restart the sequence numbers hid, which the poller caught first, is in the fleet's count alone).
        shown = {seen.backend: seen.engine_restarts for seen in polled if seen.metrics_url is not None}
        for seen in polled:
            if seen.events is None and seen.metrics_url is not None:
                restarts.add_metric([seen.backend], seen.engine_restarts)
        for stats in streams:
            label = [stats.backend]
            if stats.last_lag_s is not None:
                lag.add_metric(label, stats.last_lag_s)
            batches.add_metric(label, stats.batches)
            gaps.add_metric(label, stats.gaps)
            lost.add_metric(label, stats.unrecovered_gaps)
            failed.add_metric(label, stats.failed_replays)
            handshakes.add_metric(label, stats.handshake_failures)
            restarts.add_metric(label, max(stats.restarts, shown.get(stats.backend, 0)))
        yield from (blocks, lag, batches, gaps, lost, failed, handshakes, restarts)


class _StateCollector(Collector):
    """Reads the watched index and subscribers when the registry is scraped."""

    def __init__(self, owner: RouterMetrics) -> None:
        self._owner = owner

    def collect(self) -> Iterator[Metric]:
        return self._owner._collect_state()
