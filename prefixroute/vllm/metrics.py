"""Read vLLM's Prometheus ``/metrics``: load figures for routing, cache configuration, TTFT histogram.

:func:`parse_metrics` turns one scrape into :class:`EngineMetrics`; :class:`MetricsPoller` scrapes every backend
in a background thread and gives the router ``load(backend) -> (queue_len, kv_usage)``, marking figures stale when
a backend stops answering.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType

import httpx
from prometheus_client.parser import text_string_to_metric_families
from sortedcontainers import SortedDict

from prefixroute.errors import ConfigurationError, MetricsError

__all__ = ["EngineMetrics", "MetricsPoller", "Scrape", "fetch_metrics", "parse_metrics"]

_log = logging.getLogger(__name__)

# Newer name first: vLLM renamed gpu_cache_usage_perc / gpu_prefix_cache_* (deprecated in v0.10, removed later).
_RUNNING = ("vllm:num_requests_running",)
_WAITING = ("vllm:num_requests_waiting",)
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
_CACHE_INFO = "vllm:cache_config_info"
_TTFT = "vllm:time_to_first_token_seconds"


@dataclass(frozen=True)
class EngineMetrics:
    """One scrape of a vLLM engine, summed over its label sets (models, engines, data-parallel ranks).

    A figure the text does not expose is None. ``kv_usage`` is the mean over engines (a fraction, 1 = full).
    ``ttft_buckets`` holds ``(upper bound in seconds, cumulative count)`` pairs, sorted, ending with ``+inf``.
    """

    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    prefix_queries: float | None = None
    prefix_hits: float | None = None
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    ttft_buckets: tuple[tuple[float, float], ...] = ()
    ttft_count: float = 0.0
    ttft_sum: float = 0.0

    @property
    def hit_rate(self) -> float | None:
        """Prefix cache hits / queries in tokens (KV residency, as vLLM measures it), or None without queries."""
        if not self.prefix_queries or self.prefix_hits is None:
            return None
        return self.prefix_hits / self.prefix_queries


def parse_metrics(text: str) -> EngineMetrics:
    """Parse Prometheus text exposition from a vLLM ``/metrics`` endpoint. O(size of text).

    Raises:
        MetricsError: the text is not Prometheus exposition format, or holds no ``vllm:`` metric at all.
    """
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    # Bucket bound → cumulative count, summed over every series (engines, data-parallel ranks), kept in bound order.
    buckets: SortedDict[float, float] = SortedDict()
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                name, value = sample.name, float(sample.value)
                if name == _TTFT + "_bucket":
                    bound = float(sample.labels.get("le", "nan"))
                    if not math.isnan(bound):
                        buckets[bound] = buckets.get(bound, 0.0) + value
                    continue
                if name in (_CACHE_INFO, _CACHE_INFO[: -len("_info")]):
                    block_size = _int_label(sample.labels, "block_size", block_size)
                    num_gpu_blocks = _int_label(sample.labels, "num_gpu_blocks", num_gpu_blocks)
                    continue
                sums[name] = sums.get(name, 0.0) + value
                counts[name] = counts.get(name, 0) + 1
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        raise MetricsError(f"not Prometheus text exposition format: {exc}") from exc
    if not buckets and block_size is None and not any(name.startswith("vllm:") for name in sums):
        raise MetricsError("no vLLM metrics found (expected vllm:num_requests_running and others): is this vLLM?")

    def first(names: Sequence[str], *, mean: bool = False) -> float | None:
        for name in names:
            for candidate in (name, name.removesuffix("_total")):
                if candidate in sums:
                    return sums[candidate] / counts[candidate] if mean else sums[candidate]
        return None

    return EngineMetrics(
        running=first(_RUNNING),
        waiting=first(_WAITING),
        kv_usage=first(_KV_USAGE, mean=True),
        prefix_queries=first(_QUERIES),
        prefix_hits=first(_HITS),
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
        ttft_buckets=tuple(buckets.items()),
        ttft_count=sums.get(_TTFT + "_count", 0.0),
        ttft_sum=sums.get(_TTFT + "_sum", 0.0),
    )


def _int_label(labels: Mapping[str, str], key: str, default: int | None) -> int | None:
    raw = labels.get(key)
    if raw is None or raw in ("", "None"):
        return default
    try:
        return int(float(raw))
    except ValueError:
        return default


def fetch_metrics(client: httpx.Client, url: str, *, timeout: float = 2.0) -> EngineMetrics:
    """GET ``url`` and parse it; every failure (network, HTTP status, format) raises :class:`MetricsError`."""
    try:
        response = client.get(url, timeout=timeout)
        response.raise_for_status()
    except httpx.HTTPError as exc:
        raise MetricsError(f"cannot read {url}: {exc}") from exc
    return parse_metrics(response.text)


def metrics_url(url: str) -> str:
    """Return ``url`` with ``/metrics`` appended unless it already names a path ending in ``metrics``."""
    stripped = url.rstrip("/")
    return stripped if stripped.endswith("/metrics") else stripped + "/metrics"


@dataclass(frozen=True)
class Scrape:
    """The latest scrape of one backend: figures (None if it never answered), when, and the last error."""

    metrics: EngineMetrics | None
    fetched_at: float | None
    error: str | None


class MetricsPoller:
    """Scrape each backend's vLLM ``/metrics`` every ``interval`` seconds in a background thread.

    ``backends`` maps a backend id (as given to ``route()``) to its base URL or metrics URL; a plain sequence of
    URLs uses each URL as the id. Figures older than ``stale_after`` seconds (by ``clock``), or from a backend
    whose last scrape failed, are stale: :meth:`load` then returns ``(None, None)`` so policies fall back to the
    router's own in-flight counts. ``on_health(backend, healthy)`` is called when a backend turns unreachable or
    comes back, and on its first scrape (a gateway can stop routing to it). ``on_load(backend, queue_len, kv_usage)``
    is called after every scrape with :meth:`load`'s figures, e.g. ``lambda b, q, k: router.set_engine_load(b,
    queue_len=q, kv_usage=k)``. Backends are scraped concurrently, up to
    ``max_workers`` at a time, so one slow engine does not delay the others' figures. Thread-safe.

    >>> poller = MetricsPoller({"gpu0": "http://gpu0:8000"})   # doctest: +SKIP
    >>> poller.poll_once(); poller.load("gpu0")                   # doctest: +SKIP
    (3, 0.41)
    """

    def __init__(
        self,
        backends: Mapping[str, str] | Sequence[str],
        *,
        interval: float = 1.0,
        timeout: float = 2.0,
        stale_after: float = 5.0,
        on_health: Callable[[str, bool], None] | None = None,
        on_load: Callable[[str, int | None, float | None], None] | None = None,
        max_workers: int = 16,
        client: httpx.Client | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(backends, str):
            raise TypeError("backends must be a mapping id -> URL or a sequence of URLs, not a str")
        pairs = backends.items() if isinstance(backends, Mapping) else ((url, url) for url in backends)
        self._urls = {backend: metrics_url(url) for backend, url in pairs}
        for name, value in (("interval", interval), ("timeout", timeout), ("stale_after", stale_after)):
            if not value > 0:
                raise ConfigurationError(f"{name} must be a positive number of seconds, not {value!r}")
        self._interval = interval
        self._timeout = timeout
        self._stale_after = stale_after
        self._on_health = on_health
        self._on_load = on_load
        if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
            raise ConfigurationError(f"max_workers must be a positive int, not {max_workers!r}")
        self._max_workers = max_workers
        self._client = client if client is not None else httpx.Client()
        self._owns_client = client is None
        self._clock = clock
        self._lock = threading.Lock()
        self._scrapes: dict[str, Scrape] = {b: Scrape(None, None, "not scraped yet") for b in self._urls}
        self._healthy: dict[str, bool] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def backends(self) -> list[str]:
        """The backend ids polled."""
        return list(self._urls)

    def poll_once(self) -> None:
        """Scrape every backend now, up to ``max_workers`` at a time, each bounded by ``timeout``; fire health
        callbacks. Returns when every scrape has finished."""
        backends = list(self._urls)
        if len(backends) == 1 or self._max_workers == 1:
            for backend in backends:
                self._poll(backend)
            return
        with ThreadPoolExecutor(min(self._max_workers, len(backends)), thread_name_prefix="prefixroute-scrape") as pool:
            list(pool.map(self._poll, backends))

    def _poll(self, backend: str) -> None:
        try:
            metrics = fetch_metrics(self._client, self._urls[backend], timeout=self._timeout)
        except MetricsError as exc:
            with self._lock:
                previous = self._scrapes[backend]
                self._scrapes[backend] = Scrape(previous.metrics, previous.fetched_at, str(exc))
        else:
            with self._lock:
                self._scrapes[backend] = Scrape(metrics, self._clock(), None)
        self._report_health(backend)
        if self._on_load is not None:
            self._on_load(backend, *self.load(backend))

    def scrape(self, backend: str) -> Scrape:
        """Return the latest scrape of ``backend`` (KeyError for an unknown backend)."""
        with self._lock:
            return self._scrapes[backend]

    def is_stale(self, backend: str) -> bool:
        """Whether ``backend``'s figures should not be trusted: never scraped, last scrape failed, or too old."""
        scrape = self.scrape(backend)
        return (
            scrape.metrics is None
            or scrape.error is not None
            or scrape.fetched_at is None
            or self._clock() - scrape.fetched_at > self._stale_after
        )

    def healthy(self, backend: str) -> bool:
        """Whether ``backend`` answered its last scrape within ``stale_after`` (the health hook's view)."""
        return not self.is_stale(backend)

    def healthy_backends(self, backends: Iterable[str]) -> list[str]:
        """Filter ``backends`` to the healthy ones; backends this poller does not know pass through."""
        return [b for b in backends if b not in self._urls or self.healthy(b)]

    def load(self, backend: str) -> tuple[int | None, float | None]:
        """Return ``(queue_len, kv_usage)`` for :class:`~prefixroute.Candidate`: requests waiting in the engine
        and the KV cache fraction in use; ``(None, None)`` when the figures are stale or unknown. O(1)."""
        if backend not in self._urls or self.is_stale(backend):
            return None, None
        metrics = self.scrape(backend).metrics
        assert metrics is not None
        waiting = None if metrics.waiting is None else int(metrics.waiting)
        return waiting, metrics.kv_usage

    def cache_config(self, backend: str) -> tuple[int | None, int | None]:
        """Return ``(block_size, num_gpu_blocks)`` from ``vllm:cache_config_info`` (None where unknown)."""
        metrics = self.scrape(backend).metrics
        if metrics is None:
            return None, None
        return metrics.block_size, metrics.num_gpu_blocks

    def check_cache_config(self, *, block_size: int, capacity_blocks: int | Mapping[str, int] | None) -> list[str]:
        """Compare the engines' cache configuration with the router's; log and return one warning per mismatch.

        Nothing is changed: a block size that disagrees makes every prefix match wrong, so it is for the operator
        to fix, not for prefixroute to guess. Use :meth:`capacities` to size the index from the engines.
        """
        warnings: list[str] = []
        for backend in self._urls:
            engine_block, engine_blocks = self.cache_config(backend)
            if engine_block is not None and engine_block != block_size:
                warnings.append(
                    f"{backend}: vLLM block_size is {engine_block} but the router uses {block_size}; "
                    f"set Router(block_size={engine_block}) (or vLLM's --block-size)"
                )
            capacity = capacity_blocks.get(backend) if isinstance(capacity_blocks, Mapping) else capacity_blocks
            if engine_blocks is not None and capacity is not None and capacity != engine_blocks:
                warnings.append(
                    f"{backend}: vLLM has {engine_blocks} GPU blocks but the router's capacity is {capacity} blocks"
                )
        for warning in warnings:
            _log.warning("%s", warning)
        return warnings

    def capacities(self) -> dict[str, int]:
        """Return ``num_gpu_blocks`` per backend that reported it (for ``PrefixIndex.set_capacity``)."""
        result: dict[str, int] = {}
        for backend in self._urls:
            blocks = self.cache_config(backend)[1]
            if blocks is not None:
                result[backend] = blocks
        return result

    def start(self) -> MetricsPoller:
        """Start polling in a background thread (idempotent); return self."""
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="prefixroute-metrics", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling; close the HTTP client if the poller made it. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self._timeout * len(self._urls) + 5)
            self._thread = None
        if self._owns_client:
            self._client.close()

    def __enter__(self) -> MetricsPoller:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll_once()
            self._stop.wait(self._interval)

    def _report_health(self, backend: str) -> None:
        healthy = self.healthy(backend)
        with self._lock:
            changed = self._healthy.get(backend) != healthy
            self._healthy[backend] = healthy
        if changed and self._on_health is not None:
            self._on_health(backend, healthy)
