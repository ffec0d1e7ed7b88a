"""The sidecar's own Prometheus metrics, counted in plain ints (the hot path pays a dict increment, not a lock).

Every figure is read on the event loop's thread, which is the only writer; :meth:`SidecarMetrics.render` adds the
router's own counters (:meth:`~prefixroute.Router.stats`) and each backend's requests in flight
(:meth:`~prefixroute.Router.in_flight`), both of which first end the requests whose lease has run out: an expired
request stops counting at the next scrape even when no request arrives.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Mapping

from prefixroute.router import Decision, Router

__all__ = ["LATENCY_BUCKETS", "RELEASE_PATHS", "SidecarMetrics"]

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
"""Upper bounds (seconds) of the decision latency histogram's buckets."""

RELEASE_PATHS = ("http", "udp", "ext_proc")
"""The paths a finish or first-token report comes on, each counted in ``prefixroute_releases_total``."""


class SidecarMetrics:
    """Counters of one sidecar: decisions by reason, prompt and hit tokens, releases, release datagrams unread, bad
    requests, decision latency."""

    __slots__ = ("_bucket_counts", "_latency_count", "_latency_sum", "bad_requests", "decisions", "hit_tokens",
                 "prompt_tokens", "releases", "unread_datagrams")  # fmt: skip

    def __init__(self) -> None:
        self.decisions: dict[str, int] = {}
        self.hit_tokens = 0
        self.prompt_tokens = 0
        self.bad_requests: dict[int, int] = {}
        self.releases: dict[str, int] = {}
        self.unread_datagrams = 0
        self._bucket_counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self._latency_sum = 0.0
        self._latency_count = 0

    def decided(self, decision: Decision, seconds: float) -> None:
        """Count one decision and how long it took (from the body read to the answer built). O(log buckets)."""
        self.decisions[decision.reason] = self.decisions.get(decision.reason, 0) + 1
        self.hit_tokens += decision.matched_tokens
        self.prompt_tokens += decision.prompt_tokens
        self._bucket_counts[bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self._latency_sum += seconds
        self._latency_count += 1

    def refused(self, status: int) -> None:
        """Count one request answered with an error status."""
        self.bad_requests[status] = self.bad_requests.get(status, 0) + 1

    def released(self, path: str) -> None:
        """Count one finish or first-token report, by the path it came on (one of :data:`RELEASE_PATHS`)."""
        self.releases[path] = self.releases.get(path, 0) + 1

    def unread(self) -> None:
        """Count one datagram on the release port that held no release token."""
        self.unread_datagrams += 1

    def render(self, router: Router, backends: Iterable[str], *, up: Mapping[str, bool] | None = None) -> str:
        """The Prometheus text exposition (format 0.0.4). O(backends + buckets). ``up``: whether each of the
        sidecar's own backends is healthy, when something tells (``--metrics-from-backends``)."""
        stats = router.stats()
        lines = [
            "# HELP prefixroute_decisions_total Routing decisions, by why the backend was chosen.",
            "# TYPE prefixroute_decisions_total counter",
        ]
        for reason in ("prefix", "load-fallback", "miss", "policy"):
            lines.append(f'prefixroute_decisions_total{{reason="{reason}"}} {self.decisions.get(reason, 0)}')
        lines += [
            "# HELP prefixroute_hit_tokens_total Prompt tokens the chosen backend was predicted to hold.",
            "# TYPE prefixroute_hit_tokens_total counter",
            f"prefixroute_hit_tokens_total {self.hit_tokens}",
            "# HELP prefixroute_prompt_tokens_total Prompt tokens routed.",
            "# TYPE prefixroute_prompt_tokens_total counter",
            f"prefixroute_prompt_tokens_total {self.prompt_tokens}",
            "# HELP prefixroute_in_flight Requests routed and not yet finished, by backend.",
            "# TYPE prefixroute_in_flight gauge",
        ]
        for backend in backends:
            lines.append(f'prefixroute_in_flight{{backend="{_label(backend)}"}} {router.in_flight(backend)}')
        lines += [
            "# HELP prefixroute_leases_expired_total Requests that stopped counting because their lease ran out.",
            "# TYPE prefixroute_leases_expired_total counter",
            f"prefixroute_leases_expired_total {stats.leases_expired}",
            "# HELP prefixroute_unknown_finishes_total Finish or first-token reports that matched no request in "
            "flight (repeated, expired or unknown ids).",
            "# TYPE prefixroute_unknown_finishes_total counter",
            f"prefixroute_unknown_finishes_total {stats.ignored}",
            "# HELP prefixroute_releases_total Finish and first-token reports received, by path.",
            "# TYPE prefixroute_releases_total counter",
        ]
        for path in RELEASE_PATHS:
            lines.append(f'prefixroute_releases_total{{path="{path}"}} {self.releases.get(path, 0)}')
        lines += [
            "# HELP prefixroute_release_datagrams_unread_total Datagrams on the UDP release port that held no release "
            "token (a log format without prefixroute_finish=<id>, or other traffic).",
            "# TYPE prefixroute_release_datagrams_unread_total counter",
            f"prefixroute_release_datagrams_unread_total {self.unread_datagrams}",
            "# HELP prefixroute_bad_requests_total Requests refused, by HTTP status.",
            "# TYPE prefixroute_bad_requests_total counter",
        ]
        for status, count in sorted(self.bad_requests.items()):
            lines.append(f'prefixroute_bad_requests_total{{status="{status}"}} {count}')
        lines += [
            "# HELP prefixroute_decision_seconds Time to decide, from the request body read to the answer built.",
            "# TYPE prefixroute_decision_seconds histogram",
        ]
        cumulative = 0
        for bound, count in zip(LATENCY_BUCKETS, self._bucket_counts[:-1], strict=True):
            cumulative += count
            lines.append(f'prefixroute_decision_seconds_bucket{{le="{bound}"}} {cumulative}')
        lines += [
            f'prefixroute_decision_seconds_bucket{{le="+Inf"}} {self._latency_count}',
            f"prefixroute_decision_seconds_sum {self._latency_sum}",
            f"prefixroute_decision_seconds_count {self._latency_count}",
        ]
        if up is not None:
            lines += [
                "# HELP prefixroute_backend_up 1 while a backend is healthy (its /metrics scraped), else 0.",
                "# TYPE prefixroute_backend_up gauge",
            ]
            lines += [f'prefixroute_backend_up{{backend="{_label(b)}"}} {int(healthy)}' for b, healthy in up.items()]
        return "\n".join(lines) + "\n"


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
