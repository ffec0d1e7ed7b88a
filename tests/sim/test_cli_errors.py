"""Every bad input to ``prefixroute simulate`` and ``prefixroute study``: exit status 2, one line on stderr."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prefixroute.cli import main

TINY = ["--requests", "5"]  # a later --requests wins


def _fails_with_one_line(
    argv: list[str], capsys: pytest.CaptureFixture[str], expected: str, *, during_run: bool = False
) -> str:
    """``argv`` exits 2 with one line on stderr; unless the failure can only show ``during_run``, before any output."""
    status = main(argv)
    out, err = capsys.readouterr()
    assert status == 2, err
    assert during_run or out == "", f"bad input is refused before anything runs or prints: {out!r}"
    assert err.endswith("\n") and err.count("\n") == 1, f"not one line: {err!r}"
    assert "Traceback" not in err
    assert err.startswith(f"prefixroute {argv[0]}: "), err
    assert expected in err, err
    return err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--scenario", "nope"], "invalid choice: 'nope'"),
        (["--policy", "nope"], "unknown policy 'nope'"),
        (["--policy", "round-robin", "--policy", "nope"], "unknown policy 'nope'"),  # checked before any run
        (["--policy", "no_such_module_for_prefixroute:Policy"], "cannot import policy"),
        (["--policy", "prefixroute.policies:NoSuchPolicy"], "cannot import policy"),
        (["--policy", "json:JSONDecoder"], "not a LoadPolicy subclass"),
        (["--backends", "0"], "--backends must be an int in [1, 4,096], not 0"),
        (["--backends", str(10**13)], "--backends must be an int in [1, 4,096], not 10000000000000"),
        (["--backends", "-3"], "--backends must be an int in [1, 4,096]"),
        (["--backends", "two"], "invalid int value: 'two'"),
        (["--users", "0"], "--users must be an int in [1, "),
        (["--users", str(10**13)], "--users must be an int in [1, 1,000,000]"),
        (["--requests", "0"], "--requests must be an int in [1, "),
        (["--requests", str(10**13)], "--requests must be an int in [1, 100,000,000]"),
        (["--requests", "1e3"], "invalid int value"),
        (["--tp", "0"], "--tp must be an int in [1, "),
        (["--tp", "3"], "valid tp"),
        (["--rate", "nan"], "--rate must be a finite number > 0, not nan"),
        (["--rate", "inf"], "--rate must be a finite number > 0, not inf"),
        (["--rate", "-1"], "--rate must be a finite number > 0"),
        (["--rate", "0"], "--rate must be a finite number > 0"),
        (["--duration", "nan"], "--duration must be a finite number > 0"),
        (["--duration", "-5"], "--duration must be a finite number > 0"),
        (["--think-time", "-1"], "--think-time must be a finite number >= 0"),
        (["--think-time", "nan"], "--think-time must be a finite number >= 0"),
        (["--sharing-ratio", "2"], "between 0 and 1"),
        (["--sharing-ratio", "nan"], "between 0 and 1"),
        (["--sharing-ratio", "-0.1"], "between 0 and 1"),
        (["--speedup", "0"], "--speedup must be a finite number > 0"),
        (["--speedup", "inf"], "--speedup must be a finite number > 0"),
        (["--gpu-hour-usd", "nan"], "--gpu-hour-usd must be a finite number >= 0"),
        (["--gpu-hour-usd", "-2"], "--gpu-hour-usd must be a finite number >= 0"),
        (["--gpu-hour-usd", "1e308"], "--gpu-hour-usd must be at most 1,000,000 ($ per GPU-hour), not 1e+308"),
        (["--metrics-interval", "0"], "--metrics-interval must be a finite number > 0"),
        (["--metrics-interval", "inf"], "--metrics-interval must be a finite number > 0"),
        (["--metrics-interval", "1e-9"], "--metrics-interval must be at least 0.001 s"),
        (["--duration", "1e300"], "--duration must be at most 10,000,000 s"),
        (["--think-time", "1e300"], "--think-time must be at most 10,000,000 s"),
        (["--rate", "1e-300", "--requests", "20"], "more than 10,000,000 s: raise the rate"),
        (["--rate", "1e9", "--duration", "1000"], "makes more than 100,000,000 requests"),
        (["--seed", "x"], "invalid int value"),
        (["--model", "gpt-5"], "unknown model 'gpt-5'"),
        (["--gpu", "abacus"], "unknown GPU 'abacus'"),
        (["--index-source", "gossip"], "invalid choice"),
        (["--gateways", "0"], "--gateways must be an int in [1, 256], not 0"),
        (["--gateways", "257"], "--gateways must be an int in [1, 256], not 257"),
        (["--gateways", "two"], "invalid int value"),
        (["--frobnicate"], "unrecognized arguments"),
        (["--rate"], "expected one argument"),
        (["--trace", "mooncake:/nonexistent/trace.jsonl"], "cannot read trace /nonexistent/trace.jsonl"),
        (["--trace", "nope:/x"], "--trace must be FORMAT:PATH"),
        (["--trace", "no-colon"], "--trace must be FORMAT:PATH"),
        # Options that would be ignored silently (before, a run without them):
        (["--trace", "mooncake:data/mooncake-fast25/synthetic_trace.jsonl", "--sharing-ratio", "0.5"], "a --trace"),
        (["--trace", "mooncake:data/mooncake-fast25/synthetic_trace.jsonl", "--think-time", "2"], "give --users"),
        (["--rate", "5", "--think-time", "2"], "--think-time is the pause of closed-loop users"),
    ],
)
def test_simulate_bad_input(argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    base = [] if "--duration" in argv else TINY  # --duration and --requests are exclusive
    _fails_with_one_line(["simulate", *base, *argv], capsys, expected)


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("bad.jsonl", '{"timestamp": 0, "input_length": 10}\n', "bad.jsonl:1: missing field(s)"),
        ("garbage.jsonl", "this is not json\n", "garbage.jsonl:1: not valid JSON"),
        ("deep.jsonl", "[" * 100_000 + "]" * 100_000 + "\n", "nested too deeply"),
        ("empty.jsonl", "", "no requests in the trace"),
        ("nan.jsonl", '{"timestamp": NaN, "input_length": 1, "output_length": 1, "hash_ids": [0]}\n', "timestamp"),
        ("huge.jsonl", '{"timestamp": 0, "input_length": 1e30, "output_length": 1, "hash_ids": [0]}\n', "input_length"),
        ("binary.jsonl", b"\xff\xfe\x00garbage", "not UTF-8 text"),
        ("nul.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\n0,1\x00,1\n", "nul.csv"),
        ("columns.csv", "a,b\n1,2\n", "header lacks column(s)"),
        ("words.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\nsoon,many,few\n", "expected numbers"),
        ("short.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\n0\n", "1 field(s) where the header names 3"),
        ("inf.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\ninf,10,10\n", "finite number"),
        ("huge.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\n0,99999999999,1\n", "token counts in"),
    ],
)
def test_malformed_trace_files(
    name: str, content: str | bytes, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    kind = "mooncake" if name.endswith(".jsonl") else "splitwise"
    _fails_with_one_line(["simulate", "--trace", f"{kind}:{path}", "--requests", "5"], capsys, expected)


def test_trace_that_is_a_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fails_with_one_line(["simulate", "--trace", f"mooncake:{tmp_path}"], capsys, "cannot read trace")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads any file")
def test_unreadable_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "secret.jsonl"
    path.write_text("{}\n")
    path.chmod(0)
    _fails_with_one_line(["simulate", "--trace", f"mooncake:{path}"], capsys, "cannot read trace")


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_output_paths_checked_before_the_run(option: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fails_with_one_line(["simulate", *TINY, option, str(tmp_path)], capsys, "is a folder")
    empty = "not ''" if option == "--plot" else "--json needs a file path, not an empty one"  # before: "is a folder"
    _fails_with_one_line(["simulate", *TINY, option, ""], capsys, empty)
    blocker = tmp_path / "file"
    blocker.write_text("")
    _fails_with_one_line(["simulate", *TINY, option, str(blocker / "out")], capsys, "cannot create its folder")
    assert "round-robin" not in capsys.readouterr().out  # nothing ran


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_output_the_os_refuses_fails_before_the_run(option: str, capsys: pytest.CaptureFixture[str]) -> None:
    # os.access says yes to root for /proc, but the file cannot be created: the up-front check opens it to find out.
    if not Path("/proc/self").exists():
        pytest.skip("needs /proc")
    argv = ["simulate", *TINY, "--policy", "round-robin", option, "/proc/nope.json"]
    _fails_with_one_line(argv, capsys, f"{option} /proc/nope.json: not writable")


def test_writability_check_leaves_no_file_or_folder_behind(tmp_path: Path) -> None:
    from prefixroute.sim.cli import check_writable

    new = tmp_path / "sub" / "deeper" / "new.json"
    check_writable(new, "--json")
    assert list(tmp_path.iterdir()) == []  # the folders it made to try the file are gone: the writer makes them
    old = tmp_path / "old.json"
    old.write_text("kept")
    check_writable(old, "--json")
    assert old.read_text() == "kept"  # opened for append: not truncated


USER_MODULES = {
    "pr_syntax_error": "def broken(:\n",
    "pr_import_raises": "raise RuntimeError('no GPU here')\n",
    "pr_init_raises": (
        "from prefixroute.policies import LoadPolicy\n"
        "class P(LoadPolicy):\n"
        "    def __init__(self):\n"
        "        raise ValueError('needs a config file')\n"
        "    def choose(self, candidates):\n"
        "        return candidates[0]\n"
    ),
    "pr_needs_args": (
        "from prefixroute.policies import LoadPolicy\n"
        "class P(LoadPolicy):\n"
        "    def __init__(self, table):\n"
        "        self.table = table\n"
        "    def choose(self, candidates):\n"
        "        return candidates[0]\n"
    ),
    "pr_wrong_answer": (
        "from prefixroute.policies import Candidate, LoadPolicy\n"
        "class P(LoadPolicy):\n"
        "    def choose(self, candidates):\n"
        "        return Candidate(candidates[0].backend, 0, 0, 0)\n"
    ),
}


@pytest.mark.parametrize(
    ("module", "expected"),
    [
        ("pr_syntax_error", "SyntaxError"),
        ("pr_import_raises", "RuntimeError: no GPU here"),
        ("pr_init_raises", "ValueError: needs a config file"),
        ("pr_needs_args", "does not accept options"),
        ("pr_wrong_answer", "not one of the candidates"),
    ],
)
def test_user_policy_that_fails(
    module: str, expected: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / f"{module}.py").write_text(USER_MODULES[module])
    monkeypatch.syspath_prepend(str(tmp_path))
    attribute = "Anything" if module in ("pr_syntax_error", "pr_import_raises") else "P"
    argv = ["simulate", *TINY, "--policy", f"{module}:{attribute}"]
    _fails_with_one_line(argv, capsys, expected, during_run=module == "pr_wrong_answer")  # found by running it


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--requests", "0"], "--requests must be an int in [1, 100,000,000], not 0"),
        (["--requests", "-5"], "--requests must be an int in [1, "),
        (["--requests", str(10**13)], "--requests must be an int in [1, 100,000,000]"),
        (["--requests", "many"], "invalid int value"),
    ],
)
def test_study_bad_input(argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    _fails_with_one_line(["study", *argv], capsys, expected)


def test_study_output_that_is_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    _fails_with_one_line(["study", "--output", str(blocker), "--requests", "5"], capsys, "is not a folder")


def test_no_traceback_from_a_real_process(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    for argv in (
        ["simulate", "--rate", "nan"],
        ["simulate", "--trace", f"mooncake:{bad}"],
        ["study", "--requests", "0"],
    ):
        done = subprocess.run([sys.executable, "-m", "prefixroute", *argv], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize(("path", "named"), [("", "an empty one"), (" ", "the blank name ' '")])
def test_a_blank_output_path_is_named_as_given(path: str, named: str) -> None:
    from prefixroute.errors import ConfigurationError
    from prefixroute.sim.cli import check_writable

    with pytest.raises(ConfigurationError) as refused:
        check_writable(path, "--json")
    assert str(refused.value) == f"--json needs a file path, not {named}"


def test_two_outputs_to_a_device_are_no_collision() -> None:
    """Writing ``/dev/null`` twice destroys nothing: only one regular file under two names collides."""
    from prefixroute.sim.cli import check_distinct

    check_distinct({"--json": os.devnull, "--plot": os.devnull}, {"the trace --trace reads": os.devnull})


@pytest.mark.parametrize("command", ["simulate", "compare"])
def test_a_metrics_interval_that_polls_a_long_trace_too_often_is_refused_before_running(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Was: a trace's span was not known to the check (0 without --duration), so --metrics-interval 0.001 over a
    week-long trace started 600 million polls a policy and ran until killed."""
    trace = tmp_path / "week.csv"
    trace.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2024-05-10 00:00:00.000000+00:00,100,10\n"
        "2024-05-17 00:00:00.000000+00:00,100,10\n",
        encoding="utf-8",
    )
    argv = [command, "--trace", f"azure:{trace}", "--metrics-interval", "0.001"]
    _fails_with_one_line(argv, capsys, "--metrics-interval 0.001 s over about 6.05e+05 simulated seconds is over")
    argv[-1] = "0.1"  # 6 million polls, nearly all over idle time, which costs no poll: it runs, at once
    assert main([*argv, "--policy", "round-robin", *(["--jobs", "1"] if command == "compare" else [])]) == 0


