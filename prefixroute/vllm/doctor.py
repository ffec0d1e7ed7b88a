"""``prefixroute doctor URL|FILE …``: read vLLM ``/metrics`` and say whether cache misses under load hurt TTFT.

For each source it computes TTFT P50/P95/P99 from the ``vllm:time_to_first_token_seconds`` histogram (linear
interpolation within buckets, as Prometheus' ``histogram_quantile``), the prefix cache hit rate (cached prompt
tokens / prompt tokens) and the queue figures, and gives a verdict with the reasons and figures behind it. URLs are read
16 at a time, each within --timeout seconds (connecting, headers, body and parsing), so up to 16 URLs take at most
about --timeout, and more at most one --timeout per 16 (only engines that do not answer take it whole); files and
stdin are read whole, up to 32 MiB. Exit status: 0 healthy, 1 suspect, 2 unreadable input or a bad option (one line
on stderr).
"""

from __future__ import annotations

import argparse
import json
import math
import numbers
import sys
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from prefixroute._numbers import as_float, shown
from prefixroute.errors import ConfigurationError, InvalidTypeError, MetricsError
from prefixroute.vllm._checks import check_seconds
from prefixroute.vllm.metrics import (
    MAX_METRICS_BYTES,
    EngineMetrics,
    fetch_metrics,
    metrics_url,
    parse_metrics,
)

__all__ = ["Diagnosis", "diagnose", "histogram_quantile", "register", "run"]

Verdict = Literal["healthy", "suspect", "unreadable"]
EXIT_CODES: Mapping[str, int] = MappingProxyType({"healthy": 0, "suspect": 1, "unreadable": 2})
MISS_ADVICE = "likely cache misses under load; prefix-aware routing should help"
CONCURRENT_READS = 16
"""URLs read at once. Each read holds a thread or two, a socket and up to :data:`MAX_METRICS_BYTES` of body (32 MiB),
so a long list of URLs costs time, not threads, sockets (a process's limit is often 1024) or memory."""


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """Return the ``q`` quantile of a cumulative histogram, interpolating linearly within the bucket it falls in.

    ``buckets`` are ``(upper bound, cumulative count)`` sorted by bound and ending with ``+inf``. None without
    observations. A quantile in the ``+inf`` bucket returns the highest finite bound (the histogram cannot say
    more). O(buckets).

    >>> histogram_quantile(0.5, [(1.0, 0.0), (2.0, 10.0), (math.inf, 10.0)])
    1.5

    Raises:
        ConfigurationError: ``q`` is not a number in [0, 1].
        TypeError: ``buckets`` is not a sequence of (upper bound, cumulative count) pairs of numbers.
    """
    fraction = as_float(q)
    if fraction is None or not 0.0 <= fraction <= 1.0:
        raise ConfigurationError(f"q must be a number in [0, 1], not {shown(q)}")
    if not isinstance(buckets, Sequence) or isinstance(buckets, (str, bytes)) or not all(map(_is_bucket, buckets)):
        raise InvalidTypeError(
            f"buckets must be a sequence of (upper bound, cumulative count) pairs of numbers, not {shown(buckets)}"
        )
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = fraction * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank and count > lower_count:
            if math.isinf(bound):
                return lower_bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


def _is_bucket(pair: object) -> bool:
    return (
        isinstance(pair, (tuple, list))
        and len(pair) == 2
        and all(isinstance(x, numbers.Real) and not isinstance(x, bool) for x in pair)
    )


@dataclass
class Diagnosis:
    """The figures read from one source and the verdict they lead to."""

    source: str
    verdict: Verdict
    reasons: list[str] = field(default_factory=list)
    ttft_p50_s: float | None = None
    ttft_p95_s: float | None = None
    ttft_p99_s: float | None = None
    p99_p50_ratio: float | None = None
    ttft_samples: float = 0.0
    prefix_hit_rate: float | None = None
    prefix_queries_tokens: float | None = None
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    block_size: int | None = None
    num_gpu_blocks: int | None = None

    @property
    def exit_code(self) -> int:
        """0 healthy, 1 suspect, 2 unreadable."""
        return EXIT_CODES[self.verdict]


