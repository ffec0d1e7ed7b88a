"""Simulate vLLM-like GPU backends behind the real Router: cost model, profiles, workloads, engine.

See docs/simulator.md. ``run_policy(SimSpec(...), policy)`` is the one-call entry point the CLI uses.
"""

from __future__ import annotations

from prefixroute.sim.backend import BackendConfig, SimBackend
from prefixroute.sim.costmodel import CostCoefficients, GpuSpec, ModelSpec, Profile
from prefixroute.sim.engine import ClosedLoop, OpenLoop, SimOutcome, Simulation, TraceTimes
from prefixroute.sim.index import EventsOnlyIndex
from prefixroute.sim.kvcache import BlockCache
from prefixroute.sim.metrics import PolicyResult, summarize
from prefixroute.sim.profiles import available_profiles, load_profile
from prefixroute.sim.request import RequestRecord, SimRequest
from prefixroute.sim.runner import SimSpec, run_policy
from prefixroute.sim.traces import load_trace
from prefixroute.sim.workloads import make_workload, scenario_names

__all__ = [
    "BackendConfig",
    "BlockCache",
    "ClosedLoop",
    "CostCoefficients",
    "EventsOnlyIndex",
    "GpuSpec",
    "ModelSpec",
    "OpenLoop",
    "PolicyResult",
    "Profile",
    "RequestRecord",
    "SimBackend",
    "SimOutcome",
    "SimRequest",
    "SimSpec",
    "Simulation",
    "TraceTimes",
    "available_profiles",
    "load_profile",
    "load_trace",
    "make_workload",
    "run_policy",
    "scenario_names",
    "summarize",
]
