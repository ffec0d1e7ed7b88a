"""Per-policy figures from a run's records: hit rates, latency percentiles, throughput, balance, recompute cost."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from prefixroute._numbers import as_float, shown
from prefixroute.errors import ConfigurationError, InvalidTypeError
from prefixroute.sim.engine import SimOutcome

__all__ = ["PolicyResult", "percentile", "summarize"]

SECONDS_PER_MONTH = 30 * 24 * 3600


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0–100) of ``values`` by linear interpolation (numpy's default); NaN if empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass
class PolicyResult:
    """What one policy achieved in one run. Times in milliseconds where the name says ``_ms``.

    ``hit_rate`` is cached prompt tokens / prompt tokens as the backends' prefix caches served them (vLLM's
    ``prefix_cache_hits / prefix_cache_queries``); ``predicted_hit_rate`` is what the router expected
    (``Decision.matched_tokens``). ``recompute_gpu_seconds`` is prefill time spent on prefixes another backend held
    at the time, and ``recompute_usd_per_month`` its cost at ``gpu_hour_usd`` if the run's traffic went on for a
    30-day month.
    """

    policy: str
    requests: int
    rejected: int
    hit_rate: float
    predicted_hit_rate: float
    ttft_ms: dict[str, float]
    e2e_ms: dict[str, float]
    throughput_rps: float
    prompt_tokens_per_s: float
    backend_share: dict[str, float]
    peak_in_flight: dict[str, int]
    max_backend_share: float
    recompute_gpu_seconds: float
    recompute_usd_per_month: float
    preemptions: int
    duration_s: float
    tag_tokens: dict[str, tuple[int, int]] = field(default_factory=dict, repr=False)
    ttfts_ms: list[float] = field(default_factory=list, repr=False)

    def tag_hit_rate(self, *, exclude: str = "unique") -> float:
        """KV hit rate over the requests whose tag is not ``exclude`` (e.g. only those on a shared prefix).

        Raises:
            InvalidTypeError: ``exclude`` is not a tag (a str).
        """
        if not isinstance(exclude, str):
            raise InvalidTypeError(f"exclude must be a request tag (a str), not {type(exclude).__name__}")
        cached = sum(c for tag, (c, _p) in self.tag_tokens.items() if tag != exclude)
        prompt = sum(p for tag, (_c, p) in self.tag_tokens.items() if tag != exclude)
        return cached / prompt if prompt else 0.0

    def to_json(self) -> dict[str, object]:
        """The ``--json`` result object: exactly the documented keys (the rest is in :meth:`details`)."""
        return {
            "policy": self.policy,
            "requests": self.requests,
            "hit_rate": self.hit_rate,
            "predicted_hit_rate": self.predicted_hit_rate,
            "ttft_ms": dict(self.ttft_ms),
            "e2e_ms": dict(self.e2e_ms),
            "throughput_rps": self.throughput_rps,
            "max_backend_share": self.max_backend_share,
        }

    def details(self) -> dict[str, object]:
        """The figures beyond the ``--json`` schema: rejections, token throughput, balance, recompute cost."""
        return {
            "rejected": self.rejected,
            "prompt_tokens_per_s": self.prompt_tokens_per_s,
            "backend_share": dict(self.backend_share),
            "peak_in_flight": dict(self.peak_in_flight),
            "recompute_gpu_seconds": self.recompute_gpu_seconds,
            "recompute_usd_per_month": self.recompute_usd_per_month,
            "preemptions": self.preemptions,
            "duration_s": self.duration_s,
        }


def summarize(outcome: SimOutcome, *, policy: str, gpu_hour_usd: float = 0.0) -> PolicyResult:
    """Reduce a run to a :class:`PolicyResult`. Rejected requests count in shares but not in latencies.

    Raises:
        TypeError: ``outcome`` is not a :class:`SimOutcome` or ``policy`` not a str.
        ConfigurationError: ``gpu_hour_usd`` is not a finite number >= 0.
    """
    if not isinstance(outcome, SimOutcome):
        raise InvalidTypeError(
            f"outcome must be a SimOutcome (Simulation.run() gives one), not {type(outcome).__name__}"
        )
    if not isinstance(policy, str):
        raise InvalidTypeError(f"policy must be the policy's name (a str), not {type(policy).__name__}")
    price = as_float(gpu_hour_usd)
    if price is None or price < 0:
        raise ConfigurationError(f"gpu_hour_usd must be a finite number >= 0, not {shown(gpu_hour_usd)}")
    gpu_hour_usd = price
    records = outcome.records
    served = [r for r in records if not r.rejected]
    prompt = sum(r.prompt_tokens for r in served)
    ttfts = [1000.0 * r.ttft for r in served]
    e2es = [1000.0 * r.e2e for r in served]
    start = min((r.arrival for r in records), default=0.0)
    span = max(outcome.duration - start, 1e-9)
    counts = Counter(r.backend for r in records)
    backends = list(outcome.peak_in_flight)
    share = {b: counts.get(b, 0) / len(records) if records else 0.0 for b in backends}
    recompute = sum(r.recompute_seconds for r in served)
    tags: dict[str, tuple[int, int]] = {}
    for r in served:
        cached, total = tags.get(r.tag, (0, 0))
        tags[r.tag] = (cached + r.cached_tokens, total + r.prompt_tokens)
    return PolicyResult(
        policy=policy,
        requests=len(served),
        rejected=len(records) - len(served),
        hit_rate=sum(r.cached_tokens for r in served) / prompt if prompt else 0.0,
        predicted_hit_rate=sum(min(r.predicted_tokens, r.prompt_tokens) for r in served) / prompt if prompt else 0.0,
        ttft_ms={f"p{q}": percentile(ttfts, q) for q in (50, 95, 99)},
        e2e_ms={f"p{q}": percentile(e2es, q) for q in (50, 99)},
        throughput_rps=len(served) / span,
        prompt_tokens_per_s=prompt / span,
        backend_share=share,
        peak_in_flight=dict(outcome.peak_in_flight),
        max_backend_share=max(share.values(), default=0.0),
        recompute_gpu_seconds=recompute,
        recompute_usd_per_month=recompute / span * SECONDS_PER_MONTH / 3600.0 * gpu_hour_usd,
        preemptions=sum(r.preemptions for r in served),
        duration_s=span,
        tag_tokens=tags,
        ttfts_ms=ttfts,
    )
