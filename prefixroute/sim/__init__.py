"""Simulate vLLM-like GPU backends behind the real Router: cost model, profiles, workloads, engine."""

from __future__ import annotations

from prefixroute.sim.costmodel import CostCoefficients, GpuSpec, ModelSpec, Profile
from prefixroute.sim.profiles import available_profiles, load_profile

__all__ = ["CostCoefficients", "GpuSpec", "ModelSpec", "Profile", "available_profiles", "load_profile"]
