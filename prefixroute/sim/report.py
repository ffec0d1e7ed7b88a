"""Present per-policy results: the comparison table (rich), the ``--json`` document, the ``--plot`` PNG.

rich and matplotlib (the ``prefixroute[sim]`` extra) are imported only by the functions that need them.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefixroute.errors import ConfigurationError, InvalidTypeError
from prefixroute.sim.metrics import PolicyResult

if TYPE_CHECKING:
    from rich.table import Table

__all__ = [
    "check_plot_path",
    "json_document",
    "plot_file",
    "pyplot",
    "ratio_cell",
    "rich_table",
    "table_rows",
    "write_json",
    "write_plot",
    "write_sweep_plot",
    "write_text",
]

# The terminal table puts its headers on two lines; --json has every figure (TTFT p95 and e2e p50 too).
_TERMINAL_HEADERS = (
    "policy",
    "KV\nhit",
    "router\npredicted",
    "TTFT\np50 ms",
    "TTFT\np99 ms",
    "e2e\np99 ms",
    "req/s",
    "max\nshare",
    "peak in\nflight",
    "recompute\n$/month",
    "p99\nTTFT",
    "req/s\nratio",
    "hit Δ\npoints",
)


def ratio_cell(value: float, base: float) -> str:
    """``value / base`` as a table cell (``0.25×``); ``–`` when either is NaN or ``base`` is 0. O(1)."""
    if not base or math.isnan(base) or math.isnan(value):
        return "–"
    return f"{value / base:.2f}×"


def rate_cell(value: float) -> str:
    """A throughput in req/s as a table cell: two decimals, or three significant digits under 0.1 req/s (a sparse
    trace serves a few requests an hour, which two decimals would show as 0.00). O(1)."""
    return f"{value:.3g}" if 0 < value < 0.1 else f"{value:.2f}"


def table_rows(results: Sequence[PolicyResult]) -> list[list[str]]:
    """One row of formatted cells per policy, in the terminal table's columns; the last three compare with the first
    policy. A figure no request produced (a policy that served none) is ``–``."""
    rows: list[list[str]] = []
    base = results[0] if results else None
    for r in results:
        assert base is not None
        rows.append(
            [
                r.policy,
                f"{100 * r.hit_rate:.1f} %",
                f"{100 * r.predicted_hit_rate:.1f} %",
                _ms(r.ttft_ms["p50"]),
                _ms(r.ttft_ms["p99"]),
                _ms(r.e2e_ms["p99"]),
                rate_cell(r.throughput_rps),
                f"{100 * r.max_backend_share:.0f} %",
                str(max(r.peak_in_flight.values(), default=0)),
                f"{r.recompute_usd_per_month:,.0f}",
                ratio_cell(r.ttft_ms["p99"], base.ttft_ms["p99"]),
                ratio_cell(r.throughput_rps, base.throughput_rps),
                f"{100 * (r.hit_rate - base.hit_rate):+.1f}",
            ]
        )
    return rows


def _ms(value: float) -> str:
    return "–" if math.isnan(value) else f"{value:.0f}"


def rich_table(results: Sequence[PolicyResult], *, title: str = "") -> Table:
    """The comparison table as a :class:`rich.table.Table`."""
    from rich import box
    from rich.table import Table

    table = Table(title=title or None, box=box.SIMPLE_HEAD, pad_edge=False)
    for i, header in enumerate(_TERMINAL_HEADERS):
        table.add_column(header, justify="left" if i == 0 else "right", no_wrap=True)
    for row in table_rows(results):
        table.add_row(*row)
    return table


def json_document(header: Mapping[str, object], results: Sequence[PolicyResult]) -> dict[str, object]:
    """The ``--json`` document: ``header`` (scenario, backends, model, gpu, …) and one object per policy."""
    document = dict(header)
    document["results"] = [r.to_json() for r in results]
    return document


def write_json(path: str | Path, header: Mapping[str, object], results: Sequence[PolicyResult]) -> None:
    """Write :func:`json_document` to ``path`` (NaN, from a run with no served request, becomes null).

    Raises:
        ConfigurationError: as :func:`write_text` says.
    """
    document = _nan_to_none(json_document(header, results))
    write_text(path, json.dumps(document, indent=2) + "\n")


def write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` as UTF-8, its folder made.

    Raises:
        ConfigurationError: the folder cannot be made or the file written, naming the path (the OS names none when
            a write fails after the open, as on a full disk or /dev/full).
    """
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise ConfigurationError(f"cannot write {path}: {exc.strerror or exc}") from exc


def _nan_to_none(value: object) -> object:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _nan_to_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_nan_to_none(v) for v in value]
    return value


def write_plot(path: str | Path, results: Sequence[PolicyResult], *, title: str = "") -> None:
    """Write a PNG: TTFT CDF per policy (left) and each backend's share of requests per policy (right).

    Raises:
        ConfigurationError: ``results`` is empty, or as :func:`plot_file` says.
    """
    if not results:
        raise ConfigurationError("write_plot needs the result of at least one policy; results is empty")
    with plot_file(path, dpi=110, ncols=2, figsize=(12, 4.5)) as (figure, (cdf, load)):
        for r in results:
            values = sorted(r.ttfts_ms)
            if values:
                cdf.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=r.policy)
        cdf.set_xscale("log")
        cdf.set_xlabel("time to first token (ms, log scale)")
        cdf.set_ylabel("fraction of requests")
        cdf.set_title("TTFT CDF")
        cdf.grid(True, which="both", alpha=0.3)
        if any(r.ttfts_ms for r in results):
            cdf.legend()
        backends = list(results[0].backend_share)
        width = 0.8 / len(results)
        for i, r in enumerate(results):
            xs = [j + (i - (len(results) - 1) / 2) * width for j in range(len(backends))]
            load.bar(xs, [100 * r.backend_share.get(b, 0.0) for b in backends], width=width, label=r.policy)
        if backends:
            load.axhline(100 / len(backends), color="grey", linestyle="--", linewidth=1, label="even share")
            load.legend()
        load.set_xticks(range(len(backends)), backends, rotation=45 if len(backends) > 8 else 0)
        load.set_ylabel("% of requests")
        load.set_title("per-backend load")
        if title:
            figure.suptitle(title)


