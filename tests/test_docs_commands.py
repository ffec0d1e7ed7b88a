"""Every command line the docs tell a user to run parses with the parser that command really uses.

The shell blocks (``sh``, ``bash``, ``shell``, ``console``) of README.md and docs/*.md, and the commands in the comments
of the example gateway configurations, are read line by line: ``prefixroute SUBCOMMAND ...`` goes through the CLI's
own parser (:func:`prefixroute.cli.build_parser`), ``python benchmarks/X.py ...`` through that benchmark's, and
``python -m prefixroute.sim.costfit`` / ``costplot`` through theirs. Nothing runs: each parser stops once it has
parsed, so a renamed or removed flag in the code, or a made-up one in the docs, fails here. Placeholders (``URL``,
``N``, ``/models/llama``) are fine as long as they parse; a bare upper-case word stands for a number.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest

from prefixroute.cli import UsageError, build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CONFIGS = [ROOT / "examples" / name for name in ("nginx/prefixroute.conf", "haproxy/haproxy.cfg", "envoy/envoy.yaml")]
CONFIGS.append(ROOT / "examples" / "litellm" / "config.yaml")
SHELL = ("sh", "bash", "shell", "console")
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```", re.MULTILINE | re.DOTALL)
OPERATORS = {"|", "||", "&&", ";", "&"}
REDIRECTION = re.compile(r"^\d*(?:>>|>|<|&>)(.*)$")
ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]*$")  # N, PORT, SECONDS: a number in a synopsis
COMMANDS = ("prefixroute", "python", "python3")


def shell_lines(text: str, *, console: bool) -> Iterator[str]:
    """The logical lines of a shell block: continuations joined, ``$ `` prompts stripped (in a console block only
    prompted lines are commands; the rest is output); a quoted string that spans lines stays one line."""
    pending = ""
    for line in re.sub(r"\\\n\s*", " ", text).splitlines():
        if pending:
            line = f"{pending}\n{line}"
        else:
            line = line.strip()
            if console:
                if not line.startswith("$ "):
                    continue
                line = line[2:]
        try:
            shlex.split(line, comments=True)
        except ValueError:  # a quote still open
            pending = line
            continue
        pending = ""
        if line:
            yield line
    assert not pending, f"a quote is never closed: {pending!r}"


def commands(line: str) -> Iterator[list[str]]:
    """Each simple command of ``line`` as its words: comments, pipes, ``&&`` lists, redirections, a trailing ``&``,
    environment assignments and a ``.venv/bin/`` prefix left out, a synopsis's ``[optional]`` brackets and ``...``
    dropped."""
    words: list[str] = []
    target = False  # the next word is a redirection's target
    for word in shlex.split(line.replace("[", " ").replace("]", " "), comments=True):
        if target:
            target = False
        elif word in OPERATORS:
            yield from _command(words)
            words = []
        elif redirection := REDIRECTION.match(word):  # >, 2>, >>, <, &>, with or without its target attached
            target = not redirection[1]
        elif word not in ("...", "…"):
            words.append(word)
    yield from _command(words)


def _command(words: list[str]) -> Iterator[list[str]]:
    while words and ENV.match(words[0]):
        words = words[1:]
    if words:
        words = [words[0].removeprefix(".venv/bin/").removeprefix("../.venv/bin/"), *words[1:]]
        if words[0] in COMMANDS:
            yield words


def block_commands(text: str, name: str) -> list[tuple[str, list[str]]]:
    """(where, words) of every ``prefixroute`` and ``python`` command in the shell blocks of the Markdown ``text``."""
    found: list[tuple[str, list[str]]] = []
    for block in FENCE.finditer(text):
        if block["lang"] in SHELL:
            where = f"{name}:{text[: block.start()].count(chr(10)) + 1}"
            for line in shell_lines(block["body"], console=block["lang"] == "console"):
                found += [(where, words) for words in commands(line)]
    return found


def documented() -> list[tuple[str, list[str]]]:
    """(where, words) of every command in the docs' shell blocks and in the example configurations' comments."""
    found = [cmd for page in PAGES for cmd in block_commands(page.read_text(), str(page.relative_to(ROOT)))]
    for config in CONFIGS:
        for number, line in enumerate(config.read_text().splitlines(), 1):
            match = re.match(r"^\s*#\s{2,}((?:\.venv/bin/)?prefixroute [a-z][a-z-]* .*)$", line)
            if match:
                found += [(f"{config.relative_to(ROOT)}:{number}", words) for words in commands(match[1])]
    return found


def placeholders(args: list[str]) -> list[str]:
    return ["1" if PLACEHOLDER.match(arg) else arg for arg in args]


class Parsed(Exception):
    """Raised by a command's parser once it has parsed (carrying that parser): its main() goes no further."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


