"""Simulate vLLM-like GPU backends behind the real Router: cost model, profiles, workloads, engine."""

from __future__ import annotations

from prefixroute.sim.costmodel import CostCoefficients, GpuSpec, ModelSpec, Profile
from prefixroute.sim.profiles import available_profiles, load_profile

__all__ = ["CostCoefficients", "GpuSpec", "ModelSpec", "Profile", "available_profiles", "load_profile"]

# The simulator: engine, backends, workloads, traces, metrics (see docs/simulator.md).
from prefixroute.sim.backend import BackendConfig, SimBackend  # noqa: E402
from prefixroute.sim.engine import ClosedLoop, OpenLoop, SimOutcome, Simulation, TraceTimes  # noqa: E402
from prefixroute.sim.kvcache import BlockCache  # noqa: E402
from prefixroute.sim.metrics import PolicyResult, summarize  # noqa: E402
from prefixroute.sim.request import RequestRecord, SimRequest  # noqa: E402
from prefixroute.sim.runner import SimSpec, run_policy  # noqa: E402
from prefixroute.sim.traces import load_trace  # noqa: E402
from prefixroute.sim.workloads import make_workload, scenario_names  # noqa: E402

__all__ += [
    "BackendConfig",
    "BlockCache",
    "ClosedLoop",
    "OpenLoop",
    "PolicyResult",
    "RequestRecord",
    "SimBackend",
    "SimOutcome",
    "SimRequest",
    "SimSpec",
    "Simulation",
    "TraceTimes",
    "load_trace",
    "make_workload",
    "run_policy",
    "scenario_names",
    "summarize",
]
