"""Compare every built-in and baseline policy on one workload: run them, rank them, recommend one.

The recommendation rule (:func:`rank`): a policy is *eligible* when its throughput is at least ``1 - tolerance``
(0.97) of the best throughput any policy reached; the recommendation is the eligible policy with the lowest P99 TTFT
(ties: lower P50 TTFT, then higher KV hit rate, then name). The tail decides because the mean hides what users
wait for; the throughput floor stops a policy from buying its tail by serving less (closed-loop users slow down
when their backend is slow, which shortens queues). The ranking lists eligible policies by that order, then the
rest by the same order, so the recommendation is rank 1.

Runs are independent simulations, each built from the spec's seed, so running them in a process pool
(:func:`run_grid`) gives exactly the results of running them one after another.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from prefixroute._numbers import as_float, as_int, shown
from prefixroute.errors import ConfigurationError
from prefixroute.policies import policy_names
from prefixroute.router import Router
from prefixroute.sim.baselines import BASELINES
from prefixroute.sim.metrics import PolicyResult
from prefixroute.sim.report import rate_cell, ratio_cell
from prefixroute.sim.runner import SimSpec, run_policy

if TYPE_CHECKING:
    from rich.table import Table

    from prefixroute.sim.engine import Workload

__all__ = [
    "THROUGHPUT_TOLERANCE",
    "Ranking",
    "compared_policies",
    "default_policy_name",
    "markdown_table",
    "ms_cell",
    "policy_kind",
    "rank",
    "rich_table",
    "run_grid",
    "write_plot",
]

THROUGHPUT_TOLERANCE = 0.03
"""A recommended policy may lose at most this fraction of the best throughput."""


def compared_policies() -> list[str]:
    """Every built-in policy (:func:`~prefixroute.policy_names`), then every baseline (:data:`BASELINES`)."""
    return [*policy_names(), *(name for name in BASELINES if name not in policy_names())]


def default_policy_name() -> str:
    """The registry name of the policy ``Router()`` uses when given none (read from a fresh Router)."""
    return Router().policy.name


def policy_kind(name: str) -> str:
    """``"built-in"``, ``"baseline"`` or ``"user"``: where a policy name comes from."""
    if name in policy_names():
        return "built-in"
    return "baseline" if name in BASELINES else "user"


@dataclass(frozen=True)
class Ranking:
    """Results in rank order, the recommended one (rank 1), and the figures the rule used."""

    results: tuple[PolicyResult, ...]
    best_throughput: float
    best_p99_ms: float
    tolerance: float

    @property
    def recommended(self) -> PolicyResult:
        """The policy the rule recommends: rank 1."""
        return self.results[0]

    def eligible(self, result: PolicyResult) -> bool:
        """Whether ``result`` keeps at least ``1 - tolerance`` of the best throughput and served any request."""
        return _served(result) and result.throughput_rps >= (1 - self.tolerance) * self.best_throughput

    def of(self, policy: str) -> PolicyResult | None:
        """The result of ``policy``, or None if it was not compared."""
        return next((r for r in self.results if r.policy == policy), None)

    def position(self, policy: str) -> int | None:
        """``policy``'s rank (1 = recommended), or None if it was not compared."""
        return next((i for i, r in enumerate(self.results, 1) if r.policy == policy), None)


def rank(results: Sequence[PolicyResult], *, tolerance: float = THROUGHPUT_TOLERANCE) -> Ranking:
    """Rank ``results`` by the recommendation rule (module docstring). O(n log n).

    A result with no served request (NaN TTFT) is never eligible and ranks last.

    Raises:
        ConfigurationError: ``results`` is empty, two results share a policy name, or ``tolerance`` is not in [0, 1).
    """
    if not results:
        raise ConfigurationError("nothing to rank: compare at least one policy")
    names = [r.policy for r in results]
    if len(set(names)) != len(names):
        repeated = sorted({n for n in names if names.count(n) > 1})
        raise ConfigurationError(f"each policy may be compared once; repeated: {', '.join(repeated)}")
    share = as_float(tolerance)
    if share is None or not 0 <= share < 1:
        raise ConfigurationError(f"tolerance must be in [0, 1), not {tolerance!r}")
    tolerance = share
    served = [r for r in results if _served(r)]
    best_throughput = max((r.throughput_rps for r in served), default=0.0)
    best_p99 = min((r.ttft_ms["p99"] for r in served), default=math.nan)
    floor = (1 - tolerance) * best_throughput

    def key(r: PolicyResult) -> tuple[bool, float, float, float, str]:
        if not _served(r):
            return (True, math.inf, math.inf, 0.0, r.policy)
        return (r.throughput_rps < floor, r.ttft_ms["p99"], r.ttft_ms["p50"], -r.hit_rate, r.policy)

    ordered = tuple(sorted(results, key=key))
    return Ranking(results=ordered, best_throughput=best_throughput, best_p99_ms=best_p99, tolerance=tolerance)


