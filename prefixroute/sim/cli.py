"""``prefixroute simulate``: replay a scenario or a trace through the real Router against simulated vLLMs."""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import os
import stat
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefixroute.errors import ConfigurationError
from prefixroute.sim.compare import THROUGHPUT_TOLERANCE
from prefixroute.sim.engine import Workload
from prefixroute.sim.metrics import PolicyResult
from prefixroute.sim.runner import SimSpec, backend_config, build_policy, check_polls, run_policy
from prefixroute.sim.workloads import scenario_names

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

__all__ = [
    "add_workload_arguments",
    "check_distinct",
    "check_writable",
    "folder_argument",
    "plot_argument",
    "register",
    "register_compare",
    "run",
    "run_compare",
]

DEFAULT_POLICIES = ("round-robin", "prefix-affinity", "bounded-load", "predicted-ttft")


def register(subparsers: Any) -> None:
    """Add the ``simulate`` subcommand."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "simulate",
        help="simulate routing policies against vLLM-like GPU backends",
        description=(
            "Send a synthetic scenario or a real trace through prefixroute's Router to simulated vLLM engines "
            "(continuous batching, block prefix cache, calibrated GPU cost model) and compare policies."
        ),
    )
    add_workload_arguments(parser)
    parser.add_argument(
        "--policy",
        action="append",
        metavar="NAME",
        help="policy by registry name, baseline name (sglang, dynamo, llm-d, aibrix, ray-serve, production-stack) "
        "or module:Class; repeat to compare, each runs once (default: " + ", ".join(DEFAULT_POLICIES) + ")",
    )
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument(
        "--plot", type=plot_argument, metavar="PATH", help="write a PNG: TTFT CDF per policy and per-backend load"
    )
    parser.set_defaults(func=run)
    _register_study(subparsers)
    register_compare(subparsers)


def add_workload_arguments(parser: argparse.ArgumentParser) -> argparse._MutuallyExclusiveGroup:
    """Add the options that describe a workload and its fleet (shared by ``simulate`` and ``compare``).

    Returns the group that holds ``--scenario`` and ``--trace``, so a command can add another exclusive source.
    """
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--scenario", choices=scenario_names(), default="seed", help="synthetic workload (seed)")
    source.add_argument(
        "--trace",
        metavar="FORMAT:PATH",
        help="replay mooncake: or bailian:FILE.jsonl, or splitwise:, azure: or burstgpt:FILE.csv",
    )
    parser.add_argument("--backends", type=int, default=8, metavar="N", help="simulated vLLM engines (8)")
    arrivals = parser.add_mutually_exclusive_group()
    arrivals.add_argument("--users", type=int, metavar="N", help="closed-loop users (30; a trace: its timestamps)")
    arrivals.add_argument("--rate", type=float, metavar="RPS", help="open-loop Poisson arrivals per second")
    parser.add_argument("--model", default="codellama-13b", help="model profile (codellama-13b)")
    parser.add_argument("--gpu", default="a100-40gb", help="GPU profile (a100-40gb)")
    parser.add_argument("--tp", type=int, metavar="N", help="tensor-parallel GPUs per engine (the profile's)")
    stop = parser.add_mutually_exclusive_group()
    stop.add_argument("--requests", type=int, metavar="N", help="requests per policy (1500; a trace: all of it)")
    stop.add_argument("--duration", type=float, metavar="S", help="simulated seconds of arrivals per policy")
    parser.add_argument("--seed", type=int, default=0, help="random seed: same seed, same results (0)")
    parser.add_argument("--think-time", type=float, metavar="S", help="closed-loop mean think time (scenario's)")
    parser.add_argument("--sharing-ratio", type=float, metavar="F", help="fraction of requests on shared prefixes")
    parser.add_argument("--speedup", type=float, default=1.0, help="divide a trace's timestamps by this (1)")
    parser.add_argument("--gpu-hour-usd", type=float, default=2.0, help="$ per GPU-hour for recompute cost (2.0)")
    parser.add_argument(
        "--index-source",
        choices=("predictions", "events"),
        default="predictions",
        help="router index fed by its own predictions (default) or by the engines' KV events (exact mode)",
    )
    parser.add_argument(
        "--metrics-interval",
        type=float,
        metavar="S",
        help="poll engine queue length and KV usage into the router every S simulated seconds (off)",
    )
    parser.add_argument(
        "--gateways",
        type=int,
        default=1,
        metavar="N",
        help="gateway replicas, each with its own router and no shared state; requests spread at random (1)",
    )
    parser.add_argument(
        "--no-first-token",
        dest="first_token",
        action="store_false",
        help="report no first tokens to the router, as a gateway that sees none (LiteLLM's Router, Ray Serve)",
    )
    return source


def spec_from_args(args: argparse.Namespace) -> SimSpec:
    """Turn parsed arguments into a :class:`SimSpec` (trace replay defaults to the trace's own arrivals)."""
    replay = args.trace is not None
    users = args.users if args.users is not None else (None if replay or args.rate is not None else 30)
    requests = args.requests if args.requests is not None else (None if replay or args.duration else 1500)
    return SimSpec(
        scenario=args.scenario,
        trace=args.trace,
        backends=args.backends,
        users=users,
        rate=args.rate,
        speedup=args.speedup,
        think_time=args.think_time,
        model=args.model,
        gpu=args.gpu,
        tp=args.tp,
        requests=requests,
        duration=args.duration,
        seed=args.seed,
        sharing_ratio=args.sharing_ratio,
        gpu_hour_usd=args.gpu_hour_usd,
        index_source=args.index_source,
        metrics_interval=args.metrics_interval,
        first_token=args.first_token,
        gateways=args.gateways,
    )


def run(args: argparse.Namespace) -> int:
    """Run every policy, print the comparison table, write --json/--plot; return the exit status.

    Everything a run needs is checked before the first simulation (the options, every policy, the trace, the output
    paths), so bad input fails at once. Raises :class:`PrefixRouteError` or :class:`OSError` for bad input, which
    :func:`prefixroute.cli.main` reports as one line and exit status 2.
    """
    from rich.console import Console

    # Piped output (make demo's log, a README) gets a table-wide console instead of rich's 80 columns.
    console = Console() if sys.stdout.isatty() else Console(width=130)
    policies = list(dict.fromkeys(args.policy or DEFAULT_POLICIES))  # each once, as compare runs them
    spec = spec_from_args(args)
    config, profile = backend_config(spec)
    trace, length = _check_before_running(spec, policies, args)
    header = _header(spec)
    console.print(_describe(spec, profile.name, config.capacity_blocks, length))
    results = _run_all(spec, policies, console, trace)
    _check_served(results, spec)
    from prefixroute.sim.report import rich_table, write_json, write_plot

    _print_table(console, rich_table(results, title=f"{header['scenario']}: ratios against {policies[0]}"))
    for result in results:
        if result.rejected:
            console.print(
                f"{result.policy}: {result.rejected} requests rejected, longer than one engine's whole KV cache "
                "(choose a larger --gpu or --tp)"
            )
    if args.json:
        write_json(args.json, header, results)
        console.print(f"wrote {args.json}")
    if args.plot:
        write_plot(args.plot, results, title=f"{header['scenario']} · {profile.name} × {spec.backends}")
        console.print(f"wrote {args.plot}")
    return 0


_TABLE_MAX_WIDTH = 1000  # the widest a table is measured at: far past any policy name's row


def _print_table(console: Console, table: Table) -> None:
    """Print ``table`` whole: at the console's width, or at the table's own where that is wider (a long policy name
    such as a module:Class, a terminal under the table's 126 columns), so that rich shrinks no column and elides no
    figure ("83.…", "1.…") to fit it; a narrow terminal wraps the lines instead."""
    width = console.measure(table, options=console.options.update_width(_TABLE_MAX_WIDTH)).maximum
    narrower = console.width
    console.width = max(narrower, width)  # print(width=) would not do: rich caps it at the console's width
    try:
        console.print(table)
    finally:
        console.width = narrower


def _check_before_running(
    spec: SimSpec, policies: Sequence[str], args: argparse.Namespace
) -> tuple[Callable[[], Workload] | None, int | None]:
    """Build every policy once, read the trace, and check ``--json``/``--plot`` can be written (``--plot`` by
    matplotlib, in a format it knows): bad input fails now, before anything is printed or simulated (and not once in
    every worker).

    Returns what builds the trace's workload for each run (the file is read and checked once, and only the
    ``--requests`` a run replays are kept) and how many requests it holds; (None, None) without ``--trace``.

    Raises:
        PrefixRouteError: a policy, trace or output path that will not do (the message says which and why).
    """
    for name in policies:
        build_policy(name, seed=spec.seed)
    trace: Callable[[], Workload] | None = None
    length = None
    if spec.trace is not None:
        from prefixroute.sim.traces import TraceWorkload, check_speedup, load_trace

        read = load_trace(spec.trace, seed=spec.seed, output_tokens=spec.output_tokens, limit=spec.requests)
        if spec.users is None and spec.rate is None:  # replayed at its own timestamps
            check_speedup(read, spec.speedup)
            check_polls(spec, read.last_arrival / spec.speedup)
        trace = functools.partial(
            TraceWorkload, read.entries, kind=read.kind, seed=spec.seed, output_tokens=spec.output_tokens
        )
        length = len(read.entries)
    outputs = {option: path for option, path in (("--json", args.json), ("--plot", args.plot)) if path is not None}
    for option, path in outputs.items():
        check_writable(path, option)
    trace_path = None if spec.trace is None else os.path.expanduser(spec.trace.partition(":")[2])
    inputs = {} if trace_path is None else {"the trace --trace reads": trace_path}
    check_distinct(outputs, inputs)
    if args.plot is not None:
        from prefixroute.sim.report import check_plot_path

        check_plot_path(args.plot, "--plot")
    return trace, length


def check_writable(path: str | Path, option: str) -> None:
    """Fail now, not after the run, if a file cannot be written at ``path`` (its folder can be created).

    The file is opened for append (which leaves an existing file as it is), and it and the folders made for it are
    removed again if they did not exist, so what the OS refuses (a read-only mount, /proc, permissions even root
    lacks) is found now and nothing is left behind; ``os.access`` alone says yes to root everywhere.

    Raises:
        ConfigurationError: ``path`` is empty or blank, holds a NUL byte, cannot be looked up, is a folder, or its
            folder cannot be created, or the file cannot be opened for writing.
    """
    if not str(path).strip():  # an unset "$OUT": no name (Path("") is the current folder), or a blank one
        blank = "an empty one" if not str(path) else f"the blank name {str(path)!r}"
        raise ConfigurationError(f"{option} needs a file path, not {blank}")
    if "\0" in str(path):  # only main(argv) can pass one (the OS cannot): os.open would raise ValueError
        raise ConfigurationError(f"{option} {str(path)!r}: a path cannot hold a NUL byte")
    target = Path(path)
    try:
        folder = target.is_dir()
    except OSError as exc:  # a name the OS cannot look up (too long): is_dir() raises for it
        raise ConfigurationError(f"{option} {path}: {exc.strerror or exc}") from exc
    if folder:
        raise ConfigurationError(f"{option} {path} is a folder: give a file path")
    made = [parent for parent in target.parents if not parent.exists()]  # deepest first; the writer makes them again
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigurationError(f"{option} {path}: cannot create its folder ({exc.strerror or exc})") from exc
    existed = target.exists() or target.is_symlink()  # a dangling link: leave it (and what it now points to)
    try:  # non-blocking, so a FIFO nobody reads yet does not hang the check (ENXIO: cannot tell, let it be)
        os.close(os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o666))
    except OSError as exc:
        if exc.errno != errno.ENXIO:
            raise ConfigurationError(f"{option} {path}: not writable ({exc.strerror or exc})") from exc
    finally:  # a check leaves nothing behind: a command refused by a later check must not have made folders
        if not existed:
            target.unlink(missing_ok=True)
        for parent in made:
            with contextlib.suppress(OSError):  # another process put something there meanwhile: it stays
                parent.rmdir()


