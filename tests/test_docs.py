"""Every ``python`` code block in README.md and docs/ runs, in order, one namespace per page.

A block whose first line is a ``# needs: ...`` comment (a live vLLM engine, a GPU) is only compiled; everything else
must run as written, so the docs cannot drift from the API.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def blocks(page: Path) -> list[str]:
    return BLOCK.findall(page.read_text())


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p)], ids=lambda p: p.name)
def test_every_python_block_runs(page: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)  # a block that writes files writes them here
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem}"}
    for number, source in enumerate(blocks(page), 1):
        code = compile(source, f"{page.name}, block {number}", "exec")
        if source.startswith("# needs:"):
            continue
        exec(code, namespace)


def test_the_block_pattern_finds_blocks() -> None:
    assert len(blocks(ROOT / "README.md")) >= 2
