"""File-system hostility at the commands' path options (traces, tokenizers, model folders, outputs, pages, caches):
each bad path is exit status 2 and one line on stderr, found before anything runs, never a traceback or a hang, and
an input file is never overwritten by an output."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefixroute.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--requests", "3", "--policy", "round-robin", "--backends", "2"]
LINE = '{"timestamp": %d, "input_length": 20, "output_length": 4, "hash_ids": [1]}\n'


def _one_line(err: str, expected: str) -> None:
    assert err.endswith("\n") and err.count("\n") == 1, f"not one line: {err!r}"
    assert "Traceback" not in err and expected in err, err


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    """A small Mooncake trace (named .png too, so that --plot can name it)."""
    path = tmp_path / "trace.png"
    path.write_text(LINE % 0 + LINE % 1, encoding="utf-8")
    return path


@pytest.mark.parametrize("command", [["simulate"], ["compare", "--jobs", "1"]])
@pytest.mark.parametrize("option", ["--json", "--plot"])
@pytest.mark.parametrize("spelling", ["same", "link", "relative"])
def test_an_output_naming_the_trace_is_refused_and_the_trace_kept(
    command: list[str], option: str, spelling: str, trace: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    # Was: the run, then the trace overwritten by the results (the input lost).
    monkeypatch.chdir(trace.parent)
    output = {"same": str(trace), "link": str(trace.parent / "link.png"), "relative": f"./{trace.name}"}[spelling]
    if spelling == "link":
        os.symlink(trace, output)
    before = _digest(trace)
    assert main([*command, *TINY, "--trace", f"mooncake:{trace}", option, output]) == 2
    out, err = capsys.readouterr()
    _one_line(err, f"{option} {output} would overwrite the trace --trace reads")
    assert out == "" and _digest(trace) == before


@pytest.mark.parametrize("command", [["simulate"], ["compare", "--jobs", "1"]])
def test_json_and_plot_naming_one_file_are_refused(
    command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Was: the JSON written, then overwritten by the plot.
    both = str(tmp_path / "results.png")
    assert main([*command, *TINY, "--json", both, "--plot", both]) == 2
    out, err = capsys.readouterr()
    _one_line(err, "--json and --plot name one file")
    assert out == "" and not Path(both).exists()


@pytest.mark.parametrize("command", [["simulate"], ["compare", "--jobs", "1", "--policy", "random"]])
def test_the_header_says_how_many_requests_a_short_trace_replays(
    command: list[str], trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Was "100 requests per policy" for a trace of 2.
    assert main([*command, "--backends", "2", "--trace", f"mooncake:{trace}", "--requests", "100"]) == 0
    assert "· 2 requests (all the trace holds) per policy ·" in capsys.readouterr().out
    assert main([*command, "--backends", "2", "--trace", f"mooncake:{trace}", "--requests", "1"]) == 0
    assert "· 1 request per policy ·" in capsys.readouterr().out


def test_a_refused_command_leaves_no_folder_its_output_checks_made(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Was: --json's check made nd/sub/ (to see that the file could be written), then --plot was refused: the folders
    # stayed.
    outputs = [("--json", str(tmp_path / "nd" / "sub" / "run.json")), ("--plot", str(tmp_path / "nd2" / "plot.txt"))]
    assert main(["simulate", *TINY, *(word for pair in outputs for word in pair)]) == 2
    _one_line(capsys.readouterr().err, "matplotlib writes no 'txt' files")
    assert list(tmp_path.iterdir()) == []
    assert main(["simulate", *TINY, "--json", outputs[0][1]]) == 0  # and a run makes them, to write its file
    assert Path(outputs[0][1]).stat().st_size > 0


def test_an_output_to_a_device_or_a_pipe_is_not_a_collision(trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # /dev/null is no file an output destroys: it is written as asked, whatever else names it.
    assert main(["simulate", *TINY, "--trace", f"mooncake:{trace}", "--json", os.devnull]) == 0
    assert "round-robin" in capsys.readouterr().out


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="/dev/full is Linux's (a write to it fails)")
@pytest.mark.parametrize("command", [["simulate"], ["compare", "--jobs", "1"]])
def test_an_output_whose_write_fails_after_the_run_names_the_option_and_the_file(
    command: list[str], trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Was "error: No space left on device" (the OS names no file when a write fails, only when an open does): a
    # device that opens but refuses the bytes passes the check before the run (as /proc files do for root).
    assert main([*command, *TINY, "--trace", f"mooncake:{trace}", "--json", "/dev/full"]) == 2
    _one_line(capsys.readouterr().err, "cannot write /dev/full: No space left on device")


@pytest.mark.parametrize("output", ["data/mooncake-fast25/synthetic_trace.jsonl", "page.png"])
def test_suite_output_naming_a_suite_trace_or_its_own_plot_is_refused_before_the_runs(
    output: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Was: minutes of runs, then the repository's trace overwritten by the page (or the plot by the page).
    monkeypatch.chdir(ROOT)  # the suite reads its traces under the repository root
    target = ROOT / output
    before = _digest(target) if target.exists() else None
    assert main(["compare", "--suite", "--jobs", "1", "--output", output]) == 2
    out, err = capsys.readouterr()
    _one_line(err, "--output")
    assert out == ""
    assert (_digest(target) if target.exists() else None) == before


def test_suite_output_whose_plot_cannot_be_written_is_refused_before_the_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Was: minutes of runs, then IsADirectoryError writing the plot next to the page.
    (tmp_path / "page.png").mkdir()
    monkeypatch.chdir(ROOT)
    assert main(["compare", "--suite", "--jobs", "1", "--output", str(tmp_path / "page.md")]) == 2
    out, err = capsys.readouterr()
    _one_line(err, "page.png is a folder")
    assert out == ""


@pytest.mark.parametrize(
    "argv",
    [
        ["simulate", *TINY, "--json", " "],
        ["compare", "--suite", "--jobs", "1", "--output", ""],
        ["compare", "--suite", "--jobs", "1", "--output", " "],
    ],
)
def test_a_blank_output_name_is_refused_not_written_or_taken_as_the_default(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Was: --json " " wrote a file named " " in the current folder; --output "" (an unset "$OUT") ran the whole
    # suite and wrote the default page, docs/policies-benchmark.md.
    monkeypatch.chdir(ROOT)  # where the suite runs, and where its default page is
    page = ROOT / "docs" / "policies-benchmark.md"
    before = _digest(page)
    assert main(argv) == 2
    out, err = capsys.readouterr()
    _one_line(err, "needs a file path")
    assert out == "" and not (ROOT / " ").exists() and _digest(page) == before


def test_costplot_blank_plot_name_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    from prefixroute.sim import costplot

    # Was: the plot written as " .png" in the current folder.
    monkeypatch.chdir(tmp_path)
    assert costplot.main([" "]) == 2
    out, err = capsys.readouterr()
    _one_line(err, "needs a file path")
    assert out == "" and not list(tmp_path.iterdir())


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model folder holding a real (tiny) tokenizer.json, trained here."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(["SELECT name FROM orders;"] * 5, trainers.BpeTrainer(special_tokens=["[UNK]"]))
    folder = tmp_path_factory.mktemp("model")
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture
def taken_port() -> Iterator[str]:
    """A port the commands cannot bind: were a path taken, the command would fail there, naming the port."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield str(taken.getsockname()[1])


