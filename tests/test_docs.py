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


def test_api_reference_member_lists_name_real_members() -> None:
    """A ``members: [...]`` list in docs/api.md names attributes that exist (mkdocstrings skips others silently), and
    the index's documented hooks (evict, predict, match_confirmed) are among them."""
    import importlib

    page = (ROOT / "docs" / "api.md").read_text()
    listed = re.findall(r"^::: ([\w.]+)\n    options:\n      members: \[(.*?)\]", page, re.MULTILINE)
    assert listed, "docs/api.md lists no members"
    for target, members in listed:
        module, _, name = target.rpartition(".")
        obj = getattr(importlib.import_module(module), name)
        names = [m.strip() for m in members.split(",")]
        assert [m for m in names if not hasattr(obj, m)] == [], f"{target}: listed members that do not exist"
        if name == "PrefixIndex":
            assert {"evict", "predict", "match_confirmed"} <= set(names), "the index's hooks are not documented"
