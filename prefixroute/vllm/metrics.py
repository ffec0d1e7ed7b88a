"""Read vLLM's Prometheus ``/metrics``: load figures for routing, cache configuration, TTFT histogram.

:func:`fetch_metrics` reads one engine's ``/metrics`` within a deadline and :func:`parse_metrics` turns the text into
:class:`EngineMetrics`, rejecting read figures no engine can report (NaN, infinite, negative, a block size of 0). The
:class:`~prefixroute.vllm.Fleet` polls every engine with them.
"""

from __future__ import annotations

import contextlib
import io
import math
import socket
import threading
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_fd_to_metric_families
from sortedcontainers import SortedDict

from prefixroute.errors import ConfigurationError, InvalidTypeError, MetricsError
from prefixroute.vllm._checks import check_seconds

__all__ = ["MAX_METRICS_BYTES", "EngineMetrics", "fetch_metrics", "metrics_url", "parse_metrics"]

MAX_METRICS_BYTES = 32 * 1024 * 1024
"""A ``/metrics`` body larger than this is refused (a vLLM engine's is tens of kilobytes)."""

_MAX_BLOCK_SIZE = 1 << 20  # tokens per block; vLLM's largest is 256
_MAX_GPU_BLOCKS = 1 << 40  # blocks in one engine; a million is a lot

# Newer name first: vLLM renamed gpu_cache_usage_perc / gpu_prefix_cache_* (deprecated in v0.10, removed later).
_RUNNING = ("vllm:num_requests_running",)
_WAITING = ("vllm:num_requests_waiting",)
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
_CACHE_INFO = "vllm:cache_config_info"
_CACHE_NAMES = (_CACHE_INFO, _CACHE_INFO.removesuffix("_info"))  # as prometheus_client exposes an Info, and without
_TTFT = "vllm:time_to_first_token_seconds"
_START_TIME = "process_start_time_seconds"
# The vLLM figures read, as exposed (a counter with or without its _total): only these are checked and summed. Any
# other may hold what an engine does report: V0's prefix-cache hit rate is -1 with prefix caching off, its speculative
# decoding acceptance rate NaN before a draft token.
_READ = frozenset(
    spelling
    for name in (*_RUNNING, *_WAITING, *_KV_USAGE, *_QUERIES, *_HITS, _TTFT + "_count", _TTFT + "_sum")
    for spelling in (name, name.removesuffix("_total"))
)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
"""vLLM's bucket bounds of ``vllm:time_to_first_token_seconds``, seconds (what the fake engines serve)."""
_CHARS_PER_DEADLINE_CHECK = 1 << 16  # about 15 ms of parsing: the clock is read rarely, the deadline kept closely