def _serving(command: str, port: str) -> list[str]:
    return [command, "--backends", "http://127.0.0.1:9", "--port", port]


@pytest.mark.parametrize("command", ["serve", "proxy"])
@pytest.mark.parametrize("path", ["", " "])
def test_a_blank_tokenizer_path_is_refused_not_the_current_folder(
    command: str, path: str, model: Path, taken_port: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    # Was: --tokenizer "" (an unset "$TOKENIZER") loaded ./tokenizer.json, as Path("") is the current folder.
    monkeypatch.chdir(model)
    assert main([*_serving(command, taken_port), "--tokenizer", path]) == 2
    _one_line(capsys.readouterr().err, "a tokenizer path must name a tokenizer.json or a model folder")


@pytest.mark.parametrize("command", ["serve", "proxy"])
@pytest.mark.parametrize("kind", ["folder", "device", "fifo"])
def test_a_tokenizer_that_is_no_regular_file_is_named_so_not_missing(
    command: str, kind: str, tmp_path: Path, taken_port: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Was: "tokenizer file ... not found", for a path that is there. The FIFO case also checks that nothing opens it
    # (without a writer, that would hang): it runs in a process of its own, with a timeout.
    path = {"folder": tmp_path / "tokenizer.json", "device": Path(os.devnull), "fifo": tmp_path / "fifo"}[kind]
    argv = [*_serving(command, taken_port), "--tokenizer", str(tmp_path if kind == "folder" else path)]
    expected = f"tokenizer file {str(path)!r} is not a regular file"
    if kind == "folder":
        path.mkdir()  # the model folder's tokenizer.json
    if kind != "fifo":
        assert main(argv) == 2
        _one_line(capsys.readouterr().err, expected)
        return
    os.mkfifo(path)
    done = subprocess.run([sys.executable, "-m", "prefixroute", *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    _one_line(done.stderr, expected)


@pytest.mark.parametrize("source", ["", " ", "ftp://gpu0:8000/metrics", "file:///tmp/metrics"])
def test_doctor_source_that_names_no_file_or_url_is_a_bad_option(
    source: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Was: a diagnosis of an unreadable source, "cannot read : [Errno 21] Is a directory: '.'" for "" (Path("") is
    # the current folder) and "No such file or directory: 'ftp:/gpu0:8000/metrics'" for another scheme.
    assert main(["doctor", source]) == 2
    out, err = capsys.readouterr()
    _one_line(err, f"a source must be an http:// or https:// URL, a saved /metrics file or - for stdin, not {source!r}")
    assert out == ""


def test_doctor_reads_a_url_whose_scheme_is_upper_case(capsys: pytest.CaptureFixture[str]) -> None:
    # URL schemes are case-insensitive: HTTP://host is a URL (here one that refuses the connection), not a file.
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    main(["doctor", "--timeout", "2", f"HTTP://127.0.0.1:{port}"])
    out, err = capsys.readouterr()
    assert "a source must be" not in err
    assert f"127.0.0.1:{port}/metrics" in out + err


@pytest.mark.parametrize(
    ("page", "expected"),
    [
        (b"\xff\xfe# not UTF-8\n", "--update {page}: 'utf-8' codec can't decode"),  # was: no file named
        (b"# no markers\n", "--update {page}: markers <!-- costplot:"),  # was: no file named
        (None, "png {plot}: matplotlib writes no 'txt' files"),  # was: "Format 'txt' is not supported", after tables
    ],
)
def test_costplot_errors_name_the_file(
    page: bytes | None, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from prefixroute.sim import costplot

    markdown = tmp_path / "page.md"
    markdown.write_bytes(page or b"")
    plot = tmp_path / ("plot.png" if page is not None else "plot.txt")
    assert costplot.main([str(plot), "--update", str(markdown)]) == 2
    out, err = capsys.readouterr()
    _one_line(err, expected.format(page=markdown, plot=plot))
    assert out == "" and markdown.read_bytes() == (page or b"") and not plot.exists()


LONG = "x" * 300  # a file name over NAME_MAX (255)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["simulate", *TINY, "--json", "a\0b"], "--json 'a\\x00b': a path cannot hold a NUL byte"),
        (["simulate", *TINY, "--plot", "a\0b.png"], "--plot 'a\\x00b.png': a path cannot hold a NUL byte"),
        (["compare", "--jobs", "1", *TINY, "--json", "a\0b"], "--json 'a\\x00b': a path cannot hold a NUL byte"),
        (["study", "--requests", "3", "--output", "a\0b"], "not a name holding a NUL byte"),
        (["doctor", "a\0b"], "a source must be an http:// or https:// URL"),
        (["simulate", *TINY, "--json", f"{LONG}.json"], f"--json {LONG}.json: File name too long"),
    ],
)
def test_a_path_the_os_cannot_take_is_one_line_from_main(
    argv: list[str], expected: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    # Was: a ValueError ("embedded null byte") out of main(argv), which promises one line and status 2 for any bad
    # input (a command line cannot hold a NUL byte, a caller of main() can); a name too long was an OSError's
    # "File name too long: PATH", naming no option.
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    out, err = capsys.readouterr()
    _one_line(err, expected)
    assert out == "" and not list(tmp_path.iterdir())


def _data_copy(into: Path) -> Path:
    """The repository's data/ for costfit, as links to its files (the fit reads vidur-profiling and splitwise-sim)."""
    for folder in ("vidur-profiling/a100", "vidur-profiling/h100", "splitwise-sim"):
        (into / folder).mkdir(parents=True)
        for file in (ROOT / "data" / folder).glob("*.csv"):
            (into / folder / file.name).symlink_to(file)
    return into


def test_costfit_optional_data_file_that_is_a_fifo_is_refused_not_read(tmp_path: Path) -> None:
    # Was: the fit opened it and waited for a writer forever (a device would never end it).
    data = _data_copy(tmp_path / "data")
    os.mkfifo(data / "vidur-profiling" / "h100" / "Meta-Llama-3-8B__mlp.csv")  # optional: derived when absent
    done = subprocess.run(
        [sys.executable, "-m", "prefixroute.sim.costfit", "--data", str(data), "--check"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    _one_line(done.stderr, "Meta-Llama-3-8B__mlp.csv is not a regular file")


def test_costfit_check_of_an_out_that_is_a_file_is_a_bad_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from prefixroute.sim import costfit

    # Was: every file "missing" and "stale package data ...; rerun with --out FILE", exit status 1.
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert costfit.main(["--data", str(ROOT / "data"), "--check", "--out", str(blocker)]) == 2
    out, err = capsys.readouterr()
    _one_line(err, f"--out {blocker} is not a folder")
    assert out == ""
