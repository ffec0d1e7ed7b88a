"""``prefixroute study`` writes every section of the study, with its plots (tiny runs here)."""

from __future__ import annotations

from pathlib import Path

from prefixroute.cli import main


def test_study_writes_every_section(tmp_path: Path) -> None:
    assert main(["study", "--output", str(tmp_path), "--requests", "40"]) == 0
    text = (tmp_path / "study.md").read_text()
    for number in range(1, 9):
        assert f"## {number}. " in text
    for claim in ("12.5 %", "6,800", "36.3", "638 / 448", "91 %", "P99/P50", "$2 per GPU-hour"):
        assert claim in text
    for image in ("study-seed.png", "study-sweeps.png"):
        assert f"]({image})" in text
        assert (tmp_path / image).read_bytes()[:4] == b"\x89PNG"
    assert "40 requests per run" in text
