"""Defects the simulator's and fakes' fuzz harness (test_fuzz_sim.py) found: each case failed before its fix."""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from prefixroute import ConfigurationError, InvalidTraceError, InvalidTypeError, Router
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
    summarize,
)
from prefixroute.sim.traces import check_speedup
from prefixroute.testing import FakeBlockCache, FakeVLLM


@pytest.mark.parametrize("name", [[], {}, None, 5])
def test_a_scenario_name_that_is_no_str_is_a_type_error_of_the_tree(name: object) -> None:
    with pytest.raises(InvalidTypeError, match="scenario name"):
        make_workload(name)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", [[], "\ud800", None, 1.5, True])
def test_a_scenario_seed_that_is_no_int_is_a_type_error_when_given(seed: object) -> None:
    with pytest.raises(InvalidTypeError, match="seed"):
        make_workload("seed", seed=seed)  # type: ignore[arg-type]


@pytest.mark.parametrize("ratio", ["", "0.5", [0.5], True])
def test_a_sharing_ratio_that_is_no_number_is_a_configuration_error(ratio: object) -> None:
    with pytest.raises(ConfigurationError, match="sharing ratio"):
        make_workload("seed", sharing_ratio=ratio)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("model", "gpu", "tp"), [([], "a100-40gb", None), ("codellama-13b", {}, None), (None, None, 1)]
)
def test_load_profile_names_that_are_no_str_are_type_errors_not_unhashable(
    model: object, gpu: object, tp: object
) -> None:
    with pytest.raises(InvalidTypeError, match="name is a str"):
        load_profile(model, gpu, tp=tp)  # type: ignore[arg-type]


@pytest.mark.parametrize("tp", [[], True, 1.0])
def test_load_profile_tp_that_is_no_int_is_a_configuration_error_listing_the_valid_ones(tp: object) -> None:
    model, gpu = available_profiles()[0]
    with pytest.raises(ConfigurationError, match="valid tp"):
        load_profile(model, gpu, tp=tp)  # type: ignore[arg-type]


def test_a_trace_path_with_a_nul_byte_is_an_invalid_trace_error_not_a_value_error() -> None:
    with pytest.raises(InvalidTraceError, match="cannot read trace"):
        load_trace("mooncake:a\x00b")


@pytest.mark.parametrize("capacity", ["", "64", [64], 1.5])
def test_a_capacity_that_is_no_int_is_a_configuration_error(capacity: object) -> None:
    with pytest.raises(ConfigurationError, match="capacity_blocks"):
        BackendConfig(capacity)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="capacity_blocks"):
        BlockCache(capacity)  # type: ignore[arg-type]


@pytest.mark.parametrize("option", ["block_size", "max_num_seqs", "max_num_batched_tokens"])
@pytest.mark.parametrize("value", [None, "16", 1.5, True])
def test_backend_config_counts_that_are_no_int_are_configuration_errors(option: str, value: object) -> None:
    with pytest.raises(ConfigurationError, match="ints >= 1"):
        BackendConfig(64, **{option: value})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("option", "value", "error"),
    [("rng", None, InvalidTypeError), ("num_blocks", None, ConfigurationError),
     ("num_blocks", False, ConfigurationError), ("block_size", "16", ConfigurationError),
     ("hash_format", "hex", ConfigurationError)],
)  # fmt: skip
def test_fake_block_cache_options_are_checked_with_errors_of_the_tree(
    option: str, value: object, error: type[Exception]
) -> None:
    options: dict[str, object] = {"rng": random.Random(0), option: value}
    with pytest.raises(error, match=option):
        FakeBlockCache(**options)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("option", "value", "error"),
    [("replay_buffer", 2**64, ConfigurationError), ("replay_buffer", 0.0, ConfigurationError),
     ("replay_buffer", -1, ConfigurationError), ("seed", [], ConfigurationError),
     ("seed", "\ud800", ConfigurationError), ("num_blocks", None, ConfigurationError),
     ("encoding", "json", ConfigurationError), ("model", None, ConfigurationError),
     ("model", " ", ConfigurationError), ("model", "\ud800", ConfigurationError),
     ("model", "a\nb", ConfigurationError), ("ttft", 5, InvalidTypeError), ("port", 70000, ConfigurationError),
     ("replay_port", -1, ConfigurationError), ("host", None, ConfigurationError)],
)  # fmt: skip
def test_fake_vllm_options_are_checked_when_given_with_errors_of_the_tree(
    option: str, value: object, error: type[Exception]
) -> None:
    with pytest.raises(error, match=option):
        FakeVLLM(**{option: value})  # type: ignore[arg-type]


# The fakes' flags refuse a value that is no bool (was: read for its truth, so replay="no" answered replays):
# tests/test_flag_options.py, with every other flag of the public API.


