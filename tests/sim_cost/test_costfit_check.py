"""``python -m prefixroute.sim.costfit --check``: the packaged profiles are a refit of the raw data in data/."""

from __future__ import annotations

import errno
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from prefixroute.errors import ConfigurationError
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
    _one_line_error(capsys.readouterr().err, f"cannot fit {data}: missing 'tensor_parallel'")
    (data / "splitwise-sim" / "perf_model.csv").write_bytes(b"\xff\xfe\x00garbage")
    assert costfit.main(["--data", str(data), "--check"]) == 2
    _one_line_error(capsys.readouterr().err, f"{data / 'splitwise-sim' / 'perf_model.csv'}: 'utf-8' codec")
    header, first, *rest = (DATA / "splitwise-sim" / "perf_model.csv").read_text().splitlines()
    assert header.endswith(",prompt_time,token_time,e2e_time,tensor_parallel")
    cells = first.split(",")
    cells[-4] = "nan"  # a measured time that is no number
    (data / "splitwise-sim" / "perf_model.csv").write_text("\n".join([header, ",".join(cells), *rest]) + "\n")
    assert costfit.main(["--data", str(data), "--check"]) == 2
    # Was: "--data DATA: cannot fit (ConfigurationError: PATH:2: ...)", the library's own error retold with its
    # type name, where every other command prints the message alone.
    assert capsys.readouterr().err == (
        f"python -m prefixroute.sim.costfit: error: {data / 'splitwise-sim' / 'perf_model.csv'}:2: prompt_time must "
        "be a positive finite number, not 'nan'\n"
    )


def test_outputs_that_cannot_be_written_fail_before_the_fit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert costfit.main(["--data", str(DATA), "--out", str(blocker / "package")]) == 2
    out, err = capsys.readouterr()
    _one_line_error(err, f"error: --out {blocker / 'package' / 'profiles.json'}: ")
    assert out == ""  # nothing fitted
    assert costfit.main(["--data", str(DATA), "--check", "--plot", str(tmp_path)]) == 2
    _one_line_error(capsys.readouterr().err, f"error: --plot {tmp_path} is a folder: give a file path")
    pytest.importorskip("matplotlib")
    plot = tmp_path / "plot.notaformat"
    assert costfit.main(["--data", str(DATA), "--check", "--plot", str(plot)]) == 2
    _one_line_error(capsys.readouterr().err, f"error: --plot {plot}: matplotlib writes no 'notaformat' files")


