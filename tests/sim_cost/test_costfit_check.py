"""``python -m prefixroute.sim.costfit --check``: the packaged profiles are a refit of the raw data in data/."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from prefixroute.sim import costfit

DATA = Path(__file__).resolve().parents[2] / "data"
PACKAGED = Path(costfit.__file__).parent / "data"


def test_packaged_data_is_a_refit_of_the_raw_data(capsys: pytest.CaptureFixture[str]) -> None:
    assert costfit.main(["--data", str(DATA), "--check"]) == 0, capsys.readouterr().err
    assert "package data is up to date" in capsys.readouterr().out


def _copy_packaged(tmp_path: Path) -> Path:
    out = tmp_path / "package"
    out.mkdir()
    for name in ("profiles.json", "calibration_points.csv"):
        shutil.copy(PACKAGED / name, out / name)
    return out


def _scale_first_coefficient(out: Path, factor: float) -> str:
    path = out / "profiles.json"
    document = json.loads(path.read_text())
    coefficients = document["profiles"][0]["coefficients"]
    key = "step_overhead_s"
    coefficients[key] *= factor
    path.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")
    return key


def test_check_tolerates_last_digit_differences(tmp_path: Path) -> None:
    out = _copy_packaged(tmp_path)
    _scale_first_coefficient(out, 1 + 1e-7)  # what another numpy/BLAS build changes
    assert costfit.main(["--data", str(DATA), "--out", str(out), "--check"]) == 0


def test_check_reports_a_stale_number(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = _copy_packaged(tmp_path)
    key = _scale_first_coefficient(out, 1.01)
    assert costfit.main(["--data", str(DATA), "--out", str(out), "--check"]) == 1
    err = capsys.readouterr().err
    assert f"profiles.json.profiles[0].coefficients.{key}" in err and "stale package data: 1 differences" in err
    assert costfit.main(["--data", str(DATA), "--out", str(out), "--check", "--rel-tol", "0.02"]) == 0


def test_check_reports_changed_strings_and_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = _copy_packaged(tmp_path)
    csv = out / "calibration_points.csv"
    lines = csv.read_text().splitlines()
    csv.write_text("\n".join([lines[0], lines[1].replace("vidur", "other"), *lines[2:-1]]) + "\n")
    assert costfit.main(["--data", str(DATA), "--out", str(out), "--check"]) == 1
    assert "rows packaged" in capsys.readouterr().err  # one row short
    csv.write_text("\n".join([lines[0], lines[1].replace("vidur", "other"), *lines[2:]]) + "\n")
    assert costfit.main(["--data", str(DATA), "--out", str(out), "--check"]) == 1
    assert "calibration_points.csv:2: packaged other," in capsys.readouterr().err


def test_compare_files_numbers_and_structure() -> None:
    assert costfit.compare_files("a.json", '{"x": [1.0, "s"]}', '{"x": [1.000001, "s"]}', rel_tol=1e-5) == []
    assert costfit.compare_files("a.json", '{"x": [1.0, "s"]}', '{"x": [1.1, "s"]}', rel_tol=1e-5)
    assert costfit.compare_files("a.json", '{"x": 0.0}', '{"x": 1e-15}', rel_tol=1e-5) == []
    assert costfit.compare_files("a.json", '{"x": 1}', '{"y": 1}', rel_tol=1e-5)
    assert costfit.compare_files("a.json", '{"x": "1"}', '{"x": true}', rel_tol=1e-5)
    assert costfit.compare_files("a.csv", "a,1.0\n", "a,1.0000001\n", rel_tol=1e-5) == []
    assert costfit.compare_files("a.csv", "a,1.0\n", "b,1.0\n", rel_tol=1e-5)


def test_missing_data_folder_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert costfit.main(["--data", str(tmp_path), "--check"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "must be the repository's data/ folder" in err


def test_costplot_does_not_import_costfit() -> None:
    # The plot and tables read the packaged points; the fit (numpy) is not needed to draw them.
    code = "import sys, prefixroute.sim.costplot; print('prefixroute.sim.costfit' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def _one_line_error(err: str, expected: str) -> None:
    assert err.endswith("\n") and err.count("\n") == 1, f"not one line: {err!r}"
    assert "Traceback" not in err and err.startswith("python -m prefixroute.sim.costfit: error: "), err
    assert expected in err, err


def _run_cli(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "prefixroute.sim.costfit", *argv]
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, timeout=120)


def _data_without_files(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    (data / "vidur-profiling").mkdir(parents=True)
    (data / "splitwise-sim").mkdir()
    return data


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--check", "--rel-tol", "nan"], "argument --rel-tol: must be a finite number in [0, 1), not 'nan'"),
        (["--check", "--rel-tol", "x"], "argument --rel-tol: must be a finite number in [0, 1), not 'x'"),
        (["--check", "--rel-tol", "inf"], "argument --rel-tol"),
        (["--check", "--rel-tol", "-1e-5"], "argument --rel-tol"),
        (["--check", "--rel-tol", "1"], "argument --rel-tol"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--data"], "expected one argument"),
        (["--data", str(DATA)], "give --out FOLDER"),  # no --out, no --check: writes nothing
    ],
)
def test_bad_usage_is_one_line(argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert costfit.main(argv) == 2
    out, err = capsys.readouterr()
    _one_line_error(err, expected)
    assert out == ""


def test_bad_input_from_a_real_process(tmp_path: Path) -> None:
    data = _data_without_files(tmp_path)
    for argv, expected in [
        (["--check", "--rel-tol", "nan"], "--rel-tol"),
        (["--bogus"], "unrecognized arguments"),
        (["--data", str(data), "--check"], "lacks vidur-profiling/a100/Llama-2-7b-hf__mlp.csv"),
        (["--data", str(DATA)], "give --out FOLDER"),
    ]:
        done = _run_cli(*argv, cwd=tmp_path)
        assert done.returncode == 2, done.stderr
        _one_line_error(done.stderr, expected)


def test_default_run_does_not_touch_the_package_data(tmp_path: Path) -> None:
    before = {name: (PACKAGED / name).stat().st_mtime_ns for name in ("profiles.json", "calibration_points.csv")}
    done = _run_cli("--data", str(DATA), cwd=tmp_path)
    assert done.returncode == 2 and "give --out FOLDER" in done.stderr
    assert before == {name: (PACKAGED / name).stat().st_mtime_ns for name in before}
    assert list(tmp_path.iterdir()) == []


def test_writes_only_to_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "new" / "package"  # created
    assert costfit.main(["--data", str(DATA), "--out", str(out)]) == 0
    assert f"wrote {out / 'profiles.json'}" in capsys.readouterr().out
    assert costfit.main(["--data", str(DATA), "--out", str(out), "--check"]) == 0


def test_malformed_data_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    shutil.copytree(DATA / "vidur-profiling", data / "vidur-profiling")
    (data / "splitwise-sim").mkdir()
    (data / "splitwise-sim" / "perf_model.csv").write_text("model,hardware\nllama2-70b,a100-80gb\n")
    assert costfit.main(["--data", str(data), "--check"]) == 2
    _one_line_error(capsys.readouterr().err, "cannot fit, missing 'tensor_parallel'")
    (data / "splitwise-sim" / "perf_model.csv").write_bytes(b"\xff\xfe\x00garbage")
    assert costfit.main(["--data", str(data), "--check"]) == 2
    _one_line_error(capsys.readouterr().err, "cannot fit")
    header, first, *rest = (DATA / "splitwise-sim" / "perf_model.csv").read_text().splitlines()
    assert header.endswith(",prompt_time,token_time,e2e_time,tensor_parallel")
    cells = first.split(",")
    cells[-4] = "nan"  # a measured time that is no number
    (data / "splitwise-sim" / "perf_model.csv").write_text("\n".join([header, ",".join(cells), *rest]) + "\n")
    assert costfit.main(["--data", str(data), "--check"]) == 2
    _one_line_error(
        capsys.readouterr().err, "perf_model.csv:2: prompt_time must be a positive finite number, not 'nan'"
    )


def test_outputs_that_cannot_be_written_fail_before_the_fit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert costfit.main(["--data", str(DATA), "--out", str(blocker / "package")]) == 2
    out, err = capsys.readouterr()
    _one_line_error(err, "--out")
    assert out == ""  # nothing fitted
    assert costfit.main(["--data", str(DATA), "--check", "--plot", str(tmp_path)]) == 2
    _one_line_error(capsys.readouterr().err, "--plot")


def test_unreadable_packaged_file_is_stale(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = _copy_packaged(tmp_path)
    (out / "profiles.json").write_text("not json")
    assert costfit.main(["--data", str(DATA), "--out", str(out), "--check"]) == 1
    assert "profiles.json: unreadable" in capsys.readouterr().err