@contextmanager
def plot_file(
    path: str | Path, *, dpi: int, rect: tuple[float, float, float, float] | None = None, **subplots: Any
) -> Iterator[tuple[Any, Any]]:
    """Yield ``(figure, axes)`` from ``pyplot.subplots(**subplots)`` to draw on; when the block ends, lay the figure
    out (within ``rect``) and save it at ``path`` (its folder made), in the format its extension names (none: PNG).
    The figure is closed whatever happens, so a failed plot leaves nothing open in pyplot.

    Raises:
        InvalidTypeError: ``path`` is not a str or a path.
        ConfigurationError: matplotlib is missing, writes no file of that extension, or the file cannot be written.
    """
    check_plot_path(path, "plot")
    plt = pyplot()
    figure, axes = plt.subplots(**subplots)
    try:
        yield figure, axes
        figure.tight_layout(rect=rect)
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            figure.savefig(path, dpi=dpi)
        except OSError as exc:
            raise ConfigurationError(f"cannot write the plot {path}: {exc.strerror or exc}") from exc
    finally:
        plt.close(figure)


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend.

    Raises:
        ConfigurationError: matplotlib (the ``prefixroute[sim]`` extra) is missing, or refuses to start (it checks
            the ``MPLBACKEND`` environment variable when imported, although the plots use Agg whatever it says).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # missing, or installed but broken (a matplotlib built for NumPy 1 on NumPy 2)
        raise ConfigurationError(f"plots need matplotlib: pip install 'prefixroute[sim]' ({exc})") from exc
    except ValueError as exc:  # MPLBACKEND=nonsense
        raise ConfigurationError(f"matplotlib cannot start ({exc}): fix or unset MPLBACKEND") from exc
    return plt


def check_plot_path(path: str | Path, option: str) -> None:
    """Fail now, not after the run, if matplotlib cannot write a plot at ``path``: matplotlib missing or refusing to
    start, or a file name whose extension is no format matplotlib writes (``.png``, ``.svg``, ``.pdf``, ...; none:
    PNG). Whether the file can be created is :func:`prefixroute.sim.cli.check_writable`'s to check.

    Raises:
        InvalidTypeError: ``path`` is not a str or a path.
        ConfigurationError: the message says what to fix.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidTypeError(f"{option} must be a str or a path, not {type(path).__name__}")
    pyplot()
    from matplotlib.backend_bases import FigureCanvasBase

    suffix = Path(path).suffix[1:]
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix and suffix.lower() not in formats:
        raise ConfigurationError(
            f"{option} {path}: matplotlib writes no {suffix!r} files; end the name in one of {', '.join(formats)}"
        )


def write_sweep_plot(
    path: Path,
    models: list[tuple[str, PolicyResult, PolicyResult]],
    lengths: list[tuple[int, PolicyResult, PolicyResult]],
    sharing: list[tuple[float, PolicyResult, PolicyResult]],
    hot: list[tuple[str, float, PolicyResult]],
) -> None:
    """Write the study's four sweep panels: model size, prefix length, sharing ratio, hot-prefix load bound."""
    with plot_file(path, dpi=100, nrows=2, ncols=2, figsize=(12, 8)) as (_, axes):
        ax = axes[0][0]
        ax.bar(range(len(models)), [bl.ttft_ms["p99"] / rr.ttft_ms["p99"] for _, rr, bl in models])
        ax.set_xticks(range(len(models)), [m for m, _, _ in models])
        ax.axhline(1.0, color="grey", linewidth=1)
        ax.set_title("model size: bounded-load / round-robin P99 TTFT")
        ax = axes[0][1]
        ax.plot([n for n, _, _ in lengths], [rr.ttft_ms["p50"] for _, rr, _ in lengths], "o-", label="round-robin p50")
        ax.plot([n for n, _, _ in lengths], [bl.ttft_ms["p50"] for _, _, bl in lengths], "o-", label="bounded-load p50")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("shared prefix tokens")
        ax.set_ylabel("TTFT ms")
        ax.set_title("prefix length")
        ax.legend()
        ax = axes[1][0]
        ax.plot(
            [100 * s for s, _, _ in sharing], [100 * rr.hit_rate for _, rr, _ in sharing], "o-", label="round-robin"
        )
        ax.plot(
            [100 * s for s, _, _ in sharing], [100 * bl.hit_rate for _, _, bl in sharing], "o-", label="bounded-load"
        )
        ax.set_xlabel("% of requests on a shared prefix")
        ax.set_ylabel("KV hit rate %")
        ax.set_title("sharing ratio")
        ax.legend()
        ax = axes[1][1]
        for mode in dict.fromkeys(m for m, _, _ in hot):
            pts = [(f, r) for m, f, r in hot if m == mode]
            ax.plot([f for f, _ in pts], [r.ttft_ms["p99"] for _, r in pts], "o-", label=f"P99 TTFT, {mode}")
        ax.set_xlabel("bounded-load factor")
        ax.set_ylabel("ms")
        ax.set_yscale("log")
        ax.set_title("hot prefix: load bound")
        ax.legend()