def diagnose(
    metrics: EngineMetrics, *, source: str = "", ratio_threshold: float = 5.0, low_hit_rate: float = 0.5
) -> Diagnosis:
    """Judge one engine's figures.

    Suspect when P99/P50 TTFT exceeds ``ratio_threshold`` (with a hit rate under ``low_hit_rate`` the reason is
    cache misses under load) or when the KV cache is nearly full; healthy otherwise. Unreadable when the figures
    contradict each other: more prefix cache hits than queries, or a P99/P50 that overflows.

    Raises:
        ConfigurationError: ``ratio_threshold`` is not a finite number >= 1 or ``low_hit_rate`` not in [0, 1].
        TypeError: ``metrics`` is not an :class:`~prefixroute.vllm.EngineMetrics` or ``source`` not a str.
    """
    if not isinstance(metrics, EngineMetrics):
        raise InvalidTypeError(f"metrics must be an EngineMetrics (parse_metrics() gives one), not {shown(metrics)}")
    if not isinstance(source, str):
        raise InvalidTypeError(f"source must be a str naming where the figures came from, not {shown(source)}")
    threshold, low_rate = as_float(ratio_threshold), as_float(low_hit_rate)
    if threshold is None or threshold < 1:
        raise ConfigurationError(f"ratio_threshold must be a finite number >= 1, not {shown(ratio_threshold)}")
    if low_rate is None or not 0 <= low_rate <= 1:
        raise ConfigurationError(f"low_hit_rate must be a fraction in [0, 1], not {shown(low_hit_rate)}")
    ratio_threshold, low_hit_rate = threshold, low_rate
    hits, queries = metrics.prefix_hits, metrics.prefix_queries
    if hits is not None and queries is not None and hits > queries:
        reason = f"prefix cache hits ({hits:g} tokens) exceed queries ({queries:g}): a hit is a queried token"
        return Diagnosis(source=source, verdict="unreadable", reasons=[reason])
    p50, p95, p99 = (histogram_quantile(q, metrics.ttft_buckets) for q in (0.5, 0.95, 0.99))
    ratio = p99 / p50 if p50 and p99 is not None else None
    if ratio is not None and not math.isfinite(ratio):
        reason = f"TTFT P99/P50 overflows (P50 {p50:g}s, P99 {p99:g}s): no engine reports such figures"
        return Diagnosis(source=source, verdict="unreadable", reasons=[reason])
    hit = metrics.hit_rate
    result = Diagnosis(
        source=source, verdict="healthy", ttft_p50_s=p50, ttft_p95_s=p95, ttft_p99_s=p99, p99_p50_ratio=ratio,
        ttft_samples=metrics.ttft_count, prefix_hit_rate=hit, prefix_queries_tokens=metrics.prefix_queries,
        running=metrics.running, waiting=metrics.waiting, kv_usage=metrics.kv_usage, block_size=metrics.block_size,
        num_gpu_blocks=metrics.num_gpu_blocks,
    )  # fmt: skip
    reasons = result.reasons
    hit_text = "unknown" if hit is None else f"{hit:.1%}"
    queue_text = f"{_num(metrics.running)} running, {_num(metrics.waiting)} waiting"
    if p50 is None or p99 is None:
        reasons.append("no TTFT samples yet: nothing to judge (send traffic, then run doctor again)")
    elif ratio is None:
        reasons.append(
            "TTFT P50 is 0s by the histogram (every sample in a bucket at 0s, or none in a finite bucket): "
            "P99/P50 cannot be judged"
        )
    elif ratio > ratio_threshold:
        result.verdict = "suspect"
        figures = f"TTFT P99/P50 = {_fixed(ratio, 1)} (P50 {_seconds(p50)}, P99 {_seconds(p99)}) > {ratio_threshold:g}"
        if hit is not None and hit < low_hit_rate:
            reasons.append(f"{MISS_ADVICE}: {figures} with a prefix cache hit rate of {hit_text} ({queue_text})")
        else:
            reasons.append(
                f"long TTFT tail not explained by cache misses: {figures}, prefix cache hit rate {hit_text} "
                f"({queue_text}); look at queueing and prompt lengths"
            )
    else:
        reasons.append(
            f"TTFT P99/P50 = {_fixed(ratio, 1)} (P50 {_seconds(p50)}, P99 {_seconds(p99)}) <= {ratio_threshold:g}; "
            f"prefix cache hit rate {hit_text}; {queue_text}"
        )
    if metrics.kv_usage is not None and metrics.kv_usage >= 0.95:
        result.verdict = "suspect"
        reasons.append(f"KV cache {metrics.kv_usage:.0%} full: cached prefixes are evicted quickly")
    return result


