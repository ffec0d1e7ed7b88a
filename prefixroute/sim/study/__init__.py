"""``prefixroute study``: rerun every published claim in the simulator and write ``docs/study.md`` with plots.

Three parts, each with one job: :mod:`.runs` runs the simulations (nothing there knows what was published),
:mod:`.claims` holds the published figures and the rule that judges each, and computes every verdict, and
:mod:`.render` writes the page from the runs and the verdicts.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from prefixroute._numbers import as_int, shown
from prefixroute.errors import ConfigurationError, InvalidTypeError
from prefixroute.sim.engine import MAX_REQUESTS
from prefixroute.sim.study.claims import CLAIMS, judge
from prefixroute.sim.study.render import PLOTS, render
from prefixroute.sim.study.runs import run_all

__all__ = ["run_study"]


def run_study(
    out: str | os.PathLike[str], *, requests: int = 1500, progress: Callable[[str], None] = lambda _m: None
) -> Path:
    """Run every simulation, judge every claim, and write ``out/study.md`` plus its PNGs; return the page's path.

    Takes about a minute at 1,500 requests per run (41 runs). Every argument is checked before anything is run
    or written.

    Raises:
        InvalidTypeError: ``out`` is not a str or a path, or ``progress`` is not callable.
        ConfigurationError: ``requests`` is not an int in [1, ``MAX_REQUESTS``], ``out`` is a blank name (which
            would be the current folder) or holds a NUL byte, or exists and is not a folder, or cannot be created,
            a file of the page cannot be written there (checked before the runs, and when written), or matplotlib
            cannot write the plots. The message names the argument as passed here (``requests``, ``out``).
    """
    return _run_study(out, requests=requests, progress=progress, names=("out", "requests"))


def _run_study(
    out: str | os.PathLike[str], *, requests: int, progress: Callable[[str], None], names: tuple[str, str]
) -> Path:
    """:func:`run_study`, its messages naming ``out`` and ``requests`` as ``names`` says: the keywords of a Python
    caller, or the options of ``prefixroute study`` (``--output``, ``--requests``)."""
    out_name, requests_name = names
    if not isinstance(out, (str, os.PathLike)):
        raise InvalidTypeError(f"{out_name} must be a folder (a str or a path), not {type(out).__name__}")
    if isinstance(out, str) and not out.strip():
        raise ConfigurationError(f"{out_name} must name a folder, not {out!r}")
    if "\0" in os.fspath(out):
        raise ConfigurationError(f"{out_name} {os.fspath(out)!r}: a path cannot hold a NUL byte")
    if not callable(progress):
        raise InvalidTypeError(f"progress must be callable, not {type(progress).__name__}")
    count = as_int(requests)
    if count is None or not 1 <= count <= MAX_REQUESTS:
        raise ConfigurationError(f"{requests_name} must be an int in [1, {MAX_REQUESTS:,}], not {shown(requests)}")
    requests = count
    folder = Path(out)
    if folder.exists() and not folder.is_dir():
        raise ConfigurationError(f"{out_name} {folder} is not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # /proc, /sys, a read-only mount
        raise ConfigurationError(f"{out_name} {folder}: cannot create the folder ({exc.strerror or exc})") from exc
    # The runs take minutes at the default requests: find a file that cannot be written (or no matplotlib) now.
    from prefixroute.sim.cli import check_writable
    from prefixroute.sim.report import check_plot_path, write_text

    for name in ("study.md", *PLOTS):
        check_writable(folder / name, out_name)
    check_plot_path(folder / PLOTS[0], out_name)
    runs = run_all(requests, progress)
    page = render(runs, judge(CLAIMS, runs), folder)
    path = folder / "study.md"
    write_text(path, page)
    return path