def check_distinct(outputs: Mapping[str, str | Path], inputs: Mapping[str, str | Path]) -> None:
    """Fail now if an output would overwrite an input or another output: the same path, or another name of the same
    file (a link, a relative spelling). ``outputs`` maps each output's option to its path, ``inputs`` what the run
    reads (described as the message names it: ``"the trace --trace reads"``) to its path.

    What is not a regular file is never a collision: writing ``/dev/null`` or a pipe destroys nothing, and a run may
    read its trace from ``/dev/stdin`` and write its JSON to ``/dev/stdout`` (one terminal). O(outputs x paths).

    Raises:
        ConfigurationError: an output names an input's file, or another output's (the message names both).
    """
    for option, path in outputs.items():
        for read, taken in inputs.items():
            if _same_file(path, taken):
                raise ConfigurationError(f"{option} {path} would overwrite {read}: give another path")
    written = list(outputs.items())
    for i, (option, path) in enumerate(written):
        for other, taken in written[:i]:
            if _same_file(path, taken):
                raise ConfigurationError(f"{other} and {option} name one file, {path}: give each its own")


def _same_file(one: str | Path, other: str | Path) -> bool:
    """Whether ``one`` and ``other`` name one regular file, or one path that is no file yet."""
    try:
        first, second = os.stat(one), os.stat(other)
    except (OSError, ValueError):  # one does not exist (yet): the same once written if its path is the same
        return os.path.realpath(one) == os.path.realpath(other)
    return stat.S_ISREG(first.st_mode) and os.path.samestat(first, second)


