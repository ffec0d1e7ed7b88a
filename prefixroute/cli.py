"""The ``prefixroute`` command: one subcommand per layer, each registered by its own module."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

# Module → (the extra it needs, the subcommands it registers). Each module defines ``register(subparsers)``, adding
# its subcommands with ``set_defaults(func=...)`` where ``func(args) -> int`` returns the exit status. Modules are
# imported only when the CLI runs; one whose extra is not installed still lists its subcommands, which then say
# what to install.
COMMAND_MODULES: Mapping[str, tuple[str, tuple[str, ...]]] = MappingProxyType(
    {
        "prefixroute.sim.cli": ("sim", ("simulate", "study")),
        "prefixroute.vllm.doctor": ("vllm", ("doctor",)),
    }
)


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser with every subcommand registered."""
    from prefixroute import __version__

    parser = argparse.ArgumentParser(
        prog="prefixroute",
        description="Prefix-aware, load-bounded routing of LLM requests: simulate policies, rerun the study, "
        "diagnose a vLLM deployment.",
    )
    parser.add_argument("--version", action="version", version=f"prefixroute {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name, (extra, commands) in COMMAND_MODULES.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            for command in commands:
                unavailable = subparsers.add_parser(command, help=f"(needs: pip install 'prefixroute[{extra}]')")
                unavailable.add_argument("ignored", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
                unavailable.set_defaults(func=_missing_extra(command, extra, exc))
            continue
        module.register(subparsers)
    return parser


def _missing_extra(command: str, extra: str, exc: ImportError) -> Callable[[Any], int]:
    def run(args: Any) -> int:
        print(
            f"prefixroute {command} needs the '{extra}' extra: pip install 'prefixroute[{extra}]' ({exc})",
            file=sys.stderr,
        )
        return 2

    return run


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; return the process exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return 2
    status: int = func(args)
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