def read_source(source: str, *, timeout: float) -> EngineMetrics:
    """Read one source: an ``http(s)://`` URL (``/metrics`` added to its path if missing), a file, or ``-`` for stdin.

    ``timeout`` bounds the whole read of a URL, parsing included (see :func:`~prefixroute.vllm.fetch_metrics`); files
    and stdin are read without one. Every source is refused over :data:`~prefixroute.vllm.metrics.MAX_METRICS_BYTES`.

    Raises:
        MetricsError: the source cannot be read, is too large or is not vLLM metrics (the message says why).
    """
    if _is_url(source):
        return fetch_metrics(metrics_url(source), timeout=timeout)
    try:
        if source == "-":
            data = sys.stdin.buffer.read(MAX_METRICS_BYTES + 1)
        else:
            with Path(source).open("rb") as file:  # at most the cap and a byte: /dev/zero must not fill the memory
                data = file.read(MAX_METRICS_BYTES + 1)
        if len(data) > MAX_METRICS_BYTES:
            raise MetricsError(
                f"cannot read {source}: it is over {MAX_METRICS_BYTES} bytes (a vLLM /metrics is tens of kilobytes)"
            )
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise MetricsError(f"cannot read {source}: {exc}") from exc
    return parse_metrics(text)


def register(subparsers: Any) -> None:
    """Add the ``doctor`` subcommand."""
    parser = subparsers.add_parser(
        "doctor",
        help="diagnose vLLM TTFT and prefix cache hit rate from /metrics",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # Numbers are taken as text and checked in run(), so a bad value gets one line and exit status 2.
    parser.add_argument("sources", nargs="*", metavar="URL|FILE", help="vLLM base URL, /metrics URL, saved file or -")
    parser.add_argument("--json", action="store_true", help="print the figures and verdicts as JSON")
    parser.add_argument(
        "--timeout", default="5",
        help=f"seconds for reading each URL, all of it; URLs are read {CONCURRENT_READS} at a time (default 5)",
    )  # fmt: skip
    parser.add_argument("--ratio-threshold", default="5", help="suspect P99/P50 TTFT above this (default 5)")
    parser.add_argument("--low-hit-rate", default="0.5", help="a hit rate under this is low, 0-1 (default 0.5)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Diagnose every source; print text or JSON; return the worst exit status (2 for a bad option)."""
    try:
        timeout, ratio_threshold, low_hit_rate = _options(args)
    except ConfigurationError as exc:
        print(f"prefixroute doctor: {exc}", file=sys.stderr)
        return 2
    readings: dict[int, EngineMetrics | MetricsError] = {}
    urls = [i for i, source in enumerate(args.sources) if _is_url(source)]
    for i, source in enumerate(args.sources):
        if i not in urls:
            readings[i] = _read(source, timeout)
    if urls:  # together: the run takes one timeout per CONCURRENT_READS URLs at most, not one per URL
        with ThreadPoolExecutor(min(len(urls), CONCURRENT_READS), thread_name_prefix="prefixroute-doctor") as pool:
            for i, reading in zip(urls, pool.map(lambda i: _read(args.sources[i], timeout), urls), strict=True):
                readings[i] = reading
    results: list[Diagnosis] = []
    for i, source in enumerate(args.sources):
        reading = readings[i]
        if isinstance(reading, MetricsError):
            results.append(Diagnosis(source=source, verdict="unreadable", reasons=[str(reading)]))
        else:
            results.append(diagnose(reading, source=source, ratio_threshold=ratio_threshold, low_hit_rate=low_hit_rate))
    status = max(d.exit_code for d in results)
    if args.json:
        print(json.dumps({"exit_code": status, "targets": [asdict(d) for d in results]}, indent=2))
    else:
        for d in results:
            print(_render(d))
    return status


def _is_url(source: str) -> bool:
    """Whether ``source`` is an http(s) URL (the scheme in any case, as URLs allow: ``HTTP://gpu0``)."""
    return source[:8].lower().startswith(("http://", "https://"))


def _options(args: argparse.Namespace) -> tuple[float, float, float]:
    if not args.sources:
        raise ConfigurationError("give at least one source: a vLLM URL, a saved /metrics file, or - for stdin")
    for source in args.sources:
        # "" is no file (Path("") is the current folder, "cannot read : Is a directory"), and ftp://host would be
        # read as the file ftp:/host.
        if (
            not source.strip()
            or "\0" in source  # only main(argv) can pass one; opening it would raise ValueError
            or ("://" in source and not _is_url(source))
        ):
            raise ConfigurationError(
                f"a source must be an http:// or https:// URL, a saved /metrics file or - for stdin, not {source!r}"
            )
    timeout = check_seconds(_number(args.timeout, "--timeout"), "--timeout")
    ratio = _number(args.ratio_threshold, "--ratio-threshold")
    if not (math.isfinite(ratio) and ratio >= 1):
        raise ConfigurationError(f"--ratio-threshold must be a finite number >= 1, not {args.ratio_threshold!r}")
    low = _number(args.low_hit_rate, "--low-hit-rate")
    if not 0 <= low <= 1:
        raise ConfigurationError(f"--low-hit-rate must be a fraction in [0, 1], not {args.low_hit_rate!r}")
    return timeout, ratio, low


def _number(text: str, option: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigurationError(f"{option} must be a number, not {text!r}") from None


def _read(source: str, timeout: float) -> EngineMetrics | MetricsError:
    try:
        return read_source(source, timeout=timeout)
    except MetricsError as exc:
        return exc


def _render(d: Diagnosis) -> str:
    lines = [f"{d.source}: {d.verdict.upper()}"]
    if d.verdict != "unreadable":
        ttft = "n/a"
        if d.ttft_p50_s is not None:
            ttft = f"P50 {_seconds(d.ttft_p50_s)}  P95 {_seconds(d.ttft_p95_s or 0)}  P99 {_seconds(d.ttft_p99_s or 0)}"
        lines.append(f"  TTFT            {ttft}  ({_fixed(d.ttft_samples, 0)} requests)")
        hit = "n/a" if d.prefix_hit_rate is None else f"{d.prefix_hit_rate:.1%}"
        lines.append(f"  prefix hit rate {hit}")
        lines.append(f"  queue           {_num(d.running)} running, {_num(d.waiting)} waiting")
        if d.kv_usage is not None:
            lines.append(f"  KV cache usage  {d.kv_usage:.1%}")
    lines.extend(f"  - {reason}" for reason in d.reasons)
    return "\n".join(lines)


def _num(value: float | None) -> str:
    return "?" if value is None else f"{value:g}"


def _fixed(value: float, decimals: int) -> str:
    """``value`` with ``decimals`` decimals, or in exponent form from a million up (not 300 digits)."""
    return f"{value:.{decimals}f}" if abs(value) < 1e6 else f"{value:.3g}"


def _seconds(value: float) -> str:
    return f"{_fixed(value, 3)}s"
