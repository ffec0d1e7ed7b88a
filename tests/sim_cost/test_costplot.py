"""The calibration plot and tables that docs/cost-model.md is generated from."""

from __future__ import annotations

from pathlib import Path

from prefixroute.sim.costplot import calibration_table, hit_miss_table, main, summary_table
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
    assert main([]) == 2