def folder_argument(text: str) -> Path:
    """The type of an option naming a folder to write to: ``Path("")`` is the current folder, so an empty or blank
    value (an unset ``"$OUT"``) would write there unasked.

    Raises:
        argparse.ArgumentTypeError: ``text`` is empty or blank, or holds a NUL byte (argparse prints it as one line
            and exits 2).
    """
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a folder, not an empty name {text!r} (. is the current folder)")
    if "\0" in text:  # only main(argv) can pass one: making the folder would raise ValueError
        raise argparse.ArgumentTypeError(f"expected a folder, not a name holding a NUL byte {text!r}")
    return Path(text)


def plot_argument(text: str) -> str:
    """The type of a ``--plot`` option: a name without an extension gets ``.png``, which matplotlib would add when
    saving, so the file checked before the run, written and reported is one and the same.

    Raises:
        argparse.ArgumentTypeError: ``text`` is empty or blank (argparse prints it as one line and exits 2).
    """
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a file name for the plot, not {text!r}")
    return text if Path(text).suffix or Path(text).is_dir() else text + ".png"  # a folder: refused as not writable


def _run_all(
    spec: SimSpec, policies: list[str], console: Any, trace: Callable[[], Workload] | None
) -> list[PolicyResult]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    results: list[PolicyResult] = []
    columns = (TextColumn("{task.description:<18}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        for name in policies:
            task = progress.add_task(name, total=spec.requests)

            def advance(done: int, total: int, task: Any = task) -> None:
                if done % 25 == 0:
                    progress.update(task, completed=done)

            result = run_policy(spec, name, workload=trace, on_progress=advance)
            progress.update(task, total=result.requests + result.rejected, completed=result.requests + result.rejected)
            results.append(result)
    return results


def _header(spec: SimSpec) -> dict[str, object]:
    return {
        "scenario": spec.trace if spec.trace is not None else spec.scenario,
        "backends": spec.backends,
        "model": spec.model,
        "gpu": spec.gpu,
    }


def _requests(count: int) -> str:
    return f"{count} request{'' if count == 1 else 's'}"


def _describe(spec: SimSpec, profile: str, capacity: int | None, trace_length: int | None) -> str:
    """The run's header; ``trace_length``: the requests the trace holds (up to ``--requests``), None without one."""
    source = f"trace {spec.trace}" if spec.trace else f"scenario {spec.scenario}"
    if spec.rate is not None:
        load = f"Poisson {spec.rate:g} req/s"
    elif spec.users is None:
        load = f"trace arrival times (speedup {spec.speedup:g})"
    else:
        load = f"{spec.users} closed-loop users"
    stop = _requests(spec.requests) if spec.requests else (f"{spec.duration:g} s" if spec.duration else "all")
    if trace_length is not None and (spec.requests is None or trace_length < spec.requests):
        stop = f"{_requests(trace_length)} (all the trace holds)" + (
            f" or {spec.duration:g} s" if spec.duration else ""
        )
    lifecycle = "" if spec.first_token else " · no first tokens reported"
    if spec.gateways > 1:
        lifecycle += f" · {spec.gateways} gateway replicas"
    return (
        f"{source} · {spec.backends} × {profile}, {capacity} KV blocks of 16 tokens each\n"
        f"{load} · {stop} per policy · seed {spec.seed}{lifecycle}"
    )


def register_compare(subparsers: Any) -> None:
    """Add the ``compare`` subcommand: every built-in and baseline policy on one workload, or on the whole suite."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "compare",
        help="rank every built-in and baseline policy on a workload and recommend one",
        description=(
            "Run every built-in and baseline policy on a scenario or your own trace, print them ranked (P50/P99 "
            "TTFT, throughput, KV hit rate, max share) and recommend the one with the lowest P99 TTFT among those "
            f"within {100 * THROUGHPUT_TOLERANCE:g} % of the best throughput. --suite runs the project's whole "
            "benchmark suite and writes docs/policies-benchmark.md."
        ),
    )
    source = add_workload_arguments(parser)
    source.add_argument(
        "--suite", action="store_true", help="every scenario and the repository's traces; writes --output (a page)"
    )
    parser.add_argument(
        "--policy",
        action="append",
        metavar="NAME",
        help="compare only these (repeat; registry, baseline or module:Class name; 'all' = every built-in and "
        "baseline, the default)",
    )
    parser.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, metavar="N", help="simulations run at once (CPU cores)"
    )
    parser.add_argument("--json", metavar="PATH", help="write the ranked results and the recommendation as JSON")
    parser.add_argument(
        "--plot", type=plot_argument, metavar="PATH", help="write a PNG: TTFT and throughput per policy, ranked"
    )
    parser.add_argument(
        "--output",
        metavar="PATH",
        help=f"with --suite: the page to write ({_SUITE_PAGE}; its plot goes next to it as .png)",
    )
    parser.set_defaults(func=lambda args: run_compare(args, defaults=parser))


_SUITE_PAGE = "docs/policies-benchmark.md"
# Options the suite fixes per workload (docs/policies-benchmark.md states each workload's settings).
_SUITE_FIXED = (
    "backends", "users", "rate", "model", "gpu", "tp", "requests", "duration", "think_time", "sharing_ratio",
    "speedup", "gpu_hour_usd", "index_source", "metrics_interval", "first_token", "gateways", "policy", "json",
    "plot",
)  # fmt: skip


def run_compare(args: argparse.Namespace, *, defaults: argparse.ArgumentParser) -> int:
    """Run ``prefixroute compare``: rank every policy on the workload (or run the suite); return the exit status.

    Everything is checked before the first simulation (the options, every policy, the trace, the output paths).
    Raises :class:`PrefixRouteError` or :class:`OSError` for bad input, which :func:`prefixroute.cli.main` reports
    as one line and exit status 2.
    """
    from rich.console import Console

    from prefixroute.sim.compare import (
        compared_policies,
        default_policy_name,
        rank,
        recommendation,
        rich_table,
        run_grid,
        write_plot,
    )
    from prefixroute.sim.report import write_json

    console = Console() if sys.stdout.isatty() else Console(width=130)
    if isinstance(args.jobs, bool) or args.jobs < 1:
        raise ConfigurationError(f"--jobs must be a positive int, not {args.jobs!r}")
    if args.suite:
        return _run_suite(args, defaults, console)
    if args.output is not None:
        raise ConfigurationError("--output goes with --suite (use --json or --plot for one workload)")
    spec = spec_from_args(args)
    _, profile = backend_config(spec)
    names: list[str] = []
    for name in args.policy or ["all"]:
        for one in compared_policies() if name == "all" else [name]:
            if one not in names:
                names.append(one)
    trace, length = _check_before_running(spec, names, args)
    config, _ = backend_config(spec)
    console.print(_describe(spec, profile.name, config.capacity_blocks, length))
    jobs = min(args.jobs, len(names))
    console.print(f"{len(names)} policies, {jobs} at a time")
    done = [0]

    def on_done(_index: int, result: PolicyResult) -> None:
        done[0] += 1
        console.print(f"  [{done[0]}/{len(names)}] {result.policy}")

    results = run_grid([(spec, name) for name in names], jobs=jobs, on_done=on_done, workload=trace)
    _check_served(results, spec)
    ranking = rank(results)
    default = default_policy_name()
    header = _header(spec)
    _print_table(console, rich_table(ranking, default=default, title=f"{header['scenario']}: policies ranked"))
    console.print(
        "Rank in parentheses: more than "
        f"{100 * ranking.tolerance:g} % below the best throughput, ranked after the others."
    )
    console.print(recommendation(ranking, default=default))
    for result in results:
        if result.rejected:
            console.print(f"{result.policy}: {result.rejected} requests rejected, longer than one engine's KV cache")
    if args.json:
        best = ranking.recommended
        recommended = best.policy if ranking.eligible(best) else None  # as the table says: none if none served
        header |= {"default": default, "recommended": recommended, "tolerance": ranking.tolerance}
        write_json(args.json, header, ranking.results)
        console.print(f"wrote {args.json}")
    if args.plot:
        write_plot(
            args.plot, ranking, default=default, title=f"{header['scenario']} · {profile.name} × {spec.backends}"
        )
        console.print(f"wrote {args.plot}")
    return 0


def _check_served(results: Sequence[PolicyResult], spec: SimSpec) -> None:
    """Refuse to print a table of NaNs: a run in which no request was sent (a ``--duration`` shorter than the first
    arrival; closed-loop users start within the first second) has no figure to report.

    Raises:
        ConfigurationError: no policy's run sent a request.
    """
    if results and all(r.requests == 0 and r.rejected == 0 for r in results):
        within = f" within --duration {spec.duration:g} s of simulated time" if spec.duration is not None else ""
        raise ConfigurationError(
            f"no request was sent{within}: give a longer --duration (closed-loop users start within the first second)"
        )


def _run_suite(args: argparse.Namespace, defaults: argparse.ArgumentParser, console: Any) -> int:
    from prefixroute.sim.suite import run_suite, suite_workloads

    for dest in _SUITE_FIXED:
        if getattr(args, dest) != defaults.get_default(dest):
            flag = "--no-first-token" if dest == "first_token" else "--" + dest.replace("_", "-")
            raise ConfigurationError(f"--suite fixes each workload's settings: drop {flag}")
    traces = [w.spec.trace.partition(":")[2] for w in suite_workloads(seed=args.seed) if w.spec.trace is not None]
    name = args.output if args.output is not None else _SUITE_PAGE  # "" is no page (Path("") is the current folder)
    check_writable(name, "--output")
    output = Path(name)
    plot = output.with_suffix(".png")  # where run_suite writes it
    if plot == output:
        raise ConfigurationError(f"--output {output}: the plot is written beside the page as .png: name the page .md")
    check_writable(plot, "--output's plot")
    check_distinct({"--output": output, "--output's plot": plot}, {f"the suite's trace {t}": t for t in traces})
    page, verdicts = run_suite(output, seed=args.seed, jobs=args.jobs, progress=console.print)
    passed = sum(v.passed for v in verdicts)
    console.print(f"the default meets every check on {passed} of {len(verdicts)} workloads; wrote {page}")
    return 0


def _register_study(subparsers: Any) -> None:
    """Add the ``study`` subcommand."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "study",
        help="rerun the published claims in the simulator; write docs/study.md",
        description="Rerun every published claim in the simulator (seed 0) and write study.md and "
        "its plots to --output.",
    )
    parser.add_argument(
        "--output", type=folder_argument, default=Path("docs"), help="folder for study.md and its PNGs (docs)"
    )
    parser.add_argument("--requests", type=int, default=1500, help="requests per simulated run (1500)")
    parser.set_defaults(func=_run_study)


def _run_study(args: argparse.Namespace) -> int:
    from prefixroute.sim.study import _run_study

    def progress(message: str) -> None:
        print(message, flush=True)

    # Its messages name this command's options, not run_study's keywords.
    path = _run_study(args.output, requests=args.requests, progress=progress, names=("--output", "--requests"))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    from prefixroute.cli import main

    sys.exit(main(["simulate", *sys.argv[1:]]))