def test_unreadable_packaged_file_is_stale(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = _copy_packaged(tmp_path)
    (out / "profiles.json").write_text("not json")
    assert costfit.main(["--data", str(DATA), "--out", str(out), "--check"]) == 1
    assert "profiles.json: unreadable" in capsys.readouterr().err


def test_data_defaults_to_the_data_folder_here(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(DATA.parent)
    assert costfit.main(["--check"]) == 0, capsys.readouterr().err


def test_help_states_what_the_command_does_and_its_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        costfit.main(["--help"])
    assert stopped.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert costfit.__doc__ is not None and costfit.__doc__.splitlines()[0] in text
    for default in ("raw measurements (data)", "relative tolerance on numbers (1e-5)", "calibration plot (PNG)"):
        assert default in text


def test_a_refit_prints_the_shared_terms_and_is_laid_out_like_the_package_data(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "package"
    assert costfit.main(["--data", str(DATA), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "a100: SharedTerms(step_overhead_s=" in printed and "h100: SharedTerms(step_overhead_s=" in printed
    # Line for line the packaged file but for the last digits, so that a refit's diff shows only what changed.
    number = re.compile(r"-?\d+(\.\d+)?(e-?\d+)?")
    for name in ("profiles.json", "calibration_points.csv"):
        refit, packaged = ((folder / name).read_text() for folder in (out, PACKAGED))
        assert number.sub("N", refit) == number.sub("N", packaged), name


def test_rel_tol_holds_for_the_smallest_coefficients(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Was: an absolute 1e-12 was allowed on every number, not only on zeros, so for a coefficient of 1e-7 s
    # "--rel-tol 1e-7" let 1e-5 through, and "--rel-tol 0" never asked for the same numbers.
    out = tmp_path / "package"
    assert costfit.main(["--data", str(DATA), "--out", str(out)]) == 0
    assert costfit.main(["--data", str(DATA), "--out", str(out), "--check", "--rel-tol", "0"]) == 0
    path = out / "profiles.json"
    document = json.loads(path.read_text())
    coefficients = [c for profile in document["profiles"] for c in [profile["coefficients"]]]
    smallest, key = min((c[k], k) for c in coefficients for k in c if isinstance(c[k], float) and c[k] > 0)
    assert smallest < 2e-7
    for c in coefficients:
        if c[key] == smallest:
            c[key] = smallest * (1 + 2e-6)
    path.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")
    assert costfit.main(["--data", str(DATA), "--out", str(out), "--check", "--rel-tol", "1e-7"]) == 1
    assert f".coefficients.{key}: packaged" in capsys.readouterr().err
    assert costfit.main(["--data", str(DATA), "--out", str(out), "--check", "--rel-tol", "1e-5"]) == 0


def _stale_rows(out: Path, count: int) -> None:
    path = out / "calibration_points.csv"
    header, *rows = path.read_text().splitlines()
    rows[:count] = [row.replace("vidur", "other", 1) for row in rows[:count]]
    path.write_text("\n".join([header, *rows]) + "\n")


@pytest.mark.parametrize(("count", "more"), [(20, ""), (21, " (first 20 of 21 shown)")])
def test_check_lists_at_most_twenty_differences_one_a_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], count: int, more: str
) -> None:
    out = _copy_packaged(tmp_path)
    _stale_rows(out, count)
    assert costfit.main(["--data", str(DATA), "--out", str(out), "--check"]) == 1
    *listed, summary = capsys.readouterr().err.splitlines()
    assert len(listed) == 20 and all(line.startswith("calibration_points.csv:") for line in listed)
    assert summary == f"stale package data: {count} differences{more}; rerun with --out {out}"


def test_check_reports_every_missing_or_stale_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = _copy_packaged(tmp_path)
    (out / "profiles.json").unlink()
    _stale_rows(out, 1)
    assert costfit.main(["--data", str(DATA), "--out", str(out), "--check"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"{out / 'profiles.json'}: missing"
    assert err[1].startswith("calibration_points.csv:2: packaged other,") and len(err) == 3


def test_a_packaged_file_that_is_no_utf8_is_stale_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _copy_packaged(tmp_path)
    (out / "profiles.json").write_bytes(b'{"format": 1, "profiles": "\xff"}')
    assert costfit.main(["--data", str(DATA), "--out", str(out), "--check"]) == 1
    assert "profiles.json.profiles: packaged '\ufffd', refitted [" in capsys.readouterr().err


def test_compare_files_says_what_differs() -> None:
    def compare(packaged: str, refit: str) -> list[str]:
        return costfit.compare_files("p.json", packaged, refit, rel_tol=1e-5)

    assert compare('{"a": 1, "b": 2}', '{"a": 1, "c": 2}') == ["p.json: keys ['a', 'b'] packaged, ['a', 'c'] refitted"]
    assert compare('{"x": [1, 2]}', '{"x": [1, 2, 3]}') == ["p.json.x: 2 items packaged, 3 refitted"]
    # A packaged value of another shape is a difference, not a crash.
    assert compare('{"x": {"a": 1}}', '{"x": 5}') == ["p.json.x: packaged {'a': 1}, refitted 5"]
    assert compare('{"x": 5}', '{"x": {"a": 1}}') == ["p.json.x: packaged 5, refitted {'a': 1}"]
    assert compare('{"x": [1]}', '{"x": 1}') == ["p.json.x: packaged [1], refitted 1"]
    assert compare('{"x": 1}', '{"x": [1]}') == ["p.json.x: packaged 1, refitted [1]"]
    assert costfit.compare_files("p.csv", "a,b\n1,2\n", "a,b\n1,3\n", rel_tol=1e-5) == [
        "p.csv:2: packaged 1,2 / refitted 1,3"
    ]


def test_missing_raw_files_are_all_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _data_without_files(tmp_path)
    assert costfit.main(["--data", str(data), "--check"]) == 2
    names = [
        "vidur-profiling/a100/Llama-2-7b-hf__mlp.csv",
        "vidur-profiling/a100/Meta-Llama-3-8B__mlp.csv",
        "vidur-profiling/a100/CodeLlama-34b-Instruct-hf__mlp.csv",
        "vidur-profiling/a100/Llama-2-70b-hf__mlp.csv",
        "vidur-profiling/h100/Llama-2-7b-hf__mlp.csv",
        "vidur-profiling/h100/CodeLlama-34b-Instruct-hf__mlp.csv",
        "splitwise-sim/perf_model.csv",
    ]
    _one_line_error(capsys.readouterr().err, f"--data {data} lacks {', '.join(names)}\n")


def test_an_optional_profiling_file_that_is_a_folder_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    shutil.copytree(DATA / "vidur-profiling", data / "vidur-profiling")
    shutil.copytree(DATA / "splitwise-sim", data / "splitwise-sim")
    folder = data / "vidur-profiling" / "h100" / "Llama-2-70b-hf__mlp.csv"
    folder.mkdir()
    assert costfit.main(["--data", str(data), "--check"]) == 2
    _one_line_error(capsys.readouterr().err, f"{folder} is not a regular file: --data must hold the profiling CSVs")


def test_data_that_cannot_be_parsed_is_one_plain_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    shutil.copytree(DATA / "vidur-profiling", data / "vidur-profiling")
    (data / "splitwise-sim").mkdir()
    (data / "splitwise-sim" / "perf_model.csv").write_bytes(b"model\xff\n")
    assert costfit.main(["--data", str(data), "--check"]) == 2
    assert capsys.readouterr().err == (
        f"python -m prefixroute.sim.costfit: error: {data / 'splitwise-sim' / 'perf_model.csv'}: 'utf-8' codec can't "
        "decode byte 0xff in position 5: invalid start byte\n"
    )


def test_an_os_error_during_the_fit_is_one_line_naming_the_file(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A file that vanishes or turns unreadable between the checks and the fit.
    def vanished(data: Path) -> None:
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(data / "splitwise-sim"))

    monkeypatch.setattr(costfit, "fit_profiles", vanished)
    assert costfit.main(["--data", str(DATA), "--check"]) == 2
    _one_line_error(capsys.readouterr().err, f"error: No such file or directory: {DATA / 'splitwise-sim'}\n")
    monkeypatch.setattr(costfit, "fit_profiles", lambda data: (_ for _ in ()).throw(OSError("disk on fire")))
    assert costfit.main(["--data", str(DATA), "--check"]) == 2
    assert capsys.readouterr().err == "python -m prefixroute.sim.costfit: error: disk on fire\n"


def test_plot_is_written_where_asked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    plot = tmp_path / "calibration"  # no extension: PNG, and the name says so
    assert costfit.main(["--data", str(DATA), "--check", "--plot", str(plot)]) == 0
    assert (tmp_path / "calibration.png").read_bytes()[:4] == b"\x89PNG"
    assert f"wrote {tmp_path / 'calibration.png'}\n" in capsys.readouterr().out


def test_plot_without_matplotlib_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def no_matplotlib(path: Path) -> None:
        raise ImportError("No module named 'matplotlib'")

    monkeypatch.setattr(costfit, "plot_calibration", no_matplotlib)
    monkeypatch.setattr("prefixroute.sim.report.check_plot_path", lambda path, option: None)
    assert costfit.main(["--data", str(DATA), "--check", "--plot", "p.png"]) == 2
    _one_line_error(
        capsys.readouterr().err,
        "--plot needs matplotlib: pip install 'prefixroute[sim]' (No module named 'matplotlib')",
    )


def test_compare_files_allows_an_absolute_difference_only_against_zero() -> None:
    assert costfit.compare_files("a.json", '{"x": 0.0}', '{"x": 1e-13}', rel_tol=0) == []
    assert costfit.compare_files("a.json", '{"x": 1e-13}', '{"x": 0.0}', rel_tol=0) == []
    assert costfit.compare_files("a.json", '{"x": 0.0}', '{"x": 1e-11}', rel_tol=0.5)
    assert costfit.compare_files("a.json", '{"x": 1e-7}', '{"x": 1.000005e-7}', rel_tol=1e-7)
    assert costfit.compare_files("a.csv", "a,1e-7\n", "a,1.000005e-7\n", rel_tol=1e-7)


@pytest.mark.parametrize("rel_tol", [math.nan, -1.0, 1.0, 2.0, math.inf, True, "1e-5", None])
def test_compare_files_refuses_a_tolerance_the_command_line_refuses(rel_tol: object) -> None:
    # Was: -1 raised math.isclose's bare ValueError, and 2.0 or inf made every number equal without a word.
    with pytest.raises(ConfigurationError) as raised:
        costfit.compare_files("a.json", "1.0", "1.5", rel_tol=rel_tol)  # type: ignore[arg-type]
    assert str(raised.value) == f"rel_tol must be a finite number in [0, 1), not {rel_tol!r}"
