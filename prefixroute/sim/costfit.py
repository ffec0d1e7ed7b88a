"""Fit the cost-model coefficients to Vidur and SplitwiseSim measurements; writes the packaged profiles.

Not used at run time. Regenerate the package data (and optionally the calibration plot) with::

    python -m prefixroute.sim.costfit --data data --out prefixroute/sim/data [--plot docs/cost-model-calibration.png]
    python -m prefixroute.sim.costfit --data data --check     # exit 1 if the package data is stale

It writes only to an explicit ``--out`` (without it, and without ``--check``, it refuses: exit 2), so a stray run
never overwrites the installed package data.

``--check`` compares every number of a refit with the packaged one within a relative tolerance (default 1e-5:
numpy and BLAS builds differ in the last digits of a least-squares fit, ~2e-7 here), and every string and key
exactly. Exit status: 0 up to date, 1 stale (the differences are listed), 2 bad input (a usage error, a missing or
malformed data folder, an output that cannot be written; one line on stderr).

Method (see docs/cost-model.md): per (GPU, model, tp) the measured per-layer linear-operator time of
Vidur's ``mlp.csv`` is fitted by ``max(floor, intercept + per_token * n)``; missing combinations are
derived (13B by log-log interpolation between 7B and 34B in per-layer weights; H100 Llama-3-8B and
Llama-2-70B by the H100/A100 ratio of Llama-2-7B and CodeLlama-34B; A100-40GB by scaling the
memory-bound terms by the HBM bandwidth ratio). The terms Vidur's snapshot lacks (attention, all-reduce,
per-step overhead) are fitted by linear least squares on relative error to SplitwiseSim's measured
Llama-2-70B prefill and decode times, per GPU family, and shared by every model on that family.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import MappingProxyType

import numpy as np
import numpy.typing as npt

from prefixroute._numbers import as_float, as_int
from prefixroute.errors import ConfigurationError, InvalidTypeError, PrefixRouteError
from prefixroute.sim.calibration import Measurement
from prefixroute.sim.costmodel import CostCoefficients, ModelSpec
from prefixroute.sim.costplot import plot_calibration
from prefixroute.sim.profiles import GPUS, MODELS, TP_DEGREES

__all__ = ["LinearFit", "Measurement", "compare_files", "fit_linear", "fit_profiles", "main"]

_VIDUR_FILES = MappingProxyType(
    {
        "llama-2-7b": "Llama-2-7b-hf__mlp.csv",
        "llama-3-8b": "Meta-Llama-3-8B__mlp.csv",
        "codellama-34b": "CodeLlama-34b-Instruct-hf__mlp.csv",
        "llama-2-70b": "Llama-2-70b-hf__mlp.csv",
    }
)
_VIDUR_OPS = (
    "input_layernorm",
    "attn_pre_proj",
    "attn_rope",
    "attn_post_proj",
    "post_attention_layernorm",
    "mlp_up_proj",
    "mlp_act",
    "mlp_down_proj",
    "add",
)
_FAMILY_OF = MappingProxyType({"a100-80gb": "a100", "a100-40gb": "a100", "h100-80gb": "h100"})
_FLOOR_MAX_TOKENS = 16  # tokens at or below this are memory-bound: weight reads dominate
_SLOPE_MIN_TOKENS = 512  # tokens at or above this are compute-bound
_OUTLIER = 0.5  # SplitwiseSim rows the first fit misses by more than 50 % are dropped (and reported)
_CALIBRATION_POINTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096)


@dataclass(frozen=True)
class LinearFit:
    """Per-layer linear-operator time ``max(floor, intercept + per_token * n)`` in seconds."""

    floor: float
    intercept: float
    per_token: float

    def __call__(self, tokens: float) -> float:
        return max(self.floor, self.intercept + self.per_token * tokens)


def fit_linear(points: Sequence[tuple[int, float]]) -> LinearFit:
    """Fit ``max(floor, intercept + per_token * n)`` to ``(n, seconds)`` points.

    The floor is the median time at ``n <= 16``; intercept and slope (both >= 0, so that splitting a
    batch never makes it cheaper) minimise the relative squared error over ``n >= 512``.
    Raises :class:`~prefixroute.ConfigurationError` (a ValueError) when either range has fewer than 1 / 2 points,
    or a point is no pair of a positive int (tokens) and a positive finite number (seconds).
    """
    for point in points:
        n, t = (as_int(point[0]), as_float(point[1])) if isinstance(point, tuple) and len(point) == 2 else (None, None)
        if n is None or t is None or n <= 0 or t <= 0:
            raise ConfigurationError(
                "fit_linear needs (tokens, seconds) points of a positive int and a positive finite number, "
                f"not {point!r}"
            )
    low = [t for n, t in points if n <= _FLOOR_MAX_TOKENS]
    high = [(n, t) for n, t in points if n >= _SLOPE_MIN_TOKENS]
    if not low or len(high) < 2:
        raise ConfigurationError(f"need points at n <= {_FLOOR_MAX_TOKENS} and >= 2 at n >= {_SLOPE_MIN_TOKENS}")
    design = np.array([[1.0 / t, n / t] for n, t in high])
    intercept, per_token = _nonnegative_lstsq(design, np.ones(len(high)))
    return LinearFit(float(statistics.median(low)), float(intercept), float(per_token))


def _positive(row: dict[str, str], column: str, convert: Callable[[str], float], where: str) -> float:
    """``row[column]`` as a positive finite number; a ConfigurationError naming the file, line and column if not.

    A NaN, an infinity, zero or a negative figure is no measurement: in a median a NaN sorts anywhere (the fit
    would depend on the rows' order), and the others fit a cost model that no engine has.
    """
    text = row[column]
    try:
        value = convert(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        kind = "whole" if convert is int else "finite"
        raise ConfigurationError(f"{where}: {column} must be a positive {kind} number, not {text!r}")
    return value


def _count(row: dict[str, str], column: str, where: str) -> int:
    return int(_positive(row, column, int, where))


def _rows(path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """The rows of the CSV file ``path`` (UTF-8), each with its ``file:line``; a ConfigurationError naming the file
    for text that is not UTF-8 or CSV, and naming the line for a row with fewer or more fields than the header."""
    try:
        with path.open(newline="", encoding="utf-8") as handle:
            reader = csv.DictReader(handle)
            for row in reader:
                where = f"{path}:{reader.line_num}"
                if None in row or None in row.values():
                    fields = len(reader.fieldnames or ())
                    raise ConfigurationError(f"{where}: a row must have the header's {fields} fields")
                yield where, row
    except (UnicodeDecodeError, csv.Error) as exc:
        raise ConfigurationError(f"{path}: {exc}") from exc


def read_vidur(data: Path) -> list[Measurement]:
    """Median per-layer linear time (all ops but the embedding) by GPU family, model, tp and tokens.

    Raises:
        ConfigurationError: a profiling file is there but is no regular file (a folder, a FIFO, a device), is not
            UTF-8 CSV, has a row with another number of fields than its header, or a time or count in it is no
            positive number.
    """
    out: list[Measurement] = []
    for family in ("a100", "h100"):
        for model, filename in _VIDUR_FILES.items():
            path = data / "vidur-profiling" / family / filename
            if not path.exists():
                continue
            if not path.is_file():  # a FIFO would hang the fit, a device never end it
                raise ConfigurationError(f"{path} is not a regular file: --data must hold the profiling CSVs")
            samples: dict[tuple[int, int], list[float]] = defaultdict(list)
            for where, row in _rows(path):
                ms = sum(_positive(row, f"time_stats.{op}.median", float, where) for op in _VIDUR_OPS)
                tp, tokens = (_count(row, column, where) for column in ("num_tensor_parallel_workers", "num_tokens"))
                samples[(tp, tokens)].append(ms)
            for (tp, tokens), values in sorted(samples.items()):
                seconds = statistics.median(values) / 1e3
                out.append(Measurement("vidur", "linear", model, family, tp, tokens, 1, seconds))
    return out


def read_splitwise(data: Path) -> list[Measurement]:
    """Median Llama-2-70B prefill and decode-step times per configuration (A100-80GB, H100-80GB).

    Raises:
        ConfigurationError: the file is not UTF-8 CSV, has a row with another number of fields than its header, or
            a time or count of a row it fits is no positive number.
    """
    prefill: dict[tuple[str, int, int, int], list[float]] = defaultdict(list)
    decode: dict[tuple[str, int, int, int], list[float]] = defaultdict(list)
    path = data / "splitwise-sim" / "perf_model.csv"
    for where, row in _rows(path):
        if row["model"] != "llama2-70b" or row["hardware"] not in ("a100-80gb", "h100-80gb"):
            continue
        family = _FAMILY_OF[row["hardware"]]
        tp, prompt, batch, generated = (
            _count(row, column, where) for column in ("tensor_parallel", "prompt_size", "batch_size", "token_size")
        )
        prefill[(family, tp, prompt, batch)].append(_positive(row, "prompt_time", float, where) / 1e3)
        # Mean context over the generation of token_size tokens after the prompt.
        context = prompt + generated // 2
        decode[(family, tp, context, batch)].append(_positive(row, "token_time", float, where) / 1e3)
    out = [
        Measurement("splitwise", "prefill", "llama-2-70b", f, tp, p, b, statistics.median(v))
        for (f, tp, p, b), v in sorted(prefill.items())
    ]
    out += [
        Measurement("splitwise", "decode", "llama-2-70b", f, tp, k, b, statistics.median(v))
        for (f, tp, k, b), v in sorted(decode.items())
    ]
    return out


def _interpolate(low: LinearFit, high: LinearFit, weight: float) -> LinearFit:
    """Log-log interpolation of floor and slope, linear of intercept; ``weight`` 0 -> low, 1 -> high."""

    def geo(a: float, b: float) -> float:
        return math.exp((1 - weight) * math.log(a) + weight * math.log(b))

    intercept = (1 - weight) * low.intercept + weight * high.intercept
    return LinearFit(geo(low.floor, high.floor), intercept, geo(low.per_token, high.per_token))


def _ratio(target: LinearFit, numerator: LinearFit, denominator: LinearFit) -> LinearFit:
    """``target`` scaled term by term by ``numerator / denominator`` (e.g. H100 over A100)."""
    return LinearFit(
        target.floor * numerator.floor / denominator.floor,
        target.intercept * numerator.per_token / denominator.per_token,
        target.per_token * numerator.per_token / denominator.per_token,
    )


def linear_fits(vidur: Iterable[Measurement]) -> dict[tuple[str, str, int], tuple[LinearFit, str]]:
    """Fitted or derived linear coefficients for every (family, model, tp), with how each was made."""
    points: dict[tuple[str, str, int], list[tuple[int, float]]] = defaultdict(list)
    for m in vidur:
        points[(m.gpu, m.model, m.tp)].append((m.tokens, m.seconds))
    fits = {key: (fit_linear(pts), "Vidur mlp.csv") for key, pts in points.items()}
    for family in ("a100", "h100"):
        for tp in TP_DEGREES:
            low, high = fits[(family, "llama-2-7b", tp)][0], fits[(family, "codellama-34b", tp)][0]
            w7, w13, w34 = (
                math.log(MODELS[name].linear_params_per_layer)
                for name in ("llama-2-7b", "codellama-13b", "codellama-34b")
            )
            fits[(family, "codellama-13b", tp)] = (
                _interpolate(low, high, (w13 - w7) / (w34 - w7)),
                "log-log interpolation of Vidur llama-2-7b and codellama-34b by per-layer weights",
            )
    for tp in TP_DEGREES:
        for model, reference in (("llama-3-8b", "llama-2-7b"), ("llama-2-70b", "codellama-34b")):
            if ("h100", model, tp) not in fits:
                a100, h100_ref, a100_ref = (
                    fits[key][0] for key in (("a100", model, tp), ("h100", reference, tp), ("a100", reference, tp))
                )
                fits[("h100", model, tp)] = (
                    _ratio(a100, h100_ref, a100_ref),
                    f"Vidur A100 {model} x H100/A100 ratio of {reference}",
                )
    return fits


def _tp_latency_factor(tp: int) -> float:
    """Latency steps of a ring all-reduce over ``tp`` GPUs, up to a constant: ``2 (tp - 1)`` hops."""
    return tp - 1.0


def _comm_bytes_per_token(model: ModelSpec, tp: int) -> float:
    """Bytes each GPU moves per token and layer in the two ring all-reduces of tensor parallelism."""
    return 2 * 2 * (tp - 1) / tp * model.hidden_size * model.dtype_bytes


@dataclass(frozen=True)
class SharedTerms:
    """Terms fitted to SplitwiseSim per GPU family and shared by every model on it."""

    step_overhead_s: float  # per step, any tp
    allreduce_latency_s: float  # per layer and (tp - 1)
    comm_s_per_byte: float
    per_sequence_s: float
    attention_flops_per_s: float
    rows_used: int
    rows_dropped: int


def fit_shared_terms(
    splitwise: Sequence[Measurement], linear: dict[tuple[str, str, int], tuple[LinearFit, str]], family: str
) -> SharedTerms:
    """Least squares (relative error) of overhead, all-reduce, attention and per-sequence terms on Llama-2-70B.

    Raises :class:`~prefixroute.ConfigurationError` (a ValueError) when no SplitwiseSim rows exist for ``family``.
    """
    model = MODELS["llama-2-70b"]
    # Batched prefill rows (batch > 1) are left out: SplitwiseSim's engine ran them slower than the
    # same tokens as one prompt (e.g. 16 x 512 > 1 x 8192), which vLLM's flat-token batching does not do.
    rows = [m for m in splitwise if m.gpu == family and (m.kind == "decode" or m.batch == 1)]
    if not rows:
        raise ConfigurationError(f"no SplitwiseSim rows for {family}")
    layers = model.layers
    kv_layer = model.kv_heads * model.head_dim * 2 * model.dtype_bytes
    design, target = [], []
    for m in rows:
        lin = linear[(family, model.name, m.tp)][0]
        if m.kind == "prefill":  # attention is compute-bound: FLOPs of a causal prompt, fitted throughput
            tokens, kv_read = m.batch * m.tokens, 0.0
            attention_flops = m.batch * 4.0 * model.heads * model.head_dim / m.tp * m.tokens * (m.tokens + 1) / 2
        else:  # attention reads every context token's KV at the layer's measured streaming bandwidth
            tokens, attention_flops = m.batch, 0.0
            kv_read = m.batch * m.tokens * kv_layer / m.tp / streaming_bandwidth(model, m.tp, lin.floor)
        known = layers * (lin(tokens) + kv_read)
        features = [
            1.0,
            layers * _tp_latency_factor(m.tp),
            layers * tokens * _comm_bytes_per_token(model, m.tp),
            layers * attention_flops,
            float(m.batch),
        ]
        design.append([f / m.seconds for f in features])
        target.append((m.seconds - known) / m.seconds)
    a, b = np.array(design), np.array(target)
    keep = np.ones(len(rows), dtype=bool)
    for _ in range(2):  # fit, drop gross outliers (inconsistent measurements), refit
        x = _nonnegative_lstsq(a[keep], b[keep])
        predicted_rel = a @ x + (1 - b)  # predicted / measured
        keep = np.abs(predicted_rel - 1) <= _OUTLIER
    return SharedTerms(
        float(x[0]), float(x[1]), float(x[2]), float(x[4]), 1.0 / float(x[3]), int(keep.sum()), int((~keep).sum())
    )


def streaming_bandwidth(model: ModelSpec, tp: int, floor_s: float) -> float:
    """Effective HBM bandwidth a memory-bound layer reaches: its weights per GPU over the measured floor.

    Paged attention in decode streams KV blocks the same way, so this is the KV read bandwidth.
    """
    return model.linear_params_per_layer * model.dtype_bytes / tp / floor_s


def _nonnegative_lstsq(a: npt.NDArray[np.float64], b: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """Least squares with every coefficient >= 0: clamp the most negative one to 0 and refit."""
    free = list(range(a.shape[1]))
    while True:
        x = np.zeros(a.shape[1])
        solution, *_ = np.linalg.lstsq(a[:, free], b, rcond=None)
        x[free] = solution
        if (x >= 0).all():
            return x
        free.remove(int(np.argmin(x)))


def fit_profiles(
    data: str | os.PathLike[str],
) -> tuple[list[dict[str, object]], list[Measurement], dict[str, SharedTerms]]:
    """Fit every (model, gpu, tp) profile to the measurements in the folder ``data`` (the repository's ``data/``);
    returns the JSON entries, the measurements and shared terms.

    Raises:
        InvalidTypeError: ``data`` is not a str or a path.
        ConfigurationError: ``data`` is an empty or blank name (which would be the current folder), or its files
            cannot be fitted (a column or a combination missing, text that is not UTF-8, a measurement that is no
            positive number); the message names the folder or the file and line.
        OSError: a file the fit needs cannot be read (``splitwise-sim/perf_model.csv`` missing).
    """
    if not isinstance(data, (str, os.PathLike)):
        raise InvalidTypeError(f"data must be a folder (a str or a path), not {type(data).__name__}")
    if isinstance(data, str) and not data.strip():
        raise ConfigurationError(f"data must name a folder, not {data!r}")
    folder = Path(data)
    try:
        vidur, splitwise = read_vidur(folder), read_splitwise(folder)
        linear = linear_fits(vidur)
        shared = {family: fit_shared_terms(splitwise, linear, family) for family in ("a100", "h100")}
    except PrefixRouteError:  # a ConfigurationError is a ValueError: its message is already what to fix
        raise
    except KeyError as exc:
        raise ConfigurationError(f"cannot fit {folder}: missing {exc} (a column or a combination)") from exc
    except (ValueError, ArithmeticError) as exc:
        raise ConfigurationError(f"cannot fit {folder}: {exc}") from exc
    reference = GPUS["a100-80gb"]
    entries: list[dict[str, object]] = []
    for model in MODELS.values():
        for gpu in GPUS.values():
            family = _FAMILY_OF[gpu.name]
            terms = shared[family]
            # A100-40GB: same compute, lower HBM bandwidth -> memory-bound terms scale by the ratio.
            slow = (
                reference.memory_bandwidth_bytes_per_s / gpu.memory_bandwidth_bytes_per_s if family == "a100" else 1.0
            )
            for tp in TP_DEGREES:
                lin, how = linear[(family, model.name, tp)]
                coefficients = CostCoefficients(
                    linear_floor_s=lin.floor * slow,
                    linear_intercept_s=lin.intercept,
                    linear_per_token_s=lin.per_token,
                    comm_per_token_s=terms.comm_s_per_byte * _comm_bytes_per_token(model, tp),
                    step_overhead_s=terms.step_overhead_s
                    + model.layers * terms.allreduce_latency_s * _tp_latency_factor(tp),
                    per_sequence_s=terms.per_sequence_s,
                    attention_flops_per_s=terms.attention_flops_per_s,
                    kv_read_bytes_per_s=streaming_bandwidth(model, tp, lin.floor * slow),
                    source=f"linear: {how}; attention/overhead/all-reduce: SplitwiseSim llama2-70b on {family}"
                    + ("; memory-bound terms x HBM bandwidth ratio to a100-80gb" if slow != 1.0 else ""),
                )
                entries.append({"model": model.name, "gpu": gpu.name, "tp": tp, "coefficients": asdict(coefficients)})
    return entries, vidur + splitwise, shared


def _points_csv(measurements: Sequence[Measurement]) -> str:
    lines = ["source,kind,model,gpu,tp,tokens,batch,seconds"]
    for m in measurements:
        if m.kind == "linear" and m.tokens not in _CALIBRATION_POINTS:
            continue
        gpu = f"{m.gpu}-80gb"
        seconds = m.seconds * MODELS[m.model].layers if m.kind == "linear" else m.seconds
        lines.append(f"{m.source},{m.kind},{m.model},{gpu},{m.tp},{m.tokens},{m.batch},{seconds:.6g}")
    return "\n".join(lines) + "\n"


def compare_files(name: str, packaged: str, refit: str, *, rel_tol: float) -> list[str]:
    """Differences between a packaged data file and its refit (``profiles.json`` or ``calibration_points.csv``).

    Numbers are equal within ``rel_tol`` (relative) or, against a zero, 1e-12 (absolute); keys, strings, lengths and
    CSV rows exactly. Returns one line per difference (empty: equal). O(size of the files).

    Raises:
        ConfigurationError: ``rel_tol`` is not a finite number in [0, 1) (as ``--rel-tol``).
    """
    tolerance = as_float(rel_tol)
    if tolerance is None or not 0 <= tolerance < 1:
        raise ConfigurationError(f"rel_tol must be a finite number in [0, 1), not {rel_tol!r}")
    if name.endswith(".json"):
        differences: list[str] = []
        _compare_json(json.loads(packaged), json.loads(refit), name, rel_tol, differences)
        return differences
    old_rows, new_rows = list(csv.reader(packaged.splitlines())), list(csv.reader(refit.splitlines()))
    if len(old_rows) != len(new_rows):
        return [f"{name}: {len(old_rows)} rows packaged, {len(new_rows)} refitted"]
    differences = []
    for number, (old, new) in enumerate(zip(old_rows, new_rows, strict=True), start=1):
        if len(old) != len(new) or not all(_same(a, b, rel_tol) for a, b in zip(old, new, strict=True)):
            differences.append(f"{name}:{number}: packaged {','.join(old)} / refitted {','.join(new)}")
    return differences


def _compare_json(old: object, new: object, where: str, rel_tol: float, out: list[str]) -> None:
    if isinstance(old, dict) and isinstance(new, dict):
        if old.keys() != new.keys():
            out.append(f"{where}: keys {sorted(old)} packaged, {sorted(new)} refitted")
            return
        for key in old:
            _compare_json(old[key], new[key], f"{where}.{key}", rel_tol, out)
    elif isinstance(old, list) and isinstance(new, list):
        if len(old) != len(new):
            out.append(f"{where}: {len(old)} items packaged, {len(new)} refitted")
            return
        for i, (a, b) in enumerate(zip(old, new, strict=True)):
            _compare_json(a, b, f"{where}[{i}]", rel_tol, out)
    elif not _same(old, new, rel_tol):
        out.append(f"{where}: packaged {old!r}, refitted {new!r}")


def _same(old: object, new: object, rel_tol: float) -> bool:
    """Equal, or two numbers (or numeric strings) within the tolerance; against a zero, within 1e-12.

    The absolute 1e-12 only where one side is zero (no relative tolerance can hold there): on every number it
    would swamp a small --rel-tol for the smallest coefficients (1e-7 s per token).
    """
    if old == new:
        return True
    a, b = _number(old), _number(new)
    if a is None or b is None:
        return False
    return math.isclose(a, b, rel_tol=rel_tol, abs_tol=1e-12 if a == 0 or b == 0 else 0.0)


def _number(value: object) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 <= value < 1):
        raise argparse.ArgumentTypeError(f"must be a finite number in [0, 1), not {text!r}")
    return value


PROG = "python -m prefixroute.sim.costfit"
PACKAGE_DATA = Path(__file__).parent / "data"
_OUTPUTS = ("profiles.json", "calibration_points.csv")
# The raw files the fit cannot do without (H100 Llama-3-8B and Llama-2-70B are derived when absent).
_REQUIRED = (
    *(Path("vidur-profiling") / "a100" / name for name in _VIDUR_FILES.values()),
    *(Path("vidur-profiling") / "h100" / _VIDUR_FILES[model] for model in ("llama-2-7b", "codellama-34b")),
    Path("splitwise-sim") / "perf_model.csv",
)


def _parser() -> argparse.ArgumentParser:
    from prefixroute.cli import OneLineParser
    from prefixroute.sim.cli import folder_argument, plot_argument

    parser = OneLineParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path("data"), help="folder of the raw measurements (data)")
    parser.add_argument(
        "--out",
        type=folder_argument,
        default=None,
        help="folder to write profiles.json and calibration_points.csv to (the package data is "
        "prefixroute/sim/data); with --check, the folder to compare (default: the package data)",
    )
    parser.add_argument("--check", action="store_true", help="exit 1 if the package data differs from a refit")
    parser.add_argument(
        "--rel-tol", type=_tolerance, default=1e-5, help="--check: relative tolerance on numbers (1e-5)"
    )
    parser.add_argument(
        "--plot",
        type=lambda text: Path(plot_argument(text)),
        default=None,
        help="write the calibration plot (PNG) here",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: fit, then write to ``--out`` (or ``--check`` the package data); optionally plot.

    Writes only where ``--out`` says: without it (and without ``--check``) nothing is fitted or written, so a
    stray run never overwrites the installed package data. Bad input (a usage error, a missing or malformed data
    folder, an output that cannot be written) is exit status 2 and one line on stderr, never a traceback.
    """
    from prefixroute.cli import UsageError, fail

    try:
        args = _parser().parse_args(argv)
    except UsageError as exc:
        return fail(str(exc))
    try:
        return _run(args)
    except PrefixRouteError as exc:
        return fail(f"{PROG}: error: {exc}")
    except OSError as exc:
        where = f": {exc.filename}" if exc.filename is not None else ""
        return fail(f"{PROG}: error: {exc.strerror or exc}{where}")


def _run(args: argparse.Namespace) -> int:
    from prefixroute.sim.cli import check_writable
    from prefixroute.sim.report import write_text

    if not args.check and args.out is None:
        raise ConfigurationError(
            f"give --out FOLDER to write the refit (the package data: --out {PACKAGE_DATA}), or --check to compare"
        )
    for folder in ("vidur-profiling", "splitwise-sim"):
        if not (args.data / folder).is_dir():
            raise ConfigurationError(f"{args.data / folder} is missing: --data must be the repository's data/ folder")
    missing = [str(name) for name in _REQUIRED if not (args.data / name).is_file()]
    if missing:
        raise ConfigurationError(f"--data {args.data} lacks {', '.join(missing)}")
    if not args.check:
        for name in _OUTPUTS:
            check_writable(args.out / name, "--out")
    elif args.out is not None and args.out.exists() and not args.out.is_dir():
        raise ConfigurationError(f"--out {args.out} is not a folder: --check compares the files of a folder")
    if args.plot is not None:
        from prefixroute.sim.report import check_plot_path

        check_writable(args.plot, "--plot")
        check_plot_path(args.plot, "--plot")
    entries, measurements, shared = fit_profiles(args.data)
    files = {
        "profiles.json": json.dumps({"format": 1, "profiles": entries}, indent=1, sort_keys=True) + "\n",
        "calibration_points.csv": _points_csv(measurements),
    }
    for family, terms in shared.items():
        print(f"{family}: {terms}")
    if args.check:
        out = args.out if args.out is not None else PACKAGE_DATA
        differences: list[str] = []
        for name, text in files.items():
            path = out / name
            if not path.is_file():
                differences.append(f"{path}: missing")
                continue
            packaged = path.read_text(encoding="utf-8", errors="replace")
            try:
                differences += compare_files(name, packaged, text, rel_tol=args.rel_tol)
            except ValueError as exc:  # not JSON (or not CSV): stale, a rewrite fixes it
                differences.append(f"{path}: unreadable ({exc})")
        if differences:
            print(*differences[:20], sep="\n", file=sys.stderr)
            more = f" (first 20 of {len(differences)} shown)" if len(differences) > 20 else ""
            print(f"stale package data: {len(differences)} differences{more}; rerun with --out {out}", file=sys.stderr)
            return 1
        print(f"package data is up to date (numbers within a relative {args.rel_tol:g})")
    else:
        for name, text in files.items():
            write_text(args.out / name, text)
            print(f"wrote {args.out / name}")
    if args.plot is not None:
        try:
            plot_calibration(args.plot)
        except ImportError as exc:
            raise ConfigurationError(f"--plot needs matplotlib: pip install 'prefixroute[sim]' ({exc})") from exc
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