class Refused(Exception):
    """A benchmark's or module's parser refused the command line (its message is argparse's)."""


def stopping(base: type[argparse.ArgumentParser]) -> type[argparse.ArgumentParser]:
    """A subclass of ``base`` that raises Parsed once it has parsed and Refused where ``base`` reports an error."""

    class StopAfterParsing(base):  # type: ignore[misc, valid-type]
        def parse_args(self, args: Any = None, namespace: Any = None) -> NoReturn:
            super().parse_args(args, namespace)
            raise Parsed(self)

        def error(self, message: str) -> NoReturn:
            raise Refused(message)

    return StopAfterParsing


def parse_benchmark(script: str, args: list[str], monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """Parse ``python script args`` with the benchmark's own parser (each builds a ``_args.Parser`` in main() and
    parses ``sys.argv``; importing one runs nothing) and return that parser; raise Refused if it refuses them."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # the benchmarks import _args from their folder
    spec = importlib.util.spec_from_file_location(f"_docs_{Path(script).stem}", ROOT / script)
    assert spec is not None and spec.loader is not None, f"{script}: no such benchmark"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert isinstance(getattr(module, "Parser", None), type), f"{script} builds no _args.Parser: teach this test"
    monkeypatch.setattr(module, "Parser", stopping(module.Parser))
    monkeypatch.setattr(sys, "argv", [script, *args])
    with pytest.raises(Parsed) as parsed:
        module.main()
    return parsed.value.parser


def parse_module(name: str, args: list[str], monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """Parse ``python -m name args`` with that module's parser (``costfit`` and ``costplot`` build a
    :class:`~prefixroute.cli.OneLineParser` in main()) and return it; raise Refused if it refuses them."""
    import prefixroute.cli

    module = importlib.import_module(name)
    monkeypatch.setattr(prefixroute.cli, "OneLineParser", stopping(prefixroute.cli.OneLineParser))
    with pytest.raises(Parsed) as parsed:
        module.main(args)
    return parsed.value.parser


def parse_cli(args: list[str]) -> list[argparse.ArgumentParser]:
    """Parse ``prefixroute args`` as the CLI does and return its parser and the subcommand's; raise UsageError if
    they refuse them."""
    parser = build_parser()
    parsed = parser.parse_args(args)
    if getattr(parsed, "unavailable", False):
        pytest.skip(f"prefixroute {parsed.command}: its extra is not installed")
    [subparsers] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return [parser, subparsers.choices[parsed.command]]


def check(words: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Parse one documented command with its own parser; raise UsageError or Refused if it refuses it, and fail if
    it names a flag only by an abbreviation (argparse takes ``--metrics`` for ``--metrics-interval``)."""
    program, args = words[0], placeholders(words[1:])
    if program == "prefixroute":
        parsers = parse_cli(args)
    elif args[:1] == ["-m"]:
        args = args[2:]
        parsers = [parse_module(words[2], args, monkeypatch)]
    elif args and args[0].startswith("benchmarks/") and args[0].endswith(".py"):
        args = args[1:]
        parsers = [parse_benchmark(words[1], args, monkeypatch)]
    else:
        pytest.skip(f"not a command this test knows how to parse: {' '.join(words)}")
    flags = {flag for parser in parsers for flag in parser._option_string_actions}
    named = [arg.partition("=")[0] for arg in args if arg.startswith("-") and not arg.lstrip("-").isdigit()]
    inexact = [flag for flag in named if flag not in flags]
    assert not inexact, f"`{' '.join(words)}`: {inexact} not the exact name of any flag of the command"


