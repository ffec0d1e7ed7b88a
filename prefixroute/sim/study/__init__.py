"""``prefixroute study``: rerun every published claim in the simulator and write ``docs/study.md`` with plots.

Three parts, each with one job: :mod:`.runs` runs the simulations (nothing there knows what was published),
:mod:`.claims` holds the published figures and the rule that judges each, and computes every verdict, and
:mod:`.render` writes the page from the runs and the verdicts.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from prefixroute._numbers import as_int, shown
from prefixroute.errors import ConfigurationError
from prefixroute.sim.engine import MAX_REQUESTS
from prefixroute.sim.study.claims import CLAIMS, judge
from prefixroute.sim.study.render import render
from prefixroute.sim.study.runs import run_all

__all__ = ["run_study"]


def run_study(out: Path, *, requests: int = 1500, progress: Callable[[str], None] = lambda _m: None) -> Path:
    """Run every simulation, judge every claim, and write ``out/study.md`` plus its PNGs; return the page's path.

    Takes about a minute at 1,500 requests per run (41 runs).

    Raises:
        ConfigurationError: ``requests`` is not an int in [1, ``MAX_REQUESTS``], or ``out`` exists and is not a folder.
        OSError: ``out`` cannot be created or written.
    """
    count = as_int(requests)
    if count is None or not 1 <= count <= MAX_REQUESTS:
        raise ConfigurationError(f"--requests must be an int in [1, {MAX_REQUESTS:,}], not {shown(requests)}")
    requests = count
    if out.exists() and not out.is_dir():
        raise ConfigurationError(f"--output {out} is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    runs = run_all(requests, progress)
    page = render(runs, judge(CLAIMS, runs), out)
    path = out / "study.md"
    path.write_text(page + "\n", encoding="utf-8")
    return path
