"""The API reference renders docstrings as written: doctest examples as code, no stray block quotes.

mkdocs.yml loads ``docs/griffe_pycon.py``, which fences each docstring's doctest runs before mkdocstrings renders
them; without it Markdown read ``>>>`` lines as nested block quotes with their lines run together.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import cast

ROOT = Path(__file__).resolve().parents[1]


def _fence_examples() -> Callable[[str], str]:
    spec = importlib.util.spec_from_file_location("griffe_pycon", ROOT / "docs" / "griffe_pycon.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return cast(Callable[[str], str], module.fence_examples)


fence_examples = _fence_examples()


def test_a_doctest_run_is_fenced_up_to_its_blank_line() -> None:
    text = "Prose.\n\n>>> 1 + 1\n2\n>>> [3]\n[3]\n\nMore prose."
    assert fence_examples(text) == "Prose.\n\n```pycon\n>>> 1 + 1\n2\n>>> [3]\n[3]\n```\n\nMore prose."


def test_a_run_keeps_its_indentation_and_closes_at_the_end() -> None:
    assert fence_examples("Examples:\n    >>> x = 1\n    >>> x\n    1") == (
        "Examples:\n    ```pycon\n    >>> x = 1\n    >>> x\n    1\n    ```"
    )


def test_examples_already_fenced_are_left_alone() -> None:
    text = "```pycon\n>>> 1\n1\n```\n\n```\n>>> 2\n```"
    assert fence_examples(text) == text


def test_text_without_examples_is_unchanged() -> None:
    text = "A line with >>> inside it.\n\n    indented\n"
    assert fence_examples(text) == text.rstrip("\n")


def _docstrings() -> Iterator[tuple[str, str]]:
    for path in sorted((ROOT / "prefixroute").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                docstring = ast.get_docstring(node, clean=True)
                if docstring:
                    name = getattr(node, "name", path.stem)
                    yield f"{path.relative_to(ROOT)}:{name}", docstring


def _quoted_lines(text: str) -> list[str]:
    """Lines Markdown would take for a block quote: starting with ``>`` outside a fenced block."""
    quoted, fenced = [], False
    for line in fence_examples(text).splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            fenced = not fenced
        elif not fenced and stripped.startswith(">"):
            quoted.append(line)
    return quoted


def test_no_docstring_line_renders_as_a_block_quote() -> None:
    """A wrapped line that begins with ``>`` (``>= 0``) renders as a block quote; a doctest does once fenced."""
    quoted = {where: lines for where, docstring in _docstrings() if (lines := _quoted_lines(docstring))}
    assert not quoted


def test_the_docstring_scan_sees_the_examples() -> None:
    assert sum(">>> " in docstring for _, docstring in _docstrings()) >= 30
