"""Every scenario end to end with the real profiles: invariants checked after every step, same seed same result."""

from __future__ import annotations

import pytest

from prefixroute.errors import ConfigurationError
from prefixroute.sim.runner import SimSpec, run_policy, vllm_defaults
from prefixroute.sim.workloads import scenario_names


@pytest.mark.parametrize("scenario", scenario_names())
def test_scenarios_run_checked_and_reproducibly(scenario: str) -> None:
    spec = SimSpec(scenario=scenario, requests=80, users=10, think_time=0.1)
    first = run_policy(spec, "bounded-load", check=True)
    second = run_policy(spec, "bounded-load", check=True)
    assert first.to_json() == second.to_json()
    assert first.requests + first.rejected == 80
    assert 0.0 <= first.hit_rate <= 1.0 and first.ttft_ms["p50"] > 0


def test_open_loop_multi_turn_continues_sessions() -> None:
    spec = SimSpec(scenario="multi-turn", requests=200, users=4, rate=2.0)
    result = run_policy(spec, "prefix-affinity")
    assert result.requests == 200
    assert result.hit_rate > 0.3  # turns after the first reuse their session's earlier prompt and answer


def test_events_mode_predicts_what_the_engines_hold() -> None:
    spec = SimSpec(requests=200, users=8, index_source="events")
    result = run_policy(spec, "prefix-affinity", check=True)
    assert abs(result.predicted_hit_rate - result.hit_rate) < 0.05


def test_configuration_errors() -> None:
    with pytest.raises(ConfigurationError, match="index_source"):
        run_policy(SimSpec(requests=5, index_source="gossip"), "round-robin")
    with pytest.raises(ConfigurationError, match="--users or --rate"):
        run_policy(SimSpec(requests=5, users=None), "round-robin")
    with pytest.raises(ConfigurationError, match="--backends"):
        run_policy(SimSpec(requests=5, backends=0), "round-robin")


def test_vllm_defaults_follow_gpu_memory() -> None:
    assert vllm_defaults(40 * 2**30) == (256, 2048)
    assert vllm_defaults(80 * 2**30) == (1024, 8192)
