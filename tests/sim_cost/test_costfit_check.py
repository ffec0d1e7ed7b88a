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