@pytest.mark.parametrize("flag", ["share", "hold"])
def test_fake_engine_complete_refuses_a_flag_that_is_no_bool_and_changes_nothing(flag: str) -> None:
    engine = FakeVLLM(block_size=4, num_blocks=16)  # not started: complete() works on the cache alone
    with pytest.raises(ConfigurationError, match=f"{flag} must be True or False, not 'no'"):
        engine.complete(list(range(8)), **{flag: "no"})  # type: ignore[arg-type]
    assert engine.chains() == [] and engine.seq == 0 and engine.cache.queries == 0
    with pytest.raises(ConfigurationError, match="share must be True or False, not 0"):
        engine.cache.allocate(list(range(8)), share=0)  # type: ignore[arg-type]
    assert engine.chains() == [] and engine.cache.queries == 0


_NONE: Any = None  # None where a dataclass field's annotation says otherwise


@pytest.mark.parametrize(
    ("build", "match"),
    [(lambda: ClosedLoop(_NONE), "users"), (lambda: ClosedLoop(2**64), "users"), (lambda: ClosedLoop(True), "users"),
     (lambda: ClosedLoop(2, think_time=10**400), "think_time"), (lambda: ClosedLoop(2, think_time=_NONE), "think_time"),
     (lambda: ClosedLoop(2, ramp=_NONE), "ramp"), (lambda: ClosedLoop(2, ramp=math.inf), "ramp"),
     (lambda: OpenLoop(1.0, users=_NONE), "users"), (lambda: OpenLoop(math.nan), "rate"),
     (lambda: TraceTimes(speedup=0.0), "speedup"), (lambda: TraceTimes(speedup=_NONE), "speedup")],
)  # fmt: skip
def test_arrival_processes_are_checked_when_made_not_mid_run(build: Callable[[], object], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        build()


def _simulation(**options: object) -> Simulation:
    model, gpu = available_profiles()[0]
    parts: dict[str, Any] = {
        "router": Router(block_size=16), "workload": make_workload("seed"), "arrivals": ClosedLoop(2),
        "cost": load_profile(model, gpu), "config": BackendConfig(1000), "backends": 2, "max_requests": 3,
    }  # fmt: skip
    return Simulation(**{**parts, **options})


@pytest.mark.parametrize(
    ("option", "value"),
    [("router", None), ("workload", None), ("arrivals", None), ("cost", None), ("config", None), ("backends", None),
     ("backends", "gpu0"), ("seed", []), ("on_progress", True)],
)  # fmt: skip
def test_simulation_parts_of_the_wrong_type_are_type_errors_when_given(option: str, value: object) -> None:
    with pytest.raises(InvalidTypeError, match=option):
        _simulation(**{option: value})


@pytest.mark.parametrize(
    ("option", "value"),
    [("backends", 2**64), ("max_requests", 2**64), ("max_requests", "x"), ("duration", "x"), ("duration", math.inf),
     ("gpus_per_backend", 0)],
)  # fmt: skip
def test_simulation_counts_that_would_hang_or_fail_mid_run_are_configuration_errors(option: str, value: object) -> None:
    with pytest.raises(ConfigurationError, match=option):
        _simulation(**{option: value})


def test_run_policy_summarize_and_check_speedup_refuse_the_wrong_types_with_errors_of_the_tree() -> None:
    spec = SimSpec(requests=2, backends=1)
    with pytest.raises(InvalidTypeError, match="spec"):
        run_policy(None, "random")  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="policy"):
        run_policy(spec, None)  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="workload"):
        run_policy(spec, "random", workload=True)  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="on_progress"):
        run_policy(spec, "random", on_progress=True)  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="workload"):
        run_policy(spec, "random", workload=print)  # type: ignore[arg-type]  # a factory that returns None
    with pytest.raises(InvalidTypeError, match="outcome"):
        summarize(None, policy="random")  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="TraceWorkload"):
        check_speedup(None, 1.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["3", -1, 2.0, True, None, 2**40])
@pytest.mark.parametrize("call", ["set_load_running", "set_load_waiting", "drop_next"])
def test_fake_engine_load_and_drop_counts_are_checked_and_change_nothing(call: str, value: object) -> None:
    """Was: set_load(waiting="3") was taken, and every later /metrics scrape failed inside the HTTP thread;
    drop_next("3") raised a bare TypeError, drop_next(-1) made the engine publish without ever dropping."""
    engine = FakeVLLM(block_size=4, num_blocks=16)
    engine.set_load(running=1, waiting=2)
    name = "count" if call == "drop_next" else call.removeprefix("set_load_")
    with pytest.raises(ConfigurationError, match=re.escape(f"{name} must be an int in [0, 2**31]")):
        if call == "drop_next":
            engine.drop_next(value)  # type: ignore[arg-type]
        else:
            engine.set_load(**{name: value})  # type: ignore[arg-type]
    assert "vllm:num_requests_waiting" in engine.metrics_text()  # unchanged, still served
    engine.set_load(running=0, waiting=0)


def test_an_index_source_that_compares_elementwise_is_refused_as_a_configuration_error() -> None:
    # `array in ("predictions", "events")` compared elementwise and raised numpy's own ValueError.
    with pytest.raises(ConfigurationError, match=r"^--index-source must be 'predictions' or 'events', not array"):
        SimSpec(index_source=np.array([1, 2]))  # type: ignore[arg-type]
