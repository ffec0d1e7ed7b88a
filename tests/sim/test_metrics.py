"""Metrics: percentiles as numpy computes them, and the per-policy summary arithmetic."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixroute.errors import InvalidTypeError
from prefixroute.sim.engine import SimOutcome
from prefixroute.sim.metrics import percentile, summarize
from prefixroute.sim.request import RequestRecord


@given(st.lists(st.floats(0, 1e6), min_size=1, max_size=50), st.sampled_from([0, 50, 95, 99, 100]))
def test_percentile_matches_numpy(values: list[float], q: int) -> None:
    assert math.isclose(percentile(values, q), float(np.percentile(values, q)), rel_tol=1e-9, abs_tol=1e-9)


def test_percentile_of_nothing_is_nan() -> None:
    assert math.isnan(percentile([], 50))


def _record(i: int, backend: str, cached: int, fleet: int, recompute: float) -> RequestRecord:
    return RequestRecord(
        request_id=i,
        user=0,
        tag="",
        arrival=float(i),
        prompt_tokens=100,
        output_tokens=2,
        backend=backend,
        predicted_tokens=cached + 16,
        cached_tokens=cached,
        fleet_cached_tokens=fleet,
        first_token=i + 0.5,
        finished=i + 1.0,
        generated_tokens=2,
        recompute_seconds=recompute,
    )


def test_summary_arithmetic() -> None:
    records = [_record(0, "a", 0, 0, 0.0), _record(1, "a", 64, 64, 0.0), _record(2, "b", 32, 80, 0.36)]
    outcome = SimOutcome(
        records, duration=3.6, steps={}, peak_in_flight={"a": 1, "b": 1}, prefill_tokens={}, evictions={}
    )
    result = summarize(outcome, policy="p", gpu_hour_usd=10.0)
    assert result.hit_rate == (0 + 64 + 32) / 300
    assert result.predicted_hit_rate == (16 + 80 + 48) / 300
    assert result.ttft_ms["p50"] == 500.0 and result.e2e_ms["p99"] == 1000.0
    assert result.throughput_rps == 3 / 3.6
    assert result.backend_share == {"a": 2 / 3, "b": 1 / 3} and result.max_backend_share == 2 / 3
    # 0.36 GPU-s recomputed in 3.6 s of traffic: 10 % of a GPU, all month, at $10/h
    assert math.isclose(result.recompute_usd_per_month, 0.1 * 30 * 24 * 10.0)


def test_the_tag_hit_rate_leaves_out_one_tag_and_refuses_what_is_no_tag() -> None:
    records = [_record(0, "a", 0, 0, 0.0), _record(1, "a", 64, 64, 0.0), _record(2, "b", 32, 80, 0.0)]
    records[0] = replace(records[0], tag="unique")
    outcome = SimOutcome(records, duration=3.0, steps={}, peak_in_flight={}, prefill_tokens={}, evictions={})
    result = summarize(outcome, policy="p")
    assert result.tag_hit_rate() == (64 + 32) / 200  # the unique request left out
    assert result.tag_hit_rate(exclude="") == 0 / 100 and result.tag_hit_rate(exclude="other") == result.hit_rate
    with pytest.raises(InvalidTypeError, match="exclude must be a request tag"):
        result.tag_hit_rate(exclude=None)  # type: ignore[arg-type]  # was: every tag kept, silently
