"""Properties of the cost model that hold for every packaged profile."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import cast

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixroute.errors import ConfigurationError, InvalidTypeError, PrefixRouteError
from prefixroute.sim import Profile, available_profiles, load_profile
from prefixroute.sim.costmodel import RUNTIME_OVERHEAD_BYTES
from prefixroute.sim.profiles import GPUS, MODELS, TP_DEGREES

PAIRS = available_profiles()
tokens = st.integers(min_value=1, max_value=32768)
cached = st.integers(min_value=0, max_value=32768)
pair = st.sampled_from(PAIRS)


def test_every_model_and_gpu_has_a_profile() -> None:
    assert sorted(PAIRS) == sorted((m, g) for m in MODELS for g in GPUS)
    assert {"llama-3-8b", "codellama-13b", "codellama-34b", "llama-2-70b"} <= set(MODELS)


@settings(max_examples=60, deadline=None)
@given(pair, tokens, tokens, cached)
def test_more_new_tokens_never_cheaper(names: tuple[str, str], a: int, b: int, c: int) -> None:
    profile = load_profile(*names)
    low, high = sorted((a, b))
    assert profile.prefill_seconds(low, c) <= profile.prefill_seconds(high, c)


@settings(max_examples=60, deadline=None)
@given(pair, tokens, st.integers(min_value=16, max_value=32768))
def test_cached_tokens_cost_less_than_recomputing_them(names: tuple[str, str], new: int, hit: int) -> None:
    profile = load_profile(*names)
    assert profile.prefill_seconds(new, hit) <= profile.prefill_seconds(new + hit, 0)
    if new + hit >= 1024 and hit >= new:  # past the memory-bound floor a hit must save real time
        assert profile.prefill_seconds(new, hit) < 0.9 * profile.prefill_seconds(new + hit, 0)


@settings(max_examples=60, deadline=None)
@given(pair, st.integers(1, 256), st.integers(1, 256), st.integers(1, 8192))
def test_decode_grows_with_batch_and_context(names: tuple[str, str], b1: int, b2: int, per_seq: int) -> None:
    profile = load_profile(*names)
    low, high = sorted((b1, b2))
    assert profile.decode_seconds(low, low * per_seq) <= profile.decode_seconds(high, high * per_seq)
    assert profile.decode_seconds(low, low * per_seq) <= profile.decode_seconds(low, low * per_seq + 1000)


@settings(max_examples=60, deadline=None)
@given(pair, st.lists(st.tuples(tokens, cached), max_size=4), st.lists(st.integers(1, 16384), max_size=64))
def test_step_is_at_least_each_part_and_at_most_their_sum(
    names: tuple[str, str], prefill: list[tuple[int, int]], decode: list[int]
) -> None:
    profile = load_profile(*names)
    whole = profile.step_seconds(prefill, decode)
    parts = [profile.step_seconds([chunk], []) for chunk in prefill] + [profile.step_seconds([], decode)]
    assert whole >= max(parts) * (1 - 1e-12)
    assert whole <= sum(parts) * (1 + 1e-12)
    assert profile.step_seconds([], decode) == pytest.approx(
        profile.decode_seconds(len(decode), sum(decode)) if decode else 0.0
    )


@settings(max_examples=80, deadline=None)
@given(pair, tokens, tokens, cached)
def test_chunked_prefill_is_never_cheaper_than_one_chunk(names: tuple[str, str], a: int, b: int, c: int) -> None:
    profile = load_profile(*names)
    chunked = profile.prefill_seconds(a, c) + profile.prefill_seconds(b, c + a)
    assert chunked >= profile.prefill_seconds(a + b, c) * (1 - 1e-12)


def test_empty_step_is_free_and_negative_counts_are_rejected() -> None:
    profile = load_profile("llama-3-8b", "h100-80gb")
    assert profile.step_seconds([], []) == 0.0
    with pytest.raises(ValueError, match="new_tokens"):
        profile.step_seconds([(-1, 0)], [])
    with pytest.raises(ValueError, match="context"):
        profile.step_seconds([], [0])


@pytest.mark.parametrize("gpu", sorted(GPUS))
def test_capacity_positive_and_smaller_for_bigger_models(gpu: str) -> None:
    per_gpu = {}
    for model in ("llama-2-7b", "codellama-13b", "codellama-34b", "llama-2-70b"):
        profile = load_profile(model, gpu, tp=8)
        per_gpu[model] = profile.kv_capacity_blocks() * profile.kv_bytes_per_token
        assert load_profile(model, gpu).kv_capacity_blocks() > 0
    assert per_gpu["llama-2-7b"] > per_gpu["codellama-13b"] > per_gpu["codellama-34b"] > per_gpu["llama-2-70b"]


def test_kv_bytes_per_token_follows_the_shape() -> None:
    profile = load_profile("llama-2-70b", "a100-80gb", tp=2)
    assert profile.kv_bytes_per_token == 80 * 8 * 128 * 2 * 2 // 2
    assert load_profile("codellama-13b", "a100-40gb", tp=1).kv_bytes_per_token == 40 * 40 * 128 * 2 * 2


@pytest.mark.parametrize(
    ("model", "gpu", "tp"),
    [
        ("llama-2-70b", "a100-40gb", 4),
        ("llama-2-70b", "a100-80gb", 2),
        ("llama-2-70b", "h100-80gb", 2),
        ("codellama-34b", "a100-40gb", 2),
        ("codellama-34b", "a100-80gb", 1),
        ("codellama-13b", "a100-40gb", 1),
        ("llama-3-8b", "a100-40gb", 1),
    ],
)
def test_tp_is_the_smallest_power_of_two_that_fits(model: str, gpu: str, tp: int) -> None:
    profile = load_profile(model, gpu)
    assert profile.tp == tp
    smaller = [load_profile(model, gpu, tp=d) for d in TP_DEGREES if d < tp]
    assert all(p.kv_capacity_blocks(1) < 4096 for p in smaller)


def test_unknown_names_list_the_valid_ones() -> None:
    with pytest.raises(ConfigurationError, match="codellama-13b"):
        load_profile("gpt-5", "a100-40gb")
    with pytest.raises(ConfigurationError, match="h100-80gb"):
        load_profile("codellama-13b", "tpu-v5")
    with pytest.raises(ConfigurationError, match=r"valid tp: \[1, 2, 4, 8\]"):
        load_profile("codellama-13b", "a100-40gb", tp=3)


def test_profile_rejects_a_non_power_of_two_tp() -> None:
    good = load_profile("llama-2-7b", "a100-80gb")
    with pytest.raises(ValueError, match="power of two"):
        Profile(good.model, good.gpu, 3, good.coefficients)


@settings(max_examples=60, deadline=None)
@given(pair, st.floats(0.5, 0.95), st.floats(0.5, 0.95), st.sampled_from([8, 16, 32]))
def test_capacity_grows_with_memory_utilization_and_is_counted_in_tokens(
    names: tuple[str, str], u1: float, u2: float, block_size: int
) -> None:
    profile = load_profile(*names)
    low, high = sorted((u1, u2))
    assert profile.kv_capacity_blocks(gpu_memory_utilization=low) <= profile.kv_capacity_blocks(
        gpu_memory_utilization=high
    )
    tokens = profile.kv_capacity_blocks(1, gpu_memory_utilization=high)
    assert profile.kv_capacity_blocks(block_size, gpu_memory_utilization=high) == tokens // block_size
    # Whenever a KV cache fits, it plus weights, activations and runtime overhead stays within budget.
    used = tokens * profile.kv_bytes_per_token + profile.model.weight_bytes // profile.tp + profile.activation_bytes()
    assert tokens == 0 or used + RUNTIME_OVERHEAD_BYTES <= high * profile.gpu.memory_bytes


def test_capacity_rejects_bad_arguments() -> None:
    profile = load_profile("llama-3-8b", "a100-80gb")
    with pytest.raises(ValueError, match="block_size"):
        profile.kv_capacity_blocks(0)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        profile.kv_capacity_blocks(gpu_memory_utilization=1.5)
    assert profile.kv_capacity_blocks(max_num_batched_tokens=65536) < profile.kv_capacity_blocks()


def test_a_profile_is_its_model_gpu_and_coefficients() -> None:
    from prefixroute.sim import CostCoefficients, GpuSpec, ModelSpec

    loaded = load_profile("llama-2-7b", "a100-80gb")
    assert isinstance(loaded.model, ModelSpec) and isinstance(loaded.gpu, GpuSpec)
    assert isinstance(loaded.coefficients, CostCoefficients)
    built = Profile(MODELS["llama-2-7b"], GPUS["a100-80gb"], loaded.tp, loaded.coefficients)
    assert built == loaded and built.step_seconds([(512, 0)], [100]) == loaded.step_seconds([(512, 0)], [100])


def _bad_parts() -> list[tuple[str, Callable[[], object]]]:
    good = load_profile("llama-2-7b", "a100-80gb")
    model, gpu, coefficients = good.model, good.gpu, good.coefficients
    return [
        ("tp 3", lambda: Profile(model, gpu, 3, coefficients)),
        ("tp 0", lambda: Profile(model, gpu, 0, coefficients)),
        ("tp 2.0", lambda: Profile(model, gpu, 2.0, coefficients)),  # type: ignore[arg-type]
        ("tp str", lambda: Profile(model, gpu, "1", coefficients)),  # type: ignore[arg-type]
        ("no model", lambda: Profile(None, gpu, 1, coefficients)),  # type: ignore[arg-type]
        ("no gpu", lambda: Profile(model, "a100", 1, coefficients)),  # type: ignore[arg-type]
        ("no coefficients", lambda: Profile(model, gpu, 1, {})),  # type: ignore[arg-type]
        ("layers 0", lambda: replace(model, layers=0)),
        ("heads -1", lambda: replace(model, heads=-1)),
        ("head_dim 1.5", lambda: replace(model, head_dim=1.5)),  # type: ignore[arg-type]
        ("name", lambda: replace(model, name=None)),  # type: ignore[arg-type]
        ("memory -1", lambda: replace(gpu, memory_bytes=-1)),
        ("bandwidth nan", lambda: replace(gpu, memory_bandwidth_bytes_per_s=math.nan)),
        ("flops str", lambda: replace(gpu, peak_bf16_flops="1e12")),  # type: ignore[arg-type]
        ("attention nan", lambda: replace(coefficients, attention_flops_per_s=math.nan)),
        ("attention 0", lambda: replace(coefficients, attention_flops_per_s=0.0)),
        ("overhead inf", lambda: replace(coefficients, step_overhead_s=math.inf)),
        ("per token -1", lambda: replace(coefficients, linear_per_token_s=-1.0)),
        ("intercept None", lambda: replace(coefficients, linear_intercept_s=None)),  # type: ignore[arg-type]
        ("source", lambda: replace(coefficients, source=3)),  # type: ignore[arg-type]
    ]


@pytest.mark.parametrize("case", [name for name, _ in _bad_parts()])
def test_a_hand_built_profile_is_refused_with_an_error_of_the_tree_when_made(case: str) -> None:
    """GpuSpec, ModelSpec, CostCoefficients and Profile are public constructors (docs/cost-model.md): a value they
    cannot use is a ConfigurationError (a ValueError) or an InvalidTypeError (a TypeError) when given, never a bare
    ValueError, ZeroDivisionError or AttributeError, nor a NaN step time later."""
    build = dict(_bad_parts())[case]
    with pytest.raises((ConfigurationError, InvalidTypeError)):
        build()


@pytest.mark.parametrize("bad", [None, "8", math.nan, math.inf, -1, [1]])
def test_every_figure_a_profile_is_asked_about_is_checked(bad: object) -> None:
    # Was: None or a str raised Python's TypeError from a comparison, a NaN or an infinite count came back as a NaN
    # or infinite time, and the checks that did hold raised a bare ValueError.
    profile = load_profile("llama-3-8b", "a100-80gb")
    calls: list[Callable[[], object]] = [
        lambda: profile.linear_seconds(bad),  # type: ignore[arg-type]
        lambda: profile.prefill_seconds(bad, 0),  # type: ignore[arg-type]
        lambda: profile.prefill_seconds(16, bad),  # type: ignore[arg-type]
        lambda: profile.step_seconds([(16, 0), (bad, 0)], []),  # type: ignore[list-item]
        lambda: profile.step_seconds([], [5, bad]),  # type: ignore[list-item]
        lambda: profile.step_seconds([bad], []),  # type: ignore[list-item]
        lambda: profile.step_seconds(bad, []),  # type: ignore[arg-type]
        lambda: profile.decode_seconds(bad, 100),  # type: ignore[arg-type]
        lambda: profile.decode_seconds(1, bad),  # type: ignore[arg-type]
        lambda: profile.activation_bytes(max_num_seqs=bad),  # type: ignore[arg-type]
        lambda: profile.kv_capacity_blocks(bad),  # type: ignore[arg-type]
        lambda: profile.kv_capacity_blocks(gpu_memory_utilization=bad),  # type: ignore[arg-type]
    ]
    for call in calls:
        with pytest.raises(PrefixRouteError):
            call()
    assert profile.step_seconds([(16, 0)], [5]) > 0 and profile.decode_seconds(cast(int, np.int64(2)), 10) > 0
