"""``plot_file``, the one way every plot is written: its path checked first, its failures in the library's errors,
and its figure closed whatever happens (pyplot keeps every open figure until closed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pytest

from prefixroute import ConfigurationError, InvalidTypeError
from prefixroute.sim.report import plot_file, write_plot


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
