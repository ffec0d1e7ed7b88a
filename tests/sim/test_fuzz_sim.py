"""Hostile values at the simulator's and the fakes' public constructors and functions (``prefixroute.sim``,
``prefixroute.testing``): a call either works or raises an error of the library's tree (a wrong type is its
:class:`InvalidTypeError`), never a raw error from deep inside.

Bounded (no simulation is run, no socket opened) so the file runs in seconds; the defects it found are pinned in
test_fuzz_sim_findings.py.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixroute import Router
from prefixroute.sim import (
    BackendConfig,
    BlockCache,
    ClosedLoop,
    OpenLoop,
    SimSpec,
    Simulation,
    TraceTimes,
    available_profiles,
    load_profile,
    load_trace,
    make_workload,
    run_policy,
    scenario_names,
    summarize,
)
from prefixroute.sim.traces import check_speedup
from prefixroute.testing import FakeBlockCache, FakeVLLM

from ..conftest import StrSubclass, call_or_refuse, hostile_values

_ATOMS: list[object] = [
    None, True, False, 0, -1, 1, 2, 2**64, 10**400, 0.0, 0.5, 1.5, math.nan, math.inf, -math.inf, "", "x", "\ud800",
    "a\x00b", "x" * 5000, StrSubclass("seed"), b"", b"ab", [], (), {}, [None], object(), np.int64(3), np.float64(0.5),
    np.array([1, 2]), "seed", "mooncake:", "mooncake:/nonexistent", "mooncake:" + "y" * 5000, "mooncake:a\x00b",
    "codellama-13b", "a100-40gb", "array", "bytes", random.Random(0), print,
]  # fmt: skip

hostile = hostile_values(_ATOMS)


def _option(build: Callable[..., object], option: str) -> Callable[[Any], object]:
    return lambda value: build(**{option: value})


_MODEL, _GPU = available_profiles()[0]
_FAKE_VLLM_OPTIONS = ("block_size", "num_blocks", "model", "topic", "encoding", "hash_format", "extra_group",
                      "replay_buffer", "replay", "replay_topic", "legacy_metric_names", "ttft", "clock", "seed",
                      "host", "port", "replay_port")  # fmt: skip


def _simulation(**options: object) -> Simulation:
    parts: dict[str, Any] = {
        "router": Router(block_size=16), "workload": make_workload("seed"), "arrivals": ClosedLoop(2),
        "cost": load_profile(_MODEL, _GPU), "config": BackendConfig(1000), "backends": 2, "max_requests": 3,
    }  # fmt: skip
    return Simulation(**{**parts, **options})


_CALLS: dict[str, Callable[[Any], object]] = {
    "load_trace spec": lambda v: load_trace(v),
    **{f"load_trace {o}": _option(lambda **kw: load_trace("mooncake:/nonexistent", **kw), o)
       for o in ("seed", "output_tokens", "limit")},
    "make_workload name": lambda v: make_workload(v),
    **{f"make_workload {o}": _option(lambda **kw: make_workload("seed", **kw), o) for o in ("seed", "sharing_ratio")},
    "load_profile model": lambda v: load_profile(v, _GPU),
    "load_profile gpu": lambda v: load_profile(_MODEL, v),
    "load_profile tp": lambda v: load_profile(_MODEL, _GPU, tp=v),
    "BackendConfig capacity_blocks": lambda v: BackendConfig(v),
    **{f"BackendConfig {o}": _option(lambda **kw: BackendConfig(64, **kw), o)
       for o in ("block_size", "max_num_seqs", "max_num_batched_tokens")},
    "BlockCache": lambda v: BlockCache(v),
    **{f"SimSpec {f.name}": _option(SimSpec, f.name) for f in dataclasses.fields(SimSpec)},
    **{f"FakeBlockCache {o}": _option(lambda **kw: FakeBlockCache(**{"rng": random.Random(0), **kw}), o)
       for o in ("block_size", "num_blocks", "rng", "hash_format", "extra_group")},
    **{f"FakeVLLM {o}": _option(FakeVLLM, o) for o in _FAKE_VLLM_OPTIONS},  # built, never started
    "ClosedLoop users": lambda v: ClosedLoop(v),
    **{f"ClosedLoop {o}": _option(lambda **kw: ClosedLoop(2, **kw), o) for o in ("think_time", "ramp")},
    "OpenLoop rate": lambda v: OpenLoop(v),
    "OpenLoop users": lambda v: OpenLoop(1.0, users=v),
    "TraceTimes": lambda v: TraceTimes(speedup=v),
    **{f"Simulation {o}": _option(_simulation, o)
       for o in ("router", "workload", "arrivals", "cost", "config", "backends", "max_requests", "duration", "seed",
                 "gpus_per_backend", "on_progress", "metrics_interval")},  # built, never run
    "run_policy spec": lambda v: run_policy(v, "random"),
    "run_policy policy": lambda v: run_policy(SimSpec(requests=2, backends=1), v),
    **{f"run_policy {o}": _option(lambda **kw: run_policy(SimSpec(requests=2, backends=1), "random", **kw), o)
       for o in ("workload", "on_progress")},
    "summarize outcome": lambda v: summarize(v, policy="random"),
    "check_speedup": lambda v: check_speedup(v, 1.0),
}  # fmt: skip


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(_CALLS)), value=hostile)
def test_sim_and_fakes_refuse_hostile_values_with_the_library_s_errors(name: str, value: object) -> None:
    call_or_refuse(_CALLS[name], value)


def test_every_scenario_name_builds() -> None:
    for name in scenario_names():
        make_workload(name, seed=1)
