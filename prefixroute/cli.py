"""The ``prefixroute`` command: one subcommand per layer, each registered by its own module."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Each module defines ``register(subparsers)``, adding its subcommand with ``set_defaults(func=...)`` where
# ``func(args) -> int`` returns the exit status. Modules are imported only when the CLI runs.
COMMAND_MODULES: tuple[str, ...] = ("prefixroute.sim.cli", "prefixroute.vllm.doctor")


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
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


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
