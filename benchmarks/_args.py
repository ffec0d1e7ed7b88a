"""Command-line checks the benchmarks share: a bad value is one line on stderr and exit status 2, as in every
command of the project, never a traceback from deep inside a run."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import NoReturn

from prefixroute.cli import positive_int  # an int >= 1 (a count of runs, requests, connections): the commands' check

__all__ = ["Parser", "existing_file", "non_negative_float", "positive_float", "positive_int", "unit_fraction"]


class Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line (argparse's own print the usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def positive_float(text: str) -> float:
    """A finite number > 0 (a rate, a duration)."""
    return _finite(text, minimum=0.0, inclusive=False)


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (a delay that may be none)."""
    return _finite(text, minimum=0.0, inclusive=True)


def unit_fraction(text: str) -> float:
    """A number in [0, 1]."""
    value = _finite(text, minimum=0.0, inclusive=True)
    if value > 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1], not {text!r}")
    return value


def existing_file(text: str) -> Path:
    """The path of a regular file that exists (a folder, a FIFO or a device is refused, and none is opened)."""
    path = Path(text)
    try:
        exists, regular = path.exists(), path.is_file()
    except (OSError, ValueError) as exc:  # a name too long to look up, a NUL byte
        raise argparse.ArgumentTypeError(f"cannot look up {text!r}: {getattr(exc, 'strerror', None) or exc}") from exc
    if not regular:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a regular file (a folder, a pipe or a device)" if exists else f"no such file: {text!r}"
        )
    return path


def check_output(parser: argparse.ArgumentParser, path: Path, option: str) -> None:
    """Exit now (one line, status 2), not after the run, if a file cannot be written at ``path``: the check
    ``prefixroute simulate`` makes of its outputs (a folder, a path under a file, a name the OS refuses)."""
    from prefixroute.errors import ConfigurationError
    from prefixroute.sim.cli import check_writable

    try:
        check_writable(path, option)
    except ConfigurationError as exc:
        parser.error(str(exc))


def _finite(text: str, *, minimum: float, inclusive: bool) -> float:
    bound = f">= {minimum:g}" if inclusive else f"> {minimum:g}"
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number {bound}, not {text!r}") from None
    if not math.isfinite(value) or value < minimum or (value == minimum and not inclusive) or value > 1e9:
        raise argparse.ArgumentTypeError(f"expected a finite number {bound} (at most 1e9), not {text!r}")
    return value