@pytest.mark.parametrize(
    "argv",
    [
        ["simulate", "--requests", "5", "--speedup", "10"],  # a scenario: no timestamps to divide
        ["simulate", "--trace", "TRACE", "--users", "4", "--speedup", "10"],  # closed loop: the trace's times unused
        ["simulate", "--trace", "TRACE", "--rate", "5", "--speedup", "10"],  # open loop: likewise
    ],
)
def test_a_speedup_the_run_would_ignore_is_refused(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Was: taken and ignored (the same figures with or without it), where an option the run would ignore is an
    error (as --sharing-ratio with a trace is)."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 100, "output_length": 5, "hash_ids": [1]}\n', encoding="utf-8")
    argv = [f"mooncake:{trace}" if arg == "TRACE" else arg for arg in argv]
    _fails_with_one_line(argv, capsys, "--speedup divides a trace's timestamps: it applies to a --trace replayed")


def test_a_trace_sent_at_a_rate_stops_when_its_prompts_run_out(tmp_path: Path) -> None:
    """Was: refused ("open-loop arrivals (--rate) never stop by themselves"), though a trace's prompts end."""
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "".join(
            f'{{"timestamp": {i}, "input_length": 100, "output_length": 5, "hash_ids": [{i}]}}\n' for i in range(7)
        ),
        encoding="utf-8",
    )
    out = tmp_path / "out.json"
    argv = ["simulate", "--trace", f"mooncake:{trace}", "--rate", "50", "--policy", "round-robin", "--json", str(out)]
    assert main(argv) == 0
    assert json.loads(out.read_text())["results"][0]["requests"] == 7
