"""Calibration plot of the cost model: modelled vs measured time by prompt length (needs matplotlib).

Reads only the packaged ``calibration_points.csv`` and profiles, so it runs without the raw data::

    python -m prefixroute.sim.costplot docs/cost-model-calibration.png --update docs/cost-model.md
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

from prefixroute.errors import ConfigurationError, PrefixRouteError
from prefixroute.sim.calibration import predicted_seconds, read_measurements, read_points
from prefixroute.sim.profiles import available_profiles, load_profile

__all__ = [
    "calibration_table",
    "error_table",
    "hit_miss_table",
    "plot_calibration",
    "summary_table",
    "tables",
    "update_markdown",
]

_PROMPTS = tuple(2**k for k in range(6, 15))
_TOKENS = tuple(2**k for k in range(13))


def plot_calibration(path: Path) -> None:
    """Write a PNG: SplitwiseSim Llama-2-70B prefill (A100, H100) and Vidur linear-operator time vs model."""
    from prefixroute.sim.report import plot_file

    points = read_points()
    with plot_file(path, dpi=80, ncols=3, figsize=(15, 4.6)) as (_, axes):
        colours = {1: "tab:purple", 2: "tab:blue", 4: "tab:orange", 8: "tab:green"}
        for axis, gpu in zip(axes[:2], ("a100-80gb", "h100-80gb"), strict=True):
            for tp in (2, 4, 8):
                measured = [
                    (int(p["tokens"]), float(p["seconds"]) * 1e3)
                    for p in points
                    if p["kind"] == "prefill" and p["gpu"] == gpu and int(p["tp"]) == tp and p["batch"] == "1"
                ]
                profile = load_profile("llama-2-70b", gpu, tp=tp)
                axis.plot(*zip(*measured, strict=True), "o", color=colours[tp], label=f"measured TP{tp}")
                modelled = [profile.prefill_seconds(n, 0) * 1e3 for n in _PROMPTS]
                axis.plot(_PROMPTS, modelled, "-", color=colours[tp], label=f"model TP{tp}")
            axis.set(title=f"Llama-2-70B prefill on {gpu} (SplitwiseSim)", xlabel="prompt tokens", ylabel="TTFT (ms)")
            axis.set_xscale("log", base=2)
            axis.set_yscale("log")
            axis.legend(fontsize=7)
        axis = axes[2]
        styles = {"llama-2-7b": "tab:blue", "llama-3-8b": "tab:orange", "codellama-34b": "tab:green"}
        styles["llama-2-70b"] = "tab:red"
        for model, colour in styles.items():
            measured = [
                (int(p["tokens"]), float(p["seconds"]) * 1e3)
                for p in points
                if p["kind"] == "linear" and p["model"] == model and p["gpu"] == "a100-80gb" and p["tp"] == "1"
            ]
            profile = load_profile(model, "a100-80gb", tp=1)
            axis.plot(
                *zip(*measured, strict=True),
                "o",
                color=colour,
                markersize=3,
                label=f"{model}: Vidur (dots), fit (line)",
            )
            axis.plot(_TOKENS, [profile.linear_seconds(n) * 1e3 for n in _TOKENS], "-", color=colour)
        derived = load_profile("codellama-13b", "a100-80gb", tp=1)
        axis.plot(
            _TOKENS,
            [derived.linear_seconds(n) * 1e3 for n in _TOKENS],
            "--",
            color="k",
            label="codellama-13b (derived)",
        )
        axis.set(title="Linear operators, all layers, A100 TP1 (Vidur)", xlabel="tokens", ylabel="ms")
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.legend(fontsize=7)


def calibration_table() -> str:
    """Markdown table: measured vs modelled Llama-2-70B prefill (batch 1) by prompt length, per GPU and tp."""
    points = read_points()
    lines = [
        "| GPU | tp | prompt tokens | measured ms | modelled ms | error |",
        "|---|---|---|---|---|---|",
    ]
    for p in points:
        if p["kind"] != "prefill" or p["batch"] != "1":
            continue
        profile = load_profile(p["model"], p["gpu"], tp=int(p["tp"]))
        measured = float(p["seconds"]) * 1e3
        modelled = profile.prefill_seconds(int(p["tokens"]), 0) * 1e3
        error = modelled / measured - 1
        lines.append(f"| {p['gpu']} | {p['tp']} | {p['tokens']} | {measured:.0f} | {modelled:.0f} | {error:+.0%} |")
    return "\n".join(lines)


def error_table() -> str:
    """Markdown table: median, 90th percentile and max of ``|modelled / measured - 1|`` per group of points."""
    groups: dict[tuple[str, str, str], list[float]] = {}
    for m in read_measurements():
        kind = "prefill, batched (not fitted)" if m.kind == "prefill" and m.batch > 1 else m.kind
        error = abs(predicted_seconds(load_profile(m.model, m.gpu, tp=m.tp), m) / m.seconds - 1)
        groups.setdefault((m.source, kind, m.gpu), []).append(error)
    lines = ["| source | points | GPU | n | median | p90 | max |", "|---|---|---|---|---|---|---|"]
    for (source, kind, gpu), errors in sorted(groups.items()):
        errors.sort()
        median, p90 = statistics.median(errors), errors[int(0.9 * (len(errors) - 1))]
        cells = f"{median:.1%} | {p90:.1%} | {errors[-1]:.1%}"
        lines.append(f"| {source} | {kind} | {gpu} | {len(errors)} | {cells} |")
    return "\n".join(lines)


def hit_miss_table(model: str = "codellama-13b", gpu: str = "a100-40gb") -> str:
    """Markdown table: modelled prefill of a prompt on a miss and on hits leaving 16 or 128 tokens uncached."""
    profile = load_profile(model, gpu)
    lines = [
        f"| {profile.name} prompt | miss ms | hit, 128 new tokens, ms | hit, 16 new tokens, ms |",
        "|---|---|---|---|",
    ]
    for prompt in (2048, 4096, 8192, 16384):
        miss, hit128, hit16 = (profile.prefill_seconds(new, prompt - new) * 1e3 for new in (prompt, 128, 16))
        lines.append(f"| {prompt} | {miss:.0f} | {hit128:.1f} | {hit16:.1f} |")
    return "\n".join(lines)


def summary_table() -> str:
    """Markdown table: every profile at its automatic tp, with KV capacity and a few modelled times."""
    lines = [
        "| model | GPU | auto tp | KV blocks per GPU | prefill 2K ms | prefill 8K ms | decode step 8 x 1K ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for model, gpu in available_profiles():
        p = load_profile(model, gpu)
        times = [p.prefill_seconds(2048, 0), p.prefill_seconds(8192, 0), p.decode_seconds(8, 8 * 1024)]
        cells = " | ".join(f"{t * 1e3:.0f}" for t in times)
        lines.append(f"| {model} | {gpu} | {p.tp} | {p.kv_capacity_blocks()} | {cells} |")
    return "\n".join(lines)


def tables() -> dict[str, str]:
    """Every generated table by the marker name it has in docs/cost-model.md."""
    return {
        "errors": error_table(),
        "prefill": calibration_table(),
        "hit-miss": hit_miss_table(),
        "profiles": summary_table(),
    }


def update_markdown(text: str, generated: dict[str, str]) -> str:
    """Replace each ``<!-- costplot:NAME -->`` ... ``<!-- /costplot:NAME -->`` block's body by ``generated[NAME]``.

    Raises :class:`~prefixroute.ConfigurationError` (a ValueError) when a marker pair is missing, so a renamed table
    cannot silently go stale.
    """
    for name, table in generated.items():
        start, end = f"<!-- costplot:{name} -->", f"<!-- /costplot:{name} -->"
        head, found, rest = text.partition(start)
        _, found_end, tail = rest.partition(end)
        if not (found and found_end):
            raise ConfigurationError(f"markers {start} ... {end} not found")
        text = f"{head}{start}\n{table}\n{end}{tail}"
    return text


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: write the plot; print the tables, or write them into a Markdown page's markers.

    Bad input (a usage error, a page without the markers, a path that cannot be read or written, matplotlib
    missing) is exit status 2 and one line on stderr, never a traceback; nothing is written then.
    """
    from prefixroute.cli import OneLineParser, UsageError, fail
    from prefixroute.sim.cli import check_writable

    prog = "python -m prefixroute.sim.costplot"
    parser = OneLineParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("png", type=Path, help="where to write the calibration plot")
    parser.add_argument("--update", type=Path, default=None, help="Markdown page whose costplot tables to rewrite")
    try:
        args = parser.parse_args(argv)
    except UsageError as exc:
        return fail(str(exc))
    try:
        from prefixroute.sim.report import check_plot_path, write_text

        check_plot_path(args.png, "png")  # matplotlib writes it, in a format it knows: checked before anything
        generated = tables()
        page = None
        if args.update is not None:  # read and check the page before anything is written
            if args.update.exists() and not args.update.is_file():  # /dev/zero would fill the memory, a FIFO hang
                raise ValueError(f"--update {args.update} is not a regular file: give the Markdown page to rewrite")
            try:
                page = update_markdown(args.update.read_text(encoding="utf-8"), generated)
            except ValueError as exc:  # not UTF-8 text, or a marker missing: say which file
                raise ValueError(f"--update {args.update}: {exc}") from exc
            check_writable(args.update, "--update")
        check_writable(args.png, "png")
        plot_calibration(args.png)
        if page is not None:
            write_text(args.update, page)
    except (OSError, ValueError, ImportError, PrefixRouteError) as exc:  # a missing marker is a ValueError
        detail = f"{exc.strerror}: {exc.filename}" if isinstance(exc, OSError) and exc.strerror else str(exc)
        return fail(f"{prog}: error: {detail}")
    if page is None:
        print(*generated.values(), sep="\n\n")
    else:
        print(f"updated {args.update}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
