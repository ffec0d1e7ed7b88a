"""Defects the simulator's and fakes' fuzz harness (test_fuzz_sim.py) found: each case failed before its fix."""

from __future__ import annotations

import random

import pytest

from prefixroute import ConfigurationError, InvalidTraceError, InvalidTypeError
from prefixroute.sim import BackendConfig, BlockCache, available_profiles, load_profile, load_trace, make_workload
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
     ("replay_buffer", -1, ConfigurationError), ("seed", [], InvalidTypeError), ("seed", "\ud800", InvalidTypeError),
     ("num_blocks", None, ConfigurationError), ("encoding", "json", ConfigurationError),
     ("model", None, InvalidTypeError), ("ttft", 5, InvalidTypeError), ("port", 70000, ConfigurationError),
     ("replay_port", -1, ConfigurationError), ("host", None, InvalidTypeError)],
)  # fmt: skip
def test_fake_vllm_options_are_checked_when_given_with_errors_of_the_tree(
    option: str, value: object, error: type[Exception]
) -> None:
    with pytest.raises(error, match=option):
        FakeVLLM(**{option: value})  # type: ignore[arg-type]
