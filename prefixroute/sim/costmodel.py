"""GPU cost model: step time and KV capacity of one model served on one GPU type.

A :class:`Profile` answers the two questions a simulated vLLM engine asks: how long does one
continuous-batching step take (:meth:`Profile.step_seconds`), and how many KV blocks fit in GPU memory
(:meth:`Profile.kv_capacity_blocks`). The formulas are documented in ``docs/cost-model.md``; every
coefficient is fitted to measurements (Vidur operator profiles, SplitwiseSim timings) by
``python -m prefixroute.sim.costfit`` and shipped as package data, so nothing here reads files.

One step that runs ``N`` tokens of ``S`` sequences (every new prefill token plus one per decoding
sequence) costs::

    step = overhead + per_sequence * S + layers * (linear(N) + comm(N) + sum(attention(new_i, cached_i)))
    linear(N)          = max(floor, intercept + per_token * N)        # measured GEMM/norm time per layer
    comm(N)            = comm_per_token * N                           # tensor-parallel all-reduce payload
    attention(n, c)    = max(4 * heads * head_dim / tp * n * (c + (n + 1) / 2) / attention_flops,
                             (c + n) * kv_bytes_per_token_per_layer / kv_read_bandwidth)

A decoding sequence with context ``k`` is ``attention(1, k - 1)``: reading its KV cache dominates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

from prefixroute._numbers import as_float, as_int, shown
from prefixroute.errors import ConfigurationError, InvalidTypeError

__all__ = ["CostCoefficients", "GpuSpec", "ModelSpec", "Profile"]

_GIB = 1024**3
# Runtime memory vLLM cannot give to the KV cache besides weights and activations: the CUDA context,
# NCCL buffers and captured CUDA graphs (vLLM logs this as "non-torch memory" plus graph memory).
RUNTIME_OVERHEAD_BYTES = 1 * _GIB
# vLLM's sampler keeps float32 logits for up to max_num_seqs sequences during its profiling run.
_LOGIT_BYTES = 4


@dataclass(frozen=True)
class GpuSpec:
    """One GPU type: name, memory, and the datasheet figures used to transfer measurements."""

    name: str
    memory_bytes: int
    memory_bandwidth_bytes_per_s: float
    peak_bf16_flops: float

    def __post_init__(self) -> None:
        _check_name(self)
        _check_counts(self, ("memory_bytes",))
        _check_numbers(self, ("memory_bandwidth_bytes_per_s", "peak_bf16_flops"), positive=True)


@dataclass(frozen=True)
class ModelSpec:
    """One decoder-only transformer's shape (Llama family: gated MLP, rotary, optional GQA)."""

    name: str
    layers: int
    hidden_size: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    params: int
    max_context: int
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        _check_name(self)
        _check_counts(self, tuple(f.name for f in fields(self) if f.name != "name"))

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights at this model's dtype."""
        return self.params * self.dtype_bytes

    @property
    def linear_params_per_layer(self) -> int:
        """Weights of the GEMMs in one layer (QKV, O, gate, up, down): the work a token costs."""
        qkv = self.hidden_size * (self.heads + 2 * self.kv_heads) * self.head_dim
        out = self.heads * self.head_dim * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        return qkv + out + mlp


@dataclass(frozen=True)
class CostCoefficients:
    """Fitted coefficients of one profile, per GPU under its tensor-parallel degree (seconds)."""

    linear_floor_s: float
    linear_intercept_s: float
    linear_per_token_s: float
    comm_per_token_s: float
    step_overhead_s: float
    per_sequence_s: float
    attention_flops_per_s: float
    kv_read_bytes_per_s: float
    source: str = ""

    def __post_init__(self) -> None:
        _check_numbers(self, ("linear_intercept_s",), positive=None)  # a fit's intercept may be negative
        _check_numbers(
            self,
            ("linear_floor_s", "linear_per_token_s", "comm_per_token_s", "step_overhead_s", "per_sequence_s"),
            positive=False,
        )
        _check_numbers(self, ("attention_flops_per_s", "kv_read_bytes_per_s"), positive=True)
        if not isinstance(self.source, str):
            raise InvalidTypeError(f"CostCoefficients source must be a str, not {type(self.source).__name__}")


