"""A griffe extension for the API reference: a docstring's doctest examples render as ``pycon`` code.

mkdocstrings reads ``>>>`` lines as code only inside an ``Examples:`` section; elsewhere Markdown takes them for
nested block quotes and runs their lines together (``[(True, 2, None)]`` even became a broken cross-reference).
The library's docstrings keep their examples where they explain something, so this fences each run of them
(a ``>>>`` line up to the next blank line) before griffe parses the docstring. Loaded from mkdocs.yml; the
doctests themselves run in the test suite unchanged.
"""

from __future__ import annotations

from typing import Any

import griffe

_FENCE = "```"


def fence_examples(text: str) -> str:
    """``text`` with each run of doctest lines (a ``>>>`` line up to the next blank line, outside a fenced block)
    wrapped in a ``pycon`` fence at the run's indentation."""
    out: list[str] = []
    fenced = in_run = False
    indent = ""
    for line in text.splitlines():
        stripped = line.strip()
        if in_run and not stripped:
            out.append(f"{indent}{_FENCE}")
            in_run = False
        elif not in_run and not fenced and (stripped == ">>>" or stripped.startswith(">>> ")):
            indent = line[: len(line) - len(line.lstrip())]
            out.append(f"{indent}{_FENCE}pycon")
            in_run = True
        elif not in_run and stripped.startswith(_FENCE):
            fenced = not fenced
        out.append(line)
    if in_run:
        out.append(f"{indent}{_FENCE}")
    return "\n".join(out)


class PyconExamples(griffe.Extension):
    """Fence the doctest examples of every docstring griffe loads."""

    def on_instance(self, **kwargs: Any) -> None:
        docstring = kwargs["obj"].docstring
        if docstring is not None and ">>>" in docstring.value:
            docstring.value = fence_examples(docstring.value)
