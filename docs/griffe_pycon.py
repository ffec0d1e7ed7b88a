"""A griffe extension for the API reference: docstrings written for Python's own tools render as Markdown.

mkdocstrings reads ``>>>`` lines as code only inside an ``Examples:`` section; elsewhere Markdown takes them for
nested block quotes and runs their lines together (``[(True, 2, None)]`` even became a broken cross-reference).
The library's docstrings keep their examples where they explain something, so this fences each run of them
(a ``>>>`` line up to the next blank line) before griffe parses the docstring. Their Sphinx roles
(``:meth:`~Router.finish```, which IDEs and ``help()`` readers know) render as the code they name, as Sphinx shows
them, instead of the role's raw text. Loaded from mkdocs.yml; the doctests themselves run in the test suite
unchanged.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_FENCE = "```"
_ROLE = re.compile(r":(?:py:)?(?:meth|class|attr|func|mod|exc|data|obj|const):`(?P<target>[^`]+)`")


def _shown(match: re.Match[str]) -> str:
    """What Sphinx shows for a role's target: an explicit title (``title <target>``), else the target, cut to its
    last part when it starts with ``~``."""
    target = match["target"].strip()
    title = re.fullmatch(r"(?P<title>.+?)\s*<[^<>]+>", target, re.DOTALL)
    if title:
        return f"`{title['title']}`"
    if target.startswith("~"):
        target = target[1:].rsplit(".", 1)[-1]
    return f"`{target.lstrip('.!')}`"


def plain_roles(text: str) -> str:
    """``text`` with each Sphinx cross-reference role (``:meth:`x```) replaced by the code it names."""
    return _ROLE.sub(_shown, text)


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
    """Fence the doctest examples and plain the Sphinx roles of every docstring griffe loads."""

    def on_instance(self, **kwargs: Any) -> None:
        docstring = kwargs["obj"].docstring
        if docstring is not None:
            docstring.value = plain_roles(fence_examples(docstring.value))
