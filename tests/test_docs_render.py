"""The API reference renders docstrings as written: doctest examples as code, Sphinx roles as the code they name,
no stray block quotes.

mkdocs.yml loads ``docs/griffe_pycon.py``, which rewrites each docstring before mkdocstrings renders it; without it
Markdown read ``>>>`` lines as nested block quotes with their lines run together, and ``:meth:`` showed as text.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import cast

ROOT = Path(__file__).resolve().parents[1]


def _extension(name: str) -> Callable[[str], str]:
    spec = importlib.util.spec_from_file_location("griffe_pycon", ROOT / "docs" / "griffe_pycon.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return cast(Callable[[str], str], getattr(module, name))


fence_examples = _extension("fence_examples")
plain_roles = _extension("plain_roles")


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


def test_a_role_shows_the_code_it_names_as_sphinx_shows_it() -> None:
    assert plain_roles("See :meth:`Router.finish`, :class:`~prefixroute.vllm.Fleet` and :mod:`.claims`.") == (
        "See `Router.finish`, `Fleet` and `claims`."
    )
    assert plain_roles(
        ":meth:`EngineMetrics.restarted_since\n    <prefixroute.vllm.EngineMetrics.restarted_since>`"
    ) == ("`EngineMetrics.restarted_since`")
    assert plain_roles("a :py:attr:`Candidate.load` and ``code``") == "a `Candidate.load` and ``code``"


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


def test_no_role_is_left_in_any_docstring() -> None:
    """Every role the docstrings use is one the extension plains (a new kind would show as raw text)."""
    left = {where for where, docstring in _docstrings() if re.search(r":[a-z]+:`", plain_roles(docstring))}
    assert not left
