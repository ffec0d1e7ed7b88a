"""The cost-model fit on data whose answer is known: figures worked out by hand, and terms the fit must recover."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from prefixroute.errors import ConfigurationError, InvalidTypeError
from prefixroute.sim.calibration import Measurement
from prefixroute.sim.costfit import (
    LinearFit,
    fit_linear,
    fit_profiles,
    fit_shared_terms,
    linear_fits,
    read_splitwise,
    read_vidur,
)
from prefixroute.sim.profiles import MODELS, TP_DEGREES

VIDUR_OPS = (
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
SPLITWISE_HEADER = "model,hardware,prompt_size,batch_size,token_size,prompt_time,token_time,tensor_parallel"


def test_fit_linear_by_hand_from_the_fewest_points_it_accepts() -> None:
    # One point at n <= 16 gives the floor; two at n >= 512 fix the line: 1 ms + 10 us per token.
    fit = fit_linear([(8, 0.002), (512, 0.001 + 512e-5), (1024, 0.001 + 1024e-5)])
    assert fit.floor == 0.002
    assert fit.intercept == pytest.approx(0.001, rel=1e-9)
    assert fit.per_token == pytest.approx(1e-5, rel=1e-9)
    assert fit(1) == 0.002 and fit(2048) == pytest.approx(0.001 + 2048e-5, rel=1e-9)


def _vidur_csv(path: Path, rows: list[tuple[int, int, float]]) -> None:
    """A Vidur mlp.csv: (tp, tokens, ms per op) rows; the embedding takes 100 ms, which the fit must leave out."""
    columns = ["time_stats.emb.median", *(f"time_stats.{op}.median" for op in VIDUR_OPS)]
    lines = [",".join([*columns, "num_tensor_parallel_workers", "num_tokens"])]
    lines += [",".join(["100", *[str(ms)] * len(VIDUR_OPS), str(tp), str(tokens)]) for tp, tokens, ms in rows]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def test_read_vidur_sums_the_layers_ops_and_takes_the_median_of_repeats(tmp_path: Path) -> None:
    # 9 ops of 0.1 ms are 0.9 ms a layer; three repeats at 0.1, 0.3, 0.2 ms per op have the median 1.8 ms.
    _vidur_csv(tmp_path / "vidur-profiling" / "a100" / "Llama-2-7b-hf__mlp.csv", [(1, 16, 0.1)])
    _vidur_csv(
        tmp_path / "vidur-profiling" / "h100" / "Llama-2-70b-hf__mlp.csv", [(2, 512, 0.1), (2, 512, 0.3), (2, 512, 0.2)]
    )
    got = read_vidur(tmp_path)
    assert [(m.gpu, m.model, m.tp, m.tokens, m.batch) for m in got] == [
        ("a100", "llama-2-7b", 1, 16, 1),
        ("h100", "llama-2-70b", 2, 512, 1),
    ]
    assert got[0].seconds == pytest.approx(0.9e-3) and got[1].seconds == pytest.approx(1.8e-3)


def test_read_splitwise_keeps_llama2_70b_rows_wherever_they_are(tmp_path: Path) -> None:
    # Prefill: the median of the repeats (100, 300, 200 ms -> 0.2 s). Decode: the mean context over 129 generated
    # tokens after a 1,000-token prompt is 1,000 + 64 tokens, a whole number of tokens.
    path = tmp_path / "splitwise-sim" / "perf_model.csv"
    path.parent.mkdir(parents=True)
    path.write_text(
        "\n".join([
            SPLITWISE_HEADER,
            "llama2-13b,a100-80gb,1000,1,129,1,1,2",  # another model first: not the end of the file
            "llama2-70b,a100-40gb,1000,1,129,1,1,2",  # a GPU SplitwiseSim measured but the fit does not use
            "llama2-70b,a100-80gb,1000,1,129,100,50,2",
            "llama2-70b,a100-80gb,1000,1,129,300,70,2",
            "llama2-70b,h100-80gb,1000,1,129,200,60,2",
            "llama2-70b,a100-80gb,1000,1,129,200,60,2",
        ]) + "\n"
    )  # fmt: skip
    got = read_splitwise(tmp_path)
    assert [(m.kind, m.model, m.gpu, m.tp, m.tokens, m.batch) for m in got] == [
        ("prefill", "llama-2-70b", "a100", 2, 1000, 1),
        ("prefill", "llama-2-70b", "h100", 2, 1000, 1),
        ("decode", "llama-2-70b", "a100", 2, 1064, 1),
        ("decode", "llama-2-70b", "h100", 2, 1064, 1),
    ]
    assert [m.seconds for m in got] == pytest.approx([0.2, 0.2, 0.06, 0.06])
    assert all(type(m.tokens) is int for m in got)  # calibration_points.csv must read back with int()


def _linear_points(fit: LinearFit) -> list[tuple[int, float]]:
    return [(n, fit(n)) for n in (1, 8, 16, 512, 1024, 2048, 4096)]


def _vidur_measurements(fits: dict[tuple[str, str, int], LinearFit]) -> list[Measurement]:
    return [
        Measurement("vidur", "linear", model, gpu, tp, n, 1, seconds)
        for (gpu, model, tp), fit in fits.items()
        for n, seconds in _linear_points(fit)
    ]


def test_linear_fits_measure_where_they_can_and_derive_the_rest() -> None:
    a100 = {"llama-2-7b": 1.0, "llama-3-8b": 1.2, "codellama-34b": 4.0, "llama-2-70b": 8.0}
    truth = {
        (gpu, model, tp): LinearFit(1e-3 * scale * speed / tp, 1e-5 * scale * speed, 1e-5 * scale * speed / tp)
        for tp in TP_DEGREES
        for gpu, speed, models in (("a100", 1.0, a100), ("h100", 0.5, {"llama-2-7b": 1.0, "codellama-34b": 4.0}))
        for model, scale in models.items()
    }
    # H100 Llama-2-70B measured at a speed that no ratio would give: the measurement must win over the derivation.
    for tp in TP_DEGREES:
        truth[("h100", "llama-2-70b", tp)] = LinearFit(3e-3 / tp, 3e-5, 3e-5 / tp)
    fits = linear_fits(_vidur_measurements(truth))
    for tp in TP_DEGREES:
        fit, how = fits[("h100", "llama-2-70b", tp)]
        assert how == "Vidur mlp.csv"
        assert fit(4096) == pytest.approx(truth[("h100", "llama-2-70b", tp)](4096), rel=1e-6)
        # H100 Llama-3-8B: the A100 figure times H100/A100 of Llama-2-7B, here 0.5 in every term.
        fit, how = fits[("h100", "llama-3-8b", tp)]
        assert how == "Vidur A100 llama-3-8b x H100/A100 ratio of llama-2-7b"
        expected = truth[("a100", "llama-3-8b", tp)]
        assert (fit.floor, fit.intercept, fit.per_token) == pytest.approx(
            (0.5 * expected.floor, 0.5 * expected.intercept, 0.5 * expected.per_token), rel=1e-6
        )
        # 13B: 7B's and 34B's floor and slope interpolated in log of per-layer weights.
        w7, w13, w34 = (
            math.log(MODELS[m].linear_params_per_layer) for m in ("llama-2-7b", "codellama-13b", "codellama-34b")
        )
        weight = (w13 - w7) / (w34 - w7)
        fit, how = fits[("a100", "codellama-13b", tp)]
        assert how.startswith("log-log interpolation")
        assert fit.per_token == pytest.approx(truth[("a100", "llama-2-7b", tp)].per_token * 4.0**weight, rel=1e-6)


# Llama-2-70B's shape, written out: 80 layers, hidden 8192, 64 heads and 8 KV heads of 128, fp16.
LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 80, 8192, 64, 8, 128
TRUE = {
    "step_overhead_s": 5e-3,
    "allreduce_latency_s": 2e-5,
    "comm_s_per_byte": 1 / 100e9,  # 100 GB/s
    "per_sequence_s": 1e-4,
    "attention_flops_per_s": 150e12,
}


def _lin(tp: int) -> LinearFit:
    return LinearFit(2e-4 / tp, 5e-5, 4e-7 / tp)


def _seconds(kind: str, tp: int, tokens: int, batch: int) -> float:
    """A step's time from the terms in TRUE, computed from the model's shape (not from the code under test)."""
    lin = _lin(tp)
    # Two ring all-reduces per layer, each moving 2 (tp - 1) / tp of a token's fp16 hidden state per GPU.
    comm_bytes_per_token = 2 * 2 * (tp - 1) / tp * HIDDEN * 2
    if kind == "prefill":
        step_tokens = batch * tokens
        attention = batch * 4 * HEADS * HEAD_DIM / tp * tokens * (tokens + 1) / 2 / TRUE["attention_flops_per_s"]
    else:
        step_tokens = batch
        # The KV of every context token is read at the bandwidth a memory-bound layer reaches: its weights / floor.
        weights = HIDDEN * (HEADS + 2 * KV_HEADS) * HEAD_DIM + HEADS * HEAD_DIM * HIDDEN + 3 * HIDDEN * 28672
        bandwidth = weights * 2 / tp / lin.floor
        attention = batch * tokens * KV_HEADS * HEAD_DIM * 2 * 2 / tp / bandwidth
    per_layer = lin(step_tokens) + attention + TRUE["allreduce_latency_s"] * (tp - 1)
    per_layer += step_tokens * comm_bytes_per_token * TRUE["comm_s_per_byte"]
    return TRUE["step_overhead_s"] + LAYERS * per_layer + batch * TRUE["per_sequence_s"]


def _splitwise_rows() -> list[Measurement]:
    rows = [
        Measurement("splitwise", "prefill", "llama-2-70b", "a100", tp, prompt, 1, _seconds("prefill", tp, prompt, 1))
        for tp in (2, 4, 8)
        for prompt in (512, 1024, 2048, 4096, 8192)
    ]
    rows += [
        Measurement(
            "splitwise", "decode", "llama-2-70b", "a100", tp, context, batch, _seconds("decode", tp, context, batch)
        )
        for tp in (2, 4, 8)
        for context in (600, 1500, 3000)
        for batch in (1, 4, 16, 64)
    ]
    # Rows the fit must leave alone: another GPU family, and batched prefill (SplitwiseSim ran it slower).
    rows.append(Measurement("splitwise", "decode", "llama-2-70b", "h100", 2, 600, 1, 1.0))
    rows.append(Measurement("splitwise", "prefill", "llama-2-70b", "a100", 2, 512, 16, 100.0))
    return rows


def _linear() -> dict[tuple[str, str, int], tuple[LinearFit, str]]:
    return {("a100", "llama-2-70b", tp): (_lin(tp), "test") for tp in TP_DEGREES}


def test_fit_shared_terms_recovers_the_terms_that_made_the_measurements() -> None:
    rows = _splitwise_rows()
    terms = fit_shared_terms(rows, _linear(), "a100")
    for name, value in TRUE.items():
        assert getattr(terms, name) == pytest.approx(value, rel=1e-6), name
    assert (terms.rows_used, terms.rows_dropped) == (len(rows) - 2, 0)


def test_fit_shared_terms_drops_and_counts_a_gross_outlier() -> None:
    rows = _splitwise_rows()
    good = rows[3]
    rows[3] = Measurement(
        good.source, good.kind, good.model, good.gpu, good.tp, good.tokens, good.batch, 3 * good.seconds
    )
    terms = fit_shared_terms(rows, _linear(), "a100")
    assert (terms.rows_used, terms.rows_dropped) == (len(rows) - 3, 1)
    for name, value in TRUE.items():
        assert getattr(terms, name) == pytest.approx(value, rel=1e-6), name


def _splitwise_with(tmp_path: Path, row: str) -> Path:
    path = tmp_path / "splitwise-sim" / "perf_model.csv"
    path.parent.mkdir(parents=True)
    path.write_text(f"{SPLITWISE_HEADER}\nllama2-70b,a100-80gb,1000,1,129,100,50,2\n{row}\n")
    return path


@pytest.mark.parametrize(
    ("column", "row"),
    [
        ("prompt_time", "llama2-70b,a100-80gb,1000,1,129,nan,50,2"),
        ("prompt_time", "llama2-70b,a100-80gb,1000,1,129,inf,50,2"),
        ("prompt_time", "llama2-70b,a100-80gb,1000,1,129,-5,50,2"),
        ("token_time", "llama2-70b,a100-80gb,1000,1,129,100,0,2"),
        ("token_time", "llama2-70b,a100-80gb,1000,1,129,100,fast,2"),
        ("prompt_size", "llama2-70b,a100-80gb,-16,1,129,100,50,2"),
        ("batch_size", "llama2-70b,a100-80gb,1000,0,129,100,50,2"),
        ("token_size", "llama2-70b,a100-80gb,1000,1,1e3,100,50,2"),
        ("tensor_parallel", "llama2-70b,a100-80gb,1000,1,129,100,50,0"),
    ],
)
def test_read_splitwise_refuses_a_measurement_that_is_no_positive_number(tmp_path: Path, column: str, row: str) -> None:
    # Was: NaN, inf, negative and zero times went into the medians and the fit without a word (a NaN even made the
    # median depend on the rows' order), and a count of 0 or -16 tokens was fitted as if measured.
    path = _splitwise_with(tmp_path, row)
    with pytest.raises(ConfigurationError, match=rf"^{re.escape(str(path))}:3: {column} must be a positive"):
        read_splitwise(tmp_path)


def test_read_splitwise_checks_only_the_rows_it_fits(tmp_path: Path) -> None:
    _splitwise_with(tmp_path, "bloom-176b,a100-80gb,1000,1,129,nan,,x")
    assert len(read_splitwise(tmp_path)) == 2


@pytest.mark.parametrize(
    ("column", "value"),
    [
        ("time_stats.mlp_up_proj.median", "nan"),
        ("time_stats.mlp_up_proj.median", "inf"),
        ("time_stats.add.median", "-0.5"),
        ("time_stats.add.median", "0"),
        ("num_tokens", "0"),
        ("num_tokens", "-16"),
        ("num_tensor_parallel_workers", "two"),
    ],
)
def test_read_vidur_refuses_a_measurement_that_is_no_positive_number(tmp_path: Path, column: str, value: str) -> None:
    path = tmp_path / "vidur-profiling" / "a100" / "Llama-2-7b-hf__mlp.csv"
    _vidur_csv(path, [(1, 16, 0.1), (1, 512, 0.1)])
    lines = path.read_text().splitlines()
    header = lines[0].split(",")
    cells = lines[2].split(",")
    cells[header.index(column)] = value
    path.write_text("\n".join([*lines[:2], ",".join(cells)]) + "\n")
    with pytest.raises(ConfigurationError, match=rf"^{re.escape(str(path))}:3: {re.escape(column)} must be a positive"):
        read_vidur(tmp_path)


@pytest.mark.parametrize(
    ("points", "shown"),
    [
        ([(1, math.nan), (512, 1.0), (1024, 2.0)], "(1, nan)"),  # was: a NaN floor
        ([(1, 1.0), (512, 0.0), (1024, 2.0)], "(512, 0.0)"),  # was: ZeroDivisionError
        ([(1, 1.0), (512, -1.0), (1024, -2.0)], "(512, -1.0)"),  # was: a fit of zeros
        ([(1, 1.0), (512, math.inf), (1024, 2.0)], "(512, inf)"),  # was: the point ignored
        ([(-5, 1.0), (512, 1.0), (1024, 2.0)], "(-5, 1.0)"),
        ([(1.5, 1.0), (512, 1.0), (1024, 2.0)], "(1.5, 1.0)"),
        ([(True, 1.0), (512, 1.0), (1024, 2.0)], "(True, 1.0)"),
        ([(1, "1.0"), (512, 1.0), (1024, 2.0)], "(1, '1.0')"),
        ([(1, 1.0, 2.0), (512, 1.0), (1024, 2.0)], "(1, 1.0, 2.0)"),
    ],
)
def test_fit_linear_refuses_points_that_are_no_measurement(points: list[tuple[int, float]], shown: str) -> None:
    with pytest.raises(ConfigurationError) as raised:
        fit_linear(points)
    assert str(raised.value) == (
        f"fit_linear needs (tokens, seconds) points of a positive int and a positive finite number, not {shown}"
    )


def test_fit_shared_terms_names_the_gpu_family_it_has_no_rows_for() -> None:
    with pytest.raises(ConfigurationError, match="^no SplitwiseSim rows for h100$"):
        fit_shared_terms(_splitwise_rows()[:-2], _linear(), "h100")


DATA = Path(__file__).resolve().parents[2] / "data"


def test_fit_profiles_takes_the_data_folder_as_a_str_or_a_path() -> None:
    # Was: TypeError (unsupported operand type(s) for /: 'str' and 'str') for a str, the public function's argument.
    assert fit_profiles(str(DATA)) == fit_profiles(DATA)


@pytest.mark.parametrize(
    ("data", "error", "message"),
    [
        (5, InvalidTypeError, "data must be a folder (a str or a path), not int"),
        (None, InvalidTypeError, "data must be a folder (a str or a path), not NoneType"),
        ("", ConfigurationError, "data must name a folder, not ''"),  # Path("") would be the current folder
        (" ", ConfigurationError, "data must name a folder, not ' '"),
    ],
)
def test_fit_profiles_refuses_what_names_no_folder(data: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error) as refused:
        fit_profiles(data)  # type: ignore[arg-type]
    assert str(refused.value) == message


def test_fit_profiles_on_data_it_cannot_fit_raises_from_the_exception_tree(tmp_path: Path) -> None:
    # Was: a bare KeyError (a column missing) or UnicodeDecodeError out of the public function.
    data = tmp_path / "data"
    _vidur_csv(data / "vidur-profiling" / "a100" / "Llama-2-7b-hf__mlp.csv", [(1, 16, 0.1)])
    perf = data / "splitwise-sim" / "perf_model.csv"
    perf.parent.mkdir(parents=True)
    perf.write_text("model,hardware\nllama2-70b,a100-80gb\n")
    with pytest.raises(ConfigurationError) as refused:
        fit_profiles(data)
    assert str(refused.value) == f"cannot fit {data}: missing 'tensor_parallel' (a column or a combination)"
    perf.write_bytes(b"model\xff\n")  # the message names the file, not only the folder
    with pytest.raises(ConfigurationError, match=f"^{re.escape(str(perf))}: 'utf-8' codec can't decode"):
        fit_profiles(data)


@pytest.mark.parametrize(
    ("row", "line"),
    [
        ("llama2-70b,a100-80gb,512,1,128", 3),  # cut short: the missing fields were None, a bare TypeError
        ("llama2-70b,a100-80gb,512,1,128,1,1,196,54,7168,2,extra", 3),  # one field more than the header
    ],
)
def test_a_row_with_another_number_of_fields_than_the_header_is_refused_with_its_line(
    tmp_path: Path, row: str, line: int
) -> None:
    data = tmp_path / "data"
    _vidur_csv(data / "vidur-profiling" / "a100" / "Llama-2-7b-hf__mlp.csv", [(1, 16, 0.1)])
    perf = data / "splitwise-sim" / "perf_model.csv"
    perf.parent.mkdir(parents=True)
    header = (
        "model,hardware,prompt_size,batch_size,token_size,peak_power,average_power,prompt_time,token_time,e2e_time,"
    )
    perf.write_text(f"{header}tensor_parallel\nllama2-70b,a100-80gb,512,1,128,1,1,196,54,7168,2\n{row}\n")
    with pytest.raises(ConfigurationError) as refused:
        fit_profiles(data)
    assert str(refused.value) == f"{perf}:{line}: a row must have the header's 11 fields"


def test_a_vidur_file_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    data = tmp_path / "data"
    mlp = data / "vidur-profiling" / "a100" / "Llama-2-7b-hf__mlp.csv"
    _vidur_csv(mlp, [(1, 16, 0.1)])
    mlp.write_bytes(mlp.read_bytes() + b"\xfe\n")
    with pytest.raises(ConfigurationError, match=f"^{re.escape(str(mlp))}: 'utf-8' codec can't decode byte 0xfe"):
        fit_profiles(data)
