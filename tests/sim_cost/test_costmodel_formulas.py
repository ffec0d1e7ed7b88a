"""The cost model's formulas (docs/cost-model.md, "Formulas") on a hand-built toy profile with round coefficients.

The packaged profiles are checked for their properties in test_costmodel.py; here every term is computed again from
the documented formula, on numbers small enough to check by hand, so a changed coefficient, term or roofline branch
fails a test.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

import numpy as np
import pytest

from prefixroute.errors import ConfigurationError, InvalidTypeError
from prefixroute.sim import CostCoefficients, GpuSpec, ModelSpec, Profile
from prefixroute.sim.costmodel import RUNTIME_OVERHEAD_BYTES

GIB = 1024**3
# 2 layers, 4 query heads and 2 KV heads of dimension 2: a token's KV is 2 x 2 x 2 x 2 (K and V) x 2 bytes = 32 bytes.
TOY = ModelSpec("toy", 2, 8, 4, 2, 2, 16, 100, 1000, 4096)
GPU = GpuSpec("toy-gpu", 2 * GIB, 1e12, 1e14)
# Per query-key pair 4 x 4 heads x 2 dims / 64 = 0.5 s; per KV token read 32 bytes / 2 layers / 4 = 4 s.
COEFFICIENTS = CostCoefficients(
    linear_floor_s=10.0,
    linear_intercept_s=2.0,
    linear_per_token_s=0.5,
    comm_per_token_s=0.25,
    step_overhead_s=3.0,
    per_sequence_s=0.125,
    attention_flops_per_s=64.0,
    kv_read_bytes_per_s=4.0,
)


def toy(tp: int = 1) -> Profile:
    return Profile(TOY, GPU, tp, COEFFICIENTS)


def doc_attention(profile: Profile, n: int, c: int) -> float:
    """attention(n, c) = max(4 heads head_dim / tp n (c + (n + 1) / 2) / attention_flops,
    (c + n) kv_bytes_per_token / L / kv_read_bandwidth)."""
    m, k = profile.model, profile.coefficients
    compute = 4 * m.heads * m.head_dim / profile.tp * n * (c + (n + 1) / 2) / k.attention_flops_per_s
    reads = (c + n) * m.layers * m.kv_heads * m.head_dim * 2 * m.dtype_bytes / profile.tp / m.layers
    return max(compute, reads / k.kv_read_bytes_per_s)


def doc_step(profile: Profile, prefill: Sequence[tuple[int, int]], decode: Sequence[int]) -> float:
    """step(N, S) = overhead + per_sequence S + L (linear(N) + comm_per_token N + sum of attention(n_i, c_i)),
    a decoding sequence of context k being attention(1, k - 1); an empty step costs 0."""
    chunks = [(n, c) for n, c in prefill if n] + [(1, k - 1) for k in decode]
    if not chunks:
        return 0.0
    k = profile.coefficients
    tokens = sum(n for n, _ in chunks)
    linear = max(k.linear_floor_s, k.linear_intercept_s + k.linear_per_token_s * tokens)
    attention = sum(doc_attention(profile, n, c) for n, c in chunks)
    layer = linear + k.comm_per_token_s * tokens + attention
    return k.step_overhead_s + k.per_sequence_s * len(chunks) + profile.model.layers * layer


def test_the_toy_profile_s_terms_worked_by_hand() -> None:
    profile = toy()
    assert profile.kv_bytes_per_token == 32 and toy(2).kv_bytes_per_token == 16
    assert profile.name == "toy@toy-gpu/tp1"
    # 8 new tokens: compute 0.5 x 8 x 4.5 = 18 < KV reads 4 x 8 = 32; linear max(10, 2 + 4) = 10, comm 2.
    assert doc_attention(profile, 8, 0) == 32.0
    assert profile.prefill_seconds(8, 0) == 3 + 0.125 + 2 * (10 + 2 + 32)
    # 16 new tokens: compute 0.5 x 16 x 8.5 = 68 > KV reads 64; linear max(10, 2 + 8) = 10, comm 4.
    assert doc_attention(profile, 16, 0) == 68.0
    assert profile.prefill_seconds(16, 0) == 3 + 0.125 + 2 * (10 + 4 + 68)
    # 4 new tokens after 100 cached: compute 0.5 x 4 x 102.5 = 205 < KV reads 4 x 104 = 416; comm 1.
    assert profile.prefill_seconds(4, 100) == 3 + 0.125 + 2 * (10 + 1 + 416)
    # A decoding sequence of context 10 reads 10 tokens: 40 (compute would be 0.5 x 10 = 5).
    assert profile.decode_seconds(1, 10) == 3 + 0.125 + 2 * (10 + 0.25 + 40)
    # Past the floor the linear term is intercept + per_token x N: 40 tokens, 2 + 20 = 22 per layer.
    assert profile.linear_seconds(40) == 2 * 22.0
    assert profile.linear_seconds(1) == 2 * 10.0  # the floor
    assert profile.linear_seconds(0) == 0.0


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize(
    ("prefill", "decode"),
    [
        ([(8, 0)], []),
        ([(16, 0)], []),
        ([(1, 0)], []),
        ([(3, 7), (0, 50)], []),  # a chunk of no new tokens is no sequence and no work
        ([(64, 0), (5, 300)], [1, 2, 30]),
        ([], [7]),
        ([], [1, 1000, 64]),
        ([(40, 24)], [9]),
        ([], [3] * 40),  # 40 decoding sequences: past the linear floor (2 + 0.5 x 40 = 22 > 10)
        ([], []),
    ],
)
def test_a_step_costs_what_the_documented_formula_says(
    tp: int, prefill: list[tuple[int, int]], decode: list[int]
) -> None:
    profile = toy(tp)
    assert profile.step_seconds(prefill, decode) == pytest.approx(doc_step(profile, prefill, decode), rel=1e-12)
    if not prefill and decode:
        assert profile.decode_seconds(len(decode), sum(decode)) == pytest.approx(doc_step(profile, [], decode))
    if len(prefill) == 1:
        assert profile.prefill_seconds(*prefill[0]) == pytest.approx(doc_step(profile, prefill, []), rel=1e-12)


def test_a_decode_step_costs_each_sequence_by_its_context_whichever_roofline_bounds_it() -> None:
    # With reads cheaper than compute (kv_read 1000 bytes/s: 0.016 s a token, against 0.5 s a query-key pair) a
    # decoding sequence is compute-bound, and the step takes the larger of the two terms, per sequence.
    profile = Profile(TOY, GPU, 1, CostCoefficients(10.0, 2.0, 0.5, 0.25, 3.0, 0.125, 64.0, 1000.0))
    assert profile.decode_seconds(2, 30) == pytest.approx(3 + 2 * 0.125 + 2 * (10 + 0.5 + 0.5 * 30))
    assert profile.step_seconds([], [10, 20]) == pytest.approx(profile.decode_seconds(2, 30))
    assert profile.decode_seconds(0, 0) == 0.0
    with pytest.raises(ConfigurationError, match=r"^need batch_size <= total_context_tokens, not 3 > 2$"):
        profile.decode_seconds(3, 2)
    assert profile.decode_seconds(2, 2) > 0  # a context of 1 per sequence is allowed


def test_kv_capacity_is_the_budget_left_after_weights_activations_and_runtime_divided_by_a_block() -> None:
    def doc_capacity(tp: int, block: int, utilization: float, tokens: int, seqs: int) -> int:
        m = TOY
        qkv = (m.heads + 2 * m.kv_heads) * m.head_dim / tp
        activations = tokens * (4 * m.hidden_size + qkv + 3 * m.intermediate_size / tp) * m.dtype_bytes
        activations += seqs * m.vocab_size * 4 / tp  # float32 logits
        free = utilization * GPU.memory_bytes - m.params * m.dtype_bytes / tp - activations - GIB
        return max(0, math.floor(free / (block * m.layers * m.kv_heads * m.head_dim * 2 * m.dtype_bytes / tp)))

    assert RUNTIME_OVERHEAD_BYTES == GIB
    for tp in (1, 2):
        profile = toy(tp)
        assert profile.kv_capacity_blocks() == doc_capacity(tp, 16, 0.9, 8192, 256)
        assert profile.kv_capacity_blocks(1, gpu_memory_utilization=1.0) == doc_capacity(tp, 1, 1.0, 8192, 256)
        assert profile.kv_capacity_blocks(
            32, gpu_memory_utilization=0.6, max_num_batched_tokens=1000, max_num_seqs=3
        ) == doc_capacity(tp, 32, 0.6, 1000, 3)
        assert profile.kv_capacity_blocks(max_num_batched_tokens=0, max_num_seqs=0) == doc_capacity(tp, 16, 0.9, 0, 0)
    # Activations alone, by hand at tp 1: 10 tokens x (32 + 16 + 48) x 2 bytes + 3 x 100 x 4 bytes of logits.
    assert toy().activation_bytes(max_num_batched_tokens=10, max_num_seqs=3) == 10 * 96 * 2 + 1200
    assert toy().activation_bytes() == 8192 * 96 * 2 + 256 * 100 * 4  # vLLM's defaults: 8192 tokens, 256 seqs
    # Less than the runtime overhead left: nothing fits, not a negative count.
    assert toy().kv_capacity_blocks(gpu_memory_utilization=0.4) == 0
    assert toy().kv_capacity_blocks(gpu_memory_utilization=1.0) > toy().kv_capacity_blocks()  # 0.9 by default


def test_the_model_s_weight_and_linear_figures_follow_its_shape() -> None:
    assert TOY.weight_bytes == 1000 * 2
    # QKV 8 x (4 + 2 x 2) x 2 = 128, O 4 x 2 x 8 = 64, gated MLP 3 x 8 x 16 = 384.
    assert TOY.linear_params_per_layer == 128 + 64 + 384


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda p: p.linear_seconds(-1), ConfigurationError, r"^tokens must be a count \(an int >= 0\), not -1$"),
        (
            lambda p: p.decode_seconds(-2, 5),
            ConfigurationError,
            r"^batch_size must be a count \(an int >= 0\), not -2$",
        ),
        (lambda p: p.decode_seconds(1, "5"), ConfigurationError, r"^total_context_tokens must be a count .*, not '5'$"),
        (lambda p: p.activation_bytes(max_num_seqs=-1), ConfigurationError, r"^max_num_seqs must be a count .*-1$"),
        (
            lambda p: p.activation_bytes(max_num_batched_tokens=-1),
            ConfigurationError,
            r"^max_num_batched_tokens must be a count \(an int >= 0\), not -1$",
        ),
        (
            lambda p: p.kv_capacity_blocks(-1),
            ConfigurationError,
            r"^block_size must be a count \(an int >= 0\), not -1$",
        ),
        (lambda p: p.kv_capacity_blocks(0), ConfigurationError, r"^block_size must be >= 1, not 0$"),
        (
            lambda p: p.kv_capacity_blocks(gpu_memory_utilization=0.0),
            ConfigurationError,
            r"^gpu_memory_utilization must be in \(0, 1\], not 0.0$",
        ),
        (
            lambda p: p.step_seconds([(-1, 3)], []),
            ConfigurationError,
            r"^a prefill chunk needs new_tokens, cached_tokens >= 0, not \('-1', '3'\)$",
        ),
        (
            lambda p: p.step_seconds([(1, -3)], []),
            ConfigurationError,
            r"^a prefill chunk needs new_tokens, cached_tokens >= 0, not \('1', '-3'\)$",
        ),
        (lambda p: p.step_seconds([], [3, 0]), ConfigurationError, r"^a decoding sequence has a context >= 1, not 0$"),
        (lambda p: p.step_seconds([(1, 2, 3)], []), InvalidTypeError, r"^step_seconds takes prefill as \(new_tokens"),
        (
            lambda p: p.step_seconds([], [5, math.inf]),
            ConfigurationError,
            r"^a step's counts must be finite: prefill \[\], decode contexts sum inf$",
        ),
        (
            lambda p: p.step_seconds([(math.inf, 0)], []),
            ConfigurationError,
            r"^a step's counts must be finite: prefill \[\(inf, 0\)\], decode contexts sum 0$",
        ),
    ],
)
def test_a_bad_figure_is_named_in_the_error(call: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        call(toy())  # type: ignore[operator]


def test_the_constructors_name_the_field_and_the_value_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"^tp must be a power of two >= 1, not 6$"):
        Profile(TOY, GPU, 6, COEFFICIENTS)
    # A numpy int tp is kept as the Python int it stands for (the dataclass is frozen: set once, when checked).
    numpy_tp = Profile(TOY, GPU, cast(int, np.int64(2)), COEFFICIENTS)  # numpy 2.2 (Python 3.10) types it as no int
    assert type(numpy_tp.tp) is int and numpy_tp.tp == 2 and numpy_tp == toy(2)
    with pytest.raises(InvalidTypeError, match=r"^Profile gpu must be a GpuSpec, not str$"):
        Profile(TOY, "gpu", 1, COEFFICIENTS)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"^ModelSpec kv_heads must be a positive int, not 0$"):
        ModelSpec("toy", 2, 8, 4, 0, 2, 16, 100, 1000, 4096)
    with pytest.raises(InvalidTypeError, match=r"^GpuSpec name must be a str, not int$"):
        GpuSpec(1, GIB, 1.0, 1.0)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"^GpuSpec peak_bf16_flops must be a finite number > 0, not 0$"):
        GpuSpec("g", GIB, 1.0, 0)
    with pytest.raises(ConfigurationError, match=r"^CostCoefficients per_sequence_s must be a finite number >= 0, not"):
        CostCoefficients(10.0, 2.0, 0.5, 0.25, 3.0, -0.125, 64.0, 4.0)
    with pytest.raises(ConfigurationError, match=r"^CostCoefficients linear_intercept_s must be a finite number, not"):
        CostCoefficients(10.0, math.nan, 0.5, 0.25, 3.0, 0.125, 64.0, 4.0)
    with pytest.raises(InvalidTypeError, match=r"^CostCoefficients source must be a str, not int$"):
        CostCoefficients(10.0, 2.0, 0.5, 0.25, 3.0, 0.125, 64.0, 4.0, source=1)  # type: ignore[arg-type]
    # Zero is allowed where the bound is >= 0, a negative intercept where there is none.
    assert CostCoefficients(0.0, -5.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0).linear_intercept_s == -5.0
    assert ModelSpec("one", 1, 1, 1, 1, 1, 1, 1, 1, 1, 1).dtype_bytes == 1