COMMANDS_IN_DOCS = documented()


@pytest.mark.parametrize(
    ("where", "words"), COMMANDS_IN_DOCS, ids=[f"{w}:{' '.join(c)[:60]}" for w, c in COMMANDS_IN_DOCS]
)
def test_documented_command_parses(where: str, words: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        check(words, monkeypatch)
    except (UsageError, Refused) as exc:
        pytest.fail(f"{where}: `{' '.join(words)}` does not parse: {exc}")
    except AssertionError as exc:
        pytest.fail(f"{where}: {exc}")


def test_the_docs_name_commands_of_every_kind() -> None:
    """The extraction finds what it should: the README's proxy walk-through, the simulator's and doctor's commands,
    the benchmarks and the gateway configs' sidecar."""
    found = {" ".join(words[:2]) for _where, words in COMMANDS_IN_DOCS}
    expected = {
        "prefixroute fake-engines",
        "prefixroute proxy",
        "prefixroute simulate",
        "prefixroute compare",
        "prefixroute doctor",
        "prefixroute serve",
        "python benchmarks/bench_route.py",
        "python -m",
    }
    assert expected <= found, f"missing: {expected - found}"
    assert any(where.startswith("README.md") for where, _words in COMMANDS_IN_DOCS)


@pytest.mark.parametrize(
    "line",
    [
        "prefixroute proxy --backends http://a:8000 --no-such-flag",
        "prefixroute simulate --scenario no-such-scenario",
        "prefixroute doctor http://gpu0:8000 --jsn",
        "prefixroute no-such-command --x",
        ".venv/bin/python benchmarks/bench_route.py --quick --no-such-flag  # a comment",
        "python -m prefixroute.sim.costfit --data data --no-such-flag",
        "prefixroute compare --scenario seed --metrics 0.1",  # argparse would take it for --metrics-interval
        ".venv/bin/python benchmarks/bench_route.py --bound",  # and this for --bounded
    ],
)
def test_a_flag_that_does_not_exist_fails(line: str, monkeypatch: pytest.MonkeyPatch) -> None:
    [words] = list(commands(line))
    with pytest.raises((UsageError, Refused, AssertionError)):
        check(words, monkeypatch)


def test_the_line_splitter_keeps_only_the_command() -> None:
    block = (
        "$ curl -s http://gpu0:8000/metrics > gpu0.txt && prefixroute doctor gpu0.txt --json\n"
        "some output\n"
        "$ FOO=1 .venv/bin/prefixroute proxy --backends \\\n    http://a:1 [--port PORT] 2>/dev/null | tee log &\n"
    )
    found = [words for line in shell_lines(block, console=True) for words in commands(line)]
    assert found == [
        ["prefixroute", "doctor", "gpu0.txt", "--json"],
        ["prefixroute", "proxy", "--backends", "http://a:1", "--port", "PORT"],
    ]
    assert placeholders(found[1]) == ["prefixroute", "proxy", "--backends", "http://a:1", "--port", "1"]


def test_a_page_that_names_a_flag_that_does_not_exist_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end, from a Markdown page (a string here, never the docs) to the parser's refusal."""
    page = (
        "Run it:\n\n```sh\n.venv/bin/prefixroute simulate --scenario seed \\\n    --plot out/a.png  # the plot\n"
        "prefixroute simulate --scenario seed --no-such-flag 3 > out.txt\n```\n"
    )
    good, bad = block_commands(page, "page.md")
    assert good == ("page.md:3", ["prefixroute", "simulate", "--scenario", "seed", "--plot", "out/a.png"])
    check(good[1], monkeypatch)
    with pytest.raises(UsageError, match="unrecognized arguments: --no-such-flag"):
        check(bad[1], monkeypatch)
