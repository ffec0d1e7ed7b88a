"""The ``prefixroute`` command: one subcommand per layer, each registered by its own module.

Bad input of any kind (a usage error, an option out of range, a file that cannot be read or written, a
:class:`~prefixroute.errors.PrefixRouteError` from the library) ends the command with exit status 2 and one line on
stderr, ``prefixroute COMMAND: error: what to fix``, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, NoReturn

from prefixroute.errors import PrefixRouteError

# Module → (the extra it needs, the subcommands it registers). Each module defines ``register(subparsers)``, adding
# its subcommands with ``set_defaults(func=...)`` where ``func(args) -> int`` returns the exit status. Modules are
# imported only when the CLI runs; one whose extra is not installed still lists its subcommands, which then say
# what to install.
COMMAND_MODULES: Mapping[str, tuple[str, tuple[str, ...]]] = MappingProxyType(
    {
        "prefixroute.sim.cli": ("sim", ("simulate", "compare", "study")),
        "prefixroute.vllm.doctor": ("vllm", ("doctor",)),
        "prefixroute.adapters.serve.cli": ("serve", ("serve",)),
        "prefixroute.adapters.proxy.cli": ("proxy", ("proxy",)),
        "prefixroute.testing.openai_engine": ("proxy", ("fake-engines",)),
    }
)

# Extra → the modules it installs (import names; platform-conditional ones left out). A command module may import
# its extra's packages only when it runs, so these are looked up before its subcommands are registered: a missing one
# makes them say what to install rather than fail with a traceback half-way.
_VLLM_MODULES = ("zmq", "msgspec", "httpx", "prometheus_client")
EXTRA_MODULES: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "sim": ("matplotlib", "rich"),
        "vllm": _VLLM_MODULES,
        "serve": (*_VLLM_MODULES, "uvicorn", "httptools", "jinja2", "grpc", "envoy"),  # includes prefixroute[vllm]
        "proxy": (*_VLLM_MODULES, "aiohttp", "multidict", "jinja2"),  # the proxy extra includes prefixroute[vllm]
    }
)


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser with every subcommand registered."""
    from prefixroute import __version__

    parser = OneLineParser(
        prog="prefixroute",
        description="Prefix-aware, load-bounded routing of LLM requests: simulate and compare policies, rerun the "
        "study, diagnose a vLLM deployment, and route live traffic (a decision sidecar for gateways, an "
        "OpenAI-compatible proxy).",
    )
    parser.add_argument("--version", action="version", version=f"prefixroute {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name, (extra, commands) in COMMAND_MODULES.items():
        try:
            _require_modules(EXTRA_MODULES[extra])
            module = importlib.import_module(module_name)
        except ImportError as exc:
            for command in commands:
                needs = f"needs: pip install 'prefixroute[{extra}]'"
                unavailable = subparsers.add_parser(
                    command, help=f"({needs})", description=f"prefixroute {command} {needs} ({exc})"
                )
                unavailable.add_argument("ignored", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
                unavailable.set_defaults(func=_missing_extra(command, extra, exc), unavailable=True)
            continue
        module.register(subparsers)
    return parser


def _require_modules(names: Sequence[str]) -> None:
    """Raise ImportError naming the first of ``names`` that is not installed (found without importing it)."""
    for name in names:
        if importlib.util.find_spec(name) is None:
            raise ImportError(f"No module named {name!r}", name=name)


def _missing_extra(command: str, extra: str, exc: ImportError) -> Callable[[Any], int]:
    def run(args: Any) -> int:
        print(
            f"prefixroute {command} needs the '{extra}' extra: pip install 'prefixroute[{extra}]' ({exc})",
            file=sys.stderr,
        )
        return 2

    return run


class UsageError(Exception):
    """A command line argparse rejected: its one-line message names the command and what to fix."""


class OneLineParser(argparse.ArgumentParser):
    """An argument parser that reports a usage error as one line (subcommands' parsers are of this class too, and
    so are the ``python -m prefixroute.sim.costfit`` and ``costplot`` commands')."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: error: {message} (see {self.prog} --help)")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; return the process exit status (2, with one line on stderr, for any bad input; 130 after Ctrl-C,
    143 after SIGTERM, each with one line; 1, silently, when stdout's reader has gone, as ``| head`` does)."""
    _sturdy_streams()
    previous = _on_sigterm()
    try:
        return _run(argv)
    except KeyboardInterrupt:  # before a command ran: while the parser imported the commands' modules
        return fail("prefixroute: interrupted", status=130)
    except _Terminated:
        return fail("prefixroute: terminated (SIGTERM)", status=143)
    except BrokenPipeError:  # stdout's reader went away (`| head -1`): nothing more to say, and nowhere to say it
        _discard(sys.stdout)
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _run(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(argv)
    except UsageError as exc:
        return fail(str(exc))
    func = getattr(args, "func", None)
    if func is None:
        commands = ", ".join(c for _extra, names in COMMAND_MODULES.values() for c in names)
        return fail(f"{parser.prog}: error: give a command, one of {commands} (see {parser.prog} --help)")
    command = f"{parser.prog} {args.command}"
    if unknown and not getattr(args, "unavailable", False):  # a command that cannot run takes any arguments
        return fail(f"{command}: error: unrecognized arguments: {' '.join(unknown)} (see {command} --help)")
    try:
        status: int = func(args)
    except PrefixRouteError as exc:
        return fail(f"{command}: error: {exc}")
    except BrokenPipeError:
        raise
    except OSError as exc:  # a path that cannot be read or written
        where = f": {exc.filename}" if exc.filename is not None else ""
        return fail(f"{command}: error: {exc.strerror or exc}{where}")
    except KeyboardInterrupt:
        return fail(f"{command}: interrupted", status=130)
    except _Terminated:
        return fail(f"{command}: terminated (SIGTERM)", status=143)
    return status


class _Terminated(BaseException):
    """SIGTERM, raised in the main thread so that a command unwinds as after Ctrl-C (a compare's worker processes
    stopped, files closed) instead of dying where it stands. The servers handle SIGTERM themselves (exit 0)."""


def _terminate(signum: int, frame: object) -> None:
    raise _Terminated


def _on_sigterm() -> Any:
    """Raise :class:`_Terminated` on SIGTERM while the CLI runs; the handler it replaces (None: none was replaced,
    off the main thread or where another than the default is set)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        return None
    return signal.signal(signal.SIGTERM, _terminate)


def _sturdy_streams() -> None:
    """Streams a command can always print to: one the caller closed (``>&-``, which Python shows as None) writes to
    os.devnull, and a path that is not UTF-8 (argv keeps its bytes as lone surrogates) prints as those bytes, not as
    a UnicodeEncodeError after the work is done."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None:
            setattr(sys, name, open(os.devnull, "w"))  # noqa: SIM115  # the process's own, for its whole life
        elif isinstance(stream, io.TextIOWrapper) and stream.errors == "strict":
            stream.reconfigure(errors="surrogateescape")


def announce(line: str) -> None:
    """Print a server's announcement line on stdout; a reader that has gone (``| true``) costs the line, not the
    server (its stdout then writes to os.devnull)."""
    try:
        print(line, flush=True)
    except BrokenPipeError:
        _discard(sys.stdout)


def _discard(stream: Any) -> None:
    """Point ``stream``'s file descriptor at os.devnull, so that the interpreter's last flush at exit, into a pipe
    whose reader is gone, raises nothing more."""
    with contextlib.suppress(AttributeError, OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)


def positive_int(text: str) -> int:
    """An argparse ``type``: an int >= 1 (a count, a size); else the one-line usage error. The commands' and the
    benchmarks' (``benchmarks/_args.py``) one check of it."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, not {text!r}")
    return value


MAX_BODY_MIB = 4096
"""The largest ``--max-body-mib`` of ``prefixroute proxy`` and ``prefixroute serve``: each holds a request body whole,
so a larger limit is a typo (bytes given as MiB), not a plan."""


def body_mib(text: str) -> int:
    """An argparse ``type``: a body limit in MiB, an int in [1, :data:`MAX_BODY_MIB`]; else the one-line usage
    error. The proxy's and the sidecar's ``--max-body-mib``."""
    value = positive_int(text)
    if value > MAX_BODY_MIB:
        raise argparse.ArgumentTypeError(f"expected a whole number of MiB from 1 to {MAX_BODY_MIB}, not {text!r}")
    return value


def fail(message: str, *, status: int = 2) -> int:
    """Print ``message`` to stderr as one line; return ``status`` (the exit status of bad input)."""
    print(" ".join(message.split()), file=sys.stderr)  # one line, whatever the message holds
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