def _served(result: PolicyResult) -> bool:
    return result.requests > 0 and not math.isnan(result.ttft_ms["p99"])


def run_grid(
    runs: Sequence[tuple[SimSpec, str]],
    *,
    jobs: int = 1,
    on_done: Callable[[int, PolicyResult], None] | None = None,
    workload: Callable[[], Workload] | None = None,
) -> list[PolicyResult]:
    """Simulate every ``(spec, policy name)`` pair; return the results in the order of ``runs``.

    ``workload`` (picklable when ``jobs`` > 1) builds every run's request source, as in :func:`run_policy`: a trace
    read once instead of once per run.

    ``jobs`` > 1 runs them in a pool of that many processes (spawned, so nothing of this process's state is
    shared); the results are the same as with ``jobs=1``, since every run is built from its spec's seed.
    ``on_done(index, result)`` is called in this process as each run finishes, in completion order.

    Raises:
        ConfigurationError: ``jobs`` is not a positive int; and whatever a run raises (the first failure, after
            the pool is shut down).
    """
    count = as_int(jobs)
    if count is None or count < 1:
        raise ConfigurationError(f"--jobs must be a positive int, not {shown(jobs)}")
    jobs = count
    results: list[PolicyResult | None] = [None] * len(runs)
    if jobs == 1 or len(runs) <= 1:
        for i, (spec, name) in enumerate(runs):
            results[i] = run_policy(spec, name, workload=workload)
            if on_done is not None:
                on_done(i, results[i])  # type: ignore[arg-type]
        return [r for r in results if r is not None]
    context = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(
        max_workers=min(jobs, len(runs)), mp_context=context, initializer=_start_worker, initargs=(os.getpid(),)
    )
    try:
        futures: dict[Future[PolicyResult], int] = {
            pool.submit(run_policy, spec, name, workload=workload): i for i, (spec, name) in enumerate(runs)
        }
        for future in as_completed(futures):
            index = futures[future]
            results[index] = future.result()
            if on_done is not None:
                on_done(index, results[index])  # type: ignore[arg-type]
    except BaseException:
        _stop_workers(pool)
        raise
    pool.shutdown()
    return [r for r in results if r is not None]


_ORPHAN_POLL_S = 0.5  # how often a worker checks that the process that started it is still there


