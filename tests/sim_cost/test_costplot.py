"""The calibration plot and tables that docs/cost-model.md is generated from."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefixroute.errors import ConfigurationError
from prefixroute.sim.costplot import calibration_table, hit_miss_table, main, summary_table, tables, update_markdown
from prefixroute.sim.profiles import GPUS, MODELS


def test_tables_have_a_row_per_point_and_profile() -> None:
    assert len(calibration_table().splitlines()) == 2 + 42
    assert len(summary_table().splitlines()) == 2 + len(MODELS) * len(GPUS)
    rows = hit_miss_table().splitlines()[2:]
    assert [row.split("|")[1].strip() for row in rows] == ["2048", "4096", "8192", "16384"]
    for row in rows:
        miss, hit128, hit16 = (float(cell) for cell in row.split("|")[2:5])
        assert hit16 < hit128 < miss


def test_main_writes_a_png(tmp_path: Path) -> None:
    out = tmp_path / "calibration.png"
    assert main([str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_cost_model_page_shows_the_current_tables() -> None:
    page = Path(__file__).resolve().parents[2] / "docs" / "cost-model.md"
    text = page.read_text(encoding="utf-8")
    assert update_markdown(text, tables()) == text, "rerun: python -m prefixroute.sim.costplot ... --update"


def test_update_markdown_replaces_between_markers_and_requires_them() -> None:
    text = "a\n<!-- costplot:x -->\nold\n<!-- /costplot:x -->\nb"
    assert update_markdown(text, {"x": "new"}) == "a\n<!-- costplot:x -->\nnew\n<!-- /costplot:x -->\nb"
    with pytest.raises(ConfigurationError, match="costplot:y"):
        update_markdown(text, {"y": "new"})


def test_bad_input_is_one_line_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    page = tmp_path / "page.md"
    page.write_text("no markers here\n")
    png = tmp_path / "plot.png"
    for argv in ([], ["--bogus", str(png)], ["/proc/x.png"], [str(png), "--update", str(tmp_path / "none.md")],
                 [str(png), "--update", str(page)]):  # fmt: skip
        assert main(argv) == 2, argv
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and "error:" in lines[0], (argv, lines)
    assert not png.exists() and page.read_text() == "no markers here\n"