@dataclass(frozen=True)
class Profile:
    """Cost of serving ``model`` on ``tp`` GPUs of type ``gpu`` (one vLLM engine).

    All methods are pure; a step costs O(number of prefill chunks) plus one ``sum`` over the decode
    contexts. Times are seconds of wall clock for the whole engine.

    Raises:
        ConfigurationError: ``tp`` is not a power of two >= 1 (its parts check their own fields likewise).
        InvalidTypeError: ``model``, ``gpu`` or ``coefficients`` is not a ModelSpec, GpuSpec, CostCoefficients.
    """

    model: ModelSpec
    gpu: GpuSpec
    tp: int
    coefficients: CostCoefficients
    # Per-layer constants derived once from the fields above (seconds per query-key pair, per KV token).
    _query_key_s: float = field(init=False, repr=False, compare=False)
    _kv_token_s: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name, kind in (("model", ModelSpec), ("gpu", GpuSpec), ("coefficients", CostCoefficients)):
            if not isinstance(getattr(self, name), kind):
                raise InvalidTypeError(
                    f"Profile {name} must be a {kind.__name__}, not {type(getattr(self, name)).__name__}"
                )
        tp = as_int(self.tp)
        if tp is None or tp < 1 or tp & (tp - 1):
            raise ConfigurationError(f"tp must be a power of two >= 1, not {shown(self.tp)}")
        object.__setattr__(self, "tp", tp)  # a numpy int kept as the Python int it stands for (frozen)
        m, c = self.model, self.coefficients
        query_key = 4.0 * m.heads * m.head_dim / self.tp / c.attention_flops_per_s
        kv_token = self.kv_bytes_per_token / m.layers / c.kv_read_bytes_per_s
        object.__setattr__(self, "_query_key_s", query_key)
        object.__setattr__(self, "_kv_token_s", kv_token)

    @property
    def name(self) -> str:
        """``model@gpu/tpN``, e.g. ``codellama-13b@a100-40gb/tp1``."""
        return f"{self.model.name}@{self.gpu.name}/tp{self.tp}"

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one token occupies on each GPU: layers x KV heads x head dim x 2 x dtype / tp."""
        m = self.model
        return m.layers * m.kv_heads * m.head_dim * 2 * m.dtype_bytes // self.tp

    def linear_seconds(self, tokens: int) -> float:
        """Time of every layer's linear operators (GEMMs, norms, rotary) for ``tokens`` tokens, 0 for 0.

        Raises:
            ConfigurationError: ``tokens`` is not a count >= 0.
        """
        tokens = _count(tokens, "tokens")
        c = self.coefficients
        per_layer = max(c.linear_floor_s, c.linear_intercept_s + c.linear_per_token_s * tokens)
        return self.model.layers * per_layer if tokens else 0.0

    def step_seconds(self, prefill: Sequence[tuple[int, int]], decode_contexts: Sequence[int]) -> float:
        """Time of one engine step running prefill chunks and decode sequences together.

        ``prefill`` holds ``(new_tokens, cached_tokens)`` per chunk: ``new_tokens`` are computed in this
        step, ``cached_tokens`` precede them (prefix-cache hits or earlier chunks). ``decode_contexts``
        holds each decoding sequence's context length (tokens in its KV cache, >= 1, the token being
        decoded included). An empty step costs 0.

        Raises:
            InvalidTypeError: ``prefill`` is not a sequence of pairs of numbers, or ``decode_contexts`` of numbers.
            ConfigurationError: a count is negative, a context under 1, or one is NaN or infinite.

        >>> from prefixroute.sim import load_profile
        >>> profile = load_profile("codellama-13b", "a100-40gb")
        >>> miss = profile.step_seconds([(2048, 0)], [])
        >>> hit = profile.step_seconds([(64, 1984)], [])
        >>> hit < miss / 5
        True
        """
        query_key, kv_token = self._query_key_s, self._kv_token_s
        tokens = sequences = 0
        attention = 0.0
        try:  # the engine's own calls pass plain ints: checked by comparisons, and the result's finiteness at the end
            for new, cached in prefill:
                if not (new >= 0 and cached >= 0):
                    raise ConfigurationError(
                        f"a prefill chunk needs new_tokens, cached_tokens >= 0, not {(shown(new), shown(cached))}"
                    )
                if new:
                    tokens += new
                    sequences += 1
                    attention += max(query_key * new * (cached + (new + 1) / 2), kv_token * (cached + new))
            if decode_contexts:
                if not min(decode_contexts) >= 1:
                    raise ConfigurationError(
                        f"a decoding sequence has a context >= 1, not {shown(min(decode_contexts))}"
                    )
                # Each sequence is attention(1, context - 1); both roofline terms are proportional to the
                # context, so the sum of the maxima is the maximum of the sums.
                tokens += len(decode_contexts)
                sequences += len(decode_contexts)
                attention += max(query_key, kv_token) * sum(decode_contexts)
        except ConfigurationError:
            raise
        except (TypeError, ValueError) as exc:  # ValueError: a chunk that is not a pair
            raise InvalidTypeError(
                "step_seconds takes prefill as (new_tokens, cached_tokens) pairs of counts and decode_contexts as "
                f"counts: {exc}"
            ) from None
        if tokens == 0:
            return 0.0
        c = self.coefficients
        linear = max(c.linear_floor_s, c.linear_intercept_s + c.linear_per_token_s * tokens)
        per_layer = linear + c.comm_per_token_s * tokens + attention
        seconds = c.step_overhead_s + c.per_sequence_s * sequences + self.model.layers * per_layer
        if not math.isfinite(seconds):  # a NaN or infinite count, which every comparison above let through
            raise ConfigurationError(f"a step's counts must be finite: prefill {prefill!r:.80}, decode contexts sum "
                                     f"{shown(sum(decode_contexts) if decode_contexts else 0)}")  # fmt: skip
        return seconds

    def prefill_seconds(self, new_tokens: int, cached_tokens: int) -> float:
        """Time to prefill ``new_tokens`` after ``cached_tokens`` already cached, alone in one step.

        ``new_tokens == 0`` costs 0 (vLLM always recomputes at least the last prompt token, so an
        engine passes ``new_tokens >= 1`` even on a full hit).
        """
        return self.step_seconds(((new_tokens, cached_tokens),), ())

    def decode_seconds(self, batch_size: int, total_context_tokens: int) -> float:
        """Time of one decode step for ``batch_size`` sequences holding ``total_context_tokens`` in all.

        Equal to :meth:`step_seconds` with those sequences only.

        Raises:
            ConfigurationError: unless both are counts and ``0 <= batch_size <= total_context_tokens``.
        """
        batch_size = _count(batch_size, "batch_size")
        total_context_tokens = _count(total_context_tokens, "total_context_tokens")
        if total_context_tokens < batch_size:
            raise ConfigurationError(
                f"need batch_size <= total_context_tokens, not {batch_size} > {total_context_tokens}"
            )
        if batch_size == 0:
            return 0.0
        c = self.coefficients
        linear = max(c.linear_floor_s, c.linear_intercept_s + c.linear_per_token_s * batch_size)
        attention = max(self._query_key_s, self._kv_token_s) * total_context_tokens
        per_layer = linear + c.comm_per_token_s * batch_size + attention
        return c.step_overhead_s + c.per_sequence_s * batch_size + self.model.layers * per_layer

    def activation_bytes(self, *, max_num_batched_tokens: int = 8192, max_num_seqs: int = 256) -> int:
        """Peak activation memory of vLLM's profiling forward pass on each GPU (an estimate).

        Residual stream and norms (4 x hidden), the QKV output, and the gated MLP's gate/up/down
        intermediates, for ``max_num_batched_tokens`` tokens; plus float32 logits for ``max_num_seqs``.

        Raises:
            ConfigurationError: either is not a count >= 0.
        """
        max_num_batched_tokens = _count(max_num_batched_tokens, "max_num_batched_tokens")
        max_num_seqs = _count(max_num_seqs, "max_num_seqs")
        m = self.model
        qkv = (m.heads + 2 * m.kv_heads) * m.head_dim // self.tp
        per_token = (4 * m.hidden_size + qkv + 3 * m.intermediate_size // self.tp) * m.dtype_bytes
        logits = max_num_seqs * m.vocab_size * _LOGIT_BYTES // self.tp
        return max_num_batched_tokens * per_token + logits

    def kv_capacity_blocks(
        self,
        block_size: int = 16,
        *,
        gpu_memory_utilization: float = 0.9,
        max_num_batched_tokens: int = 8192,
        max_num_seqs: int = 256,
    ) -> int:
        """KV blocks that fit on each GPU, as vLLM sizes ``num_gpu_blocks`` (0 if none fit).

        ``utilization x memory - weights / tp - activations - runtime overhead``, divided by the
        bytes of one block.

        Raises:
            ConfigurationError: ``block_size`` is not a count >= 1, ``gpu_memory_utilization`` not a number in
                (0, 1], or a count of :meth:`activation_bytes` is bad.
        """
        block_size = _count(block_size, "block_size")
        if block_size < 1:
            raise ConfigurationError(f"block_size must be >= 1, not {block_size}")
        utilization = as_float(gpu_memory_utilization)
        if utilization is None or not 0.0 < utilization <= 1.0:
            raise ConfigurationError(f"gpu_memory_utilization must be in (0, 1], not {shown(gpu_memory_utilization)}")
        gpu_memory_utilization = utilization
        budget = int(self.gpu.memory_bytes * gpu_memory_utilization)
        used = self.model.weight_bytes // self.tp + RUNTIME_OVERHEAD_BYTES
        used += self.activation_bytes(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs)
        free = budget - used
        return max(0, free // (self.kv_bytes_per_token * block_size))


def _count(value: object, name: str) -> int:
    count = as_int(value)
    if count is None or count < 0:
        raise ConfigurationError(f"{name} must be a count (an int >= 0), not {shown(value)}")
    return count


def _check_name(spec: GpuSpec | ModelSpec) -> None:
    if not isinstance(spec.name, str):
        raise InvalidTypeError(f"{type(spec).__name__} name must be a str, not {type(spec.name).__name__}")


def _check_counts(spec: GpuSpec | ModelSpec, names: tuple[str, ...]) -> None:
    """Refuse a field of ``names`` that is not a positive int; keep a numpy int as the Python int it stands for."""
    for name in names:
        value = getattr(spec, name)
        count = as_int(value)
        if count is None or count < 1:
            raise ConfigurationError(f"{type(spec).__name__} {name} must be a positive int, not {shown(value)}")
        object.__setattr__(spec, name, count)


def _check_numbers(spec: object, names: tuple[str, ...], *, positive: bool | None) -> None:
    """Refuse a field of ``names`` that is not a finite number: > 0 (``positive``), >= 0 (False) or any (None); keep
    a numpy float (or any real number) as the plain float it stands for."""
    for name in names:
        value = getattr(spec, name)
        number = as_float(value)
        if number is None or (positive and number <= 0) or (positive is False and number < 0):
            bound = {True: " > 0", False: " >= 0", None: ""}[positive]
            raise ConfigurationError(f"{type(spec).__name__} {name} must be a finite number{bound}, not {shown(value)}")
        object.__setattr__(spec, name, number)