def _start_worker(parent: int) -> None:
    """Each pool process's initializer: Ctrl-C, which the terminal sends to every process of the command, is the
    parent's to handle (it stops the pool, see :func:`_stop_workers`), and a worker ends once its parent is gone
    (SIGTERM or SIGKILL to the parent alone) instead of simulating on as an orphan."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_when_orphaned, args=(parent,), name="prefixroute-orphan-watch", daemon=True).start()


def _exit_when_orphaned(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(_ORPHAN_POLL_S)
    os._exit(1)


def _stop_workers(pool: ProcessPoolExecutor) -> None:
    """Stop ``pool`` now: no queued run starts and the running ones are terminated (a pool's shutdown would wait for
    every run already handed to a worker; ``terminate_workers()`` does this from Python 3.14)."""
    processes = list((pool._processes or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        with contextlib.suppress(ValueError, ProcessLookupError):  # closed, or gone already
            if process.is_alive():
                process.terminate()
    for process in processes:
        with contextlib.suppress(ValueError):
            process.join(timeout=5)
            if process.is_alive():  # SIGTERM not heeded in time (a machine under load): SIGKILL is
                process.kill()
                process.join(timeout=5)


_HEADERS = (
    "rank",
    "policy",
    "kind",
    "TTFT p50 ms",
    "TTFT p99 ms",
    "req/s",
    "KV hit",
    "max share",
    "P99 ÷ best",
    "req/s ÷ best",
)


def table_rows(ranking: Ranking, *, default: str | None = None) -> list[list[str]]:
    """One row of formatted cells per policy, in rank order (see ``_HEADERS``)."""
    rows: list[list[str]] = []
    for i, r in enumerate(ranking.results, 1):
        kind = policy_kind(r.policy) + (", default" if r.policy == default else "")
        throughput_ratio = ratio_cell(r.throughput_rps, ranking.best_throughput)
        rows.append(
            [
                str(i) if ranking.eligible(r) else f"({i})",
                r.policy,
                kind,
                ms_cell(r.ttft_ms["p50"]),
                ms_cell(r.ttft_ms["p99"]),
                rate_cell(r.throughput_rps),
                f"{100 * r.hit_rate:.1f} %",
                f"{100 * r.max_backend_share:.0f} %",
                ratio_cell(r.ttft_ms["p99"], ranking.best_p99_ms),
                throughput_ratio,
            ]
        )
    return rows


def ms_cell(value: float) -> str:
    """Milliseconds as a table cell (``1,234``); ``–`` for NaN (a policy that served nothing). O(1)."""
    return "–" if math.isnan(value) else f"{value:,.0f}"


def recommendation(ranking: Ranking, *, default: str | None = None) -> str:
    """The recommendation and the rule that made it, as one or two sentences (plain text)."""
    best = ranking.recommended
    if not ranking.eligible(best):
        return "No recommendation: no policy served a request."
    share = f"{100 * (1 - ranking.tolerance):.0f} %"
    text = (
        f"Recommended: {best.policy} — the lowest P99 TTFT ({ms_cell(best.ttft_ms['p99'])} ms) among the policies that "
        f"keep {share} of the best throughput ({rate_cell(ranking.best_throughput)} req/s)."
    )
    mine = ranking.of(default) if default is not None else None
    if default is not None and mine is not None and default != best.policy:
        text += (
            f" The default, {default}, ranks {ranking.position(default)}: P99 {ms_cell(mine.ttft_ms['p99'])} ms "
            f"({ratio_cell(mine.ttft_ms['p99'], best.ttft_ms['p99'])} the recommendation's), "
            f"{ratio_cell(mine.throughput_rps, ranking.best_throughput)} the best throughput."
        )
    elif default is not None and default == best.policy:
        text += " It is the default policy."
    return text


def rich_table(ranking: Ranking, *, default: str | None = None, title: str = "") -> Table:
    """The ranked table as a :class:`rich.table.Table` (rich is imported only here)."""
    from rich import box
    from rich.table import Table

    table = Table(title=title or None, box=box.SIMPLE_HEAD, pad_edge=False)
    for i, header in enumerate(_HEADERS):
        table.add_column(header, justify="left" if i in (1, 2) else "right", no_wrap=True)
    for row in table_rows(ranking, default=default):
        recommended = ranking.eligible(ranking.recommended) and row[1] == ranking.recommended.policy
        table.add_row(*row, style="bold" if recommended else None)
    return table


def markdown_table(ranking: Ranking, *, default: str | None = None) -> str:
    """The ranked table as Markdown; the recommendation's row is in bold, the default is marked in its kind cell."""
    lines = ["| " + " | ".join(_HEADERS) + " |", "|" + "---|" * 3 + "---:|" * (len(_HEADERS) - 3)]
    for row in table_rows(ranking, default=default):
        if row[1] == ranking.recommended.policy and ranking.eligible(ranking.recommended):
            row = [f"**{cell}**" for cell in row]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def write_plot(path: str | Path, ranking: Ranking, *, default: str | None = None, title: str = "") -> None:
    """Write a PNG: P50 and P99 TTFT per policy in rank order (left), throughput with the eligibility floor (right).

    Raises:
        ConfigurationError: as :func:`~prefixroute.sim.report.plot_file` says.
    """
    from prefixroute.sim.report import plot_file

    results = list(ranking.results)
    labels = [r.policy + (" (default)" if r.policy == default else "") for r in results]
    ys = range(len(results))
    size = (12, 1.4 + 0.38 * len(results))
    with plot_file(path, dpi=100, rect=(0, 0.06, 1, 1), ncols=2, figsize=size, sharey=True) as (figure, (ttft, rate)):
        colors = [_color(ranking, r) for r in results]
        p99 = [r.ttft_ms["p99"] if _served(r) else 0.0 for r in results]
        p50 = [r.ttft_ms["p50"] if _served(r) else 0.0 for r in results]
        ttft.barh(ys, p99, color=colors)
        ttft.scatter(p50, ys, color="black", marker="|", s=120, zorder=3)
        if any(value > 0 for value in p99):  # a log scale of nothing but zeros (no policy served) warns
            ttft.set_xscale("log")
        ttft.set_xlabel("TTFT ms (log scale): bar P99, tick P50")
        ttft.set_yticks(list(ys), labels)
        ttft.invert_yaxis()
        ttft.grid(True, axis="x", which="both", alpha=0.3)
        ttft.set_title("time to first token, ranked (best first)")
        rate.barh(ys, [r.throughput_rps for r in results], color=colors)
        floor = (1 - ranking.tolerance) * ranking.best_throughput
        rate.axvline(floor, color="black", linestyle="--", linewidth=1)
        rate.set_xlabel("requests / s")
        rate.set_title("throughput")
        rate.grid(True, axis="x", alpha=0.3)
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch

        share = f"{100 * (1 - ranking.tolerance):.0f} %"
        handles = [
            Patch(color="tab:green", label="recommended"),
            Patch(color="tab:blue", label=f"within {share} of the best throughput"),
            Patch(color="tab:gray", label="below that"),
            Line2D([], [], color="black", linestyle="--", linewidth=1, label=f"{share} of the best throughput"),
        ]
        figure.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False)
        if title:
            figure.suptitle(title)


def _color(ranking: Ranking, result: PolicyResult) -> str:
    if result is ranking.recommended and ranking.eligible(result):
        return "tab:green"
    return "tab:blue" if ranking.eligible(result) else "tab:gray"
