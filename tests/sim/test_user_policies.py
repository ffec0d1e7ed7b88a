"""An outsider's policy as ``module:Class``: seeded, fresh per run, its failures one line with exit status 2, and a
module that is only a file in the current directory found by the command, its pool workers included."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from prefixroute import NoBackendError, PolicyError
from prefixroute.cli import main
from prefixroute.sim.runner import SimSpec, build_policy, run_policy

REPO = Path(__file__).resolve().parents[2]
TINY = ["--requests", "12", "--backends", "2", "--users", "4"]

POLICIES = """
import random
import time

from prefixroute.errors import NoBackendError
from prefixroute.policies import LoadPolicy


class NeedsSeed(LoadPolicy):
    def __init__(self, seed):
        self.seed = seed
        self.rng = random.Random(seed)

    def choose(self, candidates):
        return self.rng.choice(list(candidates))


class TakesRng(LoadPolicy):
    def __init__(self, *, rng=None):
        self.rng = rng or random.Random()

    def choose(self, candidates):
        return self.rng.choice(list(candidates))


class Counts(LoadPolicy):
    built = 0

    def __init__(self):
        type(self).built += 1
        self.calls = 0

    def choose(self, candidates):
        self.calls += 1
        return candidates[self.calls % len(candidates)]


class Slow(LoadPolicy):
    def choose(self, candidates):
        time.sleep(0.002)
        return candidates[0]


class Raises(LoadPolicy):
    def choose(self, candidates):
        return {}["boom"]


class RaisesOurs(LoadPolicy):
    def choose(self, candidates):
        raise NoBackendError("none of these will do")
"""


@pytest.fixture
def module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh module of policies on sys.path; returns its name."""
    name = f"pr_outsider_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(POLICIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


SPEC = SimSpec(requests=12, backends=2, users=4)


def test_a_constructor_that_requires_seed_gets_the_seed(module: str) -> None:
    policy = build_policy(f"{module}:NeedsSeed", seed=5)
    assert policy.seed == 5  # type: ignore[attr-defined]


@pytest.mark.parametrize("cls", ["NeedsSeed", "TakesRng", "Counts", "Slow"])
def test_the_same_seed_gives_the_same_result(module: str, cls: str) -> None:
    first = run_policy(SPEC, f"{module}:{cls}")
    second = run_policy(SPEC, f"{module}:{cls}")
    assert first.details() == second.details()


def test_a_stateful_policy_is_built_once_per_run(module: str) -> None:
    build_policy(f"{module}:Counts", seed=0)
    counts = sys.modules[module].Counts
    before = counts.built
    run_policy(SPEC, f"{module}:Counts")
    assert counts.built == before + 1


def test_a_policy_that_raises_is_a_policy_error(module: str) -> None:
    with pytest.raises(PolicyError, match=r"raised KeyError: 'boom'"):
        run_policy(SPEC, f"{module}:Raises")


def test_a_library_error_a_policy_raises_names_the_policy(module: str) -> None:
    """The router passes the library's own errors through unwrapped; the run names whose they are."""
    with pytest.raises(NoBackendError, match=rf"^{module}:RaisesOurs: none of these will do$"):
        run_policy(SPEC, f"{module}:RaisesOurs")


@pytest.mark.parametrize("command", ["simulate", "compare"])
def test_a_policy_that_raises_exits_2_with_one_line(
    module: str, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    jobs = ["--jobs", "1"] if command == "compare" else []
    status = main([command, *TINY, *jobs, "--policy", "round-robin", "--policy", f"{module}:Raises"])
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"{module}:Raises" in err and "KeyError: 'boom'" in err, err


@pytest.mark.parametrize(
    ("source", "cls", "expected"),
    [
        ("import sys\nsys.exit(2)\n", "P", "cannot import policy"),
        (POLICIES + "\nclass Quits(Counts):\n    def __init__(self):\n        raise SystemExit(3)\n", "Quits",
         "cannot build policy"),
    ],
)  # fmt: skip
def test_a_policy_module_that_exits_is_one_line_with_status_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], source: str, cls: str,
    expected: str,
) -> None:  # fmt: skip
    """A script whose top-level code parses its own command line raises SystemExit when imported; before, it ended
    the command with the script's status and no message."""
    name = f"pr_exits_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    status = main(["simulate", *TINY, "--policy", f"{name}:{cls}"])
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.count("\n") == 1 and err.startswith("prefixroute simulate: error: "), err
    assert f"{expected} '{name}:{cls}': it called sys.exit(" in err, err


def _command_script(tmp_path: Path) -> Path:
    """A launcher outside the current directory, as the installed ``prefixroute`` command is (its folder, not the
    current directory, is sys.path[0])."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "prefixroute_cmd.py"
    script.write_text(
        "import sys\nfrom prefixroute.cli import main\nif __name__ == '__main__':\n    sys.exit(main())\n"
    )
    return script


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["simulate", *TINY, "--policy", "mine:TakesRng"], "mine:TakesRng"),
        (["compare", *TINY, "--jobs", "2", "--policy", "round-robin", "--policy", "mine:Counts"], "mine:Counts"),
        (["compare", *TINY, "--jobs", "2", "--policy", "round-robin", "--policy", "mine:Raises"], "KeyError"),
    ],
)
def test_a_module_in_the_current_directory_is_found_by_the_command_and_its_workers(
    tmp_path: Path, argv: list[str], expected: str
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "mine.py").write_text(POLICIES)
    script = _command_script(tmp_path)
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, str(script), *argv], cwd=work, env=env, capture_output=True, text=True, timeout=300
    )
    if expected == "KeyError":
        assert done.returncode == 2, done.stderr
        assert done.stderr.count("\n") == 1 and expected in done.stderr, done.stderr
    else:
        assert done.returncode == 0, done.stderr
        assert expected in done.stdout