@dataclass(frozen=True)
class EngineMetrics:
    """One scrape of a vLLM engine, summed over its label sets (models, engines, data-parallel ranks).

    A figure the text does not expose is None. ``kv_usage`` is the mean over engines (a fraction, 1 = full);
    ``num_gpu_blocks`` the server's (data-parallel engines behind one server each report the server's total: vLLM
    sums their blocks at start-up; the largest reported is kept).
    ``ttft_buckets`` holds ``(upper bound in seconds, cumulative count)`` pairs, sorted, ending with ``+inf``;
    ``ttft_count`` is the histogram's ``_count``, or its last bucket's count when the text has no ``_count``.
    ``process_start_time`` is the server process's ``process_start_time_seconds`` (Unix time), which Prometheus'
    client library exports unless the server runs in its multiprocess mode: it changes when the engine restarts.
    Every figure is finite and non-negative; ``block_size`` and ``num_gpu_blocks`` are positive.
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
    process_start_time: float | None = None

    def restarted_since(self, earlier: EngineMetrics) -> bool:
        """Whether the engine restarted between the scrape ``earlier`` and this one: its process start time changed,
        or a counter went back (vLLM's counters only grow while its process lives: Prometheus takes a fall for a
        reset too). O(1).

        Raises:
            TypeError: ``earlier`` is not an :class:`EngineMetrics`.
        """
        if not isinstance(earlier, EngineMetrics):
            raise InvalidTypeError(f"earlier must be an EngineMetrics, not {type(earlier).__name__}")
        started, was = self.process_start_time, earlier.process_start_time
        if started is not None and was is not None and started != was:
            return True
        for now, before in ((self.prefix_queries, earlier.prefix_queries), (self.ttft_count, earlier.ttft_count)):
            if now is not None and before is not None and now < before:
                return True
        return False

    @property
    def hit_rate(self) -> float | None:
        """Prefix cache hits / queries in tokens (KV residency, as vLLM measures it), or None without queries."""
        if not self.prefix_queries or self.prefix_hits is None:
            return None
        return self.prefix_hits / self.prefix_queries


def parse_metrics(text: str, *, deadline: float | None = None) -> EngineMetrics:
    """Parse Prometheus text exposition from a vLLM ``/metrics`` endpoint. O(size of text).

    A series (a name and its labels) repeated in the text counts once, the first time; a leading UTF-8 BOM is
    ignored. ``deadline`` is a :func:`time.monotonic` instant: parsing stops with a MetricsError once it has passed
    (checked every 64 KiB of text), so a huge text cannot hold the caller long (parsing tens of MB takes seconds).

    Raises:
        MetricsError: the text is not Prometheus exposition format, holds no ``vllm:`` metric at all, or holds a
            figure no engine can report (the message names it): NaN, infinite or negative values of a figure it
            reads (or finite ones whose sum over the series overflows to infinity; another ``vllm:`` figure may
            hold anything: vLLM V0 reports some as -1 or NaN), a KV usage above 1, a TTFT histogram whose
            cumulative counts fall or with a negative bucket bound, a ``block_size`` or ``num_gpu_blocks`` that is
            not a positive int (or is absurdly large); or ``deadline`` passed before the text was parsed.
        TypeError: ``text`` is not a str (decode a body first), or ``deadline`` not a number or None.
        ConfigurationError: ``deadline`` is NaN.
    """
    if not isinstance(text, str):
        raise InvalidTypeError(
            f"text must be the metrics text as a str (decode the body first), not {type(text).__name__}"
        )
    if deadline is not None and (isinstance(deadline, bool) or not isinstance(deadline, (int, float))):
        raise InvalidTypeError(f"deadline must be a time.monotonic() instant or None, not {type(deadline).__name__}")
    if isinstance(deadline, float) and math.isnan(deadline):  # no instant is past NaN: it would never stop the parse
        raise ConfigurationError("deadline must be a time.monotonic() instant or None, not nan")
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    # Bucket bound → cumulative count, summed over every series (engines, data-parallel ranks), kept in bound order.
    buckets: SortedDict[float, float] = SortedDict()
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    seen: set[tuple[str, frozenset[tuple[str, str]]]] = set()
    vllm = False  # whether any vllm: figure was seen, read or not
    try:
        for family in text_fd_to_metric_families(_Lines(text.removeprefix("\ufeff"), deadline)):
            for sample in family.samples:
                series = (sample.name, frozenset(sample.labels.items()))
                if series in seen:  # one series is one figure (Prometheus keeps the first): not a second engine
                    continue
                seen.add(series)
                name, value = sample.name, float(sample.value)
                vllm = vllm or name.startswith("vllm:")
                if name.startswith("vllm:") and name not in _READ and name not in (_TTFT + "_bucket", *_CACHE_NAMES):
                    continue  # a figure the router does not read: whatever it holds
                if name.startswith("vllm:") and not (math.isfinite(value) and value >= 0):
                    raise MetricsError(f"{name} is {value}: an engine reports finite, non-negative figures")
                if name == _TTFT + "_bucket":
                    bound = float(sample.labels.get("le", "nan"))
                    if bound < 0:
                        raise MetricsError(f"{name} has a bucket le={bound:g}: a time to first token is not negative")
                    if not math.isnan(bound):
                        buckets[bound] = _add(buckets.get(bound, 0.0), value, f"{name}{{le={bound:g}}}")
                    continue
                if name in _CACHE_NAMES:
                    block_size = _int_label(sample.labels, "block_size", block_size)
                    # one series per engine, each with the server's total (vLLM sums its data-parallel engines'
                    # blocks into the one cache config at start-up, then labels it with every engine index)
                    blocks = _int_label(sample.labels, "num_gpu_blocks", None)
                    if blocks is not None and (num_gpu_blocks is None or blocks > num_gpu_blocks):
                        num_gpu_blocks = blocks
                    continue
                total = sums.get(name, 0.0)
                sums[name] = _add(total, value, name) if name.startswith("vllm:") else total + value
                counts[name] = counts.get(name, 0) + 1
    except MetricsError:  # a ValueError too: ours, with its own message
        raise
    except (ValueError, TypeError, IndexError, KeyError, OverflowError) as exc:
        raise MetricsError(f"not Prometheus text exposition format: {exc}") from exc
    if not vllm:
        raise MetricsError("no vLLM metrics found (expected vllm:num_requests_running and others): is this vLLM?")

    def first(names: Sequence[str], *, mean: bool = False) -> float | None:
        for name in names:
            for candidate in (name, name.removesuffix("_total")):
                if candidate in sums:
                    return sums[candidate] / counts[candidate] if mean else sums[candidate]
        return None

    counts_so_far = 0.0
    for bound, count in buckets.items():
        if count < counts_so_far:
            raise MetricsError(f"{_TTFT} is not cumulative: its bucket le={bound:g} counts fewer than the one below")
        counts_so_far = count
    kv_usage = first(_KV_USAGE, mean=True)
    if kv_usage is not None and kv_usage > 1.0:
        raise MetricsError(f"KV cache usage is {kv_usage:g}: vLLM reports a fraction in [0, 1]")
    return EngineMetrics(
        running=first(_RUNNING),
        waiting=first(_WAITING),
        kv_usage=kv_usage,
        prefix_queries=first(_QUERIES),
        prefix_hits=first(_HITS),
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
        ttft_buckets=tuple(buckets.items()),
        ttft_count=sums.get(_TTFT + "_count", buckets.peekitem(-1)[1] if buckets else 0.0),
        ttft_sum=sums.get(_TTFT + "_sum", 0.0),
        process_start_time=_start_time(sums.get(_START_TIME), counts.get(_START_TIME, 0)),
    )


def _start_time(value: float | None, series: int) -> float | None:
    """The process start time if the text holds one sane figure for it (a wrong one is no reason to fail a scrape:
    it only goes unused)."""
    if value is None or series != 1 or not math.isfinite(value) or value < 0:
        return None
    return value


class _Overdue(MetricsError):
    """The deadline passed before the text was parsed (for :func:`fetch_metrics`, which says so with its timeout)."""


class _Lines(io.StringIO):
    """The text, read line by line by the parser, which stops it with a MetricsError once ``deadline`` has passed."""

    def __init__(self, text: str, deadline: float | None) -> None:
        super().__init__(text)
        self._deadline = deadline
        self._size = len(text)
        self._read = self._unchecked = 0

    def __next__(self) -> str:  # type: ignore[override]  # typeshed: StringIO inherits _IOBase.__next__ -> bytes
        line = super().__next__()
        self._read += len(line)
        self._unchecked += len(line)
        if self._deadline is not None and self._unchecked > _CHARS_PER_DEADLINE_CHECK:
            self._unchecked = 0
            if time.monotonic() > self._deadline:
                raise _Overdue(f"not parsed by the deadline: {self._read} of {self._size} characters read")
        return line


def _add(total: float, value: float, name: str) -> float:
    """``total + value``, a MetricsError when the sum of finite samples overflows to infinity."""
    result = total + value
    if not math.isfinite(result):
        raise MetricsError(f"{name} sums to {result} over its series: no engine reports figures that large")
    return result


def _int_label(labels: Mapping[str, str], key: str, default: int | None) -> int | None:
    """A positive int label of ``vllm:cache_config_info`` (None when absent or "None", as vLLM writes unset ones)."""
    raw = labels.get(key)
    if raw is None or raw.strip() in ("", "None"):
        return default
    limit = _MAX_BLOCK_SIZE if key == "block_size" else _MAX_GPU_BLOCKS
    try:
        value = float(raw)
    except ValueError:
        raise MetricsError(f"{_CACHE_INFO}'s {key} is {raw!r}, not a number") from None
    if not (math.isfinite(value) and value == int(value) and 1 <= value <= limit):
        raise MetricsError(f"{_CACHE_INFO}'s {key} is {raw!r}: expected a positive int of at most {limit}")
    return int(value)


def check_metrics_url(url: object, name: str = "url") -> str:
    """``url`` if it is an http(s) URL (the scheme in any case) with a host, and a port in [1, 65535] or none; else a
    ConfigurationError naming ``name``. Checked before any request: httpx takes a port past 65535 and connects to it
    modulo 65536, which may be another engine's. O(len(url)).

    Raises:
        ConfigurationError: it is not.
    """
    example = "like 'http://gpu0:8000'"
    if not isinstance(url, str):
        raise ConfigurationError(f"{name} must be an http(s):// URL {example}, not {url!r}")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:  # a port past 65535 or not a number, a malformed IPv6 host
        raise ConfigurationError(f"{name} {url!r} is not a URL that can be reached: {exc}") from None
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise ConfigurationError(f"{name} must be an http(s):// URL {example}, not {url!r}")
    if port == 0:
        raise ConfigurationError(f"{name} {url!r} names port 0, which no server listens on: give the engine's port")
    return url


def fetch_metrics(url: str, *, timeout: float = 2.0, client: httpx.Client | None = None) -> EngineMetrics:
    """GET ``url`` and parse it, all within ``timeout`` seconds: connecting, the headers, the whole body and parsing it.

    The request and the parsing run in a daemon thread and the caller waits at most ``timeout``, so a slow or
    trickling endpoint, or a body too large to parse in time, cannot hold it longer; the abandoned work ends by itself
    soon after (each read is bounded by ``timeout``, reading and parsing stop at the deadline, and a connection the
    request opened is shut down, so an endpoint trickling its headers byte by byte cannot keep the thread either).

    ``client`` is used when given (its TLS and proxy settings, made once); without it a client is made and closed.
    A connection that ``client`` kept alive from an earlier request is not one this request opened, so it cannot be
    shut down: give a client that keeps none, as the :class:`~prefixroute.vllm.Fleet` does
    (``httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))``), where an endpoint may trickle.

    The body is asked for gzip-compressed (or plain) and inflated as it arrives, never more than a byte past
    :data:`MAX_METRICS_BYTES`, so a compressed bomb is refused with about that much in memory. O(size of the body).
    Redirects (3xx with a ``Location``) are followed, at most 20 in a row, as Prometheus follows them.

    Raises:
        MetricsError: every failure: no answer or a body not parsed within ``timeout``, network, HTTP status, a body
            over :data:`MAX_METRICS_BYTES` (inflated), a ``Content-Encoding`` other than gzip, deflate or none, a
            compressed body that is corrupt or cut short, format or nonsense figures (see :func:`parse_metrics`).
            Also a ``url`` that is no http(s) URL that can be reached (:func:`check_metrics_url`), before any
            request.
        ConfigurationError: ``timeout`` is not a finite positive number of seconds.
    """
    timeout = check_seconds(timeout, "timeout")
    try:
        check_metrics_url(url)
    except ConfigurationError as exc:
        raise MetricsError(f"cannot read {url}: {exc}") from None
    deadline = time.monotonic() + timeout
    done = threading.Event()
    abandoned = threading.Event()
    parsing = threading.Event()
    outcome: list[EngineMetrics | BaseException] = []
    # The connections the request opens: shut down if it is abandoned, as each read's timeout alone lets an endpoint
    # that trickles a byte of its headers now and then hold the thread (and the connection) as long as it likes.
    opened: list[socket.socket] = []

    def trace(event: str, info: dict[str, Any]) -> None:  # httpcore's trace hook, called in the request's thread
        if event.endswith(_CONNECTED):
            extra_info = getattr(info.get("return_value"), "get_extra_info", None)
            sock = extra_info("socket") if callable(extra_info) else None
            if isinstance(sock, socket.socket):
                opened.append(sock)
                if abandoned.is_set():  # appended after the caller shut down what it saw
                    _shut_down(sock)

    def get() -> None:
        try:
            body = _read_body(client, url, timeout, abandoned, trace)
            if not abandoned.is_set():
                parsing.set()
                outcome.append(parse_metrics(body, deadline=deadline))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            outcome.append(exc)
        finally:
            done.set()

    threading.Thread(target=get, name="prefixroute-scrape", daemon=True).start()
    finished = done.wait(timeout)
    if not finished:
        abandoned.set()
        for sock in list(opened):
            _shut_down(sock)
    if not finished or isinstance(outcome[0], _Overdue):  # the parsing can pass the deadline just before the wait
        if parsing.is_set():
            raise MetricsError(f"cannot read {url}: its body was not parsed within {timeout:g}s (it is too long)")
        raise MetricsError(f"cannot read {url}: no complete answer within {timeout:g}s")
    result = outcome[0]
    if isinstance(result, EngineMetrics):
        return result
    if isinstance(result, MetricsError) or parsing.is_set():  # a bug in parsing stays itself, not a network error
        raise result
    if isinstance(result, httpx.HTTPStatusError):
        status = result.response.status_code
        raise MetricsError(f"cannot read {url}: HTTP {status} {result.response.reason_phrase}") from result
    detail = str(result).strip().splitlines()[:1] or [type(result).__name__]  # one line, for the CLI
    raise MetricsError(f"cannot read {url}: {detail[0]}") from result


_CONNECTED = ("connection.connect_tcp.complete", "connection.connect_unix_socket.complete",
              "connection.start_tls.complete")  # fmt: skip
"""httpcore's trace events that return a new connection's stream (TLS wraps the TCP socket in a new one)."""


def _shut_down(sock: socket.socket) -> None:
    """Shut ``sock`` down for both directions: a read blocked on it in another thread returns at once."""
    with contextlib.suppress(OSError):  # already closed, or never connected
        sock.shutdown(socket.SHUT_RDWR)


def _read_body(
    client: httpx.Client | None,
    url: str,
    timeout: float,
    abandoned: threading.Event,
    trace: Callable[[str, dict[str, Any]], None],
) -> str:
    own = client is None
    http = httpx.Client() if client is None else client
    try:
        # Only the codings _Body inflates within the cap are asked for (httpx would ask for brotli or zstd too when
        # installed, and inflates each network chunk whole: 64 KiB of gzip can hold 64 MiB, stacked codings far more).
        headers = {"Accept-Encoding": "gzip"}
        # Redirects are followed (at most httpx's 20), as Prometheus follows them: a /metrics behind a proxy that
        # sends http:// to https:// or /metrics to /metrics/ is still read. Each hop's connection is traced too.
        with http.stream(
            "GET", url, timeout=timeout, headers=headers, extensions={"trace": trace}, follow_redirects=True
        ) as response:
            response.raise_for_status()
            body = _Body(url, response.headers.get("Content-Encoding", ""))
            for chunk in response.iter_raw():
                if abandoned.is_set():
                    return ""
                body.add(chunk)
            return body.finish().decode(response.encoding or "utf-8", errors="replace")
    finally:
        if own:
            http.close()


class _Body:
    """A response body as it arrives, inflated (``gzip`` or ``deflate``) at most a byte past :data:`MAX_METRICS_BYTES`
    at a time, so a compressed bomb is refused with about the cap in memory, not the ~1000 times a network chunk that
    inflating whole chunks allocates first."""

    def __init__(self, url: str, content_encoding: str) -> None:
        self._url = url
        self._chunks: list[bytes] = []
        self._size = 0
        codings = [c.strip().lower() for c in content_encoding.split(",") if c.strip().lower() not in ("", "identity")]
        if len(codings) > 1 or (codings and codings[0] not in _WBITS):
            raise MetricsError(
                f"cannot read {url}: its body is encoded {content_encoding.strip()!r}; prefixroute reads gzip, deflate "
                "or none (and asks for gzip)"
            )
        self._coding = codings[0] if codings else None
        self._inflate = zlib.decompressobj(_WBITS[self._coding]) if self._coding else None
        self._started = False  # whether any compressed byte was inflated (deflate's header is known by then)

    def add(self, data: bytes) -> None:
        """Take the next bytes of the body as they came. O(len(data) + what they inflate to).

        Raises:
            MetricsError: the body is over the cap, or its compressed stream is corrupt.
        """
        if self._inflate is None:
            self._keep(data)
            return
        try:
            while data:
                if self._inflate.eof:
                    raise MetricsError(f"cannot read {self._url}: its body goes on after the end of its {self._coding} "
                                       "stream")  # fmt: skip
                room = MAX_METRICS_BYTES - self._size + 1  # a byte past the cap proves the body over it
                try:
                    piece = self._inflate.decompress(data, room)
                except zlib.error:
                    if self._coding != "deflate" or self._started:
                        raise
                    # "deflate" is zlib-wrapped by the RFC, raw in some servers (as httpx, try both)
                    self._inflate = zlib.decompressobj(-zlib.MAX_WBITS)
                    piece = self._inflate.decompress(data, room)
                self._started = True
                self._keep(piece)
                # Left over only when the output reached ``room``, which _keep refused; after the stream's end, the
                # bytes that follow it, refused above.
                data = self._inflate.unconsumed_tail or self._inflate.unused_data
        except zlib.error as exc:
            raise MetricsError(f"cannot read {self._url}: its {self._coding} body is corrupt ({exc})") from exc

    def finish(self) -> bytes:
        """The whole body, inflated.

        Raises:
            MetricsError: a compressed body ended before its stream did (cut short).
        """
        if self._inflate is not None and not self._inflate.eof:
            raise MetricsError(f"cannot read {self._url}: its {self._coding} body ends before its stream does")
        return b"".join(self._chunks)

    def _keep(self, piece: bytes) -> None:
        self._size += len(piece)
        if self._size > MAX_METRICS_BYTES:
            raise MetricsError(f"cannot read {self._url}: the body is over {MAX_METRICS_BYTES} bytes")
        self._chunks.append(piece)


_WBITS = MappingProxyType({"gzip": zlib.MAX_WBITS | 16, "x-gzip": zlib.MAX_WBITS | 16, "deflate": zlib.MAX_WBITS})
"""zlib's window bits for each content coding read (HTTP's "deflate" is zlib-wrapped; a raw one is tried as well)."""


def metrics_url(url: str) -> str:
    """Return ``url`` with ``/metrics`` added to its path unless the path already ends in ``/metrics``.

    A query or fragment stays after the path, so a token in the URL still reaches the engine:

    >>> metrics_url("http://gpu0:8000/?token=abc")
    'http://gpu0:8000/metrics?token=abc'

    Raises:
        TypeError: ``url`` is not a str.
    """
    if not isinstance(url, str):
        raise InvalidTypeError(f"url must be a str like 'http://gpu0:8000', not {type(url).__name__}")
    cut = min([i for i in (url.find("?"), url.find("#")) if i >= 0], default=len(url))
    base, tail = url[:cut].rstrip("/"), url[cut:]
    path_start = base.find("/", base.find("://") + 3)  # -1: no path, only a host (which may be called "metrics")
    if path_start < 0 or not base[path_start:].endswith("/metrics"):
        base += "/metrics"
    return base + tail
