"""``plot_file``, the one way every plot is written: its path checked first, its failures in the library's errors,
and its figure closed whatever happens (pyplot keeps every open figure until closed); and ``simulate``'s table."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib.pyplot as plt
import pytest

from prefixroute import ConfigurationError, InvalidTypeError
from prefixroute.sim.metrics import PolicyResult
from prefixroute.sim.report import plot_file, rate_cell, rich_table, table_rows, write_plot


def test_a_plot_is_saved_in_the_format_its_name_says_and_its_figure_closed(tmp_path: Path) -> None:
    before = plt.get_fignums()
    with plot_file(tmp_path / "new" / "a.svg", dpi=50, ncols=2) as (_, (left, right)):
        left.plot([1, 2], [3, 4])
        right.bar([0], [1])
    assert (tmp_path / "new" / "a.svg").read_text().lstrip().startswith("<?xml")
    assert plt.get_fignums() == before


def test_a_plot_that_fails_while_drawn_or_saved_leaves_no_figure_open(tmp_path: Path) -> None:
    before = plt.get_fignums()
    with pytest.raises(ZeroDivisionError), plot_file(tmp_path / "a.png", dpi=50) as (_, axis):
        axis.plot([1], [1 / 0])
    assert not (tmp_path / "a.png").exists()
    (tmp_path / "taken").write_text("a file, not a folder")
    taken = tmp_path / "taken" / "a.png"
    with (
        pytest.raises(ConfigurationError, match="cannot write the plot .*taken/a.png"),
        plot_file(taken, dpi=50) as drawn,
    ):
        drawn[1].plot([1], [1])
    assert plt.get_fignums() == before


@pytest.mark.parametrize(("path", "error", "match"), [
    (None, InvalidTypeError, "plot must be a str or a path, not NoneType"),
    (5, InvalidTypeError, "not int"),
    ("a.nope", ConfigurationError, "writes no 'nope' files"),
])  # fmt: skip
def test_a_plot_path_that_cannot_be_written_is_refused_before_drawing(
    path: object, error: type[Exception], match: str
) -> None:
    before = plt.get_fignums()
    with pytest.raises(error, match=match), plot_file(path, dpi=50):  # type: ignore[arg-type]
        pytest.fail("drawn")
    assert plt.get_fignums() == before


def test_write_plot_refuses_no_results(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="at least one policy"):
        write_plot(tmp_path / "a.png", [])
    assert not (tmp_path / "a.png").exists()


def simulated(policy: str, *, p99: float, rps: float, hit: float, served: bool = True) -> PolicyResult:
    nan = math.nan
    return PolicyResult(
        policy=policy,
        requests=100 if served else 0,
        rejected=0 if served else 100,
        hit_rate=hit,
        predicted_hit_rate=hit + 0.01,
        ttft_ms={"p50": p99 / 4, "p95": p99 / 2, "p99": p99} if served else {"p50": nan, "p95": nan, "p99": nan},
        e2e_ms={"p50": 2 * p99, "p99": 3 * p99} if served else {"p50": nan, "p99": nan},
        throughput_rps=rps,
        prompt_tokens_per_s=0.0,
        backend_share={"gpu0": 0.75, "gpu1": 0.25},
        peak_in_flight={"gpu0": 7, "gpu1": 3},
        max_backend_share=0.75,
        recompute_gpu_seconds=0.0,
        recompute_usd_per_month=12345.6,
        preemptions=0,
        duration_s=1.0,
    )


def test_the_simulate_table_shows_each_policy_s_figures_against_the_first_and_dashes_for_none() -> None:
    results = [
        simulated("round-robin", p99=2000.0, rps=4.0, hit=0.25),
        simulated("predicted-ttft", p99=500.0, rps=5.0, hit=0.5),
        simulated("refused", p99=0.0, rps=0.0, hit=0.0, served=False),
    ]
    same = ["75 %", "7", "12,346"]  # max share, peak in flight, recompute $/month
    assert table_rows(results) == [
        ["round-robin", "25.0 %", "26.0 %", "500", "2000", "6000", "4.00", *same, "1.00×", "1.00×", "+0.0"],
        ["predicted-ttft", "50.0 %", "51.0 %", "125", "500", "1500", "5.00", *same, "0.25×", "1.25×", "+25.0"],
        ["refused", "0.0 %", "1.0 %", "–", "–", "–", "0.00", *same, "–", "0.00×", "-25.0"],
    ]
    assert table_rows([]) == []
    first_refused = table_rows(results[::-1])  # nothing to compare with: no ratio
    assert [row[-3:-1] for row in first_refused] == [["–", "–"]] * 3
    table = rich_table(results, title="t")
    assert table.title == "t" and len(table.columns) == len(table_rows(results)[0]) and table.row_count == 3
    assert [c.justify for c in table.columns] == ["left"] + ["right"] * 12
    assert [c.header for c in table.columns][:5] == [
        "policy",
        "KV\nhit",
        "router\npredicted",
        "TTFT\np50 ms",
        "TTFT\np99 ms",
    ]
    assert all(c.no_wrap for c in table.columns)
    assert rich_table(results).title is None


def test_a_sparse_trace_s_throughput_keeps_its_figures_where_two_decimals_would_show_zero() -> None:
    assert [rate_cell(r) for r in (0.0, 0.000417, 0.0125, 0.5, 0.877, 44.449)] == [
        "0.00",
        "0.000417",
        "0.0125",
        "0.50",
        "0.88",
        "44.45",
    ]
    sparse = [simulated("round-robin", p99=900.0, rps=0.0021, hit=0.1)]
    assert table_rows(sparse)[0][6] == "0.0021"
